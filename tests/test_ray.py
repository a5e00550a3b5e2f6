"""Ray Serve (radixserve.ray) end to end, on the tiny model: `radixserve serve --ray` on a local
cluster of its own, then (one module-scoped local cluster bound to 127.0.0.1, driven from a
process of its own: tests/ray_driver.py, so that nothing Ray does can end the pytest process) two
applications built from examples/ray/serve_config.yaml's args, of 2 replicas each, one routed by
prefix affinity, one round-robin. Cache behaviour is asserted from each replica's engine counters
(prefill_tokens_computed, running requests, KV slots held), never from timings; every client
call has a timeout. Without a cluster: a replica's server as a replica starts it (its keys off
its command line, a disk folder of its own), the cluster Ray joins, the routing key, the router
and the ingress against fakes."""

from __future__ import annotations

import http.client
import json
import os
import select
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
from pathlib import Path
from typing import Any

import pytest
from conftest import CORPUS
from server_helpers import MAX_BODY, USER, free_port, scaled

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
CLI_KEY = "sk-cli-4c1d9e"
TIMEOUT = 120
CONFIG = Path(__file__).resolve().parents[1] / "examples" / "ray" / "serve_config.yaml"


class Cluster:
    """The module's cluster, run by tests/ray_driver.py in a process of its own, and its HTTP URL."""

    def __init__(self, proc: subprocess.Popen[bytes], replies: int, url: str, log: Path) -> None:
        self.proc, self._fd, self.url, self.log = proc, replies, url, log
        self._buf = b""

    def call(self, op: str, timeout: float = 60, **kw: object) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}).encode() + b"\n")
        self.proc.stdin.flush()
        return self.answer(timeout)

    def answer(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            ready, _, _ = select.select([self._fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(self._fd, 1 << 20) if ready else None
            if not chunk:
                why = "exited" if chunk == b"" else f"did not answer in {timeout:g} s"
                raise RuntimeError(f"the Ray driver {why} (code {self.proc.poll()}):\n{self.log.read_text()[-4000:]}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the Ray driver: {reply['error']}")
        return reply["result"]

    def replicas(self, app: str) -> list[str]:
        """The app's engine replicas' unique ids."""
        return self.call("replicas", app=app)

    def stats(self, app: str) -> dict[str, dict]:
        """Each replica's routing stats (radixserve's record_routing_stats: its engine's counters as 'kv')."""
        return self.call("stats", app=app)

    def kill(self, app: str, replica: str) -> None:
        self.call("kill", app=app, replica=replica)


def test_radixserve_serve_ray_serves_on_a_local_cluster_and_stops(tiny_llama: Path, tmp_path: Path):
    ray_tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # the command makes its own choices
    env.update(RAY_TMPDIR=ray_tmp, RADIXSERVE_API_KEY=CLI_KEY)
    log = tmp_path / "serve.log"
    for _ in range(3):  # a free port can be taken by another test's server before Ray's proxy binds it: another port
        port = free_port()
        cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--ray", "--replicas", "1", "--model", str(tiny_llama),
               "--port", str(port), "--kv-cache-tokens", "4096", "--grammar-compile-workers", "1"]
        proc = subprocess.Popen(cmd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + scaled(180)
        while time.monotonic() < deadline and proc.poll() is None and "radixserve ready on Ray Serve" not in log.read_text():
            time.sleep(0.5)
        if proc.poll() is None or f"Failed to bind to address '127.0.0.1:{port}'" not in log.read_text():
            break
    try:
        url = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert r.status == 200
        assert proc.poll() is None, log.read_text()
        body = json.dumps({"messages": USER, "max_tokens": 5, "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=60)
        assert refused.value.code == 401  # the key came to the replica's server from the environment
        req.add_header("Authorization", f"Bearer {CLI_KEY}")
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200 and r.headers["x-radixserve-replica"]
            assert json.loads(r.read())["usage"]["completion_tokens"] == 5
        cmdlines = {pid: _read(f"/proc/{pid}/cmdline") for pid in descendants(proc.pid)}
        servers = {pid for pid, cmd in cmdlines.items() if b"radixserve.ray.child" in cmd}  # the replica's server
        assert len(servers) == 1 and not [cmd for cmd in cmdlines.values() if CLI_KEY.encode() in cmd]
        holders = {pid for pid in cmdlines if CLI_KEY.encode() in _read(f"/proc/{pid}/environ")}
        assert holders <= servers | {proc.pid}, holders  # given to the server alone: Ray's processes never had it
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


def descendants(root: int) -> set[int]:
    """Process `root` and its descendants (read from /proc)."""
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
    return tree


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""


def listeners(root: int) -> list[tuple[str, str]]:
    """(local address, process title) of every listening TCP socket of process `root` and its
    descendants (read from /proc)."""
    import ipaddress
    import socket

    owner = {}
    for pid in descendants(root):
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
    adapter = route_key(acme, json.dumps({**turn1, "model": "sql-lora"}).encode())  # a LoRA adapter's KV is its own
    assert adapter.namespace != k1.namespace and adapter.prefix == k1.prefix
    assert route_key(acme, json.dumps({**turn2, "model": "sql-lora"}).encode()).namespace == adapter.namespace
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


def test_a_replica_spec_keeps_its_keys_and_disk_folder_off_the_command_line(tmp_path: Path):
    from radixserve.ray.options import ReplicaSpec

    (tmp_path / "mk").write_text("mk-from-a-file\n")
    spec = ReplicaSpec.from_options({"api_key": "sk-spec", "metrics_key_file": str(tmp_path / "mk"),
                                     "kv_disk_dir": str(tmp_path / "kv"), "kv_cache_tokens": 8192})
    assert spec.argv == ("--kv-cache-tokens", "8192") and spec.kv_disk_dir == str(tmp_path / "kv")
    assert dict(spec.secrets) == {"RADIXSERVE_API_KEY": "sk-spec", "RADIXSERVE_METRICS_KEY": "mk-from-a-file"}
    assert "sk-spec" not in repr(spec) and spec.admin_key() == "sk-spec"
    with pytest.raises(ValueError, match="api_key: give --api-key or --api-key-file, not both"):
        ReplicaSpec.from_options({"api_key": "a", "api_key_file": str(tmp_path / "mk")})


def test_a_key_comes_from_its_file_or_its_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from radixserve.ray.options import parse
    from radixserve.server.serve import resolve_secrets

    (tmp_path / "key").write_text("sk-file\n")
    (tmp_path / "empty").write_text("\n")
    monkeypatch.setenv("RADIXSERVE_METRICS_KEY", "mk-env")
    args = parse(["--api-key-file", str(tmp_path / "key")])
    resolve_secrets(args)
    assert (args.api_key, args.metrics_key, args.api_key_file) == ("sk-file", "mk-env", None)
    assert "RADIXSERVE_METRICS_KEY" not in os.environ  # no child process inherits it
    monkeypatch.setenv("RADIXSERVE_API_KEY", "sk-env")
    args = parse(["--api-key", "sk-flag"])
    resolve_secrets(args)
    assert args.api_key == "sk-flag" and "RADIXSERVE_API_KEY" not in os.environ  # the flag wins; the variable is gone
    for argv, why in ((["--api-key", "k", "--api-key-file", str(tmp_path / "key")], "not both"),
                      (["--api-key-file", str(tmp_path / "empty")], "api_key_file: .* is empty"),
                      (["--metrics-key-file", str(tmp_path / "missing")], "metrics_key_file: cannot read")):
        with pytest.raises(ValueError, match=why):
            resolve_secrets(parse(argv))


def test_replicas_on_one_node_each_claim_a_disk_folder_of_their_own(tmp_path: Path):
    from radixserve.ray import disk_slot

    root = tmp_path / "kv"
    first, lock0 = disk_slot.claim(str(root))
    second, lock1 = disk_slot.claim(str(root))  # a second replica while the first lives
    assert (first, second) == (str(root / "ray-replica-0"), str(root / "ray-replica-1"))
    assert os.stat(root).st_mode & 0o777 == 0o700
    os.close(lock0)  # the first replica's server exited
    again, lock = disk_slot.claim(str(root))
    assert again == first  # its replacement takes its folder (and the blocks it wrote) over
    for fd in (lock, lock1):
        os.close(fd)
    os.chmod(root, 0o755)
    with pytest.raises(ValueError, match="kv_disk_dir: .* has mode 0755"):
        disk_slot.claim(str(root))


@pytest.mark.slow  # starts a server
def test_a_replicas_server_gets_its_keys_by_environment_and_a_disk_folder_of_its_own(tiny_llama: Path, tmp_path: Path):
    """As a replica starts its server (local_server.replica_server), beside another replica's
    server that holds the first folder: no key on any command line, the keys work, the server
    has a disk folder of its own, let go when it exits."""
    from radixserve.ray import disk_slot
    from radixserve.ray.local_server import replica_server
    from radixserve.ray.options import ReplicaSpec

    kv = tmp_path / "kv"
    spec = ReplicaSpec.from_options({"model": str(tiny_llama), "kv_cache_tokens": 4096, "grammar_compile_workers": 1,
                                     "api_key": "sk-replica-7f3a", "metrics_key": "mk-replica-9b2e", "kv_disk_dir": str(kv)})
    _, other = disk_slot.claim(str(kv))  # another replica on this node holds ray-replica-0
    server = replica_server(spec, scaled(120))
    try:
        cmdline = _read(f"/proc/{server.pid}/cmdline").split(b"\0")
        assert not [a for a in cmdline if b"sk-replica" in a or b"mk-replica" in a], cmdline
        assert cmdline[cmdline.index(b"--kv-disk-dir") + 1] == str(kv / "ray-replica-1").encode()
        status, _ = http_get(server.url + "/v1/models")
        assert status == 401
        status, info = http_get(server.url + "/server_info", "sk-replica-7f3a")
        assert status == 200 and info["kv_tiers"]["disk"]
        assert b"sk-replica" not in _read(f"/proc/{info['engine_pid']}/environ")  # the engine never had it
        assert http_get(server.url + "/metrics", "mk-replica-9b2e")[0] == 200
        third, lock2 = disk_slot.claim(str(kv))
        os.close(lock2)
        assert third == str(kv / "ray-replica-2")  # ray-replica-1 is the server's
        body = json.dumps({"prompt": " ".join(CORPUS * 8), "max_tokens": 1}).encode()
        req = urllib.request.Request(server.url + "/v1/completions", data=body, headers={
            "Content-Type": "application/json", "Authorization": "Bearer sk-replica-7f3a"})
        with urllib.request.urlopen(req, timeout=60) as r:
            prompt = json.loads(r.read())["usage"]["prompt_tokens"]
        signals = http_get(server.url + "/server_info", "sk-replica-7f3a")[1]["autoscaling"]  # what the replica reports
        assert prompt > 1000 and signals["waiting"] == signals["waiting_tokens"] == 0
        assert signals["ttft_per_1k_p90_s"] == pytest.approx(signals["ttft_p90_s"] * 1000 / prompt, abs=2e-4)
    finally:
        server.stop()
        os.close(other)
    folder, lock = disk_slot.claim(str(kv))
    os.close(lock)
    assert folder == str(kv / "ray-replica-0")  # both let go


def http_get(url: str, key: str | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            body = r.read()
            return r.status, json.loads(body) if r.headers.get_content_type() == "application/json" else body
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_ray_joins_only_the_cluster_it_is_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Not the one RAY_ADDRESS or another user's `ray start` (/tmp/ray/ray_current_cluster) names."""
    import ray

    from radixserve.ray.serve import connect

    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("10.9.9.9:6379")
    for name, value in (("RAY_TMPDIR", str(tmp_path)), ("RAY_ADDRESS", "10.9.9.9:6379"), ("RAY_USAGE_STATS_ENABLED", "0"),
                        ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")):
        monkeypatch.setenv(name, value)
    calls: list[dict] = []
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    assert connect(None, "127.0.0.1", 2) is True  # a new local cluster
    assert calls[-1]["address"] == "local" and "RAY_ADDRESS" not in os.environ
    assert connect("10.0.0.5:6379", "127.0.0.1", 2) is False and calls[-1] == {"address": "10.0.0.5:6379"}


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
    small = {"kv_cache_tokens": 8192, "grammar_compile_workers": 1, "tenants": str(tenants), "max_request_bytes": MAX_BODY,
             "precompute_history": False}  # (the prefill counts here are the requests' own: no answer's history after)
    return {**args, "model": str(model), "health_check_period_s": 1.0, "health_check_timeout_s": 10.0,
            "options": {**args["options"], **small, **options}}


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    """The two applications on a local cluster of their own, in a process of their own (a Ray
    crash fails this module's tests, never the pytest process); shut down with the module."""
    folder = tmp_path_factory.mktemp("ray")
    tenants, log = folder / "tenants.toml", folder / "driver.log"
    tenants.write_text(TENANTS)
    port = free_port()
    apps = [[app_args(tiny_llama, tenants), "radixserve", "/"],
            [app_args(tiny_llama, tenants, router_policy="round_robin"), "rr", "/rr"]]
    ray_tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"RAY_TMPDIR": ray_tmp}
    read, write = os.pipe()
    driver = Path(__file__).with_name("ray_driver.py")
    proc = subprocess.Popen([sys.executable, str(driver), str(write), json.dumps({"port": port, "apps": apps})],
                            stdin=subprocess.PIPE, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,
                            pass_fds=[write], start_new_session=True)
    os.close(write)
    c = Cluster(proc, read, f"http://127.0.0.1:{port}", log)
    try:
        assert c.answer(scaled(300)) == "127.0.0.1"  # the node's address
        wide = [title for addr, title in listeners(proc.pid) if addr not in ("127.0.0.1", "::ffff:127.0.0.1")]
        assert len(wide) == 6 and all(t.startswith("ray::ServeReplica:") for t in wide), wide  # see the CLI test
        yield c
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # the driver shuts Serve and Ray down and exits
        try:
            proc.wait(scaled(60))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(read)
        shutil.rmtree(ray_tmp, ignore_errors=True)


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
    conn, resp = open_stream(cluster.url, "/v1/chat/completions", fork(500, max_tokens=1200, ignore_eos=True, stream=True))
    home = resp.getheader("x-radixserve-replica")
    resp.readline()  # started: bytes reached the client
    info = cluster.stats("radixserve")[home]
    # the replica's engine stops where it is: the stream stays open and the 6 requests stay on the
    # replica until the kill, however slowly a loaded machine brings them there
    os.kill(info["engine_pid"], signal.SIGSTOP)
    try:
        pool = ThreadPoolExecutor(6)
        waiting = [pool.submit(post, cluster.url, "/v1/chat/completions", fork(600 + i, max_tokens=400, ignore_eos=True))
                   for i in range(6)]
        deadline = time.monotonic() + scaled(60)
        while (held := in_flight(info["url"])) < 7 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held >= 7, held  # the stream and the 6 requests are in the replica's server
        cluster.kill("radixserve", home)
    finally:
        os.kill(info["engine_pid"], signal.SIGCONT)  # it sees its server gone and exits
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


def in_flight(server_url: str) -> int:
    """A replica server's requests in flight or queued, as its own /server_info counts them (no engine asked)."""
    req = urllib.request.Request(server_url + "/server_info", headers={"Authorization": f"Bearer {ACME}"})
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        info = json.loads(r.read())
        return int(info["in_flight"]) + int(info["queued"])


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
