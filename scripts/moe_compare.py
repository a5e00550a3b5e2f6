"""A mixture-of-experts file on radixserve and on llama-server, same run, rounds alternating
(each round: radixserve then llama-server, each started fresh, nothing else running): one
request's decode rate (128 tokens: the difference of a 144- and a 16-token completion of the
same 64-token prompt), 8 concurrent requests of 64 tokens, and a 512-token prefill; fixed
lengths (ignore_eos), since a random-weight file's text is noise. Prints each ratio's rounds and
median (above 1: radixserve better), and writes them with every measurement to OUT.json.

    .venv/bin/python scripts/moe_compare.py FILE.gguf LLAMA_SERVER ROUNDS OUT.json
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

Gen = Callable[[list[int], int], Any]


def post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1200) as r:
        return json.loads(r.read())


def wait(url: str) -> None:
    for _ in range(600):
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{url}: no server")


def prompt(seed: int, n: int) -> list[int]:
    return [5 + (seed * 31 + i * 7) % 370 for i in range(n)]


def measure(gen: Gen) -> dict[str, float]:
    gen(prompt(0, 16), 8)
    t = time.monotonic()
    gen(prompt(1, 64), 16)
    short = time.monotonic() - t
    t = time.monotonic()
    gen(prompt(1, 64), 144)
    single = 128 / (time.monotonic() - t - short)
    with ThreadPoolExecutor(8) as pool:
        t = time.monotonic()
        list(pool.map(lambda i: gen(prompt(10 + i, 64), 64), range(8)))
        batch = 8 * 64 / (time.monotonic() - t)
    t = time.monotonic()
    gen(prompt(99, 512), 1)
    return {"single_tok_s": round(single, 1), "batch8_tok_s": round(batch, 1), "prefill512_s": round(time.monotonic() - t, 2)}


def main() -> None:
    file, peer, rounds, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    ours = str(Path(sys.executable).with_name("radixserve"))
    servers: dict[str, tuple[list[str], Gen]] = {
        "radixserve": ([ours, "serve", "--model", file, "--port", "30011", "--kv-cache-tokens", "8192"],
                       lambda ids, n: post("http://127.0.0.1:30011/generate", {
                           "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}})),
        "llama.cpp": ([peer, "-m", file, "-t", "2", "-np", "8", "-c", "8192", "--port", "30012"],
                      lambda ids, n: post("http://127.0.0.1:30012/completion", {
                          "prompt": ids, "n_predict": n, "ignore_eos": True, "temperature": 0, "cache_prompt": False})),
    }
    runs = []
    for _ in range(rounds):
        got: dict[str, Any] = {}
        for name, (cmd, gen) in servers.items():
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            try:
                wait(f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}/health")
                got[name] = measure(gen)
            finally:
                proc.terminate()
                proc.wait()
        r, p = got["radixserve"], got["llama.cpp"]
        got["ratio"] = {"single": round(r["single_tok_s"] / p["single_tok_s"], 2),
                        "batch8": round(r["batch8_tok_s"] / p["batch8_tok_s"], 2),
                        "prefill512": round(p["prefill512_s"] / r["prefill512_s"], 2)}
        runs.append(got)
    medians = {k: statistics.median(x["ratio"][k] for x in runs) for k in ("single", "batch8", "prefill512")}
    for k, v in medians.items():
        print(k, [x["ratio"][k] for x in runs], "median", v)
    out.write_text(json.dumps({"file": Path(file).name, "date": time.strftime("%Y-%m-%d"), "medians": medians, "runs": runs},
                              indent=1) + "\n")


if __name__ == "__main__":
    main()
