"""Measured tables on disk: what `ember bench tune` writes (its ``tune.json``) read back into a
model instance's `KernelTuning`.

Two sources, read in this order (a later row of the same shape and token bound wins):

- the tables shipped with ember (``ember/kernels/tuned/*.json``), each measured on one GPU model
  and used only on a GPU of that name;
- the file ``--kernel-tuning FILE`` names: used whatever GPU it names (a warning says when it
  is not this one), since the user asked for it.

Only the fused MoE's table (the ``moe`` section's ``table``) is read: the other sections measure
rows that a step A/B turns into `LinearRoutes` and `AttentionTuning` defaults by hand.
Importable without Triton.
"""

from __future__ import annotations

import json
import logging
from importlib import resources
from pathlib import Path

from ember.kernels.moe_tiles import MeasuredMoeTiles, MoeShape, MoeTiles

log = logging.getLogger(__name__)

SHIPPED_PACKAGE = "ember.kernels.tuned"


class TuningFileError(ValueError):
    """A tuning file that cannot be read as `ember bench tune`'s output."""


def measured_as_dict(row: MeasuredMoeTiles) -> dict:
    """``row`` as a tune.json's moe table entry."""
    return {
        "shape": row.shape._asdict(),
        "max_tokens": row.max_tokens,
        "tiles": row.tiles.as_dict(),
    }


def measured_rows(table: list[dict]) -> tuple[MeasuredMoeTiles, ...]:
    """A tune.json's moe ``table`` as `MoeTuning.measured` rows (a row serves the counts from
    its predecessor's bound up to its own)."""
    return tuple(
        MeasuredMoeTiles(MoeShape(**r["shape"]), r["max_tokens"], MoeTiles.from_dict(r["tiles"]))
        for r in table
    )


def merged_tunes(earlier: dict, later: dict) -> dict:
    """Two tune.json results of one GPU as one: ``later``'s moe rows and table entries replace
    ``earlier``'s of the same shape and token count (the others kept, in order of shape and
    count); any other section of ``later`` replaces ``earlier``'s whole. `TuningFileError` if
    they name different GPUs."""
    if earlier.get("gpu") != later.get("gpu"):
        raise TuningFileError(
            f"cannot merge a tune of {later.get('gpu')} into one of {earlier.get('gpu')}"
        )
    merged = {**earlier, **{key: value for key, value in later.items() if key != "moe"}}
    if "moe" in later:
        before = earlier.get("moe", {})

        def union(part: str, key) -> list[dict]:
            entries = {key(e): e for e in (*before.get(part, ()), *later["moe"].get(part, ()))}
            return [entries[k] for k in sorted(entries)]

        def shape_key(entry: dict) -> str:
            return json.dumps(entry["shape"], sort_keys=True)

        merged["moe"] = {
            "rows": union("rows", lambda r: (r["shape"], r["tokens"])),
            "table": union("table", lambda r: (shape_key(r), r["max_tokens"])),
        }
    return merged


def merge_tune_into(path: str | Path, result: dict) -> dict:
    """Merge ``result`` (a tune run's) into the tune.json at ``path`` (`merged_tunes`; a new
    file if there is none), write it and return it."""
    path = Path(path)
    if path.exists():
        try:
            earlier = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise TuningFileError(f"kernel tuning file {path}: {error}") from None
        result = merged_tunes(earlier, result)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _read(text: str, where: str) -> tuple[str | None, tuple[MeasuredMoeTiles, ...]]:
    """The GPU name and the moe rows of one tune.json's ``text``."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise TuningFileError(f"{where}: not JSON ({error})") from None
    if not isinstance(data, dict):
        raise TuningFileError(f"{where}: not a tune.json (an object with 'gpu' and 'moe')")
    moe = data.get("moe")
    if not isinstance(moe, dict) or not isinstance(moe.get("table"), list):
        raise TuningFileError(
            f"{where}: has no moe table; write one with `ember bench tune --sections moe`"
        )
    try:
        rows = measured_rows(moe["table"])
    except (KeyError, TypeError) as error:
        raise TuningFileError(f"{where}: a moe table row is malformed ({error!r})") from None
    return data.get("gpu"), rows


def shipped_rows(gpu_name: str) -> tuple[MeasuredMoeTiles, ...]:
    """The rows of every shipped table measured on a GPU named ``gpu_name``."""
    rows: list[MeasuredMoeTiles] = []
    for entry in sorted(resources.files(SHIPPED_PACKAGE).iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            gpu, table = _read(entry.read_text(), f"{SHIPPED_PACKAGE}/{entry.name}")
            if gpu == gpu_name:
                rows.extend(table)
    return tuple(rows)


def file_rows(path: str | Path, gpu_name: str | None) -> tuple[MeasuredMoeTiles, ...]:
    """The rows of the tune.json at ``path`` (`TuningFileError` if it cannot be read)."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise TuningFileError(f"kernel tuning file {path}: {error.strerror or error}") from None
    gpu, rows = _read(text, f"kernel tuning file {path}")
    if gpu_name is not None and gpu != gpu_name:
        log.warning("kernel tuning file %s was measured on %s, not this %s", path, gpu, gpu_name)
    return rows
