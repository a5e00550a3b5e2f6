"""Render the benchmark page's generated sections from the JSON the bench commands write.

    .venv/bin/python scripts/bench_page.py            # rewrite docs/benchmarks.md's generated parts
    .venv/bin/python scripts/bench_page.py --check    # exit 1 if they are not what the JSON says

Inputs live in docs/bench/: each `*.json` is a bench command's own `--json` output, and
docs/bench/runs.json says, per input, the command that wrote it, when and on what machine.
Each section of docs/benchmarks.md between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`
is replaced by its table, with a plot (SVG, beside the JSON) where a curve says more:

    fork      `bench prefix --branches N` for several N: the prefix cache's speed-up by branch
              count (the same fork with and without the cache)
    serving   `bench serving --json`: latency, throughput and goodput against arrival rate
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "bench"
PAGE = ROOT / "docs" / "benchmarks.md"


def _plot(path: Path, draw: Callable[[Any], None]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "radixserve"  # the same SVG for the same data
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    draw(ax)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)


def _made(run: dict[str, str]) -> str:
    return f"Made by `{run['command']}` ({run['date']}, {run['machine']})."


def fork(runs: dict[str, dict[str, str]], plots: bool) -> str:
    """The prefix cache's speed-up on one fork, by branch count (`bench prefix`)."""
    rows = []
    for path in sorted(BENCH.glob("prefix-fork-*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1])):
        r = json.loads(path.read_text())
        on, off = r["radixserve"], r["radixserve_no_cache"]
        rows.append((on["requests"], off["wall_s"] / on["wall_s"], on["wall_s"], off["wall_s"],
                     on["prefill_tokens_computed"], off["prefill_tokens_computed"]))
    if not rows:
        return "(no `prefix-fork-*.json` in docs/bench)"
    if plots:
        def draw(ax: Any) -> None:
            ax.plot([r[0] for r in rows], [r[1] for r in rows], "-o")
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set(xscale="log", xlabel="branches off one shared prompt", ylabel="speed-up with the prefix cache",
                   title="fork: wall time without the cache / with it")
            ax.set_xticks([r[0] for r in rows], [str(r[0]) for r in rows])
        _plot(BENCH / "fork-speedup.svg", draw)
    lines = ["![fork speed-up by branch count](bench/fork-speedup.svg)", "",
             "| branches | speed-up | wall s with / without the cache | prefill tokens with / without |", "|---:|---:|---:|---:|"]
    lines += [f"| {n} | {s:.2f}x | {a:.1f} / {b:.1f} | {p:,} / {q:,} |" for n, s, a, b, p, q in rows]
    return "\n".join(lines + ["", _made(runs["prefix-fork"])])


def serving(runs: dict[str, dict[str, str]], plots: bool) -> str:
    """Open-loop latency, throughput and goodput by arrival rate (`bench serving`)."""
    path = BENCH / "serving-chat.json"
    if not path.exists():
        return "(no serving-chat.json in docs/bench)"
    data = json.loads(path.read_text())
    points = data["open_loop"]["chat"]
    if plots:
        def draw(ax: Any) -> None:
            rates = [p["rate"] for p in points]
            ax.plot(rates, [p["request_s"] for p in points], "-o", label="completed req/s")
            ax.plot(rates, [p["goodput_req_s"] for p in points], "--o", label="goodput req/s")
            ax.plot(rates, rates, ":", color="grey", label="offered")
            ax.set(xlabel="arrivals/s", ylabel="requests/s",
                   title=f"chat goodput (SLO: TTFT {data['slo_ttft_ms']:g} ms, TPOT {data['slo_tpot_ms']:g} ms)")
            ax.legend(fontsize=8)
        _plot(BENCH / "serving-goodput.svg", draw)

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    lines = ["![chat goodput by arrival rate](bench/serving-goodput.svg)", "",
             "| arrivals/s | completed out tok/s | goodput req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms |",
             "|---:|---:|---:|---:|---:|"]
    lines += [f"| {p['rate']:g} | {p['output_tok_s']:.1f} | {p['goodput_req_s']:.2f} | {ms(p['ttft_p50_ms'])} / "
              f"{ms(p['ttft_p99_ms'])} | {ms(p['tpot_p50_ms'])} / {ms(p['tpot_p99_ms'])} |" for p in points]
    return "\n".join(lines + ["", _made(runs["serving-chat"])])


SECTIONS: dict[str, Callable[[dict[str, dict[str, str]], bool], str]] = {"fork": fork, "serving": serving}


def render(page: str, plots: bool) -> str:
    runs = json.loads((BENCH / "runs.json").read_text())
    for name, make in SECTIONS.items():
        begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
        m = re.search(re.escape(begin) + r"\n.*?" + re.escape(end), page, re.S)
        if m is None:
            raise SystemExit(f"{PAGE}: no {begin} ... {end} section")
        page = f"{page[: m.start()]}{begin}\n{make(runs, plots)}\n{end}{page[m.end() :]}"
    return page


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only check that the page says what the JSON says")
    args = p.parse_args(argv)
    page = PAGE.read_text()
    new = render(page, plots=not args.check)
    if args.check:
        if new != page:
            print(f"{PAGE} is not what docs/bench/*.json says: run scripts/bench_page.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
