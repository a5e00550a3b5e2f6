"""The engine core in its own process, as SGLang's scheduler and vLLM v1's engine core run.

    server process                                  engine process
    HTTP, auth, tokenizer, chat templates    <-->   scheduler, model loop (its main thread),
    EngineProcess (an EngineClient)       socket    KV cache, sampler, grammar compile workers

The model loop never shares a GIL with the event loop, and it runs on its process's main
thread: torch's OpenMP GEMMs run about 1.7x slower from a second thread of a process whose
main thread made its own OpenMP team (measured on SmolLM2, 2 cores: 55 vs 32 ms a decode step).

Messages are radixserve.engine.protocol's structs, msgpack-framed on a socket pair. Deltas of
one engine step travel as one message, with the stats of that step (what `snapshot()` returns).
The engine process exits when the server closes its end (shutdown, or the server died) and
kills its own compile workers; a request that fails inside it fails alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import aclosing
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from grammars import errors as grammar_errors
from radixserve.config import EngineConfig
from radixserve.engine.front import DeltaStream, RequestFront
from radixserve.engine.outputs import Delta, Output
from radixserve.engine.protocol import (
    Abort,
    AddRequest,
    Call,
    CheckIntegrity,
    Deltas,
    EngineDied,
    EngineInfo,
    EngineStats,
    ErrorInfo,
    FlushCache,
    FromEngine,
    GetStats,
    LoRACall,
    MatchLen,
    Reply,
    Shutdown,
    ToEngine,
    decoder,
    encoder,
)
from radixserve.request import InvalidParam, Req, SamplingParams

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading (and, the first time, converting) a model
CALL_TIMEOUT_S = 120.0


class EngineProcess(RequestFront):
    """`EngineProcess(model=None, **overrides)`: the same arguments as `Engine`; starts the
    engine core in a child process and waits until it is ready. Requests are built here
    (tokenized and validated: the same InvalidParam as in-process)."""

    def __init__(self, model: str | None = None, *, env: dict[str, str] | None = None, tokenizer: Any = None,
                 **overrides: Any) -> None:
        """`env`: variables set for the engine process only (a data-parallel replica's device,
        threads); `tokenizer`: the model's, already loaded (replicas share one)."""
        from radixserve.models.files import gguf_file, load_tokenizer, tokenizer_dir, vocab_texts_soon, weight_files

        self.config = EngineConfig.build(model, **overrides)  # refuses unknown names here, before a process starts
        # a bad path is a clean error here, before a process starts; no torch in this process: the
        # engine starts at once. A GGUF's config and tokenizer are read into a cached folder (once)
        # below, while the engine process builds the model from the file's metadata
        folder = None if gguf_file(model) is not None else tokenizer_dir(model)
        ours, theirs = socket.socketpair()
        prefetch = [str(f) for f in weight_files(model)] if os.environ.get("RADIXSERVE_PREFETCH", "1") != "0" else []
        cmd = [sys.executable, "-m", "radixserve.engine.process", str(theirs.fileno()),
               json.dumps({"model": model, "overrides": overrides, "parent": os.getpid(), "prefetch": prefetch})]
        self.proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], env={**os.environ, **env} if env else None)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._enc = encoder()
        self._dec = decoder(FromEngine)
        try:
            self.vocab_texts: Future[list[str]] | None = None  # a shared tokenizer's: its owner's
            if tokenizer is None:  # while the engine process loads the model
                tokenizer = load_tokenizer(tokenizer_dir(model) if folder is None else folder, save_fast=True)
                self.vocab_texts = vocab_texts_soon(tokenizer)  # the server's logprob table, meanwhile too
            self.tokenizer = tokenizer
            info = self._wait_ready()
        except BaseException:
            self._kill()
            raise
        self.model_name, self.model_path = info.model_name, info.model_path
        self.context_len, self.vocab_size, self.model_vocab_size = info.context_len, info.vocab_size, info.model_vocab_size
        self.eos_ids, self.num_slots = set(info.eos_ids), info.num_slots
        self.dtype, self.device, self.pid = info.dtype, info.device, info.pid
        self.quantization, self.weight_bytes, self.step_weight_bytes = info.quantization, info.weight_bytes, info.step_weight_bytes
        self.load_seconds, self.load_peak_rss, self.cpu_kernels = info.load_seconds, info.load_peak_rss, info.cpu_kernels
        self.activations, self.experts = info.activations, info.experts
        self.kv_location = info.kv_location
        self.default_max_new_tokens = self.config.default_max_new_tokens
        self._snapshot = EngineStats(kv_total_slots=info.num_slots, kv_free_slots=info.num_slots, kv_dtype=info.kv_dtype,
                                     kv_bytes_per_token=info.kv_bytes_per_token)
        self._streams: dict[str, _Route] = {}  # rid -> its request's route, until the engine's final delta
        self._calls: dict[int, Future[Reply]] = {}
        self._ahead: dict[str, tuple[DeltaStream, _Route]] = {}  # constrained requests sent ahead, not yet submitted
        self._waiting: dict[str, int] = {}  # rids requests wait for (_route): how many wait
        self._aborted: set[str] = set()  # ... and those aborted meanwhile
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # streams and calls
        self.dead: str | None = None  # why the engine process is gone
        self.on_death: Callable[[str], None] | None = None  # called (on the reader thread) if it dies unasked
        self._closing = False
        self._reader = threading.Thread(target=self._read, name="radixserve-engine-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> EngineInfo:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._conn.poll(0.2):
                try:
                    msg = self._dec.decode(self._conn.recv_bytes())
                except EOFError:
                    break
                if isinstance(msg, EngineInfo):
                    return msg
                if isinstance(msg, Reply) and msg.error is not None:  # it could not start: say why, as in-process
                    self._kill()
                    if msg.error.kind == "invalid_param":
                        raise ValueError(msg.error.message)
                    raise RuntimeError(f"the engine process did not start: {msg.error.message}")
            elif self.proc.poll() is not None:
                break
        self._kill()
        raise RuntimeError(f"the engine process did not start (exit code {self.proc.poll()}); see its log above")

    # -- requests ---------------------------------------------------------------------------
    async def prepare_grammar(self, req: Req) -> None:
        """Send a constrained request ahead: the engine compiles (or fetches) its grammar in its
        compile workers and answers before the request starts, or raises GrammarError (a
        ValueError naming the field) and never runs it. Its submit then reads the stream begun
        here, so the request crosses the socket once."""
        if req.grammar_spec is None:
            return
        stream = DeltaStream(lambda: self._abort_route(route))
        route = await self._route(req, stream)
        with self._lock:
            self._ahead[req.rid] = stream, route
        call = self._call(lambda cid: AddRequest.of(req, cid))
        call.add_done_callback(lambda f: None if _accepted(f) else self._drop(req.rid, route))  # refused: no delta comes
        if route.aborted:
            self._abort_route(route)
        answer = asyncio.wrap_future(call)
        answer.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, even with nobody awaiting it
        try:
            reply = await asyncio.shield(answer)  # a client gone mid-call leaves the answer to the callback above
            if reply.error is not None:
                raise reply.error.exception()
        except BaseException:
            self._forget(req.rid)
            raise

    async def submit(self, prompt: Req, params: SamplingParams | None = None, *,
                     max_backlog: int | None = None) -> AsyncGenerator[Delta, None]:
        """Stream one request's deltas (as Engine.submit: leaving early aborts it; a consumer
        that lets more than max_backlog deltas pile up has the request aborted)."""
        req = prompt if isinstance(prompt, Req) else self.make_req(prompt, params)
        with self._lock:
            ahead = self._ahead.pop(req.rid, None)  # sent by prepare_grammar
        if ahead is None:
            stream = DeltaStream(lambda: self._abort_route(route))
            route = await self._route(req, stream)
            self._send(AddRequest.of(req))
            if route.aborted:
                self._abort_route(route)
        else:  # its deltas (even the final one) are in the stream already
            stream, route = ahead
        stream.max_backlog = max_backlog
        try:
            async with aclosing(stream.deltas()) as deltas:  # closed (so aborting) as soon as this is
                async for d in deltas:
                    yield d
        finally:
            route.sink = None  # its later deltas go nowhere; the route stays until the engine's final one

    async def _route(self, req: Req, stream: DeltaStream) -> _Route:
        """Route the rid's deltas to `stream`, once the engine has let go of any earlier request
        under the same rid (its final delta came): deltas travel by rid, so a rid reused right
        after its client left would otherwise get the old request's last deltas, or be refused
        by the engine as already in flight. An abort of the rid meanwhile is the new request's
        (`aborted`: its caller aborts it once sent)."""
        rid, waited = req.rid, False
        try:
            while True:
                with self._lock:
                    if self.dead is not None:
                        raise EngineDied(f"the engine process is gone: {self.dead}")
                    held = self._streams.get(rid)
                    if held is None:
                        route = self._streams[rid] = _Route(rid, stream.sink, req.prompt_len)
                        route.aborted = waited and rid in self._aborted
                        return route
                    if not waited:
                        self._waiting[rid] = self._waiting.get(rid, 0) + 1
                        waited = True
                await asyncio.shield(asyncio.wrap_future(held.gone))  # shielded: other waiters share the future
        finally:
            if waited:
                with self._lock:
                    self._waiting[rid] -= 1
                    if not self._waiting[rid]:
                        del self._waiting[rid]
                        self._aborted.discard(rid)

    def abort(self, rid: str) -> None:
        self._forget(rid)  # sent ahead but never submitted (its client left): nobody will read it
        with self._lock:
            if rid in self._waiting:  # (also) a request waiting for the rid: it is aborted once sent
                self._aborted.add(rid)
        self._send(Abort(rid))

    def _abort_route(self, route: _Route) -> None:
        """A stream's own abort: only while the engine still runs its request (never a later one
        under the same rid)."""
        with self._lock:
            current = self._streams.get(route.rid) is route
        if current:
            self._send(Abort(route.rid))

    def _forget(self, rid: str) -> None:
        with self._lock:
            if (ahead := self._ahead.pop(rid, None)) is not None:
                ahead[1].sink = None

    def _drop(self, rid: str, route: _Route) -> None:
        with self._lock:
            if self._streams.get(rid) is route:
                del self._streams[rid]
        route.release()

    # -- calls --------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        reply = self._wait(self._call(GetStats))
        assert reply.stats is not None
        return reply.stats

    def snapshot(self) -> EngineStats:
        return self._snapshot

    def replica_snapshots(self) -> list[EngineStats]:
        return [self._snapshot]

    def flush_cache(self, keep_disk: bool = False) -> int:
        return int(self._wait(self._call(lambda call_id: FlushCache(call_id, keep_disk))).value or 0)

    def check_integrity(self) -> None:
        self._wait(self._call(CheckIntegrity))

    def load_lora(self, name: str, path: str) -> dict[str, Any]:
        return dict(self._wait(self._call(lambda call_id: LoRACall(call_id, "load", name, path))).data)

    def unload_lora(self, name: str) -> None:
        self._wait(self._call(lambda call_id: LoRACall(call_id, "unload", name)))

    def loras(self) -> list[dict[str, Any]]:
        return list(self._wait(self._call(lambda call_id: LoRACall(call_id, "list"))).data)

    async def match_len(self, req: Req) -> int:
        """How much of the request's prompt the engine's prefix cache holds now, in tokens."""
        reply = await asyncio.wrap_future(self._call(lambda cid: MatchLen(
            cid, req.token_ids[: req.prompt_len], req.tenant, req.cache_salt, req.public_prefix_len)))
        if reply.error is not None:
            raise reply.error.exception()
        return int(reply.value or 0)

    def _call(self, make: Callable[[int], Call]) -> Future[Reply]:
        """Send the call `make` builds with a fresh call id; its Reply completes the future."""
        fut: Future[Reply] = Future()
        with self._lock:
            if self.dead is not None:
                fut.set_exception(EngineDied(f"the engine process is gone: {self.dead}"))
                return fut
            call_id = next(self._ids)
            self._calls[call_id] = fut
        self._send(make(call_id))
        return fut

    @staticmethod
    def _wait(fut: Future[Reply]) -> Reply:
        reply = fut.result(CALL_TIMEOUT_S)
        if reply.error is not None:
            raise reply.error.exception()
        return reply

    def _send(self, msg: ToEngine) -> None:
        data = self._enc.encode(msg)
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except OSError:  # gone: the reader reports it
            pass

    # -- the reader thread ----------------------------------------------------------------------
    def _read(self) -> None:
        why = "it closed its end"
        try:
            while True:
                msg = self._dec.decode(self._conn.recv_bytes())
                try:
                    self._dispatch(msg)
                except Exception:  # a bug on our side of one message: the engine and its other requests are fine
                    log.exception("delivering the engine's %s failed", type(msg).__name__)
        except (EOFError, OSError) as e:
            why = f"its connection failed ({e!r})" if isinstance(e, OSError) else why
        except msgspec.DecodeError as e:  # a message we cannot read: nothing after it can be trusted
            why = f"an unreadable message ({e!r})"
            log.exception("the engine process sent an unreadable message")
        code = self.proc.poll()
        self._fail_all("shut down" if self._closing else why if code is None else f"it exited with code {code}")

    def _dispatch(self, msg: FromEngine) -> None:
        if isinstance(msg, Deltas):
            self._snapshot = msg.stats
            routed = []
            with self._lock:
                for d in msg.items:
                    if (route := self._streams.get(d.rid)) is not None:
                        routed.append((route, d))
                        if d.finished:  # the engine let go of the request: its rid may be used again
                            del self._streams[d.rid]
            for route, d in routed:
                if (sink := route.sink) is not None:
                    _deliver(sink, d)
                if d.finished:
                    route.release()
        elif isinstance(msg, Reply):
            with self._lock:
                fut = self._calls.pop(msg.call_id, None)
            if fut is not None:
                _resolve(fut, msg)

    def _fail_all(self, why: str) -> None:
        with self._lock:
            self.dead = why
            streams, self._streams = self._streams, {}
            calls, self._calls = self._calls, {}
            self._ahead.clear()
        if why != "shut down":
            log.error("the engine process is gone: %s", why)
            if self.on_death is not None:
                self.on_death(why)
        for rid, route in streams.items():
            out = Output(rid, "", [], "error", route.prompt_len, 0, 0, error=f"the engine process is gone: {why}")
            if (sink := route.sink) is not None:
                _deliver(sink, Delta(rid, "", finished=True, output=out))
            route.release()
        for fut in calls.values():
            _resolve(fut, EngineDied(f"the engine process is gone: {why}"))

    # -- lifecycle ------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what runs, stop the engine process (and its compile workers) and wait for it."""
        self._closing = True
        if self.proc.poll() is None:
            self._send(Shutdown())
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("the engine process did not stop in %.0f s; killing it", timeout)
                self._kill()
        with self._lock:
            self.dead = self.dead or "shut down"
        self._conn.close()
        self._reader.join(5)

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class _Route:
    """Where a request's deltas go, from its AddRequest until the engine's final delta for it
    (`gone` then completes): `sink` is None once its reader left."""

    def __init__(self, rid: str, sink: Callable[[Delta], None], prompt_len: int) -> None:
        self.rid, self.prompt_len = rid, prompt_len
        self.sink: Callable[[Delta], None] | None = sink
        self.aborted = False  # aborted while it waited for its rid: abort it once sent
        self.gone: Future[None] = Future()

    def release(self) -> None:
        with contextlib.suppress(InvalidStateError):  # released already (its final delta, a refusal, a death)
            self.gone.set_result(None)


def _accepted(call: Future[Reply]) -> bool:
    """A call answered without an error."""
    return not call.cancelled() and call.exception() is None and call.result().error is None


def _deliver(sink: Callable[[Delta], None], d: Delta) -> None:
    try:
        sink(d)
    except RuntimeError:  # its event loop is closed: nobody waits for it
        pass


def _resolve(fut: Future[Reply], outcome: Reply | BaseException) -> None:
    """Complete a call's future from the reader thread. NOTE: its caller may have given up first
    (a client that hung up cancels the awaiting task, and asyncio.wrap_future cancels this
    future): a reply nobody waits for is dropped, never an error on the reader thread, which
    would take the whole engine process for gone."""
    if not fut.set_running_or_notify_cancel():  # cancelled; from here on it cannot be
        return
    if isinstance(outcome, BaseException):
        fut.set_exception(outcome)
    else:
        fut.set_result(outcome)


# -- the engine process ---------------------------------------------------------------------------
class _Core:
    """The engine process's side: commands in on a reader thread, the loop on the main thread."""

    def __init__(self, conn: Connection, model: str | None, overrides: dict[str, Any]) -> None:
        from radixserve.engine.engine import Engine

        self.conn = conn
        self.enc = encoder()
        self.send_lock = threading.Lock()
        self.engine = e = Engine(model, loop_thread=False, own_process=True, **overrides)
        self.outbox: list[Delta] = []  # filled by the sinks on the loop, sent once per step or command
        self.compiling: dict[str, bool] = {}  # rid -> aborted, for requests waiting on their grammar
        self.compiling_lock = threading.Lock()
        self.last_stats: EngineStats | None = None
        e.on_change = self._flush  # on the loop, after each step or command
        self.send(EngineInfo(e.model_name, str(e.model_path), e.context_len, e.vocab_size, e.model_vocab_size,
                             sorted(e.eos_ids), e.num_slots, str(e.dtype).removeprefix("torch."), str(e.device), os.getpid(),
                             e.quantization, e.weight_bytes,
                             str(e.kv_dtype).removeprefix("torch."), e.pool.bytes_per_token, e.load_seconds,
                             e.load_peak_rss, e.cpu_kernels, e.kv_location, e.activations, e.experts,
                             e.step_weight_bytes))
        self._flush()  # the first stats, before any step

    def send(self, msg: Any) -> None:
        data = self.enc.encode(msg)
        with self.send_lock:
            if not self.conn.closed:  # closed: the process is exiting, and a late reply (a grammar wait's) has nobody to read it
                self.conn.send_bytes(data)

    def _flush(self) -> None:
        stats = self.engine.snapshot()
        if not self.outbox and stats == self.last_stats:
            return
        items, self.outbox = self.outbox, []
        self.last_stats = stats
        self.send(Deltas(items, stats))

    def read(self) -> None:
        """The reader thread: until the server closes its end or says shutdown."""
        from radixserve_kernels.threads import helper_thread

        helper_thread()  # (a LoRA adapter loads here: its torch ops must not start a second OpenMP team)
        dec = decoder(ToEngine)
        try:
            while True:
                msg = dec.decode(self.conn.recv_bytes())
                if isinstance(msg, Shutdown):
                    break
                try:
                    self.handle(msg)
                except Exception:
                    log.exception("handling %s failed", type(msg).__name__)
        except (EOFError, OSError):
            pass  # the server is gone
        self.engine.stop_loop()

    def handle(self, msg: ToEngine) -> None:
        e = self.engine
        if isinstance(msg, AddRequest):
            self.add(msg)
        elif isinstance(msg, Abort):
            with self.compiling_lock:
                if msg.rid in self.compiling:  # not in the loop yet: start() drops it
                    self.compiling[msg.rid] = True
            e.abort(msg.rid)
        elif not isinstance(msg, Shutdown):
            try:
                if isinstance(msg, GetStats):
                    reply = Reply(msg.call_id, stats=e.stats())
                elif isinstance(msg, FlushCache):
                    reply = Reply(msg.call_id, value=e.flush_cache(msg.keep_disk))
                elif isinstance(msg, LoRACall):
                    if msg.op == "load":
                        reply = Reply(msg.call_id, data=e.load_lora(msg.name, msg.path))
                    elif msg.op == "unload":
                        e.unload_lora(msg.name)
                        reply = Reply(msg.call_id)
                    else:
                        reply = Reply(msg.call_id, data=e.loras())
                elif isinstance(msg, MatchLen):
                    probe = Req(list(msg.input_ids), SamplingParams(), tenant=msg.tenant, cache_salt=msg.cache_salt,
                                public_prefix_len=msg.public_prefix_len)
                    reply = Reply(msg.call_id, value=e.match_len(probe))
                else:
                    e.check_integrity()
                    reply = Reply(msg.call_id)
            except Exception as err:
                reply = Reply(msg.call_id, error=ErrorInfo.of(err))
            self.send(reply)

    def add(self, msg: AddRequest) -> None:
        """Build the Req here and run it once its grammar (if any) is compiled, waiting on a
        thread of its own, never on the reader. A request sent ahead (call_id) is answered first:
        with its grammar's error, and then not run; a plain one's error finishes its stream."""
        e = self.engine
        try:
            req = msg.build()
            entry = None if req.grammar_spec is None else e.grammars().submit(e.compile_spec(req.grammar_spec), req.tenant)
        except Exception as err:
            self._refuse(msg, err)
            return

        def sink(d: Delta) -> None:  # on the loop only
            self.outbox.append(d)

        def start() -> None:
            failed: Exception | None = None
            if entry is not None:
                try:
                    req.grammar = entry.result(e.grammars().max_wait_s).matcher()
                except FutureTimeout:
                    assert req.grammar_spec is not None
                    failed = grammar_errors.timeout(req.grammar_spec, e.config.grammar_compile_timeout)
                except Exception as err:
                    failed = err
            with self.compiling_lock:  # an Abort handled meanwhile (it takes this lock) reaches the loop after the Add
                if self.compiling.pop(req.rid, False) and failed is None:
                    failed = RuntimeError("aborted while its grammar compiled")
                if failed is None:
                    try:
                        e.add(req, sink)
                    except Exception as err:  # e.g. a KV hand-off this engine cannot make (ValueError)
                        failed = err
            if failed is not None:
                self._refuse(msg, failed)  # a refused request still ends: a Reply, or its final delta
            elif msg.call_id:
                self.send(Reply(msg.call_id))

        if entry is None or entry.done():
            start()
        else:
            with self.compiling_lock:
                self.compiling[req.rid] = False
            threading.Thread(target=start, name="radixserve-grammar-wait", daemon=True).start()

    def _refuse(self, msg: AddRequest, err: Exception) -> None:
        if msg.call_id:
            self.send(Reply(msg.call_id, error=ErrorInfo.of(err)))
        else:
            self._fail(msg.rid, msg, str(err), err.field if isinstance(err, InvalidParam) else None)

    def _fail(self, rid: str, msg: AddRequest, error: str, field: str | None = None) -> None:
        out = Output(rid, "", [], "error", len(msg.input_ids), 0, 0, error=error, error_field=field)
        self.send(Deltas([Delta(rid, "", finished=True, output=out)], self.engine.snapshot()))


def _child_main(fd: int, spec: str) -> None:
    logging.basicConfig(level=os.environ.get("RADIXSERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s engine %(levelname)s %(name)s: %(message)s")
    args = json.loads(spec)
    die_with_parent(args["parent"])
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <engine pid>` prints every thread's stack
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server handles ^C and tells us to stop
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    conn = Connection(fd)
    # the weights' files start coming off the disk while torch is imported (about a second): a cold start's cut
    from radixserve.models.files import prefetch

    threading.Thread(target=prefetch, args=(args.get("prefetch", []),), daemon=True).start()
    try:
        core = _Core(conn, args["model"], args["overrides"])
    except Exception as e:  # e.g. weights that do not load, a bad option: the server reports it and exits
        if isinstance(e, ValueError):
            log.error("the engine could not start: %s", e)
        else:
            log.exception("the engine could not start")
        conn.send_bytes(encoder().encode(Reply(0, error=ErrorInfo.of(e))))
        sys.exit(2)
    reader = threading.Thread(target=core.read, name="radixserve-engine-commands", daemon=True)
    reader.start()
    try:
        core.engine.run_loop()  # the main thread: see the module docstring
    finally:
        core.engine.shutdown()
        try:
            core._flush()
        except OSError:
            pass
        with core.send_lock:
            conn.close()


def die_with_parent(parent: int) -> None:
    """Exit as soon as the server process is gone (the socket's EOF covers a clean close).

    NOTE: not PR_SET_PDEATHSIG: that fires when the *thread* that spawned us exits, and data-
    parallel replicas are started and restarted from short-lived threads. Also what a Ray
    replica's server process runs (radixserve.ray.child)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="radixserve-parent-watch", daemon=True).start()


if __name__ == "__main__":
    _child_main(int(sys.argv[1]), sys.argv[2])
