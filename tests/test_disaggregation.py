"""Prefill/decode disaggregation: the KV connectors (shm, tcp) move bytes and free them on
every path; one engine's published pages, taken by another, give the colocated engine's greedy
tokens and logprobs while the taker computes only the prompt's last token; a taker that holds a
prefix receives only the pages past it; lost pages are a miss, never a wrong answer. The
data-parallel engine's --disaggregate mode (slow: it starts processes) is exact the same way,
and frees every page when a request is aborted mid-prefill or a replica is killed."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time

import pytest
from server_helpers import final_outputs

from radixserve import SamplingParams
from radixserve.config import RouterConfig
from radixserve.engine import kv_connector
from radixserve.engine.engine import Engine
from radixserve.request import KVPages, Req

SYSTEM = " ".join(f"Rule {i}: agents call tools, read JSON and branch." for i in range(40))
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, return_logprob=True)


# -- the connectors ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", kv_connector.CONNECTORS)
def test_a_connector_hands_pages_over_once_and_frees_them_on_every_path(kind, monkeypatch):
    c = kv_connector.make_connector(kind)
    try:
        data = os.urandom(1 << 20)
        key = secrets.token_hex(16)
        c.publish(key, memoryview(data))
        assert c.staged == 1
        assert kv_connector.take(c.location, key, len(data) + 1) is None  # the wrong length: not these pages
        c.publish(key, memoryview(data))
        assert bytes(kv_connector.take(c.location, key, len(data)) or b"") == data
        assert c.staged == 0 and kv_connector.take(c.location, key, len(data)) is None  # taken once

        released = secrets.token_hex(16)  # an abort: the coordinator releases what nobody took
        c.publish(released, memoryview(data))
        kv_connector.release(c.location, released)
        deadline = time.monotonic() + 5
        while c.staged and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.staged == 0 and kv_connector.take(c.location, released, len(data)) is None
        kv_connector.release(c.location, released)  # idempotent

        stale = secrets.token_hex(16)  # a consumer that died: the producer drops it after the TTL
        c.publish(stale, memoryview(data))
        monkeypatch.setattr(kv_connector, "STAGED_TTL_S", -1.0)
        c.publish(secrets.token_hex(16), memoryview(b"x"))
        assert kv_connector.take(c.location, stale, len(data)) is None
    finally:
        c.close()
    assert c.staged == 0
    if kind == "shm":
        assert not os.path.exists(c.dir)  # its private staging directory, and all in it


def test_a_connector_refuses_a_key_that_is_not_one():
    with pytest.raises(ValueError, match="key"):
        kv_connector.take("shm:/dev/shm", "../etc/passwd", 10)
    with pytest.raises(ValueError, match="location"):
        kv_connector.take("nfs:/x", "ab", 10)
    kv_connector.release("tcp:127.0.0.1:1", "ab")  # a producer gone: no error


# -- two engines in this process ----------------------------------------------------------------
def _run(engine: Engine, req: Req):
    return asyncio.run(final_outputs(engine, [req]))[0]


def _engine(tiny_llama, kind="shm"):
    return Engine(str(tiny_llama), dtype="float32", kv_cache_tokens=4096, chunked_prefill_size=128, kv_connector=kind)


@pytest.fixture(scope="module")
def pair(tiny_llama):
    with _engine(tiny_llama) as prefill, _engine(tiny_llama, "tcp") as decode:
        yield prefill, decode


def _handoff(prefill: Engine, decode: Engine, prompt: str, start: int | None = None, publish: bool = True):
    """What the data-parallel coordinator does: the prompt (but its last token) on `prefill`,
    its pages past what `decode` holds published there, then the request on `decode`."""
    req = decode.make_req(prompt, GREEDY)
    upto = req.prompt_len - 1
    have = decode.match_len(req) if start is None else start
    pages = KVPages(secrets.token_hex(16), have, upto)
    if publish:
        pre = prefill.make_req(req.token_ids[:upto], SamplingParams(max_new_tokens=1, temperature=0.0))
        pre.kv_export = pages
        assert _run(prefill, pre).finish_reason == "length"
    req.kv_import = KVPages(pages.key, pages.start, pages.upto, prefill.kv_location)
    return _run(decode, req), have


def test_pages_handed_over_give_the_colocated_engines_greedy_output(pair, tiny_engine):
    prefill, decode = pair
    prompt = SYSTEM + "\nQuestion: which tool first?"
    ref = tiny_engine.generate(prompt, GREEDY)[0]
    before = decode.stats()
    out, have = _handoff(prefill, decode, prompt)
    after = decode.stats()
    assert have == 0 and out.token_ids == ref.token_ids
    assert [t.logprob for t in out.logprobs] == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-4)
    assert after.prefill_tokens_computed - before.prefill_tokens_computed == 1  # its last prompt token only
    assert after.kv_imported_tokens - before.kv_imported_tokens == out.prompt_tokens - 1
    assert out.cached_tokens == out.prompt_tokens - 1

    # a fork: the decode engine holds the shared prefix, so only the pages past it travel
    fork = SYSTEM + "\nQuestion: which tool second, and why?"
    ref = tiny_engine.generate(fork, GREEDY)[0]
    exported = prefill.stats().kv_exported_tokens
    out, have = _handoff(prefill, decode, fork)
    assert have > 300 and out.token_ids == ref.token_ids
    assert prefill.stats().kv_exported_tokens - exported == out.prompt_tokens - 1 - have
    for e in pair:
        s = e.stats()
        assert s.kv_in_use_slots == 0 and s.kv_staged_handoffs == 0
        e.check_integrity()


def test_pages_that_never_come_are_computed(pair, tiny_engine):
    prefill, decode = pair
    prompt = SYSTEM + "\nQuestion: what if the prefill replica died?"
    ref = tiny_engine.generate(prompt, GREEDY)[0]
    out, _ = _handoff(prefill, decode, prompt, publish=False)
    assert out.token_ids == ref.token_ids and out.error is None
    # pages that no longer continue what the decode engine holds (it lost the head they follow)
    decode.flush_cache()
    out, _ = _handoff(prefill, decode, prompt + " Now.", start=200)
    assert out.token_ids == tiny_engine.generate(prompt + " Now.", GREEDY)[0].token_ids
    assert decode.stats().kv_in_use_slots == 0
    decode.check_integrity()


def test_a_name_planted_in_the_staging_directory_fails_that_hand_off_only(pair, tiny_engine, tmp_path):
    """A file already at a hand-off's name (a symlink to a victim) is never followed: that prefill
    ends with an error, its decode computes the prompt, and the next hand-off goes through."""
    prefill, decode = pair
    prompt = SYSTEM + "\nQuestion: and if the name is taken?"
    ref = tiny_engine.generate(prompt, GREEDY)[0]
    req = decode.make_req(prompt, GREEDY)
    pages = KVPages(secrets.token_hex(16), 0, req.prompt_len - 1)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    os.symlink(victim, os.path.join(prefill.handoff.connector.dir, f"radixserve-kv-{pages.key}.tmp"))
    pre = prefill.make_req(req.token_ids[: pages.upto], SamplingParams(max_new_tokens=1, temperature=0.0))
    pre.kv_export = pages
    out = _run(prefill, pre)
    assert out.finish_reason == "error" and "publishing its KV pages failed" in out.error
    assert victim.read_bytes() == b"keep me"
    req.kv_import = KVPages(pages.key, pages.start, pages.upto, prefill.kv_location)
    assert _run(decode, req).token_ids == ref.token_ids  # a miss: computed
    out, _ = _handoff(prefill, decode, prompt + " Again.")
    assert out.token_ids == tiny_engine.generate(prompt + " Again.", GREEDY)[0].token_ids and out.cached_tokens > 0
    for e in pair:
        assert e.stats().kv_in_use_slots == 0
        e.check_integrity()


def test_a_hand_off_without_a_connector_is_refused_by_name(tiny_engine):
    req = tiny_engine.make_req("Hello", GREEDY)
    req.kv_export = KVPages("ab", 0, 1)
    with pytest.raises(ValueError, match="kv_export: this engine has no KV connector"):
        tiny_engine.add(req, lambda d: None)


def test_a_pool_the_hand_off_cannot_move_is_refused(tiny_models):
    with pytest.raises(ValueError, match="kv_connector"):
        Engine(str(tiny_models["Gemma3ForCausalLM"]), kv_cache_tokens=2048, kv_connector="shm")
    with pytest.raises(ValueError, match="prefill_replicas"):
        RouterConfig(disaggregate=True, data_parallel=2, prefill_replicas=2).check()  # none left to decode
    with pytest.raises(ValueError, match="kv_connector"):
        Engine(str(tiny_models["LlamaForCausalLM"]), kv_connector="rdma")


# -- the data-parallel engine's --disaggregate mode (processes) -----------------------------------
def _dp(tiny_llama, **kw):
    from radixserve.engine.data_parallel import DataParallelEngine

    opts = dict(dtype="float32", kv_cache_tokens=8192, chunked_prefill_size=128, grammar_compile_workers=1,
                disaggregate_min_tokens=64)
    router = RouterConfig(disaggregate=True, disaggregate_min_tokens=opts.pop("disaggregate_min_tokens"))
    return DataParallelEngine(str(tiny_llama), router, **{**opts, **kw})


def _settled(e):
    deadline = time.monotonic() + 10
    while True:
        stats = [r.engine.stats() for r in e.replicas if r.healthy and r.engine is not None]
        if all(s.running == s.waiting == s.kv_in_use_slots == s.kv_staged_handoffs == 0 for s in stats):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("kind", [None, *kv_connector.CONNECTORS])  # None: as the CLI passes an unset flag (shm)
def test_disaggregated_engine_is_exact_and_frees_every_page(tiny_llama, tiny_engine, kind):
    prompts = [SYSTEM + f"\nQuestion {i}: which tool first?" for i in range(4)] + ["Hi"]
    refs = tiny_engine.generate(prompts, GREEDY)
    with _dp(tiny_llama, kv_connector=kind) as e:
        assert [r.role for r in e.replicas] == ["prefill", "decode"]
        outs = asyncio.run(final_outputs(e, [e.make_req(p, GREEDY) for p in prompts]))
        assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
        stats = _settled(e)
        assert stats[0].kv_exported_tokens >= outs[0].prompt_tokens - 1  # the long prompts were prefilled there
        assert stats[0].decode_tokens == 0 and stats[1].kv_imported_tokens >= outs[0].prompt_tokens - 1
        assert stats[1].prefill_tokens_computed < 4 + len(e.tokenizer.encode("Hi")) + 8  # last tokens, and "Hi"
        e.check_integrity()
        assert e.describe()["replicas"][0]["role"] == "prefill"


@pytest.mark.slow
def test_disaggregated_engine_loses_nothing_to_an_abort_or_a_killed_replica(tiny_llama, tiny_engine):
    prompt = SYSTEM + "\nQuestion: and after a failure?"
    ref = tiny_engine.generate(prompt, GREEDY)[0]
    long = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    with _dp(tiny_llama) as e:
        staged = {r.engine.kv_location for r in e.replicas}  # each replica's shm staging directory

        async def aborted_mid_prefill():
            req = e.make_req("Another prompt. " + SYSTEM, long)
            task = asyncio.ensure_future(final_outputs(e, [req]))
            while req.rid not in e._prefilling or e._prefilling[req.rid].replica < 0:
                await asyncio.sleep(0.001)
            e.abort(req.rid)
            return (await task)[0]

        out = asyncio.run(aborted_mid_prefill())
        assert out.finish_reason == "abort"
        _settled(e)

        async def prefill_killed_mid_transfer():  # its decode replica computes the prompt
            req = e.make_req(prompt, GREEDY)
            task = asyncio.ensure_future(final_outputs(e, [req]))
            while req.rid not in e._prefilling or e._prefilling[req.rid].replica < 0:
                await asyncio.sleep(0.001)
            os.kill(e.replicas[0].engine.pid, signal.SIGKILL)
            return (await task)[0]

        out = asyncio.run(prefill_killed_mid_transfer())
        assert out.token_ids == ref.token_ids and out.error is None
        _settled(e)
        e.check_integrity()

        while not all(r.healthy for r in e.replicas):  # the prefill replica is back
            time.sleep(0.05)

        async def decode_killed_mid_answer():  # after its pages were taken: the answer ends with an error
            req = e.make_req("A third prompt. " + SYSTEM, long)
            async for d in e.submit(req):
                if d.token_ids:
                    os.kill(e.replicas[1].engine.pid, signal.SIGKILL)
                if d.finished:
                    return d.output

        staged |= {r.engine.kv_location for r in e.replicas}  # the restarted prefill replica's too

        out = asyncio.run(decode_killed_mid_answer())
        assert out.finish_reason == "error" and "replica 1" in out.error
        s = _settled(e)[0]  # the prefill replica (the decode one restarts)
        assert s.kv_exported_tokens > 0 and s.kv_staged_handoffs == 0
        staged |= {r.engine.kv_location for r in e.replicas if r.engine is not None}
    assert len(staged) >= 3 and all(loc.startswith("shm:/dev/shm/radixserve-kv-") for loc in staged), staged
    assert not [loc for loc in staged if os.path.exists(loc.removeprefix("shm:"))]  # killed or shut down: none left
