"""`radixserve bench lora`: output tokens/s of `--num-requests` concurrent requests on the base
model alone against the same requests spread over `--adapters` LoRA adapters (round robin), one
engine, in one run (base, adapters, base again: the ratio is taken against the mean of the two
base runs). The adapters are PEFT folders made here with random weights (rank `--rank` on every
decoder linear) unless `--adapter-dir` holds some already (its subfolders).

`--peer URL`: then the same prompts, the same way, against llama.cpp's llama-server serving the
same adapters: each converted to GGUF by its `convert_lora_to_gguf.py --base <the base model's
config folder>` and given as `--lora FILE` in the sorted order of `--adapter-dir`'s subfolders,
with `--lora-init-without-apply` (a request picks its adapter: `"lora": [{"id": i, "scale": 1}]`;
none listed: the base). Run after ours, the engine shut down; prompt caching off on both."""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from radixserve.bench.offline import make_prompts
from radixserve.cli_args import add_engine_args, engine_kwargs

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapter-dir", default=None, help="PEFT adapter folders to use (its subfolders) instead of random ones")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.add_argument("--peer", default=None, help="a llama-server URL serving --adapter-dir's adapters as GGUF (see above)")


def make_adapter(arch: Any, folder: Path, rank: int, seed: int, scale: float = 0.02) -> Path:
    """A PEFT LoRA folder with random A and B (not B = 0, so it changes the model) on every linear."""
    import torch
    from safetensors.torch import save_file

    from radixserve.models.lora import part_shapes

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for module, (fan_in, fan_out, _) in part_shapes(arch).items():
            kind = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * scale
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                            "target_modules": list(TARGETS), "bias": "none"}))
    return folder


async def _run(engine: Any, prompts: list[list[int]], loras: Sequence[str | None], out_len: int) -> dict[str, float]:
    from radixserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=out_len, ignore_eos=True)
    engine.flush_cache()
    reqs = [engine.make_req(p, params, lora=lora) for p, lora in zip(prompts, loras)]

    async def one(req: Any) -> int:
        n = 0
        async for d in engine.submit(req):
            n += len(d.token_ids)
        return n

    t = time.perf_counter()
    n = sum(await asyncio.gather(*(one(r) for r in reqs)))
    dt = time.perf_counter() - t
    return {"output_tokens": n, "seconds": dt, "output_tokens_per_s": n / dt}


def measure(engine: Any, names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    return _base_lora_base(lambda p, loras, n: _run(engine, p, loras, n), names, engine.vocab_size, args)


def _base_lora_base(run: Callable[[list[list[int]], Sequence[Any], int], Coroutine[Any, Any, dict[str, float]]],
                    adapters: Sequence[Any], vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    """Warm both paths, then the base, the adapters round robin, the base again (`run`: one
    server's requests, all at once, each with its adapter or None)."""
    prompts = make_prompts(args.num_requests, args.prompt_len, vocab, args.seed)
    spread = [adapters[i % len(adapters)] for i in range(len(prompts))]
    asyncio.run(run(prompts[:2], spread[:2], 4))  # warm-up: both paths
    asyncio.run(run(prompts[:2], [None, None], 4))
    base1 = asyncio.run(run(prompts, [None] * len(prompts), args.output_len))
    lora = asyncio.run(run(prompts, spread, args.output_len))
    base2 = asyncio.run(run(prompts, [None] * len(prompts), args.output_len))
    base = (base1["output_tokens_per_s"] + base2["output_tokens_per_s"]) / 2
    return {"base": [base1, base2], "lora": lora, "adapters": len(adapters), "ratio": lora["output_tokens_per_s"] / base}


async def _peer_run(url: str, prompts: list[list[int]], loras: Sequence[int | None], out_len: int) -> dict[str, float]:
    """llama-server's /completion, all requests at once; its prompt cache off (ours is flushed)."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def one(prompt: list[int], lora: int | None) -> int:
            body = {"prompt": prompt, "n_predict": out_len, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
                    "lora": [] if lora is None else [{"id": lora, "scale": 1.0}]}
            async with session.post(url.rstrip("/") + "/completion", json=body) as r:
                data = await r.json(content_type=None)
                if r.status != 200:
                    raise RuntimeError(f"--peer: /completion answered {r.status}: {str(data)[:300]}")
                return int(data["tokens_predicted"])

        t = time.perf_counter()
        n = sum(await asyncio.gather(*(one(p, lora) for p, lora in zip(prompts, loras))))
        dt = time.perf_counter() - t
    return {"output_tokens": n, "seconds": dt, "output_tokens_per_s": n / dt}


def measure_peer(url: str, adapters: int, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    return _base_lora_base(lambda p, loras, n: _peer_run(url, p, loras, n), list(range(adapters)), vocab, args)


def _print(title: str, r: dict[str, Any]) -> None:
    print(title)
    for label, x in (("base", r["base"][0]), ("adapters, mixed", r["lora"]), ("base again", r["base"][1])):
        print(f"  {label:<18}{x['output_tokens_per_s']:>9.1f} tok/s  ({x['output_tokens']} tokens in {x['seconds']:.1f} s)")
    print(f"  adapters / base: {r['ratio']:.2f}x")


def run(args: argparse.Namespace) -> int:
    """In an engine process, as `radixserve serve` runs it (its loop on that process's main thread)."""
    from radixserve.engine.process import EngineProcess
    from radixserve.models.loader import model_arch

    if args.peer and not args.adapter_dir:
        raise SystemExit("--peer: give --adapter-dir too (the peer must serve the same adapters, converted to GGUF)")
    kwargs = {**engine_kwargs(args), "enable_lora": True, "max_loras": max(args.adapters, 1),
              "max_lora_rank": max(args.rank, 1)}
    with tempfile.TemporaryDirectory(prefix="rs-lora-") as tmp:
        if args.adapter_dir:
            folders = sorted(p for p in Path(args.adapter_dir).iterdir() if (p / "adapter_config.json").exists())
        else:
            arch = model_arch(args.model, kwargs.get("quantization") or "auto")
            folders = [make_adapter(arch, Path(tmp) / f"adapter-{i}", args.rank, args.seed + i) for i in range(args.adapters)]
        names = [f"adapter-{i}" for i in range(len(folders))]
        engine = EngineProcess(args.model, **kwargs)
        try:
            for name, folder in zip(names, folders):
                engine.load_lora(name, str(folder))
            r = measure(engine, names, args)
            vocab = engine.vocab_size
        finally:
            engine.shutdown()
    if args.peer:
        r["peer"] = measure_peer(args.peer, len(names), vocab, args)
    print(f"{args.num_requests} requests x {args.output_len} tokens ({args.prompt_len}-token prompts), "
          f"{len(names)} adapters" + ("" if args.adapter_dir else f" of rank {args.rank} on every linear"))
    _print("radixserve", r)
    if "peer" in r:
        _print(f"peer ({args.peer})", r["peer"])
        mixed = r["lora"]["output_tokens_per_s"] / r["peer"]["lora"]["output_tokens_per_s"]
        print(f"  mixed adapters, radixserve / peer: {mixed:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**r, "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, type(None)))}},
                      f, indent=2)
    return 0
