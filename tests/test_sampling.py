"""Sampling parameters, stop conditions, logprobs and bad input, through the Engine."""

from __future__ import annotations

import math

import pytest
import torch

from radixserve import SamplingParams
from radixserve.engine.sampler import Sampler
from radixserve.request import Req

PROMPT = [5, 17, 42, 99, 123, 7, 250]


def test_same_seed_same_output_and_batch_independent(tiny_engine):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_new_tokens=16, ignore_eos=True, seed=7)
    a = tiny_engine.generate([PROMPT], p)[0].token_ids
    b = tiny_engine.generate([PROMPT, PROMPT[:3], PROMPT[2:]], p)[0].token_ids
    assert a == b
    other = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=8)
    assert tiny_engine.generate([PROMPT], other)[0].token_ids != a


def test_max_and_min_new_tokens(tiny_engine):
    eos = next(iter(tiny_engine.eos_ids))
    out = tiny_engine.generate([PROMPT], SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True))[0]
    assert out.completion_tokens == 5 and out.finish_reason == "length"
    # nearly every token stops; min_new_tokens holds them off, so the first three come from the rest
    allowed = {5, 6, 7}
    stops = [t for t in range(tiny_engine.vocab_size) if t not in allowed]
    out = tiny_engine.generate([PROMPT], SamplingParams(temperature=0, max_new_tokens=9, min_new_tokens=3, stop_token_ids=stops))[0]
    assert set(out.token_ids[:3]) <= allowed and eos not in out.token_ids[:3]
    assert out.completion_tokens == 4 and out.finish_reason == "stop" and out.matched_stop == out.token_ids[-1]


def test_stop_string_across_token_boundaries_is_trimmed(tiny_engine):
    base = tiny_engine.generate([PROMPT], SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True))[0]
    text = base.text
    assert len(text) > 6
    stop = text[3:6]  # a span that very likely straddles tokens
    out = tiny_engine.generate([PROMPT], SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True, stop=stop))[0]
    assert out.finish_reason == "stop" and out.matched_stop == stop
    assert out.text == text[: text.index(stop)]


def test_logprobs_with_top_alternatives_and_prompt_logprobs(tiny_engine):
    p = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True, return_logprob=True, top_logprobs_num=3,
                       logprob_start_len=2)
    out = tiny_engine.generate([PROMPT], p)[0]
    assert len(out.logprobs) == 6
    for lp in out.logprobs:
        assert len(lp.top) == 3 and lp.top[0][1] == lp.token_id  # greedy picks the top token
        assert math.isclose(lp.logprob, lp.top[0][0], rel_tol=1e-6)
    assert [e.token_id for e in out.prompt_logprobs] == PROMPT[2:]
    assert all(e.logprob is not None and e.logprob <= 0 for e in out.prompt_logprobs)
    # teacher forcing: prompt logprobs of prompt + output equal the sampled tokens' logprobs
    full = PROMPT + out.token_ids
    again = tiny_engine.generate([full], SamplingParams(max_new_tokens=0, logprob_start_len=len(PROMPT)))[0]
    got = [e.logprob for e in again.prompt_logprobs]
    want = [e.logprob for e in out.logprobs]
    assert got == pytest.approx(want, abs=1e-4)
    assert again.completion_tokens == 0


def test_prompt_logprobs_from_zero_start_with_none(tiny_engine):
    out = tiny_engine.generate([PROMPT], SamplingParams(max_new_tokens=0, logprob_start_len=0))[0]
    assert out.prompt_logprobs[0].logprob is None and len(out.prompt_logprobs) == len(PROMPT)
    one = tiny_engine.generate([PROMPT[:1]], SamplingParams(max_new_tokens=0, logprob_start_len=0))[0]
    assert [(e.token_id, e.logprob) for e in one.prompt_logprobs] == [(PROMPT[0], None)]  # nothing to score, still listed


def _req(**kw) -> Req:
    return Req([1, 3, 3], SamplingParams(**kw))


def test_penalties_and_filters_in_the_sampler():
    s = Sampler(vocab_size=8, eos_ids={7})
    logits = torch.tensor([[1.0, 5.0, 4.9, 0.0, 0.0, 0.0, 0.0, 9.0]])
    assert s.sample(logits, [_req(temperature=0)])[0] == [7]
    assert s.sample(logits, [_req(temperature=0, min_new_tokens=1)])[0] == [1]  # EOS held off
    assert s.sample(logits, [_req(temperature=0, repetition_penalty=2.0, min_new_tokens=1)])[0] == [2]
    for t in (5.6e-229, 1e-6):  # a positive temperature below 1e-5 is greedy, never inf / nan (found by the fuzzer)
        assert _req(temperature=t).params.greedy and s.sample(logits, [_req(temperature=t, seed=3)])[0] == [7]
    assert not _req(temperature=1e-4).params.greedy and s.sample(logits, [_req(temperature=1e-4, seed=3)])[0] == [7]
    for seed in range(20):  # top_k=1 and a tiny top_p both leave one candidate
        assert s.sample(logits, [_req(temperature=1.0, top_k=2, top_p=0.01, seed=seed)])[0] == [7]
        assert s.sample(logits, [_req(temperature=1.0, min_p=0.9, seed=seed)])[0] == [7]


def test_argmax_rows_is_torchs_argmax_ties_infinities_and_views_included():
    """The greedy pick (numpy's argmax on CPU) is torch's: the first of equal maxima, -inf
    and +inf rows, a padded batch's sliced view; and a plain batch's logits are not changed."""
    from radixserve.engine.sampler import argmax_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1000, generator=g)
    x[1, 10] = x[1, 500] = 99.0  # a tie: the first
    x[2] = float("-inf")
    x[3, 7] = float("inf")
    x[4, ::2] = -1e30
    x[5] = 0.0
    for v in (x, x[:, :700], x[2:5]):
        assert argmax_rows(v) == v.argmax(dim=-1).tolist()
    s = Sampler(vocab_size=700, eos_ids={1})
    before = x.clone()
    assert s.sample(x, [_req(temperature=0) for _ in range(6)])[0] == x[:, :700].argmax(dim=-1).tolist()
    assert torch.equal(x, before)
    assert s.sample(x, [_req(temperature=0, min_new_tokens=9) for _ in range(6)])[0][1] == 10  # held-off EOS: a copy
    assert torch.equal(x, before)


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ([1, 2, 10**9], SamplingParams(), "input_ids"),
        ([1, -1], SamplingParams(), "input_ids"),
        (list(range(3, 300)) * 8, SamplingParams(), "prompt"),  # past the 2,048-token window
        ([1, 2], SamplingParams(max_new_tokens=100000), "max_new_tokens"),
        ([1, 2], SamplingParams(max_new_tokens=-1), "max_new_tokens"),
        ([1, 2], SamplingParams(temperature=float("nan")), "temperature"),
        ([1, 2], SamplingParams(temperature=-0.5), "temperature"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p"),
        ([1, 2], SamplingParams(top_p=1.5), "top_p"),
        ([1, 2], SamplingParams(top_k=-3), "top_k"),
        ([1, 2], SamplingParams(min_p=2.0), "min_p"),
        ([1, 2], SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        ([1, 2], SamplingParams(frequency_penalty=float("inf")), "frequency_penalty"),
        ([1, 2], SamplingParams(stop=[""]), "stop"),
        ([1, 2], SamplingParams(stop_token_ids=[10**9]), "stop_token_ids"),
        ([1, 2], SamplingParams(top_logprobs_num=-1), "top_logprobs_num"),
        ([1, 2], SamplingParams(seed=-5), "seed"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_parameter(tiny_engine, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        tiny_engine.generate([prompt], params)
    assert tiny_engine.generate([[5, 6]], SamplingParams(max_new_tokens=2))[0].completion_tokens >= 1


def test_unknown_engine_option_is_named():
    from radixserve.config import EngineConfig

    with pytest.raises(TypeError, match="kv_cache_tokenz"):
        EngineConfig.build(None, kv_cache_tokenz=5)
    cfg = EngineConfig.build("m", kv_cache_tokens=5, chunked_prefill_size=7, attention_backend="torch")
    assert (cfg.model.path, cfg.cache.kv_cache_tokens, cfg.sched.chunked_prefill_size) == ("m", 5, 7)
