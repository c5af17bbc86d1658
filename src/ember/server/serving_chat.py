"""POST /v1/chat/completions: a conversation in, the assistant's reply out, streamed or whole."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from ember.server.errors import BadRequestError
from ember.server.generation import Generation
from ember.server.logprobs import chat_logprobs
from ember.server.params import build_sampling_params, check_context_length
from ember.server.prompts import chat_prompt
from ember.server.protocol import ChatCompletionRequest
from ember.server.respond import respond
from ember.server.responses import envelope, full_response, new_id, usage
from ember.server.sse import ChunkEncoder, sse_event
from ember.server.state import server_state


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)
    with state.lifecycle.handling():
        state.lifecycle.check_accepting()
        model = state.models.get(body.model)
        if body.top_logprobs and not body.logprobs:
            raise BadRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        prompt = await chat_prompt(body, model)
        check_context_length(
            len(prompt.token_ids), body.output_limit, model.max_model_len, param="messages"
        )
        params = build_sampling_params(
            body,
            max_tokens=body.output_limit,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            vocab_size=model.vocab_size,
        )
        generation = Generation(
            state.client, model, state.metrics, [prompt], params, body.n, new_id("chatcmpl")
        )
        generation.start(state.config.max_queue)
    stream = _stream(generation, body) if body.stream else None
    return await respond(request, generation, stream, lambda: _response(generation, body))


def _response(generation: Generation, body: ChatCompletionRequest) -> dict:
    choices = [
        {
            "index": sequence.index,
            "message": {"role": "assistant", "content": sequence.text},
            "logprobs": chat_logprobs(generation.model, sequence.logprobs)
            if body.logprobs
            else None,
            "finish_reason": sequence.finish_reason,
            "stop_reason": sequence.stop_reason,
        }
        for sequence in generation.sequences
    ]
    return full_response(generation, "chat.completion", choices)


async def _stream(generation: Generation, body: ChatCompletionRequest) -> AsyncIterator[bytes]:
    header = envelope(generation, "chat.completion.chunk")
    if body.include_usage:
        header["usage"] = None  # OpenAI: null on every chunk but the last
    encoder = ChunkEncoder(header)

    def chunk(index: int, delta: dict, logprobs: dict | None, finish: str | None, stop) -> bytes:
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": stop,
        }
        return encoder.event(choice)

    yield b"".join(  # the role first, as OpenAI does
        chunk(sequence.index, {"role": "assistant", "content": ""}, None, None, None)
        for sequence in generation.sequences
    )
    async for deltas in generation.deltas():
        events = []
        for delta in deltas:
            if not (delta.text or delta.finished or (body.logprobs and delta.logprobs)):
                continue  # a token that ends mid-character: nothing to show yet
            sequence = delta.sequence
            events.append(
                chunk(
                    sequence.index,
                    {"content": delta.text} if delta.text else {},
                    chat_logprobs(generation.model, delta.logprobs) if body.logprobs else None,
                    sequence.finish_reason if delta.finished else None,
                    sequence.stop_reason if delta.finished else None,
                )
            )
        if events:
            yield b"".join(events)  # every sequence that changed, in one write
    if body.include_usage:
        final = usage(generation.num_prompt_tokens, generation.num_generated_tokens)
        yield sse_event({**header, "choices": [], "usage": final})
