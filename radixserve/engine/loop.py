"""The engine thread: drain commands, schedule, run, post-process, stream deltas.

The server's event loop (or a sync caller) talks to it only through `inbox` (commands in)
and per-request sinks (deltas out), so it can move to its own process later.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.engine.detokenizer import IncrementalDetokenizer
from radixserve.engine.jump_forward import forced_tokens
from radixserve.engine.outputs import Delta, Output
from radixserve.engine.runner import ModelRunner, StepResult
from radixserve.engine.sampler import Sampler
from radixserve.request import FinishReason, Req
from radixserve.sched.scheduler import SchedulePlan, Scheduler

log = logging.getLogger(__name__)

Sink = Callable[[Delta], None]


@dataclass
class _Stream:
    req: Req
    detok: IncrementalDetokenizer
    sink: Sink
    sent: int = 0  # output tokens already streamed


class EngineLoop:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler, tokenizer: Any) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.inbox: queue.Queue[tuple] = queue.Queue()
        self.lock = threading.Lock()  # held while the loop mutates state; stats() reads under it
        self.streams: dict[str, _Stream] = {}
        self.steps = 0
        self.jump_forward = True  # grammars: append forced text without a forward pass per token
        self.jumped_tokens = 0
        self.on_change: Callable[[], None] | None = None  # called under the lock after each step or command
        self.thread = threading.Thread(target=self.run, name="radixserve-engine", daemon=True)
        self.stopped = threading.Event()
        self.running_here = False  # run() called on a thread of the caller's (the engine process's main thread)

    def start(self) -> None:
        """Run the loop on its own thread (in-process engines)."""
        self.thread.start()

    def add(self, req: Req, sink: Sink) -> None:
        self.inbox.put(("add", req, sink))

    def abort(self, rid: str) -> None:
        self.inbox.put(("abort", rid))

    def stop(self) -> None:
        """Finish every request (abort) and end the loop; waits for it to end."""
        if not self.stopped.is_set():
            self.inbox.put(("stop",))
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
            cmd = self.inbox.get() if block else self.inbox.get_nowait()
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

    def _handle(self, cmd: tuple) -> bool:
        kind = cmd[0]
        if kind == "add":
            _, req, sink = cmd
            if req.rid in self.streams:  # never two requests under one rid: the first would lose its stream
                req.error = f"rid {req.rid!r} is already in flight"
                req.finish(FinishReason.ERROR)
                sink(Delta(req.rid, "", finished=True, output=_output(req, "")))
                return True
            stops = req.params.stop_strs
            detok = IncrementalDetokenizer(self.tokenizer, req.token_ids, stops, req.params.skip_special_tokens)
            self.streams[req.rid] = _Stream(req, detok, sink)
            self.scheduler.add(req)
        elif kind == "abort":
            self.scheduler.abort(cmd[1])
        elif kind == "stop":
            for st in list(self.streams.values()):
                st.req.finish(FinishReason.ABORT)
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
            result = self.runner.run(plan, self.scheduler.cache.slots)
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
            self.scheduler.process(plan, result.tokens)
            self._post(plan, result)

    def _post(self, plan: SchedulePlan, result: StepResult) -> None:
        for it, tok, lp in zip(plan.items, result.tokens, result.logprobs):
            req = it.req
            st = self.streams[req.rid]
            try:
                req.prompt_logprobs.extend(result.prompt_logprobs.get(req.rid, ()))
                if tok is None or req.finish_reason is FinishReason.ABORT:
                    continue
                if lp is not None:
                    req.output_logprobs.append(lp)
                st.detok.add(tok)
                if req.grammar is not None and not req.grammar_active:
                    req.grammar_active = req.params.grammar_after in st.detok.text  # reasoning done: constrain from here
                elif req.grammar is not None:
                    _advance_grammar(req, tok)
                    if req.finish_reason is None and self.jump_forward:
                        for t in forced_tokens(req, self.tokenizer):
                            if st.detok.stopped_on is not None:  # a stop string inside the forced text
                                break
                            req.token_ids.append(t)
                            st.detok.add(t)
                            self.jumped_tokens += 1
                if st.detok.stopped_on is not None:
                    req.finish(FinishReason.STOP, st.detok.stopped_on)
                if req.finish_reason is None:
                    self._emit(st, finished=False)
            except Exception as e:  # e.g. a tokenizer error: only this request fails
                log.exception("post-processing failed for %s", req.rid)
                req.error = f"internal error while detokenizing: {e!r}"
                req.finish(FinishReason.ERROR)

    def _emit(self, st: _Stream, finished: bool, output: Output | None = None) -> None:
        req = st.req
        new_ids = req.output_ids[st.sent :]
        new_lps = req.output_logprobs[st.sent :] if req.params.return_logprob else []
        st.sent = req.output_len
        st.sink(Delta(req.rid, st.detok.take_delta(finished), new_ids, new_lps, finished, output, req.cached_tokens))

    def _reap(self) -> None:
        for req in self.scheduler.reap():
            st = self.streams.pop(req.rid, None)
            self.sampler.release(req.rid)
            if st is None:
                continue
            st.detok.flush()
            out = _output(req, st.detok.text)
            try:
                self._emit(st, finished=True, output=out)
            except Exception:
                log.exception("delivering the final output of %s failed", req.rid)


def _advance_grammar(req: Req, tok: int) -> None:
    """Feed the sampled token to the request's matcher; a complete output stops the request."""
    if req.grammar.is_terminated():
        return
    if not req.grammar.accept(tok):
        req.error = f"internal error: the grammar rejected sampled token {tok}"
        req.finish(FinishReason.ERROR)
    elif req.grammar.is_terminated():
        req.finish(FinishReason.STOP, tok)


def _output(req: Req, text: str) -> Output:
    reason = req.finish_reason or FinishReason.ABORT
    return Output(
        rid=req.rid,
        text=text,
        token_ids=req.output_ids,
        finish_reason=reason.value,
        prompt_tokens=req.prompt_len,
        completion_tokens=req.output_len,
        cached_tokens=req.cached_tokens,
        matched_stop=req.finish_matched,
        logprobs=req.output_logprobs if req.params.return_logprob else None,
        prompt_logprobs=req.prompt_logprobs if req.params.logprob_start_len >= 0 else None,
        error=req.error,
    )
