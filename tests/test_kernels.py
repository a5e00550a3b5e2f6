"""Triton kernels against their torch references under TRITON_INTERPRET=1 (small shapes, the
same code CI cannot run on a GPU): fresh random inputs, outputs poisoned first, head dims 64
and 128, GQA ratios 1/3/8, lengths 1..300 mixed in one batch, prefixes empty and not,
scattered slot tables. Relative error ‖out − ref‖ / ‖ref‖ under 1e-3 in fp32."""

from __future__ import annotations

import pytest
import torch

from radixserve_kernels.decode_attention import decode_attention_ref, decode_attention_triton
from radixserve_kernels.extend_attention import extend_attention_ref, extend_attention_triton
from radixserve_kernels.store_kv import store_kv_ref, store_kv_triton

TOL = 1e-3


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def scattered_tables(g: torch.Generator, lens: list[int], slots: int) -> torch.Tensor:
    """Each request's slots: distinct, in random order, drawn from one shuffled pool."""
    perm = torch.randperm(slots, generator=g)
    table = torch.zeros(len(lens), max(lens) + 3, dtype=torch.int32)  # wider than needed: the tail is never read
    at = 0
    for i, n in enumerate(lens):
        table[i, :n] = perm[at : at + n].to(torch.int32)
        at += n
    return table


def pools(g: torch.Generator, slots: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(slots, kv_heads, dim, generator=g), torch.randn(slots, kv_heads, dim, generator=g)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_attention_matches_its_reference(dim, group):
    g = torch.Generator().manual_seed(dim * 10 + group)
    kv_heads = 2 if group < 8 else 1
    lens = [1, 300, 37, 129]
    slots = sum(lens) + 50
    k_pool, v_pool = pools(g, slots, kv_heads, dim)
    table = scattered_tables(g, lens, slots)
    q = torch.randn(len(lens) + 2, kv_heads * group, dim, generator=g)  # two rows that are not decode rows
    q_rows = torch.tensor([3, 0, 5, 1], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ref = torch.full_like(q, float("nan"))
    decode_attention_ref(q, k_pool, v_pool, ref, q_rows, table, seq_lens)
    for splits in (None, 1, 5):  # the chosen split count, none, and more parts than short requests have blocks
        out = torch.full_like(q, float("nan"))
        decode_attention_triton(q, k_pool, v_pool, out, q_rows, table, seq_lens, splits=splits)
        rows = q_rows.long()
        assert rel_err(out[rows], ref[rows]) < TOL, splits
        assert out[[2, 4]].isnan().all()  # rows of other requests untouched


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_extend_attention_matches_its_reference(dim, group):
    g = torch.Generator().manual_seed(1000 + dim * 10 + group)
    kv_heads = 2 if group < 8 else 1
    q_lens = [1, 70, 33, 5]
    prefix_lens = [0, 0, 230, 41]  # a fresh prompt, a one-token chunk, chunks over cached prefixes
    lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    slots = sum(lens) + 20
    k_pool, v_pool = pools(g, slots, kv_heads, dim)
    table = scattered_tables(g, lens, slots)
    starts = [0]
    for n in q_lens[:-1]:
        starts.append(starts[-1] + n + 2)  # gaps: rows that belong to no extend request
    q = torch.randn(starts[-1] + q_lens[-1] + 1, kv_heads * group, dim, generator=g)
    args = [torch.tensor(x, dtype=torch.int32) for x in (starts, q_lens, prefix_lens)]
    ref = torch.full_like(q, float("nan"))
    extend_attention_ref(q, k_pool, v_pool, ref, *args, table)
    out = torch.full_like(q, float("nan"))
    extend_attention_triton(q, k_pool, v_pool, out, *args, table, max(q_lens))
    mine = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens)])
    assert rel_err(out[mine], ref[mine]) < TOL
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[mine] = False
    assert out[others].isnan().all()


def test_extend_of_a_whole_history_equals_decoding_it_token_by_token():
    """Two references that must agree: a prefix-free chunk's last row is a decode step."""
    g = torch.Generator().manual_seed(7)
    k_pool, v_pool = pools(g, 64, 2, 64)
    table = torch.randperm(64, generator=g)[:40].to(torch.int32)[None]
    q = torch.randn(40, 6, 64, generator=g)
    ext = torch.full_like(q, float("nan"))
    one = torch.tensor([0], dtype=torch.int32)
    extend_attention_triton(q, k_pool, v_pool, ext, one, torch.tensor([40], dtype=torch.int32), one, table, 40)
    dec = torch.full_like(q, float("nan"))
    decode_attention_triton(q, k_pool, v_pool, dec, torch.tensor([39], dtype=torch.int32), table,
                            torch.tensor([40], dtype=torch.int32))
    assert rel_err(dec[39], ext[39]) < TOL


@pytest.mark.parametrize("dim", [64, 128])
def test_store_kv_matches_its_reference(dim):
    g = torch.Generator().manual_seed(dim)
    qkv = torch.randn(37, 3, 4, dim, generator=g)
    k, v = qkv[:, 1], qkv[:, 2]  # strided views, as the model's fused projection gives them
    slots = torch.randperm(100, generator=g)[:37]
    want_k, want_v = torch.full((100, 4, dim), float("nan")), torch.full((100, 4, dim), float("nan"))
    got_k, got_v = want_k.clone(), want_v.clone()
    store_kv_ref(want_k, want_v, slots, k, v)
    store_kv_triton(got_k, got_v, slots, k, v)
    assert torch.equal(got_k[slots], want_k[slots]) and torch.equal(got_v[slots], want_v[slots])
    untouched = torch.ones(100, dtype=torch.bool)
    untouched[slots] = False
    assert got_k[untouched].isnan().all() and got_v[untouched].isnan().all()


def test_the_gpu_check_script_runs_its_correctness_part_in_the_interpreter():
    """scripts/gpu_check.py --smoke: every check of the GPU script at 1/64 size, fp32 and bf16,
    in the interpreter (a script that only runs when a GPU is lent must not rot meanwhile)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    r = subprocess.run([sys.executable, str(script), "--smoke"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.split()[:1] in (["decode"], ["extend"], ["store_kv"])]
    assert len(lines) == 28 and all(" yes" in ln for ln in lines) and sum("bfloat16" in ln for ln in lines) == 14


def test_lora_add_gives_each_group_of_rows_its_adapters_delta_as_the_reference():
    """Two adapters of ranks 3 and 16 over scattered rows (and rows with none, untouched), the
    output off the kernel's block width."""
    from radixserve_kernels.lora import lora_add_ref, lora_add_triton

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(9, 150, generator=g), torch.randn(9, 300, generator=g)
    a = [torch.randn(r, 150, generator=g) for r in (3, 16)]
    bt = [torch.randn(r, 300, generator=g) for r in (3, 16)]
    rows, bounds = torch.tensor([5, 1, 7, 0, 3]), [0, 3, 3, 5]
    ref, out = y.clone(), y.clone()
    lora_add_ref(ref, x, rows, bounds, a, bt)
    lora_add_triton(out, x, rows, bounds, a, bt)
    assert rel_err(out, ref) < TOL and torch.equal(out[[2, 4, 6, 8]], y[[2, 4, 6, 8]])
