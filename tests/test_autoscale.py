"""Autoscaling on radixserve's signals (radixserve/ray/autoscale.py): the policy's decisions
from requests waiting, KV usage and TTFT p90, the warm pool, Ray Serve's config accepting what
the flags build (test_server checks /server_info reports the signals); and (slow) a load ramp on a
local Ray cluster: 1 -> 2 -> 1 replicas, no request lost, the scale-up decision logged with the
signal that caused it, the new replica's cold start reported."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from radixserve.ray.autoscale import AutoscaleConfig, RadixServePolicy, Signals, decide


def test_the_largest_demand_wins_and_names_its_signal():
    want, why = decide(Signals(1, waiting=5), 2.0, 0.85, 5.0)
    assert want == 3 and why.startswith("waiting: 5 requests")
    want, why = decide(Signals(2, waiting=1, kv_usage=0.95), 2.0, 0.85, 5.0)
    assert want == 3 and why.startswith("kv_usage: 95%")
    want, why = decide(Signals(2, running=3, ttft_p90_s=7.5), 2.0, 0.85, 5.0)
    assert want == 3 and why.startswith("ttft_p90: 7.50 s, over")


def test_busy_but_keeping_up_scales_down_to_one_and_idle_to_the_warm_pool():
    assert decide(Signals(3, running=6, kv_usage=0.2), 2.0, 0.85, 5.0)[0] == 1  # running alone is no reason
    assert decide(Signals(2, ttft_p90_s=3.0, running=1), 2.0, 0.85, 5.0)[0] == 2  # near the TTFT target: hold
    assert decide(Signals(2, ttft_p90_s=3.0), 2.0, 0.85, None)[0] == 0  # TTFT not a signal
    assert decide(Signals(1), 2.0, 0.85, 5.0) == (0, "idle: nothing waiting or running")
    want, why = decide(Signals(1, waiting=4), 2.0, 0.85, 5.0, warm_replicas=1)
    assert want == 3 and why.endswith("+1 warm")


def test_the_policy_reads_rays_context_and_logs_each_change(caplog):
    policy = RadixServePolicy(target_waiting=1.0)

    def ctx(n, state, **metrics):
        return SimpleNamespace(current_num_replicas=n, aggregated_metrics=metrics, policy_state=state,
                               capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4,
                               deployment_name="RadixServeReplica")

    with caplog.at_level("INFO", logger="ray.serve"):
        want, state = policy(ctx(1, {}, waiting={"a": 3.0}, kv_usage={"a": 0.1}))
        assert want == 3 and state["last_decision"] == "1 -> 3 replicas (waiting: 3 requests, target 1 a replica)"
        assert policy(ctx(1, state, waiting={"a": 3.0}))[1] == state  # asked again: logged once
        want, state = policy(ctx(4, state, waiting={"a": 20.0, "b": 20.0}))  # capped at max
        assert want == 4
        want, state = policy(ctx(3, state))  # idle: min
        assert want == 1 and state["last_decision"].startswith("3 -> 1 replicas")
    assert [r.message.count("->") for r in caplog.records] == [1, 1]


def test_the_flags_build_a_config_ray_serve_accepts():
    from ray.serve.config import AutoscalingConfig

    from radixserve.ray.options import options_from_args, parse
    from radixserve.ray.serve import autoscale_config

    args = parse(["--replicas", "1", "--max-replicas", "3", "--warm-replicas", "1", "--autoscale-ttft-p90", "0"])
    cfg = autoscale_config(args)
    assert cfg == AutoscaleConfig(1, 3, 1, 2.0, 0.85, None, 10.0, 120.0)
    ray_cfg = AutoscalingConfig(**cfg.ray_config())
    assert ray_cfg.min_replicas == 1 and ray_cfg.max_replicas == 3 and ray_cfg.initial_replicas == 1
    assert ray_cfg.policy.policy_function == "radixserve.ray.autoscale:RadixServePolicy"
    assert ray_cfg.policy.policy_kwargs == {"target_waiting": 2.0, "target_kv_usage": 0.85, "target_ttft_p90_s": None,
                                            "warm_replicas": 1}
    RadixServePolicy(**ray_cfg.policy.policy_kwargs)
    assert "max_replicas" not in options_from_args(args)  # not a replica server's flag
    assert autoscale_config(parse(["--replicas", "2"])) is None
    with pytest.raises(ValueError, match="max_replicas"):
        autoscale_config(parse(["--replicas", "3", "--max-replicas", "2"]))
    with pytest.raises(ValueError, match="replicas"):
        autoscale_config(parse(["--replicas", "0"]))
    assert autoscale_config(parse(["--replicas", "0", "--max-replicas", "2"])).min_replicas == 0  # scale to zero, opt-in


def test_a_serve_config_asks_for_autoscaling_by_field():
    from radixserve.ray.serve import app_builder

    app = app_builder({"replicas": 1, "autoscaling": {"max_replicas": 3, "target_waiting": 4}})
    assert app is not None
    with pytest.raises(ValueError, match=r"autoscaling: unknown field\(s\) max_replica "):
        app_builder({"replicas": 1, "autoscaling": {"max_replica": 3}})
    with pytest.raises(ValueError, match="max_replicas"):
        app_builder({"replicas": 4, "autoscaling": {"max_replicas": 3}})


def test_ttft_p90_is_over_the_recent_window_only(monkeypatch):
    from radixserve.engine.protocol import EngineStats
    from radixserve.server import metrics as m

    clock = [1000.0]
    monkeypatch.setattr(m.time, "monotonic", lambda: clock[0])
    metrics = m.Metrics(EngineStats, lambda: 0, 1.0, 0.1)
    assert metrics.ttft_p90() == 0.0
    for _ in range(10):
        metrics.observe(10.0, 11.0, 5, "stop")  # an old burst
    clock[0] += m.TTFT_WINDOW_S + 1
    for i in range(1, 11):
        metrics.observe(i / 10, 2.0, 5, "stop")
    assert metrics.ttft_p90() == pytest.approx(1.0)  # the 10 recent ones: 0.1 .. 1.0


@pytest.mark.slow
def test_a_load_ramp_scales_one_to_two_and_back_losing_nothing(tiny_llama, tmp_path):
    from radixserve.ray import ramp as autoscale

    p = argparse.ArgumentParser()
    autoscale.add_args(p)
    args = p.parse_args(["--model", str(tiny_llama), "--kv-cache-tokens", "4096", "--grammar-compile-workers", "1",
                         "--max-running-requests", "1", "--high", "6", "--phase-s", "8", "--max-tokens", "48",
                         "--downscale-delay-s", "6", "--settle-s", "90"])
    record = autoscale.measure(args)
    assert record["failed"] == 0 and record["requests"] > 10, record["statuses"]
    assert record["peak_replicas"] == 2 and record["final_replicas"] == 1, record["timeline"]
    assert len(record["served_by"]) == 2  # both replicas answered
    up = next(d for d in record["decisions"] if d.startswith("1 -> 2 replicas"))
    assert "(waiting: " in up  # the signal that caused it
    assert any(d.startswith("2 -> 1 replicas") for d in record["decisions"])
    cold = [c for c in record["cold_start"] if "first_answer_s" in c]
    assert len(cold) == 2 and all(0 < c["server_ready_s"] <= c["first_answer_s"] for c in cold)


def test_the_weights_a_start_reads_are_named_and_prefetched_without_torch(tiny_llama, tmp_path):
    import subprocess
    import sys

    from radixserve.models.files import weight_files

    files = weight_files(str(tiny_llama))
    assert files and all(f.suffix == ".safetensors" and f.exists() for f in files)
    code = ("import sys; from radixserve.models.files import prefetch; prefetch(sys.argv[1:]); "
            "assert 'torch' not in sys.modules")  # the engine process runs it before importing torch
    subprocess.run([sys.executable, "-c", code, *map(str, files), str(tmp_path / "missing")], check=True)
