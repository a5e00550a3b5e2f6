"""`radixserve bench reliability --url URL --keys KEY_A,KEY_B`: overload and tenant isolation,
measured against a running server over HTTP.

- Overload: a burst of `--burst-factor` x the server's queue capacity (max_queued_requests,
  from /server_info), all sent at once. Reports how fast the excess is rejected (p50/p99,
  next to the same burst of no-op GET /health requests: the client's and the loop's floor),
  how many were accepted and whether they all completed, their latency against the same
  requests sent unloaded, and the server's resident memory before and after (from /metrics).
- Server-side rejection latency: the same burst's 429/503s as the server measured them, from
  its `radixserve_rejection_latency_seconds` histogram (arrival to answer, no client or network).
- The storm and the grammar bomb of bench/hostile.py.
- Isolation timing: per trial a fresh long prompt; tenant A sends it cold, then again (a
  same-tenant hit), then tenant B sends it. B's time to first token should match A's cold
  one (no cross-tenant hit, and nothing measurable leaks through timing) and be clearly
  slower than A's hit. Each row reports the median and the p10-p90 spread over the trials.
  On a server with a disk tier (and an admin key A), the same from disk: A sends a second fresh
  prompt, the pool is flushed (POST /flush_cache?keep_disk=1), A asks again (its blocks read
  back), the pool is flushed again, then B sends A's prompt: as slow as A's cold one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlparse

from radixserve.bench import abuse, bearer, hostile, percentile
from radixserve.bench.prom import histogram_quantile, scrape


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--keys", default=None, help="two tenants' API keys, comma-separated (isolation); omit on an open server")
    p.add_argument("--burst-factor", type=float, default=10.0)
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--prompt-words", type=int, default=1200, help="length of the isolation prompt")
    p.add_argument("--storm", type=int, default=200, help="streams in the mixed storm (0: skip it)")
    p.add_argument("--bombs", type=int, default=4, help="exploding regexes in the grammar bomb, besides one memory bomb (0: skip)")
    p.add_argument("--json", default=None)
    p.add_argument("--abuse", action="store_true", help="run the abuse bench instead (as `radixserve bench abuse`)")
    abuse.add_knobs(p.add_argument_group("abuse (with --abuse)"))


async def _chat(session: Any, url: str, key: str | None, i: int) -> tuple[int, float]:
    body = {"messages": [{"role": "user", "content": f"Request {i}: name three colours."}], "max_tokens": 16, "ignore_eos": True}
    t = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body, headers=bearer(key)) as r:
        await r.read()
        return r.status, time.perf_counter() - t


async def _health(session: Any, url: str) -> float:
    t = time.perf_counter()
    async with session.get(url + "/health") as r:
        await r.read()
    return time.perf_counter() - t


@asynccontextmanager
async def _sources(url: str, n: int, per_client: int) -> AsyncIterator[list[Any]]:
    """Client sessions for a burst of n connections: on a loopback server, as many source
    addresses (127.0.0.1, .2, ...) as keep each under the server's per-client connection cap,
    so the burst measures admission, not the connection limit."""
    import aiohttp

    k = math.ceil(n / max(per_client - 8, 1)) if urlparse(url).hostname in ("127.0.0.1", "localhost") else 1
    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, local_addr=(f"127.0.0.{i + 1}", 0) if k > 1 else None),
                                      timeout=aiohttp.ClientTimeout(total=600)) for i in range(min(k, 250))]
    try:
        yield sessions
    finally:
        for sess in sessions:
            await sess.close()


async def overload(session: Any, args: argparse.Namespace, key: str | None) -> dict[str, Any]:
    async with session.get(args.url + "/server_info", headers=bearer(key)) as r:
        info = await r.json()
    cap = info["max_queued_requests"]
    n = int(cap * args.burst_factor)
    unloaded = [(await _chat(session, args.url, key, -i))[1] for i in range(1, 4)]
    async with _sources(args.url, n, info.get("max_connections_per_client", n + 8)) as ss:
        floor = await asyncio.gather(*(_health(ss[i % len(ss)], args.url) for i in range(n)))  # the same burst of no-op requests
        m0 = await scrape(session, args.url, key)
        results = await asyncio.gather(*(_chat(ss[i % len(ss)], args.url, key, i) for i in range(n)))
        m1 = await scrape(session, args.url, key)
    rss0, rss1 = ((m.get("process_resident_memory_bytes", float("nan")) + m.get("radixserve_engine_resident_memory_bytes", 0)) / 2**20
                  for m in (m0, m1))  # the server's process and its engine process together
    name = "radixserve_rejection_latency_seconds"
    rejected = [t for s, t in results if s in (429, 503)]
    accepted = [t for s, t in results if s == 200]
    other = sorted({s for s, _ in results} - {200, 429, 503})
    return {"queue_capacity": cap, "sent": n, "sources": len(ss), "accepted": len(accepted), "rejected": len(rejected),
            "other_statuses": other,
            "reject_p50_ms": 1e3 * percentile(rejected, 0.5), "reject_p99_ms": 1e3 * percentile(rejected, 0.99),
            "noop_burst_p50_ms": 1e3 * percentile(floor, 0.5), "noop_burst_p99_ms": 1e3 * percentile(floor, 0.99),
            "accepted_p50_s": percentile(accepted, 0.5), "accepted_p99_s": percentile(accepted, 0.99),
            "unloaded_s": statistics.median(unloaded), "rss_before_mb": rss0, "rss_after_mb": rss1,
            "server_reject_p50_ms": 1e3 * (histogram_quantile(0.5, m0, m1, name) or float("nan")),
            "server_reject_p99_ms": 1e3 * (histogram_quantile(0.99, m0, m1, name) or float("nan"))}


async def _ttft(session: Any, url: str, key: str | None, text: str) -> tuple[float, int]:
    """Time to the first streamed token, and the prompt tokens served from cache."""
    body = {"text": text, "stream": True, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    t = time.perf_counter()
    first, cached = None, 0
    async with session.post(url + "/generate", json=body, headers=bearer(key)) as r:
        if r.status != 200:
            raise RuntimeError(f"isolation: /generate answered {r.status}: {await r.text()}")
        async for line in r.content:
            if line.startswith(b"data: {"):
                first = first or time.perf_counter() - t
                cached = json.loads(line[6:])["meta_info"]["cached_tokens"]
    return first or float("nan"), cached


async def _has_disk_tier(session: Any, url: str, key: str | None) -> bool:
    async with session.get(url + "/server_info", headers=bearer(key)) as r:
        info = await r.json()
    return r.status == 200 and info.get("kv_tiers", {}).get("disk") is not None


async def _flush_pool(session: Any, url: str, key: str | None) -> None:
    async with session.post(url + "/flush_cache?keep_disk=1", headers=bearer(key)) as r:
        if r.status != 200:
            raise RuntimeError(f"isolation: /flush_cache?keep_disk=1 answered {r.status}: {await r.text()} "
                               "(the disk rows need the first key to be an admin's)")


async def isolation(session: Any, args: argparse.Namespace, keys: list[str | None]) -> dict[str, Any]:
    a, b = keys
    rows: dict[str, list[tuple[float, int]]] = {"A cold": [], "A hit (same tenant)": [], "B, A's prompt (other tenant)": []}
    disk = await _has_disk_tier(session, args.url, a)
    if disk:
        rows |= {"A from disk (pool flushed)": [], "B, A's prompt on disk (other tenant)": []}
    words = ("the quick brown fox jumps over the lazy dog while agents call tools and read json " * 200).split()

    def fresh() -> str:
        return f"[{uuid.uuid4().hex}] " + " ".join(words[: args.prompt_words])

    for _ in range(args.trials):
        prompt = fresh()
        rows["A cold"].append(await _ttft(session, args.url, a, prompt + " Question one?"))
        rows["A hit (same tenant)"].append(await _ttft(session, args.url, a, prompt + " Question two?"))
        rows["B, A's prompt (other tenant)"].append(await _ttft(session, args.url, b, prompt + " Question two?"))
        if disk:  # B has sent the first prompt: the disk rows need one only A has sent
            prompt = fresh()
            await _ttft(session, args.url, a, prompt + " Question one?")
            await _flush_pool(session, args.url, a)  # its blocks are written first
            rows["A from disk (pool flushed)"].append(await _ttft(session, args.url, a, prompt + " Question two?"))
            await _flush_pool(session, args.url, a)
            rows["B, A's prompt on disk (other tenant)"].append(await _ttft(session, args.url, b, prompt + " Question two?"))
    out = {}
    for name, r in rows.items():
        ttfts = [t for t, _ in r]
        out[name] = {"ttft_p50_ms": 1e3 * percentile(ttfts, 0.5), "ttft_p10_ms": 1e3 * percentile(ttfts, 0.1),
                     "ttft_p90_ms": 1e3 * percentile(ttfts, 0.9), "cached_tokens_median": statistics.median(c for _, c in r)}
    return out


def run(args: argparse.Namespace) -> int:
    import aiohttp

    if args.abuse:
        return abuse.run(args)
    keys: list[str | None] = args.keys.split(",") if args.keys else [None, None]
    if len(keys) != 2:
        raise ValueError("keys: give two API keys, comma-separated")

    async def main() -> dict[str, Any]:
        conn = aiohttp.TCPConnector(limit=0)  # the whole burst at once, not 100 connections at a time
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
            out = {"overload": await overload(session, args, keys[0])}
            if args.storm:
                out["storm"] = await hostile.storm(session, args.url, keys[0], keys[1], args.storm)
            if args.bombs:
                out["grammar_bomb"] = await hostile.grammar_bomb(session, args.url, keys[0], keys[1], args.bombs)
            out["isolation"] = await isolation(session, args, keys)
            return out

    out = asyncio.run(main())
    o = out["overload"]
    print(f"overload: {o['sent']} requests at once against a queue of {o['queue_capacity']}: {o['accepted']} accepted "
          f"(all completed: {not o['other_statuses']}), {o['rejected']} rejected in p50 {o['reject_p50_ms']:.1f} ms / "
          f"p99 {o['reject_p99_ms']:.1f} ms (the same burst of GET /health: p50 {o['noop_burst_p50_ms']:.1f} ms / "
          f"p99 {o['noop_burst_p99_ms']:.1f} ms)")
    print(f"  server-side (its histogram): rejected in p50 {o['server_reject_p50_ms']:.2f} ms / "
          f"p99 {o['server_reject_p99_ms']:.2f} ms")
    print(f"  accepted latency p50 {o['accepted_p50_s']:.2f} s, p99 {o['accepted_p99_s']:.2f} s (unloaded {o['unloaded_s']:.2f} s); "
          f"server RSS {o['rss_before_mb']:.0f} -> {o['rss_after_mb']:.0f} MiB")
    hostile.report(out.get("storm"), out.get("grammar_bomb"))
    if keys[0] is None:
        print("isolation: an open server has one tenant; the rows below compare the same tenant")
    print(f"{'isolation (TTFT over ' + str(args.trials) + ' trials)':<38}{'p50 ms':>9}{'p10 ms':>9}{'p90 ms':>9}{'cached':>8}")
    for name, r in out["isolation"].items():
        print(f"{name:<38}{r['ttft_p50_ms']:>9.1f}{r['ttft_p10_ms']:>9.1f}{r['ttft_p90_ms']:>9.1f}{r['cached_tokens_median']:>8.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **out}, f, indent=1)
    return 0
