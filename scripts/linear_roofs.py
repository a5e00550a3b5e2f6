"""Time SmolLM2-shaped linears (30 layers of qkv, o, gate_up, down, and the 49,152-row head
on one row; each weight distinct, so it streams from memory) per kernel, dtype and row count
(native: radixserve's bf16 kernel, kernels/radixserve_kernels/cpu.py): the table in radixserve/models/linear.py.

    .venv/bin/python scripts/linear_roofs.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from radixserve_kernels import cpu

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of SmolLM2-135M's linears
LAYERS = 30
HEAD_ROWS = 49152  # the vocabulary: the logits of the sampled row


def timed(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def main() -> None:
    ops = cpu.ops()
    native = ops is not None
    print("| rows | dtype | plain ms | oneDNN-packed ms | native-packed ms |")
    print("|---:|---|---:|---:|---:|")
    for dtype in (torch.bfloat16, torch.float32):
        weights = [[torch.randn(n, k, dtype=dtype) for n, k in SHAPES] for _ in range(LAYERS)]
        packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in layer] for layer in weights]
        head = torch.randn(HEAD_ROWS, 576, dtype=dtype)
        head_packed = torch.ops.mkldnn._reorder_linear_weight(head, 32)
        nat = native and ops.linear_supports(head)
        nat_packed, nat_head = [], None
        if nat:
            nat_packed = [[ops.pack_linear(w) for w in layer] for layer in weights]
            nat_head = ops.pack_linear(head)
        for rows in (1, 32, 1024):
            xs = {k: torch.randn(rows, k, dtype=dtype) for _, k in SHAPES}
            reps = 3 if rows > 64 else 10

            def plain(weights=weights, xs=xs, head=head) -> None:
                for layer in weights:
                    for w in layer:
                        F.linear(xs[w.shape[1]], w)
                F.linear(xs[576][:1], head)

            def pk(packed=packed, xs=xs, head=head_packed) -> None:
                for layer in packed:
                    for w, (_, k) in zip(layer, SHAPES):
                        torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
                torch.ops.mkldnn._linear_pointwise(xs[576][:1], head, None, "none", [], "")

            def nat_fn(xs=xs, nat_packed=nat_packed, nat_head=nat_head) -> None:
                for layer in nat_packed:
                    for w, (n, k) in zip(layer, SHAPES):
                        ops.linear(xs[k], w, n, None, False)
                ops.linear(xs[576][:1], nat_head, HEAD_ROWS, None, False)

            name = str(dtype).removeprefix("torch.")
            nat_ms = f"{timed(nat_fn, reps):.1f}" if nat and rows <= 64 else "-"
            print(f"| {rows} | {name} | {timed(plain, reps):.1f} | {timed(pk, reps):.1f} | {nat_ms} |", flush=True)


if __name__ == "__main__":
    main()
