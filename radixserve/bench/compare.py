"""`radixserve bench compare --url A --name a --url B --name b`: the same five workloads against
any OpenAI-compatible servers (ours, llama.cpp's llama-server, vLLM, SGLang), each workload run
on every server back to back, and the ratio of the first server to each other one printed.

    single   one request, ~150-token prompt -> 128 tokens: end-to-end output tok/s (median of 3)
    batch    32 concurrent requests, ~150 -> 128 each: output tok/s
    prefill  one ~2,000-token prompt -> 1 token: ms (median of 3)
    fork     16 questions off one shared ~2,000-token prefix, sent at once -> 64 each: wall s
    json     16 concurrent JSON-schema chats (response_format json_schema): output tok/s

`--roof`: the first server's decode step against the machine's memory roof, as a weight-bound
step at batch 1 should be judged: the bytes of weights a step reads (`/server_info`
`step_weight_bytes`: every weight but an embedding table no head shares, of which a step reads
one row, as in Qwen2.5-Coder-1.5B's GGUF with its own `output.weight`; of a mixture of experts,
the dense layers' and, on average, its chosen experts') divided by its step time (the
difference of a 2n- and an n-token completion of fresh prompts, so prefill and HTTP cancel out;
where that difference is below the requests' noise, a tiny model's, the whole request's time a
token instead, an upper bound, flagged `step_is_upper_bound`), beside the read rate of a
STREAM-like sum over 1 GiB in this process (torch's threads) measured just before each of three
rounds, the round of the median share printed and all kept in `--json` as `memory_roof`.
Run it on a machine where the servers are the only load.

Greedy, `ignore_eos` where the count must be exact. Caches start cold: every workload's text
opens with a fresh random tag (no server can reuse an earlier workload's prefix), and servers
that have `/flush_cache` (ours, SGLang) are flushed before each workload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from radixserve.bench import bearer
from radixserve.bench.prefix import QUESTIONS, documentation

WORKLOADS = ("single", "batch", "prefill", "fork", "json")
HIGHER_IS_BETTER = {"single": True, "batch": True, "prefill": False, "fork": False, "json": True}
UNITS = {"single": "tok/s", "batch": "tok/s", "prefill": "ms", "fork": "s", "json": "tok/s"}
CHARS_PER_TOKEN = 4.6  # SmolLM2's tokenizer on `documentation` text; the prompts are sized by it

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 4},
        "remote": {"type": "boolean"},
    },
    "required": ["name", "age", "skills", "remote"],
    "additionalProperties": False,
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", action="append", required=True, help="a server's base URL (repeat: the first is compared to each other)")
    p.add_argument("--name", action="append", default=[], help="a name per --url, in order")
    p.add_argument("--api-key", action="append", default=[], help="a key per --url, in order ('' for none)")
    p.add_argument("--model", default="", help="the model name to send (most single-model servers ignore it)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    p.add_argument("--repeats", type=int, default=3, help="runs of the single and prefill workloads (the median is kept)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every prompt and output length (e.g. 0.05 for a smoke run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--roof", action="store_true", help="also: the first server's decode step as a share of the memory roof")
    p.add_argument("--json", default=None, help="write the figures to this file")


def _text(rng: random.Random, tokens: int) -> str:
    tag = f"[session {rng.getrandbits(64):016x}] "
    text = tag
    while len(text) < tokens * CHARS_PER_TOKEN:
        text += documentation(rng, 4)
    return text[: int(tokens * CHARS_PER_TOKEN)]


class Server:
    def __init__(self, session: Any, url: str, name: str, key: str | None, model: str) -> None:
        self.session, self.url, self.name, self.key, self.model = session, url.rstrip("/"), name, key or None, model
        self.unparsed = 0  # structured outputs that did not parse (counted, shown beside the rate)

    async def flush(self) -> None:
        try:
            async with self.session.post(self.url + "/flush_cache", headers=bearer(self.key)) as r:
                await r.read()
        except Exception:  # a server without the route: the fresh tags keep its cache cold
            pass

    async def complete(self, prompt: str, max_tokens: int) -> int:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": False}
        return await self._post("/v1/completions", body)

    async def chat_json(self, content: str) -> int:
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": 160,
                "temperature": 0.0, "response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}}
        return await self._post("/v1/chat/completions", body, check_json=True)

    async def _post(self, path: str, body: dict[str, Any], check_json: bool = False) -> int:
        async with self.session.post(self.url + path, json=body, headers=bearer(self.key)) as r:
            data = await r.json(content_type=None)
            if r.status != 200:
                raise RuntimeError(f"{self.name}: {path} answered {r.status}: {str(data)[:300]}")
        if check_json:
            try:  # structured output that does not parse is a failure, not a speed: counted and shown
                json.loads(data["choices"][0]["message"]["content"] or "")
            except ValueError:
                self.unparsed += 1
        return int(data["usage"]["completion_tokens"])


class Sizes:
    """The workloads' token counts, times --scale."""

    def __init__(self, scale: float) -> None:
        def n(x: int) -> int:
            return max(1, round(x * scale))

        self.prompt, self.output, self.long, self.fork_output = n(150), n(128), n(2000), n(64)


async def single(s: Server, rng: random.Random, repeats: int, z: Sizes) -> float:
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        n = await s.complete(_text(rng, z.prompt), z.output)
        rates.append(n / (time.perf_counter() - t))
    return statistics.median(rates)


async def batch(s: Server, rng: random.Random, repeats: int, z: Sizes) -> float:
    prompts = [_text(rng, round(z.prompt * rng.uniform(0.9, 1.1)) or 1) for _ in range(32)]
    t = time.perf_counter()
    counts = await asyncio.gather(*(s.complete(p, z.output) for p in prompts))
    return sum(counts) / (time.perf_counter() - t)


async def prefill(s: Server, rng: random.Random, repeats: int, z: Sizes) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        await s.complete(_text(rng, z.long), 1)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


async def fork(s: Server, rng: random.Random, repeats: int, z: Sizes) -> float:
    shared = _text(rng, z.long)
    questions = [f"\n\nQuestion {i + 1}: {rng.choice(QUESTIONS)}\nAnswer:" for i in range(16)]
    t = time.perf_counter()
    await asyncio.gather(*(s.complete(shared + q, z.fork_output) for q in questions))
    return time.perf_counter() - t


async def json_chats(s: Server, rng: random.Random, repeats: int, z: Sizes) -> float:
    people = [f"Describe a made-up software engineer number {rng.randint(1, 10**6)} as JSON." for _ in range(16)]
    t = time.perf_counter()
    counts = await asyncio.gather(*(s.chat_json(p) for p in people))
    return sum(counts) / (time.perf_counter() - t)


RUNS: dict[str, Callable[[Server, random.Random, int, Sizes], Awaitable[float]]] = {
    "single": single, "batch": batch, "prefill": prefill, "fork": fork, "json": json_chats}


async def compare(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    import aiohttp

    names = args.name + [f"server{i + 1}" for i in range(len(args.name), len(args.url))]
    keys = args.api_key + [""] * (len(args.url) - len(args.api_key))
    chosen = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in chosen:
        if w not in RUNS:
            raise SystemExit(f"--workloads: {w!r} is not one of {', '.join(WORKLOADS)}")
    results: dict[str, dict[str, float]] = {w: {} for w in chosen}
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        servers = [Server(session, u, n, k, args.model) for u, n, k in zip(args.url, names, keys)]
        for s in servers:  # a tiny warm-up each, plain and schema-constrained: first-request costs
            await s.complete("Hello", 2)  # (a server's grammar compiler starting up) are not a workload
            if "json" in chosen:  # (only where it is measured: a chat a random-weight model's noise may fail)
                await s.chat_json("Hello")
        for w in chosen:
            for s in servers:  # back to back, each on the same kind of fresh text
                await s.flush()
                s.unparsed = 0
                results[w][s.name] = await RUNS[w](s, random.Random(f"{args.seed}-{w}"), args.repeats, Sizes(args.scale))
                if s.unparsed:
                    results[w][f"{s.name} unparsed"] = s.unparsed
                print(f"  {w:8s} {s.name:14s} {results[w][s.name]:10.1f} {UNITS[w]}"
                      + (f" ({s.unparsed} outputs did not parse)" if s.unparsed else ""), flush=True)
    return results


def read_roof() -> float:
    """The machine's read rate, GB/s: the best of 5 sums over 1 GiB of fp32 on torch's threads
    (scripts/quant_roofs.py measures it the same way)."""
    import torch

    a = torch.ones(2**28)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best / 1e9


async def step_roof(url: str, key: str | None, model: str, seed: int, steps: int = 128) -> dict[str, Any]:
    """The server's decode step at batch 1 (see the module docstring) against the read roof
    measured just before it: three rounds, each a roof measurement then the two completions
    (a shared machine's bandwidth moves with its neighbours: a roof taken minutes apart from the
    step it judges read 21-27 GB/s on the same Xeon); the round of the median share is reported,
    every round kept in `rounds`."""
    import aiohttp

    rng = random.Random(f"{seed}-roof")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        s = Server(session, url, "roof", key, model)
        async with session.get(url + "/server_info", headers=bearer(key)) as r:
            info = await r.json(content_type=None)
        weight_bytes = int(info.get("step_weight_bytes") or info["weight_bytes"])
        await s.complete("Hello", 2)
        rounds = []
        for _ in range(3):
            roof = read_roof()
            t = time.perf_counter()
            n1 = await s.complete(_text(rng, 32), steps)
            t1 = time.perf_counter() - t
            t = time.perf_counter()
            n2 = await s.complete(_text(rng, 32), 2 * steps)
            t2 = time.perf_counter() - t
            rounds.append({"step_s": (t2 - t1) / max(1, n2 - n1), "whole_s": t2 / max(1, n2), "read_roof_gb_s": roof})
    bound = statistics.median(x["step_s"] for x in rounds) <= 0  # a step below the requests' noise (a tiny model)
    for x in rounds:
        step, whole = x.pop("step_s"), x.pop("whole_s")
        step_s = whole if bound else step
        x["step_ms"] = step_s * 1e3
        x["weights_gb_s"] = weight_bytes / step_s / 1e9
        x["share"] = x["weights_gb_s"] / x["read_roof_gb_s"]
    mid = sorted(rounds, key=lambda x: x["share"])[len(rounds) // 2]
    return {"weight_bytes": weight_bytes, **mid, "step_is_upper_bound": bound, "rounds": rounds}


def ratio(workload: str, ours: float, theirs: float) -> float:
    """How many times better the first server is (>1: it wins)."""
    return ours / theirs if HIGHER_IS_BETTER[workload] else theirs / ours


def print_table(results: dict[str, dict[str, float]]) -> None:
    names = [n for n in next(iter(results.values())) if not n.endswith(" unparsed")]
    first, others = names[0], names[1:]
    head = f"| workload | {' | '.join(names)} | " + " | ".join(f"{first} / {o}" for o in others) + " |"
    print("\n" + head)
    print("|" + "---|" * (1 + len(names) + len(others)))
    for w, row in results.items():
        cells = [f"{row[n]:,.1f} {UNITS[w]}" + (f" ({row[n + ' unparsed']:.0f} did not parse)" if n + " unparsed" in row else "")
                 for n in names]
        ratios = [f"{ratio(w, row[first], row[o]):.2f}x" for o in others]
        print(f"| {w} | " + " | ".join(cells + ratios) + " |")


def run(args: argparse.Namespace) -> int:
    if len(args.url) < 2:
        raise SystemExit("--url: give at least two servers to compare")
    results: dict[str, Any] = asyncio.run(compare(args))
    print_table(results)
    if args.roof:
        key = args.api_key[0] if args.api_key else None
        roof = asyncio.run(step_roof(args.url[0], key or None, args.model, args.seed))
        at_most = "at most " if roof["step_is_upper_bound"] else ""  # (a step below the requests' noise)
        print(f"\nmemory roof: {args.name[0] if args.name else 'server1'}'s decode step at batch 1 {at_most}{roof['step_ms']:.1f} ms "
              f"over {roof['weight_bytes'] / 2**20:,.0f} MiB of weights = {roof['weights_gb_s']:.1f} GB/s, "
              f"{roof['share']:.0%} of this machine's read roof ({roof['read_roof_gb_s']:.1f} GB/s)")
        results["memory_roof"] = roof
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
