"""Reliability: the bad-input matrix (every case a precise 4xx naming the problem, and the
server still serving), faults confined to their own request, a bounded soak that ends with
no KV in use beyond the cache and a clean integrity check."""

from __future__ import annotations

import json
import random
import re
import urllib.request

import jsonschema
import pytest
import schemathesis
from helpers import assert_no_leak
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error, response_schema_conformance
from server_helpers import MAX_BODY, USER, ServerProcess, scaled

from radixserve import SamplingParams

FN = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}


BAD = [
    ("/v1/chat/completions", b'{"messages": [', 400, "not valid JSON"),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "JSON"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}', 400, "temperature"),
    ("/v1/chat/completions", {"messages": USER, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": USER, "frobnicate": True}, 400, "frobnicate"),
    ("/v1/chat/completions", {"messages": USER, "model": "gpt-9"}, 404, "gpt-9"),
    ("/v1/chat/completions", {"messages": USER, "n": 1000}, 400, "n:"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 100000}, 400, "context window"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": USER, "regex": "(?<=a)b"}, 400, "regex"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("/generate", {}, 400, "text"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, 400, "temperature"),
    ("/generate", {"input_ids": [10**9]}, 400, "input_ids"),
    ("/generate", {"input_ids": [5] * 3000}, 400, "context window"),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "(?<=a)b"}}, 400, "sampling_params.regex"),
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": "{not json"}}, 400, "sampling_params.json_schema"),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}, 400, "at most one"),
    ("/generate", b"\xff\xfe\x00", 400, "JSON"),
    ("/generate", b'{"text": "' + b"a" * (MAX_BODY + 10) + b'"}', 413, "larger than"),
    ("/abort_request", {"rid": "no-such-request"}, 404, "no-such-request"),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 21}, 400, "top_logprobs_num"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": [f"s{i}" for i in range(17)]}}, 400, "stop"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    # -- added for the reliability matrix --
    ("/v1/chat/completions", b"", 400, "JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, "object"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "JSON"),
    ("/v1/chat/completions", {"messages": USER, "top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": USER, "top_p": -0.1}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": USER, "temperature": -0.5}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": USER, "temperature": 5}, 400, "temperature"),  # OpenAI's range: [0, 2]
    ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": USER, "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/chat/completions", {"messages": USER, "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 10**12}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": -5}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": USER, "seed": "x"}, 400, "seed"),
    ("/v1/chat/completions", {"messages": USER, "stop": 5}, 400, "stop"),
    ("/v1/chat/completions", {"messages": USER, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"messages": USER, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "sometimes", "tools": [FN]}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": USER, "tools": [FN], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     400, "nope"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                                    "schema": {"type": 5}}}},
     400, "response_format"),
    ("/v1/chat/completions", {"messages": USER, "ebnf": "root ::= ("}, 400, "ebnf"),
    ("/v1/chat/completions", {"messages": USER, "regex": "a", "ebnf": 'root ::= "a"'}, 400, "at most one"),
    ("/v1/chat/completions", {"messages": USER, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 3000}]}, 400, "context window"),
    ("/v1/chat/completions", {"messages": USER, "priority": "high"}, 400, "priority"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": [[]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "nope"}, 404, "nope"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n:"),
    ("/v1/completions", {"prompt": "word " * 3000}, 400, "context window"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "temperature": "warm"}, 400, "temperature"),
    ("/generate", {"text": ["a", 5]}, 400, "text"),
    ("/generate", {"text": []}, 400, "text: a batch of prompts must not be empty"),  # found by the fuzzer (a 200 with [])
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/generate", {"text": "hi", "input_ids": [5]}, 400, "exactly one"),
    ("/generate", {"input_ids": []}, 400, "input_ids"),
    ("/generate", {"input_ids": [-1]}, 400, "input_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"min_new_tokens": 10, "max_new_tokens": 5}}, 400, "min_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"frobnicate": 1}}, 400, "frobnicate"),
    ("/generate", {"text": "hi", "sampling_params": {"ebnf": "root ::= ("}}, 400, "sampling_params.ebnf"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": -5}}, 400, "top_k"),
    ("/generate", {"text": "hi", "priority": "high"}, 400, "priority"),
    ("/generate", {"text": "hi", "priority": -9754709280149553020928}, 400, "priority"),  # past int64: found by the fuzzer
    ("/generate", {"text": "hi", "public_prefix_len": -3}, 400, "public_prefix_len"),
    ("/generate", {"text": "hi", "rid": 5}, 400, "rid"),
    ("/generate", {"text": ["a", "b"], "stream": True}, 400, "stream"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": "x" * 5000}}, 400, "stop"),
    ("/generate", b'{"text": "hi", "sampling_params": {"temperature": 1e400}}', 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens: 9 is more than max_tokens"),
]


@pytest.mark.parametrize(("path", "body", "status", "needle"), BAD)
def test_bad_input_gets_a_4xx_naming_the_problem_and_the_server_keeps_serving(server, path, body, status, needle):
    got, r = server.post(path, body)
    assert got == status, r
    assert needle in r["error"]["message"] and r["error"]["type"], r
    ok, _ = server.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}})
    assert ok == 200


def test_the_matrix_covers_every_endpoint_fifty_times_over():
    assert len(BAD) >= 50 and {p for p, *_ in BAD} >= {"/generate", "/v1/chat/completions", "/v1/completions"}


# -- faults: each confined to its own request ----------------------------------------------------
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
POISON = [9, 9, 9, 9]


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 380) for _ in range(rng.randint(5, 90))] for _ in range(n)]


def test_a_forward_step_that_fails_for_one_request_fails_only_that_request(tiny_engine):
    """A poison request (the hook raises whenever a step holds it, from its 4th token on) fails
    alone; the requests batched with it finish with their solo greedy outputs."""
    prompts = _prompts(5, seed=1)
    solo = [tiny_engine.generate([p], GREEDY)[0].token_ids for p in prompts]

    def hook(plan):
        if any(it.req.token_ids[:4] == POISON and it.req.output_len >= 3 for it in plan.items):
            raise RuntimeError("injected fault")

    tiny_engine.runner.fault_hook = hook
    try:
        outs = tiny_engine.generate([*prompts, POISON + prompts[0]], GREEDY)
    finally:
        tiny_engine.runner.fault_hook = None
    assert [o.token_ids for o in outs[:5]] == solo
    bad = outs[5]
    assert bad.finish_reason == "error" and "injected fault" in bad.error and bad.completion_tokens == 3
    assert_no_leak(tiny_engine)


def test_a_grammar_compile_that_raises_fails_only_its_request(tiny_engine, monkeypatch):
    import functools

    from grammar_fakes import poisoned

    from grammars.cache import CompileCache

    real = tiny_engine.grammars()  # the engine's backend, compiling in workers that raise on "poison"
    cache = CompileCache(functools.partial(poisoned, real.factory), timeout_s=real.timeout_s)
    monkeypatch.setattr(tiny_engine, "_grammar_cache", cache)
    try:
        ok = SamplingParams(temperature=0.0, max_new_tokens=8, regex="[a-z]{2,6}")
        with pytest.raises(ValueError, match="injected compile fault"):  # a MemoryError, not a GrammarError
            tiny_engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, regex="poison|[0-9]+"))
        out = tiny_engine.generate([[5, 6, 7]], ok)[0]
        assert re.fullmatch("[a-z]{2,6}", out.text), out
        assert_no_leak(tiny_engine)
    finally:
        cache.shutdown()


def test_a_detokenizer_failure_fails_only_its_request(tiny_engine, monkeypatch):
    from radixserve.engine import detokenizer

    cls = detokenizer.IncrementalDetokenizer
    real_init, real_add = cls.__init__, cls.add

    def init(self, tokenizer, prompt_ids, *args, **kwargs):
        real_init(self, tokenizer, prompt_ids, *args, **kwargs)
        self.poison_tokens = 0 if list(prompt_ids[:4]) == POISON else None

    def add(self, tok):
        if self.poison_tokens is not None:
            self.poison_tokens += 1
            if self.poison_tokens == 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected tokenizer fault")
        return real_add(self, tok)

    monkeypatch.setattr(cls, "__init__", init)
    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "add", add)
    prompts = _prompts(3, seed=2)
    outs = tiny_engine.generate([*prompts, POISON + prompts[0]], GREEDY)
    assert all(o.finish_reason == "length" and o.completion_tokens == 12 for o in outs[:3])
    assert outs[3].finish_reason == "error" and "injected tokenizer fault" in outs[3].error
    assert_no_leak(tiny_engine)


# -- memory pressure -----------------------------------------------------------------------------
def test_many_long_requests_on_a_small_pool_finish_with_their_solo_outputs_and_an_impossible_one_is_refused(tiny_llama):
    from radixserve import Engine

    prompts = [p + p for p in _prompts(10, seed=3)]  # 10..180 tokens each
    params = SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True)
    with Engine(str(tiny_llama), kv_cache_tokens=8192) as big:
        solo = [big.generate([p], params)[0].token_ids for p in prompts]
    need = sum(len(p) for p in prompts) + 60 * len(prompts)
    with Engine(str(tiny_llama), kv_cache_tokens=need // 3, chunked_prefill_size=64) as small:
        with pytest.raises(ValueError, match="exceeds the whole KV pool"):  # up front, not a deadlock later
            small.generate([[5] * 390], SamplingParams(max_new_tokens=need // 3))
        outs = small.generate(prompts, params)  # together they need 3x the pool: retraction and re-admission
        assert [o.token_ids for o in outs] == solo
        assert small.stats().retractions > 0
        assert_no_leak(small)


# -- soak ----------------------------------------------------------------------------------------
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99}}, "required": ["x"],
         "additionalProperties": False}
KINDS = ("chat", "stream", "regex", "schema", "fork", "abort", "disconnect", "public", "bad")


async def _soak_one(session, url: str, key: str, kind: str, i: int, rng: random.Random) -> int:
    """One request of the mixed soak; returns its HTTP status."""
    h = {"Authorization": f"Bearer {key}"}
    system = f"You are tenant {key[:9]}'s assistant. " * 20
    question = f"Question {i}: " + " ".join(rng.choice(["tools", "json", "agents", "trees"]) for _ in range(rng.randint(1, 12)))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    if kind == "chat":
        body = {"messages": messages, "max_tokens": rng.randint(1, 24)}
        async with session.post(url + "/v1/chat/completions", json=body, headers=h) as r:
            await r.read()
            return r.status
    if kind in ("regex", "schema"):
        body = {"messages": messages, "max_tokens": 48, "temperature": 1.0}
        body.update(regex="[a-z]{2,8}") if kind == "regex" else body.update(
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": POINT}})
        async with session.post(url + "/v1/chat/completions", json=body, headers=h) as r:
            data = await r.json()
            if r.status == 200 and data["choices"][0]["finish_reason"] == "stop":
                text = data["choices"][0]["message"]["content"]
                assert re.fullmatch("[a-z]{2,8}", text) if kind == "regex" else -99 <= json.loads(text)["x"] <= 99, text
            return r.status
    if kind == "fork":
        body = {"text": [system + f" Branch {b}." for b in range(4)], "sampling_params": {"max_new_tokens": 8}}
        async with session.post(url + "/generate", json=body, headers=h) as r:
            await r.read()
            return r.status
    if kind == "public":
        body = {"text": system + question, "public_prefix_len": 40, "sampling_params": {"max_new_tokens": 4}}
        async with session.post(url + "/generate", json=body, headers=h) as r:
            await r.read()
            return r.status
    if kind == "bad":
        async with session.post(url + "/generate", json={"text": "hi", "sampling_params": {"top_p": 7}}, headers=h) as r:
            await r.read()
            return r.status
    rid = f"soak-{i}"
    body = {"text": system + question, "rid": rid, "stream": True, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    async with session.post(url + "/generate", json=body, headers=h) as r:
        if kind == "stream":
            body["sampling_params"]["max_new_tokens"] = 16
        async for line in r.content:
            if not line.startswith(b"data:"):
                continue
            if kind == "abort":
                async with session.post(url + "/abort_request", json={"rid": rid}, headers=h) as a:
                    await a.read()
                    assert a.status in (200, 404)  # 404: it finished first
                kind = "drain"  # read the rest: the stream ends early
            elif kind == "disconnect":
                break  # leaving the block closes the connection mid-stream
        return r.status


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_a_mixed_soak_ends_with_no_kv_in_use_a_clean_pool_and_no_5xx(tiny_llama, tmp_path, request):
    """Plain, constrained, forked, streamed, aborted and abandoned requests from two tenants,
    with the public prefix, against a pool small enough to evict: no 5xx, and once idle no
    slot in use beyond the radix cache, the integrity check clean, memory flat."""
    import asyncio
    import collections

    import aiohttp

    n = 3000 if request.config.getoption("--long") else 200
    (tmp_path / "tenants.toml").write_text(
        '[[tenants]]\nid = "alice"\napi_key = "key-alice"\nadmin = true\nallow_public_prefix = true\n\n'
        '[[tenants]]\nid = "bob"\napi_key = "key-bob"\nallow_public_prefix = true\n')
    server = ServerProcess(tiny_llama, "--kv-cache-tokens", "6000", "--chunked-prefill-size", "256", "--tenants",
                           str(tmp_path / "tenants.toml"), log=tmp_path / "server.log")
    rng = random.Random(0)

    async def soak(count: int) -> collections.Counter:
        statuses: collections.Counter = collections.Counter()
        gate = asyncio.Semaphore(12)

        async def one(i: int) -> None:
            async with gate:
                statuses[await _soak_one(session, server.url, ("key-alice", "key-bob")[i % 2], rng.choice(KINDS), i, rng)] += 1

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            await asyncio.gather(*(one(i) for i in range(count)))
        return statuses

    try:
        asyncio.run(soak(40))  # warm-up: caches, compiled grammars, token tables
        before = _rss_mb(server.proc.pid)
        statuses = asyncio.run(soak(n))
        kv = server.wait_idle("key-alice")
        _, info = server.get("/server_info?check_integrity=1", "key-alice")
        after = _rss_mb(server.proc.pid)
    finally:
        code = server.stop()
    log = (tmp_path / "server.log").read_text()
    assert code == 0, log[-3000:]
    assert "key-alice" not in log and "key-bob" not in log and "Question 1" not in log  # no keys, no request bodies
    assert sum(statuses.values()) == n and all(s < 500 for s in statuses), statuses
    assert statuses[400] > 0 and statuses[200] > n / 2, statuses
    assert info["integrity"] == "ok" and kv["kv_in_use_slots"] == 0, (info, kv)
    assert kv["kv_free_slots"] + kv["kv_cached_tokens"] == kv["kv_total_slots"] and kv["evicted_tokens"] > 0, kv
    assert after - before < 150, (before, after)  # MB


# -- fuzzing -------------------------------------------------------------------------------------
TOKEN_LIMITS = ("max_tokens", "max_completion_tokens", "max_new_tokens", "min_tokens", "min_new_tokens", "max_output_tokens")
# a chat or a response without a max runs to the end of the context window (the OpenAI APIs' default)
DEFAULT_LIMIT = {"/v1/chat/completions": "max_tokens", "/v1/responses": "max_output_tokens"}


def _bounded(body):
    """Keep generation short (a fuzz case tests validation, not decoding 2,000 tokens)."""
    if isinstance(body, dict):
        for k, v in body.items():
            if k in TOKEN_LIMITS and isinstance(v, int) and v > 8:
                body[k] = 8
            elif k == "n" and isinstance(v, int) and v > 2:
                body[k] = 2
            else:
                _bounded(v)
    elif isinstance(body, list):
        for v in body:
            _bounded(v)


def test_fuzzing_the_api_from_its_openapi_schema_finds_no_5xx_and_no_reply_off_its_schema(server):
    """schemathesis draws requests from /openapi.json (50 per operation); every reply must be
    a non-5xx that conforms to the schema. (Its pytest plugin does not run on pytest 9, so the
    cases are drawn with hypothesis here.)"""
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in ops} >= {"/generate", "/v1/chat/completions", "/v1/completions"}
    codes: dict[int, int] = {}
    for op in ops:
        _fuzz(op, codes)
    assert sum(codes.values()) >= 100 and codes.get(200, 0) > 0, codes


def _fuzz(op, codes: dict[int, int]) -> None:
    @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(data=st.data())
    def fuzz(data):
        case = data.draw(op.as_strategy())
        if isinstance(case.body, (dict, list)):
            _bounded(case.body)
        if isinstance(case.body, dict) and op.path in DEFAULT_LIMIT and not any(
                isinstance(case.body.get(k), int) for k in ("max_tokens", "max_completion_tokens", "max_output_tokens")):
            case.body[DEFAULT_LIMIT[op.path]] = 8
        r = case.call_and_validate(checks=[not_a_server_error, response_schema_conformance])
        codes[r.status_code] = codes.get(r.status_code, 0) + 1

    fuzz()


def _schemas():
    leaf = st.one_of(
        st.builds(lambda lo, w: {"type": "integer", "minimum": lo, "maximum": lo + w}, st.integers(-50, 50), st.integers(0, 100)),
        st.just({"type": "boolean"}),
        st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=4, unique=True).map(lambda xs: {"enum": xs}),
        st.integers(1, 6).map(lambda n: {"type": "string", "maxLength": n, "pattern": "^[a-z]*$"}),
    )
    node = st.recursive(leaf, lambda inner: st.one_of(
        st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, inner, st.integers(0, 3)),
        st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), inner, min_size=1, max_size=3).map(
            lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False})),
        max_leaves=5)
    return node


@given(schema=_schemas(), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzzing_random_schemas_through_the_sampler_finds_no_invalid_finished_output(tiny_engine, schema, seed):
    params = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=400, json_schema=json.dumps(schema))
    try:
        out = tiny_engine.generate([[5, 6, 7, 8]], params)[0]
    except ValueError as e:  # strict: a schema no backend enforces whole is refused, naming the keyword
        assert "cannot be enforced" in str(e), e
        return
    assert out.finish_reason in ("stop", "length"), out
    if out.finish_reason == "stop":
        jsonschema.validate(json.loads(out.text), schema)


# -- clients that stop reading -------------------------------------------------------------------
def test_a_consumer_that_stops_reading_gets_its_request_aborted_and_its_kv_freed(tiny_engine):
    import asyncio
    import time

    async def main() -> list:
        params = SamplingParams(temperature=0.0, max_new_tokens=1500, ignore_eos=True)
        finished = tiny_engine.stats().finished
        stream = tiny_engine.submit([5, 6, 7], params, max_backlog=8)
        await anext(stream)
        deadline = time.monotonic() + scaled(60)
        while tiny_engine.snapshot().finished == finished and time.monotonic() < deadline:  # not reading meanwhile
            await asyncio.sleep(0.02)
        return [d async for d in stream]

    rest = asyncio.run(main())
    final = rest[-1]
    assert final.finished and final.output.finish_reason == "abort", final
    assert len(rest) <= 9 and final.output.completion_tokens < 1500  # 8 unread chunks kept, then the end
    assert_no_leak(tiny_engine)


@pytest.mark.parametrize(("backlog", "write_timeout"), [(16, 600), (100000, 0.5)])
def test_an_http_client_that_stops_reading_its_stream_is_cut_off_and_freed(tiny_llama, tmp_path, backlog, write_timeout):
    """A raw socket with a tiny receive window that never reads: the stream's backlog (first
    case) or its write timeout (second) aborts the request; its KV is freed, the server goes on."""
    import socket
    import time

    server = ServerProcess(tiny_llama, "--kv-cache-tokens", "4096", "--max-stream-backlog", str(backlog),
                           "--stream-write-timeout", str(write_timeout), log=tmp_path / "server.log")
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        sock.connect(("127.0.0.1", server.port))
        body = json.dumps({"input_ids": [5, 6, 7], "stream": True, "return_logprob": True, "top_logprobs_num": 20,
                           "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}})  # big chunks: the buffers fill soon
        sock.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                     f"{body}".encode())
        deadline = time.monotonic() + scaled(60)
        while time.monotonic() < deadline:  # the request starts, stalls, and is cut off
            kv = server.get("/server_info")[1]["kv"]
            if kv["finished"] >= 1 and kv["running"] == 0:
                break
            time.sleep(0.2)
        kv = server.wait_idle()  # its handler left too: the connection was dropped, not kept to the write timeout
        assert server.get("/server_info")[1]["in_flight"] == 0
        assert kv["decode_tokens"] < 1990 and kv["kv_in_use_slots"] == 0, kv  # cut off before its 2,000 tokens
        ok, _ = server.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert ok == 200
        sock.close()
    finally:
        assert server.stop() == 0


def test_an_unread_chat_stream_with_the_kernels_default_buffers_is_cut_off(tiny_llama, tmp_path):
    """Issue 44 (17): a client that never reads, its socket as the OS makes it: Linux grew the
    server's send buffer until the whole answer fit, so the stream was decoded to its end and no
    write ever waited. The stream's send buffer is the server's now: the writes wait, the
    backlog fills and the request is aborted well before its 2,000 tokens."""
    import socket
    import time

    server = ServerProcess(tiny_llama, "--kv-cache-tokens", "4096", "--max-stream-backlog", "64",
                           "--stream-send-buffer", "8192", log=tmp_path / "server.log")
    try:
        sock = socket.create_connection(("127.0.0.1", server.port))
        body = json.dumps({"messages": [{"role": "user", "content": "Write a long story."}], "stream": True,
                           "max_tokens": 2000, "ignore_eos": True, "logprobs": True, "top_logprobs": 5})  # chunks of ~1 KB
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        deadline = time.monotonic() + scaled(90)
        while time.monotonic() < deadline:
            kv = server.get("/server_info")[1]["kv"]
            if kv["finished"] >= 1 and kv["running"] == 0:
                break
            time.sleep(0.2)
        kv = server.wait_idle()
        assert kv["decode_tokens"] < 1500 and kv["kv_in_use_slots"] == 0, kv
        with urllib.request.urlopen(server.url + "/metrics") as r:
            assert 'radixserve_requests_total{finish_reason="abort"} 1.0' in r.read().decode()
        sock.close()
    finally:
        assert server.stop() == 0


def test_streams_cut_by_the_servers_shutdown_end_with_an_error_event_not_a_finish_reason(tiny_llama, tmp_path):
    """Issue 44 (19): a stream the drain cut ended with `finish_reason: "abort"`, no value of the
    OpenAI API, so a client took the cut answer for a whole one. Each API's stream now ends with
    its error event: chat and completions an `{"error": ...}` chunk, Messages `event: error`,
    Responses `error` and `response.failed`."""
    import http.client
    import signal

    server = ServerProcess(tiny_llama, "--kv-cache-tokens", "8192", "--drain-timeout", "0", log=tmp_path / "server.log")
    long = {"max_tokens": 1900, "ignore_eos": True, "stream": True}
    user = [{"role": "user", "content": "Write a long story."}]
    routes = [("/v1/chat/completions", {**long, "messages": user}),
              ("/v1/completions", {**long, "prompt": "Once upon a time"}),
              ("/v1/messages", {"model": "", "max_tokens": 1900, "stream": True, "messages": user}),
              ("/v1/responses", {"input": "Write a long story.", "max_output_tokens": 1900, "stream": True, "store": False})]
    conns = []
    try:
        for path, body in routes:
            c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=scaled(60))
            c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
            assert r.status == 200, (path, r.read())
            r.readline()  # the stream has begun
            conns.append((path, c, r))
        server.proc.send_signal(signal.SIGTERM)
        tails = {path: r.read().decode() for path, _, r in conns}
    finally:
        assert server.stop() == 0
    for path in ("/v1/chat/completions", "/v1/completions"):
        events = [json.loads(line[6:]) for line in tails[path].splitlines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "aborted", events[-1]
        assert not any(c.get("finish_reason") for e in events for c in e.get("choices", ())), path
        assert tails[path].rstrip().endswith("data: [DONE]")
    assert "event: error" in tails["/v1/messages"] and '"overloaded_error"' in tails["/v1/messages"]
    assert "event: message_stop" not in tails["/v1/messages"]
    assert "event: response.failed" in tails["/v1/responses"] and "event: response.completed" not in tails["/v1/responses"]
    assert "aborted" in tails["/v1/responses"] and '"abort"' not in "".join(tails.values())


# -- overload and isolation benchmark (its mechanics; the numbers are in docs/benchmarks.md) ---------------
def test_bench_reliability_rejects_the_burst_excess_and_shows_no_cross_tenant_hit(tiny_llama, tmp_path):
    import argparse
    from pathlib import Path

    from radixserve.bench import reliability

    tenants = Path(__file__).resolve().parents[1] / "examples" / "agents" / "tenants.toml"
    server = ServerProcess(tiny_llama, "--tenants", str(tenants), "--max-queued-requests", "8", "--kv-cache-tokens", "8192",
                           "--grammar-compile-timeout", "1", "--kv-disk-dir", str(tmp_path / "kv"), log=tmp_path / "server.log")
    try:
        p = argparse.ArgumentParser()
        reliability.add_args(p)
        out = tmp_path / "rel.json"
        args = p.parse_args(["--url", server.url, "--keys", "sk-alice-example,sk-bob-example", "--burst-factor", "4",
                             "--trials", "2", "--prompt-words", "150", "--storm", "6", "--bombs", "1", "--json", str(out)])
        assert reliability.run(args) == 0
    finally:
        assert server.stop() == 0
    data = json.loads(out.read_text())
    o = data["overload"]
    assert o["sent"] == 32 and o["accepted"] + o["rejected"] == 32 and o["rejected"] >= 16 and not o["other_statuses"]
    assert 0 < o["server_reject_p50_ms"] <= o["server_reject_p99_ms"], o  # from the server's own histogram
    st = data["storm"]
    assert st["integrity"] == "ok" and st["queued_after"] == 0 and st["in_flight_after"] == 0, st
    assert st["b_ok"] == st["b_sent"] > 0 and sum(st["outcomes"].values()) == 6, st
    assert all(k.endswith(":400") for k in st["outcomes"] if k.startswith("grammar:")), st
    gb = data["grammar_bomb"]
    assert gb["bomb_statuses"] == [400, 400] and gb["trivial_status"] == 200 and gb["recovery_s"] is not None, gb
    iso = data["isolation"]
    assert iso["A hit (same tenant)"]["cached_tokens_median"] > 100
    assert iso["B, A's prompt (other tenant)"]["cached_tokens_median"] <= 8  # at most the nonce's leading bracket
    assert iso["A from disk (pool flushed)"]["cached_tokens_median"] > 100  # read back from the disk tier
    assert iso["B, A's prompt on disk (other tenant)"]["cached_tokens_median"] <= 8
