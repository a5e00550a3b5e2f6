"""Files on disk hold against another local user and a hostile tenant (issue 44): the disk
tier's directory is private and locked, its blocks signed, its reads never follow a link or wait
on a FIFO; retention cannot switch the tier (or the pool) off for others; a write never scans
the index and pending writes are bounded; the model fingerprint covers every byte; the
Responses store is private; a crafted GGUF is a clear error."""

from __future__ import annotations

import os
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from radixserve.cache import disk
from radixserve.cache.disk import DiskStore, block_keys
from radixserve.cache.disk_guard import private_dir
from radixserve.cache.prefix import Namespace
from radixserve.cache.radix import RadixCache

A, B = Namespace("a"), Namespace("b")
FP = "fingerprint"
KEY = bytes(range(32))
ROOT = str(Path(__file__).parents[1])


def _store(root: Path, capacity: int = 1 << 20, key: bytes = KEY, **kw) -> DiskStore:
    return DiskStore(root, capacity, 16, key=key, **kw)


def _put(store: DiskStore, ns: Namespace, start: int, until: float = 0.0, fill: int = 1) -> str:
    toks = list(range(start, start + 16))
    key = block_keys(FP, ns, toks, 16)[0]
    assert store.put(key, ns, FP, toks, bytes([fill]) * 1000, until)
    return key


def _file(root: Path, key: str) -> Path:
    return next(root.glob(f"*-{key}-*.kv"))


# -- 5: the directory, the key, the reads ------------------------------------------------------
def test_a_block_planted_without_the_key_is_a_miss_and_is_deleted(tmp_path):
    """Whoever writes the directory can compute every header field; without the key (kept
    outside it) the block they plant for a chosen tenant and prompt is a miss."""
    root = tmp_path / "kv"
    planter = _store(root, key=b"not the server's key" + bytes(12))
    key = _put(planter, A, 0, fill=9)  # a well-formed block, signed with another key
    planter.close()
    store = _store(root)
    assert store.has(key) and store.get(key, A, FP, list(range(16))) is None
    assert store.corrupt == 1 and not store.has(key) and not list(root.glob("*.kv"))
    good = _put(store, A, 0, fill=3)
    assert bytes(store.get(good, A, FP, list(range(16)))) == bytes([3]) * 1000


def _get_within(store: DiskStore, key: str, toks: list[int], seconds: float = 5.0) -> object:
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(store.get(key, A, FP, toks)), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the read hung"
    return out[0]


def test_a_symlink_or_a_fifo_in_place_of_a_block_is_a_miss_and_never_hangs(tmp_path):
    root = tmp_path / "kv"
    store = _store(root)
    linked, piped = _put(store, A, 0), _put(store, A, 16)
    elsewhere = tmp_path / "target.kv"
    os.replace(_file(root, linked), elsewhere)  # a valid block's bytes, reached through a link
    os.symlink(elsewhere, root / f"{disk.tenant_tag('a')}-{linked}-0.kv")
    fifo = _file(root, piped)
    fifo.unlink()
    os.mkfifo(fifo)
    assert _get_within(store, linked, list(range(16))) is None
    assert _get_within(store, piped, list(range(16, 32))) is None
    assert store.corrupt == 2 and store.num_blocks == 0 and elsewhere.exists() and not list(root.glob("*.kv"))
    os.mkfifo(root / f"{disk.tenant_tag('a')}-{'0' * 40}-0.kv")  # one found at start: removed, no wait
    store.close()
    assert _store(root).num_blocks == 0 and not list(root.glob("*.kv"))


def test_a_directory_other_users_can_enter_or_that_is_not_ours_is_refused_at_start(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(ValueError, match=rf"kv_disk_dir: {shared} has mode 0755.*chmod 700"):
        _store(shared)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(theirs, 4242, -1)
    else:
        monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 4242)
    with pytest.raises(ValueError, match=rf"kv_disk_dir: {theirs} is owned by uid \d+, not by this server's user"):
        _store(theirs)


def test_a_new_directory_and_its_missing_parents_are_made_private(tmp_path):
    os.chmod(tmp_path, 0o755)
    root = tmp_path / "a" / "b" / "kv"
    _store(root).close()
    for d in (tmp_path / "a", tmp_path / "a" / "b", root):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o755  # what was there is left as it was


def test_the_engine_refuses_a_shared_disk_directory_at_start(tiny_llama, tmp_path):
    from radixserve import Engine

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o750)
    with pytest.raises(ValueError, match=rf"kv_disk_dir: {shared} has mode 0750"):
        Engine(str(tiny_llama), kv_cache_tokens=256, kv_disk_dir=str(shared))


def test_data_parallel_checks_the_replicas_parent_directory_before_a_replica_starts(tiny_llama, tmp_path):
    from radixserve.config import RouterConfig
    from radixserve.engine.data_parallel import DataParallelEngine

    parent = tmp_path / "kv"
    parent.mkdir()
    os.chmod(parent, 0o755)
    with pytest.raises(ValueError, match=rf"kv_disk_dir: {parent} has mode 0755"):
        DataParallelEngine(str(tiny_llama), RouterConfig(data_parallel=2), kv_disk_dir=str(parent))


def test_the_signing_key_is_made_once_private_and_outside_the_directory(tmp_path, monkeypatch):
    from radixserve.engine.kv_tier import KEY_ENV, disk_key

    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    root = private_dir(tmp_path / "kv")
    key = disk_key(root)
    file = tmp_path / "cache" / "kv-disk.key"
    assert len(key) == 32 and disk_key(root) == key and file.read_bytes() == key
    assert stat.S_IMODE(file.stat().st_mode) == 0o600 and stat.S_IMODE(file.parent.stat().st_mode) == 0o700
    os.chmod(file, 0o644)
    with pytest.raises(ValueError, match=r"key file .* mode 0600"):
        disk_key(root)
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(root))  # the key would sit beside the blocks
    with pytest.raises(ValueError, match="would lie inside"):
        disk_key(root)
    monkeypatch.setenv(KEY_ENV, "ab" * 32)
    assert disk_key(root) == bytes([0xAB]) * 32


# -- 13: one server per directory ---------------------------------------------------------------
def test_a_second_server_on_the_same_directory_is_refused_and_leaves_the_first_ones_files(tmp_path):
    root = tmp_path / "kv"
    first = _store(root)
    key = _put(first, A, 0)
    writing = root / f".{key}.{os.getpid()}.1234abcd.99.tmp"  # the first server's write under way
    writing.write_bytes(b"half a block")
    with pytest.raises(ValueError, match=rf"kv_disk_dir: {root} is in use by another radixserve server"):
        _store(root)
    script = (f"import sys; sys.path.insert(0, {ROOT!r})\nfrom radixserve.cache.disk import DiskStore\n"
              f"DiskStore({str(root)!r}, 1 << 20, 16, key=bytes(32))")
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert other.returncode != 0 and f"{root} is in use by another radixserve server" in other.stderr
    assert writing.exists() and first.has(key) and _file(root, key).exists()
    first.close()
    again = _store(root)  # the first is gone: its leftovers are the next one's to clear
    assert again.has(key) and not writing.exists()


# -- 4: retention ------------------------------------------------------------------------------
def test_retained_blocks_hold_at_most_half_the_store_and_never_stop_another_tenants_writes(tmp_path):
    store = _store(tmp_path / "kv", capacity=20_000)  # 14 blocks of ~1.4 kB
    later = time.time() + 86400
    for i in range(30):  # tenant a retains a flood of prompts for a day
        _put(store, A, 16 * i, until=later)
        assert store.retained_bytes <= 10_000 and store.num_bytes <= 20_000
    for i in range(30):  # tenant b's ordinary prompts are all stored, each while it is recent
        key = _put(store, B, 10_000 + 16 * i)
        assert store.has(key)
    assert store.dropped == 0 and store.retained_bytes <= 10_000 and store.tenant_tokens("b") >= 16 * 5
    retained = [p for p in (tmp_path / "kv").glob("*.kv") if int(p.name.rsplit("-", 1)[1][:-3]) > time.time()]
    assert sum(p.stat().st_size for p in retained) == store.retained_bytes
    store.close()
    again = _store(tmp_path / "kv", capacity=20_000)  # names on disk agree: a restart holds the same
    assert again.retained_bytes <= 10_000


def test_retained_blocks_count_against_their_tenants_quota(tmp_path):
    store = _store(tmp_path / "kv", quotas={"a": 32})
    later = time.time() + 3600
    first = _put(store, A, 0, until=later)
    _put(store, A, 16, until=later)
    third = _put(store, A, 32, until=later)  # over a's quota: its own oldest block goes
    assert store.tenant_tokens("a") == 32 and not store.has(first) and store.has(third)


def test_the_pool_keeps_retained_prompts_past_others_only_up_to_half_the_cache():
    c = RadixCache()
    later = time.time() + 3600
    for i in range(8):  # 80 retained tokens
        c.insert(A, list(range(100 * i, 100 * i + 10)), list(range(10 * i, 10 * i + 10)), retain=(10, later))
    c.insert(B, list(range(5000, 5020)), list(range(80, 100)))  # 20 ordinary ones
    assert sorted(c.evict(20)) == list(range(20))  # the oldest retained go, not b's prompt
    assert c.match(B, list(range(5000, 5020))).length == 20
    c.check_integrity()
    small = RadixCache()  # within the share, retained prompts still go last
    small.insert(A, list(range(10)), list(range(10)), retain=(10, later))
    small.insert(B, list(range(100, 130)), list(range(10, 40)))
    assert sorted(small.evict(10)) == list(range(10, 40))


# -- 12: no scan per write, pending writes bounded ----------------------------------------------
class _NoScan(dict):
    def _scan(self, *a: object) -> None:
        raise AssertionError("a write scanned every block")

    __iter__ = keys = values = items = _scan  # type: ignore[assignment]


def test_a_write_to_a_full_store_does_not_scan_the_index(tmp_path):
    n = 20_000
    store = _store(tmp_path / "kv", capacity=1000 * n + 1400 * 32, quotas={"a": 16 * 32})
    for i in range(n):  # a full store's oldest blocks (their files gone: eviction only unlinks them)
        store._add(f"{i:040x}", disk.Entry(tmp_path / "gone", 1000, disk.tenant_tag("b"), 16, 0.0), 0.0)
    for i in range(40):
        _put(store, A, 16 * i, until=time.time() + 60 if i % 3 else 0.0)
    store._index.entries = _NoScan(store._index.entries)  # from here, iterating the index fails
    for r in range(5):  # writes that evict, over quota and retained or not: none scans
        for i in range(20):
            _put(store, A if i % 2 else B, 10_000 * (r + 1) + 16 * i, until=time.time() + 60 if i % 4 == 1 else 0.0)
    store.close()


def test_pending_writes_are_bounded_by_a_share_of_the_pool(tmp_path):
    import torch

    from radixserve.engine.kv_tier import KVTier
    from radixserve.request import Req, SamplingParams

    class Pool:
        row_bytes = 64
        nbytes = 64 * 16 * 8  # the pool: 8 blocks of 16 tokens

        def gather(self, slots: list[int]) -> torch.Tensor:
            return torch.zeros(len(slots) * self.row_bytes, dtype=torch.uint8)

    store = _store(tmp_path / "kv")
    gate = threading.Event()
    put = store.put
    store.put = lambda *a: gate.wait(30) and put(*a)  # type: ignore[method-assign]
    tier = KVTier(store, Pool(), FP)  # type: ignore[arg-type]
    assert tier.max_pending_bytes == 64 * 16 * 4  # half the pool
    req = Req(list(range(16 * 20)), SamplingParams())
    tier.save(req, list(range(16 * 20)))
    assert tier._pending_bytes <= tier.max_pending_bytes and tier.skipped_tokens >= 16 * 15
    gate.set()
    assert tier.flush(30)
    assert tier.written_tokens + tier.skipped_tokens == 16 * 20 and tier._pending_bytes == 0
    tier.close()


# -- 14: the model fingerprint -----------------------------------------------------------------
def test_the_fingerprint_covers_every_byte_and_is_hashed_once_per_file_version(tmp_path, monkeypatch):
    from radixserve.engine import kv_tier
    from radixserve.models import files

    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hashed: list[Path] = []
    real = files._hash_file
    monkeypatch.setattr(files, "_hash_file", lambda f: hashed.append(f) or real(f))
    base = bytearray(os.urandom(3 << 20))
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one, two = tmp_path / "one" / "model.gguf", tmp_path / "two" / "model.gguf"
    one.write_bytes(base)
    base[len(base) // 2] ^= 1  # a same-size fine-tune: only the middle differs
    two.write_bytes(base)
    fp = kv_tier.model_fingerprint(one, ["llama"])
    assert fp != kv_tier.model_fingerprint(two, ["llama"]) and len(hashed) == 2
    assert kv_tier.model_fingerprint(one, ["llama"]) == fp and len(hashed) == 2  # remembered
    st = one.stat()
    os.utime(one, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched, the same bytes
    assert kv_tier.model_fingerprint(one, ["llama"]) == fp and len(hashed) == 3
    with open(one, "r+b") as f:  # rewritten in place, same size, its mtime set back
        f.seek(len(base) // 2)
        f.write(bytes([base[len(base) // 2]]))
    os.utime(one, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert kv_tier.model_fingerprint(one, ["llama"]) == kv_tier.model_fingerprint(two, ["llama"]) != fp
    assert stat.S_IMODE((tmp_path / "cache" / files.DIGESTS).stat().st_mode) == 0o600


# -- 9: the Responses store ----------------------------------------------------------------------
def test_the_responses_store_and_its_wal_are_private(tmp_path):
    from radixserve.server.responses.store import ResponseStore, StoredResponse

    path = tmp_path / "new" / "responses.sqlite3"
    store = ResponseStore(lambda: path, lambda: 10)
    store.put(StoredResponse("r1", "t", 1, b"{}", b"[]", b""))
    files = [path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")]
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    store.close()
    for f in files:
        if f.exists():
            os.chmod(f, 0o644)  # as an earlier version left them
    again = ResponseStore(lambda: path, lambda: 10)
    assert again.get("t", "r1") is not None
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files if f.exists())
    again.close()


# -- 15: crafted GGUF files ----------------------------------------------------------------------
def _s(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def _gguf(tmp_path: Path, kvs: list[bytes], tensors: list[bytes] = (), tail: bytes = b"") -> Path:
    p = tmp_path / "crafted.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors) + tail)
    return p


@pytest.mark.parametrize("case, match", [
    ("nested", r"metadata 'x': arrays nested more than 8 deep"),
    ("array", r"metadata 'x': an array at byte 37: 1,099,511,627,776 items"),
    ("string", r"metadata 'x': a string at byte 37"),
    ("key", r"a metadata key at byte 24: its length"),
    ("dims", r"tensor 't': n_dims 4,294,967,295 at byte \d+ \(at most 4\)"),
    ("dims5", r"tensor 't': n_dims 5"),
    ("count", r"the metadata count \(at byte 16\): 1,152,921,504,606,846,976 items"),
])
def test_a_crafted_gguf_is_a_clear_error_naming_the_field(tmp_path, case, match):
    from radixserve.models.gguf_file import GGUFFormatError, GGUFTensors

    x = _s("x")
    if case == "nested":
        path = _gguf(tmp_path, [x + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 0)])
    elif case == "array":
        path = _gguf(tmp_path, [x + struct.pack("<I", 9) + struct.pack("<IQ", 4, 1 << 40)])
    elif case == "string":
        path = _gguf(tmp_path, [x + struct.pack("<I", 8) + struct.pack("<Q", 1 << 62)])
    elif case == "key":
        path = _gguf(tmp_path, [struct.pack("<Q", 1 << 62)], tail=bytes(64))
    elif case == "count":
        p = tmp_path / "crafted.gguf"
        p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 60) + bytes(64))
        path = p
    else:
        n = 0xFFFFFFFF if case == "dims" else 5
        info = _s("t") + struct.pack("<I", n) + struct.pack(f"<{min(n, 5)}Q", *[1] * min(n, 5)) + struct.pack("<IQ", 0, 0)
        path = _gguf(tmp_path, [], [info], tail=bytes(64))
    with pytest.raises(GGUFFormatError, match=match):
        GGUFTensors(path)
    from radixserve.models.gguf import ModelLoadError, check_gguf

    with pytest.raises(ModelLoadError, match=match):  # before transformers' reader (gguf-py) reads it
        check_gguf(path)
