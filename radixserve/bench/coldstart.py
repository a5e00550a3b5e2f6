"""`radixserve bench coldstart`: a new replica's cold start, from `radixserve serve` starting to
its first served token, as an autoscaler's new replica sees it (the CPU kernels prebuilt, as
the Dockerfile and any second start have them).

Conditions, `--runs` starts each, one after the other: `page-cache` (the weights' file in the
OS page cache, as on a node that served the model before), and `cold-disk` (the weights' file
and the model's cached folder evicted from the page cache first, with posix_fadvise
DONTNEED: read from disk again), and `cold-disk, no prefetch` (the same with
RADIXSERVE_PREFETCH=0: the engine process does not ask for the weights' files before it imports
torch, as before this round). For each start: the time until the server listens, until
/health answers 200, and until the first token of a streamed completion arrives; and the
engine's own load time (weights read and packed) from /server_info.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf, a Hugging Face folder, or unset: the default model")
    p.add_argument("--runs", type=int, default=3, help="starts per condition")
    p.add_argument("--port", type=int, default=18931)
    p.add_argument("--serve-arg", action="append", default=[], help="one more `radixserve serve` argument (repeat)")
    p.add_argument("--json", default=None, help="write the figures to this file")


def evict(paths: list[Path]) -> int:
    """Drop these files (folders: every file under them) from the page cache; returns the bytes."""
    total = 0
    for root in paths:
        for f in [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def _model_files(model: str | None) -> list[Path]:
    """The files a start reads: the weights (a GGUF and its packed caches, or safetensors) and the tokenizer's folder."""
    from radixserve.models.files import tokenizer_dir, weight_files

    return sorted({*weight_files(model), Path(tokenizer_dir(model))})


def start_once(args: argparse.Namespace, env: dict[str, str] | None = None) -> dict[str, float]:
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "radixserve.server.cli", "serve", "--port", str(args.port), *args.serve_arg]
    if args.model:
        cmd += ["--model", args.model]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    row: dict[str, float] = {}
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "radixserve ready at" in line:
                row["listening_s"] = time.monotonic() - t0
                break
        else:
            raise SystemExit(f"bench coldstart: the server exited ({proc.wait()})")
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=10) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.02)
        row["healthy_s"] = time.monotonic() - t0
        body = json.dumps({"prompt": "Hello", "max_tokens": 1, "stream": True}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            for raw in r:
                if raw.startswith(b"data: {"):
                    row["first_token_s"] = time.monotonic() - t0
                    break
        with urllib.request.urlopen(url + "/server_info", timeout=10) as r:
            info = json.loads(r.read())
        row["engine_load_s"] = info["load"]["seconds"]
    finally:
        proc.terminate()
        proc.wait(60)
    return row


def run(args: argparse.Namespace) -> int:
    results: dict[str, list[dict[str, float]]] = {}
    start_once(args)  # a first start builds whatever is not cached yet (kernels, a GGUF's converted folder)
    files = _model_files(args.model)
    conditions = {"page-cache": {}, "cold-disk": {}, "cold-disk, no prefetch": {"RADIXSERVE_PREFETCH": "0"}}
    for _ in range(args.runs):  # interleaved: drift hits every condition alike
        for condition, env in conditions.items():
            if condition.startswith("cold-disk"):
                evict(files)
            else:
                for f in files:  # read once: in the page cache
                    for p in [f] if f.is_file() else [p for p in f.rglob("*") if p.is_file()]:
                        p.read_bytes()
            results.setdefault(condition, []).append(start_once(args, env))
    print(f"{'condition':>22} | {'listening':>9} | {'healthy':>8} | {'first token':>11} | {'engine load':>11}")
    summary: dict[str, dict[str, float]] = {}
    for condition, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        summary[condition] = med
        print(f"{condition:>22} | {med['listening_s']:>8.2f}s | {med['healthy_s']:>7.2f}s | {med['first_token_s']:>10.2f}s | "
              f"{med['engine_load_s']:>10.2f}s")
    print(f"(medians of {args.runs} starts; model files: {', '.join(map(str, files))})")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "median": summary}, indent=1))
    return 0
