"""POST /v1/chat/completions: a conversation in, the assistant's reply out, streamed or whole.

With tools, the reply is read back into OpenAI tool calls (`ember.server.tool_calls`); while a
stream may be writing a call, its text is held back, then sent as `delta.tool_calls`. A
tool_choice of "required" or a named function holds decoding to such calls (a grammar, as
structured output's `response_format` does).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import Response

from ember.server.errors import BadRequestError
from ember.server.generation import Generation, Sequence
from ember.server.logprobs import chat_logprobs
from ember.server.params import build_sampling_params, check_context_length
from ember.server.prompts import chat_prompt
from ember.server.protocol import ChatCompletionRequest
from ember.server.respond import respond
from ember.server.responses import envelope, full_response, new_id, usage
from ember.server.sse import ChunkEncoder, sse_event
from ember.server.state import server_state
from ember.server.structured_outputs import check_structured_outputs, requested_structured_outputs
from ember.server.tool_calls.calls import ToolCall
from ember.server.tool_calls.request import ToolUse, tool_use
from ember.server.tool_calls.stream import ToolCallStream, parse_output
from ember.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)
    with state.lifecycle.handling():
        state.lifecycle.check_accepting()
        model = state.models.get(body.model)
        if body.top_logprobs and not body.logprobs:
            raise BadRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        tools = tool_use(
            body.tools,
            body.tool_choice,
            body.parallel_tool_calls,
            model.spec.tool_call_parser,
            model.tokenizer.chat_template,
        )
        prompt = await chat_prompt(body, model, tools.template_tools)
        check_context_length(
            len(prompt.token_ids), body.output_limit, model.max_model_len, param="messages"
        )
        params = build_sampling_params(
            body,
            max_tokens=body.output_limit,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            vocab_size=model.vocab_size,
            structured_outputs=_output_constraint(body, tools, model.tokenizer.added_token_id),
        )
        generation = Generation(
            state.client, model, state.metrics, [prompt], params, body.n, new_id("chatcmpl")
        )
        generation.start(state.config.max_queue)
    stream = _stream(generation, body, tools) if body.stream else None
    return await respond(request, generation, stream, lambda: _response(generation, body, tools))


def _output_constraint(
    body: ChatCompletionRequest, tools: ToolUse, added_token_id: Callable[[str], int | None]
) -> StructuredOutputsParams | None:
    """The request's structured output, or the calls its tool_choice demands (not both)."""
    asked = requested_structured_outputs(body)
    forced = tools.forced_output(added_token_id)
    if forced is None:
        return asked
    if asked is not None:
        raise BadRequestError(
            "a tool_choice that demands a call constrains the output: it cannot be combined "
            "with response_format or guided decoding",
            param="tool_choice",
        )
    check_structured_outputs(forced, "tools")  # a tool's parameters may not compile
    return forced


def _response(generation: Generation, body: ChatCompletionRequest, tools: ToolUse) -> dict:
    choices = []
    for sequence in generation.sequences:
        message: dict = {"role": "assistant", "content": sequence.text}
        calls: list[ToolCall] = []
        if tools.parser is not None:
            parsed = parse_output(tools.parser, sequence.text)
            calls = _kept(parsed.calls, 0, tools)
            _check_choice(tools, sequence, parsed.calls)
            message["content"] = parsed.content
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
        choices.append(
            {
                "index": sequence.index,
                "message": message,
                "logprobs": chat_logprobs(generation.model, sequence.logprobs)
                if body.logprobs
                else None,
                "finish_reason": _finish_reason(sequence, bool(calls)),
                "stop_reason": sequence.stop_reason,
            }
        )
    return full_response(generation, "chat.completion", choices)


async def _stream(
    generation: Generation, body: ChatCompletionRequest, tools: ToolUse
) -> AsyncIterator[bytes]:
    header = envelope(generation, "chat.completion.chunk")
    if body.include_usage:
        header["usage"] = None  # OpenAI: null on every chunk but the last
    encoder = ChunkEncoder(header)
    parser = tools.parser
    readers = {s.index: ToolCallStream(parser) for s in generation.sequences} if parser else {}
    sent_calls = {s.index: [] for s in generation.sequences}  # every call read, kept or not

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
            sequence = delta.sequence
            message, read = _delta_message(delta.text, delta.finished, readers.get(sequence.index))
            seen = sent_calls[sequence.index]
            kept = _kept(read, len(seen), tools)
            if kept:
                first = len(_kept(seen, 0, tools))  # the stream's index of this first call
                message["tool_calls"] = [c.to_openai(first + i) for i, c in enumerate(kept)]
            seen.extend(read)
            if delta.finished and parser is not None:
                _check_choice(tools, sequence, seen)
            if not (message or delta.finished or (body.logprobs and delta.logprobs)):
                continue  # nothing to show yet: a token ending mid-character, or held back
            events.append(
                chunk(
                    sequence.index,
                    message,
                    chat_logprobs(generation.model, delta.logprobs) if body.logprobs else None,
                    _finish_reason(sequence, bool(seen)) if delta.finished else None,
                    sequence.stop_reason if delta.finished else None,
                )
            )
        if events:
            yield b"".join(events)  # every sequence that changed, in one write
    if body.include_usage:
        final = usage(generation.num_prompt_tokens, generation.num_generated_tokens)
        yield sse_event({**header, "choices": [], "usage": final})


def _delta_message(
    text: str, finished: bool, reader: ToolCallStream | None
) -> tuple[dict, list[ToolCall]]:
    """A stream delta's content, and the calls its text completed."""
    if reader is None:
        return ({"content": text} if text else {}), []
    read = reader.feed(text)
    if finished:
        last = reader.finish()
        read.content += last.content
        read.calls += last.calls
    return ({"content": read.content} if read.content else {}), read.calls


def _kept(calls: list[ToolCall], num_before: int, tools: ToolUse) -> list[ToolCall]:
    """The calls given to the client: with parallel_tool_calls false, the first call only."""
    if tools.parallel:
        return calls
    return calls[: max(0, 1 - num_before)]


def _finish_reason(sequence: Sequence, called: bool) -> str | None:
    # A reply that ended on its own after calling tools is OpenAI's "tool_calls".
    return "tool_calls" if called and sequence.finish_reason == "stop" else sequence.finish_reason


def _check_choice(tools: ToolUse, sequence: Sequence, calls: list[ToolCall]) -> None:
    # Decoding is held to the calls tool_choice demands: a reply without them was cut short
    # (max_tokens, a stop string). It is logged and returned as the model wrote it.
    missed = tools.missed([call.name for call in calls])
    if missed:
        logger.warning("%s: %s", sequence.request_id, missed)
    if not tools.parallel and len(calls) > 1:
        logger.info(
            "%s: parallel_tool_calls is false: %d calls dropped",
            sequence.request_id,
            len(calls) - 1,
        )
