"""RadixCache on its own: unit behaviour, and a hypothesis state machine against a reference model."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radixserve.cache.allocator import SlotAllocator
from radixserve.cache.prefix import PUBLIC, Namespace
from radixserve.cache.radix import RadixCache

A, A_SALTED, B = Namespace("a"), Namespace("a", "s1"), Namespace("b")


def fill(cache: RadixCache, ns: Namespace, tokens: list[int], first_slot: int, public_len: int = 0) -> list[int]:
    slots = list(range(first_slot, first_slot + len(tokens)))
    dup = cache.insert(ns, tokens, slots, public_len)
    return slots[dup:]


def test_match_ending_inside_an_edge_splits_it_and_returns_its_slots() -> None:
    c = RadixCache()
    fill(c, A, [1, 2, 3, 4, 5], 100)
    m = c.match(A, [1, 2, 3, 9])
    assert (m.length, m.slots) == (3, [100, 101, 102])
    c.lock(m.handle)
    assert c.locked_tokens == 3 and c.evictable_tokens == 2  # the split left [4, 5] unlocked
    assert sorted(c.evict(10)) == [103, 104]
    assert c.match(A, [1, 2, 3, 4, 5]).length == 3
    c.check_integrity()


def test_insert_returns_the_length_already_cached() -> None:
    c = RadixCache()
    assert c.insert(A, [1, 2, 3], [10, 11, 12]) == 0
    assert c.insert(A, [1, 2, 3, 4], [20, 21, 22, 23]) == 3  # caller frees 20..22
    assert c.match(A, [1, 2, 3, 4]).slots == [10, 11, 12, 23]
    assert c.cached_tokens == 4


def test_namespaces_never_share_a_node_not_even_the_first_token() -> None:
    c = RadixCache()
    fill(c, A, [7, 8, 9], 0)
    assert c.match(B, [7, 8, 9]).length == 0
    assert c.match(A_SALTED, [7, 8, 9]).length == 0
    assert c.match(Namespace("a", None), [7, 8, 9]).length == 3
    assert c.insert(B, [7, 8, 9], [3, 4, 5]) == 0  # B gets its own copy
    assert c.cached_tokens == 6


def test_public_prefix_is_shared_only_between_requests_that_opt_in() -> None:
    c = RadixCache()
    fill(c, A, [1, 2, 3, 4, 5, 6], 0, public_len=4)  # [1..4] public, [5, 6] A's
    assert c.match(B, [1, 2, 3, 4, 5, 6], public_len=4).length == 4  # B opts in: public part only
    assert c.match(B, [1, 2, 3, 4, 5, 6]).length == 0  # B does not opt in
    assert c.match(A, [1, 2, 3, 4, 5, 6]).length == 0  # nor does this request of A's
    assert c.match(A, [1, 2, 3, 4, 5, 6], public_len=4).length == 6
    assert c.match(B, [1, 2, 3, 4, 5, 6], public_len=6).length == 4  # A's private tokens stay A's
    c.check_integrity()


def test_locked_paths_are_never_evicted_and_lru_goes_first() -> None:
    c = RadixCache()
    fill(c, A, [1, 1, 1], 0)
    fill(c, A, [2, 2, 2], 10)
    fill(c, A, [3, 3, 3], 20)
    c.match(A, [1, 1, 1])  # touch: [2, 2, 2] is now the least recently used
    m3 = c.match(A, [3, 3, 3])
    c.lock(m3.handle)
    assert c.evict(1) == [10, 11, 12]
    assert c.evict(100) == [0, 1, 2]  # [3, 3, 3] is locked
    c.unlock(m3.handle)
    assert c.evict(100) == [20, 21, 22]
    assert c.cached_tokens == 0
    c.check_integrity()


def test_priority_eviction_takes_low_priority_prefixes_first() -> None:
    c = RadixCache(eviction="priority")
    c.insert(A, [1, 1], [0, 1], priority=5)
    c.insert(A, [2, 2], [2, 3], priority=0)
    c.match(A, [2, 2])  # more recent, but lower priority
    assert c.evict(2) == [2, 3]


def test_tenant_over_quota_is_evicted_before_a_hot_tenant_within_quota() -> None:
    c = RadixCache(quotas={"b": 4})
    fill(c, A, [9] * 6, 0)  # A's old system prompt: the LRU victim without quotas
    for i in range(3):
        fill(c, B, [i] * 3, 100 + 10 * i)  # B holds 9 tokens > its quota of 4
    freed = c.evict(3)
    assert freed == [100, 101, 102]  # B's oldest leaf, not A's older prompt
    assert c.evict(3) == [110, 111, 112]  # B is still over quota (6 > 4)
    assert c.evict(3) == [0, 1, 2, 3, 4, 5]  # B within quota: plain LRU again
    c.check_integrity()


def test_pages_cache_whole_pages_and_key_children_by_their_first_page() -> None:
    c = RadixCache(page_size=2)
    with pytest.raises(ValueError, match="page size"):
        c.insert(A, [1, 2, 3], [0, 1, 2])
    c.insert(A, [1, 2, 3, 4], [0, 1, 2, 3])
    assert c.match(A, [1, 2, 3, 9]).length == 2  # the partial page [3] does not count
    assert c.match(A, [1, 2, 3]).length == 2
    assert c.insert(A, [1, 2, 3, 5], [10, 11, 12, 13]) == 2  # [3, 5] is a different first page
    assert c.match(A, [1, 2, 3, 5]).slots == [0, 1, 12, 13]
    c.check_integrity()


def test_reset_is_refused_while_locked_and_returns_every_slot() -> None:
    c = RadixCache()
    fill(c, A, [1, 2, 3], 0)
    m = c.match(A, [1, 2])
    c.lock(m.handle)
    with pytest.raises(RuntimeError, match="locked"):
        c.reset()
    c.unlock(m.handle)
    assert sorted(c.reset()) == [0, 1, 2]
    assert c.cached_tokens == 0 and c.match(A, [1, 2]).length == 0


def test_integrity_check_catches_a_slot_held_twice() -> None:
    c = RadixCache()
    fill(c, A, [1, 2], 0)
    fill(c, B, [1, 2], 0)  # same slots in two namespaces: a caller bug
    with pytest.raises(RuntimeError, match="two cached tokens"):
        c.check_integrity()


# -- property test: random operations against a reference model ------------------------------

NAMESPACES = [A, A_SALTED, B]
tokens_st = st.lists(st.integers(0, 3), max_size=12)
ns_st = st.sampled_from(NAMESPACES)
public_st = st.sampled_from([0, 0, 2, 4])


class RadixMachine(RuleBasedStateMachine):
    """Reference: every cached position is identified by its path (namespace of each position,
    token ids) and maps to the slot first offered for it; eviction removes leaves only, so the
    reference stays prefix-closed and the cache must agree with it exactly."""

    page_size = 1
    pool = 48

    @initialize()
    def setup(self) -> None:
        self.alloc = SlotAllocator(self.pool, self.page_size)
        self.cache = RadixCache(self.page_size, quotas={"b": 6})
        self.ref: dict[tuple, int] = {}
        self.locks: list[tuple[object, list[int]]] = []

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _path(self, ns: Namespace, tokens: list[int], public_len: int, i: int) -> tuple:
        """Position i's identity: the path (namespace and token of each position) to the end
        of its page, and its offset in the page."""
        p, end = self._aligned(public_len), i - i % self.page_size + self.page_size
        return tuple((PUBLIC if j < p else ns, tokens[j]) for j in range(end)), i % self.page_size

    def _expected(self, ns: Namespace, tokens: list[int], public_len: int) -> int:
        n = 0
        while n + self.page_size <= len(tokens) and all(
            self._path(ns, tokens, public_len, j) in self.ref for j in range(n, n + self.page_size)
        ):
            n += self.page_size
        return n

    @rule(ns=ns_st, tokens=tokens_st, public_len=public_st)
    def insert(self, ns: Namespace, tokens: list[int], public_len: int) -> None:
        tokens = tokens[: self._aligned(len(tokens))]
        slots = self.alloc.alloc(len(tokens))
        if slots is None:
            self.evict(len(tokens) - self.alloc.num_free)
            slots = self.alloc.alloc(len(tokens))
            if slots is None:
                return
        expected = self._expected(ns, tokens, public_len)
        dup = self.cache.insert(ns, tokens, slots, public_len)
        assert dup == expected
        self.alloc.free(slots[:dup])
        for j in range(dup, len(tokens)):
            self.ref[self._path(ns, tokens, public_len, j)] = slots[j]

    @rule(ns=ns_st, tokens=tokens_st, public_len=public_st, lock=st.booleans())
    def match(self, ns: Namespace, tokens: list[int], public_len: int, lock: bool) -> None:
        m = self.cache.match(ns, tokens, public_len)
        assert m.length == self._expected(ns, tokens, public_len)
        assert m.slots == [self.ref[self._path(ns, tokens, public_len, j)] for j in range(m.length)]
        if lock:
            self.cache.lock(m.handle)
            self.locks.append((m.handle, m.slots))

    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        if self.locks:
            handle, _ = self.locks.pop(i % len(self.locks))
            self.cache.unlock(handle)

    @rule(n=st.integers(1, 20))
    def evict(self, n: int) -> None:
        evictable = self.cache.evictable_tokens
        freed = self.cache.evict(n)
        assert len(freed) >= min(n, evictable) or len(freed) == evictable
        locked = {s for _, slots in self.locks for s in slots}
        assert not locked & set(freed), "a locked token was evicted"
        self.alloc.free(freed)
        gone = set(freed)
        self.ref = {k: s for k, s in self.ref.items() if s not in gone}
        ps = self.page_size
        assert all(len(p) == ps or (p[:-ps], 0) in self.ref for p, _ in self.ref), "eviction left a hole"

    @invariant()
    def accounting(self) -> None:
        if not hasattr(self, "cache"):
            return
        held = self.cache.check_integrity()
        assert self.alloc.num_free + self.cache.cached_tokens == self.alloc.size  # nothing in use by requests
        ps = self.page_size
        cached_pages = {s // ps for s in held}
        assert not cached_pages & self.alloc.free_pages(), "a page is both free and cached"
        assert len(cached_pages) + len(self.alloc.free_pages()) == self.alloc.size // ps
        assert self.cache.cached_tokens == len(self.ref)
        assert self.cache.locked_tokens == len({s for _, slots in self.locks for s in slots})


class PagedRadixMachine(RadixMachine):
    page_size = 2


TestRadixAgainstReference = RadixMachine.TestCase
TestRadixAgainstReference.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPagedRadixAgainstReference = PagedRadixMachine.TestCase
TestPagedRadixAgainstReference.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_public_tokens_count_against_the_quota_of_the_tenant_that_inserted_them():
    c = RadixCache(quotas={"a": 10})
    fill(c, B, list(range(50)), 0)  # b's hot prompt, within its (absent) quota
    for i in range(5):
        fill(c, A, [100 + i] * 20, 100 + 20 * i, public_len=20)  # a floods the public namespace
    assert c.tenant_tokens["a"] == 100
    freed = c.evict(20)
    assert all(s >= 100 for s in freed) and c.match(B, list(range(50))).length == 50
