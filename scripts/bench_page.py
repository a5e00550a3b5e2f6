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
    compare   `bench compare --json` against llama.cpp, one column per run (runs.json's
              `compare-*` entries, in order: each names its file and its column's label);
              the README's performance table
    sessions  `bench sessions --json`: an agent's returning turn from the pool, the disk tier,
              after a restart, and cold
    history   `bench history --json`: a reasoning agent's turns, the history precompute on and off
    quality   `bench quality --json` (and `--from-llama-perplexity` for llama.cpp's own runs):
              each fast path's KL divergence from its exact path, one row per runs.json
              `quality-*` entry, in order (docs/quantization.md)

The README's sections are rendered the same way (`PAGES`).
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
README = ROOT / "README.md"


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


# `bench compare`'s workloads: the row's words, and the goal radixserve is held to against llama.cpp
COMPARE_ROWS = {
    "single": ("single: one request → 128 tokens, output tok/s", 1.2),
    "batch": ("batch: 32 concurrent → 128 tokens each, output tok/s", 1.5),
    "prefill": ("prefill: one ~2,000-token prompt, ms", 1.5),
    "fork": ("fork: 16 questions off one ~2,000-token prefix → 64 tokens each, wall s", 5.0),
    "json": ("json: 16 concurrent JSON-schema chats, output tok/s", 1.5),
}
HIGHER_IS_BETTER = {"single": True, "batch": True, "prefill": False, "fork": False, "json": True}


def compare(runs: dict[str, dict[str, str]], plots: bool) -> str:
    """radixserve against llama.cpp, each workload back to back in one run per column."""
    cols = [(r["label"], json.loads((BENCH / r["file"]).read_text()), r) for k, r in runs.items() if k.startswith("compare-")]
    if not cols:
        return "(no compare-* runs in docs/bench/runs.json)"

    def cell(w: str, data: dict[str, dict[str, float]]) -> str:
        row = data.get(w)
        if not row:
            return "-"
        ours, theirs = row["radixserve"], row["llama.cpp"]
        ratio = ours / theirs if HIGHER_IS_BETTER[w] else theirs / ours
        return f"{ours:,.1f} vs {theirs:,.1f}: **{ratio:.2f}x**"

    lines = ["| workload | " + " | ".join(label for label, _, _ in cols) + " | goal |",
             "|---|" + "---:|" * (len(cols) + 1)]
    for w, (words, goal) in COMPARE_ROWS.items():
        lines.append(f"| {words} | " + " | ".join(cell(w, data) for _, data, _ in cols) + f" | {goal:g}x |")
    lines += ["", "Each cell: radixserve vs llama.cpp, and how many times better radixserve is (above 1: it wins); "
              "lengths are at --scale 1 (a column's command says its scale). Made by:", ""]
    lines += [f"- {label}: `{r['command']}` ({r['date']}, {r['machine']})" for label, _, r in cols]
    return "\n".join(lines)


def sessions(runs: dict[str, dict[str, str]], plots: bool) -> str:
    """An agent's returning turn: TTFT from the pool, the disk tier, after a restart, and cold."""
    path = BENCH / "sessions.json"
    if not path.exists():
        return "(no sessions.json in docs/bench)"
    r = json.loads(path.read_text())
    cold = r["runs"]["cold"]["ttft_s"]
    lines = [f"An agent session of {r['prompt_tokens']:,} prompt tokens (its KV: {r['kv_bytes_per_token']:,} bytes a token).", "",
             "| returning turn | TTFT ms | prompt tokens from the cache | of them from disk | vs cold |", "|---|---:|---:|---:|---:|"]
    for name, label in (("cold", "(d) cold prefill"), ("pool", "(a) from the pool"), ("disk", "(b) from disk, after eviction"),
                        ("restart", "(c) after a kill -9 and restart")):
        x = r["runs"][name]
        lines.append(f"| {label} | {x['ttft_s'] * 1000:,.0f} | {x['cached_tokens']:,} | {x['from_disk_tokens']:,} | "
                     f"{cold / x['ttft_s']:.1f}x |")
    same = "identical" if r["answers_identical"] else "NOT identical"
    lines += ["", f"Greedy answers of the four: {same}.", "", _made(runs["sessions"])]
    return "\n".join(lines)


def history(runs: dict[str, dict[str, str]], plots: bool) -> str:
    """A reasoning agent's turns with the history precompute on and off (`bench history`), one
    table per runs.json `history-*` entry."""
    out = []
    for key, run in ((k, r) for k, r in runs.items() if k.startswith("history-")):
        r = json.loads((BENCH / run["file"]).read_text())
        lines = [f"**{run['label']}**", "", "| turn | prompt tokens | on: cached | computed | TTFT ms | off: cached | computed | "
                 "TTFT ms |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        def cells(t: dict[str, Any]) -> str:
            share = t["cached_tokens"] / t["prompt_tokens"]
            return f"{t['cached_tokens']:,} ({share:.1%}) | {t['computed_tokens']:,} | {t['ttft_s'] * 1e3:,.0f}"

        for k, (a, b) in enumerate(zip(r["on"]["turns"], r["off"]["turns"])):
            lines.append(f"| {k + 1} | {a['prompt_tokens']:,} | {cells(a)} | {cells(b)} |")
        h = r["on"]["history"]
        same = "identical" if r["answers_same"] else "not identical"
        lines += ["", f"Returning turns with the precompute on: at least {r['worst_returning_share']:.1%} of each prompt "
                  f"cached; {h['precomputes']} precomputes computed {h['precomputed_tokens']:,} tokens, {h['hits']} turns hit "
                  f"them ({h['hit_tokens']:,} tokens); greedy answers on and off {same}.", "", _made(runs[key])]
        out.append("\n".join(lines))
    return "\n\n".join(out) or "(no history-* runs in docs/bench/runs.json)"


def quality(runs: dict[str, dict[str, str]], plots: bool) -> str:
    """Each fast path against its own exact path on the same file and text (`bench quality`)."""
    rows = [(r, json.loads((BENCH / r["file"]).read_text())) for k, r in runs.items() if k.startswith("quality-")]
    if not rows:
        return "(no quality-* runs in docs/bench/runs.json)"
    lines = ["| file | candidate, against its exact path | mean KLD | 99% KLD | max KLD | same top token | RMS Δp | "
             "PPL candidate / exact |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    def kld(x: float, digits: int) -> str:
        return f"{x:.{digits}f}" if x >= 10 ** -digits else f"{x:.1e}"

    for r, q in rows:
        err = f" ± {q['mean_kld_err']:.5f}" if "mean_kld_err" in q else ""
        lines.append(f"| {r['model']} | {r['label']} | {kld(q['mean_kld'], 5)}{err} | {kld(q['p99_kld'], 4)} | "
                     f"{kld(q['max_kld'], 3)} | "
                     f"{100 * q['same_top']:.2f} % | {100 * q['rms_dp']:.2f} % | "
                     f"{q['ppl_candidate']:.3f} / {q['ppl_reference']:.3f} |")
    lines += ["", "Made by:", ""]
    lines += [f"- {r['model']}, {r['label']}: `{r['command']}` ({r['date']}, {r['machine']})" for r, _ in rows]
    return "\n".join(lines)


SECTIONS: dict[str, Callable[[dict[str, dict[str, str]], bool], str]] = {
    "fork": fork, "serving": serving, "compare": compare, "sessions": sessions, "quality": quality, "history": history}
QUALITY_PAGE = ROOT / "docs" / "quantization.md"
PAGES = {PAGE: ("fork", "serving", "sessions", "history"), README: ("compare",), QUALITY_PAGE: ("quality",)}


def render(page: str, names: tuple[str, ...], plots: bool, where: Path = PAGE) -> str:
    runs = json.loads((BENCH / "runs.json").read_text())
    for name in names:
        begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
        m = re.search(re.escape(begin) + r"\n.*?" + re.escape(end), page, re.S)
        if m is None:
            raise SystemExit(f"{where}: no {begin} ... {end} section")
        page = f"{page[: m.start()]}{begin}\n{SECTIONS[name](runs, plots)}\n{end}{page[m.end() :]}"
    return page


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only check that the pages say what the JSON says")
    args = p.parse_args(argv)
    stale = []
    for path, names in PAGES.items():
        page = path.read_text()
        new = render(page, names, plots=not args.check, where=path)
        if new != page:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"{', '.join(map(str, stale))}: not what docs/bench/*.json says: run scripts/bench_page.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
