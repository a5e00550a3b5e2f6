"""Program execution: one event loop (on one background thread) drives every program; a
state's appends run in order as tasks on it, and fork branches run as concurrent tasks. The
user's program is ordinary synchronous code: `s += gen(...)` returns at once, reading
`s["x"]` or `s.text()` waits for what it needs."""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from frontend_lang import reasoning
from frontend_lang.backend import FrontendError, RuntimeEndpoint
from frontend_lang.global_config import global_config
from frontend_lang.ir import (
    REGEX_BOOL,
    REGEX_FLOAT,
    REGEX_INT,
    REGEX_STR,
    SAMPLING_DEFAULTS,
    ExprList,
    Gen,
    Image,
    PublicPrefixEnd,
    RoleBegin,
    RoleEnd,
    Select,
    SeparateReasoning,
    VarScopeBegin,
    VarScopeEnd,
)
from frontend_lang.loop import submit


def set_default_backend(backend: Any) -> None:
    global_config.default_backend = backend


def _backend(backend: Any) -> RuntimeEndpoint:
    """The given backend or the default; a Runtime stands for its endpoint (as in SGLang)."""
    b = backend or global_config.default_backend
    if b is None:
        raise FrontendError("no backend: call set_default_backend(RuntimeEndpoint(url)) or pass backend=")
    return b.endpoint if hasattr(b, "endpoint") else b


def get_server_info(backend: Any = None) -> dict[str, Any] | None:
    """The server's /server_info (None without a backend, as SGLang's)."""
    if backend is None and global_config.default_backend is None:
        return None
    return _backend(backend).get_server_info()


def flush_cache(backend: Any = None) -> Any:
    """Drop the server's cached prefixes (False without a backend, as SGLang's)."""
    if backend is None and global_config.default_backend is None:
        return False
    return _backend(backend).flush_cache()


class _Stream:
    """What a streaming program has appended so far, for readers on any thread or event loop:
    text chunks tagged with the variables they belong to (the gen that wrote them, and every
    open var_scope) and the gen's meta_info as of that chunk, a (variable,) end mark with no
    text once a variable is complete, then the end, with the program's error if it failed."""

    def __init__(self) -> None:
        self.events: list[tuple[tuple[str, ...], str | None, dict[str, Any] | None]] = []
        self.done = False
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def push(self, tags: tuple[str, ...], chunk: str | None, meta: dict[str, Any] | None = None) -> None:
        with self._cond:
            self.events.append((tags, chunk, meta))
            self._wake()

    def finish(self, error: BaseException | None) -> None:
        with self._cond:
            self.done, self.error = True, error
            self._wake()

    def _wake(self) -> None:
        self._cond.notify_all()
        for loop, fut in self._waiters:
            try:
                loop.call_soon_threadsafe(_wake, fut)
            except RuntimeError:  # that reader's event loop is closed: nobody to wake
                pass
        self._waiters.clear()

    def _ready(self, seen: int) -> bool:
        return len(self.events) > seen or self.done

    def wait(self, seen: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._ready(seen))

    async def wait_async(self, seen: int) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        waiter = (loop, fut)
        with self._cond:
            if self._ready(seen):
                return
            self._waiters.append(waiter)
        try:
            await fut
        finally:  # a cancelled reader leaves no waiter behind
            with self._cond:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def take(self, seen: int, var: str | None) -> tuple[list[tuple[str, dict[str, Any] | None]], int, bool]:
        """The (text, meta) chunks (of `var`, or all) after event `seen`, the new position, and
        whether the reader is done (the program ended, also by a failure: as SGLang's readers,
        they end and `error()` says why). A chunk of `var` may be empty text with meta
        (logprobs of held-back text)."""
        with self._cond:
            events, done = self.events[seen:], self.done
        chunks: list[Any] = []
        for tags, chunk, meta in events:
            seen += 1
            if chunk is None:
                if var is not None and tags == (var,):
                    return chunks, seen, True
            elif (chunk and var is None) or (var is not None and var in tags and (chunk or meta is not None)):
                chunks.append((chunk, meta))
        return chunks, seen, done


_INCREMENTAL_META = ("output_token_logprobs", "output_top_logprobs")  # streamed per chunk, not cumulative


def _merge_meta(pending: dict[str, Any] | None, meta: dict[str, Any]) -> dict[str, Any]:
    """A chunk's meta with the incremental logprobs of empty chunks before it prepended."""
    if pending is None:
        return meta
    out = dict(meta)
    for k in _INCREMENTAL_META:
        if k in meta or k in pending:
            out[k] = list(pending.get(k) or []) + list(meta.get(k) or [])
    return out


def resolve(defaults: dict[str, Any], g: Gen) -> Gen:
    """The gen with the program's run() defaults under its own arguments, and its dtype turned
    into SGLang's regex (int and float also stop at a space or newline)."""
    p = {**defaults, **g.params}
    p["stop"] = [p["stop"]] if isinstance(p["stop"], str) else list(p["stop"] or [])
    dtype = p.pop("dtype", None)
    if dtype is not None:
        if dtype in (int, "int", float, "float"):
            p["stop"] += [" ", "\n"]
        p["regex"] = {int: REGEX_INT, "int": REGEX_INT, float: REGEX_FLOAT, "float": REGEX_FLOAT, str: REGEX_STR,
                      "str": REGEX_STR, bool: REGEX_BOOL, "bool": REGEX_BOOL}[dtype]
    return Gen(g.name, p)


class MissingVariable(FrontendError, KeyError):
    """Reading a variable the program never set (a KeyError, as in SGLang)."""

    def __str__(self) -> str:
        return str(self.args[0])


class ProgramState:
    """A running program: append with `s += ...`; read with `s["name"]`, `s.text()`, ... An
    append that fails stops the program there: `s.error()` returns the failure, and reading a
    variable it never set raises it."""

    def __init__(self, backend: RuntimeEndpoint, text: str = "", variables: dict[str, Any] | None = None,
                 messages: list[dict[str, str]] | None = None, public_chars: int = 0, stream: bool = False,
                 defaults: dict[str, Any] | None = None) -> None:
        self.backend = backend
        self.defaults = dict(SAMPLING_DEFAULTS if defaults is None else defaults)
        self._text = text
        self.variables: dict[str, Any] = dict(variables or {})
        self.meta: dict[str, Any] = {}
        self._messages = list(messages or [])
        self._role: tuple[str, int] | None = None  # (role, where its content starts)
        self._scopes: dict[str, int] = {}  # open var_scope -> where it starts
        self._spans: dict[str, tuple[int, int]] = {}  # gen variable -> where its text is in the program's
        self._public = public_chars  # the public prefix's length in characters (0: none)
        self.assigned: set[str] = set()  # variables this state set itself (a fork's join gathers these)
        self._tail: Future[Any] | None = None
        self._stream = _Stream() if stream else None
        self.ret_value: Any = None  # what the program function returned

    # -- appending -----------------------------------------------------------------------------
    def __iadd__(self, expr: Any) -> ProgramState:
        if expr is None:
            raise ValueError("cannot append None to a program state")
        prev = self._tail

        async def step() -> None:
            if prev is not None:
                await asyncio.wrap_future(prev)  # a failure before this append fails it too
            try:
                await self._exec(expr)
            except Exception as e:  # the first failure: said once (as SGLang's interpreter warns), kept for error()
                warnings.warn(f"program stopped: {e}", stacklevel=1)
                raise

        self._tail = submit(step())
        return self

    async def _exec(self, e: Any) -> None:
        if isinstance(e, str):
            self._emit(e)
        elif isinstance(e, ExprList):
            for item in e.items:
                await self._exec(item)
        elif isinstance(e, RoleBegin):
            if self._role is not None:
                raise FrontendError(f"{e.role} role inside the open {self._role[0]} role: roles do not nest")
            if not self._messages and e.role != "system":  # the template's default system prompt, as SGLang's
                text, content = await self.backend.default_system()
                if text:
                    self._emit(text)
                    self._messages.append({"role": "system", "content": content})
            begin, _ = await self.backend.role(e.role)
            self._emit(begin)
            self._role = (e.role, len(self._text))
        elif isinstance(e, RoleEnd):
            _, end = await self.backend.role(e.role)
            start = self._role[1] if self._role else len(self._text)
            self._messages.append({"role": e.role, "content": self._text[start:].lstrip()})
            self._emit(end)
            self._role = None
        elif isinstance(e, Gen):
            await self._gen(resolve(self.defaults, e))
        elif isinstance(e, Select):
            choice, meta = await self.backend.select(self._text, e, f"select {e.name!r}", self._public)
            self._emit(choice, e.name)
            self._set(e.name, choice, meta)
        elif isinstance(e, VarScopeBegin):
            self._scopes[e.name] = len(self._text)
        elif isinstance(e, VarScopeEnd):
            self._set(e.name, self._text[self._scopes.pop(e.name):], None)
        elif isinstance(e, PublicPrefixEnd):
            self._public = len(self._text)
        elif isinstance(e, Image):
            raise FrontendError(f"{e.kind} {e.path!r}: radixserve serves text-only models; a program with an "
                                f"{e.kind} needs a multimodal server")
        elif isinstance(e, SeparateReasoning):
            self._separate_reasoning(e)
        else:
            raise FrontendError(f"cannot append {type(e).__name__} to a program state")

    async def _gen(self, e: Gen) -> None:
        what = f"gen {e.name!r}" if e.name else "gen"
        start = len(self._text)
        if self._stream is None:
            text, meta = await self.backend.generate(self._text, e, what, self._public)
            self._emit(text[0] if isinstance(text, list) else text)  # n > 1: the first sample goes on
        else:
            if e.params.get("n", 1) > 1:
                raise FrontendError(f"{what}: n > 1 samples cannot be streamed")
            prompt, text, meta = self._text, "", {}
            async for delta, latest in self.backend.generate_stream(prompt, e, what, self._public):
                text, meta = text + delta, latest
                self._emit(delta, e.name, latest)
        if e.name is not None:
            self._spans[e.name] = (start, len(self._text))
        self._set(e.name, text, meta)

    def _separate_reasoning(self, e: SeparateReasoning) -> None:
        fmt = reasoning.parser(e.model_type)
        for g in _named_gens(e.expr):
            if g.name not in self._spans:
                continue
            thinking, answer = fmt.split(self.variables[g.name])
            start, end = self._spans.pop(g.name)
            self._text = self._text[:start] + answer + self._text[end:]
            self.variables[g.name] = answer
            self._set(f"{g.name}_reasoning_content", thinking, {})

    def _emit(self, text: str, var: str | None = None, meta: dict[str, Any] | None = None) -> None:
        self._text += text
        if self._stream is not None and (text or meta is not None):
            self._stream.push(tuple(n for n in (var, *self._scopes) if n is not None), text, meta)

    def _set(self, name: str | None, value: Any, meta: Any) -> None:
        if name is not None:
            self.variables[name] = value
            self.meta[name] = meta
            self.assigned.add(name)
            if self._stream is not None:
                self._stream.push((name,), None)

    # -- reading -------------------------------------------------------------------------------
    def sync(self) -> None:
        """Wait for every append so far (a failure is kept for error(), not raised)."""
        if self._tail is not None:
            futures.wait([self._tail])  # a Ctrl-C while waiting still interrupts

    def error(self) -> BaseException | None:
        """The failure that stopped the program, or None."""
        self.sync()
        if self._tail is None:
            return None
        return futures.CancelledError("the program was cancelled") if self._tail.cancelled() else self._tail.exception()

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def get_var(self, name: str) -> Any:
        """The variable's value; a KeyError if the program never set it (a MissingVariable,
        also a FrontendError, naming the failure that stopped the program if one did)."""
        self.sync()
        if name not in self.variables:
            err = self.error()
            why = f"the program stopped at: {err}" if err is not None else \
                f"the program set: {', '.join(map(str, self.variables)) or 'none'}"
            raise MissingVariable(f"no variable {name!r}; {why}") from err
        return self.variables[name]

    def set_var(self, name: str, value: Any) -> None:
        self.sync()
        self.variables[name] = value

    __setitem__ = set_var

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self.variables

    def text(self) -> str:
        """The program's text (up to a failure, if one stopped it)."""
        self.sync()
        return self._text

    def messages(self) -> list[dict[str, str]]:
        self.sync()
        return list(self._messages)

    def get_meta_info(self, name: str) -> Any:
        """The call's meta info (None if it never ran)."""
        self.sync()
        return self.meta.get(name)

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"

    # -- streaming (a state from `run(..., stream=True)`) ----------------------------------------
    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The program's text (or variable `var_name`'s) as it is generated. Without streaming:
        the whole text (or value) once it is there."""
        if self._stream is None:
            yield self.text() if var_name is None else self[var_name]
            return
        seen, over = 0, False
        while not over:
            self._stream.wait(seen)
            chunks, seen, over = self._stream.take(seen, var_name)
            yield from (c for c, _ in chunks if c)

    async def text_async_iter(self, var_name: str | None = None, return_meta_data: bool = False) -> AsyncIterator[Any]:
        """text_iter for asyncio code: waiting never blocks the caller's event loop. With
        return_meta_data (and a var_name), it yields (text, meta_info): the gen's meta as of that
        chunk, its output_token_logprobs those of this chunk's tokens."""
        if self._stream is None:
            await asyncio.wrap_future(submit(self._drained()))
            if var_name is None:
                yield self._text
            else:
                value = self[var_name]
                yield (value, self.meta.get(var_name)) if return_meta_data else value
            return
        seen, over, pending = 0, False, None
        while not over:
            await self._stream.wait_async(seen)
            chunks, seen, over = self._stream.take(seen, var_name)
            for c, meta in chunks:
                if not (return_meta_data and var_name is not None):
                    if c:
                        yield c
                elif c:
                    yield c, _merge_meta(pending, meta or {})
                    pending = None
                elif meta is not None:
                    pending = _merge_meta(pending, meta)

    async def _drained(self) -> None:
        if self._tail is not None:
            await asyncio.wait([asyncio.wrap_future(self._tail)])  # done, failed or not

    def _end_stream(self, error: BaseException | None = None) -> None:
        """After every append so far: mark the stream finished (with the first failure)."""
        stream, prev = self._stream, self._tail
        assert stream is not None

        async def end() -> None:
            err = error
            try:
                if prev is not None and err is None:
                    await asyncio.wrap_future(prev)
            except BaseException as e:  # a cancelled step too: the readers must still see the end
                err = e
            finally:
                stream.finish(err)

        submit(end())

    def var_scope(self, name: str) -> _VarScope:
        """`with s.var_scope("x"): s += ...`: variable x is the text the block appends."""
        return _VarScope(self, name)

    # -- roles ---------------------------------------------------------------------------------
    def system(self, expr: Any = None) -> _RoleContext:
        return _RoleContext(self, "system", expr)

    def user(self, expr: Any = None) -> _RoleContext:
        return _RoleContext(self, "user", expr)

    def assistant(self, expr: Any = None) -> _RoleContext:
        return _RoleContext(self, "assistant", expr)

    # -- forks ---------------------------------------------------------------------------------
    def fork(self, size: int = 1, position_ids_offset: list[int] | None = None) -> ForkGroup:
        """`size` branches that start from this state's text and variables. (SGLang's
        position_ids_offset is accepted and has no effect: branches run at their true positions.)"""
        self.sync()
        size = int(size)
        if size < 0:
            raise ValueError(f"fork: size must not be negative, got {size}")
        branches = [ProgramState(self.backend, self._text, self.variables, self._messages, self._public,
                                 defaults=self.defaults) for _ in range(size)]
        for b in branches:  # a fork inside an open role continues it (its end closes the branch's message)
            b._role, b._scopes = self._role, dict(self._scopes)
        return ForkGroup(self, branches)

    @contextmanager
    def copy(self, position_ids_offset: list[int] | None = None) -> Iterator[ProgramState]:
        """`with s.copy() as c: c += ...`: a branch, joined (its variables gathered) at the end."""
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()


def _named_gens(expr: Any) -> list[Gen | Select]:
    if isinstance(expr, Gen | Select):
        return [expr] if expr.name is not None else []
    if isinstance(expr, ExprList):
        return [g for item in expr.items for g in _named_gens(item)]
    return []


class _RoleContext:
    """`with s.user(): s += ...` wraps the block in the role; `s.user(expr)` appends a whole message."""

    def __init__(self, state: ProgramState, role: str, expr: Any) -> None:
        self.state, self.role = state, role
        if expr is not None:
            state += ExprList([RoleBegin(role), expr, RoleEnd(role)])

    def __enter__(self) -> ProgramState:
        self.state += RoleBegin(self.role)
        return self.state

    def __exit__(self, *exc: object) -> None:
        self.state += RoleEnd(self.role)


class _VarScope:
    def __init__(self, state: ProgramState, name: str) -> None:
        self.state, self.name = state, name

    def __enter__(self) -> ProgramState:
        self.state += VarScopeBegin(self.name)
        return self.state

    def __exit__(self, *exc: object) -> None:
        self.state += VarScopeEnd(self.name)


class ForkGroup:
    def __init__(self, parent: ProgramState, branches: list[ProgramState]) -> None:
        self.parent = parent
        self.branches = branches
        self._start = len(parent._text)

    def __getitem__(self, i: int) -> ProgramState:
        return self.branches[i]

    def __setitem__(self, i: int, state: ProgramState) -> None:
        """`forks[i] += expr` stores the branch back: it must be the same branch."""
        if state is not self.branches[i]:
            raise TypeError("a fork's branches cannot be replaced")

    def __len__(self) -> int:
        return len(self.branches)

    def __iter__(self) -> Any:
        return iter(self.branches)

    def __iadd__(self, expr: Any) -> ForkGroup:
        """The same expression to every branch; a function of the branch index; or a list with
        one expression per branch."""
        if isinstance(expr, list | tuple):
            if len(expr) != len(self.branches):
                raise ValueError(f"fork: {len(expr)} expressions for {len(self.branches)} branches")
            for b, x in zip(self.branches, expr):
                b += x
        else:
            for i, b in enumerate(self.branches):
                b += expr(i) if callable(expr) else expr
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch. gather_variable: each variable the branches set becomes a list
        on the parent (of the branches that set it: a failed branch, whose `error()` says why,
        adds nothing, as in SGLang); concate_and_append: the branches' new text is appended to
        the parent's."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join: mode must be gather_variable or concate_and_append, got {mode!r}")
        for b in self.branches:
            b.sync()
        if mode == "gather_variable":
            self.parent.sync()
            names = {k for b in self.branches for k in b.assigned}
            for k in sorted(names, key=str):
                self.parent.variables[k] = [b.variables[k] for b in self.branches if k in b.variables]
        else:
            self.parent += "".join(b._text[self._start:] for b in self.branches)


class SglFunction:
    """`@function` (or `@function(num_api_spec_tokens=N)`): the first argument is the program state `s`."""

    def __init__(self, func: Callable[..., Any], num_api_spec_tokens: int | None = None,
                 bind_arguments: dict[str, Any] | None = None) -> None:
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__
        spec = inspect.getfullargspec(func)
        if not spec.args:
            raise TypeError(f"{self.__name__}: a program's first argument is its state (s)")
        self.arg_names = spec.args[1:]
        self.arg_defaults = spec.defaults or ()

    def bind(self, **kwargs: Any) -> SglFunction:
        """The program with some arguments fixed."""
        unknown = [k for k in kwargs if k not in self.arg_names]
        if unknown:
            raise TypeError(f"{self.__name__}.bind: no argument {', '.join(map(repr, unknown))}")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def run(self, *args: Any, max_new_tokens: int = 128, n: int = 1, stop: str | list[str] | None = None,
            stop_token_ids: list[int] | None = None, stop_regex: str | list[str] | None = None,
            temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
            frequency_penalty: float = 0.0, presence_penalty: float = 0.0, ignore_eos: bool = False,
            return_logprob: bool | None = None, logprob_start_len: int | None = None,
            top_logprobs_num: int | None = None, return_text_in_logprobs: bool | None = None, stream: bool = False,
            backend: Any = None, use_thread: bool = True, **kwargs: Any) -> ProgramState:
        """Run the program. The sampling arguments are defaults for every gen in it (a gen's own
        arguments win). With stream=True it returns at once; read the output as it comes with
        `text_iter` / `text_async_iter`."""
        defaults = _defaults(locals())
        return self._run(args, kwargs, defaults, stream, backend)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any], defaults: dict[str, Any], stream: bool,
             backend: Any) -> ProgramState:
        s = ProgramState(_backend(backend), stream=stream, defaults=defaults)
        kwargs = {**kwargs, **self.bind_arguments}
        if not stream:
            s.ret_value = self.func(s, *args, **kwargs)
            s.sync()
            if global_config.verbosity >= 2:
                print(s.text())
            return s

        def body() -> None:  # in its own thread, as SGLang's: run() returns before the body reads anything
            try:
                s.ret_value = self.func(s, *args, **kwargs)
            except BaseException as e:
                s._end_stream(e)
                return
            s._end_stream()

        threading.Thread(target=body, name=f"program-{self.__name__}", daemon=True).start()
        return s

    def run_batch(self, batch_kwargs: list[Any], *, max_new_tokens: int = 128, n: int = 1,
                  stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
                  stop_regex: str | list[str] | None = None, temperature: float = 1.0, top_p: float = 1.0,
                  top_k: int = -1, min_p: float = 0.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                  ignore_eos: bool = False, return_logprob: bool | None = None, logprob_start_len: int | None = None,
                  top_logprobs_num: int | None = None, return_text_in_logprobs: bool | None = None, backend: Any = None,
                  num_threads: int | str = "auto", progress_bar: bool = False,
                  generator_style: bool = False) -> Any:
        """Run the program once per kwargs dict (or tuple of positional arguments), concurrently;
        the states in input order (generator_style: yielded as they finish, in input order).
        First, if the programs share a traced prefix of over 64 characters, it is computed once."""
        defaults = _defaults(locals())
        if not isinstance(batch_kwargs, list | tuple):
            raise TypeError("run_batch: batch_kwargs must be a list of argument dicts")
        items = [self._as_kwargs(x) for x in batch_kwargs]
        if not items:
            return iter(()) if generator_style else []
        ep = _backend(backend)
        if global_config.enable_precache_with_tracing and len(items) > 1:
            self.cache(ep)
        threads = max(96, (os.cpu_count() or 1) * 16) if num_threads == "auto" else int(num_threads)
        threads = max(min(threads, len(items)), 1)
        if generator_style:
            return self._batch_iter(items, defaults, ep, threads, progress_bar)
        return list(self._batch_iter(items, defaults, ep, threads, progress_bar))

    def _batch_iter(self, items: list[dict[str, Any]], defaults: dict[str, Any], ep: RuntimeEndpoint, threads: int,
                    progress_bar: bool) -> Iterator[ProgramState]:
        bar = _progress(len(items)) if progress_bar else None
        try:
            with ThreadPoolExecutor(threads) as pool:
                futures = [pool.submit(self._run, (), kw, defaults, False, ep) for kw in items]
                for f in futures:
                    yield f.result()
                    if bar is not None:
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()

    def _as_kwargs(self, x: Any) -> dict[str, Any]:
        if isinstance(x, dict):
            return x
        if isinstance(x, list | tuple):
            required = len(self.arg_names) - len(self.arg_defaults)
            if not required <= len(x) <= len(self.arg_names):
                raise TypeError(f"run_batch: {len(x)} positional arguments for {self.__name__}({', '.join(self.arg_names)})")
            return dict(zip(self.arg_names, x))
        raise TypeError(f"run_batch: each item must be a dict of arguments or a tuple of them, got {type(x).__name__}")

    def trace(self, *, backend: Any = None, **kwargs: Any) -> Any:
        """Run the program without a server: what it appends, with placeholders for the
        arguments not given (SGLang's tracer). See frontend_lang.tracer."""
        from frontend_lang.tracer import trace_program  # (lazily: tracing is the rare path)

        return trace_program(self, kwargs, backend)

    def cache(self, backend: Any = None) -> None:
        """Compute the program's traced prefix now (if over 64 characters), as run_batch does."""
        from frontend_lang.tracer import extract_prefix

        ep = _backend(backend)
        prefix = extract_prefix(self, ep)
        if len(prefix) > 64:
            ep.cache_prefix(prefix)

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        """Calling the program runs it (SGLang's `prog(...)`, `prog(..., stream=True)`)."""
        return self.run(*args, **kwargs)


def _defaults(given: dict[str, Any]) -> dict[str, Any]:
    """run()'s sampling arguments as the program's gen defaults."""
    d = {k: given.get(k, v) for k, v in SAMPLING_DEFAULTS.items()}
    for k in ("stop", "stop_token_ids", "stop_regex"):
        d[k] = [] if d[k] is None else d[k]
    return d


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total)


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None) -> Any:
    """`@function` or `@function(num_api_spec_tokens=N)`. (SGLang's API speculation saves calls to
    chat APIs that cannot continue a partial answer; a radixserve endpoint continues the
    program's text with its cache, so N is kept on the program and does not change how it runs.)"""
    if func is not None:
        return SglFunction(func, num_api_spec_tokens)
    return lambda f: SglFunction(f, num_api_spec_tokens)


__all__ = ["ForkGroup", "ProgramState", "SglFunction", "flush_cache", "function", "get_server_info", "set_default_backend"]


def _wake(fut: Any) -> None:
    """Resolve a waiter's future (on its loop) unless it already is."""
    if not fut.done():
        fut.set_result(None)
