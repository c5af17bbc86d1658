"""Chat sessions for `ember bench multi-turn`: which turns of each recorded conversation a
session sends, and the sessions run against a server, each turn sending the conversation so far
with the model's own earlier answers."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from ember.bench.client import ENDPOINT_PATHS, RequestResult, finished_result, post_stream
from ember.bench.costs import CostMonitor
from ember.bench.datasets import ChatTurn, TokenCounter
from ember.bench.serve import PROBE_MAX_TOKENS, BenchmarkError, ServerTarget

# The chat template's tokens, counted into each planned prompt: the template's own (a default
# system prompt, the generation prompt; SmolLM2's are 25) and each message's role markers (5).
TEMPLATE_TOKENS = 32
MESSAGE_TEMPLATE_TOKENS = 8
# Sent twice before the timed part, so that the second is served from the first's cached blocks
# where the server caches prefixes: neither loading nor a first prefill on a cached prefix is
# timed. Long enough for a few KV blocks.
PROBE_MESSAGES = (
    {
        "role": "user",
        "content": "Before we start, please say hello and tell me in one short sentence what "
        "you can help me with today, so that I know the connection to you works as it should.",
    },
)
# A turn may stream for minutes under a heavy load; aiohttp's default gives up after five.
_REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=6 * 3600)


@dataclass(frozen=True)
class TurnLimits:
    """Which turns of a conversation a session sends."""

    min_turns: int = 2
    max_turns: int = 6
    max_output_len: int = 256
    max_context: int = 4096


@dataclass(frozen=True)
class PlannedTurn:
    """A turn to send: the user's message, the answer's length, and the prompt's estimated
    length (the template, the messages before, the model's answers at their planned length)."""

    user: str
    max_tokens: int
    prompt_len: int


@dataclass(frozen=True)
class Session:
    """The turns one session sends; `conversation` is the dataset conversation's index."""

    conversation: int
    turns: tuple[PlannedTurn, ...]


def plan_sessions(
    conversations: Sequence[Sequence[ChatTurn]],
    num_sessions: int,
    seed: int,
    counter: TokenCounter,
    limits: TurnLimits,
) -> list[Session]:
    """Shuffle the conversations with `seed` and plan the first `num_sessions` that keep at
    least `limits.min_turns` turns within `limits.max_context` (fewer if the set runs out)."""
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    sessions: list[Session] = []
    cursor = 0
    while len(sessions) < num_sessions and cursor < len(order):
        # Count a chunk at a time; the chunk size only changes the work, not the result.
        chunk = order[cursor : cursor + max(64, 2 * (num_sessions - len(sessions)))]
        cursor += len(chunk)
        turns = {i: conversations[i][: limits.max_turns] for i in chunk}
        texts = [text for i in chunk for turn in turns[i] for text in (turn.user, turn.reply)]
        lengths = iter(counter.count_tokens(texts))
        for i in chunk:
            counted = [(next(lengths), next(lengths)) for _ in turns[i]]
            session = fit_session(i, turns[i], counted, limits)
            if session is not None and len(sessions) < num_sessions:
                sessions.append(session)
    return sessions


def fit_session(
    index: int,
    turns: Sequence[ChatTurn],
    lengths: Sequence[tuple[int, int]],
    limits: TurnLimits,
) -> Session | None:
    """The session of one conversation's turns, given each turn's (user, reply) token counts:
    at most `max_turns`, ending before the first turn whose prompt and answer pass
    `max_context`; None if fewer than `min_turns` are left."""
    planned: list[PlannedTurn] = []
    context = TEMPLATE_TOKENS
    most = limits.max_turns
    for turn, (user_len, reply_len) in zip(turns[:most], lengths[:most], strict=True):
        max_tokens = max(1, min(reply_len, limits.max_output_len))
        prompt_len = context + user_len + MESSAGE_TEMPLATE_TOKENS
        if prompt_len + max_tokens > limits.max_context:
            break
        planned.append(PlannedTurn(turn.user, max_tokens, prompt_len))
        context = prompt_len + max_tokens + MESSAGE_TEMPLATE_TOKENS
    if len(planned) < limits.min_turns:
        return None
    return Session(index, tuple(planned))


@dataclass(frozen=True)
class TurnResult:
    """How one turn went: its session's index in the plan, the turn's index, the request."""

    session: int
    turn: int
    result: RequestResult


class ChatStreamClient:
    """Streams chat completions (greedy, exactly `max_tokens`, usage in the stream) and keeps
    the answer's text, which the session's next turn sends back. Timed as `OpenAIStreamClient`
    times a request."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str):
        self.session = session
        self.url = base_url.rstrip("/") + ENDPOINT_PATHS["chat"]
        self.model = model

    def payload(self, messages: Sequence[dict], max_tokens: int) -> dict:
        """The JSON body of one turn."""
        return {
            "model": self.model,
            "messages": list(messages),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def send(
        self, messages: Sequence[dict], max_tokens: int, prompt_len: int = 0
    ) -> tuple[RequestResult, str]:
        """Send one turn: its timing (errors recorded, never raised) and the answer's text."""
        result = RequestResult(False, prompt_len, start_s=time.perf_counter())
        pieces: list[str] = []

        def on_text(text: str) -> bool:
            pieces.append(text)
            return False

        body = self.payload(messages, max_tokens)
        usage_tokens, _ = await post_stream(self.session, self.url, body, result, on_text)
        if result.error:
            return result, ""
        return finished_result(result, usage_tokens), "".join(pieces)


async def run_session(
    client: ChatStreamClient, index: int, session: Session, think_time_s: float, bar: tqdm
) -> list[TurnResult]:
    """Send a session's turns one after another, each with the answers before it; a failed
    turn ends the session (the next turn would have no answer to send back)."""
    messages: list[dict] = []
    results = []
    for turn_index, turn in enumerate(session.turns):
        if turn_index and think_time_s > 0:
            await asyncio.sleep(think_time_s)
        messages.append({"role": "user", "content": turn.user})
        result, answer = await client.send(messages, turn.max_tokens, turn.prompt_len)
        results.append(TurnResult(index, turn_index, result))
        bar.update(1)
        if not result.success:
            break
        messages.append({"role": "assistant", "content": answer})
    return results


@dataclass(frozen=True)
class SessionsRun:
    """Every turn's result and the timed part's wall time."""

    turns: list[TurnResult]
    duration_s: float


async def drive_sessions(
    target: ServerTarget,
    sessions: Sequence[Session],
    max_concurrency: int,
    think_time_s: float,
    monitor: CostMonitor,
    show_progress: bool = True,
    before_timed_load: Callable[[], Awaitable[None]] | None = None,
) -> SessionsRun:
    """Run every session, `max_concurrency` at once, after a short probe request sent twice;
    costs are sampled over the timed part only. ``before_timed_load`` runs between the probes
    and it."""
    connector = aiohttp.TCPConnector(limit=max_concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=_REQUEST_TIMEOUT) as http:
        client = ChatStreamClient(http, target.base_url, target.model)
        for _ in range(2):
            probe, _ = await client.send(PROBE_MESSAGES, PROBE_MAX_TOKENS)
            if not probe.success:
                raise BenchmarkError(f"the probe request failed: {probe.error}")
        if before_timed_load is not None:
            await before_timed_load()

        gate = asyncio.Semaphore(max_concurrency)

        async def gated(index: int, session: Session) -> list[TurnResult]:
            async with gate:
                return await run_session(client, index, session, think_time_s, bar)

        total = sum(len(s.turns) for s in sessions)
        with tqdm(total=total, disable=not show_progress, unit="turn") as bar, monitor:
            start_s = time.perf_counter()
            done = await asyncio.gather(*(gated(i, s) for i, s in enumerate(sessions)))
            duration_s = time.perf_counter() - start_s
    return SessionsRun([turn for turns in done for turn in turns], duration_s)
