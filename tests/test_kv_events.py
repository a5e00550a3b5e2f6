"""KV-cache events (--kv-events-config) read by a subscriber written from vLLM's published types
(vllm/distributed/kv_events.py and examples/online_serving/kv_events_subscriber.py), not from
radixserve's classes: it rebuilds the cached block set from the stream alone, recomputing every
hash from the token ids as docs/prefix-cache.md documents it, and matches the server's counts
after forks, evictions, a disk restore and a flush; a subscriber that drops out catches up by
replay; two tenants' blocks never share a hash."""

from __future__ import annotations

import hashlib
import json
import random
import struct
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import pytest


# -- vLLM's types (array-like, tagged by class name) ---------------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def old_example_decoder() -> msgspec.msgpack.Decoder:
    """The types of vLLM's example subscriber as first published (six fields of BlockStored)."""

    class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]

    class Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(Event):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    class BlockRemoved(Event):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(Event):
        pass

    class KVEventBatch(Batch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return msgspec.msgpack.Decoder(KVEventBatch)


def doc_hash(parent: int | None, extra: tuple[Any, ...], tokens: list[int]) -> int:
    """The block hash as the docs give it, from its parent, its extra key and its tokens."""
    public = extra[1].to_bytes(4, "big") if len(extra) > 1 else b""
    data = (parent or 0).to_bytes(8, "big") + bytes.fromhex(extra[0]) + public + struct.pack(f"<{len(tokens)}I", *tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class View:
    """A subscriber's view of one publisher: the stored blocks per (medium, group), rebuilt from
    the events; every stored hash recomputed from its parent, namespace key and tokens."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[str | None, int | None], set[int]] = {}
        self.last = -1
        self.cleared = 0
        self.stores: list[BlockStored] = []
        self.removed: Counter[str | None] = Counter()

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        assert seq == self.last + 1, (seq, self.last)  # in order, none missed
        self.last = seq
        for e in batch.events:
            if isinstance(e, BlockStored):
                self.stores.append(e)
                b, parent = e.block_size, e.parent_block_hash
                assert e.extra_keys is not None and len(e.extra_keys) == len(e.block_hashes)
                assert len(e.token_ids) == b * len(e.block_hashes)
                held = self.blocks.setdefault((e.medium, e.group_idx), set())
                for j, h in enumerate(e.block_hashes):
                    key = e.extra_keys[j]
                    assert key is not None
                    assert doc_hash(parent, key, e.token_ids[j * b : (j + 1) * b]) == h
                    assert h not in held, f"{h} stored twice in {e.medium}, group {e.group_idx}"
                    held.add(h)
                    parent = h
            elif isinstance(e, BlockRemoved):
                held = self.blocks.setdefault((e.medium, e.group_idx), set())
                assert set(e.block_hashes) <= held, "removed a block never stored"
                self.removed[e.medium] += len(e.block_hashes)
                held.difference_update(e.block_hashes)
            else:
                self.blocks.clear()
                self.cleared += 1

    def count(self, medium: str, group: int = 0) -> int:
        return len(self.blocks.get((medium, group), ()))


class Subscriber:
    """vLLM's replay protocol: SUB for the stream; for a gap, the first missing sequence number to
    the replay socket, which answers each buffered batch from there and then -1. By a DEALER:
    a REQ socket (vLLM's example's) takes only the first answer of the several."""

    def __init__(self, pub: str, replay: str, view: View | None = None) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sub.connect(pub)
        self.req = self.ctx.socket(zmq.DEALER)
        self.req.connect(replay)
        self.decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        self.raw: list[bytes] = []
        self.view = view or View()
        self.replays = 0

    def pump(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if not self.sub.poll(int(left * 1000) + 1):
                continue
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == b"kv-events"
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.view.last + 1:
                self._replay()
            if seq > self.view.last:
                self._apply(seq, payload)

    def _replay(self) -> None:
        self.replays += 1
        self.req.send_multipart((b"", (self.view.last + 1).to_bytes(8, "big")))
        while True:
            assert self.req.poll(10_000), "no replay answer"
            empty, seq_bytes, payload = self.req.recv_multipart()
            assert empty == b""
            if not payload:
                assert int.from_bytes(seq_bytes, "big", signed=True) == -1
                return
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.view.last:
                self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.raw.append(payload)
        self.view.apply(seq, self.decode(payload))

    def close(self) -> None:
        self.ctx.destroy(linger=0)


# -- the tree alone ------------------------------------------------------------------------------
@pytest.mark.parametrize("window,page", [(0, 1), (0, 2), (8, 1), (8, 2)])
def test_every_change_of_the_tree_is_told_and_the_told_set_is_the_trees(window, page):
    """Random inserts (public prefixes, tombstoned heads), matches that split edges, evictions,
    window evictions and resets: the events, encoded and decoded as vLLM's types, rebuild exactly
    the blocks the tree holds (check_integrity recomputes them from its tokens)."""
    from radixserve.cache.events import BlockEvents, batch
    from radixserve.cache.prefix import Namespace
    from radixserve.cache.radix import RadixCache

    rng = random.Random(window * 10 + page)
    cache = RadixCache(page, window=window)
    cache.events = BlockEvents(4, "CPU", window)
    view, encode, decode = View(), msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder(KVEventBatch).decode
    slot = 0
    for step in range(300):
        ns = Namespace(rng.choice(["a", "b"]), rng.choice([None, "salt"]))
        n = rng.randrange(0, 40) // page * page
        tokens = [rng.randrange(3) for _ in range(n)]
        window_from = rng.choice([0, 0, n]) if window else 0
        cache.insert(ns, tokens, list(range(slot, slot + n)), public_len=rng.choice([0, 0, 3, 5, 6]), window_from=window_from,
                     on_revive=lambda mine, theirs: None)
        slot += n
        r = rng.random()
        if r < 0.2:
            cache.evict(rng.randrange(1, 30))
        elif r < 0.3 and window:
            cache.evict_window(rng.randrange(1, 20))
        elif r < 0.4:
            cache.match(ns, tokens[: rng.randrange(0, n + 1)])
        elif r < 0.42:
            cache.reset()
        cache.check_integrity()
        if events := cache.events.take(0):
            view.apply(step if view.last < 0 else view.last + 1, decode(encode(batch(events, None))))
        want = {k: v for k, v in cache.events.live.items() if v}
        assert {k: v for k, v in view.blocks.items() if v} == want, step
    assert view.count("CPU") > 50 and (not window or view.count("CPU", 1) > 20)


def test_vllms_first_example_subscriber_reads_our_batches():
    from radixserve.cache.events import AllBlocksCleared as Cleared
    from radixserve.cache.events import BlockRemoved as Removed
    from radixserve.cache.events import BlockStored as Stored
    from radixserve.cache.events import batch

    ours = batch([Stored([7, 8], None, [1, 2, 3, 4], 2, None, "CPU", None, [("ab",), ("ab",)], 0, "full_attention"),
                  Removed([8], "DISK", 0), Cleared()], 3)
    old = old_example_decoder().decode(msgspec.msgpack.encode(ours))
    stored, removed, cleared = old.events
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size, stored.medium) == (
        [7, 8], None, [1, 2, 3, 4], 2, "CPU")
    assert (removed.block_hashes, removed.medium) == ([8], "DISK") and type(cleared).__name__ == "AllBlocksCleared"
    new = msgspec.msgpack.Decoder(KVEventBatch).decode(msgspec.msgpack.encode(ours))
    assert new.data_parallel_rank == 3 and new.events[0].extra_keys == [("ab",), ("ab",)]


def test_a_bad_kv_events_config_is_refused_naming_its_field():
    from radixserve.config import CacheConfig, parse_kv_events
    from radixserve.engine.kv_events import offset_endpoint

    for text, field in (('{"endpoint": 5}', "endpoint"), ('{"no_such": 1}', "no_such"), ('{"publisher": "kafka"}', "publisher"),
                        ('{"endpoint": "http://x:1"}', "endpoint"), ('{"buffer_steps": -1}', "buffer_steps"),
                        ('{"block_size": 0}', "block_size"), ("{", "not JSON")):
        with pytest.raises(ValueError, match=field):
            parse_kv_events(text)
    with pytest.raises(ValueError, match="disable_radix_cache"):
        CacheConfig(kv_events_config='{"enable_kv_cache_events": true}', disable_radix_cache=True).check()
    assert not parse_kv_events("{}").enabled and parse_kv_events('{"enable_kv_cache_events": true}').enabled
    assert not parse_kv_events('{"publisher": "zmq"}').enabled  # as vLLM: nothing is made without enable_kv_cache_events
    assert not parse_kv_events('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559" and offset_endpoint("ipc:///tmp/e", 1) == "ipc:///tmp/e_dp1"
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"


def test_each_data_parallel_replica_publishes_with_its_rank():
    from radixserve.config import EngineConfig, parse_kv_events
    from radixserve.engine.data_parallel import _replica_overrides

    cfg = EngineConfig.build(None, kv_events_config='{"enable_kv_cache_events": true, "topic": "t"}')
    over = _replica_overrides(cfg, {}, 1, 2)
    assert parse_kv_events(over["kv_events_config"]).data_parallel_rank == 1
    assert parse_kv_events(over["kv_events_config"]).topic == "t"


# -- a served model ------------------------------------------------------------------------------
TENANTS = """
[[tenants]]
id = "acme"
api_key = "key-acme"
admin = true

[[tenants]]
id = "globex"
api_key = "key-globex"
"""


@pytest.fixture
def events_server(tiny_llama, tmp_path):
    from server_helpers import ServerProcess, free_port

    pub, replay = free_port(), free_port()
    (tmp_path / "tenants.toml").write_text(TENANTS)
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
              "topic": "kv-events", "block_size": 16}
    s = ServerProcess(tiny_llama, "--kv-cache-tokens", "1024", "--kv-disk-dir", str(tmp_path / "disk"),
                      "--kv-disk-block-tokens", "32", "--tenants", str(tmp_path / "tenants.toml"),
                      "--kv-events-config", json.dumps(config), log=tmp_path / "server.log")
    try:
        yield s, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
    finally:
        s.stop()


def _chat(server, system: str, question: str, key: str = "key-acme") -> dict:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 4, "temperature": 0}
    status, out = server.post("/v1/chat/completions", body, key)
    assert status == 200, out
    return out


def _settle(server, subs: list[Subscriber]) -> dict:
    """Once the server is idle and every subscriber has what it published: the server's counts."""
    kv = server.wait_idle("key-acme")
    deadline = time.monotonic() + 20
    while True:
        for s in subs:
            s.pump(0.2)
        _, info = server.get("/server_info", "key-acme")
        kv = info["kv"]
        if all(s.view.last + 1 == kv["kv_events_batches"] for s in subs) or time.monotonic() > deadline:
            return kv


def test_a_subscriber_rebuilds_the_servers_cached_blocks_from_the_events_alone(events_server):
    from conftest import CORPUS

    server, pub, replay = events_server
    live = Subscriber(pub, replay)
    dropped = Subscriber(pub, replay)
    time.sleep(0.3)  # a SUB connects a moment after it is made: what it misses, replay brings
    system = " ".join(CORPUS)[:900]
    with ThreadPoolExecutor(6) as pool:  # forks of one system prompt
        list(pool.map(lambda i: _chat(server, system, f"Question {i}?"), range(6)))
    kv = _settle(server, [live, dropped])
    assert live.view.cleared == 1 and live.replays >= 1  # the start's AllBlocksCleared, by replay
    assert live.view.count("CPU") == kv["kv_events_blocks"] > 0
    dropped.close()  # it drops out here; it comes back below and catches up by replay
    saved = dropped.view

    theirs = _chat(server, system, "Question 0?", key="key-globex")  # another tenant, the same prompt
    assert theirs["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    kv = _settle(server, [live])
    by_ns: dict[str, set[int]] = {}
    for e in live.view.stores:
        for key, h in zip(e.extra_keys or [], e.block_hashes):
            by_ns.setdefault(key[0], set()).add(h)
    assert len(by_ns) == 2 and not set.intersection(*by_ns.values())  # no hash shared across tenants
    first = [e for e in live.view.stores if e.parent_block_hash is None and e.medium == "CPU"]
    assert len({tuple(e.token_ids[:16]) for e in first}) == 1 and len({e.block_hashes[0] for e in first}) == 2

    for i in range(8):  # unique prompts past the 1024-token pool: evictions, written through to disk
        _chat(server, f"Prompt {i}. " + " ".join(CORPUS[i:] + CORPUS[:i])[:700], "Go on.")
    kv = _settle(server, [live])
    assert kv["evicted_tokens"] > 0 and live.view.removed["CPU"] > 0
    assert live.view.count("CPU") == kv["kv_events_blocks"] and live.view.count("DISK") == kv["kv_events_disk_blocks"] > 0

    back = _chat(server, "Prompt 0. " + " ".join(CORPUS)[:700], "Go on.")  # evicted from the pool: read back from disk
    kv = _settle(server, [live])
    assert back["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32 and kv["cached_prompt_tokens_disk"] >= 32
    assert live.view.count("CPU") == kv["kv_events_blocks"] and live.view.count("DISK") == kv["kv_events_disk_blocks"]
    status, _ = server.get("/server_info?check_integrity=1", "key-acme")  # the told blocks are the tree's, recomputed
    assert status == 200

    again = Subscriber(pub, replay, saved)  # the dropped subscriber: from where it left off
    time.sleep(0.3)
    _chat(server, system, "One more?")
    kv = _settle(server, [live, again])
    assert again.replays >= 1 and again.view.blocks == live.view.blocks

    assert server.post("/flush_cache", b"", "key-acme")[0] == 200
    kv = _settle(server, [live, again])
    assert live.view.cleared == 2 and live.view.count("CPU") == live.view.count("DISK") == 0
    assert kv["kv_events_blocks"] == kv["kv_events_disk_blocks"] == 0 and again.view.blocks == live.view.blocks
    live.close()
    again.close()


def test_a_sliding_window_models_tombstones_leave_group_1(tiny_models, tmp_path):
    """Gemma 3 (a window of 8) with a small window pool: window KV is dropped under pressure
    (tombstones) and the subscriber's group 1 (sliding_window) follows it, group 0 the cache."""
    import asyncio

    from server_helpers import final_outputs

    from radixserve import Engine, SamplingParams

    pub, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": pub, "replay_endpoint": replay,
                         "topic": "kv-events", "block_size": 4})
    sub = Subscriber(pub, replay)
    with Engine(str(tiny_models["Gemma3ForCausalLM"]), kv_cache_tokens=512, chunked_prefill_size=32,
                swa_full_tokens_ratio=0.2, kv_events_config=config, dtype="float32") as e:
        for r in range(6):
            reqs = [e.make_req(list(range(5 + i + r, 60 + 7 * i + r)), SamplingParams(max_new_tokens=6, temperature=0.0))
                    for i in range(4)]
            asyncio.run(final_outputs(e, reqs))
            e.check_integrity()  # the blocks told, both groups, are the tree's
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sub.view.last + 1 < e.stats().kv_events_batches:
            sub.pump(0.1)
        s = e.stats()
    sub.close()
    assert s.evicted_tokens > 0 and 0 < s.kv_events_window_blocks < s.kv_events_blocks
    assert (sub.view.count("CPU"), sub.view.count("CPU", 1)) == (s.kv_events_blocks, s.kv_events_window_blocks)
    kinds = {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in sub.view.stores}
    assert kinds == {(0, "full_attention", None), (1, "sliding_window", 8)}
    assert sub.view.removed["CPU"] > 0
