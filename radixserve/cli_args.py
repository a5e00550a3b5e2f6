"""Engine flags shared by every command; defaults are read from the config dataclasses."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from radixserve.config import CacheConfig, EngineConfig, ModelConfig, SchedConfig

# CLI flag -> (config group, field); defaults are read from the dataclasses.
_ENGINE_FLAGS: dict[str, tuple[type, str, type]] = {
    "--dtype": (ModelConfig, "dtype", str),
    "--device": (ModelConfig, "device", str),
    "--context-length": (ModelConfig, "context_length", int),
    "--kv-cache-tokens": (CacheConfig, "kv_cache_tokens", int),
    "--kv-mem-fraction": (CacheConfig, "kv_mem_fraction", float),
    "--chunked-prefill-size": (SchedConfig, "chunked_prefill_size", int),
    "--max-running-requests": (SchedConfig, "max_running_requests", int),
    "--max-total-tokens": (SchedConfig, "max_total_tokens", int),
    "--attention-backend": (EngineConfig, "attention_backend", str),
}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct)")
    for flag, (cls, name, typ) in _ENGINE_FLAGS.items():
        default = {f.name: f.default for f in dataclasses.fields(cls)}[name]
        p.add_argument(flag, dest=name, type=typ, default=default, help=f"(default: {default})")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for _, name, _ in _ENGINE_FLAGS.values()}
