"""Quantized weights (models/quant.py; kernels/radixserve_kernels/csrc/quant_linear.cpp and kquant_linear.cpp:
pack_quant / dequant_quant / qlinear): every kernel of every kind on every build this CPU runs
against a torch reference on fresh random inputs, the GGUF reader against gguf-py, and the
served models against their dequantized selves."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from radixserve import Engine, SamplingParams
from radixserve.models import quant

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import quants  # noqa: E402

QTYPES = {"q4_0": QT.Q4_0, "q4_1": QT.Q4_1, "q8_0": QT.Q8_0}  # also on CUDA (kernels/radixserve_kernels/quant_matmul.py)
KINDS = {**QTYPES, "mxfp4": QT.MXFP4, "q5_0": QT.Q5_0, "q5_1": QT.Q5_1, "q4_k": QT.Q4_K, "q5_k": QT.Q5_K, "q6_k": QT.Q6_K}
PANEL_KINDS = (*QTYPES, "mxfp4")  # the 4- and 8-bit panels (quant_linear.cpp): dequant_ref reads them
SHAPES = [(1, 32), (37, 64), (100, 96), (16, 576), (33, 160)]  # odd output counts: partial panels
K_SHAPES = [(1, 256), (37, 512), (16, 768), (33, 256)]  # super-blocks of 256


KIND_SHAPES = [(kind, n, k) for kind in KINDS for n, k in (K_SHAPES if kind.endswith("_k") else SHAPES)]


# where each kind keeps its fp16 scales, in bytes of its block: random blocks get sane ones
_FP16_AT = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,), QT.IQ4_NL: (0,)}


def random_blocks(qt: QT, n: int, k: int, rng: np.random.Generator, scale: float = 1e-3) -> np.ndarray:
    """Valid blocks of a type gguf-py cannot quantize to (the K-quants): random values and
    sub-block scales, fp16 super-block scales near `scale`."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, (n, k // block, nbytes), dtype=np.uint8)
    for at in _FP16_AT[qt]:
        d = (scale * (0.5 + rng.random((n, k // block)))).astype(np.float16)
        raw[..., at:at + 2] = d.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def gguf_blocks(kind: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights in GGUF blocks of `kind` (quantized by gguf-py where it can, else random
    valid blocks): (raw blocks, gguf-py's dequantized fp32)."""
    rng = np.random.default_rng(seed)
    qt = KINDS[kind]
    if qt in _FP16_AT:
        raw = random_blocks(qt, n, k, rng)
    else:
        raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qt)
    return torch.from_numpy(raw.copy()), torch.from_numpy(quants.dequantize(raw, qt).reshape(n, k).copy())


STEPS = {8: 127.0, 16: 32639.0}  # act_bits -> the integer steps of a block's largest value


def reference_qlinear(x: torch.Tensor, w: torch.Tensor, bits: int = 16) -> torch.Tensor:
    """What qlinear computes: each row's activations rounded per block of 32 to amax/127 (8
    bits) or amax/32639 (16 bits) steps, with the kernel's fp32 roundings (xi = round(x *
    (steps / amax)), half to even), then their exact dot product with the dequantized weight
    (float64)."""
    m, k = x.shape
    xp = F.pad(x.float(), (0, (-k) % 32)).view(m, -1, 32)
    amax = xp.abs().amax(-1, keepdim=True)
    steps = torch.tensor(STEPS[bits], dtype=torch.float32)
    inv = torch.where(amax > 0, steps / amax.clamp_min(1e-38), torch.zeros_like(amax))
    xi = torch.round((xp * inv).clamp(-steps, steps))
    xq = xi.double() * (amax / steps).double()
    return xq.view(m, -1)[:, :k] @ w.double().T


@pytest.mark.parametrize("kind,n,k", KIND_SHAPES)
def test_pack_then_dequantize_reproduces_gguf_py_bit_for_bit(ops, kind, n, k):
    raw, ref = gguf_blocks(kind, n, k, seed=n * 1000 + k)
    packed = ops.pack_quant(raw, kind, n, k)
    assert packed.shape == quant.packed_shape(kind, n, k)
    assert torch.equal(ops.dequant_quant(packed, n, k, None), ref)
    if kind in PANEL_KINDS:
        assert torch.equal(quant.dequant_ref(packed, n, k), ref)  # the torch path, for devices without the kernels
    rows = torch.tensor([n - 1, 0, n // 2, n - 1])
    assert torch.equal(ops.dequant_quant(packed, n, k, rows), ref[rows])
    file_bytes = raw.numel()
    assert file_bytes <= packed.numel() <= 1.03 * file_bytes + 16 * 2368 * k // 32  # the file's size (+ a ragged panel)


@pytest.mark.parametrize("kind,n,k", KIND_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 17, 64])
def test_qlinear_is_the_dot_product_with_8_or_16_bit_activations(ops, kind, n, k, m):
    raw, w = gguf_blocks(kind, n, k, seed=m + n + k)
    packed = ops.pack_quant(raw, kind, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * n))
    exact = x.double() @ w.double().T
    for bits in (8, 16):
        ref = reference_qlinear(x, w, bits)
        scale = ref.abs().max().item() + 1e-6
        for generic in (False, True):  # the build's vector path and the portable one
            y = ops.qlinear(x, packed, n, None, False, generic, bits)
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert (y.double() - ref).abs().max().item() <= 2e-5 * scale, (bits, generic)
        # and against unquantized activations: 16 bits lose ~1e-4, 8 bits ~1e-2
        assert (y.double() - exact).abs().max().item() <= (1e-3 if bits == 16 else 5e-2) * scale, bits


def test_mxfp4_scales_fp16_cannot_hold_are_refused_and_a_block_of_zeros_takes_any(ops):
    """MXFP4 packs its block scale 2^(e - 128) and m = -12d as fp16: exact for 104 <= e <= 140.
    A block of zeros (codes +0 / -0) may carry any scale (the packed one is 1); another scale is
    refused by pack_quant, and `packable` tells the loader to dequantize that tensor instead."""
    raw, _ = gguf_blocks("mxfp4", 16, 64, seed=3)
    zero = raw.clone()
    zero.view(16, 2, 17)[5, 1] = torch.tensor([0] + [0x88] * 16, dtype=torch.uint8)  # -0s, scale 2^-128
    q = quant.QuantTensor("mxfp4", zero, 16, 64)
    assert quant.packable(q)
    assert torch.equal(ops.dequant_quant(ops.pack_quant(zero, "mxfp4", 16, 64), 16, 64, None), q.dequantize())
    big = raw.clone()
    big.view(16, 2, 17)[3, 0, 0] = 150  # 2^22: beyond fp16
    assert not quant.packable(quant.QuantTensor("mxfp4", big, 16, 64))
    with pytest.raises(RuntimeError, match="outside what fp16 holds exactly"):
        ops.pack_quant(big, "mxfp4", 16, 64)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("bits", [8, 16])
def test_every_builds_qlinear_makes_the_same_integer_sums_so_the_same_numbers(kind, bits):
    """The AVX-512 VNNI tile (vpdpbusd) and the AVX2 one (vpmaddubsw + vpmaddwd) sum the same
    integers and combine them in the same order: the same output bit for bit (and for the 5/6-bit
    and K-quant kinds, the portable path too: it does the same fused multiply-adds), at a few rows
    and at many (the K-family tiles then unpack each panel once for all rows: AVX2's from 16,
    AVX-512's from 32 for the kinds with high-bit planes; AMX, where the CPU has it, at 40), over
    more rows than a pass takes (150: two passes, the numbers of its rows called 64 at a time),
    and from bf16 rows (each build quantizes the rows alike)."""
    from radixserve_kernels import cpu

    builds = [cpu.ops_for(isa) for isa in cpu.runnable_isas() if isa != "generic"]
    if len(builds) < 2:
        pytest.skip(f"this CPU runs one vector build only ({cpu.runnable_isas()[0]})")
    n, k = 70, 256 * 3
    raw, _ = gguf_blocks(kind, n, k, seed=11)
    packs = [b.pack_quant(raw, kind, n, k) for b in builds]
    for m in (1, 3, 4, 9, 22, 40, 150):
        for dtype in (torch.float32, torch.bfloat16) if m in (9, 150) else (torch.float32,):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
            ys = [b.qlinear(x, p, n, None, True, False, bits) for b, p in zip(builds, packs)]
            if kind not in PANEL_KINDS:
                ys.append(builds[0].qlinear(x, packs[0], n, None, True, True, bits))
            assert all(torch.equal(ys[0], y) for y in ys[1:]), (m, dtype)
            if m > 64:
                alone = torch.cat([builds[0].qlinear(x[i:i + 64], packs[0], n, None, True, False, bits) for i in (0, 64, 128)])
                assert torch.equal(ys[0], alone)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("bits", [8, 16])
def test_the_amx_tiles_make_the_vnni_tiles_numbers_bit_for_bit(kind, bits):
    """On a CPU with AMX-INT8, calls of 32 rows or more run on the tiles (csrc/amx.h): the same
    integer sums as vpdpbusd, scaled by the same float operations in the same order, so the
    output is the VNNI path's bit for bit (whatever the batch: a request's numbers do not depend
    on how many rows it shares a step with): whole 16-row tiles and a ragged last one, a ragged
    last panel, bf16 in and out with a bias, and qlinear_many."""
    from radixserve_kernels import cpu

    ops = cpu.ops_for("avx512")
    if ops is None or not ops.set_amx(True):
        pytest.skip("no AMX-INT8 on this CPU (or the kernel refused the tile state)")
    assert ops.isa().endswith("+amx")
    n, k = 70, 256 * 3
    raw, _ = gguf_blocks(kind, n, k, seed=5)
    packed = ops.pack_quant(raw, kind, n, k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    try:
        for m in (32, 45, 64):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            runs = []
            for amx in (True, False):
                ops.set_amx(amx)
                runs.append((ops.qlinear(x, packed, n, None, True, False, bits),
                             ops.qlinear(x.bfloat16(), packed, n, bias, False, False, bits),
                             ops.qlinear_many([x, x[:33]], [packed, packed], [n, n], bits)))
            (a, ab, am), (v, vb, vm) = runs
            assert torch.equal(a, v) and torch.equal(ab, vb), m
            assert all(torch.equal(p, q) for p, q in zip(am, vm)), m
            assert (a.double() - reference_qlinear(x, torch.from_numpy(
                quants.dequantize(raw.numpy(), KINDS[kind]).reshape(n, k).copy()), bits)).abs().max() \
                <= 2e-5 * a.abs().max()
    finally:
        ops.set_amx(True)


# the bytes of a GGUF block that hold its quants (every other byte: scales), per 5/6-bit kind
_QUANT_BYTES = {"q5_0": (2, 22), "q5_1": (4, 24), "q4_k": (16, 144), "q5_k": (16, 176), "q6_k": (0, 192)}


@pytest.mark.parametrize("kind", list(_QUANT_BYTES))
def test_the_largest_quants_against_full_scale_activations_sum_without_overflow(kind):
    """Every quant at its largest (15, 31 or 63) against activations all at +127 or all at
    -127 (8 bits): the AVX2 tile adds vpmaddubsw's 16-bit pair sums before widening, four
    chunks at a time (two for 6 bits); any wrap shows against the reference's exact sum."""
    n, k, m = 16, 512, 12  # (12: the AVX2 K-family tiles' many-row path, three groups of 4)
    raw, _ = gguf_blocks(kind, n, k, seed=3)
    qt = KINDS[kind]
    block, size = quants.GGML_QUANT_SIZES[qt]
    lo, hi = _QUANT_BYTES[kind]
    blocks = raw.numpy().reshape(n, k // block, size).copy()
    blocks[..., lo:hi] = 0xFF
    raw = torch.from_numpy(blocks.reshape(n, -1))
    w = torch.from_numpy(quants.dequantize(raw.numpy(), qt).reshape(n, k).copy())
    x = torch.ones(m, k) * torch.tensor([[1.0], [-1.0], [3.0], [-0.5]]).repeat(3, 1)
    ref = reference_qlinear(x, w, 8)
    from radixserve_kernels import cpu

    for isa in cpu.runnable_isas():  # every build this CPU runs (AVX2's tile on an AVX-512 machine too)
        b = cpu.ops_for(isa)
        for generic in (False, True):
            y = b.qlinear(x, b.pack_quant(raw, kind, n, k), n, None, True, generic, 8)
            assert (y.double() - ref).abs().max().item() <= 2e-5 * ref.abs().max().item(), (isa, generic)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("bits", [8, 16])
def test_qlinear_takes_bf16_a_bias_and_returns_fp32_logits_when_asked(ops, kind, bits):
    n, k, m = 50, 256 if kind.endswith("_k") else 96, 3
    raw, w = gguf_blocks(kind, n, k, seed=7)
    packed = ops.pack_quant(raw, kind, n, k)
    x = torch.randn(m, k).bfloat16()
    bias = torch.randn(n)
    ref = reference_qlinear(x.float(), w, bits) + bias.double()
    y = ops.qlinear(x, packed, n, bias, False, False, bits)
    assert y.dtype == torch.bfloat16 and (y.double() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()
    y32 = ops.qlinear(x, packed, n, bias, True, False, bits)
    assert y32.dtype == torch.float32 and (y32.double() - ref).abs().max().item() <= 2e-5 * ref.abs().max().item()


def test_the_kernels_refuse_what_they_cannot_run(ops):
    raw, _ = gguf_blocks("q4_1", 16, 64, seed=1)
    with pytest.raises(RuntimeError, match="kind must be q4_0, q4_1, q8_0, mxfp4, q5_0, q5_1, q4_k, q5_k or q6_k"):
        ops.pack_quant(raw, "q2_k", 16, 64)
    with pytest.raises(RuntimeError, match="multiple of 256 for q4_k"):
        ops.pack_quant(raw, "q4_k", 16, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.pack_quant(raw, "q4_1", 16, 48)
    with pytest.raises(RuntimeError, match="rows of 2 q4_1 blocks"):
        ops.pack_quant(raw[:, :20], "q4_1", 16, 64)
    packed = ops.pack_quant(raw, "q4_1", 16, 64)
    with pytest.raises(RuntimeError, match="packed by pack_quant for this n and k"):
        ops.qlinear(torch.randn(2, 128), packed, 16, None, False, False, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.dequant_quant(packed, 16, 64, torch.tensor([16]))


@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize("k", [64, 80])  # 80: padded to whole blocks
def test_load_time_quantization_makes_valid_gguf_blocks_within_half_a_step(ops, method, k):
    n = 40
    w = torch.randn(n, k) * 0.1
    q = quant.QUANTIZERS[method](w)
    assert q.kind == ("q4_1" if method == "int4" else "q8_0") and q.k == (k + 31) // 32 * 32
    raw = q.raw.numpy()
    theirs = torch.from_numpy(quants.dequantize(raw, QTYPES[q.kind]).reshape(n, q.k).copy())[:, :k]
    ours = ops.dequant_quant(quant.pack(q), n, k, None)
    assert torch.equal(ours, theirs)  # gguf-py reads our blocks as we do
    blocks = q.raw.view(n, -1, 20 if method == "int4" else 34)
    d = blocks[..., :2].contiguous().view(torch.float16).float().squeeze(-1)  # (n, blocks)
    if method == "int8":
        assert torch.equal(d, d[:, :1].expand_as(d))  # per-channel: one scale per output row
        step = d[:, :1]
    else:
        step = d.repeat_interleave(32, 1)[:, :k]
    assert ((ours - w).abs() <= step * 0.5 + 1e-3 * step + 1e-6).all()


@pytest.mark.parametrize("bits", [8, 16, 0])
def test_a_quant_linear_runs_many_rows_on_the_dequantized_weight_or_the_native_kernel_in_passes(ops, monkeypatch, bits):
    """Prefill (more than 64 rows): dequantize + fp32 GEMM gives exactly the dequantized model's
    numbers; the native path (the default with VNNI) is one call, which the kernel takes in
    passes of rows, and gives, row for row, what it gives those rows in calls of 64 (a row's
    numbers do not depend on the rows beside it). Float activations (act_bits 0): the
    dequantized model's numbers at any row count."""
    raw, w = gguf_blocks("q4_1", 70, 64, seed=3)
    mod = quant.QuantLinear(70, 64, "q4_1", bias=True)
    mod.packed.copy_(ops.pack_quant(raw, "q4_1", 70, 64))
    with torch.no_grad():
        mod.bias.copy_(torch.randn(70))
    mod.finish()
    mod.native = ops
    mod.act_bits = bits
    x = torch.randn(2 * quant.MAX_NATIVE_ROWS + 5, 64)
    tol = {16: 1e-3, 8: 2e-2, 0: 0.0}[bits]
    with torch.no_grad():
        monkeypatch.setattr(quant, "NATIVE_PREFILL", False)
        assert torch.equal(mod(x), F.linear(x, w, mod.bias))  # prefill: the dequantized model's numbers
        monkeypatch.setattr(quant, "NATIVE_PREFILL", True)
        if bits:
            chunks = [ops.qlinear(x[i:i + 64].contiguous(), mod.packed, 70, mod.native_bias, False, False, bits)
                      for i in range(0, len(x), 64)]
            assert torch.equal(mod(x), torch.cat(chunks))
        assert (mod(x) - F.linear(x, w, mod.bias)).abs().max() <= tol
        few = mod(x[:3])
    assert (few - F.linear(x[:3], w, mod.bias)).abs().max() <= tol


# -- GGUF files ------------------------------------------------------------------------------
def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (what the reader undoes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(path, folder, kinds: dict[str, str], extra: dict[str, np.ndarray] | None = None,
                     meta=None) -> dict[str, torch.Tensor]:
    """The tiny Llama's weights as a GGUF file: linears in the given GGUF types (q/k rows
    permuted as llama.cpp stores them; the K-quants random blocks, not the folder's weights),
    the rest F32, and `extra` tensors as given. Returns the weights it stands for (the
    dequantized values, under Hugging Face names)."""
    import json

    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    names = {v: k for k, v in {**_gguf_names(cfg["num_hidden_layers"])}.items()}
    w = gguf.GGUFWriter(str(path), "llama")
    if meta is not None:
        meta(w)
    meant = {}
    for hf, tensor in state.items():
        if hf not in names:
            continue
        name, arr = names[hf], tensor.float().numpy()
        kind = next((q for part, q in kinds.items() if part in name), None) if arr.ndim == 2 else None
        heads = cfg["num_attention_heads"] if ".attn_q." in name else cfg["num_key_value_heads"]
        if kind is None:
            meant[hf] = torch.from_numpy(arr)
            w.add_tensor(name, _llama_permute(arr, heads) if ".attn_q." in name or ".attn_k." in name else arr)
            continue
        qt = getattr(QT, kind.upper())
        if qt in _FP16_AT:  # no quantizer in gguf-py: random blocks of about the weight's size
            raw = random_blocks(qt, *arr.shape, np.random.default_rng(len(meant)), scale=5e-4)
        else:
            raw = quants.quantize(arr, qt)
        meant[hf] = torch.from_numpy(quants.dequantize(raw, qt).reshape(arr.shape).copy())
        if ".attn_q." in name or ".attn_k." in name:
            raw = _llama_permute(raw, heads)
        w.add_tensor(name, raw, raw_dtype=getattr(QT, kind.upper()))
    for name, arr in (extra or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return meant


def _gguf_names(layers: int) -> dict[str, str]:
    from radixserve.models.gguf import hf_name

    parts = ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    names = [f"blk.{i}.{p}.weight" for i in range(layers) for p in parts] + ["token_embd.weight", "output_norm.weight"]
    return {n: hf_name(n) for n in names}


def _logits(model, ids: list[int]) -> torch.Tensor:
    from tests.helpers import forward_prompt

    return forward_prompt(model, ids)


@pytest.mark.parametrize("embed_kind", ["q8_0", "q4_0"])
def test_a_gguf_file_is_served_from_its_blocks_as_its_dequantized_weights_are(ops, tiny_llama, tmp_path, caplog, embed_kind,
                                                                            monkeypatch):
    import json

    from radixserve.models.config import ArchConfig
    from radixserve.models.gguf import read_tensors
    from radixserve.models.loader import _build

    path = tmp_path / "tiny.gguf"
    kinds = {"attn_q": "q4_1", "attn_k": "q4_1", "attn_v": "q4_1", "attn_output": "q4_0", "ffn_gate": "q8_0",
             "ffn_up": "q8_0", "ffn_down": "iq4_nl", "token_embd": embed_kind}  # iq4_nl: not native, dequantized
    meant = _write_tiny_gguf(path, tiny_llama, kinds)
    cfg = json.loads((tiny_llama / "config.json").read_text())
    arch = ArchConfig.from_hf(cfg)
    model = _build(arch, torch.float32, torch.device("cpu"), read_tensors(path, cfg)).eval()
    assert "IQ4_NL tensors are dequantized to float" in caplog.text
    expected = {"q4_1": 2, "q4_0": 2, "q8_0": 2}  # per layer: qkv, o, gate_up (down is the iq4_nl one)
    expected[embed_kind] += 2  # the embedding, and the head tied to it
    assert quant.describe(model) == expected
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, quant.QuantLinear)
    assert isinstance(model.model.layers[0].mlp.down_proj, torch.nn.Linear)  # the iq4_nl one
    assert model.lm_head.packed is model.model.embed_tokens.packed  # tied: one copy of the blocks
    ref = _build(arch, torch.float32, torch.device("cpu"), iter(meant.items())).eval()
    long_prompt = _check_prefill(model, ref, arch.vocab_size, monkeypatch)
    short = long_prompt[:9]
    err = (_logits(model, short) - _logits(ref, short)).abs().max().item()
    assert err < 1e-3  # few rows: the integer kernel


def _emulated(model: torch.nn.Module, ids: list[int], bits: int, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """The model's logits with every quantized linear replaced by reference_qlinear: its
    activations rounded as the kernel rounds them, then an exact product with the dequantized
    weight (float64, cast back): what the integer kernels compute, layer after layer."""
    def forward(self: quant.QuantLinear, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).float()
        y = reference_qlinear(x2, self.dequantized(), bits)
        if self.bias is not None:
            y = y + self.bias.double()
        return y.to(torch.float32 if self.float_out else x.dtype).view(*x.shape[:-1], self.out_features)

    with monkeypatch.context() as m:
        m.setattr(quant.QuantLinear, "forward", forward)
        return _logits(model, ids)


def _check_prefill(model: torch.nn.Module, ref: torch.nn.Module, vocab: int, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A prompt past one native call's rows: prefill dequantized gives exactly the reference's
    logits; prefill on the integer kernel at 16- and 8-bit activations what the same rounding
    of the activations gives in torch (and at 16 bits, close to the reference: random weights
    amplify rounding, 8 bits' far more); float activations exactly the reference's. Returns the
    prompt."""
    prompt = [(i * 37) % (vocab - 3) + 3 for i in range(quant.MAX_NATIVE_ROWS + 8)]
    # one thread: MKL may take fewer threads when the machine is busy (MKL_DYNAMIC), and another
    # split of the sums rounds differently (seen once in CI on a loaded 2-core Xeon)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _check_prefill_at_one_thread(model, ref, prompt, monkeypatch)
    finally:
        torch.set_num_threads(threads)


def _check_prefill_at_one_thread(model: torch.nn.Module, ref: torch.nn.Module, prompt: list[int],
                                 monkeypatch: pytest.MonkeyPatch) -> list[int]:
    theirs = _logits(ref, prompt)
    with monkeypatch.context() as m:
        m.setattr(quant, "NATIVE_PREFILL", False)
        assert torch.equal(_logits(model, prompt), theirs)
        m.setattr(quant, "NATIVE_PREFILL", True)
        for act, bits in (("int16", 16), ("int8", 8)):
            assert quant.set_activations(model, act) == act
            ours, emulated = _logits(model, prompt), _emulated(model, prompt, bits, monkeypatch)
            diff, top = (ours - emulated).abs(), emulated.abs().max().item()
            # summation order differs by ~1e-7, which now and then moves a value across a rounding
            # boundary of the next layer's activations: one step there (1/127 of a block at 8 bits),
            # which these random weights amplify (8 bits against the float model: ~5e-2 on average)
            assert diff.mean().item() < 5e-4 * top and diff.max().item() < (1e-3 if bits == 16 else 3e-2) * top, act
        assert (ours.argmax(-1) == emulated.argmax(-1)).float().mean().item() >= 0.95
        quant.set_activations(model, "int16")
        ours = _logits(model, prompt)
        assert (ours - theirs).abs().max().item() < 1e-2 * theirs.abs().max().item()
        assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item() >= 0.95
        assert quant.set_activations(model, "float") == "float"
        assert torch.equal(_logits(model, prompt), theirs)
        quant.set_activations(model, "int16")
    return prompt


@pytest.mark.parametrize("kind,runs,head_bits", [("q8_0", "int8 (head int16)", 16), ("q6_k", "int8", 8)])
def test_auto_keeps_an_8_bit_head_at_16_bits_and_a_coarser_one_at_8(ops, kind, runs, head_bits):
    """`--activations auto`: 8 bits everywhere, but 16 for a head whose weights are 8-bit (Q8_0:
    SmolLM2's), where the activations' rounding is as large as the weights'; a K-quant head
    (Qwen2.5's Q6_K) takes 8 like the rest (quant.WIDE_HEAD_KINDS). The explicit choices apply
    to the head too."""

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = quant.QuantLinear(256, 256, "q4_k", bias=False)
            self.lm_head = quant.QuantLinear(512, 256, kind, bias=False)

    model = Model()
    for q in (model.body, model.lm_head):
        q.finish()
    assert quant.set_activations(model, "auto") == runs
    assert model.body.act_bits == 8 and model.lm_head.act_bits == head_bits
    assert quant.set_activations(model, "int16") == "int16" and model.lm_head.act_bits == 16
    assert quant.set_activations(model, "int8") == "int8" and model.lm_head.act_bits == 8


@pytest.fixture(scope="module")
def wide_llama(tiny_llama, tmp_path_factory):
    """The tiny Llama's tokenizer on a model 256 wide (K-quant rows are super-blocks of 256)."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    d = tmp_path_factory.mktemp("wide")
    cfg = json.loads((tiny_llama / "config.json").read_text())
    cfg.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    (d / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(d)), dtype=torch.float32).save_pretrained(str(d))
    (d / "config.json").write_text(json.dumps(cfg))
    for f in tiny_llama.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (d / f.name).write_bytes(f.read_bytes())
    return d


def test_a_gguf_file_of_k_quants_is_served_from_its_blocks_as_its_dequantized_weights_are(ops, wide_llama, tmp_path, monkeypatch):
    """Every kind of a Q4_K_M / Q5_K_M file at once: q and k in Q4_K beside v in Q6_K (a fused
    q/k/v of mixed kinds: each part on its own blocks), Q5_K, Q5_0 / Q5_1 and a Q6_K embedding
    tied to the head; held at the file's size; prefill dequantized gives exactly the dequantized
    model's numbers, prefill on the integer kernel (the default with VNNI) close to them."""
    import json

    from radixserve.models.config import ArchConfig
    from radixserve.models.gguf import read_tensors
    from radixserve.models.loader import _build

    path = tmp_path / "wide.gguf"
    kinds = {"attn_q": "q4_k", "attn_k": "q4_k", "attn_v": "q6_k", "attn_output": "q5_k", "ffn_gate": "q5_0",
             "ffn_up": "q5_0", "ffn_down": "q5_1", "token_embd": "q6_k"}
    meant = _write_tiny_gguf(path, wide_llama, kinds)
    cfg = json.loads((wide_llama / "config.json").read_text())
    arch = ArchConfig.from_hf(cfg)
    model = _build(arch, torch.float32, torch.device("cpu"), read_tensors(path, cfg)).eval()
    layers = cfg["num_hidden_layers"]
    assert quant.describe(model) == {"q4_k": 2 * layers, "q6_k": layers + 2, "q5_k": layers, "q5_0": layers, "q5_1": layers}
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, quant.SplitQuantLinear)
    assert model.lm_head.packed is model.model.embed_tokens.packed
    reader = gguf.GGUFReader(str(path))
    quantized_bytes = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type.name != "F32")
    packed_bytes = sum(b.numel() for b in model.buffers() if b.dtype == torch.uint8)
    assert quantized_bytes <= packed_bytes <= 1.03 * quantized_bytes  # the file's size, not fp32's 7x
    ref = _build(arch, torch.float32, torch.device("cpu"), iter(meant.items())).eval()
    long_prompt = _check_prefill(model, ref, arch.vocab_size, monkeypatch)
    short = long_prompt[:9]
    theirs = _logits(ref, short)
    assert (_logits(model, short) - theirs).abs().max().item() < 1e-3 * theirs.abs().max().item()  # few rows: integers


def test_quantization_int8_and_int4_serve_a_float_checkpoint_as_its_quantized_values(ops, tiny_llama):
    """The served model computes what the float model computes with each weight replaced by its
    quantized value (int8 per channel / int4 per group of 32; the head int8 either way)."""
    from radixserve.models.loader import load_model
    from tests.helpers import forward_prompt

    ids = [5, 17, 42, 99, 123, 7, 250, 31]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    for method, kinds in (("int8", "q8_0"), ("int4", "q4_1+q8_0")):
        ref = load_model(str(tiny_llama), torch.float32, torch.device("cpu"), "none").model
        full = quant.weight_bytes(ref)
        for name, mod in ref.named_modules():
            if isinstance(mod, torch.nn.Linear):
                q = (quant.quantize_int8 if name == "lm_head" else quant.QUANTIZERS[method])(mod.weight.detach())
                with torch.no_grad():
                    mod.weight.copy_(ops.dequant_quant(quant.pack(q), mod.out_features, mod.in_features, None))
        with Engine(str(tiny_llama), kv_cache_tokens=512, quantization=method, activations="int16") as e:
            assert e.quantization == kinds and e.dtype == torch.float32  # auto: fp32 activations for quantized weights
            assert len(e.generate([ids], greedy)[0].token_ids) == 12
            ours, theirs = forward_prompt(e.runner.model, ids), forward_prompt(ref, ids)
            assert (ours - theirs).abs().max() <= 1e-3 * theirs.abs().max(), method
            assert quant.weight_bytes(e.runner.model) < full / 2  # the float copies are gone
    with pytest.raises(Exception, match="quantization: 'int3' is not one of auto, none, int8, int4"):
        Engine(str(tiny_llama), kv_cache_tokens=512, quantization="int3")


def test_a_step_reads_every_weight_but_an_embedding_table_no_head_shares(tiny_models):
    """`step_weight_bytes` (what `bench compare --roof` divides by a step's time): a tied head
    reads the whole table, an untied model's step one row of it."""
    from radixserve.models.loader import load_model

    for arch, tied in (("LlamaForCausalLM", True), ("Qwen2ForCausalLM", False)):
        model = load_model(str(tiny_models[arch]), torch.float32, torch.device("cpu"), "none").model
        table = model.model.embed_tokens.weight
        assert (model.lm_head.weight is table) == tied
        assert quant.unread_embedding_bytes(model) == (0 if tied else table.numel() * 4), arch


@pytest.mark.smollm2
def test_the_default_model_stays_within_its_measured_divergence_from_the_exact_model(smollm2_dir):
    """`bench quality`'s measurement on the default file (its Q4_1 blocks against the same file
    dequantized to fp32), over the first 4 windows of 256 tokens of the GPL's text (docs/
    quantization.md measures 8 of 512 of it beside llama.cpp: 0.0021 mean KLD there, 97.2 %
    same top token; these windows 0.0022 and 97.6 %, 2026-12-06): 16-bit activations are the
    exact model to rounding; the default (8 bits, the head at 16) inside llama.cpp's own
    divergence on the file (0.0029, 96.5 %) with a margin for the machine's summation order."""
    from radixserve.bench import quality
    from radixserve.models.gguf import default_gguf

    text = (Path(__file__).parent / "data" / "GPL-3.txt").read_text()
    auto, wide = quality.measure(None, text, 256, 4, [{}, {"activations": "int16"}], quality.REFERENCE, log=lambda _: None)
    assert auto["candidate"]["quantization"] == "q4_1+q8_0" and auto["candidate"]["activations"] == "int8 (head int16)"
    assert auto["reference"]["quantization"] == "none" and auto["reference"]["dtype"] == "float32"
    assert wide["candidate"]["activations"] == "int16"
    assert wide["mean_kld"] < 1e-5 and wide["same_top"] >= 0.995
    assert 0 < auto["mean_kld"] < 0.0029 and auto["same_top"] >= 0.965
    assert auto["candidate"]["weight_bytes"] <= 1.3 * default_gguf().stat().st_size  # served from the file's blocks


@pytest.mark.parametrize("kind", list(QTYPES))
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (5, 37, 64), (20, 50, 96)])
def test_the_triton_kernel_computes_its_torch_reference(ops, monkeypatch, kind, m, n, k):
    """The CUDA path of QuantLinear (kernels/radixserve_kernels/quant_matmul.py), in Triton's interpreter."""
    from radixserve_kernels import quant_matmul

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    raw, w = gguf_blocks(kind, n, k, seed=m * 7 + n)
    packed = ops.pack_quant(raw, kind, n, k)
    x, bias = torch.randn(m, k), torch.randn(n)
    ref = quant_matmul.quant_matmul_ref(x, packed, n, bias)
    assert torch.allclose(ref, F.linear(x, w, bias), atol=1e-5)
    y = quant_matmul.quant_matmul_triton(x, packed, n, bias)
    assert torch.allclose(y, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", list(QTYPES))
def test_a_quant_tensor_dequantizes_as_its_packed_form_does(ops, kind):
    """QuantTensor.dequantize (gguf-py: a fused group of mixed kinds falls back to it) against
    the kernels' dequant_quant of the same blocks."""
    raw, ref = gguf_blocks(kind, 24, 64, seed=5)
    q = quant.QuantTensor(kind, raw, 24, 64)
    assert torch.equal(q.dequantize(), ref)
    assert torch.equal(q.dequantize(), ops.dequant_quant(quant.pack(q), 24, 64, None))


def test_the_fused_decode_step_runs_qwen2_biases_over_linears_of_mixed_kinds(ops, tiny_models):
    """A Qwen2 as a Q4_K_M file holds it: q and k in Q4_K beside v in Q6_K (a split linear) with
    q/k/v biases, other linears in other kinds: a decode step of three rows in one native call
    gives exactly the logits of the same kernels called layer by layer (each part adds its slice
    of the bias in its kernel, both ways)."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    from radixserve.models.config import ArchConfig
    from radixserve.models.loader import _build
    from tests.helpers import fused_and_layered_logits

    cfg = json.loads((tiny_models["Qwen2ForCausalLM"] / "config.json").read_text())
    cfg.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
    kinds = {"q_proj": "q4_k", "k_proj": "q4_k", "v_proj": "q6_k", "o_proj": "q5_k", "gate_proj": "q4_0", "up_proj": "q4_0",
             "down_proj": "q8_0"}
    weights = []
    for i, (name, t) in enumerate(hf.state_dict().items()):
        kind = next((q for part, q in kinds.items() if f".{part}.weight" in name), None)
        if kind is None:
            weights.append((name, t.float() if not name.endswith(".bias") else torch.randn(t.shape) * 0.5))
            continue
        raw, _ = gguf_blocks(kind, *t.shape, seed=i)
        weights.append((name, quant.QuantTensor(kind, raw, *t.shape)))
    arch = ArchConfig.from_hf(cfg)
    model = _build(arch, torch.float32, torch.device("cpu"), iter(weights)).eval()
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, quant.SplitQuantLinear) and qkv.bias_in_parts
    assert torch.equal(qkv.parts[2].bias, qkv.bias[-qkv.parts[2].out_features:])
    assert model.fuse_decode()

    logits, calls = fused_and_layered_logits(model, [5, 17, 30])
    assert calls == 1
    assert torch.equal(logits[0], logits[1])


def test_packed_weights_kept_on_disk_load_as_packed_and_a_bad_file_is_a_miss(ops, wide_llama, tmp_path, monkeypatch):
    """models.packed_cache: a GGUF model's packed blocks written once and mapped back give the
    same model without packing anything; a truncated, foreign or mismatched file is a miss
    (packed again), never an error or a misread."""
    import json

    from radixserve.models import packed_cache
    from radixserve.models.config import ArchConfig
    from radixserve.models.gguf import read_tensors
    from radixserve.models.loader import _build

    path = tmp_path / "wide.gguf"
    _write_tiny_gguf(path, wide_llama, {"attn_q": "q4_k", "attn_k": "q4_k", "attn_v": "q6_k", "attn_output": "q5_k",
                                        "ffn_gate": "q4_0", "ffn_up": "q4_0", "ffn_down": "q8_0", "token_embd": "q6_k"})
    cfg = json.loads((wide_llama / "config.json").read_text())
    arch = ArchConfig.from_hf(cfg)
    model = _build(arch, torch.float32, torch.device("cpu"), read_tensors(path, cfg)).eval()
    buffers = {n: b for n, b in model.named_buffers() if n.endswith(".packed")}
    assert "model.layers.0.self_attn.qkv_proj.parts.2.packed" in buffers  # a split linear's parts too
    keep = tmp_path / "cache" / "layout.bin"
    packed_cache.save(keep, buffers)
    assert oct(keep.stat().st_mode & 0o777) == "0o600" and not list(keep.parent.glob(".packed-*"))
    mapped = packed_cache.load(keep)
    assert mapped.keys() == buffers.keys() and all(torch.equal(mapped[n], b) for n, b in buffers.items())

    packs = []
    real_pack = quant.pack
    monkeypatch.setattr(quant, "pack", lambda q: packs.append(q.kind) or real_pack(q))
    again = _build(arch, torch.float32, torch.device("cpu"), read_tensors(path, cfg), mapped).eval()
    assert packs == []  # nothing packed: every buffer came from the file
    prompt = [5, 17, 42, 99, 123, 7]
    assert torch.equal(_logits(again, prompt), _logits(model, prompt))

    name = "model.layers.1.mlp.down_proj.packed"
    wrong = {**mapped, name: mapped[name][:, :1]}  # a buffer of another shape: packed again
    again = _build(arch, torch.float32, torch.device("cpu"), read_tensors(path, cfg), wrong).eval()
    assert packs == ["q8_0"] and torch.equal(_logits(again, prompt), _logits(model, prompt))

    data = keep.read_bytes()
    for bad in (data[: len(data) // 2], b"not a cache file", data[:8] + b"\xff" * 8 + data[16:]):
        keep.write_bytes(bad)
        assert packed_cache.load(keep) == {}
    assert packed_cache.load(tmp_path / "missing.bin") == {}


def test_a_packed_write_cut_short_is_cleaned_up_by_the_next_one(tmp_path):
    """A write whose process died (an engine that failed to start, a SIGKILL) leaves its
    temporary file; the next write removes it (its writer's pid is gone), not a live writer's."""
    import os
    import subprocess
    import sys

    from radixserve.models import packed_cache

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folder = tmp_path / "packed"
    folder.mkdir()
    orphan, live = folder / f".packed-{dead.pid}-abc", folder / f".packed-{os.getpid()}-def"
    orphan.write_bytes(b"x" * 10)
    live.write_bytes(b"y")
    packed_cache.save_soon(folder / "layout.bin", {"a.packed": torch.arange(8, dtype=torch.uint8)})
    packed_cache.wait()
    assert packed_cache.load(folder / "layout.bin")["a.packed"].tolist() == list(range(8))
    assert not orphan.exists() and live.exists()


@pytest.mark.smollm2
def test_the_default_model_packs_once_and_maps_its_packed_weights_after(ops, tmp_path, monkeypatch):
    from radixserve.models import packed_cache
    from radixserve.models.loader import load_model

    keep = tmp_path / "packed" / "layout.bin"
    monkeypatch.setattr(packed_cache, "cache_file", lambda gguf: keep)
    first = load_model(None, torch.float32, torch.device("cpu")).model
    packed_cache.wait()  # written on a thread of its own
    assert keep.exists()
    monkeypatch.setattr(quant, "pack", lambda q: pytest.fail("packed again"))
    second = load_model(None, torch.float32, torch.device("cpu")).model
    prompt = [1, 504, 3458, 314, 260, 2]
    assert torch.equal(_logits(second, prompt), _logits(first, prompt))
    monkeypatch.setenv("RADIXSERVE_PACKED_CACHE", "0")
    with pytest.raises(pytest.fail.Exception):  # off: packs (and would write nothing)
        load_model(None, torch.float32, torch.device("cpu"))


def _llama3_rope_freqs(cfg: dict) -> np.ndarray:
    """What llama.cpp's converter writes as `rope_freqs.weight` for a llama3 rope scaling: one
    divisor per frequency (1 for short wavelengths, the factor for long ones, smoothed between)."""
    s, dim = cfg["rope_scaling"], cfg["head_dim"]
    inv = 1.0 / cfg["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    old = s["original_max_position_embeddings"]
    out = []
    for wavelen in 2 * np.pi / inv:
        if wavelen < old / s["high_freq_factor"]:
            out.append(1.0)
        elif wavelen > old / s["low_freq_factor"]:
            out.append(s["factor"])
        else:
            smooth = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def test_a_llama3_gguf_takes_its_rope_scaling_from_rope_freqs(tiny_llama, tmp_path):
    """llama.cpp writes a Llama 3.x model's rope scaling as the tensor `rope_freqs.weight` (the
    GGUF's config has no rope_scaling): it loads, and the model computes what transformers does
    with the llama3 scaling in its config, past the original context; a config that also names
    the llama3 scaling does not apply it twice."""
    import json

    from radixserve.models.config import ArchConfig
    from radixserve.models.gguf import read_tensors
    from radixserve.models.loader import _build
    from tests.helpers import hf_logits_and_greedy

    cfg = json.loads((tiny_llama / "config.json").read_text())
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_scaling"]["original_max_position_embeddings"] == 64
    factors = _llama3_rope_freqs(cfg)
    assert (factors == 1).any() and (factors == cfg["rope_scaling"]["factor"]).any() and len(set(factors.tolist())) > 2
    path, with_freqs = tmp_path / "plain.gguf", tmp_path / "llama3.gguf"
    _write_tiny_gguf(path, tiny_llama, {})
    _write_tiny_gguf(with_freqs, tiny_llama, {}, {"rope_freqs.weight": factors})
    prompt = [(i * 37) % (cfg["vocab_size"] - 3) + 3 for i in range(150)]
    theirs, _ = hf_logits_and_greedy(tiny_llama, prompt, 1)
    plain = {k: v for k, v in cfg.items() if k != "rope_scaling"}  # what the GGUF's metadata gives
    for config in (plain, cfg):
        arch = ArchConfig.from_hf(config)
        model = _build(arch, torch.float32, torch.device("cpu"), read_tensors(with_freqs, config)).eval()
        ours = _logits(model, prompt)
        assert (ours - theirs).abs().max().item() < 1e-4 * theirs.abs().max().item()
    without = _build(ArchConfig.from_hf(plain), torch.float32, torch.device("cpu"), read_tensors(path, plain)).eval()
    assert (_logits(without, prompt) - theirs).abs().max().item() > 1e-2  # the scaling matters past 64 tokens


def _model_dims(w, cfg: dict) -> None:
    """The shape keys every llama.cpp architecture writes, from a config.json."""
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])


def _llama_metadata(w, folder) -> None:
    """What llama.cpp's converter writes about a Llama model and its byte-level BPE tokenizer."""
    import json

    cfg = json.loads((folder / "config.json").read_text())
    tj = json.loads((folder / "tokenizer.json").read_text())
    vocab = {**tj["model"]["vocab"], **{t["content"]: t["id"] for t in tj["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in tj["added_tokens"] if t["special"]}
    _model_dims(w, cfg)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])


def test_a_llama3_gguf_file_loads_whole_as_llama_cpp_writes_it(tiny_llama, tmp_path, monkeypatch):
    """A whole Llama 3 GGUF (metadata, tokenizer, rope_freqs; no rope scaling in its metadata, as
    llama.cpp's converter writes it) through load_model, the path `radixserve serve --model`
    takes: config and tokenizer from the file, and transformers' logits with the llama3 scaling
    past the original context. Before rope_freqs had a place it was refused."""
    import json

    from radixserve.models.loader import load_model
    from tests.helpers import hf_logits_and_greedy

    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    cfg = json.loads((tiny_llama / "config.json").read_text())
    path = tmp_path / "llama3.gguf"
    _write_tiny_gguf(path, tiny_llama, {}, {"rope_freqs.weight": _llama3_rope_freqs(cfg)},
                     meta=lambda w: _llama_metadata(w, tiny_llama))
    loaded = load_model(str(path), torch.float32, torch.device("cpu"), "auto")
    assert loaded.arch.rope_scaling is None and loaded.arch.max_position == cfg["max_position_embeddings"]
    prompt = [(i * 37) % (cfg["vocab_size"] - 3) + 3 for i in range(150)]
    theirs, _ = hf_logits_and_greedy(tiny_llama, prompt, 1)
    assert (_logits(loaded.model, prompt) - theirs).abs().max().item() < 1e-4 * theirs.abs().max().item()
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_llama))
    text = "Hello, world! 123 <|im_end|>"
    assert loaded.tokenizer.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert loaded.tokenizer.eos_token_id == hf.eos_token_id


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_gguf_files_config_and_tokenizer_are_what_transformers_reads_from_it(arch, tiny_llama, tiny_models, tmp_path):
    """The meta folder a first start writes (config from our metadata walk, the tokenizer in the
    class AutoTokenizer picks) holds the files transformers' own GGUF readers give, byte for
    byte: its reader parses the whole vocabulary twice (27 s of a 35 s first start on Qwen2.5)."""
    import json

    from transformers import AutoConfig, AutoTokenizer

    from radixserve.models.gguf import _fix_tokenizer, _hf_config, _token_id, _write_meta, file_config

    path = tmp_path / f"{arch}.gguf"
    if arch == "llama":
        _write_tiny_gguf(path, tiny_llama, {}, meta=lambda w: _llama_metadata(w, tiny_llama))
    else:
        folder = tiny_models["Gemma3ForCausalLM"]
        _gemma_gguf(path, folder, json.loads((folder / "config.json").read_text())["vocab_size"])
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    made = _write_meta(path, ours)  # what the server then serves with, as its files load back:
    back = AutoTokenizer.from_pretrained(str(ours))
    chat = [{"role": "user", "content": "Hello, world! 123"}]
    assert type(made) is type(back) and made.encode("Hello, world! 123 <|im_end|>") == back.encode("Hello, world! 123 <|im_end|>")
    if back.chat_template:  # (the tiny Llama's file has none)
        assert made.apply_chat_template(chat, tokenize=False) == back.apply_chat_template(chat, tokenize=False)
    tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    cfg = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name).to_dict()
    cfg = _hf_config(cfg, lambda text: _token_id(tok, text))
    _fix_tokenizer(cfg, tok)
    cfg = json.loads(json.dumps(cfg))  # as config.json holds it
    tok.save_pretrained(str(theirs))
    written = json.loads((ours / "config.json").read_text())
    assert {k: v for k, v in written.items() if k != "_name_or_path"} == {k: v for k, v in cfg.items() if k != "_name_or_path"}
    assert json.loads(json.dumps(file_config(path))) == written  # what an engine builds the model from, meanwhile
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    assert (ours / "chat_template.jinja").exists() == (theirs / "chat_template.jinja").exists()


def test_two_processes_starting_a_new_file_write_its_folder_once(tmp_path):
    """The server writes a new GGUF's meta folder while its engine may ask for it: the second
    waits on the file lock and finds it whole, and nobody writes it twice."""
    import threading
    import time

    from radixserve.models import gguf as gg

    made, started = [], threading.Event()

    def make(path, out):
        made.append(out)
        started.set()
        time.sleep(0.3)
        (out / "config.json").write_text("{}")
        return "the tokenizer"

    out = tmp_path / "m-meta"
    got = []
    first = threading.Thread(target=lambda: got.append(gg._cached(tmp_path / "x.gguf", out, make, "making")))
    first.start()
    started.wait(5)
    got.append(gg._cached(tmp_path / "x.gguf", out, make, "making"))  # blocks on the lock until the first is done
    first.join()
    assert len(made) == 1 and got == [out, out] and (out / "config.json").exists()
    assert gg.made_tokenizer(out) == "the tokenizer" and gg.made_tokenizer(out) is None  # handed over once


def test_bench_coldstart_forgets_a_files_folders_and_nothing_else(tmp_path, monkeypatch):
    from radixserve.bench.coldstart import forget
    from radixserve.models import packed_cache
    from radixserve.models.gguf import meta_dir

    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    f, other = tmp_path / "a.gguf", tmp_path / "b.gguf"
    for g in (f, other):
        g.write_bytes(b"GGUF")
        for d in (meta_dir(g), packed_cache.cache_file(g).parent):
            d.mkdir(parents=True, exist_ok=True)
            (d / "x").write_text("x")
    assert sorted(forget(f)) == sorted([meta_dir(f), packed_cache.cache_file(f).parent])
    assert not meta_dir(f).exists() and meta_dir(other).exists() and packed_cache.cache_file(other).parent.exists()


def _gemma_gguf(path, folder, vocab: int) -> None:
    """A Gemma 3 GGUF as llama.cpp's converter writes one: arch gemma3, its four norms stored as
    1 + w, q/k not permuted, a SentencePiece vocabulary (scores, byte tokens), no chat template,
    and no layer types (llama.cpp derives them: every sixth layer global)."""
    import json

    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    w = gguf.GGUFWriter(str(path), "gemma3")
    _model_dims(w, cfg)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(cfg["sliding_window"])
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = [f"<0x{b:02X}>" for b in range(256)] + ["▁", "▁the", "▁a", "he", "ll", "o", "▁w", "or", "ld"]
    pieces += [f"▁tok{i}" for i in range(vocab - len(specials) - len(pieces))]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(specials + pieces)
    w.add_token_scores([0.0] * len(specials) + [0.0] * 256 + [-float(i) for i in range(len(pieces) - 256)])
    w.add_token_types([3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 256))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    for hf, tensor in state.items():
        arr = tensor.float().numpy()
        if hf == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", quants.quantize(arr, QT.Q8_0), raw_dtype=QT.Q8_0)
            continue
        if hf == "model.norm.weight":
            w.add_tensor("output_norm.weight", arr + 1.0)
            continue
        layer, rest = hf.removeprefix("model.layers.").split(".", 1)
        module, _, suffix = rest.rpartition(".")
        name = f"blk.{layer}.{parts[module]}.{suffix}"
        if module.endswith("norm"):
            w.add_tensor(name, arr + 1.0)
        elif module.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):  # as a Q4_K_M file's small ones
            w.add_tensor(name, quants.quantize(arr, QT.Q5_0), raw_dtype=QT.Q5_0)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gemma3_gguf_file_loads_whole_and_computes_what_transformers_computes_from_it(tiny_models, tmp_path, monkeypatch):
    """A whole Gemma 3 GGUF (llama.cpp's layout: norms as 1 + w, Q8_0 tied embedding, Q5_0 linears,
    SentencePiece vocabulary, no chat template) through load_model, the path `radixserve serve
    --model` takes, against transformers reading the same file: prompt logits past the sliding
    window (8 positions here), and served greedily through the engine (a prefix hit past the
    window included); the file's missing chat template and <end_of_turn> stop are supplied."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from radixserve.models.gguf import GEMMA_CHAT_TEMPLATE
    from radixserve.models.loader import load_model

    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    folder = tiny_models["Gemma3ForCausalLM"]
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    path = tmp_path / "gemma3.gguf"
    _gemma_gguf(path, folder, vocab)
    loaded = load_model(str(path), torch.float32, torch.device("cpu"), "auto")
    quant.set_activations(loaded.model, "int16")  # (8 bits: bench quality's business, not transformers' logits)
    assert loaded.arch.architecture == "Gemma3ForCausalLM" and loaded.arch.layer_windows == (8, 8, 8)
    assert set(loaded.quantization.split("+")) == {"q8_0", "q5_0"}
    assert loaded.tokenizer.chat_template == GEMMA_CHAT_TEMPLATE and 5 in loaded.arch.eos_token_ids
    # the file has no query_pre_attn_scalar: llama.cpp (and radixserve) scale by head_dim, transformers assumes 256
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32,
                                              query_pre_attn_scalar=loaded.arch.head_dim).eval()
    prompt = [(i * 37) % (vocab - 10) + 6 for i in range(40)]
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0]
        greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    assert (_logits(loaded.model, prompt) - theirs).abs().max().item() < 1e-3 * theirs.abs().max().item()
    with Engine(str(path), dtype="float32", kv_cache_tokens=512, chunked_prefill_size=16, activations="int16") as engine:
        params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
        assert engine.generate([prompt], params)[0].token_ids == greedy
        again = engine.generate([prompt], params)[0]  # its prompt from the radix cache
        assert again.token_ids == greedy and again.cached_tokens >= 32
        chat = engine.chat_ids([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}])
        ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
        text = "<bos><start_of_turn>user\nBe brief.\n\nhello<end_of_turn>\n<start_of_turn>model\n"
        assert chat == ref.encode(text, add_special_tokens=False)


_CONVERTER = """
import runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base as base
for cls in vars(base).values():  # a tiny trained tokenizer has no pre-tokenizer hash llama.cpp knows
    if isinstance(cls, type) and hasattr(cls, "get_vocab_base_pre"):
        cls.get_vocab_base_pre = lambda self, tokenizer: "llama-bpe"
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _llama_cpp_sources():
    import os

    found = os.environ.get("RADIXSERVE_LLAMA_CPP")
    if not found or not (Path(found) / "convert_hf_to_gguf.py").exists():
        pytest.skip("opt-in: set RADIXSERVE_LLAMA_CPP to a llama.cpp source tree (e.g. the llama-cpp-python sdist's "
                    "vendor/llama.cpp) and pip install sentencepiece")
    pytest.importorskip("sentencepiece")
    return Path(found)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM",
                                  "Qwen2MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM"])
def test_a_gguf_made_by_llama_cpps_own_converter_is_served_as_transformers_computes(arch, tiny_tokenizer, tmp_path,
                                                                                    monkeypatch):
    """The tiny models converted by llama.cpp's convert_hf_to_gguf.py (its pre-tokenizer check
    told what a tiny trained tokenizer is; nothing else touched): prompt logits and greedy
    tokens against transformers on the folder it was made from (Llama with llama3 rope scaling,
    written by the converter as rope_freqs; Gemma 3 past its window, six layers so its fixed
    pattern holds, its softmax scale head_dim as llama.cpp's; the mixtures of experts with their
    3-D expert tensors; gpt-oss's float experts, which the converter writes as they are, with
    their biases, sinks and windows)."""
    import subprocess
    import sys

    from radixserve.models.loader import load_model
    from tests.conftest import _config, make_tiny_model
    from tests.helpers import hf_logits_and_greedy

    sources = _llama_cpp_sources()
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    tok_dir, vocab, eos = tiny_tokenizer
    cfg = _config(arch, vocab, eos)
    if arch == "Gemma3ForCausalLM":
        cfg.pop("layer_types")
        cfg.update(num_hidden_layers=6, query_pre_attn_scalar=cfg["head_dim"])
        cfg["rope_parameters"]["full_attention"] = {"rope_type": "default", "rope_theta": 1e6}
    if arch == "Qwen3MoeForCausalLM":  # llama.cpp's qwen3moe routes every layer
        cfg["mlp_only_layers"] = []
    if arch == "GptOssForCausalLM":  # the released clamp (a GGUF holds none: llama.cpp's 7.0), YaRN as the converter reads it
        rope = cfg.pop("rope_parameters")
        cfg.update(swiglu_limit=7.0, rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
    folder = make_tiny_model(tmp_path / arch, arch, cfg, tok_dir, 3)
    out = tmp_path / f"{arch}.gguf"
    subprocess.run([sys.executable, "-c", _CONVERTER, str(sources), str(folder), "--outfile", str(out), "--outtype", "f32"],
                   check=True, capture_output=True)
    prompt = [(i * 37) % (vocab - 10) + 5 for i in range(150)]
    theirs, greedy = hf_logits_and_greedy(folder, prompt, 24)
    loaded = load_model(str(out), torch.float32, torch.device("cpu"), "auto")
    assert (_logits(loaded.model, prompt) - theirs).abs().max().item() < 1e-4 * theirs.abs().max().item()
    with Engine(str(out), dtype="float32", kv_cache_tokens=1024) as engine:
        params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
        assert engine.generate([prompt], params)[0].token_ids == greedy
