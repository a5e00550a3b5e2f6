"""Program execution: one event loop (on one background thread) drives every program; a
state's appends run in order as tasks on it, and fork branches run as concurrent tasks. The
user's program is ordinary synchronous code: `s += gen(...)` returns at once, reading
`s["x"]` or `s.text()` waits for what it needs."""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from frontend_lang.backend import FrontendError, RuntimeEndpoint
from frontend_lang.ir import ExprList, Gen, PublicPrefixEnd, RoleBegin, RoleEnd, Select, VarScopeBegin, VarScopeEnd

_DEFAULT: dict[str, Any] = {"backend": None}
_LOOP: dict[str, Any] = {}
_LOCK = threading.Lock()


def _loop() -> asyncio.AbstractEventLoop:
    with _LOCK:
        if "loop" not in _LOOP:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="frontend-lang", daemon=True).start()
            _LOOP["loop"] = loop
            atexit.register(_close_sessions)
        return _LOOP["loop"]


def _close_sessions() -> None:
    from frontend_lang.backend import _OPEN

    for ep in list(_OPEN):
        try:
            _submit(ep.close()).result(2)
        except Exception:
            pass


def _submit(coro: Coroutine[Any, Any, Any]) -> Future[Any]:
    return asyncio.run_coroutine_threadsafe(coro, _loop())


def set_default_backend(backend: RuntimeEndpoint) -> None:
    _DEFAULT["backend"] = backend


def _backend(backend: RuntimeEndpoint | None) -> RuntimeEndpoint:
    b = backend or _DEFAULT["backend"]
    if b is None:
        raise FrontendError("no backend: call set_default_backend(RuntimeEndpoint(url)) or pass backend=")
    return b


def get_server_info(backend: RuntimeEndpoint | None = None) -> dict[str, Any]:
    return _submit(_backend(backend).server_info()).result()


def flush_cache(backend: RuntimeEndpoint | None = None) -> Any:
    return _submit(_backend(backend).request("POST", "/flush_cache", "flush_cache", {})).result()


class _Stream:
    """What a streaming program has appended so far, for readers on any thread or event loop:
    text chunks tagged with the variables they belong to (the gen that wrote them, and every
    open var_scope), a (variable,) end mark with no text once a variable is complete, then
    the end, with the program's error if it failed."""

    def __init__(self) -> None:
        self.events: list[tuple[tuple[str, ...], str | None]] = []
        self.done = False
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def push(self, tags: tuple[str, ...], chunk: str | None) -> None:
        with self._cond:
            self.events.append((tags, chunk))
            self._wake()

    def finish(self, error: BaseException | None) -> None:
        with self._cond:
            self.done, self.error = True, error
            self._wake()

    def _wake(self) -> None:
        self._cond.notify_all()
        for loop, fut in self._waiters:
            try:
                loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(None))
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

    def take(self, seen: int, var: str | None) -> tuple[list[str], int, bool]:
        """The text chunks (of `var`, or all) after event `seen`, the new position, and whether
        the reader is done; the program's error is raised once everything before it was read."""
        with self._cond:
            events, done, error = self.events[seen:], self.done, self.error
        chunks = []
        for tags, chunk in events:
            seen += 1
            if chunk is None:
                if var is not None and tags == (var,):
                    return chunks, seen, True
            elif chunk and (var is None or var in tags):
                chunks.append(chunk)
        if done and error is not None:
            if chunks:
                return chunks, seen, False  # hand these out first; the error comes on the next read
            raise error
        return chunks, seen, done


class ProgramState:
    def __init__(self, backend: RuntimeEndpoint, text: str = "", variables: dict[str, Any] | None = None,
                 messages: list[dict[str, str]] | None = None, public_chars: int = 0, stream: bool = False) -> None:
        self.backend = backend
        self._text = text
        self.variables: dict[str, Any] = dict(variables or {})
        self.meta: dict[str, Any] = {}
        self._messages = list(messages or [])
        self._role: tuple[str, int] | None = None  # (role, where its content starts)
        self._scopes: dict[str, int] = {}  # open var_scope -> where it starts
        self._public = public_chars  # the public prefix's length in characters (0: none)
        self.assigned: set[str] = set()  # variables this state set itself (a fork's join gathers these)
        self._tail: Future[Any] | None = None
        self._stream = _Stream() if stream else None

    # -- appending -----------------------------------------------------------------------------
    def __iadd__(self, expr: Any) -> ProgramState:
        prev = self._tail

        async def step() -> None:
            if prev is not None:
                await asyncio.wrap_future(prev)
            await self._exec(expr)

        self._tail = _submit(step())
        return self

    async def _exec(self, e: Any) -> None:
        if isinstance(e, str):
            self._emit(e)
        elif isinstance(e, ExprList):
            for item in e.items:
                await self._exec(item)
        elif isinstance(e, RoleBegin):
            begin, _ = await self.backend.role(e.role)
            self._emit(begin)
            self._role = (e.role, len(self._text))
        elif isinstance(e, RoleEnd):
            _, end = await self.backend.role(e.role)
            start = self._role[1] if self._role else len(self._text)
            self._messages.append({"role": e.role, "content": self._text[start:]})
            self._emit(end)
            self._role = None
        elif isinstance(e, Gen):
            await self._gen(e)
        elif isinstance(e, Select):
            choice, meta = await self.backend.select(self._text, e, f"select {e.name!r}", self._public)
            self._emit(choice, e.name)
            self._set(e.name, choice, meta)
        elif isinstance(e, VarScopeBegin):
            self._scopes[e.name] = len(self._text)
        elif isinstance(e, VarScopeEnd):
            self._set(e.name, self._text[self._scopes.pop(e.name):], {})
        elif isinstance(e, PublicPrefixEnd):
            self._public = len(self._text)
        else:
            raise FrontendError(f"cannot append {type(e).__name__} to a program state")

    async def _gen(self, e: Gen) -> None:
        what = f"gen {e.name!r}" if e.name else "gen"
        if self._stream is None:
            text, meta = await self.backend.generate(self._text, e, what, self._public)
            self._emit(text)
        else:
            prompt, text, meta = self._text, "", {}
            async for delta, latest in self.backend.generate_stream(prompt, e, what, self._public):
                text, meta = text + delta, latest
                self._emit(delta, e.name)
        if e.dtype is int:
            try:
                value: Any = int(text)
            except ValueError:
                raise FrontendError(f"{what}: dtype=int but the model wrote {text!r}") from None
        else:
            value = text
        self._set(e.name, value, meta)

    def _emit(self, text: str, var: str | None = None) -> None:
        self._text += text
        if self._stream is not None and text:
            self._stream.push(tuple(n for n in (var, *self._scopes) if n is not None), text)

    def _set(self, name: str | None, value: Any, meta: dict[str, Any]) -> None:
        if name is not None:
            self.variables[name] = value
            self.meta[name] = meta
            self.assigned.add(name)
            if self._stream is not None:
                self._stream.push((name,), None)

    # -- reading -------------------------------------------------------------------------------
    def sync(self) -> None:
        """Wait for every append so far; re-raises the first failure."""
        if self._tail is not None:
            self._tail.result()

    def __getitem__(self, name: str) -> Any:
        self.sync()
        if name not in self.variables:
            raise KeyError(f"no variable {name!r}; the program set: {', '.join(self.variables) or 'none'}")
        return self.variables[name]

    def get_var(self, name: str) -> Any:
        return self[name]

    def text(self) -> str:
        self.sync()
        return self._text

    def messages(self) -> list[dict[str, str]]:
        self.sync()
        return list(self._messages)

    def get_meta_info(self, name: str) -> dict[str, Any]:
        self.sync()
        return self.meta[name]

    # -- streaming (a state from `run(..., stream=True)`) ----------------------------------------
    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The program's text (or variable `var_name`'s) as it is generated. Without streaming:
        the whole text (or value) once it is there."""
        if self._stream is None:
            yield self.text() if var_name is None else str(self[var_name])
            return
        seen, over = 0, False
        while not over:
            self._stream.wait(seen)
            chunks, seen, over = self._stream.take(seen, var_name)
            yield from chunks

    async def text_async_iter(self, var_name: str | None = None) -> AsyncIterator[str]:
        """text_iter for asyncio code: waiting never blocks the caller's event loop."""
        if self._stream is None:
            await asyncio.wrap_future(_submit(self._drained()))
            yield self._text if var_name is None else str(self[var_name])
            return
        seen, over = 0, False
        while not over:
            await self._stream.wait_async(seen)
            chunks, seen, over = self._stream.take(seen, var_name)
            for c in chunks:
                yield c

    async def _drained(self) -> None:
        if self._tail is not None:
            await asyncio.wrap_future(self._tail)

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

        _submit(end())

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
    def fork(self, n: int) -> ForkGroup:
        self.sync()
        return ForkGroup(self, [ProgramState(self.backend, self._text, self.variables, self._messages, self._public)
                                for _ in range(n)])

    def copy(self) -> ProgramState:
        return self.fork(1)[0]


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
        for i, b in enumerate(self.branches):
            b += expr(i) if callable(expr) else expr
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch (a failure names its branch). gather_variable: each variable a
        branch set becomes a list on the parent; concate_and_append: the branches' new text is
        appended to the parent's."""
        for i, b in enumerate(self.branches):
            try:
                b.sync()
            except Exception as e:
                raise FrontendError(f"fork branch {i}: {e}") from e
        if mode == "gather_variable":
            names = {k for b in self.branches for k in b.assigned}
            for k in sorted(names):
                self.parent.variables[k] = [b.variables.get(k) for b in self.branches]
        elif mode == "concate_and_append":
            self.parent += "".join(b._text[self._start:] for b in self.branches)
        else:
            raise ValueError(f"join: mode must be gather_variable or concate_and_append, got {mode!r}")


class SglFunction:
    """`@function`: the first argument is the program state `s`."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def run(self, *args: Any, backend: RuntimeEndpoint | None = None, stream: bool = False, **kwargs: Any) -> ProgramState:
        """Run the program. With stream=True it returns as soon as the program's body has
        queued its appends; read the output as it comes with `text_iter` / `text_async_iter`."""
        s = ProgramState(_backend(backend), stream=stream)
        if not stream:
            self.func(s, *args, **kwargs)
            s.sync()
            return s
        try:
            self.func(s, *args, **kwargs)
        except BaseException as e:
            s._end_stream(e)
            raise
        s._end_stream()
        return s

    def run_batch(self, batch_kwargs: list[dict[str, Any]], backend: RuntimeEndpoint | None = None,
                  num_threads: int | str = "auto", progress_bar: bool = False) -> list[ProgramState]:
        """Run the program once per kwargs dict, concurrently; results in input order."""
        n = min(len(batch_kwargs), 32) if num_threads == "auto" else int(num_threads)
        bar = _progress(len(batch_kwargs)) if progress_bar else None
        with ThreadPoolExecutor(max(n, 1)) as pool:
            futures = [pool.submit(self.run, backend=backend, **kw) for kw in batch_kwargs]
            out = []
            for f in futures:
                out.append(f.result())
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(*args, **kwargs)


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total)


def function(func: Callable[..., Any]) -> SglFunction:
    return SglFunction(func)


__all__ = ["ForkGroup", "ProgramState", "SglFunction", "flush_cache", "function", "get_server_info", "set_default_backend"]
