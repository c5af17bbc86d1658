"""The real chat route and `serving_chat` over a scripted engine: no engine process, a
tokenizer of one token per character, and a model whose reply is fixed by the test."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient

from ember.config import EngineConfig
from ember.engine.step_types import RequestUpdate
from ember.server.config import ServedModelSpec
from ember.server.errors import install_error_handlers
from ember.server.models import ServedModel
from ember.server.routes import build_router
from ember.tokenizer.chat_template import ChatTemplate

MODEL = "tiny"


class CharTokenizer:
    """One token per character (its code point), so the text out is exactly the script."""

    def __init__(self, template: str) -> None:
        self.chat_template = template
        self._template = ChatTemplate(template)
        self.rendered: list[str] = []  # every prompt rendered, for the test to read

    def encode_chat(self, messages, add_generation_prompt=True, tools=None, **kwargs) -> list[int]:
        text = self._template.render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
        )
        self.rendered.append(text)
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))

    def added_token_id(self, text: str) -> int | None:
        return None  # every character is its own token


class ScriptedEngine:
    """Answers every sequence with `reply` (text, one token per character, or token ids),
    `chunk` tokens per update, one update per loop turn."""

    def __init__(self, reply: str | list[int], chunk: int = 3, finish_reason: str = "stop") -> None:
        self.reply = reply
        self.chunk = chunk
        self.finish_reason = finish_reason  # the last update's ("length": max_tokens hit)
        self.params = []
        self.prompts: list[list[int]] = []  # every prompt's token ids

    def num_waiting(self, model: str) -> int:
        return 0

    def submit(self, request_id, model, token_ids, params, inbox, index) -> None:
        self.params.append(params)
        self.prompts.append(list(token_ids))
        ids, finish_reason = self.written(params, index)
        pieces = [ids[i : i + self.chunk] for i in range(0, len(ids), self.chunk)]
        loop = asyncio.get_running_loop()
        for k, piece in enumerate(pieces):
            finish = finish_reason if k == len(pieces) - 1 else None
            update = RequestUpdate(request_id, piece, [None] * len(piece), finish)
            loop.call_later(0.001 * (k + 1), inbox.put_nowait, (index, update))

    def written(self, params, index: int) -> tuple[list[int], str]:
        """The reply's token ids and its finish reason."""
        ids = [ord(c) for c in self.reply] if isinstance(self.reply, str) else self.reply
        return ids, self.finish_reason

    def abort(self, request_ids) -> None:
        pass


class GrammarEngine(ScriptedEngine):
    """A model that writes ``reply`` (token ids) as far as the request's grammar allows, then
    what the grammar allows, drawn at random (`helpers.grammar_writer`); a request without a
    grammar gets ``reply`` as it is. Choice ``index`` draws with seed ``index``."""

    def __init__(self, reply: list[int], writer, max_tokens: int = 2000, chunk: int = 3) -> None:
        super().__init__(reply, chunk)
        self.writer = writer
        self.max_tokens = max_tokens

    def written(self, params, index: int) -> tuple[list[int], str]:
        if params.structured_outputs is None:
            return super().written(params, index)
        grammar = self.writer.compiler.matcher(params.structured_outputs)
        return self.writer.write(grammar, self.reply, index, self.max_tokens)


class _Lifecycle:
    def check_accepting(self) -> None:
        pass

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        yield


class _Models:
    def __init__(self, model: ServedModel) -> None:
        self.model = model

    def get(self, name: str | None) -> ServedModel:
        return self.model


def chat_client(
    template: str,
    reply: str | list[int],
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    tokenizer: Any = None,
    engine: ScriptedEngine | None = None,
) -> tuple[TestClient, Any, ScriptedEngine]:
    """The app over a scripted engine (``engine``, else one replying ``reply``);
    ``tokenizer``: the model's, instead of a CharTokenizer of ``template`` (a real one replies
    with token ids)."""
    spec = ServedModelSpec(
        EngineConfig(served_model_name=MODEL),
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
    )
    tokenizer = tokenizer or CharTokenizer(template)
    model = ServedModel(spec, tokenizer)  # type: ignore[arg-type]
    model.info = SimpleNamespace(max_model_len=1 << 16, vocab_size=0x110000)
    engine = engine or ScriptedEngine(reply)
    app = FastAPI()
    app.include_router(build_router())
    install_error_handlers(app)
    app.state.ember = SimpleNamespace(
        config=SimpleNamespace(max_queue=16),
        client=engine,
        models=_Models(model),
        metrics=SimpleNamespace(observe_sequence=lambda *args: None),
        lifecycle=_Lifecycle(),
    )
    return TestClient(app), tokenizer, engine
