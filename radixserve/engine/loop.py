"""The engine loop: drain commands, schedule, run, post-process (engine.postprocess), stream.

Callers talk to it only through `inbox` (commands in: Add, Abort, Stop; Loaded from the disk
tier's or the KV hand-off's reader; Refresh from the KV events' publisher) and per-request sinks (deltas out). It runs on its own
thread in-process, or on the main thread of the engine process.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from radixserve.engine.kv_handoff import KVHandoff
from radixserve.engine.kv_tier import KVTier
from radixserve.engine.outputs import Delta
from radixserve.engine.postprocess import PostProcessor
from radixserve.engine.runner import ModelRunner
from radixserve.request import FinishReason, Req
from radixserve.sched.scheduler import SchedulePlan, Scheduler

log = logging.getLogger(__name__)

Sink = Callable[[Delta], None]
IDLE_S = 10.0  # how long the loop waits with no work before its on_idle hook (deferred start-up work) runs


@dataclass(frozen=True)
class Add:
    req: Req
    sink: Sink


@dataclass(frozen=True)
class Abort:
    rid: str


@dataclass(frozen=True)
class Stop:
    """Finish every request (abort) and end the loop."""


@dataclass(frozen=True)
class Loaded:
    """A lower tier has read a waiting request's KV: the disk tier (engine.kv_tier) its blocks from
    block `first`, or the KV hand-off (engine.kv_handoff) another engine's pages from token `first`."""

    req: Req  # the request itself, not its rid: a rid may be reused once its request has left
    first: int
    payloads: list[memoryview]
    source: KVTier | KVHandoff


@dataclass(frozen=True)
class Refresh:
    """Something the stats count changed off the loop (the KV events published while it idles)."""


Command = Add | Abort | Stop | Loaded | Refresh


class EngineLoop:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, post: PostProcessor, tier: KVTier | None = None,
                 handoff: KVHandoff | None = None) -> None:
        self.scheduler = scheduler
        self.tier = tier
        self.handoff = handoff
        self.loading: dict[str, Req] = {}  # requests waiting for the disk tier or the hand-off, outside the scheduler
        self.runner = runner
        self.post = post
        self.inbox: queue.Queue[Command] = queue.Queue()
        self.lock = threading.Lock()  # held while the loop mutates state; stats() reads under it
        self.steps = 0
        self.on_change: Callable[[], None] | None = None  # called under the lock after each step or command
        self.thread = threading.Thread(target=self.run, name="radixserve-engine", daemon=True)
        self.stopped = threading.Event()
        self.running_here = False  # run() called on a thread of the caller's (the engine process's main thread)
        self.on_idle: Callable[[], None] | None = None  # called once, when the loop has first waited IDLE_S with no work

    def start(self) -> None:
        """Run the loop on its own thread (in-process engines)."""
        self.thread.start()

    def add(self, req: Req, sink: Sink) -> None:
        self.inbox.put(Add(req, sink))

    def abort(self, rid: str) -> None:
        self.inbox.put(Abort(rid))

    def stop(self) -> None:
        """Finish every request (abort) and end the loop; waits for it to end."""
        if not self.stopped.is_set():
            self.inbox.put(Stop())
        if self.thread.is_alive():
            self.thread.join()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() or (self.running_here and not self.stopped.is_set())

    # -- the loop body: on its own thread, or on the caller's (`run()`) -------------------
    def run(self) -> None:
        if threading.current_thread() is not self.thread:
            self.running_here = True
        self.runner.on_thread_start()
        try:
            while self._drain(block=not self.scheduler.has_work):
                try:
                    with self.lock:
                        self._step()
                        self._changed()
                except Exception:  # never let one bad step end the loop
                    log.exception("engine step failed")
        finally:
            self.stopped.set()

    def _drain(self, block: bool) -> bool:
        try:
            cmd = self._next(block)
        except queue.Empty:
            return True
        while True:
            with self.lock:
                if not self._handle(cmd):
                    return False
                self._changed()
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _next(self, block: bool) -> Command:
        """The next command (queue.Empty if none and not `block`); a blocking wait runs `on_idle`
        once it has waited IDLE_S."""
        if not block:
            return self.inbox.get_nowait()
        if self.on_idle is not None:
            try:
                return self.inbox.get(timeout=IDLE_S)
            except queue.Empty:
                idle, self.on_idle = self.on_idle, None
                idle()
        return self.inbox.get()

    def _handle(self, cmd: Command) -> bool:
        """Apply one command; False once told to stop."""
        if isinstance(cmd, Add):
            req = cmd.req
            if not self.post.open(req, cmd.sink):  # never two requests under one rid
                return True
            if self._fetch(req):
                self.loading[req.rid] = req
            else:
                self.scheduler.add(req)
        elif isinstance(cmd, Loaded):
            if self.loading.get(cmd.req.rid) is not cmd.req:  # it left meanwhile
                return True
            req = self.loading.pop(cmd.req.rid)
            try:
                cmd.source.put_back(req, self.scheduler.cache, cmd.first, cmd.payloads)
            except Exception:  # the request computes what it could not put back
                log.exception("putting %s's KV into the pool failed (a miss)", req.rid)
            self.scheduler.add(req)
        elif isinstance(cmd, Refresh):
            pass  # the stats are published after every command
        elif isinstance(cmd, Abort):
            if (left := self.loading.pop(cmd.rid, None)) is not None:
                left.finish(FinishReason.ABORT)
                self.scheduler.add(left)  # reaped below
            else:
                self.scheduler.abort(cmd.rid)
        else:
            for req in self.loading.values():
                req.finish(FinishReason.ABORT)
                self.scheduler.add(req)
            self.loading.clear()
            self.post.abort_all()
            self._reap()
            return False
        self._reap()
        return True

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _step(self) -> None:
        plan = self.scheduler.schedule()
        if plan.items:
            self.steps += 1
            self._run(plan)
        self._reap()

    def _run(self, plan: SchedulePlan) -> None:
        """Run one forward step. If it fails, run its requests one at a time: only a request
        that fails alone is finished with the error, the rest of the batch goes on (rerunning a
        request writes the same K/V to the same slots). A failure after sampling has advanced
        seeded generators: a seeded request rerun this way may then sample differently."""
        try:
            cache = self.scheduler.cache
            result = self.runner.run(plan, cache.slots, cache.window_tables)
        except Exception as e:
            if len(plan.items) > 1:
                log.warning("a forward step of %d requests failed (%r); running them one at a time", len(plan.items), e)
                for it in plan.items:
                    self._run(SchedulePlan([it]))
                return
            req = plan.items[0].req
            log.exception("the forward step of %s failed; finishing it with an error", req.rid)
            req.error = f"internal error in the forward step: {e!r}"
            req.finish(FinishReason.ERROR)
        else:
            kept = self.post.process(plan, result)
            self.scheduler.process(plan, result.accepted, kept)
            if self.tier is not None:
                self._write_through(plan)
            if self.handoff is not None:
                self._export(plan)

    def _fetch(self, req: Req) -> bool:
        """Ask the KV hand-off for the request's pages, or the disk tier for its blocks; True if
        it waits for them (a Loaded)."""
        if req.kv_import is not None and self.handoff is not None:
            handoff = self.handoff
            handoff.fetch(req, lambda first, got: self.inbox.put(Loaded(req, first, got, handoff)))
            return True
        if self.tier is None:
            return False
        try:
            tier = self.tier
            return tier.fetch(req, self.scheduler.cache, lambda first, got: self.inbox.put(Loaded(req, first, got, tier)))
        except Exception:
            log.exception("KV disk tier: looking up %s's blocks failed (a miss)", req.rid)
            return False

    @staticmethod
    def _prefilled(plan: SchedulePlan) -> list[Req]:
        """The requests whose prompt's last token was computed this step (their KV is in the pool)."""
        return [it.req for it in plan.items
                if it.spec is None and it.start < it.req.prompt_len <= it.start + it.length
                and it.req.finish_reason not in (FinishReason.ABORT, FinishReason.ERROR)]

    def _write_through(self, plan: SchedulePlan) -> None:
        """Prompts whose prefill ended this step go to the disk tier."""
        for req in self._prefilled(plan):
            self._save(req, self.scheduler.cache.slots(req))

    def _export(self, plan: SchedulePlan) -> None:
        """Prompts whose prefill ended this step, marked kv_export, publish their pages; one that
        cannot ends with an error (its coordinator then has the decode side compute them)."""
        assert self.handoff is not None
        for req in self._prefilled(plan):
            if req.kv_export is None:
                continue
            try:
                self.handoff.export(req, self.scheduler.cache.slots(req))
            except Exception as e:
                log.exception("KV hand-off: publishing %s's pages failed", req.rid)
                req.error = f"publishing its KV pages failed: {e!r}"
                req.finish_reason = FinishReason.ERROR  # over its length finish: the hand-off is what it was for

    def _save(self, req: Req, slots: list[int], upto: int | None = None) -> None:
        assert self.tier is not None
        try:
            self.tier.save(req, slots, upto)
        except Exception:  # the tier misses these blocks; the request and the step go on
            log.exception("KV disk tier: saving %s's blocks failed", req.rid)

    def _reap(self) -> None:
        if self.tier is not None:  # a finished answer is the next turn's prompt: its blocks go to disk too
            for req in self.scheduler.running:
                if req.finish_reason is not None and req.finish_reason not in (FinishReason.ABORT, FinishReason.ERROR):
                    slots = self.scheduler.cache.slots(req)
                    self._save(req, slots, min(req.computed_len, len(slots)))
        self.post.finish(self.scheduler.reap())
