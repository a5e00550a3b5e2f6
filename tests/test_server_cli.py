"""The serving command's surface: --help describes every flag, a busy port is one line and exit 2
before the model loads, the access log (one line per request, never the key, the prompt only
with --log-requests), and /openapi.json covering every route on the app."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from server_helpers import USER, ServerProcess

from radixserve.config import RouterConfig, ServerConfig
from radixserve.engine.protocol import EngineStats
from radixserve.server import serve
from radixserve.server.app import build_app
from radixserve.server.auth import Auth
from radixserve.server.openapi import DOCUMENT

CLI = [sys.executable, "-m", "radixserve.cli"]


# -- --help --------------------------------------------------------------------------------------
def _help_blocks(text: str) -> dict[str, tuple[str, str]]:
    """flag -> (its invocation, e.g. '--dtype {auto,...}', its help text), from argparse's output."""
    blocks: dict[str, tuple[str, str]] = {}
    flag = None
    for line in text.splitlines():
        m = re.match(r"^  (--[\w-]+,?(?: \S+)*)(?:\s{2,}(.*))?$", line)  # '--flag METAVAR' (or '--x, --no-x'), then the help
        if m:
            flag = m.group(1).split()[0].rstrip(",")
            blocks[flag] = (m.group(1), (m.group(2) or "").strip())
        elif flag and line.startswith("    ") and line.strip():
            inv, text_so_far = blocks[flag]
            blocks[flag] = (inv, (text_so_far + " " + line.strip()).strip())
        elif not line.strip():
            flag = None
    return blocks


def test_serve_help_describes_every_flag_with_its_default_and_choices():
    from radixserve.cli_args import _ENGINE_FLAGS, scalar_fields

    out = subprocess.run([*CLI, "serve", "--help"], capture_output=True, text=True, env={**os.environ, "COLUMNS": "400"},
                         check=True).stdout
    blocks = _help_blocks(out)
    flags = {**_ENGINE_FLAGS, **scalar_fields(ServerConfig), **scalar_fields(RouterConfig)}
    from radixserve.ray.options import RAY_ONLY  # --ray, --replicas and the autoscaling flags (and host, port)
    from radixserve.server.serve import SECRET_ENV  # --api-key-file, --metrics-key-file

    ray_flags = {"--" + n.replace("_", "-") for n in RAY_ONLY}
    key_files = {f"--{n.replace('_', '-')}-file" for n in SECRET_ENV}
    assert set(blocks) == {"--model"} | ray_flags | key_files | {"--" + n.replace("_", "-") for n in flags}  # and -h, --help
    assert all(blocks[f][1] for f in ray_flags | key_files), "a Ray or key-file flag without a description"
    for name, f in flags.items():
        invocation, text = blocks["--" + name.replace("_", "-")]
        description = re.sub(r"\s*\(default: [^)]*\)$", "", text)
        assert description, f"--{name} has no description: {text!r}"
        if f.type is not bool:
            assert text.endswith(f"(default: {f.default})"), text
        if f.choices:
            assert "{" + ",".join(f.choices) + "}" in invocation, invocation
    assert "(default: 30000)" in blocks["--port"][1] and "{auto,float32,bfloat16,float16}" in blocks["--dtype"][0]


def test_config_choices_match_the_registries_that_resolve_them():
    from radixserve import config
    from radixserve.attention import CHOICES
    from radixserve.cache.radix import EVICTION_POLICIES
    from radixserve.engine.engine import _DTYPES
    from radixserve.routing.policy import POLICIES as ROUTERS
    from radixserve.sched.policy import POLICIES

    assert config.ATTENTION_BACKENDS == CHOICES and config.EVICTION_POLICIES == tuple(EVICTION_POLICIES)
    assert config.SCHEDULE_POLICIES == POLICIES and config.DTYPES == ("auto", *_DTYPES)
    assert config.ROUTER_POLICIES == tuple(ROUTERS)


# -- a busy port ---------------------------------------------------------------------------------
@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_busy_port_is_one_line_and_exit_2_before_the_model_loads(busy_port, tmp_path):
    missing = tmp_path / "no-model-here"  # never loaded: the port is checked first
    r = subprocess.run([*CLI, "serve", "--model", str(missing), "--port", str(busy_port)], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"radixserve: error: port {busy_port} on 127.0.0.1 is already in use "
                                "(choose another with --port)")


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_a_port_out_of_range_is_one_line_and_exit_2_before_the_model_loads(port, tmp_path):
    r = subprocess.run([*CLI, "serve", "--model", str(tmp_path / "no-model-here"), "--port", port], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"radixserve: error: port: {port} is not a TCP port (0-65535)"


def test_a_port_taken_after_the_check_is_the_same_one_line(busy_port):
    """The race: the port is free when checked and taken at the real bind."""
    engine = SimpleNamespace(tokenizer=None, vocab_size=0, model_name="m", snapshot=EngineStats,
                             replica_snapshots=lambda: [EngineStats()], loras=lambda: [])
    cfg = ServerConfig(port=busy_port)
    with pytest.raises(ValueError) as e:
        asyncio.run(serve.serve(engine, cfg, Auth(), time.monotonic()))
    assert str(e.value) == f"port {busy_port} on 127.0.0.1 is already in use (choose another with --port)"
    serve.check_port("127.0.0.1", 0)  # a free port passes


# -- the access log --------------------------------------------------------------------------------
SECRET_PROMPT = "Zebras audit quarterly ledgers."
LINE = re.compile(r"radixserve\.access: (\w+) (\S+) status=(\d+) tenant=(\S+) prompt_tokens=(\S+) "
                  r"completion_tokens=(\S+) latency_ms=[\d.]+(?: prompt=(.*))?$")


def _access_lines(log: Path, at_least: int) -> list[tuple[str, ...]]:
    for _ in range(100):  # a line is written once its response is handed to aiohttp
        lines = [m.groups() for m in map(LINE.search, log.read_text().splitlines()) if m]
        if len(lines) >= at_least:
            return lines
        time.sleep(0.05)
    return lines


def test_access_log_has_a_line_per_request_without_the_prompt(server):
    status, _ = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": SECRET_PROMPT}],
                                                     "temperature": -1})
    assert status == 400
    status, body = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": SECRET_PROMPT}],
                                                        "max_tokens": 3, "ignore_eos": True})
    assert status == 200
    lines = [x for x in _access_lines(server.log, 2) if x[1] == "/v1/chat/completions"]
    bad = next(x for x in lines if x[2] == "400")
    good = next(x for x in lines if x[2] == "200")
    assert bad[:6] == ("POST", "/v1/chat/completions", "400", "default", "-", "-")
    usage = body["usage"]
    assert good[:6] == ("POST", "/v1/chat/completions", "200", "default", str(usage["prompt_tokens"]), "3")
    assert SECRET_PROMPT not in server.log.read_text() and good[6] is None


def test_access_log_never_has_the_key_and_has_the_prompt_with_log_requests(tiny_llama, tmp_path):
    key = "sk-very-secret-key-4242"
    s = ServerProcess(tiny_llama, "--kv-cache-tokens", "2048", "--api-key", key, "--log-requests", log=tmp_path / "server.log")
    try:
        assert s.post("/generate", {"text": SECRET_PROMPT, "sampling_params": {"max_new_tokens": 2}}, key="wrong-key")[0] == 401
        assert s.post("/v1/completions", {"prompt": SECRET_PROMPT, "max_tokens": 2, "n": 2, "ignore_eos": True}, key=key)[0] == 200
        assert s.get("/v1/models/nope", key=key)[0] == 404
        assert s.post("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "ignore_eos": True}, key=key)[0] == 200
        lines = _access_lines(s.log, 5)  # and the readiness probe's GET /health
    finally:
        assert s.stop() == 0
    text = s.log.read_text()
    assert key not in text and "wrong-key" not in text
    by_path = {x[1]: x for x in lines}
    assert by_path["/generate"][2:6] == ("401", "-", "-", "-")
    completion = by_path["/v1/completions"]
    assert completion[2:4] == ("200", "default") and completion[5] == "4"  # n=2: two samples of 2 tokens
    assert completion[6] == f'"{SECRET_PROMPT}"'  # one prompt, counted and shown once
    assert by_path["/v1/models/nope"][2:4] == ("404", "default")
    assert USER[0]["content"] in by_path["/v1/chat/completions"][6]  # the chat template's text around it


# -- /openapi.json -------------------------------------------------------------------------------
def test_openapi_covers_every_route_on_the_app_and_is_openapi_3_1(server):
    import jsonschema
    from aiohttp import hdrs
    from schemathesis.specs.openapi.definitions import OPENAPI_31

    app = build_app(SimpleNamespace(config=ServerConfig(), model_name="m"))
    doc = app[DOCUMENT]
    jsonschema.Draft202012Validator(OPENAPI_31).validate(doc)
    routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes()
              if r.method not in ("HEAD", hdrs.METH_ANY)}
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert routes == documented
    assert {("get", "/health"), ("get", "/v1/models/{model}"), ("post", "/flush_cache"), ("get", "/metrics")} <= routes
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert op["summary"] and "200" in op["responses"], path
    model = doc["paths"]["/v1/models/{model}"]["get"]
    assert model["parameters"][0]["name"] == "model" and model["responses"]["200"]["content"]["application/json"]["schema"]
    assert "requestBody" in doc["paths"]["/abort_request"]["post"]
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    _, served = server.get("/openapi.json")
    assert set(served["paths"]) == set(doc["paths"])


def test_every_config_field_has_a_description():
    from radixserve import config

    for cls in (config.ModelConfig, config.CacheConfig, config.SchedConfig, config.SpecConfig, config.EngineConfig,
                config.ServerConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name}"
