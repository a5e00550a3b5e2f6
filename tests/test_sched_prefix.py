"""The scheduler with the radix cache and a fake model (pure Python, fast): sibling
deduplication, mid-prompt reuse, lpm ordering, eviction before retraction, no leaks."""

from __future__ import annotations

import random

import pytest

from radixserve.cache.allocator import SlotAllocator
from radixserve.cache.prefix import NullPrefixCache
from radixserve.cache.radix import RadixCache
from radixserve.config import SchedConfig
from radixserve.request import Req, SamplingParams
from radixserve.sched.cache_manager import CacheManager
from radixserve.sched.scheduler import Scheduler
from radixserve.sched.siblings import SiblingGate


def _sched(pool: int, page_size: int = 1, cache: bool = True, context_cost: float = 0.0, **kw) -> Scheduler:
    cfg = SchedConfig(**{"chunked_prefill_size": 256, **kw})
    prefix = RadixCache(page_size) if cache else NullPrefixCache(page_size)
    return Scheduler(cfg, CacheManager(SlotAllocator(pool, page_size), prefix), context_cost=context_cost)


def _fake_model(s: Scheduler, plan) -> None:
    """What the engine does after a step of a fake model that always samples token 9 (EOS is 0)."""
    s.process(plan)
    for it in plan.items:
        if it.samples and it.req.finish_reason is None:
            it.req.append_token(9, {0}, 10000)


def _step(s: Scheduler) -> None:
    """One iteration with a fake model that always emits token 9."""
    plan = s.schedule()
    _fake_model(s, plan)
    s.reap()
    s.cache.check_integrity()


def _drive(s: Scheduler, steps: int = 5000) -> None:
    n = 0
    while s.has_work and n < steps:
        _step(s)
        n += 1
    assert not s.has_work, "the scheduler did not finish its work"


def _fork(n: int, prefix_len: int, seed: int = 0) -> tuple[list[int], list[Req]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 300) for _ in range(prefix_len)]
    reqs = [Req(prefix + [rng.randrange(1, 300) for _ in range(rng.randint(5, 20))], SamplingParams(), max_new_tokens=8)
            for _ in range(n)]
    return prefix, reqs


@pytest.mark.parametrize("page_size", [1, 4])
def test_sixteen_siblings_sent_together_compute_the_shared_prompt_once(page_size):
    s = _sched(pool=8192, page_size=page_size)
    prefix, reqs = _fork(16, 1000)
    for r in reqs:
        s.add(r)
    _drive(s)
    suffixes = sum(r.prompt_len - len(prefix) for r in reqs)
    assert s.counters.prefill_tokens_computed <= len(prefix) + suffixes + 16 * page_size
    assert all(r.output_len == 8 for r in reqs)
    assert sum(r.cached_tokens > 0 for r in reqs) == 15  # every sibling but the leader hit
    assert s.cache.in_use() == 0


def test_without_a_cache_every_sibling_computes_the_prompt():
    s = _sched(pool=8192, cache=False)
    prefix, reqs = _fork(16, 1000)
    for r in reqs:
        s.add(r)
    _drive(s)
    assert s.counters.prefill_tokens_computed == sum(r.prompt_len for r in reqs)


def test_siblings_are_held_only_when_a_cache_can_serve_them():
    for cache in (True, False):
        s = _sched(pool=8192, cache=cache)
        _, reqs = _fork(3, 1000)
        for r in reqs:
            s.add(r)
        _step(s)  # the first request takes the whole 256-token budget
        gate = SiblingGate(s.cache, s.running)
        assert gate.holds(reqs[1]) is cache


def test_a_chunked_prompt_is_reusable_before_its_request_finishes():
    s = _sched(pool=8192, chunked_prefill_size=100)
    rng = random.Random(3)
    prompt = [rng.randrange(1, 300) for _ in range(350)]
    first = Req(prompt, SamplingParams(), max_new_tokens=50)
    s.add(first)
    for _ in range(2):  # two chunks of 100 computed, the prompt is not done
        _step(s)
    assert s.cache.prefix.cached_tokens == 200
    late = Req(prompt[:300] + [7, 7], SamplingParams(), max_new_tokens=4)
    s.add(late)
    _drive(s)
    assert late.cached_tokens == 300  # it waited for the leader's third chunk, then hit all 300
    assert s.counters.prefill_tokens_computed == 350 + 2


def test_lpm_admits_the_request_with_the_longest_cached_prefix_first():
    s = _sched(pool=8192, schedule_policy="lpm", max_running_requests=1)
    rng = random.Random(5)
    warm = [rng.randrange(1, 300) for _ in range(200)]
    s.add(Req(warm, SamplingParams(), max_new_tokens=1))
    _drive(s)
    cold = Req([rng.randrange(1, 300) for _ in range(50)], SamplingParams(), max_new_tokens=1)
    hit = Req(warm + [5], SamplingParams(), max_new_tokens=1)
    s.add(cold)  # arrives first
    s.add(hit)
    _step(s)
    assert s.running == [hit] or hit.finish_reason is not None
    assert cold.cached_tokens == 0 and hit.cached_tokens == 200
    fcfs = _sched(pool=8192, max_running_requests=1)
    a, b = Req([1] * 5, SamplingParams()), Req([2] * 5, SamplingParams())
    fcfs.add(a)
    fcfs.add(b)
    fcfs.schedule()
    assert fcfs.running == [a]


def test_cached_leaves_are_evicted_before_any_running_request_is_retracted():
    s = _sched(pool=300, chunked_prefill_size=512)
    rng = random.Random(7)
    for _ in range(3):  # fill the cache with finished prompts
        s.add(Req([rng.randrange(1, 300) for _ in range(80)], SamplingParams(), max_new_tokens=1))
        _drive(s)
    assert s.cache.prefix.cached_tokens >= 240
    big = Req([rng.randrange(1, 300) for _ in range(150)], SamplingParams(), max_new_tokens=100)
    s.add(big)
    _drive(s)
    assert s.counters.retractions == 0 and big.output_len == 100
    assert s.cache.prefix.evicted_tokens > 0


def test_random_forks_under_memory_pressure_finish_without_leaks():
    s = _sched(pool=600, chunked_prefill_size=64, page_size=2)
    rng = random.Random(11)
    prefixes = [[rng.randrange(1, 300) for _ in range(rng.randint(20, 120))] for _ in range(4)]
    reqs = []
    for _ in range(60):
        p = rng.choice(prefixes) + [rng.randrange(1, 300) for _ in range(rng.randint(1, 30))]
        r = Req(p, SamplingParams(), priority=rng.randint(0, 2), max_new_tokens=rng.randint(1, 40),
                tenant=rng.choice([None, "t1"]), public_prefix_len=rng.choice([0, 0, 16]))
        reqs.append(r)
    for r in reqs[:30]:
        s.add(r)
    for _ in range(20):
        _step(s)
    for r in reqs[30:]:
        s.add(r)
    _drive(s)
    assert all(r.output_len == r.max_new_tokens for r in reqs)
    assert s.cache.in_use() == 0
    assert s.counters.cached_prompt_tokens > 0


def test_a_request_wanting_prompt_logprobs_is_not_held_for_a_prefix_it_cannot_use():
    s = _sched(pool=8192, chunked_prefill_size=64)
    _, reqs = _fork(2, 500)
    s.add(reqs[0])
    _step(s)  # the leader is prefilling the shared prompt
    wants_logprobs = Req(reqs[1].token_ids, SamplingParams(logprob_start_len=0), max_new_tokens=2)
    gate = SiblingGate(s.cache, s.running)
    assert gate.holds(reqs[1]) and not gate.holds(wants_logprobs)


def test_admission_counts_the_prefix_it_locks_as_used_memory():
    s = _sched(pool=200, chunked_prefill_size=512)
    rng = random.Random(13)
    prefix = [rng.randrange(1, 300) for _ in range(101)]
    s.add(Req(prefix + [1], SamplingParams(), max_new_tokens=1))
    _drive(s)
    a = Req(prefix + [rng.randrange(1, 300) for _ in range(10)], SamplingParams(), max_new_tokens=70)
    b = Req([rng.randrange(1, 300) for _ in range(60)], SamplingParams(), max_new_tokens=20)
    s.add(a)
    s.add(b)
    _drive(s)
    assert s.counters.retractions == 0 and a.output_len == 70 and b.output_len == 20


def test_a_request_rolled_back_at_admission_reports_no_cached_tokens():
    s = _sched(pool=120, chunked_prefill_size=512, init_new_token_ratio=1.0)
    prompt = list(range(1, 41))
    s.add(Req(prompt, SamplingParams(), max_new_tokens=1))
    _drive(s)  # prompt cached
    hog = Req(list(range(100, 160)), SamplingParams(), max_new_tokens=50)
    s.add(hog)
    _step(s)
    late = Req(prompt + [7], SamplingParams(), max_new_tokens=60)
    s.add(late)
    _step(s)  # matched 40 cached tokens, but does not fit beside the hog: rolled back
    assert late in s.waiting
    s.abort(late.rid)
    s.reap()
    assert late.cached_tokens == 0


def test_prefixes_held_for_waiting_requests_never_block_the_head_of_the_queue():
    """A prefix the disk tier put back is held for its request until it is admitted; when that
    hold leaves the request at the head of the queue no room with nothing running, the holds go."""
    s = _sched(pool=200)
    head = Req(list(range(1, 151)), SamplingParams(), max_new_tokens=8)
    back = Req(list(range(300, 420)) + [7, 8], SamplingParams(), max_new_tokens=8)
    s.add(head)
    assert s.cache.adopt(back, 120, lambda at, slots: None) == 120  # 120 slots locked for `back`
    s.add(back)
    _drive(s)
    assert head.finish_reason is not None and back.finish_reason is not None
    assert s.cache.allocator.num_used == s.cache.prefix.cached_tokens  # nothing held, nothing leaked


def test_one_tenants_long_prompts_do_not_hold_another_tenants_request_behind_their_chunks():
    """Issue 44's abuse bench: tenant A's max-context prompts, chunk after chunk, kept tenant B's
    short chat waiting until A stopped (B's requests timed out). B's request now starts the step
    after it arrives, with A's chunk beside it; two long prompts split the budget."""
    s = _sched(pool=65536, chunked_prefill_size=256, shared_prefill_size=256)
    rng = random.Random(5)
    longs = [Req([rng.randrange(1, 300) for _ in range(4000)], SamplingParams(), max_new_tokens=4, tenant="a")
             for _ in range(3)]
    for r in longs:
        s.add(r)
    _step(s)
    _step(s)
    assert longs[0].computed_len == 512 and not any(r.computed_len for r in longs[1:])  # A's prompts, one at a time
    short = Req([rng.randrange(1, 300) for _ in range(40)], SamplingParams(), max_new_tokens=4, tenant="b")
    s.add(short)
    plan = s.schedule()
    fed = {it.req.tenant: it.length for it in plan.items}
    assert fed == {"b": 40, "a": 256 - 40}, fed  # B admitted at once, A's chunk beside it
    _fake_model(s, plan)
    s.reap()
    other = Req([rng.randrange(1, 300) for _ in range(3000)], SamplingParams(), max_new_tokens=4, tenant="c")
    s.add(other)
    _step(s)  # C's long prompt starts within half the budget
    plan = s.schedule()
    chunks = {it.req.tenant: it.length for it in plan.items if it.length > 1}
    assert chunks == {"a": 128, "c": 128}, chunks  # the budget split evenly
    _fake_model(s, plan)
    s.reap()
    _drive(s)
    assert all(r.finish_reason is not None for r in [*longs, short, other])


def test_a_step_prefills_at_most_the_shared_size_while_tenants_share_the_engine():
    """A step lasts as long as its prefill: beside another tenant's decodes it is short."""
    s = _sched(pool=65536, chunked_prefill_size=1024, shared_prefill_size=128)
    rng = random.Random(6)
    long = Req([rng.randrange(1, 300) for _ in range(3000)], SamplingParams(), max_new_tokens=4, tenant="a")
    s.add(long)
    _step(s)
    assert long.computed_len == 1024  # alone: the whole chunk
    chat = Req([rng.randrange(1, 300) for _ in range(30)], SamplingParams(), max_new_tokens=50, tenant="b")
    s.add(chat)
    for _ in range(5):
        plan = s.schedule()
        assert sum(it.length for it in plan.items if not it.is_decode) <= 128, plan.items
        _fake_model(s, plan)
        s.reap()
    assert chat.output_len == 5 and long.computed_len > 1024
    _drive(s)


def test_while_tenants_share_a_chunk_is_costed_with_its_attention_over_the_context():
    """A chunk's attention grows with its context: 128 tokens after 8k cost SmolLM2 about 8 times
    what they cost after none. While tenants share the engine a step's prefill is
    shared_prefill_size token-equivalents (PrefillAdder.cost), so the step stays short."""
    s = _sched(pool=65536, chunked_prefill_size=4096, shared_prefill_size=128, context_cost=1024.0)
    rng = random.Random(7)
    long = Req([rng.randrange(1, 300) for _ in range(12000)], SamplingParams(), max_new_tokens=4, tenant="a")
    s.add(long)
    _step(s)
    _step(s)
    assert long.computed_len == 8192  # alone: whole chunks, whatever they cost
    chat = Req([rng.randrange(1, 300) for _ in range(30)], SamplingParams(), max_new_tokens=200, tenant="b")
    s.add(chat)
    for _ in range(20):
        plan = s.schedule()
        chunk = next(it for it in plan.items if it.req is long)
        cost = chunk.length * (1 + (chunk.start + chunk.length) / 1024)
        assert 1 <= chunk.length <= 128 * 1024 // chunk.start and cost <= 128 + 1 + chunk.start / 1024, chunk
        _fake_model(s, plan)
        s.reap()
    assert chat.output_len == 20 and long.computed_len > 8192 + 20  # both move: B decodes, A's prompt goes on
    _drive(s)
    assert long.finish_reason is not None


def test_a_context_too_long_for_the_shared_budget_still_moves_a_token_a_step():
    s = _sched(pool=65536, chunked_prefill_size=4096, shared_prefill_size=16, context_cost=64.0)
    rng = random.Random(8)
    long = Req([rng.randrange(1, 300) for _ in range(5000)], SamplingParams(), max_new_tokens=1, tenant="a")
    s.add(long)
    _step(s)
    chat = Req([rng.randrange(1, 300) for _ in range(10)], SamplingParams(), max_new_tokens=100, tenant="b")
    s.add(chat)
    _step(s)
    before = long.computed_len
    for _ in range(5):
        _step(s)
    assert long.computed_len == before + 5  # 1 token a step: 16 token-equivalents buy less than one at 4k context


def test_siblings_are_not_held_a_step_for_a_few_shared_tokens():
    """Held siblings wait a whole step, a tenth of a second beside another tenant's long prompt:
    worth it for a shared prompt, not for the two tokens "Request 1" shares with "Request 2"."""
    s = _sched(pool=4096)
    rng = random.Random(9)
    head = [rng.randrange(1, 300) for _ in range(8)]
    few = [Req(head + [rng.randrange(1, 300) for _ in range(20)], SamplingParams(), max_new_tokens=2) for _ in range(4)]
    for r in few:
        s.add(r)
    plan = s.schedule()
    assert {it.req.rid for it in plan.items} == {r.rid for r in few}  # all four at once
    _fake_model(s, plan)
    s.reap()
    _drive(s)


def test_a_tenant_between_requests_still_shares_the_engine_for_a_few_steps():
    """Issue 44's abuse bench: B's chats all finished in one step and its next ones came a few ms
    later, into a full 1,024-token chunk of A's 8k prompt (2 s): B's first token waited for it."""
    s = _sched(pool=65536, chunked_prefill_size=1024, shared_prefill_size=64)
    rng = random.Random(10)
    long = Req([rng.randrange(1, 300) for _ in range(20000)], SamplingParams(), max_new_tokens=1, tenant="a")
    chat = Req([rng.randrange(1, 300) for _ in range(20)], SamplingParams(), max_new_tokens=3, tenant="b")
    s.add(long)
    s.add(chat)
    while chat.finish_reason is None:
        _step(s)
    fed = []
    for _ in range(20):
        plan = s.schedule()
        fed.append(sum(it.length for it in plan.items))
        _fake_model(s, plan)
        s.reap()
    assert fed[:16] == [64] * 16 and fed[17:] == [1024] * 3, fed  # shared for 16 steps more, then A's own again
