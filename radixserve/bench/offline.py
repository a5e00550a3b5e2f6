"""`radixserve bench offline`: output tokens/s of our engine against Hugging Face `generate`
(a) one request at a time, as a web server calling generate() in a loop would, and (b) in
padded static batches, all in the same process run, on the same prompts and weights."""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from typing import Any

from radixserve.cli_args import add_engine_args, engine_kwargs


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=200, help="mean prompt length (tokens, +-10%%)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-sequential-requests", type=int, default=4,
                   help="requests timed for the one-at-a-time baseline (its rate does not depend on the count)")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures to this file")


def make_prompts(n: int, mean_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo, hi = int(mean_len * 0.9), int(mean_len * 1.1)
    return [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def bench_engine(engine: Any, prompts: list[list[int]], out_len: int) -> dict[str, float]:
    from radixserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=out_len, ignore_eos=True)
    engine.generate([prompts[0][:16]], SamplingParams(temperature=0.0, max_new_tokens=4))  # warm-up
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t
    n = sum(o.completion_tokens for o in outs)
    return {"requests": len(prompts), "output_tokens": n, "seconds": dt, "output_tokens_per_s": n / dt}


def bench_hf(model_path: str, prompts: list[list[int]], out_len: int, batch: int, pad_id: int, device: Any = "cpu",
             dtype: Any = None) -> dict[str, float]:
    """Hugging Face `generate` on the engine's device and dtype (default: CPU, fp32). Runs on a
    fresh thread with flush-to-zero on, as our engine thread runs, so that neither side pays
    for denormal arithmetic the other avoids."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = _bench_hf(model_path, prompts, out_len, batch, pad_id, device, dtype)
        except BaseException as e:  # re-raised on the caller's thread
            box["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def _bench_hf(model_path: str, prompts: list[list[int]], out_len: int, batch: int, pad_id: int, device: Any,
              dtype: Any) -> dict[str, float]:
    import torch

    torch.set_flush_denormal(True)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype or torch.float32).to(device).eval()
    kw = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=pad_id)
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][:16]], device=device), max_new_tokens=4, do_sample=False, pad_token_id=pad_id)
        t = time.perf_counter()
        n = 0
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], device=device)  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
            out = model.generate(input_ids=ids, attention_mask=mask, **kw)
            n += (out.shape[1] - width) * len(chunk)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
    return {"requests": len(prompts), "output_tokens": n, "seconds": dt, "output_tokens_per_s": n / dt}


def run(args: argparse.Namespace) -> int:
    from radixserve import Engine

    with Engine(args.model, **engine_kwargs(args)) as engine:
        prompts = make_prompts(args.num_requests, args.prompt_len, engine.vocab_size, args.seed)
        results = {"radixserve": bench_engine(engine, prompts, args.output_len)}
        model_path, pad_id, on = str(engine.model_path), engine.tokenizer.pad_token_id or 0, (engine.device, engine.dtype)
    if not args.skip_hf:
        results["hf_static_batch"] = bench_hf(model_path, prompts, args.output_len, args.hf_batch_size, pad_id, *on)
        seq = prompts[: args.hf_sequential_requests]
        results["hf_sequential"] = bench_hf(model_path, seq, args.output_len, 1, pad_id, *on)
    print_table(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def print_table(results: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    print(f"\noffline throughput: {args.num_requests} requests, ~{args.prompt_len}-token prompts, "
          f"{args.output_len} output tokens, greedy, ignore_eos")
    ours = results["radixserve"]["output_tokens_per_s"]
    print(f"{'system':<18}{'requests':>9}{'seconds':>10}{'out tok/s':>11}{'radixserve / this':>19}")
    for name, r in results.items():
        ratio = ours / r["output_tokens_per_s"]
        print(f"{name:<18}{r['requests']:>9}{r['seconds']:>10.1f}{r['output_tokens_per_s']:>11.1f}{ratio:>18.2f}x")
