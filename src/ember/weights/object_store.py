"""S3-compatible object stores (S3, R2, MinIO, ...) as a model source, through `obstore`.

Configured the standard way: the ``AWS_*`` environment variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_REGION``), then
the shared AWS files (``~/.aws/credentials`` and ``~/.aws/config``, profile ``AWS_PROFILE`` or
``default``; ``AWS_SHARED_CREDENTIALS_FILE`` and ``AWS_CONFIG_FILE`` move them), then what
`obstore` finds itself (instance metadata, web identity). A value in the environment wins over
the files, as with the AWS CLI.

Every failure is an `ObjectStoreError` that names the URL it concerns.
"""

from __future__ import annotations

import configparser
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

S3_SCHEME = "s3://"
DEFAULT_REGION = "us-east-1"
# How long one request may take to connect, and to deliver its bytes; then how long retries of a
# failed request may go on. A store that is down must fail a start in seconds, not minutes.
CONNECT_TIMEOUT = timedelta(seconds=5)
REQUEST_TIMEOUT = timedelta(seconds=120)
RETRY_TIMEOUT = timedelta(seconds=15)
MAX_RETRIES = 3

# Profile keys read from the shared files, and the store option each one sets.
_FILE_KEYS = {
    "aws_access_key_id": "access_key_id",
    "aws_secret_access_key": "secret_access_key",
    "aws_session_token": "session_token",
    "region": "region",
    "endpoint_url": "endpoint",
}
_CREDENTIALS = ("access_key_id", "secret_access_key", "session_token")
# Environment variables that `obstore` reads itself, per store option.
_ENV_KEYS = {
    "access_key_id": ("AWS_ACCESS_KEY_ID",),
    "secret_access_key": ("AWS_SECRET_ACCESS_KEY",),
    "session_token": ("AWS_SESSION_TOKEN", "AWS_TOKEN"),
    "region": ("AWS_REGION", "AWS_DEFAULT_REGION"),
    "endpoint": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"),
}


class ObjectStoreError(ValueError):
    """An object store could not be reached, refused access, or lacks an object; names the URL."""


class StoreUnreachableError(ObjectStoreError):
    """The store did not answer (down, or no network): a cached copy may stand in."""


def is_object_url(source: str | os.PathLike[str] | None) -> bool:
    return isinstance(source, str) and source.startswith(S3_SCHEME)


@dataclass(frozen=True)
class ObjectUrl:
    """``s3://bucket/prefix``: a bucket and a key prefix ('' for the whole bucket)."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> ObjectUrl:
        if not url.startswith(S3_SCHEME):
            raise ValueError(f"{url}: not an s3:// URL")
        bucket, _, prefix = url[len(S3_SCHEME) :].partition("/")
        if not bucket:
            raise ValueError(f"{url}: no bucket; write s3://BUCKET/PREFIX")
        prefix = prefix.strip("/")
        if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
            raise ValueError(f"{url}: the key prefix has an empty, '.' or '..' part")
        return cls(bucket, prefix)

    def key(self, name: str) -> str:
        """The object key of a file of this model, by its path relative to the prefix."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def relative(self, key: str) -> str:
        return key[len(self.prefix) + 1 :] if self.prefix else key

    def object(self, name: str) -> str:
        """The full URL of one file, for messages."""
        return f"{S3_SCHEME}{self.bucket}/{self.key(name)}"

    def __str__(self) -> str:
        return f"{S3_SCHEME}{self.bucket}/{self.prefix}" if self.prefix else S3_SCHEME + self.bucket


def store_settings(
    environ: Mapping[str, str] | None = None, home: Path | None = None
) -> dict[str, str]:
    """The store options the shared AWS files give and the environment does not override; the
    environment's own values `obstore` reads by itself."""
    env = os.environ if environ is None else environ
    profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    home = Path.home() if home is None else home
    credentials_file = Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws/credentials")
    config_file = Path(env.get("AWS_CONFIG_FILE") or home / ".aws/config")
    from_files: dict[str, str] = {}
    # The credentials file names a section by the bare profile; the config file by
    # "profile NAME" (except "default"). Credentials win over config for the same key.
    config_section = profile if profile == "default" else f"profile {profile}"
    for path, section in ((config_file, config_section), (credentials_file, profile)):
        for key, value in _read_profile(path, section).items():
            if key in _FILE_KEYS:
                from_files[_FILE_KEYS[key]] = value
    # Credentials go as a whole: a key in the environment is never paired with a file's secret.
    env_has_credentials = any(env.get(v) for o in _CREDENTIALS for v in _ENV_KEYS[o])
    return {
        option: value
        for option, value in from_files.items()
        if not any(env.get(variable) for variable in _ENV_KEYS[option])
        and not (option in _CREDENTIALS and env_has_credentials)
    }


def _read_profile(path: Path, section: str) -> dict[str, str]:
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(path, encoding="utf-8")
    except (configparser.Error, UnicodeDecodeError) as exc:
        raise ObjectStoreError(f"{path}: unreadable AWS file: {exc}") from exc
    return dict(parser[section]) if parser.has_section(section) else {}


def open_store(url: ObjectUrl, environ: Mapping[str, str] | None = None) -> Any:
    """An `obstore` S3 store for ``url``'s bucket."""
    from obstore.store import S3Store

    env = os.environ if environ is None else environ
    options = store_settings(env)
    endpoint = options.get("endpoint") or next(
        (env[v] for v in _ENV_KEYS["endpoint"] if env.get(v)), None
    )
    if not any(env.get(v) for v in _ENV_KEYS["region"]):
        options.setdefault("region", DEFAULT_REGION)
    client = {"connect_timeout": CONNECT_TIMEOUT, "timeout": REQUEST_TIMEOUT}
    if endpoint is not None and endpoint.startswith("http://"):
        client["allow_http"] = True  # a store on the local network (MinIO, a test server)
    retry = {"max_retries": MAX_RETRIES, "retry_timeout": RETRY_TIMEOUT}
    try:
        return S3Store(url.bucket, client_options=client, retry_config=retry, **options)
    except Exception as exc:  # obstore's configuration errors are plain Exception subclasses
        raise ObjectStoreError(f"{url}: cannot configure the object store: {exc}") from exc


def store_error(exc: BaseException, what: str) -> ObjectStoreError:
    """Turn an `obstore` exception into an `ObjectStoreError` about ``what`` (a URL)."""
    from obstore.exceptions import NotFoundError, PermissionDeniedError, UnauthenticatedError

    text = str(exc)
    # The first line says what failed; the rest is the client's debug dump.
    summary = text.strip().splitlines()[0].split(": <?xml")[0] if text.strip() else repr(exc)
    status = _STATUS.search(text)
    code = int(status.group(1)) if status else None
    if isinstance(exc, NotFoundError) or code == 404 or "NoSuchBucket" in text:
        return ObjectStoreError(f"{what}: not found in the object store ({summary})")
    if isinstance(exc, PermissionDeniedError | UnauthenticatedError) or code in (401, 403):
        return ObjectStoreError(
            f"{what}: access denied; check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the "
            f"AWS profile ({summary})"
        )
    if code is None and any(sign in text for sign in _UNREACHABLE):
        return StoreUnreachableError(f"{what}: the object store did not answer ({summary})")
    return ObjectStoreError(f"{what}: object store error: {summary}")


_STATUS = re.compile(r"status code: (\d{3})")
# How the client reports a store it could not reach or that went silent.
_UNREACHABLE = ("kind: Connect", "kind: Timeout", "error sending request", "Connection refused")
