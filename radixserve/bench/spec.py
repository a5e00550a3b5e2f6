"""`radixserve bench spec`: speculative decoding from context copies, on vs off, in one run.

Two engines on the same weights, each in its own engine process (as `radixserve serve` runs
it): one with `--speculative none`, one with `--speculative ngram` (and the spec flags given).
Each request (or group sent at once) runs on the first, the second, the second and the first
again, back to back, on flushed prefix caches (whichever engine runs right after the other is
~20% faster on this VM: ABBA cancels it); the rates add up each engine's time. Greedy throughout, so both must
produce the same tokens (checked).

    rewrite  "rewrite this ~800-token document fixing the typos", one request at a time
    json     product lists (six lines of SKU | name | colour | price) -> a JSON array of
             objects copying the fields (json_schema), one at a time
    chat1    plain chat questions, one at a time, up to 128 tokens each
    chat32   32 plain chat questions at once, up to 128 tokens each (--repeats times)

Reports output tok/s of each, the ratio (on / off), and the speculating engine's acceptance
rate and tokens per verified decode over the workload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

from radixserve.bench.spec_texts import CHAT_QUESTIONS, DOCUMENT, LIST_ASK, LIST_SCHEMA, product_list, with_typos
from radixserve.cli_args import add_engine_args, engine_kwargs
from radixserve.engine.protocol import EngineStats

WORKLOADS = ("rewrite", "json", "chat1", "chat32")


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    p.add_argument("--repeats", type=int, default=2, help="documents rewritten (each with its own typos); chat32 batches run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures to this file")


def _requests(engine: Any, workload: str, rng: random.Random, repeats: int) -> list[list[tuple[list[int], Any]]]:
    """The workload as groups of (prompt ids, params); a group's requests are sent at once."""
    from radixserve import SamplingParams

    def chat(text: str) -> list[int]:
        return engine.chat_ids([{"role": "user", "content": text}])

    if workload == "rewrite":
        p = SamplingParams(max_new_tokens=1000, temperature=0)
        docs = [with_typos(DOCUMENT, rng) for _ in range(repeats)]
        ask = "Rewrite the following document, fixing the typos. Output only the corrected document.\n\n"
        return [[(chat(ask + d), p)] for d in docs]
    if workload == "json":
        p = SamplingParams(max_new_tokens=400, temperature=0, json_schema=json.dumps(LIST_SCHEMA))
        return [[(chat(LIST_ASK + product_list(rng)), p)] for _ in range(3)]
    p = SamplingParams(max_new_tokens=128, temperature=0)
    if workload == "chat1":
        return [[(chat(q), p)] for q in CHAT_QUESTIONS[:4]]
    batch = [(chat(q + ("" if i < 16 else " Answer briefly.")), p) for i, q in enumerate(CHAT_QUESTIONS * 2)]
    return [batch] * repeats  # one batch is one sample of each engine: repeated, the machine's noise averages out


async def _one(engine: Any, ids: list[int], params: Any) -> Any:
    out = None
    async for d in engine.submit(engine.make_req(ids, params)):
        if d.finished:
            out = d.output
    if out is None or out.finish_reason == "error":
        raise RuntimeError(f"a request failed: {getattr(out, 'error', None)}")
    return out


async def _group(engine: Any, group: list[tuple[list[int], Any]]) -> tuple[float, int, list[list[int]]]:
    """One group (sent at once) on a flushed cache: seconds, output tokens, every output's tokens."""
    engine.flush_cache()
    t = time.perf_counter()
    done = await asyncio.gather(*(_one(engine, ids, p) for ids, p in group))
    return time.perf_counter() - t, sum(o.completion_tokens for o in done), [o.token_ids for o in done]


def _interleaved(off: Any, on: Any, groups: list[list[tuple[list[int], Any]]]) -> dict[str, Any]:
    """Each group on `off`, then on `on`, then on `on` and `off` again (the machine's drift hits
    both alike); the speculating engine's counters over its runs."""
    secs, toks = {"off": 0.0, "on": 0.0}, {"off": 0, "on": 0}
    outs: dict[str, list[Any]] = {"off": [], "on": []}
    before = on.stats()
    for g in groups:  # each group twice, ABBA: whichever engine runs right after the other runs ~20% faster here
        for name, engine in (("off", off), ("on", on), ("on", on), ("off", off)):
            dt, n, o = asyncio.run(_group(engine, g))
            secs[name] += dt
            toks[name] += n
            outs[name] += o
    after = on.stats()

    def delta(field: str) -> int:
        return getattr(after, field) - getattr(before, field)

    fields = ("spec_draft_tokens", "spec_accepted_tokens", "spec_verifies", "spec_emitted_tokens")
    counts: dict[str, Any] = {f: delta(f) for f in fields}
    d = EngineStats(**counts)
    off_rate, on_rate = toks["off"] / secs["off"], toks["on"] / secs["on"]
    return {"off_tok_s": off_rate, "on_tok_s": on_rate, "ratio": on_rate / off_rate,
            "acceptance": d.spec_acceptance_rate, "draft_tokens": d.spec_draft_tokens,
            "tokens_per_verify": d.spec_tokens_per_verify,
            "identical": sum(a == b for a, b in zip(outs["on"], outs["off"])), "outputs": len(outs["on"])}


def bench(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from radixserve.engine.process import EngineProcess

    chosen = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in chosen:
        if w not in WORKLOADS:
            raise SystemExit(f"--workloads: {w!r} is not one of {', '.join(WORKLOADS)}")
    kw = engine_kwargs(args)
    on_kw = {**kw, "speculative": "ngram" if kw["speculative"] == "none" else kw["speculative"]}
    results: dict[str, dict[str, float]] = {}
    with EngineProcess(args.model, **{**kw, "speculative": "none"}) as off, EngineProcess(args.model, **on_kw) as on:
        _interleaved(off, on, [[(off.chat_ids([{"role": "user", "content": "Hello"}]), _params(4))]])  # warm-up
        for w in chosen:
            groups = _requests(off, w, random.Random(f"{args.seed}-{w}"), args.repeats)
            results[w] = r = _interleaved(off, on, groups)
            print(f"  {w:8s} off {r['off_tok_s']:7.1f} tok/s  on {r['on_tok_s']:7.1f} tok/s  {r['ratio']:.2f}x  acceptance "
                  f"{r['acceptance']:.0%} of {r['draft_tokens']} drafted, {r['tokens_per_verify']:.2f} tokens per verify, "
                  f"identical outputs {r['identical']}/{r['outputs']}", flush=True)
    return results


def _params(n: int) -> Any:
    from radixserve import SamplingParams

    return SamplingParams(max_new_tokens=n, temperature=0)


def print_table(results: dict[str, dict[str, float]]) -> None:
    print("\n| workload | off tok/s | on tok/s | on / off | acceptance | tokens per verify | identical |")
    print("|---|---|---|---|---|---|---|")
    for w, r in results.items():
        print(f"| {w} | {r['off_tok_s']:.1f} | {r['on_tok_s']:.1f} | {r['ratio']:.2f}x | {r['acceptance']:.0%} | "
              f"{r['tokens_per_verify']:.2f} | {r['identical']}/{r['outputs']} |")


def run(args: argparse.Namespace) -> int:
    results = bench(args)
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
