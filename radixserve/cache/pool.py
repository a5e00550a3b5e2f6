"""Per-layer K and V tensors indexed by slot: `k[layer][slot] -> (kv_heads, head_dim)`."""

from __future__ import annotations

import logging

import torch

from kernels.store_kv import store_kv

log = logging.getLogger(__name__)


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


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
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_slots = num_slots
        # One extra zeroed slot, never allocated, that padded gathers point at. The rest is
        # left uninitialized (no multi-GB memset at start): a slot is read only once written.
        self.pad_slot = num_slots
        self.k = [torch.empty(num_slots + 1, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(num_slots + 1, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        for t in self.k + self.v:
            t[self.pad_slot].zero_()
        nbytes = 2 * num_layers * self.k[0].numel() * self.k[0].element_size()
        log.info("KV pool: %d slots x %d layers, %.1f MiB (%s)", num_slots, num_layers, nbytes / 2**20, dtype)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        store_kv(self.k[layer], self.v[layer], slots, k, v)
