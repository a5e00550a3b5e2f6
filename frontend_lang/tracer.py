"""Tracing: run a program's function without a server, recording what it appends, with
placeholders (`Argument`) for arguments that have no value. run_batch traces to find the
text every program of the batch starts with, and computes it once before the batch."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from frontend_lang.ir import Argument, ExprList, RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd
from frontend_lang.loop import submit


class StopTracing(Exception):
    """The traced program needs a value it cannot have (a generated variable, a fork)."""


class TracedState:
    """Stands in for the program state while tracing: `nodes` is what the program appended, in
    order (lists flattened); reading a variable, forking or an argument's value stops the trace
    when only the prefix is wanted (`prefix_only`), else reads give placeholders."""

    def __init__(self, arguments: dict[str, Any], prefix_only: bool) -> None:
        self.arguments = arguments
        self.prefix_only = prefix_only
        self.nodes: list[Any] = []
        self.variables: dict[str, Any] = {}
        self.ret_value: Any = None

    def __iadd__(self, expr: Any) -> TracedState:
        self.nodes.extend(_flatten(expr))
        if self.prefix_only and any(not isinstance(n, str | RoleBegin | RoleEnd) for n in _flatten(expr)):
            raise StopTracing
        return self

    def __getitem__(self, name: str) -> Any:
        if self.prefix_only:
            raise StopTracing
        return self.variables.get(name, Argument(name))

    get_var = __getitem__

    def set_var(self, name: str, value: Any) -> None:
        self.variables[name] = value

    __setitem__ = set_var

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> Any:
        raise StopTracing

    def _role(self, role: str, expr: Any) -> Any:
        if expr is not None:
            self += ExprList([RoleBegin(role), expr, RoleEnd(role)])
            return None
        return self._block(RoleBegin(role), RoleEnd(role))

    @contextmanager
    def _block(self, begin: Any, end: Any) -> Iterator[TracedState]:
        self += begin
        yield self
        self += end

    def system(self, expr: Any = None) -> Any:
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    def var_scope(self, name: str) -> Any:
        return self._block(VarScopeBegin(name), VarScopeEnd(name))


def _flatten(expr: Any) -> list[Any]:
    if isinstance(expr, ExprList):
        return [n for item in expr.items for n in _flatten(item)]
    return [expr]


def trace_program(program: Any, kwargs: dict[str, Any], backend: Any = None) -> TracedState:
    """The program run against a TracedState: arguments not in kwargs are placeholders."""
    args = {name: Argument(name) for name in program.arg_names if name not in kwargs}
    args.update(kwargs)
    args.update(program.bind_arguments)
    state = TracedState(args, prefix_only=False)
    state.ret_value = program.func(state, **args)
    return state


def extract_prefix(program: Any, backend: Any) -> str:
    """The text every run of the program starts with: its constant text and roles up to the
    first gen, select, argument or read. Role markers are rendered by the backend."""
    args = {name: Argument(name) for name in program.arg_names}
    args.update(program.bind_arguments)
    state = TracedState(args, prefix_only=True)
    try:
        program.func(state, **args)
    except Exception:  # noqa: BLE001  where the program first needs what tracing cannot give (StopTracing, a
        pass  # placeholder used as a value, ...): the prefix is what it appended before; tracing never fails a batch
    prefix = ""
    for node in state.nodes:
        if isinstance(node, str):
            prefix += node
        elif isinstance(node, RoleBegin | RoleEnd):
            begin, end = submit(backend.role(node.role)).result()
            prefix += begin if isinstance(node, RoleBegin) else end
        else:  # a gen, select, argument, ...: the programs differ from here
            break
    return prefix
