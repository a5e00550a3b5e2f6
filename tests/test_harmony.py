"""gpt-oss's harmony answers: channels split into reasoning, content and calls, whole and as a
stream (any cut of the text gives the same), read in linear time, and the auto and required
constraints hold the calls to the offered tools' schemas, matching the special tokens."""

from __future__ import annotations

import json
import random

import pytest

from radixserve.server.chat import harmony
from radixserve.server.chat.reasoning import LiveParts, answer
from radixserve.server.chat.tools import Tool, harmony_tag

WEATHER = Tool("get_weather", "Weather in a city", {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False})
TOOLS = {"get_weather": WEATHER}
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant"
FINAL = "<|channel|>final<|message|>It is sunny in Paris."
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'

CASES = [  # (text, reasoning, content, call names)
    (ANALYSIS + FINAL, "The user wants the weather.", "It is sunny in Paris.", []),
    (FINAL, None, "It is sunny in Paris.", []),
    (ANALYSIS + CALL, "The user wants the weather.", None, ["get_weather"]),
    (CALL, None, None, ["get_weather"]),
    (ANALYSIS + ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}',
     "The user wants the weather.", None, ["get_weather"]),  # the recipient before the channel
    (ANALYSIS + "<|channel|>commentary<|message|>Let me look that up.<|end|><|start|>assistant" + CALL,
     "The user wants the weather.", "Let me look that up.", ["get_weather"]),  # a preamble is content
    ('<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{"path": "/"}', None, '{"path": "/"}', []),
    ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": ', None, '{"city":', []),
    ("Just text, no channels.", None, "Just text, no channels.", []),
    ("<|channel|>analysis<|message|>cut off while thinking", "cut off while thinking", None, []),
    ("<|channel|>analysis<|message|>done<|end|><|start|>assistant<|channel|>fin", "done", None, []),  # a header cut short
    ("<|channel|>analysis<|message|>A1<|end|><|start|>assistant<|channel|>analysis<|message|>A2<|end|>"
     "<|start|>assistant" + FINAL, "A1\n\nA2", "It is sunny in Paris.", []),  # messages of a kind: paragraphs
    ("<|channel|>commentary<|message|>Let me check.<|end|>" + ANALYSIS + FINAL, None,
     "Let me check.\n\nThe user wants the weather.\n\nIt is sunny in Paris.", []),  # reasoning only before content
    ("<|channel|>analysis<|message|>A<|start|>assistant" + FINAL, "A", "It is sunny in Paris.", []),  # <|start|> ends one too
]
PLAIN = ["Sure! Here it is.<|channel|>final<|message|>answer", "<|channel|>" + "x" * 300 + "<|message|>answer"]


@pytest.mark.parametrize("text", PLAIN)
def test_text_before_a_header_or_a_header_too_long_is_plain_content_whole_and_streamed(text):
    assert harmony.read(text, TOOLS) == (None, text, [])
    s = harmony.Splitter(TOOLS)
    parts = [s.feed(ch) for ch in text] + [s.flush()]
    assert "".join(c for _, c in parts) == text and not "".join(r for r, _ in parts)


@pytest.mark.parametrize("text, reasoning, content, names", CASES)
def test_a_whole_answer_splits_into_reasoning_content_and_calls(text, reasoning, content, names):
    r, c, calls = harmony.read(text, TOOLS)
    assert (r, c, [k.function.name for k in calls]) == (reasoning, content, names)
    for k in calls:
        assert json.loads(k.function.arguments)["city"] in ("Paris", "Rome")
    a = answer(text, "stop", "harmony", "auto", [WEATHER])
    assert (a.reasoning, a.content, [k.function.name for k in a.calls]) == (reasoning, content, names)
    none = answer(text, "stop", "harmony", "none", [WEATHER])  # no tools: a call is no call
    assert none.calls == [] and none.reasoning == reasoning


@pytest.mark.parametrize("text, reasoning, content, names", CASES)
def test_any_cut_of_the_stream_reads_as_the_whole(text, reasoning, content, names):
    rng = random.Random(len(text))
    for cuts in ([1] * len(text), [rng.randint(1, 9) for _ in text]):
        s, r, c, at = harmony.Splitter(TOOLS), [], [], 0
        for n in cuts:
            if at >= len(text):
                break
            dr, dc = s.feed(text[at:at + n])
            r.append(dr)
            c.append(dc)
            at += n
        dr, dc = s.flush()
        whole_r, whole_c = "".join(r) + dr, ("".join(c) + dc).strip()
        assert (whole_r if s.saw_reasoning else None, whole_c or None) == (reasoning, content)
        assert [k.function.name for k in s.take_calls()] == names
        assert "<|" not in whole_r + whole_c  # no marker reaches a client


def test_a_streamed_call_is_released_when_its_message_ends_and_keeps_its_id():
    class Parts(LiveParts):
        def __init__(self) -> None:
            super().__init__("harmony", True, None, [WEATHER])
            self.events: list[tuple[str, str]] = []

        async def reasoning_delta(self, text: str) -> None:
            self.events.append(("r", text))

        async def tool_call(self, index: int, call) -> None:
            self.events.append(("call", call.id))

    import asyncio

    p = Parts()
    asyncio.run(p.feed(ANALYSIS[:40], False))
    assert p.events and all(kind == "r" for kind, _ in p.events)
    asyncio.run(p.feed(ANALYSIS[40:] + CALL, True))
    ids = [i for kind, i in p.events if kind == "call"]
    assert len(ids) == 1
    a = answer(ANALYSIS + CALL, "stop", "harmony", "auto", [WEATHER], streamed=p.streamed_calls())
    assert [k.id for k in a.calls] == ids


HOSTILE = {  # what a model can be made to write, fed one character at a time
    "partial end markers in the reasoning": "<|channel|>analysis<|message|>" + "a<|en" * 20_000,
    "a header that never ends": "<|channel|>" + " to=functions." * 10_000,
    "a call's arguments that never end": '<|channel|>commentary to=functions.get_weather<|message|>{"city": ' + " " * 100_000,
    "empty messages": "<|channel|>final<|message|><|end|><|start|>assistant" * 2_000,
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_answer_in_one_character_deltas_is_read_in_linear_time(name):
    from test_untrusted_text import bounded

    text = HOSTILE[name]
    with bounded(6.0):  # ~0.5 s at 100k characters; a quadratic reading takes minutes
        s = harmony.Splitter(TOOLS)
        for ch in text:
            s.feed(ch)
        s.flush()


def test_the_constraints_hold_calls_to_the_schema_and_match_the_special_tokens(tiny_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    from grammars import create_backend
    from radixserve.request import SamplingParams

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer[0]))
    tok.add_special_tokens({"additional_special_tokens": [harmony.START, harmony.END, harmony.MESSAGE, harmony.CHANNEL,
                                                          harmony.CONSTRAIN, harmony.RETURN, harmony.CALL]})
    stops = tok.convert_tokens_to_ids([harmony.RETURN, harmony.CALL])
    xgr = create_backend("xgrammar", tok, len(tok), stops)

    def enc(text: str) -> list[int]:
        ids: list[int] = []
        for piece in text.replace("<|", "\0<|").replace("|>", "|>\0").split("\0"):
            ids += [tok.convert_tokens_to_ids(piece)] if piece.startswith("<|") else tok.encode(piece, add_special_tokens=False)
        return ids

    def accepts(required: bool, text: str, stop: str) -> bool:
        m = xgr.compile(SamplingParams(structural_tag=harmony_tag([WEATHER], required)).grammar_spec()).matcher()
        return all(m.accept(t) for t in [*enc(text), tok.convert_tokens_to_ids(stop)]) and m.is_terminated()

    assert accepts(False, ANALYSIS + FINAL, harmony.RETURN) and accepts(False, FINAL, harmony.RETURN)
    for call in (CALL, CALL.replace(" <|constrain|>", "<|constrain|>"),
                 ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}'):
        assert accepts(False, ANALYSIS + call, harmony.CALL) and accepts(True, ANALYSIS + call, harmony.CALL)
        assert accepts(True, call, harmony.CALL)
    assert not accepts(False, ANALYSIS + CALL.replace("Paris", "Oslo"), harmony.CALL)
    assert not accepts(False, ANALYSIS + CALL.replace("get_weather", "rm_rf"), harmony.CALL)
    assert not accepts(True, ANALYSIS + FINAL, harmony.RETURN)  # required: a call, not an answer
    assert not accepts(False, "Plain text without a channel.", harmony.RETURN)
    assert accepts(False, "<|channel|>analysis<|message|>Only thinking.<|end|>", harmony.RETURN)
    assert not accepts(False, FINAL + "<|end|><|start|>assistant" + ANALYSIS + FINAL, harmony.RETURN)  # reasoning first
    assert not accepts(False, "<|channel|>analysis<|message|>a <|channel|> in it<|end|><|start|>assistant" + FINAL,
                       harmony.RETURN)  # no message holds another's markers


# -- served: a tiny gpt-oss with harmony's special tokens and a harmony chat template ------------
TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|># Tools\n\nnamespace functions {\n{% for t in tools %}"
    "type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;\n{% endfor %}}<|end|>{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'assistant' and m.tool_calls %}{% for tc in m.tool_calls %}<|start|>assistant to=functions."
    "{{ tc.function.name }}<|channel|>commentary json<|message|>{{ tc.function.arguments }}<|call|>{% endfor %}"
    "{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
OPENAI_WEATHER = {"type": "function", "function": {"name": WEATHER.name, "description": WEATHER.description,
                                                   "parameters": WEATHER.parameters}}


@pytest.fixture(scope="module")
def harmony_server(tiny_tokenizer, tmp_path_factory):
    from server_helpers import ServerProcess
    from transformers import AutoTokenizer

    from tests.conftest import _config, make_tiny_model

    root = tmp_path_factory.mktemp("harmony")
    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer[0]))
    tok.add_special_tokens({"additional_special_tokens": [harmony.START, harmony.END, harmony.MESSAGE, harmony.CHANNEL,
                                                          harmony.CONSTRAIN, harmony.RETURN, harmony.CALL]})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(root / "tokenizer"))
    cfg = _config("GptOssForCausalLM", len(tok), tok.convert_tokens_to_ids(harmony.RETURN))
    model = make_tiny_model(root / "model", "GptOssForCausalLM", cfg, root / "tokenizer", 11)
    s = ServerProcess(model, "--kv-cache-tokens", "4096", log=root / "server.log")
    yield s, {t: tok.convert_tokens_to_ids(t) for t in (harmony.END, harmony.CALL, harmony.CHANNEL)}
    assert s.stop() == 0, (root / "server.log").read_text()


def _weather(args: str) -> None:
    assert json.loads(args)["city"] in ("Paris", "Rome")


def test_a_required_call_comes_back_as_a_tool_call_through_the_openai_client(harmony_server):
    """The required constraint makes the random model write a harmony call (a bias ends any
    analysis at once); chat and streamed chat read it as get_weather's call, its reasoning apart,
    no marker as content; <|call|> stops it though the file names only <|return|>."""
    import openai

    s, ids = harmony_server
    _, info = s.get("/server_info")
    assert info["tool_call_parser"] == "harmony"
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="none")
    body = {"model": "", "messages": ASK, "tools": [OPENAI_WEATHER], "tool_choice": "required", "temperature": 0,
            "max_tokens": 200, "logit_bias": {str(ids[harmony.END]): 100}}
    out = client.chat.completions.create(**body)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    _weather(choice.message.tool_calls[0].function.arguments)
    text, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        text += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for tc in delta.tool_calls or []:
            calls.setdefault(tc.index, "")
            calls[tc.index] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and not text.strip() and "<|" not in reasoning and list(calls) == [0]
    assert calls[0] == choice.message.tool_calls[0].function.arguments


def test_an_auto_answer_always_reads_as_messages_and_valid_calls(harmony_server):
    """Auto mode: whatever the random model writes within the constraint is reasoning, content
    and calls of get_weather with valid arguments; nothing of the markup reaches the client."""
    s, ids = harmony_server
    for seed in range(4):
        status, out = s.post("/v1/chat/completions", {
            "messages": ASK, "tools": [OPENAI_WEATHER], "temperature": 1.0, "seed": seed, "max_tokens": 120,
            "logit_bias": {str(ids[harmony.END]): 8}})
        assert status == 200, out
        msg = out["choices"][0]["message"]
        assert "<|" not in (msg.get("content") or "") + (msg.get("reasoning_content") or ""), msg
        for call in msg.get("tool_calls") or []:
            assert call["function"]["name"] == "get_weather"
            _weather(call["function"]["arguments"])


def test_a_required_call_through_the_anthropic_client(harmony_server):
    import anthropic

    s, ids = harmony_server
    client = anthropic.Anthropic(base_url=s.url, api_key="none")
    tool = {"name": "get_weather", "description": WEATHER.description, "input_schema": WEATHER.parameters}
    body = {"model": "", "max_tokens": 400, "messages": ASK, "tools": [tool], "tool_choice": {"type": "any"},
            "extra_body": {"temperature": 0}}
    msg = client.messages.create(**body)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and [u.name for u in uses] == ["get_weather"], msg
    assert uses[0].input["city"] in ("Paris", "Rome")
    assert all("<|" not in b.text for b in msg.content if b.type == "text")
    with client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [uses[0].input]


def test_a_harmony_plan_splits_its_channels_and_constrains_a_schema_from_the_final_message():
    from radixserve.server.chat.core import Plan, Sampling, prepare
    from radixserve.server.chat.tools import CHAT_PARAMS

    plan = Plan(list(ASK), CHAT_PARAMS, tool_format="harmony")
    plan.schema = ('{"type": "object"}', False)
    [p] = prepare(plan, Sampling(), None)
    assert plan.parser == "harmony" and plan.keep_markers and not p.skip_special_tokens
    assert p.grammar_after == harmony.FINAL
    plan = Plan(list(ASK), CHAT_PARAMS, [WEATHER], "required", [WEATHER], tool_format="harmony")
    [p] = prepare(plan, Sampling(), None)
    assert plan.schema is None and plan.call_tag and p.structural_tag and p.grammar_after is None
