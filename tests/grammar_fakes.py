"""Grammar backends for tests, importable by compile workers (the cache takes a picklable
factory: `functools.partial(fake, log)` here, built in each worker and in the parent).

The fake compiles any spec; its source picks a behaviour: "bad" refuses it, "raise" raises
a non-GrammarError, "sleep:S" takes S seconds, "spin..." burns CPU forever, "grow..."
allocates memory without end, "exit" / "kill" / "segv" end the worker process, "big:N"
compiles to N MiB. Every compile appends its source to `log`, so a test counts compiles
across processes.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from grammars import GrammarError, GrammarSpec
from grammars.base import Backend, BackendFactory, Compiled, Matcher, check_backend


class FakeCompiled(Compiled):
    backend = "fake"

    def __init__(self, source: str, pid: int) -> None:
        self.source, self.pid = source, pid  # pid: the worker that compiled it

    def matcher(self) -> Matcher:
        raise NotImplementedError("a fake grammar has no matcher")

    def serialize(self) -> bytes:
        pad = int(self.source.split(":")[1]) << 20 if self.source.startswith("big:") else 0  # "big:N": N MiB more
        return f"{self.pid}:{self.source}".encode() + b" " * pad


class FakeBackend(Backend):
    name = "fake"

    def __init__(self, log: str | None = None) -> None:
        self.log = log

    def compile(self, spec: GrammarSpec) -> Compiled:
        if self.log:
            with open(self.log, "a") as f:
                f.write(spec.source + "\n")
        src = spec.source
        if src == "bad":
            raise GrammarError("regex: bad on purpose", "regex")
        if src == "raise":
            raise MemoryError("injected compile fault")
        if src.startswith("sleep:"):
            time.sleep(float(src.split(":")[1]))
        elif src.startswith("spin"):
            while True:
                pass
        elif src.startswith("grow"):
            hoard = []
            while True:
                hoard.append(b"x" * (8 << 20))  # 8 MiB at a time, written (so resident)
        elif src == "exit":
            os._exit(3)
        elif src == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif src == "segv":
            ctypes.string_at(0)
        return FakeCompiled(src, os.getpid())

    def deserialize(self, backend: str, data: bytes) -> Compiled:
        check_backend(self.name, backend)
        pid, _, source = data.decode().rstrip(" ").partition(":")
        return FakeCompiled(source, int(pid))


def fake(log: str | None = None) -> Backend:
    return FakeBackend(log)


def compiles(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


class Poisoned(Backend):
    """A real backend whose compile raises MemoryError for sources containing "poison"."""

    def __init__(self, inner: Backend) -> None:
        self.inner, self.name = inner, inner.name

    def compile(self, spec: GrammarSpec) -> Compiled:
        if "poison" in spec.source:
            raise MemoryError("injected compile fault")  # not a GrammarError: any exception
        return self.inner.compile(spec)

    def deserialize(self, backend: str, data: bytes) -> Compiled:
        return self.inner.deserialize(backend, data)


def poisoned(factory: BackendFactory) -> Any:
    return Poisoned(factory())


@contextmanager
def fake_cache(log: Path, **kw: Any) -> Iterator[Any]:
    """A CompileCache of fake backends that log each compile to `log`; shut down on exit."""
    from grammars.cache import CompileCache

    cache = CompileCache(functools.partial(fake, str(log)), **kw)
    try:
        yield cache
    finally:
        cache.shutdown()
