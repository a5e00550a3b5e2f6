"""Engine flags shared by every command: one `--field-name` per scalar EngineConfig field,
with its default, description and choices read from the config dataclasses (one source of truth)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from radixserve.config import CacheConfig, EngineConfig, ModelConfig, SchedConfig, SpecConfig

_TYPES = {"int": int, "float": float, "str": str, "bool": bool}
LOG_LEVELS = ["debug", "info", "warning", "error"]
_NOT_FLAGS = {"path"}  # --model


@dataclasses.dataclass(frozen=True)
class Flag:
    """One config field as a CLI flag: its default, value type, description and choices (the
    field's metadata["help"] and metadata["choices"])."""

    default: Any
    type: type
    help: str = ""
    choices: tuple[str, ...] | None = None
    many: bool = False  # a tuple of values: the flag takes one or more

    def help_text(self) -> str:
        """The description, then the default; a bool flag says what it turns on (off by default)."""
        text = self.help.replace("%", "%%")  # argparse %-formats help
        if self.type is bool:
            return text
        return f"{text} (default: {self.default})".lstrip()


def scalar_fields(*classes: type) -> dict[str, Flag]:
    """Config field -> its Flag, for every field of a scalar type."""
    out: dict[str, Flag] = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            many = str(f.type) == "tuple[str, ...]"
            typ = str if many else _TYPES.get(str(f.type).split(" | ")[0])
            if typ is None or f.name in _NOT_FLAGS:
                continue  # config groups and mappings (tenant quotas come from --tenants)
            out[f.name] = Flag(f.default, typ, f.metadata.get("help", ""), f.metadata.get("choices"), many)
    return out


_ENGINE_FLAGS = scalar_fields(ModelConfig, CacheConfig, SchedConfig, SpecConfig, EngineConfig)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct)")
    add_flags(p, _ENGINE_FLAGS)


def add_flags(p: argparse.ArgumentParser, flags: dict[str, Flag]) -> None:
    for name, f in flags.items():
        flag = "--" + name.replace("_", "-")
        if f.type is bool:  # off by default: the flag turns it on (a field on by default gets --no-...)
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            p.add_argument(flag, dest=name, action=action, default=f.default, help=f.help_text())
        elif f.many:
            p.add_argument(flag, dest=name, type=f.type, nargs="+", default=f.default, help=f.help_text())
        else:
            p.add_argument(flag, dest=name, type=f.type, default=f.default, choices=f.choices, help=f.help_text())


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in _ENGINE_FLAGS}


def add_log_level(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="log verbosity (default: info)")


def run_command(fn: Any, args: argparse.Namespace) -> int:
    """A command's exit status: a bad option or model (ValueError, ModelLoadError among them) is
    one line on stderr and status 2, ^C is 130."""
    import sys

    try:
        return int(fn(args))
    except ValueError as e:
        print(f"radixserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
