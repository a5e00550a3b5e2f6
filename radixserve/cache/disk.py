"""The disk tier: KV blocks of cached prompts in files that outlive the process. Pure Python:
bytes in, bytes out (engine/kv_tier.py moves them between these files and the KV pool).

A block is `block_tokens` tokens of one prompt in one namespace. Keys chain, as LMCache's and
vLLM's block hashes do: the first block's key hashes the model's fingerprint (weights, KV dtype
and layout), the namespace (tenant, cache_salt) and its tokens; each next block's key hashes the
previous key and its own tokens. So a block is reachable only through the exact tokens before
it, in the same namespace, for the same model and KV layout; and the file says all of that again
in its header, which a read checks, so not even a hash collision can serve another prompt's,
model's or tenant's KV.

One file per block, `<tenant tag>-<key>-<retained until>.kv` in one directory (mode 0700, files
0600: not readable by other users):

    b"RSKVBLK1" | header length (u32 LE) | header (JSON, space-padded: the payload starts at a multiple of 64)
    | payload | crc32 of header + payload (u32 LE)

Writes go to a temporary file that is renamed into place (atomic: a reader sees a whole block or
none); a crash leaves at most temporary files, removed at the next start. A block whose bytes
do not check out (torn by a power loss, corrupted, truncated, another version) is a miss: it is
deleted and the caller recomputes.

The store is bounded (`capacity_bytes`): least recently used blocks go first, but never a block
retained until a later time (`prompt_cache_retention`, `cache_control` TTLs) unless that time
has passed; a write that would need one is dropped instead. Per-tenant quotas (in tokens) hold
here as in the pool: a tenant over its quota loses its own oldest blocks first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from radixserve.cache.prefix import Namespace

log = logging.getLogger(__name__)

MAGIC = b"RSKVBLK1"
VERSION = 1
_LEN = struct.Struct("<I")
ALIGN = 64  # the payload's offset in the file (and in the buffer a read fills): whole cache lines


def block_keys(fingerprint: str, ns: Namespace, tokens: list[int], block_tokens: int) -> list[str]:
    """The chained key of each whole block of `tokens` (a trailing partial block has none)."""
    h = hashlib.sha256(json.dumps([VERSION, fingerprint, ns.tenant, ns.cache_salt]).encode()).digest()
    keys = []
    for i in range(0, len(tokens) - block_tokens + 1, block_tokens):
        h = hashlib.sha256(h + struct.pack(f"<{block_tokens}q", *tokens[i : i + block_tokens])).digest()
        keys.append(h.hex()[:40])
    return keys


def tenant_tag(tenant: str | None) -> str:
    return hashlib.sha256(str(tenant).encode()).hexdigest()[:8]


@dataclass
class Entry:
    path: Path
    size: int
    tag: str  # the tenant's tag
    tokens: int
    until: float  # retained until (epoch seconds; 0: not retained)


class DiskStore:
    def __init__(self, root: str | os.PathLike[str], capacity_bytes: int, block_tokens: int,
                 quotas: dict[str, int] | None = None) -> None:
        self.root = Path(root)
        self.capacity = capacity_bytes
        self.block_tokens = block_tokens
        self.quotas = {tenant_tag(t): q for t, q in (quotas or {}).items()}
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # key -> entry, least recently used first
        self._bytes = 0
        self._tenant_tokens: dict[str, int] = {}
        self.corrupt = 0  # blocks found bad (and deleted) by reads
        self.dropped = 0  # writes given up: the bound could not be kept without a retained block
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        self._scan()

    # -- the index --------------------------------------------------------------------------
    def _scan(self) -> None:
        """Index what an earlier process left (least recently used first), removing its
        temporary files (a write it never finished) and anything not named like a block."""
        found = []
        for p in self.root.iterdir():
            if p.suffix != ".kv" or p.name.count("-") != 2:
                if p.name.endswith(".tmp"):
                    p.unlink(missing_ok=True)
                continue
            tag, key, until = p.stem.split("-")
            try:
                st = p.stat()
                found.append((st.st_mtime, key, Entry(p, st.st_size, tag, self.block_tokens, float(until))))
            except (OSError, ValueError):
                continue
        for _, key, e in sorted(found, key=lambda f: f[0]):
            self._add(key, e)
        if found:
            log.info("KV disk tier: %d blocks (%.1f MiB) found in %s", len(found), self._bytes / 2**20, self.root)

    def _add(self, key: str, e: Entry) -> None:
        self._entries[key] = e
        self._bytes += e.size
        self._tenant_tokens[e.tag] = self._tenant_tokens.get(e.tag, 0) + e.tokens

    def _remove(self, key: str, keep: Path | None = None) -> None:
        """Forget the block and delete its file (unless that file is `keep`)."""
        e = self._entries.pop(key, None)
        if e is None:
            return
        self._bytes -= e.size
        self._tenant_tokens[e.tag] -= e.tokens
        if e.path != keep:
            e.path.unlink(missing_ok=True)

    def has(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def hits(self, keys: list[str]) -> int:
        """How many of `keys`, from the first, are stored (the chain a load could follow)."""
        with self._lock:
            n = 0
            while n < len(keys) and keys[n] in self._entries:
                n += 1
            return n

    @property
    def num_bytes(self) -> int:
        return self._bytes

    @property
    def num_blocks(self) -> int:
        return len(self._entries)

    def tenant_tokens(self, tenant: str | None) -> int:
        return self._tenant_tokens.get(tenant_tag(tenant), 0)

    # -- writing ----------------------------------------------------------------------------
    def retain(self, key: str, until: float) -> None:
        """Keep a stored block at least until `until` (its name says so: a rename)."""
        with self._lock:
            e = self._entries.get(key)
            if e is None or e.until >= until:
                return
            new = e.path.with_name(f"{e.tag}-{key}-{int(until)}.kv")
            try:
                os.replace(e.path, new)
            except OSError:
                return
            e.path, e.until = new, float(int(until))

    def put(self, key: str, ns: Namespace, fingerprint: str, tokens: list[int], payload: bytes | memoryview,
            until: float = 0.0) -> bool:
        """Store one block (a no-op if it is there: then only its retention may grow). False if
        the bound or the tenant's quota could not be kept without dropping a retained block."""
        if self.has(key):
            self.retain(key, until)
            return True
        header = json.dumps({"v": VERSION, "key": key, "fingerprint": fingerprint, "tenant": ns.tenant,
                             "salt": ns.cache_salt, "tokens": tokens, "payload": len(payload)}).encode()
        header += b" " * (-(len(MAGIC) + _LEN.size + len(header)) % ALIGN)  # the payload starts aligned
        body = MAGIC + _LEN.pack(len(header)) + header
        crc = zlib.crc32(payload, zlib.crc32(header))
        size = len(body) + len(payload) + _LEN.size
        tag = tenant_tag(ns.tenant)
        with self._lock:
            if not self._make_room(size, tag, len(tokens)):
                self.dropped += 1
                return False
        path = self.root / f"{tag}-{key}-{int(until)}.kv"
        tmp = self.root / f"{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body)
                f.write(payload)
                f.write(_LEN.pack(crc))
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            if key in self._entries:  # written twice at once: the same bytes, kept in the newer file
                self._remove(key, keep=path)
            self._add(key, Entry(path, size, tag, len(tokens), float(int(until))))
        return True

    def _make_room(self, size: int, tag: str, tokens: int) -> bool:
        """Evict (least recently used first, never a block retained past now) until `size`
        more bytes fit and the tenant stays within its quota."""
        now = time.time()
        quota = self.quotas.get(tag)
        if quota is not None and tokens > quota:
            return False
        if quota is not None and self._tenant_tokens.get(tag, 0) + tokens > quota:
            for key in [k for k, e in self._entries.items() if e.tag == tag and e.until <= now]:
                self._remove(key)
                if self._tenant_tokens.get(tag, 0) + tokens <= quota:
                    break
            if self._tenant_tokens.get(tag, 0) + tokens > quota:
                return False
        if self._bytes + size > self.capacity:
            for key in [k for k, e in self._entries.items() if e.until <= now]:
                self._remove(key)
                if self._bytes + size <= self.capacity:
                    break
        return self._bytes + size <= self.capacity

    # -- reading ----------------------------------------------------------------------------
    def get(self, key: str, ns: Namespace, fingerprint: str, tokens: list[int]) -> memoryview | None:
        """The payload of the block `key` if it is stored, whole, and is the block of exactly
        these tokens in this namespace for this model; else None (a corrupt block is deleted).
        The payload is a writable view (torch.frombuffer takes it without a copy)."""
        for _ in range(3):  # retain() may rename the file between the lookup and the open
            with self._lock:
                e = self._entries.get(key)
                if e is None:
                    return None
                self._entries.move_to_end(key)
                path = e.path
            try:
                with open(path, "rb") as f:
                    data = bytearray(os.fstat(f.fileno()).st_size)
                    if f.readinto(data) != len(data):
                        raise OSError("short read")
                break
            except FileNotFoundError:
                continue
            except OSError:
                self._drop(key, path, "unreadable")
                return None
        else:
            self._drop(key, path, "gone")
            return None
        payload = _parse(data, key, ns, fingerprint, tokens)
        if payload is None:
            self._drop(key, path, "corrupt or not this prompt's")
            return None
        try:
            os.utime(path)  # recency survives a restart
        except OSError:
            pass
        return payload

    def _drop(self, key: str, path: Path, why: str) -> None:
        """Delete the block read from `path` (unless it has since been renamed: a new file)."""
        with self._lock:
            e = self._entries.get(key)
            if e is None or e.path != path:
                return
            log.warning("KV disk tier: block %s is %s: a miss (deleted)", key, why)
            self.corrupt += 1
            self._remove(key)

    def clear(self) -> int:
        """Delete every block; returns how many."""
        with self._lock:
            keys = list(self._entries)
            for key in keys:
                self._remove(key)
        return len(keys)


def _parse(data: bytearray, key: str, ns: Namespace, fingerprint: str, tokens: list[int]) -> memoryview | None:
    if len(data) < len(MAGIC) + 2 * _LEN.size or not data.startswith(MAGIC):
        return None
    (hlen,) = _LEN.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    if start + hlen + _LEN.size > len(data):
        return None
    header_bytes = bytes(data[start : start + hlen])
    payload = memoryview(data)[start + hlen : len(data) - _LEN.size]
    (crc,) = _LEN.unpack_from(data, len(data) - _LEN.size)
    if zlib.crc32(payload, zlib.crc32(header_bytes)) != crc:
        return None
    try:
        h = json.loads(header_bytes)
    except ValueError:
        return None
    ok = (h.get("v") == VERSION and h.get("key") == key and h.get("fingerprint") == fingerprint
          and h.get("tenant") == ns.tenant and h.get("salt") == ns.cache_salt and h.get("tokens") == tokens
          and h.get("payload") == len(payload))
    return payload if ok else None
