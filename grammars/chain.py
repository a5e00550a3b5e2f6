"""Backends in order of preference, with "no silent weakening": for a strict JSON schema, a
backend that would drop or loosen a keyword is skipped; if none enforces the schema, the
error names the keyword and its JSON pointer. The result is the member's own Compiled, so its
`backend` says which member compiled it, and `deserialize` hands it back to that member."""

from __future__ import annotations

from grammars.base import Backend, Compiled
from grammars.schema_check import unenforced
from grammars.spec import GrammarError, GrammarSpec


class Chain(Backend):
    def __init__(self, backends: list[Backend]) -> None:
        self.backends = backends
        self.name = "+".join(b.name for b in backends)

    def compile(self, spec: GrammarSpec) -> Compiled:
        errors: list[GrammarError] = []
        for b in self.backends:
            if spec.kind == "json_schema" and spec.strict:
                missing = unenforced(spec.schema(), b.name)
                if missing:
                    ptr, kw = missing[0]
                    errors.append(GrammarError(
                        "json_schema", f"{kw} at {ptr} cannot be enforced (backend {b.name}); "
                        "drop it, or send a non-strict schema to have it enforced only as far as possible"))
                    continue
            try:
                return b.compile(spec)
            except GrammarError as e:
                errors.append(e)
        raise errors[0]

    def deserialize(self, backend: str, data: bytes) -> Compiled:
        for b in self.backends:
            if b.name == backend:
                return b.deserialize(backend, data)
        raise GrammarError(None, f"a grammar compiled by {backend!r} cannot be loaded by the {self.name!r} backend")
