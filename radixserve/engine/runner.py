"""ModelRunner: plan -> ForwardBatch -> forward -> logits of the rows that need them -> tokens."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from radixserve.attention.base import AttnBackend
from radixserve.batch import ForwardBatch
from radixserve.cache.allocator import WindowTables
from radixserve.engine.sampler import Sampler, logprob_entries
from radixserve.request import Req, TokenLogprob
from radixserve.sched.scheduler import PlanItem, SchedulePlan
from radixserve_kernels.threads import helper_thread


@dataclass
class StepResult:
    tokens: list[list[int]]  # per plan item, the tokens it produced (empty where it does not sample)
    logprobs: list[list[TokenLogprob | None]]  # one per token
    accepted: list[int]  # per item, how many of its draft tokens the model agreed with
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # rid -> new entries


class ModelRunner:
    def __init__(self, model: nn.Module, backend: AttnBackend, sampler: Sampler, device: torch.device) -> None:
        self.model: Any = model  # a registry class (models/): forward, compute_logits
        self.backend = backend
        self.sampler = sampler
        self.device = device
        self.fault_hook: Callable[[SchedulePlan], None] | None = None  # tests inject faults here
        self.parallel: Any = None  # tensor or pipeline parallelism: runs the forward with the workers (engine/model_parallel.py)
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="radixserve-masks", initializer=helper_thread)

    def close(self) -> None:
        self._mask_pool.shutdown(wait=False)

    def on_thread_start(self) -> None:
        """Per-thread set-up of the thread that runs the model."""
        if self.device.type == "cpu":
            torch.set_flush_denormal(True)  # denormals make CPU elementwise ops several times slower

    @torch.inference_mode()
    def run(self, plan: SchedulePlan, slots_of: Callable[[Req], list[int]], window: WindowTables | None = None) -> StepResult:
        """A sampling item samples its last fed row; one with a draft samples every row (row j:
        the token after the pending one and draft[:j]) and keeps the rows up to the first draft
        token the sampler did not produce, plus the token it produced there instead. Draft
        tokens jump-forward would append (`Draft.forced_from`) are kept without a check."""
        if self.fault_hook is not None:
            self.fault_hook(plan)
        batch = ForwardBatch.from_plan(plan, slots_of, self.backend, self.device, window)
        sampling = [i for i, it in enumerate(plan.items) if it.samples and it.req.max_new_tokens > 0]
        row_reqs = [plan.items[i].req for i in sampling for _ in range(1 + len(plan.items[i].draft))]
        row_drafts = [plan.items[i].draft[:j] for i in sampling for j in range(1 + len(plan.items[i].draft))]
        masks = None  # grammar rows are filled on a helper thread while the model runs
        if any(r.grammar is not None for r in row_reqs):
            masks = self._mask_pool.submit(self.sampler.grammar_masks, row_reqs, row_drafts)
        hidden = self.parallel.forward(batch) if self.parallel is not None else self.model(batch)
        rows: list[int] = []
        prompt_at: list[tuple[Req, list[int], int]] = []  # (req, target positions, first index into rows)
        for it, seq in zip(plan.items, batch.seqs):
            targets = _prompt_targets(it)
            if targets:
                prompt_at.append((it.req, targets, len(rows)))
                rows.extend(seq.q_start + t - 1 - it.start for t in targets if t > 0)
        sample_from = len(rows)
        for i in sampling:
            it, seq = plan.items[i], batch.seqs[i]
            n = 1 + len(it.draft)
            rows.extend(seq.q_start + it.length - n + j for j in range(n))
        n_items = len(plan.items)
        result = StepResult([[] for _ in range(n_items)], [[] for _ in range(n_items)], [0] * n_items)
        if not rows:  # nothing to score but maybe a one-token prompt's first token (it has no logprob)
            for req, targets, _ in prompt_at:
                result.prompt_logprobs[req.rid] = self._prompt_logprobs(req, targets, None, 0)
            return result
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        if sampling:
            toks, lps = self.sampler.sample(logits[sample_from:], row_reqs, masks.result() if masks is not None else None,
                                            row_drafts)
            at = 0
            for i in sampling:
                spec = plan.items[i].spec
                draft = plan.items[i].draft
                n = 1 + len(draft)
                t = toks[at : at + n]
                forced = spec.forced_from if spec is not None and spec.forced_from is not None else n
                a = 0  # forced tokens (what jump-forward appends there) are kept once the tokens before them are
                while a < len(draft) and (a >= forced or t[a] == draft[a]):
                    a += 1
                result.tokens[i], result.logprobs[i], result.accepted[i] = draft[:a] + t[a : a + 1], lps[at : at + a + 1], a
                at += n
        for req, targets, first in prompt_at:
            result.prompt_logprobs[req.rid] = self._prompt_logprobs(req, targets, logits, first)
        return result

    def _prompt_logprobs(self, req: Req, targets: list[int], logits: torch.Tensor | None, first: int) -> list[TokenLogprob]:
        out = [TokenLogprob(req.token_ids[0], None)] if targets[0] == 0 else []
        scored = [t for t in targets if t > 0]
        if scored and logits is not None:
            n = len(scored)
            out += logprob_entries(
                logits[first : first + n][:, : self.sampler.vocab_size],
                [req.token_ids[t] for t in scored],
                [req.params.top_logprobs_num] * n,
            )
        return out


def _prompt_targets(it: PlanItem) -> list[int]:
    """Prompt positions t whose logprob this chunk yields (row t-1 lies in the chunk)."""
    req = it.req
    if not req.wants_prompt_logprobs:
        return []
    first = req.params.logprob_start_len + len(req.prompt_logprobs)
    lo = max(first, it.start + 1 if it.start > 0 or first > 0 else 0)
    hi = min(req.prompt_len, it.start + it.length + 1)
    return list(range(lo, hi))
