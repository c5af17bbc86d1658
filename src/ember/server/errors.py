"""Errors as the OpenAI API reports them: `{"error": {"message", "type", "param", "code"}}`.

Handlers raise an `APIError` subclass; the app's exception handlers (installed by
`install_error_handlers`) turn it, FastAPI's validation errors, Starlette's HTTP errors and
anything unexpected into that JSON with the right status code.
"""

from __future__ import annotations

from http import HTTPStatus

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response


class APIError(Exception):
    """An error to send to the client as OpenAI error JSON."""

    status_code = HTTPStatus.BAD_REQUEST
    error_type = "invalid_request_error"
    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self) -> Response:
        return error_response(self.status_code, self.body(), self.headers)


class BadRequestError(APIError):
    """400: an invalid parameter, malformed JSON, a prompt longer than the context."""


class AuthenticationError(APIError):
    status_code = HTTPStatus.UNAUTHORIZED
    default_code = "invalid_api_key"


class NotFoundError(APIError):
    status_code = HTTPStatus.NOT_FOUND
    default_code = "model_not_found"


class ConflictError(APIError):
    """409: the action does not apply to the model's state (e.g. waking a loaded model)."""

    status_code = HTTPStatus.CONFLICT
    default_code = "invalid_state"


class PayloadTooLargeError(APIError):
    status_code = HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    default_code = "request_too_large"


class QueueFullError(APIError):
    """429: the model's waiting queue is at its bound; the client should retry later."""

    status_code = HTTPStatus.TOO_MANY_REQUESTS
    error_type = "rate_limit_error"
    default_code = "queue_full"


class ServiceUnavailableError(APIError):
    """503: the engine is loading, shutting down or dead."""

    status_code = HTTPStatus.SERVICE_UNAVAILABLE
    error_type = "service_unavailable"


class InternalServerError(APIError):
    status_code = HTTPStatus.INTERNAL_SERVER_ERROR
    error_type = "server_error"
    default_code = "internal_error"


class ClientDisconnectedError(Exception):
    """The client closed the connection before the response was ready: nobody to answer."""


# nginx's "client closed request": logged in the access log, never seen by the client.
CLIENT_CLOSED_REQUEST = 499


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | int | None = None
) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(status: int, body: dict, headers: dict[str, str] | None = None) -> Response:
    return Response(
        msgspec.json.encode(body),
        status_code=status,
        headers=headers,
        media_type="application/json",
    )


def validation_error(exc: RequestValidationError) -> BadRequestError:
    """A 400 naming the first offending field of a request FastAPI could not parse."""
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return BadRequestError(
            f"the request body is not valid JSON: {first.get('msg', '')}", code="invalid_json"
        )
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    message = first.get("msg", "invalid request")
    if location:
        param = ".".join(location)
        message = f"{param}: {message}"
    else:  # a check of the whole body names the parameter it found in its context
        param = (first.get("ctx") or {}).get("param")
    return BadRequestError(message, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app can produce an OpenAI error JSON."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(ClientDisconnectedError)
    async def _client_left(_: Request, exc: ClientDisconnectedError) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, exc: RequestValidationError) -> Response:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        status = HTTPStatus(exc.status_code)
        kind = "invalid_request_error" if status < 500 else "server_error"
        code = status.phrase.lower().replace(" ", "_")
        return error_response(status, error_body(str(exc.detail), kind, None, code), exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        # Starlette re-raises after this response is sent, so uvicorn logs the traceback.
        return InternalServerError(f"internal error: {type(exc).__name__}: {exc}").response()
