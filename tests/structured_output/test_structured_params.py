"""`StructuredOutputsParams` on `SamplingParams`: one constraint of its type, checked by shape
(compiling it is the front end's check), carried to the engine process by msgspec."""

from __future__ import annotations

import msgspec
import pytest

from ember.sampling_params import SamplingParams
from ember.structured_output.params import StructuredOutputsParams

VALID = [
    StructuredOutputsParams(json={"type": "object"}),
    StructuredOutputsParams(json='{"type": "integer"}'),
    StructuredOutputsParams(regex="[a-z]+"),
    StructuredOutputsParams(choice=["yes", "no"]),
    StructuredOutputsParams(grammar='start: "a"'),
    StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
]

INVALID = [
    (StructuredOutputsParams(), "none is set"),
    (StructuredOutputsParams(json={}, regex="a"), "json and regex are all set"),
    (StructuredOutputsParams(json=3), "JSON schema must be an object"),
    (StructuredOutputsParams(regex=""), "regex must be a non-empty string"),
    (StructuredOutputsParams(choice=[]), "choice must be a non-empty list"),
    (StructuredOutputsParams(choice=["a", 1]), "choice must be a non-empty list"),
    (StructuredOutputsParams(grammar=""), "grammar must be a non-empty string"),
    (StructuredOutputsParams(regex="\ud800"), "valid Unicode"),
]


@pytest.mark.parametrize("constraint", VALID, ids=lambda c: c.kind)
def test_one_constraint_of_its_type_is_accepted_and_crosses_to_the_engine(constraint):
    params = SamplingParams(structured_outputs=constraint)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded.structured_outputs == constraint
    assert decoded.structured_outputs.kind == constraint.constraints[0]


@pytest.mark.parametrize(("constraint", "message"), INVALID)
def test_anything_else_is_refused_by_name(constraint, message):
    with pytest.raises(ValueError, match=message) as caught:
        SamplingParams(structured_outputs=constraint)
    assert str(caught.value).split(" ", 1)[0] == "structured_outputs"


def test_guided_decoding_is_the_older_name_of_structured_outputs():
    constraint = StructuredOutputsParams(choice=["a"])
    params = SamplingParams(guided_decoding=constraint)
    assert params.structured_outputs is constraint and params.guided_decoding is None
    with pytest.raises(ValueError, match="give one, not both"):
        SamplingParams(structured_outputs=constraint, guided_decoding=constraint)
