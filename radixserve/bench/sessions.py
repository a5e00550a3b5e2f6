"""`radixserve bench sessions`: an agent session that outlives the pool and the server.

One run starts its own `radixserve serve` with a disk tier (--kv-disk-dir, a fresh directory
unless given) and a pool sized so that other traffic evicts the session. The agent has a long
system prompt and a tool catalogue (~16,000 tokens at --scale 1, scaled down to fit the model's
context window). Its first turn runs; then its returning turn (the first turn, its answer and a
follow-up question) is timed to first token, streamed over the chat API:

    (d) cold      the same tokens in a fresh namespace (cache_salt): the whole prompt prefilled
    (a) pool      the session's prefix still in the pool
    (b) disk      after other traffic (--other distinct prompts) evicted it (and the disk tier has
                  written that traffic's blocks): read back from disk
    (c) restart   after the server is killed (-9) and started again on the same directory

Each server first answers an unrelated ~1,500-token prompt (first-call costs are not measured).
Every returning turn is greedy; their answers must be identical. Printed: each TTFT, (d)/(b) and
(d)/(c) (the goal is 10x on SmolLM2), the tokens each took from the disk tier, and what bounds
(b) and (c): the bytes read back (the KV of every token in every layer) against the prefill
compute they replace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

from radixserve.bench.prefix import documentation

TOKENS_AT_SCALE_1 = 16_000
CHARS_PER_TOKEN = 4.6  # SmolLM2's tokenizer on `documentation` text


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a model folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--scale", type=float, default=1.0, help="the agent's prompt is ~16,000 tokens x scale (cut to the context window)")
    p.add_argument("--other", type=int, default=3, help="distinct prompts of other traffic, each ~0.6x the session's")
    p.add_argument("--kv-disk-dir", default=None, help="the disk tier's directory (default: a fresh temporary one)")
    p.add_argument("--port", type=int, default=30123)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.add_argument("--serve-arg", action="append", default=[], help="one more argument for `radixserve serve` (repeat)")


class Server:
    """`radixserve serve` in a process group of its own, for a bench (`bench`: its name in messages)."""

    def __init__(self, args: argparse.Namespace, flags: list[str], bench: str = "sessions") -> None:
        cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(args.port),
               *(["--model", args.model] if args.model else []), *flags, *args.serve_arg]
        self.url, self.bench = f"http://127.0.0.1:{args.port}", bench
        self.log = tempfile.NamedTemporaryFile(prefix=f"radixserve-{bench}-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    @classmethod
    def on_disk(cls, args: argparse.Namespace, disk: str, pool_tokens: int | None) -> Server:
        return cls(args, ["--kv-disk-dir", disk, *(["--kv-cache-tokens", str(pool_tokens)] if pool_tokens else [])])

    async def ready(self, session: Any, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"bench {self.bench}: the server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                async with session.get(self.url + "/health") as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            await asyncio.sleep(0.3)
        raise SystemExit(f"bench {self.bench}: the server did not become ready")

    def stop(self) -> None:
        """SIGTERM (its drain), then SIGKILL if it has not gone in a minute."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def kill(self) -> None:
        """kill -9: the server and its engine process, no goodbye (a crash)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def agent(rng: random.Random, tokens: int) -> tuple[str, list[dict[str, Any]]]:
    """A system prompt and a tool catalogue of about `tokens` tokens together (a fifth tools)."""
    tools: list[dict[str, Any]] = []
    while len(json.dumps(tools)) < tokens * CHARS_PER_TOKEN / 5:
        i = len(tools)
        tools.append({"type": "function", "function": {
            "name": f"tool_{i}", "description": documentation(rng, 3),
            "parameters": {"type": "object", "properties": {f"arg_{j}": {"type": "string", "description": documentation(rng, 1)}
                                                              for j in range(3)}, "required": ["arg_0"]}}})
    system = "You are an agent with tools. Read the manual below before you act.\n\n"
    while len(system) < tokens * CHARS_PER_TOKEN * 4 / 5:
        system += documentation(rng, 10)
    return system, tools


async def turn(session: Any, url: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
               max_tokens: int, salt: str | None = None) -> tuple[float, str, dict[str, Any]]:
    """(seconds to the first content, the whole answer, usage), streamed."""
    body = {"messages": messages, "tools": tools, "tool_choice": "none", "max_tokens": max_tokens, "temperature": 0.0,
            **({"cache_salt": salt} if salt else {})}
    return await stream_chat(session, url, body)


async def stream_chat(session: Any, url: str, body: dict[str, Any], bench: str = "sessions") -> tuple[float, str, dict[str, Any]]:
    """A chat request streamed: (seconds to the first content, the whole answer, usage)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first: float | None = None
    text, usage = "", {}
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise SystemExit(f"bench {bench}: {r.status} {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                piece = c.get("delta", {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - t0
                text += piece
    return (first if first is not None else time.perf_counter() - t0), text, usage


async def count(session: Any, url: str, system: str, tools: list[dict[str, Any]], ask: dict[str, Any]) -> int:
    """The prompt's tokens as the server renders it (Anthropic's count_tokens: no generation)."""
    body = {"model": "", "system": system, "messages": [ask],
            "tools": [{"name": t["function"]["name"], "description": t["function"]["description"],
                       "input_schema": t["function"]["parameters"]} for t in tools]}
    async with session.post(url + "/v1/messages/count_tokens", json=body) as r:
        return int((await r.json())["input_tokens"])


async def warm(session: Any, url: str, rng: random.Random) -> None:
    """A fresh server's first-call costs (kernels met for the first time at a long context) are
    not what is measured: each server first answers an unrelated ~1,500-token prompt."""
    await turn(session, url, [{"role": "user", "content": documentation(rng, 120)}], [], 2, salt=f"warm-{uuid.uuid4().hex}")


async def info(session: Any, url: str) -> dict[str, Any]:
    async with session.get(url + "/server_info") as r:
        return dict(await r.json())


def disk_hits(before: dict[str, Any], after: dict[str, Any]) -> int:
    """Prompt tokens the disk tier served between two /server_info reads."""
    def hits(i: dict[str, Any]) -> int:
        return int(i["kv_tiers"].get("disk", {}).get("cache_hit_prompt_tokens", 0))
    return hits(after) - hits(before)


async def _wait_written(session: Any, url: str) -> None:
    """Until the disk tier's writer has caught up (its written tokens stop growing)."""
    last = -1
    while True:
        written = (await info(session, url))["kv_tiers"]["disk"]["written_tokens"]
        if written == last:
            return
        last = written
        await asyncio.sleep(0.5)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    disk = args.kv_disk_dir or os.path.join(tempfile.mkdtemp(prefix="radixserve-sessions-"), "kv")
    rng = random.Random(args.seed)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        probe = Server.on_disk(args, disk, None)  # first: the context window and a token count, to size the prompt and the pool
        ask = {"role": "user", "content": "Which tool lists the files? Say why."}
        try:
            await probe.ready(session)
            context = (await info(session, probe.url))["max_context_len"]
            tokens = min(int(TOKENS_AT_SCALE_1 * args.scale), context - 600)
            system, tools = agent(random.Random(args.seed), tokens)
            got = await count(session, probe.url, system, tools, ask)  # the chars-per-token guess, corrected once
            system, tools = agent(random.Random(args.seed), int(tokens * tokens / got))
        finally:
            probe.kill()
        first_turn = [{"role": "system", "content": system}, ask]
        server = Server.on_disk(args, disk, int(tokens * 1.6) + 2048)
        try:
            await server.ready(session)
            await warm(session, server.url, rng)
            _, answer, usage1 = await turn(session, server.url, first_turn, tools, 32)
            prompt_tokens = usage1["prompt_tokens"]
            back = [*first_turn, {"role": "assistant", "content": answer}, {"role": "user", "content": "And then? Be brief."}]
            runs: dict[str, dict[str, Any]] = {}

            async def timed(name: str, salt: str | None = None) -> None:
                before = await info(session, server.url)
                ttft, text, usage = await turn(session, server.url, back, tools, args.max_tokens, salt)
                after = await info(session, server.url)
                details = usage.get("prompt_tokens_details") or {}
                runs[name] = {"ttft_s": ttft, "answer": text, "prompt_tokens": usage.get("prompt_tokens"),
                              "cached_tokens": details.get("cached_tokens", 0), "from_disk_tokens": disk_hits(before, after)}
                print(f"  {name:8s} TTFT {ttft * 1000:9.1f} ms  cached {runs[name]['cached_tokens']:6d}  "
                      f"from disk {runs[name]['from_disk_tokens']:6d}", flush=True)

            await timed("cold", salt=f"cold-{uuid.uuid4().hex}")
            await timed("pool")
            await _wait_written(session, server.url)
            for i in range(args.other):  # other traffic, distinct prompts: the session leaves the pool
                other = [{"role": "system", "content": documentation(rng, int(tokens * 0.6 * CHARS_PER_TOKEN / 60))},
                         {"role": "user", "content": f"Question {i}?"}]
                await turn(session, server.url, other, [], 2)
            await _wait_written(session, server.url)  # the other prompts' blocks written: not a load's competitor
            await timed("disk")
            await _wait_written(session, server.url)
            bytes_per_token = (await info(session, server.url))["kv_bytes_per_token"]
        finally:
            server.kill()
        server = Server.on_disk(args, disk, int(tokens * 1.6) + 2048)
        try:
            await server.ready(session)
            await warm(session, server.url, rng)
            await timed("restart")
        finally:
            server.kill()
    cold = runs["cold"]["ttft_s"]
    return {"prompt_tokens": prompt_tokens, "kv_bytes_per_token": bytes_per_token, "disk_dir": disk, "runs": runs,
            "speedup_disk": cold / runs["disk"]["ttft_s"], "speedup_restart": cold / runs["restart"]["ttft_s"],
            "speedup_pool": cold / runs["pool"]["ttft_s"],
            "answers_identical": len({r["answer"] for r in runs.values()}) == 1}


def run(args: argparse.Namespace) -> int:
    r = asyncio.run(measure(args))
    runs = r["runs"]
    gb = r["runs"]["disk"]["from_disk_tokens"] * r["kv_bytes_per_token"] / 1e9
    print(f"\nan agent session of {r['prompt_tokens']:,} prompt tokens (KV {r['kv_bytes_per_token']:,} bytes per token)")
    print("| returning turn | TTFT ms | prompt tokens from the cache | of them from disk | vs cold |")
    print("|---|---:|---:|---:|---:|")
    for name, label in (("cold", "(d) cold prefill"), ("pool", "(a) from the pool"), ("disk", "(b) from disk, after eviction"),
                        ("restart", "(c) after a kill -9 and restart")):
        x = runs[name]
        print(f"| {label} | {x['ttft_s'] * 1000:,.0f} | {x['cached_tokens']:,} | {x['from_disk_tokens']:,} | "
              f"{runs['cold']['ttft_s'] / x['ttft_s']:.1f}x |")
    print(f"\ndisk {r['speedup_disk']:.1f}x and restart {r['speedup_restart']:.1f}x faster than cold (goal 10x); "
          f"{gb:.2f} GB of KV read back; greedy answers identical: {r['answers_identical']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0 if r["answers_identical"] else 1
