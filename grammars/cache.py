"""Compiled grammars, cached by (tenant, spec); compiled in killable worker processes (grammars.pool).

`CompileCache(factory, ...)`: `factory()` builds the backend, once in each worker and once
here (in the background), where it turns what a worker compiled back into a Compiled.

What is cached: a compiled grammar; a grammar the backend refused (GrammarError); a compile
that ran past the timeout or the memory cap (the same grammar would do it again: resending
a grammar bomb fails at once instead of taking a worker for another `timeout_s`). Not
cached (the next request for the grammar compiles it again): a compile that could not
start in time (busy), a worker that crashed (a crash may be the machine's, e.g. the OOM
killer, not the grammar's), a cache shut down. Cache hits never touch a worker.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from grammars import errors
from grammars.base import Backend, BackendFactory, Compiled
from grammars.errors import NotCompiled
from grammars.pool import CompilePool
from grammars.spec import GrammarError, GrammarSpec


def _helper_thread() -> None:
    """The loader's thread never starts an OpenMP team of its own (radixserve_kernels.threads)."""
    from radixserve_kernels.threads import helper_thread

    helper_thread()


class CompileCache:
    """`workers` compile processes; at most `tenant_compiles` (default: half the workers, at
    least 1) compiles of one tenant at once; each compile stopped at `timeout_s` seconds from
    its start or `memory_mb` MiB over its worker's memory at its start."""

    def __init__(self, factory: BackendFactory, timeout_s: float = 10.0, workers: int = 2, tenant_compiles: int | None = None,
                 memory_mb: int = 1024, max_entries: int = 4096, warm: bool = True) -> None:
        """warm=False: nothing starts until `warm()` or the first compile (the engine calls warm()
        once it has been idle a moment, so start-up work never competes with its first requests)."""
        self.factory = factory
        self.timeout_s = timeout_s
        self.max_entries = max_entries
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="radixserve-grammar-load", initializer=_helper_thread)
        self._backend: Future[Backend] | None = None
        per_tenant = max(1, workers // 2) if tenant_compiles is None else tenant_compiles
        self._pool = CompilePool(factory, workers=workers, tenant_compiles=per_tenant, timeout_s=timeout_s, memory_mb=memory_mb,
                                 warm=False)
        self._entries: dict[tuple, Future[Compiled]] = {}  # (tenant, spec key) -> its compiled grammar
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        if warm:
            self.warm()

    def warm(self) -> None:
        """Build this process's backend (importing xgrammar takes a while) and start a compile
        worker, both in the background; idempotent."""
        with self._lock:
            if self._backend is None:
                try:
                    self._backend = self._loader.submit(self.factory)
                except RuntimeError:  # shut down
                    return
        self._pool.warm()

    def submit(self, spec: GrammarSpec, tenant: Hashable = None) -> Future[Compiled]:
        """NOTE: entries are per tenant, like the prefix cache's namespaces: a hit on a grammar
        that another tenant compiled would tell, by its speed, that the other tenant used it."""
        key = (tenant, spec.key)
        self.warm()
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self.hits += 1
                return entry
            self.misses += 1
            if len(self._entries) >= self.max_entries:
                self._entries.pop(next(iter(self._entries)))  # oldest first
            entry = self._entries[key] = Future()
            job = self._pool.submit(spec, tenant)
        job.result.add_done_callback(lambda done: self._load_later(spec, key, entry, done))
        return entry

    def get(self, spec: GrammarSpec, tenant: Hashable = None) -> Compiled:
        """Blocking: the compiled grammar, or GrammarError (the timeouts and limits included)."""
        result = self.submit(spec, tenant)
        try:
            return result.result(self.max_wait_s)
        except FutureTimeout:
            raise errors.timeout(spec, self.timeout_s) from None

    async def get_async(self, spec: GrammarSpec, tenant: Hashable = None) -> Compiled:
        """For event loops: waits without blocking the loop (and never cancels the shared compile)."""
        result = self.submit(spec, tenant)
        if result.done():  # a hit
            return result.result()
        shared = asyncio.wrap_future(result)
        shared.add_done_callback(lambda f: f.cancelled() or f.exception())  # its waiter may have left (a client gone)
        try:
            return await asyncio.wait_for(asyncio.shield(shared), self.max_wait_s)
        except TimeoutError:
            raise errors.timeout(spec, self.timeout_s) from None

    @property
    def max_wait_s(self) -> float:
        """The longest a request waits for a compile: queued, then running to its timeout."""
        return self._pool.max_wait_s

    def worker_pids(self, busy: bool = False) -> list[int]:
        """The live worker processes (busy: only those compiling now)."""
        return self._pool.pids(busy)

    def shutdown(self) -> None:
        """Kill the workers (no process is left behind) and fail compiles still pending."""
        self._pool.shutdown()
        self._loader.shutdown(wait=False)  # its queued loads still run: they resolve their entries (shut down)

    # -- results: deserialized on the loader thread, never on the pool's monitor thread -----------
    def _load_later(self, spec: GrammarSpec, key: tuple, entry: Future[Compiled], done: Future[tuple[str, bytes]]) -> None:
        try:
            self._loader.submit(self._load, spec, key, entry, done)
        except RuntimeError:  # shut down
            entry.set_exception(errors.other(spec, "the grammar compile cache is shut down"))

    def _load(self, spec: GrammarSpec, key: tuple, entry: Future[Compiled], done: Future[tuple[str, bytes]]) -> None:
        try:
            backend, data = done.result()
            compiled = self._parent_backend(spec).deserialize(backend, data)
        except NotCompiled as e:
            with self._lock:
                if self._entries.get(key) is entry:
                    del self._entries[key]
            entry.set_exception(e)
        except GrammarError as e:
            entry.set_exception(e)
        except BaseException as e:
            entry.set_exception(GrammarError(spec.kind, repr(e)))
        else:
            entry.set_result(compiled)

    def _parent_backend(self, spec: GrammarSpec) -> Backend:
        try:
            assert self._backend is not None  # warm() ran before the job was submitted
            return self._backend.result()
        except Exception as e:
            raise errors.other(spec, f"the grammar backend could not be built: {e!r}") from None
