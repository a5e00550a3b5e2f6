"""Mixtures of experts (models/moe.py): Qwen3-MoE, Qwen2-MoE and Mixtral against transformers on
the same weights (fp32), the grouped expert step against a per-token reference, and configs or
checkpoints that disagree refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from radixserve import Engine, SamplingParams
from radixserve.models.config import ArchConfig
from radixserve.models.moe import MoE, grouped_experts, route
from radixserve.models.quant import QuantLinear, set_activations
from tests.conftest import ALL_MOE_ARCHS, MOE_ARCHS
from tests.helpers import hf_logits_and_greedy, our_prompt_logits

IDS = [5, 17, 42, 99, 123, 7, 250, 31, 64, 200, 11, 3, 77, 150, 300, 9, 45, 46, 47, 18]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


def _per_token(x, w13, w2, weights, experts):
    """The reference: each token through each of its experts, one at a time."""
    out = torch.zeros(x.shape[0], w2.shape[1])
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for k in range(experts.shape[1]):
            e = int(experts[t, k])
            h = w13[e] @ x[t]
            out[t] += weights[t, k] * (w2[e] @ (F.silu(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize("rows", [1, 2, 7, 33])
def test_the_grouped_expert_step_is_each_tokens_experts_summed(rows):
    """Rows that pick the same expert, experts no row picks (16 experts, top 2), one row."""
    g = torch.Generator().manual_seed(rows)
    e, hidden, inter = 16, 24, 40
    x = torch.randn(rows, hidden, generator=g)
    w13, w2 = torch.randn(e, 2 * inter, hidden, generator=g) * 0.2, torch.randn(e, hidden, inter, generator=g) * 0.2
    logits = torch.randn(rows, e, generator=g)
    logits[:, 3] += 10  # every row picks expert 3
    weights, experts = route(logits, 2, renormalize=True)
    assert (experts == 3).any(dim=1).all() and len(set(experts.flatten().tolist())) < e
    torch.testing.assert_close(grouped_experts(x, w13, w2, weights, experts), _per_token(x, w13, w2, weights, experts),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, 33])
def test_the_triton_fused_moe_kernel_is_the_grouped_step(rows, monkeypatch):
    """Under TRITON_INTERPRET=1, the two grouped GEMMs of radixserve_kernels.fused_moe against
    grouped_experts (torch): rows sharing an expert, experts no row picks, one row, widths that
    are no multiple of a tile, and a pair of another rank's expert (-1, weight 0) left out."""
    from radixserve_kernels.fused_moe import align, fused_moe_triton

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(rows)
    e, hidden, inter = 16, 24, 40
    x = torch.randn(rows, hidden, generator=g)
    w13, w2 = torch.randn(e, 2 * inter, hidden, generator=g) * 0.2, torch.randn(e, hidden, inter, generator=g) * 0.2
    logits = torch.randn(rows, e, generator=g)
    logits[:, 3] += 10
    weights, experts = route(logits, 2, renormalize=True)
    weights[0, 1], experts[0, 1] = 0.0, -1
    ids, tiles = align(experts, e, 16)  # every live pair once, each tile's pairs all of its expert
    flat = experts.reshape(-1)
    assert sorted(ids[ids < flat.numel()].tolist()) == [i for i, v in enumerate(flat.tolist()) if v >= 0]
    for tile, expert in zip(ids.view(-1, 16), tiles.tolist()):
        assert (flat[tile[tile < flat.numel()]] == expert).all()
    torch.testing.assert_close(fused_moe_triton(x, w13, w2, weights, experts), grouped_experts(x, w13, w2, weights, experts),
                               rtol=1e-5, atol=1e-5)


def test_routing_is_the_top_k_of_the_softmax_renormalised_where_asked():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    p = torch.softmax(logits, -1)[0]
    w, e = route(logits, 2, renormalize=False)
    assert e.tolist() == [[1, 2]] and torch.allclose(w, p[[1, 2]][None])
    w, _ = route(logits, 2, renormalize=True)
    assert torch.allclose(w, (p[[1, 2]] / p[[1, 2]].sum())[None])


@pytest.mark.parametrize("arch", ALL_MOE_ARCHS)
def test_tiny_moe_matches_transformers_whole_in_chunks_and_through_the_cache(arch, tiny_moe_models):
    path = tiny_moe_models[arch]
    ref_logits, ref_tokens = hf_logits_and_greedy(path, IDS, GREEDY.max_new_tokens)
    err = (our_prompt_logits(path, IDS) - ref_logits).abs().max().item()
    assert err < 1e-3, f"prompt logits differ from transformers by {err}"
    with Engine(str(path), kv_cache_tokens=1024) as whole:
        assert whole.generate([IDS], GREEDY)[0].token_ids == ref_tokens
        again = whole.generate([IDS], GREEDY)[0]  # the prompt from the radix cache
        assert again.token_ids == ref_tokens and again.cached_tokens > 0
    with Engine(str(path), kv_cache_tokens=1024, chunked_prefill_size=8) as chunked:
        outs = chunked.generate([IDS, IDS[:12] + [8, 8, 8]], GREEDY)  # a batch of two, sharing a prefix
        assert outs[0].token_ids == ref_tokens
        assert outs[1].token_ids == hf_logits_and_greedy(path, IDS[:12] + [8, 8, 8], GREEDY.max_new_tokens)[1]


@pytest.mark.parametrize("arch", ALL_MOE_ARCHS)
def test_the_parameter_count_is_the_models(arch, tiny_moe_models):
    from radixserve.models.loader import load_model
    from radixserve.models.moe import describe

    loaded = load_model(str(tiny_moe_models[arch]), torch.float32, torch.device("cpu"))
    assert describe(loaded.arch)["parameters"] == sum(p.numel() for p in loaded.model.parameters())


def test_the_config_names_what_routes(tiny_moe_models):
    cfg = ArchConfig.from_hf(json.loads((tiny_moe_models["Qwen3MoeForCausalLM"] / "config.json").read_text()))
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_layers, cfg.norm_topk_prob) == (8, 3, (0, 2), True)
    mixtral = ArchConfig.from_hf(json.loads((tiny_moe_models["MixtralForCausalLM"] / "config.json").read_text()))
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.moe_layers) == (4, 64, (0, 1))
    qwen2 = ArchConfig.from_hf(json.loads((tiny_moe_models["Qwen2MoeForCausalLM"] / "config.json").read_text()))
    assert (qwen2.shared_expert_intermediate_size, qwen2.norm_topk_prob, qwen2.qkv_bias) == (48, False, True)


@pytest.mark.parametrize(("change", "names"), [({"num_experts_per_tok": 9}, "num_experts_per_tok"),
                                               ({"moe_intermediate_size": 0}, "moe_intermediate_size")])
def test_a_config_whose_routing_cannot_work_is_refused_by_name(tiny_moe_models, change, names):
    cfg = json.loads((tiny_moe_models["Qwen3MoeForCausalLM"] / "config.json").read_text())
    with pytest.raises(ValueError, match=names):
        ArchConfig.from_hf({**cfg, **change})


def test_a_checkpoint_missing_an_expert_or_with_one_too_many_is_refused(tiny_moe_models, tmp_path):
    from safetensors.torch import load_file, save_file

    from radixserve.models.loader import load_model

    src = tiny_moe_models["MixtralForCausalLM"]
    tensors = load_file(src / "model.safetensors")
    for name, edit in [("missing", lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w3.weight")),
                       ("extra", lambda t: t.__setitem__("model.layers.0.block_sparse_moe.experts.4.w1.weight",
                                                         t["model.layers.0.block_sparse_moe.experts.0.w1.weight"].clone()))]:
        folder = tmp_path / name
        shutil.copytree(src, folder)
        t = dict(tensors)
        edit(t)
        save_file(t, folder / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match="lacks|expert 4"):
            load_model(str(folder), torch.float32, torch.device("cpu"))


def test_transformers_5s_fused_expert_tensors_load_as_the_per_expert_ones(tiny_moe_models, tmp_path):
    """`experts.gate_up_proj` (experts, 2 * inter, hidden) and `experts.down_proj`, as
    transformers 5 holds them in memory, load to the same model."""
    from safetensors.torch import load_file, save_file

    src = tiny_moe_models["Qwen3MoeForCausalLM"]
    tensors = load_file(src / "model.safetensors")
    fused: dict[str, torch.Tensor] = {}
    for layer in (0, 2):
        pre = f"model.layers.{layer}.mlp.experts"
        fused[f"{pre}.gate_up_proj"] = torch.stack(
            [torch.cat([tensors.pop(f"{pre}.{j}.gate_proj.weight"), tensors.pop(f"{pre}.{j}.up_proj.weight")]) for j in range(8)])
        fused[f"{pre}.down_proj"] = torch.stack([tensors.pop(f"{pre}.{j}.down_proj.weight") for j in range(8)])
    folder = tmp_path / "fused"
    shutil.copytree(src, folder)
    save_file({**tensors, **fused}, folder / "model.safetensors", metadata={"format": "pt"})
    assert torch.equal(our_prompt_logits(folder, IDS), our_prompt_logits(src, IDS))


@pytest.mark.parametrize("arch", ALL_MOE_ARCHS)
def test_two_expert_parallel_ranks_give_one_ranks_tokens(arch, tiny_moe_models):
    """Each rank holds half the experts (Qwen2-MoE's shared expert on rank 0), the routed
    layers' outputs summed over the ranks: one rank's greedy tokens, whole and batched."""
    path = str(tiny_moe_models[arch])
    prompts = [IDS, IDS[:12] + [8, 8, 8]]
    with Engine(path, kv_cache_tokens=1024) as one:
        want = [o.token_ids for o in one.generate(prompts, GREEDY)]
    with Engine(path, kv_cache_tokens=1024, expert_parallel=2) as two:
        assert [o.token_ids for o in two.generate(prompts, GREEDY)] == want


def test_expert_parallel_that_cannot_split_is_refused_by_name(tiny_moe_models, tiny_llama):
    with pytest.raises(Exception, match="expert_parallel: 4 ranks do not divide the model's 6 experts"):
        Engine(str(tiny_moe_models["Qwen2MoeForCausalLM"]), kv_cache_tokens=512, expert_parallel=4)
    with pytest.raises(Exception, match="expert_parallel: LlamaForCausalLM has no experts"):
        Engine(str(tiny_llama), kv_cache_tokens=512, expert_parallel=2)
    with pytest.raises(Exception, match="expert_parallel: not together with tensor_parallel"):
        Engine(str(tiny_moe_models["Qwen3MoeForCausalLM"]), kv_cache_tokens=512, expert_parallel=2, tensor_parallel=2)


def test_two_pipeline_ranks_give_one_ranks_tokens_and_tensor_parallel_says_it_does_not_split(tiny_moe_models):
    path = str(tiny_moe_models["Qwen3MoeForCausalLM"])
    with Engine(path, kv_cache_tokens=512) as one:
        want = one.generate([IDS], GREEDY)[0].token_ids
    with Engine(path, kv_cache_tokens=512, pipeline_parallel=2) as two:
        assert two.generate([IDS], GREEDY)[0].token_ids == want
    with pytest.raises(Exception, match="mixture-of-experts.*--pipeline-parallel"):
        Engine(path, kv_cache_tokens=512, tensor_parallel=2)


def test_a_served_moe_model_reports_its_experts_and_answers_in_a_json_schema(tiny_moe_models, tmp_path):
    from server_helpers import ServerProcess

    s = ServerProcess(tiny_moe_models["Qwen2MoeForCausalLM"], "--kv-cache-tokens", "2048", log=tmp_path / "server.log")
    try:
        _, info = s.get("/server_info")
        e = info["experts"]
        assert (e["experts"], e["experts_per_token"], e["routed_layers"], e["expert_parallel"]) == (6, 2, 2, 1)
        assert e["active_parameters"] == e["parameters"] - 2 * (6 - 2) * 3 * 96 * 32
        vocab = json.loads((tiny_moe_models["Qwen2MoeForCausalLM"] / "config.json").read_text())["vocab_size"]
        unread = 2 * (6 - 2) * 3 * 96 * 32 * 2 + vocab * 96 * 2  # (bf16) the idle experts; the untied embedding but a row
        assert e["step_weight_bytes"] == info["step_weight_bytes"] == info["weight_bytes"] - unread
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
        status, body = s.post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "a number"}], "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}})
        assert status == 200, body
        if body["choices"][0]["finish_reason"] == "stop":
            assert isinstance(json.loads(body["choices"][0]["message"]["content"])["n"], int)
    finally:
        assert s.stop() == 0, (tmp_path / "server.log").read_text()


# -- GGUF: the experts as llama.cpp's converter writes them (one 3-D tensor per layer and kind) ---
_GGUF_ARCH = {"Qwen3MoeForCausalLM": "qwen3moe", "Qwen2MoeForCausalLM": "qwen2moe", "MixtralForCausalLM": "llama"}
_PARTS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_EXPERT_PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def _gguf_writer(path, folder, gguf_arch: str):
    """A GGUF writer for the tiny folder as architecture `gguf_arch`, its llama.cpp metadata and
    tokenizer written (from a copy of the folder with rope_theta at the top, as _llama_metadata
    reads it); and the folder's config and tensors."""
    import gguf
    from safetensors.torch import load_file

    from tests.test_quant import _llama_metadata

    cfg = json.loads((folder / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), gguf_arch)
    meta = path.parent / f"{gguf_arch}-meta"
    shutil.copytree(folder, meta, dirs_exist_ok=True)
    (meta / "config.json").write_text(json.dumps({**cfg, "rope_theta": cfg["rope_parameters"]["rope_theta"]}))
    _llama_metadata(w, meta)
    return w, cfg, load_file(str(folder / "model.safetensors"))


def _close(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _moe_gguf(path, folder, arch: str, experts: int, bad_experts: bool = False) -> dict[str, torch.Tensor]:
    """The tiny folder as a GGUF file: its experts stacked per layer as Q8_0 3-D tensors (the
    down projections Q4_0 on Mixtral: a layer's kinds may differ), the
    rest F32, q/k permuted for Mixtral (llama); returns the experts' dequantized values under
    the folder's names (what the file stands for)."""
    import numpy as np
    from gguf import GGMLQuantizationType as QT
    from gguf import quants

    from tests.test_quant import _llama_permute

    w, cfg, state = _gguf_writer(path, folder, _GGUF_ARCH[arch])
    if arch == "Qwen3MoeForCausalLM":
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch != "MixtralForCausalLM":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "Qwen2MoeForCausalLM":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    stacks: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    meant: dict[str, torch.Tensor] = {}
    for hf, tensor in state.items():
        arr = tensor.float().numpy()
        if hf in _TOP:
            w.add_tensor(_TOP[hf], arr)
            continue
        layer, rest = hf.removeprefix("model.layers.").split(".", 1)
        rest = rest.replace("block_sparse_moe.", "mlp.")
        if ".experts." in rest:
            j, part = rest.split(".experts.")[1].split(".")[:2]
            stacks.setdefault((layer, _EXPERT_PARTS[part]), {})[int(j)] = arr
            continue
        module, _, suffix = rest.rpartition(".")
        if module.endswith(("q_proj", "k_proj")) and arch == "MixtralForCausalLM":
            heads = cfg["num_attention_heads"] if "q_proj" in module else cfg["num_key_value_heads"]
            arr = _llama_permute(arr, heads)
        if module == "mlp.shared_expert_gate":
            arr = arr.reshape(-1)
        w.add_tensor(f"blk.{layer}.{_PARTS[module]}.{suffix}", arr)
    names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    for (layer, kind), by_expert in stacks.items():
        stacked = np.stack([by_expert[j] for j in sorted(by_expert)][: experts - 1 if bad_experts else None])
        qt = QT.Q4_0 if arch == "MixtralForCausalLM" and kind == "down" else QT.Q8_0
        raw = quants.quantize(stacked, qt)
        back = quants.dequantize(raw, qt).reshape(stacked.shape)
        for j in range(back.shape[0]):
            meant[f"model.layers.{layer}.mlp.experts.{j}.{names[kind]}.weight"] = torch.from_numpy(back[j].copy())
        w.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight", raw, raw_dtype=qt)
    _close(w)
    return meant


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_a_moe_gguf_with_3d_expert_tensors_computes_what_its_weights_do(arch, tiny_moe_models, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    from radixserve.models.loader import load_model
    from tests.helpers import forward_prompt

    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    folder = tiny_moe_models[arch]
    cfg = json.loads((folder / "config.json").read_text())
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    meant = _moe_gguf(tmp_path / "moe.gguf", folder, arch, experts)
    loaded = load_model(str(tmp_path / "moe.gguf"), torch.float32, torch.device("cpu"), "auto")
    routed = [m for m in loaded.model.modules() if isinstance(m, MoE)]
    assert routed and all(isinstance(m.experts[0].gate_up_proj, QuantLinear) for m in routed)  # served from the blocks
    set_activations(loaded.model, "int16")  # exact to rounding (8-bit activations: bench quality measures them)
    assert (loaded.arch.architecture, loaded.arch.num_experts, loaded.arch.moe_layers) == (
        arch, experts, ArchConfig.from_hf(cfg).moe_layers)
    # the folder with the experts' dequantized values: what transformers would compute from the file
    ref = tmp_path / "ref"
    shutil.copytree(folder, ref)
    state = load_file(str(folder / "model.safetensors"))
    for name, value in meant.items():
        key = name if name in state else name.replace(".mlp.", ".block_sparse_moe.").replace(
            "gate_proj", "w1").replace("up_proj", "w3").replace("down_proj", "w2")
        assert key in state
        state[key] = value
    save_file(state, ref / "model.safetensors", metadata={"format": "pt"})
    theirs, greedy = hf_logits_and_greedy(ref, IDS, GREEDY.max_new_tokens)
    ours = forward_prompt(loaded.model, IDS)
    assert (ours - theirs).abs().max().item() < 1e-4 * theirs.abs().max().item()
    with Engine(str(tmp_path / "moe.gguf"), kv_cache_tokens=1024, activations="int16", chunked_prefill_size=8) as e:
        assert e.generate([IDS], GREEDY)[0].token_ids == greedy
    with Engine(str(tmp_path / "moe.gguf"), kv_cache_tokens=1024, activations="int16", expert_parallel=2) as e:
        assert e.generate([IDS], GREEDY)[0].token_ids == greedy  # the quantized experts split over two ranks


def _gpt_oss_gguf(path, folder) -> dict[str, torch.Tensor]:
    """The tiny gpt-oss folder as llama.cpp's converter writes it: arch `gpt-oss`, YaRN in the
    rope metadata, the experts split into gate / up / down 3-D MXFP4 tensors (out, in) with
    their biases per expert beside them, sinks as attn_sinks; returns the experts' values as
    the file holds them (MXFP4-rounded), in the folder's names and layout."""
    import gguf
    from gguf import GGMLQuantizationType as QT
    from gguf import quants

    w, cfg, state = _gguf_writer(path, folder, "gpt-oss")
    rope = cfg["rope_parameters"]
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    meant: dict[str, torch.Tensor] = {}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.router": "ffn_gate_inp"}

    def mxfp4(name: str, value: torch.Tensor) -> torch.Tensor:  # (experts, out, in) -> the file's values
        raw = quants.quantize(value.float().numpy(), QT.MXFP4)
        w.add_tensor(name, raw, raw_dtype=QT.MXFP4)
        return torch.from_numpy(quants.dequantize(raw, QT.MXFP4).reshape(value.shape).copy())

    for hf, tensor in state.items():
        if hf in _TOP:
            w.add_tensor(_TOP[hf], tensor.float().numpy())
            continue
        layer, rest = hf.removeprefix("model.layers.").split(".", 1)
        blk = f"blk.{layer}"
        if rest == "self_attn.sinks":
            w.add_tensor(f"{blk}.attn_sinks.weight", tensor.float().numpy())
        elif rest == "mlp.experts.gate_up_proj":  # (experts, in, 2 out), gate and up interleaved
            t = tensor.transpose(1, 2)
            gate, up = mxfp4(f"{blk}.ffn_gate_exps.weight", t[:, 0::2]), mxfp4(f"{blk}.ffn_up_exps.weight", t[:, 1::2])
            both = torch.empty_like(t)
            both[:, 0::2], both[:, 1::2] = gate, up
            meant[hf] = both.transpose(1, 2).contiguous()
        elif rest == "mlp.experts.down_proj":  # (experts, in, out)
            meant[hf] = mxfp4(f"{blk}.ffn_down_exps.weight", tensor.transpose(1, 2)).transpose(1, 2).contiguous()
        elif rest == "mlp.experts.gate_up_proj_bias":
            w.add_tensor(f"{blk}.ffn_gate_exps.bias", tensor[:, 0::2].float().numpy().copy())
            w.add_tensor(f"{blk}.ffn_up_exps.bias", tensor[:, 1::2].float().numpy().copy())
        elif rest == "mlp.experts.down_proj_bias":
            w.add_tensor(f"{blk}.ffn_down_exps.bias", tensor.float().numpy())
        else:
            module, _, suffix = rest.rpartition(".")
            w.add_tensor(f"{blk}.{parts[module]}.{suffix}", tensor.float().numpy())
    _close(w)
    return meant


def test_a_gpt_oss_gguf_with_mxfp4_experts_computes_what_its_weights_do(ops, tiny_moe_models, tmp_path, monkeypatch):
    """gpt-oss as llama.cpp writes it: MXFP4 experts served from their blocks (quantized linears
    with the experts' biases and the clamped SwiGLU), YaRN and the alternating window from the
    metadata, the sinks: transformers' logits and greedy tokens on the same (MXFP4-rounded)
    weights, through the engine whole and in chunks."""
    from safetensors.torch import load_file, save_file

    from radixserve.models.loader import load_model
    from radixserve.models.moe import ClampedExpert
    from tests.helpers import forward_prompt

    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    folder = tiny_moe_models["GptOssForCausalLM"]
    meant = _gpt_oss_gguf(tmp_path / "gpt-oss.gguf", folder)
    loaded = load_model(str(tmp_path / "gpt-oss.gguf"), torch.float32, torch.device("cpu"), "auto")
    want = ArchConfig.from_hf(json.loads((folder / "config.json").read_text()))
    assert (loaded.arch.architecture, loaded.arch.layer_windows, loaded.arch.rope_scaling, loaded.arch.attn_sinks,
            loaded.arch.swiglu_limit) == ("GptOssForCausalLM", want.layer_windows, want.rope_scaling, True, 7.0)
    expert = loaded.model.model.layers[0].mlp.experts[0]
    assert isinstance(expert, ClampedExpert) and expert.gate_up_proj.kind == expert.down_proj.kind == "mxfp4"
    set_activations(loaded.model, "int16")
    ref = tmp_path / "ref"  # the file's weights, and its SwiGLU limit: none is written, llama.cpp's 7.0 applies
    shutil.copytree(folder, ref)
    save_file({**load_file(str(folder / "model.safetensors")), **meant}, ref / "model.safetensors", metadata={"format": "pt"})
    (ref / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()), "swiglu_limit": 7.0}))
    theirs, greedy = hf_logits_and_greedy(ref, IDS, GREEDY.max_new_tokens)
    ours = forward_prompt(loaded.model, IDS)
    assert (ours - theirs).abs().max().item() < 1e-3 * theirs.abs().max().item()
    with Engine(str(tmp_path / "gpt-oss.gguf"), kv_cache_tokens=1024, activations="int16", chunked_prefill_size=8) as e:
        assert e.generate([IDS], GREEDY)[0].token_ids == greedy


def test_gpt_oss_as_released_serves_its_mxfp4_blocks(ops, tiny_moe_models, tmp_path):
    """gpt-oss's safetensors as OpenAI released them: each layer's experts as MXFP4 blocks and
    E8M0 scales (`gate_up_proj_blocks` / `_scales`, two e2m1 codes a byte, gate and up rows
    interleaved), their biases fused: served from the blocks (quantized linears of kind mxfp4),
    with transformers' logits on the values the blocks hold; with --quantization none, those
    values in float."""
    import numpy as np
    from gguf import GGMLQuantizationType as QT
    from gguf import quants
    from safetensors.torch import load_file, save_file

    from radixserve.models.loader import load_model
    from tests.helpers import forward_prompt

    folder = tiny_moe_models["GptOssForCausalLM"]
    released, meant = {}, {}
    for name, t in load_file(str(folder / "model.safetensors")).items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            released[name] = t
            continue
        w = t.transpose(1, 2).float().numpy()  # (experts, out, in)
        raw = quants.quantize(w, QT.MXFP4).reshape(*w.shape[:2], -1, 17)  # GGUF's: byte j holds codes j, j + 16
        meant[name] = torch.from_numpy(quants.dequantize(raw.reshape(*w.shape[:2], -1), QT.MXFP4).reshape(w.shape)).transpose(1, 2)
        codes = np.concatenate([raw[..., 1:] & 0xF, raw[..., 1:] >> 4], -1)
        released[f"{name}_blocks"] = torch.from_numpy(codes[..., 0::2] | (codes[..., 1::2] << 4))  # OCP's: codes 2i, 2i + 1
        released[f"{name}_scales"] = torch.from_numpy(raw[..., 0].copy())
    for name, state in (("released", released), ("ref", {**released, **{k: v.contiguous() for k, v in meant.items()}})):
        shutil.copytree(folder, tmp_path / name)
        if name == "ref":
            state = {k: v for k, v in state.items() if not k.endswith(("_blocks", "_scales"))}
        save_file(state, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
    loaded = load_model(str(tmp_path / "released"), torch.float32, torch.device("cpu"))
    expert = loaded.model.model.layers[1].mlp.experts[3]
    assert expert.gate_up_proj.kind == expert.down_proj.kind == "mxfp4"
    set_activations(loaded.model, "int16")
    theirs, _ = hf_logits_and_greedy(tmp_path / "ref", IDS, 1)
    ours = forward_prompt(loaded.model, IDS)
    assert (ours - theirs).abs().max().item() < 1e-3 * theirs.abs().max().item()
    plain = load_model(str(tmp_path / "released"), torch.float32, torch.device("cpu"), "none")  # the blocks' values in float
    assert not any(isinstance(m, QuantLinear) for m in plain.model.modules())
    assert (forward_prompt(plain.model, IDS) - theirs).abs().max().item() < 1e-4 * theirs.abs().max().item()


def test_a_moe_gguf_whose_experts_disagree_with_its_metadata_is_refused_by_name(tiny_moe_models, tmp_path, monkeypatch):
    from radixserve.models.gguf import ModelLoadError
    from radixserve.models.loader import load_model

    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    _moe_gguf(tmp_path / "bad.gguf", tiny_moe_models["Qwen3MoeForCausalLM"], "Qwen3MoeForCausalLM", 8, bad_experts=True)
    with pytest.raises(ModelLoadError, match=r"ffn_\w+_exps.*expert_count"):
        load_model(str(tmp_path / "bad.gguf"), torch.float32, torch.device("cpu"), "auto")


@pytest.mark.parametrize("bits", ["int8", "int16"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_the_fused_decode_step_routes_and_runs_the_experts_as_layer_by_layer(ops, arch, bits, tiny_moe_models, tmp_path,
                                                                              monkeypatch):
    """A GGUF file's quantized experts in the one-call decode step: routed in the native call,
    exactly the logits of the layer-by-layer path (both run the experts in moe_experts, tested
    against the experts' own modules below), at one row and at several whose experts overlap;
    Qwen3-MoE's dense middle layer beside its routed ones. Qwen2-MoE's shared expert keeps it
    layer by layer."""
    from radixserve.models.linear import pack_linears
    from radixserve.models.loader import load_model
    from tests.helpers import fused_and_layered_logits

    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    folder = tiny_moe_models[arch]
    cfg = json.loads((folder / "config.json").read_text())
    _moe_gguf(tmp_path / "moe.gguf", folder, arch, cfg.get("num_experts") or cfg["num_local_experts"])
    model = load_model(str(tmp_path / "moe.gguf"), torch.float32, torch.device("cpu"), "auto").model.eval()
    set_activations(model, bits)
    pack_linears(model, torch.float32, torch.device("cpu"))
    if arch == "Qwen2MoeForCausalLM":
        assert not model.fuse_decode()
        return
    assert model.fuse_decode()
    for lens in ([9], [5, 17, 30, 2]):
        logits, calls = fused_and_layered_logits(model, lens)
        assert calls == 1
        assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_is_each_chosen_experts_own_modules_weighted(ops, dtype):
    """The native chosen-experts step (the fused decode step's and the layer-by-layer path's)
    against the experts' own modules called one by one: rows sharing an expert, an expert no row
    chose, a pair of another rank's expert (-1) left out, fp32 and bf16 rows."""
    from radixserve.models.layers import GatedMLP
    from tests.test_quant import gguf_blocks

    hidden, inter = 64, 32
    experts = []
    for j in range(5):
        m = GatedMLP(hidden, inter, False)
        for name, kind, n, k in (("gate_up_proj", "q4_0", 2 * inter, hidden), ("down_proj", "q8_0", hidden, inter)):
            raw, _ = gguf_blocks(kind, n, k, seed=10 * j + n)
            q = QuantLinear(n, k, kind, False, packed=ops.pack_quant(raw, kind, n, k))
            q.finish()
            q.act_bits = 16
            setattr(m, name, q)
        experts.append(m)
    x = torch.randn(4, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    chosen = torch.tensor([[0, 2], [2, -1], [0, 3], [3, 2]])  # expert 1 and 4: no row
    weights = torch.rand(4, 2, generator=torch.Generator().manual_seed(2))
    got = ops.moe_experts(x, weights, chosen, [m.gate_up_proj.packed for m in experts], [m.down_proj.packed for m in experts],
                          inter, 16)
    want = torch.zeros(4, hidden)
    for t in range(4):
        for k in range(2):
            if chosen[t, k] >= 0:
                want[t] += weights[t, k] * experts[int(chosen[t, k])](x[t:t + 1].float())[0]
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("bits", [8, 16])
def test_qlinear_many_is_each_qlinear(ops, bits):
    """Jobs of every kind family, of 1 and 3 rows and of no row, in one call: each one's output is
    qlinear's on it, to the bit (the same integer sums, the same order)."""
    from tests.test_quant import gguf_blocks

    jobs = [("q4_k", 48, 512, 1), ("q6_k", 32, 256, 3), ("q8_0", 40, 96, 1), ("q4_0", 16, 64, 3), ("q5_0", 24, 128, 0)]
    xs, packed, ns = [], [], []
    for i, (kind, n, k, m) in enumerate(jobs):
        raw, _ = gguf_blocks(kind, n, k, seed=i)
        packed.append(ops.pack_quant(raw, kind, n, k))
        xs.append(torch.randn(m, k, generator=torch.Generator().manual_seed(i)))
        ns.append(n)
    ys = ops.qlinear_many(xs, packed, ns, bits)
    for x, w, n, y in zip(xs, packed, ns, ys):
        assert torch.equal(y, ops.qlinear(x, w, n, None, True, False, bits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 16])
def test_qlinear_parts_is_each_qlinear_side_by_side(ops, dtype, bits):
    """Parts of every kind family, widths off the 16-output panel, with and without a bias, in one
    call: its columns are each part's qlinear, to the bit, at 1 to 130 rows (two passes of rows);
    a part of another input width is refused."""
    from tests.test_quant import gguf_blocks

    k = 256
    parts = [("q4_k", 40, True), ("q6_k", 32, False), ("q8_0", 16, True), ("q4_1", 24, False), ("q5_0", 70, True)]
    packed, ns, biases = [], [], []
    for i, (kind, n, has_bias) in enumerate(parts):
        raw, _ = gguf_blocks(kind, n, k, seed=i)
        packed.append(ops.pack_quant(raw, kind, n, k))
        ns.append(n)
        biases.append(torch.randn(n, generator=torch.Generator().manual_seed(10 + i)) if has_bias else None)
    for rows in (1, 2, 5, 33, 130):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        y = ops.qlinear_parts(x, packed, ns, biases, bits)
        assert y.dtype == dtype and y.shape == (rows, sum(ns))
        want = torch.cat([ops.qlinear(x, w, n, b, False, False, bits) for w, n, b in zip(packed, ns, biases)], dim=-1)
        assert torch.equal(y, want), rows
    raw, _ = gguf_blocks("q4_k", 16, 512, seed=9)
    with pytest.raises(RuntimeError, match="packed by pack_quant for this n and k"):
        ops.qlinear_parts(torch.randn(1, k), [packed[0], ops.pack_quant(raw, "q4_k", 16, 512)], [40, 16], [None, None], 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_split_linear_runs_its_parts_in_one_call_as_each_part_computes(ops, dtype):
    """q/k in Q4_K beside v in Q6_K with a bias (a Q4_K_M file's Qwen2 attention): one
    qlinear_parts, equal to each part's own call, concatenated."""
    from radixserve.models.quant import SplitQuantLinear
    from tests.test_quant import gguf_blocks

    parts = []
    for i, (kind, n) in enumerate([("q4_k", 64), ("q4_k", 32), ("q6_k", 32)]):
        raw, _ = gguf_blocks(kind, n, 256, seed=i)
        parts.append(QuantLinear(n, 256, kind, False, packed=ops.pack_quant(raw, kind, n, 256)))
    split = SplitQuantLinear(parts, True)
    with torch.no_grad():
        split.bias.copy_(torch.randn(128))
    split.finish()
    for q in parts:
        q.finish()
    assert split.bias_in_parts
    for rows in (1, 3, 80):
        x = torch.randn(rows, 256).to(dtype)
        assert torch.equal(split(x), torch.cat([p(x) for p in parts], dim=-1)), rows


def test_quantizing_a_moe_folder_leaves_its_routers_float(tiny_moe_models):
    """--quantization int8 on a Hugging Face MoE folder: the attention's linears become
    quantized, the routers (and the shared expert's gate) stay float, as llama.cpp keeps them."""
    from radixserve.models.loader import load_model

    model = load_model(str(tiny_moe_models["Qwen2MoeForCausalLM"]), torch.float32, torch.device("cpu"), "int8").model
    moe = model.model.layers[0].mlp
    assert isinstance(model.model.layers[0].self_attn.o_proj, QuantLinear)
    assert not isinstance(moe.gate, QuantLinear) and not isinstance(moe.shared_expert_gate, QuantLinear)
