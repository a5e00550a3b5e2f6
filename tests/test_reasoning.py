"""--reasoning-parser: <think>...</think> reasoning apart from the answer, in whole answers and
streams, with constraints (JSON, tool calls) applied to the answer only."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import subprocess
import sys

import openai
import pytest
from chat_plans import chat_plan
from server_helpers import USER, ServerProcess

from radixserve.config import ServerConfig
from radixserve.engine.outputs import Output
from radixserve.server.chat import reasoning
from radixserve.server.openai.chat import chat_choice
from radixserve.server.protocol import ChatCompletionRequest, ChatMessage


def _streamed(text: str, parser: str, seed: int) -> tuple[str, str, bool]:
    """The text fed in random pieces of 1-4 characters: (reasoning, content, saw reasoning)."""
    rng, s, r, c, i = random.Random(seed), reasoning.splitter(parser), "", "", 0
    while i < len(text):
        k = rng.randint(1, 4)
        a, b = reasoning.feed(s, text[i:i + k], final=i + k >= len(text))
        r, c, i = r + a, c + b, i + k
    return r, c, s.saw_reasoning


CASES = [  # (parser, output, reasoning_content, content)
    ("qwen3", "<think>\nplan it</think>\n\nThe answer", "plan it", "The answer"),
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("qwen3", "no tags at all", None, "no tags at all"),
    ("qwen3", "an answer mentioning <think> later", None, "an answer mentioning <think> later"),
    ("qwen3", "<thi", None, "<thi"),  # ended mid-tag: plain text
    ("qwen3", "<think>cut off by max_tok", "cut off by max_tok", None),  # unterminated: all reasoning
    ("qwen3", "<think>x</think", "x</think", None),
    ("deepseek_r1", "reasoning first</think>\n{\"a\": 1}", "reasoning first", "{\"a\": 1}"),
    ("deepseek_r1", "<think>\nit opened anyway</think>ok", "it opened anyway", "ok"),
    ("deepseek_r1", "never closed", "never closed", None),
    ("deepseek_r1", "a </thin k> is no tag</think>x</think>", "a </thin k> is no tag", "x</think>"),
]


@pytest.mark.parametrize(("parser", "text", "thought", "content"), CASES)
def test_whole_split_and_every_streamed_split_agree(parser, text, thought, content):
    assert reasoning.split(text, parser) == (thought, content)
    for seed in range(40):  # tags cut across deltas at random places
        r, c, saw = _streamed(text, parser, seed)
        assert (r if saw else None, (c or None) if saw else c) == (thought, content), seed


def test_a_tag_split_across_deltas_never_leaks_into_either_part():
    s = reasoning.splitter("qwen3")
    assert s.feed("<th") == ("", "")
    assert s.feed("ink>ab</th") == ("ab", "")
    assert s.feed("in") == ("", "")
    assert s.feed("k>\n\n") == ("", "")
    assert s.feed("Hi") == ("", "Hi")
    assert s.flush() == ("", "")


def test_no_parser_leaves_the_text_alone():
    assert reasoning.split("<think>x</think>y", None) == (None, "<think>x</think>y")
    assert reasoning.feed(None, "<think>", final=True) == ("", "<think>")


def test_the_cli_choices_are_the_parsers_there_are():
    field = next(f for f in dataclasses.fields(ServerConfig) if f.name == "reasoning_parser")
    assert tuple(field.metadata["choices"]) == tuple(reasoning.PARSERS)


def _plan(parser: str | None, **body):
    b = ChatCompletionRequest(messages=[ChatMessage("user", "hi")], **body)
    return b, *chat_plan(b, parser)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}


def test_a_constraint_starts_after_the_reasoning_only_with_a_parser_and_thinking_on():
    json_fmt = {"response_format": {"type": "json_object"}}
    b, plan, params = _plan("qwen3", **json_fmt)
    assert params[0].grammar_after == "</think>"
    b, plan, params = _plan("qwen3", tools=[TOOL], tool_choice="required")
    assert params[0].grammar_after == "</think>" and params[0].json_schema
    b, plan, params = _plan("qwen3")  # nothing to constrain
    assert params[0].grammar_after is None
    b, plan, params = _plan(None, **json_fmt)  # no parser: unchanged
    assert params[0].grammar_after is None and plan.parser is None
    b, plan, params = _plan("qwen3", chat_template_kwargs={"enable_thinking": False}, **json_fmt)
    assert params[0].grammar_after is None and plan.parser is None  # the template closed it
    b, plan, params = _plan("deepseek_r1", grammar_after="ANSWER:", regex="[0-9]+")
    assert params[0].grammar_after == "ANSWER:"  # the client's own marker wins


def _out(text: str, reason: str = "stop") -> Output:
    return Output("r", text, [], reason, 3, 5, 0)


def _choice(o: Output, plan):
    return chat_choice(None, 0, o, reasoning.read(o, plan))


def test_tool_calls_and_json_are_read_from_the_content_only():
    b, plan, params = _plan("qwen3", tools=[TOOL], tool_choice="required")
    c = _choice(_out('<think>call f with {"x": 2}</think>\n{"name": "f", "arguments": {"x": 1}}'), plan)
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert c.message.reasoning_content == 'call f with {"x": 2}'
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"x": 1}
    b, plan, params = _plan("qwen3", tools=[TOOL])  # auto: a tagged call inside the reasoning is not a call
    c = _choice(_out('<think><tool_call>{"name": "f", "arguments": {}}</tool_call></think>Hi'), plan)
    assert c.finish_reason == "stop" and c.message.tool_calls is None and c.message.content == "Hi"
    b, plan, params = _plan("deepseek_r1", response_format={"type": "json_object"})
    c = _choice(_out("still thinking", "length"), plan)
    assert (c.message.reasoning_content, c.message.content, c.finish_reason) == ("still thinking", None, "length")
    b, plan, params = _plan(None, tools=[TOOL])  # no parser: the tags are content
    c = _choice(_out("<think>x</think>y"), plan)
    assert c.message.content == "<think>x</think>y" and c.message.reasoning_content is None


THINKING_TEMPLATE = (  # Qwen3's switch: enable_thinking=false closes an empty reasoning in the prompt
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def qwen3_server(tiny_llama, tmp_path_factory):
    model = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_llama, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": THINKING_TEMPLATE}))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    s = ServerProcess(model, "--kv-cache-tokens", "4096", "--reasoning-parser", "qwen3", log=model.parent / "server.log")
    yield s
    assert s.stop() == 0, s.log.read_text()


def test_served_output_without_think_tags_is_all_content_whole_and_streamed(qwen3_server):
    client = openai.OpenAI(base_url=qwen3_server.url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model="", messages=USER, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message
    assert isinstance(whole.content, str) and "<think>" not in whole.content
    assert getattr(whole, "reasoning_content", None) is None
    chunks = [ch.choices[0].delta for ch in client.chat.completions.create(**kw, stream=True) if ch.choices]
    assert "".join(d.content or "" for d in chunks) == whole.content
    assert not any(getattr(d, "reasoning_content", None) for d in chunks)


def test_served_template_kwargs_reach_the_template_and_thinking_off_constrains_at_once(qwen3_server):
    client = openai.OpenAI(base_url=qwen3_server.url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model="", messages=USER, max_tokens=40, temperature=0, response_format={"type": "json_object"})
    on = client.chat.completions.create(**kw)
    off = client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the template closed the reasoning itself
    assert on.choices[0].finish_reason in ("stop", "length")  # constrained only after a </think> that never came
    if off.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(off.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a JSON prefix, no free text before it
        assert off.choices[0].message.content.lstrip().startswith("{")


def test_an_unknown_reasoning_parser_is_refused_at_the_command_line(tiny_llama):
    r = subprocess.run([sys.executable, "-m", "radixserve.cli", "serve", "--model", str(tiny_llama),
                        "--reasoning-parser", "nope"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "invalid choice: 'nope'" in r.stderr
