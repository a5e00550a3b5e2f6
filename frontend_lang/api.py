"""The public primitives (SGLang's signatures): gen, gen_int, gen_string, select, the roles,
image/video, separate_reasoning, and radixserve's public-prefix mark."""

from __future__ import annotations

import json
import re
from typing import Any

from frontend_lang import choices as _choices
from frontend_lang.ir import ExprList, Gen, Image, PublicPrefixEnd, RoleBegin, RoleEnd, Select, SeparateReasoning

DTYPES = (int, float, str, bool, "int", "float", "str", "bool")


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None, n: int | None = None,
        stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
        stop_regex: str | list[str] | None = None, temperature: float | None = None, top_p: float | None = None,
        top_k: int | None = None, min_p: float | None = None, frequency_penalty: float | None = None,
        presence_penalty: float | None = None, ignore_eos: bool | None = None, return_logprob: bool | None = None,
        logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None, dtype: type | str | None = None, choices: list[str] | None = None,
        choices_method: Any = None, regex: str | None = None, json_schema: Any = None) -> Gen | Select:
    """Generate into variable `name`. Arguments left None take the program's run() defaults.
    `choices` makes it a select; `dtype` (int, float, str, bool) constrains the text to SGLang's
    REGEX_INT/FLOAT/STR/BOOL (the variable is still the generated text)."""
    if choices:
        return select(name, choices, 0.0 if temperature is None else temperature,
                      _choices.token_length_normalized if choices_method is None else choices_method)
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as e:  # re.error, as SGLang's gen raises, naming the gen
            raise re.error(f"gen {name!r}: regex {regex!r} is not a valid regular expression: {e.msg}", e.pattern,
                           e.pos) from None
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"gen {name!r}: dtype must be int, float, str or bool, got {dtype!r}")
    if json_schema is not None and not isinstance(json_schema, str):
        json_schema = json.dumps(json_schema)
    given = dict(max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids,
                 stop_regex=stop_regex, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                 frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
                 return_logprob=return_logprob, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                 return_text_in_logprobs=return_text_in_logprobs, dtype=dtype, regex=regex, json_schema=json_schema)
    return Gen(name, {k: v for k, v in given.items() if v is not None})


def _typed(dtype: type, name: str | None, kwargs: dict[str, Any]) -> Gen | Select:
    for bad in ("min_tokens", "dtype", "choices", "choices_method", "regex", "json_schema"):
        if bad in kwargs:
            raise TypeError(f"gen_{dtype.__name__}() got an unexpected keyword argument {bad!r}")
    return gen(name, dtype=dtype, **kwargs)


def gen_int(name: str | None = None, **kwargs: Any) -> Gen | Select:
    """An integer's text (SGLang's REGEX_INT; it stops at a space or newline)."""
    return _typed(int, name, kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Gen | Select:
    """A JSON string, quotes included (SGLang's REGEX_STR: word characters and spaces)."""
    return _typed(str, name, kwargs)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: Any = _choices.token_length_normalized) -> Select:
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"select {name!r}: choices must be a non-empty list of strings")
    if temperature > 1e-5:
        raise ValueError(f"select {name!r}: temperature must be 0: a select picks the best-scoring choice (as SGLang's)")
    try:
        method = _choices.method(choices_method)
    except ValueError as e:
        raise ValueError(f"select {name!r}: {e}") from None
    return Select(name, list(choices), temperature, method)


def image(path: Any) -> Image:
    """SGLang's image input. radixserve serves text-only models: running it is a clear error."""
    return Image(path, "image")


def video(path: Any, num_frames: int) -> Image:
    """SGLang's video input. radixserve serves text-only models: running it is a clear error."""
    return Image(path, "video")


def separate_reasoning(expr: Any = None, model_type: str | None = None) -> ExprList:
    """Run `expr`, then split each named gen's text into its reasoning (variable
    `<name>_reasoning_content`) and its answer (`<name>`, and in the program's text)."""
    from frontend_lang.reasoning import parser

    parser(model_type)  # an unknown model type fails here, where the program says it
    return ExprList([expr, SeparateReasoning(model_type, expr)])


def public_prefix_end() -> PublicPrefixEnd:
    """Mark the program's text so far as the public prefix: tenants that opt in (their key allows
    the public prefix) share its KV cache; what follows stays in the caller's own namespace. Not
    an SGLang primitive: radixserve's tenant namespaces have no SGLang counterpart."""
    return PublicPrefixEnd()


def _role(role: str, expr: Any) -> ExprList:
    """A whole message: `s += sgl.user("Hi")` (`sgl.user()` alone: an empty one). For a block, use
    `with s.user(): ...`."""
    return ExprList([RoleBegin(role), RoleEnd(role)] if expr is None else [RoleBegin(role), expr, RoleEnd(role)])


def system(expr: Any = None) -> ExprList:
    return _role("system", expr)


def user(expr: Any = None) -> ExprList:
    return _role("user", expr)


def assistant(expr: Any = None) -> ExprList:
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
