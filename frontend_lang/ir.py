"""The expressions a program appends to its state: text, roles, gen, select, variable scopes,
the public-prefix mark (and lists of them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class Expr:
    def __add__(self, other: Any) -> ExprList:
        return ExprList([self, *_items(other)])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([*_items(other), self])


@dataclass
class ExprList(Expr):
    items: list[Any]

    def __add__(self, other: Any) -> ExprList:
        return ExprList([*self.items, *_items(other)])


@dataclass
class RoleBegin(Expr):
    role: str


@dataclass
class RoleEnd(Expr):
    role: str


@dataclass
class VarScopeBegin(Expr):
    name: str


@dataclass
class VarScopeEnd(Expr):
    name: str


@dataclass
class PublicPrefixEnd(Expr):
    """Everything before this point is the public prefix (see `frontend_lang.public_prefix_end`)."""


@dataclass
class Gen(Expr):
    name: str | None
    params: dict[str, Any] = field(default_factory=dict)  # radixserve sampling_params
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    dtype: type | None = None  # int or str: convert the generated text


@dataclass
class Select(Expr):
    name: str | None
    choices: list[str]
    temperature: float = 0.0
    choices_method: str = "token_length_normalized"


def _items(x: Any) -> list[Any]:
    return x.items if isinstance(x, ExprList) else [x]
