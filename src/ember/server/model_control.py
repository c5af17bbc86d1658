"""The models endpoint and the control endpoints of a multi-model server.

`GET /v1/models` lists every configured model as OpenAI does, plus an ``ember`` object with its
state in the engine (``unloaded``, ``loading``, ``loaded``, ``sleeping``, ``waking``,
``failed``), its memory and its transition counts; `GET /v1/models/{id}` answers the same
object for one of them, by its name or an alias. `POST /v1/models/{name}/{action}` (``load``,
``sleep``, ``wake``, ``unload``) runs one transition and answers when it is done, with the
seconds it took. Like every route but /health and /metrics, they need the API key when the
server has one; a name must be a configured model's, so no request can make the server open a
path of its choosing.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from ember.engine.ipc import MODEL_ACTIONS, ModelStatus
from ember.server.config import ServedModelSpec
from ember.server.engine_client import EngineDeadError
from ember.server.errors import (
    APIError,
    BadRequestError,
    ConflictError,
    NotFoundError,
    ServiceUnavailableError,
)
from ember.server.responses import JSONResponse
from ember.server.state import ServerState


def list_served_models(state: ServerState) -> dict[str, Any]:
    data = [
        _model_object(state, spec, name)
        for spec in state.models.specs
        for name in (spec.name, *spec.aliases)
    ]
    return {"object": "list", "data": data}


def retrieve_served_model(state: ServerState, name: str) -> dict[str, Any]:
    """OpenAI's retrieve model: the list's object for ``name`` (a served name or an alias);
    NotFoundError for any other."""
    served = state.models.canonical(name)
    if served is None:
        raise NotFoundError(
            f"The model `{name}` does not exist. Served models: "
            f"{', '.join(s.name for s in state.models.specs)}",
            param="model",
        )
    spec = next(s for s in state.models.specs if s.name == served)
    return _model_object(state, spec, name)


def _model_object(state: ServerState, spec: ServedModelSpec, name: str) -> dict[str, Any]:
    """One entry of `GET /v1/models` for ``name``, the served name of ``spec`` or an alias."""
    model = next((m for m in state.models.loaded() if m.name == spec.name), None)
    return {
        "id": name,
        "object": "model",
        "created": model.created if model else 0,
        "owned_by": "ember",
        "root": spec.engine.model or spec.name,
        "parent": None if name == spec.name else spec.name,
        "max_model_len": model.info.max_model_len if model and model.info else None,
        "ember": _ember_fields(state.client.model_states.get(spec.name), spec.engine.policy.pinned),
    }


def _ember_fields(status: ModelStatus | None, pinned: bool) -> dict[str, Any]:
    if status is None:  # the engine has not reported yet (it is starting)
        status = ModelStatus(model="", state="loading", pinned=pinned)
    counts, last = status.transitions, None
    if counts.last_action is not None:
        last = {"action": counts.last_action, "seconds": counts.last_seconds}
    return {
        "state": status.state,
        "pinned": status.pinned,
        "device_bytes": status.device_bytes,
        "host_bytes": status.host_bytes,
        "weight_bytes": status.weight_bytes,
        "kv_cache_bytes": status.kv_cache_bytes,
        "num_kv_blocks": status.num_kv_blocks,
        "loads": counts.loads,
        "sleeps": counts.sleeps,
        "wakes": counts.wakes,
        "last_transition": last,
        "error": status.error,
    }


async def run_model_action(state: ServerState, name: str, action: str) -> Response:
    if action not in MODEL_ACTIONS:
        raise NotFoundError(
            f"unknown model action {action!r}; one of: {', '.join(MODEL_ACTIONS)}",
            code="unknown_action",
        )
    served = state.models.canonical(name)
    if served is None:
        raise NotFoundError(
            f"The model `{name}` does not exist. Served models: "
            f"{', '.join(s.name for s in state.models.specs)}",
            param="name",
        )
    state.lifecycle.check_accepting()
    try:
        done = await state.client.command(served, action)
    except EngineDeadError as exc:
        raise ServiceUnavailableError(str(exc), code="engine_unavailable") from exc
    if done.status != 200:
        raise _command_error(done.status, done.message)
    return JSONResponse(
        {
            "id": served,
            "object": "model.action",
            "action": action,
            "state": done.state,
            "seconds": done.seconds,
            "message": done.message,
        }
    )


def _command_error(status: int, message: str) -> APIError:
    if status == 409:
        return ConflictError(message)
    if status == 404:
        return NotFoundError(message)
    if status == 400:
        return BadRequestError(message)
    return ServiceUnavailableError(message, code="model_unavailable")
