"""The grammar backend contract.

- `Backend.compile(spec) -> Compiled` may be slow, use unbounded memory, or crash: it runs only
  in a compile worker process (grammars.pool), never in the serving process. It raises
  GrammarError for grammars it cannot compile or, with `spec.strict`, cannot fully enforce.
- `Compiled.backend` names the backend that built it (a Chain returns its member's result, so
  this says which member compiled it); `Compiled.serialize() -> bytes` turns it into bytes
  that `Backend.deserialize(compiled.backend, data)` of an equal backend (same tokenizer,
  vocabulary size and stop tokens) turns back into a Compiled enforcing the same grammar.
  The serving process deserializes what a worker compiled: the bytes are data (JSON, an
  index), never a pickle, so a worker compromised by a hostile grammar cannot run code there.
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
from collections.abc import Callable

import torch

from grammars.spec import GrammarError, GrammarSpec


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
    backend: str  # the name of the backend that compiled it

    @abstractmethod
    def matcher(self) -> Matcher: ...

    @abstractmethod
    def serialize(self) -> bytes: ...


class Backend(ABC):
    name: str

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Compiled: ...

    @abstractmethod
    def deserialize(self, backend: str, data: bytes) -> Compiled:
        """What `compile` returned, from its `serialize()`; `backend` is its `Compiled.backend`.
        Raises GrammarError for a backend name it does not own or bytes it cannot read."""


BackendFactory = Callable[[], Backend]  # picklable (a module-level function or a functools.partial of one)


def check_backend(owner: str, backend: str) -> None:
    if backend != owner:
        raise GrammarError(None, f"a grammar compiled by {backend!r} cannot be loaded by the {owner!r} backend")


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
