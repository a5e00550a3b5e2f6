"""Greedy agreement of a GGUF model served from its own quantized blocks (`--quantization
auto`) against the same file dequantized to fp32 (`--quantization none --dtype float32`): 32
chat prompts x 64 tokens; and the resident memory the quantized weights take, against the file.

    .venv/bin/python scripts/quant_check.py [--model FILE.gguf] [--tokens 64] [--dtype auto] [--quantization auto]
        [--against none]

--model: the default model (SmolLM2's Q4_1 file) unless given, e.g. the Qwen2.5-Coder-1.5B Q4_K_M
file of scripts/fetch_real_model.sh. (The reference converts the file once to fp32 safetensors
in the radixserve cache: 4 bytes a weight on disk.)

(`--quantization none --dtype bfloat16` measures what bf16 activations alone change.)

Prints, per prompt, how many leading tokens agree; then: prompts identical to the end, mean
agreeing prefix, and the share of the first divergences' positions.
"""

from __future__ import annotations

import argparse
import statistics

from radixserve import Engine, SamplingParams
from radixserve.models.quant import weight_bytes

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis to a child.",
    "List three uses of copper.", "How do I reverse a list in Python?", "What is 17 times 23?",
    "Give me a recipe for pancakes.", "Who wrote Pride and Prejudice?", "Describe the water cycle.",
    "What is a prime number?", "Translate 'good morning' into Spanish.", "Why is the sky blue?",
    "Write a short poem about autumn.", "What does HTTP stand for?", "Summarize the plot of Hamlet.",
    "How many legs does a spider have?", "What is the boiling point of water?", "Name the planets of the solar system.",
    "Write a SQL query that counts rows in a table.", "What is machine learning?", "Suggest a name for a pet cat.",
    "How does a bicycle work?", "What causes earthquakes?", "Write a limerick about a programmer.",
    "Explain what a black hole is.", "Give three tips for better sleep.", "What is the tallest mountain on Earth?",
    "How do vaccines work?", "Write a function in JavaScript that adds two numbers.", "What is democracy?",
    "Describe a sunset in two sentences.", "What are the primary colors?",
]


def greedy(engine: Engine, tokens: int) -> list[list[int]]:
    ids = [engine.chat_ids([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)
    return [o.token_ids for o in engine.generate(ids, params)]


def rss_mib() -> tuple[float, float, float]:
    """(anonymous, file-backed, of which mapped packed-weight cache files) resident memory of
    this process, MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon", "RssFile")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) / 1024
    packed, current = 0.0, False
    with open("/proc/self/smaps") as f:  # mappings of models.packed_cache's files
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:
                current = len(head) >= 6 and "-packed/" in head[-1]
            elif current and line.startswith("Rss:"):
                packed += int(head[1]) / 1024
    return out["RssAnon"], out["RssFile"], packed


def weight_rss(model: str | None, quantization: str) -> tuple[float, float, float]:
    """The resident memory one load of the model's weights adds to this process (MiB), every
    weight touched once (mapped pages count once read): anonymous, file-backed pages of the
    packed-weight cache (models.packed_cache: a start after the first maps the packed blocks),
    and other file-backed pages (library code paged in by the load's first torch calls). The
    kernels are loaded first, and the engine's tokenizer twice (the allocator's arenas grown), so
    they do not count; the load's own tokenizer does (an upper bound: a third tokenizer measured
    here added 5-60 MiB, as the allocator reused memory or not)."""
    import gc

    import torch

    from radixserve.models.files import load_tokenizer, tokenizer_dir
    from radixserve.models.loader import load_model
    from radixserve_kernels import cpu

    cpu.ops()
    toks = [load_tokenizer(tokenizer_dir(model), fast=True) for _ in range(2)]
    gc.collect()
    before = rss_mib()
    loaded = load_model(model, torch.float32, torch.device("cpu"), quantization)
    for t in [*loaded.model.parameters(), *loaded.model.buffers()]:
        t.sum()
    gc.collect()
    after = rss_mib()
    del loaded, toks
    anon, packed = after[0] - before[0], after[2] - before[2]
    return anon, packed, after[1] - before[1] - packed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a .gguf file (default: the default model's)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--dtype", default="auto", help="the candidate's activation dtype (auto: fp32 for quantized weights)")
    p.add_argument("--quantization", default="auto", help="the candidate's --quantization (auto: the file's Q4_1)")
    p.add_argument("--against", default="none", help="the reference's --quantization (none: dequantized fp32)")
    args = p.parse_args()
    if args.quantization == "auto":
        from pathlib import Path

        from radixserve.models.gguf import default_gguf

        size = Path(args.model or default_gguf()).stat().st_size / 2**20
        anon, packed, code = weight_rss(args.model, "auto")
        print(f"weights' resident memory: {anon + packed:.1f} MiB ({anon:.1f} anonymous + {packed:.1f} mapped from the "
              f"packed-weight cache) for a {size:.1f} MiB GGUF file ({(anon + packed) / size:.2f}x); "
              f"library code paged in by the load: {code:.1f} MiB more")
    runs = {}
    for name, kw in (("candidate", dict(quantization=args.quantization, dtype=args.dtype)),
                     ("reference", dict(quantization=args.against, dtype="float32"))):
        with Engine(args.model, kv_cache_tokens=len(PROMPTS) * (args.tokens + 64) + 512, **kw) as engine:
            runs[name] = greedy(engine, args.tokens)
            print(f"{name}: {kw}, weights {weight_bytes(engine.runner.model) / 2**20:.1f} MiB ({engine.quantization})")
    agree = []
    for q, r in zip(runs["candidate"], runs["reference"]):
        n = next((i for i, (a, b) in enumerate(zip(q, r)) if a != b), min(len(q), len(r)))
        agree.append(n)
    print("agreeing prefix per prompt:", agree)
    same = sum(n == args.tokens for n in agree)
    print(f"identical to the end: {same}/{len(agree)}; mean agreeing prefix {statistics.mean(agree):.1f} of {args.tokens} "
          f"tokens; tokens before the first divergence: {sum(agree) / (len(agree) * args.tokens):.1%}")


if __name__ == "__main__":
    main()
