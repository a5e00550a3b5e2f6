"""The boundary between the serving front (HTTP, tokenization, chat templates) and the engine
core (scheduler, model, KV cache): typed messages, the stats they report, typed errors, and
the `EngineClient` protocol both sides of a deployment program against.

`Engine` implements EngineClient in-process (offline use, tests); `EngineProcess` implements it
with the engine core in its own process, so the model loop never shares a GIL with the server.
Messages are msgspec structs on the wire (msgpack); requests cross it as a plain `AddRequest`
and are built into a `Req` on the engine side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import msgspec

from grammars.spec import GrammarError
from radixserve.config import EngineConfig
from radixserve.engine.outputs import Delta
from radixserve.request import InvalidParam, KVPages, Req, Retention, SamplingParams

__all__ = ["InvalidParam", "EngineClient", "EngineDied", "EngineStats", "AddRequest"]


class EngineDied(RuntimeError):
    """The engine core's process is gone (or, data-parallel, no replica is serving)."""


@dataclass
class EngineStats:
    """KV accounting (tokens: free + cached + in use = total) and scheduler counters."""

    kv_total_slots: int = 0
    kv_free_slots: int = 0
    kv_in_use_slots: int = 0
    kv_cached_tokens: int = 0
    kv_evictable_tokens: int = 0
    kv_locked_tokens: int = 0
    evicted_tokens: int = 0
    kv_namespaces: int = 0
    cache_hit_rate: float = 0.0
    running: int = 0
    waiting: int = 0
    waiting_tokens: int = 0  # the waiting requests' tokens (prompt, and output of a retracted one)
    steps: int = 0
    jump_forward_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    cached_prompt_tokens_disk: int = 0  # of those, read back from the disk tier (the rest: the pool's own)
    prefill_tokens_computed: int = 0
    decode_tokens: int = 0
    retractions: int = 0
    finished: int = 0
    spec_draft_tokens: int = 0  # speculative draft tokens fed to the model
    spec_accepted_tokens: int = 0  # of those, the ones the sampler itself would have produced
    spec_verifies: int = 0  # decodes that carried a draft
    spec_emitted_tokens: int = 0  # tokens those decodes appended (accepted drafts, then the sampler's next token)
    spec_cache_draft_tokens: int = 0  # draft tokens found in the namespace's cached branches (the rest: own tokens)
    spec_cache_accepted_tokens: int = 0
    engine_rss_bytes: int = 0  # the engine process's resident memory (0 for an engine in the caller's process)
    kv_dtype: str = ""  # what the KV pool stores: the activations' dtype, bfloat16, int8 or float8_e4m3fn
    kv_bytes_per_token: int = 0  # K and V of one token in every layer, scales included
    kv_window_total_slots: int = 0  # the sliding-window layers' own pool (0: they share the one pool)
    kv_window_free_slots: int = 0
    kv_window_cached_tokens: int = 0  # cached tokens that still hold their window KV
    kv_pool_bytes: int = 0  # both pools, scales included
    kv_disk_blocks: int = 0  # the disk tier (--kv-disk-dir): blocks and bytes stored, its bound
    kv_disk_bytes: int = 0
    kv_disk_capacity_bytes: int = 0
    kv_disk_written_tokens: int = 0
    kv_disk_skipped_tokens: int = 0  # not written: the writer too far behind, or no room without a retained block
    kv_disk_loaded_tokens: int = 0  # put back into the pool
    kv_disk_corrupt_blocks: int = 0  # found torn or corrupt by a read: misses, deleted
    kv_exported_tokens: int = 0  # prefill/decode hand-off (--kv-connector): prompt tokens' KV published for another engine
    kv_imported_tokens: int = 0  # taken from another engine and put into the pool
    kv_events_batches: int = 0  # --kv-events-config: batches published
    kv_events_blocks: int = 0  # blocks told as stored in the KV pool (a subscriber's count)
    kv_events_window_blocks: int = 0  # of those, told as holding their sliding-window KV (group 1)
    kv_events_disk_blocks: int = 0  # blocks told as stored on the disk tier
    kv_staged_handoffs: int = 0  # published and not yet taken, as of the engine's last step (dropped after kv_connector.STAGED_TTL_S)

    @classmethod
    def sum(cls, parts: list[EngineStats]) -> EngineStats:
        """Data-parallel replicas' stats as one engine's: counts add up, the hit rate is
        recomputed, the KV dtype and bytes per token are the first replica's (all are alike)."""
        if not parts:
            return cls()
        total = cls(**{f.name: sum(getattr(p, f.name) for p in parts) for f in dataclasses.fields(cls)
                       if f.type in ("int", "float")})
        total.cache_hit_rate = total.cached_prompt_tokens / total.prompt_tokens if total.prompt_tokens else 0.0
        total.kv_dtype, total.kv_bytes_per_token = parts[0].kv_dtype, parts[0].kv_bytes_per_token
        return total

    @property
    def spec_acceptance_rate(self) -> float:
        """Draft tokens accepted / drafted."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_tokens_per_verify(self) -> float:
        """Tokens a decode with a draft produced, on average (accepted draft tokens + 1)."""
        return self.spec_emitted_tokens / self.spec_verifies if self.spec_verifies else 0.0


# -- front -> engine ----------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add", frozen=True):
    """A validated, tokenized request; the engine builds its Req from this. With a call_id (a
    constrained request sent ahead by the front) the engine answers one Reply once its grammar is
    compiled, or with the error and without running it; so the request crosses the socket once."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # resolved: the request's own or the engine's default
    priority: int = 0
    tenant: str | None = None
    cache_salt: str | None = None
    public_prefix_len: int = 0
    call_id: int = 0
    retention: Retention | None = None
    kv_export: KVPages | None = None
    kv_import: KVPages | None = None
    lora: str | None = None

    @classmethod
    def of(cls, req: Req, call_id: int = 0) -> AddRequest:
        return cls(req.rid, req.token_ids[: req.prompt_len], req.params, req.max_new_tokens, req.priority, req.tenant,
                   req.cache_salt, req.public_prefix_len, call_id, req.retention, req.kv_export, req.kv_import, req.lora)

    def build(self) -> Req:
        req = Req(list(self.input_ids), self.params, rid=self.rid, priority=self.priority,
                  max_new_tokens=self.max_new_tokens, tenant=self.tenant, cache_salt=self.cache_salt,
                  public_prefix_len=self.public_prefix_len, retention=self.retention, lora=self.lora)
        req.kv_export, req.kv_import = self.kv_export, self.kv_import
        return req


class Abort(msgspec.Struct, tag="abort", frozen=True):
    rid: str


class GetStats(msgspec.Struct, tag="stats", frozen=True):
    call_id: int


class FlushCache(msgspec.Struct, tag="flush_cache", frozen=True):
    call_id: int
    keep_disk: bool = False


class CheckIntegrity(msgspec.Struct, tag="check_integrity", frozen=True):
    call_id: int


class MatchLen(msgspec.Struct, tag="match_len", frozen=True):
    """How much of a prompt the engine's prefix cache holds now (Reply.value, in tokens)."""

    call_id: int
    input_ids: list[int]
    tenant: str | None = None
    cache_salt: str | None = None
    public_prefix_len: int = 0


class LoRACall(msgspec.Struct, tag="lora", frozen=True):
    """load (name, path: Reply.data the adapter), unload (name) or list (Reply.data the adapters)."""

    call_id: int
    op: str
    name: str = ""
    path: str = ""


# each Call is answered by one Reply with its call_id (an AddRequest: when it has one)
Call = AddRequest | GetStats | FlushCache | CheckIntegrity | MatchLen | LoRACall


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    pass


ToEngine = AddRequest | Abort | GetStats | FlushCache | CheckIntegrity | MatchLen | LoRACall | Shutdown


# -- engine -> front ----------------------------------------------------------------------------
class EngineInfo(msgspec.Struct, tag="ready", frozen=True):
    """Sent once the engine core is up: what the front needs to build requests."""

    model_name: str
    model_path: str
    context_len: int
    vocab_size: int
    model_vocab_size: int
    eos_ids: list[int]
    num_slots: int
    dtype: str
    device: str
    pid: int
    quantization: str  # "none", or the weight kinds held, e.g. "q4_1+q8_0"
    weight_bytes: int
    kv_dtype: str
    kv_bytes_per_token: int
    load_seconds: float = 0.0  # the model's load (weights read and packed), and the process's peak RSS then
    load_peak_rss: int = 0
    cpu_kernels: str = ""  # the native CPU kernels' build (radixserve_kernels.cpu: avx512+vnni+bf16, avx2, ...), or ""
    kv_location: str = ""  # its KV connector's address (--kv-connector; engine/kv_connector.py), or ""
    activations: str = "float"  # what quantized linears multiply: int8, int16 or float (models.quant.set_activations)
    experts: dict[str, int] | None = None  # a mixture of experts' layout (models.moe.describe), or None
    step_weight_bytes: int = 0  # what a decode step at batch 1 reads of weight_bytes (Engine.step_weight_bytes)


class Deltas(msgspec.Struct, tag="deltas", frozen=True):
    """Every request's deltas of one engine step (or command), in one message, with the stats
    as of its end."""

    items: list[Delta]
    stats: EngineStats


class ErrorInfo(msgspec.Struct, frozen=True):
    """kind: invalid_param (an InvalidParam: a 4xx naming `field`), grammar (a GrammarError: a 4xx,
    naming `field` where it has one), runtime (refused now, e.g. a flush while busy), internal.
    The field travels as is: nothing downstream reads it back out of the message."""

    kind: str
    message: str
    field: str | None = None

    @classmethod
    def of(cls, e: BaseException) -> ErrorInfo:
        if isinstance(e, InvalidParam):
            return cls("invalid_param", e.message, e.field)
        if isinstance(e, GrammarError):
            return cls("grammar", e.message, e.field)
        if isinstance(e, ValueError):
            return cls("invalid_param", str(e), None)
        if isinstance(e, RuntimeError):
            return cls("runtime", str(e))
        return cls("internal", repr(e))

    def exception(self) -> Exception:
        if self.kind == "grammar":
            return GrammarError(self.field, self.message)
        if self.kind == "invalid_param":
            return InvalidParam(self.field, self.message) if self.field is not None else ValueError(self.message)
        if self.kind == "runtime":
            return RuntimeError(self.message)
        return RuntimeError(f"the engine failed: {self.message}")


class Reply(msgspec.Struct, tag="reply", frozen=True):
    call_id: int
    stats: EngineStats | None = None
    value: int | None = None
    error: ErrorInfo | None = None
    data: Any = None


FromEngine = EngineInfo | Deltas | Reply


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder(kind: Any) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(kind)


# -- the contract -------------------------------------------------------------------------------
@runtime_checkable
class EngineClient(Protocol):
    """What the server needs of an engine. Request building (make_req, chat_ids) runs where the
    caller is; everything else goes to the engine core."""

    model_name: str
    model_path: str
    context_len: int
    vocab_size: int
    tokenizer: Any
    weight_bytes: int
    step_weight_bytes: int  # what a decode step at batch 1 reads of them: not an untied embedding, nor idle experts
    load_seconds: float  # the model's load, and the engine process's peak RSS by its end
    load_peak_rss: int
    cpu_kernels: str  # radixserve_kernels.cpu's build in use ("" on a GPU or without them)
    quantization: str  # what the weights are ("none", or the kinds held, e.g. "q4_k+q6_k")
    activations: str  # what their linears multiply: int8, int16 or float
    experts: dict[str, int] | None  # a mixture of experts' layout (models.moe.describe), or None for a dense model
    dtype: Any  # the activations' torch.dtype, and the device they are on
    device: Any
    config: EngineConfig  # as built from the flags (/server_info reports it)

    @property
    def pid(self) -> int: ...  # the engine core's process (a data-parallel engine: its first replica's)

    def make_req(self, prompt: str | list[int], params: SamplingParams | None = None, rid: str | None = None,
                 priority: int = 0, *, tenant: str | None = None, cache_salt: str | None = None,
                 public_prefix_len: int | None = None, retention: Retention | None = None,
                 tenant_key: str | None = None, default_max_new_tokens: int | None = None,
                 lora: str | None = None) -> Req: ...

    def chat_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                 template_kwargs: dict[str, Any] | None = None, prefix: tuple[str, list[int]] | None = None,
                 on_text: Callable[[str], None] | None = None) -> list[int]: ...

    def turn_prefix_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        template_kwargs: dict[str, Any] | None, sentinel: str) -> list[int] | None: ...

    async def prepare_grammar(self, req: Req) -> None: ...  # compile a constrained request's grammar (a GrammarError if it fails)

    def submit(self, prompt: Req, params: SamplingParams | None = None, *,
               max_backlog: int | None = None) -> AsyncGenerator[Delta, None]: ...

    def abort(self, rid: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def snapshot(self) -> EngineStats: ...

    def replica_snapshots(self) -> list[EngineStats]: ...  # per data-parallel replica; snapshot() is their sum

    def describe(self) -> dict[str, Any] | None: ...  # data parallel: the router and each replica; one engine: None

    def route(self, req: Req, hint: str | None = None) -> None: ...  # choose the request's replica (one engine: no-op)

    def flush_cache(self, keep_disk: bool = False) -> int: ...

    def load_lora(self, name: str, path: str) -> dict[str, Any]: ...  # an adapter (--enable-lora); ValueError naming the field

    def unload_lora(self, name: str) -> None: ...

    def loras(self) -> list[dict[str, Any]]: ...  # the adapters loaded (name, path, digest, resident)

    def check_integrity(self) -> None: ...

    def shutdown(self) -> None: ...
