"""The table `radixserve bench abuse` prints: tenant B's latencies beside each of tenant A's
shapes against B's solo run, A's outcomes, the server's RSS and restarts, and the goals."""

from __future__ import annotations

import argparse
from typing import Any


def _f(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None or x != x else format(x, fmt)


COLUMNS = (("phase", "<20"), ("B TTFT p50/p99 ms", ">19"), ("x solo", ">8"), ("TPOT p50/p99 ms", ">17"), ("x solo", ">8"),
           ("B served", ">10"), ("A 2xx/4xx/shed/5xx/other", ">26"), ("server RSS MiB (growth, peak)", ">30"), ("restart", ">9"),
           ("goals", ">7"))


def _line(cells: list[str]) -> str:
    return "".join(format(c, spec) for c, (_, spec) in zip(cells, COLUMNS, strict=True))


def _row(name: str, row: dict[str, Any]) -> str:
    if "b" not in row:
        return f"{name:<20}{row.get('skipped', '')}"
    b, a, x = row["b"], row.get("a"), row.get("x_solo", {})
    a_col = "/".join(str(a[k]) for k in ("served", "refused", "shed", "5xx", "other")) if a and row.get("a_outcomes") else "-"
    goals = row.get("goals")
    return _line([name, f"{_f(b['ttft_p50_ms'], '.1f')} / {_f(b['ttft_p99_ms'], '.1f')}", _f(x.get("ttft_p99", 1.0), ".2f"),
                  f"{_f(b['tpot_p50_ms'], '.1f')} / {_f(b['tpot_p99_ms'], '.1f')}", _f(x.get("tpot_p99", 1.0), ".2f"),
                  f"{b['served']}/{b['sent']}", a_col,
                  f"{_f(row['before']['rss_mb'])}->{_f(row['after']['rss_mb'])} ({_f(row['rss_growth_mb'], '+.0f')}, "
                  f"{_f(row['rss_peak_growth_mb'], '+.0f')})",
                  {None: "?", True: "YES", False: "no"}[row["restarted"]],
                  "-" if goals is None else "pass" if all(v is not False for v in goals.values()) else "FAIL"])


def _details(name: str, row: dict[str, Any], what: str) -> list[str]:
    lines = [f"  {name}: {what}" + (f" ({'; '.join(row['notes'])})" if row.get("notes") else "")]
    if row.get("before", {}).get("engine_rss_mb") is not None and row.get("after", {}).get("engine_rss_mb") is not None:
        lines.append(f"    engine process RSS: {_f(row['before']['engine_rss_mb'])} -> {_f(row['after']['engine_rss_mb'])} MiB "
                     "(its KV pool's pages count once first written)")
    if row.get("a_outcomes"):
        lines.append(f"    A's outcomes: {dict(sorted(row['a_outcomes'].items()))}")
    lines += [f"    first {k}: {text}" for k, text in sorted(row.get("a_samples", {}).items())]
    if set(row["b"]["statuses"]) != {"200"}:
        lines.append(f"    B's outcomes: {row['b']['statuses']}")
    missed = [g for g, ok in row.get("goals", {}).items() if ok is False]
    unknown = [g for g, ok in row.get("goals", {}).items() if ok is None]
    if missed:
        lines.append(f"    missed: {'; '.join(missed)}")
    if unknown:
        lines.append(f"    not measured (this key cannot see it): {'; '.join(unknown)}")
    if row.get("settled_after") is False:
        lines.append(f"    the server was still busy when the settle timeout ({row['busy_after_s']:.0f} s) ran out")
    elif row.get("busy_after_s", 0) > 2:
        lines.append(f"    the server went idle {row['busy_after_s']:.1f} s after B's load ended (A's last requests)")
    return lines


def report(out: dict[str, Any], args: argparse.Namespace, what: dict[str, str]) -> None:
    """`what`: each phase's shape, in words."""
    print(f"abuse: tenant B ({args.clients} clients, {args.b_tokens}-token streamed chats, {args.duration:g} s a phase) "
          f"alone, then beside each of tenant A's shapes; server {out['server']['model']} "
          f"(context {out['server']['max_context_len']}, {out['server']['tool_call_parser']} tool calls)")
    if out["open_server"]:
        print("  an open server: A and B are the same default tenant (give --keys KEY_A,KEY_B for two tenants)")
    print(_line([title for title, _ in COLUMNS]))
    print(_row("solo", out["solo"]))
    for name, row in out["phases"].items():
        print(_row(name, row))
    print(_row("solo again (noise)", out["solo_again"]))
    for name, row in out["phases"].items():
        if "b" in row:
            print("\n".join(_details(name, row, what[name])))
    rows = [r for r in out["phases"].values() if "goals" in r]
    met = sum(all(v is not False for v in r["goals"].values()) for r in rows)
    print(f"goals met in {met} of {len(out['phases'])} phases (x solo: p99 over B's solo p99; shed: 503/429, "
          "a refusal; 'other': timeouts, closed or held connections, client errors)")
