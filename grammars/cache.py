"""Compiled grammars, cached by (backend, spec key); compiled on a thread pool with a timeout.

The timeout counts from the moment a compile starts, not from when it was queued, so slow
grammars ahead in the queue do not time out the ones behind them; a compile that cannot
even start within the timeout fails with its own message. Failures are cached too, so a bad
grammar sent again fails at once. A compile that outlives its timeout keeps running on its
pool thread (Python cannot stop it) and is cached when it ends. The pool is bounded, so
pathological grammars cannot take more than `workers` threads.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from grammars.base import Backend, Compiled
from grammars.spec import GrammarError, GrammarSpec


@dataclass
class _Entry:
    result: Future[Compiled] = field(default_factory=Future)
    started: Future[float] = field(default_factory=Future)  # resolves to the monotonic start time


class CompileCache:
    def __init__(self, backend: Backend, timeout_s: float = 10.0, workers: int = 4, max_entries: int = 4096) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self.max_entries = max_entries
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="radixserve-grammar")
        self._entries: dict[tuple, _Entry] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def submit(self, spec: GrammarSpec) -> _Entry:
        key = (self.backend.name, spec.key)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self.hits += 1
                return entry
            self.misses += 1
            if len(self._entries) >= self.max_entries:
                self._entries.pop(next(iter(self._entries)))  # oldest first
            entry = self._entries[key] = _Entry()
        self._pool.submit(self._compile, spec, entry)
        return entry

    def _compile(self, spec: GrammarSpec, entry: _Entry) -> None:
        entry.started.set_result(time.monotonic())
        try:
            entry.result.set_result(self.backend.compile(spec))
        except BaseException as e:  # cached: the same grammar fails at once next time
            entry.result.set_exception(e if isinstance(e, GrammarError) else GrammarError(f"{spec.kind}: {e!r}", spec.kind))

    def get(self, spec: GrammarSpec) -> Compiled:
        """Blocking: the compiled grammar, or GrammarError (including the timeouts)."""
        entry = self.submit(spec)
        if entry.result.done():
            return entry.result.result()
        try:
            start = entry.started.result(self.timeout_s)
        except FutureTimeout:
            raise self._busy(spec) from None
        try:
            return entry.result.result(max(start + self.timeout_s - time.monotonic(), 0.0))
        except FutureTimeout:
            raise self._timeout(spec) from None

    async def get_async(self, spec: GrammarSpec) -> Compiled:
        """For event loops: waits without blocking the loop (and never cancels the shared compile)."""
        entry = self.submit(spec)
        if entry.result.done():  # a hit: however long ago it compiled (a 0 s wait_for below would time out)
            return entry.result.result()
        try:
            start = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(entry.started)), self.timeout_s)
        except TimeoutError:
            raise self._busy(spec) from None
        remaining = max(start + self.timeout_s - time.monotonic(), 0.0)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(entry.result)), remaining)
        except TimeoutError:
            raise self._timeout(spec) from None

    def _timeout(self, spec: GrammarSpec) -> GrammarError:
        return GrammarError(f"{spec.kind}: compiling the grammar took longer than the grammar_compile_timeout of "
                            f"{self.timeout_s:g} s", spec.kind)

    def _busy(self, spec: GrammarSpec) -> GrammarError:
        return GrammarError(f"{spec.kind}: every grammar compiler is busy with slow grammars; its compile did not start "
                            f"within the grammar_compile_timeout of {self.timeout_s:g} s", spec.kind)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
