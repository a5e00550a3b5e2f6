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

Sliding-window layers (`window` > 0, Gemma 3, Mistral): their KV sits in a second pool
(cache/allocator.WindowedAllocator) and a query sees only the `window` positions up to its
own, so a node's window KV is needed only while some query may still see it. A node holds its
full-attention KV for as long as it is cached, and its window KV until `evict_window` drops it
(a tombstone, `windowed` False). A cached prefix is usable only where the `window - 1`
positions before its end still have window KV: `match` cuts a match back to the deepest such
end (SGLang's SWA radix cache does the same). A request pins that window with `lock_window`:
a range lock over [end - window + 1, end), whose start is made a node boundary when it is
taken, so later splits keep it exact (both halves of a split node lie inside every window
lock that covered it). An insert of tokens the tree holds as tombstones, by a caller that
still has their window KV, gives that window KV to the tree (`on_revive`).
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from radixserve.cache.events import FULL, WINDOW, BlockEvents, chain, extra_key, namespace_key
from radixserve.cache.prefix import PUBLIC, Namespace, PrefixCache, PrefixMatch, common_prefix_len


class Node:
    __slots__ = ("ns", "owner", "key", "slots", "parent", "children", "lock_ref", "last_access", "priority", "windowed",
                 "window_lock", "retain_until", "blocks")

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
        self.windowed = True  # holds its sliding-window layers' KV (False: dropped, a tombstone)
        self.window_lock = 0  # window locks covering this node (requests whose queries still see it)
        self.retain_until = 0.0  # epoch seconds: a retained prompt's node is evicted after every unretained one
        self.blocks: list[list[Any]] = []  # KV events on: [end within the key, hash, told with window KV] of each block ending here

    def __repr__(self) -> str:
        return f"Node({self.ns}, len={len(self.key)}, lock={self.lock_ref}, t={self.last_access})"


RETAINED_SHARE = 0.5  # of the cached tokens: what retained prompts may keep past everyone else's
_ROOT = Namespace("", None)  # the root's: no tenant's (the root holds no tokens and is never a child)

# Eviction order: the smallest key goes first.
EVICTION_POLICIES: dict[str, Callable[[Node], Any]] = {
    "lru": lambda n: n.last_access,
    "priority": lambda n: (n.priority, n.last_access),  # lowest request priority, then LRU
}


class RadixCache(PrefixCache):
    def __init__(self, page_size: int = 1, eviction: str = "lru", quotas: Mapping[str, int] | None = None,
                 window: int = 0) -> None:
        if page_size < 1:
            raise ValueError(f"page_size: must be at least 1, got {page_size}")
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"radix_eviction_policy: {eviction!r} is not supported; choose from: {', '.join(EVICTION_POLICIES)}")
        self.page_size = page_size
        self._evict_key = EVICTION_POLICIES[eviction]
        self.quotas: dict[str, int] = dict(quotas or {})  # tenant -> max cached tokens
        self.reach = max(window - 1, 0)  # positions before its own a sliding-window query sees
        self._evicted = 0
        self.events: BlockEvents | None = None  # set to tell what is cached as KV events (cache/events.py)
        self._clear()

    def _clear(self) -> None:
        self.root = Node(_ROOT, [], [], None)
        self.root.lock_ref = 1  # never evicted
        self._cached = 0
        self._evictable = 0
        self._window_tokens = 0  # in nodes that hold their window KV
        self._window_evictable = 0  # of those, in nodes no window lock covers
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

    def _walk(self, ns: Namespace, tokens: list[int], public_len: int, priority: int | None) -> tuple[Node, int, list[Node]]:
        """Follow `tokens` down the tree, splitting the edge where the match ends inside it.
        Returns the deepest matched node, the matched length and the nodes on the path."""
        total = self.aligned(len(tokens))
        plen = self.aligned(min(public_len, total))
        self._tick += 1
        node, i, path = self.root, 0, []
        while i < total:
            child, n = self._step(node, ns, tokens, i, plen, total)
            if child is None or n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self._tick
            if priority is not None:
                child.priority = max(child.priority, priority)
            path.append(child)
            node, i = child, i + n
        return node, i, path

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
        upper.windowed, upper.window_lock, upper.retain_until = child.windowed, child.window_lock, child.retain_until
        parent.children[(child.ns, self._child_key(child.key, 0))] = upper
        child.key, child.slots, child.parent = child.key[n:], child.slots[n:], upper
        if child.blocks:  # each block stays with the node its last token is in
            upper.blocks = [b for b in child.blocks if b[0] <= n]
            child.blocks = [[e - n, h, w] for e, h, w in child.blocks if e > n]
        upper.children[(child.ns, self._child_key(child.key, 0))] = child
        return upper

    def match(self, ns: Namespace, tokens: list[int], public_len: int = 0, whole: bool = False) -> PrefixMatch:
        node, n, path = self._walk(ns, tokens, public_len, None)
        if self.reach and not whole:
            path = self._usable(path)
            node, n = (path[-1], sum(len(x.key) for x in path)) if path else (self.root, 0)
        slots = path[0].slots if len(path) == 1 else [s for x in path for s in x.slots]
        return PrefixMatch(n, list(slots), node)

    def _usable(self, path: list[Node]) -> list[Node]:
        """The longest head of a matched path whose end a query can start from: the `reach`
        positions before it hold their window KV (a run of windowed nodes at least that long,
        or reaching back to the root)."""
        best, run, at_root = 0, 0, True
        for i, node in enumerate(path):
            if not node.windowed:
                run, at_root = 0, False
                continue
            run += len(node.key)
            if at_root or run >= self.reach:
                best = i + 1
        return path[:best]

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
    def insert(self, ns: Namespace, tokens: list[int], slots: list[int], public_len: int = 0, priority: int = 0,
               window_from: int = 0, on_revive: Callable[[list[int], list[int]], None] | None = None,
               retain: tuple[int, float] = (0, 0.0)) -> int:
        """`window_from` (page-aligned): the caller holds window KV for tokens from there on
        only; new nodes before it are tombstones. Tombstones the insert duplicates from there on
        take the caller's window KV: `on_revive(its slots, the node's slots)` moves it over."""
        total = len(tokens)
        if total % self.page_size or len(slots) != total:
            raise ValueError(f"insert: {total} tokens with {len(slots)} slots (page size {self.page_size})")
        node, dup, path = self._walk(ns, tokens, public_len, priority)
        if self.reach and on_revive is not None:
            self._revive(path, slots, window_from, on_revive)
        plen = self.aligned(min(public_len, total))
        i = dup
        while i < total:  # the rest is new: one node for the public part, one for the private (each cut at window_from)
            cur, end = (PUBLIC, plen) if i < plen else (ns, total)
            if i < window_from < end:
                end = window_from
            child = Node(self._intern(cur), tokens[i:end], slots[i:end], node, ns.tenant)
            child.last_access, child.priority = self._tick, priority
            child.windowed = i >= window_from
            node.children[(child.ns, self._child_key(tokens, i))] = child
            self._account(child, +1)
            if self.events is not None:
                self._tell_stored(child, i)
            path.append(child)
            node, i = child, end
        if retain[0]:
            at = 0
            for x in path:  # every node that starts inside the retained head
                if at >= retain[0]:
                    break
                x.retain_until = max(x.retain_until, retain[1])
                at += len(x.key)
        return dup

    def _revive(self, path: list[Node], slots: list[int], window_from: int, on_revive: Callable[[list[int], list[int]], None]) -> None:
        at = 0
        for node in path:
            end = at + len(node.key)
            if not node.windowed and end > window_from:
                if at < window_from:  # only its part from window_from on: cut there
                    self._split(node, window_from - at)
                    at = window_from
                on_revive(slots[at:end], node.slots)
                node.windowed = True
                self._tell_window(node)
                self._window_tokens += len(node.key)
                if node.window_lock == 0:
                    self._window_evictable += len(node.key)
            at = end

    def _account(self, node: Node, sign: int) -> None:
        self._version += 1
        n = sign * len(node.key)
        self._cached += n
        self._evictable += n  # new and removed nodes are unlocked
        self.tenant_tokens[node.owner] += n
        if node.windowed:
            self._window_tokens += n
            self._window_evictable += n

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

    def _window_range(self, handle: Node) -> tuple[int, int]:
        end = 0
        node: Node | None = handle
        while node is not None and node is not self.root:
            end += len(node.key)
            node = node.parent
        return self.aligned(max(end - self.reach, 0)), end

    def lock_window(self, handle: Any) -> None:
        """Pin the window KV a query right after `handle` sees: the nodes covering
        [end - reach, end) (page-aligned down), the node at the start split so it begins there."""
        if not self.reach:
            return
        start, b = self._window_range(handle)
        node = handle
        while node is not self.root and b > start:
            a = b - len(node.key)
            if a < start:
                self._split(node, start - a)
                a = start
            if node.window_lock == 0 and node.windowed:
                self._window_evictable -= len(node.key)
            node.window_lock += 1
            node, b = node.parent, a

    def unlock_window(self, handle: Any) -> None:
        if not self.reach:
            return
        start, b = self._window_range(handle)
        node = handle
        while node is not self.root and b > start:
            if node.window_lock <= 0:
                raise RuntimeError(f"window unlock of a node without a window lock {node!r}")
            node.window_lock -= 1
            if node.window_lock == 0 and node.windowed:
                self._window_evictable += len(node.key)
            node, b = node.parent, b - len(node.key)

    def evict_window(self, n: int) -> list[int]:
        """Drop the window KV of at least n tokens if possible, from nodes no window lock covers
        (least recently used first; the nodes stay, as tombstones); returns their slots."""
        heap = [(self._evict_key(x), id(x), x) for x in self._nodes()
                if x is not self.root and x.windowed and x.window_lock == 0]
        heapq.heapify(heap)
        dropped: list[int] = []
        while heap and len(dropped) < n:
            node = heapq.heappop(heap)[2]
            node.windowed = False
            self._tell_window(node)
            self._version += 1
            self._window_tokens -= len(node.key)
            self._window_evictable -= len(node.key)
            dropped.extend(node.slots)
        return dropped

    def slots_with_window(self) -> list[int]:
        """Slots of every node that holds its window KV."""
        return [s for x in self._nodes() if x is not self.root and x.windowed for s in x.slots]

    # -- eviction ---------------------------------------------------------------------------
    def _over_quota(self, tenant: str | None) -> bool:
        quota = self.quotas.get(tenant) if tenant is not None else None
        return quota is not None and self.tenant_tokens[tenant] > quota

    def evict(self, n: int) -> list[int]:
        """Tenants over their quota lose their leaves first; then retained prompts past their
        share of the cache (RETAINED_SHARE), least recently used first; then everyone in policy
        order (retained prompts last)."""
        freed: list[int] = []
        if any(self._over_quota(t) for t in self.quotas):
            self._evict_from(n, freed, lambda node: self._over_quota(node.owner))
        if len(freed) < n:
            self._evict_retained_excess(n, freed)
        if len(freed) < n:
            self._evict_from(n, freed, lambda node: True)
        return freed

    def _evict_retained_excess(self, n: int, freed: list[int]) -> None:
        now = time.time()
        retained = sum(len(x.key) for x in self._nodes() if x.retain_until > now)
        excess = retained - RETAINED_SHARE * self._cached
        if excess > 0:  # evicting x retained tokens leaves retained - x of cached - x
            target = len(freed) + int(excess / (1 - RETAINED_SHARE)) + 1
            self._evict_from(min(n, target), freed, lambda node: node.retain_until > now)

    def _evict_from(self, n: int, freed: list[int], eligible: Callable[[Node], bool]) -> None:
        now = time.time()

        def order(x: Node) -> tuple[Any, ...]:  # tombstones first, retained prompts last
            return x.windowed, x.retain_until > now, self._evict_key(x), id(x), x

        heap = [order(x) for x in self._leaves() if eligible(x)]
        heapq.heapify(heap)
        while heap and len(freed) < n:
            node = heapq.heappop(heap)[-1]
            if node.lock_ref or node.children or not eligible(node):
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[(node.ns, self._child_key(node.key, 0))]
            node.parent = None
            self._account(node, -1)
            if node.blocks and self.events is not None:
                self.events.removed([h for _, h, _ in node.blocks])
                self.events.removed([h for _, h, w in node.blocks if w], group=WINDOW)
            self._drop_ns(node.ns)
            self._evicted += len(node.key)
            freed.extend(node.slots)
            if parent is not self.root and not parent.children and parent.lock_ref == 0 and eligible(parent):
                heapq.heappush(heap, order(parent))

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
        nodes = self._nodes()
        if self.events is not None:
            self.events.removed([h for x in nodes for _, h, _ in x.blocks])
            self.events.removed([h for x in nodes for _, h, w in x.blocks if w], group=WINDOW)
        slots = [s for node in nodes for s in node.slots]
        self._clear()
        return slots

    # -- KV events (cache/events.py) ---------------------------------------------------------
    def _tell_stored(self, node: Node, start: int) -> None:
        """`node` (new, from position `start`) completes the blocks whose last token it holds."""
        ev = self.events
        assert ev is not None
        b = ev.block_size
        end, first = start + len(node.key), (start // b + 1) * b  # the first block end past start
        if first > end:
            return
        parent, head, public = self._before(node, first - b, start - (first - b))
        seq = head + node.key  # from position first - b
        key = namespace_key(node.ns)
        hashes = chain(parent, key, seq, b, public)
        n = len(hashes)
        node.blocks = [[first + j * b - start, h, False] for j, h in enumerate(hashes)]
        ev.stored(hashes, parent, seq[: n * b], [extra_key(key, public)] + [extra_key(key)] * (n - 1))
        if self.reach:
            for i, rec in enumerate(node.blocks):
                if self._windowed(node, rec[0]):
                    rec[2] = True
                    self._tell_one(node, i, WINDOW)

    def _before(self, node: Node, block_start: int, need: int) -> tuple[int | None, list[int], int]:
        """For a block from `block_start` ending in `node`: the hash of the block before it (None
        at the root), its `need` tokens cached above `node`, and how many of those are in the
        public prefix (where `node` is not: a block across the public prefix's end)."""
        head: list[int] = []
        parent: int | None = None
        public = 0
        found = block_start == 0
        p = node.parent
        while p is not None and p is not self.root and (len(head) < need or not found):
            if len(head) < need:
                part = p.key[max(len(p.key) - (need - len(head)), 0) :]
                head = part + head
                if p.ns == PUBLIC and node.ns != PUBLIC:
                    public += len(part)
            if not found and p.blocks:
                parent, found = p.blocks[-1][1], True
            p = p.parent
        return parent, head, public

    def _windowed(self, node: Node, end: int) -> bool:
        """Every token of the block ending `end` tokens into `node` holds its window KV."""
        assert self.events is not None
        need = self.events.block_size - end
        p: Node | None = node
        while p is not None and p is not self.root:
            if not p.windowed:
                return False
            if need <= 0:
                return True
            p = p.parent
            if p is not None and p is not self.root:
                need -= len(p.key)
        return True

    def _tell_one(self, node: Node, i: int, group: int) -> None:
        """A stored event for `node`'s i-th block (its parent's hash and its tokens looked up)."""
        ev = self.events
        assert ev is not None
        rec = node.blocks[i]
        b, end = ev.block_size, rec[0]
        public = 0
        if i:
            parent, tokens = node.blocks[i - 1][1], node.key[end - b : end]
        else:
            parent, head, public = self._before(node, self._depth(node) + end - b, max(b - end, 0))
            tokens = head + node.key[max(end - b, 0) : end]
        ev.stored([rec[1]], parent, tokens, [extra_key(namespace_key(node.ns), public)], group=group)

    def _depth(self, node: Node) -> int:
        d, p = 0, node.parent
        while p is not None and p is not self.root:
            d, p = d + len(p.key), p.parent
        return d

    def _tell_window(self, node: Node) -> None:
        """`node`'s window KV went or came back: the blocks with a token in it change group 1."""
        if self.events is None:
            return
        self._version += 1
        b = self.events.block_size
        stack: list[tuple[Node, int]] = [(node, -len(node.key))]  # (node, its start past `node`'s end)
        while stack:
            x, d = stack.pop()
            for i, rec in enumerate(x.blocks):
                if d + rec[0] - b >= 0:
                    break  # this block and the later ones start past `node`
                now = self._windowed(x, rec[0])
                if now != rec[2]:
                    rec[2] = now
                    if now:
                        self._tell_one(x, i, WINDOW)
                    else:
                        self.events.removed([rec[1]], group=WINDOW)
            after = d + len(x.key)
            if after < b - 1:
                stack.extend((c, after) for c in x.children.values())

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
    def window_tokens(self) -> int:
        return self._window_tokens

    @property
    def window_evictable_tokens(self) -> int:
        return self._window_evictable

    @property
    def namespaces(self) -> int:
        return len(self._namespaces)

    def check_integrity(self) -> list[int]:
        slots: list[int] = []
        cached = evictable = windowed = window_evictable = 0
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
            _check(0 <= node.window_lock <= node.lock_ref, f"{node!r} has a window lock without its path lock")
            _check(self.reach > 0 or (node.windowed and not node.window_lock), f"{node!r} has window state without a window")
            windowed += len(node.key) if node.windowed else 0
            window_evictable += len(node.key) if node.windowed and not node.window_lock else 0
            slots.extend(node.slots)
            cached += len(node.key)
            evictable += len(node.key) if node.lock_ref == 0 else 0
            tenants[node.owner] += len(node.key)
            per_ns[node.ns] += 1
            _check(self._namespaces.get(node.ns, [None])[0] is node.ns, f"{node!r} holds a namespace that is not interned")
        _check(len(set(slots)) == len(slots), "a slot is held by two cached tokens")
        _check(cached == self._cached, f"cached count {self._cached} != {cached} in the tree")
        _check(evictable == self._evictable, f"evictable count {self._evictable} != {evictable} in the tree")
        _check(windowed == self._window_tokens, f"window-KV count {self._window_tokens} != {windowed} in the tree")
        _check(window_evictable == self._window_evictable,
               f"window-evictable count {self._window_evictable} != {window_evictable} in the tree")
        _check(per_ns == {ns: e[1] for ns, e in self._namespaces.items()}, "namespace node counts do not match the tree")
        _check(+tenants == +self.tenant_tokens, f"per-tenant counts {dict(self.tenant_tokens)} != {dict(tenants)}")
        if self.events is not None:
            self._check_blocks(self.events)
        return slots

    def _check_blocks(self, ev: BlockEvents) -> None:
        """Every block's hash recomputed from the tree's tokens, and the blocks told as stored
        (the pool's, both groups) exactly the tree's."""
        b = ev.block_size
        full: set[int] = set()
        window: set[int] = set()
        told = 0
        # (node, the tokens since the last block's end, how many of them are public, the last block's hash)
        stack: list[tuple[Node, list[int], int, int | None]] = [(c, [], 0, None) for c in self.root.children.values()]
        while stack:
            x, tail, tail_public, prev = stack.pop()
            seq = tail + x.key
            key = namespace_key(x.ns)
            hashes = chain(prev, key, seq, b, tail_public if x.ns != PUBLIC else 0)
            want = [[(j + 1) * b - len(tail), h, self.reach > 0 and self._windowed(x, (j + 1) * b - len(tail))]
                    for j, h in enumerate(hashes)]
            prev = hashes[-1] if hashes else prev
            _check(x.blocks == want, f"{x!r} holds blocks {x.blocks} where its tokens make {want}")
            full.update(h for _, h, _ in want)
            window.update(h for _, h, w in want if w)
            told += len(want)
            rest = seq[len(seq) - len(seq) % b :]
            rest_public = len(rest) if x.ns == PUBLIC else (tail_public if not want else 0)
            stack.extend((c, rest, rest_public, prev) for c in x.children.values())
        _check(told == len(full), "two cached blocks have one hash")
        _check(ev.live.get((ev.medium, FULL), set()) == full, "the blocks told as stored are not the tree's")
        _check(ev.live.get((ev.medium, WINDOW), set()) == window, "the blocks told with window KV are not the tree's")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(f"radix cache integrity: {message}")
