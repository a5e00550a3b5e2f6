"""`radixserve bench tp`: the same model on one rank and on N (--tensor-parallel, default 2),
on the same cores (one rank: all its threads; N ranks: the cores shared out), one after the
other in one run: the time of a prefill (a batch of prompts, no output) and of a decode step
(the batch's prompts cached, one token each a step), and the all-reduce's share of rank 0's
time. Rank 0's all-reduce time includes waiting for the slowest rank (an uneven split of the
heads shows there). Float weights only (a GGUF is loaded with --quantization none)."""

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


def measure(model: str | None, kwargs: dict[str, Any], n: int, args: argparse.Namespace) -> dict[str, Any]:
    from radixserve import Engine, SamplingParams

    with Engine(model, **{**kwargs, "tensor_parallel": n}) as e:
        prompts = make_prompts(args.batch, args.prompt_len, e.vocab_size, args.seed)
        e.generate([p[:32] for p in prompts], SamplingParams(temperature=0.0, max_new_tokens=4))  # warm-up
        group = e.tp_group
        if group is not None:
            group.timed = True
        row: dict[str, Any] = {"ranks": n}
        for name, out_len in (("prefill", 1), ("decode", args.output_len)):
            if group is not None:
                group.seconds, group.calls = 0.0, 0
            t = time.perf_counter()
            e.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=out_len, ignore_eos=True))
            dt = time.perf_counter() - t
            row[f"{name}_ms"] = dt * 1e3 if name == "prefill" else dt * 1e3 / out_len  # decode: per step
            row[f"{name}_allreduce_share"] = group.seconds / dt if group is not None else 0.0
        return row


def run(args: argparse.Namespace) -> int:
    kwargs = engine_kwargs(args)
    n = kwargs.pop("tensor_parallel", 1)
    n = n if n > 1 else 2
    rows = [measure(args.model, kwargs, k, args) for k in (1, n)]
    print(f"{args.batch} prompts of ~{args.prompt_len} tokens; decode: per step, {args.batch} rows")
    print(f"{'ranks':>5} | {'prefill ms':>10} | {'all-reduce':>10} | {'decode step ms':>14} | {'all-reduce':>10}")
    for r in rows:
        print(f"{r['ranks']:>5} | {r['prefill_ms']:>10.1f} | {r['prefill_allreduce_share']:>9.0%} | "
              f"{r['decode_ms']:>14.2f} | {r['decode_allreduce_share']:>9.0%}")
    one, many = rows
    print(f"{n} ranks / 1: prefill x{one['prefill_ms'] / many['prefill_ms']:.2f}, "
          f"decode step x{one['decode_ms'] / many['decode_ms']:.2f} (above 1: faster)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "prompt_len": args.prompt_len, "output_len": args.output_len, "rows": rows}, f, indent=1)
    return 0
