"""`radixserve bench quality`: how far one configuration's next-token distributions are from
another's on the same text, measured as llama.cpp's `llama-perplexity --kl-divergence` does.

    radixserve bench quality --model FILE --text FILE [--ctx 512] [--chunks 8] [--json OUT]
        [candidate: any engine flag, e.g. --quantization --dtype --activations --kv-cache-dtype]
        [reference: --ref-quantization none --ref-dtype float32 --ref-activations auto --ref-kv-cache-dtype auto]

With no configuration flags the candidate is what `radixserve serve` runs on the file, and the
reference is the exact path (`--quantization none --dtype float32`): the answer to "how far is
the default from exact".

The method is llama-perplexity's: the text is tokenized whole (with the tokenizer's BOS where it
adds one) and cut into `--chunks` windows of `--ctx` consecutive tokens, each window's first
token replaced by BOS where the tokenizer adds one. Each window is run with teacher forcing
(prefilled as `serve` prefills a prompt, in chunks of `--chunked-prefill-size`), and its second
half is scored: the rows ctx/2 .. ctx-2, each predicting the next token. The reference runs first
and its log-probabilities of the scored rows are kept in a temporary file (fp32, ~1.2 GB for
8 windows of 512 over Qwen2.5's vocabulary, in $TMPDIR); then the candidate runs and is compared row by row:

- KLD: sum_v p_ref(v) (log p_ref(v) - log p_cand(v)), in float64;
- same top token: argmax p_cand == argmax p_ref;
- dp: p_cand(true token) - p_ref(true token);
- each side's perplexity, exp(mean -log p(true token)).

`--from-llama-perplexity LOG` turns a `llama-perplexity --kl-divergence` run's printed
statistics into the same JSON keys, so both tables render from files of one shape.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REFERENCE = {"quantization": "none", "dtype": "float32", "activations": "auto", "kv_cache_dtype": "auto"}
# JSON keys of the figures, in the order they print (llama-perplexity's names beside them)
PERCENTILES = (("max_kld", 100.0), ("p999_kld", 99.9), ("p99_kld", 99.0), ("p95_kld", 95.0), ("p90_kld", 90.0),
               ("median_kld", 50.0), ("p10_kld", 10.0), ("p5_kld", 5.0), ("p1_kld", 1.0), ("p01_kld", 0.1), ("min_kld", 0.0))


def add_args(p: argparse.ArgumentParser) -> None:
    from radixserve.cli_args import add_engine_args

    add_engine_args(p)  # the candidate: any engine flag, as `serve` takes it
    p.add_argument("--text", default=None, help="the text to score (UTF-8), e.g. wikitext-2's test set")
    p.add_argument("--ctx", type=int, default=512, help="tokens per window (llama-perplexity's -c; default: 512)")
    p.add_argument("--chunks", type=int, default=8, help="windows to score, at most what the text holds (default: 8)")
    for name, default in REFERENCE.items():
        p.add_argument("--ref-" + name.replace("_", "-"), dest="ref_" + name, default=default,
                       help=f"the reference's --{name.replace('_', '-')} (default: {default})")
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.add_argument("--from-llama-perplexity", default=None, metavar="LOG",
                   help="read a `llama-perplexity --kl-divergence` log instead of measuring, and write its figures "
                        "under the same JSON keys (with --json)")
    p.add_argument("--label", default=None, help="a name for this row of the table (default: the candidate's settings)")


# --- the statistics ----------------------------------------------------------------------------


@dataclass
class Divergence:
    """Per scored position: KLD, whether the top tokens agree, the change in the true token's
    probability, and each side's log-probability of it."""

    kld: list[float] = field(default_factory=list)
    same: list[bool] = field(default_factory=list)
    dp: list[float] = field(default_factory=list)
    ref_lp: list[float] = field(default_factory=list)
    cand_lp: list[float] = field(default_factory=list)

    def add(self, ref: Any, cand: Any, targets: Any) -> None:
        """ref, cand: (rows, vocab) log-probabilities (torch); targets: (rows,) the true next tokens."""
        import torch

        ref64, cand64 = ref.double(), cand.double()
        p = ref64.exp()
        self.kld += (p * (ref64 - cand64)).sum(-1).clamp_min(0.0).tolist()  # >= 0 but for rounding
        self.same += (ref.argmax(-1) == cand.argmax(-1)).tolist()
        t = torch.as_tensor(targets, dtype=torch.long).unsqueeze(1)
        r, c = ref64.gather(1, t).squeeze(1), cand64.gather(1, t).squeeze(1)
        self.dp += (c.exp() - r.exp()).tolist()
        self.ref_lp += r.tolist()
        self.cand_lp += c.tolist()

    def summary(self) -> dict[str, float]:
        n = len(self.kld)
        if n == 0:
            raise ValueError("nothing was scored")
        kld, dp = np.asarray(self.kld), np.asarray(self.dp)
        same = float(np.mean(self.same))
        out = {
            "positions": n,
            "ppl_candidate": math.exp(-float(np.mean(self.cand_lp))),
            "ppl_reference": math.exp(-float(np.mean(self.ref_lp))),
            "mean_kld": float(kld.mean()),
            "mean_kld_err": float(kld.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0,
        }
        out.update({key: _percentile(kld, q) for key, q in PERCENTILES})
        out.update({
            "same_top": same,
            "same_top_err": math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0,
            "mean_dp": float(dp.mean()),
            "rms_dp": float(math.sqrt(float((dp * dp).mean()))),
        })
        return out


def _percentile(values: np.ndarray, q: float) -> float:
    """The q-th percentile as llama-perplexity takes it: linear between the two nearest ranks."""
    return float(np.percentile(values, q))


# --- the windows and the forward passes --------------------------------------------------------


def windows(tokenizer: Any, text: str, ctx: int, chunks: int) -> list[list[int]]:
    """llama-perplexity's windows: the whole text tokenized once, `chunks` runs of ctx tokens, each
    one's first token replaced by BOS where the tokenizer adds one."""
    if ctx < 4:
        raise ValueError(f"--ctx: at least 4 tokens per window, got {ctx}")
    if chunks < 1:
        raise ValueError(f"--chunks: at least 1, got {chunks}")
    ids = tokenizer.encode(text, add_special_tokens=True)
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and bool(ids) and ids[0] == bos
    have = len(ids) // ctx
    if have < 2:
        raise ValueError(f"--text: {len(ids)} tokens make {have} window(s) of --ctx {ctx}; at least 2 are needed "
                         f"({2 * ctx} tokens): give a longer text or a smaller --ctx")
    out = []
    for i in range(min(chunks, have)):
        w = ids[i * ctx : (i + 1) * ctx]
        if adds_bos:
            w[0] = bos
        out.append(w)
    return out


class Scorer:
    """One configuration's engine (no loop thread: nothing else runs on it), scoring one window
    at a time through the model as the engine's prefill runs it."""

    def __init__(self, model: str | None, overrides: dict[str, Any], ctx: int) -> None:
        from radixserve import Engine

        if overrides.get("tensor_parallel", 1) != 1 or overrides.get("pipeline_parallel", 1) != 1:
            raise ValueError("bench quality runs one process: --tensor-parallel and --pipeline-parallel must be 1")
        page = int(overrides.get("page_size") or 1)  # the pool rounds down to whole pages: room for ctx
        kw = {**overrides, "kv_cache_tokens": -(-ctx // page) * page, "kv_cache_memory_mb": None, "max_total_tokens": None,
              "disable_hybrid_swa_memory": True, "speculative": "none", "kv_disk_dir": None}
        self.engine = Engine(model, loop_thread=False, **kw)

    def close(self) -> None:
        self.engine.shutdown()

    def describe(self) -> dict[str, Any]:
        e = self.engine
        return {"quantization": e.quantization, "weight_bytes": e.weight_bytes, "dtype": str(e.dtype).removeprefix("torch."),
                "activations": e.activations, "kv_cache_dtype": str(e.kv_dtype).removeprefix("torch."),
                "cpu_kernels": e.cpu_kernels}

    def logprobs(self, ids: list[int], first: int) -> Any:
        """(len(ids) - 1 - first, vocab) fp32 log-probabilities of rows first .. len(ids) - 2."""
        import torch

        from radixserve.batch import ForwardBatch
        from radixserve.request import Req, SamplingParams
        from radixserve.sched.scheduler import PlanItem, SchedulePlan

        e = self.engine
        model, backend = e.runner.model, e.runner.backend
        req = Req(ids, SamplingParams(max_new_tokens=1))
        slots = list(range(len(ids)))
        step = e.config.sched.chunked_prefill_size
        rows = []
        with torch.inference_mode():
            for start in range(0, len(ids), step):
                n = min(step, len(ids) - start)
                batch = ForwardBatch.from_plan(SchedulePlan([PlanItem(req, start, n)]), lambda r: slots, backend, e.device)
                hidden = model(batch)
                lo, hi = max(first, start), min(len(ids) - 1, start + n)
                if hi > lo:
                    rows.append(model.compute_logits(hidden[lo - start : hi - start]))
            logits = torch.cat(rows)[:, : e.vocab_size].float()
            return torch.log_softmax(logits, -1)


def _open(model: str | None, overrides: dict[str, Any], ctx: int, what: str) -> Scorer:
    try:
        return Scorer(model, overrides, ctx)
    except Exception as e:  # a configuration the file cannot take: say which side it was
        raise ValueError(f"the {what} ({_settings(overrides)}) cannot load: {e}") from e


def _settings(overrides: dict[str, Any]) -> str:
    return " ".join(f"--{k.replace('_', '-')} {overrides[k]}" for k in REFERENCE if k in overrides)


def measure(model: str | None, text: str, ctx: int, chunks: int, candidates: list[dict[str, Any]],
            reference: dict[str, Any], log: Any = print) -> list[dict[str, Any]]:
    """Run the reference over every window, then each candidate in turn (one engine loaded at a
    time), and compare each with the reference: one report per candidate."""
    import torch

    first = ctx // 2
    t0 = time.monotonic()
    reports = []
    with tempfile.TemporaryDirectory(prefix="radixserve-quality-") as tmp:
        ref = _open(model, reference, ctx, "reference")
        try:
            wins = windows(ref.engine.tokenizer, text, ctx, chunks)
            ref_info, vocab = ref.describe(), ref.engine.vocab_size
            store = np.lib.format.open_memmap(os.path.join(tmp, "ref.npy"), mode="w+", dtype=np.float32,
                                              shape=(len(wins), ctx - 1 - first, vocab))
            for i, w in enumerate(wins):
                store[i] = ref.logprobs(w, first).numpy()
                log(f"reference: window {i + 1}/{len(wins)}")
        finally:
            ref.close()
        ref_s = time.monotonic() - t0
        for candidate in candidates:
            t1 = time.monotonic()
            cand = _open(model, candidate, ctx, "candidate")
            try:
                if cand.engine.vocab_size != vocab:
                    raise ValueError(f"the candidate's vocabulary ({cand.engine.vocab_size}) is not the reference's ({vocab})")
                div = Divergence()
                for i, w in enumerate(wins):
                    div.add(torch.from_numpy(np.asarray(store[i])), cand.logprobs(w, first), w[first + 1 :])
                    log(f"candidate: window {i + 1}/{len(wins)}")
                reports.append({"ctx": ctx, "chunks": len(wins), "candidate": cand.describe(), "reference": ref_info,
                                "seconds": {"reference": round(ref_s, 1), "candidate": round(time.monotonic() - t1, 1)},
                                **div.summary()})
            finally:
                cand.close()
    return reports


# --- llama-perplexity's log -----------------------------------------------------------------

_LP_KEYS = {  # llama-perplexity --kl-divergence's printed names -> ours
    "Mean PPL(Q)": "ppl_candidate", "Mean PPL(base)": "ppl_reference", "Mean KLD": "mean_kld",
    "Maximum KLD": "max_kld", "99.9% KLD": "p999_kld", "99.0% KLD": "p99_kld", "95.0% KLD": "p95_kld",
    "90.0% KLD": "p90_kld", "Median KLD": "median_kld", "10.0% KLD": "p10_kld", "5.0% KLD": "p5_kld", "1.0% KLD": "p1_kld",
    "0.1% KLD": "p01_kld", "Minimum KLD": "min_kld",
    "Mean Δp": "mean_dp", "RMS Δp": "rms_dp", "Same top p": "same_top",
}


def parse_llama_perplexity(log: str) -> dict[str, Any]:
    """The statistics a `llama-perplexity --kl-divergence` run prints, under this bench's keys
    (percentages as shares, as ours are). Lines are split at their colon: no regex backtracks."""
    out: dict[str, Any] = {}
    for line in log.splitlines():
        name, sep, rest = line.partition(":")
        if not sep:
            continue
        key = _LP_KEYS.get(" ".join(name.split()))
        if key is None:
            continue
        value, _, err = rest.strip().rstrip("%").strip().partition("±")
        try:
            x = float(value)
        except ValueError:
            continue
        pct = rest.strip().endswith("%") or key in ("mean_dp", "rms_dp")
        scale = 0.01 if pct else 1.0
        out[key] = x * scale
        if err.strip():
            out[key + "_err"] = float(err.strip()) * scale
    missing = [k for k in ("mean_kld", "same_top") if k not in out]
    if missing:
        raise ValueError(f"--from-llama-perplexity: no {', '.join(missing)} in the log (was it run with --kl-divergence?)")
    out["source"] = "llama-perplexity"
    return out


# --- the command ------------------------------------------------------------------------------


def print_report(r: dict[str, Any]) -> None:
    print("====== Perplexity statistics ======")
    print(f"PPL(candidate)       : {r['ppl_candidate']:10.4f}")
    print(f"PPL(reference)       : {r['ppl_reference']:10.4f}")
    print("====== KL divergence statistics ======")
    print(f"Mean    KLD          : {r['mean_kld']:10.6f} ± {r.get('mean_kld_err', 0.0):.6f}")
    for key, q in PERCENTILES:
        if key in r:  # (llama-perplexity prints some of them)
            print(f"{q:5.1f}%  KLD          : {r[key]:10.6f}")
    print("====== Token probability statistics ======")
    print(f"Mean    Δp           : {100 * r['mean_dp']:8.3f} %")
    print(f"RMS     Δp           : {100 * r['rms_dp']:8.3f} %")
    print(f"Same top token       : {100 * r['same_top']:8.3f} ± {100 * r.get('same_top_err', 0.0):.3f} %")


def run(args: argparse.Namespace) -> int:
    if args.from_llama_perplexity:
        r = parse_llama_perplexity(Path(args.from_llama_perplexity).read_text(encoding="utf-8", errors="replace"))
        r["label"] = args.label or "llama.cpp"
    else:
        if not args.text:
            raise ValueError("--text: give the text to score (or --from-llama-perplexity LOG)")
        text = Path(args.text).read_text(encoding="utf-8")
        from radixserve.cli_args import engine_kwargs

        candidate = engine_kwargs(args)
        reference = {**candidate, **{k: getattr(args, "ref_" + k) for k in REFERENCE}}
        r = measure(args.model, text, args.ctx, args.chunks, [candidate], reference)[0]
        r.update(model=str(args.model or "SmolLM2-135M-Instruct (default)"), text=str(args.text))
        r["label"] = args.label or _settings(candidate)
    print_report(r)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
