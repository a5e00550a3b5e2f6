"""The chat core the three chat APIs share (server/chat/core.py): the tool constraint a plan
derives, the sampling parameters it makes, the renderer through the engine's chat_ids (a stored
turn's ids reused), and admission naming the tool behind a call schema's compile error."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from types import SimpleNamespace

import pytest

from radixserve.engine.front import RequestFront
from radixserve.request import SamplingParams
from radixserve.server.chat import core as chat_core
from radixserve.server.chat import tools
from radixserve.server.chat.core import Plan, Sampling
from radixserve.server.errors import ApiError
from radixserve.server.state import RequestOptions

FN = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
TOOLS = [tools.Tool("f", "", FN), tools.Tool("g", "", FN)]
USER = [{"role": "user", "content": "Hello there"}]


def _plan(mode: str, **kw) -> Plan:
    return Plan(list(USER), tools.CHAT_PARAMS, list(TOOLS), mode, list(TOOLS), **kw)


def test_a_plan_derives_its_call_constraint_and_reasoning_split_once():
    required = chat_core.constrain(_plan("required"), "qwen3")
    assert required.schema == tools.call_spec(TOOLS) and required.tag is None and required.parser == "qwen3"
    auto = chat_core.constrain(_plan("auto"), None)
    assert auto.call_tag and json.loads(auto.tag or "")["type"] == "structural_tag" and auto.schema is None
    assert not chat_core.constrain(_plan("auto"), None, free=False).call_tag  # a regex or EBNF of the client's
    assert not chat_core.constrain(_plan("auto", schema=('{"type": "object"}', False)), None).call_tag
    none = chat_core.constrain(_plan("none", template_kwargs={"enable_thinking": False}), "qwen3")
    assert none.offered == [] and none.tag is None and none.parser is None  # the template closed the reasoning


def test_unset_knobs_are_the_engine_defaults_and_each_choice_its_own_seed():
    assert Sampling().params() == SamplingParams(strict_json_schema=False)
    params = chat_core.sampling_params(chat_core.constrain(_plan("required"), "qwen3"), Sampling(n=3, seed=7))
    assert [p.seed for p in params] == [7, 8, 9] and all(p.grammar_after == "</think>" and p.strict_json_schema is False
                                                         for p in params)
    own = chat_core.sampling_params(_plan("none"), Sampling(regex="[0-9]+", grammar_after="ANSWER:"))[0]
    assert own.grammar_after == "ANSWER:" and own.json_schema is None  # the client's own marker wins


def test_calls_marked_with_special_tokens_are_decoded_with_them():
    mistral = chat_core.constrain(_plan("auto", tool_format="mistral"), None)
    assert chat_core.sampling_params(mistral, Sampling())[0].skip_special_tokens is False
    assert chat_core.sampling_params(_plan("required", tool_format="mistral"), Sampling())[0].skip_special_tokens


@pytest.fixture(scope="module")
def front(tiny_tokenizer) -> RequestFront:
    from transformers import AutoTokenizer

    f = RequestFront()
    f.tokenizer, f.context_len = AutoTokenizer.from_pretrained(str(tiny_tokenizer[0])), 256
    return f


def test_a_continuation_reuses_the_stored_ids_and_tokenizes_only_the_rest(front):
    tok = front.tokenizer
    texts: list[str] = []
    ids = front.chat_ids(USER, on_text=texts.append)
    assert ids == tok.apply_chat_template(USER, tokenize=True, add_generation_prompt=True, return_dict=False)
    turn = [*USER, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "The fox"}]
    stored = (texts[0], [5] * 3)  # ids as the engine ran them: not what the text tokenizes to
    again = front.chat_ids(turn, prefix=stored, on_text=texts.append)
    assert texts[1].startswith(texts[0])
    assert again == [5, 5, 5, *tok.encode(texts[1][len(texts[0]):], add_special_tokens=False)]
    assert front.chat_ids(turn, prefix=("not the start", [5])) == front.chat_ids(turn)


def _engine(fail: Exception) -> SimpleNamespace:
    def chat_ids(*args, **kwargs):
        raise fail

    return SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None), chat_ids=chat_ids)


def test_the_renderer_names_the_field_the_conversation_came_in():
    rename = {"prompt": "input", "max_new_tokens": "max_output_tokens"}
    with pytest.raises(ApiError) as e:
        chat_core.renderer(_engine(RuntimeError("roles must alternate")), _plan("none"), rename)()
    assert (e.value.param, e.value.message) == ("input", "input: the model's chat template rejected it: roles must alternate")
    with pytest.raises(ApiError, match="^messages: the model's chat template rejected them") as e:
        chat_core.renderer(_engine(RuntimeError("x")), _plan("none"), {"prompt": "messages"})()
    from radixserve.request import InvalidParam

    with pytest.raises(ApiError, match="^input: 9 characters cannot fit") as e:
        chat_core.renderer(_engine(InvalidParam("prompt", "9 characters cannot fit")), _plan("none"), rename)()
    assert e.value.param == "input"


def _admit(plan: Plan, error: ApiError, where: str = tools.CHAT_PARAMS) -> tuple[ApiError, RequestOptions]:
    plan.tool_schemas = where
    chat_core.constrain(plan, None)  # where a call's schema errors go is the plan's
    opts = RequestOptions(rename={"json_schema": "response_format"})

    @asynccontextmanager
    async def admit(tenant, prompts, params, opts, arrival):
        raise error
        yield

    async def go() -> None:
        async with chat_core.admit(SimpleNamespace(admit=admit), None, plan, [], [], opts, 0.0):
            pass

    with pytest.raises(ApiError) as e:
        asyncio.run(go())
    return e.value, opts


def test_a_call_schemas_compile_error_names_the_tool_in_the_apis_own_place():
    err = ApiError(400, "tools: unsupported keyword at #/anyOf/1/properties/arguments/properties/x", param="tools")
    e, opts = _admit(_plan("required"), err, tools.RESPONSES_PARAMS)
    assert opts.rename["json_schema"] == "tools"  # two tools may be called: the list, until the pointer says which
    assert e.param == "tools[1].parameters" and e.message.startswith("tools[1].parameters: unsupported keyword at #/")
    one = _plan("required")
    one.callable = TOOLS[1:]
    _, opts = _admit(one, err, tools.ANTHROPIC_PARAMS)
    assert opts.rename["json_schema"] == "tools[1].input_schema"
    e, opts = _admit(_plan("none"), err)  # no call is constrained: the error as it came
    assert e is err and opts.rename == {"json_schema": "response_format"}
