"""Grammar-constrained generation: specs, backends (xgrammar, outlines-core), a compile cache.

`create_backend(name, tokenizer, vocab_size, stop_token_ids)` is the one place a backend name
becomes a class; backends import their libraries lazily.
"""

from __future__ import annotations

from typing import Any

from grammars.spec import KINDS, GrammarError, GrammarSpec

BACKENDS = ("auto", "xgrammar", "outlines")

__all__ = ["BACKENDS", "KINDS", "GrammarError", "GrammarSpec", "create_backend"]


def create_backend(name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """auto: xgrammar, falling back to outlines-core for what xgrammar cannot compile or
    enforce. Every choice checks strict JSON schemas against what the backend enforces."""
    from grammars.chain import Chain

    names = {"auto": ["xgrammar", "outlines"], "xgrammar": ["xgrammar"], "outlines": ["outlines"]}.get(name)
    if names is None:
        raise ValueError(f"grammar_backend: {name!r} is not supported; choose from: {', '.join(BACKENDS)}")
    return Chain([_one(n, tokenizer, vocab_size, stop_token_ids) for n in names])


def _one(name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    if name == "xgrammar":
        from grammars.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
    from grammars.outlines_backend import OutlinesBackend

    return OutlinesBackend(tokenizer, vocab_size, stop_token_ids)
