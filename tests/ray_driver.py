"""A Ray Serve cluster in a process of its own, for test_ray.py: nothing Ray does (its shutdown,
a core worker that ends its process when it is shut down under a thread still using it) can end
the pytest process, and no Ray thread outlives the module that started it.

    python tests/ray_driver.py REPLY_FD CONFIG_JSON

CONFIG_JSON: {"port": P, "apps": [[app_builder args, name, route_prefix], ...]}. It starts a
local cluster (address "local": never one it finds) of 4 CPUs, Ray Serve's proxy on 127.0.0.1:P
and the applications, then answers on REPLY_FD one JSON line per request read from stdin (one
JSON line each), {"result": ...} or {"error": "..."}; the first answer, unasked, is the node's
address. Requests: {"op": "replicas", "app": A} -> the app's engine replicas' unique ids;
{"op": "stats", "app": A} -> {id: its record_routing_stats}; {"op": "kill", "app": A, "replica":
id} -> ray.kill of that replica's actor. When stdin closes it shuts Serve and Ray down and exits.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

# before ray is imported: a one-machine cluster whose every socket is on 127.0.0.1, no usage stats
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def replicas(app: str) -> dict[str, Any]:
    """The app's engine replicas: unique id -> actor handle (Serve names them SERVE_REPLICA::app#deployment#id)."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#RadixServeReplica#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    return {n[len(prefix):]: ray.get_actor(n, namespace="serve") for n in names}


def answer(op: dict[str, Any]) -> Any:
    import ray

    if op["op"] == "replicas":
        return sorted(replicas(op["app"]))
    if op["op"] == "stats":
        return {uid: ray.get(a.record_routing_stats.remote(), timeout=30) for uid, a in replicas(op["app"]).items()}
    if op["op"] == "kill":
        ray.kill(replicas(op["app"])[op["replica"]])
        return None
    raise ValueError(f"unknown op {op['op']!r}")


def main(reply_fd: int, config: dict[str, Any]) -> int:
    import ray
    from ray import serve
    from ray.serve.api import RunTarget

    from radixserve.ray.serve import app_builder

    out = os.fdopen(reply_fd, "w", buffering=1)

    def reply(**kw: Any) -> None:
        out.write(json.dumps(kw) + "\n")

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": config["port"]})
            serve.run_many([RunTarget(app_builder(args), name, prefix) for args, name, prefix in config["apps"]])
        except Exception:
            reply(error=traceback.format_exc())
            return 1
        reply(result=ray.util.get_node_ip_address())
        for line in sys.stdin:
            try:
                reply(result=answer(json.loads(line)))
            except Exception as e:
                reply(error=f"{type(e).__name__}: {e}")
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), json.loads(sys.argv[2])))
