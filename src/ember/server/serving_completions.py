"""POST /v1/completions: prompts in, text completions out, streamed or whole.

Choices are numbered prompt by prompt: choice `p * n + i` is the i-th sample of prompt p.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from ember.server.errors import BadRequestError
from ember.server.generation import Generation, Sequence, SequenceDelta
from ember.server.logprobs import CompletionLogprobs, merge_completion_logprobs
from ember.server.params import build_sampling_params, check_context_length
from ember.server.prompts import completion_prompts
from ember.server.protocol import CompletionRequest
from ember.server.respond import respond
from ember.server.responses import envelope, full_response, new_id, usage
from ember.server.sse import ChunkEncoder, sse_event
from ember.server.state import server_state


async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = server_state(request)
    with state.lifecycle.handling():
        state.lifecycle.check_accepting()
        model = state.models.get(body.model)
        if body.suffix:
            raise BadRequestError("suffix is not supported", param="suffix")
        prompts = await completion_prompts(body, model)
        for prompt in prompts:
            check_context_length(
                len(prompt.token_ids), body.max_tokens, model.max_model_len, param="prompt"
            )
        params = build_sampling_params(
            body, max_tokens=body.max_tokens, logprobs=body.logprobs, vocab_size=model.vocab_size
        )
        generation = Generation(
            state.client, model, state.metrics, prompts, params, body.n, new_id("cmpl")
        )
        generation.start(state.config.max_queue)
    stream = _stream(generation, body) if body.stream else None
    return await respond(request, generation, stream, lambda: _response(generation, body))


def _prompt_text(generation: Generation, sequence: Sequence) -> str:
    prompt = sequence.prompt
    if prompt.text is not None:
        return prompt.text
    return generation.model.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)


def _response(generation: Generation, body: CompletionRequest) -> dict:
    choices = []
    for sequence in generation.sequences:
        text, logprobs = sequence.text, None
        if body.echo:
            text = _prompt_text(generation, sequence) + text
        if body.logprobs is not None:
            builder = CompletionLogprobs(generation.model)
            parts = [builder.prompt(sequence.prompt.token_ids)] if body.echo else []
            parts.append(builder.generated(sequence.logprobs))
            logprobs = merge_completion_logprobs(parts)
        choices.append(
            {
                "index": sequence.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": sequence.finish_reason,
                "stop_reason": sequence.stop_reason,
            }
        )
    return full_response(generation, "text_completion", choices)


async def _stream(generation: Generation, body: CompletionRequest) -> AsyncIterator[bytes]:
    header = envelope(generation, "text_completion")
    if body.include_usage:
        header["usage"] = None  # OpenAI: null on every chunk but the last
    encoder = ChunkEncoder(header)

    def chunk(index: int, text: str, logprobs: dict | None, finish: str | None, stop) -> bytes:
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": stop,
        }
        return encoder.event(choice)

    builders = (
        {s.index: CompletionLogprobs(generation.model) for s in generation.sequences}
        if body.logprobs is not None
        else {}
    )
    if body.echo:
        for sequence in generation.sequences:
            builder = builders.get(sequence.index)
            echoed = builder.prompt(sequence.prompt.token_ids) if builder else None
            yield chunk(sequence.index, _prompt_text(generation, sequence), echoed, None, None)
    async for deltas in generation.deltas():
        events = []
        for delta in deltas:
            if _worth_sending(delta, body.logprobs is not None):
                sequence = delta.sequence
                builder = builders.get(sequence.index)
                events.append(
                    chunk(
                        sequence.index,
                        delta.text,
                        builder.generated(delta.logprobs) if builder else None,
                        sequence.finish_reason if delta.finished else None,
                        sequence.stop_reason if delta.finished else None,
                    )
                )
        if events:
            yield b"".join(events)  # every sequence that changed, in one write
    if body.include_usage:
        final = usage(generation.num_prompt_tokens, generation.num_generated_tokens)
        yield sse_event({**header, "choices": [], "usage": final})


def _worth_sending(delta: SequenceDelta, with_logprobs: bool) -> bool:
    """Skip chunks with nothing in them (a token that ends mid-character, say)."""
    return bool(delta.text) or delta.finished or (with_logprobs and bool(delta.logprobs))
