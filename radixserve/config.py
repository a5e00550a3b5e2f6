"""Frozen, typed configuration, grouped by consumer.

`EngineConfig.build(model, **overrides)` is the one place where flat override names
(`kv_cache_tokens=...`, `chunked_prefill_size=...`) are routed to their group, so the CLI,
the Engine constructor and tests share one source of defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

QUANTIZATIONS = ("auto", "none", "int8", "int4")  # ModelConfig.quantization
KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3", "int8")  # radixserve.cache.pool maps them to torch dtypes
SPECULATIVE = ("none", "ngram")  # SpecConfig.speculative


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None  # None: the default SmolLM2-135M-Instruct
    # auto: bfloat16 on CUDA and on CPUs with AMX or AVX512-BF16, else float32, and float32 for quantized
    # weights on a CPU | float32 | bfloat16 | float16 (the activations' and, with kv_cache_dtype auto, the KV's)
    dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    context_length: int | None = None  # cap below the model's own window
    # auto: a GGUF file's Q4_0/Q4_1/Q8_0 weights as they are (the default model: Q4_1), a folder as it is |
    # none: every weight in --dtype | int8 | int4: float weights quantized at load (models/loader.py)
    quantization: str = field(default="auto", metadata={"choices": QUANTIZATIONS})
    disable_packed_linears: bool = False  # CPU: True keeps plain torch linears (no oneDNN-packed copy of the weights)
    disable_cpu_kernels: bool = False  # CPU: True uses torch ops instead of radixserve's native kernels (kernels/cpu.py)


@dataclass(frozen=True)
class CacheConfig:
    kv_cache_tokens: int | None = None  # explicit pool size in tokens (slots)
    kv_cache_memory_mb: int | None = None  # else: a byte budget in MiB (K, V and their scales); tokens follow from the dtype
    kv_mem_fraction: float = 0.25  # else: this fraction of available memory
    # auto: the activations' dtype | bf16 | fp8_e4m3, int8: quantized, an fp32 scale per (token, KV head)
    kv_cache_dtype: str = field(default="auto", metadata={"choices": KV_CACHE_DTYPES})
    page_size: int = 1  # tokens per KV page; the prefix cache shares whole pages only
    disable_radix_cache: bool = False  # True: no prefix sharing (for A/B runs)
    radix_eviction_policy: str = "lru"  # lru | priority (lowest request priority first, then LRU)
    tenant_max_cached_tokens: Mapping[str, int] = field(default_factory=dict)  # tenant -> quota

    def check(self) -> None:
        """The pool's sizing options, refused before a model loads (ValueError naming the option)."""
        if self.kv_cache_tokens is not None and self.kv_cache_memory_mb is not None:
            raise ValueError("kv_cache_memory_mb: give it or kv_cache_tokens, not both")
        for name in ("kv_cache_tokens", "kv_cache_memory_mb", "page_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value}")
        if not 0 < self.kv_mem_fraction <= 1:
            raise ValueError(f"kv_mem_fraction: must be in (0, 1], got {self.kv_mem_fraction}")


@dataclass(frozen=True)
class SchedConfig:
    chunked_prefill_size: int = 1024  # prefill tokens per iteration (decodes ride along)
    max_running_requests: int = 64
    max_total_tokens: int | None = None  # cap on the KV pool, in tokens
    schedule_policy: str = "fcfs"  # fcfs | lpm (longest cached prefix first)
    lpm_queue_cap: int = 128  # above this many waiting requests lpm falls back to fcfs
    init_new_token_ratio: float = 0.7  # share of remaining decode tokens reserved at admission
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.002
    reserve_clip_tokens: int = 4096  # per-request cap on the reservation


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding from context copies (sched/spec.py): drafts are the tokens that followed
    the request's latest n-gram in its own tokens or in its namespace's cached branches, verified
    exactly in the same forward as the batch's decodes."""

    speculative: str = field(default="none", metadata={"choices": SPECULATIVE})  # ngram: draft from the context
    spec_max_draft: int = 16  # most draft tokens per request per step (adaptive below it)
    spec_ngram_min: int = 1  # shortest suffix n-gram looked up
    spec_ngram_max: int = 8  # longest (the longest that occurs wins)
    spec_max_batch: int = 16  # no drafts when more requests than this decode at once (compute-bound)
    # What one decode step costs beyond its rows, in rows (reading the weights, overheads): a draft
    # token is proposed only where its chance of acceptance beats the row it adds. None: 3 on a CPU
    # (measured on the 2-core reference machine: 8.5 ms for 1 row, +~2 ms per row), 64 on a GPU.
    spec_fixed_cost_rows: float | None = None

    def fixed_cost(self, device_type: str) -> float:
        """spec_fixed_cost_rows, or its default on this kind of device."""
        if self.spec_fixed_cost_rows is not None:
            return self.spec_fixed_cost_rows
        return 64.0 if device_type == "cuda" else 3.0

    def check(self) -> None:
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative: {self.speculative!r} is not supported; choose from: {', '.join(SPECULATIVE)}")
        if not 1 <= self.spec_max_draft <= 32:
            raise ValueError(f"spec_max_draft: must be in [1, 32], got {self.spec_max_draft}")
        if not 1 <= self.spec_ngram_min <= self.spec_ngram_max <= 16:
            raise ValueError(f"spec_ngram_min, spec_ngram_max: need 1 <= min <= max <= 16, got {self.spec_ngram_min}, "
                             f"{self.spec_ngram_max}")
        if self.spec_max_batch < 1:
            raise ValueError(f"spec_max_batch: must be a positive integer, got {self.spec_max_batch}")
        if self.spec_fixed_cost_rows is not None and not self.spec_fixed_cost_rows > 0:
            raise ValueError(f"spec_fixed_cost_rows: must be positive, got {self.spec_fixed_cost_rows}")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    tenants: str | None = None  # TOML or JSON file: api key -> tenant
    served_model_name: str | None = None  # default: the model's name
    max_queued_requests: int = 256  # accepted requests without a first token yet; over it: 503
    max_request_bytes: int = 8 << 20  # larger bodies: 413 (a declared Content-Length over it: at once)
    body_read_timeout: float = 30.0  # seconds for a request's whole body to arrive; then 408
    keepalive_timeout: float = 15.0  # seconds a connection may sit idle, or take to send its headers; then closed
    max_connections: int = 4096  # open connections in all; more are answered 503 and closed at once
    max_connections_per_client: int = 512  # open connections from one client address; more: 503 and closed
    metrics_key: str | None = None  # a key for GET /metrics besides admin keys (open only when no key is configured)
    slo_ttft_ms: float = 2000.0  # goodput counts requests within both SLOs
    slo_tpot_ms: float = 200.0
    drain_timeout: float = 30.0  # seconds running requests may take to finish on SIGTERM
    max_stream_backlog: int = 512  # deltas a stream may have waiting for a client that does not read; over it: abort
    stream_write_timeout: float = 60.0  # seconds one stream write may wait on a client that does not read; then abort


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    attention_backend: str = "auto"  # auto | torch | torch_ref | triton
    default_max_new_tokens: int = 128
    grammar_backend: str = "auto"  # auto (xgrammar, then outlines-core) | xgrammar | outlines
    grammar_compile_timeout: float = 10.0  # seconds from a compile's start in a worker; then the worker is killed, a 400
    # Compiles run in killable worker processes. 2: a compile is CPU-bound on about one core and an
    # idle worker holds ~240 MiB (torch + xgrammar), so on the 2-core reference machine more workers
    # would only slow each other and the model's forward.
    grammar_compile_workers: int = 2
    grammar_tenant_compiles: int | None = None  # compiles one tenant may run at once (None: half the workers, at least 1)
    # A compile whose worker grows this many MiB past its memory at the compile's start is killed (a 400).
    # Measured on SmolLM2's vocabulary: ordinary schemas and regexes +2..15 MiB, an exploding regex
    # +190 MiB in its 10 s; 1024 leaves large schemas and vocabularies room and stops a memory bomb in ~3 s.
    grammar_compile_memory_mb: int = 1024
    grammar_max_whitespace: int = 2  # JSON: most whitespace characters in a row (-1: unbounded)
    disable_jump_forward: bool = False  # True: sample every token, even ones the grammar forces

    @classmethod
    def build(cls, model: str | None = None, **overrides: Any) -> EngineConfig:
        """Route flat field names to their group: `build(dtype="float32", kv_cache_tokens=4096)`."""
        groups = {"model": ModelConfig, "cache": CacheConfig, "sched": SchedConfig, "spec": SpecConfig}
        per_group: dict[str, dict[str, Any]] = {g: {} for g in groups}
        top: dict[str, Any] = {}
        top_names = {f.name for f in fields(cls)} - set(groups)
        if model is not None:
            per_group["model"]["path"] = str(model)
        for name, value in overrides.items():
            owner = next((g for g, c in groups.items() if name in _field_names(c)), None)
            if owner is not None:
                per_group[owner][name] = value
            elif name in top_names:
                top[name] = value
            else:
                known = sorted(top_names.union(*(_field_names(c) for c in groups.values())))
                raise TypeError(f"unknown engine option {name!r}; known options: {', '.join(known)}")
        base = cls()
        parts = {g: replace(getattr(base, g), **kw) for g, kw in per_group.items()}
        cfg = replace(base, **parts, **top)
        cfg.cache.check()
        cfg.spec.check()
        return cfg


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}
