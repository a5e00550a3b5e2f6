"""Program execution: one event loop (on one background thread) drives every program; a
state's appends run in order as tasks on it, and fork branches run as concurrent tasks. The
user's program is ordinary synchronous code: `s += gen(...)` returns at once, reading
`s["x"]` or `s.text()` waits for what it needs."""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from frontend_lang.backend import FrontendError, RuntimeEndpoint
from frontend_lang.ir import ExprList, Gen, RoleBegin, RoleEnd, Select

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


class ProgramState:
    def __init__(self, backend: RuntimeEndpoint, text: str = "", variables: dict[str, Any] | None = None,
                 messages: list[dict[str, str]] | None = None) -> None:
        self.backend = backend
        self._text = text
        self.variables: dict[str, Any] = dict(variables or {})
        self.meta: dict[str, Any] = {}
        self._messages = list(messages or [])
        self._role: tuple[str, int] | None = None  # (role, where its content starts)
        self.assigned: set[str] = set()  # variables this state set itself (a fork's join gathers these)
        self._tail: Future[Any] | None = None

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
            self._text += e
        elif isinstance(e, ExprList):
            for item in e.items:
                await self._exec(item)
        elif isinstance(e, RoleBegin):
            begin, _ = await self.backend.role(e.role)
            self._text += begin
            self._role = (e.role, len(self._text))
        elif isinstance(e, RoleEnd):
            _, end = await self.backend.role(e.role)
            start = self._role[1] if self._role else len(self._text)
            self._messages.append({"role": e.role, "content": self._text[start:]})
            self._text += end
            self._role = None
        elif isinstance(e, Gen):
            what = f"gen {e.name!r}" if e.name else "gen"
            text, meta = await self.backend.generate(self._text, e, what)
            self._text += text
            self._set(e.name, int(text) if e.dtype is int else text, meta)
        elif isinstance(e, Select):
            choice, meta = await self.backend.select(self._text, e, f"select {e.name!r}")
            self._text += choice
            self._set(e.name, choice, meta)
        else:
            raise FrontendError(f"cannot append {type(e).__name__} to a program state")

    def _set(self, name: str | None, value: Any, meta: dict[str, Any]) -> None:
        if name is not None:
            self.variables[name] = value
            self.meta[name] = meta
            self.assigned.add(name)

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
        return ForkGroup(self, [ProgramState(self.backend, self._text, self.variables, self._messages) for _ in range(n)])

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

    def run(self, *args: Any, backend: RuntimeEndpoint | None = None, **kwargs: Any) -> ProgramState:
        s = ProgramState(_backend(backend))
        self.func(s, *args, **kwargs)
        s.sync()
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
