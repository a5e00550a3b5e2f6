"""The real default model, where meaning matters; loading errors; the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from radixserve import SamplingParams
from radixserve.models.gguf import ModelLoadError
from radixserve.models.loader import resolve_model_dir

pytestmark = pytest.mark.smollm2


def test_chat_answer_names_paris(smollm2_engine):
    ids = smollm2_engine.chat_ids([{"role": "user", "content": "What is the capital of France?"}])
    out = smollm2_engine.generate([ids], SamplingParams(temperature=0, max_new_tokens=24))[0]
    assert "Paris" in out.text and out.finish_reason == "stop"


def test_streamed_deltas_concatenate_to_the_full_text(smollm2_engine):
    import asyncio

    ids = smollm2_engine.chat_ids([{"role": "user", "content": "Name three colours. Émojis welcome 🎨"}])
    p = SamplingParams(temperature=0, max_new_tokens=40)

    async def collect() -> tuple[str, str]:
        parts, final = [], ""
        async for d in smollm2_engine.submit(ids, p):
            parts.append(d.text)
            if d.finished:
                final = d.output.text
        return "".join(parts), final

    streamed, final = asyncio.run(collect())
    assert streamed == final == smollm2_engine.generate([ids], p)[0].text


def test_cli_generate_streams_the_answer(smollm2_dir):
    """In fp32: this float folder's default dtype is bf16 on CPUs with AVX512-BF16 or AMX, whose
    greedy answer here depends on the CPU's bf16 dot products (an Intel Xeon's native and oneDNN
    paths start "L'Étoile" where torch's plain bf16 and fp32 say "The capital of France is
    Paris": the same distance from fp32 on average, mean KL 0.0022 against 0.0023, a near tie on
    the first token)."""
    r = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "generate", "--model", str(smollm2_dir), "--dtype", "float32",
         "--kv-cache-tokens", "2048", "--max-new-tokens", "24", "What is the capital of France?"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_clear_errors_for_bad_model_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    from radixserve.models.loader import read_arch

    with pytest.raises(ModelLoadError, match="supported: LlamaForCausalLM"):
        read_arch(tmp_path)
    r = subprocess.run([sys.executable, "-m", "radixserve.cli", "generate", "--model", str(tmp_path / "x"), "hi"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_missing_tokenizer_is_named(tmp_path, smollm2_dir):
    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).symlink_to(smollm2_dir / f)
    from radixserve import Engine

    with pytest.raises(ModelLoadError, match="no tokenizer"):
        Engine(str(tmp_path), kv_cache_tokens=64)
