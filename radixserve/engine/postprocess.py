"""The post-processing stage: everything that happens to a step's sampled tokens.

    append (EOS, stop tokens, max_new_tokens) -> prompt logprobs -> detokenize -> grammar
    advance -> jump-forward -> stop strings -> deltas; and the final Output of a finished request

The scheduler only advances requests and caches their prefixes; the runner only computes and
samples; this stage owns each request's stream (its detokenizer and its sink).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve import stop_regex
from radixserve.engine.detokenizer import IncrementalDetokenizer
from radixserve.engine.jump_forward import forced_tokens
from radixserve.engine.outputs import Delta, Output
from radixserve.engine.runner import StepResult
from radixserve.engine.sampler import Sampler
from radixserve.request import FinishReason, Req
from radixserve.sched.scheduler import SchedulePlan

log = logging.getLogger(__name__)

Sink = Callable[[Delta], None]


@dataclass
class _Stream:
    req: Req
    detok: IncrementalDetokenizer
    sink: Sink
    sent: int = 0  # output tokens already streamed


class PostProcessor:
    def __init__(self, tokenizer: Any, sampler: Sampler, eos_ids: set[int], context_len: int) -> None:
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.eos_ids = eos_ids
        self.context_len = context_len
        self.streams: dict[str, _Stream] = {}
        self.jump_forward = True  # grammars: append forced text without a forward pass per token
        self.jumped_tokens = 0

    def open(self, req: Req, sink: Sink) -> bool:
        """Start the request's stream; False (and the request ended with an error) for a rid
        already in flight: the first would lose its stream."""
        if req.rid in self.streams:
            req.error = f"rid {req.rid!r} is already in flight"
            req.finish(FinishReason.ERROR)
            sink(Delta(req.rid, "", finished=True, output=_output(req, "")))
            return False
        detok = IncrementalDetokenizer(self.tokenizer, req.token_ids, req.params.stop_strs, req.params.skip_special_tokens,
                                       stop_regex.validate(req.params.stop_regex))
        self.streams[req.rid] = _Stream(req, detok, sink)
        return True

    def process(self, plan: SchedulePlan, result: StepResult) -> list[int]:
        """Append each item's tokens; returns how many of them each consumed. A speculative
        item's tokens are appended in order until one finishes the request or the grammar forces
        text after one (jump-forward appends it) that the draft did not carry: the tokens after
        that were verified in another context, so they are dropped, exactly as decoding one
        token at a time would have. Forced tokens the draft carried are the same tokens (the
        same function computed them), so the rows after them hold and appending goes on."""
        kept = [0] * len(plan.items)
        for n, (it, toks, lps) in enumerate(zip(plan.items, result.tokens, result.logprobs)):
            req = it.req
            st = self.streams[req.rid]
            try:
                req.prompt_logprobs.extend(result.prompt_logprobs.get(req.rid, ()))
                if not it.samples or req.finish_reason is not None:
                    continue
                if not toks:  # nothing sampled: max_new_tokens=0
                    req.finish(FinishReason.LENGTH)
                    continue
                j = 0
                while j < len(toks):
                    req.append_token(toks[j], self.eos_ids, self.context_len)
                    lp = lps[j]
                    if lp is not None:
                        req.output_logprobs.append(lp)
                    size = len(req.token_ids)
                    self._text(req, st, toks[j])
                    j += 1
                    jumped = req.token_ids[size:]
                    if jumped and jumped == toks[j : j + len(jumped)]:
                        j += len(jumped)  # the draft carried the forced tokens: their rows were verified after them
                    elif jumped:
                        break
                    if req.finish_reason is not None:
                        break
                kept[n] = j
                if req.finish_reason is None:
                    self._emit(st, finished=False)
            except stop_regex.StopRegexTimeout as e:  # the caller's pattern: only this request fails, saying why
                req.error = str(e)
                req.finish(FinishReason.ERROR)
            except Exception as e:  # e.g. a tokenizer error: only this request fails
                log.exception("post-processing failed for %s", req.rid)
                req.error = f"internal error while detokenizing: {e!r}"
                req.finish(FinishReason.ERROR)
        return kept

    def _text(self, req: Req, st: _Stream, tok: int) -> None:
        if req.finish_reason is FinishReason.STOP and req.finish_matched == tok:
            return  # the EOS or stop token that ended it: in output_ids, not in the text (as vLLM and SGLang trim it)
        st.detok.add(tok)
        if req.grammar is not None and not req.grammar_active:
            after = req.params.grammar_after
            req.grammar_active = after is None or after in st.detok.text  # reasoning done: constrain from here
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

    def _emit(self, st: _Stream, finished: bool, output: Output | None = None) -> None:
        req = st.req
        new_ids = req.output_ids[st.sent :]
        new_lps = req.output_logprobs[st.sent :] if req.params.return_logprob else []
        st.sent = req.output_len
        st.sink(Delta(req.rid, st.detok.take_delta(finished), new_ids, new_lps, finished, output, req.cached_tokens))

    def finish(self, reqs: list[Req]) -> None:
        """The final delta (with the Output) of each request the scheduler released."""
        for req in reqs:
            st = self.streams.pop(req.rid, None)
            self.sampler.release(req.rid)
            if st is None:
                continue
            try:
                st.detok.flush()
                self._emit(st, finished=True, output=_output(req, st.detok.text))
            except Exception as e:  # still a final delta: its reader (and its rid) must not wait forever
                log.exception("delivering the final output of %s failed", req.rid)
                failed = Output(req.rid, "", [], "error", req.prompt_len, req.output_len, req.cached_tokens,
                                error=f"internal error while finishing: {e!r}")
                with contextlib.suppress(Exception):
                    st.sink(Delta(req.rid, "", finished=True, output=failed))

    def abort_all(self) -> None:
        for st in list(self.streams.values()):
            st.req.finish(FinishReason.ABORT)


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
