"""Engine flags shared by every command: one `--field-name` per scalar EngineConfig field,
with its default read from the config dataclasses (one source of truth)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from radixserve.config import CacheConfig, EngineConfig, ModelConfig, SchedConfig, SpecConfig

_TYPES = {"int": int, "float": float, "str": str, "bool": bool}
_NOT_FLAGS = {"path"}  # --model


Flag = tuple[Any, type, tuple[str, ...] | None]  # default, value type, choices (a field's metadata["choices"])


def scalar_fields(*classes: type) -> dict[str, Flag]:
    """Config field -> (its default, the CLI value type, its choices), for every field of a scalar type."""
    out: dict[str, Flag] = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            typ = _TYPES.get(str(f.type).split(" | ")[0])
            if typ is None or f.name in _NOT_FLAGS:
                continue  # config groups and mappings (tenant quotas come from --tenants)
            out[f.name] = (f.default, typ, f.metadata.get("choices"))
    return out


_ENGINE_FLAGS = scalar_fields(ModelConfig, CacheConfig, SchedConfig, SpecConfig, EngineConfig)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct)")
    add_flags(p, _ENGINE_FLAGS)


def add_flags(p: argparse.ArgumentParser, flags: dict[str, Flag]) -> None:
    for name, (default, typ, choices) in flags.items():
        flag = "--" + name.replace("_", "-")
        if typ is bool:
            p.add_argument(flag, dest=name, action="store_true", default=default)
        else:
            p.add_argument(flag, dest=name, type=typ, default=default, choices=choices, help=f"(default: {default})")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in _ENGINE_FLAGS}
