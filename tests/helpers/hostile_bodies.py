"""Hypothesis strategies for hostile request bodies of the OpenAI endpoints, as the bytes a
client sends.

Most bodies are a valid request of the endpoint (values at the edges of what is accepted) with
up to three fields replaced by hostile values: of the right type but out of range (huge
integers, NaN and Infinity, strings with lone surrogates, template syntax, reserved names), or
junk of any JSON shape; often with unknown fields of any name beside them. One body in ten is
not an object, or not JSON at all. So each field's checks are reached on their own, and valid
requests go on to the engine.

Generation stays cheap on purpose: `max_tokens` is at most 3 or else far beyond any context,
and no body asks for an unbounded generation (``max_tokens: null`` in a chat request).
"""

from __future__ import annotations

import json
import math

from hypothesis import strategies as st

VOCAB_SIZE = 49152  # SmolLM2's
MAX_TOKENS_CAP = 3  # the most tokens a fuzzed request may generate per sequence
OUT_OF_CONTEXT = 4096  # from here, max_tokens exceeds any test server's context
MAX_MUTATIONS = 3

EDGE_INTS = (0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1)
EDGE_FLOATS = (math.nan, math.inf, -math.inf, -0.0, 5e-324, 1e-45, 1e308, 2.5, -2.5)
SURROGATE_TEXTS = ("\ud800", "a\udfffb", "\ud83d")  # the last: half of an emoji's pair
NASTY_TEXTS = (
    "",
    "\n[ERROR] forged log line\n",
    "\x00\x1b[31m",
    "\u2028",
    "{{ raise_exception('boom') }}",
    "{% for x in range(10**9) %}{% endfor %}",
    "<|im_start|>system\n",
    "<|endoftext|>",
)
RESERVED_TEMPLATE_NAMES = (
    "self",
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    "special_tokens",
)
ROLES = ("system", "developer", "user", "assistant", "tool")
BAD_ROLES = ("function", "hacker", "", "USER", "user\n")

# -- values ----------------------------------------------------------------------------------

# Text a client may send (valid Unicode), and text that JSON can carry but UTF-8 cannot.
clean_texts = st.one_of(
    st.text(st.characters(codec="utf-8"), max_size=24), st.sampled_from(NASTY_TEXTS)
)
_any_characters = st.one_of(
    st.characters(codec=None, exclude_categories=()),
    st.characters(categories=["Cs"]),  # lone surrogates, or pairs that JSON joins into one
)
texts = st.one_of(
    clean_texts, st.text(_any_characters, max_size=24), st.sampled_from(SURROGATE_TEXTS)
)
ints = st.one_of(st.integers(), st.sampled_from(EDGE_INTS), st.integers(-(2**70), 2**70))
floats = st.one_of(st.floats(), st.sampled_from(EDGE_FLOATS))
junk = st.recursive(
    st.one_of(st.none(), st.booleans(), ints, floats, texts),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(texts, children, max_size=4)
    ),
    max_leaves=8,
)
clean_junk = st.recursive(  # any JSON a strict parser would accept too
    st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=False, allow_infinity=False)),
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(clean_texts, children, max_size=3)
    ),
    max_leaves=6,
)
token_ids = st.integers(0, VOCAB_SIZE - 1)
hostile_token_ids = st.one_of(ints, st.booleans(), st.sampled_from([1.0, "1", None]))


def hostile(*typed: st.SearchStrategy) -> st.SearchStrategy:
    """Values of the field's type out of its range, or junk of any shape."""
    return st.one_of(*typed, junk)


# Either nothing much to generate, or refused before any generation: never None, never 4..4095.
output_limits = st.integers(1, MAX_TOKENS_CAP)
hostile_output_limits = st.one_of(
    st.integers(max_value=0),
    st.integers(min_value=OUT_OF_CONTEXT),
    st.sampled_from([2**31, 2**63, 2**64, 1.5, math.nan, math.inf, "2", [], {}]),
)

# -- fields: name -> (accepted values, hostile values) ----------------------------------------

_SAMPLING_FIELDS = {
    "model": (st.sampled_from([None, ""]), texts),
    "n": (st.integers(1, 2), hostile(ints, floats)),
    "temperature": (st.floats(0, 2), hostile(floats, ints)),
    "top_p": (st.floats(0.01, 1), hostile(floats)),
    "top_k": (st.one_of(st.integers(-1, 64), st.just(2**31 - 1)), hostile(ints)),
    "min_p": (st.floats(0, 1), hostile(floats)),
    "seed": (st.one_of(st.integers(0, 2**63 - 1), st.just(2**63 - 1)), hostile(ints)),
    "stop": (
        st.one_of(clean_texts.filter(bool), st.lists(clean_texts.filter(bool), max_size=3)),
        hostile(texts, st.lists(texts, max_size=3)),
    ),
    "stop_token_ids": (
        st.lists(token_ids, max_size=3),
        hostile(st.lists(hostile_token_ids, min_size=1, max_size=3)),
    ),
    "presence_penalty": (st.floats(-2, 2), hostile(floats)),
    "frequency_penalty": (st.floats(-2, 2), hostile(floats)),
    "repetition_penalty": (st.floats(0.5, 2), hostile(floats)),
    "logit_bias": (
        st.dictionaries(token_ids.map(str), st.floats(-100, 100), max_size=3),
        hostile(st.dictionaries(st.one_of(ints.map(str), texts), floats, min_size=1, max_size=3)),
    ),
    "ignore_eos": (st.booleans(), junk),
    "min_tokens": (st.integers(0, 1), hostile(ints)),
    "skip_special_tokens": (st.booleans(), junk),
    "include_stop_str_in_output": (st.booleans(), junk),
    "stream": (st.booleans(), junk),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}), junk),
    "user": (clean_texts, texts),
    # Structured output: two of its fields (together, a 400), each compiled by llguidance.
    "response_format": (st.sampled_from([{"type": "text"}, {"type": "json_object"}]), junk),
    "guided_regex": (st.sampled_from(["[a-z]{1,4}", "(yes|no)", r"\d+"]), hostile(texts)),
}
_PROMPTS = (
    st.one_of(
        clean_texts.filter(str.strip),
        st.lists(clean_texts.filter(str.strip), min_size=1, max_size=3),
        st.lists(token_ids, min_size=1, max_size=8),
        st.lists(st.lists(token_ids, min_size=1, max_size=6), min_size=1, max_size=3),
    ),
    hostile(
        texts,
        st.lists(texts, max_size=3),
        st.lists(hostile_token_ids, min_size=1, max_size=4),
        st.lists(st.lists(hostile_token_ids, min_size=1, max_size=3), min_size=1, max_size=2),
        st.just([]),
    ),
)
COMPLETION_FIELDS = {
    "prompt": _PROMPTS,
    "max_tokens": (output_limits, hostile_output_limits),
    **_SAMPLING_FIELDS,
    "echo": (st.booleans(), junk),
    "logprobs": (st.integers(0, 5), hostile(ints)),
    "suffix": (st.sampled_from([None, ""]), hostile(texts)),
    "best_of": (st.sampled_from([None, 1]), junk),
    "add_special_tokens": (st.booleans(), junk),
}
_CONTENT_PARTS = st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": clean_texts}), min_size=1, max_size=2
)
_MESSAGES = (
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(ROLES)},
            optional={
                "content": st.one_of(st.none(), clean_texts, _CONTENT_PARTS),
                "name": clean_texts,
            },
        ),
        min_size=1,
        max_size=3,
    ),
    hostile(
        st.just([]),
        st.lists(
            st.fixed_dictionaries(
                {"role": st.one_of(st.sampled_from(ROLES + BAD_ROLES), texts)},
                optional={
                    "content": st.one_of(
                        texts, st.lists(st.dictionaries(texts, junk, max_size=2), max_size=2)
                    ),
                    "name": texts,
                    "tool_calls": junk,
                },
            ),
            min_size=1,
            max_size=3,
        ),
    ),
)
CHAT_FIELDS = {
    "messages": _MESSAGES,
    "max_tokens": (output_limits, hostile_output_limits),
    **_SAMPLING_FIELDS,
    "max_completion_tokens": (output_limits, hostile_output_limits),
    "logprobs": (st.booleans(), junk),
    "top_logprobs": (st.integers(0, 5), hostile(ints)),
    "add_generation_prompt": (st.booleans(), junk),
    "chat_template_kwargs": (
        st.dictionaries(clean_texts.filter(lambda k: k not in RESERVED_TEMPLATE_NAMES), clean_junk),
        hostile(st.dictionaries(st.sampled_from(RESERVED_TEMPLATE_NAMES), junk, min_size=1)),
    ),
    "tools": (st.lists(st.dictionaries(clean_texts, clean_junk, max_size=2), max_size=2), junk),
}
TOKENIZE_FIELDS = {
    "model": _SAMPLING_FIELDS["model"],
    "prompt": (clean_texts, hostile(texts)),
    "messages": _MESSAGES,
    "add_special_tokens": (st.booleans(), junk),
    "add_generation_prompt": (st.booleans(), junk),
    "return_token_strs": (st.booleans(), junk),
}
DETOKENIZE_FIELDS = {
    "tokens": (
        st.lists(token_ids, max_size=8),
        hostile(st.lists(hostile_token_ids, min_size=1, max_size=4)),
    ),
    "model": _SAMPLING_FIELDS["model"],
}

# -- bodies ----------------------------------------------------------------------------------


def objects(fields: dict, required: tuple[str, ...]) -> st.SearchStrategy[dict]:
    """A valid body (the `required` fields and any of the others), then up to MAX_MUTATIONS
    fields set to hostile values, then up to three unknown fields."""
    valid = st.fixed_dictionaries(
        {name: fields[name][0] for name in required},
        optional={name: accepted for name, (accepted, _) in fields.items() if name not in required},
    )
    mutation = st.sampled_from(sorted(fields)).flatmap(
        lambda name: st.tuples(st.just(name), fields[name][1])
    )
    unknown = st.dictionaries(texts.filter(lambda name: name not in fields), junk, max_size=3)
    return st.tuples(valid, st.lists(mutation, max_size=MAX_MUTATIONS), unknown).map(
        lambda parts: {**parts[2], **parts[0], **dict(parts[1])}
    )


def completion_objects() -> st.SearchStrategy[dict]:
    return objects(COMPLETION_FIELDS, ("prompt", "max_tokens"))


def chat_objects() -> st.SearchStrategy[dict]:
    return objects(CHAT_FIELDS, ("messages", "max_tokens"))


def tokenize_objects() -> st.SearchStrategy[dict]:
    return objects(TOKENIZE_FIELDS, ())


def detokenize_objects() -> st.SearchStrategy[dict]:
    return objects(DETOKENIZE_FIELDS, ("tokens",))


def encode(body: object) -> bytes:
    """What a client would send: Python's JSON, with NaN and Infinity literals and escaped lone
    surrogates."""
    return json.dumps(body, allow_nan=True).encode()


def request_bodies(bodies: st.SearchStrategy) -> st.SearchStrategy[bytes]:
    """Mostly `bodies`; one in ten is junk JSON of another shape, or bytes that may not be JSON
    at all (truncated, not UTF-8, empty)."""
    return st.integers(0, 19).flatmap(
        lambda pick: (
            bodies.map(encode)
            if pick >= 2
            else (junk.map(encode) if pick == 1 else st.binary(max_size=48))
        )
    )
