"""Autoscaling on what replicas fix (radixserve/ray/autoscale.py): the policy's decisions from
requests waiting, their prompt tokens, KV usage and TTFT per 1k computed prompt tokens (not raw
TTFT: one tenant's long prompts alone do not scale out), capped at the requests in flight and
within min/max, the warm pool, Ray Serve's config accepting what the flags build (test_server
checks /server_info reports the signals); and (slow) a load ramp on a local Ray cluster, in a
process of its own: 1 -> 2 -> 1 replicas, no request lost, the scale-up decision logged with the
signal that caused it, the new replica's cold start reported."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import pytest
from server_helpers import scaled

from radixserve.ray.autoscale import AutoscaleConfig, RadixServePolicy, Signals, Targets, decide

T = Targets()  # 2 waiting, 16384 waiting tokens a replica, 85 % KV, 5 s TTFT per 1k tokens


def ctx(n: int, state: dict | None, most: int = 4, least: int = 1, **metrics: dict) -> SimpleNamespace:
    """Ray's AutoscalingContext as the policy reads it."""
    return SimpleNamespace(current_num_replicas=n, aggregated_metrics=metrics, policy_state=state,
                           capacity_adjusted_min_replicas=least, capacity_adjusted_max_replicas=most,
                           deployment_name="RadixServeReplica")


def test_the_largest_demand_wins_and_names_its_signal():
    want, why = decide(Signals(1, waiting=5, running=1), T)
    assert want == 3 and why.startswith("waiting: 5 requests")
    want, why = decide(Signals(2, waiting=1, running=4, kv_usage=0.95), T)
    assert want == 3 and why.startswith("kv_usage: 95%")
    want, why = decide(Signals(2, running=3, ttft_per_1k_p90_s=7.5), T)
    assert want == 3 and why.startswith("ttft_per_1k_p90: 7.50 s, over")
    want, why = decide(Signals(1, waiting=3, waiting_tokens=60000, running=1), T)
    assert want == 4 and why.startswith("waiting_tokens: 60000 prompt tokens")


def test_busy_but_keeping_up_scales_down_to_one_and_idle_to_the_warm_pool():
    assert decide(Signals(3, running=6, kv_usage=0.2), T)[0] == 1  # running alone is no reason
    assert decide(Signals(2, ttft_per_1k_p90_s=3.0, running=2), T)[0] == 2  # near the TTFT target: hold
    assert decide(Signals(2, ttft_per_1k_p90_s=3.0, running=2), Targets(ttft_per_1k_s=None))[0] == 1  # not a signal
    assert decide(Signals(1), T) == (0, "idle: nothing waiting or running")
    want, why = decide(Signals(1, waiting=4), T, warm_replicas=1)
    assert want == 3 and why.endswith("+1 warm")


def test_one_tenants_long_prompts_alone_do_not_scale_out():
    """One tenant sends 16k-token prompts one after another: its raw TTFT p90 is 12 s, far over
    5 s, but nothing waits, and per 1k computed tokens its TTFT is the replica's prefill speed
    (0.75 s). A new replica would prefill it no faster: decision after decision, no scale-out;
    scaled out already (by an earlier burst), the deployment comes back to one replica."""
    policy = RadixServePolicy()
    alone = {"waiting": {"a": 0.0}, "waiting_tokens": {"a": 0.0}, "running": {"a": 1.0}, "kv_usage": {"a": 0.6},
             "ttft_p90_s": {"a": 12.0}, "ttft_per_1k_p90_s": {"a": 0.75}}  # as its replica reports them
    state: dict = {}
    for _ in range(10):
        want, state = policy(ctx(1, state, **alone))
        assert want == 1, state
    assert policy(ctx(4, {}, **alone))[0] == 1
    two = {**alone, "waiting": {"a": 1.0}, "waiting_tokens": {"a": 16000.0}, "ttft_per_1k_p90_s": {"a": 4.0}}
    assert policy(ctx(1, {}, **two))[0] == 1  # its second prompt waits, under every target: no
    slow = {**two, "ttft_per_1k_p90_s": {"a": 9.0}}  # ... until it waits long: one more replica serves it
    assert policy(ctx(1, {}, **slow))[0] == 2 and policy(ctx(2, {}, **slow))[0] == 2  # never more than in flight


def test_a_real_backlog_scales_out_within_min_and_max():
    policy = RadixServePolicy(warm_replicas=1)
    backlog = {"waiting": {"a": 9.0, "b": 7.0}, "waiting_tokens": {"a": 4000.0, "b": 3000.0}, "running": {"a": 2.0, "b": 2.0},
               "kv_usage": {"a": 0.5, "b": 0.5}, "ttft_per_1k_p90_s": {"a": 2.0, "b": 2.0}}
    want, state = policy(ctx(2, {}, **backlog))
    assert want == 4 and state["last_decision"] == ("2 -> 4 replicas (waiting: 16 requests, target 2 a replica; "
                                                    "+1 warm)")  # 8 + 1 asked, max 4
    assert policy(ctx(1, {}, most=6, **backlog))[0] == 6
    many_tokens = {**backlog, "waiting": {"a": 1.0, "b": 1.0}, "waiting_tokens": {"a": 40000.0, "b": 40000.0}}
    assert policy(ctx(2, {}, most=8, **many_tokens))[0] == 6  # ceil(80000 / 16384) = 5, then the warm one
    assert policy(ctx(3, {}, least=2, most=8))[0] == 2  # idle: the warm one, at least min


def test_the_policy_reads_rays_context_and_logs_each_change(caplog):
    policy = RadixServePolicy(target_waiting=1.0)
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

    args = parse(["--replicas", "1", "--max-replicas", "3", "--warm-replicas", "1", "--autoscale-ttft-per-1k", "0",
                  "--autoscale-waiting-tokens", "8192"])
    cfg = autoscale_config(args)
    assert cfg == AutoscaleConfig(1, 3, 1, target_waiting_tokens=8192, target_ttft_per_1k_s=None)
    ray_cfg = AutoscalingConfig(**cfg.ray_config())
    assert ray_cfg.min_replicas == 1 and ray_cfg.max_replicas == 3 and ray_cfg.initial_replicas == 1
    assert ray_cfg.policy.policy_function == "radixserve.ray.autoscale:RadixServePolicy"
    assert ray_cfg.policy.policy_kwargs == {"target_waiting": 2.0, "target_waiting_tokens": 8192, "target_kv_usage": 0.85,
                                            "target_ttft_per_1k_s": None, "warm_replicas": 1}
    RadixServePolicy(**ray_cfg.policy.policy_kwargs)
    assert "max_replicas" not in options_from_args(args)  # not a replica server's flag
    assert autoscale_config(parse(["--replicas", "2"])) is None
    with pytest.raises(ValueError, match="max_replicas"):
        autoscale_config(parse(["--replicas", "3", "--max-replicas", "2"]))
    with pytest.raises(ValueError, match="replicas"):
        autoscale_config(parse(["--replicas", "0"]))
    assert autoscale_config(parse(["--replicas", "0", "--max-replicas", "2"])).min_replicas == 0  # scale to zero, opt-in
    with pytest.raises(ValueError, match="autoscale_waiting_tokens: must be > 0"):
        autoscale_config(parse(["--max-replicas", "2", "--autoscale-waiting-tokens", "-1"]))


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


def test_ttft_per_1k_computed_prompt_tokens_is_what_a_replica_reports(monkeypatch):
    from radixserve.engine.protocol import EngineStats
    from radixserve.server import metrics as m

    clock = [1000.0]
    monkeypatch.setattr(m.time, "monotonic", lambda: clock[0])
    metrics = m.Metrics(EngineStats, lambda: 0, 1.0, 0.1)
    for _ in range(10):
        metrics.observe(12.0, 13.0, 5, "stop", computed_prompt_tokens=16000)  # long prompts: 0.75 s per 1k
    assert metrics.ttft_p90() == 12.0 and metrics.ttft_per_1k_p90() == pytest.approx(0.75)
    for _ in range(10):
        metrics.observe(3.0, 4.0, 5, "stop", computed_prompt_tokens=40)  # short ones that waited: as they are
    assert metrics.ttft_per_1k_p90() == pytest.approx(3.0)
    clock[0] += m.TTFT_WINDOW_S + 1
    assert metrics.ttft_per_1k_p90() == 0.0


@pytest.mark.slow
def test_a_load_ramp_scales_one_to_two_and_back_losing_nothing(tiny_llama, tmp_path):
    """`radixserve bench autoscale` in a process of its own (a Ray crash there fails this test,
    never the pytest process), on a local cluster of its own (RAY_TMPDIR)."""
    ray_tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"RAY_TMPDIR": ray_tmp}
    out, log = tmp_path / "ramp.json", tmp_path / "ramp.log"
    cmd = [sys.executable, "-m", "radixserve.cli", "bench", "autoscale", "--model", str(tiny_llama),
           "--kv-cache-tokens", "4096", "--grammar-compile-workers", "1", "--max-running-requests", "1", "--high", "6",
           "--phase-s", "8", "--max-tokens", "48", "--downscale-delay-s", "6", "--settle-s", "90", "--json", str(out)]
    try:
        with open(log, "wb") as f:
            subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=scaled(400), start_new_session=True)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert out.exists(), log.read_text()[-4000:]
    record = json.loads(out.read_text())
    assert record["failed"] == 0 and record["requests"] > 10, record["statuses"]
    assert record["peak_replicas"] == 2 and record["final_replicas"] == 1, record["timeline"]
    assert len(record["served_by"]) == 2  # both replicas answered
    up = next(d for d in record["decisions"] if d.startswith("1 -> 2 replicas"))
    assert "(waiting: " in up  # the signal that caused it
    assert any(d.startswith("2 -> 1 replicas") for d in record["decisions"])
    cold = [c for c in record["cold_start"] if "first_answer_s" in c]
    assert len(cold) == 2 and all(0 < c["server_ready_s"] <= c["first_answer_s"] for c in cold)


def test_the_weights_a_start_reads_are_named_and_prefetched_without_torch(tiny_llama, tmp_path):
    from radixserve.models.files import weight_files

    files = weight_files(str(tiny_llama))
    assert files and all(f.suffix == ".safetensors" and f.exists() for f in files)
    code = ("import sys; from radixserve.models.files import prefetch; prefetch(sys.argv[1:]); "
            "assert 'torch' not in sys.modules")  # the engine process runs it before importing torch
    subprocess.run([sys.executable, "-c", code, *map(str, files), str(tmp_path / "missing")], check=True)
