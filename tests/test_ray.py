"""Ray Serve (radixserve.ray) end to end, on the tiny model: `radixserve serve --ray` on a local
cluster of its own, then (one module-scoped local cluster bound to 127.0.0.1) two applications
built from examples/ray/serve_config.yaml's args, of 2 replicas each, one routed by prefix
affinity, one round-robin. Cache behaviour is asserted from each replica's engine counters
(prefill_tokens_computed, running requests, KV slots held), never from timings; every client
call has a timeout."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import CORPUS
from server_helpers import MAX_BODY, USER, free_port, scaled

# before ray is imported: a one-machine cluster whose every socket is on 127.0.0.1, no usage stats
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

LONG = " ".join(CORPUS * 4)  # ~650 tokens of the tiny tokenizer
TENANTS = """
[[tenants]]
id = "acme"
api_key = "sk-acme"
admin = true

[[tenants]]
id = "globex"
api_key = "sk-globex"
admin = true
"""
ACME, GLOBEX = "sk-acme", "sk-globex"
TIMEOUT = 120
CONFIG = Path(__file__).resolve().parents[1] / "examples" / "ray" / "serve_config.yaml"


@dataclass
class Cluster:
    url: str

    def replicas(self, app: str) -> dict[str, object]:
        """The app's engine replicas: unique id -> actor handle (Serve names them SERVE_REPLICA::app#deployment#id)."""
        import ray

        prefix = f"SERVE_REPLICA::{app}#RadixServeReplica#"
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
        return {n[len(prefix):]: ray.get_actor(n, namespace="serve") for n in names}

    def stats(self, app: str) -> dict[str, dict]:
        """Each replica's routing stats (radixserve's record_routing_stats: its engine's counters as 'kv')."""
        import ray

        return {uid: ray.get(a.record_routing_stats.remote(), timeout=30) for uid, a in self.replicas(app).items()}


def test_radixserve_serve_ray_serves_on_a_local_cluster_and_stops(tiny_llama: Path, tmp_path: Path):
    ray_tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # the command makes its own choices
    env.update(RAY_TMPDIR=ray_tmp)
    port, log = free_port(), tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "radixserve.server.cli", "serve", "--ray", "--replicas", "1", "--model", str(tiny_llama),
           "--port", str(port), "--kv-cache-tokens", "4096", "--grammar-compile-workers", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + scaled(180)
        while time.monotonic() < deadline and proc.poll() is None and "radixserve ready on Ray Serve" not in log.read_text():
            time.sleep(0.5)
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert r.status == 200
        assert proc.poll() is None, log.read_text()
        body = json.dumps({"messages": USER, "max_tokens": 5, "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200 and r.headers["x-radixserve-replica"]
            assert json.loads(r.read())["usage"]["completion_tokens"] == 5
        assert "this node 127.0.0.1" in log.read_text()  # the cluster it started has the loopback address
        socks = listeners(proc.pid)
        wide = [title for addr, title in socks if addr not in ("127.0.0.1", "::ffff:127.0.0.1")]
        assert len(socks) >= 8, socks  # GCS, raylet, object manager, agents, Serve's controller and proxy, ...
        # all on 127.0.0.1 but Ray Serve's inter-deployment gRPC server, one in each replica (the ingress
        # and the engine replica), which Ray 2.60 binds to [::] in replica.py with no option to change it
        assert len(wide) == 2 and all(t.startswith("ray::ServeReplica:radixserve:") for t in wide), socks
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def listeners(root: int) -> list[tuple[str, str]]:
    """(local address, process title) of every listening TCP socket of process `root` and its
    descendants (read from /proc)."""
    import ipaddress
    import socket

    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            pass
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, ppid in parents.items() if ppid in tree} - tree
        tree, grew = tree | more, bool(more)
    owner = {}
    for pid in tree:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
                title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            except OSError:
                continue
            if target.startswith("socket:["):
                owner[target[8:-1]] = title
    out = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in owner:  # LISTEN
                raw = bytes.fromhex(fields[1].split(":")[0])
                packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # /proc prints host-order words
                addr = str(ipaddress.ip_address(packed)) if family == socket.AF_INET else socket.inet_ntop(family, packed)
                out.append((addr, owner[fields[9]]))
    return out


def test_routing_key_follows_the_conversation_and_the_namespace():
    from radixserve.ray.envelope import route_key

    acme = (("Authorization", "Bearer sk-a"),)
    turn1 = {"tools": [{"type": "function", "function": {"name": "f"}}], **fork(1)}
    turn2 = {**turn1, "messages": [*turn1["messages"], {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]}
    k1, k2 = (route_key(acme, json.dumps(t).encode()) for t in (turn1, turn2))
    assert k2.prefix.startswith(k1.prefix) and k1.namespace == k2.namespace and LONG in k1.prefix
    assert route_key((("x-api-key", "sk-a"),), json.dumps(turn1).encode()).namespace == k1.namespace  # one key, one tenant
    assert route_key((("Authorization", "Bearer sk-b"),), json.dumps(turn1).encode()).namespace != k1.namespace
    salted = route_key(acme, json.dumps({**turn1, "cache_salt": "s", "prompt_cache_key": "conv-1"}).encode())
    assert salted.namespace != k1.namespace and salted.hint == "conv-1" and "sk-a" not in repr(salted)
    assert route_key(acme, json.dumps({"prompt": [5, 6, 7]}).encode()).prefix == [5, 6, 7]  # token ids stay tokens
    assert route_key(acme, b"not json") is None and route_key(acme, b"") is None and route_key(acme, b"[1]") is None


def test_serve_options_become_radixserve_serve_flags(tmp_path: Path):
    from radixserve.ray.options import ReplicaSpec, parse, to_argv

    args = parse(to_argv({"model": "/m", "kv_cache_tokens": 8192, "router_policy": "round_robin", "log_requests": True}))
    assert (args.model, args.kv_cache_tokens, args.router_policy, args.log_requests) == ("/m", 8192, "round_robin", True)
    for bad, why in (({"no_such_option": 1}, "no_such_option"), ({"port": 1}, "port"), ({"router_policy": "x"}, "invalid choice")):
        with pytest.raises(ValueError, match=why):
            to_argv(bad)
    (tmp_path / "t.toml").write_text(TENANTS)
    spec = ReplicaSpec.from_options({"tenants": str(tmp_path / "t.toml"), "kv_cache_tokens": 8192})
    assert "--tenants" not in spec.argv and json.loads(spec.tenants)["tenants"][1]["id"] == "globex"  # travels as JSON
    assert spec.admin_key() == ACME
    (tmp_path / "bad.toml").write_text("[[tenants]]\nid = 'x'\n")
    with pytest.raises(ValueError, match="api_key"):  # refused where the app is built, not in each replica
        ReplicaSpec.from_options({"tenants": str(tmp_path / "bad.toml")})
    assert ReplicaSpec.from_options({"api_key": "k"}).admin_key() == "k" and ReplicaSpec.from_options({}).admin_key() is None


class FakeReplica:
    """What the router reads of a Ray RunningReplica."""

    max_ongoing_requests = 100

    def __init__(self, uid: str, deployment: object) -> None:
        from ray.serve.request_router import ReplicaID

        self.replica_id = ReplicaID(uid, deployment)

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def test_router_ranks_the_prefix_replica_first_and_avoids_a_failed_one():
    import asyncio
    import dataclasses

    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
    from ray.serve.request_router import PendingRequest

    from radixserve.config import RouterConfig
    from radixserve.ray.envelope import Envelope, route_key
    from radixserve.ray.router import PrefixAwareRequestRouter

    def pending(i: int, avoid: frozenset[str] = frozenset()) -> PendingRequest:
        key = route_key((("Authorization", "Bearer sk-a"),), json.dumps(fork(i)).encode())
        return PendingRequest([Envelope("POST", "/v1/chat/completions", (), b"", key, avoid)], {}, RequestMetadata("r", "r"))

    async def scenario() -> None:
        dep = DeploymentID("RadixServeReplica", "app")
        router = PrefixAwareRequestRouter(dep, DeploymentHandleSource.UNKNOWN)
        router.initialize_state(**dataclasses.asdict(RouterConfig()))
        a, b = FakeReplica("a", dep), FakeReplica("b", dep)
        first = await router.choose_replicas([a, b], pending(0))
        (home,), (other,) = first  # ranked: the chosen one, then the fallback
        assert [await router.choose_replicas([a, b], pending(i)) for i in (1, 2)] == [first, first]  # the prefix sticks
        assert (await router.choose_replicas([a, b], pending(3, frozenset({home.replica_id.unique_id}))))[0] == [other]
        assert (await router.choose_replicas([a, b], pending(4)))[0] == [other]  # avoided for every request now
        no_key = PendingRequest([Envelope("GET", "/v1/models", (), b"", None)], {}, RequestMetadata("r", "r"))
        assert await router.choose_replicas([a, b], no_key) == [[other]]  # Ray's least loaded, among the live ones
        assert router.policy.decisions["prefix"] >= 2

    asyncio.run(scenario())


class FakeHandle:
    """A DeploymentHandle to RadixServeReplica whose every replica streams `items` (an exception
    among them is raised there)."""

    def __init__(self, items: list) -> None:
        self.items, self.calls = items, []
        self.forward = self

    def options(self, **_: object) -> FakeHandle:
        return self

    def remote(self, env: object) -> object:
        self.calls.append(env)
        return FakeStream(list(self.items), len(self.calls))


class FakeStream:
    def __init__(self, items: list, n: int) -> None:
        self.items, self.n = items, n

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> object:
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, type) and issubclass(item, Exception):
            from radixserve.ray.errors import ReplicaGone

            raise ReplicaGone(f"r{self.n}", "its radixserve server exited with code 1")
        return item

    def cancel(self) -> None:
        pass


def ingress_call(handle: FakeHandle, path: str, body: bytes) -> object:
    import asyncio

    from starlette.requests import Request

    from radixserve.ray.ingress import RadixServeIngress

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"authorization", b"Bearer sk-a")]}

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def call() -> tuple[object, bytes]:
        resp = await RadixServeIngress.func_or_class(handle, max_request_bytes=MAX_BODY)(Request(scope, receive))
        chunks = [c async for c in resp.body_iterator] if hasattr(resp, "body_iterator") else [resp.body]
        return resp, b"".join(chunks)

    return asyncio.run(call())


def test_ingress_retries_elsewhere_until_bytes_went_out():
    from radixserve.ray.envelope import Head

    handle = FakeHandle([Exception])  # every replica fails before answering
    resp, body = ingress_call(handle, "/v1/chat/completions", json.dumps(fork(0)).encode())
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert json.loads(body)["error"]["code"] == "replica_unavailable"
    assert [e.avoid for e in handle.calls] == [frozenset(), {"r1"}, {"r1", "r2"}]  # 3 attempts, each avoiding the failed
    sse = Head(200, (("content-type", "text/event-stream"),), "r1")
    for path, want in (("/v1/responses", b'event: error\ndata: {"type":"error","sequence_number":1'),
                       ("/v1/messages", b'event: error\ndata: {"type":"error","error":{"type":"api_error"'),
                       ("/generate", b'data: {"error":{"message":"the radixserve replica serving this stream failed')):
        resp, body = ingress_call(FakeHandle([sse, b"data: {}\n\n", Exception]), path, json.dumps(fork(0)).encode())
        assert resp.status_code == 200 and body.startswith(b"data: {}\n\n" + want), (path, body)
        assert (b'"replica_failed"' in body) == (path != "/v1/messages")  # Anthropic's errors carry a type, no code
        assert body.endswith(b"data: [DONE]\n\n") == (path == "/generate")
    resp, body = ingress_call(FakeHandle([]), "/v1/messages", b"x" * (MAX_BODY + 1))
    assert resp.status_code == 413 and json.loads(body)["error"]["type"] == "request_too_large"  # Anthropic's shape


def app_args(model: Path, tenants: Path, **options: object) -> dict:
    """The example Serve config's application args, on the tiny model with a small KV pool and
    body limit, and health checks every second."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load(CONFIG.read_text())
    ServeDeploySchema.model_validate(config)  # a config `serve run` / `serve deploy` accept
    args = config["applications"][0]["args"]
    small = {"kv_cache_tokens": 8192, "grammar_compile_workers": 1, "tenants": str(tenants), "max_request_bytes": MAX_BODY}
    return {**args, "model": str(model), "health_check_period_s": 1.0, "health_check_timeout_s": 10.0,
            "options": {**args["options"], **small, **options}}


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    import ray
    from ray import serve
    from ray.serve.api import RunTarget

    from radixserve.ray.serve import app_builder

    tenants = tmp_path_factory.mktemp("ray") / "tenants.toml"
    tenants.write_text(TENANTS)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run_many([RunTarget(app_builder(app_args(tiny_llama, tenants)), "radixserve", "/"),
                        RunTarget(app_builder(app_args(tiny_llama, tenants, router_policy="round_robin")), "rr", "/rr")])
        wide = [title for addr, title in listeners(os.getpid()) if addr not in ("127.0.0.1", "::ffff:127.0.0.1")]
        assert len(wide) == 6 and all(t.startswith("ray::ServeReplica:") for t in wide), wide  # see the CLI test
        yield Cluster(f"http://127.0.0.1:{port}")
    finally:
        serve.shutdown()
        ray.shutdown()


def post(url: str, path: str, body: dict | bytes, key: str | None = ACME) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + path, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def fork(i: int, text: str = LONG, **extra: object) -> dict:
    return {"messages": [{"role": "system", "content": text}, {"role": "user", "content": f"Question {i}?"}],
            "max_tokens": 4, "temperature": 0, **extra}


def computed(stats: dict[str, dict]) -> dict[str, int]:
    return {uid: s["kv"]["prefill_tokens_computed"] for uid, s in stats.items()}


def send_forks(url: str, path: str, n: int = 8, key: str = ACME) -> list[tuple[int, dict, dict]]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: post(url, path, fork(i), key), range(n)))


def test_prefix_affinity_computes_a_shared_prompt_once(cluster: Cluster):
    before = computed(cluster.stats("radixserve"))
    results = send_forks(cluster.url, "/v1/chat/completions")
    assert all(status == 200 for status, _, _ in results), results
    served = {h["x-radixserve-replica"] for _, h, _ in results}
    assert len(served) == 1, served  # all 8 forks on one replica
    home = served.pop()
    prompt = max(b["usage"]["prompt_tokens"] for _, _, b in results)
    after = computed(cluster.stats("radixserve"))
    delta = {uid: after[uid] - before.get(uid, 0) for uid in after}
    assert prompt <= delta[home] < prompt + 8 * 16, (prompt, delta)  # the shared prompt once, plus 8 short questions
    assert all(d == 0 for uid, d in delta.items() if uid != home), delta  # the other replica computed none of it
    cached = sorted(b["usage"]["prompt_tokens_details"]["cached_tokens"] for _, _, b in results)
    assert cached[0] == 0 and all(c >= prompt - 16 for c in cached[1:]), cached


def test_tenant_namespaces_hold_across_replicas(cluster: Cluster):
    _, h_acme, _ = post(cluster.url, "/v1/chat/completions", fork(100))
    status, h1, b1 = post(cluster.url, "/v1/chat/completions", fork(100), key=GLOBEX)
    assert status == 200 and b1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # not acme's cache
    assert h1["x-radixserve-replica"] != h_acme["x-radixserve-replica"]  # globex's prefix matched nothing of acme's
    status, h2, b2 = post(cluster.url, "/v1/chat/completions", fork(101), key=GLOBEX)
    assert status == 200 and h2["x-radixserve-replica"] == h1["x-radixserve-replica"]  # globex's own affinity
    assert b2["usage"]["prompt_tokens_details"]["cached_tokens"] >= b2["usage"]["prompt_tokens"] - 16


def test_round_robin_computes_the_prompt_on_both_replicas(cluster: Cluster):
    results = send_forks(cluster.url, "/rr/v1/chat/completions")
    assert all(status == 200 for status, _, _ in results), results
    prompt = max(b["usage"]["prompt_tokens"] for _, _, b in results)
    delta = computed(cluster.stats("rr"))
    assert len(delta) == 2 and all(d >= prompt - 16 for d in delta.values()), (prompt, delta)  # twice in all
    assert {h["x-radixserve-replica"] for _, h, _ in results} == set(delta)


def sse_events(resp: http.client.HTTPResponse) -> list[str]:
    return [line[6:] for line in resp.read().decode().split("\n") if line.startswith("data: ")]


def open_stream(url: str, path: str, body: dict, key: str = ACME) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    return conn, conn.getresponse()


def test_streams_and_errors_pass_through_unchanged(cluster: Cluster):
    conn, resp = open_stream(cluster.url, "/v1/chat/completions", fork(200, max_tokens=12, ignore_eos=True, stream=True,
                                                                       stream_options={"include_usage": True}))
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    assert len(resp.headers.get_all("Date")) == 1  # the proxy's, not the replica server's too
    events = sse_events(resp)
    conn.close()
    assert events[-1] == "[DONE]" and len(events) >= 4
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[-1]["usage"]["completion_tokens"] == 12
    import openai

    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key=GLOBEX, max_retries=0, timeout=TIMEOUT)
    stream = client.chat.completions.create(model="", stream=True, extra_body={"ignore_eos": True}, **fork(201, max_tokens=8))
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text  # 8 tokens, streamed
    native = {"text": LONG[:200], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    status, _, body = post(cluster.url, "/generate", native)
    assert status == 200 and body["meta_info"]["completion_tokens"] == 3
    status, _, body = post(cluster.url, "/v1/chat/completions", {"messages": "not a list"})
    assert status == 400 and body["error"]["param"] == "messages"  # the server's own 400
    status, _, body = post(cluster.url, "/v1/chat/completions", fork(0), key="sk-wrong")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _, body = post(cluster.url, "/v1/chat/completions", b"x" * (MAX_BODY + 1))
    assert status == 413 and body["error"]["code"] == "request_too_large"  # refused at the ingress, the server's error


def idle(kv: dict) -> bool:
    return kv["running"] == kv["waiting"] == kv["kv_in_use_slots"] == kv["kv_locked_tokens"] == 0


def wait_kv(cluster: Cluster, app: str, replica: str, done: Callable[[dict], bool], timeout: float = 30) -> dict:
    """The replica's engine counters once `done` holds of them (or as they are at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        kv = cluster.stats(app)[replica]["kv"]
        if done(kv) or time.monotonic() > deadline:
            return kv
        time.sleep(0.02)


def test_client_disconnect_aborts_and_frees_kv(cluster: Cluster):
    before = cluster.stats("radixserve")
    conn, resp = open_stream(cluster.url, "/v1/chat/completions", fork(300, max_tokens=1200, ignore_eos=True, stream=True))
    assert resp.status == 200
    home = resp.getheader("x-radixserve-replica")
    resp.readline()  # the stream began
    kv = wait_kv(cluster, "radixserve", home, lambda kv: kv["running"] == 1 and kv["kv_locked_tokens"] > 0)
    assert kv["running"] == 1 and kv["kv_locked_tokens"] > 0, kv  # decoding, its prefix locked
    conn.close()
    kv = wait_kv(cluster, "radixserve", home, idle)
    assert idle(kv), kv  # aborted: nothing runs, no slot is held or locked
    assert kv["decode_tokens"] - before[home]["kv"]["decode_tokens"] < 1200  # long before its 1200 tokens


def test_a_dead_engine_fails_over_and_its_replica_is_replaced(cluster: Cluster):
    victim, info = next(iter(cluster.stats("rr").items()))
    os.kill(info["engine_pid"], signal.SIGKILL)  # the replica's actor lives on, its server exits
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: post(cluster.url, "/rr/v1/chat/completions", fork(400 + i)), range(6)))
    assert [s for s, _, _ in results] == [200] * 6, results  # round robin sent some to the dead one: retried
    assert all(h["x-radixserve-replica"] != victim for _, h, _ in results)
    deadline = time.monotonic() + scaled(60)
    while victim in cluster.replicas("rr") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert victim not in cluster.replicas("rr")  # its health check failed: Serve replaced it


def test_a_killed_replica_loses_no_request_that_had_not_started(cluster: Cluster):
    import ray

    conn, resp = open_stream(cluster.url, "/v1/chat/completions", fork(500, max_tokens=1200, ignore_eos=True, stream=True))
    home = resp.getheader("x-radixserve-replica")
    resp.readline()  # started: bytes reached the client
    pool = ThreadPoolExecutor(6)
    waiting = [pool.submit(post, cluster.url, "/v1/chat/completions", fork(600 + i, max_tokens=400, ignore_eos=True))
               for i in range(6)]
    kv = wait_kv(cluster, "radixserve", home, lambda kv: kv["running"] + kv["waiting"] >= 7)
    assert kv["running"] + kv["waiting"] >= 7, kv  # the stream and the 6 requests are on the replica
    info = cluster.stats("radixserve")[home]
    ray.kill(cluster.replicas("radixserve")[home])
    results = [f.result(timeout=TIMEOUT) for f in waiting]
    pool.shutdown()
    assert [s for s, _, _ in results] == [200] * 6, results
    assert all(h["x-radixserve-replica"] != home and b["usage"]["completion_tokens"] == 400 for _, h, b in results)
    events = sse_events(resp)  # the started stream ends with an error event, then [DONE]
    conn.close()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "replica_failed", events[-3:]
    status, _, _ = post(cluster.url, "/v1/chat/completions", fork(700))
    assert status == 200
    deadline = time.monotonic() + scaled(30)
    while any(map(alive, (info["server_pid"], info["engine_pid"]))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(info["server_pid"]) and not alive(info["engine_pid"])  # they died with the replica's process


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
