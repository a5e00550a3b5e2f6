"""The frontend's one event loop, on a daemon thread of its own, and `submit` to run a coroutine
on it from any thread (programs run synchronously, their HTTP calls asynchronously here).
Endpoints with a live HTTP session register in `OPEN`; the sessions are closed at exit."""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

OPEN: set[Any] = set()  # endpoints with a live session (each has an async close()), closed at exit
_LOOP: dict[str, asyncio.AbstractEventLoop] = {}
_LOCK = threading.Lock()


def loop() -> asyncio.AbstractEventLoop:
    with _LOCK:
        if "loop" not in _LOOP:
            new = asyncio.new_event_loop()
            threading.Thread(target=new.run_forever, name="frontend-lang", daemon=True).start()
            _LOOP["loop"] = new
            atexit.register(_close_sessions)
        return _LOOP["loop"]


def submit(coro: Coroutine[Any, Any, Any]) -> Future[Any]:
    return asyncio.run_coroutine_threadsafe(coro, loop())


def _close_sessions() -> None:
    for ep in list(OPEN):
        try:
            submit(ep.close()).result(2)
        except Exception:
            pass
