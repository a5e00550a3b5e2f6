"""`radixserve bench prefix`: an agent forks many calls off one long system prompt.

Fork: a shared system prompt (2,000 tokens by default) and 16 different short questions,
sent together, each generating 64 tokens. Systems, in the same process run, on the same
prompts and weights: our engine with the radix cache, our engine with it disabled, and
Hugging Face `generate` one request at a time (no reuse). Multi-turn: 8 conversations of 6
turns, each turn re-sending the whole history as rendered chat text (as an OpenAI client
does), with the cache on and off; reports the hit rate next to the reusable share (the
part of each prompt that repeats the conversation's previous prompt and answer).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from radixserve.cache.prefix import common_prefix_len
from radixserve.cli_args import add_engine_args, engine_kwargs

WORDS = (
    "agent tool call returns json schema field string integer array object required optional "
    "search query result document page user request plan step retry timeout error status code "
    "cache prefix branch fork merge answer question context window token budget memory latency "
    "always never must should may when if then else before after each every only first last"
).split()
QUESTIONS = [
    "Which tool should I call to search the documents?", "What does a timeout error mean here?",
    "Summarize the retry policy in one sentence.", "How many steps may a plan have?",
    "Which fields of the result are required?", "What should the agent do after an error?",
    "Can two branches share one cache?", "What is the token budget per call?",
    "When must the agent ask the user?", "Which status codes are retried?",
    "How is a fork merged back?", "What is the first step of every plan?",
    "Which answer format is expected?", "How long may the context window be?",
    "What happens when memory runs out?", "Name one optional field of a request.",
]


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--system-tokens", type=int, default=2000, help="length of the shared system prompt")
    p.add_argument("--branches", type=int, default=16, help="calls forked off the system prompt (at most 16)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--turn-output-len", type=int, default=32)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-multiturn", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures to this file")


def documentation(rng: random.Random, n_sentences: int) -> str:
    """Pseudo tool documentation: sentences of domain words."""
    return "".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + ". " for _ in range(n_sentences))


def system_prompt(tok: Any, n_tokens: int, seed: int) -> list[int]:
    """Exactly n_tokens ids: a rendered system message with documentation inside."""
    rng = random.Random(seed)
    head, tail = tok.encode("<|im_start|>system\n"), tok.encode("<|im_end|>\n")
    body: list[int] = []
    while len(body) < n_tokens:
        body += tok.encode(documentation(rng, 10))
    return head + body[: max(n_tokens - len(head) - len(tail), 0)] + tail


def fork_prompts(tok: Any, args: argparse.Namespace) -> tuple[list[int], list[list[int]]]:
    system = system_prompt(tok, args.system_tokens, args.seed)
    asks = [tok.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n") for q in QUESTIONS[: args.branches]]
    return system, [system + a for a in asks]


def _delta(engine: Any, before: Any) -> dict[str, Any]:
    after = engine.stats()
    prompt = after.prompt_tokens - before.prompt_tokens
    cached = after.cached_prompt_tokens - before.cached_prompt_tokens
    return {
        "prefill_tokens_computed": after.prefill_tokens_computed - before.prefill_tokens_computed,
        "prompt_tokens": prompt,
        "cached_prompt_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
    }


def bench_fork(engine: Any, prompts: list[list[int]], out_len: int) -> dict[str, Any]:
    from radixserve import SamplingParams

    # warm-up at the real prompt length (the first engine in a process would otherwise pay for the
    # long prefill's first kernels alone); then flushed: the timed run starts from a cold cache
    engine.generate([prompts[0]], SamplingParams(temperature=0.0, max_new_tokens=4))
    engine.flush_cache()
    before = engine.stats()
    t = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=out_len, ignore_eos=True))
    wall = time.perf_counter() - t
    n_out = sum(o.completion_tokens for o in outs)
    return {"requests": len(prompts), "wall_s": wall, "output_tokens": n_out, **_delta(engine, before)}


def bench_multiturn(engine: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Each turn sends every conversation's full history, rendered by the chat template."""
    from radixserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=args.turn_output_len)
    convs = [[{"role": "system", "content": documentation(random.Random(args.seed + 1 + c), 12)}] for c in range(args.conversations)]
    engine.flush_cache()
    before = engine.stats()
    prev: list[list[int]] = [[] for _ in convs]  # previous prompt + answer ids, per conversation
    reusable = total = 0
    t = time.perf_counter()
    for turn in range(args.turns):
        for c, msgs in enumerate(convs):
            msgs.append({"role": "user", "content": QUESTIONS[(c + turn) % len(QUESTIONS)]})
        prompts = [engine.chat_ids(msgs) for msgs in convs]
        outs = engine.generate(prompts, params)
        for c, (msgs, ids, out) in enumerate(zip(convs, prompts, outs)):
            reusable += common_prefix_len(ids, prev[c])
            total += len(ids)
            prev[c] = ids + out.token_ids
            msgs.append({"role": "assistant", "content": out.text})
    wall = time.perf_counter() - t
    d = _delta(engine, before)
    return {"conversations": len(convs), "turns": args.turns, "wall_s": wall, "reusable_share": reusable / total, **d}


def run(args: argparse.Namespace) -> int:
    from radixserve import Engine
    from radixserve.bench.offline import bench_hf

    if not 1 <= args.branches <= len(QUESTIONS):
        raise ValueError(f"branches: must be in [1, {len(QUESTIONS)}], got {args.branches}")
    kw = engine_kwargs(args)
    results: dict[str, dict[str, Any]] = {}
    for name, disable in (("radixserve", False), ("radixserve_no_cache", True)):
        with Engine(args.model, **{**kw, "disable_radix_cache": disable}) as engine:
            system, prompts = fork_prompts(engine.tokenizer, args)
            results[name] = bench_fork(engine, prompts, args.output_len)
            if not args.skip_multiturn:
                results[name]["multiturn"] = bench_multiturn(engine, args)
            model_path, pad_id, page = str(engine.model_path), engine.tokenizer.pad_token_id or 0, engine.config.cache.page_size
            on = (engine.device, engine.dtype)
    if not args.skip_hf:
        hf = bench_hf(model_path, prompts, args.output_len, 1, pad_id, *on)
        n = sum(len(p) for p in prompts)
        results["hf_sequential"] = {"requests": len(prompts), "wall_s": hf["seconds"], "output_tokens": hf["output_tokens"],
                                    "prefill_tokens_computed": n, "prompt_tokens": n, "cached_prompt_tokens": 0, "hit_rate": 0.0}
    bound = len(system) + sum(len(p) - len(system) for p in prompts) + len(prompts) * page
    results["radixserve"]["prefill_bound"] = bound
    print_table(results, args, len(system), bound)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def print_table(results: dict[str, dict[str, Any]], args: argparse.Namespace, shared: int, bound: int) -> None:
    print(f"\nprefix sharing: {args.branches} branches off a {shared}-token system prompt, "
          f"{args.output_len} new tokens each, greedy, sent together")
    ours = results["radixserve"]["wall_s"]
    print(f"{'system':<22}{'wall s':>8}{'prefill tokens':>16}{'hit rate':>10}{'radixserve speed-up':>21}")
    for name, r in results.items():
        print(f"{name:<22}{r['wall_s']:>8.1f}{r['prefill_tokens_computed']:>16,}{r['hit_rate']:>10.2f}{r['wall_s'] / ours:>20.2f}x")
    computed = results["radixserve"]["prefill_tokens_computed"]
    verdict = "within" if computed <= bound else "OVER"
    print(f"prefill tokens computed with the cache: {computed:,}, {verdict} the bound of {bound:,} "
          f"(prompt once + every question + one page per request)")
    if "multiturn" in results["radixserve"]:
        on, off = results["radixserve"]["multiturn"], results["radixserve_no_cache"]["multiturn"]
        print(f"\nmulti-turn: {on['conversations']} conversations x {on['turns']} turns, history re-sent as chat text each turn")
        print(f"  hit rate {on['hit_rate']:.2f} (reusable share {on['reusable_share']:.2f}); prefill tokens "
              f"{on['prefill_tokens_computed']:,} vs {off['prefill_tokens_computed']:,} without the cache; "
              f"wall {on['wall_s']:.1f} s vs {off['wall_s']:.1f} s ({off['wall_s'] / on['wall_s']:.2f}x)")
