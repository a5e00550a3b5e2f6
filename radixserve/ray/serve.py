"""Build and run the Ray Serve application: `radixserve serve --ray --replicas N [serve flags]`
(run_ray), or `serve run examples/ray/serve_config.yaml` (app_builder).

Cluster: the one --ray-address names (given by the user, never looked up: not RAY_ADDRESS, not
the cluster another user's `ray start` left its address for in /tmp/ray), else a new local one
(ray.init(address="local")), which with a loopback --host is a one-machine cluster on 127.0.0.1
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0; no dashboard, no usage stats; Ray Serve 2.60 still binds
each replica's inter-deployment gRPC server to [::], with no option to change it). HTTP is Ray's
proxy on --host/--port. On SIGINT/SIGTERM the application is deleted (replicas drain), and a
cluster started here is shut down.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Mapping
from typing import Any

from radixserve.ray.autoscale import AutoscaleConfig
from radixserve.ray.options import ReplicaSpec, options_from_args, parse

log = logging.getLogger("radixserve.ray")
APP_NAME = "radixserve"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
BUILDER_ARGS = ("model", "replicas", "options", "ray_actor_options", "health_check_period_s", "health_check_timeout_s",
                "autoscaling")


def autoscale_config(args: argparse.Namespace) -> AutoscaleConfig | None:
    """`radixserve serve --ray --max-replicas N ...`'s autoscaling (None without --max-replicas)."""
    if args.max_replicas is None:
        if args.replicas < 1:
            raise ValueError(f"replicas: must be a positive integer, got {args.replicas} (0 goes with --max-replicas)")
        return None
    cfg = AutoscaleConfig(args.replicas, args.max_replicas, args.warm_replicas, target_waiting=args.autoscale_waiting,
                          target_waiting_tokens=args.autoscale_waiting_tokens or None,
                          target_kv_usage=args.autoscale_kv_usage, target_ttft_per_1k_s=args.autoscale_ttft_per_1k or None,
                          upscale_delay_s=args.upscale_delay_s, downscale_delay_s=args.downscale_delay_s)
    cfg.check()
    return cfg


def build_app(options: Mapping[str, Any] | None = None, replicas: int = 2, *, ray_actor_options: dict[str, Any] | None = None,
              health_check_period_s: float = 10.0, health_check_timeout_s: float = 30.0,
              autoscale: AutoscaleConfig | None = None) -> Any:
    """The application: RadixServeIngress in front of `replicas` RadixServeReplica (with
    `autoscale`: between its min and max replicas, on radixserve's signals: autoscale.py), each a
    `radixserve serve` with these options (field names: kv_cache_tokens, tenants, router_policy...),
    routed by PrefixAwareRequestRouter with the options' RouterConfig. Ray Serve's health-check
    defaults (10 s period, 30 s timeout) unless given."""
    from ray.serve.config import RequestRouterConfig

    from radixserve.ray.deployment import RadixServeReplica
    from radixserve.ray.ingress import RadixServeIngress
    from radixserve.ray.router import PrefixAwareRequestRouter
    from radixserve.server.serve import router_config

    opts = dict(options or {})
    if autoscale is not None:
        autoscale.check()
    elif replicas < 1:
        raise ValueError(f"replicas: must be a positive integer, got {replicas}")
    spec = ReplicaSpec.from_options(opts)  # a bad option or tenants file fails here, not in each replica
    args = parse(list(spec.argv))
    router = router_config(args)
    per_replica = args.max_queued_requests + args.max_running_requests * args.data_parallel  # its server refuses first
    scaling: dict[str, Any] = ({"autoscaling_config": autoscale.ray_config()} if autoscale is not None
                               else {"num_replicas": replicas})
    most = autoscale.max_replicas if autoscale is not None else replicas
    engine = RadixServeReplica.options(  # type: ignore[attr-defined]  # a serve.deployment, typed by Ray as its class
        **scaling, max_ongoing_requests=per_replica,
        ray_actor_options=ray_actor_options or _replica_resources(args.device),
        health_check_period_s=health_check_period_s, health_check_timeout_s=health_check_timeout_s,
        request_router_config=RequestRouterConfig(request_router_class=PrefixAwareRequestRouter,  # type: ignore[arg-type]
                                                  request_router_kwargs=dataclasses.asdict(router)),
    ).bind(spec)
    return RadixServeIngress.options(  # type: ignore[attr-defined]
        max_ongoing_requests=per_replica * most).bind(engine, args.max_request_bytes)


def _replica_resources(device: str) -> dict[str, Any]:
    """One CPU a replica, and one GPU when the engine runs on CUDA (device cuda, or auto on a
    cluster with GPUs)."""
    import ray

    gpus = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1
    return {"num_cpus": 1, "num_gpus": 1} if device == "cuda" or (device == "auto" and gpus) else {"num_cpus": 1}


def app_builder(args: Mapping[str, Any]) -> Any:
    """For `serve run` / a Serve config file: args model, replicas, options (a dict of
    `radixserve serve` options), ray_actor_options, health_check_period_s, health_check_timeout_s,
    autoscaling (AutoscaleConfig's fields but min_replicas, which is `replicas`)."""
    unknown = sorted(set(args) - set(BUILDER_ARGS))
    if unknown:
        raise ValueError(f"unknown radixserve application argument(s): {', '.join(unknown)} (known: {', '.join(BUILDER_ARGS)})")
    options = dict(args.get("options") or {})
    if args.get("model") is not None:
        options["model"] = str(args["model"])
    hc = {k: float(args[k]) for k in ("health_check_period_s", "health_check_timeout_s") if k in args}
    replicas = int(args.get("replicas", 2))
    scaling = args.get("autoscaling")
    autoscale = None
    if scaling is not None:
        known = {f.name for f in dataclasses.fields(AutoscaleConfig)} - {"min_replicas"}
        if unknown := sorted(set(scaling) - known):
            raise ValueError(f"autoscaling: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        autoscale = AutoscaleConfig(min_replicas=replicas, **scaling)
    return build_app(options, replicas, ray_actor_options=args.get("ray_actor_options"), autoscale=autoscale, **hc)


def run_ray(args: argparse.Namespace) -> int:
    """`radixserve serve --ray`: serve until SIGINT/SIGTERM."""
    from radixserve.server.serve import check_port

    autoscale = autoscale_config(args)
    options = options_from_args(args)
    most = autoscale.max_replicas if autoscale is not None else args.replicas
    started = connect(args.ray_address, args.host, most, check=lambda: check_port(args.host, args.port))
    import ray
    from ray import serve

    stop = _stop_on_signal()  # replaces the handler ray.init installed, which aborts the process on SIGTERM
    try:
        app = build_app(options, args.replicas, autoscale=autoscale)
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=APP_NAME, route_prefix="/")
        log.info("radixserve ready on Ray Serve at http://%s:%d | %s replicas | router %s", args.host, args.port,
                 f"{args.replicas} to {most} (autoscaled)" if autoscale else args.replicas, args.router_policy)
        while not stop.wait(1.0):
            pass
        log.info("stopping: the replicas finish their running requests")
    finally:
        if started:
            serve.shutdown()
            ray.shutdown()
        else:
            serve.delete(APP_NAME)  # a shared cluster: its other applications stay
    return 0


def connect(address: str | None, host: str, replicas: int, check: Any = None) -> bool:
    """Join the cluster at `address` (--ray-address), or start a new local one (see the module
    docstring); True when a new local one was started."""
    if address is None:
        if check is not None:
            check()  # the HTTP port, before anything starts
        if os.environ.pop("RAY_ADDRESS", None):  # nor may Ray's own processes read it
            log.warning("RAY_ADDRESS is set but not read: --ray-address names the cluster to join; starting a new one")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if host in LOOPBACK:
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # node address 127.0.0.1: nothing else listens
    import ray

    if address is None:
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, replicas), include_dashboard=False)
    else:
        ray.init(address=address)
    log.info("Ray: %s cluster, this node %s", "a new local" if address is None else f"the {address}",
             ray.util.get_node_ip_address())
    return address is None


def _stop_on_signal() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop
