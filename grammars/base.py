"""The grammar backend contract.

- `Backend.compile(spec) -> Compiled` may be slow: callers run it on a thread pool (the
  compile cache does), never on the engine thread. It raises GrammarError for grammars it
  cannot compile or, with `spec.strict`, cannot fully enforce.
- `Compiled.matcher() -> Matcher`: cheap; one per request, owned by it.
- A Matcher tracks one output: `fill_bitmask(mask, row)` writes the allowed next tokens into
  row `row` of an int32 `(batch, ceil(vocab/32))` tensor (a set bit allows a token);
  `accept(token)` advances (False: the token was not allowed, nothing changes);
  `is_terminated()` is True once the output is complete and the stop token accepted;
  `rollback(n)` undoes the last n accepted tokens; `jump_forward()` is the text the grammar
  forces next ("" when there is a choice).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from grammars.spec import GrammarSpec


class Matcher(ABC):
    @abstractmethod
    def accept(self, token: int) -> bool: ...

    @abstractmethod
    def fill_bitmask(self, mask: torch.Tensor, row: int) -> None: ...

    @abstractmethod
    def is_terminated(self) -> bool: ...

    @abstractmethod
    def rollback(self, n: int) -> None: ...

    @abstractmethod
    def jump_forward(self) -> str: ...


class Compiled(ABC):
    @abstractmethod
    def matcher(self) -> Matcher: ...


class Backend(ABC):
    name: str

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Compiled: ...


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
