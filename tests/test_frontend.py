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
from frontend_lang.loop import submit


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
    bad[0] += sgl.gen("x", max_tokens=2, ignore_eos=True)
    bad[1] += sgl.gen("x", max_tokens=100000)
    bad.join()  # as SGLang's: the failed branch adds nothing, and says why
    assert re.search(r"gen 'x': the server answered 400: .*(max_tokens|max_new_tokens)", str(bad[1].error()))
    assert s["x"] == [bad[0]["x"]] and s.error() is None


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
    def batch(s, i):
        s += "Background. " * 10  # a shared prefix run_batch would precompute on a native server
        s += "Item " + str(i) + ": " + sgl.gen("x", max_tokens=2)

    states = batch.run_batch([{"i": 1}, {"i": 2}], backend=ep)
    assert all(st.error() is None and isinstance(st["x"], str) for st in states)


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
    assert "".join(whole) == s.text() and "<|im_start|>user\nSay something." in s.text()
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


@sgl.function
def fails_midway(s):
    s += "Hi " + sgl.gen("ok", max_tokens=2, ignore_eos=True)
    s += sgl.gen("huge", max_tokens=100000)  # over the context window: a 400
    s += sgl.gen("never", max_tokens=2)


def test_a_failure_while_streaming_ends_the_reader_and_error_says_why(backend):
    ep, _ = backend
    s = fails_midway.run(backend=ep, stream=True)
    assert "".join(s.text_iter()) == s.text()  # the reader ends where the program stopped (SGLang's readers too)
    assert "gen 'huge': the server answered 400" in str(s.error())
    assert len(s.variables["ok"]) > 0 and list(s.text_iter("huge")) == []  # what came before the failure is kept


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


def test_run_sampling_arguments_are_every_gens_defaults_and_a_gens_own_win(backend):
    ep, _ = backend

    @sgl.function
    def two(s):
        s += "A: " + sgl.gen("a", ignore_eos=True)
        s += " B: " + sgl.gen("b", max_tokens=2, ignore_eos=True)

    s = two.run(backend=ep, max_new_tokens=5, temperature=0)
    assert s.get_meta_info("a")["completion_tokens"] == 5 and s.get_meta_info("b")["completion_tokens"] == 2
    again = two(backend=ep, max_new_tokens=5, temperature=0)  # calling the program runs it
    assert again["a"] == s["a"]  # run()'s temperature=0 reached both gens
    states = two.run_batch([{}, {}], backend=ep, max_new_tokens=3, temperature=0)
    assert [st.get_meta_info("a")["completion_tokens"] for st in states] == [3, 3]
    gen = two.run_batch([{}] * 3, backend=ep, max_new_tokens=3, generator_style=True)
    assert len(list(gen)) == 3


def test_gen_n_samples_bind_set_var_and_contains(backend):
    ep, _ = backend

    @sgl.function
    def greet(s, name, style):
        s += f"{style} {name}: " + sgl.gen("x", n=3, max_tokens=3, ignore_eos=True, temperature=1.0)

    s = greet.bind(style="Dear").run(name="Ann", backend=ep)
    assert isinstance(s["x"], list) and len(s["x"]) == 3 and s.text() == "Dear Ann: " + s["x"][0]
    s["y"] = 7
    assert "y" in s and s.get_var("y") == 7 and "z" not in s
    with pytest.raises(TypeError, match="no argument 'bogus'"):
        greet.bind(bogus=1)


def test_a_failed_append_stops_the_program_and_error_returns_it(backend):
    ep, _ = backend
    s = fails_midway.run(backend=ep)
    assert isinstance(s.error(), sgl.FrontendError) and "gen 'huge'" in str(s.error())
    assert len(s["ok"]) > 0  # what came before is kept
    with pytest.raises(sgl.FrontendError, match="gen 'huge'"):
        s["never"]
    images = sgl.function(lambda s: s.__iadd__(sgl.user(sgl.image("cat.png") + "What is this?"))).run(backend=ep)
    assert "image 'cat.png': radixserve serves text-only models" in str(images.error())


def test_separate_reasoning_splits_the_thinking_from_the_answer(backend):
    ep, _ = backend

    @sgl.function
    def think(s):
        s += "Q: ? A: " + sgl.separate_reasoning(sgl.gen("a", regex=r"<think>[a-z]{3}</think> [a-z]{2}"), model_type="qwen3")
        s += " Done."

    s = think.run(backend=ep)
    assert re.fullmatch(r"[a-z]{2}", s["a"]) and re.fullmatch(r"[a-z]{3}", s["a_reasoning_content"])
    assert s.text() == "Q: ? A: " + s["a"] + " Done."
    with pytest.raises(ValueError, match="not supported here"):
        sgl.separate_reasoning(sgl.gen("a"), model_type="nonesuch")


def test_tracing_finds_the_shared_prefix_run_batch_computes_once(backend):
    from frontend_lang.tracer import extract_prefix

    ep, server = backend

    @sgl.function
    def brief(s, question):
        s += sgl.system("Shared rules. " * 40)
        s += sgl.user("Q: " + question)
        s += sgl.assistant(sgl.gen("a", max_tokens=2))

    system_begin, system_end = submit(ep.role("system")).result()
    user_begin, _ = submit(ep.role("user")).result()
    assert extract_prefix(brief, ep) == system_begin + "Shared rules. " * 40 + system_end + user_begin + "Q: "
    traced = brief.trace(backend=ep)
    assert [type(n).__name__ for n in traced.nodes][-5:] == ["Argument", "RoleEnd", "RoleBegin", "Gen", "RoleEnd"]
    sgl.flush_cache(ep)
    before = server.get("/server_info")[1]["kv"]
    states = brief.run_batch([{"question": f"q{i}"} for i in range(6)], backend=ep, temperature=0)
    after = server.get("/server_info")[1]["kv"]
    assert all(isinstance(st["a"], str) for st in states)
    computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    assert computed < (after["prompt_tokens"] - before["prompt_tokens"]) / 3  # the prefix was computed once


def test_streaming_meta_data_and_custom_choice_methods(backend):
    ep, _ = backend

    class Last(sgl.ChoicesSamplingMethod):
        def __call__(self, *, choices, **scores):
            assert len(scores["input_token_logprobs"]) == len(choices)
            return sgl.ChoicesDecision(choices[-1], {"mine": True})

    @sgl.function
    def pick(s):
        s += "Pick: " + sgl.select("x", ["a", "bb", "ccc"], choices_method=Last())
        s += " then " + sgl.gen("g", max_tokens=4, ignore_eos=True, return_logprob=True)

    s = pick.run(backend=ep)
    assert s["x"] == "ccc" and s.get_meta_info("x")["mine"] is True

    async def meta() -> list:
        t = pick.run(backend=ep, stream=True)
        return [c async for c in t.text_async_iter("g", return_meta_data=True)]

    import asyncio

    chunks = asyncio.run(meta())
    assert sum(len(m["output_token_logprobs"]) for _, m in chunks) == chunks[-1][1]["completion_tokens"] == 4
    with pytest.raises(ValueError, match="temperature must be 0"):
        sgl.select("x", ["a"], temperature=0.7)


def test_named_chat_templates_and_the_global_default_backend(backend):
    ep, server = backend
    chatml = sgl.RuntimeEndpoint(server.url, chat_template_name="chatml")

    @sgl.function
    def hi(s):
        s += sgl.user("Hi") + sgl.assistant(sgl.gen("a", max_tokens=2))

    assert hi.run(backend=chatml).text().startswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="chat_template_name: 'nonesuch'"):
        sgl.RuntimeEndpoint(server.url, chat_template_name="nonesuch")
    sgl.set_default_backend(ep)
    try:
        assert sgl.global_config.default_backend is ep and isinstance(hi.run()["a"], str)
        assert sgl.get_server_info()["model"] and ep.get_model_name() == server.get("/get_model_info")[1]["model_path"]
    finally:
        sgl.set_default_backend(None)


def test_runtime_starts_a_local_server_and_shuts_it_down(tiny_llama):
    with pytest.raises(TypeError, match="mem_fraction_static is not supported"):
        sgl.Runtime(model_path=str(tiny_llama), mem_fraction_static=0.8)
    with pytest.raises(RuntimeError, match="exited with 2 while starting"):
        sgl.Runtime(model_path=str(tiny_llama), bogus=1)  # radixserve serve: unrecognized arguments: --bogus 1
    rt = sgl.Runtime(model_path=str(tiny_llama), kv_cache_tokens=4096, disable_cpu_kernels=True, tp_size=1)
    try:
        @sgl.function
        def one(s):
            s += "Hi " + sgl.gen("a", max_tokens=3, ignore_eos=True)

        assert one.run(backend=rt).get_meta_info("a")["completion_tokens"] == 3  # a Runtime stands for its endpoint
        assert json.loads(rt.generate("Hi", {"max_new_tokens": 2, "ignore_eos": True}))["meta_info"]["completion_tokens"] == 2
    finally:
        rt.shutdown()
    assert rt._healthy() is False


def test_forks_continue_an_open_role_and_the_template_adds_its_default_system_prompt(smollm2_server):
    ep = sgl.RuntimeEndpoint(smollm2_server.url)

    @sgl.function
    def opts(s):
        s += sgl.user("Name a color.")
        with s.assistant():
            forks = s.fork(2)
            forks += [sgl.user("nested?"), "Blue" + sgl.assistant_end()]
            return forks

    s = opts.run(backend=ep)
    forks = s.ret_value
    assert "roles do not nest" in str(forks[0].error())  # the branch is inside the assistant role, as in SGLang
    assert forks[1].messages()[-1] == {"role": "assistant", "content": "Blue"}
    system = s.messages()[0]  # SmolLM2's template adds its system prompt to a chat that starts without one
    assert system["role"] == "system" and "SmolLM" in system["content"] and s.text().startswith("<|im_start|>system\n")
    chat = smollm2_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a color."}],
                                                       "max_tokens": 1})[1]
    assert chat["usage"]["prompt_tokens"] == smollm2_server.post("/generate", {
        "text": s.text().split("<|im_start|>assistant")[0] + "<|im_start|>assistant\n",
        "sampling_params": {"max_new_tokens": 0}})[1]["meta_info"]["prompt_tokens"]  # the chat endpoint's very prompt


def test_sglangs_error_types_and_calls_without_a_backend(backend):
    import re as regex

    ep, _ = backend
    with pytest.raises(regex.error, match="gen 'x': regex"):
        sgl.gen("x", regex="([a-z")
    assert sgl.flush_cache() is False and sgl.get_server_info() is None  # no backend: SGLang's answers
    s = sgl.function(lambda s: None).run(backend=ep)
    with pytest.raises(KeyError, match="no variable 'nope'"):
        s["nope"]
    assert s.get_meta_info("nope") is None

    @sgl.function
    def long(s, q):
        s += "Rules. " * 20 + q

    long.cache(backend=ep)  # computes the traced prefix, as SGLang's prog.cache()
    assert ep.get_server_info()["model"]
