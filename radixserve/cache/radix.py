"""RadixCache: a radix tree from token ids to KV slots, shared across requests. Pure Python.

Every node but the root belongs to one namespace and holds one edge: its `key` tokens and
their KV `slots`. Children are keyed by (namespace, first page of the edge), so two
namespaces never share a node, not even the first token. A public prefix is a path of PUBLIC
nodes from the root; each namespace's private continuation hangs below it:

    root ─┬─ (A) [system prompt] ─┬─ (A) [question 1 ...]
          │                       └─ (A) [question 2 ...]
          ├─ (B) [system prompt]                 B's copy: B never reaches A's nodes
          └─ (PUBLIC) [tool specs] ─┬─ (A) [...]  public_len = len(tool specs)
                                    └─ (B) [...]

NOTE: lock counts are path counts: locking a node adds one to it and to every ancestor, so
`lock_ref(parent) >= lock_ref(child)` and a node is evictable iff `lock_ref == 0`. Only
leaves are evicted; a parent becomes a leaf (and a candidate) when its last child goes.
A split keeps the lower half as the original node object, so handles stay valid.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from radixserve.cache.prefix import PUBLIC, Namespace, PrefixCache, PrefixMatch, common_prefix_len


class Node:
    __slots__ = ("ns", "owner", "key", "slots", "parent", "children", "lock_ref", "last_access", "priority")

    def __init__(self, ns: Namespace, key: list[int], slots: list[int], parent: Node | None, owner: str | None = None) -> None:
        self.ns = ns
        self.owner = owner  # the tenant charged for these tokens (for PUBLIC nodes: whoever inserted them)
        self.key = key
        self.slots = slots
        self.parent = parent
        self.children: dict[tuple[Namespace, Any], Node] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.priority = 0

    def __repr__(self) -> str:
        return f"Node({self.ns}, len={len(self.key)}, lock={self.lock_ref}, t={self.last_access})"


_ROOT = Namespace("", None)  # the root's: no tenant's (the root holds no tokens and is never a child)

# Eviction order: the smallest key goes first.
EVICTION_POLICIES: dict[str, Callable[[Node], Any]] = {
    "lru": lambda n: n.last_access,
    "priority": lambda n: (n.priority, n.last_access),  # lowest request priority, then LRU
}


class RadixCache(PrefixCache):
    def __init__(self, page_size: int = 1, eviction: str = "lru", quotas: Mapping[str, int] | None = None) -> None:
        if page_size < 1:
            raise ValueError(f"page_size: must be at least 1, got {page_size}")
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"radix_eviction_policy: {eviction!r} is not supported; choose from: {', '.join(EVICTION_POLICIES)}")
        self.page_size = page_size
        self._evict_key = EVICTION_POLICIES[eviction]
        self.quotas: dict[str, int] = dict(quotas or {})  # tenant -> max cached tokens
        self._evicted = 0
        self._clear()

    def _clear(self) -> None:
        self.root = Node(_ROOT, [], [], None)
        self.root.lock_ref = 1  # never evicted
        self._cached = 0
        self._evictable = 0
        self._tick = 0
        self._version = getattr(self, "_version", 0) + 1
        self.tenant_tokens: Counter[str | None] = Counter()
        self._namespaces: dict[Namespace, list[Any]] = {}  # ns -> [its one shared instance, nodes in it]

    def _intern(self, ns: Namespace) -> Namespace:
        """Every node of a namespace holds the same key object (a salt is kept once, not per node)."""
        entry = self._namespaces.setdefault(ns, [ns, 0])
        entry[1] += 1
        return entry[0]

    def _drop_ns(self, ns: Namespace) -> None:
        entry = self._namespaces[ns]
        entry[1] -= 1
        if entry[1] == 0:
            del self._namespaces[ns]

    # -- lookup -----------------------------------------------------------------------------
    def _child_key(self, tokens: list[int], i: int) -> Any:
        return tokens[i] if self.page_size == 1 else tuple(tokens[i : i + self.page_size])

    def _walk(self, ns: Namespace, tokens: list[int], public_len: int, priority: int | None) -> tuple[Node, int, list[list[int]]]:
        """Follow `tokens` down the tree, splitting the edge where the match ends inside it.
        Returns the deepest matched node, the matched length and the slot chunks on the path."""
        total = self.aligned(len(tokens))
        plen = self.aligned(min(public_len, total))
        self._tick += 1
        node, i, chunks = self.root, 0, []
        while i < total:
            child, n = self._step(node, ns, tokens, i, plen, total)
            if child is None or n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self._tick
            if priority is not None:
                child.priority = max(child.priority, priority)
            chunks.append(child.slots)
            node, i = child, i + n
        return node, i, chunks

    def _step(self, node: Node, ns: Namespace, tokens: list[int], i: int, plen: int, total: int) -> tuple[Node | None, int]:
        """The child of `node` that tokens[i:] continues into (PUBLIC below plen, `ns` after),
        and how many whole pages of its edge they match."""
        cur, end = (PUBLIC, plen) if i < plen else (ns, total)
        child = node.children.get((cur, self._child_key(tokens, i)))
        if child is None:
            return None, 0
        return child, self.aligned(common_prefix_len(child.key, tokens[i : min(i + len(child.key), end)]))

    def _split(self, child: Node, n: int) -> Node:
        """Cut `child`'s edge after n tokens; the new upper node takes the first n."""
        parent = child.parent
        assert parent is not None
        upper = Node(self._intern(child.ns), child.key[:n], child.slots[:n], parent, child.owner)
        upper.lock_ref, upper.last_access, upper.priority = child.lock_ref, child.last_access, child.priority
        parent.children[(child.ns, self._child_key(child.key, 0))] = upper
        child.key, child.slots, child.parent = child.key[n:], child.slots[n:], upper
        upper.children[(child.ns, self._child_key(child.key, 0))] = child
        return upper

    def match(self, ns: Namespace, tokens: list[int], public_len: int = 0) -> PrefixMatch:
        node, n, chunks = self._walk(ns, tokens, public_len, None)
        slots = chunks[0] if len(chunks) == 1 else [s for c in chunks for s in c]
        return PrefixMatch(n, list(slots), node)

    def branches(self, ns: Namespace, tokens: list[int], public_len: int, context: int, limit: int) -> list[list[int]]:
        # Walk `tokens` down without splitting or touching anything; then, from the deepest point
        # up, collect the other cached paths of `ns` below each node on the way.
        total = self.aligned(len(tokens))
        plen = self.aligned(min(public_len, total))
        path: list[tuple[Node, int]] = [(self.root, 0)]  # (node, tokens matched through it)
        node, i = self.root, 0
        inside: tuple[Node, int] | None = None  # the child the match ends within, and how far into it
        while i < total:
            child, n = self._step(node, ns, tokens, i, plen, total)
            if child is None:
                break
            if n < len(child.key):
                inside = (child, n) if n else None
                break
            node, i = child, i + n
            path.append((node, i))
        runs: list[list[int]] = []
        budget = [limit]
        if inside is not None and inside[0].ns != ns:
            inside = None  # a PUBLIC edge: shared prompt text, not a branch of this namespace's
        if inside is not None:  # the same prefix, continued: the rest of that edge and below it
            child, n = inside
            self._collect(child, tokens[max(i + n - context, 0) : i + n] + child.key[n:], ns, runs, budget)
        taken = inside[0] if inside is not None else None
        for node, depth in reversed(path):
            head = tokens[max(depth - context, 0) : depth]
            for child in sorted(node.children.values(), key=lambda c: -c.last_access):
                if child is not taken and child.ns == ns and budget[0] > 0:
                    self._collect(child, head + child.key, ns, runs, budget)
            taken = node
        return runs

    def _collect(self, node: Node, run: list[int], ns: Namespace, runs: list[list[int]], budget: list[int]) -> None:
        """Every root-to-leaf path below `node` (its edge already in `run`), most recent first."""
        stack = [(node, run)]
        while stack and budget[0] > 0:
            node, run = stack.pop()
            kids = sorted((c for c in node.children.values() if c.ns == ns), key=lambda c: c.last_access)
            if not kids:
                run = run[: budget[0]]
                budget[0] -= len(run)
                runs.append(run)
                continue
            for c in kids:  # the most recent is popped first
                stack.append((c, run + c.key))

    @property
    def version(self) -> int:
        return self._version

    # -- insert -----------------------------------------------------------------------------
    def insert(self, ns: Namespace, tokens: list[int], slots: list[int], public_len: int = 0, priority: int = 0) -> int:
        total = len(tokens)
        if total % self.page_size or len(slots) != total:
            raise ValueError(f"insert: {total} tokens with {len(slots)} slots (page size {self.page_size})")
        node, dup, _ = self._walk(ns, tokens, public_len, priority)
        plen = self.aligned(min(public_len, total))
        i = dup
        while i < total:  # the rest is new: one node for the public part, one for the private
            cur, end = (PUBLIC, plen) if i < plen else (ns, total)
            child = Node(self._intern(cur), tokens[i:end], slots[i:end], node, ns.tenant)
            child.last_access, child.priority = self._tick, priority
            node.children[(child.ns, self._child_key(tokens, i))] = child
            self._account(child, +1)
            node, i = child, end
        return dup

    def _account(self, node: Node, sign: int) -> None:
        self._version += 1
        n = sign * len(node.key)
        self._cached += n
        self._evictable += n  # new and removed nodes are unlocked
        self.tenant_tokens[node.owner] += n

    # -- locks ------------------------------------------------------------------------------
    def lock(self, handle: Any) -> None:
        node = handle
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, handle: Any) -> None:
        node = handle
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
            node = node.parent

    # -- eviction ---------------------------------------------------------------------------
    def _over_quota(self, tenant: str | None) -> bool:
        quota = self.quotas.get(tenant) if tenant is not None else None
        return quota is not None and self.tenant_tokens[tenant] > quota

    def evict(self, n: int) -> list[int]:
        """Tenants over their quota lose their leaves first, then everyone in policy order."""
        freed: list[int] = []
        if any(self._over_quota(t) for t in self.quotas):
            self._evict_from(n, freed, lambda node: self._over_quota(node.owner))
        if len(freed) < n:
            self._evict_from(n, freed, lambda node: True)
        return freed

    def _evict_from(self, n: int, freed: list[int], eligible: Callable[[Node], bool]) -> None:
        heap = [(self._evict_key(x), id(x), x) for x in self._leaves() if eligible(x)]
        heapq.heapify(heap)
        while heap and len(freed) < n:
            _, _, node = heapq.heappop(heap)
            if node.lock_ref or node.children or not eligible(node):
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[(node.ns, self._child_key(node.key, 0))]
            node.parent = None
            self._account(node, -1)
            self._drop_ns(node.ns)
            self._evicted += len(node.key)
            freed.extend(node.slots)
            if parent is not self.root and not parent.children and parent.lock_ref == 0 and eligible(parent):
                heapq.heappush(heap, (self._evict_key(parent), id(parent), parent))

    def _nodes(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _leaves(self) -> list[Node]:
        return [x for x in self._nodes() if not x.children and x.lock_ref == 0 and x is not self.root]

    def reset(self) -> list[int]:
        if self.locked_tokens:
            raise RuntimeError(f"cannot reset the prefix cache: {self.locked_tokens} tokens are locked by running requests")
        slots = [s for node in self._nodes() for s in node.slots]
        self._clear()
        return slots

    # -- accounting -------------------------------------------------------------------------
    @property
    def cached_tokens(self) -> int:
        return self._cached

    @property
    def evictable_tokens(self) -> int:
        return self._evictable

    @property
    def evicted_tokens(self) -> int:
        return self._evicted

    @property
    def namespaces(self) -> int:
        return len(self._namespaces)

    def check_integrity(self) -> list[int]:
        slots: list[int] = []
        cached = evictable = 0
        tenants: Counter[str | None] = Counter()
        per_ns: Counter[Namespace] = Counter()
        for node in self._nodes():
            for (ns, first), child in node.children.items():
                _check(child.parent is node, f"{child!r} has the wrong parent")
                _check(ns == child.ns and first == self._child_key(child.key, 0), f"{child!r} is filed under the wrong key")
                below_ok = node is self.root or node.ns == child.ns or node.ns == PUBLIC
                _check(below_ok, f"{child!r} hangs below a private node of another namespace")
                _check(node is self.root or node.lock_ref >= child.lock_ref, f"{child!r} is locked more than its parent")
            if node is self.root:
                continue
            _check(len(node.key) == len(node.slots) > 0, f"{node!r} has {len(node.slots)} slots for {len(node.key)} tokens")
            _check(len(node.key) % self.page_size == 0, f"{node!r} is not a whole number of pages")
            _check(node.lock_ref >= 0, f"{node!r} has a negative lock count")
            slots.extend(node.slots)
            cached += len(node.key)
            evictable += len(node.key) if node.lock_ref == 0 else 0
            tenants[node.owner] += len(node.key)
            per_ns[node.ns] += 1
            _check(self._namespaces.get(node.ns, [None])[0] is node.ns, f"{node!r} holds a namespace that is not interned")
        _check(len(set(slots)) == len(slots), "a slot is held by two cached tokens")
        _check(cached == self._cached, f"cached count {self._cached} != {cached} in the tree")
        _check(evictable == self._evictable, f"evictable count {self._evictable} != {evictable} in the tree")
        _check(per_ns == {ns: e[1] for ns, e in self._namespaces.items()}, "namespace node counts do not match the tree")
        _check(+tenants == +self.tenant_tokens, f"per-tenant counts {dict(self.tenant_tokens)} != {dict(tenants)}")
        return slots


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(f"radix cache integrity: {message}")
