"""Autoscaling the Ray deployment on radixserve's own signals, not on busy-ness.

Each replica reports, through Ray Serve's `record_autoscaling_stats` hook (deployment.py),
what its server's /server_info says: requests waiting (in the engine's queue, not yet admitted
to a batch: radixserve:num_requests_waiting), requests running, KV pool usage (pages in use / all), and the 90th percentile of the
time to first token over its last TTFT_WINDOW_S (server/metrics.py). Ray aggregates each over
`look_back_period_s` and calls `RadixServePolicy` (Ray Serve's custom autoscaling policy hook,
`AutoscalingConfig(policy=AutoscalingPolicy(policy_function=...))`) in its controller.

The decision, as Kubernetes' HPA and llm-d's autoscaler make theirs, the largest of:

    waiting:  ceil(replicas * waiting per replica / target)      queue depth: work not started
    kv:       ceil(replicas * mean KV usage / target)            memory: the next prompts will not fit
    ttft:     replicas + 1 while the p90 TTFT is over its target   the latency users see

then `+ warm_replicas` (a warm pool: that many replicas beyond what the load needs, so a burst
finds them started), then Ray's own wrapper: min/max replicas, upscale_delay_s and
downscale_delay_s. A replica's running requests alone never scale up (a busy replica that keeps
up is not a reason, though it holds one replica). Every change is logged (the controller's log, `ray.serve` logger) with the
signal that caused it, and kept in the policy state (`last_decision`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("ray.serve")

SIGNALS = ("waiting", "running", "kv_usage", "ttft_p90_s")  # what each replica reports


@dataclass(frozen=True)
class AutoscaleConfig:
    min_replicas: int = 1  # 0: scale to zero when idle (Ray starts one when a request comes)
    max_replicas: int = 1
    warm_replicas: int = 0  # idle replicas kept beyond the demand (a warm pool)
    target_waiting: float = 2.0  # waiting requests per replica
    target_kv_usage: float = 0.85  # of the KV pool in use
    target_ttft_p90_s: float | None = 5.0  # None: TTFT is not a signal
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 120.0
    look_back_period_s: float = 15.0  # over Ray's metrics_interval_s (10)

    def check(self) -> None:
        if self.min_replicas < 0 or self.max_replicas < max(1, self.min_replicas):
            raise ValueError(f"max_replicas: must be at least 1 and at least --replicas ({self.min_replicas}), "
                             f"got {self.max_replicas}")
        if self.warm_replicas < 0:
            raise ValueError(f"warm_replicas: must be >= 0, got {self.warm_replicas}")
        if self.target_waiting <= 0 or not 0 < self.target_kv_usage <= 1:
            raise ValueError("autoscale_waiting must be > 0 and autoscale_kv_usage in (0, 1]")
        if self.target_ttft_p90_s is not None and self.target_ttft_p90_s <= 0:
            raise ValueError(f"autoscale_ttft_p90: must be > 0, got {self.target_ttft_p90_s}")

    def ray_config(self) -> dict[str, Any]:
        """Ray Serve's autoscaling_config for the replicas' deployment."""
        kwargs = {k: v for k, v in asdict(self).items() if k.startswith(("target_", "warm_"))}
        return {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "initial_replicas": min(self.max_replicas, max(self.min_replicas, self.warm_replicas)),
                "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s,
                "look_back_period_s": self.look_back_period_s,
                "policy": {"policy_function": "radixserve.ray.autoscale:RadixServePolicy", "policy_kwargs": kwargs}}


@dataclass(frozen=True)
class Signals:
    """The deployment's signals as the policy sees them (means over the running replicas)."""

    replicas: int
    waiting: float = 0.0  # in all
    running: float = 0.0
    kv_usage: float = 0.0  # mean
    ttft_p90_s: float = 0.0  # the worst replica's

    @classmethod
    def of(cls, replicas: int, metrics: dict[str, dict[Any, float]] | None) -> Signals:
        m = metrics or {}

        def values(name: str) -> list[float]:
            return [float(v) for v in (m.get(name) or {}).values()]

        kv = values("kv_usage")
        return cls(replicas, sum(values("waiting")), sum(values("running")), sum(kv) / len(kv) if kv else 0.0,
                   max(values("ttft_p90_s"), default=0.0))


def decide(s: Signals, target_waiting: float, target_kv_usage: float, target_ttft_p90_s: float | None,
           warm_replicas: int = 0) -> tuple[int, str]:
    """The replicas the signals ask for (before min/max and the delays), and the signal that asks most."""
    wants = [
        (math.ceil(s.waiting / target_waiting), f"waiting: {s.waiting:g} requests, target {target_waiting:g} a replica"),
        (math.ceil(s.replicas * s.kv_usage / target_kv_usage), f"kv_usage: {s.kv_usage:.0%}, target {target_kv_usage:.0%}"),
        (1 if s.running or s.waiting else 0, f"running: {s.running:g}, nothing over a target"),
    ]
    if target_ttft_p90_s is not None and s.ttft_p90_s > target_ttft_p90_s:
        wants.append((s.replicas + 1, f"ttft_p90: {s.ttft_p90_s:.2f} s, over the target {target_ttft_p90_s:g} s"))
    elif target_ttft_p90_s is not None and s.ttft_p90_s > target_ttft_p90_s / 2:  # near it: hold, no flapping down
        wants.append((s.replicas, f"ttft_p90: {s.ttft_p90_s:.2f} s, near the target {target_ttft_p90_s:g} s"))
    want, why = max(wants, key=lambda w: w[0])
    if want == 0:
        why = "idle: nothing waiting or running"
    return want + warm_replicas, why + (f"; +{warm_replicas} warm" if warm_replicas else "")


class RadixServePolicy:
    """Ray Serve's custom autoscaling policy (a class: Ray builds it with `policy_kwargs`)."""

    def __init__(self, target_waiting: float = 2.0, target_kv_usage: float = 0.85,
                 target_ttft_p90_s: float | None = 5.0, warm_replicas: int = 0) -> None:
        self.target_waiting, self.target_kv_usage = target_waiting, target_kv_usage
        self.target_ttft_p90_s, self.warm_replicas = target_ttft_p90_s, warm_replicas

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        s = Signals.of(ctx.current_num_replicas, ctx.aggregated_metrics)
        want, why = decide(s, self.target_waiting, self.target_kv_usage, self.target_ttft_p90_s, self.warm_replicas)
        want = min(max(want, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)
        state = dict(ctx.policy_state or {})
        if want != ctx.current_num_replicas and state.get("asked") != want:
            decision = f"{ctx.current_num_replicas} -> {want} replicas ({why})"
            log.info("radixserve autoscaler: %s asks %s", ctx.deployment_name, decision)
            state["last_decision"] = decision
        state["asked"] = want
        return want, state
