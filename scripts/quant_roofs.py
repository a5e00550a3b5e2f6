"""How close each quantized linear kernel gets to this machine's memory roof at one row (decode
at batch 1 is bound by reading the weights), and its rate at 32 rows, per GGUF kind and per
kernel build this CPU runs. The roof is measured here, STREAM-like: the read rate of a sum
over a 1 GiB array, and the rate of a 1 GiB copy (read + write), on torch's threads.

    .venv/bin/python scripts/quant_roofs.py [--mib 512] [--kinds q4_0,q4_k,...] [--isas avx512,avx2] [--bits 8,16]

Each kind is timed over Qwen2.5-1.5B-shaped weights (a layer's q/k/v, o, gate/up and down,
repeated to --mib MiB of packed blocks, each weight distinct, so they stream from memory).
Prints a table: kind, build, activation bits (--activations int8 / int16), packed GB/s at one
row (and its share of the read roof), ms per pass, the same one row over a single q/k/v weight
called again and again (it stays in cache: the kernel's own ceiling at one row, calls included),
and GMAC/s at 32 and 64 rows.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from radixserve_kernels import cpu

SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]  # Qwen2.5-1.5B: qkv, o, gate_up, down


def best_of(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def roofs() -> tuple[float, float]:
    a = torch.ones(2**28)  # 1 GiB of fp32
    b = torch.empty_like(a)
    read = a.numel() * 4 / best_of(lambda: a.sum()) / 1e9
    copy = 2 * a.numel() * 4 / best_of(lambda: b.copy_(a)) / 1e9
    return read, copy


def weights(kind: str, mib: int, ops) -> list[tuple[torch.Tensor, int, int]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tests/, run as a script
    from tests.test_quant import gguf_blocks

    out, total = [], 0
    seed = 0
    while total < mib * 2**20:
        for n, k in SHAPES:
            raw, _ = gguf_blocks(kind, 64, k, seed)  # 64 distinct rows, tiled: the values do not matter, the bytes do
            seed += 1
            p = ops.pack_quant(raw.repeat(n // 64, 1), kind, n, k)
            out.append((p, n, k))
            total += p.numel()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--kinds", default="q4_0,q4_1,q8_0,q5_0,q5_1,q4_k,q5_k,q6_k")
    ap.add_argument("--isas", default=",".join(i for i in cpu.runnable_isas() if i != "generic"))
    ap.add_argument("--bits", default="8,16", help="activation bits to time (8: --activations int8, 16: int16)")
    args = ap.parse_args()
    read, copy = roofs()
    print(f"memory roof: read {read:.1f} GB/s (sum of 1 GiB), copy {copy:.1f} GB/s (read + write of 1 GiB), "
          f"{torch.get_num_threads()} threads")
    print("| kind | build | bits | 1 row: packed GB/s | share of the read roof | ms a pass | 1 row in cache: GB/s "
          "| 32 rows: GMAC/s | 64 rows: GMAC/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind in args.kinds.split(","):
        for isa in args.isas.split(","):
            ops = cpu.ops_for(isa)
            ws = weights(kind, args.mib, ops)
            nbytes = sum(p.numel() for p, _, _ in ws)
            macs = sum(n * k for _, n, k in ws)
            xs = {k: torch.randn(64, k) for _, k in SHAPES}
            for bits in map(int, args.bits.split(",")):
                def run(rows: int, ws=ws, xs=xs, ops=ops, bits=bits) -> None:
                    for p, n, k in ws:
                        ops.qlinear(xs[k][:rows], p, n, None, True, False, bits)

                def resident(ws=ws, xs=xs, ops=ops, bits=bits) -> None:
                    p, n, k = ws[0]
                    for _ in range(100):
                        ops.qlinear(xs[k][:1], p, n, None, True, False, bits)

                t1 = best_of(lambda: run(1), 3)
                t_res = best_of(resident, 5) / 100
                t32 = best_of(lambda: run(32), 2)
                t64 = best_of(lambda: run(64), 2)
                gbs = nbytes / t1 / 1e9
                print(f"| {kind} | {ops.isa()} | {bits} | {gbs:.1f} | {gbs / read:.0%} | {t1 * 1e3:.1f} | "
                      f"{ws[0][0].numel() / t_res / 1e9:.1f} | {32 * macs / t32 / 1e9:.0f} | {64 * macs / t64 / 1e9:.0f} |",
                      flush=True)
            del ws


if __name__ == "__main__":
    main()
