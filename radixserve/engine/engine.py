"""Engine: composes model, KV memory, scheduler and sampler behind a sync and an async API."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

import torch

from grammars.spec import GrammarSpec
from radixserve.attention import create_backend
from radixserve.cache.allocator import SlotAllocator, WindowedAllocator
from radixserve.cache.events import DISK, WINDOW, BlockEvents
from radixserve.cache.pool import KVPool, available_memory_bytes, kv_bytes_per_token, kv_cache_dtype
from radixserve.cache.prefix import NullPrefixCache, PrefixCache
from radixserve.cache.radix import RadixCache
from radixserve.config import EngineConfig, parse_kv_events
from radixserve.engine.front import DeltaStream, Prompt, RequestFront
from radixserve.engine.jump_forward import forced_after
from radixserve.engine.kv_connector import make_connector
from radixserve.engine.kv_events import DEFAULT_BLOCK, ZmqPublisher
from radixserve.engine.kv_handoff import KVHandoff
from radixserve.engine.kv_tier import KVTier, open_tier
from radixserve.engine.loop import EngineLoop, Refresh, Stop
from radixserve.engine.lora import LoRAManager, parse_modules
from radixserve.engine.outputs import Delta, Output
from radixserve.engine.postprocess import PostProcessor
from radixserve.engine.protocol import EngineStats
from radixserve.engine.runner import ModelRunner
from radixserve.engine.sampler import Sampler
from radixserve.models import packed_cache
from radixserve.models.linear import PACKED_MAX_ROWS, pack_linears
from radixserve.models.loader import load_model, quantized_weights
from radixserve.models.moe import describe as describe_experts
from radixserve.models.moe import idle_bytes
from radixserve.models.quant import set_activations, unread_embedding_bytes, weight_bytes
from radixserve.request import InvalidParam, Req, Retention, SamplingParams
from radixserve.sched.cache_manager import CacheManager
from radixserve.sched.scheduler import Scheduler
from radixserve.sched.spec import NgramProposer
from radixserve_kernels import cpu as cpu_kernels
from radixserve_kernels.kv_quant import is_quantized
from radixserve_kernels.threads import release_workers

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


HARMONY_STOPS = ("<|return|>", "<|call|>")  # the end of an answer, and of a turn that calls a tool


def harmony_stops(tokenizer: Any) -> set[int]:
    """A harmony model's (gpt-oss: its vocabulary has <|channel|>) stop tokens, whatever its
    file says: a turn ends at its answer or at a call, as gpt-oss's generation_config.json and
    llama.cpp's end-of-generation tokens have it (a GGUF file names only <|return|>; config.json
    likewise). NOTE: read from the vocabulary, which a fast-loaded tokenizer has without
    transformers (its chat template would load them)."""
    vocab = tokenizer.get_vocab()
    return {vocab[t] for t in HARMONY_STOPS if t in vocab} if "<|channel|>" in vocab else set()


class Engine(RequestFront):
    """`Engine(model=None, **overrides)`: model None is the default SmolLM2-135M-Instruct;
    overrides are EngineConfig field names (kv_cache_tokens, chunked_prefill_size, ...)."""

    def __init__(self, model: str | None = None, *, loop_thread: bool = True, own_process: bool = False,
                 **overrides: Any) -> None:
        """loop_thread=False: the caller runs the loop itself (`run_loop()`, on its own thread:
        the engine process runs it on its main thread). own_process: this process is the
        engine core's alone (its RSS is reported in the stats)."""
        self.config = cfg = EngineConfig.build(model, **overrides)
        self.pid = os.getpid()  # the engine core's process
        self.own_process = own_process
        self.device = _device(cfg.model.device)
        cpu_kernels.set_enabled(not cfg.model.disable_cpu_kernels)
        cpu_kernels.ops()  # built now (once per machine, cached), not in the first request; quantized weights are packed by it
        self.dtype = _dtype(cfg.model.dtype, self.device, quantized_weights(cfg.model.path, cfg.model.quantization))
        self.kv_dtype = kv_cache_dtype(cfg.cache.kv_cache_dtype, self.dtype)
        t0 = time.monotonic()
        loaded = load_model(cfg.model.path, self.dtype, self.device, cfg.model.quantization)
        self.quantization = loaded.quantization
        self.activations = set_activations(loaded.model, cfg.model.activations)  # before the decode step fuses them
        self.kv_heads = loaded.arch.num_kv_heads  # this rank's (its shard's, with tensor parallelism)
        self.pool_layers, self.pool_windows = loaded.arch.num_layers, loaded.arch.layer_windows  # (its stage's, pipelined)
        self.parallel: Any = None  # rank 0's side of --tensor-parallel / --pipeline-parallel (engine/model_parallel.py)
        self.tp_group: Any = None
        self.stage: Any = None
        split = cfg.model.tensor_parallel != 1 or cfg.model.pipeline_parallel != 1 or cfg.model.expert_parallel != 1
        if split:
            self._split(loaded.model)
        if not cfg.model.disable_packed_linears:
            pack_linears(loaded.model, self.dtype, self.device)
            fuse = getattr(loaded.model, "fuse_decode", None)
            if fuse is not None and not split and fuse():
                how = "in one native call" if self.kv_dtype == self.dtype or is_quantized(self.kv_dtype) else \
                    "layer by layer (the one-call step reads a pool in the activations' dtype, or int8 / fp8, only)"
                log.info("decode steps run all %d layers %s", loaded.arch.num_layers, how)
        self.weight_bytes = weight_bytes(loaded.model)  # with the packed copies of float linears
        # what a decode step at batch 1 reads: not an untied embedding's table (one row of it), nor
        # the experts it does not choose (bench compare --roof divides these by the step's time)
        self.step_weight_bytes = self.weight_bytes - unread_embedding_bytes(loaded.model)
        self.experts = describe_experts(loaded.arch)  # a mixture of experts' layout, or None
        if self.experts is not None:
            self.step_weight_bytes -= idle_bytes(loaded.model)
            self.experts["step_weight_bytes"] = self.step_weight_bytes
        self.load_seconds, self.load_peak_rss = time.monotonic() - t0, _peak_rss()
        kernels = cpu_kernels.ops() if self.device.type == "cpu" else None
        self.cpu_kernels = kernels.isa() if kernels is not None else ""
        self.model_name, self.model_path, self.arch = loaded.name, loaded.path, loaded.arch
        self.lora = self._lora(loaded.model, split)
        self.tokenizer = loaded.tokenizer
        self.context_len = min(self.arch.max_position, cfg.model.context_length or self.arch.max_position)
        self.vocab_size = min(self.arch.vocab_size, len(self.tokenizer))
        self.model_vocab_size = self.arch.vocab_size
        self.default_max_new_tokens = cfg.default_max_new_tokens
        self.eos_ids = set(self.arch.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_ids |= harmony_stops(self.tokenizer)
        a = self.arch
        self.window = max(a.layer_windows, default=0) if not cfg.cache.disable_hybrid_swa_memory else 0
        slots, window_slots = self._pool_slots()
        self.pool = KVPool(self.pool_layers, slots, self.kv_heads, a.head_dim, self.dtype, self.device, self.kv_dtype,
                           self.pool_windows, window_slots)
        self.num_slots = self.pool.num_slots
        ps = cfg.cache.page_size
        allocator = WindowedAllocator(slots, window_slots, ps) if window_slots else SlotAllocator(slots, ps)
        self.cache = CacheManager(allocator, self._prefix_cache())
        self.scheduler = Scheduler(cfg.sched, self.cache, self._proposer(), self.arch.context_cost())
        self.sampler = Sampler(self.vocab_size, self.eos_ids, (self.arch.vocab_size + 31) // 32)
        self._grammar_cache = self._new_grammar_cache()  # nothing started yet: see on_idle below
        backend = create_backend(cfg.attention_backend, self.pool, self.device, loaded.arch.attn_sinks)
        self.runner = ModelRunner(loaded.model, backend, self.sampler, self.device)
        if split:
            self._start_workers(slots, window_slots, loaded.model, backend)
        self.post = PostProcessor(self.tokenizer, self.sampler, self.eos_ids, self.context_len)
        self.post.jump_forward = not cfg.disable_jump_forward
        self.tier = self._disk_tier(loaded.path)
        self.handoff = self._kv_handoff()
        self.kv_events = self._kv_events()
        self._loop = EngineLoop(self.scheduler, self.runner, self.post, self.tier, self.handoff)
        self._loop.on_idle = self._grammar_cache.warm
        self._snapshot = self._stats()
        self.on_change: Callable[[], None] | None = None  # after each step or command, on the loop (the engine process sends there)
        self._loop.on_change = self._publish
        if self.kv_events is not None:
            self.kv_events.on_batch = self._events_sent
        if loop_thread:
            release_workers()  # this thread's OpenMP workers (it loaded the model) would slow every step of the loop's
            self._loop.start()

    def run_loop(self) -> None:
        """Run the engine loop on this thread until `stop_loop()` (for `loop_thread=False`)."""
        self._loop.run()

    def stop_loop(self) -> None:
        """Abort every request and end the loop (from any thread; does not wait)."""
        self._loop.inbox.put(Stop())

    def add(self, req: Req, sink: Callable[[Delta], None]) -> None:
        """Queue a built request (its grammar prepared); `sink` gets its deltas, on the loop.
        Raises InvalidParam for a KV hand-off this engine has no connector for."""
        if self.handoff is None and (req.kv_export is not None or req.kv_import is not None):
            field = "kv_export" if req.kv_export is not None else "kv_import"
            raise InvalidParam(field, "this engine has no KV connector (--kv-connector) to hand KV pages over with")
        if req.lora is not None:
            if self.lora is None:
                raise InvalidParam("model", f"{req.lora!r}: this engine serves no LoRA adapters (--enable-lora)")
            with self._loop.lock:
                self.lora.resolve(req)
                if self.kv_events is not None:  # its blocks' events name the adapter
                    self.kv_events.events.tag_lora(CacheManager.namespace(req), self.lora.ids[req.lora], req.lora)
        self._loop.add(req, sink)

    def _split(self, model: Any) -> None:
        """Cut the model to rank 0's part: its tensor-parallel shard (this rank's KV heads), its
        pipeline stage (this rank's layers) or its experts."""
        from radixserve.engine import model_parallel as mp
        from radixserve.models.tp import Group

        m = self.config.model
        tp, pp, ep = m.tensor_parallel, m.pipeline_parallel, m.expert_parallel
        for name, n in (("tensor_parallel", tp), ("pipeline_parallel", pp), ("expert_parallel", ep)):
            if n < 1:
                raise ValueError(f"{name}: must be a positive integer, got {n}")
        given = [name for name, n in (("tensor_parallel", tp), ("pipeline_parallel", pp), ("expert_parallel", ep)) if n > 1]
        if len(given) > 1:
            raise ValueError(f"{given[-1]}: not together with {given[0]} yet; give one of them")
        name = given[0]
        if self.device.type != "cpu":
            raise ValueError(f"{name}: runs on CPU (gloo) only so far; NCCL on CUDA is not built yet")
        for option, what in (("kv_disk_dir", "the disk tier"), ("kv_connector", "the KV hand-off")):
            if getattr(self.config.cache, option) is not None:  # refused here, before any worker starts
                raise ValueError(f"{option}: {what} does not hold a split pool's KV (each rank holds part of it) yet; "
                                 f"leave out {option} or {name}")
        torch.set_num_threads(mp.threads_per_rank(max(tp, pp, ep)))
        if tp > 1:
            self.tp_group = Group()
            self.kv_heads = mp.shard(model, 0, tp, self.tp_group).kv_heads
        elif ep > 1:
            self.tp_group = Group()
            mp.shard_experts(model, 0, ep, self.tp_group)
        else:
            self.stage = mp.stage(model, 0, pp)
            self.pool_layers = self.stage.hi - self.stage.lo
            self.pool_windows = self.pool_windows[self.stage.lo : self.stage.hi]

    def _start_workers(self, slots: int, window_slots: int, model: Any, backend: Any) -> None:
        """Ranks 1..N-1 (after rank 0 has built its pool: they build theirs alike)."""
        from radixserve.engine import model_parallel as mp

        m = self.config.model
        n = max(m.tensor_parallel, m.pipeline_parallel, m.expert_parallel)
        tensor = self.tp_group is not None
        mode = mp.EXPERT if m.expert_parallel > 1 else mp.TENSOR if tensor else mp.PIPELINE
        spec = mp.WorkerSpec(mode, m.path, self.dtype, m.quantization, m.activations,
                             self.kv_dtype, slots,
                             window_slots, self.config.attention_backend, not m.disable_packed_linears, mp.threads_per_rank(n),
                             n, mp.new_init_file(), mp.new_shm_name() if tensor else "")
        self.parallel = mp.ModelParallel(spec, model, backend, self.tp_group if tensor else self.stage)
        self.runner.parallel = self.parallel

    def _disk_tier(self, path: Any) -> KVTier | None:
        """The KV cache's disk tier (--kv-disk-dir), keyed by this model's fingerprint."""
        c = self.config.cache
        if c.kv_disk_dir is None:
            return None
        self._one_pool("kv_disk_dir", "the disk tier")
        facts = [self.arch, self.dtype, self.kv_dtype, self.quantization, self.config.model.quantization, self.activations]
        return open_tier(c, self.pool, Path(path), facts)

    def _lora(self, model: Any, split: bool) -> LoRAManager | None:
        """The LoRA adapters (--enable-lora, --lora-modules), each read and checked now."""
        m = self.config.model
        modules = parse_modules(m.lora_modules)
        if not (m.enable_lora or modules):
            return None
        if split:
            raise ValueError("enable_lora: LoRA adapters do not go with --tensor-parallel, --pipeline-parallel or "
                             "--expert-parallel yet")
        if not hasattr(model, "model") or not hasattr(model.model, "layers"):
            raise ValueError(f"enable_lora: this model ({type(model).__name__}) does not take LoRA adapters")
        manager = LoRAManager(model, self.arch, self.lora_dtype(), self.device, m.max_loras, m.max_lora_rank, self.model_name)
        for name, path in modules:
            try:
                manager.load(name, path)
            except ValueError as e:
                raise ValueError(f"lora_modules: {name}={path}: {e}") from None
        return manager

    def lora_dtype(self) -> torch.dtype:
        """--lora-dtype: auto is the model's dtype, or bf16 over quantized weights on a CPU (vLLM's
        auto is the model's dtype: our quantized models run fp32 activations, and fp32 adapters
        there would read as many bytes a step as a small model's 4-bit weights)."""
        choice = self.config.model.lora_dtype
        if choice == "auto":
            quantized = self.quantization != "none"
            return torch.bfloat16 if quantized and self.device.type == "cpu" else self.dtype
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[choice]

    def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Read an adapter and serve it under `name` (ValueError naming the field at fault)."""
        if self.lora is None:
            raise InvalidParam("lora_name", "this engine serves no LoRA adapters (start it with --enable-lora)")
        with self._loop.lock:
            return self.lora.load(name, path)

    def unload_lora(self, name: str) -> None:
        if self.lora is None:
            raise InvalidParam("lora_name", "this engine serves no LoRA adapters (start it with --enable-lora)")
        with self._loop.lock:
            self.lora.unload(name)

    def loras(self) -> list[dict[str, Any]]:
        if self.lora is None:
            return []
        with self._loop.lock:
            return self.lora.describe()

    def _kv_events(self) -> ZmqPublisher | None:
        """The KV events' publisher (--kv-events-config), told by the radix cache and the disk tier."""
        c = self.config.cache
        cfg = parse_kv_events(c.kv_events_config) if c.kv_events_config is not None else None
        if cfg is None or not cfg.enabled:
            return None
        prefix = self.cache.prefix
        assert isinstance(prefix, RadixCache)  # CacheConfig.check refused disable_radix_cache
        block = cfg.block_size or (c.page_size if c.page_size > 1 else DEFAULT_BLOCK)
        if block % c.page_size:
            raise ValueError(f"kv_events_config: block_size ({block}) must be a multiple of page_size ({c.page_size})")
        if self.tier is not None and self.tier.block % block:
            raise ValueError(f"kv_events_config: block_size ({block}) must divide kv_disk_block_tokens ({self.tier.block})")
        events = BlockEvents(block, "GPU" if self.device.type == "cuda" else "CPU", self.window)
        prefix.events = events
        if self.tier is not None:
            self.tier.tell(events)
        return ZmqPublisher(cfg, events)

    def _one_pool(self, option: str, what: str) -> None:
        """`what` moves a token's KV as one pool's rows (KVPool.gather): refuse a sliding-window pool
        (a split pool is refused in _split, before its workers start)."""
        if self.cache.windowed is not None:
            raise ValueError(f"{option}: {what} does not hold a sliding-window pool's KV yet; "
                             "add --disable-hybrid-swa-memory to use it with this model")

    def _kv_handoff(self) -> KVHandoff | None:
        """Prefill/decode disaggregation's KV connector (--kv-connector)."""
        c = self.config.cache
        if c.kv_connector is None:
            return None
        self._one_pool("kv_connector", "the KV hand-off")
        return KVHandoff(self.pool, make_connector(c.kv_connector, c.kv_connector_host))

    @property
    def kv_location(self) -> str:
        """Where another engine takes the KV pages this one publishes ("" without a connector)."""
        return self.handoff.location if self.handoff is not None else ""

    def match_len(self, req: Req) -> int:
        """How much of the request's prompt the prefix cache holds now (waits for the step to end)."""
        with self._loop.lock:
            return self.cache.match_len(req)

    def _proposer(self) -> NgramProposer | None:
        s = self.config.spec
        if s.speculative == "none":
            return None
        fixed = s.fixed_cost(self.device.type)
        rows = PACKED_MAX_ROWS if self.device.type == "cpu" else 1 << 30
        forced = None if self.config.disable_jump_forward else functools.partial(forced_after, tokenizer=self.tokenizer)
        return NgramProposer(s, self.cache, self.eos_ids, self.context_len, fixed, self.tokenizer.decode, forced, rows)

    def _prefix_cache(self) -> PrefixCache:
        c = self.config.cache
        if c.disable_radix_cache:
            return NullPrefixCache(c.page_size, self.window)
        return RadixCache(c.page_size, c.radix_eviction_policy, c.tenant_max_cached_tokens, self.window)

    def _pool_slots(self) -> tuple[int, int]:
        """(full slots, window slots). Tokens: kv_cache_tokens, else kv_cache_memory_mb's bytes,
        else kv_mem_fraction of the free memory, over the bytes a token takes in the KV dtype
        (scales included). With sliding-window layers in a pool of their own (unless
        disable_hybrid_swa_memory), that pool holds swa_full_tokens_ratio as many tokens, and
        at least what one request's window and prefill chunk need (0: no such pool)."""
        c, a = self.config, self.arch
        windowed = sum(1 for w in a.layer_windows if w) if self.window else 0
        ratio = c.cache.swa_full_tokens_ratio if windowed else 0.0
        layer_bytes = kv_bytes_per_token(1, self.kv_heads, a.head_dim, self.kv_dtype)
        per_token = layer_bytes * (a.num_layers - windowed + ratio * windowed)
        if c.cache.kv_cache_tokens is not None:
            n = c.cache.kv_cache_tokens
        elif c.cache.kv_cache_memory_mb is not None:
            n = int((c.cache.kv_cache_memory_mb << 20) // per_token)
        else:
            n = int(available_memory_bytes(self.device) * c.cache.kv_mem_fraction // per_token)
        given = "kv_cache_tokens" if c.cache.kv_cache_memory_mb is None else "kv_cache_memory_mb"
        if c.sched.max_total_tokens is not None and c.sched.max_total_tokens < n:
            n, given = c.sched.max_total_tokens, "max_total_tokens"
        ps = c.cache.page_size
        n -= n % ps
        if n < 1:
            raise ValueError(f"{given}: the KV pool would hold {n} tokens ({per_token:.0f} bytes each); give it at least one page")
        if not windowed:
            return n, 0
        floor = self.window + c.sched.chunked_prefill_size + 2 * ps  # one request's window and chunk, page-rounded
        w = min(n, max(int(n * ratio), floor))
        return n, w - w % ps

    # -- grammars ---------------------------------------------------------------------------
    def grammars(self) -> Any:
        """The compile cache (grammars.cache.CompileCache)."""
        return self._grammar_cache

    def _new_grammar_cache(self) -> Any:
        """Cheap here: xgrammar is imported, and the first compile worker started, in the background
        at the first compile or once the loop has been idle a moment (`EngineLoop.on_idle`): that
        start-up takes seconds of CPU, which would otherwise slow the first requests after ready."""
        from grammars import check_backend_name, create_backend
        from grammars.cache import CompileCache

        c = self.config
        check_backend_name(c.grammar_backend)
        factory = functools.partial(create_backend, c.grammar_backend, self.tokenizer, self.arch.vocab_size, sorted(self.eos_ids))
        return CompileCache(factory, c.grammar_compile_timeout, c.grammar_compile_workers, c.grammar_tenant_compiles,
                            c.grammar_compile_memory_mb, warm=False)

    def compile_spec(self, spec: GrammarSpec) -> GrammarSpec:
        """The spec as compiled here (the server's whitespace cap applied)."""
        ws = self.config.grammar_max_whitespace
        return dataclasses.replace(spec, max_whitespace=None if ws < 0 else ws)

    def prepare_grammar_sync(self, req: Req) -> None:
        """Compile (or fetch) the request's grammar on the compile pool, waiting here; raises
        GrammarError (a ValueError naming the field and the problem)."""
        if req.grammar_spec is not None and req.grammar is None:
            req.grammar = self.grammars().get(self.compile_spec(req.grammar_spec), req.tenant).matcher()

    async def prepare_grammar(self, req: Req) -> None:
        """The same for event loops: the request waits here, outside the run queue."""
        if req.grammar_spec is not None and req.grammar is None:
            req.grammar = (await self.grammars().get_async(self.compile_spec(req.grammar_spec), req.tenant)).matcher()

    def generate(
        self,
        prompts: Sequence[Prompt] | str,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tenant: str | None = None,
        cache_salt: str | None = None,
        public_prefix_len: int | None = None,
        retention: Retention | None = None,
    ) -> list[Output]:
        """Run a batch to completion (offline use). One Output per prompt, in order. All
        prompts are submitted together: those sharing a prefix compute it once."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: got {len(plist)} SamplingParams for {len(prompts)} prompts")
        reqs = [self.make_req(p, sp, tenant=tenant, cache_salt=cache_salt, public_prefix_len=public_prefix_len,
                              retention=retention) for p, sp in zip(prompts, plist)]
        for req in reqs:
            self.prepare_grammar_sync(req)
        results: dict[str, Output] = {}
        done = threading.Event()
        guard = threading.Lock()

        def sink(d: Delta) -> None:
            if d.finished and d.output is not None:
                with guard:
                    results[d.rid] = d.output
                    if len(results) == len(reqs):
                        done.set()

        for req in reqs:
            self.add(req, sink)
        try:
            while not done.wait(0.1):
                if not self._loop.alive:
                    raise RuntimeError("the engine loop has stopped")
        except BaseException:
            for req in reqs:
                self.abort(req.rid)
            raise
        return [results[r.rid] for r in reqs]

    async def submit(
        self,
        prompt: Prompt | Req,
        params: SamplingParams | None = None,
        *,
        rid: str | None = None,
        priority: int = 0,
        tenant: str | None = None,
        cache_salt: str | None = None,
        public_prefix_len: int | None = None,
        retention: Retention | None = None,
        max_backlog: int | None = None,
    ) -> AsyncGenerator[Delta, None]:
        """Stream one request's deltas. Leaving the iteration early aborts the request. With
        `max_backlog`, a consumer that lets more deltas than that pile up unread (a client that
        stopped reading) gets the request aborted: its KV is freed, the deltas past the cap
        are dropped, and the final delta (finish reason "abort") still arrives."""
        if isinstance(prompt, Req):
            req = prompt
        else:
            req = self.make_req(prompt, params, rid, priority, tenant=tenant, cache_salt=cache_salt,
                                public_prefix_len=public_prefix_len, retention=retention)
        await self.prepare_grammar(req)
        stream = DeltaStream(lambda: self.abort(req.rid), max_backlog)
        self.add(req, stream.sink)
        async with aclosing(stream.deltas()) as deltas:  # closed (so aborting) as soon as this is
            async for d in deltas:
                yield d

    def abort(self, rid: str) -> None:
        self._loop.abort(rid)

    def stats(self) -> EngineStats:
        """KV accounting (in tokens: free + cached + in use = total) and scheduler counters.
        Waits for the current step to end; `snapshot()` does not wait."""
        with self._loop.lock:
            return self._stats()

    def snapshot(self) -> EngineStats:
        """The stats as of the end of the last step or command; never blocks (event loops use this)."""
        return self._snapshot

    def replica_snapshots(self) -> list[EngineStats]:
        """One engine is one replica."""
        return [self._snapshot]

    def _publish(self) -> None:
        self._snapshot = self._stats()
        if self.on_change is not None:
            self.on_change()

    def _stats(self) -> EngineStats:
        s, alloc, prefix = self.scheduler, self.cache.allocator, self.cache.prefix
        c = s.counters
        return EngineStats(
            kv_total_slots=alloc.size,
            kv_free_slots=alloc.num_free,
            kv_in_use_slots=self.cache.in_use(),
            kv_cached_tokens=prefix.cached_tokens,
            kv_evictable_tokens=prefix.evictable_tokens,
            kv_locked_tokens=prefix.locked_tokens,
            evicted_tokens=prefix.evicted_tokens,
            kv_namespaces=prefix.namespaces,
            cache_hit_rate=c.cached_prompt_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
            running=len(s.running),
            waiting=len(s.waiting) + len(self._loop.loading),
            waiting_tokens=sum(len(r.token_ids) for r in s.waiting),
            steps=self._loop.steps,
            jump_forward_tokens=self.post.jumped_tokens,
            engine_rss_bytes=_rss_bytes() if self.own_process else 0,
            kv_dtype=str(self.kv_dtype).removeprefix("torch."),
            kv_bytes_per_token=self.pool.bytes_per_token,
            kv_window_total_slots=self.pool.window_slots,
            kv_window_free_slots=self.cache.windowed.window.num_free if self.cache.windowed is not None else 0,
            kv_window_cached_tokens=prefix.window_tokens if self.cache.windowed is not None else 0,
            kv_pool_bytes=self.pool.nbytes,
            **(self._event_stats() if self.kv_events is not None else {}),
            **(self.tier.stats() if self.tier is not None else {}),
            **(self.handoff.stats() if self.handoff is not None else {}),
            **vars(c),
        )

    def _events_sent(self) -> None:
        """A batch of KV events went out: an idle loop publishes the stats that count them (a busy
        one does after its next step)."""
        if not self.scheduler.has_work:
            self._loop.inbox.put(Refresh())

    def _event_stats(self) -> dict[str, int]:
        assert self.kv_events is not None
        ev = self.kv_events.events
        return {"kv_events_batches": self.kv_events.published, "kv_events_blocks": ev.count(),
                "kv_events_window_blocks": ev.count(group=WINDOW), "kv_events_disk_blocks": ev.count(DISK)}

    def flush_cache(self, keep_disk: bool = False) -> int:
        """Drop every cached prefix, the disk tier's blocks too unless `keep_disk` (then the
        blocks being written are written first); returns the tokens dropped from the pool.
        Raises RuntimeError while requests are running or waiting (their prefixes are locked or
        about to be)."""
        with self._loop.lock:
            if self.scheduler.has_work or self._loop.loading:
                s = self.scheduler
                raise RuntimeError(
                    f"flush_cache: refused while {len(s.running)} requests are running and "
                    f"{len(s.waiting) + len(self._loop.loading)} waiting; retry when idle"
                )
            if self.tier is not None:
                self.tier.flush()
                if not keep_disk:
                    self.tier.store.clear()
            dropped = self.cache.flush()  # (the blocks each told removed, then:)
            if self.kv_events is not None and (self.tier is None or not keep_disk):
                self.kv_events.events.cleared()  # everything is gone
            return dropped

    def check_integrity(self) -> None:
        """Raise RuntimeError unless every KV page is free, cached or owned by one request."""
        with self._loop.lock:
            self.cache.check_integrity()

    # -- lifecycle --------------------------------------------------------------------------
    def shutdown(self) -> None:
        self._loop.stop()
        if self.parallel is not None:
            self.parallel.close()
        if self.tier is not None:
            self.tier.close()
        if self.handoff is not None:
            self.handoff.close()
        if self.kv_events is not None:
            self.kv_events.close()  # after the disk tier's last writes, which it tells
        self.runner.close()
        self._grammar_cache.shutdown()  # kills its compile workers
        packed_cache.wait()  # a first start's packed weights, still being written for the next

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


_RSS_EVERY_S = 0.5
_rss_seen = [float("-inf"), 0]  # (monotonic time, bytes) of the last read


def _rss_bytes() -> int:
    """This process's resident memory, read from /proc at most every half second (the stats
    are built after every step, and the read cost ~80 us of a ~13 ms step)."""
    now = time.monotonic()
    if now - _rss_seen[0] >= _RSS_EVERY_S:
        try:
            with open("/proc/self/statm") as f:
                _rss_seen[1] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            _rss_seen[1] = 0
        _rss_seen[0] = now
    return int(_rss_seen[1])


def _peak_rss() -> int:
    """This process's peak resident memory so far, in bytes (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_has_bf16() -> bool:
    """AMX or AVX512-BF16: bf16 matmuls run natively, at twice fp32's rate and half its weight
    traffic (SGLang's and vLLM's CPU backends default to bf16 there too)."""
    if not cpu_kernels.chosen_isa().startswith("avx512"):  # RADIXSERVE_CPU_ISA=avx2 stands in for an AVX2-only CPU
        return False
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(caps.get("amx_bf16") or caps.get("avx512_bf16"))


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _dtype(name: str, device: torch.device, quantized: bool) -> torch.dtype:
    """auto: bf16 on CUDA and on CPUs with AMX or AVX512-BF16; fp32 elsewhere, and on a CPU for
    quantized weights (their integer kernels take fp32 activations as fast as bf16, and fp32 keeps
    greedy output identical to the dequantized model's: scripts/quant_check.py)."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_bf16() and not quantized else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype: {name!r} is not supported; choose from: auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]
