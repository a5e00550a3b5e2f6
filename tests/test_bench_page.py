"""scripts/bench_page.py: the benchmark page's generated sections say what the committed JSON
says, and a section is rendered from a bench command's own --json output."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_page.py"


def _page_module():
    spec = importlib.util.spec_from_file_location("bench_page", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_page_says_what_its_json_says():
    assert _page_module().main(["--check"]) == 0


def test_the_fork_section_is_the_speed_up_the_prefix_bench_measured(tmp_path, monkeypatch):
    page = _page_module()
    monkeypatch.setattr(page, "BENCH", tmp_path)
    for n, on, off in ((2, 10.0, 12.5), (16, 12.0, 96.0)):
        row = {"requests": n, "prefill_tokens_computed": 2000 + 10 * n}
        (tmp_path / f"prefix-fork-{n}.json").write_text(json.dumps({
            "radixserve": {**row, "wall_s": on}, "radixserve_no_cache": {**row, "wall_s": off, "prefill_tokens_computed": 2000 * n}}))
    (tmp_path / "runs.json").write_text(json.dumps({name: {"command": "cmd", "date": "d", "machine": "m"}
                                                    for name in ("prefix-fork", "serving-chat")}))
    out = page.render("<!-- bench:fork -->\nold\n<!-- /bench:fork -->\n<!-- bench:serving -->\n<!-- /bench:serving -->",
                      ("fork", "serving"), plots=True)
    assert "| 2 | 1.25x | 10.0 / 12.5 | 2,020 / 4,000 |" in out and "| 16 | 8.00x | 12.0 / 96.0 |" in out
    assert "old" not in out and "Made by `cmd` (d, m)." in out and "(no serving-chat.json" in out
    assert (tmp_path / "fork-speedup.svg").read_text().startswith("<?xml")


def test_the_compare_table_is_what_bench_compare_wrote(tmp_path, monkeypatch):
    """One column per compare run, in runs.json's order; lower is better for prefill and fork."""
    page = _page_module()
    monkeypatch.setattr(page, "BENCH", tmp_path)
    (tmp_path / "a.json").write_text(json.dumps({"single": {"radixserve": 120.0, "llama.cpp": 80.0},
                                                 "fork": {"radixserve": 7.0, "llama.cpp": 140.0}}))
    (tmp_path / "b.json").write_text(json.dumps({"prefill": {"radixserve": 4000.0, "llama.cpp": 2000.0}}))
    (tmp_path / "runs.json").write_text(json.dumps({
        "compare-a": {"label": "A, avx512", "file": "a.json", "command": "bench a", "date": "d", "machine": "m"},
        "prefix-fork": {"command": "x", "date": "d", "machine": "m"},
        "compare-b": {"label": "B, avx2", "file": "b.json", "command": "bench b", "date": "d", "machine": "m"}}))
    out = page.render("x\n<!-- bench:compare -->\n<!-- /bench:compare -->\ny", ("compare",), plots=False)
    assert "| workload | A, avx512 | B, avx2 | goal |" in out
    assert "| single: one request → 128 tokens, output tok/s | 120.0 vs 80.0: **1.50x** | - | 1.2x |" in out
    assert "| prefill: one ~2,000-token prompt, ms | - | 4,000.0 vs 2,000.0: **0.50x** | 1.5x |" in out
    assert "7.0 vs 140.0: **20.00x**" in out and "- B, avx2: `bench b` (d, m)" in out
    assert out.startswith("x\n") and out.endswith("\ny")


def test_the_quality_section_is_a_row_per_quality_run(tmp_path, monkeypatch):
    page = _page_module()
    monkeypatch.setattr(page, "BENCH", tmp_path)
    figures = {"mean_kld": 0.00211, "mean_kld_err": 0.00005, "p99_kld": 0.0121, "max_kld": 0.0412, "same_top": 0.97206,
               "rms_dp": 0.0116, "ppl_candidate": 18.48, "ppl_reference": 18.41}
    (tmp_path / "ours.json").write_text(json.dumps(figures))
    (tmp_path / "peer.json").write_text(json.dumps({**figures, "mean_kld": 0.0019}))
    made = {"model": "SmolLM2 Q4_1", "date": "d", "machine": "m"}
    (tmp_path / "runs.json").write_text(json.dumps({
        "quality-a": {**made, "label": "radixserve", "file": "ours.json", "command": "c1"},
        "quality-b": {**made, "label": "llama.cpp", "file": "peer.json", "command": "c2"}}))
    out = page.render("<!-- bench:quality -->\n<!-- /bench:quality -->", ("quality",), plots=False)
    assert "| SmolLM2 Q4_1 | radixserve | 0.00211 ± 0.00005 | 0.0121 | 0.041 | 97.21 % | 1.16 % | 18.480 / 18.410 |" in out
    assert "| SmolLM2 Q4_1 | llama.cpp | 0.00190 ± 0.00005 |" in out and "`c2` (d, m)" in out
