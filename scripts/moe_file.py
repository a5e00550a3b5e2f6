"""A Qwen3-30B-A3B-shaped GGUF for measuring mixtures of experts without a hub download:
hidden 2048, 32/4 heads of 128, 128 experts of 768, top 8, as many layers as asked (8: ~5B
parameters, 3 GiB), random Q4_K blocks (Q6_K for v, the experts' down and the head, as Q4_K_M
files mix them) and the test suite's tiny BPE tokenizer, written as llama.cpp's converter lays
a qwen3moe file out. Its text is noise: measure with fixed lengths (scripts/moe_compare.py).

    .venv/bin/python scripts/moe_file.py OUT.gguf [LAYERS]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

H, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, WIDTH = 2048, 32, 4, 128, 128, 8, 768


def main() -> None:
    import conftest
    from test_quant import _llama_metadata, random_blocks

    out, layers = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 8
    work = out.with_suffix(".tokenizer")
    shutil.rmtree(work, ignore_errors=True)
    vocab = conftest._train_tokenizer(work / "tok")
    eos = json.loads((work / "tok" / "tokenizer.json").read_text())["model"]["vocab"]["<|im_end|>"]
    cfg = {"max_position_embeddings": 8192, "hidden_size": H, "num_hidden_layers": layers, "intermediate_size": 6144,
           "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
           "head_dim": HEAD_DIM, "bos_token_id": 1, "eos_token_id": eos}
    shutil.copytree(work / "tok", work / "meta")
    (work / "meta" / "config.json").write_text(json.dumps(cfg))
    w = gguf.GGUFWriter(str(out), "qwen3moe")
    _llama_metadata(w, work / "meta")
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(TOP_K)
    w.add_expert_feed_forward_length(WIDTH)
    rng = np.random.default_rng(0)

    def blocks(n: int, k: int, qt: QT = QT.Q4_K) -> np.ndarray:
        return random_blocks(qt, n, k, rng, 2e-3)

    ones = np.ones(H, np.float32)
    w.add_tensor("token_embd.weight", (rng.standard_normal((vocab, H)) * 0.02).astype(np.float32))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", blocks(vocab, H, QT.Q6_K), raw_dtype=QT.Q6_K)
    for i in range(layers):
        p = f"blk.{i}."
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + name + ".weight", ones)
        for name in ("attn_q_norm", "attn_k_norm"):
            w.add_tensor(p + name + ".weight", np.ones(HEAD_DIM, np.float32))
        for name, n, k, qt in (("attn_q", HEADS * HEAD_DIM, H, QT.Q4_K), ("attn_k", KV_HEADS * HEAD_DIM, H, QT.Q4_K),
                               ("attn_v", KV_HEADS * HEAD_DIM, H, QT.Q6_K), ("attn_output", H, HEADS * HEAD_DIM, QT.Q4_K)):
            w.add_tensor(p + name + ".weight", blocks(n, k, qt), raw_dtype=qt)
        w.add_tensor(p + "ffn_gate_inp.weight", (rng.standard_normal((EXPERTS, H)) * 0.05).astype(np.float32))
        for kind, n, k, qt in (("gate", WIDTH, H, QT.Q4_K), ("up", WIDTH, H, QT.Q4_K), ("down", H, WIDTH, QT.Q6_K)):
            w.add_tensor(p + f"ffn_{kind}_exps.weight", np.stack([blocks(n, k, qt) for _ in range(EXPERTS)]), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{out}: {out.stat().st_size / 2**30:.2f} GiB, {layers} layers")


if __name__ == "__main__":
    main()
