"""logit_bias (OpenAI's semantics): added to the logits before penalties, temperature, filters and
the grammar mask, on greedy, sampled and speculative draft rows; validated with the field named;
carried across the engine-process boundary to a served request."""

from __future__ import annotations

import pytest
import torch

from radixserve import SamplingParams
from radixserve.engine.sampler import Sampler
from radixserve.request import MAX_LOGIT_BIAS, InvalidParam, Req

LOGITS = torch.tensor([[1.0, 5.0, 4.9, 0.0, 0.0, 0.0, 0.0, 9.0]])


def _req(**kw) -> Req:
    return Req([1, 3, 3], SamplingParams(**kw))


class _Allow:
    """A matcher that accepts only `allowed` tokens (what the sampler asks of a grammar)."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def accept(self, tok: int) -> bool:
        return tok in self.allowed

    def rollback(self, n: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False

    def fill_bitmask(self, mask: torch.Tensor, row: int) -> None:
        mask[row] = sum(1 << t for t in self.allowed)


def test_bias_moves_greedy_and_sampled_rows_and_leaves_logprobs_raw():
    s = Sampler(vocab_size=8, eos_ids={6})
    assert s.sample(LOGITS, [_req(temperature=0)])[0] == [7]
    assert s.sample(LOGITS, [_req(temperature=0, logit_bias={"2": 4.2})])[0] == [2]  # 4.9 + 4.2 > 9
    assert s.sample(LOGITS, [_req(temperature=0, logit_bias={7: -100})])[0] == [1]  # int keys work too
    for seed in range(10):
        assert s.sample(LOGITS, [_req(temperature=1.0, seed=seed, logit_bias={"3": 100})])[0] == [3]
        assert s.sample(LOGITS, [_req(temperature=1.0, top_k=1, seed=seed, logit_bias={"7": -100})])[0] == [1]
    toks, lps = s.sample(LOGITS, [_req(temperature=0, logit_bias={"4": 50}, return_logprob=True, top_logprobs_num=1)])
    assert toks == [4] and lps[0] is not None and lps[0].top[0][1] == 7  # logprobs: the model's own distribution


def test_each_row_gets_its_own_requests_bias_draft_rows_included():
    s = Sampler(vocab_size=8, eos_ids={6})
    a, b = _req(temperature=0, logit_bias={"5": 100}), _req(temperature=0)
    logits = LOGITS.repeat(4, 1)
    toks, _ = s.sample(logits, [a, a, a, b], drafts=[(), (5,), (5, 5), ()])  # a's draft rows, then b's one row
    assert toks == [5, 5, 5, 7]


def test_bias_comes_before_the_penalties_and_the_grammar_mask():
    s = Sampler(vocab_size=8, eos_ids={6})
    r = _req(temperature=0, logit_bias={"3": 8}, repetition_penalty=2.0)
    r.token_ids.append(7)  # seen: 1, 3, 7. The penalty halves the biased logit: 3 -> (0 + 8) / 2 = 4, 7 -> 4.5
    assert s.sample(LOGITS, [r])[0] == [2]  # 2 (4.9, unseen) wins; a bias added after the penalty would pick 3
    g = _req(temperature=0, logit_bias={"7": 100, "2": 20})
    g.grammar = _Allow({1, 2})  # the grammar refuses 7 however it is biased; 2's bias decides among the rest
    assert s.sample(LOGITS, [g])[0] == [2]
    sampled = _req(temperature=1.0, seed=3, logit_bias={"7": 100, "1": 30})
    mask = torch.zeros(1, 1, dtype=torch.int32)
    _Allow({1, 2}).fill_bitmask(mask, 0)
    assert s.sample(LOGITS, [sampled], masks=([0], mask))[0] == [1]


@pytest.mark.parametrize(("bias", "text"), [
    ({"abc": 1}, "key 'abc'"),
    ({"-1": 1}, "key '-1'"),
    ({"8": 1}, "key '8'"),
    ({True: 1}, "key True"),
    ({"3": 100.5}, "token 3"),
    ({"3": float("nan")}, "token 3"),
    ({"3": "1"}, "token 3"),
    ({"3": 1, "03": 2}, "twice"),
    ({str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}, "limit of 300"),
    ([1, 2], "expected an object"),
])
def test_bad_logit_bias_names_the_field(bias, text):
    with pytest.raises(InvalidParam, match=text) as e:
        SamplingParams(logit_bias=bias).validate(8)
    assert e.value.field == "logit_bias"
    SamplingParams(logit_bias={"0": -100, 7: 100.0, "5": 0}).validate(8)
    SamplingParams(logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS)}).validate(1000)


def test_speculative_drafts_are_verified_under_the_bias(tiny_llama):
    """A +100 bias repeats one token: the n-gram drafts are that token, and every verified row
    must be biased as the decode itself would be, or the output would stray from it."""
    from radixserve import Engine

    with Engine(str(tiny_llama), kv_cache_tokens=2048, speculative="ngram", spec_fixed_cost_rows=1e9) as e:
        p = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, logit_bias={"42": 100})
        out = e.generate([[5, 17, 42, 99, 123]], p)[0]
        assert out.token_ids == [42] * 24
        assert e.snapshot().spec_accepted_tokens > 0


# -- served: the openai client, through the engine process ------------------------------------
def _client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _first(client, **kw):
    r = client.chat.completions.create(model="", messages=[{"role": "user", "content": "Agents call tools."}],
                                       max_tokens=1, temperature=0, logprobs=True, top_logprobs=5, **kw)
    lp = r.choices[0].logprobs.content[0]
    return lp.token, [t.token for t in lp.top_logprobs]


def test_served_bias_picks_a_token_and_bans_the_argmax(server, tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    ids_of: dict[str, list[int]] = {}
    for i in range(len(tok)):
        ids_of.setdefault(tok.decode([i]), []).append(i)
    client = _client(server)
    best, top = _first(client)
    assert best == top[0]
    other = next(t for t in top[1:] if len(ids_of.get(t, [])) == 1 and t != best)
    picked, _ = _first(client, logit_bias={str(ids_of[other][0]): 100})
    assert picked == other
    banned, top_banned = _first(client, logit_bias={str(i): -100 for i in ids_of[best]})
    assert banned != best and banned == next(t for t in top if t != best)
    assert top_banned == top  # logprobs stay the model's own


@pytest.mark.parametrize(("bias", "text"), [
    ({"abc": 5}, "key 'abc' is not a token id"),
    ({"99999999": 5}, "key '99999999' is not a token id"),
    ({"5": 101}, "not a number in [-100, 100]"),
    ({"5": -1e9}, "not a number in [-100, 100]"),
    ({str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}, "more than the limit of 300"),
])
def test_served_bad_logit_bias_is_a_400_naming_it(server, bias, text):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        _client(server).chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                                logit_bias=bias)
    assert e.value.param == "logit_bias" and text in e.value.message
    status, body = server.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, "logit_bias": bias}})
    assert status == 400 and body["error"]["param"] == "sampling_params.logit_bias", body


def test_native_generate_takes_logit_bias(server):
    status, body = server.post("/generate", {"input_ids": [5, 17, 42], "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {"77": 100}}, "return_logprob": True})
    assert status == 200 and [t[1] for t in body["meta_info"]["output_token_logprobs"]] == [77, 77, 77], body
