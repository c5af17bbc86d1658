"""`find_non_json_value`: a body parsed by Python's json holds NaN, ±Infinity or a lone
surrogate somewhere, or it does not; the finder says where, whatever the body's shape."""

from __future__ import annotations

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from ember.server.json_values import MAX_PATH_CHARS, find_non_json_value

_texts = st.text(st.characters(codec="utf-8"), max_size=8)
json_values = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False)
    )
    | _texts,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_texts, children, max_size=4),
    max_leaves=12,
)
bad_values = st.sampled_from([math.nan, math.inf, -math.inf, "\ud800", "a\udfffb"])


def leaf_paths(value, path=()):
    """The path of every leaf of `value` (a scalar, or an empty container)."""
    if isinstance(value, dict) and value:
        return [p for key, child in value.items() for p in leaf_paths(child, (*path, key))]
    if isinstance(value, list) and value:
        return [p for i, child in enumerate(value) for p in leaf_paths(child, (*path, i))]
    return [path]


def replaced(value, path, new):
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = replaced(value[path[0]], path[1:], new)
    return copy


@settings(max_examples=200, database=None)
@given(json_values)
def test_json_that_a_strict_parser_accepts_has_nothing_to_find(value):
    json.dumps(value, allow_nan=False, ensure_ascii=False).encode()  # strict JSON, UTF-8
    assert find_non_json_value(value) is None


@settings(max_examples=200, database=None)
@given(json_values, bad_values, st.data())
def test_one_bad_value_anywhere_is_found_where_it_is(value, bad, data):
    path = data.draw(st.sampled_from(leaf_paths(value)))
    found = find_non_json_value(replaced(value, path, bad))
    expected = ".".join(map(str, path))
    assert found is not None and found[0] == expected[:MAX_PATH_CHARS]
    assert ("Unicode" in found[1]) == isinstance(bad, str)


def test_a_key_with_a_lone_surrogate_is_found_at_its_object():
    assert find_non_json_value({"a": [{"\udc00": 1}]})[0] == "a.0"
    assert find_non_json_value({"\ud800": 1})[0] == ""


def test_nesting_deeper_than_the_stack_is_walked():
    value = math.inf
    for _ in range(20_000):
        value = [value]
    path, reason = find_non_json_value({"deep": value})
    assert path.startswith("deep.0.0") and len(path) <= MAX_PATH_CHARS + 3
    assert "inf" in reason
