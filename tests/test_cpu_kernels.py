"""The native CPU kernels (kernels/radixserve_kernels/cpu.py) against their torch references: fresh random
inputs, outputs poisoned first, fp32 and bf16 (and int8 / fp8 KV pools), head dims on the vector path (64, 128) and off
it (80), GQA ratios 1/3/8 and 16 (off the vector path), lengths not a multiple of 16, scattered
slot tables, strided views. They must build here: CI has the compiler that users have."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.models.layers import RMSNorm, apply_rope, rope_qk
from radixserve_kernels import cpu
from radixserve_kernels.decode_attention import decode_attention_cpu, decode_attention_ref
from radixserve_kernels.store_kv import store_kv, store_kv_quant, store_kv_quant_ref, store_kv_ref

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():  # the kernels have no backward; under autograd the torch ops run
        yield


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("dim", "group"), [(64, 1), (64, 3), (128, 8), (80, 3), (64, 16)])
def test_decode_attention_reads_scattered_slots_as_the_reference_does(ops, dtype, dim, group):
    g = torch.Generator().manual_seed(dim + group)
    kv_heads = 2
    lens = [1, 300, 37, 129, 16]
    slots = sum(lens) + 40
    k_pool = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    v_pool = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    perm = torch.randperm(slots, generator=g)
    table = torch.zeros(len(lens), max(lens) + 5, dtype=torch.int64)  # wider than needed: the tail is never read
    at = 0
    for i, n in enumerate(lens):
        table[i, :n] = perm[at : at + n]
        at += n
    q = torch.randn(len(lens) + 2, kv_heads * group, dim, generator=g).to(dtype)  # two rows are not decode rows
    q_rows = torch.tensor([3, 0, 6, 1, 4])
    seq_lens = torch.tensor(lens)
    ref, ref_lse = torch.full_like(q, float("nan")), torch.empty(len(lens), q.shape[1])
    decode_attention_ref(q, k_pool, v_pool, ref, q_rows, table, seq_lens, lse=ref_lse)
    out, lse = torch.full_like(q, float("nan")), torch.full((len(lens), q.shape[1]), float("nan"))
    decode_attention_cpu(q, k_pool, v_pool, out, q_rows, table, seq_lens, lse=lse)
    assert rel_err(out[q_rows], ref[q_rows]) < TOL[dtype]
    assert torch.allclose(lse, ref_lse, atol=1e-4, rtol=1e-4)
    untouched = torch.tensor([2, 5])
    assert out[untouched].isnan().all()
    bad = table.clone()
    bad[1, 7] = slots  # one past the pool: refused, not read
    with pytest.raises(RuntimeError, match="out of range"):
        decode_attention_cpu(q, k_pool, v_pool, out, q_rows, bad, seq_lens)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("dim", "group"), [(64, 3), (128, 8), (80, 3)])
def test_a_drafts_rows_read_together_give_each_rows_own_numbers_bit_for_bit(ops, dtype, dim, group):
    """Rows that are one request's consecutive positions (a draft's) are attended as one run
    (K/V read once); each row's output must be exactly what it gets alone in its own call."""
    g = torch.Generator().manual_seed(7 * dim + group)
    kv_heads, slots = 3, 600
    k_pool = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    v_pool = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    perm = torch.randperm(slots, generator=g)
    for n0, count in [(1, 2), (14, 5), (15, 2), (16, 9), (31, 3), (100, 4), (250, 7), (17, 1)]:
        other = 40  # a second request's row between two runs: it joins neither
        lens = [n0 + r for r in range(count)] + [other] + [n0 + r for r in range(2)]
        table = torch.zeros(len(lens), max(lens) + 1, dtype=torch.int64)
        for i, n in enumerate(lens):
            table[i, :n] = perm[300 : 300 + n] if i == count else perm[:n]
        q = torch.randn(len(lens), kv_heads * group, dim, generator=g).to(dtype)
        q_rows, seq_lens = torch.arange(len(lens)), torch.tensor(lens)
        together, lse = torch.full_like(q, float("nan")), torch.full((len(lens), q.shape[1]), float("nan"))
        decode_attention_cpu(q, k_pool, v_pool, together, q_rows, table, seq_lens, lse=lse)
        for i in range(len(lens)):
            alone, lse_alone = torch.full_like(q, float("nan")), torch.full((1, q.shape[1]), float("nan"))
            decode_attention_cpu(q, k_pool, v_pool, alone, q_rows[i : i + 1], table[i : i + 1], seq_lens[i : i + 1], lse=lse_alone)
            assert torch.equal(together[i], alone[i]), (n0, count, i)
            assert torch.equal(lse[i], lse_alone[0]), (n0, count, i)
        ref = torch.full_like(q, float("nan"))
        decode_attention_ref(q, k_pool, v_pool, ref, q_rows, table, seq_lens)
        assert rel_err(together, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_the_residual(ops, dtype):
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(200, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(200, generator=g))
    x, res = torch.randn(7, 200, generator=g).to(dtype), torch.randn(7, 200, generator=g).to(dtype)
    ref_sum = x + res
    ref = F.rms_norm(ref_sum, (200,), norm.weight, 1e-6)
    out, summed = norm(x, res)
    assert torch.equal(summed, ref_sum)  # the residual stream is rounded as torch's add rounds it
    assert rel_err(out, ref) < TOL[dtype]
    assert rel_err(norm(x), F.rms_norm(x, (200,), norm.weight, 1e-6)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_strided_q_and_k_views_in_place(ops, dtype):
    g = torch.Generator().manual_seed(2)
    t, heads, kv_heads, dim = 5, 4, 2, 64
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)  # a fused projection's output
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(t, heads, dim), k.view(t, kv_heads, dim)
    ang = torch.rand(t, dim // 2, generator=g) * 6
    cos, sin = ang.cos(), ang.sin()
    ref_q, ref_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    out_q, out_k = rope_qk(q, k, cos, sin)
    assert out_q.data_ptr() == q.data_ptr()  # in place
    assert rel_err(out_q, ref_q) < TOL[dtype] and rel_err(out_k, ref_k) < TOL[dtype]
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # v, beside them, is not touched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1536, 21])  # the vector loop and the scalar tail
def test_silu_and_mul(ops, dtype, n):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(3, 2 * n, generator=g) * 4).to(dtype)
    ref = F.silu(x[:, :n].float()) * x[:, n:].float()
    assert rel_err(ops.silu_and_mul(x), ref) < TOL[dtype]


@pytest.mark.parametrize("wdtype", DTYPES)  # the adapters' weights (--lora-dtype); rows and sums fp32
@pytest.mark.parametrize("n", [37, 1536])  # off the vector width, and a wide MLP
def test_lora_add_gives_each_group_of_rows_its_own_adapters_delta(ops, n, wdtype):
    """Rows scattered over two adapters of ranks 3 and 16 (and rows with none, untouched), as
    models.lora.apply's torch path computes them: one group of 6 rows (a tile of 4 and a tail),
    a part's columns ending off the kernel's column blocks; a row out of range is refused."""
    g = torch.Generator().manual_seed(n)
    x, y = torch.randn(13, 45, generator=g), torch.randn(13, n, generator=g)
    a = [torch.randn(r, 45, generator=g).to(wdtype) for r in (3, 16)]
    bt = [torch.randn(r, n, generator=g).to(wdtype) for r in (3, 16)]
    rows, bounds = torch.tensor([5, 1, 7, 10, 12, 11, 0, 3]), [0, 6, 6, 8]  # rows 5, 1, 7, 10, 12, 11: adapter 0; 0, 3: 1
    cut = n // 2 - 3
    cols = [torch.tensor([[0, n]] * 3), torch.tensor([[0, cut]] * 8 + [[cut, n]] * 8)]  # adapter 1: two parts
    bt[1][:8, cut:] = 0
    bt[1][8:, :cut] = 0
    ref = y.clone()
    for k, (lo, hi) in enumerate(((0, 6), (6, 8))):
        idx = rows[lo:hi]
        ref[idx] += (x[idx] @ a[k].float().t()) @ bt[k].float()
    out = y.clone()
    ops.lora_add_(out, x, rows, bounds, a, bt, cols)
    assert rel_err(out, ref) < 1e-5 and torch.equal(out[[2, 4, 6, 8, 9]], y[[2, 4, 6, 8, 9]])
    with pytest.raises(RuntimeError, match="out of range"):
        ops.lora_add_(out, x, torch.tensor([13]), [0, 1], a[:1], bt[:1], cols[:1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_strided_rows_and_refuses_a_slot_out_of_range(ops, dtype):
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(4, 2 * 3 * 8, generator=g).to(dtype)
    k, v = (t.reshape(4, 3, 8) for t in kv.split(24, dim=-1))  # views of one tensor
    slots = torch.tensor([9, 2, 5, 0])
    pools = [torch.zeros(10, 3, 8, dtype=dtype) for _ in range(4)]
    store_kv(pools[0], pools[1], slots, k, v)
    store_kv_ref(pools[2], pools[3], slots, k, v)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    with pytest.raises(RuntimeError, match="out of range"):
        ops.store_kv(pools[0], pools[1], torch.tensor([1, 2, 3, 10]), k, v)


QDTYPES = [torch.int8, torch.float8_e4m3fn]


def _poisoned_pool(g: torch.Generator, slots: int, kv_heads: int, dim: int, qdtype: torch.dtype) -> torch.Tensor:
    """Random values over every code but NaN (fp8's 0x7f and 0xff): what stores never write."""
    if qdtype == torch.int8:
        return torch.randint(-127, 128, (slots, kv_heads, dim), generator=g, dtype=torch.int8)
    codes = torch.randint(0, 254, (slots, kv_heads, dim), generator=g)
    return (codes + (codes >= 0x7f).long()).to(torch.uint8).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("qdtype", QDTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_quant_writes_what_the_reference_does_bit_for_bit(ops, dtype, qdtype):
    g = torch.Generator().manual_seed(5)
    t, heads, dim, slots = 40, 3, 80, 64
    span = torch.logspace(-6, 3, t * heads).view(t, heads, 1)  # scales from tiny to large; fp8 subnormals within rows
    kv = (torch.randn(t, heads, 2 * dim, generator=g) * span).to(dtype)
    kv[7, 1] = 0  # an all-zero row: scale FLT_MIN, values 0
    k, v = kv[..., :dim], kv[..., dim:]  # strided views
    where = torch.randperm(slots, generator=g)[:t]
    pools = [_poisoned_pool(g, slots, heads, dim, qdtype) for _ in range(2)]
    pools += [p.clone() for p in pools]
    scales = [torch.full((slots, heads), float("nan")) for _ in range(2)]
    scales += [s.clone() for s in scales]
    store_kv_quant(pools[0], pools[1], scales[0], scales[1], where, k, v)
    store_kv_quant_ref(pools[2], pools[3], scales[2], scales[3], where, k, v)
    for i in (0, 1):
        assert torch.equal(pools[i].view(torch.uint8), pools[i + 2].view(torch.uint8))
        assert torch.equal(scales[i].view(torch.int32), scales[i + 2].view(torch.int32))  # bits: the NaN poison where neither wrote
    assert scales[0][where].isfinite().all() and (scales[0][where] > 0).all()
    with pytest.raises(RuntimeError, match="out of range"):
        ops.store_kv_quant(pools[0], pools[1], scales[0], scales[1], torch.full((t,), slots), k, v)


@pytest.mark.parametrize("qdtype", QDTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("dim", "group"), [(64, 1), (64, 3), (128, 8), (80, 3), (64, 16)])
def test_decode_attention_reads_a_quantized_pool_in_place_as_the_reference_does(ops, dtype, qdtype, dim, group):
    g = torch.Generator().manual_seed(dim + group)
    kv_heads, lens = 2, [1, 300, 37, 129, 16]
    slots = sum(lens) + 40
    k_pool, v_pool = _poisoned_pool(g, slots, kv_heads, dim, qdtype), _poisoned_pool(g, slots, kv_heads, dim, qdtype)
    k_scale = torch.rand(slots, kv_heads, generator=g) * 0.02 + 1e-3  # scores of a few units: softmax neither flat nor one-hot
    v_scale = torch.rand(slots, kv_heads, generator=g) + 0.01
    if qdtype == torch.float8_e4m3fn:
        k_scale /= 20
    perm = torch.randperm(slots, generator=g)
    table = torch.zeros(len(lens), max(lens) + 5, dtype=torch.int64)
    at = 0
    for i, n in enumerate(lens):
        table[i, :n] = perm[at : at + n]
        at += n
    q = torch.randn(len(lens) + 2, kv_heads * group, dim, generator=g).to(dtype)
    q_rows, seq_lens = torch.tensor([3, 0, 6, 1, 4]), torch.tensor(lens)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    ref, ref_lse = torch.full_like(q, float("nan")), torch.empty(len(lens), q.shape[1])
    decode_attention_ref(q, k_pool, v_pool, ref, q_rows, table, seq_lens, lse=ref_lse, **scales)
    out, lse = torch.full_like(q, float("nan")), torch.full((len(lens), q.shape[1]), float("nan"))
    decode_attention_cpu(q, k_pool, v_pool, out, q_rows, table, seq_lens, lse=lse, **scales)
    assert rel_err(out[q_rows], ref[q_rows]) < TOL[dtype]
    assert torch.allclose(lse, ref_lse, atol=1e-4, rtol=1e-4)
    assert out[torch.tensor([2, 5])].isnan().all()
    bad = table.clone()
    bad[1, 7] = slots
    with pytest.raises(RuntimeError, match="out of range"):
        decode_attention_cpu(q, k_pool, v_pool, out, q_rows, bad, seq_lens, **scales)



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(960, 576), (77, 33)])  # whole panels; a ragged panel and an odd k
def test_the_linear_over_its_packed_weight(ops, dtype, n, k):
    """fp32 and bf16 on every build (bf16 by vdpbf16ps where the avx512 build has AVX512-BF16,
    else widened to fp32 as the weights are loaded)."""
    assert ops.linear_supports(torch.empty(1, dtype=dtype))
    if ops.isa().startswith("avx512") and "avx512_bf16" in cpu.cpu_flags():
        assert "+bf16" in ops.isa(), "the avx512 kernels were built without the AVX512-BF16 this CPU has"
    g = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    packed = ops.pack_linear(w)
    for rows in (1, 2, 6, 7, 64):
        x = torch.randn(rows, k, generator=g).to(dtype)
        for bias in (b, None):
            ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
            for float_out in (False, True):
                got = ops.linear(x, packed, n, None if bias is None else bias.float(), float_out)
                assert got.shape == (rows, n) and got.dtype == (torch.float32 if float_out else dtype)
                tol = 1e-5 if dtype == torch.float32 or float_out else 4e-3
                assert rel_err(got, ref) < tol, (rows, bias is None, float_out)


def test_a_failed_build_falls_back_to_torch_ops_with_a_warning(tmp_path):
    """No working compiler (CXX=false): a warning, ops() is None, and the layers still run."""
    import os
    import subprocess
    import sys

    code = ("import logging, torch; logging.basicConfig(); from radixserve_kernels import cpu; "
            "from radixserve.models.layers import RMSNorm; assert cpu.ops() is None; "
            "print(RMSNorm(8, 1e-6)(torch.ones(2, 8)).shape)")
    env = {**os.environ, "CXX": "false", "RADIXSERVE_KERNEL_CACHE": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "torch.Size([2, 8])" in r.stdout
    assert "CPU kernels are not available" in r.stderr
