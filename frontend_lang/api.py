"""The public primitives: gen, gen_int, gen_string, select, the roles, and the public-prefix mark."""

from __future__ import annotations

import json
from typing import Any

from frontend_lang.ir import ExprList, Gen, PublicPrefixEnd, RoleBegin, RoleEnd, Select

_SAMPLING = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "stop": "stop", "stop_token_ids": "stop_token_ids",
             "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty", "ignore_eos": "ignore_eos",
             "regex": "regex"}
METHODS = ("token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized")


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None, stop: Any = None,
        stop_token_ids: list[int] | None = None, temperature: float | None = None, top_p: float | None = None,
        top_k: int | None = None, min_p: float | None = None, frequency_penalty: float | None = None,
        presence_penalty: float | None = None, ignore_eos: bool | None = None, return_logprob: bool = False,
        logprob_start_len: int | None = None, top_logprobs_num: int | None = None, dtype: type | None = None,
        choices: list[str] | None = None, regex: str | None = None, json_schema: Any = None) -> Gen | Select:
    """Generate into variable `name` (SGLang's signature). `choices` makes it a select."""
    if choices is not None:
        return select(name, choices, temperature or 0.0)
    given = dict(max_tokens=max_tokens, min_tokens=min_tokens, stop=stop, stop_token_ids=stop_token_ids,
                 temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
                 presence_penalty=presence_penalty, ignore_eos=ignore_eos, regex=regex)
    params = {_SAMPLING[k]: v for k, v in given.items() if v is not None}
    if json_schema is not None:
        params["json_schema"] = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    if dtype is int and "regex" not in params:
        params["regex"] = r"-?(0|[1-9][0-9]{0,17})"
    if dtype not in (None, int, str):
        raise ValueError(f"gen {name!r}: dtype must be int or str, got {dtype!r}")
    return Gen(name, params, return_logprob, logprob_start_len, top_logprobs_num, dtype)


def gen_int(name: str | None = None, **kwargs: Any) -> Gen | Select:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Gen | Select:
    """A JSON-style string without quotes inside."""
    return gen(name, dtype=str, regex=kwargs.pop("regex", r'[^"\n]{0,100}'), **kwargs)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: str = "token_length_normalized") -> Select:
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"select {name!r}: choices must be a non-empty list of strings")
    if choices_method not in METHODS:
        raise ValueError(f"select {name!r}: choices_method must be one of {', '.join(METHODS)}")
    return Select(name, list(choices), temperature, choices_method)


def public_prefix_end() -> PublicPrefixEnd:
    """Mark the program's text so far as the public prefix: tenants that opt in (their key allows
    the public prefix) share its KV cache; what follows stays in the caller's own namespace. Not
    an SGLang primitive: radixserve's tenant namespaces have no SGLang counterpart."""
    return PublicPrefixEnd()


def _role(role: str, expr: Any) -> ExprList:
    """A whole message: `s += sgl.user("Hi")`. (For a block, use `with s.user(): ...`.)"""
    return ExprList([RoleBegin(role), expr, RoleEnd(role)])


def system(expr: Any) -> ExprList:
    return _role("system", expr)


def user(expr: Any) -> ExprList:
    return _role("user", expr)


def assistant(expr: Any) -> ExprList:
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")
