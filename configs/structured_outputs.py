"""Structured output parameters (vLLM's `StructuredOutputsParams`: names and meanings).

Exactly one constraint is set per request: a JSON schema, a regex, a choice list, an EBNF
grammar, any JSON object, or an xgrammar structural tag. Whether the schema, regex or grammar
itself is valid is checked when the engine takes the request (runner/structured_output, with
xgrammar), where a bad one is refused with an error naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ConfigDict, field_validator, model_validator
from pydantic.dataclasses import dataclass

CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""The mutually exclusive constraints, in vLLM's order."""


@dataclass(config=ConfigDict(extra="forbid"), frozen=True)
class StructuredOutputsParams:
    """What the output must match. `json` is a JSON schema (a dict, or its text); `regex` a
    regular expression the whole output matches; `choice` one of the given strings; `grammar`
    an EBNF grammar (xgrammar's dialect: GBNF, rule `root` first); `json_object=True` any JSON
    object; `structural_tag` an xgrammar structural tag as JSON text. `disable_any_whitespace`
    makes JSON output compact (no free whitespace between tokens of the JSON text).
    A pydantic dataclass, as in vLLM: a model field named `json` would shadow BaseModel.json."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False

    @field_validator("json", mode="before")
    @classmethod
    def _schema_text_or_object(cls, value: Any) -> Any:
        if isinstance(value, type) and hasattr(value, "model_json_schema"):  # a pydantic model class
            return value.model_json_schema()
        return value

    @field_validator("choice")
    @classmethod
    def _some_choices(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or any(c == "" for c in value)):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        return value

    @field_validator("regex", "grammar", "structural_tag")
    @classmethod
    def _not_empty(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputsParams":
        chosen = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(chosen) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(CONSTRAINT_FIELDS)}; "
                             f"got {', '.join(chosen) if chosen else 'none'}")
        if self.json_object is False:
            raise ValueError("json_object=False constrains nothing: leave it unset, or set it to true")
        return self

    @property
    def kind(self) -> str:
        """The constraint's field name ("json", "regex", ...)."""
        return next(name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None)

    def cache_key(self) -> tuple[str, str, bool]:
        """Equal for constraints that compile to the same grammar (a schema dict by its sorted JSON)."""
        kind = self.kind
        value = getattr(self, kind)
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        elif isinstance(value, list):
            value = json.dumps(value)
        return kind, str(value), self.disable_any_whitespace
