"""Load a model: the default SmolLM2, a local Hugging Face folder, or a .gguf file."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from radixserve.models import SUPPORTED_ARCHITECTURES, ArchConfig, model_class
from radixserve.models.gguf import ModelLoadError, default_gguf, ensure_converted

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass
class LoadedModel:
    model: nn.Module
    arch: ArchConfig
    tokenizer: Any  # a transformers tokenizer
    path: Path
    name: str


def resolve_model_dir(path: str | None) -> Path:
    """A Hugging Face folder for `path` (None: the default model), converting GGUF once."""
    if path is None:
        return ensure_converted(default_gguf())
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path {path!r} does not exist (expected a Hugging Face folder or a .gguf file)")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelLoadError(f"model path {path!r} is a file but not a .gguf file")
        return ensure_converted(p)
    if not (p / "config.json").exists():
        raise ModelLoadError(f"model folder {path!r} has no config.json")
    return p


def read_arch(folder: Path) -> ArchConfig:
    cfg = json.loads((folder / "config.json").read_text())
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch!r} in {folder}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return ArchConfig.from_hf(cfg)


def load_tokenizer(folder: Path) -> Any:
    if not any((folder / f).exists() for f in _TOKENIZER_FILES):
        raise ModelLoadError(f"model folder {folder} has no tokenizer (looked for {', '.join(_TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model folder {folder} has no .safetensors weights")
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def load_model(path: str | None, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    folder = resolve_model_dir(path)
    arch = read_arch(folder)
    tokenizer = load_tokenizer(folder)
    with torch.device("meta"):
        model = model_class(arch.architecture)(arch)
    model = model.to(dtype=dtype).to_empty(device=device)
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for m in model.modules():
        if hasattr(m, "reset_buffers"):
            m.reset_buffers()
    try:
        model.load_weights(iter_safetensors(folder))
    except ValueError as e:
        raise ModelLoadError(f"cannot load weights from {folder}: {e}") from e
    model.eval()
    name = path if path is not None else "SmolLM2-135M-Instruct"
    log.info("loaded %s (%s, %d layers) from %s as %s on %s", name, arch.architecture, arch.num_layers, folder, dtype, device)
    return LoadedModel(model, arch, tokenizer, folder, Path(str(name)).name)
