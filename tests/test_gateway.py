"""Kubernetes gateways (examples/kubernetes/): the gauges an endpoint picker scores pods by, on a
real server under load; /health as a readiness probe through a SIGTERM drain; and the example
manifests, checked against the Kubernetes JSON schemas (kubernetes-validate, offline), against
the InferencePool CRD's schema, and against each other and radixserve's own CLI."""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import ServerProcess, scaled

from radixserve.engine.protocol import EngineStats
from radixserve.server.metrics import Metrics, kv_cache_usage

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "kubernetes"
WAITING, RUNNING, KV = "radixserve:num_requests_waiting", "radixserve:num_requests_running", "radixserve:kv_cache_usage_perc"
GAUGES = (WAITING, RUNNING, KV)
LEGACY_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")  # the endpoint picker parses /metrics with these rules
BUILTIN_KINDS = {"Deployment", "Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding"}
MAX_RUNNING = 2

# The InferencePool schema, transcribed from the CRD of kubernetes-sigs/gateway-api-inference-extension,
# config/crd/bases/inference.networking.k8s.io_inferencepools.yaml, as the strictest of its v1
# releases: endpointPickerRef required and one target port (v1.0.0), a non-empty selector of at
# most 64 labels (v1.3.0+). Its two CEL rules (x-kubernetes-validations) are checked in _cel_rules.
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_PORT = {"type": "object", "required": ["number"], "additionalProperties": False,
         "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
INFERENCE_POOL_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"}, "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name"], "properties": {"name": _NAME}},
        "spec": {"type": "object", "required": ["endpointPickerRef", "selector", "targetPorts"], "additionalProperties": False,
                 "properties": {
                     "selector": {"type": "object", "required": ["matchLabels"], "additionalProperties": False, "properties": {
                         "matchLabels": {"type": "object", "minProperties": 1, "maxProperties": 64, "additionalProperties": {
                             "type": "string", "maxLength": 63, "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}}}},
                     "targetPorts": {"type": "array", "minItems": 1, "maxItems": 1, "items": _PORT},
                     "endpointPickerRef": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
                         "group": {"type": "string", "maxLength": 253,
                                   "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"},
                         "kind": {"type": "string", "minLength": 1, "maxLength": 63,
                                  "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"},
                         "name": _NAME, "port": _PORT, "failureMode": {"enum": ["FailOpen", "FailClose"]}}}}}},
}


def _cel_rules(pool: dict[str, Any]) -> list[str]:
    """The CRD's x-kubernetes-validations, as the API server would report them."""
    spec, errors = pool["spec"], []
    ref = spec["endpointPickerRef"]
    if ref.get("kind", "Service") == "Service" and "port" not in ref:
        errors.append("port is required when kind is 'Service' or unspecified (defaults to 'Service')")
    numbers = [p["number"] for p in spec["targetPorts"]]
    if len(set(numbers)) != len(numbers):
        errors.append("port number must be unique")
    return errors


# The endpoint picker's plugin types and parameters used in epp.yaml, as GAIE v1.5.0 and llm-d's router
# define them: pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go (engineConfigParams,
# modelServerExtractorParams), .../requestcontrol/dataproducer/approximateprefix/types.go (config), and
# the scorers' and data source's Type constants.
EPP_PLUGIN_PARAMETERS = {
    "queue-scorer": set(), "kv-cache-utilization-scorer": set(), "prefix-cache-scorer": set(), "metrics-data-source": set(),
    "approx-prefix-cache-producer": {"autoTune", "blockSizeTokens", "maxPrefixBlocksToMatch", "lruCapacityPerServer"},
    "core-metrics-extractor": {"engineLabelKey", "defaultEngine", "engineConfigs"},
}
EPP_ENGINE_FIELDS = {"name", "queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec", "cacheInfoSpec"}


def _manifests() -> list[dict[str, Any]]:
    return [d for p in sorted(EXAMPLES.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d is not None]


def _get(kind: str, name: str) -> dict[str, Any]:
    return next(d for d in _manifests() if d["kind"] == kind and d["metadata"]["name"] == name)


def _epp_config() -> dict[str, Any]:
    return yaml.safe_load(_get("ConfigMap", "radixserve-epp")["data"]["epp-config.yaml"])


def _radixserve_engine_config() -> dict[str, str]:
    extractor = next(p for p in _epp_config()["plugins"] if p["type"] == "core-metrics-extractor")
    return next(e for e in extractor["parameters"]["engineConfigs"] if e["name"] == "radixserve")


# -- the manifests ---------------------------------------------------------------------------------
def test_every_manifest_parses_and_builtin_kinds_validate_against_the_kubernetes_schemas():
    docs = _manifests()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["Deployment", "Service", "InferencePool", "HTTPRoute", "ConfigMap", "ServiceAccount", "Role",
                            "RoleBinding", "Deployment", "Service", "PodMonitor", "ScaledObject"])
    for doc in (d for d in docs if d["kind"] in BUILTIN_KINDS):
        for version in ("1.29.0", kubernetes_validate.latest_version()):  # strict: an unknown field fails
            kubernetes_validate.validate(doc, version, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):  # the schemas bite: a typo is refused
        bad = _get("Deployment", "radixserve")
        bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
        kubernetes_validate.validate(bad, "1.29.0", strict=True)


def test_the_keda_scaled_object_scales_the_deployment_on_metrics_the_pods_export():
    """keda-scaledobject.yaml: it targets radixserve.yaml's Deployment, scrapes its pods' port,
    and every metric its queries name is one the server exports (the gauges, the TTFT histogram)."""
    scaled, monitor, pods = _get("ScaledObject", "radixserve"), _get("PodMonitor", "radixserve"), _get("Deployment", "radixserve")
    assert scaled["spec"]["scaleTargetRef"]["name"] == pods["metadata"]["name"]
    assert 1 <= scaled["spec"]["minReplicaCount"] < scaled["spec"]["maxReplicaCount"]  # scale to zero: off
    labels = pods["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = [p["name"] for p in pods["spec"]["template"]["spec"]["containers"][0]["ports"]]
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["http"] and "http" in ports
    queries = [t["metadata"]["query"] for t in scaled["spec"]["triggers"]]
    names = {n for q in queries for n in re.findall(r"(radixserve[:_][a-z0-9_:]+)\{", q)}
    assert names == {WAITING, KV, "radixserve_time_to_first_token_per_1k_prompt_tokens_seconds_bucket"}
    metrics = Metrics(EngineStats, lambda: 0, 1.0, 0.1)
    metrics.observe(0.5, 1.0, 4, "stop")
    exported = {s.name for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert names <= exported
    assert all(t["type"] == "prometheus" and float(t["metadata"]["threshold"]) > 0 for t in scaled["spec"]["triggers"])


def test_the_inference_pool_validates_against_the_crd_schema():
    pool = _get("InferencePool", "radixserve")
    jsonschema.validate(pool, INFERENCE_POOL_SCHEMA)
    assert _cel_rules(pool) == []
    no_port = {**pool, "spec": {**pool["spec"], "endpointPickerRef": {"name": "x"}}}
    assert _cel_rules(no_port) == ["port is required when kind is 'Service' or unspecified (defaults to 'Service')"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**pool, "spec": {**pool["spec"], "selector": {"matchLabels": {}}}}, INFERENCE_POOL_SCHEMA)


def test_the_manifests_reference_each_other():
    deploy, service, pool = _get("Deployment", "radixserve"), _get("Service", "radixserve"), _get("InferencePool", "radixserve")
    pod = deploy["spec"]["template"]
    labels, container = pod["metadata"]["labels"], pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert deploy["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items() and service["spec"]["ports"][0]["targetPort"] in ports
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports["http"]]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] in ports
    assert labels["llm-d.ai/engine-type"] == labels["inference.networking.k8s.io/engine-type"] == _radixserve_engine_config()["name"]
    route = _get("HTTPRoute", "radixserve")["spec"]["rules"][0]["backendRefs"][0]
    assert (route["group"], route["kind"], route["name"]) == ("inference.networking.k8s.io", "InferencePool", "radixserve")
    _check_epp_references(pool)


def _check_epp_references(pool: dict[str, Any]) -> None:
    epp, svc = _get("Deployment", "radixserve-epp"), _get("Service", pool["spec"]["endpointPickerRef"]["name"])
    pod = epp["spec"]["template"]
    container = pod["spec"]["containers"][0]
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert not pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()  # the picker is no model server
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    ext_proc = next(p for p in svc["spec"]["ports"] if p["port"] == pool["spec"]["endpointPickerRef"]["port"]["number"])
    assert ports[ext_proc["targetPort"]] == int(args["grpc-port"])
    assert args["pool-name"] == pool["metadata"]["name"] and args["pool-group"] == "inference.networking.k8s.io"
    mount = container["volumeMounts"][0]
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    config_map = _get("ConfigMap", volume["configMap"]["name"])
    assert args["config-file"] == f"{mount['mountPath']}/epp-config.yaml" and "epp-config.yaml" in config_map["data"]
    binding, role = _get("RoleBinding", "radixserve-epp"), _get("Role", "radixserve-epp")
    assert binding["subjects"][0]["name"] == pod["spec"]["serviceAccountName"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    watched = {r for rule in role["rules"] for r in rule["resources"]}
    assert {"pods", "inferencepools"} <= watched
    cfg = _epp_config()
    assert (cfg["apiVersion"], cfg["kind"]) == ("inference.networking.x-k8s.io/v1alpha1", "EndpointPickerConfig")
    for plugin in cfg["plugins"]:
        assert set(plugin.get("parameters", {})) <= EPP_PLUGIN_PARAMETERS[plugin["type"]], plugin
    extractor = next(p for p in cfg["plugins"] if p["type"] == "core-metrics-extractor")["parameters"]
    assert all(set(e) <= EPP_ENGINE_FIELDS for e in extractor["engineConfigs"])
    assert extractor["defaultEngine"] in {e["name"] for e in extractor["engineConfigs"]}
    names = {p.get("name", p["type"]) for p in cfg["plugins"]}
    refs = {p["pluginRef"] for prof in cfg["schedulingProfiles"] for p in prof["plugins"]}
    sources = cfg["data"]["sources"]
    refs |= {s["pluginRef"] for s in sources} | {e["pluginRef"] for s in sources for e in s["extractors"]}
    assert refs <= names


def test_the_container_command_is_a_radixserve_command_line_that_drains_within_the_grace_period():
    from radixserve.cli import build_parser

    pod = _get("Deployment", "radixserve")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["radixserve"]
    args = build_parser().parse_args(container["args"])  # every flag is one radixserve serve knows
    assert (args.cmd, args.host, args.port) == ("serve", "0.0.0.0", container["ports"][0]["containerPort"])
    assert args.kv_cache_memory_mb is not None  # not sized from the node's memory
    assert pod["terminationGracePeriodSeconds"] >= args.drain_timeout + 5  # the drain, then its aborts' 5 s
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > args.drain_timeout  # a drain's 503s never restart it


# -- the gauges, on a real server ------------------------------------------------------------------
@pytest.fixture(scope="module")
def gateway_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    s = ServerProcess(tiny_llama, "--kv-cache-tokens", "4096", "--max-running-requests", str(MAX_RUNNING),
                      log=tmp_path_factory.mktemp("gateway") / "server.log")
    yield s
    assert s.stop() == 0, s.log.read_text()


def _scrape(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return {f.name: f for f in text_string_to_metric_families(r.read().decode())}


def _value(families: dict[str, Any], name: str) -> float:
    (sample,) = families[name].samples
    return sample.value


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def test_the_gateway_gauges_are_exported_with_their_documented_names_and_types(gateway_server):
    families = _scrape(gateway_server.url)
    for name in GAUGES:
        assert families[name].type == "gauge" and families[name].samples[0].labels == {}
    assert all(LEGACY_NAME.match(name) for name in families)
    spec = _radixserve_engine_config()  # what epp.yaml maps: exactly these gauges
    assert (spec["queuedRequestsSpec"], spec["runningRequestsSpec"], spec["kvUsageSpec"]) == GAUGES
    for name in ("radixserve_replica_waiting_requests", "radixserve_replica_running_requests",
                 "radixserve_replica_kv_cache_usage_perc"):
        assert [s.labels for s in families[name].samples] == [{"replica": "0"}]  # one engine: one replica
    assert {"radixserve_queued_requests", "radixserve_running_requests", "radixserve_waiting_requests"} <= set(families)
    assert not any(name.startswith("vllm:") for name in families)  # vLLM's names only when asked for


def test_the_probe_paths_answer_200_on_a_ready_server(gateway_server):
    container = _get("Deployment", "radixserve")["spec"]["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert gateway_server.get(container[probe]["httpGet"]["path"]) == (200, {"status": "ok"})
    assert _value(_scrape(gateway_server.url), "radixserve_kv_total_tokens") == 4096  # ready: the engine is loaded


def test_the_gauges_count_waiting_and_running_requests_under_load_and_return_to_idle(gateway_server):
    s, n, tokens = gateway_server, 4, 128
    body = lambda i: {"input_ids": _ids(40, i), "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
    seen: dict[str, list[float]] = {g: [] for g in GAUGES}
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(s.post, "/generate", body(i)) for i in range(n)]
        while not all(f.done() for f in futures):
            families = _scrape(s.url)
            for g in GAUGES:
                seen[g].append(_value(families, g))
            time.sleep(0.02)
        results = [f.result() for f in futures]
    assert all(st == 200 and r["meta_info"]["completion_tokens"] == tokens for st, r in results)
    assert max(seen[RUNNING]) == MAX_RUNNING  # --max-running-requests 2: two at once, never more
    pairs = list(zip(seen[WAITING], seen[RUNNING]))
    assert (n - MAX_RUNNING, MAX_RUNNING) in pairs  # while two ran, the rest waited in the engine's queue
    assert all(w + r <= n for w, r in pairs)
    assert 0 < max(seen[KV]) <= 1
    s.wait_idle()
    families = _scrape(s.url)
    assert [_value(families, g) for g in GAUGES] == [0, 0, 0]
    assert _value(families, "radixserve_kv_cached_tokens") > 0  # cached prefixes stay, evictable: they count as free


# -- the gauges' arithmetic -----------------------------------------------------------------------
def test_kv_usage_counts_held_and_locked_slots_and_evictable_prefixes_as_free():
    held = EngineStats(kv_total_slots=100, kv_free_slots=50, kv_in_use_slots=20, kv_cached_tokens=30,
                       kv_evictable_tokens=20, kv_locked_tokens=10)
    assert kv_cache_usage(held) == 0.3  # 20 held by requests + 10 locked; 20 evictable are free
    assert kv_cache_usage(EngineStats(kv_total_slots=64, kv_free_slots=0, kv_cached_tokens=64, kv_evictable_tokens=64)) == 0
    assert kv_cache_usage(EngineStats()) == 0  # no pool yet


def test_vllm_names_and_per_replica_gauges_when_asked_for():
    replicas = [EngineStats(kv_total_slots=100, kv_free_slots=40, kv_in_use_slots=60, running=3, waiting=1),
                EngineStats(kv_total_slots=100, kv_free_slots=100)]
    total = EngineStats.sum(replicas)
    m = Metrics(lambda: total, lambda: 0, 1.0, 1.0, replicas=lambda: replicas, vllm_names=True)
    families = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    for ours, theirs in zip(GAUGES, ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")):
        assert _value(families, ours) == _value(families, theirs)
    assert [_value(families, g) for g in GAUGES] == [1, 3, 0.3]
    per_replica = {s.labels["replica"]: s.value for s in families["radixserve_replica_kv_cache_usage_perc"].samples}
    assert per_replica == {"0": 0.6, "1": 0.0}

    text = Metrics(lambda: total, lambda: 0, 1.0, 1.0).render().decode()  # by default: one replica, our names only
    families = {f.name: f for f in text_string_to_metric_families(text)}
    running = {s.labels["replica"]: s.value for s in families["radixserve_replica_running_requests"].samples}
    assert running == {"0": 3} and _value(families, RUNNING) == 3 and "vllm:num_requests_running" not in families


# -- /health through a drain ---------------------------------------------------------------------
def _call(url: str, path: str, data: bytes | None = None) -> tuple[int, str, str | None]:
    """(status, body, Retry-After) of a GET, or of a JSON POST when data is given."""
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode(), r.headers.get("Retry-After")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers.get("Retry-After")


def test_health_says_engine_down_before_draining_and_a_clean_shutdown_is_no_failure():
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from radixserve.server.app import health
    from radixserve.server.state import ServerState

    async def answer(dead: str | None, draining: bool) -> tuple[int, str]:
        state = SimpleNamespace(engine=SimpleNamespace(dead=dead), admission=SimpleNamespace(draining=draining))
        state.engine_down = lambda: ServerState.engine_down(state)  # the real rule: "shut down" is no failure
        app = web.Application()
        app["state"] = state
        resp = await health(make_mocked_request("GET", "/health", app=app))
        return resp.status, json.loads(resp.body)["status"]

    cases = {(None, False): (200, "ok"), (None, True): (503, "draining"), ("shut down", False): (200, "ok"),
             ("it exited with code -9", False): (503, "engine_down"), ("it exited with code -9", True): (503, "engine_down")}
    for (dead, draining), expected in cases.items():
        assert asyncio.run(answer(dead, draining)) == expected


def test_health_is_ready_then_503_draining_after_sigterm_until_the_running_request_ends(gateway_server):
    """Last in the module: it stops the module's server (SIGTERM, as a pod deletion does)."""
    s = gateway_server
    box: dict[str, Any] = {}
    body = {"input_ids": _ids(30, 5), "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}}
    t = threading.Thread(target=lambda: box.update(result=s.post("/generate", body)))
    t.start()
    deadline = time.monotonic() + scaled(30)
    while _value(_scrape(s.url), RUNNING) == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _call(s.url, "/health")[:2] == (200, '{"status":"ok"}')
    s.proc.send_signal(signal.SIGTERM)
    answers, draining, refused = [], (503, '{"status":"draining"}'), None
    while t.is_alive() and time.monotonic() < deadline:  # the drain lasts as long as the request runs
        try:
            answers.append(_call(s.url, "/health")[:2])
            if answers[-1] == draining and refused is None:  # a new request meanwhile
                refused = _call(s.url, "/generate", b'{"text": "hi"}')
        except OSError:  # no longer listening: the drain is over
            break
        time.sleep(0.02)
    t.join()
    assert draining in answers and set(answers[answers.index(draining):]) == {draining}  # never ready again
    assert refused is not None and (refused[0], refused[2]) == (503, "1")  # refused: retry in a second (elsewhere)
    status, r = box["result"]
    assert status == 200 and r["meta_info"]["completion_tokens"] == 240
    assert s.proc.wait(30) == 0
