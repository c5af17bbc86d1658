"""`ember bench multi-turn`: whole conversations read from a ShareGPT file cut short, the
sessions planned from them, each turn sending the model's own earlier answers, the prefix-cache
figures from /metrics, and a run on a tiny model with prefix caching on and off.

Benchmarks are not tests: nothing here asserts a timing, only that the right things are sent and
measured.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from typing import Self

import pytest
from aiohttp import web
from helpers.tiny_models import make_tiny_model

from ember.bench import chat_sessions, multi_turn
from ember.bench.chat_sessions import TurnLimits, fit_session, plan_sessions
from ember.bench.datasets import ChatTurn, load_sharegpt_conversations
from ember.cli import main as ember_main

STAND_IN_MODEL = "stand-in"


def sharegpt_text(conversations: list[list[tuple[str, str]]], cut: bool = True) -> str:
    """A ShareGPT file of these conversations ((speaker, text) messages), cut mid-record after
    them as the packaged file is when `cut`."""
    records = [
        {"id": str(i), "conversations": [{"from": who, "value": text} for who, text in messages]}
        for i, messages in enumerate(conversations)
    ]
    text = json.dumps(records, indent=1)
    if cut:
        text = text[: text.rindex("]")] + ',\n {"id": "cut", "conversations": [{"from": "hum'
    return text


VOCABULARY = ("time", "people", "water", "house", "light", "world", "hand", "place", "river")


def words(seed: int, count: int) -> str:
    return " ".join(random.Random(seed).choices(VOCABULARY, k=count))


def conversation(seed: int, turns: int, user_words: int = 12, reply_words: int = 20) -> list:
    """`turns` alternating human/gpt messages of plain words."""
    messages = []
    for t in range(turns):
        messages.append(("human", f"q{seed}.{t} " + words(seed * 100 + t, user_words)))
        messages.append(("gpt", words(seed * 100 + 50 + t, reply_words)))
    return messages


class WordCounter:
    """A token is a whitespace-separated word."""

    def count_tokens(self, texts):
        return [len(text.split()) for text in texts]


# ----------------------------------------------------------------------------- conversations


def test_a_truncated_file_gives_each_conversations_alternating_turns(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(
        sharegpt_text(
            [
                # A last user message with no reply is not a turn.
                [("human", "a1"), ("gpt", "r1"), ("human", "a2"), ("gpt", "r2"), ("human", "a3")],
                # Leading assistant messages are skipped: the turns start at the first user's.
                [("gpt", "hello"), ("human", "b1"), ("gpt", "r1")],
                # A system message, one speaker twice, or an empty message ends the turns.
                [("human", "c1"), ("gpt", "r1"), ("system", "s"), ("human", "c2"), ("gpt", "r2")],
                [("human", "d1"), ("gpt", "r1"), ("human", "d2"), ("human", "d3"), ("gpt", "r")],
                [("human", "e1"), ("gpt", "  "), ("human", "e2"), ("gpt", "r2")],
                # Other names of the two speakers.
                [("user", "f1"), ("chatgpt", "r1"), ("human", "f2"), ("bard", "r2")],
            ]
        )
    )
    assert load_sharegpt_conversations(path) == [
        (ChatTurn("a1", "r1"), ChatTurn("a2", "r2")),
        (ChatTurn("b1", "r1"),),
        (ChatTurn("c1", "r1"),),
        (ChatTurn("d1", "r1"),),
        (ChatTurn("f1", "r1"), ChatTurn("f2", "r2")),
    ]
    assert [turns[0].user for turns in load_sharegpt_conversations(path, min_turns=2)] == [
        "a1",
        "f1",
    ]


@pytest.mark.slow
def test_the_packaged_sharegpt_file_has_thousands_of_multi_turn_conversations():
    conversations = load_sharegpt_conversations(min_turns=2)
    assert len(conversations) > 5000
    assert all(len(turns) >= 2 for turns in conversations)
    assert all(t.user.strip() and t.reply.strip() for turns in conversations for t in turns)


# ----------------------------------------------------------------------------- sessions


def test_a_session_ends_before_the_turn_that_would_pass_the_context():
    turns = [ChatTurn(f"u{i}", f"r{i}") for i in range(4)]
    lengths = [(20, 30), (20, 5), (20, 30), (20, 30)]  # (user, reply) tokens
    template, message = chat_sessions.TEMPLATE_TOKENS, chat_sessions.MESSAGE_TEMPLATE_TOKENS
    # Each prompt: the template, every message so far with its markers, answers at their length.
    prompts = [template + 20 + message]
    prompts.append(prompts[0] + 10 + message + 20 + message)
    prompts.append(prompts[1] + 5 + message + 20 + message)
    roomy = TurnLimits(min_turns=2, max_turns=3, max_output_len=10, max_context=10_000)
    session = fit_session(7, turns, lengths, roomy)
    assert session.conversation == 7
    assert [(t.user, t.max_tokens, t.prompt_len) for t in session.turns] == [
        ("u0", 10, prompts[0]),  # the reply's 30 tokens, capped
        ("u1", 5, prompts[1]),  # a shorter reply: its own length
        ("u2", 10, prompts[2]),  # and --max-turns ends it
    ]
    # The third turn's prompt and answer pass the context: the session ends after two...
    tight = TurnLimits(min_turns=2, max_turns=3, max_output_len=10, max_context=prompts[2] + 9)
    assert len(fit_session(7, turns, lengths, tight).turns) == 2
    # ...and then has fewer turns than asked for: no session.
    tighter = TurnLimits(min_turns=3, max_turns=3, max_output_len=10, max_context=prompts[2] + 9)
    assert fit_session(7, turns, lengths, tighter) is None


def test_sessions_are_drawn_by_seed_among_the_conversations_that_fit():
    conversations = [
        tuple(ChatTurn(user, reply) for user, reply in zip(c[::2], c[1::2], strict=True))
        for c in (
            [text for _, text in conversation(seed, turns=2 + seed % 3)] for seed in range(40)
        )
    ]
    long_first = (ChatTurn(words(99, 500), "r"), ChatTurn("u", "r"))  # never fits 400 tokens
    conversations.insert(5, long_first)
    limits = TurnLimits(min_turns=2, max_turns=3, max_output_len=16, max_context=400)
    drawn = plan_sessions(conversations, 12, seed=3, counter=WordCounter(), limits=limits)
    assert len(drawn) == 12 and len({s.conversation for s in drawn}) == 12
    assert 5 not in {s.conversation for s in drawn}
    assert drawn == plan_sessions(conversations, 12, 3, WordCounter(), limits)
    assert drawn != plan_sessions(conversations, 12, 4, WordCounter(), limits)
    for session in drawn:
        turns = conversations[session.conversation]
        assert [t.user for t in session.turns] == [t.user for t in turns[:3]]
        assert all(t.max_tokens == 16 for t in session.turns)  # replies of 20 words, capped
    everything = plan_sessions(conversations, 1000, 3, WordCounter(), limits)
    assert len(everything) == 40  # the set ran out


# ----------------------------------------------------------------------------- a stand-in server


class StandInChatServer:
    """Streams an answer of its own for each chat request (one word a chunk, `max_tokens`
    words), records what it was sent and what it answered, counts words at /tokenize, and
    exports prefix-cache counters that grow by 10 queried and 4 hit tokens a request."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.answers: dict[str, str] = {}  # the messages sent, as JSON -> the answer
        self.requests = 0
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/chat/completions", self.chat)
        self._runner = web.AppRunner(app)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.base_url = ""

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": STAND_IN_MODEL}]})

    async def metrics(self, request: web.Request) -> web.Response:
        label = f'{{model_name="{STAND_IN_MODEL}"}}'
        text = (
            "# TYPE ember:prefix_cache_queries_total counter\n"
            f"ember:prefix_cache_queries_total{label} {10.0 * self.requests}\n"
            "# TYPE ember:prefix_cache_hits_total counter\n"
            f"ember:prefix_cache_hits_total{label} {4.0 * self.requests}\n"
        )
        return web.Response(text=text)

    async def tokenize(self, request: web.Request) -> web.Response:
        return web.json_response({"count": len((await request.json())["prompt"].split())})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.requests += 1
        n = len(self.bodies)
        pieces = [f"a{n}.{i} " for i in range(body["max_tokens"])]
        self.answers[json.dumps(body["messages"])] = "".join(pieces)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in pieces:
            chunk = {"choices": [{"index": 0, "delta": {"content": piece}}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0)  # let the other sessions interleave
        usage = {"prompt_tokens": 3, "completion_tokens": len(pieces)}
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    def __enter__(self) -> Self:
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    async def _start(self) -> int:
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        return self._runner.addresses[0][1]

    def __exit__(self, *exc_info) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


def test_each_turn_sends_the_conversation_with_the_models_own_answers(tmp_path):
    dataset = [conversation(seed, turns=2 + seed % 3) for seed in range(5)]
    path = tmp_path / "sharegpt.json"
    path.write_text(sharegpt_text(dataset))
    out = tmp_path / "multi_turn.json"
    with StandInChatServer() as server:
        argv = ["--base-url", server.base_url, "--dataset-path", str(path), "--disable-tqdm"]
        argv += ["--num-conversations", "4", "--max-turns", "3", "--max-output-len", "6"]
        argv += ["--max-concurrency", "2", "--think-time", "0.01", "--output-json", str(out)]
        assert multi_turn.main(argv) == 0
    report = json.loads(out.read_text())
    probes, bodies = server.bodies[:2], server.bodies[2:]
    assert probes[0] == probes[1]  # the second is served from the first's cached prefix
    assert len(bodies) == report["workload"]["turns"] == report["runs"]["run"]["completed"]

    users_of = {messages[0][1]: [text for who, text in messages[::2]] for messages in dataset}
    for body in bodies:
        messages = body["messages"]
        assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == 6
        assert [m["role"] for m in messages] == ["user", "assistant"] * (len(messages) // 2) + [
            "user"
        ]
        # The users' messages are the dataset's, in order; each answer is the one the server
        # streamed for the conversation up to it, not the dataset's reply.
        assert [m["content"] for m in messages[::2]] == users_of[messages[0]["content"]][
            : len(messages) // 2 + 1
        ]
        for i in range(1, len(messages), 2):
            assert messages[i]["content"] == server.answers[json.dumps(messages[:i])]
    assert len({body["messages"][0]["content"] for body in bodies}) == 4  # sessions

    run = report["runs"]["run"]
    turns = report["workload"]["turns"]
    assert (run["failed"], run["sessions"], run["sessions_cut_short"]) == (0, 4, 0)
    assert run["total_output_tokens"] == 6 * turns
    # The counters' growth over the timed turns alone (the probe came before the first scrape).
    assert (run["prefix_cache_queries"], run["prefix_cache_hits"]) == (10 * turns, 4 * turns)
    assert run["prefix_cache_hit_rate"] == pytest.approx(0.4)
    assert run["steps_with_prefill"] is None  # no step counters at this server
    assert run["median_ttft_first_turns_ms"] is not None
    assert run["median_ttft_later_turns_ms"] is not None
    assert len(run["median_ttft_ms_by_turn"]) == 3
    assert report["comparison"] is None and report["config"]["max_concurrency"] == 2


def test_a_server_without_the_counters_gets_no_hit_rate():
    assert multi_turn.parse_prefix_cache_counts("# TYPE x counter\nx_total 1.0\n", "m") is None
    assert multi_turn.prefix_cache_figures(None, {"a": 1}) == {
        "prefix_cache_queries": None,
        "prefix_cache_hits": None,
        "prefix_cache_hit_rate": None,
    }
    nothing_looked_up = {"prefix_cache_queries": 5.0, "prefix_cache_hits": 0.0}
    figures = multi_turn.prefix_cache_figures(nothing_looked_up, nothing_looked_up)
    assert figures["prefix_cache_queries"] == 0 and figures["prefix_cache_hit_rate"] is None


@pytest.mark.parametrize(
    "argv",
    [
        [],  # no server
        ["--base-url", "http://h:1", "--launch"],  # two
        ["--base-url", "http://h:1", "--compare-prefix-caching"],  # nothing to launch twice
        ["--launch", "--compare-prefix-caching", "--server-args=--no-enable-prefix-caching"],
        ["--launch", "--max-concurrency", "0"],
        ["--launch", "--min-turns", "3", "--max-turns", "2"],
    ],
)
def test_flags_that_cannot_run_are_refused(argv, capsys):
    assert ember_main(["bench", "multi-turn", *argv]) == 2
    assert "ember bench multi-turn:" in capsys.readouterr().err


# ----------------------------------------------------------------------------- a tiny model


@pytest.mark.slow
def test_prefix_caching_on_and_off_on_a_tiny_model(tmp_path):
    model = make_tiny_model("LlamaForCausalLM", tmp_path / "tiny", max_position_embeddings=1024)
    dataset = [conversation(seed, turns=3, user_words=40) for seed in range(3)]
    path = tmp_path / "sharegpt.json"
    path.write_text(sharegpt_text(dataset))
    out = tmp_path / "multi_turn.json"
    argv = ["--launch", str(model), "--server-args", "--max-model-len 1024", "--disable-tqdm"]
    argv += ["--compare-prefix-caching", "--dataset-path", str(path), "--tokenizer", str(model)]
    argv += ["--num-conversations", "3", "--max-output-len", "8", "--max-context", "1024"]
    argv += ["--max-concurrency", "2", "--output-json", str(out)]
    assert multi_turn.main(argv) == 0

    report = json.loads(out.read_text())
    on, off = report["runs"]["prefix_caching_on"], report["runs"]["prefix_caching_off"]
    assert report["workload"]["turns"] == 9
    for run in (on, off):
        assert (run["completed"], run["failed"]) == (9, 0)
        assert run["total_output_tokens"] == report["workload"]["planned_output_tokens"]
        assert run["prefix_cache_queries"] > 0
    assert "--no-enable-prefix-caching" in off["server_command"]
    assert "--no-enable-prefix-caching" not in on["server_command"]
    assert on["prefix_cache_hits"] > 0 and on["prefix_cache_hit_rate"] > 0
    assert off["prefix_cache_hits"] == 0 and not off["prefix_cache_hit_rate"]
    # The same prompts both times; with the cache the engine computed fewer of their tokens.
    assert on["total_input_tokens"] == off["total_input_tokens"]
    assert on["scheduled_prefill_tokens"] < off["scheduled_prefill_tokens"]
    assert set(report["comparison"]) == {f"{key}_gain" for key, _ in multi_turn.COMPARED}
    assert all(gain > 0 for gain in report["comparison"].values())
