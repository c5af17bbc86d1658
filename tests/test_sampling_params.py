"""`SamplingParams.validate`: every value the engine cannot hold (integers past its int32
columns or its int64 seed, floats that are not finite, text that is not UTF-8) is a ValueError
whose message starts with the field's name, which the server reports as the 400's `param`."""

from __future__ import annotations

import math

import pytest

from ember.sampling_params import INT32_MAX, SEED_MAX, SamplingParams

INVALID = [
    ("n", 0),
    ("n", INT32_MAX + 1),
    ("n", True),
    ("temperature", -0.5),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("top_p", 0.0),
    ("top_p", math.nan),
    ("top_k", INT32_MAX + 1),
    ("top_k", 2**64),
    ("min_p", math.nan),
    ("min_p", 1.5),
    ("max_tokens", 0),
    ("max_tokens", INT32_MAX + 1),
    ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("min_tokens", INT32_MAX + 1),
    ("presence_penalty", math.nan),
    ("frequency_penalty", -math.inf),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", math.inf),
    ("repetition_penalty", math.nan),
    ("stop_token_ids", [5, INT32_MAX + 1]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [False]),
    ("logit_bias", {INT32_MAX + 1: 1.0}),
    ("logit_bias", {True: 1.0}),
    ("logit_bias", {5: math.nan}),
    ("logit_bias", {5: -math.inf}),
    ("logprobs", 21),
    ("seed", -1),
    ("seed", SEED_MAX + 1),
    ("seed", 2**64),
    ("stop", ["ok", "\ud800"]),
]


@pytest.mark.parametrize(("field", "value"), INVALID)
def test_values_the_engine_cannot_hold_are_refused_by_name(field, value):
    fields = {field: value, "max_tokens": None} if field == "min_tokens" else {field: value}
    with pytest.raises(ValueError) as caught:
        SamplingParams(**fields)
    assert str(caught.value).split(" ", 1)[0] == field


def test_min_tokens_must_not_exceed_max_tokens():
    with pytest.raises(ValueError, match=r"^min_tokens \(5\) must not exceed max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_the_largest_values_the_engine_holds_are_accepted():
    params = SamplingParams(
        n=INT32_MAX,
        top_k=INT32_MAX,
        max_tokens=INT32_MAX,
        min_tokens=INT32_MAX,
        seed=SEED_MAX,
        stop_token_ids=[0, INT32_MAX],
        logit_bias={INT32_MAX: 100.0, 0: -1e300},
        stop=["é", "🙂"],
        temperature=1e300,
        repetition_penalty=1e-300,
    )
    assert params.seed == SEED_MAX and params.top_k == INT32_MAX


def test_a_negative_top_k_still_means_no_top_k():
    assert SamplingParams(top_k=-1).top_k == SamplingParams(top_k=-(2**70)).top_k == 0
