"""The disk tier: KV blocks of cached prompts in files that outlive the process. Pure Python:
bytes in, bytes out (engine/kv_tier.py moves them between these files and the KV pool).

A block is `block_tokens` tokens of one prompt in one namespace. Keys chain, as LMCache's and
vLLM's block hashes do: the first block's key hashes the model's fingerprint (weights, KV dtype
and layout), the namespace (every field of it) and its tokens; each next block's key hashes the
previous key and its own tokens. So a block is reachable only through the exact tokens before
it, in the same namespace, for the same model and KV layout; and the file says all of that again
in its header, which a read checks, so not even a hash collision can serve another prompt's,
model's or tenant's KV.

One file per block, `<tenant tag>-<key>-<retained until>.kv`, in a directory private to this
server's user (cache/disk_guard: 0700, ours, refused at start otherwise; one server at a time,
by a lock file):

    b"RSKVBLK2" | header length (u32 LE) | header (JSON, space-padded: the payload starts at a multiple of 64)
    | payload | HMAC-SHA256 of everything before it, under a key kept outside the directory

Writes go to a temporary file (named for its writer) that is renamed into place (atomic: a
reader sees a whole block or none); a crash leaves at most temporary files, removed at the next
start (which holds the lock: no writer of them is alive). A block whose bytes do not check out
(torn by a power loss, corrupted, truncated, another version, not signed with our key: planted)
or that is not a regular file (a link, a FIFO: opened without following or blocking) is a miss:
it is deleted and the caller recomputes.

The store is bounded (`capacity_bytes`): least recently used blocks go first; blocks retained
until a later time (`prompt_cache_retention`, `cache_control` TTLs) go after every other, but
may hold at most `retained_share` of the capacity: past it, the oldest retained blocks lose
their retention (the next to go), so a write is never dropped because retained blocks fill the
store. Per-tenant quotas (in tokens) hold here as in the pool, retained blocks included: a
tenant over its quota loses its own oldest blocks first (unretained before retained).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from radixserve.cache.disk_guard import DirLock, private_dir
from radixserve.cache.disk_index import BlockIndex, Entry
from radixserve.cache.prefix import Namespace

log = logging.getLogger(__name__)

MAGIC = b"RSKVBLK2"
VERSION = 2
_LEN = struct.Struct("<I")
MAC_BYTES = 32
ALIGN = 64  # the payload's offset in the file (and in the buffer a read fills): whole cache lines
MAX_HEADER = 1 << 20
RETAINED_SHARE = 0.5  # of the capacity, that retained blocks may hold
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def namespace_digest(ns: Namespace) -> str:
    """Every field of the namespace, whatever they are (a tenant, a salt, digests of them)."""
    return hashlib.sha256(repr(tuple(ns)).encode()).hexdigest()


def block_keys(fingerprint: str, ns: Namespace, tokens: list[int], block_tokens: int) -> list[str]:
    """The chained key of each whole block of `tokens` (a trailing partial block has none)."""
    h = hashlib.sha256(json.dumps([VERSION, fingerprint, namespace_digest(ns)]).encode()).digest()
    keys = []
    for i in range(0, len(tokens) - block_tokens + 1, block_tokens):
        h = hashlib.sha256(h + struct.pack(f"<{block_tokens}q", *tokens[i : i + block_tokens])).digest()
        keys.append(h.hex()[:40])
    return keys


def tenant_tag(tenant: str | None) -> str:
    return hashlib.sha256(str(tenant).encode()).hexdigest()[:8]


class NotABlock(Exception):
    """A file in the directory that is not a block we wrote."""


class DiskStore:
    def __init__(self, root: str | os.PathLike[str], capacity_bytes: int, block_tokens: int,
                 quotas: dict[str, int] | None = None, *, key: bytes, retained_share: float = RETAINED_SHARE) -> None:
        self.root = private_dir(root)
        self.capacity = capacity_bytes
        self.block_tokens = block_tokens
        self.quotas = {tenant_tag(t): q for t, q in (quotas or {}).items()}
        self._key = key
        self._lock = threading.Lock()
        self._index = BlockIndex(int(capacity_bytes * retained_share))
        self._writer = f"{os.getpid()}.{secrets.token_hex(4)}"  # in this store's temporary files' names
        self.corrupt = 0  # blocks found bad (and deleted) by reads
        self.dropped = 0  # writes given up: bigger than the bound or the tenant's quota
        self.on_removed: Callable[[str], None] | None = None  # told each key forgotten (KV events), under the lock
        self._dir_lock = DirLock(self.root)
        try:
            self._scan()
        except BaseException:
            self._dir_lock.release()
            raise

    def close(self) -> None:
        """Let another server open the directory."""
        self._dir_lock.release()

    # -- the index --------------------------------------------------------------------------
    def _scan(self) -> None:
        """Index what an earlier process left (least recently used first), removing its
        temporary files (a write it never finished) and anything named like a block that is
        not a regular file."""
        found = []
        for d in os.scandir(self.root):
            name = d.name
            if name.endswith(".tmp"):
                os.unlink(d.path)
                continue
            if not name.endswith(".kv") or name.count("-") != 2:
                continue
            st = d.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                os.unlink(d.path)
                continue
            tag, key, until = name[:-3].split("-")
            try:
                found.append((st.st_mtime, key, Entry(Path(d.path), st.st_size, tag, self.block_tokens, float(until))))
            except ValueError:
                continue
        now = time.time()
        with self._lock:
            for _, key, e in sorted(found, key=lambda f: f[0]):
                self._add(key, e, now)
        if found:
            log.info("KV disk tier: %d blocks (%.1f MiB) found in %s", len(found), self._index.bytes / 2**20, self.root)

    def _add(self, key: str, e: Entry, now: float) -> None:
        self._remove(key, keep=e.path)  # written twice at once: the same bytes, kept in the newer file
        self._index.add(key, e)
        if e.until > now:
            self._hold(key)

    def _hold(self, key: str) -> None:
        for old in self._index.hold(key):  # over the retained share: these lost their retention
            self._rename(old)

    def _rename(self, key: str) -> None:
        """The block's file name says its retention (`until`), for a restart to find."""
        e = self._index.entries[key]
        new = e.path.with_name(f"{e.tag}-{key}-{int(e.until)}.kv")
        try:
            os.replace(e.path, new)
        except OSError:
            return
        e.path = new

    def _remove(self, key: str, keep: Path | None = None) -> None:
        """Forget the block and delete its file (unless that file is `keep`)."""
        e = self._index.remove(key)
        if e is not None and e.path != keep:
            e.path.unlink(missing_ok=True)
        if e is not None and self.on_removed is not None:
            self.on_removed(key)

    def has(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def hits(self, keys: list[str]) -> int:
        """How many of `keys`, from the first, are stored (the chain a load could follow)."""
        with self._lock:
            n = 0
            while n < len(keys) and keys[n] in self._index:
                n += 1
            return n

    @property
    def num_bytes(self) -> int:
        return self._index.bytes

    @property
    def retained_bytes(self) -> int:
        return self._index.held_bytes

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def tenant_tokens(self, tenant: str | None) -> int:
        return self._index.tenant_tokens.get(tenant_tag(tenant), 0)

    # -- writing ----------------------------------------------------------------------------
    def retain(self, key: str, until: float) -> None:
        """Keep a stored block at least until `until` (its name says so: a rename)."""
        with self._lock:
            e = self._index.get(key)
            if e is None or e.until >= int(until):
                return
            e.until = float(int(until))
            self._rename(key)
            now = time.time()
            self._index.expire(now)
            if e.until > now:
                self._hold(key)

    def put(self, key: str, ns: Namespace, fingerprint: str, tokens: list[int], payload: bytes | memoryview,
            until: float = 0.0) -> bool:
        """Store one block (a no-op if it is there: then only its retention may grow). False if
        it is bigger than the bound or than the tenant's quota."""
        if self.has(key):
            self.retain(key, until)
            return True
        header = json.dumps({"v": VERSION, "key": key, "fingerprint": fingerprint, "ns": namespace_digest(ns),
                             "tokens": tokens, "payload": len(payload)}).encode()
        header += b" " * (-(len(MAGIC) + _LEN.size + len(header)) % ALIGN)  # the payload starts aligned
        body = MAGIC + _LEN.pack(len(header)) + header
        mac = hmac.new(self._key, body, hashlib.sha256)
        mac.update(payload)
        size = len(body) + len(payload) + MAC_BYTES
        tag = tenant_tag(ns.tenant)
        with self._lock:
            if not self._make_room(size, tag, len(tokens)):
                self.dropped += 1
                return False
        path = self.root / f"{tag}-{key}-{int(until)}.kv"
        tmp = self.root / f".{key}.{self._writer}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body)
                f.write(payload)
                f.write(mac.digest())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self._add(key, Entry(path, size, tag, len(tokens), float(int(until))), time.time())
        return True

    def _make_room(self, size: int, tag: str, tokens: int) -> bool:
        """Evict until `size` more bytes fit and the tenant stays within its quota: its own
        oldest blocks, then everyone's least recently used (retained ones last)."""
        self._index.expire(time.time())
        quota = self.quotas.get(tag)
        if quota is not None:
            if tokens > quota:
                return False
            while self._index.tenant_tokens.get(tag, 0) + tokens > quota and (old := self._index.oldest(tag)):
                self._remove(old)
        if size > self.capacity:
            return False
        while self._index.bytes + size > self.capacity and (old := self._index.oldest()):
            self._remove(old)
        return True

    # -- reading ----------------------------------------------------------------------------
    def get(self, key: str, ns: Namespace, fingerprint: str, tokens: list[int],
            payload_bytes: int | None = None) -> memoryview | None:
        """The payload of the block `key` if it is stored, whole, signed with our key, and is the
        block of exactly these tokens in this namespace for this model (and `payload_bytes`
        long, if given); else None (a bad block is deleted). The payload is a writable view
        (torch.frombuffer takes it without a copy)."""
        limit = self.capacity if payload_bytes is None else payload_bytes + MAX_HEADER + ALIGN + MAC_BYTES
        for _ in range(3):  # retain() may rename the file between the lookup and the open
            with self._lock:
                e = self._index.get(key)
                if e is None:
                    return None
                self._index.touch(key)
                path = e.path
            try:
                data = _read(path, limit)
                break
            except FileNotFoundError:
                continue
            except (OSError, NotABlock) as err:
                self._drop(key, path, f"unreadable ({err})")
                return None
        else:
            self._drop(key, path, "gone")
            return None
        payload = _parse(data, self._key, key, ns, fingerprint, tokens)
        if payload is None or (payload_bytes is not None and len(payload) != payload_bytes):
            self._drop(key, path, "corrupt, unsigned or not this prompt's")
            return None
        try:
            os.utime(path, follow_symlinks=False)  # recency survives a restart
        except OSError:
            pass
        return payload

    def _drop(self, key: str, path: Path, why: str) -> None:
        """Delete the block read from `path` (unless it has since been renamed: a new file)."""
        with self._lock:
            e = self._index.get(key)
            if e is None or e.path != path:
                return
            log.warning("KV disk tier: block %s is %s: a miss (deleted)", key, why)
            self.corrupt += 1
            self._remove(key)

    def clear(self) -> int:
        """Delete every block; returns how many."""
        with self._lock:
            keys = list(self._index.entries)
            for key in keys:
                self._remove(key)
        return len(keys)


def _read(path: Path, limit: int) -> bytearray:
    """The file's bytes: a regular file (never a link, a FIFO or a device: no wait), at most
    `limit` bytes."""
    fd = os.open(path, _OPEN)
    with os.fdopen(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotABlock("not a regular file")
        if st.st_size > limit:
            raise NotABlock(f"{st.st_size} bytes")
        data = bytearray(st.st_size)
        view, got = memoryview(data), 0
        while got < len(data) and (n := f.readinto(view[got:])):
            got += n
        if got != len(data):
            raise NotABlock("short read")
    return data


def _parse(data: bytearray, mac_key: bytes, key: str, ns: Namespace, fingerprint: str,
           tokens: list[int]) -> memoryview | None:
    start = len(MAGIC) + _LEN.size
    if len(data) < start + MAC_BYTES or not data.startswith(MAGIC):
        return None
    (hlen,) = _LEN.unpack_from(data, len(MAGIC))
    if hlen > MAX_HEADER or start + hlen + MAC_BYTES > len(data):
        return None
    view = memoryview(data)
    mac = hmac.new(mac_key, view[: len(data) - MAC_BYTES], hashlib.sha256).digest()
    if not hmac.compare_digest(mac, bytes(view[len(data) - MAC_BYTES :])):
        return None
    try:
        h = json.loads(bytes(view[start : start + hlen]))
    except ValueError:
        return None
    payload = view[start + hlen : len(data) - MAC_BYTES]
    ok = (isinstance(h, dict) and h.get("v") == VERSION and h.get("key") == key and h.get("fingerprint") == fingerprint
          and h.get("ns") == namespace_digest(ns) and h.get("tokens") == tokens and h.get("payload") == len(payload))
    return payload if ok else None
