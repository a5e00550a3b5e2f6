"""`radixserve bench coldstart`: a start of `radixserve serve`, to its first answer, as a user
or an autoscaler's new replica sees it (the CPU kernels prebuilt, as the set-up script, the
Dockerfile and any second start have them), beside llama.cpp's `llama-server` on the same file.

Conditions, `--runs` starts each, interleaved (drift hits every condition alike):
- `new-file`: a GGUF file never served here: its cached config and tokenizer folder and its
  packed weights removed first (what a user's first start of a downloaded file has);
- `page-cache`: a second start, the weights' files in the OS page cache;
- `cold-disk`: the same with the weights' files and the model's cached folder evicted from the
  page cache first (posix_fadvise DONTNEED), and `cold-disk-no-prefetch` with
  RADIXSERVE_PREFETCH=0 (the engine does not ask for the files before it imports torch).

For each start: until the server listens, until /health answers 200, and until the first token
of a streamed chat completion (the chat template, the tokenizer and the model's first step,
`max_tokens` 1) arrives; and the engine's own load time from /server_info. `--llama-server
BIN` starts the peer on the same file (in the page cache), with the same context and threads,
after each round, to the same first token, and prints the ratios of the medians; and times a
fresh interpreter importing the CPU kernels (`kernel import`: torch and the prebuilt extension).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

CONDITIONS = ("new-file", "page-cache", "cold-disk", "cold-disk-no-prefetch")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf, a Hugging Face folder, or unset: the default model")
    p.add_argument("--runs", type=int, default=3, help="starts per condition")
    p.add_argument("--port", type=int, default=18931)
    p.add_argument("--conditions", default=",".join(CONDITIONS),
                   help=f"comma-separated, of: {', '.join(CONDITIONS)} (new-file needs a .gguf --model)")
    p.add_argument("--context", type=int, default=4096, help="the KV cache's tokens, both servers (--kv-cache-tokens, -c)")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary: the peer, on the same .gguf file")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the peer's -t")
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


def _read(path: Path) -> None:
    """Read a file through once (into the page cache), 64 MiB at a time."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def _stop(proc: subprocess.Popen[Any]) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def forget(gguf: Path) -> list[Path]:
    """Remove what a first start of this GGUF file writes (its config and tokenizer folder, its
    packed weights), so the next start is a new file's; returns what was removed."""
    from radixserve.models import packed_cache
    from radixserve.models.gguf import meta_dir

    gone = [d for d in (meta_dir(gguf), packed_cache.cache_file(gguf).parent) if d.exists()]
    for d in gone:
        shutil.rmtree(d)
    return gone


def _model_files(model: str | None) -> list[Path]:
    """The files a start reads: the weights (a GGUF and its packed caches, or safetensors) and the tokenizer's folder."""
    from radixserve.models.files import tokenizer_dir, weight_files

    return sorted({*weight_files(model), Path(tokenizer_dir(model))})


def first_token(url: str, model: str | None = None) -> None:
    """A streamed chat completion's first token."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 1, "stream": True}
    if model:
        body["model"] = model
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            if raw.startswith(b"data: {"):
                return
    raise SystemExit(f"bench coldstart: {url} streamed no token")


def _healthy(url: str, proc: subprocess.Popen[Any], what: str) -> None:
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"bench coldstart: {what} exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=10) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.02)


def start_once(args: argparse.Namespace, env: dict[str, str] | None = None) -> dict[str, float]:
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(args.port),
           "--kv-cache-tokens", str(args.context), *args.serve_arg]
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
        _healthy(url, proc, "the server")
        row["healthy_s"] = time.monotonic() - t0
        first_token(url)
        row["first_token_s"] = time.monotonic() - t0
        with urllib.request.urlopen(url + "/server_info", timeout=10) as r:
            info = json.loads(r.read())
        row["engine_load_s"] = info["load"]["seconds"]
    finally:
        _stop(proc)
    return row


def peer_once(args: argparse.Namespace) -> dict[str, float]:
    port = args.port + 1
    url = f"http://127.0.0.1:{port}"
    cmd = [args.llama_server, "-m", args.model, "-t", str(args.threads), "-c", str(args.context), "--jinja",
           "--port", str(port)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _healthy(url, proc, "llama-server")
        row = {"healthy_s": time.monotonic() - t0}
        first_token(url)
        row["first_token_s"] = time.monotonic() - t0
    finally:
        _stop(proc)
    return row


def kernel_import() -> dict[str, float]:
    """A fresh interpreter importing the CPU kernels (torch, and the prebuilt extension)."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import radixserve_kernels.cpu as k; k.ops()"], check=True)
    return {"first_token_s": time.monotonic() - t0}


def run(args: argparse.Namespace) -> int:
    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    unknown = [c for c in conditions if c not in CONDITIONS]
    gguf = Path(args.model) if args.model and args.model.endswith(".gguf") else None
    if unknown:
        raise SystemExit(f"bench coldstart: --conditions: unknown {', '.join(map(repr, unknown))} (of {', '.join(CONDITIONS)})")
    if "new-file" in conditions and gguf is None:
        raise SystemExit("bench coldstart: --conditions new-file needs --model FILE.gguf")
    if args.llama_server and gguf is None:
        raise SystemExit("bench coldstart: --llama-server needs --model FILE.gguf (the file both serve)")
    start_once(args)  # a first start builds whatever is not cached yet (kernels, a GGUF's folders)
    files = _model_files(args.model)
    envs = {"cold-disk-no-prefetch": {"RADIXSERVE_PREFETCH": "0"}}
    results: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.runs):
        for condition in conditions:
            if condition == "new-file":
                assert gguf is not None
                forget(gguf)
            if condition.startswith("cold-disk"):
                evict(files)
            else:
                for f in _model_files(args.model) if gguf is None or condition != "new-file" else [gguf]:
                    for p in [f] if f.is_file() else [p for p in f.rglob("*") if p.is_file()]:
                        _read(p)  # read once: in the page cache
            results.setdefault(condition, []).append(start_once(args, envs.get(condition)))
        if args.llama_server:
            assert gguf is not None
            _read(gguf)  # the peer's file in the page cache too (a cold-disk condition may have evicted it)
            results.setdefault("llama-server", []).append(peer_once(args))
            results.setdefault("kernel import", []).append(kernel_import())
    print(f"{'condition':>22} | {'listening':>9} | {'healthy':>8} | {'first token':>11} | {'engine load':>11}")
    summary: dict[str, dict[str, float]] = {}
    for condition, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        summary[condition] = med
        cells = [f"{med[k]:>{w - 1}.2f}s" if k in med else " " * w
                 for k, w in (("listening_s", 9), ("healthy_s", 8), ("first_token_s", 11), ("engine_load_s", 11))]
        print(f"{condition:>22} | " + " | ".join(cells))
    if "llama-server" in summary:
        peer, imp = summary["llama-server"], summary["kernel import"]["first_token_s"]
        for condition in conditions:
            ours = summary[condition]
            print(f"{condition}: healthy {ours['healthy_s'] / peer['healthy_s']:.2f}x llama-server's, first token "
                  f"{ours['first_token_s'] / peer['first_token_s']:.2f}x; first token {ours['first_token_s']:.2f} s against "
                  f"3x llama-server's + the kernels' import: {3 * peer['first_token_s'] + imp:.2f} s")
    print(f"(medians of {args.runs} starts; model files: {', '.join(map(str, files))})")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "median": summary, "context": args.context,
                                               "threads": args.threads}, indent=1))
    return 0
