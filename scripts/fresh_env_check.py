"""Run by a fresh environment's Python (radixserve installed from its wheel beside the newest
transformers and Hugging Face's `kernels`): radixserve imports without shadowing HF's `kernels`,
the wheel carries the C++ sources, the kernels' prebuild step runs, and a served model's greedy
tokens and log-probabilities are transformers' on the same weights.

    python scripts/fresh_env_check.py MODEL_DIR [CHECKOUT]

Run it outside the checkout, with radixserve installed from its wheel (not editable). With
CHECKOUT, it also imports with the checkout's root first on sys.path (an editable install of the
old layout put it there, and its `kernels/__init__.py` then shadowed Hugging Face's `kernels`).
tests/test_fresh_env.py makes the environment and runs it.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import torch


def check_imports() -> None:
    import kernels  # Hugging Face's, which transformers >= 5.25 imports
    import transformers

    import radixserve
    import radixserve_kernels
    from radixserve_kernels.cpu import CSRC

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    for mod in (kernels, radixserve, radixserve_kernels):
        where = Path(mod.__file__).resolve()
        assert where.is_relative_to(site), f"{mod.__name__} imported from {where}, not the installed {site}"
    assert hasattr(kernels, "get_kernel"), f"`import kernels` is not Hugging Face's: {kernels.__file__}"
    sources = sorted(p.name for p in CSRC.iterdir())
    assert "ops.cpp" in sources and "vec.h" in sources, f"the wheel lacks the C++ sources: {sources}"
    print(f"imports: transformers {transformers.__version__}, HF kernels {kernels.__file__}, "
          f"radixserve_kernels {radixserve_kernels.__file__} with {len(sources)} sources")


def check_checkout_first(checkout: Path) -> None:
    """The checkout's root first on sys.path: `kernels` is still Hugging Face's."""
    code = ("import kernels, radixserve_kernels.cpu, transformers; assert hasattr(kernels, 'get_kernel'), kernels.__file__; "
            "from transformers import AutoModelForCausalLM; print(kernels.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)},
                         capture_output=True, text=True)
    assert out.returncode == 0, f"with {checkout} first on sys.path:\n{out.stderr}"
    print(f"with the checkout first on sys.path, `import kernels` is {out.stdout.strip()}")


def prebuild() -> None:
    """The set-up's step, as a user runs it after `pip install`."""
    t = time.monotonic()
    subprocess.run([sys.executable, "-m", "radixserve_kernels.cpu"], check=True)
    print(f"prebuild: python -m radixserve_kernels.cpu ran in {time.monotonic() - t:.1f} s")


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def serve_and_compare(model: Path, ids: list[int], n: int = 8) -> None:
    from transformers import AutoModelForCausalLM

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "radixserve", "serve", "--model", str(model), "--port", str(port), "--dtype", "float32",
           "--kv-cache-tokens", "1024"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{proc.stdout.read().decode() if proc.stdout else ''}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    break
            except OSError:
                time.sleep(0.2)
        out = _post(f"http://127.0.0.1:{port}/generate", {
            "input_ids": ids, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}})
    finally:
        proc.terminate()
        proc.wait(30)
    ours = [(t[1], t[0]) for t in out["meta_info"]["output_token_logprobs"]]

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.inference_mode():
        greedy = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)[0]
        logp = torch.log_softmax(hf(greedy[None]).logits[0].float(), -1)
    ref = [(int(t), float(logp[len(ids) - 1 + i, t])) for i, t in enumerate(greedy[len(ids):].tolist())]
    assert [t for t, _ in ours] == [t for t, _ in ref], f"greedy tokens differ: served {ours}, transformers {ref}"
    err = max(abs(a - b) for (_, a), (_, b) in zip(ours, ref, strict=True))
    assert err < 1e-3 and all(math.isfinite(a) for _, a in ours), f"log-probabilities differ by {err}"
    print(f"served: {n} greedy tokens equal transformers', log-probabilities within {err:.1e}")


def main() -> None:
    model = Path(sys.argv[1])
    check_imports()
    if len(sys.argv) > 2:
        check_checkout_first(Path(sys.argv[2]))
    prebuild()
    serve_and_compare(model, [5, 17, 42, 99, 123, 7, 250, 31, 64, 200, 11, 3])
    print("fresh environment: ok")


if __name__ == "__main__":
    main()
