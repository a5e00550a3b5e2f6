"""frontend_lang against a real `radixserve serve` (tiny model for mechanics, SmolLM2 where
meaning matters): roles, gen and its constraints, select, fork/join, run_batch, errors, and
fork efficiency read from the server's counters."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from server_helpers import ServerProcess

import frontend_lang as sgl


@pytest.fixture(scope="module")
def backend(tiny_llama, tmp_path_factory):
    s = ServerProcess(tiny_llama, "--kv-cache-tokens", "16384", "--chunked-prefill-size", "256",
                      log=tmp_path_factory.mktemp("fl") / "server.log")
    yield sgl.RuntimeEndpoint(s.url), s
    assert s.stop() == 0


COORD = {"type": "integer", "minimum": -999, "maximum": 999}  # bounded: a random model's output always fits max_tokens
POINT = {"type": "object", "properties": {"x": COORD, "y": COORD}, "required": ["x", "y"], "additionalProperties": False}


@sgl.function
def constrained(s, topic):
    s += sgl.system("You answer in the format asked.")
    with s.user():
        s += "Tell me about " + topic + "."
    with s.assistant():
        s += "Code: " + sgl.gen("code", regex=r"[A-Z]{3}-[0-9]{2}", temperature=1.0) + "\n"
        s += "Count: " + sgl.gen_int("count", max_tokens=24) + "\n"
        s += "Point: " + sgl.gen("point", json_schema=POINT, max_tokens=60, temperature=1.0) + "\n"
        s += "Mood: " + sgl.select("mood", ["happy", "sad", "calm"])


def test_roles_gen_constraints_and_select(backend):
    ep, _ = backend
    s = constrained.run(topic="radix trees", backend=ep)
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", s["code"])
    assert re.fullmatch(r"[-+]?[0-9]+", s["count"])  # SGLang's REGEX_INT; the variable is the text, as in SGLang
    jsonschema.validate(json.loads(s["point"]), POINT)
    assert s["mood"] in ("happy", "sad", "calm")
    assert "normalized_prompt_logprobs" in s.get_meta_info("mood")
    roles = [m["role"] for m in s.messages()]
    assert roles == ["system", "user", "assistant"] and s.messages()[1]["content"] == "Tell me about radix trees."
    assert "<|im_start|>user\nTell me about radix trees.<|im_end|>" in s.text()  # the model's own template


@sgl.function
def panel(s, question, experts):
    s += sgl.system("Shared briefing. " * 150)
    s += sgl.user(question)
    forks = s.fork(experts)
    forks += lambda i: sgl.assistant(f"Expert {i}: " + sgl.gen("opinion", max_tokens=6, ignore_eos=True))
    forks.join()


def test_fork_branches_run_together_and_compute_the_shared_prompt_once(backend):
    ep, server = backend
    sgl.flush_cache(ep)
    before = server.get("/server_info")[1]["kv"]
    s = panel.run(question="Which data structure?", experts=8, backend=ep)
    after = server.get("/server_info")[1]["kv"]
    assert len(s["opinion"]) == 8 and all(isinstance(o, str) for o in s["opinion"])
    prompt_tokens = after["prompt_tokens"] - before["prompt_tokens"]
    computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    assert prompt_tokens > 8 * 600  # eight branches, each sent the whole ~700-token prompt
    assert computed < prompt_tokens / 4  # ...which the server computed once (plus short suffixes and outputs)


def test_join_concatenates_and_errors_name_the_branch(backend):
    ep, _ = backend
    s = sgl.function(lambda s: None).run(backend=ep)
    s += "Start."
    forks = s.fork(2)
    forks[0] += " A"
    forks[1] += " B"
    forks.join("concate_and_append")
    assert s.text() == "Start. A B"
    bad = s.fork(2)
    bad[1] += sgl.gen("x", max_tokens=100000)
    with pytest.raises(sgl.FrontendError, match=r"fork branch 1: gen 'x': the server answered 400: .*max_tokens|max_new_tokens"):
        bad.join()


def test_run_batch_runs_twenty_programs(backend):
    ep, _ = backend

    @sgl.function
    def tag(s, i):
        s += f"Item {i}: " + sgl.gen("t", regex=r"[a-z]{2,4}", temperature=1.0)

    states = tag.run_batch([{"i": i} for i in range(20)], backend=ep, num_threads=8, progress_bar=True)
    assert len(states) == 20 and all(re.fullmatch(r"[a-z]{2,4}", s["t"]) for s in states)


def test_a_server_that_is_down_is_a_clear_error_not_a_hang():
    ep = sgl.RuntimeEndpoint("http://127.0.0.1:9", timeout=5)

    @sgl.function
    def one(s):
        s += "Hi " + sgl.gen("a", max_tokens=2)

    s = one.run(backend=ep)  # as SGLang's run: the failure is kept on the state, not raised
    assert isinstance(s.error(), sgl.FrontendError) and "gen 'a': cannot reach" in str(s.error())
    with pytest.raises(sgl.FrontendError, match="gen 'a': cannot reach"):
        s["a"]  # ...and reading what it never set raises it
    assert s.text() == "Hi "


@pytest.fixture(scope="module")
def smollm2_server(smollm2_dir, tmp_path_factory):
    s = ServerProcess(smollm2_dir, "--kv-cache-tokens", "16384", log=tmp_path_factory.mktemp("sm") / "server.log")
    yield s
    assert s.stop() == 0


def test_select_picks_paris_on_smollm2(smollm2_server):
    @sgl.function
    def capital(s):
        s += sgl.user("What is the capital of France?")
        s += sgl.assistant("The capital of France is " + sgl.select("city", ["London", "Paris", "Berlin", "Madrid"]))

    assert capital.run(backend=sgl.RuntimeEndpoint(smollm2_server.url))["city"] == "Paris"


def _example(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "agents" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_expert_panel_runs_and_hits_the_cache(smollm2_server):
    out = _example("expert_panel").main(smollm2_server.url, experts=3)
    assert out["verdict"]["choice"] in ("A", "B", "C")
    assert out["cached_prompt_tokens"] > out["prompt_tokens"] / 2, out  # the briefing was computed once


def test_example_extract_records_validates_every_record(smollm2_server):
    example = _example("extract_records")
    records = example.main(smollm2_server.url)  # it asserts that every record validates
    assert len(records) == 10
    assert sum(r["name"] == name for r, (name, _, _) in zip(records, example.PEOPLE)) >= 8  # SmolLM2 reads the names


def test_example_react_tools_runs_its_loop_with_real_tools(smollm2_server):
    example = _example("react_tools")
    assert example.calculator("17 * 23") == "391" and example.calculator("__import__('os')").startswith("error")
    assert "330 metres" in example.search("Eiffel tower")
    out = example.main(smollm2_server.url)
    for action, args in out["steps"]:
        assert action in ("calculator", "search", "answer")
        if action != "answer":
            jsonschema.validate(json.loads(args), example.ARGS[action])
    assert isinstance(out["answer"], str)


def test_example_tree_of_thought_picks_one_candidate_per_depth(smollm2_server):
    path = _example("tree_of_thought").main(smollm2_server.url)
    assert len(path) == 2 and all(isinstance(p, str) for p in path)


def test_join_gathers_variables_a_second_fork_sets_again(backend):
    ep, _ = backend
    s = sgl.function(lambda s: None).run(backend=ep)
    s += "x"
    for n in (2, 3):  # the second join replaces the first one's list
        forks = s.fork(n)
        forks += sgl.gen("v", max_tokens=2, ignore_eos=True)
        forks.join()
        assert len(s["v"]) == n


def test_the_openai_backend_runs_gen_programs_and_refuses_what_needs_the_native_api(backend):
    _, server = backend
    ep = sgl.OpenAI(server.get("/v1/models")[1]["data"][0]["id"], base_url=server.url + "/v1", api_key="unused")

    @sgl.function
    def chat(s):
        s += sgl.user("Name a colour.")
        s += sgl.assistant(sgl.gen("colour", max_tokens=6, regex=r"[a-z]{3,5}"))

    s = chat.run(backend=ep)
    assert re.fullmatch(r"[a-z]{3,5}", s["colour"]) and "User: Name a colour.\n" in s.text()

    @sgl.function
    def pick(s):
        s += "Pick: " + sgl.select("x", ["a", "b"])

    with pytest.raises(sgl.FrontendError, match="select needs prompt logprobs from the native API"):
        pick.run(backend=ep)["x"]


@sgl.function
def two_parts(s):
    s += sgl.user("Say something.")
    s += sgl.assistant(sgl.gen("a", max_tokens=8, ignore_eos=True, temperature=1.0))
    s += "Then: " + sgl.gen("b", max_tokens=6, ignore_eos=True, temperature=1.0)


def test_streaming_yields_the_text_as_it_is_generated(backend):
    ep, _ = backend
    s = two_parts.run(backend=ep, stream=True)
    whole = list(s.text_iter())
    only_b = list(s.text_iter("b"))
    assert "".join(whole) == s.text() and s.text().startswith("<|im_start|>user\nSay something.")
    assert "".join(only_b) == s["b"] and len(only_b) > 1  # several chunks: one per streamed token or so
    assert "".join(s.text_iter("a")) == s["a"]

    async def read() -> tuple[str, str]:
        t = two_parts.run(backend=ep, stream=True)
        whole = "".join([c async for c in t.text_async_iter()])
        return whole, "".join([c async for c in t.text_async_iter("a")])

    import asyncio

    whole, a = asyncio.run(read())
    assert whole.endswith(a + "<|im_end|>\nThen: " + whole.split("Then: ")[1]) and len(a) > 0
    plain = two_parts.run(backend=ep)  # without streaming, the iterators give the whole value once
    assert list(plain.text_iter("b")) == [plain["b"]]


def test_a_failure_while_streaming_surfaces_in_the_reader(backend):
    ep, _ = backend

    @sgl.function
    def bad(s):
        s += "Hi " + sgl.gen("ok", max_tokens=2, ignore_eos=True)
        s += sgl.gen("huge", max_tokens=100000)

    s = bad.run(backend=ep, stream=True)
    with pytest.raises(sgl.FrontendError, match="gen 'huge': the server answered 400"):
        "".join(s.text_iter())
    assert len(s.variables["ok"]) > 0  # what came before the failure is kept


def test_var_scope_captures_the_text_a_block_appends(backend):
    ep, _ = backend

    @sgl.function
    def scoped(s):
        s += "Intro. "
        with s.var_scope("middle"):
            s += "Middle " + sgl.gen("g", max_tokens=3, ignore_eos=True)
        s += " End."

    s = scoped.run(backend=ep)
    assert s["middle"] == "Middle " + s["g"] and s.text() == "Intro. " + s["middle"] + " End."
    streamed = scoped.run(backend=ep, stream=True)
    assert "".join(streamed.text_iter("middle")) == streamed["middle"]  # a scope streams too
    assert "".join(streamed.text_iter()) == streamed.text()  # ...and its text only once in the whole


def test_the_openai_backend_streams(backend):
    _, server = backend
    ep = sgl.OpenAI(server.get("/v1/models")[1]["data"][0]["id"], base_url=server.url + "/v1", api_key="unused")

    @sgl.function
    def one(s):
        s += "Count: " + sgl.gen("n", max_tokens=5, ignore_eos=True)

    s = one.run(backend=ep, stream=True)
    chunks = list(s.text_iter("n"))
    assert "".join(chunks) == s["n"] and len(chunks) > 1


def test_example_two_tenants_shares_only_the_public_prefix(tiny_llama, tmp_path):
    from pathlib import Path

    tenants = Path(__file__).resolve().parents[1] / "examples" / "agents" / "tenants.toml"
    server = ServerProcess(tiny_llama, "--tenants", str(tenants), "--kv-cache-tokens", "16384", log=tmp_path / "server.log")
    try:
        rows = _example("two_tenants").main(server.url)
    finally:
        assert server.stop() == 0
    cold, again, other, public_cold, public_hit = (r["cached_tokens"] for r in rows)
    policy = 0.9 * rows[0]["prompt_tokens"]  # the policy is all but the question's few tokens
    assert cold == 0 and again > policy  # alice's second call reuses her policy
    assert other == 0  # ...which bob cannot hit
    assert public_cold < 8  # the public namespace started empty (at most a page-sized coincidence)
    assert public_hit > policy  # bob, opting in, hits the policy alice put in the public prefix


def test_bench_agents_runs_both_versions_of_both_programs(backend, tmp_path):
    import argparse

    from radixserve.bench import agents

    _, server = backend
    p = argparse.ArgumentParser()
    agents.add_args(p)
    out = tmp_path / "agents.json"
    args = p.parse_args(["--url", server.url, "--runs", "2", "--concurrency", "2", "--experts", "2", "--output-len", "4",
                         "--steps", "1", "--briefing-repeats", "3", "--json", str(out)])
    assert agents.run(args) == 0
    points = json.loads(out.read_text())["points"]
    assert [(x["program"], x["system"]) for x in points] == [
        ("panel", "frontend_lang"), ("panel", "openai_sequential"), ("react", "frontend_lang"), ("react", "openai_sequential")]
    assert all(x["programs"] == 2 and x["decode_tokens"] > 0 for x in points)
    panel = points[0]
    assert panel["cached_prompt_tokens"] > panel["prompt_tokens"] / 2  # each fork reused the briefing
    assert agents.run_tool("calculator", "6 * 7") == "42" and agents.run_tool("calculator", "__import__('os')").startswith("error")
