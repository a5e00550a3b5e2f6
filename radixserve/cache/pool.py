"""Per-layer K and V tensors indexed by slot: `k[layer][slot] -> (kv_heads, head_dim)`.

The pool stores K/V in the activations' dtype, or in the one `--kv-cache-dtype` names: bf16,
or int8 / fp8 e4m3 with an fp32 scale per (slot, KV head) in `k_scale[layer]` and
`v_scale[layer]` (kernels/radixserve_kernels/kv_quant.py). Writing quantizes; backends read either in place
(the native CPU decode kernels take the pool and its scales) or through `read`, which
returns the rows in the activations' dtype.

With `window_slots` > 0 the sliding-window layers (those with a window in `layer_windows`)
have tensors of their own size, indexed by the window pool's slots (cache/allocator
WindowedAllocator): they keep only the KV their windows still see. Every other layer is
indexed by the full slots.
"""

from __future__ import annotations

import logging

import torch

from radixserve_kernels.kv_quant import SCALE_DTYPE, dequantize, is_quantized
from radixserve_kernels.store_kv import store_kv, store_kv_quant

log = logging.getLogger(__name__)

KV_CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}


def kv_cache_dtype(name: str, activations: torch.dtype) -> torch.dtype:
    """The pool's dtype for a `kv_cache_dtype` name; auto: the activations' dtype."""
    if name == "auto":
        return activations
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: {name!r} is not supported; choose from: auto, {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token in `num_layers` layers, stored as dtype: with their scales if it is quantized."""
    row = head_dim * torch.empty((), dtype=dtype).element_size()
    if is_quantized(dtype):
        row += torch.empty((), dtype=SCALE_DTYPE).element_size()
    return 2 * num_layers * kv_heads * row


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable", info["MemFree"])
    except OSError:
        return 4 << 30


class KVPool:
    """`dtype`: the activations' (what `read` returns); `kv_dtype`: what is stored (default:
    the same). Quantized pools have `k_scale`/`v_scale` per layer, else those lists are empty."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_dtype: torch.dtype | None = None,
        layer_windows: tuple[int, ...] = (),
        window_slots: int = 0,
    ) -> None:
        self.num_slots = num_slots
        self.window_slots = window_slots  # 0: one pool for every layer
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.quantized = is_quantized(self.kv_dtype)
        # One extra zeroed slot, never allocated, that padded gathers point at. The rest is
        # left uninitialized (no multi-GB memset at start): a slot is read only once written.
        self.pad_slot = num_slots
        self.window_pad_slot = window_slots
        windowed = [bool(window_slots and layer_windows and layer_windows[i]) for i in range(num_layers)]

        def tensors(*shape: int, dtype: torch.dtype) -> list[torch.Tensor]:
            return [torch.empty((window_slots if w else num_slots) + 1, *shape, dtype=dtype, device=device) for w in windowed]

        self.k, self.v = tensors(kv_heads, head_dim, dtype=self.kv_dtype), tensors(kv_heads, head_dim, dtype=self.kv_dtype)
        self.k_scale: list[torch.Tensor] = tensors(kv_heads, dtype=SCALE_DTYPE) if self.quantized else []
        self.v_scale: list[torch.Tensor] = tensors(kv_heads, dtype=SCALE_DTYPE) if self.quantized else []
        for t in self.k + self.v + self.k_scale + self.v_scale:
            t[-1].zero_()  # the pad slot; a zero scale: it reads as zeros when quantized too
        self.parts = [*self.k, *self.v, *self.k_scale, *self.v_scale]  # a token's KV, in `gather`'s order
        self.part_row_bytes = [t[0].numel() * t.element_size() for t in self.parts]
        self.row_bytes = sum(self.part_row_bytes)  # one slot's KV as stored, scales included
        n_win = sum(windowed)
        self.bytes_per_token = kv_bytes_per_token(num_layers, kv_heads, head_dim, self.kv_dtype)  # every layer
        self.window_bytes_per_token = kv_bytes_per_token(n_win, kv_heads, head_dim, self.kv_dtype)  # in the window pool
        kind = str(self.kv_dtype).removeprefix("torch.")
        if n_win:
            log.info("KV pool: %d slots x %d full layers and %d window slots x %d sliding-window layers, %.1f MiB (%s)",
                     num_slots, num_layers - n_win, window_slots, n_win, self.nbytes / 2**20, kind)
        else:
            log.info("KV pool: %d slots x %d layers, %.1f MiB (%s)", num_slots, num_layers, self.nbytes / 2**20, kind)

    @property
    def nbytes(self) -> int:
        w = self.window_bytes_per_token
        return self.num_slots * (self.bytes_per_token - w) + self.window_slots * w

    def gather(self, slots: list[int]) -> torch.Tensor:
        """The stored KV of `slots`, as bytes on the CPU: each part's rows in turn (every layer's
        K, every layer's V, then their scales), len(slots) * row_bytes in all. A one-pool layout only
        (the disk tier and the KV hand-off refuse a sliding-window pool)."""
        idx = torch.tensor(slots, dtype=torch.long, device=self.k[0].device)
        return torch.cat([t.index_select(0, idx).reshape(-1).view(torch.uint8) for t in self.parts]).cpu()

    def scatter(self, data: torch.Tensor, rows: int, slots: list[int], skip: int = 0) -> None:
        """Write rows [skip, skip + len(slots)) of `data`, what `gather` made of `rows` slots, into `slots`."""
        dst = torch.tensor(slots, dtype=torch.long, device=self.k[0].device)
        off = 0
        for t, rb in zip(self.parts, self.part_row_bytes):
            part = data[off : off + rows * rb].view(t.dtype).view(rows, *t.shape[1:])
            t.index_copy_(0, dst, part[skip : skip + len(slots)].to(t.device))
            off += rows * rb

    def pad_for(self, window: int) -> int:
        """The zeroed pad slot of a layer with this window (0: a full-attention layer)."""
        return self.window_pad_slot if window and self.window_slots else self.pad_slot

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.quantized:
            store_kv_quant(self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer], slots, k, v)
        else:
            store_kv(self.k[layer], self.v[layer], slots, k.to(self.kv_dtype), v.to(self.kv_dtype))

    def read(self, layer: int, kv: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows of the slots `kv` (a slice, or an index tensor of any shape), each
        (*kv's shape, kv_heads, head_dim) in the activations' dtype: views of the pool when it
        stores that dtype and kv is a slice, else copies (dequantized)."""
        return self._rows(self.k, self.k_scale, layer, kv), self._rows(self.v, self.v_scale, layer, kv)

    def _rows(self, pool: list[torch.Tensor], scales: list[torch.Tensor], layer: int, kv: slice | torch.Tensor) -> torch.Tensor:
        def take(t: torch.Tensor) -> torch.Tensor:
            return t[kv] if isinstance(kv, slice) else t.index_select(0, kv.reshape(-1)).view(*kv.shape, *t.shape[1:])

        if self.quantized:
            return dequantize(take(pool[layer]), take(scales[layer]), self.dtype)
        return take(pool[layer]).to(self.dtype)
