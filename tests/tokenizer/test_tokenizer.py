"""Tokenizer, chat templates, incremental detokenization and stop strings.

The reference is transformers' AutoTokenizer on the same files (SmolLM2's tokenizer, and a Llama 3
style variant of it); byte-fallback detokenization uses a small hand-built SentencePiece-style
tokenizer.
"""

from __future__ import annotations

import inspect
import json
import random
import shutil
from pathlib import Path

import pytest
import tokenizers
from helpers.tiny_models import smollm2_tokenizer_dir
from tokenizers import decoders, pre_tokenizers
from tokenizers.models import BPE

from ember.tokenizer.chat_template import (
    RENDER_ARGUMENTS,
    ChatTemplate,
    NoChatTemplateError,
    load_chat_template,
)
from ember.tokenizer.detokenizer import IncrementalDetokenizer
from ember.tokenizer.stop_strings import StopStringMatcher
from ember.tokenizer.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world.",
    "  leading and trailing spaces  ",
    "Émoji 🤗🚀 and CJK 你好，世界 and Ελληνικά",
    "line one\nline two\r\n\ttabbed",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
    "",
    "1234567890 + 3.14159 = ?",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Tell me a joke 🤗"},
    ],
]
# Writes BOS itself, like Llama 3's template; roles are plain text so a second BOS would show.
LLAMA3_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def tokenizer_from_dir(path: Path, **kwargs) -> Tokenizer:
    config = json.loads((path / "tokenizer_config.json").read_text())
    template_file = path / "chat_template.jinja"
    if template_file.exists():
        config["chat_template"] = template_file.read_text()
    backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    return Tokenizer(backend, config, **kwargs)


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    return smollm2_tokenizer_dir()


@pytest.fixture(scope="module")
def smol(smol_dir) -> Tokenizer:
    return tokenizer_from_dir(smol_dir, generation_config={"eos_token_id": 2})


@pytest.fixture(scope="module")
def hf_smol(smol_dir):
    return transformers.AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="module")
def llama3_style_dir(smol_dir, tmp_path_factory) -> Path:
    """SmolLM2's vocabulary with Llama 3's arrangement: the post-processor adds BOS."""
    out = tmp_path_factory.mktemp("llama3-style")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_dir / name, out / name)
    spec = json.loads((out / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    spec["post_processor"] = {
        "type": "Sequence",
        "processors": [
            {
                "type": "ByteLevel",
                "add_prefix_space": True,
                "trim_offsets": False,
                "use_regex": True,
            },
            {
                "type": "TemplateProcessing",
                "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}]
                + [bos, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {
                    "<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}
                },
            },
        ],
    }
    (out / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = LLAMA3_STYLE_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


# ---- encode / decode against transformers ----


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(smol, hf_smol, add_special_tokens):
    for text in TEXTS:
        expected = hf_smol.encode(text, add_special_tokens=add_special_tokens)
        assert smol.encode(text, add_special_tokens=add_special_tokens) == expected, text
    assert smol.encode_batch(TEXTS, add_special_tokens) == [
        hf_smol.encode(t, add_special_tokens=add_special_tokens) for t in TEXTS
    ]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(smol, hf_smol, skip_special_tokens):
    rng = random.Random(0)
    sequences = [hf_smol.encode(t) for t in TEXTS] + [
        [rng.randrange(smol.vocab_size) for _ in range(rng.randrange(1, 40))] for _ in range(50)
    ]
    for ids in sequences:
        expected = hf_smol.decode(ids, skip_special_tokens=skip_special_tokens)
        assert smol.decode(ids, skip_special_tokens=skip_special_tokens) == expected, ids


def test_vocabulary_facts_match_transformers(smol, hf_smol):
    assert smol.vocab_size == len(hf_smol)
    assert smol.bos_token_id == hf_smol.bos_token_id == 1
    assert smol.eos_token_id == hf_smol.eos_token_id == 2
    assert smol.eos_token_ids == (2,)
    assert set(hf_smol.all_special_ids) <= set(smol.all_special_ids)
    ids = hf_smol.encode(TEXTS[2])
    assert smol.convert_ids_to_tokens(ids) == hf_smol.convert_ids_to_tokens(ids)
    assert smol.convert_ids_to_tokens(ids[0]) == hf_smol.convert_ids_to_tokens(ids[0])
    assert not smol.adds_bos_token


def test_llama3_style_post_processor_bos_matches_transformers(llama3_style_dir):
    ours = tokenizer_from_dir(llama3_style_dir)
    hf = transformers.AutoTokenizer.from_pretrained(llama3_style_dir)
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == hf.encode(
            text, add_special_tokens=False
        )
    assert ours.encode("hi")[0] == 1 and ours.adds_bos_token
    for conversation in CONVERSATIONS:
        text = hf.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        assert ours.apply_chat_template(conversation) == text
        # transformers encodes a rendered chat without special tokens: the template's BOS only.
        expected = hf.encode(text, add_special_tokens=False)
        assert ours.encode_chat(conversation) == expected
        assert expected[0] == 1 and expected[1] != 1


def test_add_bos_token_config_adds_exactly_one_bos(smol_dir):
    """A GGUF-style `add_bos_token` with a post-processor that adds nothing (llama.cpp's rule)."""
    config = json.loads((smol_dir / "tokenizer_config.json").read_text())
    backend = tokenizers.Tokenizer.from_file(str(smol_dir / "tokenizer.json"))
    with_bos_template = Tokenizer(
        backend, {**config, "add_bos_token": True, "chat_template": LLAMA3_STYLE_TEMPLATE}
    )
    plain_ids = with_bos_template.encode("Hello", add_special_tokens=False)
    assert with_bos_template.encode("Hello") == [1, *plain_ids]
    assert with_bos_template.encode_batch(["Hello"]) == [[1, *plain_ids]]
    chat_ids = with_bos_template.encode_chat(CONVERSATIONS[0])
    assert chat_ids[0] == 1 and chat_ids[1] != 1  # the template's BOS, no second one
    no_bos_template = Tokenizer(
        backend, {**config, "add_bos_token": True, "chat_template": "{{ messages[0].content }}"}
    )
    assert no_bos_template.encode_chat(CONVERSATIONS[0]) == [
        1,
        *no_bos_template.encode("Hi there!", False),
    ]


def test_tokenizer_from_checkpoint_with_template_override(smol_dir, tmp_path):
    from helpers.tiny_models import make_tiny_model

    from ember.weights.hf_checkpoint import HFDirCheckpoint

    ckpt = HFDirCheckpoint(make_tiny_model("LlamaForCausalLM", tmp_path / "m"))
    assert Tokenizer.from_checkpoint(ckpt).eos_token_ids == (2,)
    override = Tokenizer.from_checkpoint(ckpt, chat_template_override="{{ 'X' }}{{ eos_token }}")
    assert override.apply_chat_template(CONVERSATIONS[0]) == "X<|im_end|>"


# ---- chat templates ----


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(smol, hf_smol, add_generation_prompt):
    for conversation in CONVERSATIONS:
        expected = hf_smol.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        got = smol.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
        assert got == expected
        assert smol.encode_chat(conversation, add_generation_prompt) == smol.encode(
            expected, add_special_tokens=False
        )


def test_template_features_match_transformers(smol, hf_smol):
    template = (
        "{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{{ m | tojson }}|{% endfor %}"
        "{{ ns.n }}|{{ tools | tojson(indent=2) }}|{{ bos_token }}|{{ unset_var }}|{{ extra }}\n"
        "  {%- generation %}{{ 'gen' }}{% endgeneration %}"
    )
    tools = [{"type": "function", "function": {"name": "météo", "description": "<weather> & co"}}]
    conversation = CONVERSATIONS[2]
    expected = hf_smol.apply_chat_template(
        conversation, tools=tools, chat_template=template, tokenize=False, extra="E"
    )
    ours = ChatTemplate(template).render(
        conversation,
        add_generation_prompt=False,
        tools=tools,
        special_tokens=smol.special_tokens,
        extra="E",
    )
    assert ours == expected
    assert "météo" in ours and "<weather> & co" in ours  # no ASCII or HTML escaping


def test_template_globals():
    rendered = ChatTemplate("{{ strftime_now('%Y') }}").render([])
    assert rendered.isdigit() and len(rendered) == 4
    with pytest.raises(ValueError, match="chat template error: roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}").render([])
    with pytest.raises(ValueError, match="chat template error"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render([{"content": "x"}])
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}").render([])


def test_render_arguments_are_the_names_the_renderer_sets_itself(smol):
    """A template variable under one of them collides with the renderer's own argument (so the
    server refuses them in chat_template_kwargs); any other name is a variable."""
    conversation = [{"role": "user", "content": "Hi"}]

    def encode(**variables):  # as the server calls it
        return smol.encode_chat(conversation, add_generation_prompt=True, tools=None, **variables)

    for name in sorted(RENDER_ARGUMENTS):
        with pytest.raises((TypeError, ValueError), match=name):
            encode(**{name: []})
    assert encode(some_flag=True) == encode()
    # A parameter added to the renderer must join them.
    functions = (Tokenizer.encode_chat, Tokenizer.apply_chat_template, ChatTemplate.render)
    named = {
        parameter.name
        for function in functions
        for parameter in inspect.signature(function).parameters.values()
        if parameter.kind is not inspect.Parameter.VAR_KEYWORD
    }
    assert named <= RENDER_ARGUMENTS


def test_template_sandbox_forbids_mutation():
    with pytest.raises(ValueError, match="chat template error"):
        ChatTemplate("{{ messages.append(1) }}").render([])


def test_named_templates_pick_tool_use_when_tools_are_given():
    template = ChatTemplate(
        [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]
    )
    assert template.render([]) == "plain"
    assert template.render([], tools=[{"name": "f"}]) == "tools"
    with pytest.raises(NoChatTemplateError, match="several chat templates"):
        ChatTemplate({"a": "1", "b": "2"}).render([])


def test_missing_template_is_a_clear_error(smol_dir):
    config = json.loads((smol_dir / "tokenizer_config.json").read_text())
    backend = tokenizers.Tokenizer.from_file(str(smol_dir / "tokenizer.json"))
    bare = Tokenizer(backend, config)
    assert bare.chat_template is None
    with pytest.raises(NoChatTemplateError, match="--chat-template"):
        bare.apply_chat_template(CONVERSATIONS[0])
    given = Tokenizer(backend, config, chat_template="{{ messages | length }}")
    assert given.apply_chat_template(CONVERSATIONS[1]) == "2"


def test_load_chat_template_from_file_or_text(tmp_path):
    jinja_file = tmp_path / "t.jinja"
    jinja_file.write_text("{{ 'file' }}")
    json_file = tmp_path / "chat_template.json"
    json_file.write_text(json.dumps({"chat_template": "{{ 'json' }}"}))
    assert load_chat_template(str(jinja_file)) == "{{ 'file' }}"
    assert load_chat_template(str(json_file)) == "{{ 'json' }}"
    assert load_chat_template("{% if x %}y{% endif %}") == "{% if x %}y{% endif %}"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


# ---- incremental detokenization ----


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes=(1,)) -> list[str]:
    """Feed `ids` in chunks of the given sizes (cycled); return every returned piece."""
    pieces, i, k = [], 0, 0
    while i < len(ids):
        size = chunk_sizes[k % len(chunk_sizes)]
        pieces.append(detok.add(ids[i : i + size]))
        i, k = i + size, k + 1
    pieces.append(detok.flush())
    return pieces


def byte_fallback_tokenizer() -> Tokenizer:
    """A Llama 2 style tokenizer: metaspace words, characters outside the vocab as <0xNN> bytes."""
    chars = "▁abcdefghijklmnopqrstuvwxyzHW.,!"
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({c: len(vocab) + i for i, c in enumerate(chars)})
    merges = [("▁", "H"), ("▁H", "e"), ("l", "l"), ("▁He", "ll"), ("▁Hell", "o"), ("▁", "w")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = tokenizers.Tokenizer(
        BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}
    return Tokenizer(backend, config)


def test_stream_equals_full_decode_with_split_characters(smol):
    text = "Hi 🤗🚀! 你好，世界 — ñandú ✓ done"
    ids = smol.encode(text)
    # The test is only meaningful if some token ends inside a character.
    assert any(smol.decode(ids[:n]).endswith("\ufffd") for n in range(1, len(ids)))
    for chunks in [(1,), (2,), (3, 1), (len(ids),)]:
        pieces = stream(IncrementalDetokenizer(smol, []), ids, chunks)
        assert "".join(pieces) == text
        assert all("\ufffd" not in piece for piece in pieces)


def test_stream_equals_full_decode_for_random_tokens(smol):
    rng = random.Random(1)
    for _ in range(100):
        ids = [rng.randrange(smol.vocab_size) for _ in range(rng.randrange(1, 30))]
        chunks = tuple(rng.randrange(1, 4) for _ in range(3))
        for skip in (True, False):
            detok = IncrementalDetokenizer(smol, [], skip_special_tokens=skip)
            pieces = stream(detok, ids, chunks)
            assert "".join(pieces) == smol.decode(ids, skip_special_tokens=skip)
            assert detok.text == "".join(pieces)


def test_stream_continues_the_prompt(smol):
    prompt = smol.encode("The answer is")
    output = smol.encode(" forty-two 🤗 ok", add_special_tokens=False)
    pieces = stream(IncrementalDetokenizer(smol, prompt), output)
    assert "".join(pieces) == " forty-two 🤗 ok"


def test_byte_fallback_stream():
    tok = byte_fallback_tokenizer()
    text = "Hello world, 你好 🤗!"
    ids = tok.encode(text)
    assert ids[0] == 1 and tok.decode(ids) == text
    assert "<0xF0>" in tok.convert_ids_to_tokens(ids)  # the emoji is spelled in bytes
    for chunks in [(1,), (2, 3)]:
        pieces = stream(IncrementalDetokenizer(tok, []), ids, chunks)
        assert "".join(pieces) == text
        assert all("\ufffd" not in piece for piece in pieces)
    # After a prompt, the first word keeps its space (a fresh decode would strip it).
    prompt, output = tok.encode("Hello"), tok.encode("world 你好", add_special_tokens=False)
    assert output[0] == tok.backend.token_to_id("▁w")
    assert "".join(stream(IncrementalDetokenizer(tok, prompt), output)) == " world 你好"


def test_detokenizer_decodes_a_short_window_per_step(smol):
    """Each step's cost must not grow with the output: decode calls see a bounded window."""

    class CountingDecoder:
        longest = 0

        def decode(self, ids, skip_special_tokens=True):
            self.longest = max(self.longest, len(ids))
            return smol.decode(ids, skip_special_tokens)

    counting = CountingDecoder()
    ids = smol.encode("Streaming 🤗 text, 你好. " * 40)
    detok = IncrementalDetokenizer(counting, smol.encode("prompt " * 50))
    assert "".join(stream(detok, ids)) == smol.decode(ids)
    assert len(ids) > 300 and counting.longest <= 12


# ---- stop strings ----


def test_stop_string_spanning_tokens_is_cut(smol):
    ids = smol.encode("Hello world. The end")
    detok = IncrementalDetokenizer(smol, [], stop=["world."])
    pieces = stream(detok, ids)
    assert "".join(pieces) == "Hello "
    assert detok.finished and detok.stop_reason == "world."
    assert detok.add(smol.encode(" more")) == "" and detok.flush() == ""


def test_stop_string_included_on_request(smol):
    ids = smol.encode("Hello world. The end")
    detok = IncrementalDetokenizer(smol, [], stop=["ld. T"], include_stop_str_in_output=True)
    assert "".join(stream(detok, ids)) == "Hello world. T"
    assert detok.stop_reason == "ld. T"


def test_stop_string_at_the_very_start(smol):
    detok = IncrementalDetokenizer(smol, [], stop=["Hello"])
    assert stream(detok, smol.encode("Hello world")) == ["", "", ""]
    assert detok.finished and detok.text == ""


def test_partial_stop_string_is_held_back_then_released(smol):
    ids = smol.encode("Hello wor and the wor")
    detok = IncrementalDetokenizer(smol, [], stop=["world", "xyz"])
    shown = ""
    for token in ids:
        shown += detok.add([token])
        assert not any(shown.endswith("world"[:n]) for n in range(1, 5)), shown
    assert shown == "Hello wor and the "
    assert detok.flush() == "wor" and not detok.finished


def test_stop_matcher_agrees_with_a_reference_on_random_streams():
    rng = random.Random(2)
    for _ in range(300):
        text = "".join(rng.choice("ab c") for _ in range(rng.randrange(0, 25)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 4))) for _ in range(2)]
        include = rng.random() < 0.5
        matcher = StopStringMatcher(stops, include)
        shown, snapshots, i = "", [], 0
        while i < len(text) and not matcher.finished:
            size = rng.randrange(1, 5)
            shown += matcher.feed(text[i : i + size])
            snapshots.append(shown)
            i += size
        shown += matcher.flush()
        assert (shown, matcher.stop_reason) == reference_stop(text, stops, include)
        # Nothing shown is ever taken back: no part of a (cut) stop string was streamed.
        assert all(shown.startswith(snapshot) for snapshot in snapshots)


def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Scan the text one character at a time; the first stop string completed wins."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return text[: end if include else end - len(stop)], stop
    return text, None


def test_empty_stop_strings_are_ignored():
    matcher = StopStringMatcher(["", "z"])
    assert matcher.feed("abc") == "abc" and not matcher.finished
