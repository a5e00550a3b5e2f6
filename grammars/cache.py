"""Compiled grammars, cached by (backend, spec key); compiled on a thread pool with a timeout.

Failures are cached too, so a bad grammar sent again fails at once. A compile that outlives
its timeout keeps running on its pool thread (Python cannot stop it) and is cached when it
ends; the waiting request gets a GrammarError at the timeout. The pool is bounded, so
pathological grammars cannot take more than `workers` threads.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from grammars.base import Backend, Compiled
from grammars.spec import GrammarError, GrammarSpec


class CompileCache:
    def __init__(self, backend: Backend, timeout_s: float = 10.0, workers: int = 2, max_entries: int = 4096) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self.max_entries = max_entries
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="radixserve-grammar")
        self._futures: dict[tuple, Future[Compiled]] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def submit(self, spec: GrammarSpec) -> Future[Compiled]:
        key = (self.backend.name, spec.key)
        with self._lock:
            fut = self._futures.get(key)
            if fut is not None:
                self.hits += 1
                return fut
            self.misses += 1
            if len(self._futures) >= self.max_entries:
                self._futures.pop(next(iter(self._futures)))  # oldest first
            fut = self._futures[key] = self._pool.submit(self.backend.compile, spec)
            return fut

    def get(self, spec: GrammarSpec) -> Compiled:
        """Blocking: the compiled grammar, or GrammarError (including the timeout)."""
        try:
            return self.submit(spec).result(self.timeout_s)
        except FutureTimeout:
            raise self._timeout(spec) from None

    async def get_async(self, spec: GrammarSpec) -> Compiled:
        """For event loops: waits without blocking the loop."""
        try:
            # shield: a timed-out wait must not cancel the shared compile the cache holds
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self.submit(spec))), self.timeout_s)
        except TimeoutError:
            raise self._timeout(spec) from None

    def _timeout(self, spec: GrammarSpec) -> GrammarError:
        return GrammarError(f"{spec.kind}: compiling the grammar took longer than the grammar_compile_timeout of "
                            f"{self.timeout_s:g} s", spec.kind)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
