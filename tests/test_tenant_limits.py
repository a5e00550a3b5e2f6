"""What one tenant may ask of the request surfaces, and what it sees of the others: cache_control
breakpoints checked in one linear pass, retention within the tenant's max_cache_retention,
kv_tiers for admins only, cache salts capped and digested, a tenant id issued again with a new
key starting with an empty cache (disk tier included), the OpenAI default max_tokens (the context
window left), OpenAI's and Anthropic's sampling ranges, a JSON Content-Type on every JSON route,
and a tenant's request rate (max_requests_per_second) counted before any body is read."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import time
import tracemalloc
import urllib.request

import msgspec
import pytest
from server_helpers import USER, ServerProcess, final_outputs, scaled

from radixserve.cache.prefix import salt_key
from radixserve.request import SamplingParams
from radixserve.server.anthropic import cache as anthropic_cache
from radixserve.server.anthropic.protocol import MessagesRequest
from radixserve.server.auth import Auth, Tenant, load_tenants
from radixserve.server.errors import ApiError
from radixserve.server.rate_limit import MAX_PACE_S, RateLimiter, units

CONTEXT = 320  # the test server's --context-length
TENANTS = ('[[tenants]]\nid = "ops"\napi_key = "key-ops"\nadmin = true\nmax_cache_retention = "24h"\n\n'
           '[[tenants]]\nid = "plain"\napi_key = "key-plain"\n\n'
           '[[tenants]]\nid = "hourly"\napi_key = "key-hourly"\nmax_cache_retention = "1h"\n\n'
           '[[tenants]]\nid = "metered"\napi_key = "key-metered"\nmax_requests_per_second = 2\nmax_request_burst = 3\n')
CHAT = {"messages": USER, "max_tokens": 2}
MESSAGES = {"model": "", "max_tokens": 2, "messages": USER}
RESPONSES = {"input": "Agents call tools.", "max_output_tokens": 2}


def _marked(n: int) -> dict:
    blocks = [{"type": "text", "text": f"b{i}", "cache_control": {"type": "ephemeral"}} for i in range(n)]
    return {"model": "", "max_tokens": 1, "messages": [{"role": "user", "content": blocks}]}


# -- units -----------------------------------------------------------------------------------------
def test_a_fifth_cache_control_is_refused_in_one_pass_that_copies_nothing():
    body = msgspec.convert(_marked(2000), MessagesRequest)
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        with pytest.raises(ApiError) as e:
            anthropic_cache.find(body)
        took = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert e.value.status == 400 and e.value.param == "messages[0].content[4].cache_control", e.value.message
    assert "at most 4" in e.value.message
    assert peak < 64 << 10 and took < 0.05, (peak, took)  # before: a copy of the content per mark (16 MB here)
    four = anthropic_cache.find(msgspec.convert(_marked(4), MessagesRequest))
    cuts = [(len(cut.messages[0].content), ttl) for cut, ttl in four.cuts()]
    assert cuts == [(1, 300), (2, 300), (3, 300), (4, 300)]


def test_a_ttl_past_the_tenants_cap_names_the_field():
    body = msgspec.convert({**_marked(2), "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral",
                                                                                                     "ttl": "1h"}}]},
                           MessagesRequest)
    with pytest.raises(ApiError) as e:
        anthropic_cache.find(body, max_ttl=300)
    assert e.value.status == 400 and e.value.param == "system[0].cache_control.ttl", e.value.message
    assert len(anthropic_cache.find(body, max_ttl=3600).marks) == 3


def test_max_cache_retention_is_a_duration_defaulting_to_five_minutes(tmp_path):
    (tmp_path / "t.toml").write_text('[[tenants]]\nid = "a"\napi_key = "k"\nmax_cache_retention = "1 hour"\n')
    with pytest.raises(ValueError, match="max_cache_retention: '1 hour' is not a duration"):
        load_tenants(tmp_path / "t.toml")
    assert Tenant("a", "k").retention_cap == 300 and Tenant("a", "k", max_cache_retention="90s").retention_cap == 90
    assert Auth.from_options(None, None).authenticate(None).retention_cap == 86400  # the open server: any
    assert Auth.from_options("secret", None).authenticate("Bearer secret").retention_cap == 86400


def test_namespace_salts_are_fixed_size_digests_of_the_salt_and_the_tenants_key(tiny_engine):
    a, b = Tenant("acme", "key-1"), Tenant("acme", "key-2")
    assert a.namespace_key != b.namespace_key and "key-1" not in (a.namespace_key or "")
    made = tiny_engine.make_req([5, 6, 7], SamplingParams(), tenant="acme", cache_salt="s" * 256, tenant_key=a.namespace_key)
    assert made.cache_salt == salt_key("s" * 256, a.namespace_key) and len(made.cache_salt) == 32
    assert salt_key("s" * 256, b.namespace_key) != made.cache_salt != salt_key("s" * 256)
    assert salt_key(None) is None and salt_key("x") == salt_key("x") != salt_key(None, "x")


def test_a_tenant_id_issued_again_with_a_new_key_finds_none_of_the_old_owners_disk_blocks(tiny_llama, tmp_path):
    """Two tenants files, one after the other, on one disk directory: "acme" with key-1, then
    "acme" with key-2. The second owner's prompt misses the disk tier; key-1 back finds it."""
    from radixserve import Engine
    from radixserve.config import ServerConfig
    from radixserve.server.state import RequestOptions, ServerState

    prompt = [10 + (i * 37) % 180 for i in range(200)]
    params = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)

    def run(key: str) -> int:
        (tmp_path / "tenants.toml").write_text(f'[[tenants]]\nid = "acme"\napi_key = "{key}"\n')
        auth = Auth(load_tenants(tmp_path / "tenants.toml"))
        with Engine(str(tiny_llama), kv_cache_tokens=1024, chunked_prefill_size=64, kv_disk_dir=str(tmp_path / "kv"),
                    kv_disk_block_tokens=16) as e:
            state = ServerState(e, ServerConfig(), auth, "m")
            tenant = auth.authenticate(f"Bearer {key}")
            reqs = state._make_reqs(tenant, [prompt], [params], None, RequestOptions(), 0)
            out = asyncio.run(final_outputs(e, reqs))[0]
            state.executor.shutdown()
            e.check_integrity()
            return out.cached_tokens

    assert run("key-1") == 0
    assert run("key-2") == 0  # before: the old owner's 192 tokens, from disk
    assert run("key-1") == 192  # the first owner's blocks are there: 12 whole blocks of 16


# -- over HTTP -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def limits(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("limits")
    (d / "tenants.toml").write_text(TENANTS)
    s = ServerProcess(tiny_llama, "--kv-cache-tokens", "4096", "--context-length", str(CONTEXT), "--tenants",
                      str(d / "tenants.toml"), log=d / "server.log")
    yield s
    assert s.stop() == 0, s.log.read_text()


def _post(s: ServerProcess, path: str, body: bytes | dict, key: str,
          content_type: str | None = "application/json") -> tuple[int, dict]:
    """POST as sent, with exactly these headers (None: no Content-Type at all, which urllib would add)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}", **({"Content-Type": content_type} if content_type else {})}
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=scaled(120))
    try:
        conn.request("POST", path, data, headers)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def _message(reply: dict) -> str:
    return reply["error"]["message"]


def test_kv_tiers_are_for_admins_only(limits):
    _, plain = limits.get("/server_info", "key-plain")
    _, ops = limits.get("/server_info", "key-ops")
    assert "kv_tiers" not in plain and "kv" not in plain and plain["tenant"]["id"] == "plain"
    assert ops["kv_tiers"]["device"]["capacity_tokens"] > 0 and "kv_capacity_tokens" in plain


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/chat/completions", {**CHAT, "prompt_cache_retention": "24h"}, "prompt_cache_retention"),
    ("/v1/responses", {**RESPONSES, "prompt_cache_retention": "24h"}, "prompt_cache_retention"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}, "prompt_cache_retention": "1h"},
     "prompt_cache_retention"),
    ("/v1/messages", {**MESSAGES, "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
     "system[0].cache_control.ttl"),
    ("/v1/messages", {**MESSAGES, "cache_control": {"type": "ephemeral", "ttl": "1h"}}, "cache_control.ttl"),
])
def test_retention_past_the_tenants_max_cache_retention_is_a_400_naming_the_field(limits, path, body, field):
    status, r = _post(limits, path, body, "key-plain")
    assert status == 400 and field in _message(r) and "max_cache_retention" in _message(r), r
    if path != "/v1/messages":
        assert r["error"]["param"] == field and r["error"]["code"] == "retention_not_allowed", r
    assert _post(limits, path, body, "key-ops")[0] == 200  # 24h allowed
    hourly = _post(limits, path, body, "key-hourly")[0]
    assert hourly == (400 if "24h" in json.dumps(body) else 200)


def test_the_default_retention_stays_open_to_every_tenant(limits):
    five = {**MESSAGES, "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}]}
    assert _post(limits, "/v1/messages", five, "key-plain")[0] == 200
    assert _post(limits, "/v1/chat/completions", {**CHAT, "prompt_cache_retention": "in_memory"}, "key-plain")[0] == 200


def _rss_mib(s: ServerProcess) -> float:
    req = urllib.request.Request(s.url + "/metrics", headers={"Authorization": "Bearer key-ops"})
    with urllib.request.urlopen(req, timeout=scaled(30)) as r:
        text = r.read().decode()
    return float(re.search(r"^process_resident_memory_bytes (\S+)", text, re.M).group(1)) / 2**20


def test_a_cache_control_bomb_is_refused_at_once(limits):
    body = json.dumps(_marked(20000)).encode()  # 1.5 MB: before, 3.8 s and +2 GiB of server memory
    before = _rss_mib(limits)
    t0 = time.monotonic()
    status, r = _post(limits, "/v1/messages", body, "key-plain")
    took = time.monotonic() - t0
    assert status == 400 and "messages[0].content[4].cache_control" in _message(r), r
    assert took < scaled(2.0) and _rss_mib(limits) - before < 64, (took, before)


SALT = "s" * (6 << 20)


@pytest.mark.parametrize(("path", "body"), [
    ("/generate", {"text": "hi", "cache_salt": SALT}),
    ("/v1/chat/completions", {**CHAT, "cache_salt": SALT}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "cache_salt": SALT}),
    ("/v1/responses", {**RESPONSES, "cache_salt": SALT}),
    ("/v1/messages", {**MESSAGES, "cache_salt": SALT}),
])
def test_a_huge_cache_salt_is_a_400_naming_it_on_every_route(limits, path, body):
    status, r = _post(limits, path, body, "key-plain")
    assert status == 400 and "cache_salt" in _message(r), r


@pytest.mark.parametrize(("path", "body"), [
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}}),
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("/v1/responses", RESPONSES),
    ("/v1/messages", MESSAGES),
    ("/v1/messages/count_tokens", {"model": "", "messages": USER}),
    ("/abort_request", {"rid": "nothing"}),
])
def test_a_body_not_sent_as_json_is_a_415_naming_the_header(limits, path, body):
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        status, r = _post(limits, path, body, "key-plain", kind)
        assert status == 415 and "Content-Type" in _message(r), (kind, r)
    status, r = _post(limits, path, body, "key-plain", "application/json; charset=utf-8")
    assert status == (404 if path == "/abort_request" else 200), r


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/chat/completions", {**CHAT, "temperature": 5}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "temperature": 2.01}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "temperature": 2.5}, "temperature"),
    ("/v1/responses", {**RESPONSES, "temperature": 3}, "temperature"),
    ("/v1/responses", {**RESPONSES, "top_p": 1.5}, "top_p"),
    ("/v1/messages", {**MESSAGES, "temperature": 1.5}, "temperature"),
    ("/v1/messages", {**MESSAGES, "top_p": 1.5}, "top_p"),
])
def test_sampling_outside_the_apis_ranges_is_a_400_naming_the_field(limits, path, body, field):
    status, r = _post(limits, path, body, "key-plain")
    assert status == 400 and _message(r).startswith(field), r


def test_the_apis_range_edges_and_sglangs_own_rules_are_accepted(limits):
    assert _post(limits, "/v1/chat/completions", {**CHAT, "temperature": 2}, "key-plain")[0] == 200
    assert _post(limits, "/v1/messages", {**MESSAGES, "temperature": 1}, "key-plain")[0] == 200
    hot = {"text": "hi", "sampling_params": {"max_new_tokens": 1, "temperature": 5}}
    assert _post(limits, "/generate", hot, "key-plain")[0] == 200


def test_a_chat_without_max_tokens_runs_to_the_end_of_the_context_window(limits):
    body = {"messages": USER, "temperature": 0, "ignore_eos": True}
    status, r = _post(limits, "/v1/chat/completions", body, "key-plain")
    assert status == 200, r
    u = r["usage"]
    assert u["completion_tokens"] == CONTEXT - u["prompt_tokens"] > 128 and r["choices"][0]["finish_reason"] == "length"
    native = {"text": "hi", "sampling_params": {"temperature": 0, "ignore_eos": True}}
    status, r = _post(limits, "/generate", native, "key-plain")
    assert status == 200 and r["meta_info"]["completion_tokens"] == 128, r  # SGLang's native default


# -- request rate ----------------------------------------------------------------------------------
def test_the_rate_limiter_allows_the_burst_then_the_rate_and_charges_nothing_for_a_refusal():
    now = [100.0]
    rl, t = RateLimiter(lambda: now[0]), Tenant("t", api_key="k", max_requests_per_second=4, max_request_burst=2)
    assert [rl.wait(t) for _ in range(2)] == [0.0, 0.0]  # the burst
    assert rl.wait(t) == pytest.approx(0.25)  # then one every 1/4 s
    assert rl.wait(t) == pytest.approx(0.25)  # a refusal counts nothing
    now[0] += 0.25
    assert rl.wait(t) == 0.0 and rl.wait(t) == pytest.approx(0.25)
    now[0] += 10
    assert [rl.wait(t) for _ in range(3)][:2] == [0.0, 0.0]  # idle: the burst again, no more
    assert rl.wait(Tenant("free", api_key="f")) == 0.0  # no limit set: never waits
    assert Tenant("d", api_key="k", max_requests_per_second=0.5).request_burst == 1
    ten = Tenant("big", api_key="k", max_requests_per_second=10, max_request_burst=10)
    assert units(100) == 1 and units(5 << 16) == 6
    assert rl.wait(ten, units(5 << 16)) == 0.0  # a 320 KiB body counts 6 requests
    assert rl.wait(ten, 5) == pytest.approx(0.1) and rl.wait(ten, 4) == 0.0
    rl.charge(ten, 3)  # a chunked body, counted once read
    assert rl.wait(ten) == pytest.approx(0.4)
    assert rl.wait(ten, 1000) == pytest.approx(1.3)  # never more than the burst
    late = RateLimiter(lambda: 13881.320236085)  # a monotonic clock hours after boot: rounding at the edge
    twenty = Tenant("t20", api_key="k", max_requests_per_second=20)
    assert late.wait(twenty, 20) == 0.0 and late.wait(twenty, 20) > 0.9  # (it once let the second in uncounted)
    for bad in ({"max_requests_per_second": 0}, {"max_requests_per_second": float("inf")}, {"max_request_burst": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Tenant("x", api_key="k", **bad)


def test_over_its_rate_a_tenant_gets_a_paced_429_before_its_body_is_read(limits):
    """Issue 44's abuse bench: a tenant flooding refusals (a retention it may not ask, 6 MiB salts)
    made the server read and decode ~830 requests a second beside the other tenants' work."""
    statuses = [limits.get("/v1/models", "key-metered")[0] for _ in range(3)]
    assert statuses == [200, 200, 200]  # the burst
    big = json.dumps({**CHAT, "cache_salt": "x" * (3 << 20)}).encode()  # would be a 400 once read: never read
    conn = http.client.HTTPConnection("127.0.0.1", limits.port, timeout=scaled(30))
    try:
        t0 = time.perf_counter()
        conn.putrequest("POST", "/v1/chat/completions")
        for k, v in {"Authorization": "Bearer key-metered", "Content-Type": "application/json",
                     "Content-Length": str(len(big))}.items():
            conn.putheader(k, v)
        conn.endheaders()  # the headers alone: the answer comes before the body is sent
        r = conn.getresponse()
        took, reply = time.perf_counter() - t0, json.loads(r.read())
        assert r.status == 429 and reply["error"]["code"] == "rate_limited", reply
        assert "2 requests a second" in _message(reply) and r.getheader("Retry-After") is not None
        assert r.getheader("Connection") == "close"  # the unread body is never drained
        assert 0.2 <= took <= MAX_PACE_S + scaled(1.0), took  # paced: answered when the next request would be allowed
    finally:
        conn.close()
    assert limits.get("/v1/models", "key-plain")[0] == 200  # other tenants are not counted
    time.sleep(0.6)
    assert limits.get("/v1/models", "key-metered")[0] == 200  # the rate goes on
