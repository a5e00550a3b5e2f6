"""A bounded pool of killable compile worker processes.

Every compile runs in a worker process (grammars.worker), so a compile can be stopped:
- deadline: `timeout_s` counts from the job's start in a worker; at the deadline the worker
  is SIGKILLed (its CPU is free at once) and the job fails with the timeout message;
- memory: a worker whose resident memory grows more than `memory_mb` past what it held when
  its job started is SIGKILLed at once (checked every `poll_s`), failing its job; a worker
  that keeps more than that after a job is retired;
- crash: a worker that dies for any other reason (a segfault in a C library, an OOM kill)
  fails only its job;
- busy: a job that cannot start within `timeout_s` of being queued fails with its own
  message (time spent waiting for a worker that is still starting up does not count);
- fairness: at most `tenant_compiles` jobs of one tenant run at once (grammars.fair).
Dead workers are replaced on demand; one is kept started (warm) while the pool is open, and
the first starts in the background when the pool is created (or, with warm=False, at `warm()`
or the first job).

One monitor thread owns the workers: it dispatches jobs, reads answers, and enforces the
deadline and the memory cap. Job futures are resolved outside the pool's lock, and only
after a killed worker is reaped. Every job resolves within `max_wait_s`.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, InvalidStateError
from multiprocessing.connection import wait
from typing import Any, cast

from grammars import errors
from grammars.base import BackendFactory
from grammars.fair import TenantQueues, Waiting
from grammars.spec import GrammarError, GrammarSpec
from grammars.workers import Worker, context

log = logging.getLogger(__name__)


class Job(Waiting):
    """`result`: (backend name, serialized compiled grammar), or a GrammarError."""

    def __init__(self, job_id: int, spec: GrammarSpec, queued_at: float) -> None:
        super().__init__(queued_at)
        self.id, self.spec = job_id, spec
        self.result: Future[tuple[str, bytes]] = Future()


class CompilePool:
    def __init__(self, factory: BackendFactory, *, workers: int, tenant_compiles: int, timeout_s: float, memory_mb: int,
                 poll_s: float = 0.025, startup_timeout_s: float = 120.0, warm: bool = True) -> None:
        if workers < 1 or memory_mb < 1 or timeout_s <= 0:
            raise ValueError(f"grammar compile pool: need workers >= 1, memory_mb >= 1 and timeout_s > 0, got "
                             f"{workers}, {memory_mb}, {timeout_s}")
        self.factory, self.max_workers, self.timeout_s, self.memory_mb = factory, workers, timeout_s, memory_mb
        self.poll_s, self.startup_timeout_s = poll_s, startup_timeout_s
        self.max_wait_s = startup_timeout_s + 2 * timeout_s + 10 * poll_s + 5.0
        self._ctx = context()
        self._queues = TenantQueues(tenant_compiles)
        self._workers: list[Worker] = []
        self._launching = 0
        self._launchers: list[threading.Thread] = []  # threads starting a worker (shutdown waits for them)
        self._start_failed = False  # no new workers until the next submit (a broken factory must not spin)
        self._closed = False
        self._keep_warm = False  # one worker kept started once warm() has been called
        self._lock = threading.Lock()
        self._outbox: list[Callable[[], Any]] = []  # future resolutions, run outside the lock
        self._ids = itertools.count()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._monitor = threading.Thread(target=self._run, name="radixserve-grammar-pool", daemon=True)
        if warm:
            self.warm()
        self._monitor.start()

    # -- API (any thread) ----------------------------------------------------------------------
    def submit(self, spec: GrammarSpec, tenant: Hashable = None) -> Job:
        job = Job(next(self._ids), spec, time.monotonic())
        with self._lock:
            if self._closed:
                job.result.set_exception(errors.other(spec, "the grammar compile pool is shut down"))
                return job
            self._start_failed = False
            self._queues.push(job, tenant)
            self._wake()
        return job

    def warm(self) -> None:
        """Start a worker in the background if none is started or starting (the first start,
        with this process's forkserver, takes seconds of CPU)."""
        with self._lock:
            self._keep_warm = True
            if not self._closed and not self._workers and not self._launching:
                self._launch()

    def pids(self, busy: bool = False) -> list[int]:
        with self._lock:
            return [w.pid for w in self._workers if w.job is not None or not busy]

    def shutdown(self) -> None:
        """Kill every worker and fail what is queued or running; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake()
        self._monitor.join(5.0)
        deadline = time.monotonic() + 10.0
        for t in list(self._launchers):  # a worker half-started when the process exits makes the forkserver print a traceback
            t.join(max(deadline - time.monotonic(), 0.0))  # started, it sees the pool closed and is killed
        with self._lock:
            self._fail_everything("the grammar compile pool is shut down")
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1
        self._flush()

    # -- the monitor thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                handles, timeout = self._tick(time.monotonic())
            self._flush()
            ready = wait(handles, timeout)
            with self._lock:
                if self._closed:
                    return
                self._drain_wake()
                try:
                    self._read(ready)
                except Exception:
                    self._internal_error()
            self._flush()

    def _tick(self, now: float) -> tuple[list[Any], float | None]:
        """Watch, dispatch, start workers, expire; what to wait on, and for how long."""
        try:
            self._watch(now)
            self._dispatch(now)
            self._grow()
            self._expire(now)  # last: a job that can start once a worker is up is not "busy"
        except Exception:
            self._internal_error()
        handles: list[Any] = [self._wake_r]
        for w in self._workers:
            handles += [w.conn, w.proc.sentinel]
        active = any(w.job is not None or not w.ready for w in self._workers) or self._launching
        return handles, self.poll_s if active or any(True for _ in self._queues.waiting()) else None

    def _expire(self, now: float) -> None:
        starting = self._launching or any(not w.ready for w in self._workers)
        for job in list(self._queues.waiting()):
            if now - job.queued_at > self.timeout_s and not (starting and self._queues.is_runnable(job)):
                self._queues.remove(job)
                self._fail(cast(Job, job), errors.busy(cast(Job, job).spec, self.timeout_s, self._queues.limit))

    def _watch(self, now: float) -> None:
        for w in list(self._workers):
            if w.job is not None and w.rss() - w.job_rss > self.memory_mb << 20:
                self._kill(w, errors.memory(w.job.spec, self.memory_mb))
            elif w.job is not None and now - w.job_started > self.timeout_s:
                self._kill(w, errors.timeout(w.job.spec, self.timeout_s))
            elif not w.ready and now - w.created > self.startup_timeout_s:
                self._kill(w, None)
                self._start_failure(f"it was not ready within {self.startup_timeout_s:g} s")

    def _dispatch(self, now: float) -> None:
        for w in self._workers:
            if not w.ready or w.job is not None:
                continue
            nxt = self._queues.pop()
            if nxt is None:
                return
            w.job, w.tenant = nxt
            w.job_started, w.job_rss = now, w.rss()
            try:
                w.send(w.job.id, w.job.spec)
            except (OSError, ValueError):
                pass  # it died: its sentinel reports it, failing the job as a crash

    def _grow(self) -> None:
        """Start workers for compiles that could run but have none coming; keep one warm once
        warmed (with warm=False, not before: a start's CPU would slow the first requests)."""
        if self._start_failed or self._closed:
            return
        coming = self._launching + sum(1 for w in self._workers if not w.ready or w.job is None)
        live = len(self._workers) + self._launching
        want = max(self._queues.runnable() - coming, 1 if live == 0 and self._keep_warm else 0)
        for _ in range(min(want, self.max_workers - live)):
            self._launch()

    def _read(self, ready: list[Any]) -> None:
        for w in list(self._workers):
            try:
                while w in self._workers and w.conn.poll():
                    self._on_message(w, *w.recv())
            except (EOFError, OSError, ValueError):
                self._lost(w)
                continue
            if w in self._workers and w.proc.sentinel in ready:
                self._lost(w)

    def _on_message(self, w: Worker, header: dict[str, Any], payload: bytes) -> None:
        kind = header["type"]
        if kind == "ready":
            w.mark_ready()
        elif kind == "failed":
            self._kill(w, None)
            self._start_failure(str(header.get("message")))
        elif kind in ("ok", "error") and w.job is not None and header.get("job") == w.job.id:
            job, w.job = w.job, None
            self._queues.finished(w.tenant)
            if kind == "ok":
                result = (str(header.get("backend")), payload)
                self._outbox.append(lambda: job.result.set_result(result))
            else:
                field = header.get("field")
                self._fail(job, GrammarError(field if isinstance(field, str) else None, str(header.get("message"))))
            if w.rss() - w.ready_rss > self.memory_mb << 20:
                self._kill(w, None)  # it kept what its compiles used: retire it, a fresh one starts on demand
        else:
            raise ValueError(f"unexpected message from a grammar compile worker: {kind}")

    def _lost(self, w: Worker) -> None:
        """The worker died on its own (or sent garbage)."""
        if w.proc.exitcode is None:
            w.proc.join(0.5)  # it closed its pipe: let it finish dying for a precise reason
        reason = w.exit_reason()
        job = w.job
        self._kill(w, None)
        if job is not None:
            self._fail(job, errors.crashed(job.spec, reason))
        elif not w.ready:
            self._start_failure(f"the process died during start-up ({reason})")

    # -- helpers (lock held) -----------------------------------------------------------------------
    def _kill(self, w: Worker, error: GrammarError | None) -> None:
        """Kill and reap `w` (its memory is free before its job's waiters hear of it)."""
        w.kill()
        self._workers.remove(w)
        if w.job is not None:
            self._queues.finished(w.tenant)
            if error is not None:
                self._fail(w.job, error)
            w.job = None

    def _start_failure(self, why: str) -> None:
        self._start_failed = True
        self._fail_queued(f"the grammar compiler process could not start: {why}")

    def _internal_error(self) -> None:
        """A bug in the pool must not hang every waiter: fail them all and keep serving."""
        log.exception("grammar compile pool: monitor error")
        self._fail_everything("the grammar compile pool hit an internal error")

    def _fail_everything(self, why: str) -> None:
        for w in list(self._workers):
            self._kill(w, errors.other(w.job.spec, why) if w.job else None)
        self._fail_queued(why)

    def _fail_queued(self, why: str) -> None:
        for job in list(self._queues.waiting()):
            self._queues.remove(job)
            self._fail(cast(Job, job), errors.other(cast(Job, job).spec, why))

    def _fail(self, job: Job, error: GrammarError) -> None:
        self._outbox.append(lambda: job.result.set_exception(error))

    def _launch(self) -> None:
        """Start a worker on a helper thread (the forkserver's first start takes seconds)."""
        self._launching += 1
        t = threading.Thread(target=self._start_one, name="radixserve-grammar-start", daemon=True)
        self._launchers = [x for x in self._launchers if x.is_alive()] + [t]
        t.start()

    def _start_one(self) -> None:
        try:
            w = Worker(self._ctx, self.factory, self.memory_mb)
        except Exception as e:  # e.g. a factory that does not pickle
            with self._lock:
                self._launching -= 1
                self._start_failure(f"{type(e).__name__}: {e}")
            self._flush()
            return
        with self._lock:
            self._launching -= 1
            closed = self._closed
            if not closed:
                self._workers.append(w)
                self._wake()
        if closed:
            w.kill()

    def _flush(self) -> None:
        with self._lock:
            todo, self._outbox = self._outbox, []
        for resolve in todo:
            try:
                resolve()
            except InvalidStateError:  # cancelled by a caller: nobody waits for it
                pass

    def _wake(self) -> None:
        """Lock held (so the pipe is still open)."""
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # already woken

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
