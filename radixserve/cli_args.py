"""Engine flags shared by every command; defaults are read from the config dataclasses."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from radixserve.config import CacheConfig, EngineConfig, ModelConfig, SchedConfig

# Config field -> (its group, the CLI value type); the flag is `--field-name`.
_ENGINE_FLAGS: dict[str, tuple[type, type]] = {
    "dtype": (ModelConfig, str),
    "device": (ModelConfig, str),
    "context_length": (ModelConfig, int),
    "kv_cache_tokens": (CacheConfig, int),
    "kv_mem_fraction": (CacheConfig, float),
    "page_size": (CacheConfig, int),
    "disable_radix_cache": (CacheConfig, bool),
    "radix_eviction_policy": (CacheConfig, str),
    "schedule_policy": (SchedConfig, str),
    "chunked_prefill_size": (SchedConfig, int),
    "max_running_requests": (SchedConfig, int),
    "max_total_tokens": (SchedConfig, int),
    "attention_backend": (EngineConfig, str),
}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct)")
    for name, (cls, typ) in _ENGINE_FLAGS.items():
        default = next(f.default for f in dataclasses.fields(cls) if f.name == name)
        flag = "--" + name.replace("_", "-")
        if typ is bool:
            p.add_argument(flag, dest=name, action="store_true", default=default)
        else:
            p.add_argument(flag, dest=name, type=typ, default=default, help=f"(default: {default})")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in _ENGINE_FLAGS}
