"""Where one request's decode steps go, in the engine as an engine process runs it (the loop on
this process's main thread): the loop's whole step, the runner (batch, forward, head, sampling),
the model's forward and, where the model has it, the fused native decode call; the median over
a generation of fixed length, after a first generation of the same prompt (so its prefill and
first steps are not counted). The server's own share (the process boundary, HTTP, the client)
is what `bench compare --roof` measures beyond this.

    .venv/bin/python scripts/step_breakdown.py FILE.gguf [--tokens 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from radixserve import Engine, SamplingParams
from radixserve.engine import loop as engine_loop
from radixserve.models import llama


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=200)
    args = p.parse_args()
    times: dict[str, list[float]] = defaultdict(list)

    def timed(owner: Any, name: str, key: str) -> None:
        fn: Callable[..., Any] = getattr(owner, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times[key].append(time.perf_counter() - t0)

        setattr(owner, name, wrapper)

    eng = Engine(args.model, kv_cache_tokens=4096, loop_thread=False)
    runner = eng.runner
    timed(engine_loop.EngineLoop, "_step", "step (the loop's)")
    timed(runner, "run", "runner")
    timed(type(runner.model), "forward", "model forward")
    timed(llama.FusedDecode, "run", "fused native call")
    weights = eng.step_weight_bytes

    async def generate() -> None:
        params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True, temperature=0)
        async for _ in eng.submit([5, 6, 7, 8] * 8, params):
            pass

    def client() -> None:
        asyncio.run(generate())
        times.clear()
        asyncio.run(generate())  # the same prompt: a cache hit, then decode steps only
        eng.stop_loop()

    t = threading.Thread(target=client)
    t.start()
    eng.run_loop()
    t.join()
    print(f"{args.model}: {args.tokens} tokens, a step reads {weights / 2**20:.0f} MiB of weights "
          "(/server_info's step_weight_bytes)")
    for key, v in times.items():
        print(f"  {key:20s} median {1e3 * statistics.median(v):6.2f} ms over {len(v)} calls")
    eng.shutdown()


if __name__ == "__main__":
    main()
