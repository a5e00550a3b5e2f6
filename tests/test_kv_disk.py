"""The KV cache's disk tier: the block store (atomic, signed, bounded, retained, per tenant),
and the engine writing prompts through to it and putting them back into the pool: the same
greedy output from the pool, the disk or a recomputation, across a restart, never another
tenant's blocks, a corrupt or torn block a miss."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from radixserve.cache.disk import DiskStore, block_keys
from radixserve.cache.prefix import Namespace
from radixserve.cache.radix import RadixCache
from radixserve.request import Retention, SamplingParams

A, B = Namespace("a"), Namespace("b")
FP = "fingerprint"
KEY = bytes(range(32))


def _store(root: Path, capacity: int, block_tokens: int = 16, **kw) -> DiskStore:
    return DiskStore(root, capacity, block_tokens, key=KEY, **kw)


def _put(store: DiskStore, ns: Namespace, tokens: list[int], fill: int = 1, until: float = 0.0) -> str:
    key = block_keys(FP, ns, tokens, store.block_tokens)[-1]
    assert store.put(key, ns, FP, tokens[-store.block_tokens:], bytes([fill]) * 1000, until)
    return key


# -- the store -------------------------------------------------------------------------------
def test_keys_chain_through_the_namespace_the_model_and_every_earlier_token():
    toks = list(range(64))
    keys = block_keys(FP, A, toks, 16)
    assert len(keys) == 4 and len(set(keys)) == 4
    assert block_keys(FP, A, toks[:40], 16) == keys[:2]  # a partial block has no key
    assert block_keys(FP, B, toks, 16)[0] != keys[0] and block_keys("other", A, toks, 16)[0] != keys[0]
    assert block_keys(FP, Namespace("a", "salt"), toks, 16)[0] != keys[0]
    changed = [99, *toks[1:]]  # the same last block after a different first one: another key
    assert block_keys(FP, A, changed, 16)[3] != keys[3]


def test_a_block_reads_back_only_as_exactly_what_was_written(tmp_path):
    store = _store(tmp_path / "kv", 1 << 20)
    toks = list(range(16))
    key = _put(store, A, toks, fill=7)
    assert bytes(store.get(key, A, FP, toks)) == bytes([7]) * 1000
    assert store.get(key, B, FP, toks) is None  # another tenant's view of the same key: refused (and the block dropped)
    key = _put(store, A, toks, fill=7)
    assert store.get(key, A, "another model", toks) is None
    key = _put(store, A, toks, fill=7)
    assert store.get(key, A, FP, [1, *toks[1:]]) is None
    assert store.corrupt == 3
    assert stat.S_IMODE((tmp_path / "kv").stat().st_mode) == 0o700
    key = _put(store, A, toks)
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in (tmp_path / "kv").iterdir())


def test_a_block_renamed_for_its_retention_while_it_is_read_is_still_read(tmp_path, monkeypatch):
    from radixserve.cache import disk

    store = _store(tmp_path / "kv", 1 << 20)
    toks = list(range(16))
    key = _put(store, A, toks, fill=5)
    opened: list[str] = []
    read = disk._read

    def racing_read(path, *args):  # another request retains the block between lookup and open
        if not opened:
            store.retain(key, time.time() + 3600)
        opened.append(str(path))
        return read(path, *args)

    monkeypatch.setattr(disk, "_read", racing_read)
    assert bytes(store.get(key, A, FP, toks)) == bytes([5]) * 1000
    assert len(opened) == 2 and opened[0] != opened[1] and store.corrupt == 0 and store.num_blocks == 1


def test_a_corrupt_truncated_or_torn_block_is_a_miss_and_is_deleted(tmp_path):
    store = _store(tmp_path, 1 << 20)
    blocks = [list(range(i * 16, i * 16 + 16)) for i in range(3)]
    keys = [_put(store, A, b, fill=i + 1) for i, b in enumerate(blocks)]
    files = {k: next(tmp_path.glob(f"*-{k}-*.kv")) for k in keys}
    data = bytearray(files[keys[0]].read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit in the payload
    files[keys[0]].write_bytes(bytes(data))
    files[keys[1]].write_bytes(files[keys[1]].read_bytes()[:-10])  # torn: cut short
    (tmp_path / "abc.123.456.tmp").write_bytes(b"half a block")  # a write a crash interrupted
    store.close()
    again = _store(tmp_path, 1 << 20)  # a restart
    assert not list(tmp_path.glob("*.tmp")) and again.num_blocks == 3
    assert again.get(keys[0], A, FP, blocks[0]) is None and again.get(keys[1], A, FP, blocks[1]) is None
    assert bytes(again.get(keys[2], A, FP, blocks[2])) == bytes([3]) * 1000
    assert again.corrupt == 2 and again.num_blocks == 1 and not files[keys[0]].exists()


def test_the_bound_holds_under_a_flood_and_retained_blocks_stay_until_their_time(tmp_path):
    store = _store(tmp_path, 20_000)
    kept = _put(store, A, list(range(16)), until=time.time() + 3600)
    lapsed = _put(store, A, list(range(100, 116)), until=time.time() - 1)
    for i in range(200):  # distinct prompts, far more than the bound
        _put(store, B, list(range(1000 + 16 * i, 1016 + 16 * i)))
        assert store.num_bytes <= 20_000
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("*.kv"))
    assert on_disk == store.num_bytes <= 20_000
    assert store.has(kept) and not store.has(lapsed)


def test_a_tenant_over_its_quota_loses_its_own_oldest_blocks(tmp_path):
    store = _store(tmp_path, 1 << 20, quotas={"a": 32})
    other = _put(store, B, list(range(16)))
    first = _put(store, A, list(range(16)))
    _put(store, A, list(range(16, 32)))
    _put(store, A, list(range(32, 48)))  # a's third block: its first goes
    assert not store.has(first) and store.has(other) and store.tenant_tokens("a") == 32


def test_blocks_survive_a_process_killed_while_writing(tmp_path):
    """kill -9 in the middle of writing blocks: a restart finds whole blocks or none, and no
    temporary file; every block it finds reads back as written."""
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from radixserve.cache.disk import DiskStore, block_keys
from radixserve.cache.prefix import Namespace
store = DiskStore({str(tmp_path)!r}, 1 << 34, 16, key=bytes(range(32)))
ns = Namespace("a")
i = 0
while True:
    toks = list(range(16 * i, 16 * i + 16))
    key = block_keys("fp", ns, toks, 16)[0]
    store.put(key, ns, "fp", toks, bytes([i % 251]) * (4 << 20))
    i += 1
    if i == 3:
        print("writing", flush=True)
"""
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline().strip() == b"writing"
    time.sleep(0.3)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    store = _store(tmp_path, 1 << 34)
    assert store.num_blocks >= 3 and not list(tmp_path.glob("*.tmp"))
    for i in range(store.num_blocks):
        toks = list(range(16 * i, 16 * i + 16))
        got = store.get(block_keys("fp", A, toks, 16)[0], A, "fp", toks)
        assert got is not None and bytes(got) == bytes([i % 251]) * (4 << 20)


def test_the_pool_evicts_a_retained_prompt_after_every_unretained_one():
    c = RadixCache()
    c.insert(A, list(range(10)), list(range(10)), retain=(10, time.time() + 60))
    c.insert(A, list(range(100, 110)), list(range(10, 20)))
    c.insert(A, list(range(200, 210)), list(range(20, 30)), retain=(10, time.time() - 1))  # lapsed
    c.match(A, list(range(100, 110)))  # the most recently used
    assert sorted(c.evict(20)) == list(range(10, 30))
    assert c.match(A, list(range(10))).length == 10
    c.check_integrity()


# -- the engine --------------------------------------------------------------------------------
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, return_logprob=True)


def _prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 200) for _ in range(n)]


def _engine(model: Path, disk: Path | None, **kw):
    from radixserve import Engine

    extra = {"kv_disk_dir": str(disk), "kv_disk_block_tokens": 16} if disk is not None else {}
    return Engine(str(model), kv_cache_tokens=kw.pop("kv_cache_tokens", 1024), chunked_prefill_size=64, **extra, **kw)


def test_a_prompt_evicted_from_the_pool_comes_back_from_disk_with_the_same_greedy_output(tiny_llama, tmp_path):
    prompt = _prompt(300, 1)
    with _engine(tiny_llama, None) as plain:
        ref = plain.generate(prompt, GREEDY)[0]
    with _engine(tiny_llama, tmp_path, kv_cache_tokens=700) as e:
        cold = e.generate(prompt, GREEDY)[0]
        assert e.tier is not None and e.tier.flush()
        assert e.stats().kv_disk_written_tokens == 304  # 19 whole blocks of 16: the prompt, then with its answer
        pooled = e.generate(prompt, GREEDY)[0]
        assert pooled.cached_tokens == 299 and e.stats().cached_prompt_tokens_disk == 0
        for i in range(4):  # other traffic: the prompt leaves the pool
            e.generate(_prompt(300, 100 + i), GREEDY)
        assert e.cache.match_len(e.make_req(prompt, GREEDY)) < 288
        disk = e.generate(prompt, GREEDY)[0]
        s = e.stats()
        assert disk.cached_tokens == 288 and s.cached_prompt_tokens_disk == 288 and s.kv_disk_loaded_tokens == 288
        assert s.waiting == 0 and s.kv_in_use_slots == 0
        e.check_integrity()
    assert cold.token_ids == pooled.token_ids == disk.token_ids == ref.token_ids
    assert [lp.logprob for lp in disk.logprobs] == pytest.approx([lp.logprob for lp in cold.logprobs], abs=1e-4)


def test_a_restarted_engine_finds_its_prompts_and_no_other_tenant_does(tiny_llama, tmp_path):
    prompt = _prompt(200, 2)
    with _engine(tiny_llama, tmp_path) as e:
        first = e.generate(prompt, GREEDY, tenant="a")[0]
    with _engine(tiny_llama, tmp_path) as e:  # the same directory after a restart
        other = e.generate(prompt, GREEDY, tenant="b")[0]
        salted = e.generate(prompt, GREEDY, tenant="a", cache_salt="s")[0]
        assert other.cached_tokens == salted.cached_tokens == 0 and e.stats().kv_disk_loaded_tokens == 0
        again = e.generate(prompt, GREEDY, tenant="a")[0]
        assert again.cached_tokens == 192 and e.stats().cached_prompt_tokens_disk == 192  # 12 whole blocks
        e.check_integrity()
    assert first.token_ids == other.token_ids == again.token_ids


def test_a_corrupt_block_ends_the_chain_there_and_the_rest_is_recomputed(tiny_llama, tmp_path):
    prompt = _prompt(200, 3)
    with _engine(tiny_llama, tmp_path) as e:
        first = e.generate(prompt, GREEDY)[0]
        keys = e.tier.keys(e.make_req(prompt, GREEDY))
    bad = next(tmp_path.glob(f"*-{keys[5]}-*.kv"))
    data = bytearray(bad.read_bytes())
    data[-100] ^= 0x01
    bad.write_bytes(bytes(data))
    with _engine(tiny_llama, tmp_path) as e:
        again = e.generate(prompt, GREEDY)[0]
        s = e.stats()
        assert again.cached_tokens == 80 and s.kv_disk_corrupt_blocks == 1 and s.kv_disk_loaded_tokens == 80
        e.check_integrity()
    assert again.token_ids == first.token_ids


def test_a_retained_prompt_is_kept_on_disk_past_the_bound(tiny_llama, tmp_path):
    from radixserve.engine.kv_tier import KVTier

    prompt = _prompt(64, 4)
    with _engine(tiny_llama, tmp_path) as e:
        per_block = e.tier.block_bytes + 2000  # with its header
    with _engine(tiny_llama, tmp_path, kv_disk_gb=12 * per_block / 1e9) as e:
        assert isinstance(e.tier, KVTier)
        e.generate(prompt, GREEDY, retention=Retention(3600))
        for i in range(6):
            e.generate(_prompt(64, 200 + i), GREEDY)
        assert e.tier.flush()
        keys = e.tier.keys(e.make_req(prompt, GREEDY))
        assert all(e.tier.store.has(k) for k in keys) and e.stats().kv_disk_bytes <= 12 * per_block
    names = [p.name for p in tmp_path.glob(f"*-{keys[0]}-*.kv")]
    assert len(names) == 1 and int(names[0].rsplit("-", 1)[1][:-3]) > time.time() + 3000


def test_a_request_aborted_while_its_blocks_load_frees_everything(tiny_llama, tmp_path):
    import asyncio

    prompt = _prompt(300, 5)
    with _engine(tiny_llama, tmp_path) as e:
        e.generate(prompt, GREEDY)
    with _engine(tiny_llama, tmp_path) as e:
        async def leave() -> None:
            agen = e.submit(prompt, SamplingParams(temperature=0.0, max_new_tokens=50))
            await agen.__anext__()
            await agen.aclose()

        asyncio.run(leave())
        deadline = time.monotonic() + 20
        while (e.stats().kv_in_use_slots or e.stats().waiting or e.stats().running) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert e.stats().kv_in_use_slots == 0
        e.check_integrity()
        assert e.flush_cache() >= 0 and e.stats().kv_disk_blocks == 0  # flush empties every tier


def test_a_late_read_never_reaches_a_new_request_under_the_same_rid(tiny_llama, tmp_path):
    """Request x leaves while its blocks are read; a new request x (another prompt) arrives and
    waits for its own. The first read, ending while the new x waits, goes nowhere: the new x
    gets its own prompt's KV and its own prompt's greedy output."""
    import asyncio

    first, second = _prompt(300, 6), _prompt(300, 7)
    with _engine(tiny_llama, tmp_path) as e:
        ref = e.generate(second, GREEDY)[0]
        e.generate(first, GREEDY)
    with _engine(tiny_llama, tmp_path) as e:
        assert e.tier is not None
        held: list = []
        e.tier._reader.submit = held.append  # the reads wait until this test runs them

        async def run() -> list:
            gone = e.submit(e.make_req(first, GREEDY, rid="x"))
            task = asyncio.ensure_future(gone.__anext__())
            while len(held) < 1:
                await asyncio.sleep(0.01)
            task.cancel()  # x leaves while its blocks are "read"
            await asyncio.gather(task, return_exceptions=True)
            await gone.aclose()
            while e.stats().waiting:
                await asyncio.sleep(0.01)
            again = e.submit(e.make_req(second, GREEDY, rid="x"))
            nxt = asyncio.ensure_future(again.__anext__())
            while len(held) < 2:
                await asyncio.sleep(0.01)
            held[0]()  # the first x's read ends now: its blocks must not become the second's
            held[1]()
            out = [await nxt]
            out += [d async for d in again]
            return out

        deltas = asyncio.run(run())
        final = deltas[-1].output
        assert final is not None and final.token_ids == ref.token_ids and final.cached_tokens == 288
        assert e.stats().kv_in_use_slots == 0
        e.check_integrity()


def test_the_disk_tier_refuses_what_it_cannot_hold(tiny_llama, tmp_path):
    from radixserve import Engine

    with pytest.raises(ValueError, match="kv_disk_block_tokens"):
        Engine(str(tiny_llama), kv_cache_tokens=512, page_size=4, kv_disk_dir=str(tmp_path), kv_disk_block_tokens=30)
    with pytest.raises(ValueError, match="kv_disk_dir"):
        Engine(str(tiny_llama), kv_cache_tokens=512, kv_disk_dir=str(tmp_path), disable_radix_cache=True)
