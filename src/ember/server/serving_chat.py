"""POST /v1/chat/completions: a conversation in, the assistant's reply out, streamed or whole.

With tools, the reply is read back into OpenAI tool calls (`ember.server.tool_calls`); while a
stream may be writing a call, its text is held back, then sent as `delta.tool_calls`. A
tool_choice of "required" or a named function holds decoding to such calls (a grammar, as
structured output's `response_format` does). gpt-oss's replies are read by their harmony
channels (`ember.server.harmony`): reasoning, content and calls, the calls' arguments streamed
as they are written; a reasoning parser's `<think>` block is read into reasoning
(`ember.server.reasoning`). The request's `ReplySyntax` gives each choice its reader
(`ember.server.reply`) and holds only the answer after the reasoning to a constraint.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from ember.server.errors import BadRequestError
from ember.server.generation import Generation, Sequence
from ember.server.logprobs import chat_logprobs
from ember.server.models import ServedModel
from ember.server.params import build_sampling_params, check_context_length
from ember.server.prompts import chat_prompt
from ember.server.protocol import ChatCompletionRequest
from ember.server.reply import CallDelta, ReplyDelta, ReplyReader, read_reply
from ember.server.reply_syntax import ReplySyntax, reply_syntax
from ember.server.respond import respond
from ember.server.responses import envelope, full_response, new_id, usage
from ember.server.sse import ChunkEncoder, sse_event
from ember.server.state import server_state
from ember.server.structured_outputs import requested_structured_outputs
from ember.server.tool_calls.request import ToolUse, tool_use

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
            harmony=model.reads_harmony,
        )
        prompt = await chat_prompt(body, model, tools.template_tools)
        check_context_length(
            len(prompt.token_ids), body.output_limit, model.max_model_len, param="messages"
        )
        syntax = _reply_syntax(model, tools, prompt.token_ids)
        params = build_sampling_params(
            body,
            max_tokens=body.output_limit,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            vocab_size=model.vocab_size,
            structured_outputs=syntax.constraint(
                requested_structured_outputs(body), model.tokenizer.added_token_id
            ),
        )
        if syntax.harmony:  # the reader needs the channel markers, special tokens
            params = dataclasses.replace(params, skip_special_tokens=False)
        generation = Generation(
            state.client, model, state.metrics, [prompt], params, body.n, new_id("chatcmpl")
        )
        generation.start(state.config.max_queue)
    stream = _stream(generation, body, tools, syntax) if body.stream else None
    return await respond(
        request, generation, stream, lambda: _response(generation, body, tools, syntax)
    )


def _reply_syntax(model: ServedModel, tools: ToolUse, prompt_ids: list[int]) -> ReplySyntax:
    tokenizer = model.tokenizer
    return reply_syntax(
        tools, model.reads_harmony, model.spec.reasoning_parser, prompt_ids, tokenizer.decode
    )


def _response(
    generation: Generation, body: ChatCompletionRequest, tools: ToolUse, syntax: ReplySyntax
) -> dict:
    choices = []
    for sequence in generation.sequences:
        message: dict = {"role": "assistant", "content": sequence.text}
        called = False
        reader = syntax.reader()
        if reader is not None:
            reply = read_reply(reader, sequence.text)
            called = bool(reply.calls)
            _check_choice(tools, sequence, [call.name for call in reply.calls])
            message["content"] = reply.content
            if syntax.reads_reasoning:
                message["reasoning_content"] = reply.reasoning
            calls = reply.calls if tools.parallel else reply.calls[:1]
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
        choices.append(
            {
                "index": sequence.index,
                "message": message,
                "logprobs": chat_logprobs(generation.model, sequence.logprobs)
                if body.logprobs
                else None,
                "finish_reason": _finish_reason(sequence, called),
                "stop_reason": sequence.stop_reason,
            }
        )
    return full_response(generation, "chat.completion", choices)


async def _stream(
    generation: Generation, body: ChatCompletionRequest, tools: ToolUse, syntax: ReplySyntax
) -> AsyncIterator[bytes]:
    header = envelope(generation, "chat.completion.chunk")
    if body.include_usage:
        header["usage"] = None  # OpenAI: null on every chunk but the last
    encoder = ChunkEncoder(header)
    readers = {s.index: syntax.reader() for s in generation.sequences}
    called = {s.index: [] for s in generation.sequences}  # every call's name, kept or not

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
            message, calls = _delta_message(delta.text, delta.finished, readers[sequence.index])
            kept = [call for call in calls if _kept(call, tools)]
            if kept:
                message["tool_calls"] = [call.to_openai() for call in kept]
            names = called[sequence.index]
            names.extend(call.name for call in calls if call.name is not None)
            if delta.finished and readers[sequence.index] is not None:
                _check_choice(tools, sequence, names)
            if not (message or delta.finished or (body.logprobs and delta.logprobs)):
                continue  # nothing to show yet: a token ending mid-character, or held back
            events.append(
                chunk(
                    sequence.index,
                    message,
                    chat_logprobs(generation.model, delta.logprobs) if body.logprobs else None,
                    _finish_reason(sequence, bool(names)) if delta.finished else None,
                    sequence.stop_reason if delta.finished else None,
                )
            )
        if events:
            yield b"".join(events)  # every sequence that changed, in one write
    if body.include_usage:
        final = usage(generation.num_prompt_tokens, generation.num_generated_tokens)
        yield sse_event({**header, "choices": [], "usage": final})


def _delta_message(
    text: str, finished: bool, reader: ReplyReader | None
) -> tuple[dict, list[CallDelta]]:
    """A stream delta's reasoning and content, and the pieces of calls its text gave."""
    if reader is None:
        return ({"content": text} if text else {}), []
    read = reader.feed(text)
    if finished:
        read.extend(reader.finish())
    return _message_of(read), read.calls


def _message_of(read: ReplyDelta) -> dict:
    message = {}
    if read.reasoning:
        message["reasoning_content"] = read.reasoning
    if read.content:
        message["content"] = read.content
    return message


def _kept(call: CallDelta, tools: ToolUse) -> bool:
    """Whether a call is given to the client: with parallel_tool_calls false, the first only."""
    return tools.parallel or call.index == 0


def _finish_reason(sequence: Sequence, called: bool) -> str | None:
    # A reply that ended on its own after calling tools is OpenAI's "tool_calls".
    return "tool_calls" if called and sequence.finish_reason == "stop" else sequence.finish_reason


def _check_choice(tools: ToolUse, sequence: Sequence, names: list[str]) -> None:
    # Decoding is held to the calls tool_choice demands: a reply without them was cut short
    # (max_tokens, a stop string). It is logged and returned as the model wrote it.
    missed = tools.missed(names)
    if missed:
        logger.warning("%s: %s", sequence.request_id, missed)
    if not tools.parallel and len(names) > 1:
        logger.info(
            "%s: parallel_tool_calls is false: %d calls dropped",
            sequence.request_id,
            len(names) - 1,
        )
