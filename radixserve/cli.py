"""`radixserve` command line (`python -m radixserve`): serve (one process's server, or `--ray`: Ray
Serve replicas), generate (stream one answer), bench (benchmarks). Above every serving mode:
server/ and ray/ never import it, and server/ never imports ray/."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import sys
from typing import Any

from radixserve.cli_args import add_engine_args, add_log_level, engine_kwargs, run_command

# `radixserve bench NAME`: its module (add_args, run) and its one-line help
BENCHES = {
    "compare": ("radixserve.bench.compare", "five workloads against OpenAI-compatible servers (llama.cpp, ...)"),
    "agents": ("radixserve.bench.agents", "agent programs in frontend_lang vs sequential openai-client calls"),
    "offline": ("radixserve.bench.offline", "offline throughput vs Hugging Face generate"),
    "prefix": ("radixserve.bench.prefix", "16 calls forked off a long system prompt; multi-turn history reuse"),
    "route": ("radixserve.bench.route", "data-parallel replicas: prefix-affinity vs round-robin vs random routing"),
    "serving": ("radixserve.bench.serving", "a running server under open- and closed-loop load, over HTTP"),
    "reliability": ("radixserve.bench.reliability", "a running server: overload rejections, tenant isolation timing "
                                                    "(--abuse: the abuse bench)"),
    "abuse": ("radixserve.bench.abuse", "a running server: tenant B's chat latency alone and beside each of tenant A's "
                                        "abusive shapes (bombs, floods, idle connections), RSS, 5xx, restarts"),
    "structured": ("radixserve.bench.structured", "JSON-schema coverage, compile time, compliance, constrained speed"),
    "sessions": ("radixserve.bench.sessions", "an agent session's time to first token: pool, disk tier, restart, cold"),
    "history": ("radixserve.bench.history", "a reasoning agent's turns with the history precompute on and off: cached "
                                            "tokens, computed tokens, TTFT per turn"),
    "lora": ("radixserve.bench.lora", "concurrent requests spread over LoRA adapters vs the base model alone: "
                                      "output tokens/s and their ratio"),
    "spec": ("radixserve.bench.spec", "speculative decoding from context copies, on vs off: rewrite, JSON, chat"),
    "tools": ("radixserve.bench.tools", "tool calls in auto mode against OpenAI-compatible servers: made, valid, text"),
    # a bench on Ray: above the bench layer, as ray/ is; imports ray when it runs
    "autoscale": ("radixserve.ray.ramp", "a load ramp on a local Ray cluster: the autoscaled deployment scales "
                                         "1 -> 2 -> 1, no request lost, cold start"),
    "coldstart": ("radixserve.bench.coldstart", "a start to its first token: a new GGUF file, weights in the page cache "
                                                "and from a cold disk, beside llama-server"),
    "disagg": ("radixserve.bench.disagg", "prefill/decode disaggregation vs colocated replicas: short chats' TPOT p99 "
                                          "while long prompts arrive"),
    "quality": ("radixserve.bench.quality", "KL divergence of a configuration's next-token distributions from the exact "
                                            "model's over a text, as llama-perplexity measures it"),
    "tp": ("radixserve.bench.tp", "tensor parallelism: one rank vs N on the same cores, step times, all-reduce share"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve", description="LLM serving engine for agents")
    add_log_level(p)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="stream the answer to one chat-templated prompt")
    add_engine_args(g)
    g.add_argument("--max-new-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy (default: 0.0)")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("prompt", help="the user message (with --raw: the whole prompt text)")
    from radixserve.server import serve

    serve.add_args(sub.add_parser("serve", help="serve the OpenAI-compatible and native HTTP APIs"))
    b = sub.add_parser("bench", help="benchmarks (each compares against a baseline in the same run)")
    bsub = b.add_subparsers(dest="bench", required=True)
    for name, (module, words) in BENCHES.items():
        importlib.import_module(module).add_args(bsub.add_parser(name, help=words))
    return p


async def _stream(engine: Any, ids: list[int], params: Any) -> None:
    async for d in engine.submit(ids, params):
        sys.stdout.write(d.text)
        sys.stdout.flush()
        if d.finished and d.output is not None and d.output.finish_reason == "error":
            print(f"\nerror: {d.output.error}", file=sys.stderr)
    sys.stdout.write("\n")


def cmd_generate(args: argparse.Namespace) -> int:
    from radixserve import Engine, SamplingParams

    with Engine(args.model, **engine_kwargs(args)) as engine:
        ids = engine.tokenizer.encode(args.prompt) if args.raw else engine.chat_ids([{"role": "user", "content": args.prompt}])
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
        asyncio.run(_stream(engine, ids, params))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_command(_dispatch, args)


def _dispatch(args: argparse.Namespace) -> int:
    if args.cmd == "generate":
        return cmd_generate(args)
    if args.cmd == "serve":
        from radixserve.server import serve

        if args.ray:  # the serving modes meet here, above server/ and ray/ (ray/ uses server/'s options)
            from radixserve.ray.serve import run_ray

            serve.resolve_secrets(args)
            return run_ray(args)
        return serve.run(args)
    return int(importlib.import_module(BENCHES[args.bench][0]).run(args))  # each bench module has run(args)

if __name__ == "__main__":
    sys.exit(main())
