"""Data-parallel replicas behind one front (`DataParallelEngine`, `radixserve serve
--data-parallel N`): prefix affinity computes a forked prompt once on one replica where
round-robin computes it on both (counts from each replica's stats), tenants stay apart across
replicas, and a replica killed mid-run loses no request that had not started."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from server_helpers import final_outputs, scaled

from radixserve import SamplingParams
from radixserve.config import RouterConfig
from radixserve.engine.data_parallel import DataParallelEngine
from radixserve.routing import make_router

pytestmark = pytest.mark.slow  # every test here starts engine processes (replicas)

SYSTEM = " ".join(f"Rule {i}: agents call tools, read JSON and branch." for i in range(60))
QUESTIONS = [f"Question {i}: which tool first?" for i in range(8)]


def _engine(tiny_llama, **kw) -> DataParallelEngine:
    opts = dict(dtype="float32", kv_cache_tokens=8192, chunked_prefill_size=256, grammar_compile_workers=1)
    return DataParallelEngine(str(tiny_llama), RouterConfig(data_parallel=2), **{**opts, **kw})


@pytest.fixture(scope="module")
def dp(tiny_llama):
    with _engine(tiny_llama) as e:
        yield e


def _forks(e, tenant="acme", n=8):
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    return [e.make_req(SYSTEM + "\n" + q, params, tenant=tenant) for q in QUESTIONS[:n]]


def _computed(e) -> list[int]:
    return [s.prefill_tokens_computed for s in e.replica_snapshots()]


def _settle(e, before: list[int]) -> list[int]:
    """Per replica, prefill tokens computed since `before` (stats as of each replica's last step)."""
    for _ in range(50):
        stats = [s.stats() for s in (r.engine for r in e.replicas)]
        if all(s.running == 0 and s.waiting == 0 for s in stats):
            break
        time.sleep(0.05)
    return [s.prefill_tokens_computed - b for s, b in zip(stats, before)]


def test_prefix_affinity_computes_a_forked_prompt_once_on_one_replica(dp):
    dp.flush_cache()
    reqs = _forks(dp)
    prompt = reqs[0].prompt_len
    shared = len(os.path.commonprefix([r.token_ids[: r.prompt_len] for r in reqs]))
    before = _computed(dp)
    outs = asyncio.run(final_outputs(dp, reqs))
    delta = _settle(dp, before)
    assert all(o.finish_reason == "length" for o in outs)
    assert sorted(delta)[0] == 0, f"one replica computed nothing: {delta}"
    assert sum(delta) <= prompt + 8 * (prompt - shared) + 8, (delta, prompt, shared)  # the prefix once, each question
    assert sum(o.cached_tokens for o in outs) >= 7 * (shared - 16)

    # a second tenant's identical prompt: not served from the first tenant's cache, on any replica
    other = asyncio.run(final_outputs(dp, _forks(dp, tenant="beta", n=1)))[0]
    assert other.cached_tokens == 0
    assert dp.router.decisions["prefix"] >= 7


def test_round_robin_computes_the_same_forks_on_both_replicas(dp):
    dp.flush_cache()
    dp.router = make_router(RouterConfig(data_parallel=2, router_policy="round_robin"))
    try:
        reqs = _forks(dp)
        shared = len(os.path.commonprefix([r.token_ids[: r.prompt_len] for r in reqs]))
        before = _computed(dp)
        asyncio.run(final_outputs(dp, reqs))
        delta = _settle(dp, before)
    finally:
        dp.router = make_router(dp.router_config)
    assert min(delta) >= shared, f"each replica computed the shared prefix itself: {delta}, shared {shared}"


def test_bench_route_counts_less_prefill_under_prefix_affinity_than_round_robin(dp):
    from radixserve.bench import route
    from radixserve.cli import build_parser

    args = build_parser().parse_args(["bench", "route", "--agents", "2", "--branches", "4", "--system-tokens", "400",
                                      "--conversations", "3", "--turns", "3", "--output-len", "4"])
    r = route.measure(dp, args)
    for workload in ("fork", "multi_turn"):
        prefix, rr = r[f"{workload}/prefix"], r[f"{workload}/round_robin"]
        assert prefix["prompt_tokens"] == rr["prompt_tokens"] > 0
        assert prefix["prefill_tokens_computed"] < rr["prefill_tokens_computed"], (workload, prefix, rr)
        assert prefix["hit_rate"] > rr["hit_rate"]
    assert sum(r["fork/prefix"]["requests_per_replica"]) == 8
    assert route.index_bytes_per_block(replicas=2, blocks=1000) > 0


def test_an_outside_router_fed_only_kv_events_routes_forks_and_turns_to_their_cache(tiny_llama, tmp_path):
    """Each replica publishes on its own sockets (ipc suffixes by rank), its rank in each batch;
    a router that reads only those events computes less than round robin."""
    import json

    from radixserve.bench import route
    from radixserve.cli import build_parser
    from radixserve.engine.kv_events import offset_endpoint
    from radixserve.routing.kv_events import EventView

    pub, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": pub, "replay_endpoint": replay})
    args = build_parser().parse_args(["bench", "route", "--agents", "2", "--branches", "4", "--system-tokens", "400",
                                      "--conversations", "3", "--turns", "3", "--output-len", "4", "--policies", "round_robin"])
    with _engine(tiny_llama, kv_events_config=config) as e:
        view = EventView({i: (offset_endpoint(pub, i), offset_endpoint(replay, i)) for i in range(2)})
        try:
            r = route.measure(e, args, view)
        finally:
            view.close()
        assert view.ranks == {0: {0}, 1: {1}}
        stats = [x.engine.stats() for x in e.replicas]
    for workload in ("fork", "multi_turn"):
        ext, rr = r[f"{workload}/kv_events"], r[f"{workload}/round_robin"]
        assert ext["prompt_tokens"] == rr["prompt_tokens"] > 0
        assert ext["prefill_tokens_computed"] < rr["prefill_tokens_computed"], (workload, ext, rr)
    assert all(s.kv_events_batches > 0 and s.kv_events_blocks > 0 for s in stats)


def test_a_killed_replica_fails_its_started_stream_and_retries_what_had_not_started(tiny_llama):
    with _engine(tiny_llama, max_running_requests=1) as e:
        e.router = make_router(RouterConfig(data_parallel=2, router_policy="round_robin"))

        async def scenario():
            long = e.make_req("Go on forever.", SamplingParams(max_new_tokens=2000, temperature=0.0, ignore_eos=True))
            queued = [e.make_req(f"Queued {i}.", SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
                      for i in range(6)]
            e.route(long)
            victim = e._placed[long.rid]
            for r in queued:
                e.route(r)
            pid = e.replicas[victim].engine.pid
            stream = e.submit(long)
            first = await anext(stream)  # it has started on the victim (one running at a time: the rest wait there)
            assert first.token_ids
            tasks = [asyncio.ensure_future(final_outputs(e, [r])) for r in queued]
            await asyncio.sleep(0.3)
            os.kill(pid, signal.SIGKILL)
            tail = [d async for d in stream]
            outs = [o for (o,) in await asyncio.wait_for(asyncio.gather(*tasks), 120)]
            return victim, tail[-1].output, outs

        victim, cut, outs = asyncio.run(scenario())
        assert cut.finish_reason == "error" and f"data-parallel replica {victim}" in cut.error, cut
        assert [o.finish_reason for o in outs] == ["length"] * 6, [o.error for o in outs]
        assert all(o.completion_tokens == 8 for o in outs)

        assert not e.replicas[victim].healthy
        survivor = 1 - victim
        for i in range(4):  # never routed to the dead replica
            r = e.make_req(f"After {i}.", SamplingParams(max_new_tokens=2))
            e.route(r)
            assert e._placed[r.rid] == survivor
            e.abort(r.rid)
        assert [r.load for r in e.replicas] == [0, 0]

        deadline = time.monotonic() + scaled(120)  # restarted cold in the background
        while not e.replicas[victim].healthy and time.monotonic() < deadline:
            time.sleep(0.2)
        assert e.replicas[victim].healthy and e.replicas[victim].restarts == 1
        outs = asyncio.run(final_outputs(e, [e.make_req(f"Back {i}.", SamplingParams(max_new_tokens=3)) for i in range(4)]))
        assert all(o.finish_reason in ("length", "stop") for o in outs)
        e.check_integrity()


def test_a_replica_restarted_on_its_disk_tier_keeps_its_prefixes_and_the_router_sends_them_there(tiny_llama, tmp_path):
    with _engine(tiny_llama, kv_disk_dir=str(tmp_path), kv_disk_block_tokens=16) as e:
        [first] = asyncio.run(final_outputs(e, _forks(e, n=1)))
        home = max(range(2), key=lambda i: e.replicas[i].engine.stats().prefill_tokens_computed)
        deadline = time.monotonic() + scaled(30)
        while e.replicas[home].engine.stats().kv_disk_written_tokens < 256 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any((tmp_path / f"replica-{home}").glob("*.kv")) and not any((tmp_path / f"replica-{1 - home}").glob("*.kv"))
        os.kill(e.replicas[home].engine.pid, signal.SIGKILL)
        deadline = time.monotonic() + scaled(120)
        while not (e.replicas[home].healthy and e.replicas[home].restarts == 1) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert e.replicas[home].healthy
        req = _forks(e, n=2)[1]
        e.route(req)
        assert e._placed[req.rid] == home  # the router still knows where the prefix is
        [again] = asyncio.run(final_outputs(e, [req]))
        s = e.replicas[home].engine.stats()
        assert again.cached_tokens >= 100 and s.cached_prompt_tokens_disk >= 100, s
        assert first.finish_reason == again.finish_reason == "length"
        e.check_integrity()


# -- through the server: `radixserve serve --data-parallel 2`, the official openai client ------------
@pytest.fixture(scope="module")
def dp_server(tiny_llama, tmp_path_factory):
    from tests.server_helpers import ServerProcess

    d = tmp_path_factory.mktemp("dp")
    (d / "tenants.toml").write_text('[[tenants]]\nid = "acme"\napi_key = "key-acme"\nadmin = true\n\n'
                                    '[[tenants]]\nid = "beta"\napi_key = "key-beta"\nadmin = true\n')
    s = ServerProcess(tiny_llama, "--data-parallel", "2", "--tenants", str(d / "tenants.toml"), "--kv-cache-tokens", "8192",
                      "--grammar-compile-workers", "1", "--dtype", "float32", "--metrics-vllm-names", log=d / "server.log")
    yield s
    assert s.stop() == 0, (d / "server.log").read_text()


def _replicas(server) -> list[dict]:
    status, info = server.get("/server_info", "key-acme")
    assert status == 200, info
    return info["data_parallel"]["replicas"]


def test_served_forks_hit_one_replica_streamed_or_whole_and_tenants_stay_apart(dp_server):
    from openai import AsyncOpenAI

    async def ask(key, question, stream, hint=None):
        client = AsyncOpenAI(base_url=dp_server.url + "/v1", api_key=key, timeout=60, max_retries=0)
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        extra = {"prompt_cache_key": hint} if hint else {}
        if not stream:
            r = await client.chat.completions.create(model="", messages=msgs, max_tokens=4, temperature=0, extra_body=extra)
            return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content
        chunks = await client.chat.completions.create(model="", messages=msgs, max_tokens=4, temperature=0, stream=True,
                                                      stream_options={"include_usage": True}, extra_body=extra)
        text, cached = "", None
        async for c in chunks:
            text += "".join(ch.delta.content or "" for ch in c.choices)
            cached = c.usage.prompt_tokens_details.cached_tokens if c.usage else cached
        return cached, text

    async def forks():
        return await asyncio.gather(*(ask("key-acme", q, stream=i % 2 == 1) for i, q in enumerate(QUESTIONS)))

    dp_server.wait_idle("key-acme")
    before = [r["kv"]["prefill_tokens_computed"] for r in _replicas(dp_server)]
    answers = asyncio.run(forks())
    dp_server.wait_idle("key-acme")
    delta = [r["kv"]["prefill_tokens_computed"] - b for r, b in zip(_replicas(dp_server), before)]
    assert all(text for _, text in answers), answers
    assert min(delta) == 0 and sum(c for c, _ in answers) > 0, (delta, answers)
    first, _ = asyncio.run(ask("key-beta", QUESTIONS[0], stream=False))
    assert first == 0, "another tenant's identical prompt is not served from acme's cache"

    status, info = dp_server.get("/server_info", "key-acme")
    hints = info["data_parallel"]["router"]["decisions"].get("hint", 0)
    asyncio.run(ask("key-acme", "Unrelated A", stream=False, hint="agent-42"))
    asyncio.run(ask("key-acme", "Unrelated B", stream=True, hint="agent-42"))
    dp_server.wait_idle("key-acme")  # (the history precomputes after the answers route by prefix, never by the hint)
    status, info = dp_server.get("/server_info", "key-acme")
    assert info["data_parallel"]["router"]["decisions"].get("hint", 0) == hints + 1
    assert all(r["healthy"] and r["load"] == 0 for r in info["data_parallel"]["replicas"])


def test_a_client_gone_mid_stream_frees_its_replica_and_its_load(dp_server):
    import http.client
    import json

    body = json.dumps({"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 1500,
                       "temperature": 0, "ignore_eos": True, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", dp_server.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body, {"Authorization": "Bearer key-acme", "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    assert sum(r["load"] for r in _replicas(dp_server)) == 1
    conn.close()  # gone mid-stream
    dp_server.wait_idle("key-acme")
    replicas = _replicas(dp_server)
    assert [r["load"] for r in replicas] == [0, 0]
    status, info = dp_server.get("/server_info?check_integrity=1", "key-acme")
    assert [r["kv"]["kv_in_use_slots"] for r in replicas] == [0, 0], (replicas, info.get("integrity"))
    assert info["integrity"] == "ok"



def test_metrics_sum_the_replicas_and_label_each_under_both_names(dp_server):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(dp_server.url + "/metrics", headers={"Authorization": "Bearer key-acme"})
    with urllib.request.urlopen(req, timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    replicas = _replicas(dp_server)
    total = families["radixserve_kv_total_tokens"].samples[0].value
    assert total == sum(r["kv"]["kv_total_slots"] for r in replicas) == 2 * 8192
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
        assert families[f"radixserve:{name}"].type == families[f"vllm:{name}"].type == "gauge"
    labels = {s.labels["replica"] for s in families["radixserve_replica_running_requests"].samples}
    assert labels == {"0", "1"}
