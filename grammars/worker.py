"""The compile worker: the child-process side of grammars.pool.

A worker builds its backend once from a picklable factory, then compiles one job at a time:
the parent sends `(job_id, spec)` (pickled: the parent is trusted), the worker answers with
one framed message (a JSON header, a NUL, then raw bytes: never a pickle, so the parent
reads nothing a hostile grammar could turn into code). Messages from a worker:

    {"type": "ready"}                                       backend built, waiting for jobs
    {"type": "failed", "message": ...}                      the factory raised; the worker exits
    {"type": "ok", "job": id, "backend": name} + payload    `Compiled.serialize()` of the result
    {"type": "error", "job": id, "message": ..., "param": ...}   the compile raised

The fallback chain runs inside the one job, so all backends share its deadline and memory
cap. A worker exits when its jobs pipe closes, when it receives None, or (from a watcher
thread) the moment its parent dies: it holds the read end of a pipe whose only writer is
the parent, so no worker outlives the serving process even while stuck in C code.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any

from grammars import errors
from grammars.spec import GrammarError


def encode(header: dict[str, Any], payload: bytes = b"") -> bytes:
    return json.dumps(header).encode() + b"\0" + payload


def decode(message: bytes) -> tuple[dict[str, Any], bytes]:
    """Raises ValueError on a malformed message."""
    head, sep, payload = message.partition(b"\0")
    header = json.loads(head)
    if not sep or not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise ValueError("malformed message from a grammar compile worker")
    return header, payload


def serve(factory: Any, jobs: Connection, alive: Connection, memory_mb: int) -> None:
    """The worker's main: build the backend, then compile jobs until told to stop. A compiled
    grammar larger than `memory_mb` fails like a compile over the memory cap (the parent
    would hold it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops the workers
    _exit_with_parent(alive)
    try:
        backend = factory()
    except BaseException as e:
        jobs.send_bytes(encode({"type": "failed", "message": f"{type(e).__name__}: {e}"}))
        return
    jobs.send_bytes(encode({"type": "ready"}))
    while True:
        try:
            msg = jobs.recv()
        except EOFError:
            return
        if msg is None:
            return
        job_id, spec = msg
        jobs.send_bytes(_compile(backend, job_id, spec, memory_mb))


def _compile(backend: Any, job_id: int, spec: Any, memory_mb: int) -> bytes:
    try:
        compiled = backend.compile(spec)
        payload = compiled.serialize()
        if len(payload) > memory_mb << 20:
            raise errors.memory(spec, memory_mb)
    except GrammarError as e:
        return encode({"type": "error", "job": job_id, "message": e.message, "field": e.field})
    except BaseException as e:  # any other failure fails this grammar, not the worker
        return encode({"type": "error", "job": job_id, "message": repr(e), "field": spec.kind})
    return encode({"type": "ok", "job": job_id, "backend": compiled.backend}, payload)


def _exit_with_parent(alive: Connection) -> None:
    def watch() -> None:
        try:
            alive.recv_bytes()  # the parent never writes: this returns only at EOF
        except (EOFError, OSError):
            pass
        os._exit(0)

    threading.Thread(target=watch, name="radixserve-grammar-parent-watch", daemon=True).start()
