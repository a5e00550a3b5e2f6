"""The hostile parts of `radixserve bench reliability`: a mixed storm and a grammar bomb.

- Storm: after a warm-up round of the same storm (the KV pool's first touch) and a cache
  flush, tenant A opens `--storm` streams at once (a quarter read to the end, a quarter vanish
  after a few chunks, a quarter read slowly, a quarter send grammars that cannot compile in
  time or nest too deep) while tenant B sends plain chats one after another. Reports B's
  latency against its unloaded latency, A's statuses, and afterwards the integrity check, the
  queue counters and the server's RSS against its baseline.
- Grammar bomb: tenant A sends `--bombs` regexes whose automaton explodes and one schema whose
  expansion eats memory, all at once; at the same moment B asks for a trivial regex. Reports
  how B's grammar fared and the time from the bombs' 400s until a plain request is served at
  its unloaded latency again.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
import uuid
from collections import Counter
from typing import Any

from radixserve.bench import bearer, percentile
from radixserve.bench.prom import scrape

MEMORY_BOMB = {"type": "array", "minItems": 50, "items": {"type": "array", "minItems": 50, "items": {"type": "array",
               "minItems": 50}}}  # refused by xgrammar; outlines-core expands it without end


def _regex_bomb() -> str:
    tag = "".join(random.choice("cdefgh") for _ in range(8))  # a fresh spec: no compile-cache hit
    return f"(?i)[ab]*a[ab]{{18}}x{tag}"


def _chat_body(text: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "ignore_eos": True, **extra}


async def plain(session: Any, url: str, key: str | None) -> tuple[int, float]:
    t = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=_chat_body("Name three colours.", 16), headers=bearer(key)) as r:
        await r.read()
        return r.status, time.perf_counter() - t


async def _stream(session: Any, url: str, key: str | None, kind: str, i: int) -> str:
    body = _chat_body(f"Storm request {i}: tell a story.", 32, stream=True)
    if kind == "grammar":
        regex = (i // 4) % 2 == 0
        body["regex" if regex else "response_format"] = _regex_bomb() if regex else {
            "type": "json_schema", "json_schema": {"name": "b", "schema": {**MEMORY_BOMB, "title": uuid.uuid4().hex}}}
    stop_after = random.randint(1, 5) if kind == "vanish" else None
    try:
        async with session.post(url + "/v1/chat/completions", json=body, headers=bearer(key)) as r:
            chunks = 0
            async for _ in r.content:
                chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    r.close()  # the client vanishes mid-stream
                    return "vanished"
                if kind == "slow":
                    await asyncio.sleep(0.05)
            return str(r.status)
    except Exception as e:  # a client-side failure is an outcome to count, not a crash
        return type(e).__name__


async def _rss_mb(session: Any, url: str, key: str | None) -> float | None:
    m = await scrape(session, url, key)  # the server's process and its engine process together
    value = m.get("process_resident_memory_bytes")
    if value is not None:
        value += m.get("radixserve_engine_resident_memory_bytes", 0)
    return value / 2**20 if value is not None else None


async def _settle(session: Any, url: str, key: str | None) -> dict[str, Any]:
    """Wait (up to 60 s) until nothing is queued or running; then the integrity check."""
    for _ in range(600):
        async with session.get(url + "/server_info", headers=bearer(key)) as r:
            info = await r.json()
        kv = info.get("kv", {})
        if info.get("in_flight", 0) == 0 and kv.get("running", 0) == 0 and kv.get("waiting", 0) == 0:
            break
        await asyncio.sleep(0.1)
    async with session.get(url + "/server_info?check_integrity=1", headers=bearer(key)) as r:
        return await r.json()


async def _flush(session: Any, url: str, key: str | None) -> None:
    async with session.post(url + "/flush_cache", headers=bearer(key)) as r:
        await r.read()


async def _storm_round(session: Any, url: str, a: str | None, b: str | None, n: int) -> tuple[Counter, list[tuple[int, float]]]:
    kinds = ("read", "vanish", "slow", "grammar")
    tasks = [asyncio.ensure_future(_stream(session, url, a, kinds[i % 4], i)) for i in range(n)]
    b_results: list[tuple[int, float]] = []
    while not all(t.done() for t in tasks):
        b_results.append(await plain(session, url, b))
    return Counter(f"{kinds[i % 4]}:{t.result()}" for i, t in enumerate(tasks)), b_results


async def storm(session: Any, url: str, a: str | None, b: str | None, n: int) -> dict[str, Any]:
    """A is an admin key: it checks the pool and flushes the cache, so that the round measured
    reuses the KV slots a warm-up round touched first (RSS then shows leaks, not first touch)."""
    unloaded = [(await plain(session, url, b))[1] for _ in range(3)]
    await _storm_round(session, url, a, b, n)  # warm-up: the KV pool's first touch, compiled grammars, buffers
    await _settle(session, url, a)
    await _flush(session, url, a)
    rss0 = await _rss_mb(session, url, a)
    outcomes, b_results = await _storm_round(session, url, a, b, n)
    info = await _settle(session, url, a)
    await _flush(session, url, a)
    await asyncio.sleep(1.0)  # let freed memory go back
    rss1 = await _rss_mb(session, url, a)
    b_ok = [t for s, t in b_results if s == 200]
    return {"streams": n, "outcomes": dict(sorted(outcomes.items())), "b_sent": len(b_results), "b_ok": len(b_ok),
            "b_p50_s": percentile(b_ok, 0.5), "b_p99_s": percentile(b_ok, 0.99), "b_unloaded_s": statistics.median(unloaded),
            "integrity": info.get("integrity"), "queued_after": info.get("queued"), "in_flight_after": info.get("in_flight"),
            "rss_before_mb": rss0, "rss_after_mb": rss1}


async def grammar_bomb(session: Any, url: str, a: str | None, b: str | None, bombs: int) -> dict[str, Any]:
    unloaded = statistics.median([(await plain(session, url, b))[1] for _ in range(3)])

    async def bomb(body: dict[str, Any]) -> tuple[int, float]:
        t = time.perf_counter()
        async with session.post(url + "/v1/chat/completions", json=body, headers=bearer(a)) as r:
            await r.read()
            return r.status, time.perf_counter() - t

    t0 = time.perf_counter()
    sent = [bomb(_chat_body("x", 8, regex=_regex_bomb())) for _ in range(bombs)]
    schema = {**MEMORY_BOMB, "title": uuid.uuid4().hex}
    sent.append(bomb(_chat_body("x", 8, response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": schema}})))
    bomb_tasks = [asyncio.ensure_future(x) for x in sent]
    await asyncio.sleep(0.2)  # the bombs hold the compilers now
    trivial = await bomb_trivial(session, url, b)
    bomb_results = await asyncio.gather(*bomb_tasks)
    answered = time.perf_counter()
    recovery, attempts = None, 0
    while recovery is None and time.perf_counter() - answered < 120:
        status, latency = await plain(session, url, b)
        attempts += 1
        if status == 200 and latency <= 1.5 * unloaded:
            recovery = time.perf_counter() - answered
    return {"bombs": bombs + 1, "bomb_statuses": sorted(s for s, _ in bomb_results),
            "bombs_answered_s": answered - t0, "trivial_status": trivial[0], "trivial_s": trivial[1],
            "unloaded_s": unloaded, "recovery_s": recovery, "recovery_attempts": attempts}


async def bomb_trivial(session: Any, url: str, key: str | None) -> tuple[int, float]:
    """Tenant B's trivial constrained request, sent while A's bombs compile."""
    t = time.perf_counter()
    body = _chat_body("Three digits:", 4, regex="[0-9]{3}")
    async with session.post(url + "/v1/chat/completions", json=body, headers=bearer(key)) as r:
        text = await r.text()
        status = r.status
    if status != 200:
        print(f"  B's trivial regex got {status}: {json.loads(text).get('error', {}).get('message')}")
    return status, time.perf_counter() - t


def report(st: dict[str, Any] | None, gb: dict[str, Any] | None) -> None:
    if st is not None:
        print(f"storm: {st['streams']} streams from tenant A (read / vanish / slow / bad grammar): {st['outcomes']}")
        print(f"  tenant B meanwhile: {st['b_ok']} of {st['b_sent']} plain chats completed, p50 {st['b_p50_s']:.2f} s / "
              f"p99 {st['b_p99_s']:.2f} s (unloaded {st['b_unloaded_s']:.2f} s)")
        print(f"  afterwards: integrity {st['integrity']}, queued {st['queued_after']}, in flight {st['in_flight_after']}, "
              f"RSS {st['rss_before_mb']:.0f} -> {st['rss_after_mb']:.0f} MiB")
    if gb is not None:
        rec = "never (120 s)" if gb["recovery_s"] is None else f"{gb['recovery_s']:.2f} s"
        print(f"grammar bomb: {gb['bombs']} bombs from tenant A answered {gb['bomb_statuses']} after {gb['bombs_answered_s']:.1f} s; "
              f"B's trivial regex meanwhile: {gb['trivial_status']} in {gb['trivial_s']:.2f} s; a plain request is served at its "
              f"unloaded latency ({gb['unloaded_s']:.2f} s) again {rec} after the bombs' answers")
