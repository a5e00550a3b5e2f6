"""Frozen, typed configuration, grouped by consumer.

`EngineConfig.build(model, **overrides)` is the one place where flat override names
(`kv_cache_tokens=...`, `chunked_prefill_size=...`) are routed to their group, so the CLI,
the Engine constructor and tests share one source of defaults. Each field's one-line
description (and its choices) are data, `metadata["help"]` (and `metadata["choices"]`): the
CLI prints them (radixserve.cli_args).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import msgspec

from grammars import BACKENDS as GRAMMAR_BACKENDS

QUANTIZATIONS = ("auto", "none", "int8", "int4")  # ModelConfig.quantization
ACTIVATIONS = ("auto", "int8", "int16", "float")  # ModelConfig.activations (radixserve.models.quant.ACTIVATIONS)
KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3", "int8")  # radixserve.cache.pool maps them to torch dtypes
SPECULATIVE = ("none", "ngram")  # SpecConfig.speculative
# Names other layers resolve (a test checks each against its registry): the engine's dtypes,
# radixserve.attention's backends, the radix cache's eviction policies, the scheduler's policies.
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "torch_ref", "triton")
EVICTION_POLICIES = ("lru", "priority")
SCHEDULE_POLICIES = ("fcfs", "lpm")
KV_CONNECTORS = ("shm", "tcp")  # radixserve.engine.kv_connector
ROUTER_POLICIES = ("prefix", "round_robin", "random", "least_loaded")  # radixserve.routing's registry


def option(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A config field with its CLI description (and its choices) as metadata."""
    return field(default=default, metadata={"help": help} if choices is None else {"help": help, "choices": choices})


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = option(None, "local Hugging Face folder or .gguf file; unset: the default SmolLM2-135M-Instruct")
    # auto: bfloat16 on CUDA and on CPUs with AMX or AVX512-BF16, else float32, and float32 for quantized
    # weights on a CPU. The activations' dtype and, with kv_cache_dtype auto, the KV's.
    dtype: str = option("auto", "activation dtype; auto: bfloat16 on CUDA and on CPUs with AMX or AVX512-BF16, "
                                "else float32 (float32 for quantized weights on a CPU)", DTYPES)
    device: str = option("auto", "device to run on: auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    context_length: int | None = option(None, "cap on the context window, below the model's own; unset: the model's")
    # auto: a GGUF file's quantized weights as they are (the default model: Q4_1; models.quant.FORMATS), a folder as
    # it is | none: every weight in --dtype | int8 | int4: float weights quantized at load (models/loader.py)
    quantization: str = option("auto", "weight quantization; auto: as stored (GGUF Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K "
                                       "kept), none: every weight in --dtype, int8/int4: float weights quantized at load",
                               QUANTIZATIONS)
    # what quantized weights' native kernels multiply: activations quantized per block of 32 to 8 bits (auto, int8:
    # llama.cpp's Q8_0 form) or 16 (int16), or float (dequantize the weight each call: exact, slow)
    activations: str = option("auto", "activations of quantized linears; auto: int8 (per block of 32, as llama.cpp; "
                                      "a Q8_0 head int16), "
                                      "int16: twice the integer work, float: dequantize each call (exact, slow)",
                              ACTIVATIONS)
    disable_packed_linears: bool = option(False, "CPU: keep plain torch linears (no oneDNN-packed copy of the weights)")
    tensor_parallel: int = option(1, "split each layer's heads and MLP over N processes (float weights; gloo on CPU); "
                                     "the engine is rank 0, N - 1 workers follow its steps")
    pipeline_parallel: int = option(1, "split the layers into N stages in N processes, micro-batches flowing stage to "
                                       "stage (any weights, GGUF blocks included; gloo on CPU)")
    expert_parallel: int = option(1, "split a mixture of experts' experts over N processes, each rank computing its "
                                     "experts' rows of every routed layer, the outputs summed (any weights; gloo on CPU)")
    disable_cpu_kernels: bool = option(False, "CPU: use torch ops instead of radixserve's native kernels (radixserve_kernels.cpu)")
    enable_lora: bool = option(False, "serve LoRA adapters (PEFT folders) over the base model, chosen per request by "
                                      "`model`, mixed in one batch (models/lora.py)")
    lora_modules: tuple[str, ...] = option((), "adapters to load at start: NAME=PATH ... (implies --enable-lora)")
    max_loras: int = option(4, "LoRA adapters held in memory at once (more registered: least recently used read "
                               "again from their folders when asked for)")
    max_lora_rank: int = option(64, "the largest LoRA rank an adapter may have")
    lora_dtype: str = option("auto", "LoRA adapters' weights in memory; auto: the model's dtype, or bfloat16 over "
                                     "quantized weights on a CPU (far finer than the base's rounding, half the bytes "
                                     "a decode step reads)", ("auto", "float32", "bfloat16"))


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """--kv-events-config: vLLM's KVEventsConfig fields, and radixserve's block_size and
    data_parallel_rank (engine/kv_events.py says what each does)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    block_size: int | None = None
    data_parallel_rank: int = 0

    @property
    def enabled(self) -> bool:
        """As vLLM: events are made with enable_kv_cache_events, and published unless the publisher is "null"."""
        return self.enable_kv_cache_events and self.publisher != "null"


def parse_kv_events(text: str) -> KVEventsConfig:
    """vLLM's JSON; ValueError naming the field that is wrong."""
    try:
        cfg = msgspec.json.decode(text, type=KVEventsConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"kv_events_config: {e}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"kv_events_config: not JSON ({e})") from None
    if cfg.publisher not in (None, "zmq", "null"):
        raise ValueError(f"kv_events_config: publisher must be 'zmq' or 'null', got {cfg.publisher!r}")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"kv_events_config: {name} must not be negative, got {getattr(cfg, name)}")
    if cfg.block_size is not None and cfg.block_size < 1:
        raise ValueError(f"kv_events_config: block_size must be a positive integer, got {cfg.block_size}")
    for name in ("endpoint", "replay_endpoint"):
        value = getattr(cfg, name)
        if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"kv_events_config: {name} must be a tcp://, ipc:// or inproc:// address, got {value!r}")
    return cfg


@dataclass(frozen=True)
class CacheConfig:
    kv_cache_tokens: int | None = option(None, "KV pool size in tokens (slots); overrides the memory options")
    kv_cache_memory_mb: int | None = option(None, "else: KV pool byte budget in MiB (K, V and their scales)")
    kv_mem_fraction: float = option(0.25, "else: the fraction of available memory the KV pool takes")
    kv_cache_dtype: str = option("auto", "KV cache dtype; auto: the activations' dtype; fp8_e4m3, int8: quantized "
                                         "with an fp32 scale per (token, KV head)", KV_CACHE_DTYPES)
    page_size: int = option(1, "tokens per KV page; the prefix cache shares whole pages only")
    disable_radix_cache: bool = option(False, "turn off prefix sharing (the radix cache), e.g. for A/B runs")
    swa_full_tokens_ratio: float = option(0.5, "sliding-window layers (Gemma 3, Mistral): their own KV pool's tokens "
                                               "per token of the full pool (at least one request's window and chunk)")
    disable_hybrid_swa_memory: bool = option(False, "keep the sliding-window layers' KV in the one pool, for every "
                                                    "position (no window pool)")
    radix_eviction_policy: str = option("lru", "prefix-cache eviction: lru, or priority (lowest request priority "
                                               "first, then LRU)", EVICTION_POLICIES)
    tenant_max_cached_tokens: Mapping[str, int] = field(default_factory=dict, metadata={
        "help": "tenant id -> its prefix-cache quota in tokens (from --tenants)"})
    kv_disk_dir: str | None = option(None, "a directory for the disk tier of the KV cache: every prompt's whole blocks "
                                           "are written through and outlive eviction and restarts (unset: no disk tier)")
    kv_disk_gb: float = option(16.0, "the disk tier's bound in GB (least recently used blocks go first; a block "
                                     "retained by prompt_cache_retention or cache_control stays until its TTL)")
    kv_disk_block_tokens: int = option(64, "tokens per disk-tier block (a multiple of page_size; what a prompt's "
                                               "tail past its last whole block costs to recompute)")
    kv_connector: str | None = option(None, "prefill/decode disaggregation: how this engine hands prompts' KV pages "
                                            "to another and takes another's: shm (one machine) or tcp (set by "
                                            "--disaggregate; unset: no hand-off)", KV_CONNECTORS)
    kv_connector_host: str = option("127.0.0.1", "tcp connector: the address it serves its staged pages on")
    kv_events_config: str | None = option(None, "KV-cache events for outside routers, vLLM's JSON (e.g. "
                                                "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
                                                "\"replay_endpoint\": \"tcp://*:5558\"}'): blocks stored and removed, "
                                                "over ZMQ (engine/kv_events.py)")

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
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ValueError(f"swa_full_tokens_ratio: must be in (0, 1], got {self.swa_full_tokens_ratio}")
        if not self.kv_disk_gb > 0:
            raise ValueError(f"kv_disk_gb: must be positive, got {self.kv_disk_gb}")
        if self.kv_disk_block_tokens < 1 or self.kv_disk_block_tokens % self.page_size:
            raise ValueError(f"kv_disk_block_tokens: must be a positive multiple of page_size ({self.page_size}), "
                             f"got {self.kv_disk_block_tokens}")
        if self.kv_events_config is not None:
            if parse_kv_events(self.kv_events_config).enabled and self.disable_radix_cache:
                raise ValueError("kv_events_config: events tell what the prefix cache holds; it cannot go with "
                                 "disable_radix_cache")
        if self.kv_disk_dir is not None and self.disable_radix_cache:
            raise ValueError("kv_disk_dir: the disk tier lies under the prefix cache; it cannot go with disable_radix_cache")
        if self.kv_connector is not None and self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector: {self.kv_connector!r} is not one of {', '.join(KV_CONNECTORS)}")
        if self.kv_connector is not None and self.disable_radix_cache:
            raise ValueError("kv_connector: handed-off pages enter through the prefix cache; it cannot go with "
                             "disable_radix_cache")


@dataclass(frozen=True)
class SchedConfig:
    chunked_prefill_size: int = option(1024, "prefill tokens per iteration (running decodes ride along)")
    shared_prefill_size: int = option(64, "prefill per iteration while requests of more than one tenant run or wait, "
                                          "in token-equivalents (a token's attention over its context counted): a short "
                                          "step keeps the others' decodes and first tokens moving beside one tenant's "
                                          "long prompts")
    max_running_requests: int = option(64, "requests decoding at once")
    max_total_tokens: int | None = option(None, "cap on the KV pool, in tokens")
    schedule_policy: str = option("fcfs", "order of waiting requests: fcfs, or lpm (longest cached prefix first)",
                                  SCHEDULE_POLICIES)
    lpm_queue_cap: int = option(128, "above this many waiting requests lpm falls back to fcfs")
    init_new_token_ratio: float = option(0.7, "share of running requests' remaining decode tokens reserved at admission")
    min_new_token_ratio: float = option(0.1, "floor that reserved share decays to")
    new_token_ratio_decay: float = option(0.002, "how much the reserved share decays per iteration")
    reserve_clip_tokens: int = option(4096, "per-request cap on the reservation, in tokens")

    def __post_init__(self) -> None:
        for name in ("chunked_prefill_size", "shared_prefill_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)}")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding from context copies (sched/spec.py): drafts are the tokens that followed
    the request's latest n-gram in its own tokens or in its namespace's cached branches, verified
    exactly in the same forward as the batch's decodes."""

    speculative: str = option("none", "speculative decoding; ngram: draft from the request's context and its "
                                      "namespace's cached branches", SPECULATIVE)
    spec_max_draft: int = option(16, "most draft tokens per request per step (adaptive below it)")
    spec_ngram_min: int = option(1, "shortest suffix n-gram looked up")
    spec_ngram_max: int = option(8, "longest suffix n-gram looked up (the longest that occurs wins)")
    spec_max_batch: int = option(16, "no drafts when more requests than this decode at once (compute-bound)")
    # What one decode step costs beyond its rows, in rows (reading the weights, overheads): a draft
    # token is proposed only where its chance of acceptance beats the row it adds. None: 6 on a CPU
    # (the default model on the 2-core reference machine, one request's rows: 4.7 ms + 0.66 ms a row
    # at 450 tokens of context, 7.4 + 1.6 at 1,600, plus ~1 ms of Python a step), 64 on a GPU.
    spec_fixed_cost_rows: float | None = option(None, "a decode step's fixed cost in rows: a draft token is proposed "
                                                      "only where it pays for its row; unset: 6 on a CPU, 64 on a GPU")

    def fixed_cost(self, device_type: str) -> float:
        """spec_fixed_cost_rows, or its default on this kind of device."""
        if self.spec_fixed_cost_rows is not None:
            return self.spec_fixed_cost_rows
        return 64.0 if device_type == "cuda" else 6.0

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
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(30000, "TCP port to listen on")
    api_key: str | None = option(None, "one API key for one admin tenant (clients send 'Authorization: Bearer KEY')")
    tenants: str | None = option(None, "TOML or JSON file mapping API keys to tenants (priority, quotas, admin)")
    served_model_name: str | None = option(None, "the model name the API reports and accepts; unset: the model's own name")
    max_queued_requests: int = option(256, "accepted requests without a first token yet; over it: 503")
    max_request_bytes: int = option(8 << 20, "largest request body in bytes; larger: 413 (a declared Content-Length at once)")
    body_read_timeout: float = option(30.0, "seconds a request's whole body may take to arrive; then 408")
    keepalive_timeout: float = option(15.0, "seconds a connection may sit idle, or take to send its headers; then closed")
    max_connections: int = option(4096, "open connections in all; more are answered 503 and closed at once")
    max_connections_per_client: int = option(512, "open connections from one client address; more: 503 after the "
                                                  "keep-alive timeout (at most 5 s), then closed")
    metrics_key: str | None = option(None, "a key for GET /metrics besides admin keys (/metrics is open only when no key "
                                           "is configured)")
    metrics_vllm_names: bool = option(False, "also export the gateway gauges under vLLM's names (vllm:num_requests_waiting, "
                                             "vllm:num_requests_running, vllm:kv_cache_usage_perc), for an endpoint picker "
                                             "left on its default mapping")
    slo_ttft_ms: float = option(2000.0, "time-to-first-token SLO in ms; goodput counts requests within both SLOs")
    slo_tpot_ms: float = option(200.0, "time-per-output-token SLO in ms")
    drain_timeout: float = option(30.0, "seconds running requests may take to finish on SIGTERM")
    max_stream_backlog: int = option(512, "deltas a stream may have waiting for a client that does not read; "
                                          "over it: abort")
    stream_write_timeout: float = option(60.0, "seconds one stream write may wait on a client that does not read; "
                                               "then abort")
    stream_send_buffer: int = option(16384, "bytes of a stream the kernel may hold for a client that does not read "
                                            "(the socket's SO_SNDBUF, which Linux doubles); past it writes wait, and the "
                                            "backlog and write timeout apply")
    responses_db: str | None = option(None, "SQLite file of stored /v1/responses; unset: responses.sqlite3 in the "
                                            "cache folder")
    responses_max_stored: int = option(10000, "stored /v1/responses kept per tenant; past it the tenant's oldest are "
                                              "deleted (a store can never fill the disk)")
    log_requests: bool = option(False, "also write each request's prompt text to the access log (never its API key)")
    precompute_history: bool = option(True, "chat: once an answer ends, compute the KV of the conversation as the next "
                                           "turn will render it where that leaves the turn as it ran (a reasoning model's "
                                           "template drops the reasoning), at the lowest priority, so a returning turn "
                                           "computes only its new message (server/chat/history.py)")
    chat_template: str | None = option(None, "a Jinja chat template replacing the model's own: a file, or the template "
                                             "text itself (as vLLM's --chat-template)")
    reasoning_parser: str | None = option(None, "chat: return <think>...</think> reasoning as reasoning_content, apart "
                                                "from content; a JSON or tool-call constraint starts after it "
                                                "(server/chat/reasoning.py)", ("qwen3", "deepseek_r1"))
    tool_call_parser: str = option("auto", "how the model writes tool calls (tool_choice auto): auto (from its chat "
                                           "template), hermes, llama3_json, mistral (its v11 form where the template "
                                           "writes [ARGS]), qwen3_coder or harmony (gpt-oss; its channels also split the "
                                           "reasoning off) (server/chat/tool_parsers.py)",
                                   ("auto", "hermes", "llama3_json", "mistral", "qwen3_coder", "harmony"))


@dataclass(frozen=True)
class RouterConfig:
    """Data-parallel replicas and how requests are routed to them (radixserve.routing): the
    prefix policy follows SGLang's cache-aware router (its documented defaults)."""

    data_parallel: int = option(1, "engine processes (data-parallel replicas) behind this one server, each with its "
                                   "own KV cache; requests are routed by --router-policy")
    router_policy: str = option("prefix", "replica choice: prefix (the replica that most likely holds the request's "
                                          "prefix, the least loaded when load is unbalanced), round_robin, random or "
                                          "least_loaded", ROUTER_POLICIES)
    router_cache_threshold: float = option(0.3, "prefix policy: the matched share of a prompt's first blocks above "
                                                "which it goes to the best-matching replica (below: the emptiest)")
    router_balance_abs_threshold: int = option(64, "prefix policy: load is unbalanced when the busiest replica has "
                                                   "more than this many requests over the idlest...")
    router_balance_rel_threshold: float = option(1.5, "...and more than this many times its requests; then the least "
                                                      "loaded replica is chosen")
    router_block_tokens: int = option(16, "prefix index block, in tokens (in characters: 4x, where only text is seen)")
    router_max_prefix_tokens: int = option(4096, "how much of a prompt's start the prefix index keys on, in tokens")
    router_max_blocks_per_replica: int = option(65536, "prefix index blocks remembered per replica (LRU beyond)")
    disaggregate: bool = option(False, "prefill/decode disaggregation: some replicas only prefill, handing each "
                                       "prompt's KV pages to a decode replica (--kv-connector, shm by default); "
                                       "--data-parallel replicas in all, at least 2")
    prefill_replicas: int | None = option(None, "with --disaggregate: how many replicas prefill (default: half, "
                                                "at least 1); the rest decode")
    disaggregate_min_tokens: int = option(32, "with --disaggregate: a prompt whose uncached part is shorter than "
                                              "this is prefilled on its decode replica (no hand-off: as llm-d's "
                                              "threshold)")

    @property
    def replicas(self) -> int:
        """Engine processes in all: --data-parallel, at least 2 when disaggregated."""
        return max(self.data_parallel, 2) if self.disaggregate else self.data_parallel

    @property
    def prefill(self) -> int:
        """Replicas 0..prefill-1 prefill, the rest decode (0: every replica does both)."""
        if not self.disaggregate:
            return 0
        return self.prefill_replicas if self.prefill_replicas is not None else self.replicas // 2

    def check(self) -> None:
        if self.data_parallel < 1:
            raise ValueError(f"data_parallel: must be a positive integer, got {self.data_parallel}")
        if self.prefill_replicas is not None and not self.disaggregate:
            raise ValueError("prefill_replicas: goes with disaggregate")
        if self.disaggregate and not 1 <= self.prefill < self.replicas:
            raise ValueError(f"prefill_replicas: must leave at least one of the {self.replicas} replicas to decode "
                             f"and be at least 1, got {self.prefill_replicas}")
        if self.disaggregate_min_tokens < 0:
            raise ValueError(f"disaggregate_min_tokens: must be >= 0, got {self.disaggregate_min_tokens}")
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy: {self.router_policy!r} is not one of {', '.join(ROUTER_POLICIES)}")
        if not 0 <= self.router_cache_threshold <= 1:
            raise ValueError(f"router_cache_threshold: must be in [0, 1], got {self.router_cache_threshold}")
        for name in ("router_block_tokens", "router_max_prefix_tokens", "router_max_blocks_per_replica"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)}")
        if self.router_balance_abs_threshold < 0 or self.router_balance_rel_threshold < 1:
            raise ValueError("router_balance_abs_threshold, router_balance_rel_threshold: need >= 0 and >= 1, got "
                             f"{self.router_balance_abs_threshold}, {self.router_balance_rel_threshold}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "the model and where it runs"})
    cache: CacheConfig = field(default_factory=CacheConfig, metadata={"help": "the KV pool and the prefix cache"})
    sched: SchedConfig = field(default_factory=SchedConfig, metadata={"help": "batching and admission"})
    spec: SpecConfig = field(default_factory=SpecConfig, metadata={"help": "speculative decoding"})
    attention_backend: str = option("auto", "attention kernels: auto (triton on CUDA, else torch), torch, torch_ref "
                                            "(the simple oracle) or triton", ATTENTION_BACKENDS)
    default_max_new_tokens: int = option(128, "max new tokens of a /generate (or in-process) request that does not say, "
                                              "as SGLang's; chat and Responses default to the context window left")
    grammar_backend: str = option("auto", "grammar backend for constrained output; auto: xgrammar, then outlines-core",
                                  GRAMMAR_BACKENDS)
    grammar_compile_timeout: float = option(10.0, "seconds a grammar compile may take in its worker; then the worker "
                                                  "is killed and the request gets a 400")
    # Compiles run in killable worker processes. 2: a compile is CPU-bound on about one core and an
    # idle worker holds ~240 MiB (torch + xgrammar), so on the 2-core reference machine more workers
    # would only slow each other and the model's forward.
    grammar_compile_workers: int = option(2, "grammar compile worker processes (each ~240 MiB idle)")
    grammar_tenant_compiles: int | None = option(None, "compiles one tenant may run at once; unset: half the workers, "
                                                       "at least 1")
    # A compile whose worker grows this many MiB past its memory at the compile's start is killed (a 400).
    # Measured on SmolLM2's vocabulary: ordinary schemas and regexes +2..15 MiB, an exploding regex
    # +190 MiB in its 10 s; 1024 leaves large schemas and vocabularies room and stops a memory bomb in ~3 s.
    grammar_compile_memory_mb: int = option(1024, "MiB a compile's worker may grow past its start; then it is killed "
                                                  "and the request gets a 400")
    grammar_max_whitespace: int = option(2, "JSON output: most whitespace characters in a row (-1: unbounded)")
    disable_jump_forward: bool = option(False, "sample every token, even ones the grammar forces (no jump-forward)")

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
