"""Mistral's tool calls end to end on tiny models whose tokenizer has Mistral's special tokens:
the markers reach the parser (decoded with special tokens in auto mode), the template picks
the v3 list form or the v11 name[ARGS] form, and auto mode's constraint engages at the
[TOOL_CALLS] token and holds the call to the offered tool's schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import _config, make_tiny_model

_HEAD = ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
         "{% for m in messages %}{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
         "{% elif m['role'] == 'assistant' %}{% if m.tool_calls %}")
_TAIL = ("{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}"
         "{% elif m['role'] == 'tool' %}[TOOL_RESULTS]{{ m['content'] }}[/TOOL_RESULTS]{% endif %}{% endfor %}")
TEMPLATES = {  # Mistral 7B v0.3 / Nemo, and Mistral Small 3.x / Devstral
    "mistral": _HEAD + '[TOOL_CALLS][{% for tc in m.tool_calls %}{"name": "{{ tc.function.name }}", '
                       '"arguments": {{ tc.function.arguments }}}{% endfor %}]' + _TAIL,
    "mistral_v11": _HEAD + "{% for tc in m.tool_calls %}[TOOL_CALLS]{{ tc.function.name }}[ARGS]"
                           "{{ tc.function.arguments }}{% endfor %}" + _TAIL,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


def mistral_tokenizer(tiny_tokenizer, out: Path, template: str) -> tuple[Path, int]:
    """The tiny tokenizer with [TOOL_CALLS] and [ARGS] as special tokens and `template`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer[0]))
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    tok.chat_template = template
    tok.save_pretrained(str(out))
    return out, len(tok)


@pytest.mark.parametrize("fmt", list(TEMPLATES))
def test_the_auto_constraint_engages_at_the_marker_token_and_holds_the_form(tiny_tokenizer, tmp_path, fmt):
    """Free text passes; from the [TOOL_CALLS] token only a call of get_weather in the format's
    own form, its arguments per the schema; the v3 list closes the answer, v11 calls may repeat
    (one only with parallel_tool_calls false)."""
    from transformers import AutoTokenizer

    from grammars import create_backend
    from radixserve.request import SamplingParams
    from radixserve.server.chat.tools import Tool, auto_tag

    tok = AutoTokenizer.from_pretrained(str(mistral_tokenizer(tiny_tokenizer, tmp_path / "tok", TEMPLATES[fmt])[0]))
    calls, args = tok.convert_tokens_to_ids(["[TOOL_CALLS]", "[ARGS]"])
    xgr = create_backend("xgrammar", tok, len(tok), [tok.eos_token_id])
    weather = Tool("get_weather", "", WEATHER["function"]["parameters"])

    def accepts(ids: list[int], one_call: bool = False) -> bool:
        m = xgr.compile(SamplingParams(structural_tag=auto_tag([weather], fmt, one_call)).grammar_spec()).matcher()
        return all(m.accept(t) for t in [*ids, tok.eos_token_id])

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    good = '{"city": "Paris", "unit": "celsius"}'
    v3 = [calls, *enc(f'[{{"name": "get_weather", "arguments": {good}}}]')]
    v11 = [calls, *enc("get_weather"), args, *enc(good)]
    assert accepts(enc("It is sunny in Paris.")) and accepts(enc("No call: [1, 2] and {}"))
    assert accepts(v3 if fmt == "mistral" else v11)
    assert not accepts(v11 if fmt == "mistral" else v3)  # the other form
    bad = good.replace("Paris", "Oslo")
    assert not accepts([calls, *enc(f'[{{"name": "get_weather", "arguments": {bad}}}]')])
    assert not accepts([calls, *enc("get_weather"), args, *enc(bad)]) and not accepts([calls, *enc("rm_rf"), args, *enc("{}")])
    if fmt == "mistral_v11":
        assert accepts(v11 + v11) and not accepts(v11 + v11, one_call=True)
    else:
        assert not accepts(v3 + enc(" and more"))


@pytest.fixture(scope="module", params=list(TEMPLATES))
def mistral_server(request, tiny_tokenizer, tmp_path_factory):
    from server_helpers import ServerProcess

    fmt = request.param
    root = tmp_path_factory.mktemp(fmt)
    tok_dir, vocab = mistral_tokenizer(tiny_tokenizer, root / "tokenizer", TEMPLATES[fmt])
    cfg = _config("MistralForCausalLM", vocab, tiny_tokenizer[2])
    model = make_tiny_model(root / "model", "MistralForCausalLM", cfg, tok_dir, 7)
    s = ServerProcess(model, "--kv-cache-tokens", "4096", log=root / "server.log")
    marker = json.loads((tok_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in marker["added_tokens"]}
    yield fmt, s, ids
    assert s.stop() == 0, (root / "server.log").read_text()


def _check_call(call: dict) -> None:
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    assert set(args) == {"city", "unit"} and args["city"] in ("Paris", "Rome") and args["unit"] in ("celsius", "fahrenheit")


def test_a_mistral_call_is_opened_by_its_token_held_to_the_schema_and_parsed(mistral_server):
    """A strong logit bias makes the random model open a call with [TOOL_CALLS]; from there the
    grammar holds it to get_weather's schema in the template's form, and the answer comes back
    as a tool call (chat and streamed chat), the markers never as content."""
    import openai

    fmt, server, ids = mistral_server
    _, info = server.get("/server_info")
    assert info["tool_call_parser"] == fmt
    body = {"model": "", "messages": ASK, "tools": [WEATHER], "temperature": 0, "max_tokens": 300,
            "parallel_tool_calls": False, "logit_bias": {str(ids["[TOOL_CALLS]"]): 100}}
    status, out = server.post("/v1/chat/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"], choice
    assert len(choice["message"]["tool_calls"]) == 1
    _check_call(choice["message"]["tool_calls"][0])

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    stream = client.chat.completions.create(**{k: v for k, v in body.items() if k != "model"}, model="", stream=True)
    calls, text, finish = {}, "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"type": "function", "function": {"name": "", "arguments": ""}})
            entry["function"]["name"] += tc.function.name or ""
            entry["function"]["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and "[TOOL_CALLS]" not in text and "[ARGS]" not in text and list(calls) == [0]
    _check_call(calls[0])
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == calls[0]["function"]["arguments"]



def test_without_tools_mistral_answers_are_text_with_special_tokens_skipped(mistral_server):
    _, server, ids = mistral_server
    status, out = server.post("/v1/chat/completions", {"model": "", "messages": ASK, "temperature": 0, "max_tokens": 8,
                                                       "logit_bias": {str(ids["[ARGS]"]): 100}})
    assert status == 200 and "[ARGS]" not in out["choices"][0]["message"]["content"], out


@pytest.mark.parametrize("fmt", list(TEMPLATES))
def test_responses_and_messages_ask_for_the_markers_and_the_token_triggered_call(fmt):
    """The other two APIs build the same request: special tokens kept in auto mode only, and
    the call constrained from the [TOOL_CALLS] token (the Messages and Responses readers then
    parse it as chat's does: tests/test_server_units.py)."""
    from chat_plans import messages_plan, responses_plan

    from radixserve.server.anthropic.protocol import MessagesRequest
    from radixserve.server.chat.tools import keeps_markers
    from radixserve.server.errors import decode_body
    from radixserve.server.responses.protocol import CreateResponseRequest

    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    for choice, auto in (({"type": "auto"}, True), ({"type": "none"}, False), ({"type": "any"}, False)):
        b = decode_body(json.dumps({"model": "", "max_tokens": 8, "messages": ASK, "tools": [tool], "tool_choice": choice}).encode(),
                        MessagesRequest)
        conv, params = messages_plan(b, None, fmt)
        assert params.skip_special_tokens is not auto and keeps_markers(conv.mode, fmt) is auto
        assert (params.structural_tag is not None and "token_triggered_tags" in params.structural_tag) is auto
    b = decode_body(json.dumps({"input": "hi", "tools": [{"type": "function", **WEATHER["function"]}]}).encode(),
                    CreateResponseRequest)
    _, params = responses_plan(b, None, fmt)
    assert params.skip_special_tokens is False and "[TOOL_CALLS]" in (params.structural_tag or "")
