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
        c = self._compiler
        try:
            if spec.kind == "json_schema":
                compiled = c.compile_grammar(json_schema_ebnf(spec))
            elif spec.kind == "regex":
                compiled = c.compile_regex(spec.source)
            elif spec.kind == "ebnf":
                compiled = c.compile_grammar(spec.source)
            elif spec.kind == "structural_tag":
                compiled = _structural_tag(c, json.loads(spec.source))
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
    return str(grammar).replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)


def _structural_tag(compiler: Any, tag: dict[str, Any]) -> Any:
    """SGLang's / OpenAI's shape ({"structures": [{"begin", "schema", "end"}], "triggers": [...]})
    or xgrammar's own structural-tag object."""
    import xgrammar as xgr

    if "structures" in tag:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                 for s in tag["structures"]]
        return compiler.compile_structural_tag(items, list(tag.get("triggers", [])))
    return compiler.compile_structural_tag(tag)


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _first_line(e: Exception) -> str:
    """xgrammar's message without its C++ log prefix ("[12:00:00] /path/file.cc:94: ")."""
    text = str(e).strip()
    return _LOG_PREFIX.sub("", text.splitlines()[0]) if text else type(e).__name__
