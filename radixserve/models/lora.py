"""LoRA adapters in PEFT's format, many over one base model, mixed in one batch.

An adapter is a folder as PEFT saves it: `adapter_config.json` (`r`, `lora_alpha`,
`target_modules`, `use_rslora`) and `adapter_model.safetensors` (`...layers.N.self_attn.q_proj.
lora_A.weight` (r, in) and `lora_B.weight` (out, r)), on any of the decoder's linears: q, k, v,
o, gate, up, down. Its delta to a linear's output is x A^T B^T times alpha / r (rsLoRA:
alpha / sqrt(r)), folded into B at load.

Ours fuses q/k/v into qkv_proj and gate/up into gate_up_proj, so an adapter keeps, per layer and
fused linear, its parts' A matrices stacked (one shrink x A^T for all of them) and each part's B
with the output columns it adds to (one expand per part). A batch mixing adapters applies each
adapter to its own rows (`LoRARows`: rows grouped by adapter, shrink then expand per group,
S-LoRA's and Punica's SGMV: radixserve_kernels.lora), over whatever
the base linear is (float, packed or quantized): `LoRALinear` adds the deltas to the base
linear's output.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from radixserve.batch import LoRARows
from radixserve.models.config import ArchConfig
from radixserve_kernels.lora import lora_add

# PEFT's module name -> (our fused linear, its part)
TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
FUSED_STEP_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # decode_layers' order, per layer
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
MAX_ADAPTER_BYTES = 4 << 30


class AdapterError(ValueError):
    """An adapter that cannot be served: names the file, tensor or field at fault."""


def part_shapes(arch: ArchConfig) -> dict[str, tuple[int, int, int]]:
    """PEFT module -> (in features, out features, first output column in our fused linear)."""
    h, q, kv, inter = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    return {"q_proj": (h, q, 0), "k_proj": (h, kv, q), "v_proj": (h, kv, q + kv), "o_proj": (q, h, 0),
            "gate_proj": (h, inter, 0), "up_proj": (h, inter, inter), "down_proj": (inter, h, 0)}


@dataclass
class Fused:
    """One adapter on one of our linears: its parts' A stacked (sum of ranks, in), and one B^T
    (sum of ranks, out) holding each part's B^T, scaled, in that part's rank rows and output
    columns (zero elsewhere)."""

    a: torch.Tensor
    bt: torch.Tensor
    cols: torch.Tensor  # (sum of ranks, 2) int64: the output columns [first, end) of each rank row's part


@dataclass
class Adapter:
    name: str
    path: str
    digest: str  # of its files: its KV's namespace (the same weights under another name share it)
    rank: int
    alpha: float
    targets: list[str]
    linears: dict[tuple[int, str], Fused]
    nbytes: int
    step: tuple[Any, Any] | None = field(default=None, repr=False, compare=False)  # (kernels, step_weights' object)

    def step_weights(self, ops: Any, layers: int) -> Any:
        """Its weights as the fused decode step takes them (radixserve_kernels.cpu step_lora: A, Bt
        and cols per layer and linear), built once per kernels module."""
        if self.step is None or self.step[0] is not ops:
            fs = [self.linears.get((i, name)) for i in range(layers) for name in FUSED_STEP_LINEARS]
            self.step = (ops, ops.step_lora([f.a if f else None for f in fs], [f.bt if f else None for f in fs],
                                            [f.cols if f else None for f in fs]))
        return self.step[1]

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "rank": self.rank, "alpha": self.alpha, "targets": self.targets,
                "digest": self.digest, "bytes": self.nbytes}


def digest_of(path: str | Path) -> str:
    """A digest of the adapter's two files (what its KV depends on)."""
    folder = Path(path)
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        f = folder / name
        try:
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    h.update(chunk)
        except OSError as e:
            raise AdapterError(f"lora_path: cannot read {f}: {e.strerror or e}") from None
    return h.hexdigest()[:32]


def load_adapter(name: str, path: str | Path, arch: ArchConfig, dtype: torch.dtype, device: torch.device,
                 max_rank: int) -> Adapter:
    """Read and check a PEFT LoRA folder; AdapterError naming what is wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"lora_path: {str(path)!r} is not a folder (a PEFT adapter: adapter_config.json and "
                           "adapter_model.safetensors)")
    digest = digest_of(folder)
    try:
        cfg = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter_config.json: not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise AdapterError("adapter_config.json: not a JSON object")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)  # (PEFT's default alpha)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter_config.json: peft_type {cfg.get('peft_type')!r} is not served (LORA only)")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"adapter_config.json: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise AdapterError(f"adapter_config.json: r ({r}) is over this server's max_lora_rank ({max_rank})")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"adapter_config.json: lora_alpha must be a number, got {alpha!r}")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False)):
        if cfg.get(key, ok) != ok:
            raise AdapterError(f"adapter_config.json: {key}={cfg[key]!r} is not served")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"adapter_config.json: bias={cfg['bias']!r} is not served (only 'none')")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"adapter_config.json: modules_to_save {cfg['modules_to_save']!r} is not served")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise AdapterError("adapter_config.json: rank_pattern/alpha_pattern (per-module ranks) are not served")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    weights = folder / "adapter_model.safetensors"
    if weights.stat().st_size > MAX_ADAPTER_BYTES:
        raise AdapterError(f"adapter_model.safetensors: over {MAX_ADAPTER_BYTES >> 30} GiB")
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as e:
        raise AdapterError(f"adapter_model.safetensors: not a safetensors file ({e})") from None
    shapes = part_shapes(arch)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(f"adapter_model.safetensors: tensor {key!r} is not a LoRA A/B weight of a decoder linear")
        layer, module, which = int(m[1]), m[2], m[3]
        if module not in TARGETS:
            raise AdapterError(f"adapter_model.safetensors: {key!r} targets {module!r}; served: {', '.join(TARGETS)}")
        if not 0 <= layer < arch.num_layers:
            raise AdapterError(f"adapter_model.safetensors: {key!r}: layer {layer} of a {arch.num_layers}-layer model")
        if layer in arch.moe_layers and module in ("gate_proj", "up_proj", "down_proj"):
            raise AdapterError(f"adapter_model.safetensors: {key!r}: layer {layer}'s MLP is a mixture of experts")
        fan_in, fan_out, _ = shapes[module]
        want = (r, fan_in) if which == "A" else (fan_out, r)
        if tuple(t.shape) != want:
            raise AdapterError(f"adapter_model.safetensors: {key!r} has shape {tuple(t.shape)}, expected {want} "
                               f"(r={r} on this model)")
        pairs.setdefault((layer, module), {})[which] = t
    width = {"qkv_proj": shapes["q_proj"][1] + 2 * shapes["k_proj"][1], "o_proj": shapes["o_proj"][1],
             "gate_up_proj": 2 * shapes["gate_proj"][1], "down_proj": shapes["down_proj"][1]}
    grouped: dict[tuple[int, str], list[tuple[str, dict[str, torch.Tensor]]]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter_model.safetensors: layer {layer} {module} has lora_{''.join(ab)} without its pair")
        grouped.setdefault((layer, TARGETS[module][0]), []).append((module, ab))
    linears: dict[tuple[int, str], Fused] = {}
    nbytes = 0
    for (layer, fused), parts in grouped.items():
        a = torch.cat([ab["A"].float() for _, ab in parts]).to(device=device, dtype=dtype)
        bt = torch.zeros(r * len(parts), width[fused])
        cols = torch.zeros(r * len(parts), 2, dtype=torch.int64)
        for j, (module, ab) in enumerate(parts):
            _, fan_out, lo = shapes[module]
            bt[j * r : (j + 1) * r, lo : lo + fan_out] = ab["B"].float().t() * scale
            cols[j * r : (j + 1) * r] = torch.tensor([lo, lo + fan_out])
        linears[(layer, fused)] = Fused(a, bt.to(device=device, dtype=dtype).contiguous(), cols)
        nbytes += (a.numel() + bt.numel()) * a.element_size()
    if not linears:
        raise AdapterError("adapter_model.safetensors: holds no LoRA weights")
    targets = sorted({m for _, m in pairs})
    return Adapter(name, str(path), digest, r, float(alpha), targets, linears, nbytes)


def apply(rows: LoRARows, x: torch.Tensor, y: torch.Tensor, key: tuple[int, str]) -> torch.Tensor:
    """y (the base linear's output for x) plus each adapter's delta on its rows
    (radixserve_kernels.lora.lora_add: Triton, native or torch)."""
    present = [(f, lo, hi) for adapter, lo, hi in rows.groups if (f := adapter.linears.get(key)) is not None]
    if present:
        lora_add(y, x, rows.rows, [b for _, lo, hi in present for b in (lo, hi)], [f.a for f, _, _ in present],
                 [f.bt for f, _, _ in present], [f.cols for f, _, _ in present], rows.start)
    return y


class LoRAContext:
    """The rows of the forward pass under way (set by the model around it; None: no adapter)."""

    rows: LoRARows | None = None


class LoRALinear(nn.Module):
    """A base linear plus the adapters of the rows that have one."""

    def __init__(self, base: nn.Module, ctx: LoRAContext, key: tuple[int, str]) -> None:
        super().__init__()
        self.base, self.ctx, self.key = base, ctx, key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = self.ctx.rows
        return y if rows is None else apply(rows, x, y, self.key)


def wrap_model(model: nn.Module) -> LoRAContext:
    """Put a LoRALinear around every decoder linear an adapter may target; returns the context
    the model sets per forward pass."""
    ctx = LoRAContext()
    for i, layer in enumerate(model.model.layers):  # type: ignore[union-attr, arg-type]
        attn = layer.self_attn
        attn.qkv_proj = LoRALinear(attn.qkv_proj, ctx, (i, "qkv_proj"))
        attn.o_proj = LoRALinear(attn.o_proj, ctx, (i, "o_proj"))
        mlp = layer.mlp
        if hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj"):  # a dense MLP (not a mixture of experts)
            mlp.gate_up_proj = LoRALinear(mlp.gate_up_proj, ctx, (i, "gate_up_proj"))
            mlp.down_proj = LoRALinear(mlp.down_proj, ctx, (i, "down_proj"))
    return ctx
