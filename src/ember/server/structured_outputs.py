"""What a request asks of structured output, in every shape clients send it: OpenAI's
`response_format`, vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`
and its newer `structured_outputs` object. One constraint at most; each is compiled here, in
the front end, so an invalid schema, regex or grammar is a 400 naming its field and the engine
never sees one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ember.server.errors import BadRequestError
from ember.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from ember.server.protocol import SamplingFields


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema and its name (`strict` is taken as
    given: the output always follows the schema)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def requested_structured_outputs(body: SamplingFields) -> StructuredOutputsParams | None:
    """The one constraint ``body`` asks for, compiled and checked (None: none); a 400 naming
    the field when it asks for several, or when one does not compile."""
    asked = _constraints(body)
    if len(asked) > 1:
        names = " and ".join(name for name, _ in asked)
        raise BadRequestError(
            f"{names} each constrain the output: give one of them", param=asked[1][0]
        )
    if not asked:
        return None
    field, params = asked[0]
    check_structured_outputs(params, field)
    return params


def check_structured_outputs(params: StructuredOutputsParams, field: str) -> None:
    """400 naming ``field`` unless ``params`` is one constraint that compiles."""
    from ember.structured_output.grammar import check_grammar  # llguidance, when first needed

    try:
        params.validate()
        check_grammar(params)
    except ValueError as exc:
        raise BadRequestError(f"{field}: {exc}", param=field) from None


def _constraints(body: SamplingFields) -> list[tuple[str, StructuredOutputsParams]]:
    """Every constraint ``body`` sets, with the field that sets it."""
    asked = []
    response_format = body.response_format
    if response_format is not None and response_format.type == "json_object":
        asked.append(("response_format", StructuredOutputsParams(json_object=True)))
    if response_format is not None and response_format.type == "json_schema":
        described = response_format.json_schema
        if described is None or described.schema_ is None:
            raise BadRequestError(
                "response_format of type json_schema needs json_schema.schema",
                param="response_format",
            )
        asked.append(("response_format", StructuredOutputsParams(json=described.schema_)))
    guided = {
        "guided_json": StructuredOutputsParams(json=body.guided_json),
        "guided_regex": StructuredOutputsParams(regex=body.guided_regex),
        "guided_choice": StructuredOutputsParams(choice=body.guided_choice),
        "guided_grammar": StructuredOutputsParams(grammar=body.guided_grammar),
    }
    asked += [(name, params) for name, params in guided.items() if params.constraints]
    if body.structured_outputs is not None:  # vLLM's object: the engine's own parameters
        asked.append(("structured_outputs", body.structured_outputs))
    return asked
