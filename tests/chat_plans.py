"""Test helpers: each chat API's request as the chat core prepares it (translated, constrained,
its sampling parameters), and a Responses reply's call and turn, without a server."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from radixserve.request import SamplingParams
from radixserve.server.anthropic import convert as anthropic_convert
from radixserve.server.chat import core as chat_core
from radixserve.server.chat.core import Call, Plan, Rendered, Sampling, Turn
from radixserve.server.openai import chat as openai
from radixserve.server.responses import translate as responses_input
from radixserve.server.state import RequestOptions


def responses_plan(b: Any, parser: str | None, fmt: str = "hermes") -> tuple[Plan, SamplingParams]:
    plan, sampling = responses_input.plan_of(b, fmt)
    return plan, chat_core.prepare(plan, sampling, parser)[0]


def chat_plan(b: Any, parser: str | None) -> tuple[Plan, list[SamplingParams]]:
    plan = openai.chat_plan(b)
    return plan, chat_core.prepare(plan, openai.chat_sampling(b), parser)


def messages_plan(b: Any, parser: str | None, fmt: str = "hermes") -> tuple[Plan, SamplingParams]:
    plan = anthropic_convert.conversation(b, parser, fmt)
    sampling, _ = anthropic_convert.engine_request(b, plan)
    return plan, chat_core.prepare(plan, sampling, parser)[0]


def responses_reply(state: Any, b: Any, plan: Plan) -> tuple[Call, Turn]:
    """A Responses call and turn as the reply sees them (not stored), its item ids rs_1 and msg_1."""
    pending = responses_input.Pending(responses_input.new_response(state.model_name, b), ("rs_1", "msg_1"), [], None)
    call = Call(SimpleNamespace(app={"state": state}), state, SimpleNamespace(id="t"), 0.0, b)
    return call, Turn(plan, Sampling(), RequestOptions(), rendered=Rendered(), data=pending)
