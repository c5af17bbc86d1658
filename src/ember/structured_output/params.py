"""What a request asks of structured output, shaped like vLLM's `StructuredOutputsParams`.

Only the shape is checked here (one constraint, of the right type): whether a schema, regex or
grammar compiles is `ember.structured_output.grammar`'s question, asked by the front end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The constraints, in the order a message names them.
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint on a request's output: ``json`` (a JSON schema, as an object or
    its text), ``regex`` (the whole output matches it), ``choice`` (the output is one of these
    strings), ``grammar`` (Lark, or GBNF as llama.cpp writes it) or ``json_object`` (any JSON
    object). ``disable_any_whitespace``: JSON with no whitespace between its tokens (otherwise
    a line break and some indentation may go between them)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    @property
    def constraints(self) -> list[str]:
        """The names of the constraints set."""
        return [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]

    @property
    def kind(self) -> str:
        """The one constraint set (after `validate`)."""
        return self.constraints[0]

    def validate(self) -> None:
        """ValueError unless exactly one constraint is set, of its type (the message names
        the constraint, not the field holding these parameters)."""
        given = self.constraints
        if len(given) != 1:
            what = " and ".join(given) + " are all set" if given else "none is set"
            raise ValueError(f"give exactly one of {', '.join(CONSTRAINTS)}: {what}")
        kind, value = given[0], getattr(self, given[0])
        if kind == "json" and not isinstance(value, (str, dict)):
            raise ValueError("the JSON schema must be an object or its text")
        if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
            raise ValueError(f"the {kind} must be a non-empty string")
        if kind == "choice" and not (
            isinstance(value, list) and value and all(isinstance(v, str) for v in value)
        ):
            raise ValueError("the choice must be a non-empty list of strings")
        if kind == "json_object" and value is not True:
            raise ValueError("json_object must be true when given")

    def texts(self) -> list[str]:
        """The strings of the constraint (they cross to the engine process as UTF-8)."""
        value = getattr(self, self.kind)
        if isinstance(value, str):
            return [value]
        return list(value) if self.kind == "choice" else []
