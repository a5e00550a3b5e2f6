"""Grammar-constrained generation: specs, backends (xgrammar, outlines-core), a compile cache
whose compiles run in killable worker processes (grammars.cache, grammars.pool).

`create_backend(name, tokenizer, vocab_size, stop_token_ids)` is the one place a backend name
becomes a class; backends import their libraries lazily. A `functools.partial` of it is the
picklable factory the compile cache builds its backends with.
"""

from __future__ import annotations

from typing import Any

from grammars.spec import KINDS, GrammarError, GrammarSpec

BACKENDS = ("auto", "xgrammar", "outlines")

__all__ = ["BACKENDS", "KINDS", "GrammarError", "GrammarSpec", "check_backend_name", "create_backend"]
_MEMBERS = {"auto": ["xgrammar", "outlines"], "xgrammar": ["xgrammar"], "outlines": ["outlines"]}


def check_backend_name(name: str) -> None:
    if name not in _MEMBERS:
        raise ValueError(f"grammar_backend: {name!r} is not supported; choose from: {', '.join(BACKENDS)}")


def create_backend(name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """auto: xgrammar, falling back to outlines-core for what xgrammar cannot compile or
    enforce. Every choice checks strict JSON schemas against what the backend enforces. A
    tokenizer with a `full()` (radixserve's FastTokenizer) hands over the transformers tokenizer
    behind it: the backends read its vocabulary the transformers way."""
    from grammars.chain import Chain

    check_backend_name(name)
    if callable(getattr(type(tokenizer), "full", None)):
        tokenizer = tokenizer.full()
    return Chain([_one(n, tokenizer, vocab_size, stop_token_ids) for n in _MEMBERS[name]])


def _one(name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    if name == "xgrammar":
        from grammars.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
    from grammars.outlines_backend import OutlinesBackend

    return OutlinesBackend(tokenizer, vocab_size, stop_token_ids)
