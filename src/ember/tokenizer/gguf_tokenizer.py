"""Hugging Face `tokenizers.Tokenizer` rebuilt from a GGUF file's `tokenizer.*` metadata.

Two vocabulary kinds (`tokenizer.ggml.model`):
- "gpt2": byte-level BPE with explicit merges. `tokenizer.ggml.pre` names llama.cpp's
  pre-tokenizer, which we map to the HF pre-tokenizer the original tokenizer.json used.
- "llama": SentencePiece BPE (▁ for spaces, byte fallback); merges are ranked by the score of
  the merged piece, which is how SentencePiece picks its next merge.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers.models import BPE

# llama.cpp token types (tokenizer.ggml.token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2(tok: Tokenizer) -> None:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2(tok: Tokenizer) -> None:
    # llama.cpp isolates every \p{N} before the GPT-2 split (SmolLM's tokenizer.json does the same).
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _split_then_bytes(pattern: str) -> Callable[[Tokenizer], None]:
    def configure(tok: Tokenizer) -> None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return configure


def _qwen2(tok: Tokenizer) -> None:
    tok.normalizer = normalizers.NFC()  # as in Qwen2's tokenizer.json
    _split_then_bytes(_QWEN2_SPLIT)(tok)


# tokenizer.ggml.pre -> how to set up the pre-tokenizer; grouped as llama.cpp groups them.
# "default" (old files whose tokenizer the converter did not recognise) gets GPT-2's split.
_PRE_TOKENIZERS: dict[str, Callable[[Tokenizer], None]] = {
    **dict.fromkeys(("default", "gpt2", "mpt", "olmo", "jais"), _gpt2),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
        _digits_then_gpt2,
    ),
    **dict.fromkeys(("llama-bpe", "llama3", "dbrx", "smaug-bpe"), _split_then_bytes(_LLAMA3_SPLIT)),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen"), _qwen2),
}
# Pre-tokenizers for which llama.cpp (and the HF tokenizer.json) look a word up whole first.
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3"})


def tokenizer_from_gguf(reader_or_fields: Any) -> Tokenizer:
    """Build the tokenizer described by a `gguf.GGUFReader` or a mapping of metadata values.

    Control and unknown tokens become special added tokens (kept whole, skipped by
    `decode(skip_special_tokens=True)`); user-defined tokens become ordinary added tokens.
    """
    fields = _tokenizer_fields(reader_or_fields)
    model = fields.get("tokenizer.ggml.model")
    if model == "gpt2":
        tok = _byte_level_bpe(fields)
    elif model == "llama":
        tok = _sentencepiece_bpe(fields)
    else:
        raise ValueError(f"unsupported tokenizer.ggml.model {model!r}; supported: gpt2, llama")
    _add_added_tokens(tok, fields)
    _set_post_processor(tok, fields)
    return tok


def tokenizer_config_from_gguf(reader_or_fields: Any) -> dict[str, Any]:
    """A tokenizer_config.json-style dict: chat_template, special token strings, add_bos/eos."""
    fields = _tokenizer_fields(reader_or_fields)
    tokens = fields["tokenizer.ggml.tokens"]

    def token(kind: str) -> str | None:
        token_id = fields.get(f"tokenizer.ggml.{kind}_token_id")
        return None if token_id is None else tokens[int(token_id)]

    return {
        "chat_template": fields.get("tokenizer.chat_template"),
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": _add_bos(fields),
        "add_eos_token": bool(fields.get("tokenizer.ggml.add_eos_token", False)),
    }


def _tokenizer_fields(reader_or_fields: Any) -> Mapping[str, Any]:
    if isinstance(reader_or_fields, Mapping):
        return reader_or_fields
    # A gguf.GGUFReader: decode only the tokenizer's fields.
    return {
        name: field.contents()
        for name, field in reader_or_fields.fields.items()
        if name.startswith("tokenizer.")
    }


def _byte_level_bpe(fields: Mapping[str, Any]) -> Tokenizer:
    pre = fields.get("tokenizer.ggml.pre", "default")
    configure = _PRE_TOKENIZERS.get(pre)
    if configure is None:
        raise ValueError(
            f"unsupported tokenizer.ggml.pre {pre!r}; supported: "
            + ", ".join(sorted(_PRE_TOKENIZERS))
        )
    tokens: Sequence[str] = fields["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in fields["tokenizer.ggml.merges"]]
    tok = Tokenizer(
        BPE(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            ignore_merges=pre in _IGNORE_MERGES,
        )
    )
    configure(tok)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(fields: Mapping[str, Any]) -> Tokenizer:
    tokens: Sequence[str] = fields["tokenizer.ggml.tokens"]
    types = _token_types(fields)
    unk_id = fields.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(
        BPE(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=_merges_from_scores(tokens, fields["tokenizer.ggml.scores"], types),
            unk_token=None if unk_id is None else tokens[int(unk_id)],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    add_space_prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    # Like llama.cpp (and HF's legacy Llama tokenizer): a space prefix on every text segment,
    # including the one right after a special token.
    replace_spaces = normalizers.Replace(" ", "▁")
    tok.normalizer = (
        normalizers.Sequence([normalizers.Prepend("▁"), replace_spaces])
        if add_space_prefix
        else replace_spaces
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]
) -> list[tuple[str, str]]:
    """Every split of a normal piece into two normal pieces, best-scored merged piece first."""
    ids = {token: i for i, token in enumerate(tokens) if types[i] == _NORMAL}
    ranked = []
    for token, merged_id in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-float(scores[merged_id]), merged_id, ids[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _token_types(fields: Mapping[str, Any]) -> Sequence[int]:
    types = fields.get("tokenizer.ggml.token_type")
    return [_NORMAL] * len(fields["tokenizer.ggml.tokens"]) if types is None else list(types)


def _add_added_tokens(tok: Tokenizer, fields: Mapping[str, Any]) -> None:
    tokens = fields["tokenizer.ggml.tokens"]
    types = _token_types(fields)
    special = [t for t, kind in zip(tokens, types, strict=True) if kind in (_CONTROL, _UNKNOWN)]
    user = [t for t, kind in zip(tokens, types, strict=True) if kind == _USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _add_bos(fields: Mapping[str, Any]) -> bool:
    # llama.cpp's default when the key is absent: SentencePiece vocabularies start with BOS.
    default = fields.get("tokenizer.ggml.model") == "llama"
    return bool(fields.get("tokenizer.ggml.add_bos_token", default))


def _set_post_processor(tok: Tokenizer, fields: Mapping[str, Any]) -> None:
    tokens = fields["tokenizer.ggml.tokens"]
    bos_id = fields.get("tokenizer.ggml.bos_token_id") if _add_bos(fields) else None
    add_eos = fields.get("tokenizer.ggml.add_eos_token", False)
    eos_id = fields.get("tokenizer.ggml.eos_token_id") if add_eos else None
    if bos_id is None and eos_id is None:
        return

    def wrap(sequence: str, type_id: int) -> str:
        parts = [] if bos_id is None else [f"{tokens[bos_id]}:{type_id}"]
        parts.append(f"{sequence}:{type_id}")
        parts += [] if eos_id is None else [f"{tokens[eos_id]}:{type_id}"]
        return " ".join(parts)

    special_ids = {int(i) for i in (bos_id, eos_id) if i is not None}
    tok.post_processor = processors.TemplateProcessing(
        single=wrap("$A", 0),
        pair=wrap("$A", 0) + " " + wrap("$B", 1),
        special_tokens=[(tokens[i], i) for i in sorted(special_ids)],
    )
