"""The engine core in its own process: typed messages round-trip, requests give the same tokens
as in-process, a request that breaks the forward fails alone, and the engine process never
outlives its server (shut down, or killed)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from grammars.spec import GrammarError
from radixserve import Engine, SamplingParams
from radixserve.cache.prefix import salt_key
from radixserve.engine.outputs import Delta, Output
from radixserve.engine.process import EngineProcess, _Route
from radixserve.engine.protocol import (
    Abort,
    AddRequest,
    CheckIntegrity,
    Deltas,
    EngineClient,
    EngineInfo,
    EngineStats,
    ErrorInfo,
    FlushCache,
    FromEngine,
    GetStats,
    InvalidParam,
    Reply,
    Shutdown,
    ToEngine,
    decoder,
    encoder,
)
from radixserve.request import Retention, TokenLogprob
from tests.server_helpers import ServerProcess


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
        return f.read().split(") ")[1][0] != "Z"


def _wait_gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_every_message_round_trips_typed():
    params = SamplingParams(max_new_tokens=7, temperature=0.5, stop=["\n", "END"], stop_token_ids=[3], seed=11,
                            json_schema='{"type": "object"}', return_logprob=True, top_logprobs_num=2)
    lps = [TokenLogprob(5, -0.25, [(-0.25, 5), (-1.5, 9)]), TokenLogprob(1, None)]
    out = Output("r1", "hi", [5, 1], "stop", 3, 2, 1, matched_stop="END", logprobs=lps, error=None)
    stats = EngineStats(kv_total_slots=10, kv_free_slots=4, cache_hit_rate=0.5, finished=2, engine_rss_bytes=1 << 30)
    to_engine = [AddRequest("r1", [1, 2, 3], params, 7, priority=-2, tenant="t", cache_salt="s", public_prefix_len=2),
                 Abort("r1"), AddRequest("r2", [4], params, 7, tenant="t", call_id=4, retention=Retention(3600, 2)),
                 GetStats(5), FlushCache(6), CheckIntegrity(7), Shutdown()]
    from_engine = [EngineInfo("m", "/p", 128, 100, 104, [2], 4096, "bfloat16", "cpu", 123, "q4_1+q8_0", 1 << 20, "int8", 2176),
                   Deltas([Delta("r1", "h", [5], lps[:1], cached_tokens=1), Delta("r1", "i", [1], [], True, out, 1)], stats),
                   Reply(4, stats=stats), Reply(5, value=17), Reply(6, error=ErrorInfo("invalid_param", "bad", "regex"))]
    enc = encoder()
    for kind, msgs in ((ToEngine, to_engine), (FromEngine, from_engine)):
        dec = decoder(kind)
        for m in msgs:
            assert dec.decode(enc.encode(m)) == m
    err = ErrorInfo.of(InvalidParam("top_p", "0 is out of range (0, 1]"))
    assert (err.kind, err.field, err.message) == ("invalid_param", "top_p", "0 is out of range (0, 1]")
    back = err.exception()  # the same class, its field carried as is (nothing parses the message)
    assert isinstance(back, InvalidParam) and (back.field, back.message) == ("top_p", "0 is out of range (0, 1]")
    grammar = ErrorInfo.of(GrammarError("structural_tag.structures[0]", "needs string begin and end")).exception()
    assert isinstance(grammar, GrammarError) and grammar.field == "structural_tag.structures[0]"
    assert str(grammar) == "structural_tag.structures[0]: needs string begin and end"
    assert type(ErrorInfo.of(GrammarError(None, "cannot be loaded")).exception().field) is type(None)
    assert isinstance(ErrorInfo.of(RuntimeError("busy")).exception(), RuntimeError)


def test_a_built_request_crosses_as_a_plain_message(tiny_engine):
    req = tiny_engine.make_req([5, 6, 7], SamplingParams(max_new_tokens=3), "rid-1", 2, tenant="a", cache_salt="s",
                               public_prefix_len=1)
    back = AddRequest.of(req).build()
    assert (back.rid, back.token_ids, back.max_new_tokens, back.priority, back.tenant, back.cache_salt,
            back.public_prefix_len) == ("rid-1", [5, 6, 7], 3, 2, "a", salt_key("s"), 1)
    assert isinstance(tiny_engine, EngineClient)


@pytest.fixture(scope="module")
def proc_engine(tiny_llama):
    with EngineProcess(str(tiny_llama), dtype="float32", kv_cache_tokens=4096, chunked_prefill_size=64) as e:
        yield e


async def _collect(engine, req) -> Output:
    out = None
    async for d in engine.submit(req):
        out = d.output if d.finished else out
    assert out is not None
    return out


def test_the_engine_process_gives_the_in_process_tokens_and_accounts_the_same(proc_engine, tiny_llama):
    assert isinstance(proc_engine, EngineClient) and proc_engine.pid != os.getpid() and _alive(proc_engine.pid)
    prompts = [[7 + i, 8, 9, 10 + i] * 20 for i in range(3)]
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)

    async def run() -> list[Output]:
        return list(await asyncio.gather(*(_collect(proc_engine, proc_engine.make_req(p, params)) for p in prompts)))

    remote = asyncio.run(run())
    with Engine(str(tiny_llama), kv_cache_tokens=4096, chunked_prefill_size=64) as local:
        here = local.generate(prompts, params)
    assert [o.token_ids for o in remote] == [o.token_ids for o in here]
    assert [o.text for o in remote] == [o.text for o in here]
    s = proc_engine.stats()
    assert s.kv_in_use_slots == 0 and s.finished >= 3 and s.decode_tokens > 0
    assert proc_engine.snapshot().finished == s.finished  # pushed with the last step's deltas
    proc_engine.check_integrity()
    assert proc_engine.flush_cache() > 0 and proc_engine.stats().kv_cached_tokens == 0
    with pytest.raises(InvalidParam, match="top_p"):  # refused where it is built, before anything is sent
        proc_engine.make_req([1, 2], SamplingParams(top_p=0))


def test_grammars_compile_in_the_engine_process_and_bad_ones_name_the_field(proc_engine):
    """A constrained request is sent once: prepare_grammar sends it ahead, the engine answers
    when its grammar is compiled (or with the error, never running it), submit reads its stream."""
    schema = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
    good = proc_engine.make_req([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=40, json_schema=schema))
    bad = proc_engine.make_req([5, 6, 7], SamplingParams(max_new_tokens=4, regex="(unclosed"))
    left = proc_engine.make_req([5, 6, 7], SamplingParams(max_new_tokens=400, regex="[a-z ]+"))
    sent: list[str] = []
    send = proc_engine._send

    def counting(msg):
        sent.append(type(msg).__name__)
        send(msg)

    async def run() -> Output:
        proc_engine._send = counting
        try:
            await proc_engine.prepare_grammar(good)
            with pytest.raises(ValueError, match="regex"):
                await proc_engine.prepare_grammar(bad)
            out = await _collect(proc_engine, good)
            await proc_engine.prepare_grammar(left)  # sent ahead, then its client leaves before reading
            proc_engine.abort(left.rid)
            return out
        finally:
            proc_engine._send = send

    out = asyncio.run(run())
    import json

    assert out.finish_reason == "stop" and isinstance(json.loads(out.text)["n"], int)
    assert sent == ["AddRequest", "AddRequest", "AddRequest", "Abort"]  # one crossing each
    assert not proc_engine._ahead  # nobody reads it; its route goes with the engine's final delta for it
    deadline = time.monotonic() + 30
    while proc_engine._streams and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not proc_engine._streams
    while proc_engine.stats().kv_in_use_slots and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc_engine.stats().kv_in_use_slots == 0
    proc_engine.check_integrity()


def test_a_client_that_leaves_while_its_grammar_compiles_stops_nothing(proc_engine):
    """Issue 44's critical finding: a client that hung up while its constrained request's grammar
    compiled cancelled the call's future, the engine's reply then failed to complete it on the
    reader thread, and the server took its engine process for gone (after 3 such clients)."""
    async def leave(i: int) -> bool:
        """One client that sends a fresh schema and leaves; whether it left before the reply
        (on a loaded machine the reply can win the race: that client then tested nothing)."""
        schema = f'{{"type": "object", "properties": {{"k{i}": {{"type": "string", "maxLength": {i + 3}}}}}}}'  # fresh
        req = proc_engine.make_req([5, 6, 7], SamplingParams(max_new_tokens=8, json_schema=schema))
        task = asyncio.create_task(proc_engine.prepare_grammar(req))
        while not proc_engine._calls and not task.done():  # sent: its reply is on its way
            await asyncio.sleep(0)
        task.cancel()  # what aiohttp does to a handler whose client disconnected
        try:
            await task  # (an engine taken for gone raises EngineDied here)
            left_first = False
        except asyncio.CancelledError:
            left_first = True
        proc_engine.abort(req.rid)  # what admission's exit does next
        deadline = time.monotonic() + 60
        while proc_engine._calls and time.monotonic() < deadline:  # the engine answers the cancelled call
            await asyncio.sleep(0.01)
        return left_first

    async def run() -> Output:
        hits = 0
        for i in range(16):  # 4 clients that left first (3 stopped the server before the fix)
            hits += await leave(i)
            if hits == 4:
                break
        assert hits == 4, f"only {hits} of 16 clients left before their reply: the test missed its path"
        return await _collect(proc_engine, proc_engine.make_req([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=3)))

    ok = asyncio.run(run())
    assert proc_engine.dead is None and _alive(proc_engine.pid)
    assert ok.finish_reason == "length" and ok.completion_tokens == 3
    assert not proc_engine._calls and not proc_engine._ahead and not proc_engine._streams
    assert proc_engine.stats().kv_in_use_slots == 0
    proc_engine.check_integrity()


def test_a_request_that_breaks_the_forward_fails_alone_and_the_engine_goes_on(proc_engine):
    """A front that let a bad token id through (this one bypasses validation): the forward
    fails, that request ends with an error, the process and the next requests are fine."""
    bad = AddRequest("broken", [10**6], SamplingParams(max_new_tokens=2), 2)

    async def run() -> tuple[Delta, Output]:
        loop = asyncio.get_running_loop()
        got: asyncio.Future[Delta] = loop.create_future()
        with proc_engine._lock:
            proc_engine._streams["broken"] = _Route("broken", lambda d: loop.call_soon_threadsafe(got.set_result, d), 1)
        proc_engine._send(bad)
        d = await asyncio.wait_for(got, 60)
        assert "broken" not in proc_engine._streams  # the final delta took its route
        ok = await _collect(proc_engine, proc_engine.make_req([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=3)))
        return d, ok

    d, ok = asyncio.run(run())
    assert d.finished and d.output is not None and d.output.finish_reason == "error" and "forward" in d.output.error
    assert ok.finish_reason == "length" and ok.completion_tokens == 3
    assert _alive(proc_engine.pid) and proc_engine.stats().kv_in_use_slots == 0
    proc_engine.check_integrity()


def test_the_engine_process_dies_with_a_killed_client(tiny_llama, tmp_path):
    script = tmp_path / "client.py"
    script.write_text(
        "import asyncio, sys, time\n"
        "from radixserve.engine.process import EngineProcess\n"
        "from radixserve.request import SamplingParams\n"
        f"e = EngineProcess({str(tiny_llama)!r}, kv_cache_tokens=1024)\n"
        "asyncio.run(e.prepare_grammar(e.make_req([5, 6], SamplingParams(max_new_tokens=1, regex='[a-z]+'))))\n"
        "print(e.pid, flush=True)\n"
        "time.sleep(600)\n")
    client = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(client.stdout.readline())
        assert _alive(pid)
        children = _children(pid)  # the compile worker that compiled the grammar, and its forkserver
        assert children, "the engine process started no compile workers"
        client.send_signal(signal.SIGKILL)
        client.wait(30)
        assert _wait_gone(pid), "the engine process outlived its killed client"
        for c in children:  # its grammar compile workers and their forkserver
            assert _wait_gone(c), f"engine child {c} outlived the engine"
    finally:
        client.kill()


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    kids = [int(x) for x in out.split()]
    return kids + [g for k in kids for g in _children(k)]


def _hang_up_during_the_grammar(url: str, i: int, after_s: float) -> None:
    """A chat with a fresh JSON schema whose client gives up while the grammar compiles."""
    import json
    import socket
    from urllib.parse import urlparse

    schema = {"type": "object", "properties": {f"field{i}": {"type": "integer", "maximum": 100 + i}}, "required": [f"field{i}"]}
    body = json.dumps({"messages": [{"role": "user", "content": "Give JSON."}], "max_tokens": 16,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}).encode()
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(after_s)


def test_the_server_survives_clients_that_leave_mid_grammar_and_stops_its_engine_cleanly(tiny_llama, tmp_path):
    """Issue 44 (0), as a client meets it: clients that hang up while their grammars compile,
    the server checked after each; then a clean stop (the bug made the server exit 1)."""
    s = ServerProcess(tiny_llama, "--kv-cache-tokens", "2048", log=tmp_path / "server.log")
    try:
        _, info = s.get("/server_info")
        pid = info["engine_pid"]
        assert pid != s.proc.pid and _alive(pid)
        for i, after in enumerate((0.01, 0.03, 0.06, 0.1, 0.15, 0.02)):
            _hang_up_during_the_grammar(s.url, i, after)
            assert s.get("/health")[0] == 200 and s.proc.poll() is None
        assert s.get("/server_info")[1]["engine_pid"] == pid
        status, out = s.post("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 3}})
        assert status == 200 and out["meta_info"]["completion_tokens"] == 3
        assert s.wait_idle()["kv_in_use_slots"] == 0
    finally:
        code = s.stop()
    assert code == 0 and _wait_gone(pid, 10)
    assert "Traceback" not in (tmp_path / "server.log").read_text()


def test_a_server_whose_engine_process_dies_fails_its_streams_and_exits_for_a_restart(tiny_llama, tmp_path):
    import json
    import socket

    s = ServerProcess(tiny_llama, "--kv-cache-tokens", "4096", log=tmp_path / "server.log")
    try:
        pid = s.get("/server_info")[1]["engine_pid"]
        sock = socket.create_connection(("127.0.0.1", s.port))
        body = json.dumps({"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}})
        sock.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        got = b""
        while got.count(b"data:") < 2:
            got += sock.recv(65536)
        os.kill(pid, signal.SIGKILL)  # the OOM killer, say
        sock.settimeout(30)
        while b"[DONE]" not in got:  # the stream ends, with the error, instead of hanging
            chunk = sock.recv(65536)
            assert chunk, got[-500:]
            got += chunk
        assert b"engine process is gone" in got
        assert s.proc.wait(30) == 1  # exits non-zero: a supervisor restarts it
    finally:
        s.stop()
    assert "the engine process is gone" in (tmp_path / "server.log").read_text()


def test_an_engine_that_cannot_start_is_a_clean_error_and_leaves_nothing_behind(tiny_llama, tmp_path):
    for args, says in ((["--max-total-tokens", "0"], "max_total_tokens: the KV pool would hold 0 tokens"),
                       (["--activations", "int8"], "--activations int8: the model has no quantized weights"),
                       (["--model", str(tmp_path / "missing")], "does not exist")):
        model = [] if args[0] == "--model" else ["--model", str(tiny_llama)]
        r = subprocess.run([sys.executable, "-m", "radixserve.cli", "serve", *model, *args, "--port", "1"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "radixserve: error: " in r.stderr and says in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in r.stderr, r.stderr[-2000:]
    # the engine process that failed is gone (its command line holds its options as JSON)
    assert subprocess.run(["pgrep", "-f", 'radixserve.engine.process .*"max_total_tokens": 0']).returncode == 1


def test_a_rid_reused_at_once_waits_for_the_old_request_and_an_abort_meanwhile_is_the_new_ones(proc_engine):
    """Deltas cross by rid: a request under a rid whose last request is still being let go of
    waits for its final delta (so it never reads that request's end), and an abort of the rid
    while it waits ends it, not (only) the old one."""
    from contextlib import aclosing

    long = SamplingParams(max_new_tokens=400, ignore_eos=True, temperature=0)

    async def left_at_once() -> None:
        async with aclosing(proc_engine.submit(proc_engine.make_req([5, 6, 7], long, "reused"))) as deltas:
            async for _ in deltas:
                break  # its client leaves: aborted

    async def run() -> tuple[Output, Output]:
        await left_at_once()
        whole = await _collect(proc_engine, proc_engine.make_req([5, 6, 7], SamplingParams(max_new_tokens=5), "reused"))
        await left_at_once()
        waiting = asyncio.ensure_future(_collect(proc_engine, proc_engine.make_req([5, 6, 7], long, "reused")))
        def started() -> bool:  # waiting for the rid, or holding it (the old route's reader has gone)
            route = proc_engine._streams.get("reused")
            return "reused" in proc_engine._waiting or (route is not None and route.sink is not None)

        while not waiting.done() and not started():
            await asyncio.sleep(0)
        proc_engine.abort("reused")
        return whole, await asyncio.wait_for(waiting, 60)

    whole, aborted = asyncio.run(run())
    assert whole.finish_reason == "length" and whole.completion_tokens == 5
    assert aborted.finish_reason == "abort" and aborted.completion_tokens < 400
    assert not proc_engine._waiting and not proc_engine._aborted
