"""What a quantized KV cache costs and buys, on the default model (SmolLM2-135M, `Engine()`
defaults but the KV dtype and size), against bf16 K/V in the same run:

1. accuracy over a long context: 8 prompts of --context tokens (windows of this repository's
   README and engine source), prefilled in chunks, then --new tokens teacher-forced with the
   bf16 run's greedy tokens: the max |logit error| over those positions; and free-running
   greedy generation: tokens equal at the same position, and how long the paths stay equal;
2. capacity: for one byte budget (--budget-mb), the pool's tokens per KV dtype, and a fork
   run at high concurrency (--groups shared prompts, --branches forks each, distinct suffixes,
   --serve-new tokens each): the largest batch a step ran, the mean decode batch, the
   retractions, and the wall time (informational).

    .venv/bin/python scripts/kv_quant_check.py [--context 1800 --new 64 --budget-mb 160]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from radixserve import Engine, SamplingParams
from radixserve.batch import ForwardBatch, SeqView

DTYPES = ("bf16", "int8", "fp8_e4m3")
ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["README.md", "radixserve/engine/engine.py", "radixserve/cache/radix.py", "radixserve/sched/scheduler.py"]


def prompts(engine: Engine, n: int, length: int) -> list[list[int]]:
    """n windows of `length` tokens of this repository's text, disjoint where it is long enough."""
    ids = engine.tokenizer.encode("\n\n".join((ROOT / t).read_text() for t in TEXTS))
    step = max((len(ids) - length) // max(n - 1, 1), 1)
    return [ids[i * step : i * step + length] for i in range(n)]


@torch.inference_mode()
def forced_logits(engine: Engine, prompt: list[int], forced: list[int], chunk: int) -> torch.Tensor:
    """Logits (len(forced), vocab) of each generated position: the prompt prefilled in chunks
    (each over the pool's prefix), then one decode step per forced token."""
    model, backend = engine.runner.model, engine.runner.backend
    slots = list(range(len(prompt) + len(forced)))
    tokens = prompt + forced
    out = []

    def run(start: int, n: int) -> torch.Tensor:
        seq = SeqView(0, n, start, slots[: start + n])
        batch = ForwardBatch(torch.tensor(tokens[start : start + n]), torch.arange(start, start + n),
                             torch.tensor(slots[start : start + n]), [seq], backend)
        backend.prepare(batch)
        return model.compute_logits(model(batch)[-1:])[0]

    for start in range(0, len(prompt), chunk):
        last = run(start, min(chunk, len(prompt) - start))
    out.append(last)
    for i in range(len(forced) - 1):
        out.append(run(len(prompt) + i, 1))
    return torch.stack(out)


def accuracy(args: argparse.Namespace) -> None:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=args.new, ignore_eos=True)
    tokens, logits = {}, {}
    for name in DTYPES:
        with Engine(kv_cache_dtype=name, kv_cache_tokens=args.prompts * (args.context + args.new) + 64) as e:
            ps = prompts(e, args.prompts, args.context)
            tokens[name] = [o.token_ids for o in e.generate(ps, greedy)]
            e.flush_cache()  # the forced runs write slots 0.. directly, outside the cache's accounting
            logits[name] = [forced_logits(e, p, t, e.config.sched.chunked_prefill_size) for p, t in zip(ps, tokens["bf16"])]
            print(f"  {name}: model {e.dtype}, KV {e.kv_dtype}, {len(ps)} prompts x {len(ps[0])} tokens", flush=True)
    n = args.prompts * args.new
    print(f"\naccuracy against bf16 K/V ({args.prompts} prompts x {args.context} tokens, {args.new} generated each)")
    print(f"{'kv dtype':<10} {'max |dlogit|':>13} {'mean |dlogit|':>14} {'same argmax':>12} {'same tokens':>12} "
          f"{'paths equal for':>16}")
    for name in DTYPES[1:]:
        err = torch.cat([(a - b).abs() for a, b in zip(logits[name], logits["bf16"])])
        argmax = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(logits[name], logits["bf16"]))
        same = sum(x == y for a, b in zip(tokens[name], tokens["bf16"]) for x, y in zip(a, b))
        run = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(tokens[name], tokens["bf16"])]
        print(f"{name:<10} {err.max().item():>13.3f} {err.mean().item():>14.4f} {argmax:>7}/{n:<4} {same:>7}/{n:<4} "
              f"{sum(run) / len(run):>9.1f} tokens (min {min(run)})")


def serving(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=args.serve_new, ignore_eos=True)
    rows = []
    for name in DTYPES:
        with Engine(kv_cache_dtype=name, kv_cache_memory_mb=args.budget_mb) as e:
            base = prompts(e, args.groups, args.shared)
            work = [p + [rng.randrange(100, 40000) for _ in range(args.suffix)] for p in base for _ in range(args.branches)]
            batches: list[tuple[int, int]] = []
            run = e.runner.run

            def spy(plan, slots_of, run=run, batches=batches):
                batches.append((len(plan.items), sum(1 for it in plan.items if it.is_decode)))
                return run(plan, slots_of)

            e.runner.run = spy
            e.generate(base, SamplingParams(temperature=0.0, max_new_tokens=1))  # the shared prompts, cached
            t = time.perf_counter()
            outs = e.generate(work, greedy)
            wall = time.perf_counter() - t
            s = e.stats()
            decodes = [d for _, d in batches if d]
            rows.append((name, e.kv_dtype, s.kv_bytes_per_token, s.kv_total_slots, max(b for b, _ in batches),
                         sum(decodes) / len(decodes), s.retractions, sum(o.completion_tokens for o in outs) / wall, wall))
            e.check_integrity()
    need = args.groups * (args.shared + args.branches * (args.suffix + args.serve_new))
    print(f"\nserving at one KV budget of {args.budget_mb} MiB: {args.groups} shared prompts of {args.shared} tokens x "
          f"{args.branches} forks, +{args.suffix} own tokens, {args.serve_new} generated each (~{need} KV tokens in all)")
    print(f"{'kv dtype':<10} {'bytes/token':>11} {'pool tokens':>11} {'peak batch':>10} {'mean decode batch':>17} "
          f"{'retractions':>11} {'tok/s':>7} {'wall s':>7}")
    for name, _, per, total, peak, mean, retr, tps, wall in rows:
        print(f"{name:<10} {per:>11} {total:>11} {peak:>10} {mean:>17.1f} {retr:>11} {tps:>7.1f} {wall:>7.1f}")
    print(f"pool tokens int8 / bf16: {rows[1][3] / rows[0][3]:.2f}x, fp8 / bf16: {rows[2][3] / rows[0][3]:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--context", type=int, default=1800)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--budget-mb", type=int, default=160)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--branches", type=int, default=12)
    p.add_argument("--shared", type=int, default=600)
    p.add_argument("--suffix", type=int, default=100)
    p.add_argument("--serve-new", type=int, default=128)
    p.add_argument("--skip-accuracy", action="store_true")
    args = p.parse_args()
    if not args.skip_accuracy:
        accuracy(args)
    serving(args)


if __name__ == "__main__":
    main()
