"""Multi-LoRA: PEFT adapters over the tiny Llama, against PEFT itself (the logits of a prompt
through each adapter equal PEFT's; a batch mixing adapters and the base equals each alone),
over float and int8 weights; the prefix cache namespaced by adapter; a served model choosing its
adapter by `model`, vLLM's load/unload endpoints under traffic, and bad adapters refused by name."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from radixserve import Engine, SamplingParams

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = list(range(3, 40))


def _peft_model(base_path: Path, adapter: Path | None = None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32).eval()
    return base if adapter is None else PeftModel.from_pretrained(base, str(adapter)).eval()


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    """"a": every linear, r=4; "b": q and v, r=8, rsLoRA; "big": r=16 (over a cap of 8)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    specs = {"a": dict(r=4, lora_alpha=8, target_modules=ALL),
             "b": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], use_rslora=True),
             "big": dict(r=16, lora_alpha=16, target_modules=["q_proj"])}
    out = {}
    for i, (name, spec) in enumerate(specs.items()):
        torch.manual_seed(10 + i)
        base = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
        get_peft_model(base, LoraConfig(init_lora_weights=False, **spec)).save_pretrained(str(root / name))
        out[name] = root / name
    return out


@torch.inference_mode()
def _logits(model, seqs: list[tuple[object, list[int]]]) -> list[torch.Tensor]:
    """Our model's logits for each (adapter or None, prompt), all in one forward batch."""
    from radixserve.attention import create_backend
    from radixserve.batch import ForwardBatch
    from radixserve.cache.pool import KVPool
    from radixserve.request import Req
    from radixserve.sched.scheduler import PlanItem, SchedulePlan

    a, total = model.cfg, sum(len(ids) for _, ids in seqs)
    pool = KVPool(a.num_layers, total, a.num_kv_heads, a.head_dim, torch.float32, torch.device("cpu"))
    backend = create_backend("torch", pool, torch.device("cpu"))
    items, slots, at = [], {}, 0
    for adapter, ids in seqs:
        req = Req(ids, SamplingParams())
        req.adapter = adapter
        items.append(PlanItem(req, 0, len(ids)))
        slots[req.rid], at = list(range(at, at + len(ids))), at + len(ids)
    batch = ForwardBatch.from_plan(SchedulePlan(items), lambda r: slots[r.rid], backend, torch.device("cpu"))
    out = model.compute_logits(model(batch))
    return list(out.split([len(ids) for _, ids in seqs]))


def _loaded(tiny_llama, adapters, quantization: str = "none", lora_dtype: torch.dtype = torch.float32):
    from radixserve.engine.lora import LoRAManager
    from radixserve.models.loader import load_model

    model = load_model(str(tiny_llama), torch.float32, torch.device("cpu"), quantization).model
    manager = LoRAManager(model, model.cfg, lora_dtype, torch.device("cpu"), 4, 8, "base")
    for name in ("a", "b"):
        manager.load(name, str(adapters[name]))
    return model, manager


def test_each_adapters_logits_equal_pefts_and_a_mixed_batch_equals_each_alone(tiny_llama, adapters):
    with torch.inference_mode():
        ref = {name: _peft_model(tiny_llama, adapters[name])(torch.tensor([PROMPT])).logits[0] for name in ("a", "b")}
        ref[None] = _peft_model(tiny_llama)(torch.tensor([PROMPT])).logits[0]
    model, m = _loaded(tiny_llama, adapters)
    a, b = m.get("a"), m.get("b")
    for name, adapter in (("a", a), ("b", b), (None, None)):
        (alone,) = _logits(model, [(adapter, PROMPT)])
        assert torch.allclose(alone, ref[name], atol=1e-4), (name, (alone - ref[name]).abs().max())
    assert (ref["a"] - ref[None]).abs().max() > 0.1 and (ref["b"] - ref[None]).abs().max() > 0.1  # they matter
    short = PROMPT[:9]
    mixed = _logits(model, [(a, PROMPT), (None, PROMPT), (b, short), (a, short), (None, short)])  # a's rows: two runs
    for (name, ids), got in zip([("a", PROMPT), (None, PROMPT), ("b", short), ("a", short), (None, short)], mixed):
        assert torch.allclose(got, ref[name][: len(ids)], atol=1e-4), (name, len(ids))


def test_adapters_over_int8_weights_add_pefts_delta(tiny_llama, adapters):
    """Over quantized base weights the adapter (in bf16 there: --lora-dtype auto) adds the delta
    PEFT's adds over the float ones (to int8's error: the hidden states drift by it), and a mixed
    batch still equals each alone."""
    with torch.inference_mode():
        ref_a = _peft_model(tiny_llama, adapters["a"])(torch.tensor([PROMPT])).logits[0]
        ref_base = _peft_model(tiny_llama)(torch.tensor([PROMPT])).logits[0]
    model, m = _loaded(tiny_llama, adapters, "int8", torch.bfloat16)
    assert m.get("a").linears[(0, "qkv_proj")].a.dtype == torch.bfloat16
    base, lora = _logits(model, [(None, PROMPT), (m.get("a"), PROMPT)])
    want = ref_a - ref_base
    assert torch.nn.functional.cosine_similarity((lora - base).flatten(), want.flatten(), dim=0) > 0.99
    assert (lora - ref_a).abs().max() < 2 * (base - ref_base).abs().max()  # no more off than int8 makes the base
    (alone,) = _logits(model, [(m.get("a"), PROMPT)])
    assert torch.allclose(alone, lora, atol=1e-4)


def test_the_fused_decode_step_adds_the_deltas_as_the_per_layer_path_does(tiny_llama, adapters):
    """A decode step whose rows mix two adapters (bf16 weights, as over quantized weights) and the
    base runs all layers in one native call, each linear's deltas added inside it by the same
    kernel as layer by layer: the same logits bit for bit."""
    from tests.helpers import fused_and_layered_logits

    model, m = _loaded(tiny_llama, adapters, "int8", torch.bfloat16)
    assert model.fuse_decode()
    a, b = m.get("a"), m.get("b")
    (fused, layered), calls = fused_and_layered_logits(model, [5, 9, 17, 30], [a, None, b, a])
    assert calls == 1 and torch.equal(fused, layered)
    (base, _), _ = fused_and_layered_logits(model, [5, 9, 17, 30])
    assert torch.equal(fused[1], base[1]) and not torch.allclose(fused[0], base[0])


def test_lora_dtype_auto_is_the_models_or_bf16_over_quantized_weights_on_a_cpu():
    """vLLM's --lora-dtype auto is the model's dtype; ours too, except over quantized weights on a
    CPU (fp32 activations there), where bf16 halves the bytes a decode step reads."""
    from types import SimpleNamespace

    def chosen(choice, quantization, device="cpu", dtype=torch.float32):
        stub = SimpleNamespace(config=SimpleNamespace(model=SimpleNamespace(lora_dtype=choice)), quantization=quantization,
                               device=torch.device(device), dtype=dtype)
        return Engine.lora_dtype(stub)  # type: ignore[arg-type]

    assert chosen("auto", "none") == torch.float32 and chosen("auto", "none", dtype=torch.bfloat16) == torch.bfloat16
    assert chosen("auto", "q4_k+q6_k") == torch.bfloat16 and chosen("auto", "q8_0", "cuda", torch.float16) == torch.float16
    assert chosen("float32", "q4_k") == torch.float32 and chosen("bfloat16", "none") == torch.bfloat16


def test_bad_adapters_are_refused_by_name(tiny_llama, adapters, tmp_path):
    from radixserve.models.lora import AdapterError

    model, m = _loaded(tiny_llama, adapters)
    cases = {"missing": (tmp_path / "nowhere", "not a folder"), "big": (adapters["big"], "max_lora_rank")}
    broken = tmp_path / "shapes"
    shutil.copytree(adapters["a"], broken)
    from safetensors.torch import load_file, save_file

    t = load_file(str(broken / "adapter_model.safetensors"))
    key = next(k for k in t if "q_proj.lora_A" in k)
    t[key] = torch.zeros(4, 7)
    save_file(t, str(broken / "adapter_model.safetensors"))
    cases["shapes"] = (broken, r"expected \(4, ")
    dora = tmp_path / "dora"
    shutil.copytree(adapters["a"], dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    cases["dora"] = (dora, "use_dora")
    for name, (path, why) in cases.items():
        with pytest.raises(AdapterError, match=why):
            m.load(name, str(path))
    with pytest.raises(AdapterError, match="already loaded"):
        m.load("a", str(adapters["a"]))
    with pytest.raises(AdapterError, match="lora_name"):
        m.load("base", str(adapters["a"]))
    assert sorted(x["name"] for x in m.describe()) == ["a", "b"]


def test_an_adapters_kv_never_serves_another_or_the_base_and_evicted_adapters_come_back(tiny_llama, adapters):
    from server_helpers import final_outputs

    with Engine(str(tiny_llama), dtype="float32", kv_cache_tokens=4096, lora_modules=(f"a={adapters['a']}",),
                max_loras=1, max_lora_rank=8) as e:
        e.load_lora("b", str(adapters["b"]))

        def run(lora):
            req = e.make_req(PROMPT, SamplingParams(max_new_tokens=6, temperature=0.0), lora=lora)
            (out,) = asyncio.run(final_outputs(e, [req]))
            return out

        first = {name: run(name) for name in (None, "a", "b")}
        assert [first[n].cached_tokens for n in (None, "a", "b")] == [0, 0, 0]  # three namespaces
        again = {name: run(name) for name in ("a", "b", None)}  # max_loras=1: each read again from its folder
        assert all(again[n].cached_tokens > 0 and again[n].token_ids == first[n].token_ids for n in again)
        assert e.lora is not None and e.lora.evictions >= 3 and e.lora.loads >= 4
        model = _peft_model(tiny_llama, adapters["a"])
        x = torch.tensor([PROMPT])
        greedy = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                pad_token_id=0)[0, len(PROMPT):].tolist()
        assert first["a"].token_ids == greedy
        e.unload_lora("b")
        with pytest.raises(ValueError, match="no adapter named 'b'"):
            run("b")
        e.check_integrity()


TENANTS = """
[[tenants]]
id = "ops"
api_key = "key-ops"
admin = true

[[tenants]]
id = "app"
api_key = "key-app"
"""


def test_served_adapters_by_model_name_and_vllms_endpoints_under_traffic(tiny_llama, adapters, tmp_path):
    import openai
    from server_helpers import ServerProcess

    (tmp_path / "tenants.toml").write_text(TENANTS)
    s = ServerProcess(tiny_llama, "--dtype", "float32", "--kv-cache-tokens", "4096", "--lora-modules", f"a={adapters['a']}",
                      "--max-lora-rank", "8", "--tenants", str(tmp_path / "tenants.toml"), log=tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="key-app", max_retries=0)
        models = {m.id: m for m in client.models.list().data}
        base = next(n for n in models if n != "a")
        assert set(models) == {base, "a"} and models["a"].model_extra["parent"] == base
        ask = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 5, "temperature": 0}
        plain = client.chat.completions.create(model=base, **ask)
        tuned = client.chat.completions.create(model="a", **ask)
        assert plain.choices[0].message.content != tuned.choices[0].message.content
        assert (plain.model, tuned.model) == (base, "a")  # the answer names the adapter that gave it
        status, body = s.post("/v1/chat/completions", {**ask, "model": "nope"}, "key-app")
        assert status == 404 and body["error"]["param"] == "model"
        for name, code in (("nope", 404), ("", 400)):
            status, body = s.post("/generate", {"text": "Hi", "lora_path": name}, "key-app")
            assert status == code and body["error"]["param"] == "lora_path", body

        load = {"lora_name": "b", "lora_path": str(adapters["b"])}
        assert s.post("/v1/load_lora_adapter", load, "key-app")[0] == 403  # admins only
        for bad, param, why in (({"lora_name": "c", "lora_path": str(tmp_path / "none")}, "lora_path", "not a folder"),
                                ({"lora_name": "c", "lora_path": str(adapters["big"])}, "lora_path", "max_lora_rank"),
                                ({"lora_name": "a", "lora_path": str(adapters["b"])}, "lora_name", "already"),
                                ({"lora_name": ""}, "lora_path", "")):
            status, body = s.post("/v1/load_lora_adapter", bad, "key-ops")
            assert status == 400 and body["error"]["param"] == param and why in body["error"]["message"], body

        def traffic(i: int) -> int:  # requests on "a" while "b" comes and goes
            return s.post("/v1/chat/completions", {**ask, "model": "a"}, "key-app")[0]

        with ThreadPoolExecutor(4) as pool:
            running = [pool.submit(traffic, i) for i in range(16)]
            for _ in range(3):
                assert s.post("/v1/load_lora_adapter", load, "key-ops")[0] == 200
                status, body = s.post("/generate", {"text": "Hi", "lora_path": "b", "sampling_params": {"max_new_tokens": 3}},
                                      "key-app")
                assert status == 200, body
                assert s.post("/v1/unload_lora_adapter", {"lora_name": "b"}, "key-ops")[0] == 200
            assert [f.result() for f in running] == [200] * 16
        status, body = s.post("/v1/unload_lora_adapter", {"lora_name": "b"}, "key-ops")
        assert status == 404 and body["error"]["param"] == "lora_name"
        assert s.post("/v1/chat/completions", {**ask, "model": "b"}, "key-app")[0] == 404
        assert s.wait_idle("key-ops")["kv_in_use_slots"] == 0
        assert s.get("/server_info?check_integrity=1", "key-ops")[0] == 200
    finally:
        s.stop()


def test_the_three_ways_of_adding_the_deltas_agree(tiny_llama, adapters, monkeypatch):
    """models.lora.apply over one linear: the native kernel (a batch of decodes), the torch path
    (a prefill chunk's rows) and the Triton kernel (in the interpreter), rows scattered over two
    adapters and the base."""
    from radixserve.batch import LoRARows
    from radixserve.models import lora
    from radixserve_kernels import lora as kernels_lora

    model, m = _loaded(tiny_llama, adapters)
    a, b = m.get("a"), m.get("b")
    rows = LoRARows.of([(a, 0, 2), (None, 2, 1), (b, 3, 2), (a, 5, 1)], torch.device("cpu"))
    assert rows is not None and rows.start is None  # scattered: gathered and scattered back
    g = torch.Generator().manual_seed(1)
    q = model.cfg.num_heads * model.cfg.head_dim + 2 * model.cfg.num_kv_heads * model.cfg.head_dim
    x, y = torch.randn(6, model.cfg.hidden_size, generator=g), torch.randn(6, q, generator=g)
    native = lora.apply(rows, x, y.clone(), (0, "qkv_proj"))
    monkeypatch.setattr(kernels_lora, "NATIVE_MAX_ROWS", 0)
    torch_path = lora.apply(rows, x, y.clone(), (0, "qkv_proj"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton_path = lora.apply(rows, x, y.clone(), (0, "qkv_proj"))
    assert torch.allclose(native, torch_path, atol=1e-5) and torch.allclose(triton_path, torch_path, atol=1e-4)
    assert torch.equal(native[2], y[2]) and not torch.allclose(native[0], y[0])


def test_a_disaggregated_prompt_is_computed_with_its_adapter_and_an_unknown_one_ends_naming_model(tiny_llama, adapters):
    """--disaggregate: the prefill replica computes an adapter's prompt with the adapter (its
    pages then serve the decode replica's adapter namespace): the answer is the in-process
    engine's. A request naming an adapter no replica holds ends with an error naming `model`."""
    from server_helpers import final_outputs

    from radixserve.config import RouterConfig
    from radixserve.engine.data_parallel import DataParallelEngine

    prompt = PROMPT * 4  # past disaggregate_min_tokens
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    opts = dict(dtype="float32", kv_cache_tokens=4096, grammar_compile_workers=1, lora_modules=(f"a={adapters['a']}",),
                max_lora_rank=8)
    with Engine(str(tiny_llama), **opts) as e:
        want = asyncio.run(final_outputs(e, [e.make_req(prompt, greedy, lora="a")]))[0].token_ids
    with DataParallelEngine(str(tiny_llama), RouterConfig(disaggregate=True, disaggregate_min_tokens=16), **opts) as dp:
        out, ghost = asyncio.run(final_outputs(dp, [dp.make_req(prompt, greedy, lora="a"),
                                                    dp.make_req(prompt, greedy, lora="ghost")]))
        stats = [r.engine.stats() for r in dp.replicas]
    assert out.token_ids == want and stats[0].kv_exported_tokens > 0  # prefilled on the prefill replica
    assert ghost.finish_reason == "error" and ghost.error_field == "model" and "ghost" in (ghost.error or "")


def test_kv_events_name_the_adapter_whose_blocks_they_are(tiny_llama, adapters):
    """Blocks cached for an adapter's request carry its lora_name and lora_id (its number, in load
    order) in BlockStored, read by a subscriber built from vLLM's types; the base model's carry
    none, and the same tokens cached for both never share a hash."""
    from server_helpers import free_port
    from test_kv_events import Subscriber

    pub, replay = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
              "topic": "kv-events", "block_size": 4}
    sub = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    try:
        with Engine(str(tiny_llama), kv_cache_tokens=1024, lora_modules=(f"a={adapters['a']}", f"b={adapters['b']}"),
                    kv_events_config=json.dumps(config)) as engine:
            time.sleep(0.5)  # (the subscription reaches the publisher)
            params = SamplingParams(temperature=0, max_new_tokens=2)
            for lora in (None, "b"):
                async def run(lora=lora):
                    async for _ in engine.submit(engine.make_req(PROMPT, params, lora=lora)):
                        pass
                asyncio.run(run())
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and sub.view.last + 1 < engine.stats().kv_events_batches:
                sub.pump(0.2)
        stored = [e for raw in sub.raw for e in sub.decode(raw).events if type(e).__name__ == "BlockStored"]
        by = {lora: {h for e in stored if (e.lora_name, e.lora_id) == lora for h in e.block_hashes}
              for lora in {(e.lora_name, e.lora_id) for e in stored}}
        assert set(by) == {(None, None), ("b", 2)}, set(by)
        assert len(by["b", 2]) >= len(PROMPT) // 4 and not by["b", 2] & by[None, None]
    finally:
        sub.close()


def test_bench_lora_peer_sends_llama_servers_lora_field_and_counts_its_tokens():
    """--peer: the same prompts to llama-server's /completion, the base with no adapter applied
    ("lora": []) and the mixed run round robin over the adapters by id, prompt caching off."""
    import argparse
    import threading

    from aiohttp import web

    from radixserve.bench.lora import measure_peer

    seen: list[dict] = []

    async def completion(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        return web.json_response({"content": "x", "tokens_predicted": body["n_predict"]})

    app = web.Application()
    app.router.add_post("/completion", completion)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        args = argparse.Namespace(num_requests=6, prompt_len=10, output_len=7, seed=0)
        r = measure_peer(f"http://127.0.0.1:{port}", 3, 1000, args)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
        loop.run_until_complete(runner.cleanup())
        loop.close()
    assert r["lora"]["output_tokens"] == 6 * 7 and all(b["output_tokens"] == 42 for b in r["base"])
    mixed = [b for b in seen if b["lora"]]
    assert [b["lora"] for b in mixed[-6:]] == [[{"id": i % 3, "scale": 1.0}] for i in range(6)]
    assert len(seen) - len(mixed) == 2 + 12 and all(not b["cache_prompt"] and b["ignore_eos"] for b in seen)
    assert all(9 <= len(b["prompt"]) <= 11 and max(b["prompt"]) < 1000 for b in seen)
