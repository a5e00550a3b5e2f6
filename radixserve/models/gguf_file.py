"""A GGUF file's tensor index, read in well under a second, and its tensors as views of a
read-only memory map.

gguf-py's `GGUFReader` parses every metadata value into numpy views first: on a model with a
150k-entry vocabulary (Qwen2.5) that is ~14 s before the first tensor. The weights need only
the tensor infos, and the config only the scalars, so this walks the metadata by its lengths,
keeping scalars, strings and arrays of numbers in `metadata` (an array of strings, the
vocabulary, as its length unless asked for), reads the infos, and maps the file. `release(t)`
hands a tensor's pages back once it has been packed, so a load does not hold the whole file
resident beside the packed weights.

Layout (GGUF v2/v3, little-endian): magic, version u32, tensor count u64, metadata count u64;
metadata (key string, value type u32, value); tensor infos (name string, n_dims u32, dims u64
each, fastest first, type u32, offset u64); padding to `general.alignment` (32); tensor data.

Every count and length is checked against what the rest of the file can hold before it is used,
arrays nest at most MAX_DEPTH deep and tensors have at most GGML_MAX_DIMS dimensions: a crafted
or damaged file is a GGUFFormatError naming the field and its byte offset, never a recursion or
an allocation its header asks for.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# metadata value type -> its size in bytes (8: string, 9: array, handled apart), its struct code
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_CODE = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MIN_SIZE = {**_SCALAR, _STRING: 8, _ARRAY: 12}  # the fewest bytes a value of each type takes
MAX_DEPTH = 8  # metadata arrays of arrays (gguf-py and llama.cpp write one level)
GGML_MAX_DIMS = 4


class GGUFFormatError(ValueError):
    """Not a GGUF file this reader understands, or one cut short."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest dimension first
    offset: int  # from the file's start
    nbytes: int


class GGUFTensors:
    """The tensors of one GGUF file (see the module docstring). Use as a context manager."""

    def __init__(self, path: Path, strings: tuple[str, ...] = ()) -> None:
        """`strings`: the arrays of strings to keep in `metadata` whole (e.g. the vocabulary)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = path
        self.metadata: dict[str, Any] = {}  # scalars, strings, arrays of numbers; string arrays as their length
        self._strings = strings
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            infos, alignment, end = self._index()
            size = len(self._map)
            start = (end + alignment - 1) // alignment * alignment
            self.tensors: list[TensorInfo] = []
            for name, dims, kind, off in infos:
                try:
                    qt = GGMLQuantizationType(kind)
                except ValueError:
                    raise GGUFFormatError(f"tensor {name!r} has an unknown type {kind}") from None
                block, type_size = GGML_QUANT_SIZES[qt]
                count = 1
                for d in dims:
                    count *= d
                nbytes = count // block * type_size
                t = TensorInfo(name, qt, dims, start + off, nbytes)
                if t.offset + nbytes > size:
                    raise GGUFFormatError(f"the file looks truncated: tensor {name!r} ends at byte {t.offset + nbytes:,}, "
                                          f"past the file's {size:,} bytes")
                self.tensors.append(t)
        except BaseException:
            self._map.close()
            raise

    def data(self, t: TensorInfo) -> Any:
        """The tensor's bytes: a read-only uint8 numpy view of the map (no copy)."""
        import numpy as np

        return np.frombuffer(self._map, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    def release(self, t: TensorInfo) -> None:
        """Drop the tensor's pages from this process's memory (they stay in the page cache)."""
        page = mmap.PAGESIZE
        lo = t.offset // page * page
        try:
            self._map.madvise(mmap.MADV_DONTNEED, lo, t.offset + t.nbytes - lo)
        except (AttributeError, OSError, ValueError):  # no madvise here: the pages stay until close
            pass

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # a view is still alive: the map closes when it goes
            pass

    def __enter__(self) -> GGUFTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the index ---------------------------------------------------------------------
    def _index(self) -> tuple[list[tuple[str, tuple[int, ...], int, int]], int, int]:
        m = self._map
        if len(m) < 24 or m[:4] != b"GGUF":
            raise GGUFFormatError("not a GGUF file (no GGUF magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
        if version < 2:
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 or 3)")
        self._fits(n_kv, 8 + 4 + 1, 24, "the metadata count (at byte 16)")
        self._fits(n_tensors, 8 + 4 + 4 + 8, 24, "the tensor count (at byte 8)")
        pos, alignment = 24, 32
        try:
            for _ in range(n_kv):
                key, pos = self._string(pos, "a metadata key")
                (vtype,) = struct.unpack_from("<I", m, pos)
                if key == "general.alignment" and vtype == _UINT32:
                    (alignment,) = struct.unpack_from("<I", m, pos + 4)
                end = self._skip(vtype, pos + 4, key[:80], 0)
                self.metadata[key] = self._value(vtype, pos + 4, end, key in self._strings)
                pos = end
            infos = []
            for _ in range(n_tensors):
                name, pos = self._string(pos, "a tensor name")
                (n_dims,) = struct.unpack_from("<I", m, pos)
                if n_dims > GGML_MAX_DIMS:
                    raise GGUFFormatError(f"tensor {name[:80]!r}: n_dims {n_dims:,} at byte {pos:,} (at most {GGML_MAX_DIMS})")
                dims = struct.unpack_from(f"<{n_dims}Q", m, pos + 4)
                kind, off = struct.unpack_from("<IQ", m, pos + 4 + 8 * n_dims)
                pos += 4 + 8 * n_dims + 12
                infos.append((name, tuple(int(d) for d in dims), kind, off))
        except struct.error:
            raise GGUFFormatError("the file looks truncated: its header ends early") from None
        if alignment <= 0:
            raise GGUFFormatError(f"general.alignment {alignment} is not positive")
        return infos, alignment, pos

    def _fits(self, count: int, item: int, pos: int, what: str) -> None:
        """`count` values of at least `item` bytes each fit in the file from `pos` on."""
        left = len(self._map) - pos
        if count * item > left:
            raise GGUFFormatError(f"{what}: {count:,} items of at least {item} bytes each, more than the "
                                  f"{max(left, 0):,} bytes left in the file from byte {pos:,}")

    def _string(self, pos: int, what: str) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._map, pos)
        self._fits(n, 1, pos + 8, f"{what} at byte {pos:,}: its length")
        return self._map[pos + 8 : pos + 8 + n].decode("utf-8", "replace"), pos + 8 + n

    def _value(self, vtype: int, pos: int, end: int, strings: bool) -> Any:
        """The value `_skip` has checked from `pos` to `end` (an array of strings: its length, or
        its strings if `strings`)."""
        m = self._map
        if vtype in _SCALAR:
            return struct.unpack_from("<" + _CODE[vtype], m, pos)[0]
        if vtype == _STRING:
            return m[pos + 8 : end].decode("utf-8", "replace")
        etype, count = struct.unpack_from("<IQ", m, pos)
        if etype in _SCALAR:
            return list(struct.unpack_from(f"<{count}{_CODE[etype]}", m, pos + 12))
        if etype != _STRING or not strings:
            return count
        out, pos = [], pos + 12
        for _ in range(count):
            (n,) = struct.unpack_from("<Q", m, pos)
            out.append(m[pos + 8 : pos + 8 + n].decode("utf-8", "replace"))
            pos += 8 + n
        return out

    def _skip(self, vtype: int, pos: int, key: str, depth: int) -> int:
        if vtype in _SCALAR:
            return pos + _SCALAR[vtype]
        if vtype == _STRING:
            (n,) = struct.unpack_from("<Q", self._map, pos)
            self._fits(n, 1, pos + 8, f"metadata {key!r}: a string at byte {pos:,}")
            return pos + 8 + n
        if vtype == _ARRAY:
            if depth >= MAX_DEPTH:
                raise GGUFFormatError(f"metadata {key!r}: arrays nested more than {MAX_DEPTH} deep (at byte {pos:,})")
            etype, count = struct.unpack_from("<IQ", self._map, pos)
            if etype not in _MIN_SIZE:
                raise GGUFFormatError(f"metadata {key!r}: unknown array item type {etype} at byte {pos:,}")
            self._fits(count, _MIN_SIZE[etype], pos + 12, f"metadata {key!r}: an array at byte {pos:,}")
            pos += 12
            if etype in _SCALAR:
                return pos + count * _SCALAR[etype]
            for _ in range(count):
                pos = self._skip(etype, pos, key, depth + 1)
            return pos
        raise GGUFFormatError(f"metadata {key!r}: unknown value type {vtype} at byte {pos - 4:,}")
