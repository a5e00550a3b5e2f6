"""Quantized KV cache (`kv_cache_dtype`): the quantize/dequantize round trip, the pool's
capacity for a byte budget, the engine end to end over an int8 / fp8 pool (forks, prefix
hits, no leaked slots), what /server_info and /metrics report, and bad values refused."""

from __future__ import annotations

import random
import urllib.request

import pytest
import torch
from helpers import assert_no_leak
from server_helpers import ServerProcess

from radixserve import Engine, SamplingParams
from radixserve.cache.pool import KV_CACHE_DTYPES, kv_bytes_per_token
from radixserve.config import KV_CACHE_DTYPES as KV_CACHE_DTYPE_NAMES
from radixserve_kernels.kv_quant import dequantize, quantize

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_round_trip_errors_are_bounded(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(500, 4, 64, generator=g) * torch.logspace(-5, 4, 500)[:, None, None]).to(dtype)
    x[3, 2] = 0
    for qdtype, qmax in ((torch.int8, 127), (torch.float8_e4m3fn, 448)):
        q, scale = quantize(x, qdtype)
        assert q.dtype == qdtype and scale.dtype == torch.float32 and scale.shape == x.shape[:2]
        back = dequantize(q, scale, torch.float32)
        err, xf = (back - x.float()).abs(), x.float()
        assert torch.equal(back[3, 2], torch.zeros(64)) and back.isfinite().all()
        assert (q.float().abs().amax(-1) == qmax).sum() >= x.shape[0] * x.shape[1] - 1  # each row's absmax lands on QMAX
        if qdtype == torch.int8:  # half a step of absmax / 127
            assert (err <= scale[..., None] / 2 * (1 + 1e-5)).all()
        else:  # 3 mantissa bits: half an ulp, 1/16 of the value; steps of scale * 2^-9 below 2^-6
            assert (err <= torch.maximum(xf.abs() / 16, scale[..., None] * 2**-10) * (1 + 1e-5)).all()
        assert (err.amax(-1) / xf.abs().amax(-1).clamp_min(1e-30))[xf.abs().amax(-1) > 0].max() < (0.004 if qmax == 127 else 0.07)


def test_a_byte_budget_holds_nearly_twice_the_tokens_in_int8_as_in_bf16():
    """The scales count: SmolLM2-135M's shape (30 layers, 3 KV heads, head_dim 64)."""
    bf16, int8, fp8 = (kv_bytes_per_token(30, 3, 64, d) for d in (torch.bfloat16, torch.int8, torch.float8_e4m3fn))
    assert (bf16, int8, fp8) == (2 * 30 * 3 * 128, 2 * 30 * 3 * (64 + 4), 2 * 30 * 3 * (64 + 4))
    budget = 256 << 20
    assert (budget // bf16, budget // int8) == (11650, 21931)  # 1.88x


def test_the_engine_sizes_its_pool_from_kv_cache_memory_mb_in_its_kv_dtype(tiny_llama):
    """The tiny model: 2 layers, 2 KV heads, head_dim 16 -> 512 (fp32), 256 (bf16), 160 (int8) bytes a token."""
    tokens = {}
    for name in ("auto", "bf16", "int8", "fp8_e4m3"):
        with Engine(str(tiny_llama), kv_cache_memory_mb=1, kv_cache_dtype=name) as e:
            s = e.stats()
            tokens[name] = (s.kv_total_slots, s.kv_dtype, s.kv_bytes_per_token)
    assert tokens == {"auto": (2048, "float32", 512), "bf16": (4096, "bfloat16", 256), "int8": (6553, "int8", 160),
                      "fp8_e4m3": (6553, "float8_e4m3fn", 160)}


def test_a_bad_kv_cache_dtype_or_a_double_size_is_a_clear_error(tiny_llama):
    assert set(KV_CACHE_DTYPE_NAMES) == {"auto", *KV_CACHE_DTYPES}  # the CLI's choices are the pool's
    with pytest.raises(ValueError, match="kv_cache_dtype: 'int4' is not supported; choose from: auto, bf16, fp8_e4m3, int8"):
        Engine(str(tiny_llama), kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_memory_mb: give it or kv_cache_tokens, not both"):
        Engine(str(tiny_llama), kv_cache_memory_mb=1, kv_cache_tokens=100)


def _workload() -> tuple[list[list[int]], list[list[int]]]:
    """A cached system prompt, then branches off it (fork groups decoding over its slots) and
    a chunked prompt that hits it."""
    rng = random.Random(4)
    system = [rng.randrange(3, 380) for _ in range(150)]
    first = [[5, 9, 11], system]
    then = [system + [30 + i] * (i + 1) for i in range(5)] + [system + [rng.randrange(3, 380) for _ in range(90)]]
    return first, then


@pytest.mark.parametrize(("kv_dtype", "tol"), [("int8", 0.3), ("fp8_e4m3", 1.0)])
def test_the_engine_serves_forks_and_prefix_hits_from_a_quantized_pool(tiny_llama, kv_dtype, tol):
    """Against fp32 K/V: the same first token everywhere (prefill over a cached, quantized
    prefix), and the chosen tokens' log-probabilities within tol while the greedy paths agree
    (measured on the tiny random model, whose flat logits part paths early: 0.14 and 0.49)."""
    first, then = _workload()
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, return_logprob=True)
    outs = {}
    for name in ("auto", kv_dtype):
        with Engine(str(tiny_llama), kv_cache_tokens=2048, chunked_prefill_size=64, kv_cache_dtype=name) as e:
            fused = e.runner.model.model.fused
            assert fused is not None  # the fused decode step exists, and takes int8 / fp8 pools too (with their scales)
            calls = []
            orig = fused.run
            fused.run = lambda *a, calls=calls, orig=orig: calls.append(1) or orig(*a)
            outs[name] = e.generate(first, params) + e.generate(then, params)
            assert e.stats().cached_prompt_tokens >= len(then) * 150 - len(then)
            assert calls  # decode-only steps ran in one native call
            assert_no_leak(e)
    for exact, got in zip(outs["auto"], outs[kv_dtype]):
        assert exact.token_ids[0] == got.token_ids[0]
        for a, b in zip(exact.logprobs, got.logprobs):
            if a.token_id != b.token_id:
                break
            assert abs(a.logprob - b.logprob) < tol


def test_the_server_reports_its_kv_dtype_bytes_per_token_and_capacity(tiny_llama, tmp_path):
    """(With int4 weights whose activations are chosen: /server_info says that too.)"""
    s = ServerProcess(tiny_llama, "--kv-cache-dtype", "int8", "--kv-cache-memory-mb", "1", "--quantization", "int4",
                      "--activations", "int16", log=tmp_path / "server.log")
    try:
        status, out = s.post("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 3}})
        assert status == 200 and out["meta_info"]["completion_tokens"] == 3
        _, info = s.get("/server_info?check_integrity=1")
        assert (info["kv_cache_dtype"], info["kv_bytes_per_token"], info["kv_capacity_tokens"]) == ("int8", 160, 6553)
        assert info["integrity"] == "ok"
        assert (info["quantization"], info["activations"]) == ("q4_1+q8_0", "int16")
        with urllib.request.urlopen(s.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'radixserve_kv_cache_dtype_info{dtype="int8"} 1.0' in text
        assert "radixserve_kv_bytes_per_token 160.0" in text and "radixserve_kv_total_tokens 6553.0" in text
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("options,says", [
    (dict(kv_cache_memory_mb=0), "kv_cache_memory_mb: must be a positive integer, got 0"),
    (dict(kv_cache_tokens=-5), "kv_cache_tokens: must be a positive integer, got -5"),
    (dict(kv_cache_tokens=1000, kv_cache_memory_mb=100), "kv_cache_memory_mb: give it or kv_cache_tokens, not both"),
    (dict(kv_mem_fraction=1.5), r"kv_mem_fraction: must be in \(0, 1\], got 1.5"),
])
def test_pool_sizes_are_refused_before_a_model_loads(options, says):
    from radixserve.config import EngineConfig

    with pytest.raises(ValueError, match=says):
        EngineConfig.build(None, **options)
