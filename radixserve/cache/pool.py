"""Per-layer K and V tensors indexed by slot: `k[layer][slot] -> (kv_heads, head_dim)`.

The pool stores K/V in the activations' dtype, or in the one `--kv-cache-dtype` names: bf16,
or int8 / fp8 e4m3 with an fp32 scale per (slot, KV head) in `k_scale[layer]` and
`v_scale[layer]` (kernels/kv_quant.py). Writing quantizes; backends read either in place
(the native CPU decode kernels take the pool and its scales) or through `read`, which
returns the rows in the activations' dtype.
"""

from __future__ import annotations

import logging

import torch

from kernels.kv_quant import SCALE_DTYPE, dequantize, is_quantized
from kernels.store_kv import store_kv, store_kv_quant

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
    """K and V of one token in every layer, stored as dtype: with their scales if it is quantized."""
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
    ) -> None:
        self.num_slots = num_slots
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.quantized = is_quantized(self.kv_dtype)
        # One extra zeroed slot, never allocated, that padded gathers point at. The rest is
        # left uninitialized (no multi-GB memset at start): a slot is read only once written.
        self.pad_slot = num_slots

        def tensors(*shape: int, dtype: torch.dtype) -> list[torch.Tensor]:
            return [torch.empty(num_slots + 1, *shape, dtype=dtype, device=device) for _ in range(num_layers)]

        self.k, self.v = tensors(kv_heads, head_dim, dtype=self.kv_dtype), tensors(kv_heads, head_dim, dtype=self.kv_dtype)
        self.k_scale: list[torch.Tensor] = tensors(kv_heads, dtype=SCALE_DTYPE) if self.quantized else []
        self.v_scale: list[torch.Tensor] = tensors(kv_heads, dtype=SCALE_DTYPE) if self.quantized else []
        for t in self.k + self.v + self.k_scale + self.v_scale:
            t[self.pad_slot].zero_()  # a zero scale: the pad slot reads as zeros when quantized too
        self.bytes_per_token = kv_bytes_per_token(num_layers, kv_heads, head_dim, self.kv_dtype)
        log.info("KV pool: %d slots x %d layers, %.1f MiB (%s)", num_slots, num_layers,
                 num_slots * self.bytes_per_token / 2**20, str(self.kv_dtype).removeprefix("torch."))

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
