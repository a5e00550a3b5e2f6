"""Time one decode step of the engine's model in this process (the loop's own thread), on a
synthetic batch: B requests with L tokens of context each (contiguous slots, random K/V), the
model, the head and an argmax; the median of several rounds. With --profile, torch.profiler's
op table over 10 steps (radixserve's native calls show as native::NAME).

    .venv/bin/python scripts/decode_step.py --dtype bfloat16 --batch 32 --context 200 [--kernels layers] [--profile]
        [--quantization none] [--kv-cache-dtype int8] [--model FILE.gguf]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from radixserve import Engine
from radixserve.batch import ForwardBatch, SeqView
from radixserve_kernels import cpu


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="a model folder or .gguf file (default: the default model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=150)
    p.add_argument("--kernels", choices=["fused", "layers", "torch"], default="fused",
                   help="fused: the decode step in one native call (the default); layers: native kernels called layer by "
                        "layer; torch: --disable-cpu-kernels (torch ops, oneDNN-packed linears)")
    p.add_argument("--quantization", default="auto", help="auto (the default model: its Q4_1 weights) | none | int8 | int4")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | bf16 | fp8_e4m3 | int8")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    b, ctx = args.batch, args.context
    eng = Engine(args.model, loop_thread=False, dtype=args.dtype, kv_cache_tokens=b * (ctx + 8) + 64,
                 disable_cpu_kernels=args.kernels == "torch", quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    torch.set_flush_denormal(True)
    model, backend = eng.runner.model, eng.runner.backend
    if args.kernels == "layers":
        model.model.fused = None
    for t in eng.pool.k + eng.pool.v:  # random K/V (a quantized pool: random codes at a plausible scale)
        t.copy_(torch.randn(t.shape).clamp(-4, 4).mul(32 if t.dtype == torch.int8 else 1).to(t.dtype))
    for t in eng.pool.k_scale + eng.pool.v_scale:
        t.fill_(1 / 32 if eng.pool.kv_dtype == torch.int8 else 1.0)

    @torch.inference_mode()
    def step() -> torch.Tensor:
        seqs = [SeqView(i, 1, ctx, list(range(i * (ctx + 8), i * (ctx + 8) + ctx + 1))) for i in range(b)]
        batch = ForwardBatch(torch.randint(min(100, eng.vocab_size // 2), min(1000, eng.vocab_size), (b,)), torch.full((b,), ctx),
                             torch.tensor([s.slots[-1] for s in seqs]), seqs, backend)
        backend.prepare(batch)
        return model.compute_logits(model(batch)).argmax(-1)

    if args.profile:
        _wrap_native(model)
    time.sleep(3)  # steps in the first seconds after the start ran ~3x slower here (measured): let it settle
    for _ in range(5):
        step()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(10):
            step()
        rounds.append((time.perf_counter() - t) * 100)
    print(f"{args.dtype} batch {b} context {ctx} kernels {args.kernels}: {statistics.median(rounds):.1f} ms a step "
          f"(rounds {', '.join(f'{r:.1f}' for r in rounds)})")
    if args.profile:
        with torch.profiler.profile() as prof:
            for _ in range(10):
                step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    eng.shutdown()


def _wrap_native(model: torch.nn.Module) -> None:
    """Name radixserve's native calls in the profile (it sees only torch ops otherwise)."""
    ops = cpu.ops()
    if ops is None:
        return

    class Named:
        def __getattr__(self, name: str):
            fn = getattr(ops, name)

            def call(*a, **k):
                with torch.profiler.record_function("native::" + name):
                    return fn(*a, **k)
            return call

    named = Named()
    cpu._state[cpu.chosen_isa()] = named  # type: ignore[assignment]
    for m in model.modules():
        if getattr(m, "native", None) is not None:
            m.native = named
    fused = getattr(getattr(model, "model", None), "fused", None)
    if fused is not None:
        fused.ops = named


if __name__ == "__main__":
    main()
