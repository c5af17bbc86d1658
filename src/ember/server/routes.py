"""The HTTP routes. Generation lives in `serving_*`; the rest is small enough to sit here."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.openapi.utils import get_openapi
from starlette.requests import Request
from starlette.responses import Response

from ember import __version__
from ember.server.errors import NotFoundError, ServiceUnavailableError
from ember.server.metrics import CONTENT_TYPE
from ember.server.model_control import (
    list_served_models,
    retrieve_served_model,
    run_model_action,
)
from ember.server.prompts import check_token_ids, encode_chat, encode_text
from ember.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from ember.server.responses import JSONResponse
from ember.server.serving_chat import create_chat_completion
from ember.server.serving_completions import create_completion
from ember.server.state import server_state


def build_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, request)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request)

    @router.get("/v1/models")
    async def list_models(request: Request) -> Response:
        return JSONResponse(list_served_models(server_state(request)))

    # A path parameter: served names may hold '/' ("org/model"), as OpenAI's ids may not.
    @router.get("/v1/models/{name:path}")
    async def retrieve_model(name: str, request: Request) -> Response:
        return JSONResponse(retrieve_served_model(server_state(request), name))

    # The name as a path too ("org/model"): the last segment is the action.
    @router.post("/v1/models/{name:path}/{action}")
    async def model_action(name: str, action: str, request: Request) -> Response:
        return await run_model_action(server_state(request), name, action)

    # Said outright, so a client switching from another server learns why instead of a bare 404.
    @router.post("/v1/embeddings")
    async def embeddings() -> Response:
        raise NotFoundError(
            "ember does not serve embeddings: /v1/embeddings is not available (ember serves "
            "generation models through /v1/chat/completions and /v1/completions)",
            code="embeddings_not_supported",
        )

    @router.get("/health")
    async def health(request: Request) -> Response:
        healthy, reason = server_state(request).lifecycle.health()
        if not healthy:
            raise ServiceUnavailableError(reason, code="unhealthy")
        return JSONResponse({"status": "ok"})

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE)

    @router.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    # The app is built with openapi_url=None; this serves the schema of its routes and request
    # bodies (the pydantic models of `protocol`) behind the API key, for clients and fuzzers.
    @router.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> Response:
        app = request.app
        return JSONResponse(get_openapi(title=app.title, version=__version__, routes=app.routes))

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> Response:
        model = server_state(request).models.get(body.model)
        if body.messages is not None:
            ids = await encode_chat(
                model, body.messages, add_generation_prompt=body.add_generation_prompt
            )
        else:
            ids = await encode_text(model, body.prompt or "", body.add_special_tokens)
        reply = {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids}
        if body.return_token_strs:
            reply["token_strs"] = [model.token_text(t) for t in ids]
        return JSONResponse(reply)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
        model = server_state(request).models.get(body.model)
        if body.tokens:
            check_token_ids(body.tokens, model.vocab_size, "tokens")
        # Special tokens kept (as vLLM, transformers' default): /tokenize of the text gives the
        # same ids back, which clients tokenizing through the server (lm-eval) rely on.
        text = model.tokenizer.decode(body.tokens, skip_special_tokens=False)
        return JSONResponse({"prompt": text})

    # vLLM's, behind the same flag: a server that lends its tokenizer says what it is.
    @router.get("/tokenizer_info")
    async def tokenizer_info(request: Request, model: str | None = None) -> Response:
        state = server_state(request)
        if not state.config.tokenizer_info_endpoint:
            raise NotFoundError(
                "/tokenizer_info is off: start ember serve with --enable-tokenizer-info-endpoint",
                code="tokenizer_info_disabled",
            )
        return JSONResponse(state.models.get(model).tokenizer_info())

    return router
