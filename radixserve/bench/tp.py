"""`radixserve bench tp`: the same model on one rank, on N tensor-parallel ranks and on N
pipeline stages (--tensor-parallel N, default 2), on the same cores (one rank: all its threads;
N ranks: the cores shared out), one after the other in one run: the time of a prefill (a batch
of prompts, no output) and of a decode step (the batch's prompts cached, one token each a
step), and the all-reduce's share of rank 0's time (tensor parallel; it includes waiting for
the slowest rank: an uneven split of the heads shows there). Tensor parallelism takes float
weights only (a GGUF is loaded with --quantization none)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from radixserve.bench.offline import make_prompts
from radixserve.cli_args import add_engine_args, engine_kwargs


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--batch", type=int, default=4, help="prompts run together")
    p.add_argument("--prompt-len", type=int, default=256, help="mean prompt length (tokens, +-10%%)")
    p.add_argument("--output-len", type=int, default=32, help="decode steps timed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures to this file")


def measure(model: str | None, kwargs: dict[str, Any], label: str, args: argparse.Namespace) -> dict[str, Any]:
    from radixserve import Engine, SamplingParams

    with Engine(model, **kwargs) as e:
        prompts = make_prompts(args.batch, args.prompt_len, e.vocab_size, args.seed)
        e.generate([p[:32] for p in prompts], SamplingParams(temperature=0.0, max_new_tokens=4))  # warm-up
        group = e.tp_group
        if group is not None:
            group.timed = True
        row: dict[str, Any] = {"ranks": label}
        for name, out_len in (("prefill", 1), ("decode", args.output_len)):
            if group is not None:
                group.seconds = 0.0
            t = time.perf_counter()
            e.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=out_len, ignore_eos=True))
            dt = time.perf_counter() - t
            row[f"{name}_ms"] = dt * 1e3 if name == "prefill" else dt * 1e3 / out_len  # decode: per step
            row[f"{name}_allreduce_share"] = group.seconds / dt if group is not None else 0.0
        return row


def run(args: argparse.Namespace) -> int:
    kwargs = engine_kwargs(args)
    n = max(kwargs.pop("tensor_parallel", 1), kwargs.pop("pipeline_parallel", 1), 2)
    runs = {"1": {}, f"tensor {n}": {"tensor_parallel": n}, f"pipeline {n}": {"pipeline_parallel": n}}
    rows = []
    for label, extra in runs.items():
        try:
            rows.append(measure(args.model, {**kwargs, **extra}, label, args))
        except ValueError as e:  # e.g. tensor parallelism on a GGUF's quantized blocks
            print(f"{label}: not run: {e}")
    print(f"{args.batch} prompts of ~{args.prompt_len} tokens; decode: per step, {args.batch} rows")
    print(f"{'ranks':>10} | {'prefill ms':>10} | {'all-reduce':>10} | {'decode step ms':>14} | {'all-reduce':>10}")
    for r in rows:
        print(f"{r['ranks']:>10} | {r['prefill_ms']:>10.1f} | {r['prefill_allreduce_share']:>9.0%} | "
              f"{r['decode_ms']:>14.2f} | {r['decode_allreduce_share']:>9.0%}")
    one = rows[0]
    for r in rows[1:]:
        print(f"{r['ranks']} / 1: prefill x{one['prefill_ms'] / r['prefill_ms']:.2f}, "
              f"decode step x{one['decode_ms'] / r['decode_ms']:.2f} (above 1: faster)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "prompt_len": args.prompt_len, "output_len": args.output_len, "rows": rows}, f, indent=1)
    return 0
