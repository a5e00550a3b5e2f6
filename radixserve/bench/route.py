"""`radixserve bench route`: prefix-affinity routing vs round-robin vs random, on data-parallel
replicas (`DataParallelEngine`, one engine process each), in one run.

Workloads (each policy runs them on flushed caches, in the same processes):
- fork: `--agents` agents, each with its own long system prompt, fork `--branches` calls off
  it, every call of every agent sent at once;
- multi-turn: `--conversations` conversations of `--turns` turns, each turn re-sending the
  whole history (previous prompts and the model's own answers) plus a new question; the turns
  of all conversations run together, turn after turn.

Reported from each replica's own stats: prompt tokens, tokens served from the prefix cache
(hit rate), prefill tokens computed, and requests per replica. On a 2-core CPU the replicas
share the cores, so throughput says nothing here (it would on one GPU per replica): the
counts are the result. Also: the router index's memory per block (tracemalloc), for sizing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
import tracemalloc
from typing import Any

from radixserve.bench.prefix import QUESTIONS, system_prompt
from radixserve.cli_args import add_engine_args, engine_kwargs
from radixserve.config import ROUTER_POLICIES, RouterConfig
from radixserve.routing import PrefixIndex, block_hashes, make_router

COMPARED = ("prefix", "round_robin", "random")


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--replicas", type=int, default=2, help="data-parallel replicas (engine processes)")
    p.add_argument("--policies", default=",".join(COMPARED), help=f"comma-separated, from {', '.join(ROUTER_POLICIES)}")
    p.add_argument("--agents", type=int, default=4, help="fork: agents, each with its own system prompt")
    p.add_argument("--branches", type=int, default=8, help="fork: calls each agent forks off its prompt")
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--external", action="store_true",
                   help="also route by a router outside the engines that sees only their KV events (kv_events: "
                        "routing/kv_events.py), the replicas publishing them on ipc:// sockets")
    p.add_argument("--json", default=None, help="write the figures to this file")


async def _outputs(engine: Any, reqs: list[Any]) -> list[Any]:
    async def one(req: Any) -> Any:
        out = None
        async for d in engine.submit(req):
            out = d.output if d.finished else out
        return out

    return await asyncio.gather(*(one(r) for r in reqs))


def _params(args: argparse.Namespace) -> Any:
    from radixserve import SamplingParams

    return SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)


def fork(engine: Any, args: argparse.Namespace) -> None:
    tok = engine.tokenizer
    reqs = []
    for a in range(args.agents):
        system = system_prompt(tok, args.system_tokens, seed=100 + a)
        for q in QUESTIONS[: args.branches]:
            ask = tok.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")
            reqs.append(engine.make_req(system + ask, _params(args), tenant=f"agent-{a}"))
    asyncio.run(_outputs(engine, reqs))


def multi_turn(engine: Any, args: argparse.Namespace) -> None:
    """Each turn's requests arrive in a new (seeded) order, as independent users' would: a fixed
    order would let round-robin send every conversation to the same replica by chance."""
    tok = engine.tokenizer
    rng = random.Random(0)
    history = [system_prompt(tok, args.system_tokens // 4, seed=200 + c) for c in range(args.conversations)]
    for t in range(args.turns):
        order = rng.sample(range(args.conversations), args.conversations)
        asks = {c: tok.encode(f"<|im_start|>user\n{QUESTIONS[(c + t) % len(QUESTIONS)]}<|im_end|>\n<|im_start|>assistant\n")
                for c in order}
        reqs = {c: engine.make_req(history[c] + asks[c], _params(args), tenant="chat") for c in order}
        outs = asyncio.run(_outputs(engine, list(reqs.values())))
        for (c, r), o in zip(reqs.items(), outs):
            history[c] = r.token_ids[: r.prompt_len] + o.token_ids + tok.encode("<|im_end|>\n")


def _measure(engine: Any, workload: Any, args: argparse.Namespace, view: Any = None) -> dict[str, Any]:
    engine.flush_cache()
    if view is not None:
        time.sleep(0.3)  # the flush's events reach the outside router's view
    before = [r.engine.stats() for r in engine.replicas]
    workload(engine, args)
    after = [r.engine.stats() for r in engine.replicas]
    per = [{k: getattr(a, k) - getattr(b, k) for k in ("prompt_tokens", "cached_prompt_tokens", "prefill_tokens_computed",
                                                       "finished")} for a, b in zip(after, before)]
    prompt = sum(p["prompt_tokens"] for p in per)
    cached = sum(p["cached_prompt_tokens"] for p in per)
    return {"prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0,
            "prefill_tokens_computed": sum(p["prefill_tokens_computed"] for p in per),
            "requests_per_replica": [p["finished"] for p in per],
            "computed_per_replica": [p["prefill_tokens_computed"] for p in per]}


def index_bytes_per_block(replicas: int = 8, blocks: int = 20_000) -> float:
    """What the prefix index holds per (replica, block) entry, measured."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(capacity=blocks)
    for r in range(replicas):
        index.insert(r, block_hashes(("t", None), list(range(r * blocks * 16, (r + 1) * blocks * 16)), 16, blocks))
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used / (replicas * blocks)


def measure(engine: Any, args: argparse.Namespace, view: Any = None) -> dict[str, dict[str, Any]]:
    """Every workload under every policy, on the same replicas: "fork/prefix" -> its counts
    (with an EventView, the outside router's "kv_events" too). The engine's own router is put
    back afterwards."""
    from radixserve.routing.kv_events import KVEventsRouter

    policies = [p.strip() for p in args.policies.split(",") if p.strip()] + (["kv_events"] if view is not None else [])
    results: dict[str, dict[str, Any]] = {}
    own = engine.router
    try:
        for workload in (fork, multi_turn):
            for policy in policies:
                if policy == "kv_events":
                    engine.router = KVEventsRouter(view)
                else:
                    engine.router = make_router(RouterConfig(data_parallel=len(engine.replicas), router_policy=policy))
                results[f"{workload.__name__}/{policy}"] = _measure(engine, workload, args, view)
    finally:
        engine.router = own
    return results


def run(args: argparse.Namespace) -> int:
    from radixserve.engine.data_parallel import DataParallelEngine
    from radixserve.engine.kv_events import offset_endpoint
    from radixserve.routing.kv_events import EventView

    kwargs, view = engine_kwargs(args), None
    with tempfile.TemporaryDirectory(prefix="rs-events-") as folder:
        pub, replay = f"ipc://{folder}/pub", f"ipc://{folder}/replay"
        if args.external:
            kwargs["kv_events_config"] = json.dumps({"enable_kv_cache_events": True, "endpoint": pub, "replay_endpoint": replay})
        with DataParallelEngine(args.model, RouterConfig(data_parallel=args.replicas), **kwargs) as engine:
            if args.external:
                view = EventView({i: (offset_endpoint(pub, i), offset_endpoint(replay, i)) for i in range(args.replicas)})
            try:
                results = measure(engine, args, view)
            finally:
                if view is not None:
                    view.close()
    per_block = index_bytes_per_block()
    _print(results, args, per_block, RouterConfig())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "index_bytes_per_block": per_block}, f, indent=2)
    return 0


def _print(results: dict[str, dict[str, Any]], args: argparse.Namespace, per_block: float, cfg: RouterConfig) -> None:
    print(f"\n{args.replicas} replicas; fork: {args.agents} agents x {args.branches} calls off a {args.system_tokens}-token "
          f"prompt; multi-turn: {args.conversations} conversations x {args.turns} turns; {args.output_len} tokens each")
    print(f"{'workload/policy':<24}{'prompt tok':>11}{'cached':>9}{'hit rate':>9}{'computed':>10}  "
          f"{'computed vs round_robin':>24}  requests per replica")
    for key, r in results.items():
        base = results.get(key.split("/")[0] + "/round_robin")
        ratio = f"{r['prefill_tokens_computed'] / base['prefill_tokens_computed']:.2f}x" if base else "-"
        print(f"{key:<24}{r['prompt_tokens']:>11}{r['cached_tokens']:>9}{r['hit_rate']:>9.1%}"
              f"{r['prefill_tokens_computed']:>10}  {ratio:>24}  {r['requests_per_replica']}")
    mib = per_block * cfg.router_max_blocks_per_replica / 2**20
    print(f"router index: {per_block:.0f} bytes per (replica, block); at {cfg.router_max_blocks_per_replica} blocks "
          f"({cfg.router_max_blocks_per_replica * cfg.router_block_tokens} tokens) per replica: {mib:.1f} MiB a replica, "
          f"{mib * 1000 / 1024:.1f} GiB per 1,000 replicas")
