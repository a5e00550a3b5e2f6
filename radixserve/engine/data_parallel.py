"""Data-parallel replicas behind one server: N engine processes, each with its own model copy
and KV cache, and a router that sends each request to the one most likely to hold its prefix.

    server process                                     engine processes
    HTTP, auth, tokenizer  --route-->  DataParallelEngine --+--> EngineProcess 0 (cuda:0 / cores/N)
    (one EngineClient)      Router (radixserve.routing)     +--> EngineProcess 1
                                                            +--> ...

Routing happens once a request is built (tokenized), before its grammar is compiled (on the
replica it will run on) and it is submitted: `route(req, hint)`. Load is the requests routed
to a replica and not yet finished, as SGLang's router counts it.

Failure: a replica whose engine process dies is out of the routing set at once (its socket's
EOF is the health check) and restarted in the background: cold, its index entries forgotten,
unless it has a disk tier (--kv-disk-dir: each replica its own directory under it), whose
blocks it finds again, so the router keeps what it knew of it.
A request that had received nothing from it yet is resubmitted on another replica; one that
had streamed part of its answer ends with an error naming the replica. If every replica is
gone at once, the engine is `dead` (the server exits, as it does for one engine).

Prefill/decode disaggregation (--disaggregate): replicas 0..P-1 prefill, the rest decode, as
SGLang's PD router and vLLM's disaggregated proxy split them, so a long prompt's prefill never
stalls another request's decode steps. A request is routed to a decode replica first (by prefix
and load, among the decode replicas); that replica is asked how much of the prompt it already
holds (`match_len`); if what is left is at least --disaggregate-min-tokens, a prefill replica
(by prefix and load, among the prefill replicas: forks of one prompt meet in one prefill cache)
computes the prompt up to its last token and publishes the KV pages past what the decode replica
holds through the KV connector (engine/kv_connector.py: shm, or tcp), and the request goes to
its decode replica carrying their key (engine/kv_handoff.py). The decode replica computes the
last token itself and samples everything, so output is the colocated engine's. A failed
prefill (its replica gone, its pages lost) costs only time: the decode replica computes the
prompt. Every hand-off the coordinator begins, it releases when the request ends (whatever
the path); a producer drops what is never taken after kv_connector.STAGED_TTL_S.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from radixserve.cache.disk_guard import private_dir
from radixserve.cache.prefix import DEFAULT_TENANT, Namespace
from radixserve.config import EngineConfig, RouterConfig
from radixserve.engine import kv_connector
from radixserve.engine.front import RequestFront
from radixserve.engine.outputs import Delta, Output
from radixserve.engine.process import EngineProcess
from radixserve.engine.protocol import EngineDied, EngineStats
from radixserve.request import KVPages, Req, SamplingParams
from radixserve.routing import RouteKey, make_router

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = (1.0, 5.0, 30.0)  # before a dead replica's 1st, 2nd, 3rd and later restarts


PREFILL, DECODE, BOTH = "prefill", "decode", "both"


@dataclass
class Replica:
    index: int
    engine: EngineProcess | None  # None while (re)starting
    role: str = BOTH  # prefill or decode when disaggregated
    load: int = 0  # requests routed here and not finished
    restarts: int = 0

    @property
    def healthy(self) -> bool:
        return self.engine is not None and self.engine.dead is None


class DataParallelEngine(RequestFront):
    """`DataParallelEngine(model, router=RouterConfig(data_parallel=N), **overrides)`: the
    arguments of EngineProcess, started N times. An EngineClient: the server uses it as it
    uses one engine."""

    def __init__(self, model: str | None = None, router: RouterConfig | None = None, *,
                 restart: bool = True, **overrides: Any) -> None:
        self.router_config = cfg = router or RouterConfig(data_parallel=2)
        cfg.check()
        self.router = make_router(cfg)
        self._model, self._restart = model, restart
        n = cfg.replicas
        if cfg.disaggregate and overrides.get("kv_connector") is None:  # (the CLI passes every flag, unset ones as None)
            overrides = {**overrides, "kv_connector": "shm"}
        self.config = EngineConfig.build(model, **overrides)  # refuses a bad option before N processes start
        if self.config.cache.kv_disk_dir is not None:  # the replicas' folders' parent: made or checked private
            private_dir(self.config.cache.kv_disk_dir)
        gpus = _visible_gpus() if self.config.model.device in ("auto", "cuda") else []
        self._gpus = gpus if len(gpus) >= n else []
        self._overrides = overrides if self._gpus else _split_memory(self.config, overrides, n)
        # NOTE: loaded here, once: the replicas start on threads, and transformers' lazy imports
        # are not thread-safe (two threads importing AutoTokenizer at once fail)
        from radixserve.models.files import load_tokenizer, tokenizer_dir, vocab_texts_soon

        self.tokenizer = load_tokenizer(tokenizer_dir(model))
        self.vocab_texts = vocab_texts_soon(self.tokenizer)  # the server's logprob table, while the replicas load
        self._lock = threading.Lock()  # replicas and the router: the event loop, reader and restart threads
        self._closing = False
        self._restarts: list[threading.Thread] = []  # replicas starting again after a death
        self.dead: str | None = None
        self.on_death: Callable[[str], None] | None = None
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(self._start, i) for i in range(n)]
            errors = [f.exception() for f in futures]
        started = [f.result() for f in futures if f.exception() is None]
        if len(started) < n:
            for e in started:
                e.shutdown()
            raise next(e for e in errors if e is not None)
        self.replicas = [Replica(i, e, _role(i, cfg.prefill)) for i, e in enumerate(started)]
        first = started[0]  # what the replicas share, as the first one reports it
        self.model_name, self.model_path, self.quantization = first.model_name, first.model_path, first.quantization
        self.context_len, self.vocab_size, self.model_vocab_size = first.context_len, first.vocab_size, first.model_vocab_size
        self.eos_ids, self.num_slots, self.dtype, self.device = first.eos_ids, first.num_slots, first.dtype, first.device
        self.weight_bytes, self.default_max_new_tokens = first.weight_bytes, first.default_max_new_tokens
        self.step_weight_bytes = first.step_weight_bytes
        self.load_seconds, self.load_peak_rss, self.cpu_kernels = first.load_seconds, first.load_peak_rss, first.cpu_kernels
        self.activations, self.experts = first.activations, first.experts
        self._placed: dict[str, int] = {}  # rid -> replica, routed and not submitted yet
        self._running: dict[str, int] = {}  # rid -> replica, submitted
        self._handoffs: dict[str, KVPages | None] = {}  # rid -> the pages a prefill replica was asked to publish (None: none)
        self._prefilling: dict[str, _Prefill] = {}  # rid -> its prefill under way
        self._cancelled: set[str] = set()  # rids aborted while their prefill ran
        self._lora_ops: list[tuple[str, str, str]] = []  # LoRA adapters loaded and unloaded at run time: (op, name, path)
        for r in self.replicas:
            self._watch(r)

    @property
    def pid(self) -> int:
        return next((r.engine.pid for r in self.replicas if r.engine is not None), 0)

    def _start(self, i: int) -> EngineProcess:
        n = self.router_config.replicas
        return EngineProcess(self._model, env=_replica_env(i, n, self._gpus), tokenizer=self.tokenizer,
                             **_replica_overrides(self.config, self._overrides, i, n))

    @property
    def disaggregated(self) -> bool:
        return self.router_config.disaggregate

    @property
    def _keeps_prefixes(self) -> bool:
        """A replica with a disk tier finds its prefixes again when it restarts on its directory."""
        return self.config.cache.kv_disk_dir is not None

    # -- routing ----------------------------------------------------------------------------
    def route(self, req: Req, hint: str | None = None) -> None:
        """Choose the request's replica among the healthy ones (raises EngineDied if none is)."""
        if req.rid in self._placed:
            return
        self._placed[req.rid] = self._choose(req, hint, exclude=())

    def _choose(self, req: Req, hint: str | None, exclude: tuple[int, ...] | set[int], role: str = DECODE) -> int:
        """A healthy replica that runs `role` (decode: the request itself; prefill: its hand-off)."""
        ns: Any = Namespace(req.tenant or DEFAULT_TENANT, req.cache_salt)
        if req.lora is not None:  # an adapter's prefixes are its own (engine/lora.py): never the base's replica by them
            ns = (ns, req.lora)
        with self._lock:
            loads = {r.index: r.load for r in self.replicas
                     if r.healthy and r.index not in exclude and r.role in (role, BOTH)}
            if not loads:
                raise EngineDied(f"no data-parallel {role} replica is serving (restarting)")
            keyed = req.token_ids[:min(req.prompt_len, self.router_config.router_max_prefix_tokens)]
            i = self.router.choose(RouteKey(ns, keyed, hint), loads)
            self.replicas[i].load += 1
        return i

    def _release(self, i: int) -> None:
        with self._lock:
            self.replicas[i].load -= 1

    # -- requests ---------------------------------------------------------------------------
    async def prepare_grammar(self, req: Req) -> None:
        """Compile on the replica the request goes to; if it dies meanwhile, on another."""
        tried: set[int] = set()
        if req.grammar_spec is not None and self.disaggregated:
            self.route(req)
            if not await self._prefill_elsewhere(req, self._placed[req.rid]):  # before it is sent ahead to decode
                return  # aborted meanwhile: its submit ends at once
        while True:
            self.route(req)
            i = self._placed[req.rid]
            engine = self.replicas[i].engine
            try:
                if engine is None:
                    raise EngineDied(f"replica {i} is restarting")
                return await engine.prepare_grammar(req)
            except EngineDied:
                tried.add(i)
                self._placed.pop(req.rid, None)
                self._release(i)
                self._placed[req.rid] = self._choose(req, None, exclude=tried)

    async def submit(self, prompt: Req, params: SamplingParams | None = None, *,
                     max_backlog: int | None = None) -> AsyncGenerator[Delta, None]:
        """Stream the request from its replica. Nothing received yet when that replica died: it
        runs again on another one; part of an answer received: the stream ends with an error."""
        req = prompt if isinstance(prompt, Req) else self.make_req(prompt, params)
        self.route(req)
        i = self._placed.pop(req.rid)
        tried: set[int] = set()
        answered = False  # a delta came from the decode replica: it took the hand-off's pages first
        try:
            if self.disaggregated and (req.rid in self._cancelled or (
                    req.rid not in self._handoffs and not await self._prefill_elsewhere(req, i))):
                yield _ended(req, "abort")
                return
            while True:
                self._running[req.rid] = i
                received = False
                async with aclosing(self._stream(i, req, max_backlog)) as deltas:
                    async for d in deltas:
                        if d is None:  # the replica died before sending anything
                            break
                        received = answered = True
                        yield d
                if received:
                    return
                tried.add(i)
                self._release(i)
                try:
                    i = self._choose(req, None, exclude=tried)
                except EngineDied as e:
                    i = -1
                    yield _ended(req, "error", str(e))
                    return
                log.warning("request %s: replica %s died before answering; resubmitted on replica %d",
                            req.rid, sorted(tried), i)
        finally:
            self._running.pop(req.rid, None)
            if i >= 0:
                self._release(i)
            self._end_handoff(req.rid, taken=answered)

    # -- prefill/decode disaggregation --------------------------------------------------------
    async def _prefill_elsewhere(self, req: Req, d: int) -> bool:
        """Have a prefill replica compute the request's prompt (but its last token) and publish
        the pages decode replica `d` lacks; on success the request carries their key
        (`kv_import`). Any failure leaves it without: `d` computes the prompt. False if the
        request was aborted meanwhile."""
        self._handoffs[req.rid] = None
        page = self.config.cache.page_size
        upto = (req.prompt_len - 1) // page * page
        engine = self.replicas[d].engine
        state = self._prefilling[req.rid] = _Prefill(-1, f"{req.rid}/prefill")
        try:
            have = await engine.match_len(req) if engine is not None else 0
            if not state.aborted and upto - have >= max(self.router_config.disaggregate_min_tokens, 1):
                state.replica = self._choose(req, None, exclude=(), role=PREFILL)
        except EngineDied:
            pass  # no replica to ask or to prefill on: the decode replica computes the prompt
        finally:
            if state.replica < 0:
                self._prefilling.pop(req.rid, None)
        if (p := state.replica) < 0:
            return self._settled(req, state)
        pages = KVPages(secrets.token_hex(16), have // page * page, upto)
        pre = Req(req.token_ids[:upto], SamplingParams(max_new_tokens=1, temperature=0.0), rid=state.rid,
                  priority=req.priority, max_new_tokens=1, tenant=req.tenant, cache_salt=req.cache_salt,
                  public_prefix_len=min(req.public_prefix_len, upto), lora=req.lora)  # computed by its adapter
        pre.kv_export = pages
        producer = self.replicas[p].engine
        ok = False
        try:
            if producer is not None:
                self._handoffs[req.rid] = dataclasses.replace(pages, location=producer.kv_location)
                async with aclosing(producer.submit(pre)) as deltas:
                    async for delta in deltas:
                        out = delta.output
                        if delta.finished and out is not None:
                            ok = out.error is None and out.finish_reason == "length"
                            if not ok:
                                log.warning("request %s: its prefill on replica %d failed (%s); its decode replica "
                                            "computes the prompt", req.rid, p, out.error or out.finish_reason)
        except EngineDied:
            pass
        finally:
            self._prefilling.pop(req.rid, None)
            self._release(p)
        if ok:
            req.kv_import = self._handoffs[req.rid]
        return self._settled(req, state)

    def _settled(self, req: Req, state: _Prefill) -> bool:
        """False (and the request remembered as cancelled) if it was aborted during its prefill."""
        if state.aborted:
            self._cancelled.add(req.rid)
        return not state.aborted

    def _end_handoff(self, rid: str, taken: bool = False) -> None:
        """Drop what the request's prefill replica published, unless its decode replica `taken` it
        (or lost it: a producer drops what is left after STAGED_TTL_S)."""
        self._cancelled.discard(rid)
        pages = self._handoffs.pop(rid, None)
        if pages is not None and not taken:
            if pages.location.startswith("shm:"):
                kv_connector.release(pages.location, pages.key)
            else:  # a socket call: off the event loop
                threading.Thread(target=kv_connector.release, args=(pages.location, pages.key), daemon=True).start()

    async def _stream(self, i: int, req: Req, max_backlog: int | None) -> AsyncGenerator[Delta | None, None]:
        """Replica i's deltas; a single None if it died before the first one."""
        engine = self.replicas[i].engine
        if engine is None:
            yield None
            return
        first = True
        try:
            async with aclosing(engine.submit(req, max_backlog=max_backlog)) as deltas:
                async for d in deltas:
                    if d.finished and engine.dead is not None and d.output is not None and d.output.error:
                        if first:  # its death failed the request: nothing of it reached the caller
                            yield None
                            return
                        d.output.error = f"data-parallel replica {i}: {d.output.error}"
                    first = False
                    yield d
        except EngineDied:
            if not first:
                raise
            yield None

    def abort(self, rid: str) -> None:
        if (pre := self._prefilling.get(rid)) is not None:  # its prefill is under way: it ends there
            pre.aborted = True
            producer = self.replicas[pre.replica].engine if pre.replica >= 0 else None
            if producer is not None:
                producer.abort(pre.rid)
            return
        i = self._placed.pop(rid, None)
        if i is not None:  # routed, never submitted (its client left, or it was refused)
            if (placed := self.replicas[i].engine) is not None:
                placed.abort(rid)  # sent ahead for its grammar: it runs there unless told
            self._release(i)
            self._end_handoff(rid)
            return
        i = self._running.get(rid)
        engine = self.replicas[i].engine if i is not None else None
        if engine is not None:
            engine.abort(rid)

    # -- calls --------------------------------------------------------------------------------
    def _engines(self) -> list[EngineProcess]:
        with self._lock:
            return [r.engine for r in self.replicas if r.healthy and r.engine is not None]

    def stats(self) -> EngineStats:
        return EngineStats.sum([e.stats() for e in self._engines()])

    def snapshot(self) -> EngineStats:
        return EngineStats.sum([e.snapshot() for e in self._engines()])

    def replica_snapshots(self) -> list[EngineStats]:
        """Each replica's stats by index (a restarting one: empty)."""
        return [r.engine.snapshot() if r.engine is not None else EngineStats() for r in self.replicas]

    def describe(self) -> dict[str, Any] | None:
        """For /server_info: the router and each replica's process, health, load, restarts and KV."""
        snaps = self.replica_snapshots()
        with self._lock:
            replicas = [{"replica": r.index, "role": r.role, "pid": r.engine.pid if r.engine else None,
                         "healthy": r.healthy, "load": r.load, "restarts": r.restarts, "kv": dataclasses.asdict(s)}
                        for r, s in zip(self.replicas, snaps)]
            return {"router": {"policy": self.router.name, "decisions": dict(self.router.decisions)}, "replicas": replicas}

    def flush_cache(self, keep_disk: bool = False) -> int:
        return sum(e.flush_cache(keep_disk) for e in self._engines())

    def check_integrity(self) -> None:
        for e in self._engines():
            e.check_integrity()

    def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """On every replica (undone on those that took it if one refuses); a replica that restarts
        loads it again."""
        done: list[EngineProcess] = []
        try:
            for e in self._engines():
                out = e.load_lora(name, path)
                done.append(e)
        except Exception:
            for e in done:
                e.unload_lora(name)
            raise
        self._lora_ops.append(("load", name, path))
        return out

    def unload_lora(self, name: str) -> None:
        self._lora_ops.append(("unload", name, ""))  # first: a replica restarting meanwhile unloads it too
        failed: Exception | None = None
        for e in self._engines():
            try:
                e.unload_lora(name)
            except ValueError as err:  # not on this replica (it restarted without it): unloaded there all the same
                failed = failed or err
        if failed is not None:
            log.warning("unloading LoRA adapter %r: %s", name, failed)

    def loras(self) -> list[dict[str, Any]]:
        engines = self._engines()
        return engines[0].loras() if engines else []

    # -- failure and restart ------------------------------------------------------------------
    def _watch(self, r: Replica) -> None:
        assert r.engine is not None
        r.engine.on_death = lambda why, r=r: self._died(r, why)

    def _died(self, r: Replica, why: str) -> None:
        """On the dead replica's reader thread."""
        if r.engine is not None:  # a killed producer leaves its shm staging directory behind
            kv_connector.forget(r.engine.kv_location)
        with self._lock:
            if not self._keeps_prefixes:
                self.router.forget(r.index)
            alive = [x for x in self.replicas if x.healthy]
            if not alive and not self._closing:
                self.dead = f"every data-parallel replica is gone (replica {r.index}: {why})"
        log.error("data-parallel replica %d is gone (%s)%s", r.index, why, "" if alive else "; no replica is left")
        if not alive:
            if self.on_death is not None:
                self.on_death(self.dead or why)
            return
        if self._restart:
            t = threading.Thread(target=self._restart_replica, args=(r,), name=f"radixserve-replica-{r.index}-restart",
                                 daemon=True)
            with self._lock:
                self._restarts = [x for x in self._restarts if x.is_alive()] + [t]
            t.start()

    def _restart_replica(self, r: Replica) -> None:
        with self._lock:
            old, r.engine = r.engine, None
        if old is not None:
            old.shutdown(timeout=5)
        while not self._closing and self.dead is None:
            time.sleep(RESTART_BACKOFF_S[min(r.restarts, len(RESTART_BACKOFF_S) - 1)])
            r.restarts += 1
            try:
                engine = self._start(r.index)
            except Exception:
                log.exception("data-parallel replica %d did not restart (try %d)", r.index, r.restarts)
                continue
            for op, name, path in list(self._lora_ops):  # the adapters loaded and unloaded at run time, in order
                try:
                    engine.load_lora(name, path) if op == "load" else engine.unload_lora(name)
                except Exception:
                    log.exception("data-parallel replica %d: LoRA adapter %r could not be %sed again", r.index, name, op)
            with self._lock:
                if self._closing or self.dead is not None:
                    engine.shutdown()
                    return
                if not self._keeps_prefixes:
                    self.router.forget(r.index)  # cold: whatever was routed there before is gone
                r.engine = engine
            self._watch(r)
            log.info("data-parallel replica %d restarted (%s)", r.index,
                     "its disk tier's prefixes kept" if self._keeps_prefixes else "cold cache")
            return

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._lock:
            self._closing = True
            engines = [r.engine for r in self.replicas if r.engine is not None]
            restarts = list(self._restarts)
        with ThreadPoolExecutor(max(len(engines), 1)) as pool:
            list(pool.map(lambda e: e.shutdown(timeout), engines))
        for t in restarts:  # a replica starting again stops once started: no process (nor its shm directory) outlives this
            t.join(timeout)
        self.dead = self.dead or "shut down"

    def __enter__(self) -> DataParallelEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _role(i: int, prefill: int) -> str:
    """Replica i's role: the first `prefill` replicas prefill, the rest decode (0: all do both)."""
    return BOTH if not prefill else PREFILL if i < prefill else DECODE


@dataclass
class _Prefill:
    replica: int  # -1 until chosen
    rid: str  # the prefill request's
    aborted: bool = False


def _ended(req: Req, reason: str, why: str | None = None) -> Delta:
    out = Output(req.rid, "", [], reason, req.prompt_len, 0, 0, error=why)
    return Delta(req.rid, "", finished=True, output=out)


def _split_memory(cfg: EngineConfig, overrides: dict[str, Any], n: int) -> dict[str, Any]:
    """Replicas sharing one memory: --kv-mem-fraction is the whole server's share, each of n
    replicas takes 1/n of it (a token or MiB budget is per replica, as given)."""
    c = cfg.cache
    if c.kv_cache_tokens is None and c.kv_cache_memory_mb is None:
        return {**overrides, "kv_mem_fraction": c.kv_mem_fraction / n}
    return dict(overrides)


def _replica_overrides(cfg: EngineConfig, overrides: dict[str, Any], i: int, n: int) -> dict[str, Any]:
    """Replica i of n: with a disk tier, a directory of its own under --kv-disk-dir (so a replica
    restarted there finds its own blocks) and 1/n of --kv-disk-gb; with KV events, its rank
    (each batch carries it; engine/kv_events.offset_endpoint moves its sockets by it)."""
    c, out = cfg.cache, dict(overrides)
    if c.kv_disk_dir is not None:
        out.update(kv_disk_dir=os.path.join(c.kv_disk_dir, f"replica-{i}"), kv_disk_gb=c.kv_disk_gb / n)
    if c.kv_events_config is not None:
        events = json.loads(c.kv_events_config)
        out["kv_events_config"] = json.dumps({**events, "data_parallel_rank": i})
    return out


def _replica_env(i: int, n: int, gpus: list[str]) -> dict[str, str]:
    """Replica i of n: its own GPU where there are n (CUDA_VISIBLE_DEVICES, as SGLang and vLLM
    place data-parallel ranks), else a 1/n share of the CPU's threads."""
    if gpus:
        return {"CUDA_VISIBLE_DEVICES": gpus[i]}
    if "OMP_NUM_THREADS" not in os.environ and n > 1:
        return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}
    return {}


def _visible_gpus() -> list[str]:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d for d in listed.split(",") if d.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:
        return []
