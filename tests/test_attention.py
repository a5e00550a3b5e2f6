"""The fast torch attention backend against the torch reference on fresh random inputs:
fork groups sharing prefix slots, non-contiguous slot tables, GQA, chunks over prefixes."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.attention import create_backend
from radixserve.batch import ForwardBatch, SeqView
from radixserve.cache.pool import KVPool
from radixserve_kernels import cpu


def _batch(spec: list[tuple[list[int], int]], backend, heads: int, kv_heads: int, dim: int, seed: int):
    """spec: (slots, q_len) per sequence; the last q_len slots are the rows fed now."""
    g = torch.Generator().manual_seed(seed)
    seqs, out, row = [], [], 0
    for slots, q_len in spec:
        seqs.append(SeqView(row, q_len, len(slots) - q_len, slots))
        out += slots[len(slots) - q_len :]
        row += q_len
    t = torch.tensor
    batch = ForwardBatch(t([0] * row), t([0] * row), t(out), seqs, backend)
    q = torch.randn(row, heads, dim, generator=g)
    k = torch.randn(row, kv_heads, dim, generator=g)
    v = torch.randn(row, kv_heads, dim, generator=g)
    return batch, q, k, v


def _forward(name: str, pool: KVPool, spec, heads: int, kv_heads: int, dim: int, seed: int):
    """Backend `name`'s attention output for the batch `spec` describes, and the batch."""
    backend = create_backend(name, pool, torch.device("cpu"))
    batch, q, k, v = _batch(spec, backend, heads, kv_heads, dim, seed)
    backend.prepare(batch)
    return backend.forward(q, k, v, 0, batch), batch


def _random_pool(slots: int, kv_heads: int, dim: int, seed: int, kv_dtype: torch.dtype | None = None) -> KVPool:
    """A one-layer fp32 pool whose every slot holds fresh random K/V, stored as kv_dtype."""
    pool = KVPool(1, slots, kv_heads, dim, torch.float32, torch.device("cpu"), kv_dtype)
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(slots, kv_heads, dim, generator=g), torch.randn(slots, kv_heads, dim, generator=g)
    pool.store(0, torch.arange(slots), k, v)
    return pool


@pytest.fixture(params=[True, False], ids=["native", "gather"])
def native_kernels(request):
    """Decode rows through the native CPU kernel (in place), or gathered for torch's kernel."""
    cpu.set_enabled(request.param)
    yield request.param
    cpu.set_enabled(True)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 64), (9, 3, 64), (8, 1, 128)])
def test_fast_backend_matches_the_reference_on_forks_chunks_and_scattered_slots(heads, kv_heads, dim, native_kernels):
    rng = random.Random(heads * 100 + dim)
    pool = _random_pool(4096, kv_heads, dim, seed=7)
    free = list(range(200, 4096))
    rng.shuffle(free)
    prompt = list(range(0, 150))  # a contiguous cached prompt shared by a fork
    scattered = [free.pop() for _ in range(90)]  # a second fork group over scattered slots
    spec = []
    for _ in range(5):
        spec.append((prompt + [free.pop() for _ in range(rng.randint(1, 40))], 1))  # decoding branches
    for _ in range(3):
        spec.append((scattered + [free.pop() for _ in range(rng.randint(1, 9))], 1))
    spec.append(([free.pop() for _ in range(rng.randint(1, 300))], 1))  # a lone decode
    spec.append((prompt[:100] + [free.pop() for _ in range(37)], 37))  # a chunk over a contiguous prefix
    spec.append((scattered[:61] + [free.pop() for _ in range(20)], 20))  # over a scattered prefix
    spec.append(([free.pop() for _ in range(50)], 50))  # a first chunk, no prefix
    ref, _ = _forward("torch_ref", pool, spec, heads, kv_heads, dim, seed=3)
    got, batch = _forward("torch", pool, spec, heads, kv_heads, dim, seed=3)
    assert ("dec_lens" in batch.attn_meta) is native_kernels  # the path under test was taken
    groups = batch.attn_meta["dec_groups"]
    assert sorted(len(x.members) for x in groups) == [3, 5]  # both forks were read once per group
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5
    per_row = (got - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
    assert per_row.max().item() < 1e-4


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 64), (9, 3, 64), (8, 1, 128)])
def test_the_triton_backend_matches_the_reference_on_a_mixed_batch(heads, kv_heads, dim, monkeypatch):
    """Under TRITON_INTERPRET=1: decode rows and chunks over prefixes in one batch, scattered slots."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rng = random.Random(heads * 10 + dim)
    pool = _random_pool(1024, kv_heads, dim, seed=11)
    free = list(range(1024))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(60)]
    spec = [(shared + [free.pop()], 1), (shared + [free.pop() for _ in range(3)], 1)]  # a fork, decoding
    spec += [([free.pop() for _ in range(n)], 1) for n in (1, 2, 130)]  # lone decodes
    spec += [(shared[:40] + [free.pop() for _ in range(25)], 25), ([free.pop() for _ in range(70)], 70)]  # chunks
    ref, _ = _forward("torch_ref", pool, spec, heads, kv_heads, dim, seed=5)
    got, _ = _forward("triton", pool, spec, heads, kv_heads, dim, seed=5)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5


def test_the_triton_backend_refuses_a_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pool = KVPool(1, 16, 1, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="triton needs a CUDA device"):
        create_backend("triton", pool, torch.device("cpu"))


def test_the_plain_torch_fallback_matches_the_cpu_fused_kernel():
    from radixserve.attention.torch_flash import attention_lse, plain_attention_lse

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 32, generator=g)
    k, v = torch.randn(2, 2, 9, 32, generator=g), torch.randn(2, 2, 9, 32, generator=g)
    bias = torch.zeros(2, 1, 1, 9)
    bias[1, ..., 7:] = float("-inf")
    cases = [(k, v, False, bias), (k[:, :, :5], v[:, :, :5], True, None)]
    for kk, vv, causal, b in cases:
        fused = attention_lse(q, kk, vv, causal=causal, bias=b)
        plain = plain_attention_lse(q, kk, vv, causal=causal, bias=b)
        for x, y in zip(fused, plain):
            assert torch.allclose(x, y, atol=1e-5)


def test_the_triton_backend_generates_what_the_torch_backend_does(tiny_llama, monkeypatch):
    """End to end on a tiny model under TRITON_INTERPRET=1: chunked prefill, a radix-cache hit
    (a chunk over a cached prefix), forks decoding together, greedy tokens identical."""
    from helpers import assert_no_leak

    from radixserve import Engine, SamplingParams

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rng = random.Random(3)
    system = [rng.randrange(3, 380) for _ in range(150)]  # three chunks of 64
    prompts = [[5, 9, 11], system, system + [17, 18, 19, 20]] + [system + [30 + i] * (i + 1) for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    got = {}
    for name in ("torch", "triton"):
        with Engine(str(tiny_llama), attention_backend=name, kv_cache_tokens=2048, chunked_prefill_size=64) as e:
            outs = [o.token_ids for o in e.generate(prompts[:2], greedy)]  # the system prompt gets cached
            outs += [o.token_ids for o in e.generate(prompts[2:], greedy)]  # ...and is hit by the rest
            assert e.stats().cached_prompt_tokens >= 4 * 150 - 4
            assert_no_leak(e)
            got[name] = outs
    assert got["triton"] == got["torch"]


KV_TOL = {torch.int8: 0.02, torch.float8_e4m3fn: 0.06, torch.bfloat16: 0.005}  # measured: 0.3-0.8%, 1.4-3.2%, 0.1-0.2%


def _mixed_spec(rng: random.Random, slots: int) -> list[tuple[list[int], int]]:
    """Decode rows first (two fork groups and a lone one), then chunks with and without prefixes."""
    free = list(range(200, slots))
    rng.shuffle(free)
    prompt, scattered = list(range(150)), [free.pop() for _ in range(90)]
    spec = [(prompt + [free.pop() for _ in range(rng.randint(1, 40))], 1) for _ in range(4)]
    spec += [(scattered + [free.pop() for _ in range(rng.randint(1, 9))], 1) for _ in range(3)]
    spec.append(([free.pop() for _ in range(rng.randint(1, 300))], 1))
    spec.append((prompt[:100] + [free.pop() for _ in range(37)], 37))
    spec.append((scattered[:61] + [free.pop() for _ in range(20)], 20))
    spec.append(([free.pop() for _ in range(50)], 50))
    return spec


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn, torch.bfloat16], ids=["int8", "fp8", "bf16"])
@pytest.mark.parametrize("name", ["torch", "torch_ref"])
def test_a_quantized_pool_attends_close_to_an_fp32_one_in_each_backend(name, kv_dtype, native_kernels):
    heads, kv_heads, dim, decodes = 9, 3, 64, 8
    spec = _mixed_spec(random.Random(5), 1024)
    exact, _ = _forward(name, _random_pool(1024, kv_heads, dim, seed=7), spec, heads, kv_heads, dim, seed=3)
    got, batch = _forward(name, _random_pool(1024, kv_heads, dim, seed=7, kv_dtype=kv_dtype), spec, heads, kv_heads, dim, seed=3)
    err = ((got - exact).norm() / exact.norm()).item()
    assert 1e-5 < err < KV_TOL[kv_dtype]  # close, and the pool really was stored in kv_dtype
    if name == "torch":  # decode rows: native in place (int8/fp8) or gathered, fork groups merged, as the oracle reads
        assert ("dec_lens" in batch.attn_meta) is (native_kernels and kv_dtype != torch.bfloat16)
        ref, _ = _forward("torch_ref", _random_pool(1024, kv_heads, dim, seed=7, kv_dtype=kv_dtype), spec, heads, kv_heads, dim,
                          seed=3)
        assert ((got[:decodes] - ref[:decodes]).norm() / ref[:decodes].norm()).item() < 1e-5


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_the_triton_backend_reads_a_quantized_pool_as_the_reference_does(kv_dtype, monkeypatch):
    """Under TRITON_INTERPRET=1: the touched slots dequantized into a compact pool."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rng = random.Random(2)
    free = list(range(512))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(40)]
    spec = [(shared + [free.pop()], 1), (shared + [free.pop() for _ in range(3)], 1), ([free.pop() for _ in range(70)], 1)]
    spec += [(shared[:30] + [free.pop() for _ in range(25)], 25)]
    ref, _ = _forward("torch_ref", _random_pool(512, 2, 64, seed=4, kv_dtype=kv_dtype), spec, 6, 2, 64, seed=9)
    got, _ = _forward("triton", _random_pool(512, 2, 64, seed=4, kv_dtype=kv_dtype), spec, 6, 2, 64, seed=9)
    exact, _ = _forward("triton", _random_pool(512, 2, 64, seed=4), spec, 6, 2, 64, seed=9)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5
    assert 1e-5 < ((got - exact).norm() / exact.norm()).item() < KV_TOL[kv_dtype]


def test_the_fused_decode_step_is_offered_only_a_pool_in_the_activations_dtype():
    """A decode-only batch (the fused step's case): offered for fp32 K/V and for int8 / fp8 (with
    their scales), refused for bf16 under fp32, which then runs layer by layer."""
    spec = [([i * 50 + j for j in range(20 + i)], 1) for i in range(4)]  # no shared slots: no fork group
    offered = {}
    for kv_dtype in (None, torch.int8, torch.float8_e4m3fn, torch.bfloat16):
        _, batch = _forward("torch", _random_pool(256, 2, 64, seed=1, kv_dtype=kv_dtype), spec, 4, 2, 64, seed=2)
        offered[kv_dtype] = batch.attn_backend.native_decode(batch) is not None
    assert offered == {None: True, torch.int8: True, torch.float8_e4m3fn: True, torch.bfloat16: False}


def _windowed_oracle(pool: KVPool, spec, q: torch.Tensor, window: int, layer: int = 0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Dense softmax per row over the slots at positions (p - window, p], p the row's position;
    with `sinks`, each head's sink logit one more score whose share is dropped (transformers' eager
    gpt-oss attention)."""
    out, row = torch.empty_like(q), 0
    group = q.shape[1] // pool.k[0].shape[1]
    for slots, q_len in spec:
        for j in range(q_len):
            p = len(slots) - q_len + j
            seen = torch.tensor(slots[max(0, p - window + 1) : p + 1])
            k, v = (x.repeat_interleave(group, 1) for x in pool.read(layer, seen))  # (L, heads, dim)
            s = torch.einsum("hd,lhd->hl", q[row], k) * q.shape[-1] ** -0.5
            p = s.softmax(-1) if sinks is None else torch.cat([s, sinks[:, None]], -1).softmax(-1)[:, :-1]
            out[row] = torch.einsum("hl,lhd->hd", p, v)
            row += 1
    return out


def _window_and_full(backend, batch, q, k, v, window: int, native: bool, full_layer: int):
    """The batch through layer 0 as a sliding-window layer and through `full_layer` as a full
    one, with the native CPU kernels on or off."""
    cpu.set_enabled(native)
    try:
        backend.prepare(batch)
        return backend.forward(q, k, v, 0, batch, window=window), backend.forward(q, k, v, full_layer, batch)
    finally:
        cpu.set_enabled(True)


@pytest.mark.parametrize(("name", "native"), [("torch", True), ("torch", False), ("torch_ref", True), ("triton", True)],
                         ids=["torch-native", "torch-gather", "torch_ref", "triton"])
def test_a_sliding_window_layer_sees_only_its_window_in_each_backend(name, native, monkeypatch):
    """Decodes (a fork group, scattered slots), chunks over prefixes longer than the window and a
    first chunk longer than it, against a dense oracle; the same batch's full layer still sees all."""
    if name == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    heads, kv_heads, dim, window = 6, 2, 32, 24
    spec = _mixed_spec(random.Random(5), 2048)
    pool = _random_pool(2048, kv_heads, dim, seed=9)
    backend = create_backend(name, pool, torch.device("cpu"))
    batch, q, k, v = _batch(spec, backend, heads, kv_heads, dim, seed=4)
    got, full = _window_and_full(backend, batch, q, k, v, window, native, full_layer=0)
    if name == "torch":
        assert ("dec_lens" in batch.attn_meta) is native
    want = _windowed_oracle(pool, spec, q, window)
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    assert ((full - _windowed_oracle(pool, spec, q, 10**6)).norm() / full.norm()).item() < 1e-5


@pytest.mark.parametrize(("name", "native", "kv_dtype"),
                         [("torch", True, None), ("torch", False, None), ("torch_ref", True, None), ("triton", True, None),
                          ("torch", True, torch.int8), ("triton", True, torch.int8)],
                         ids=["torch-native", "torch-gather", "torch_ref", "triton", "torch-int8", "triton-int8"])
def test_a_window_pool_is_written_and_read_through_its_own_slots_in_each_backend(name, native, kv_dtype, monkeypatch):
    """Layer 0 a sliding-window layer with a pool of its own (its slots a permutation of the full
    ones), layer 1 a full layer holding the same K/V: the windowed layer stores at the batch's
    window slots and reads its window through them, as the full layer's rows say it should."""
    if name == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    heads, kv_heads, dim, window = 6, 2, 32, 24
    spec = _mixed_spec(random.Random(5), 2048)
    pool = KVPool(2, 2048, kv_heads, dim, torch.float32, torch.device("cpu"), kv_dtype, (window, 0), 2048)
    assert pool.window_slots == 2048 and pool.pad_for(window) == pool.window_pad_slot
    g = torch.Generator().manual_seed(9)
    perm = torch.randperm(2048, generator=g)
    k, v = torch.randn(2048, kv_heads, dim, generator=g), torch.randn(2048, kv_heads, dim, generator=g)
    pool.store(1, torch.arange(2048), k, v)
    pool.store(0, perm, k, v)
    backend = create_backend(name, pool, torch.device("cpu"))
    batch, q, k, v = _batch(spec, backend, heads, kv_heads, dim, seed=4)
    for s in batch.seqs:  # what ForwardBatch.from_plan gives each sequence: its window's slots in the window pool
        s.window_slots = perm[torch.tensor(s.slots[max(0, s.prefix_len - (window - 1)) :])].tolist()
    batch.window_out_slots = perm[batch.out_slots]
    got, full = _window_and_full(backend, batch, q, k, v, window, native, full_layer=1)
    assert backend.native_decode(batch) is None  # one slot table cannot serve both pools
    want = _windowed_oracle(pool, spec, q, window, layer=1)
    tol = 1e-5 if kv_dtype is None else KV_TOL[kv_dtype]  # a chunk's own rows come unquantized from its inputs
    assert ((got - want).norm() / want.norm()).item() < tol
    assert ((full - _windowed_oracle(pool, spec, q, 10**6, layer=1)).norm() / full.norm()).item() < tol


@pytest.mark.parametrize(("name", "native"), [("torch", True), ("torch", False), ("torch_ref", True)],
                         ids=["torch-native", "torch-gather", "torch_ref"])
def test_attention_sinks_take_their_share_of_every_softmax_in_each_backend(name, native):
    """gpt-oss's sink logit per head on decodes (fork groups merged, then the sink applied),
    scattered slots, chunks over prefixes and a first chunk, in a windowed layer and a full one,
    against a dense oracle holding the sink as one more score."""
    heads, kv_heads, dim, window = 6, 2, 32, 24
    spec = _mixed_spec(random.Random(6), 2048)
    pool = _random_pool(2048, kv_heads, dim, seed=10)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(1)) * 2
    backend = create_backend(name, pool, torch.device("cpu"), sinks=True)
    batch, q, k, v = _batch(spec, backend, heads, kv_heads, dim, seed=4)
    cpu.set_enabled(native)
    try:
        backend.prepare(batch)
        windowed = backend.forward(q, k, v, 0, batch, window=window, sinks=sinks)
        full = backend.forward(q, k, v, 0, batch, sinks=sinks)
    finally:
        cpu.set_enabled(True)
    if name == "torch":
        assert ("dec_lens" in batch.attn_meta) is native and len(batch.attn_meta["dec_groups"]) == 2
    for got, w in ((windowed, window), (full, 10**6)):
        want = _windowed_oracle(pool, spec, q, w, sinks=sinks)
        assert ((got - want).norm() / want.norm()).item() < 1e-5
    assert ((full - _windowed_oracle(pool, spec, q, 10**6)).norm() / full.norm()).item() > 1e-2  # (the sinks count)


def test_a_model_with_attention_sinks_is_kept_off_the_triton_kernels():
    from radixserve.attention import resolve_backend_name

    assert resolve_backend_name("auto", torch.device("cuda"), sinks=True) == "torch"
    assert resolve_backend_name("auto", torch.device("cuda")) == "triton"
    with pytest.raises(ValueError, match="attention_backend: triton has no attention sinks"):
        resolve_backend_name("triton", torch.device("cpu"), sinks=True)
