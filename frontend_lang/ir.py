"""The expressions a program appends to its state (text, roles, gen, select, variable scopes,
images, reasoning splits, the public-prefix mark, and lists of them), SGLang's sampling
defaults, and the regexes of `gen(dtype=...)` (SGLang's constants, under SGLang's names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""  # a JSON string of word characters and spaces

# What `run(...)` gives every gen that does not say otherwise (SGLang's SglFunction.run defaults).
SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128, "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [],
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "ignore_eos": False, "return_logprob": None, "logprob_start_len": None, "top_logprobs_num": None,
    "return_text_in_logprobs": None,
}
GEN_KEYS = (*SAMPLING_DEFAULTS, "dtype", "regex", "json_schema")


class Expr:
    def __add__(self, other: Any) -> ExprList:
        return ExprList([*_items(self), *_items(other)])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([*_items(other), *_items(self)])


@dataclass
class ExprList(Expr):
    items: list[Any]


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
    """`params`: what this gen set (SGLang's names, GEN_KEYS); the program's run() defaults fill
    the rest when it executes."""

    name: str | None
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class Select(Expr):
    name: str | None
    choices: list[str]
    temperature: float = 0.0
    choices_method: Any = "token_length_normalized"  # a ChoicesSamplingMethod, or its name


@dataclass
class Image(Expr):
    path: Any
    kind: str = "image"  # or "video"


@dataclass
class SeparateReasoning(Expr):
    """After `expr` ran: split each of its named gens' text into reasoning (`<name>_reasoning_content`)
    and the answer (`<name>`)."""

    model_type: str | None
    expr: Any


@dataclass
class Argument(Expr):
    """A program argument while the program is traced (its value unknown)."""

    name: str

    def __str__(self) -> str:
        raise TypeError(f"argument {self.name!r} has no value while the program is traced")

    def __format__(self, spec: str) -> str:  # an f-string stops the trace too
        return str(self)


def _items(x: Any) -> list[Any]:
    return x.items if isinstance(x, ExprList) else [x]
