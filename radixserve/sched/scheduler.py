"""Continuous batching: every iteration, running decodes plus new prefill chunks.

`schedule()` returns a SchedulePlan (what to run); the engine turns it into one ForwardBatch,
runs it, and hands the sampled tokens back to `process()`. `reap()` then releases finished
requests. Everything here runs on the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from radixserve.config import SchedConfig
from radixserve.request import BACKGROUND, FinishReason, Req, ReqStatus
from radixserve.sched.cache_manager import CacheManager
from radixserve.sched.policy import Policy, keep_key
from radixserve.sched.prefill import PrefillAdder
from radixserve.sched.siblings import SiblingGate
from radixserve.sched.spec import Draft, NgramProposer


@dataclass
class PlanItem:
    """Feed req.token_ids[start : start + length] (their KV slots are allocated); with a
    speculative draft, its tokens follow, and `length` counts them too."""

    req: Req
    start: int
    length: int
    spec: Draft | None = None

    @property
    def draft(self) -> list[int]:
        return self.spec.tokens if self.spec is not None else []

    @property
    def fed_ids(self) -> list[int]:
        n = len(self.draft)
        return self.req.token_ids[self.start : self.start + self.length - n] + self.draft

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the request's tokens, so the next token is sampled
        (after each draft token too)."""
        return self.start + self.length - len(self.draft) == len(self.req.token_ids)

    @property
    def is_decode(self) -> bool:
        return self.length - len(self.draft) == 1 and self.start >= self.req.prompt_len


@dataclass
class SchedulePlan:
    items: list[PlanItem] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(it.length for it in self.items)


@dataclass
class SchedCounters:
    prompt_tokens: int = 0  # of admitted requests (counted at first admission)
    cached_prompt_tokens: int = 0  # of those, served from the prefix cache
    cached_prompt_tokens_disk: int = 0  # of those, put back into the pool from the disk tier for the request
    prefill_tokens_computed: int = 0
    decode_tokens: int = 0
    retractions: int = 0
    finished: int = 0
    spec_draft_tokens: int = 0  # speculative draft tokens fed to the model
    spec_accepted_tokens: int = 0  # of those, what the sampler itself would have produced
    spec_verifies: int = 0  # decodes (or jump-forward extends) that carried a draft
    spec_emitted_tokens: int = 0  # tokens they produced (accepted drafts and the next token)
    spec_cache_draft_tokens: int = 0  # draft tokens found in the namespace's cached branches
    spec_cache_accepted_tokens: int = 0


PREFILL_DECAY = 0.5 ** (1 / 64)  # a tenant's recent prefill halves every 64 steps
SHARE_LINGER_STEPS = 16  # steps a tenant counts as present after its last request (_tenants_share)
PREFILL_TIE_TOKENS = 256  # recent prefill within this of another tenant's counts as the same (then FCFS)


def fair_chunks(chunking: list[Req], budget: int, cost: Callable[[Req, int], int] = lambda r, n: n) -> dict[Req, int]:
    """The step's prefill budget split over the tenants with partly prefilled requests in equal
    shares (what one needs less of goes to the others), and a tenant's share over its requests
    in `chunking`'s order: no tenant's long prompts hold the whole budget while another
    tenant's request waits for its next chunk. Shares are in the budget's units: `cost(req, n)`
    is what req's next n tokens take from it (PrefillAdder.cost)."""
    by_tenant: dict[str | None, list[Req]] = {}
    for r in chunking:
        by_tenant.setdefault(r.tenant, []).append(r)
    whole = {r: cost(r, r.extend_len) for r in chunking}
    need = {t: sum(whole[r] for r in rs) for t, rs in by_tenant.items()}
    share: dict[str | None, int] = {}
    for i, t in enumerate(sorted(need, key=need.__getitem__)):
        share[t] = min(need[t], max(budget // (len(need) - i), 0))
        budget -= share[t]
    give: dict[Req, int] = {}
    for t, rs in by_tenant.items():
        for r in rs:
            give[r] = min(whole[r], share[t])
            share[t] -= give[r]
    return {r: n for r, n in give.items() if n > 0}


class Scheduler:
    def __init__(self, cfg: SchedConfig, cache: CacheManager, proposer: NgramProposer | None = None,
                 context_cost: float = 0.0) -> None:
        self.cfg = cfg
        self.context_cost = context_cost  # ArchConfig.context_cost (0: chunks are costed by their tokens alone)
        self.cache = cache
        self.proposer = proposer  # speculative drafts (None: off)
        self.policy = Policy(cfg.schedule_policy, cfg.lpm_queue_cap)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.counters = SchedCounters()
        self.new_token_ratio = cfg.init_new_token_ratio
        self._prefilled: dict[str | None, float] = {}  # tenant -> its prefill tokens lately (_count_prefill)
        self._present: dict[str | None, int] = {}  # tenant -> the last step it had work in (_tenants_share)
        self._steps = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        self.waiting.append(req)

    def abort(self, rid: str) -> Req | None:
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    req.finish(FinishReason.ABORT)
                    return req
        return None

    # -- planning ---------------------------------------------------------------------------
    def schedule(self) -> SchedulePlan:
        plan = SchedulePlan()
        self.new_token_ratio = max(self.new_token_ratio - self.cfg.new_token_ratio_decay, self.cfg.min_new_token_ratio)
        self._schedule_decodes(plan)
        adder = PrefillAdder(self.cfg, self.cache, self.running, self.new_token_ratio)
        if self._tenants_share():
            adder.budget = min(adder.budget, self.cfg.shared_prefill_size)
            adder.context_cost = self.context_cost
        chunking = [r for r in sorted(self.running, key=keep_key) if r.extend_len > 1]
        # a prompt under way waits for waiting requests of a higher priority (e.g. a history
        # precompute, at the lowest, for any request): its next chunk takes what they leave
        top = max((r.priority for r in self.waiting), default=None)
        later = [r for r in chunking if top is not None and r.priority < top]
        chunking = [r for r in chunking if r not in later]
        if chunking and self.waiting and adder.can_admit:
            self._admit_others_first(plan, adder, chunking)
        self._continue_chunks(plan, adder, chunking)
        if later and adder.can_admit:  # only those above them go first: the rest come after their chunks
            floor = max(r.priority for r in later)
            self._admit(plan, adder, lambda r: r.priority > floor)
        self._continue_chunks(plan, adder, later)
        if self.waiting and adder.can_admit:
            self._admit(plan, adder)
        self._count_prefill(plan)
        if not plan.items and not self.running and self.waiting and self.cache.let_go_all():
            # Nothing fits while prefixes put back from disk are held for requests further back
            # in the queue: they go back to being plain cached prefixes (evictable).
            return self.schedule()
        if not plan.items and self.running:
            # Every running request is stuck on memory (partly prefilled, nothing decoding):
            # free the least important one so the others can move.
            self._retract(max(self.running, key=keep_key))
            return self.schedule()
        if self.proposer is not None:
            self._draft(plan)
        return plan

    def _tenants_share(self) -> bool:
        """Requests of more than one tenant run or wait, or did within SHARE_LINGER_STEPS steps.
        NOTE: a step lasts as long as its prefill: at the full chunk (1,024 tokens, 2 to 5 s for
        SmolLM2 on 2 cores after 2k to 8k of context) one tenant's long prompts set every other
        tenant's time per token and first token; with tenants sharing the engine, the step's
        prefill is shared_prefill_size token-equivalents, a chunk's attention over its context
        counted (PrefillAdder.cost). The linger: a tenant whose requests all finished in one step
        sends its next ones a few milliseconds later, into the step under way; without it that
        step was the other tenant's full chunk."""
        self._steps += 1
        for q in (self.running, self.waiting):
            for r in q:
                self._present[r.tenant] = self._steps
        for tenant, seen in list(self._present.items()):
            if self._steps - seen > SHARE_LINGER_STEPS:
                del self._present[tenant]
        return len(self._present) > 1

    def _continue_chunks(self, plan: SchedulePlan, adder: PrefillAdder, chunking: list[Req]) -> None:
        for req, n in fair_chunks(chunking, adder.budget, adder.cost).items():
            if n := adder.continue_chunk(req, n):
                plan.items.append(PlanItem(req, req.computed_len, n))

    def _admit_others_first(self, plan: SchedulePlan, adder: PrefillAdder, chunking: list[Req]) -> None:
        """NOTE (tenant fairness): a long prompt's chunks go on step after step, and the next
        chunk used to come before anyone new, so one tenant's long prompts kept every other
        tenant's requests waiting for as long as it sent them. Waiting requests of tenants that
        have had less prefill lately than every tenant with a chunk under way (`_prefilled`), at
        the priority of those chunks or above, are admitted first, within half the step's
        budget; the chunks share the rest."""
        least = min(self._prefilled.get(r.tenant, 0.0) for r in chunking)
        top = max(r.priority for r in chunking)
        half = adder.budget // 2
        adder.budget -= half
        self._admit(plan, adder, lambda r: self._prefilled.get(r.tenant, 0.0) < least and r.priority >= top)
        adder.budget += half

    def _count_prefill(self, plan: SchedulePlan) -> None:
        """Each tenant's prefill tokens, halving every 64 steps (PREFILL_DECAY)."""
        for tenant in list(self._prefilled):
            self._prefilled[tenant] *= PREFILL_DECAY
            if self._prefilled[tenant] < 1:
                del self._prefilled[tenant]
        for it in plan.items:
            if not it.is_decode:
                self._prefilled[it.req.tenant] = self._prefilled.get(it.req.tenant, 0.0) + it.length

    def _admit(self, plan: SchedulePlan, adder: PrefillAdder, eligible: Callable[[Req], bool] | None = None) -> None:
        """Admit waiting requests in policy order until the budget or memory runs out,
        skipping siblings that will hit a prefix being computed right now (and those not
        `eligible`)."""
        hits: dict[str, int] = {}  # one prefix match per waiting request per round (nothing is inserted mid-round)

        def cached_len(req: Req) -> int:
            if req.rid not in hits:
                hits[req.rid] = self.cache.match_len(req)
            return hits[req.rid]

        gate = SiblingGate(self.cache, self.running, cached_len)
        order = self.policy.order(self.waiting, cached_len)
        if len(self._prefilled) > 1:  # tenants that had less prefill lately go first among equal priorities
            order.sort(key=lambda r: (-r.priority, self._prefilled.get(r.tenant, 0.0) // PREFILL_TIE_TOKENS))
        for req in order:
            if gate.holds(req) or (eligible is not None and not eligible(req)):
                continue
            n = adder.admit(req)
            if not n:
                break
            self.waiting.remove(req)
            self.running.append(req)
            self.cache.admitted(req)
            req.status = ReqStatus.RUNNING
            plan.items.append(PlanItem(req, req.computed_len, n))
            gate.add_leader(req)
            if req.retractions == 0:  # what the caller is told; re-admissions don't count
                req.cached_tokens = req.cached_len
            if req.retractions == 0 and req.priority != BACKGROUND:  # (a history precompute is no client's prompt)
                self.counters.prompt_tokens += req.prompt_len
                self.counters.cached_prompt_tokens += req.cached_tokens
                self.counters.cached_prompt_tokens_disk += min(req.disk_tokens, req.cached_tokens)

    def _schedule_decodes(self, plan: SchedulePlan) -> None:
        """One slot per decoding request; when memory runs out, retract from the least
        important end (lowest priority, newest) until the rest fit."""
        order = sorted(self.running, key=keep_key)
        i = 0
        while i < len(order):
            req = order[i]
            if req.extend_len != 1:
                i += 1
                continue
            if self.cache.alloc(req, 1):
                plan.items.append(PlanItem(req, req.computed_len, 1))
                i += 1
                continue
            victim = order.pop()
            self._retract(victim)

    def _draft(self, plan: SchedulePlan) -> None:
        """Speculative drafts for the items that sample an output token (decodes, and the
        extends that feed a pending token with the text jump-forward appended), within the
        step's row bound and where memory is free without evicting anything (drafted slots
        are given back after the step unless accepted)."""
        assert self.proposer is not None
        self.proposer.end_step()
        decodes = [it for it in plan.items if it.samples and it.start >= it.req.prompt_len]
        room = self.proposer.max_rows - plan.num_tokens
        for it in decodes:
            if room <= 0:
                break
            d = self.proposer.propose(it.req, len(decodes))
            if d is not None:
                del d.tokens[room:]
            if d is not None and self.cache.alloc(it.req, len(d.tokens), evict=False):
                room -= len(d.tokens)
                it.spec = d
                it.length += len(d.tokens)

    def _retract(self, req: Req) -> None:
        self.cache.release(req)
        self.running.remove(req)
        req.status = ReqStatus.WAITING
        req.retractions += 1
        self.waiting.append(req)
        self.counters.retractions += 1
        self.new_token_ratio = self.cfg.init_new_token_ratio

    # -- results ----------------------------------------------------------------------------
    def process(self, plan: SchedulePlan, accepted: list[int] | None = None, kept: list[int] | None = None) -> None:
        """Advance each item past the tokens it fed, and cache what a prefill computed (the
        sampled tokens were appended by the post-processing stage: engine.postprocess). An item
        with a draft keeps the KV of its pending token and of the draft tokens that were kept
        (`kept`: the tokens the step appended, each draft token's KV then matches its token);
        the rest of its slots go back at once. `accepted`: draft tokens the model agreed with."""
        c = self.counters
        none = [0] * len(plan.items)
        for item, acc, k in zip(plan.items, accepted or none, kept or none):
            req = item.req
            if item.spec is not None:  # the pending token (after any forced ones) and the kept draft tokens
                base = item.length - len(item.draft)
                req.computed_len = item.start + base - 1 + max(k, 1)
                if base > 1:
                    c.prefill_tokens_computed += base
                self.cache.trim(req)
                c.spec_draft_tokens += len(item.draft)
                c.spec_accepted_tokens += acc
                c.spec_verifies += 1
                c.spec_emitted_tokens += k
                if item.spec.from_cache:
                    c.spec_cache_draft_tokens += len(item.draft)
                    c.spec_cache_accepted_tokens += acc
                c.decode_tokens += k
                assert self.proposer is not None
                self.proposer.observe(req, item.spec, acc)
                self.cache.slide(req)
                continue
            req.computed_len = item.start + item.length
            if item.is_decode:
                c.decode_tokens += 1
            else:
                c.prefill_tokens_computed += item.length
                if req.finish_reason is None:
                    self.cache.cache_prefix(req)  # reusable before the request finishes
            self.cache.slide(req)

    def reap(self) -> list[Req]:
        """Release every request that has a finish reason; returns them."""
        done = [r for r in self.waiting + self.running if r.finish_reason is not None]
        for req in done:
            self.cache.release(req)
            (self.running if req.status is ReqStatus.RUNNING else self.waiting).remove(req)
            req.status = ReqStatus.FINISHED
            self.counters.finished += 1
            if self.proposer is not None:
                self.proposer.release(req.rid)
        return done
