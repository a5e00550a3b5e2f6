"""GPU check of the Triton kernels and the `triton` attention backend, in one command:

    python scripts/gpu_check.py            # a CUDA machine with the repo installed (pip install -e .)
    python scripts/gpu_check.py --quick    # kernels only (no model benchmarks)
    python scripts/gpu_check.py --smoke    # no GPU: the correctness part at 1/64 size in the Triton
                                           # interpreter, so the script itself is tested on CPU

1. Correctness at real sizes: every kernel against its torch reference on fresh random inputs
   (outputs poisoned first; scattered slot tables), fp32 (‖out−ref‖/‖ref‖ < 1e-3) and bf16 (< 2e-2).
2. Speed: each kernel timed with triton.testing.do_bench (median), its achieved memory
   bandwidth printed against the card's measured device-to-device copy bandwidth.
3. `radixserve bench offline` and `radixserve bench prefix` on SmolLM2 in bf16 with
   `--attention-backend triton` (Hugging Face on the same GPU and dtype as the baseline).

Prints a short table last. Sized to finish in under 8 minutes on one H200.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]

from radixserve_kernels.decode_attention import decode_attention_ref, decode_attention_triton  # noqa: E402
from radixserve_kernels.extend_attention import extend_attention_ref, extend_attention_triton  # noqa: E402
from radixserve_kernels.store_kv import store_kv_ref, store_kv_triton  # noqa: E402

DEV = torch.device("cpu" if SMOKE else "cuda")
SCALE = 64 if SMOKE else 1  # lengths are divided by this
TOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2}
SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}  # heads, kv_heads, head_dim


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def table_for(lens: list[int], slots: int, g: torch.Generator) -> torch.Tensor:
    perm = torch.randperm(slots, generator=g)
    table = torch.zeros(len(lens), max(lens), dtype=torch.int32)
    at = 0
    for i, n in enumerate(lens):
        table[i, :n] = perm[at : at + n].to(torch.int32)
        at += n
    return table.to(DEV)


def pools(slots: int, kv_heads: int, dim: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(slots, kv_heads, dim, generator=g).to(DEV, dtype) for _ in range(2))  # type: ignore[return-value]


def check_decode(shape: str, dtype: torch.dtype, lens: list[int], bench: bool) -> dict:
    heads, kv_heads, dim = SHAPES[shape]
    g = torch.Generator().manual_seed(len(lens))
    slots = sum(lens) + 64
    k, v = pools(slots, kv_heads, dim, dtype, g)
    table = table_for(lens, slots, g)
    q = torch.randn(len(lens), heads, dim, generator=g).to(DEV, dtype)
    rows = torch.arange(len(lens), dtype=torch.int32, device=DEV)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    ref, out = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    decode_attention_ref(q, k, v, ref, rows, table, seq)
    decode_attention_triton(q, k, v, out, rows, table, seq)
    row = {"kernel": "decode", "shape": f"{shape} B={len(lens)} kv={sum(lens) // len(lens)}", "dtype": _name(dtype),
           "rel_err": rel_err(out, ref), "ok": rel_err(out, ref) < TOL[dtype]}
    if bench:
        ms = _bench(lambda: decode_attention_triton(q, k, v, out, rows, table, seq))
        nbytes = 2 * sum(lens) * kv_heads * dim * k.element_size() + 2 * q.numel() * q.element_size() + table.numel() * 4
        row.update(us=ms * 1e3, gbps=nbytes / ms / 1e6)
    return row


def check_extend(shape: str, dtype: torch.dtype, q_lens: list[int], prefix_lens: list[int], bench: bool) -> dict:
    heads, kv_heads, dim = SHAPES[shape]
    g = torch.Generator().manual_seed(sum(q_lens))
    lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    slots = sum(lens) + 64
    k, v = pools(slots, kv_heads, dim, dtype, g)
    table = table_for(lens, slots, g)
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    q = torch.randn(sum(q_lens), heads, dim, generator=g).to(DEV, dtype)
    args = [torch.tensor(x, dtype=torch.int32, device=DEV) for x in (starts, q_lens, prefix_lens)]
    ref, out = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    extend_attention_ref(q, k, v, ref, *args, table)
    extend_attention_triton(q, k, v, out, *args, table, max(q_lens))
    row = {"kernel": "extend", "shape": f"{shape} N={len(q_lens)} q={q_lens[0]} prefix={prefix_lens[0]}",
           "dtype": _name(dtype), "rel_err": rel_err(out, ref), "ok": rel_err(out, ref) < TOL[dtype]}
    if bench:
        ms = _bench(lambda: extend_attention_triton(q, k, v, out, *args, table, max(q_lens)))
        flops = sum(4 * n * (p + n / 2) * heads * dim for p, n in zip(prefix_lens, q_lens))
        nbytes = 2 * sum(lens) * kv_heads * dim * k.element_size() + 2 * q.numel() * q.element_size()
        row.update(us=ms * 1e3, gbps=nbytes / ms / 1e6, tflops=flops / ms / 1e9)
    return row


def check_store(shape: str, dtype: torch.dtype, tokens: int, bench: bool) -> dict:
    _, kv_heads, dim = SHAPES[shape]
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 3, kv_heads, dim, generator=g).to(DEV, dtype)
    k, v = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(tokens * 2, generator=g)[:tokens].to(DEV)
    want = [torch.full((tokens * 2, kv_heads, dim), float("nan"), dtype=dtype, device=DEV) for _ in range(2)]
    got = [w.clone() for w in want]
    store_kv_ref(*want, slots, k, v)
    store_kv_triton(*got, slots, k, v)
    ok = torch.equal(got[0][slots], want[0][slots]) and torch.equal(got[1][slots], want[1][slots])
    row = {"kernel": "store_kv", "shape": f"{shape} T={tokens}", "dtype": _name(dtype), "rel_err": 0.0 if ok else 1.0, "ok": ok}
    if bench:
        ms = _bench(lambda: store_kv_triton(*got, slots, k, v))
        row.update(us=ms * 1e3, gbps=2 * 2 * k.numel() * k.element_size() / ms / 1e6)
    return row


def check_quant(kind: str, dtype: torch.dtype, m: int, n: int, k: int, bench: bool) -> dict:
    """kernels/radixserve_kernels/quant_matmul.py (QuantLinear's CUDA path) against its torch reference; the blocks
    are random bytes with sane fp16 scales, packed by the CPU kernels as the loader packs them."""
    from radixserve_kernels import cpu
    from radixserve_kernels.quant_matmul import quant_matmul_ref, quant_matmul_triton

    g = torch.Generator().manual_seed(m + n + k)
    block = {"q4_0": 18, "q4_1": 20, "q8_0": 34}[kind]
    raw = torch.randint(0, 256, (n, k // 32, block), dtype=torch.uint8, generator=g)
    raw[..., :2] = torch.full((n, k // 32), 0.01).half().view(torch.uint8).view(n, k // 32, 2)
    if kind == "q4_1":
        raw[..., 2:4] = torch.full((n, k // 32), -0.08).half().view(torch.uint8).view(n, k // 32, 2)
    packed = cpu.ops().pack_quant(raw.view(n, -1), kind, n, k).to(DEV)
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    ref = quant_matmul_ref(x, packed, n)
    err = rel_err(quant_matmul_triton(x, packed, n), ref)
    row = {"kernel": "qmatmul", "shape": f"{kind} M={m} N={n} K={k}", "dtype": _name(dtype), "rel_err": err,
           "ok": err < (1e-3 if dtype == torch.float32 else 2e-2)}
    if bench:
        ms = _bench(lambda: quant_matmul_triton(x, packed, n))
        row.update(us=ms * 1e3, gbps=packed.numel() / ms / 1e6, tflops=2 * m * n * k / ms / 1e9)
    return row


def copy_bandwidth() -> float:
    x = torch.empty(1 << 28, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    return 2 * x.numel() / _bench(lambda: y.copy_(x)) / 1e6  # GB/s: read + write


def _bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kernels(bench: bool) -> list[dict]:
    def n(x: int) -> int:
        return max(1, x // SCALE)

    def ns(xs: list[int]) -> list[int]:
        return [n(x) if x else 0 for x in xs]

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        timed = bench and dtype == torch.bfloat16  # fp32 is checked for accuracy; serving runs bf16
        for shape in SHAPES:
            g = torch.Generator().manual_seed(0)
            mixed = torch.randint(1, n(4096) + 1, (n(64),), generator=g).tolist()
            rows.append(check_decode(shape, dtype, mixed, False))  # lengths 1..4096 in one batch
            rows.append(check_decode(shape, dtype, [n(2048)] * n(64), timed))  # steady decode
            rows.append(check_decode(shape, dtype, [n(32768)], timed))  # one long context: split-KV
            rows.append(check_extend(shape, dtype, [n(512)] * 4, [0] * 4, timed))  # prefill
            rows.append(check_extend(shape, dtype, ns([512, 77, 1, 300]), ns([2048, 0, 900, 31]), False))  # over prefixes
            rows.append(check_extend(shape, dtype, [n(256)] * 8, [n(2048)] * 8, timed))  # chunks over a cached prefix
            rows.append(check_store(shape, dtype, n(8192), timed))
        for kind in ("q4_1", "q8_0"):
            for m in (1, 32, n(512)):
                rows.append(check_quant(kind, dtype, m, n(4096), n(4096) // 32 * 32 or 32, timed))
    return rows


def model_benches(out: Path) -> dict:
    common = ["--dtype", "bfloat16", "--attention-backend", "triton"]
    runs = {
        "offline": ["bench", "offline", *common, "--num-requests", "256", "--output-len", "128", "--hf-batch-size", "64"],
        "prefix": ["bench", "prefix", *common, "--skip-multiturn"],
    }
    results = {}
    for name, argv in runs.items():
        path = out / f"{name}.json"
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "radixserve.cli", *argv, "--json", str(path)], cwd=ROOT, timeout=200,
                           capture_output=True, text=True)
        print(r.stdout[-3000:], r.stderr[-2000:] if r.returncode else "", flush=True)
        results[name] = json.loads(path.read_text()) if r.returncode == 0 and path.exists() else {"error": r.returncode}
        results[name]["wall_s"] = time.perf_counter() - t
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="kernels only")
    p.add_argument("--smoke", action="store_true", help="no GPU: correctness only, small, in the Triton interpreter")
    a = p.parse_args()
    if a.smoke:
        rows = kernels(bench=False)
        for r in rows:
            print(f"{r['kernel']:<10}{r['shape']:<40}{r['dtype']:<10}{r['rel_err']:>9.1e}{'yes' if r['ok'] else 'NO':>4}")
        return 0 if all(r["ok"] for r in rows) else 1
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; on CPU run the interpreter tests: TRITON_INTERPRET=1 pytest tests/test_kernels.py")
        return 2
    import triton

    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}", flush=True)
    t0 = time.perf_counter()
    copy = copy_bandwidth()
    rows = kernels(bench=True)
    benches = {} if a.quick else model_benches(Path(tempfile.mkdtemp()))
    print(f"\ncopy bandwidth (device to device): {copy:,.0f} GB/s   total {time.perf_counter() - t0:.0f} s")
    print(f"{'kernel':<10}{'shape':<40}{'dtype':<10}{'rel err':>9}{'ok':>4}{'us':>10}{'GB/s':>9}{'% copy':>8}{'TFLOP/s':>9}")
    for r in rows:
        timing = ""
        if "us" in r:
            timing = f"{r['us']:>10.1f}{r['gbps']:>9.0f}{100 * r['gbps'] / copy:>7.0f}%"
            timing += f"{r['tflops']:>9.1f}" if "tflops" in r else ""
        print(f"{r['kernel']:<10}{r['shape']:<40}{r['dtype']:<10}{r['rel_err']:>9.1e}{'yes' if r['ok'] else 'NO':>4}{timing}")
    off, pre = benches.get("offline", {}), benches.get("prefix", {})
    if "radixserve" in off:
        ours = off["radixserve"]["output_tokens_per_s"]
        for name, r in off.items():
            if isinstance(r, dict) and "output_tokens_per_s" in r:
                rate = r["output_tokens_per_s"]
                print(f"bench offline  {name:<22}{rate:>10.0f} tok/s   radixserve / this {ours / rate:.2f}x")
    if "radixserve" in pre:
        ours = pre["radixserve"]["wall_s"]
        for name, r in pre.items():
            if isinstance(r, dict) and "wall_s" in r and "prefill_tokens_computed" in r:
                print(f"bench prefix   {name:<22}{r['wall_s']:>10.2f} s  prefill {r['prefill_tokens_computed']:>7,}   "
                      f"speed-up of cache-on {r['wall_s'] / ours:.2f}x")
    for name, r in benches.items():
        if "error" in r:
            print(f"bench {name}: FAILED (exit {r['error']})")
    return 0 if all(r["ok"] for r in rows) and not any("error" in r for r in benches.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
