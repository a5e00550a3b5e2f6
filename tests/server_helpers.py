"""Start a real `radixserve serve` process on a free port and wait until it is ready."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scaled(seconds: float) -> float:
    """A test's deadline times RADIXSERVE_TEST_TIMEOUT_SCALE (default 1): a loaded or slow
    machine raises it instead of failing on a readiness wait."""
    return seconds * float(os.environ.get("RADIXSERVE_TEST_TIMEOUT_SCALE", "1"))


MAX_BODY = 65536  # the small --max-request-bytes of the shared test server
USER = [{"role": "user", "content": "Agents call tools and read JSON."}]


class ServerProcess:
    def __init__(self, model: Path, *args: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--model", str(model), "--port", str(self.port), *args]
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env={**os.environ})
        deadline = time.monotonic() + scaled(120)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become ready:\n{log.read_text()}")

    def get(self, path: str, key: str | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(req, timeout=scaled(60)) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def post(self, path: str, body: bytes | dict, key: str | None = None) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=scaled(120)) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def wait_idle(self, key: str | None = None) -> dict:
        """Once nothing runs or holds KV (or after 30 s scaled: the caller's checks then fail): the
        server's KV accounting (from /server_info)."""
        deadline = time.monotonic() + scaled(30)
        while True:
            _, info = self.get("/server_info", key)
            kv = info["kv"]
            idle = (kv["running"] == 0 and kv["waiting"] == 0 and kv["kv_in_use_slots"] == 0 and info["queued"] == 0
                    and info.get("in_flight", 0) == 0 and not (info.get("history") or {}).get("running"))
            if idle or time.monotonic() > deadline:
                return kv
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(scaled(timeout))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


async def final_outputs(engine, reqs) -> list:
    """Each request's final Output, the requests submitted together (to any EngineClient: an
    in-process engine, an engine process, data-parallel replicas)."""
    import asyncio

    async def one(req):
        out = None
        async for d in engine.submit(req):
            out = d.output if d.finished else out
        return out

    return await asyncio.gather(*(one(r) for r in reqs))


def fake_state(**kw: object) -> object:
    """A ServerState stand-in for a route's reply functions, serving the model "m"."""
    from types import SimpleNamespace

    return SimpleNamespace(model_name="m", answered_by=lambda model: "m", **kw)
