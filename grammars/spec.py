"""GrammarSpec: what a request asks its output to match. Immutable and hashable: its
canonical key identifies a compiled grammar in the cache."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json_schema", "regex", "ebnf", "choice", "structural_tag")


class GrammarError(ValueError):
    """A grammar that cannot be compiled or enforced; the message names the problem (and the
    schema keyword and its JSON pointer where there is one)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    kind: str
    source: str  # json_schema: the schema as JSON text; choice: a JSON list of strings
    strict: bool = True  # reject schema keywords the backend cannot enforce
    max_whitespace: int | None = 2  # JSON: at most this many whitespace chars in a row (None: unbounded)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"grammar kind {self.kind!r} is not one of {', '.join(KINDS)}")

    @classmethod
    def json_schema(cls, schema: str | dict[str, Any], strict: bool = True) -> GrammarSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"json_schema: not valid JSON: {e}", "json_schema") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("json_schema: a JSON schema must be an object or a boolean", "json_schema")
        # Key order is kept: it is the order the output's keys are generated in.
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), strict)

    @classmethod
    def structural_tag(cls, tag: str | dict[str, Any]) -> GrammarSpec:
        if isinstance(tag, str):
            try:
                tag = json.loads(tag)
            except json.JSONDecodeError as e:
                raise GrammarError(f"structural_tag: not valid JSON: {e}", "structural_tag") from None
        if not isinstance(tag, dict):
            raise GrammarError("structural_tag: expected a JSON object", "structural_tag")
        for i, s in enumerate(tag.get("structures", [])):
            if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
                raise GrammarError(f"structural_tag.structures[{i}]: needs string begin and end", "structural_tag")
        return cls("structural_tag", json.dumps(tag, separators=(",", ":")))

    @classmethod
    def choice(cls, options: list[str]) -> GrammarSpec:
        if not options or not all(isinstance(o, str) and o for o in options):
            raise GrammarError("choices: need a non-empty list of non-empty strings", "choices")
        return cls("choice", json.dumps(list(options)))

    @property
    def key(self) -> tuple[str, str, bool, int | None]:
        return (self.kind, self.source, self.strict, self.max_whitespace)

    def schema(self) -> Any:
        return json.loads(self.source)
