"""`radixserve bench disagg`: prefill/decode disaggregation against colocated replicas, on the
same cores, one after the other in one run. Colocated: 2 data-parallel replicas, each with half
the cores, every request prefilled and decoded where it is routed. Disaggregated: 1 prefill + 1
decode replica (--disaggregate), each with half the cores, a prompt's KV pages handed over
through the KV connector.

The workload, the same for both: `--short-streams` clients chat back to back (short distinct
prompts, `--short-output` tokens each), while long prompts (`--long-len` tokens, at least 2,000
by default, distinct, a few tokens of output) arrive evenly spaced at each rate of
`--long-rates` in turn (per second; 0: none). For each mode and rate: the short chats' time per output token (TPOT:
(last token - first token) / (tokens - 1), per request) at p50 and p99, their worst gap between
two tokens (p99 of each request's largest), the short chats' output tokens per second (the
price disaggregation pays: one replica decodes everything), and the long prompts' time to
first token. Colocated, a long prompt's prefill chunks run in the same steps as the decodes on
its replica and stretch them; disaggregated, the decode replica never prefills one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

from radixserve.cli_args import add_engine_args, engine_kwargs
from radixserve.config import RouterConfig


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--short-streams", type=int, default=4, help="short chats in flight at once")
    p.add_argument("--short-len", type=int, default=64, help="short prompts' length (tokens)")
    p.add_argument("--short-output", type=int, default=48, help="short chats' output tokens")
    p.add_argument("--long-len", type=int, default=2048, help="long prompts' length (tokens)")
    p.add_argument("--long-output", type=int, default=4, help="long prompts' output tokens")
    p.add_argument("--long-rates", default="0,0.05,0.1", help="long prompts per second, one run each (comma-separated)")
    p.add_argument("--seconds", type=float, default=60.0, help="each run's length")
    p.add_argument("--modes", default="colocated,disaggregated", help="which to run (comma-separated)")
    p.add_argument("--disaggregate-min-tokens", type=int, default=RouterConfig().disaggregate_min_tokens,
                   help="prompts with fewer uncached tokens are prefilled on the decode replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures to this file")


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _workload(engine: Any, args: argparse.Namespace, rate: float, rng: random.Random) -> dict[str, Any]:
    from radixserve import SamplingParams

    vocab = engine.vocab_size
    short = SamplingParams(temperature=0.0, max_new_tokens=args.short_output, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_new_tokens=args.long_output, ignore_eos=True)
    tpots: list[float] = []
    gaps: list[float] = []
    ttfts: list[float] = []
    short_tokens = 0
    end = time.monotonic() + args.seconds

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    async def one(ids: list[int], params: Any) -> list[float]:
        """The arrival time of each output token."""
        times: list[float] = []
        async for d in engine.submit(engine.make_req(ids, params)):
            times.extend(time.monotonic() for _ in d.token_ids)
            if d.finished and d.output is not None and d.output.error:
                raise RuntimeError(d.output.error)
        return times

    async def chats() -> None:
        nonlocal short_tokens
        while time.monotonic() < end:
            times = await one(tokens(args.short_len), short)
            if len(times) > 1 and times[-1] <= end:
                tpots.append((times[-1] - times[0]) / (len(times) - 1))
                gaps.append(max(b - a for a, b in zip(times, times[1:])))
                short_tokens += len(times)

    async def longs() -> None:
        if rate <= 0:
            return
        pending = []
        next_at = time.monotonic() + 0.5 / rate  # evenly spaced: both modes see the same arrivals
        while next_at < end:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

            async def timed(t0: float) -> None:
                times = await one(tokens(args.long_len), long)
                ttfts.append(times[0] - t0)

            pending.append(asyncio.ensure_future(timed(time.monotonic())))
            next_at += 1 / rate
        await asyncio.gather(*pending)

    t0 = time.monotonic()
    await asyncio.gather(longs(), *(chats() for _ in range(args.short_streams)))
    return {"long_rate": rate, "short_requests": len(tpots), "tpot_p50_ms": _pct(tpots, 0.5) * 1e3,
            "tpot_p99_ms": _pct(tpots, 0.99) * 1e3, "worst_gap_p99_ms": _pct(gaps, 0.99) * 1e3,
            "short_tokens_per_s": short_tokens / args.seconds, "long_requests": len(ttfts),
            "long_ttft_mean_s": statistics.mean(ttfts) if ttfts else float("nan"),
            "wall_s": time.monotonic() - t0}


def measure(args: argparse.Namespace, mode: str, rates: list[float]) -> list[dict[str, Any]]:
    from radixserve.engine.data_parallel import DataParallelEngine

    router = RouterConfig(data_parallel=2, disaggregate=mode == "disaggregated",
                          disaggregate_min_tokens=args.disaggregate_min_tokens)
    rows = []
    with DataParallelEngine(args.model, router, **engine_kwargs(args)) as engine:
        rng = random.Random(args.seed)
        warm = argparse.Namespace(**{**vars(args), "seconds": 3.0, "short_output": 4})
        asyncio.run(_workload(engine, warm, 0.0, rng))
        for rate in rates:
            row = {"mode": mode, **asyncio.run(_workload(engine, args, rate, rng))}
            stats = [r.engine.stats() for r in engine.replicas if r.engine is not None]  # cumulative
            row["prefill_on_decode_replica"] = stats[-1].prefill_tokens_computed
            row["handed_off_tokens"] = sum(s.kv_exported_tokens for s in stats)
            rows.append(row)
            print(_line(row), flush=True)
    return rows


HEAD = (f"{'mode':>13} | {'long/s':>6} | {'short':>5} | {'TPOT p50':>8} | {'TPOT p99':>8} | {'gap p99':>8} | "
        f"{'short tok/s':>11} | {'long':>4} | {'long TTFT':>9}")


def _line(r: dict[str, Any]) -> str:
    return (f"{r['mode']:>13} | {r['long_rate']:>6.3f} | {r['short_requests']:>5} | {r['tpot_p50_ms']:>6.1f}ms | "
            f"{r['tpot_p99_ms']:>6.1f}ms | {r['worst_gap_p99_ms']:>6.0f}ms | {r['short_tokens_per_s']:>11.1f} | "
            f"{r['long_requests']:>4} | {r['long_ttft_mean_s']:>8.2f}s")


def run(args: argparse.Namespace) -> int:
    rates = [float(x) for x in args.long_rates.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    for m in modes:
        if m not in ("colocated", "disaggregated"):
            raise SystemExit(f"--modes: {m!r} is not colocated or disaggregated")
    print(f"{args.short_streams} short chats ({args.short_len} tokens in, {args.short_output} out) back to back; "
          f"long prompts of {args.long_len} tokens at {rates}/s; {args.seconds:.0f} s a run; 2 replicas, half the "
          "cores each")
    print(HEAD)
    rows = [r for m in modes for r in measure(args, m, rates)]
    if any(r["mode"] == "disaggregated" and not r["handed_off_tokens"] for r in rows):
        raise SystemExit("bench disagg: the disaggregated engine handed no KV pages over")
    by = {(r["mode"], r["long_rate"]): r for r in rows}
    for rate in rates:
        c, d = by.get(("colocated", rate)), by.get(("disaggregated", rate))
        if c and d:
            print(f"long/s {rate}: TPOT p99 colocated / disaggregated x{c['tpot_p99_ms'] / d['tpot_p99_ms']:.2f}, "
                  f"short tok/s disaggregated / colocated x{d['short_tokens_per_s'] / c['short_tokens_per_s']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str))},
                       "rows": rows}, f, indent=1)
    return 0
