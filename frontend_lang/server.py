"""Runtime: a local `radixserve serve` started from Python (SGLang's `sgl.Runtime`), for
programs that bring their own server: `sgl.set_default_backend(sgl.Runtime(model_path=...))`."""

from __future__ import annotations

import atexit
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

from frontend_lang.backend import RuntimeEndpoint, sse_objects

# SGLang ServerArgs names that mean a radixserve option under another name.
_RENAMED = {"model_path": "model"}
# SGLang ServerArgs that radixserve has no equivalent for, and why (refused, not ignored).
_REFUSED = {
    "mem_fraction_static": "radixserve sizes its KV cache with kv_cache_tokens= or kv_mem_fraction= (of free memory)",
    "tokenizer_path": "radixserve reads the tokenizer from the model folder",
}
_SINGLE = ("tp_size", "dp_size", "pp_size", "ep_size")  # radixserve runs on one device: only 1 is accepted
_NO_EFFECT = ("trust_remote_code",)  # radixserve runs no model code from the model folder


def _free_port(start: int) -> int:
    for port in range(start, 40000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"Runtime: no free port in [{start}, 40000)")


def server_command(kwargs: dict[str, Any], log_level: str) -> list[str]:
    """`radixserve serve` flags for keyword arguments (`kv_cache_tokens=4096` -> `--kv-cache-tokens 4096`,
    `disable_radix_cache=True` -> `--disable-radix-cache`); `radixserve serve` itself refuses a
    name it does not know."""
    argv = [sys.executable, "-m", "radixserve.cli", "--log-level", log_level, "serve"]
    for key, value in kwargs.items():
        if key in _REFUSED:
            raise TypeError(f"Runtime: {key} is not supported: {_REFUSED[key]}")
        if key in _SINGLE:
            if value not in (None, 1):
                raise TypeError(f"Runtime: {key}={value}: radixserve serves a model on one device")
            continue
        if key in _NO_EFFECT or value is None or value is False:
            continue
        flag = "--" + _RENAMED.get(key, key).replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


class Runtime:
    """Start `radixserve serve` in a subprocess and wait until it answers. `endpoint` is its
    RuntimeEndpoint; a Runtime passed as a backend stands for it. Keyword arguments are
    radixserve serve options (model_path= for --model, kv_cache_tokens=, chunked_prefill_size=, ...);
    the server is shut down at exit, or by shutdown()."""

    def __init__(self, log_level: str = "error", launch_timeout: float = 300.0, **kwargs: Any) -> None:
        host = kwargs.setdefault("host", "127.0.0.1")
        port = kwargs.pop("port", None) or _free_port(30000)
        kwargs["port"] = port
        self.url = f"http://{host}:{port}"
        self.generate_url = self.url + "/generate"
        self.model_path = kwargs.get("model_path")
        self.api_key = kwargs.get("api_key")
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(server_command(kwargs, log_level))
        self.pid = self._proc.pid
        atexit.register(self.shutdown)
        deadline = time.monotonic() + launch_timeout
        while True:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise RuntimeError(f"Runtime: radixserve serve exited with {code} while starting (its log, above, says "
                                   "why: e.g. an option it does not know)")
            if self._healthy():
                break
            if time.monotonic() > deadline:
                self.shutdown()
                raise TimeoutError(f"Runtime: the server did not answer within {launch_timeout:g} s")
            time.sleep(0.25)
        self.endpoint = RuntimeEndpoint(self.url, api_key=self.api_key)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def shutdown(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def cache_prefix(self, prefix: str) -> None:
        self.endpoint.cache_prefix(prefix)

    def generate(self, prompt: str | list[str], sampling_params: dict[str, Any] | None = None,
                 return_logprob: bool | list[bool] = False, logprob_start_len: int | None = None,
                 top_logprobs_num: int | None = None) -> str:
        """POST /generate; the answer as JSON text (as SGLang's Runtime.generate returns it)."""
        body: dict[str, Any] = {"text": prompt, "sampling_params": sampling_params or {}, "return_logprob": return_logprob}
        if logprob_start_len is not None:
            body["logprob_start_len"] = logprob_start_len
        if top_logprobs_num is not None:
            body["top_logprobs_num"] = top_logprobs_num
        req = urllib.request.Request(self.generate_url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})})
        try:
            with urllib.request.urlopen(req) as r:
                return r.read().decode()
        except urllib.error.HTTPError as e:
            return e.read().decode()

    async def async_generate(self, prompt: str, sampling_params: dict[str, Any] | None = None) -> AsyncIterator[str]:
        """Stream one prompt's new text (on the caller's event loop)."""
        import aiohttp

        body = {"text": prompt, "sampling_params": sampling_params or {}, "stream": True}
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with aiohttp.ClientSession(headers=headers) as session, session.post(self.generate_url, json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"async_generate: the server answered {r.status}: {await r.text()}")
            pos = 0
            async for chunk in sse_objects(r.content, "async_generate: the stream"):
                text = chunk["text"]  # cumulative
                if text[pos:]:
                    yield text[pos:]
                pos = len(text)

    add_request = async_generate

    async def get_server_info(self) -> dict[str, Any]:
        import asyncio

        from frontend_lang.loop import submit

        return await asyncio.wrap_future(submit(self.endpoint.server_info()))

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
