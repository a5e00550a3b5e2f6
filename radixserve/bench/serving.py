"""`radixserve bench serving --url URL`: load a running server the way users do, over HTTP.

Open loop: Poisson arrivals at each rate of a sweep (arrivals do not wait for answers, so an
overloaded server shows it: latency climbs, goodput falls, rejections appear). Closed loop:
a fixed number of clients, each sending its next request when the last one is answered.
Workloads: `chat` (one user message, varied lengths) and `fork` (an agent sends 4 branches
at once off a long system prompt shared by every agent). Every request streams from
/v1/chat/completions, so TTFT and TPOT are measured at the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from radixserve.bench import bearer, percentile
from radixserve.bench.prefix import QUESTIONS, documentation


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--workloads", default="chat,fork", help="comma-separated: chat, fork")
    p.add_argument("--rates", default="0.25,0.5,1,2,4", help="open-loop arrival rates, requests/s")
    p.add_argument("--concurrency", default="1,4,16", help="closed-loop client counts ('' to skip)")
    p.add_argument("--requests", type=int, default=24, help="requests per point of each sweep")
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--system-sentences", type=int, default=60, help="length of the fork workload's shared system prompt")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write every point to this file")
    p.add_argument("--plot", default=None, help="latency and goodput against arrival rate, as a PNG")


@dataclass
class Result:
    status: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    tokens: int = 0
    error: str | None = None

    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.ttft is not None and self.tokens > 1 else None


@dataclass
class Workload:
    name: str
    rng: random.Random
    system: str = field(default="")

    def requests(self, n: int) -> list[list[list[dict[str, str]]]]:
        """n arrivals; each is a group of message lists sent at the same instant."""
        out = []
        for _ in range(n):
            if self.name == "chat":
                q = documentation(self.rng, self.rng.randint(1, 12)) + self.rng.choice(QUESTIONS)
                out.append([[{"role": "user", "content": q}]])
            else:
                task = documentation(self.rng, 2)
                out.append([[{"role": "system", "content": self.system},
                             {"role": "user", "content": f"{task} Branch {b}: {self.rng.choice(QUESTIONS)}"}] for b in range(4)])
        return out


async def _one(session: Any, args: argparse.Namespace, messages: list[dict[str, str]]) -> Result:
    body = {"model": "", "messages": messages, "max_tokens": args.output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    headers = bearer(args.api_key)
    r, t0 = Result(), time.perf_counter()
    try:
        async with session.post(args.url + "/v1/chat/completions", json=body, headers=headers) as resp:
            r.status = resp.status
            if resp.status != 200:
                r.error = (await resp.text())[:200]
                return r
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content") and r.ttft is None:
                    r.ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    r.tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # a dropped connection is a result too
        r.error = repr(e)
    r.e2e = time.perf_counter() - t0
    return r


async def open_loop(session: Any, args: argparse.Namespace, work: Workload, rate: float) -> tuple[list[Result], float]:
    arrivals, rng = work.requests(args.requests), random.Random(args.seed)
    tasks, t0 = [], time.perf_counter()
    for group in arrivals:
        tasks += [asyncio.ensure_future(_one(session, args, m)) for m in group]
        await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - t0


async def closed_loop(session: Any, args: argparse.Namespace, work: Workload, clients: int) -> tuple[list[Result], float]:
    queue = work.requests(args.requests)
    results: list[Result] = []
    t0 = time.perf_counter()

    async def client() -> None:
        while queue:
            group = queue.pop()
            results.extend(await asyncio.gather(*(_one(session, args, m) for m in group)))

    await asyncio.gather(*(client() for _ in range(clients)))
    return results, time.perf_counter() - t0


def summarize(results: list[Result], wall: float, args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200 and r.error is None]
    good = [r for r in ok if r.ttft is not None and r.ttft <= args.slo_ttft_ms / 1e3 and (r.tpot() or 0.0) <= args.slo_tpot_ms / 1e3]

    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [t for r in ok if (t := r.tpot()) is not None]
    return {
        "requests": len(results), "completed": len(ok), "rejected": sum(r.status in (429, 503) for r in results),
        "errors": sum(1 for r in results if r.status not in (200, 429, 503) or (r.status == 200 and r.error)),
        "wall_s": wall, "output_tok_s": sum(r.tokens for r in ok) / wall, "request_s": len(ok) / wall,
        "goodput_req_s": len(good) / wall,
        **{f"ttft_p{q}_ms": _ms(percentile(ttft, q / 100, None)) for q in (50, 95, 99)},
        **{f"tpot_p{q}_ms": _ms(percentile(tpot, q / 100, None)) for q in (50, 95, 99)},
        "e2e_p50_s": percentile([r.e2e for r in ok], 0.5, None),
        "first_error": next((f"{r.status}: {r.error}" for r in results if r.error), None),
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


async def sweep(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    rng = random.Random(args.seed)
    system = documentation(random.Random(args.seed + 1), args.system_sentences)
    out: dict[str, Any] = {"url": args.url, "output_len": args.output_len, "slo_ttft_ms": args.slo_ttft_ms,
                           "slo_tpot_ms": args.slo_tpot_ms, "open_loop": {}, "closed_loop": {}}
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        for name in [w for w in args.workloads.split(",") if w]:
            if name not in ("chat", "fork"):
                raise ValueError(f"workloads: {name!r} is not one of chat, fork")
            for rate in _floats(args.rates):
                res, wall = await open_loop(session, args, Workload(name, random.Random(rng.random()), system), rate)
                out["open_loop"].setdefault(name, []).append({"rate": rate, **summarize(res, wall, args)})
                _print_point(name, f"rate {rate:g}/s", out["open_loop"][name][-1])
            for c in _floats(args.concurrency):
                res, wall = await closed_loop(session, args, Workload(name, random.Random(rng.random()), system), int(c))
                out["closed_loop"].setdefault(name, []).append({"concurrency": int(c), **summarize(res, wall, args)})
                _print_point(name, f"{int(c)} clients", out["closed_loop"][name][-1])
    return out


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _print_point(workload: str, point: str, s: dict[str, Any]) -> None:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    print(f"{workload:<5} {point:<12} done {s['completed']:>3}/{s['requests']:<3} rejected {s['rejected']:>3} "
          f"out {s['output_tok_s']:6.1f} tok/s  goodput {s['goodput_req_s']:5.2f} req/s  "
          f"TTFT p50/p95/p99 {f(s['ttft_p50_ms'])}/{f(s['ttft_p95_ms'])}/{f(s['ttft_p99_ms'])} ms  "
          f"TPOT p50/p99 {f(s['tpot_p50_ms'])}/{f(s['tpot_p99_ms'])} ms", flush=True)
    if s["errors"]:
        print(f"      {s['errors']} errors, the first: {s['first_error']}", flush=True)


def plot(data: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4))
    for name, points in data["open_loop"].items():
        rates = [p["rate"] for p in points]
        for key, style in (("ttft_p50_ms", "-o"), ("ttft_p99_ms", "--o"), ("tpot_p50_ms", "-s"), ("tpot_p99_ms", "--s")):
            lat.plot(rates, [p[key] if p[key] is not None else float("nan") for p in points], style, label=f"{name} {key[:-3]}")
        thr.plot(rates, [p["request_s"] for p in points], "-o", label=f"{name} throughput")
        thr.plot(rates, [p["goodput_req_s"] for p in points], "--o", label=f"{name} goodput")
    xlabel = "arrivals/s (a fork arrival is 4 requests)"
    lat.set(xlabel=xlabel, ylabel="ms", yscale="log", title="latency (open loop)")
    thr.set(xlabel=xlabel, ylabel="completed requests/s",
            title=f"throughput and goodput (SLO: TTFT {data['slo_ttft_ms']:g} ms, TPOT {data['slo_tpot_ms']:g} ms)")
    for ax in (lat, thr):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> int:
    data = asyncio.run(sweep(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)
    if args.plot:
        plot(data, args.plot)
    return 0
