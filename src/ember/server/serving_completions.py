"""POST /v1/completions: prompts in, text completions out, streamed or whole.

Choices are numbered prompt by prompt: choice `p * n + i` is the i-th sample of prompt p.
With `echo` and `logprobs` the prompt tokens are scored too (the engine's prompt logprobs), and
`max_tokens: 0` with `echo` scores the prompt without generating (evaluation harnesses);
vLLM's `prompt_logprobs` field returns them in vLLM's shape.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from ember.logprobs import prompt_logprob_dicts
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
from ember.server.structured_outputs import requested_structured_outputs


async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = server_state(request)
    with state.lifecycle.handling():
        state.lifecycle.check_accepting()
        model = state.models.get(body.model)
        if body.suffix:
            raise BadRequestError("suffix is not supported", param="suffix")
        if body.max_tokens == 0 and not body.echo:
            raise BadRequestError(
                "max_tokens must be at least 1 (0 only with echo, to score the prompt)",
                param="max_tokens",
            )
        prompts = await completion_prompts(body, model)
        for prompt in prompts:
            check_context_length(
                len(prompt.token_ids), body.max_tokens, model.max_model_len, param="prompt"
            )
        params = build_sampling_params(
            body,
            max_tokens=body.max_tokens,
            logprobs=body.logprobs,
            prompt_logprobs=_engine_prompt_logprobs(body),
            vocab_size=model.vocab_size,
            structured_outputs=requested_structured_outputs(body),
        )
        generation = Generation(
            state.client, model, state.metrics, prompts, params, body.n, new_id("cmpl")
        )
        generation.start(state.config.max_queue)
    stream = _stream(generation, body) if body.stream else None
    return await respond(request, generation, stream, lambda: _response(generation, body))


def _engine_prompt_logprobs(body: CompletionRequest) -> int | None:
    """The alternatives per prompt token the engine returns: as many as the echoed logprobs
    or the `prompt_logprobs` field want; a prompt-only request (echo, max_tokens 0) scores its
    prompt even when neither asks. None: no prompt logprobs."""
    wanted = [body.prompt_logprobs, body.logprobs if body.echo else None]
    wanted = [k for k in wanted if k is not None]
    if wanted:
        return max(wanted)
    return 0 if body.echo and body.max_tokens == 0 else None


def _opening(
    generation: Generation,
    sequence: Sequence,
    body: CompletionRequest,
    builder: CompletionLogprobs | None,
) -> dict:
    """What comes before a choice's completion: the echoed prompt (its text, and with
    ``builder`` its logprobs) and vLLM's `prompt_logprobs`; empty when neither is asked."""
    fields: dict = {}
    if body.echo:
        fields["text"] = _prompt_text(generation, sequence)
        if builder is not None:
            fields["logprobs"] = builder.prompt(
                sequence.prompt.token_ids, sequence.prompt_logprobs, body.logprobs
            )
    if body.prompt_logprobs is not None:
        scores = sequence.prompt_logprobs or []
        fields["prompt_logprobs"] = prompt_logprob_dicts(
            scores, generation.model.token_text, body.prompt_logprobs
        )
    return fields


def _prompt_text(generation: Generation, sequence: Sequence) -> str:
    prompt = sequence.prompt
    if prompt.text is not None:
        return prompt.text
    return generation.model.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)


def _response(generation: Generation, body: CompletionRequest) -> dict:
    choices = []
    for sequence in generation.sequences:
        builder = CompletionLogprobs(generation.model) if body.logprobs is not None else None
        opening = _opening(generation, sequence, body, builder)
        text, logprobs = opening.get("text", "") + sequence.text, None
        if builder is not None:
            parts = [opening["logprobs"]] if body.echo else []
            parts.append(builder.generated(sequence.logprobs))
            logprobs = merge_completion_logprobs(parts)
        choice = {
            "index": sequence.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": sequence.finish_reason,
            "stop_reason": sequence.stop_reason,
        }
        if "prompt_logprobs" in opening:
            choice["prompt_logprobs"] = opening["prompt_logprobs"]
        choices.append(choice)
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

    def opening_chunk(sequence: Sequence) -> bytes:
        opening = _opening(generation, sequence, body, builders.get(sequence.index))
        choice = {
            "index": sequence.index,
            "text": opening.pop("text", ""),
            "logprobs": opening.pop("logprobs", None),
            "finish_reason": None,
            "stop_reason": None,
            **opening,  # prompt_logprobs, when asked
        }
        return encoder.event(choice)

    builders = (
        {s.index: CompletionLogprobs(generation.model) for s in generation.sequences}
        if body.logprobs is not None
        else {}
    )
    # The opening chunk (echo, prompt logprobs) goes first; when it carries prompt logprobs it
    # waits for its choice's first update, which brings them.
    scored = body.prompt_logprobs is not None or (body.echo and body.logprobs is not None)
    waiting = {s.index for s in generation.sequences} if scored else set()
    if body.echo and not scored:
        for sequence in generation.sequences:
            yield opening_chunk(sequence)
    async for deltas in generation.deltas():
        events = []
        for delta in deltas:
            sequence = delta.sequence
            if sequence.index in waiting:
                waiting.discard(sequence.index)
                events.append(opening_chunk(sequence))
            if _worth_sending(delta, body.logprobs is not None):
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
