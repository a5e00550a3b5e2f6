"""The radix cache inside the engine on a tiny real model: same greedy outputs with the cache
on and off, forks computing the shared prompt once, tenant isolation, quotas, flush, stats."""

from __future__ import annotations

import asyncio
import random

import pytest
from helpers import assert_no_leak

from radixserve import Engine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


@pytest.fixture(scope="module")
def engines(tiny_llama):
    kw = dict(kv_cache_tokens=16384, chunked_prefill_size=64)
    with Engine(str(tiny_llama), **kw) as on, Engine(str(tiny_llama), disable_radix_cache=True, **kw) as off:
        yield on, off


def test_greedy_outputs_are_identical_with_the_cache_on_and_off(engines):
    on, off = engines
    on.flush_cache()
    system = _ids(300, seed=1)  # 5 chunks of 64: chunked prefill, then reuse
    single = _ids(40, seed=2)
    forks = [system + _ids(5 + i, seed=10 + i) for i in range(6)]
    for prompts in ([single], [single], [system + [7]], forks, forks[::-1]):
        got = [o.token_ids for o in on.generate(prompts, GREEDY)]
        want = [o.token_ids for o in off.generate(prompts, GREEDY)]
        assert got == want
    s = on.stats()
    assert s.cached_prompt_tokens > 0 and s.prefill_tokens_computed < off.stats().prefill_tokens_computed
    assert_no_leak(on)
    assert_no_leak(off)


def test_sixteen_forks_sent_together_compute_the_shared_prefix_once(engines):
    on, _ = engines
    on.flush_cache()
    prefix = _ids(1000, seed=3)
    prompts = [prefix + _ids(4 + i, seed=100 + i) for i in range(16)]
    before = on.stats().prefill_tokens_computed
    outs = on.generate(prompts, GREEDY)
    computed = on.stats().prefill_tokens_computed - before
    assert computed <= 1000 + sum(len(p) - 1000 for p in prompts) + 16  # + one page per request
    assert sum(o.cached_tokens >= 1000 for o in outs) == 15  # all but the one that computed it
    assert_no_leak(on)


def test_the_same_prompt_is_shared_within_a_namespace_only(engines):
    on, _ = engines
    on.flush_cache()
    p = _ids(200, seed=4)

    def cached(**ns) -> int:
        return on.generate([p], GREEDY, **ns)[0].cached_tokens

    assert cached(tenant="a") == 0
    assert cached(tenant="b") == 0  # another tenant never hits A's copy
    assert cached(tenant="a") == 199  # same tenant, no salt: a hit
    assert cached(tenant="a", cache_salt="s1") == 0  # a different salt is a different namespace
    assert cached(tenant="a", cache_salt="s1") == 199
    assert cached() == 0  # the default tenant is a tenant of its own
    assert_no_leak(on)


def test_the_public_prefix_is_shared_only_when_both_sides_opt_in(engines):
    on, _ = engines
    on.flush_cache()
    system, q = _ids(120, seed=5), _ids(30, seed=6)
    on.generate([system + q], GREEDY, tenant="a", public_prefix_len=120)
    assert on.generate([system + q], GREEDY, tenant="b")[0].cached_tokens == 0  # B did not opt in
    hit = on.generate([system + q], GREEDY, tenant="b", public_prefix_len=120)[0]
    assert hit.cached_tokens == 120  # the public part only: A's question stays A's
    on.generate([system + q], GREEDY, tenant="c")  # C's prompt, not marked public
    assert on.generate([system + q], GREEDY, tenant="d", public_prefix_len=150)[0].cached_tokens == 120
    assert_no_leak(on)


@pytest.mark.parametrize("quota", [True, False])
def test_a_tenant_flooding_unique_prompts_cannot_flush_anothers_hot_prompt(tiny_llama, quota):
    quotas = {"a": 2000, "b": 300} if quota else {}
    with Engine(str(tiny_llama), kv_cache_tokens=1200, tenant_max_cached_tokens=quotas) as e:
        hot = _ids(400, seed=7)
        e.generate([hot + [5]], GREEDY, tenant="a")
        for i in range(8):  # 8 x ~216 tokens of unique prompts through a 1,200-token pool
            e.generate([_ids(200, seed=50 + i)], GREEDY, tenant="b")
        again = e.generate([hot + [6]], GREEDY, tenant="a")[0].cached_tokens
        assert e.stats().evicted_tokens > 0
        assert (again == 400) is quota
        assert_no_leak(e)


def test_flush_cache_is_refused_while_requests_run_then_empties_the_cache(engines):
    on, _ = engines
    p = _ids(100, seed=8)
    on.generate([p], GREEDY)

    async def run() -> None:
        stream = on.submit(p, SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True))
        await stream.__anext__()
        with pytest.raises(RuntimeError, match="flush_cache: refused while"):
            on.flush_cache()
        async for _ in stream:
            pass

    asyncio.run(run())
    assert_no_leak(on)
    assert on.flush_cache() > 0
    s = on.stats()
    assert s.kv_cached_tokens == 0 and s.kv_free_slots == s.kv_total_slots
    assert on.generate([p], GREEDY)[0].cached_tokens == 0


def test_stats_report_hit_rate_and_cache_occupancy(tiny_llama):
    with Engine(str(tiny_llama), kv_cache_tokens=4096) as e:
        p = _ids(100, seed=9)
        e.generate([p], GREEDY)
        e.generate([p], GREEDY)
        s = e.stats()
        assert s.prompt_tokens == 200 and s.cached_prompt_tokens == 99
        assert s.cache_hit_rate == pytest.approx(99 / 200)
        assert s.kv_cached_tokens == s.kv_evictable_tokens > 100 and s.kv_locked_tokens == 0
        assert s.prefill_tokens_computed == 101


def test_namespace_arguments_are_validated(engines):
    on, _ = engines
    with pytest.raises(ValueError, match="public_prefix_len"):
        on.make_req([5, 6, 7], public_prefix_len=4)
    with pytest.raises(ValueError, match="tenant"):
        on.make_req([5, 6, 7], tenant="")
    with pytest.raises(ValueError, match="cache_salt"):
        on.make_req([5, 6, 7], cache_salt=3)  # type: ignore[arg-type]


def test_a_paged_cache_shares_whole_pages_and_keeps_greedy_outputs(engines, tiny_llama):
    _, off = engines
    system = _ids(203, seed=12)
    prompts = [system + _ids(3 + i, seed=200 + i) for i in range(5)]
    want = [o.token_ids for o in off.generate(prompts, GREEDY)]
    with Engine(str(tiny_llama), kv_cache_tokens=4096, chunked_prefill_size=64, page_size=4) as paged:
        before = paged.stats().prefill_tokens_computed
        outs = paged.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == want
        assert all(o.cached_tokens % 4 == 0 for o in outs)
        assert sum(o.cached_tokens == 200 for o in outs) == 4  # 203 tokens shared: 50 whole pages
        computed = paged.stats().prefill_tokens_computed - before
        assert computed <= 203 + sum(len(p) - 203 for p in prompts) + 5 * 4
        assert_no_leak(paged)
