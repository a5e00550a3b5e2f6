"""What real OpenAI clients send: tools generated from nested pydantic models (the official
SDK's pydantic_function_tool, pydantic-ai's output tools), OpenAI's newer request fields,
chat_template_kwargs, and models.retrieve."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_helpers import USER

from radixserve.server.chat.tools import Tool, call_schema


class Address(BaseModel):  # bounded everywhere, so a random model's answer fits max_tokens
    street: str = Field(max_length=8)
    zip: int = Field(ge=0, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=8)
    home: Address
    work: Address | None = None


class Order(BaseModel):
    """Its own `Address`, unlike Person's: the two tools' definitions share a name."""

    class Address(BaseModel):
        country: str = Field(max_length=2)

    ship_to: Address
    count: int = Field(ge=1, le=9)


class Tree(BaseModel):  # recursive: a $ref to its own definition
    label: str = Field(max_length=4)
    kids: list[Tree] = Field(default_factory=list, max_length=1)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _tool(name: str, model: type[BaseModel]) -> Tool:
    return Tool(name, "", model.model_json_schema())


def test_each_tools_definitions_move_to_the_root_and_clashing_names_are_namespaced():
    tools = [_tool("person", Person), _tool("order", Order), _tool("tree", Tree)]
    schema = json.loads(call_schema(tools))
    assert {"Address", "order__Address", "Tree"} <= set(schema["$defs"])
    ok = [{"name": "person", "arguments": {"name": "a", "home": {"street": "s", "zip": 1}}},
          {"name": "order", "arguments": {"ship_to": {"country": "FR"}, "count": 2}},
          {"name": "tree", "arguments": {"label": "a", "kids": [{"label": "b", "kids": []}]}}]
    for call in ok:
        jsonschema.validate(call, schema)
    bad = [{"name": "order", "arguments": {"ship_to": {"street": "s", "zip": 1}, "count": 2}},  # Person's Address
           {"name": "tree", "arguments": {"label": "a", "kids": [{"label": 3}]}}]
    for call in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(call, schema)
    one = json.loads(call_schema([_tool("order", Order)]))  # a single tool keeps its names
    assert set(one["$defs"]) == {"Address"} and one["properties"]["arguments"]["properties"]["ship_to"]["$ref"] == "#/$defs/Address"


def test_refs_into_the_parameters_themselves_and_definitions_are_rewritten_too():
    params = {"type": "object", "definitions": {"N": {"type": "integer"}},
              "properties": {"a": {"$ref": "#/definitions/N"}, "b": {"$ref": "#/properties/a"},
                             "default": {"$ref": "#/definitions/N"}, "c": {"const": {"$ref": "#/kept/as/data"}}}}
    schema = json.loads(call_schema([Tool("x", "", {"type": "object"}), Tool("y", "", params)]))
    props = schema["anyOf"][1]["properties"]["arguments"]["properties"]
    assert props["a"]["$ref"] == props["default"]["$ref"] == "#/$defs/N"
    assert props["b"]["$ref"] == "#/anyOf/1/properties/arguments/properties/a"
    assert props["c"]["const"] == {"$ref": "#/kept/as/data"}
    jsonschema.validate({"name": "y", "arguments": {"a": 1, "b": 2, "default": 3, "c": {"$ref": "#/kept/as/data"}}}, schema)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_openai_sdk_pydantic_tools_with_nested_models_come_back_valid(client, choice):
    tools = [openai.pydantic_function_tool(Person), openai.pydantic_function_tool(Order)]
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "Order"}}
    r = client.chat.completions.create(model="", messages=USER, tools=tools, tool_choice=tool_choice, max_tokens=200,
                                       temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    call = c.message.tool_calls[0].function
    model = {"Person": Person, "Order": Order}[call.name]
    assert choice == "required" or call.name == "Order"
    model.model_validate_json(call.arguments)


def test_pydantic_ai_agent_with_a_nested_output_type_gets_a_valid_result(server, client):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    name = client.models.list().data[0].id
    model = OpenAIChatModel(name, provider=OpenAIProvider(base_url=server.url + "/v1", api_key="unused"))
    agent = Agent(model, output_type=Person, model_settings={"temperature": 0, "max_tokens": 200})
    result = asyncio.run(agent.run("Invent a person."))
    assert isinstance(result.output, Person) and isinstance(result.output.home, Address)


def test_tool_schema_compile_errors_name_the_tools_parameters(server):
    dangling = {"type": "function", "function": {"name": "d", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/Nope"}}}}}
    odd = {"type": "function", "function": {"name": "o", "parameters": {"type": "object", "properties": {"a": {"type": "foo"}}}}}
    plain = {"type": "function", "function": {"name": "p", "parameters": {"type": "object"}}}
    for tools, choice, param in (([plain, dangling], "required", "tools[1].function.parameters"),
                                 ([odd, plain], {"type": "function", "function": {"name": "o"}}, "tools[0].function.parameters")):
        status, err = server.post("/v1/chat/completions", {"messages": USER, "tools": tools, "tool_choice": choice})
        assert status == 400 and err["error"]["param"] == param, err
        assert err["error"]["message"].startswith(param) and "response_format" not in err["error"]["message"], err
    status, err = server.post("/v1/chat/completions", {"messages": USER, "tools": [plain, dangling], "tool_choice": "required"})
    assert "#/$defs/Nope" in err["error"]["message"], err  # the pointer as in the tool's own schema


def test_newer_openai_fields_are_accepted_on_chat_and_completions(client, server):
    extra = {"prompt_cache_key": "tenant-7-system-v2", "safety_identifier": "user-1f3a", "verbosity": "low"}
    r = client.chat.completions.create(model="", messages=USER, max_tokens=4, user="u", extra_body=extra)
    assert r.choices[0].finish_reason in ("stop", "length")
    r = client.completions.create(model="", prompt="Agents", max_tokens=4, extra_body=extra)
    assert r.choices[0].finish_reason in ("stop", "length")
    for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "x"})):
        status, err = server.post(path, {**body, "verbosity": "loud"})
        assert status == 400 and err["error"]["param"] == "verbosity", err
        status, err = server.post(path, {**body, "prompt_cache_key": "k" * 10_000})
        assert status == 400 and err["error"]["param"] == "prompt_cache_key", err


def test_prompt_cache_retention_is_taken_by_every_api_and_a_bad_value_names_the_field(client, server):
    r = client.chat.completions.create(model="", messages=USER, max_tokens=2, extra_body={"prompt_cache_retention": "24h"})
    assert r.choices[0].finish_reason in ("stop", "length")
    r = client.responses.create(model="", input="Agents", max_output_tokens=2, prompt_cache_retention="in_memory")
    assert r.status in ("completed", "incomplete")
    status, out = server.post("/generate", {"text": "Agents", "sampling_params": {"max_new_tokens": 2},
                                            "prompt_cache_retention": "1h"})
    assert status == 200, out
    for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/responses", {"input": "x"}),
                       ("/generate", {"text": "x"})):
        status, err = server.post(path, {**body, "prompt_cache_retention": "forever"})
        assert status == 400 and err["error"]["param"] == "prompt_cache_retention", err


def test_chat_template_kwargs_are_accepted_and_cannot_override_the_templates_own_arguments(client, server):
    r = client.chat.completions.create(model="", messages=USER, max_tokens=4,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False, "x": [1]}})
    assert r.choices[0].finish_reason in ("stop", "length")
    for key in ("tokenize", "chat_template", "messages", "not a name"):
        status, err = server.post("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {key: "x"}})
        assert status == 400 and err["error"]["param"] == f"chat_template_kwargs.{key}", err
    status, err = server.post("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": [1]})
    assert status == 400 and err["error"]["param"] == "chat_template_kwargs", err


def test_a_returned_message_with_reasoning_content_can_be_sent_back(client):
    history = [*USER, {"role": "assistant", "content": "Hi", "reasoning_content": "greet"}, {"role": "user", "content": "Go"}]
    r = client.chat.completions.create(model="", messages=history, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_models_retrieve_finds_the_served_model_and_404s_another(client):
    name = client.models.list().data[0].id
    card = client.models.retrieve(name)
    assert card.id == name and card.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.status_code == 404 and "gpt-4o" in str(e.value)
