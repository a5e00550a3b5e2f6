"""xgrammar: JSON schema, regex, EBNF, choice."""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from grammars.base import Backend, Compiled, Matcher, check_backend
from grammars.spec import GrammarError, GrammarSpec


class XGrammarMatcher(Matcher):
    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(token))

    def fill_bitmask(self, mask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(mask, row)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def rollback(self, n: int) -> None:
        self._m.rollback(n)

    def jump_forward(self) -> str:
        return self._m.find_jump_forward_string()


class XGrammarCompiled(Compiled):
    backend = "xgrammar"

    def __init__(self, compiled: Any) -> None:
        self._c = compiled

    def serialize(self) -> bytes:
        return self._c.serialize_json().encode()

    def matcher(self) -> Matcher:
        import xgrammar as xgr

        return XGrammarMatcher(xgr.GrammarMatcher(self._c))


class XGrammarBackend(Backend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=2, cache_enabled=False)

    def deserialize(self, backend: str, data: bytes) -> Compiled:
        import xgrammar as xgr

        check_backend(self.name, backend)
        try:  # checks the tokenizer too: a grammar compiled for another vocabulary is refused
            return XGrammarCompiled(xgr.CompiledGrammar.deserialize_json(data.decode(), self._info))
        except Exception as e:
            raise GrammarError(None, f"the compiled xgrammar grammar could not be loaded: {_first_line(e)}") from None

    def compile(self, spec: GrammarSpec) -> Compiled:
        import xgrammar as xgr

        c = self._compiler
        try:
            if spec.kind == "json_schema":
                compiled = c.compile_grammar(json_schema_ebnf(spec))
            elif spec.kind == "regex":
                compiled = c.compile_grammar(strict_utf8(str(xgr.Grammar.from_regex(spec.source))))
            elif spec.kind == "ebnf":
                compiled = c.compile_grammar(strict_utf8(str(xgr.Grammar.from_ebnf(spec.source))))
            elif spec.kind == "structural_tag":
                compiled = c.compile_grammar(strict_utf8(str(_structural_tag(c, json.loads(spec.source)))))
            elif spec.kind == "choice":
                options = json.loads(spec.source)
                compiled = c.compile_grammar("root ::= " + " | ".join(json.dumps(o) for o in options))
            else:
                raise GrammarError(spec.kind, "not supported by the xgrammar backend yet")
        except GrammarError:
            raise
        except Exception as e:  # xgrammar reports bad grammars as RuntimeError / ValueError
            raise GrammarError(spec.kind, f"could not compile: {_first_line(e)}") from None
        return XGrammarCompiled(compiled)


# xgrammar 0.2.9 writes length-bounded strings (minLength / maxLength) with this character
# class, which lets raw control characters into a JSON string: invalid JSON. We tighten it to
# the class its unbounded strings use.
_LOOSE_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\]'


def json_schema_ebnf(spec: GrammarSpec) -> str:
    """The schema as xgrammar EBNF, with JSON strings that are always valid JSON."""
    import xgrammar as xgr

    ws = spec.max_whitespace
    grammar = xgr.Grammar.from_json_schema(spec.source, any_whitespace=ws is None or ws > 0,
                                           max_whitespace_cnt=ws if ws else None, strict_mode=True)
    return strict_utf8(str(grammar).replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def _structural_tag(compiler: Any, tag: dict[str, Any]) -> Any:
    """SGLang's / OpenAI's shape ({"structures": [{"begin", "schema", "end"}], "triggers": [...]})
    or xgrammar's own structural-tag object, as a grammar. The latter's token triggers resolve
    only against a vocabulary, so it goes through the compiler."""
    import xgrammar as xgr

    if "structures" in tag:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                 for s in tag["structures"]]
        return xgr.Grammar.from_structural_tag(items, list(tag.get("triggers", [])))
    return compiler.compile_structural_tag(tag).grammar


# xgrammar 0.2.9 matches a character class as UTF-8 over code points 0-0x10FFFF, surrogates
# included: a negated class such as a JSON string's lets the model write ED A0 80 (U+D800),
# which no UTF-8 decoder accepts: the text shows three U+FFFD and breaks a maxLength. Every
# class of the printed grammar is rewritten to leave the surrogates out.
_SURROGATES = (0xD800, 0xDFFF)
_CLASS_ATOM = re.compile(r"\\u[0-9a-fA-F]{4}|\\U[0-9a-fA-F]{8}|\\x[0-9a-fA-F]{2}|\\.|.", re.S)
_NAMED_ESCAPES = {"0": 0, "a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, "e": 27}


def strict_utf8(ebnf: str) -> str:
    """The grammar (as xgrammar prints it) with no character class matching a surrogate."""
    out, i, n = [], 0, len(ebnf)
    while i < n:
        ch = ebnf[i]
        if ch == '"':  # a string literal: copied as it is
            j = i + 1
            while j < n and ebnf[j] != '"':
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i : j + 1])
            i = j + 1
        elif ch == "[":
            j = i + 1
            while j < n and ebnf[j] != "]":
                j += 2 if ebnf[j] == "\\" else 1
            out.append(_class_without_surrogates(ebnf[i + 1 : j]))
            i = j + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _class_without_surrogates(body: str) -> str:
    if body.startswith("^"):
        return f"[{body}\\uD800-\\uDFFF]"
    atoms = _CLASS_ATOM.findall(body)
    parts, k = [], 0
    while k < len(atoms):
        if k + 2 < len(atoms) and atoms[k + 1] == "-":
            lo, hi = _code_point(atoms[k]), _code_point(atoms[k + 2])
            if lo <= _SURROGATES[1] and hi >= _SURROGATES[0]:
                kept = [(lo, _SURROGATES[0] - 1), (_SURROGATES[1] + 1, hi)]
                parts += [f"{_escaped(a)}-{_escaped(b)}" for a, b in kept if a <= b]
            else:
                parts.append("".join(atoms[k : k + 3]))
            k += 3
        else:
            parts.append(atoms[k] if not _SURROGATES[0] <= _code_point(atoms[k]) <= _SURROGATES[1] else "")
            k += 1
    return "[" + "".join(parts) + "]"


def _code_point(atom: str) -> int:
    if len(atom) == 1:
        return ord(atom)
    if atom[1] in "uUx" and len(atom) > 2:
        return int(atom[2:], 16)
    return _NAMED_ESCAPES.get(atom[1], ord(atom[1]))


def _escaped(cp: int) -> str:
    return f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}"


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _first_line(e: Exception) -> str:
    """xgrammar's message without its C++ log prefix ("[12:00:00] /path/file.cc:94: ")."""
    text = str(e).strip()
    return _LOG_PREFIX.sub("", text.splitlines()[0]) if text else type(e).__name__
