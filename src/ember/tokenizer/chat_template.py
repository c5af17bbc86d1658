"""Render Hugging Face chat templates (Jinja) the way `transformers` does.

Templates are code shipped with a model, so they run in Jinja's immutable sandbox. The
environment mirrors transformers': trim_blocks + lstrip_blocks, the loop-controls extension, a
`tojson` that keeps non-ASCII text and supports `indent`, and the `raise_exception` and
`strftime_now` globals. Anything that goes wrong while rendering becomes a `ValueError` with the
template's reason, which the server reports as a client error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# A model may ship several named templates; these names have a meaning to transformers.
DEFAULT_TEMPLATE_NAME = "default"
TOOL_USE_TEMPLATE_NAME = "tool_use"

# Names a message's reasoning (chain of thought) comes under, the first set one wins: the
# template sees it under the first two (gpt-oss's templates read "thinking"), as transformers
# passes it.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# The arguments that the renderer (`ChatTemplate.render`, `Tokenizer.encode_chat`) and Jinja's
# `Template.render` name themselves: extra template variables must not reuse them.
RENDER_ARGUMENTS = frozenset(
    {"self", "messages", "add_generation_prompt", "tools", "documents", "special_tokens"}
)


class NoChatTemplateError(ValueError):
    """The model has no chat template and none was given with --chat-template."""


class ChatTemplate:
    """A model's chat template (or its named set of templates), compiled on first use."""

    def __init__(self, source: str | Mapping[str, str] | Sequence[Mapping[str, str]]) -> None:
        """`source` is a template string, {name: template}, or HF's [{"name", "template"}]."""
        if isinstance(source, str):
            self._sources = {DEFAULT_TEMPLATE_NAME: source}
        elif isinstance(source, Mapping):
            self._sources = dict(source)
        else:
            self._sources = {entry["name"]: entry["template"] for entry in source}
        if not self._sources:
            raise NoChatTemplateError("the chat template list is empty")
        self._environment = _sandboxed_environment()
        self._compiled: dict[str, jinja2.Template] = {}

    @property
    def source(self) -> str:
        """The default template's text (or the only one's)."""
        return self._sources[self._pick_name(tools=None)]

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text.

        `special_tokens` (bos_token, eos_token, ...) become template variables, but only those
        that are set: an unset one stays undefined, so it renders as "" and not as "None".
        A message's reasoning reaches the template as both ``reasoning_content`` and
        ``thinking`` (`REASONING_FIELDS`). Other keyword arguments are passed to the template
        as they are.
        """
        template = self._template(self._pick_name(tools))
        variables = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        variables.update(kwargs)
        try:
            return template.render(
                messages=[_with_reasoning_aliases(message) for message in messages],
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        # A template is arbitrary code: any failure inside it is the request's or template's
        # fault, never the server's, so every exception becomes a ValueError with the reason.
        except Exception as exc:
            raise ValueError(f"chat template error: {exc}") from exc

    def _pick_name(self, tools: Sequence[Mapping[str, Any]] | None) -> str:
        # transformers' choice: "tool_use" when tools are given and it exists, else "default".
        if tools is not None and TOOL_USE_TEMPLATE_NAME in self._sources:
            return TOOL_USE_TEMPLATE_NAME
        if DEFAULT_TEMPLATE_NAME in self._sources:
            return DEFAULT_TEMPLATE_NAME
        if len(self._sources) == 1:
            return next(iter(self._sources))
        raise NoChatTemplateError(
            "the model has several chat templates and none named 'default': "
            + ", ".join(sorted(self._sources))
        )

    def _template(self, name: str) -> jinja2.Template:
        if name not in self._compiled:
            try:
                self._compiled[name] = self._environment.from_string(self._sources[name])
            except jinja2.TemplateSyntaxError as exc:
                raise ValueError(f"chat template {name!r} does not compile: {exc}") from exc
        return self._compiled[name]


def load_chat_template(value: str) -> str:
    """The template given by a --chat-template value: a file path, or the template itself.

    A `.json` file is read as HF's chat_template.json ({"chat_template": "..."}).
    """
    path = Path(value).expanduser()
    if "\n" not in value and path.is_file():
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            template = json.loads(text).get("chat_template")
            if not isinstance(template, str):
                raise ValueError(f"{path}: no 'chat_template' string")
            return template
        return text
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: neither a file nor a Jinja template")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged.

    transformers uses the tag to mark assistant text for training masks; serving only needs
    the templates that use it to compile.
    """

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _with_reasoning_aliases(message: Any) -> Any:
    """``message`` with its reasoning under both names templates read it by (a new dict)."""
    if not isinstance(message, Mapping):
        return message
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &, '), which would change prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _sandboxed_environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment
