"""The walk of one `/v1/responses` request through radixserve's modules (issue 31's measure).

Every first entry into a function under radixserve/ (not a coroutine's resumption), in order,
folded into stays (consecutive entries in one module), rooms (distinct modules) and returns
(stays in a module already left). The server runs in this process on an in-process engine; one
warm-up request goes first.

    .venv/bin/python scripts/request_walk.py [MODEL|-] [whole|stream]    # default: SmolLM2, whole
"""

from __future__ import annotations

import asyncio
import dis
import os
import sys
from types import CodeType, FrameType
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from radixserve import Engine
from radixserve.config import ServerConfig
from radixserve.server.app import build_app
from radixserve.server.auth import Auth
from radixserve.server.state import ServerState

VERBOSE = bool(os.environ.get("WALK_VERBOSE"))
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "radixserve") + os.sep


def caller(frame: FrameType) -> str | None:
    """The radixserve module of the nearest radixserve frame that called (or awaits) this one."""
    f = frame.f_back
    while f is not None and not f.f_code.co_filename.startswith(ROOT):
        f = f.f_back
    return None if f is None else f.f_code.co_filename[len(ROOT):]


def doors(seq: list[tuple[str, str | None]]) -> tuple[list[str], int]:
    """(rooms in the order entered, returns) counting only calls from one module into another:
    a module's calls to its own functions stay in the room, a callee's return to its caller is
    not an entry, and calls into the room last entered fold into that stay; a return is an
    entry into a module entered before."""
    entered: list[str] = []
    returns = 0
    for m, by in seq:
        if m == by or (entered and entered[-1] == m):
            continue
        returns += m in entered
        entered.append(m)
    return entered, returns


def fold(seq: list[str]) -> tuple[list[str], int]:
    """(stays, returns) of a sequence of module names."""
    stays: list[str] = []
    for m in seq:
        if not stays or stays[-1] != m:
            stays.append(m)
    left: set[str] = set()
    returns = 0
    for prev, m in zip([None, *stays], stays):
        if prev is not None:
            left.add(prev)
        returns += m in left
    return stays, returns


async def walk(engine: Engine, stream: bool) -> list[tuple[str, str | None]]:
    state = ServerState(engine, ServerConfig(), Auth(), "walk")
    await state.build_token_table()
    server = TestServer(build_app(state))
    await server.start_server()
    body = {"model": "", "input": "Say hello.", "max_output_tokens": 8, "stream": stream}
    starts: dict[CodeType, int] = {}
    seq: list[tuple[str, str | None]] = []

    def first_entry(frame: FrameType) -> bool:  # the frame stands at its RESUME: entered, not resumed
        code = frame.f_code
        if code not in starts:
            starts[code] = next(x.offset for x in dis.get_instructions(code) if x.opname == "RESUME")
        return frame.f_lasti == starts[code]

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(ROOT) and first_entry(frame):
            seq.append((name[len(ROOT):], caller(frame)))
            if VERBOSE:
                print(f"{caller(frame)} -> {name[len(ROOT):]}:{frame.f_code.co_qualname}")

    try:
        async with aiohttp.ClientSession() as session:
            for timed in (False, True):
                sys.setprofile(profile if timed else None)
                async with session.post(server.make_url("/v1/responses"), json=body) as r:
                    await r.read()
                sys.setprofile(None)
    finally:
        await server.close()
        state.executor.shutdown(wait=False)
    return seq


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "-" else None
    stream = len(sys.argv) > 2 and sys.argv[2] == "stream"
    with Engine(model, kv_cache_tokens=4096) as engine:
        seq = asyncio.run(walk(engine, stream))
    server = [m for m, _ in seq if m.startswith("server/")]
    for label, names in (("radixserve/", [m for m, _ in seq]), ("radixserve/server/", server)):
        stays, returns = fold(names)
        print(f"every entry, {label}: {len(stays)} stays in {len(set(stays))} rooms, {returns} returns")
    print("  " + " -> ".join(fold(server)[0]))
    entered, returns = doors([(m, by) for m, by in seq if m.startswith("server/")])
    print(f"calls between server modules: {len(entered)} entries into {len(set(entered))} rooms, {returns} returns")
    print("  " + " -> ".join(entered))


if __name__ == "__main__":
    main()
