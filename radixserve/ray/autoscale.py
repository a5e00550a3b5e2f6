"""Autoscaling the Ray deployment on what more replicas fix, not on busy-ness or raw latency.

Each replica reports, through Ray Serve's `record_autoscaling_stats` hook (deployment.py),
what its server's /server_info `autoscaling` block says: requests waiting (in the engine's
queue, not yet admitted to a batch: radixserve:num_requests_waiting), their prompt tokens
(waiting_tokens), requests running, KV pool usage (pages held / all), and the 90th percentile,
over its last TTFT_WINDOW_S, of each request's time to first token per 1,000 prompt tokens it
computed (a prompt under 1,000 counts as 1,000: server/metrics.py). Ray aggregates each over
`look_back_period_s` and calls `RadixServePolicy` (Ray Serve's custom autoscaling policy hook,
`AutoscalingConfig(policy=AutoscalingPolicy(policy_function=...))`) in its controller.

The decision, as Kubernetes' HPA and llm-d's autoscaler make theirs, the largest of:

    waiting:         ceil(waiting / target per replica)              queue depth: work not started
    waiting_tokens:  ceil(waiting prompt tokens / target per replica) the same, weighed by prompt size
    kv:              ceil(replicas * mean KV usage / target)         memory: the next prompts will not fit
    ttft_per_1k:     replicas + 1 while its p90 is over the target    requests wait, whatever their size

capped at the requests in flight (waiting + running: a request runs on one replica, so replicas
beyond them shorten nobody's wait), then `+ warm_replicas` (a warm pool: that many replicas
beyond what the load needs, so a burst finds them started), then Ray's own wrapper: min/max
replicas, upscale_delay_s and downscale_delay_s.

Not raw TTFT: a long prompt's prefill takes as long on a new replica as on this one, so one
tenant sending long prompts alone (high TTFT, nothing waiting) must not scale the deployment
out; per 1,000 tokens computed, its TTFT is the replica's prefill speed, under the target. A
replica's running requests alone never scale up (a busy replica that keeps up is not a reason,
though it holds one replica). Every change is logged (the controller's log, `ray.serve` logger)
with the signal that caused it, and kept in the policy state (`last_decision`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("ray.serve")

SIGNALS = ("waiting", "waiting_tokens", "running", "kv_usage", "ttft_per_1k_p90_s")  # what each replica reports


@dataclass(frozen=True)
class Targets:
    """The policy's targets (None: that signal is not used)."""

    waiting: float = 2.0  # waiting requests per replica
    waiting_tokens: float | None = 16384  # their prompt tokens per replica
    kv_usage: float = 0.85  # of the KV pool in use
    ttft_per_1k_s: float | None = 5.0  # TTFT p90 per 1,000 computed prompt tokens (a prompt under 1,000 counts as 1,000)

    def check(self) -> None:
        if self.waiting <= 0 or not 0 < self.kv_usage <= 1:
            raise ValueError("autoscale_waiting must be > 0 and autoscale_kv_usage in (0, 1]")
        for name, v in (("autoscale_waiting_tokens", self.waiting_tokens), ("autoscale_ttft_per_1k", self.ttft_per_1k_s)):
            if v is not None and v <= 0:
                raise ValueError(f"{name}: must be > 0 (0 on the command line: not a signal), got {v}")


@dataclass(frozen=True)
class AutoscaleConfig:
    min_replicas: int = 1  # 0: scale to zero when idle (Ray starts one when a request comes)
    max_replicas: int = 1
    warm_replicas: int = 0  # idle replicas kept beyond the demand (a warm pool)
    target_waiting: float = Targets.waiting
    target_waiting_tokens: float | None = Targets.waiting_tokens
    target_kv_usage: float = Targets.kv_usage
    target_ttft_per_1k_s: float | None = Targets.ttft_per_1k_s
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 120.0
    look_back_period_s: float = 15.0  # over Ray's metrics_interval_s (10)

    def check(self) -> None:
        if self.min_replicas < 0 or self.max_replicas < max(1, self.min_replicas):
            raise ValueError(f"max_replicas: must be at least 1 and at least --replicas ({self.min_replicas}), "
                             f"got {self.max_replicas}")
        if self.warm_replicas < 0:
            raise ValueError(f"warm_replicas: must be >= 0, got {self.warm_replicas}")
        self.targets().check()

    def targets(self) -> Targets:
        return Targets(self.target_waiting, self.target_waiting_tokens, self.target_kv_usage, self.target_ttft_per_1k_s)

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
    """The deployment's signals as the policy sees them (sums over the running replicas, but
    the KV usage, a mean, and the TTFT, the worst replica's)."""

    replicas: int
    waiting: float = 0.0
    waiting_tokens: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    ttft_per_1k_p90_s: float = 0.0

    @classmethod
    def of(cls, replicas: int, metrics: dict[str, dict[Any, float]] | None) -> Signals:
        m = metrics or {}

        def values(name: str) -> list[float]:
            return [float(v) for v in (m.get(name) or {}).values()]

        kv = values("kv_usage")
        return cls(replicas, sum(values("waiting")), sum(values("waiting_tokens")), sum(values("running")),
                   sum(kv) / len(kv) if kv else 0.0, max(values("ttft_per_1k_p90_s"), default=0.0))

    @property
    def in_flight(self) -> float:
        return self.waiting + self.running


def decide(s: Signals, t: Targets, warm_replicas: int = 0) -> tuple[int, str]:
    """The replicas the signals ask for (before min/max and the delays), and the signal that asks most."""
    wants = [
        (math.ceil(s.waiting / t.waiting), f"waiting: {s.waiting:g} requests, target {t.waiting:g} a replica"),
        (math.ceil(s.replicas * s.kv_usage / t.kv_usage), f"kv_usage: {s.kv_usage:.0%}, target {t.kv_usage:.0%}"),
        (1 if s.in_flight else 0, f"running: {s.running:g}, nothing over a target"),
    ]
    if t.waiting_tokens is not None:
        wants.append((math.ceil(s.waiting_tokens / t.waiting_tokens),
                      f"waiting_tokens: {s.waiting_tokens:g} prompt tokens, target {t.waiting_tokens:g} a replica"))
    ttft, target = s.ttft_per_1k_p90_s, t.ttft_per_1k_s
    if target is not None and ttft > target:
        wants.append((s.replicas + 1, f"ttft_per_1k_p90: {ttft:.2f} s, over the target {target:g} s"))
    elif target is not None and ttft > target / 2:  # near it: hold, no flapping down
        wants.append((s.replicas, f"ttft_per_1k_p90: {ttft:.2f} s, near the target {target:g} s"))
    want, why = max(wants, key=lambda w: w[0])
    if want > (cap := math.ceil(s.in_flight)):  # a request runs on one replica: more shorten nobody's wait
        want, why = cap, why + f"; capped at the {s.in_flight:g} requests in flight"
    if want == 0:
        why = "idle: nothing waiting or running"
    return want + warm_replicas, why + (f"; +{warm_replicas} warm" if warm_replicas else "")


class RadixServePolicy:
    """Ray Serve's custom autoscaling policy (a class: Ray builds it with `policy_kwargs`)."""

    def __init__(self, target_waiting: float = Targets.waiting, target_waiting_tokens: float | None = Targets.waiting_tokens,
                 target_kv_usage: float = Targets.kv_usage, target_ttft_per_1k_s: float | None = Targets.ttft_per_1k_s,
                 warm_replicas: int = 0) -> None:
        self.targets = Targets(target_waiting, target_waiting_tokens, target_kv_usage, target_ttft_per_1k_s)
        self.warm_replicas = warm_replicas

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        s = Signals.of(ctx.current_num_replicas, ctx.aggregated_metrics)
        want, why = decide(s, self.targets, self.warm_replicas)
        want = min(max(want, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)
        state = dict(ctx.policy_state or {})
        if want != ctx.current_num_replicas and state.get("asked") != want:
            decision = f"{ctx.current_num_replicas} -> {want} replicas ({why})"
            log.info("radixserve autoscaler: %s asks %s", ctx.deployment_name, decision)
            state["last_decision"] = decision
        state["asked"] = want
        return want, state
