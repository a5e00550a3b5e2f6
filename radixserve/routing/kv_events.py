"""A router outside the engines, as NVIDIA Dynamo's KV router and llm-d's scheduler are: it sees
each replica's cache only through the KV events the replica publishes (--kv-events-config,
engine/kv_events.py), and sends a request to the replica holding most of its prompt's first
blocks. `radixserve bench route --external` compares it with the engine's own router.

The view keys blocks by their tokens alone, chained (a hash of the previous block's key and the
block's token ids), as Dynamo does with its own block hashes: a router that sees requests, not
tenants' credentials, cannot recompute the engine's namespaced hashes, so it maps each stored
block's engine hash to its token key. Blocks it has just routed a prompt to count as held for
`PREDICT_S` seconds before their events arrive (Dynamo's predicted blocks), so forks sent at
once follow the first.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from radixserve.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from radixserve.routing.index import Replica
from radixserve.routing.policy import RouteKey, Router

PREDICT_S = 5.0
SEEN = 4096


def token_key(parent: int, tokens: Sequence[int]) -> int:
    return hash((parent, tuple(tokens)))


class EventView:
    """Each replica's blocks as its events tell them, kept by a thread that subscribes to every
    replica's publisher (replaying what it missed)."""

    def __init__(self, endpoints: Mapping[Replica, tuple[str, str | None]], topic: str = "") -> None:
        import zmq

        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self.block_size = 0
        self._by_hash: dict[Replica, dict[int, list[int]]] = {r: {} for r in endpoints}  # engine hash -> [token key, media]
        self._held: dict[Replica, Counter[int]] = {r: Counter() for r in endpoints}  # token key -> blocks (media, tenants)
        self._last: dict[Replica, int] = {r: -1 for r in endpoints}
        self.ranks: dict[Replica, set[int | None]] = {r: set() for r in endpoints}  # the ranks its batches carried
        self._seen: dict[tuple[Replica, int], bytes] = {}  # the last SEEN batches applied (a restart's tell)
        self._subs: dict[Any, Replica] = {}
        self._replay: dict[Replica, Any] = {}
        for r, (pub, replay) in endpoints.items():
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            sub.connect(pub)
            self._subs[sub] = r
            if replay is not None:
                self._replay[r] = self._ctx.socket(zmq.DEALER)
                self._replay[r].connect(replay)
        self._decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixserve-kv-event-view", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        for sub in self._subs:
            poller.register(sub, zmq.POLLIN)
        while not self._stop.is_set():
            for sub, _ in poller.poll(50):
                _, seq_bytes, payload = sub.recv_multipart()
                r, seq = self._subs[sub], int.from_bytes(seq_bytes, "big")
                if seq <= self._last[r] and self._seen.get((r, seq)) not in (None, payload):
                    self._restarted(r)  # a publisher that started again counts from 0: not a batch seen twice
                if seq > self._last[r] + 1 and r in self._replay:
                    self._catch_up(r)
                if seq > self._last[r]:
                    self._apply(r, seq, payload)

    def _restarted(self, r: Replica) -> None:
        with self._lock:
            self._by_hash[r].clear()
            self._held[r].clear()
            self._last[r] = -1
            for key in [k for k in self._seen if k[0] == r]:
                del self._seen[key]

    def _catch_up(self, r: Replica) -> None:
        sock = self._replay[r]
        sock.send_multipart((b"", (self._last[r] + 1).to_bytes(8, "big")))
        while sock.poll(5000):
            _, seq_bytes, payload = sock.recv_multipart()
            if not payload:
                return
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self._last[r]:
                self._apply(r, seq, payload)

    def _apply(self, r: Replica, seq: int, payload: bytes) -> None:
        self._last[r] = seq
        self._seen[(r, seq)] = payload
        if len(self._seen) > SEEN:
            del self._seen[next(iter(self._seen))]
        batch = self._decode(payload)
        self.ranks[r].add(batch.data_parallel_rank)
        with self._lock:
            by_hash, held = self._by_hash[r], self._held[r]
            for e in batch.events:
                if isinstance(e, BlockStored):
                    if e.group_idx not in (None, 0):
                        continue  # sliding-window KV: the full-attention group says what is cached
                    b = self.block_size = e.block_size
                    if e.parent_block_hash is not None and e.parent_block_hash not in by_hash:
                        continue  # its head was never seen: its tokens cannot be keyed from the start
                    parent = by_hash[e.parent_block_hash][0] if e.parent_block_hash is not None else 0
                    for j, h in enumerate(e.block_hashes):
                        parent = token_key(parent, e.token_ids[j * b : (j + 1) * b])
                        by_hash.setdefault(h, [parent, 0])[1] += 1
                        held[parent] += 1
                elif isinstance(e, BlockRemoved):
                    if e.group_idx not in (None, 0):
                        continue
                    for h in e.block_hashes:
                        if (entry := by_hash.get(h)) is None:
                            continue
                        entry[1] -= 1
                        held[entry[0]] -= 1
                        if not entry[1]:
                            del by_hash[h]
                        if held[entry[0]] <= 0:
                            del held[entry[0]]
                elif isinstance(e, AllBlocksCleared):
                    by_hash.clear()
                    held.clear()

    def keys(self, tokens: Sequence[int]) -> list[int]:
        """The token keys of the whole blocks of `tokens`."""
        b, out, parent = self.block_size, [], 0
        if b:
            for i in range(0, len(tokens) - b + 1, b):
                parent = token_key(parent, tokens[i : i + b])
                out.append(parent)
        return out

    def depth(self, r: Replica, keys: list[int], predicted: set[int]) -> int:
        """How many of `keys`, from the first, the replica holds (or is predicted to)."""
        with self._lock:
            held = self._held.get(r, Counter())
            n = 0
            while n < len(keys) and (keys[n] in held or keys[n] in predicted):
                n += 1
            return n

    def blocks(self, r: Replica) -> int:
        with self._lock:
            return sum(self._held.get(r, Counter()).values())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._ctx.destroy(linger=0)


class KVEventsRouter(Router):
    """The replica whose events show the longest cached head of the prompt; none: the least
    loaded (then the emptiest)."""

    name = "kv_events"

    def __init__(self, view: EventView, max_blocks: int = 256) -> None:
        super().__init__()
        self.view, self.max_blocks = view, max_blocks
        self._predicted: dict[Replica, dict[int, float]] = {}

    def choose(self, key: RouteKey, loads: Mapping[Replica, int]) -> Replica:
        if isinstance(key.prefix, str):
            raise TypeError("the KV events router needs the prompt's tokens")
        keys = self.view.keys(key.prefix)[: self.max_blocks]
        now = time.monotonic()
        live = {r: {k for k, t in self._predicted.get(r, {}).items() if t > now} for r in loads}
        depth = {r: self.view.depth(r, keys, live[r]) for r in loads}
        best = max(loads, key=lambda r: (depth[r], -loads[r]))
        if depth[best]:
            choice, why = best, "events"
        else:
            choice, why = min(loads, key=lambda r: (loads[r], self.view.blocks(r))), "fresh"
        mine = self._predicted.setdefault(choice, {})
        for k in [k for k, t in mine.items() if t <= now]:
            del mine[k]
        mine.update(dict.fromkeys(keys, now + PREDICT_S))
        self.decisions[why] += 1
        return choice

    def forget(self, replica: Replica) -> None:
        self._predicted.pop(replica, None)
