"""Our Llama-family forward against Hugging Face transformers on the same weights (fp32)."""

from __future__ import annotations

import pytest
import torch

from radixserve import SamplingParams
from tests.conftest import ARCHS
from tests.helpers import hf_logits_and_greedy, our_prompt_logits

GREEDY_32 = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)


def _check(path, ids, engine_factory) -> None:
    ref_logits, ref_tokens = hf_logits_and_greedy(path, ids, 32)
    ours = our_prompt_logits(path, ids)
    err = (ours - ref_logits).abs().max().item()
    assert err < 1e-3, f"prompt logits differ from transformers by {err}"
    with engine_factory() as engine:
        out = engine.generate([ids], GREEDY_32)[0]
    assert out.token_ids == ref_tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_architecture_matches_transformers(arch, tiny_models):
    from radixserve import Engine

    path = tiny_models[arch]
    ids = [5, 17, 42, 99, 123, 7, 250, 31, 64, 200, 11, 3, 77, 150, 300, 9]
    _check(path, ids, lambda: Engine(str(path), kv_cache_tokens=1024))


@pytest.mark.smollm2
def test_smollm2_matches_transformers(smollm2_dir, smollm2_engine):
    from contextlib import nullcontext

    ids = smollm2_engine.chat_ids([{"role": "user", "content": "Write a haiku about the sea."}])
    _check(smollm2_dir, ids, lambda: nullcontext(smollm2_engine))


def test_tied_and_untied_heads_load(tiny_models):
    from radixserve.models.loader import load_model

    tied = load_model(str(tiny_models["LlamaForCausalLM"]), torch.float32, torch.device("cpu")).model
    untied = load_model(str(tiny_models["Qwen2ForCausalLM"]), torch.float32, torch.device("cpu")).model
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linears_compute_what_plain_linears_compute_at_every_row_count(ops, dtype):
    """Decode rows take the oneDNN-packed weights, bf16 prefill chunks fp32 on the fly: each
    path against F.linear in fp32 on fresh random inputs, with and without a bias."""
    from torch import nn

    from radixserve.models.linear import PACKED_MAX_ROWS, UPCAST_MIN_ROWS, PackedLinear, packing_available

    assert packing_available(dtype, torch.device("cpu"))  # the pinned CPU torch has oneDNN
    torch.manual_seed(0)
    for bias in (False, True):
        lin = nn.Linear(96, 80, bias=bias).to(dtype)
        packed = PackedLinear(lin)
        assert packed.weight is lin.weight  # shared: a tied embedding stays tied
        for rows in (1, 2, 7, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, UPCAST_MIN_ROWS, 300):
            x = torch.randn(rows, 96, dtype=dtype)
            ref = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float() if bias else None)
            got = packed(x)
            assert got.dtype == dtype and got.shape == (rows, 80)
            tol = 1e-4 if dtype == torch.float32 else 3e-2 * ref.abs().max().item()
            assert (got.float() - ref).abs().max().item() < tol, (rows, bias)


def test_the_engine_packs_its_linears_unless_told_not_to(tiny_llama):
    from radixserve import Engine
    from radixserve.models.linear import PackedLinear

    for disable in (False, True):
        with Engine(str(tiny_llama), kv_cache_tokens=256, disable_packed_linears=disable) as e:
            kinds = {type(m) for m in e.runner.model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))}
            assert kinds == ({torch.nn.Linear} if disable else {PackedLinear})
            out = e.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=4))[0]
            assert out.completion_tokens == 4


@pytest.mark.parametrize("page_size", [1, 4])
def test_the_native_cpu_kernels_generate_what_torch_ops_do(ops, tiny_llama, page_size):
    """fp32 greedy, token for token, with radixserve's CPU kernels and with torch's ops; the two
    branches off the cached prompt decode as a fork group (its shared-prefix pass); slots
    handed out one by one or in pages of 4."""
    from radixserve import Engine
    from radixserve_kernels import cpu

    prompt = [(7 * i) % 250 + 3 for i in range(60)]
    prompts = [prompt + [11], prompt + [12], [5, 6, 7]]
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    outs = []
    for disable in (False, True):
        with Engine(str(tiny_llama), kv_cache_tokens=1024, page_size=page_size, disable_cpu_kernels=disable) as e:
            assert cpu.enabled() is not disable
            assert (e.runner.model.model.fused is not None) is not disable  # decode steps: all layers in one call
            e.generate([prompt], SamplingParams(temperature=0, max_new_tokens=1))  # caches the prompt
            outs.append([o.token_ids for o in e.generate(prompts, params)])
    cpu.set_enabled(True)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("arch,dtype,kv", [("LlamaForCausalLM", "float32", "auto"), ("LlamaForCausalLM", "bfloat16", "auto"),
                                           ("LlamaForCausalLM", "float32", "int8"), ("LlamaForCausalLM", "bfloat16", "fp8_e4m3"),
                                           ("LlamaForCausalLM", "float32", "fp8_e4m3"), ("Qwen2ForCausalLM", "float32", "auto"),
                                           ("Qwen2ForCausalLM", "bfloat16", "int8"), ("Qwen3ForCausalLM", "float32", "auto"),
                                           ("Qwen3ForCausalLM", "bfloat16", "auto")])
def test_the_fused_decode_step_computes_what_the_layer_by_layer_path_does(ops, tiny_models, arch, dtype, kv):
    """The same kernels in one native call or called layer by layer from Python: the same
    tokens and logprobs, in both dtypes, over float and int8 / fp8 pools, for Llama, Qwen2 (q/k/v
    biases) and Qwen3 (q/k norms) (a batch of three unrelated prompts: a fork group's steps take
    the per-layer path either way)."""
    from radixserve import Engine

    prompts = [[(5 * i) % 200 + 3 for i in range(40)], [(7 * i) % 190 + 11 for i in range(23)], [4, 5, 6]]
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True, return_logprob=True)
    with Engine(str(tiny_models[arch]), kv_cache_tokens=1024, dtype=dtype, kv_cache_dtype=kv) as e:
        model = e.runner.model.model
        fused = model.fused
        assert fused is not None
        calls, run = [], fused.run
        fused.run = lambda *a: calls.append(1) or run(*a)
        runs = []
        for on in (True, False):
            model.fused = fused if on else None
            e.flush_cache()
            runs.append([(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in e.generate(prompts, params)])
        model.fused = fused
    assert len(calls) >= 9  # the first run's decode steps went through it
    assert runs[0] == runs[1]
