"""The routing policies (pure Python): prefix affinity keyed by namespace, SGLang's load-balance
override, prompt_cache_key stickiness, the index's LRU cutting chains from their ends, and the
baselines the benchmark compares against."""

from __future__ import annotations

import pytest

from radixserve.cache.prefix import Namespace
from radixserve.config import RouterConfig
from radixserve.routing import PrefixIndex, RouteKey, block_hashes, make_router

A, B = Namespace("acme", None), Namespace("beta", None)
PROMPT = list(range(1000, 1640))  # 40 blocks of 16 tokens


def _route(router, keys, loads=None, busy=True):
    """Each key in turn; a chosen replica's load grows by one (the requests stay in flight)."""
    loads = dict(loads or {0: 0, 1: 0})
    out = []
    for k in keys:
        r = router.choose(k, loads)
        loads[r] += busy
        out.append(r)
    return out


def test_forks_of_one_prompt_follow_the_first_to_one_replica_and_another_tenant_goes_elsewhere():
    router = make_router(RouterConfig())
    forks = [RouteKey(A, PROMPT + [7, i]) for i in range(8)]
    placed = _route(router, forks + [RouteKey(B, PROMPT)])
    assert len(set(placed[:8])) == 1, placed
    assert placed[8] != placed[0], "the same tokens in another namespace match nothing: it goes to the emptiest replica"
    assert router.decisions == {"fresh": 2, "prefix": 7}


def test_round_robin_and_random_spread_the_forks_over_both_replicas():
    for policy in ("round_robin", "random"):
        placed = _route(make_router(RouterConfig(router_policy=policy)), [RouteKey(A, PROMPT + [i]) for i in range(8)])
        assert set(placed) == {0, 1}, (policy, placed)
    assert _route(make_router(RouterConfig(router_policy="least_loaded")), [RouteKey(A, PROMPT)] * 4) == [0, 1, 0, 1]


def test_unbalanced_load_overrides_affinity_by_both_thresholds():
    router = make_router(RouterConfig(router_balance_abs_threshold=4, router_balance_rel_threshold=2.0))
    first = router.choose(RouteKey(A, PROMPT), {0: 0, 1: 0})
    other = 1 - first
    assert router.choose(RouteKey(A, PROMPT), {first: 6, other: 3}) == first, "6 - 3 is within the absolute threshold"
    assert router.choose(RouteKey(A, PROMPT), {first: 30, other: 20}) == first, "30 is under 2x 20"
    assert router.choose(RouteKey(A, PROMPT), {first: 30, other: 5}) == other, "unbalanced by both: the least loaded"
    assert router.decisions["balance"] == 1


def test_a_short_match_below_the_cache_threshold_goes_to_the_emptiest_replica():
    router = make_router(RouterConfig(router_cache_threshold=0.5))
    first = router.choose(RouteKey(A, PROMPT[:160]), {0: 0, 1: 0})  # 10 blocks recorded
    longer = PROMPT[:160] + list(range(5000, 5480))  # shares 10 of its 40 blocks: 25%
    assert router.choose(RouteKey(A, longer), {0: 0, 1: 0}) == 1 - first
    assert router.choose(RouteKey(A, PROMPT[:160] + [1]), {0: 0, 1: 0}) == first


def test_a_prompt_cache_key_sticks_to_its_replica_even_with_different_prompts():
    router = make_router(RouterConfig())
    keys = [RouteKey(A, [i] * 64, hint="agent-7") for i in range(6)]
    assert len(set(_route(router, keys, busy=False))) == 1
    assert router.decisions["hint"] == 5
    elsewhere = router.choose(RouteKey(B, [0] * 64, hint="agent-7"), {0: 0, 1: 0})  # another tenant's same key: its own
    assert router.decisions["hint"] == 5 and elsewhere in (0, 1)


def test_a_dead_replica_is_never_chosen_and_is_forgotten_cold():
    router = make_router(RouterConfig())
    first = router.choose(RouteKey(A, PROMPT), {0: 0, 1: 0})
    assert router.choose(RouteKey(A, PROMPT), {1 - first: 0}) == 1 - first, "only healthy replicas are offered"
    router.forget(first)
    assert router.index.size(first) == 0
    assert router.choose(RouteKey(A, PROMPT), {0: 0, 1: 0}) == 1 - first, "the surviving replica holds it now"


def test_text_prefixes_are_keyed_in_blocks_four_times_longer():
    router = make_router(RouterConfig())
    doc = "You are a careful agent. " * 40
    placed = _route(router, [RouteKey(A, doc + f"Question {i}?") for i in range(4)])
    assert len(set(placed)) == 1
    assert len(block_hashes(A, doc, 64, 1000)) == len(doc) // 64


def test_the_index_evicts_a_chain_from_its_end_and_per_replica():
    index = PrefixIndex(capacity=8)
    old, new = block_hashes(A, list(range(96)), 16, 100), block_hashes(A, list(range(500, 596)), 16, 100)
    index.insert(0, old)
    index.insert(1, old)
    index.insert(0, new)  # 12 blocks on replica 0: the 4 least recent go, the deepest of `old` first
    assert index.size(0) == 8 and index.size(1) == 6
    assert index.match(old, [0, 1]) == {0: 2, 1: 6}
    assert index.match(new, [0, 1]) == {0: 6, 1: 0}
    index.forget(0)
    assert index.match(old, [0, 1]) == {0: 0, 1: 6}


def test_namespaces_never_share_a_block_hash():
    assert not set(block_hashes(A, PROMPT, 16, 100)) & set(block_hashes(B, PROMPT, 16, 100))
    assert not set(block_hashes(A, PROMPT, 16, 100)) & set(block_hashes(Namespace("acme", "salt"), PROMPT, 16, 100))


@pytest.mark.parametrize("field,value", [("data_parallel", 0), ("router_policy", "nearest"), ("router_cache_threshold", 1.5),
                                         ("router_block_tokens", 0), ("router_balance_rel_threshold", 0.5)])
def test_bad_router_options_are_refused_naming_the_option(field, value):
    with pytest.raises(ValueError, match=field):
        make_router(RouterConfig(**{field: value}))
