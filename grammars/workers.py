"""One compile worker process, seen from the parent: start, send a job, read its answer,
measure its memory, kill it.

Workers start from a forkserver (never a plain fork of the serving process, which runs
threads). The forkserver is started once per parent process, preloading torch, xgrammar and
outlines-core, so each worker after the first is a fork of an already-warm interpreter:
about 0.3 s to ready with SmolLM2's tokenizer against 2 s for a spawned interpreter (the
first forkserver start costs those 2 s once). Killed or crashed workers are reaped by the
forkserver; `kill()` returns once the worker is gone.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from grammars.base import BackendFactory
from grammars.spec import GrammarSpec
from grammars.worker import decode, serve

PRELOAD = ["grammars.worker", "grammars.chain", "grammars.xgrammar_backend", "grammars.outlines_backend", "xgrammar",
           "outlines_core"]
_PAGE = os.sysconf("SC_PAGE_SIZE")


def context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the forkserver starts (once per process)
    return ctx


_MAIN_LOCK = threading.Lock()


@contextmanager
def _without_main() -> Iterator[None]:
    """Start a worker without multiprocessing re-running the parent's main script in it (what it
    does for any spawned process, so a plain script that builds an Engine at top level would
    run again in every worker). Workers need nothing from __main__: their factory is made of
    library functions. NOTE: hides __main__.__spec__ and __file__ only while a process starts."""
    main = sys.modules["__main__"]
    with _MAIN_LOCK:
        saved: dict[str, Any] = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
        main.__dict__.pop("__file__", None)
        main.__spec__ = None
        try:
            yield
        finally:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


class Worker:
    """States: starting (started, `ready` False) -> idle (`ready`, no job) <-> busy (a job).
    The memory cap counts from `job_rss`, its resident memory when its job started; a worker
    that keeps more than the cap past `ready_rss` (its memory when it became ready) is retired."""

    def __init__(self, ctx: Any, factory: BackendFactory, memory_mb: int) -> None:
        self.conn, child_conn = ctx.Pipe()
        alive_r, self._alive = ctx.Pipe(duplex=False)  # the worker exits when this closes
        self.proc = ctx.Process(target=serve, args=(factory, child_conn, alive_r, memory_mb), name="radixserve-grammar-worker",
                                daemon=True)
        with _without_main():
            self.proc.start()
        child_conn.close()
        alive_r.close()
        self.pid: int = self.proc.pid
        self.created = time.monotonic()
        self._max_message = (memory_mb << 20) + (1 << 20)  # a compiled grammar within the cap, and its header
        self.ready = False
        self.ready_rss = 0
        self.job: Any = None  # the pool's job while busy, and the tenant it runs for
        self.tenant: Any = None
        self.job_started = 0.0
        self.job_rss = 0

    def send(self, job_id: int, spec: GrammarSpec) -> None:
        self.conn.send((job_id, spec))

    def recv(self) -> tuple[dict[str, Any], bytes]:
        """The next message; raises EOFError/OSError once the worker is gone, ValueError on garbage."""
        return decode(self.conn.recv_bytes(self._max_message))

    def rss(self) -> int:
        """Resident bytes; 0 once the process is gone."""
        try:
            with open(f"/proc/{self.pid}/statm", "rb") as f:
                return int(f.read().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            return 0

    def mark_ready(self) -> None:
        self.ready, self.ready_rss = True, self.rss()

    def exit_reason(self) -> str:
        code = self.proc.exitcode
        if code is None:
            return "it stopped answering"
        if code < 0:
            try:
                return f"killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def kill(self) -> None:
        """SIGKILL, then wait until it is reaped: its CPU and memory are free when this returns."""
        if self.proc.exitcode is None:
            self.proc.kill()
        self.proc.join(5.0)
        self.close()

    def close(self) -> None:
        for c in (self.conn, self._alive):
            c.close()
