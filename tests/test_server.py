"""The HTTP server as users meet it: real `radixserve serve` processes on free ports (tiny
random model), the official `openai` client, the native /generate, auth, overload,
disconnects, bad input, metrics and graceful shutdown."""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from helpers import scripted_server
from server_helpers import USER, ServerProcess, scaled


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]




def test_openai_chat_returns_text_and_usage_with_cached_tokens(client, model):
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=8, temperature=0)
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 1 <= r.usage.completion_tokens <= 8
    again = client.chat.completions.create(model=model, messages=USER, max_completion_tokens=8, temperature=0)
    assert again.choices[0].message.content == r.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_openai_streaming_matches_the_whole_answer_and_ends_with_usage(client, model):
    whole = client.chat.completions.create(model=model, messages=USER, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=model, messages=USER, max_tokens=12, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_openai_n_seed_stop_and_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=6, temperature=1.0, n=3, seed=7,
                                       logprobs=True, top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert len(c.logprobs.content) >= 1 and all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    again = client.chat.completions.create(model=model, messages=USER, max_tokens=6, temperature=1.0, n=3, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]  # seeded
    whole = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=10, temperature=0)
    stop = whole.choices[0].text[3:5]
    cut = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=10, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert whole.choices[0].text.startswith(cut.choices[0].text)
    lp = client.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0, logprobs=2)
    assert len(lp.choices[0].logprobs.token_logprobs) == 3 and all(len(t) <= 2 for t in lp.choices[0].logprobs.top_logprobs)


def test_native_generate_with_logprobs_and_streaming(server):
    body = {"input_ids": _ids(20, 1), "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 3}
    status, r = server.post("/generate", body)
    assert status == 200, r
    meta = r["meta_info"]
    assert meta["completion_tokens"] == 5 and meta["finish_reason"]["type"] == "length"
    assert [t[1] for t in meta["output_token_logprobs"]] == r["output_ids"]
    assert all(len(top) == 3 for top in meta["output_top_logprobs"])
    status, batch = server.post("/generate", {"text": ["Hello", "The fox"], "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and len(batch) == 2
    import urllib.request

    req = urllib.request.Request(server.url + "/generate", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as resp:
        events = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["output_ids"] == r["output_ids"] and last["text"] == r["text"]


def test_four_concurrent_forks_share_the_system_prompt(server, model):
    system = {"role": "system", "content": " ".join(["agents branch into parallel tool calls"] * 40)}

    async def fork() -> list[int]:
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        calls = [c.chat.completions.create(model=model, messages=[system, {"role": "user", "content": f"Branch {i}"}],
                                           max_tokens=4, temperature=0) for i in range(4)]
        rs = await asyncio.gather(*calls)
        await c.close()
        return sorted(r.usage.prompt_tokens_details.cached_tokens for r in rs)

    assert server.post("/flush_cache", b"")[0] == 200
    cached = asyncio.run(fork())
    assert cached[0] == 0 and all(x > 200 for x in cached[1:]), cached  # one computed it, three hit it
    assert server.wait_idle()["kv_in_use_slots"] == 0


def test_concurrent_requests_with_one_rid_get_one_answer_and_the_rest_a_400(server):
    body = {"input_ids": _ids(40, 21), "rid": "same", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: server.post("/generate", body), range(3)))
    statuses = sorted(st for st, _ in results)
    assert statuses[0] == 200 and all(st in (200, 400) for st in statuses), results
    for st, r in results:
        if st == 200:
            assert r["meta_info"]["completion_tokens"] == 8 and r["meta_info"]["id"] == "same"
        else:
            assert "already in flight" in r["error"]["message"]
    kv = server.wait_idle()
    assert kv["kv_in_use_slots"] == 0 and kv["kv_locked_tokens"] == 0


def test_a_returned_assistant_message_can_be_sent_back(client, model):
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=4, temperature=0)
    again = client.chat.completions.create(model=model, max_tokens=4, temperature=0,
                                           messages=[*USER, r.choices[0].message.model_dump(), USER[0]])
    assert again.usage.prompt_tokens > r.usage.prompt_tokens


def test_a_client_vanishing_mid_stream_aborts_and_frees_its_kv(server):
    body = json.dumps({"input_ids": _ids(50, 3), "stream": True,
                       "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        got = b""
        while got.count(b"data: ") < 3:
            got += sock.recv(65536)
    kv = server.wait_idle()
    assert kv["kv_in_use_slots"] == 0 and kv["running"] == 0
    _, metrics = server.get("/server_info")
    status, text = _metrics(server)
    assert 'radixserve_requests_total{finish_reason="abort"}' in text


def _metrics(server) -> tuple[int, str]:
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics") as r:
        return r.status, r.read().decode()


def test_metrics_and_openapi_describe_the_server(server):
    status, text = _metrics(server)
    for name in ("radixserve_time_to_first_token_seconds_bucket", "radixserve_time_per_output_token_seconds_count",
                 "radixserve_e2e_request_latency_seconds_sum", "radixserve_goodput_requests_total",
                 "radixserve_queued_requests", "radixserve_cache_hit_rate", "radixserve_prefill_tokens_computed_total",
                 "radixserve_rejected_requests_total"):
        assert name in text, name
    _, doc = server.get("/openapi.json")
    assert {"/generate", "/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(doc["paths"])
    assert "ChatCompletionRequest" in doc["components"]["schemas"]
    _, info = server.get("/server_info")
    assert info["max_context_len"] == 2048 and "im_start" in info["chat_template"] and "kv_total_slots" in info["kv"]
    signals = info["autoscaling"]  # what a Ray replica reports to the autoscaler (radixserve/ray/autoscale.py)
    from radixserve.ray.autoscale import SIGNALS

    assert set(signals) == {*SIGNALS, "ttft_p90_s"}
    assert signals["waiting"] == signals["waiting_tokens"] == 0 and 0 <= signals["kv_usage"] <= 1
    assert 0 <= signals["ttft_per_1k_p90_s"] <= signals["ttft_p90_s"]


# -- tenants ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tenant_server(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("tenants")
    (d / "tenants.toml").write_text(
        '[[tenants]]\nid = "acme"\napi_key = "key-acme"\npriority = 1\n\n'
        '[[tenants]]\nid = "globex"\napi_key = "key-globex"\nmax_queued_requests = 8\n'
    )
    s = ServerProcess(tiny_llama, "--kv-cache-tokens", "8192", "--tenants", str(d / "tenants.toml"), log=d / "server.log")
    yield s
    assert s.stop() == 0


def test_missing_or_wrong_api_keys_get_401(tenant_server):
    assert tenant_server.post("/generate", {"text": "hi"})[0] == 401
    status, r = tenant_server.post("/generate", {"text": "hi"}, key="key-nope")
    assert status == 401 and "invalid API key" in r["error"]["message"]
    assert tenant_server.get("/v1/models")[0] == 401
    assert tenant_server.get("/health")[0] == 200


def test_tenants_never_share_cache_and_salts_split_a_tenants_namespace(tenant_server):
    ids = _ids(120, 9)

    def cached(key: str, **extra) -> int:
        status, r = tenant_server.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, **extra}, key)
        assert status == 200, r
        return r["meta_info"]["cached_tokens"]

    assert cached("key-acme") == 0
    assert cached("key-globex") == 0  # the same prompt, another tenant: no hit
    assert cached("key-acme") == 119
    assert cached("key-acme", cache_salt="s") == 0
    assert cached("key-acme", cache_salt="s") == 119
    status, r = tenant_server.post("/generate", {"input_ids": ids, "public_prefix_len": 10}, "key-globex")
    assert status == 403 and "public_prefix_len" in r["error"]["message"]
    status, r = tenant_server.post("/flush_cache", b"", "key-globex")
    assert status == 403 and "admin" in r["error"]["message"]
    assert cached("key-acme") == 119  # nobody flushed acme's prefixes


def test_a_key_that_is_not_utf8_is_a_401_not_a_500(tenant_server):
    with socket.create_connection(("127.0.0.1", tenant_server.port)) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n")
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 401"), head[:80]


# -- overload and shutdown -------------------------------------------------------------------
def test_overload_rejects_the_excess_at_once_and_completes_the_rest(tiny_llama, tmp_path):
    s = ServerProcess(tiny_llama, "--kv-cache-tokens", "16384", "--chunked-prefill-size", "64",
                      "--max-queued-requests", "4", log=tmp_path / "server.log")
    try:
        body = {"input_ids": _ids(600, 4), "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
        with ThreadPoolExecutor(40) as pool:
            results = list(pool.map(lambda i: s.post("/generate", {**body, "input_ids": _ids(600, 100 + i)}), range(40)))
        statuses = [st for st, _ in results]
        assert set(statuses) <= {200, 503} and statuses.count(503) > 0 and statuses.count(200) >= 4
        rejected = next(r for st, r in results if st == 503)
        assert "overloaded" in rejected["error"]["message"]
        too_many = s.post("/v1/chat/completions", {"messages": USER, "n": 5, "max_tokens": 2})
        assert too_many[0] == 400 and "can never be admitted" in too_many[1]["error"]["message"]
        assert all(r["meta_info"]["completion_tokens"] == 8 for st, r in results if st == 200)
        kv = s.wait_idle()
        assert kv["kv_in_use_slots"] == 0
    finally:
        assert s.stop() == 0


def test_sigterm_drains_running_requests_refuses_new_ones_and_exits_0(tiny_llama, tmp_path):
    s = ServerProcess(tiny_llama, "--kv-cache-tokens", "8192", log=tmp_path / "server.log")
    box = {}

    def long_request() -> None:
        box["result"] = s.post("/generate", {"input_ids": _ids(30, 5), "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}})

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + scaled(30)
    while s.get("/server_info")[1]["kv"]["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    s.proc.send_signal(15)
    time.sleep(0.3)
    status, r = s.post("/generate", {"text": "hi"})
    assert status == 503 and "shutting down" in r["error"]["message"]
    t.join()
    status, r = box["result"]
    assert status == 200 and r["meta_info"]["completion_tokens"] == 400
    assert s.proc.wait(30) == 0


def test_bench_serving_sweeps_rates_and_clients_and_plots(server, tmp_path):
    from radixserve.cli import main

    out, png = tmp_path / "serving.json", tmp_path / "serving.png"
    rc = main(["bench", "serving", "--url", server.url, "--rates", "4", "--concurrency", "2", "--requests", "3",
               "--output-len", "4", "--system-sentences", "5", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    data = json.loads(out.read_text())
    chat = data["open_loop"]["chat"][0]
    assert chat["completed"] == chat["requests"] == 3 and chat["ttft_p50_ms"] is not None
    fork = data["closed_loop"]["fork"][0]
    assert fork["completed"] == fork["requests"] == 12 and fork["output_tok_s"] > 0  # 3 agents x 4 branches
    assert png.stat().st_size > 10_000


def test_structured_outputs_over_http_always_parse(server, client, model):
    from pydantic import BaseModel, Field

    class Answer(BaseModel):
        city: str = Field(max_length=10)
        rank: int = Field(ge=0, le=99)  # bounded, so a random model's answer always fits max_tokens

    parsed = client.chat.completions.parse(model=model, messages=USER, response_format=Answer, max_tokens=200, temperature=0.7, seed=1)
    assert isinstance(parsed.choices[0].message.parsed, Answer)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]},
              "maxItems": 2}}, "required": ["ok", "tags"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=200, seed=2, response_format=fmt)
    import jsonschema

    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    sp = {"regex": "[A-C]{2}-[0-9]{3}", "max_new_tokens": 20}
    status, g = server.post("/generate", {"input_ids": _ids(10, 7), "sampling_params": sp})
    assert status == 200 and len(g["text"]) == 6 and g["meta_info"]["finish_reason"]["type"] == "stop"
    bad = {"type": "object", "properties": {"x": {"oneOf": [{"type": "integer"}, {"type": "string"}]}}}
    status, err = server.post("/v1/chat/completions", {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "b", "schema": bad, "strict": True}}})
    assert status == 400 and "oneOf at /properties/x/oneOf" in err["error"]["message"], err
    status, _ = server.post("/v1/chat/completions", {"messages": USER, "max_tokens": 50, "response_format": {
        "type": "json_schema", "json_schema": {"name": "b", "schema": bad, "strict": False}}})
    assert status == 200  # not strict: enforced as far as the backend can


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_tool_calls_required_named_and_streamed(client, model):
    import jsonschema

    r = client.chat.completions.create(model=model, messages=USER, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=120, seed=3)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    params = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), params)
    named = client.chat.completions.create(model=model, messages=USER, tools=[WEATHER, TIME], max_tokens=120, seed=4,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_time"
    chunks = list(client.chat.completions.create(model=model, messages=USER, tools=[WEATHER], tool_choice="required",
                                                 max_tokens=120, seed=5, stream=True))
    deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or []) if ch.choices]
    assert deltas and deltas[0].function.name == "get_weather"
    history = [*USER, named.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": named.choices[0].message.tool_calls[0].id, "content": "12:00"}]
    followup = client.chat.completions.create(model=model, messages=history, tools=[WEATHER, TIME], max_tokens=8)
    assert followup.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError, match="no tool is named"):
        client.chat.completions.create(model=model, messages=USER, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


def test_a_slow_grammar_times_out_with_a_400_while_other_requests_complete(tiny_llama, tmp_path):
    s = ServerProcess(tiny_llama, "--kv-cache-tokens", "4096", "--grammar-backend", "outlines",
                      "--grammar-compile-timeout", "0.3", log=tmp_path / "server.log")
    try:
        slow = {"input_ids": _ids(8, 1), "sampling_params": {"regex": "(a|b)*a(a|b){17}", "max_new_tokens": 4}}
        plain = {"input_ids": _ids(8, 2), "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}
        with ThreadPoolExecutor(2) as pool:
            slow_f = pool.submit(s.post, "/generate", slow)
            plain_f = pool.submit(s.post, "/generate", plain)
            (status, err), (ok, out) = slow_f.result(), plain_f.result()
        assert status == 400 and "grammar_compile_timeout of 0.3 s" in err["error"]["message"], err
        assert ok == 200 and out["meta_info"]["completion_tokens"] == 16
        assert s.wait_idle()["kv_in_use_slots"] == 0
    finally:
        assert s.stop() == 0


def test_bench_compare_runs_every_workload_on_each_server_and_prints_ratios(server, tmp_path, capsys):
    from radixserve.cli import main

    out = tmp_path / "compare.json"
    rc = main(["bench", "compare", "--url", server.url, "--name", "a", "--url", server.url, "--name", "b",
               "--workloads", "single,batch,prefill,fork", "--repeats", "1", "--scale", "0.05", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data) == {"single", "batch", "prefill", "fork"}
    assert all(set(row) == {"a", "b"} and all(v > 0 for v in row.values()) for row in data.values())
    table = capsys.readouterr().out
    assert "| workload | a | b | a / b |" in table and table.count("x |") == 4


def test_bench_compare_roof_prints_the_first_servers_decode_step_against_the_machines_read_rate(server, tmp_path, capsys):
    from radixserve.cli import main

    out = tmp_path / "compare.json"
    assert main(["bench", "compare", "--url", server.url, "--name", "a", "--url", server.url, "--name", "b",
                 "--workloads", "single", "--repeats", "1", "--scale", "0.05", "--roof", "--json", str(out)]) == 0
    roof = json.loads(out.read_text())["memory_roof"]
    _, info = server.get("/server_info")
    assert roof["weight_bytes"] == info["step_weight_bytes"] and roof["step_ms"] > 0 and roof["read_roof_gb_s"] > 1
    assert roof["weights_gb_s"] == pytest.approx(roof["weight_bytes"] / roof["step_ms"] * 1e3 / 1e9)
    assert roof["share"] == pytest.approx(roof["weights_gb_s"] / roof["read_roof_gb_s"])
    shares = sorted(r["share"] for r in roof["rounds"])  # each round judged by the roof measured beside it
    assert len(shares) == 3 and roof["share"] == shares[1]
    assert all(r["share"] == pytest.approx(r["weights_gb_s"] / r["read_roof_gb_s"]) for r in roof["rounds"])
    assert "memory roof: a's decode step at batch 1" in capsys.readouterr().out


def test_bench_compare_counts_structured_outputs_that_do_not_parse_instead_of_dying(capsys):
    """A peer whose constrained output is cut off (llama-server at max_tokens) is a row with a
    count of failures, not a crash of the whole comparison."""
    import asyncio
    import types

    from aiohttp import web

    from radixserve.bench import compare

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        digits = re.findall(r"\d+", body["messages"][0]["content"])
        n = int(digits[0]) % 2 if digits else 0  # about half cut short (and the warm-up)
        content = '{"name": "Ada", "age": 3' + ("}" if n else "")
        return web.json_response({"choices": [{"message": {"content": content}}], "usage": {"completion_tokens": 7}})

    async def completions(request: web.Request) -> web.Response:
        return web.json_response({"usage": {"completion_tokens": 2}})

    async def go() -> dict:
        async with scripted_server({"/v1/chat/completions": chat, "/v1/completions": completions}) as url:
            args = types.SimpleNamespace(url=[url, url], name=["a", "b"], api_key=[], model="m", workloads="json",
                                         seed=1, repeats=1, scale=0.05)
            return await compare.compare(args)

    results = asyncio.run(go())
    assert results["json"]["a"] > 0 and 0 < results["json"]["a unparsed"] < 16
    compare.print_table(results)
    table = capsys.readouterr().out
    assert "did not parse" in table and "| json |" in table and table.count("x |") == 1


def test_streamed_completion_logprobs_offsets_run_on_and_models_retrieve_works(server, client, model):
    kw = dict(model=model, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=1)
    whole = client.completions.create(**kw).choices[0].logprobs
    offsets, tokens = [], []
    for chunk in client.completions.create(**kw, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            offsets += chunk.choices[0].logprobs.text_offset
            tokens += chunk.choices[0].logprobs.tokens
    assert tokens == whole.tokens and offsets == whole.text_offset  # not [0] in every chunk
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert client.models.retrieve(model).id == model
    import openai

    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


SGLANG_SAMPLING = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 6,
                   "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [], "temperature": 0.0,
                   "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                   "ignore_eos": True, "regex": None, "json_schema": None}  # what SGLang's RuntimeEndpoint sends


def _events(server, body: dict) -> list[dict]:
    import urllib.request

    req = urllib.request.Request(server.url + "/generate", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as resp:
        lines = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_native_generate_takes_every_field_sglangs_client_sends(server):
    status, r = server.post("/generate", {"text": "Agents branch.", "sampling_params": SGLANG_SAMPLING,
                                          "return_logprob": True, "top_logprobs_num": 0, "return_text_in_logprobs": True})
    assert status == 200, r
    meta = r["meta_info"]
    assert meta["completion_tokens"] == 6 and meta["output_token_logprobs_length"] == 6
    assert all(isinstance(t[2], str) for t in meta["output_token_logprobs"])  # return_text_in_logprobs: the token's text
    assert meta["input_token_logprobs"] == []  # asked for logprobs, not the prompt's: SGLang's empty list
    _, plain = server.post("/generate", {"text": "Agents branch.", "sampling_params": SGLANG_SAMPLING, "return_logprob": True})
    assert [t[2] for t in plain["meta_info"]["output_token_logprobs"]] == [None] * 6  # SGLang's default: no text
    status, bad = server.post("/generate", {"text": "x", "sampling_params": {**SGLANG_SAMPLING, "bogus": 1}})
    assert status == 400 and "bogus" in bad["error"]["message"]  # truly unknown fields are still refused
    for path in ("/get_model_info", "/model_info"):
        status, info = server.get(path)
        assert status == 200 and info["is_generation"] is True and info["model_path"] and info["max_context_len"] > 0
    assert server.get("/get_server_info")[1].keys() == server.get("/server_info")[1].keys()
    assert server.get("/health_generate")[0] == 200
    status, ok = server.post("/concate_and_append_request", {"src_rids": ["a", "b"], "dst_rid": "c"})
    assert status == 200 and ok["success"] is True
    status, bad = server.post("/concate_and_append_request", {"src_rids": "a"})
    assert status == 400 and "src_rids" in bad["error"]["message"]


def test_native_n_samples_each_prompt_in_sglangs_order(server):
    sp = {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True, "seed": 3}
    status, one = server.post("/generate", {"text": "Hello", "sampling_params": {**sp, "n": 3}})
    assert status == 200 and isinstance(one, list) and len(one) == 3
    assert len({tuple(x["output_ids"]) for x in one}) > 1  # seeded samples differ from each other
    status, batch = server.post("/generate", {"input_ids": [_ids(5, 1), _ids(9, 2)], "sampling_params": {**sp, "n": 2}})
    assert status == 200 and [x["meta_info"]["prompt_tokens"] for x in batch] == [5, 9, 5, 9]
    status, r = server.post("/generate", {"text": "Hello", "sampling_params": {**sp, "n": 0}})
    assert status == 400 and r["error"]["param"] == "sampling_params.n"
    status, r = server.post("/generate", {"text": "Hello", "stream": True, "sampling_params": {**sp, "n": 2}})
    assert status == 400 and r["error"]["param"] == "stream"
    cap = server.get("/server_info")[1]["max_queued_requests"]
    status, r = server.post("/generate", {"text": ["Hi"] * (cap // 64 + 1), "sampling_params": {**sp, "n": 64}})
    assert status == 400 and r["error"]["param"] == "sampling_params.n"  # what made it too many requests
    status, r = server.post("/generate", {"text": ["Hi"] * (cap + 1), "sampling_params": sp})
    assert status == 400 and r["error"]["param"] == "text"
    status, r = server.post("/generate", {"text": "Hi", "sampling_params": {**sp, "n": 2, "seed": 2**63 - 1}})
    assert status == 200  # the second sample's seed wraps around
    status, r = server.post("/generate", {"text": "Hi", "sampling_params": {"temperature": -1}})
    assert status == 400 and r["error"]["param"] == "sampling_params.temperature"


def test_native_stop_regex_stops_at_the_match_and_keeps_it(server):
    base = {"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    _, whole = server.post("/generate", base)
    pattern = re.escape(whole["text"][4:7])
    cut_at = whole["text"].find(whole["text"][4:7]) + 3
    status, r = server.post("/generate", {**base, "sampling_params": {**base["sampling_params"], "stop_regex": [pattern]}})
    assert status == 200, r
    assert r["text"] == whole["text"][:cut_at] and r["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern,
                                                                                        "message": None}
    status, bad = server.post("/generate", {**base, "sampling_params": {"stop_regex": "(a+)+"}})
    assert status == 400 and bad["error"]["param"] == "sampling_params.stop_regex"
    # A pattern that passes the checks but backtracks on this output ends its own request, saying why
    status, slow = server.post("/generate", {"text": "x", "sampling_params": {
        "max_new_tokens": 100, "regex": "a{90}c", "stop_regex": "(a|aa)+b"}})
    assert status == 200 and slow["meta_info"]["finish_reason"]["type"] == "error"
    assert "backtrack" in slow["meta_info"]["finish_reason"]["message"]
    assert server.post("/generate", base)[1]["text"] == whole["text"]  # the engine goes on


def test_native_logprobs_of_a_scored_prompt_and_of_a_stream(server):
    ids = [_ids(6, 3), _ids(4, 4)]
    status, r = server.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True})
    assert status == 200
    for x, want in zip(r, ids):  # nothing generated, no logprob_start_len: the whole prompt (SGLang's unconditional select)
        lps = x["meta_info"]["input_token_logprobs"]
        assert [t[1] for t in lps] == want and lps[0][0] is None and all(t[0] < 0 for t in lps[1:])
    events = _events(server, {"input_ids": _ids(8, 5), "return_logprob": True,
                              "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    seen = 0
    for e in events:
        meta = e["meta_info"]
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"] == len(e["output_ids"])
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - seen  # each event's new tokens only
        seen = meta["completion_tokens"]
    assert seen == 6
