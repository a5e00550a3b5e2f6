"""`radixserve bench abuse --url URL --keys KEY_A,KEY_B` (also `bench reliability --abuse`): can
one tenant hurt another? Measured against a running server over HTTP.

Tenant B runs a steady chat load alone (`--clients` clients, each sending its next streamed chat
of `--b-tokens` tokens when the last is answered, for `--duration` seconds): its solo TTFT and
TPOT, measured at the client. Then, one phase per shape, the same load again while tenant A
sends that shape (bench/abuse_shapes.py, from a process of its own so its client-side work never
delays B's timings): the Anthropic cache_control bomb, a regex that makes the model write the
tool-call parser's worst case, a 24 h retention flood, max-context prompts (A's legitimate heavy
load, at the same priority), thousands of idle connections, unread streams, and cheap malformed
requests (a huge cache_salt, a JSON body sent as text/plain, temperature 5). Last, B alone again:
how far the machine's noise moves the solo numbers.

Per phase: B's p50/p99 TTFT and TPOT and their ratio to solo, B's and A's outcomes (2xx served,
4xx refused, 503/429 shed, other 5xx, client-side: timeouts, connections closed), whether the
server or its engine restarted (/metrics `process_start_time_seconds`, /server_info
`engine_pid`), the server process's RSS before and after (its engine process's beside it), and
the goals: B's p99 TTFT within 1.25x solo (2x under max-context load), every B request served,
no 5xx but load shedding's 503s to A, no restart, the RSS (sampled every second) never more
than 200 MiB over its level before the phase.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import queue
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from radixserve.bench import abuse_shapes, bearer, percentile
from radixserve.bench.abuse_report import report
from radixserve.bench.prom import scrape

# knob: (type, full size, --quick size, help)
SIZES: dict[str, tuple[type, Any, Any, str]] = {
    "duration": (float, 30.0, 3.0, "seconds of B's load in each phase"),
    "clients": (int, 4, 2, "B's concurrent clients"),
    "b_tokens": (int, 32, 16, "tokens of each of B's answers"),
    "a_concurrency": (int, 4, 2, "A's concurrent senders in the floods (retention, max-context, malformed)"),
    "bomb_concurrency": (int, 1, 1, "A's concurrent senders of the cache_control and regex bombs"),
    "bomb_blocks": (int, 20000, 2000, "content blocks, each with cache_control, in one /v1/messages bomb"),
    "regex_spaces": (int, 1600, 200, "spaces after the tool-call open tag in the regex bomb"),
    "retention_words": (int, 2000, 200, "words of each 24 h-retained prompt"),
    "context_tokens": (int, 0, 0, "tokens of each max-context prompt (0: the server's window but 40)"),
    "idle_connections": (int, 2000, 200, "A's idle TCP connections (capped by this client's fd limit)"),
    "idle_sources": (int, 1, 1, "loopback source addresses A's idle connections come from (127.0.0.2...)"),
    "unread_streams": (int, 8, 4, "A's streams that are never read"),
    "unread_tokens": (int, 4000, 256, "tokens each unread stream asks for"),
    "salt_bytes": (int, 6 << 20, 64 << 10, "length of each distinct cache_salt"),
    "request_timeout": (float, 120.0, 60.0, "seconds before any one request counts as a timeout"),
    "settle_timeout": (float, 120.0, 60.0, "seconds to wait for the server to go idle between phases"),
    "lead_in": (float, 1.0, 0.5, "seconds A's shape runs before B's load starts"),
}
PHASES: dict[str, tuple[float, str]] = {  # name: (B's p99 TTFT bound, x solo; what A sends)
    "cache_control_bomb": (1.25, "Anthropic /v1/messages, every block marked cache_control"),
    "tool_regex_bomb": (1.25, "a regex forcing the tool-call open tag + spaces, streamed beside tools"),
    "retention_flood": (1.25, "distinct long prompts with prompt_cache_retention 24h"),
    "max_context": (2.0, "prompts filling the context window, same priority (legitimate heavy load)"),
    "idle_connections": (1.25, "TCP connections that send nothing or half a header"),
    "unread_streams": (1.25, "streams whose client never reads"),
    "malformed": (1.25, "a huge distinct cache_salt, a text/plain JSON body, temperature 5"),
}
RSS_GROWTH_MIB = 200.0


def add_knobs(p: Any) -> None:
    """The abuse bench's own options (a parser or an argument group), beside --url, --keys, --json."""
    p.add_argument("--quick", action="store_true", help="small sizes for every knob not given (a smoke run)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of: {', '.join(PHASES)}")
    p.add_argument("--admin-key", default=None, help="a key that may read /metrics and /server_info's engine_pid "
                                                     "(an admin tenant's or the --metrics-key; default: A's key)")
    for name, (kind, full, quick, text) in SIZES.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=f"{text} (default {full}; --quick {quick})")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--keys", default=None, help="tenant A's and tenant B's API keys, comma-separated; omit on an open server")
    p.add_argument("--json", default=None, help="write the results to this file")
    add_knobs(p)


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """args with every size knob not given set to its full (or --quick) default."""
    for name, (_, full, quick, _) in SIZES.items():
        if getattr(args, name, None) is None:
            setattr(args, name, quick if args.quick else full)
    unknown = set(args.phases.split(",")) - set(PHASES)
    if unknown:
        raise ValueError(f"phases: no phase {', '.join(sorted(unknown))}; the phases are {', '.join(PHASES)}")
    return args


# -- the server, as the admin key sees it ---------------------------------------------------------------
@dataclass
class Probe:
    up: bool
    rss_mb: float | None = None
    server_start: float | None = None
    engine_pid: int | None = None
    engine_rss_mb: float | None = None


async def _get_json(session: Any, url: str, key: str | None) -> tuple[int, dict[str, Any]]:
    async with session.get(url, headers=bearer(key)) as r:
        return r.status, (await r.json() if r.content_type == "application/json" else {})


def _rss_mb(m: dict[str, float]) -> float | None:
    """The server process's resident memory in MiB (what a request's body, its connection and its
    stream hold), from a /metrics scrape. NOTE: the engine process's is reported beside it but is
    no goal: its KV pool is allocated at start and its pages count as they are first written, so
    a phase that fills more of the pool than any before grows it by up to the pool's size."""
    rss = m.get("process_resident_memory_bytes")
    return None if rss is None else rss / 2**20


def _engine_rss_mb(m: dict[str, float]) -> float | None:
    rss = m.get("radixserve_engine_resident_memory_bytes")
    return None if rss is None else rss / 2**20


async def probe(session: Any, url: str, key: str | None) -> Probe:
    try:
        async with session.get(url + "/health") as r:
            up = r.status == 200
        m = await scrape(session, url, key)
        _, info = await _get_json(session, url + "/server_info", key)
    except Exception:  # the server is gone (or restarting): that is the finding
        return Probe(False)
    return Probe(up, _rss_mb(m), m.get("process_start_time_seconds"), info.get("engine_pid"), _engine_rss_mb(m))


async def watch_rss(session: Any, url: str, key: str | None, seen: list[float]) -> None:
    """Scrape the RSS every second into `seen` until cancelled (a bomb's memory may go back
    before the phase ends)."""
    while True:
        with contextlib.suppress(Exception):
            if (rss := _rss_mb(await scrape(session, url, key))) is not None:
                seen.append(rss)
        await asyncio.sleep(1.0)


def restarted(before: Probe, after: Probe) -> bool | None:
    """Whether the server or its engine process was replaced (None: this key sees neither)."""
    if not after.up:
        return True
    seen = [(b, a) for b, a in ((before.server_start, after.server_start), (before.engine_pid, after.engine_pid))
            if b is not None and a is not None]
    return any(b != a for b, a in seen) if seen else None


async def settle(session: Any, url: str, key: str | None, timeout: float) -> tuple[bool | None, float]:
    """Wait until nothing is queued or running: (idle, seconds waited); None: this key cannot see
    (then it waits a second)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        try:
            _, info = await _get_json(session, url + "/server_info", key)
        except Exception:
            return False, time.perf_counter() - t0
        if "in_flight" not in info:
            await asyncio.sleep(1.0)
            return None, time.perf_counter() - t0
        kv = info.get("kv", {})
        if info["in_flight"] == 0 and kv.get("running", 0) == 0 and kv.get("waiting", 0) == 0:
            return True, time.perf_counter() - t0
        await asyncio.sleep(0.2)
    return False, time.perf_counter() - t0


# -- tenant B's steady load ------------------------------------------------------------------------------
@dataclass
class BResult:
    status: str
    ttft: float | None = None
    tpot: float | None = None


async def b_request(session: Any, args: argparse.Namespace, key: str | None, i: int) -> BResult:
    """One streamed chat; TTFT at its first content (the role chunk comes at once; without any
    content, at the chunk after it), TPOT over the tokens after the first."""
    import aiohttp

    body = {"messages": [{"role": "user", "content": f"Request {i}: name three colours and say why."}],
            "max_tokens": args.b_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    chunks: list[float] = []  # when each chunk with choices came
    content_at: float | None = None
    tokens = 0
    try:
        async with session.post(args.url + "/v1/chat/completions", json=body, headers=bearer(key),
                                timeout=aiohttp.ClientTimeout(total=args.request_timeout)) as r:
            if r.status != 200:
                await r.read()
                return BResult(str(r.status))
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk, now = json.loads(line[6:]), time.perf_counter() - t0
                if "error" in chunk:
                    return BResult("error event")  # the stream was cut by the server
                if chunk.get("choices"):
                    chunks.append(now)
                    content_at = now if content_at is None and chunk["choices"][0]["delta"].get("content") else content_at
                tokens = chunk["usage"]["completion_tokens"] if chunk.get("usage") else tokens
    except TimeoutError:
        return BResult("timeout")
    except (aiohttp.ClientError, OSError, ValueError, KeyError, IndexError) as e:  # dropped, or a malformed chunk
        return BResult(type(e).__name__)
    end = time.perf_counter() - t0
    ttft = content_at if content_at is not None else chunks[1] if len(chunks) > 1 else None
    return BResult("200", ttft, (end - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None)


async def b_load(session: Any, args: argparse.Namespace, key: str | None) -> list[BResult]:
    out: list[BResult] = []
    deadline = time.perf_counter() + args.duration
    count = iter(range(1 << 62))

    async def client() -> None:
        while time.perf_counter() < deadline:
            out.append(r := await b_request(session, args, key, next(count)))
            if r.status != "200":
                await asyncio.sleep(0.05)  # a refusal or a dead server: counted, not spun on

    await asyncio.gather(*(client() for _ in range(args.clients)))
    return out


def b_summary(results: list[BResult]) -> dict[str, Any]:
    ttft = [r.ttft for r in results if r.ttft is not None]
    tpot = [r.tpot for r in results if r.tpot is not None]
    ms = 1e3
    return {"sent": len(results), "served": sum(r.status == "200" for r in results),
            "statuses": dict(Counter(r.status for r in results)),
            "ttft_p50_ms": ms * percentile(ttft, 0.5), "ttft_p99_ms": ms * percentile(ttft, 0.99),
            "tpot_p50_ms": ms * percentile(tpot, 0.5), "tpot_p99_ms": ms * percentile(tpot, 0.99)}


# -- tenant A, one shape a phase -------------------------------------------------------------------------
def a_summary(outcomes: dict[str, int]) -> dict[str, int]:
    """Outcomes by class: 2xx served, 4xx refused, 503/429 shed (load shedding, a refusal),
    other 5xx, and client-side ones (timeouts, closed or held connections)."""
    out = Counter[str]()
    for key, n in outcomes.items():
        status = key.rsplit(":", 1)[-1]
        code = int(status) if status.isdigit() else 0
        cls = ("served" if 200 <= code < 300 else "shed" if code in (429, 503) else "refused" if 400 <= code < 500
               else "5xx" if code >= 500 else "other")
        out[cls] += n
    return {k: out[k] for k in ("served", "refused", "shed", "5xx", "other")}


@dataclass
class AResult:
    outcomes: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    samples: dict[str, str] = field(default_factory=dict)


async def attack(a: abuse_shapes.Attack, shape: str, args: argparse.Namespace, during: Any) -> tuple[Any, AResult]:
    """Run `during` (a coroutine: B's load) while A sends `shape` from its own process; then
    A's last requests get `request_timeout` seconds. Returns during's result and A's."""
    ctx = multiprocessing.get_context("forkserver")  # a fresh process (no copy of this one's loop), quick to start
    ctx.set_forkserver_preload(["aiohttp", "radixserve.bench.abuse_shapes"])
    stop, ready, results = ctx.Event(), ctx.Event(), ctx.Queue()
    grace = args.request_timeout + 5
    proc = ctx.Process(target=abuse_shapes.attack_main, args=(a, shape, stop, ready, results, grace), daemon=True)
    proc.start()
    late: list[str] = []
    try:
        if not await asyncio.to_thread(ready.wait, 60):
            late.append("A's process did not start within 60 s")
        await asyncio.sleep(args.lead_in)
        got = await during
    finally:
        stop.set()
    try:
        a_result = AResult(*await asyncio.to_thread(results.get, True, grace + 30))
    except queue.Empty:  # A's process died or hung: reported, B's numbers still stand
        a_result = AResult({"bench error: A's process gave no result": 1})
    finally:
        await asyncio.to_thread(proc.join, 10)
        if proc.is_alive():
            proc.kill()
    a_result.notes[:0] = late
    return got, a_result


async def phase(session: Any, args: argparse.Namespace, keys: list[str | None], a: abuse_shapes.Attack | None,
                name: str) -> dict[str, Any]:
    """One phase: settle, probe, B's load (beside A's shape unless a is None), settle, probe."""
    admin = args.admin_key or keys[0]
    t0 = time.perf_counter()
    await settle(session, args.url, admin, args.settle_timeout)
    before = await probe(session, args.url, admin)
    if not before.up:
        return {"skipped": "the server is down"}
    a_result, seen = AResult(), list[float]()
    watcher = asyncio.ensure_future(watch_rss(session, args.url, admin, seen))
    try:
        if a is None:
            b = await b_load(session, args, keys[1])
        else:
            b, a_result = await attack(a, name, args, b_load(session, args, keys[1]))
        settled, busy = await settle(session, args.url, admin, args.settle_timeout)  # A's hang-ups served or aborted
    finally:
        watcher.cancel()
    after = await probe(session, args.url, admin)
    growth = peak = None
    if after.rss_mb is not None and before.rss_mb is not None:
        growth, peak = after.rss_mb - before.rss_mb, max([after.rss_mb, *seen]) - before.rss_mb
    return {"b": b_summary(b), "a_outcomes": a_result.outcomes, "a": a_summary(a_result.outcomes),
            "a_samples": a_result.samples, "notes": a_result.notes,
            "settled_after": settled, "busy_after_s": busy, "restarted": restarted(before, after),
            "before": asdict(before), "after": asdict(after), "rss_growth_mb": growth, "rss_peak_growth_mb": peak,
            "wall_s": time.perf_counter() - t0}


def ratios(b: dict[str, Any], solo: dict[str, Any]) -> dict[str, float]:
    """B's latencies over its solo run's (nan where either is missing)."""
    keys = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
    return {k.removesuffix("_ms"): b[k] / solo[k] if solo[k] > 0 else float("nan") for k in keys}


def goals(row: dict[str, Any], limit: float) -> dict[str, bool | None]:
    """Each goal: True (met), False (missed), None (not measurable here)."""
    b, a, ratio = row["b"], row["a"], row["x_solo"]["ttft_p99"]
    b_5xx = sum(n for s, n in b["statuses"].items() if s.isdigit() and int(s) >= 500)
    growth = row["rss_peak_growth_mb"]
    return {f"B p99 TTFT <= {limit:g}x solo": None if ratio != ratio else ratio <= limit,
            "B all served": b["sent"] > 0 and b["served"] == b["sent"],
            "no 5xx": a["5xx"] == 0 and b_5xx == 0,
            "no restart": None if row["restarted"] is None else not row["restarted"],
            f"RSS peak growth <= {RSS_GROWTH_MIB:g} MiB": None if growth is None else growth <= RSS_GROWTH_MIB}


async def _server(session: Any, url: str, key: str | None) -> dict[str, Any]:
    try:
        status, info = await _get_json(session, url + "/server_info", key)
    except Exception as e:  # aiohttp's errors and a timeout alike
        raise ValueError(f"url: cannot reach the server at {url}: {type(e).__name__}: {e}") from e
    if status != 200:
        raise ValueError(f"url: GET /server_info answered {status}: {info}")
    return info


async def main(args: argparse.Namespace, keys: list[str | None]) -> dict[str, Any]:
    import aiohttp

    names = args.phases.split(",")
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)  # the probes' (B's requests set their own)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        info = await _server(session, args.url, keys[0])
        a = abuse_shapes.Attack(args.url, keys[0], info["model"], info["max_context_len"], info["vocab_size"],
                                info.get("tool_call_parser") or "hermes", args)
        await b_load(session, argparse.Namespace(**{**vars(args), "duration": min(args.duration, 2.0)}), keys[1])  # warm-up
        out: dict[str, Any] = {"server": {k: info.get(k) for k in ("model", "max_context_len", "tool_call_parser")},
                               "open_server": keys[0] is None, "solo": await phase(session, args, keys, None, "solo"),
                               "phases": {}}
        for name in names:
            out["phases"][name] = await phase(session, args, keys, a, name)
        out["solo_again"] = await phase(session, args, keys, None, "solo")
    for name, row in [*out["phases"].items(), ("solo_again", out["solo_again"])]:
        if "b" in row and "b" in out["solo"]:
            row["x_solo"] = ratios(row["b"], out["solo"]["b"])
            if name in PHASES:
                row["goals"] = goals(row, PHASES[name][0])
    return out


def run(args: argparse.Namespace) -> int:
    args = resolve(args)
    keys: list[str | None] = args.keys.split(",") if args.keys else [None, None]
    if len(keys) != 2:
        raise ValueError("keys: give two API keys, tenant A's then tenant B's, comma-separated")
    out = asyncio.run(main(args, keys))
    report(out, args, {name: what for name, (_, what) in PHASES.items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **out}, f, indent=1)
    return 0
