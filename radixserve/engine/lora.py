"""The engine's LoRA adapters (--enable-lora): registered by name (at start from --lora-modules,
at run time through the server's /v1/load_lora_adapter), at most `max_loras` of them in memory,
least recently used out first (an evicted one is read from its folder again at its next
request; a running request keeps the weights it started with).

A request names its adapter (`Req.lora`); `resolve` gives it the weights and moves its prefix
cache into the adapter's namespace (its cache_salt folded with the adapter's digest, no public
prefix): an adapter's KV never serves another adapter or the base model.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from radixserve.cache.prefix import salt_key
from radixserve.models.config import ArchConfig
from radixserve.models.lora import Adapter, AdapterError, digest_of, load_adapter, wrap_model
from radixserve.request import InvalidParam, Req

log = logging.getLogger(__name__)

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")


def parse_modules(spec: Any) -> list[tuple[str, str]]:
    """--lora-modules: NAME=PATH items (a list, or one string of them separated by spaces or commas)."""
    items = spec.replace(",", " ").split() if isinstance(spec, str) else list(spec or [])
    out = []
    for item in items:
        name, sep, path = str(item).partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules: {item!r} is not NAME=PATH")
        out.append((name, path))
    return out


class LoRAManager:
    def __init__(self, model: nn.Module, arch: ArchConfig, dtype: torch.dtype, device: torch.device,
                 max_loras: int, max_rank: int, base_name: str) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank: must be positive, got {max_loras} and {max_rank}")
        self.arch, self.dtype, self.device = arch, dtype, device
        self.max_loras, self.max_rank, self.base_name = max_loras, max_rank, base_name
        self.ctx = wrap_model(model)
        model.model.lora_ctx = self.ctx  # type: ignore[union-attr]
        self.registered: dict[str, tuple[str, str]] = {}  # name -> (path, digest)
        self.ids: dict[str, int] = {}  # name -> its number (vLLM's lora_int_id: KV events' lora_id), in load order
        self._next_id = 1
        self.resident: OrderedDict[str, Adapter] = OrderedDict()
        self.loads = self.evictions = 0

    def load(self, name: str, path: str) -> dict[str, Any]:
        """Register and read an adapter (AdapterError, a ValueError, naming the field at fault)."""
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise AdapterError(f"lora_name: {name!r} is not a name (letters, digits and ._:/@+-, up to 128)")
        if name == self.base_name:
            raise AdapterError(f"lora_name: {name!r} is the base model's name")
        if name in self.registered:
            raise AdapterError(f"lora_name: an adapter named {name!r} is already loaded; unload it first")
        adapter = self._read(name, path)
        self.registered[name] = (path, adapter.digest)
        self.ids[name], self._next_id = self._next_id, self._next_id + 1
        self._keep(adapter)
        log.info("LoRA adapter %r loaded from %s (rank %d, %s)", name, path, adapter.rank, ", ".join(adapter.targets))
        return {**adapter.describe(), "id": self.ids[name]}

    def unload(self, name: str) -> None:
        if name not in self.registered:
            raise AdapterError(f"lora_name: no adapter named {name!r} is loaded")
        del self.registered[name]
        del self.ids[name]
        self.resident.pop(name, None)
        log.info("LoRA adapter %r unloaded", name)

    def _read(self, name: str, path: str) -> Adapter:
        self.loads += 1
        return load_adapter(name, path, self.arch, self.dtype, self.device, self.max_rank)

    def _keep(self, adapter: Adapter) -> None:
        self.resident[adapter.name] = adapter
        self.resident.move_to_end(adapter.name)
        while len(self.resident) > self.max_loras:
            old, _ = self.resident.popitem(last=False)
            self.evictions += 1
            log.info("LoRA adapter %r left memory (over max_loras=%d); read again at its next request", old, self.max_loras)

    def get(self, name: str) -> Adapter:
        if name not in self.registered:
            raise InvalidParam("model", f"no adapter named {name!r} is loaded")
        adapter = self.resident.get(name)
        if adapter is None:
            path, digest = self.registered[name]
            if digest_of(path) != digest:
                raise InvalidParam("model", f"adapter {name!r}: its files changed since it was loaded; load it again")
            adapter = self._read(name, path)
        self._keep(adapter)
        return adapter

    def resolve(self, req: Req) -> None:
        """Give a request naming an adapter its weights and the adapter's cache namespace."""
        if req.lora is None or req.adapter is not None:
            return
        adapter = self.get(req.lora)
        req.adapter = adapter
        req.cache_salt = salt_key(f"lora:{adapter.digest}", req.cache_salt)
        req.public_prefix_len = 0

    def describe(self) -> list[dict[str, Any]]:
        return [{"name": n, "id": self.ids[n], "path": p, "digest": d, "resident": n in self.resident}
                for n, (p, d) in self.registered.items()]
