"""The abuse bench's mechanics at tiny sizes (`radixserve bench abuse`): it runs every phase
against a real two-tenant server and reports them; its goals' numbers are for a quiet machine
(docs/reliability.md), so only the report's shape is checked here."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from server_helpers import ServerProcess, scaled

TENANTS = ('[[tenants]]\nid = "alice"\napi_key = "key-alice"\n\n'
           '[[tenants]]\nid = "bob"\napi_key = "key-bob"\n\n'
           '[[tenants]]\nid = "ops"\napi_key = "key-ops"\nadmin = true\n')
TINY = ["--quick", "--duration", "0.5", "--clients", "2", "--b-tokens", "4", "--a-concurrency", "1", "--bomb-blocks", "200",
        "--regex-spaces", "20", "--retention-words", "50", "--context-tokens", "400", "--idle-connections", "40",
        "--unread-streams", "2", "--unread-tokens", "64", "--salt-bytes", "4096", "--request-timeout", "20",
        "--settle-timeout", "20", "--lead-in", "0.2"]


def test_bench_abuse_reports_tenant_b_beside_every_shape_of_tenant_a(tiny_llama, tmp_path):
    from radixserve.bench import abuse

    (tmp_path / "tenants.toml").write_text(TENANTS)
    server = ServerProcess(tiny_llama, "--tenants", str(tmp_path / "tenants.toml"), "--kv-cache-tokens", "8192",
                           "--keepalive-timeout", "2", log=tmp_path / "server.log")
    out = tmp_path / "abuse.json"
    try:
        cmd = [sys.executable, "-m", "radixserve.cli", "bench", "abuse", "--url", server.url, "--keys", "key-alice,key-bob",
               "--admin-key", "key-ops", *TINY, "--json", str(out)]
        bench = subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(240))
        assert bench.returncode == 0, bench.stdout + bench.stderr
    finally:
        assert server.stop() == 0, (tmp_path / "server.log").read_text()[-3000:]
    data = json.loads(out.read_text())
    assert not data["open_server"] and data["server"]["max_context_len"] > 400
    assert list(data["phases"]) == list(abuse.PHASES)
    for row in [data["solo"], *data["phases"].values(), data["solo_again"]]:
        assert row["b"]["sent"] > 0 and row["before"]["rss_mb"] > 0 and row["after"]["engine_pid"], row
    for name, row in data["phases"].items():
        assert sum(row["a_outcomes"].values()) > 0 and sum(row["a"].values()) == sum(row["a_outcomes"].values()), (name, row)
        assert len(row["goals"]) == 5 and set(row["x_solo"]) == {"ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"}, row
        assert row["restarted"] is not None, row  # the admin key sees the server's start time and the engine's pid
    idle = data["phases"]["idle_connections"]["a_outcomes"]
    assert all(k.startswith(("silent:", "partial:")) for k in idle) and sum(idle.values()) >= 40, idle
    printed = bench.stdout
    print(printed)  # the table, for `pytest -s`
    assert all(name in printed for name in abuse.PHASES) and "solo again" in printed and "goals met in" in printed


def test_bench_reliability_abuse_switch_runs_the_abuse_bench(monkeypatch):
    from radixserve.bench import abuse, reliability

    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(abuse, "run", lambda args: seen.append(args) or 0)
    p = argparse.ArgumentParser()
    reliability.add_args(p)
    assert reliability.run(p.parse_args(["--abuse", "--quick", "--phases", "malformed"])) == 0
    assert abuse.resolve(seen[0]).duration == abuse.SIZES["duration"][2] and seen[0].phases == "malformed"
