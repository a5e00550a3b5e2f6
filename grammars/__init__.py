"""Grammar-constrained generation: specs, backends (xgrammar, outlines-core), a compile cache.

`create_backend(name, tokenizer, vocab_size, stop_token_ids)` is the one place a backend name
becomes a class; backends import their libraries lazily.
"""

from __future__ import annotations

from typing import Any

from grammars.spec import KINDS, GrammarError, GrammarSpec

BACKENDS = ("auto", "xgrammar")

__all__ = ["BACKENDS", "KINDS", "GrammarError", "GrammarSpec", "create_backend"]


def create_backend(name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    if name in ("auto", "xgrammar"):
        from grammars.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
    raise ValueError(f"grammar_backend: {name!r} is not supported; choose from: {', '.join(BACKENDS)}")
