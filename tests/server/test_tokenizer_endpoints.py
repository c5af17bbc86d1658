"""The tokenizer a client borrows through the server, as lm-evaluation-harness's remote tokenizer
does (`tokenizer_backend=remote`, or `auto` finding /tokenizer_info): /detokenize keeps special
tokens, so /tokenize of its text gives the same ids back (a rolling loglikelihood window starts
with BOS), and `GET /tokenizer_info` (vLLM's, behind the same flag) names the special tokens.
On an app built in this process with a hand-made tokenizer; no engine runs."""

from __future__ import annotations

import pytest
import tokenizers
from fastapi.testclient import TestClient
from tokenizers import decoders, pre_tokenizers
from tokenizers.models import BPE

from ember.config import engine_config
from ember.engine.ipc import ModelInfo
from ember.server.app import build_app
from ember.server.config import ServedModelSpec, ServerConfig
from ember.server.models import ServedModel
from ember.tokenizer.tokenizer import Tokenizer

TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
CONTEXT = 64


def small_tokenizer() -> Tokenizer:
    """Words of a few letters, `<s>` (BOS) and `</s>` (EOS) as special tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({c: len(vocab) for c in "▁abcdefghijklmnopqrstuvwxyz"})
    backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}
    return Tokenizer(backend, config, chat_template=TEMPLATE)


def app_client(**config) -> TestClient:
    spec = ServedModelSpec(engine_config("/models/small", served_model_name="small"))
    tokenizer = small_tokenizer()
    info = ModelInfo("small", CONTEXT, tokenizer.vocab_size, 16)
    model = ServedModel(spec=spec, tokenizer=tokenizer, info=info)
    return TestClient(build_app(ServerConfig(models=(spec,), **config), [model]))


@pytest.fixture
def app() -> TestClient:
    return app_client(tokenizer_info_endpoint=True)


def test_detokenize_keeps_special_tokens_and_round_trips_through_tokenize(app):
    ids = [1, *app.post("/tokenize", json={"prompt": "hi there"}).json()["tokens"][1:], 2]
    text = app.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text.startswith("<s>") and text.endswith("</s>")
    again = app.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert again["tokens"] == ids


def test_tokenizer_info_names_what_a_remote_tokenizer_needs(app):
    reply = app.get("/tokenizer_info")
    assert reply.status_code == 200
    info = reply.json()
    assert (info["bos_token"], info["eos_token"], info["unk_token"]) == ("<s>", "</s>", "<unk>")
    assert info["pad_token"] is None and info["add_bos_token"] is True
    assert info["model_max_length"] == CONTEXT and info["chat_template"] == TEMPLATE
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    # lm-eval's remote tokenizer takes EOS's id from /tokenize of its text.
    eos = app.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"] == [2]


def test_tokenizer_info_takes_a_model_by_name(app):
    assert app.get("/tokenizer_info", params={"model": "small"}).json()["eos_token"] == "</s>"
    unknown = app.get("/tokenizer_info", params={"model": "other"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


def test_tokenizer_info_is_off_unless_the_flag_asks_for_it():
    reply = app_client().get("/tokenizer_info")
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["code"] == "tokenizer_info_disabled"
    assert "--enable-tokenizer-info-endpoint" in error["message"]


def test_tokenizer_info_needs_the_api_key():
    client = app_client(tokenizer_info_endpoint=True, api_key="secret")
    assert client.get("/tokenizer_info").status_code == 401
    authorized = client.get("/tokenizer_info", headers={"Authorization": "Bearer secret"})
    assert authorized.status_code == 200
