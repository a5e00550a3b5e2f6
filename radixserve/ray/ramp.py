"""`radixserve bench autoscale`: a load ramp on a local Ray cluster against the autoscaled
deployment (`radixserve serve --ray --max-replicas N`'s application: radixserve/ray/autoscale.py).
It lives here, not in bench/, because it builds the Ray application (ray/ is above bench/).

Phases: `--low` clients for `--phase-s`, then `--high` clients until the deployment has scaled
up and the new replica has served (or `--phase-s` x 3), then `--low` again until it is back
to its minimum (or `--settle-s`). Each client sends completions back to back. Reported: every
request's status (none may fail: "no request lost"), the replica count over time (Serve's
status), each replica that served and how many requests it took (the x-radixserve-replica
header), the autoscaler's decisions with the signal that caused each (the Serve controller's
log), and the new replica's cold start: from its actor's start to its server ready and to its
first answer (its record_routing_stats), and from the scale-up decision to that first answer.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

from radixserve.cli_args import add_engine_args, engine_kwargs

REQUEST_TIMEOUT_S = 120.0
DECISION = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}).*radixserve autoscaler: \S+ asks (.*)")


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--max-replicas", type=int, default=2)
    p.add_argument("--low", type=int, default=1, help="clients in the low phases")
    p.add_argument("--high", type=int, default=8, help="clients in the high phase")
    p.add_argument("--phase-s", type=float, default=20.0, help="the first low phase; the high one lasts up to 3x this")
    p.add_argument("--settle-s", type=float, default=120.0, help="how long the last low phase waits for the scale-down")
    p.add_argument("--prompt-words", type=int, default=200, help="each prompt's length, in words (distinct prompts)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--target-waiting", type=float, default=1.0, help="the autoscaler's target requests waiting per replica")
    p.add_argument("--upscale-delay-s", type=float, default=2.0)
    p.add_argument("--downscale-delay-s", type=float, default=15.0)
    p.add_argument("--look-back-s", type=float, default=3.0)
    p.add_argument("--json", default=None, help="write the run's record to this file")


class _Load:
    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url, self.args = url, args
        self.results: list[tuple[float, int, str]] = []  # (when, status, replica)
        self._lock = threading.Lock()
        self._n = 0
        self._clients: list[tuple[threading.Thread, threading.Event]] = []  # the running ones
        self._all: list[threading.Thread] = []

    @property
    def clients(self) -> int:
        return len(self._clients)

    def set(self, n: int) -> None:
        """Run n clients: more start, or the extra ones stop after their current request."""
        while len(self._clients) > n:
            self._clients.pop()[1].set()
        while len(self._clients) < n:
            stop = threading.Event()
            t = threading.Thread(target=self._client, args=(stop,), daemon=True)
            self._clients.append((t, stop))
            self._all.append(t)
            t.start()

    def _client(self, stop: threading.Event) -> None:
        while not stop.is_set():
            with self._lock:
                self._n += 1
                k = self._n
            words = " ".join(f"w{(k * 7919 + j) % 5000}" for j in range(self.args.prompt_words))
            body = json.dumps({"prompt": f"Request {k}. {words}", "max_tokens": self.args.max_tokens,
                               "temperature": 0}).encode()
            req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                    r.read()
                    status, replica = r.status, r.headers.get("x-radixserve-replica", "?")
            except urllib.error.HTTPError as e:
                status, replica = e.code, e.headers.get("x-radixserve-replica", "?")
            except Exception:
                status, replica = 0, "?"
            with self._lock:
                self.results.append((time.monotonic(), status, replica))

    def stop(self) -> None:
        """Stop every client and wait for each (a request in flight ends within its timeout)."""
        self.set(0)
        for t in self._all:
            t.join(REQUEST_TIMEOUT_S + 30)


def _running(app: str) -> int:
    from ray import serve
    from ray.serve._private.common import ReplicaState

    dep = serve.status().applications[app].deployments["RadixServeReplica"]
    return int(dep.replica_states.get(ReplicaState.RUNNING, 0))


def _decisions(logs: Path) -> list[tuple[float, str]]:
    """The autoscaler's decisions in the Serve controller's log: (epoch seconds, the decision)."""
    out = []
    for f in sorted(logs.glob("serve/controller_*.log")):
        for line in f.read_text(errors="replace").splitlines():
            if (m := DECISION.search(line)) is not None:
                out.append((datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp(), m[2]))
    return out


def run(args: argparse.Namespace) -> int:
    record = measure(args)
    print(json.dumps({k: record[k] for k in ("requests", "failed", "served_by", "peak_replicas", "final_replicas",
                                             "decisions", "cold_start")}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    ok = record["failed"] == 0 and record["peak_replicas"] >= 2 and record["final_replicas"] == 1
    print("ramp 1 -> 2 -> 1 with no request lost:", "yes" if ok else "NO")
    return 0 if ok else 1


def measure(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")  # before the cluster starts
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from radixserve.ray.autoscale import AutoscaleConfig
    from radixserve.ray.serve import build_app
    from radixserve.server.serve import check_port

    options = {k: v for k, v in engine_kwargs(args).items() if v is not None}
    if args.model is not None:
        options["model"] = args.model
    scale = AutoscaleConfig(1, args.max_replicas, 0, target_waiting=args.target_waiting, target_waiting_tokens=None,
                            target_ttft_per_1k_s=None, upscale_delay_s=args.upscale_delay_s,
                            downscale_delay_s=args.downscale_delay_s, look_back_period_s=args.look_back_s)
    port = 18000 + os.getpid() % 1000
    check_port("127.0.0.1", port)
    ray.init(address="local", num_cpus=max(4, args.max_replicas + 2), include_dashboard=False, log_to_driver=False)
    app = "autoscale"
    timeline: list[tuple[float, int]] = []
    load = _Load(f"http://127.0.0.1:{port}", args)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(options, 1, autoscale=scale), name=app, route_prefix="/")
        t0 = time.monotonic()

        def watch(until: Any, limit: float) -> None:
            deadline = time.monotonic() + limit
            while time.monotonic() < deadline:
                n = _running(app)
                if not timeline or timeline[-1][1] != n:
                    timeline.append((round(time.monotonic() - t0, 2), n))
                    print(f"{time.monotonic() - t0:7.1f} s: {n} replicas running, {load.clients} clients", flush=True)
                if until(n):
                    return
                time.sleep(0.5)

        load.set(args.low)
        watch(lambda n: False, args.phase_s)
        load.set(args.high)
        first = len(load.results)
        watch(lambda n: n >= 2 and len({r for _, s, r in load.results[first:] if s == 200}) >= 2, args.phase_s * 3)
        watch(lambda n: False, 5.0)  # the new replica serves a while
        stats = _replica_stats(app)  # both replicas' cold starts, before one goes
        load.set(args.low)
        watch(lambda n: n <= 1, args.settle_s)
        load.stop()
        ctx = ray.get_runtime_context()  # this cluster's session (session_latest may be another cluster's)
        decisions = _decisions(Path(ctx.get_temp_dir()) / ctx.get_session_name() / "logs")
    finally:
        load.stop()  # no client thread outlives the cluster
        serve.shutdown()
        ray.shutdown()
    statuses = Counter(s for _, s, _ in load.results)
    cold = [s["cold_start"] for s in stats.values() if s.get("cold_start")]
    up = next((t for t, d in decisions if d.startswith("1 -> 2 replicas")), None)
    for c in cold:  # the replica the scale-up started: from the decision to its first answer
        if up is not None and "first_answer_s" in c and c["started_at"] >= up - 1:
            c["decision_to_first_answer_s"] = round(c["started_at"] + c["first_answer_s"] - up, 3)
    return {"requests": len(load.results), "failed": sum(n for s, n in statuses.items() if s != 200),
            "statuses": dict(statuses), "served_by": dict(Counter(r for _, s, r in load.results if s == 200)),
            "timeline": timeline, "peak_replicas": max((n for _, n in timeline), default=0),
            "final_replicas": timeline[-1][1] if timeline else 0,
            "decisions": [d for _, d in decisions], "scale_up_logged_at": up, "cold_start": cold}


def _replica_stats(app: str) -> dict[str, dict[str, Any]]:
    import ray

    prefix = f"SERVE_REPLICA::{app}#RadixServeReplica#"
    out: dict[str, dict[str, Any]] = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith(prefix):
            actor = ray.get_actor(a["name"], namespace="serve")
            stats: dict[str, Any] = ray.get(actor.record_routing_stats.remote(), timeout=30)  # type: ignore[assignment]
            out[a["name"][len(prefix):]] = stats
    return out
