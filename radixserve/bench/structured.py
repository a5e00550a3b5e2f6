"""`radixserve bench structured`: JSON-schema coverage, compile time, compliance and speed.

- Coverage and compile time, per JSONSchemaBench subset and backend (xgrammar, outlines, auto):
  the share of schemas accepted in strict mode (compiled and fully enforced), and compile time
  p50/p95 cold (first compile) and warm (the same schema again: a compile-cache hit). Compiles
  run in a worker process with a per-schema timeout, so a pathological schema costs its time
  budget and no more.
- Compliance: a sample of each subset's accepted schemas, generated with the default model
  (greedy): the share of finished outputs that validate against the full schema.
- Speed: decode tokens/s constrained vs unconstrained at batch 1 and 16, with and without
  jump-forward, and Hugging Face `generate` with xgrammar's logits processor, same prompts.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from radixserve.bench import percentile
from radixserve.cli_args import add_engine_args, engine_kwargs

DATA = Path(__file__).parent / "data" / "jsonschemabench"  # the default subsets, bundled (see its README.md)
SUBSETS = "Glaiveai2K,Github_easy,Github_medium,Kubernetes,Snowplow"


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--data", default=str(DATA), help="folder of JSONSchemaBench *.jsonl.gz files (default: the bundled subsets)")
    p.add_argument("--subsets", default=SUBSETS)
    p.add_argument("--schemas", type=int, default=60, help="schemas sampled per subset for coverage")
    p.add_argument("--compliance-schemas", type=int, default=8, help="schemas per subset generated with the model")
    p.add_argument("--compile-timeout", type=float, default=10.0)
    p.add_argument("--speed-tokens", type=int, default=96)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)


def load_subset(folder: str, name: str, n: int, seed: int) -> list[dict[str, Any]]:
    with gzip.open(Path(folder) / f"{name}.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    random.Random(seed).shuffle(rows)
    return rows[:n]


# -- coverage (worker process) --------------------------------------------------------------------
_WORKER: dict[str, Any] = {}


def _worker_init(model_dir: str) -> None:
    from radixserve.models.loader import load_tokenizer

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _WORKER["tok"] = load_tokenizer(Path(model_dir))


def _compile_one(backend: str, schema: Any) -> tuple[bool, str, float, float]:
    """Cold: a compile as the server runs it (in a compile worker process, then loaded here);
    warm: the same schema again, a compile-cache hit."""
    import functools

    from grammars import GrammarError, GrammarSpec, create_backend
    from grammars.cache import CompileCache

    tok = _WORKER["tok"]
    if backend not in _WORKER:  # the caller's per-schema timeout bounds it (this process is killed)
        factory = functools.partial(create_backend, backend, tok, len(tok), [tok.eos_token_id])
        _WORKER[backend] = CompileCache(factory, timeout_s=1e9, workers=1, memory_mb=1 << 20)
    cache = _WORKER[backend]
    try:
        spec = GrammarSpec.json_schema(schema)
        t = time.perf_counter()
        cache.get(spec)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        cache.get(spec)
        warm = time.perf_counter() - t
        return True, "", cold, warm
    except GrammarError as e:
        return False, str(e)[:160], 0.0, 0.0


def _pool(model_dir: str) -> ProcessPoolExecutor:
    """One spawned worker (forking a process that runs the engine's threads is not safe)."""
    import multiprocessing

    return ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init, initargs=(model_dir,))


def coverage(model_dir: str, subsets: dict[str, list[dict[str, Any]]], timeout: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for backend in ("xgrammar", "outlines", "auto"):
        pool = _pool(model_dir)
        for name, rows in subsets.items():
            ok, cold, warm = 0, [], []
            reasons: dict[str, int] = {}
            for row in rows:
                fut = pool.submit(_compile_one, backend, row["schema"])
                try:
                    good, why, c, w = fut.result(timeout)
                except FutureTimeout:
                    good, why, c, w = False, "timeout", 0.0, 0.0
                    for proc in list(getattr(pool, "_processes", {}).values()):
                        proc.kill()
                    pool.shutdown(wait=False, cancel_futures=True)
                    pool = _pool(model_dir)
                except Exception as e:  # a crashed worker (e.g. out of memory)
                    good, why, c, w = False, f"worker died: {type(e).__name__}", 0.0, 0.0
                    pool = _pool(model_dir)
                if good:
                    ok += 1
                    cold.append(c)
                    warm.append(w)
                else:
                    key = why.split(" at ")[0][:70]
                    reasons[key] = reasons.get(key, 0) + 1
            out.setdefault(name, {})[backend] = {
                "schemas": len(rows), "coverage": ok / len(rows) if rows else 0.0,
                "compile_ms_p50": 1e3 * percentile(cold, 0.5), "compile_ms_p95": 1e3 * percentile(cold, 0.95),
                "warm_ms_p50": 1e3 * percentile(warm, 0.5), "warm_ms_p95": 1e3 * percentile(warm, 0.95),
                "top_rejections": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:3]),
            }
            r = out[name][backend]
            print(f"coverage {name:<14} {backend:<9} {r['coverage']:6.1%}  compile p50/p95 {r['compile_ms_p50']:.1f}/"
                  f"{r['compile_ms_p95']:.1f} ms  warm p50 {r['warm_ms_p50']:.3f} ms", flush=True)
        pool.shutdown(wait=False, cancel_futures=True)
    return out


# -- compliance and speed (the engine) --------------------------------------------------------------
def compliance(engine: Any, subsets: dict[str, list[dict[str, Any]]], n: int) -> dict[str, Any]:
    import jsonschema

    from radixserve import SamplingParams

    out = {}
    for name, rows in subsets.items():
        finished = valid = rejected = 0
        for row in rows[:n]:
            prompt = engine.chat_ids([{"role": "user", "content": "Reply with a JSON document that follows this schema:\n"
                                       + json.dumps(row["schema"])[:1500]}])
            params = SamplingParams(temperature=0, max_new_tokens=256, json_schema=json.dumps(row["schema"]))
            try:
                o = engine.generate([prompt], params)[0]
            except ValueError:  # refused in strict mode: counted under coverage
                rejected += 1
                continue
            if o.finish_reason != "stop":
                continue
            finished += 1
            try:
                jsonschema.validate(json.loads(o.text), row["schema"])
                valid += 1
            except Exception:
                pass
        out[name] = {"generated": min(n, len(rows)) - rejected, "finished": finished, "valid": valid,
                     "compliance": valid / finished if finished else float("nan")}
        print(f"compliance {name:<14} {valid}/{finished} finished outputs validate", flush=True)
    return out


SPEED_SCHEMA = {"type": "object", "additionalProperties": False,
                "required": ["customer_full_name", "shipping_street_address", "shipping_postal_code", "order_item_names"],
                "properties": {"customer_full_name": {"type": "string", "maxLength": 40},
                               "shipping_street_address": {"type": "string", "maxLength": 60},
                               "shipping_postal_code": {"type": "string", "maxLength": 10},
                               "order_item_names": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 30}}}}


def speed(engine: Any, batch: int, tokens: int) -> dict[str, float]:
    from radixserve import SamplingParams

    prompts = [engine.chat_ids([{"role": "user", "content": f"Invent order number {i} as JSON: customer, address, items."}])
               for i in range(batch)]
    results = {}
    constrained = SamplingParams(temperature=0, max_new_tokens=tokens, json_schema=json.dumps(SPEED_SCHEMA))
    cases = {"unconstrained": (SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True), True),
             "constrained": (constrained, False), "constrained_jump_forward": (constrained, True)}
    for name, (params, jf) in cases.items():
        engine.post.jump_forward = jf
        engine.generate(prompts[:1], params)  # warm-up (and the grammar compile)
        t = time.perf_counter()
        outs = engine.generate(prompts, params)
        dt = time.perf_counter() - t
        results[name] = sum(o.completion_tokens for o in outs) / dt
    engine.post.jump_forward = True
    return results


def hf_speed(model_dir: str, tok: Any, tokens: int) -> float:
    """HF generate, batch 1, with xgrammar's HF logits processor on the same schema."""
    import torch
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM

    torch.set_flush_denormal(True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.config.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SPEED_SCHEMA))
    ids = tok.apply_chat_template([{"role": "user", "content": "Invent order number 0 as JSON: customer, address, items."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.inference_mode():
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)],
                             pad_token_id=tok.pad_token_id or 0)
        dt = time.perf_counter() - t
    return (out.shape[1] - ids.shape[1]) / dt


def run(args: argparse.Namespace) -> int:
    from radixserve import Engine

    subsets = {name: load_subset(args.data, name, args.schemas, args.seed) for name in args.subsets.split(",") if name}
    results: dict[str, Any] = {"subsets": list(subsets), "schemas_per_subset": args.schemas}
    with Engine(args.model, **engine_kwargs(args)) as engine:
        model_dir = str(engine.model_path)
        results["coverage"] = coverage(model_dir, subsets, args.compile_timeout)
        results["compliance"] = compliance(engine, subsets, args.compliance_schemas)
        results["speed"] = {f"batch_{b}": speed(engine, b, args.speed_tokens) for b in (1, 16)}
        for b, r in results["speed"].items():
            print(f"speed {b:<9} " + "  ".join(f"{k} {v:.1f} tok/s" for k, v in r.items()), flush=True)
        tok = engine.tokenizer
    if not args.skip_hf:
        results["speed"]["hf_generate_xgrammar_batch_1"] = hf_speed(model_dir, tok, args.speed_tokens)
        print(f"speed HF generate + xgrammar logits processor, batch 1: {results['speed']['hf_generate_xgrammar_batch_1']:.1f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
