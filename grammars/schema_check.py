"""What a backend really enforces of a JSON schema: "it compiled" is not "it is enforced".

`unenforced(schema, backend)` lists (JSON pointer, keyword) for every constraint the backend
would silently drop or loosen. The tables are conservative: a standard validation keyword
not known to be enforced counts as unenforced. Keywords that are not validation keywords
(title, description, vendor extensions such as x-kubernetes-*, misspellings) constrain
nothing under JSON Schema's rules, so they are fine; so is `format`, an annotation unless a
schema opts in to format assertion (backends enforce the formats they know anyway).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

VALIDATION = {"type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
              "maxLength", "minLength", "pattern", "maxItems", "minItems", "uniqueItems", "maxContains", "minContains",
              "maxProperties", "minProperties", "required", "dependentRequired", "dependencies", "properties",
              "patternProperties", "additionalProperties", "propertyNames", "items", "prefixItems", "additionalItems",
              "contains", "unevaluatedItems", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "not", "if", "then",
              "else", "dependentSchemas", "$ref", "$dynamicRef"}
_COMMON = {"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "enum", "const",
           "anyOf", "$ref", "minLength", "maxLength", "pattern", "format"}
ENFORCED = {
    "xgrammar": _COMMON | {"prefixItems", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "allOf"},
    "outlines": set(_COMMON),
}
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas", "dependencies")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")  # list-form items: draft-4 tuples
_SUBSCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems", "not",
                  "if", "then", "else", "contains", "propertyNames")


def unenforced(schema: Any, backend: str) -> list[tuple[str, str]]:
    return list(_walk(schema, backend, ""))


def _walk(s: Any, backend: str, ptr: str) -> Iterator[tuple[str, str]]:
    if isinstance(s, bool):
        if backend == "outlines":
            yield ptr or "/", "boolean schema"
        return
    if not isinstance(s, dict):
        return
    for kw in s:
        if kw not in VALIDATION or kw in ENFORCED[backend]:
            continue
        if kw == "uniqueItems" and not s[kw]:
            continue
        if kw == "oneOf" and _exclusive(s[kw]):
            continue  # branches of distinct types: at most one can match, so anyOf enforces it
        if kw in ("then", "else") and "if" in s:
            continue  # reported once, as "if"
        yield f"{ptr}/{kw}", kw
    yield from _special_cases(s, backend, ptr)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(s.get(key), dict):
            for name, sub in s[key].items():
                if isinstance(sub, (dict, bool)):  # dependencies may also map to lists of names
                    yield from _walk(sub, backend, f"{ptr}/{key}/{_escape(name)}")
    for key in _SUBSCHEMA_LISTS:
        if isinstance(s.get(key), list):
            for i, sub in enumerate(s[key]):
                yield from _walk(sub, backend, f"{ptr}/{key}/{i}")
    for key in _SUBSCHEMA_ONE:
        if isinstance(s.get(key), dict):
            yield from _walk(s[key], backend, f"{ptr}/{key}")


def _special_cases(s: dict[str, Any], backend: str, ptr: str) -> Iterator[tuple[str, str]]:
    ref = s.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        yield f"{ptr}/$ref", "$ref (not local)"
    yield from _combinators(s, ptr)
    if backend == "xgrammar":
        if "pattern" in s or "format" in s:  # xgrammar drops length limits next to a pattern or format
            yield from ((f"{ptr}/{k}", k) for k in ("minLength", "maxLength") if k in s)
        if isinstance(s.get("allOf"), list) and len(s["allOf"]) > 1:
            yield f"{ptr}/allOf", "allOf (several branches)"
        for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if isinstance(s.get(k), (int, float)) and abs(s[k]) > 2**53:
                yield f"{ptr}/{k}", f"{k} (beyond 2^53)"
    if backend == "outlines":
        if "minLength" in s or "maxLength" in s:  # outlines-core drops a pattern or format next to a length limit
            yield from ((f"{ptr}/{k}", k) for k in ("pattern", "format") if k in s)
        if not any(k in s for k in ("type", "$ref", "enum", "const", "anyOf")) and s:
            yield ptr or "/", "a sub-schema without type"
        if isinstance(s.get("maxLength"), int) and s["maxLength"] > 256:
            yield f"{ptr}/maxLength", "maxLength (over 256: the index build explodes)"


_COMBINATORS = ("anyOf", "oneOf", "allOf")
_STANDALONE = ("type", "$ref", "enum", "const")


def _combinators(s: dict[str, Any], ptr: str) -> Iterator[tuple[str, str]]:
    """Branches are compiled as alternatives of whole values: a combinator next to other
    validation keywords, or a branch that only adds constraints (`{"required": [...]}`), is
    dropped without a warning."""
    siblings = [k for k in s if k in VALIDATION and k not in _COMBINATORS]
    for kw in _COMBINATORS:
        branches = s.get(kw)
        if not isinstance(branches, list):
            continue
        partial = any(isinstance(b, dict) and not any(k in b for k in (*_STANDALONE, *_COMBINATORS)) for b in branches)
        if siblings or partial:
            yield f"{ptr}/{kw}", f"{kw} (combined with sibling keywords or partial branches)"


def _exclusive(branches: Any) -> bool:
    """oneOf branches that each name one JSON type, all different (null | string, ...)."""
    if not isinstance(branches, list):
        return False
    types = [b.get("type") if isinstance(b, dict) else None for b in branches]
    simple = all(isinstance(t, str) and t not in ("number", "integer") for t in types)
    return simple and len(set(types)) == len(types)


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
