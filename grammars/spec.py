"""GrammarSpec: what a request asks its output to match. Immutable and hashable: its
canonical key identifies a compiled grammar in the cache."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json_schema", "regex", "ebnf", "choice", "structural_tag")


class GrammarError(ValueError):
    """A grammar that cannot be compiled or enforced: `field` is the request field at fault (None
    where no one field is, e.g. a compiled grammar that cannot be loaded), `message` the problem
    (with the schema keyword and its JSON pointer where there is one); str() reads
    'field: message', as radixserve's InvalidParam does."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class GrammarSpec:
    kind: str
    source: str  # json_schema: the schema as JSON text; choice: a JSON list of strings
    strict: bool = True  # reject schema keywords the backend cannot enforce
    max_whitespace: int | None = 2  # JSON: at most this many whitespace chars in a row (None: unbounded)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(None, f"grammar kind {self.kind!r} is not one of {', '.join(KINDS)}")

    @classmethod
    def json_schema(cls, schema: str | dict[str, Any], strict: bool = True) -> GrammarSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError("json_schema", f"not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("json_schema", "a JSON schema must be an object or a boolean")
        # Key order is kept: it is the order the output's keys are generated in.
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), strict)

    @classmethod
    def structural_tag(cls, tag: str | dict[str, Any]) -> GrammarSpec:
        if isinstance(tag, str):
            try:
                tag = json.loads(tag)
            except json.JSONDecodeError as e:
                raise GrammarError("structural_tag", f"not valid JSON: {e}") from None
        if not isinstance(tag, dict):
            raise GrammarError("structural_tag", "expected a JSON object")
        for i, s in enumerate(tag.get("structures", [])):
            if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
                raise GrammarError(f"structural_tag.structures[{i}]", "needs string begin and end")
        return cls("structural_tag", json.dumps(tag, separators=(",", ":")))

    @classmethod
    def choice(cls, options: list[str]) -> GrammarSpec:
        if not options or not all(isinstance(o, str) and o for o in options):
            raise GrammarError("choices", "need a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(options)))

    @property
    def key(self) -> tuple[str, str, bool, int | None]:
        return (self.kind, self.source, self.strict, self.max_whitespace)

    def schema(self) -> Any:
        return json.loads(self.source)
