"""Sliding-window layers keep only their window's KV (a pool of their own): the allocator's two
pools, the radix cache's tombstones and window locks, the scheduler driving both with a fake
model that checks every KV row a step reads, and the engine's greedy output against one pool."""

from __future__ import annotations

import random

import pytest

from radixserve.cache.allocator import WindowedAllocator
from radixserve.cache.prefix import Namespace, NullPrefixCache
from radixserve.cache.radix import RadixCache
from radixserve.config import SchedConfig
from radixserve.request import Req, SamplingParams
from radixserve.sched.cache_manager import CacheManager
from radixserve.sched.scheduler import Scheduler

A = Namespace("a")


# -- the allocator -----------------------------------------------------------------------------
def test_each_page_in_use_holds_one_window_page_until_it_is_dropped():
    a = WindowedAllocator(16, 8, page_size=2)
    s = a.alloc(5)  # three pages, three window pages
    assert s is not None and len(s) == 6 and a.num_window_free == 2
    w = a.window_slots(s)
    assert len(set(w)) == 6 and all(0 <= x < 8 for x in w) and w[1] == w[0] + 1  # page offsets kept
    assert a.short(4) == (0, 2)  # two full pages are there, one window page is not
    assert a.alloc(4) is None and a.num_free == 10  # nothing taken
    a.drop_window(s[:2])
    assert a.num_window_free == 4 and not a.has_window(s[0]) and a.has_window(s[2])
    with pytest.raises(RuntimeError, match="dropped"):
        a.window_slots(s[:3])
    t = a.alloc(2)
    assert t is not None
    a.drop_window(t)
    a.move_window(s[2:4], t)  # t's page takes s's second window page over
    assert a.window_slots(t) == w[2:4] and not a.has_window(s[2])
    a.free(s + t)
    assert a.num_free == 16 and a.num_window_free == 8 and a.window_pages() == {}


# -- the radix cache ---------------------------------------------------------------------------
def test_a_match_is_cut_back_to_where_the_window_before_its_end_holds_window_kv():
    c = RadixCache(window=4)  # a query sees 3 positions before its own
    c.insert(A, list(range(20)), list(range(100, 120)))
    c.lock(c.match(A, list(range(10))).handle)  # splits at 10: [0, 10) and [10, 20)
    assert c.match(A, list(range(20))).length == 20
    c.match(A, list(range(10)))  # [0, 10) the most recently used
    dropped = c.evict_window(1)  # least recently used first: the node [10, 20)
    assert sorted(dropped) == list(range(110, 120))
    assert c.match(A, list(range(20))).length == 10  # [17, 20) lost its window KV; at 10 the window is whole
    assert c.match(A, list(range(20)), whole=True).length == 20  # a caller with the window itself adopts it all
    c.evict_window(1)
    assert c.match(A, list(range(20))).length == 0
    assert c.window_tokens == 0 and c.cached_tokens == 20
    c.check_integrity()


def test_a_match_resumes_a_window_past_a_tombstone():
    c = RadixCache(window=3)
    c.insert(A, list(range(6)), list(range(6)))
    c.evict_window(6)
    c.insert(A, list(range(12)), list(range(100, 112)), window_from=6)  # [6, 12) new, with window KV
    assert c.match(A, list(range(12))).length == 12  # 10 and 11 hold their window KV
    assert c.match(A, list(range(7))).length == 0  # position 5 does not: nothing before 6 is usable
    assert c.match(A, list(range(8))).length == 8
    c.check_integrity()


def test_window_locks_stay_exact_across_later_splits():
    c = RadixCache(window=5)  # locks cover [end - 4, end)
    c.insert(A, list(range(30)), list(range(30)))
    h = c.match(A, list(range(30))).handle
    c.lock(h)
    c.lock_window(h)  # splits at 26
    assert c.window_evictable_tokens == 26
    h2 = c.match(A, list(range(28))).handle  # a split inside the locked range
    c.lock(h2)
    c.lock_window(h2)  # covers [24, 28): a split at 24
    c.match(A, list(range(25)))  # and one more split
    assert c.window_evictable_tokens == 24
    assert len(c.evict_window(100)) == 24  # only [0, 24) loses its window KV
    c.unlock_window(h2)
    c.unlock(h2)
    c.unlock_window(h)
    c.unlock(h)
    assert c.window_evictable_tokens == 6 and c.locked_tokens == 0
    c.check_integrity()


def test_full_eviction_takes_tombstones_first_and_an_insert_revives_them():
    c = RadixCache(window=2)
    c.insert(A, [1, 2, 3], [10, 11, 12])
    c.insert(A, [7, 8, 9], [20, 21, 22])
    c.match(A, [1, 2, 3])  # [1, 2, 3] is the more recent
    c.evict_window(1)  # drops the least recent: [7, 8, 9]
    c.match(A, [7, 8, 9])  # now the most recent, but a tombstone
    assert sorted(c.evict(1)) == [20, 21, 22]
    c.evict_window(1)
    moved = []
    assert c.insert(A, [1, 2, 3, 4], [30, 31, 32, 33], window_from=1, on_revive=lambda src, dst: moved.append((src, dst))) == 3
    assert moved == [([31, 32], [11, 12])]  # from window_from on: the node was cut at 1
    assert c.match(A, [1, 2, 3, 4]).length == 4 and c.window_tokens == 3
    c.check_integrity()


# -- the scheduler with a fake model that checks every KV row it reads -------------------------
class _FakeKV:
    """What a model with sliding-window layers would find in the pools: each step writes, for
    every fed position, an identity of the tokens up to it into its full slot and its window
    slot, and checks that every row the step reads (the full prefix, the window before each
    query) holds its own position's identity."""

    def __init__(self, cache: CacheManager) -> None:
        self.cache = cache
        assert cache.windowed is not None and cache.window_tables is not None
        self.full: dict[int, tuple] = {}
        self.win: dict[int, tuple] = {}

    def step(self, s: Scheduler, rng: random.Random) -> None:
        plan = s.schedule()
        reach, tables = self.cache.reach, self.cache.window_tables
        assert tables is not None
        for it in plan.items:
            req, end = it.req, it.start + it.length
            slots = self.cache.slots(req)[:end]
            lo = max(0, it.start - reach)
            wslots = tables.slots(slots[lo:end])  # what ForwardBatch.from_plan asks: raises if one was dropped
            ident = [tuple(req.token_ids[: p + 1]) for p in range(end)]
            for p in range(it.start, end):
                self.full[slots[p]] = ident[p]
                self.win[wslots[p - lo]] = ident[p]
            for p in range(it.start):
                assert self.full[slots[p]] == ident[p], f"full KV of position {p} of {req.rid} is another's"
            for p in range(lo, it.start):
                assert self.win[wslots[p - lo]] == ident[p], f"window KV of position {p} of {req.rid} is another's"
        s.process(plan)
        for it in plan.items:
            if it.samples and it.req.finish_reason is None:
                it.req.append_token(rng.choice([5, 6]), {0}, 10000)
        s.reap()
        self.cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("share", [True, False])
def test_the_scheduler_keeps_every_window_a_query_reads_and_frees_the_rest(page_size, share):
    """Random requests over a few shared prompts, a window pool far smaller than the full one:
    window KV is dropped, matches are cut back, tombstones revived, requests retracted; no
    step ever reads a row that is not its own position's, and nothing leaks."""
    window = 6
    for seed in range(5):
        rng = random.Random(seed)
        prefix = RadixCache(page_size, window=window) if share else NullPrefixCache(page_size, window)
        cache = CacheManager(WindowedAllocator(256, 48, page_size), prefix)
        cfg = SchedConfig(chunked_prefill_size=8, max_running_requests=4)
        s = Scheduler(cfg, cache)
        kv = _FakeKV(cache)
        heads = [[rng.randrange(1, 4) for _ in range(rng.randint(4, 30))] for _ in range(3)]
        for _ in range(400):
            if rng.random() < 0.3:
                ids = rng.choice(heads)[: rng.randint(1, 30)] + [rng.randrange(1, 4) for _ in range(rng.randint(0, 12))]
                s.add(Req(ids, SamplingParams(), max_new_tokens=rng.randint(1, 20)))
            if s.has_work:
                kv.step(s, rng)
        for _ in range(2000):
            if not s.has_work:
                break
            kv.step(s, rng)
        assert not s.has_work
        assert cache.windowed is not None and cache.windowed.window.num_free + prefix.window_evictable_tokens == 48
        if share:
            assert prefix.cached_tokens > 0 and prefix.window_tokens < prefix.cached_tokens  # some window KV was dropped


# -- the engine --------------------------------------------------------------------------------
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    base = [rng.randrange(3, 300) for _ in range(40)]
    return [base + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 30))] for _ in range(6)]


def _run(path, **kw) -> tuple[list[list[int]], object]:
    from radixserve import Engine

    prompts = _prompts()
    with Engine(str(path), **kw) as e:
        first = [o.token_ids for o in e.generate(prompts, GREEDY)]
        again = [o.token_ids for o in e.generate(prompts[::-1], GREEDY)][::-1]  # from the cache, cut back where dropped
        e.check_integrity()
        return first + again, e.snapshot()


@pytest.fixture(scope="module")
def one_pool(tiny_models):
    return _run(tiny_models["Gemma3ForCausalLM"], kv_cache_tokens=512, disable_hybrid_swa_memory=True)


SMALL = dict(kv_cache_tokens=512, chunked_prefill_size=16, swa_full_tokens_ratio=0.05)


@pytest.mark.parametrize("kw", [SMALL, {**SMALL, "page_size": 4}, {**SMALL, "attention_backend": "torch_ref"},
                                {**SMALL, "speculative": "ngram"}, {**SMALL, "disable_radix_cache": True},
                                {**SMALL, "kv_cache_dtype": "int8"}],
                         ids=["pages1", "pages4", "torch_ref", "ngram", "no_radix", "int8"])
def test_a_window_pool_gives_the_greedy_tokens_of_one_pool(tiny_models, one_pool, kw):
    """Gemma 3 (window 8) over 41..69-token prompts sharing 40: the window pool holds 26..32
    tokens, so window KV is dropped and matches cut back; the tokens are those of one pool."""
    want, base = one_pool
    if kw.get("kv_cache_dtype") == "int8":
        want, base = _run(tiny_models["Gemma3ForCausalLM"], kv_cache_tokens=512, disable_hybrid_swa_memory=True,
                          kv_cache_dtype="int8")
    got, stats = _run(tiny_models["Gemma3ForCausalLM"], **kw)
    assert got == want
    assert 0 < stats.kv_window_total_slots <= 32 and stats.kv_pool_bytes < base.kv_pool_bytes / 2
    if not kw.get("disable_radix_cache"):
        assert 0 < stats.kv_window_cached_tokens < stats.kv_cached_tokens


def test_the_window_pool_is_sized_by_its_ratio_and_never_below_one_request(tiny_models):
    from radixserve import Engine

    with Engine(str(tiny_models["Gemma3ForCausalLM"]), kv_cache_tokens=4096, chunked_prefill_size=64) as e:
        s = e.snapshot()
        assert (s.kv_total_slots, s.kv_window_total_slots) == (4096, 2048)  # the default ratio, 0.5
        per_layer = s.kv_bytes_per_token // 3  # one full layer, two windowed ones
        assert s.kv_pool_bytes == 4096 * per_layer + 2048 * 2 * per_layer
    with Engine(str(tiny_models["Gemma3ForCausalLM"]), kv_cache_tokens=4096, chunked_prefill_size=1024,
                swa_full_tokens_ratio=0.01) as e:
        assert e.snapshot().kv_window_total_slots == 8 + 1024 + 2  # the window and a chunk, page-rounded
    with Engine(str(tiny_models["LlamaForCausalLM"]), kv_cache_tokens=4096) as e:
        assert e.snapshot().kv_window_total_slots == 0  # no sliding-window layers: one pool
