"""`radixserve bench quality` (radixserve/bench/quality.py): its statistics against an
independent computation on a known perturbation, llama-perplexity's log read under the same
keys, the whole command on the tiny model (a configuration against itself: KLD 0), and its
errors for bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from radixserve.bench import quality
from radixserve.cli import main

TEXT = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"  # English prose, in every checkout


def test_the_statistics_are_the_exact_divergence_of_a_known_perturbation():
    """The candidate is the reference's logits at temperature 1.25: every figure against a
    computation of its own (torch's kl_div, sorted quantiles), which keeps the top token."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 50, generator=g) * 3
    targets = torch.randint(0, 50, (300,), generator=g)
    ref, cand = torch.log_softmax(logits, -1), torch.log_softmax(logits / 1.25, -1)
    div = quality.Divergence()
    div.add(ref[:100], cand[:100], targets[:100])  # in parts, as windows come
    div.add(ref[100:], cand[100:], targets[100:])
    r = div.summary()
    kld = F.kl_div(cand.double(), ref.double(), log_target=True, reduction="none").sum(-1)
    assert r["positions"] == 300
    assert math.isclose(r["mean_kld"], kld.mean().item(), rel_tol=1e-9)
    assert math.isclose(r["max_kld"], kld.max().item(), rel_tol=1e-9)
    assert math.isclose(r["median_kld"], kld.median().item() if len(kld) % 2 else kld.quantile(0.5).item(), rel_tol=1e-9)
    assert math.isclose(r["p99_kld"], kld.quantile(0.99).item(), rel_tol=1e-9)
    assert r["same_top"] == 1.0 and r["same_top_err"] == 0.0  # a temperature keeps the order
    dp = cand.exp().gather(1, targets[:, None]) - ref.exp().gather(1, targets[:, None])
    assert math.isclose(r["rms_dp"], dp.double().pow(2).mean().sqrt().item(), rel_tol=1e-6)
    nll = -ref.gather(1, targets[:, None]).double().mean().item()
    assert math.isclose(r["ppl_reference"], math.exp(nll), rel_tol=1e-9)
    swapped = quality.Divergence()  # a candidate whose top token is another one at a known share of rows
    other = ref.clone()
    flip = torch.arange(300) % 4 == 0
    top = ref.argmax(-1)
    other[flip, top[flip]] = -1e4  # those rows lose their top token
    swapped.add(ref, torch.log_softmax(other, -1), targets)
    assert swapped.summary()["same_top"] == 0.75


LLAMA_PERPLEXITY_LOG = """\
llama_perf_context_print:        load time =     612.33 ms
====== Perplexity statistics ======
Mean PPL(Q)                   :  12.345678 ±   0.456789
Mean PPL(base)                :  12.300000 ±   0.450000
Cor(ln(PPL(Q)), ln(PPL(base))):  99.87%
Mean ln(PPL(Q)/PPL(base))     :   0.003706 ±   0.000812
Mean PPL(Q)/PPL(base)         :   1.003713 ±   0.000815
Mean PPL(Q)-PPL(base)         :   0.045678 ±   0.010123

====== KL divergence statistics ======
Mean    KLD:   0.001900 ±   0.000087
Maximum KLD:   0.312345
99.9%   KLD:   0.098765
99.0%   KLD:   0.020123
Median  KLD:   0.000812
10.0%   KLD:   0.000034
 5.0%   KLD:   0.000012
 1.0%   KLD:   0.000002
 0.1%   KLD:  -0.000001
Minimum KLD:  -0.000003

====== Token probability statistics ======
Mean    Δp: -0.021 ± 0.030 %
Maximum Δp: 18.123%
99.9%   Δp:  9.876%
Median  Δp:  0.000%
RMS Δp    :  1.170 ± 0.041 %
Same top p: 97.412 ± 0.099 %
"""


def test_a_llama_perplexity_log_reads_under_the_same_keys(tmp_path: Path):
    r = quality.parse_llama_perplexity(LLAMA_PERPLEXITY_LOG)
    assert r["mean_kld"] == 0.0019 and r["mean_kld_err"] == 0.000087
    assert r["p99_kld"] == 0.020123 and r["max_kld"] == 0.312345 and r["median_kld"] == 0.000812
    assert r["same_top"] == pytest.approx(0.97412) and r["same_top_err"] == pytest.approx(0.00099)
    assert r["rms_dp"] == pytest.approx(0.0117) and r["mean_dp"] == pytest.approx(-0.00021)
    assert r["ppl_candidate"] == 12.345678 and r["ppl_reference"] == 12.3
    log, out = tmp_path / "lp.log", tmp_path / "lp.json"
    log.write_text(LLAMA_PERPLEXITY_LOG)
    assert main(["bench", "quality", "--from-llama-perplexity", str(log), "--label", "llama.cpp Q4_K_M", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["label"] == "llama.cpp Q4_K_M" and written["mean_kld"] == 0.0019
    log.write_text("llama-perplexity: perplexity only\n[1]12.3,[2]12.4\n")
    with pytest.raises(ValueError, match="no mean_kld, same_top in the log"):
        quality.parse_llama_perplexity(log.read_text())


@pytest.mark.slow
def test_the_command_scores_a_configuration_against_itself_as_identical_and_a_quantized_one_apart(tiny_llama: Path,
                                                                                                   tmp_path: Path):
    out = tmp_path / "same.json"
    args = ["bench", "quality", "--model", str(tiny_llama), "--text", str(TEXT), "--ctx", "64", "--chunks", "3"]
    assert main([*args, "--quantization", "none", "--dtype", "float32", "--chunked-prefill-size", "24",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["chunks"] == 3 and r["positions"] == 3 * 31  # rows 32..62 of each window
    assert r["mean_kld"] == 0.0 and r["max_kld"] == 0.0 and r["same_top"] == 1.0 and r["rms_dp"] == 0.0
    assert r["ppl_candidate"] == r["ppl_reference"] > 1
    assert r["reference"]["quantization"] == "none" and r["reference"]["dtype"] == "float32"
    out8 = tmp_path / "int4.json"
    assert main([*args, "--quantization", "int4", "--json", str(out8)]) == 0  # int4 weights, int8 activations (auto)
    q = json.loads(out8.read_text())
    assert q["candidate"]["activations"] == "int8 (head int16)" and q["candidate"]["quantization"] == "q4_1+q8_0"
    assert q["mean_kld"] > 0 and q["ppl_reference"] == pytest.approx(r["ppl_reference"], rel=1e-5)  # (chunked otherwise)


@pytest.mark.slow
def test_bad_input_is_a_clear_error_naming_it(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    short = tmp_path / "short.txt"
    short.write_text("A few words only.")
    assert main(["bench", "quality", "--model", str(tiny_llama), "--text", str(short), "--ctx", "64"]) == 2
    err = capsys.readouterr().err
    assert "--text: " in err and "at least 2 are needed" in err
    assert main(["bench", "quality", "--model", str(tiny_llama), "--text", str(TEXT), "--ctx", "64",
                 "--ref-activations", "int8"]) == 2
    err = capsys.readouterr().err
    assert "the reference (" in err and "--activations int8: the model has no quantized weights" in err
    assert main(["bench", "quality", "--model", str(tiny_llama)]) == 2
    assert "--text: give the text to score" in capsys.readouterr().err
