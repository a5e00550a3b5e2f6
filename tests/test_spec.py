"""Speculative decoding from context copies (sched/spec.py): drafting, cutting, verification.

The engine tests force drafts (a huge fixed step cost and batch cap, so the cost model always
drafts) and hold speculation to its contract: greedy output token-identical to decoding
without it, sampled output with the same distribution, and no KV slot leaked.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
from helpers import assert_no_leak

from radixserve import Engine, SamplingParams
from radixserve.cache.allocator import SlotAllocator
from radixserve.cache.prefix import Namespace, NullPrefixCache
from radixserve.cache.radix import RadixCache
from radixserve.config import SpecConfig
from radixserve.request import Req
from radixserve.sched.cache_manager import CacheManager
from radixserve.sched.spec import NgramProposer

FORCE = dict(speculative="ngram", spec_fixed_cost_rows=1e9, spec_max_batch=64)  # draft whenever a draft is found


def _proposer(cache: CacheManager | None = None, eos: int = 99, decode=None, **cfg) -> NgramProposer:
    cache = cache or CacheManager(SlotAllocator(64), NullPrefixCache())
    return NgramProposer(SpecConfig(speculative="ngram", **cfg), cache, {eos}, 4096, 1e9, decode)


def _req(tokens: list[int], prompt_len: int | None = None, **params) -> Req:
    n = len(tokens) if prompt_len is None else prompt_len
    req = Req(tokens[:n], SamplingParams(max_new_tokens=params.pop("max_new_tokens", 64), **params))
    req.token_ids.extend(tokens[n:])
    return req


# -- drafting -------------------------------------------------------------------------------
def test_the_longest_suffix_ngram_wins_then_the_latest_occurrence():
    p = _proposer(spec_ngram_max=3)
    d = p.propose(_req([1, 2, 3, 4, 9, 9, 5, 2, 3, 7, 7, 1, 2, 3]), 1)
    assert d is not None and d.ngram == 3 and d.tokens[:3] == [4, 9, 9] and not d.from_cache
    d = p.propose(_req([5, 6, 2, 3, 8, 1, 7, 2, 3, 4, 5, 0, 2, 3]), 1)  # [2, 3] twice: the latest
    assert d is not None and d.ngram == 2 and d.tokens[:3] == [4, 5, 0]
    assert p.propose(_req([1, 2, 3, 4, 5]), 1) is None  # nothing recurs


def test_a_draft_is_cut_at_eos_max_new_tokens_and_stop_strings():
    tokens = [10, 11, 12, 13, 99, 14, 15, 10, 11]
    d = _proposer().propose(_req(tokens), 1)
    assert d is not None and d.tokens == [12, 13, 99]  # stops after EOS
    d = _proposer().propose(_req(tokens, ignore_eos=True), 1)
    assert d is not None and d.tokens[:4] == [12, 13, 99, 14]
    d = _proposer().propose(_req(tokens, prompt_len=7, max_new_tokens=4), 1)  # 2 generated, room for 1 + the next
    assert d is not None and d.tokens == [12]
    words = {10: "a", 11: "b", 12: "c", 13: "STOP", 14: "d", 15: "e", 99: ""}
    d = _proposer(decode=lambda ids: "".join(words[t] for t in ids)).propose(_req(tokens, stop=["cST"]), 1)
    assert d is not None and d.tokens == [12, 13]  # the token completing the stop string is the last


class _Matcher:
    """Accepts tokens below `limit`; terminates on 0."""

    def __init__(self, limit: int) -> None:
        self.limit, self.done, self.accepted = limit, False, []

    def accept(self, t: int) -> bool:
        if self.done or t >= self.limit:
            return False
        self.accepted.append(t)
        self.done = t == 0
        return True

    def is_terminated(self) -> bool:
        return self.done

    def rollback(self, n: int) -> None:
        for _ in range(n):
            self.done = False
            self.accepted.pop()

    def jump_forward(self) -> str:
        return ""


def test_a_draft_is_cut_where_the_grammar_rejects_or_ends_and_the_matcher_is_left_as_it_was():
    req = _req([1, 2, 3, 50, 4, 1, 2])
    req.grammar = m = _Matcher(limit=40)
    d = _proposer().propose(req, 1)
    assert d is not None and d.tokens == [3] and m.accepted == []  # 50 is refused
    req = _req([1, 2, 3, 0, 4, 1, 2])
    req.grammar = m = _Matcher(limit=40)
    d = _proposer().propose(req, 1)
    assert d is not None and d.tokens == [3, 0] and m.accepted == [] and not m.done  # 0 ends the grammar
    req.grammar_active = False  # `grammar_after` not seen yet: no drafts
    assert _proposer().propose(req, 1) is None


def test_the_cost_model_drafts_less_as_the_batch_grows_and_after_rejections():
    p = NgramProposer(SpecConfig(speculative="ngram", spec_max_draft=16), CacheManager(SlotAllocator(64), NullPrefixCache()),
                      set(), 4096, 3.0)
    req = _req(list(range(20)) * 2 + [0, 1])
    lengths = [len(d.tokens) if (d := p.propose(req, b)) else 0 for b in (1, 4, 16)]
    assert lengths[0] > lengths[1] >= lengths[2] and lengths[0] >= 1
    draft = p.propose(req, 1)
    for _ in range(6):  # the model keeps refusing the first draft token
        p.observe(req, draft, 0)
    assert p.propose(req, 1) is None
    p.release(req.rid)


def test_cached_branches_are_read_only_and_never_cross_namespaces():
    c = RadixCache()
    a, b = Namespace("A"), Namespace("B")
    c.insert(a, [1, 2, 3, 4, 5, 6, 7], list(range(7)))
    c.insert(a, [1, 2, 3, 20, 21, 22], [0, 1, 2, 10, 11, 12])
    c.insert(b, [1, 2, 3, 30, 31, 32], list(range(20, 26)))
    version, nodes = c.version, len(c._nodes())
    runs = c.branches(a, [1, 2, 3, 4, 40], 0, 2, 100)
    assert [3, 4, 5, 6, 7] in runs and [2, 3, 20, 21, 22] in runs  # 2 tokens of context, then the branch
    assert not any(30 in r for r in runs)
    assert c.branches(b, [1, 2, 3, 40], 0, 2, 100) == [[2, 3, 30, 31, 32]]
    assert c.branches(Namespace("C"), [1, 2, 3], 0, 2, 100) == []
    assert (c.version, len(c._nodes())) == (version, nodes)  # no split, nothing touched
    c.check_integrity()
    c.insert(a, [1, 2, 9], [0, 1, 40])
    assert c.version != version


def test_a_cached_branch_drafts_what_a_sibling_wrote():
    cache = CacheManager(SlotAllocator(64), RadixCache())
    cache.prefix.insert(Namespace("default"), [1, 2, 3, 4, 5, 6, 7, 8], list(range(8)))
    p = _proposer(cache)
    d = p.propose(_req([1, 2, 3, 4, 5]), 1)
    assert d is not None and d.from_cache and d.tokens == [6, 7, 8]
    other = _req([1, 2, 3, 4, 5])
    other.tenant = "other"
    assert p.propose(other, 1) is None


def test_trim_gives_back_whole_pages_past_the_kept_tokens():
    cache = CacheManager(SlotAllocator(64, page_size=4), RadixCache(page_size=4))
    req = _req(list(range(5)))
    cache.admit(req)
    assert cache.alloc(req, 13)
    req.computed_len = 6
    cache.trim(req)
    assert cache.num_slots(req) == 6 and cache.allocator.num_free == 64 - 8
    assert cache.alloc(req, 3) and cache.allocator.num_free == 64 - 12  # the spare room of the last page first
    cache.release(req)
    assert cache.allocator.num_free + cache.prefix.cached_tokens == 64
    cache.check_integrity()


# -- engine: greedy identity, on the tiny model ---------------------------------------------
PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "Agents call tools, read JSON, and branch. Agents call tools, read",
           "a b a b a b a b a b a b a b a b",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"]


def _run(path: Path, prompts, params, rounds: int = 2, **kw):
    """Every round's outputs, and the stats. A random tiny model seldom repeats itself, so its
    drafts come mostly from the cache: the second round drafts what the first wrote."""
    with Engine(str(path), **kw) as e:
        outs = [e.generate(prompts, params) for _ in range(rounds)]
        stats = e.stats()
        assert_no_leak(e)
    return [o for r in outs for o in r], stats


@pytest.mark.parametrize("extra", [{}, {"page_size": 4}, {"attention_backend": "torch_ref"}], ids=["default", "pages", "torch_ref"])
def test_greedy_output_is_identical_with_speculation(tiny_llama, extra):
    params = [SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True),
              SamplingParams(max_new_tokens=40, temperature=0, stop=["lazy"]),
              SamplingParams(max_new_tokens=30, temperature=0, return_logprob=True, top_logprobs_num=2),
              SamplingParams(max_new_tokens=33, temperature=0, repetition_penalty=1.3, min_new_tokens=20)]
    base, _ = _run(tiny_llama, PROMPTS, params, kv_cache_tokens=2048, **extra)
    spec, st = _run(tiny_llama, PROMPTS, params, kv_cache_tokens=2048, **extra, **FORCE)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    assert [o.finish_reason for o in spec] == [o.finish_reason for o in base]
    for a, b in zip(spec[2].logprobs + spec[6].logprobs, base[2].logprobs + base[6].logprobs):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for _, t in a.top] == [t for _, t in b.top]
    assert st.spec_verifies > 0 and st.spec_accepted_tokens > 0, st
    assert st.spec_verifies <= st.spec_emitted_tokens <= st.spec_accepted_tokens + st.spec_verifies  # kept <= accepted + 1


def test_greedy_identity_holds_with_grammars_and_jump_forward(tiny_llama):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "tags": {"type": "array", "items": {"enum": ["ab", "ba", "aa"]}, "maxItems": 6}},
              "required": ["name", "tags"]}
    params = [SamplingParams(max_new_tokens=60, temperature=0, json_schema=json.dumps(schema)),
              SamplingParams(max_new_tokens=40, temperature=0, regex=r"(ab|ba|a b ){2,12}"),
              SamplingParams(max_new_tokens=40, temperature=0, regex=r"(ab|ba|a b ){2,12}", stop=["ba"])]
    prompts = PROMPTS[2:3] * 3
    for extra, draft in (({}, {}), ({}, {"spec_max_draft": 2}), ({"disable_jump_forward": True}, {})):
        base, _ = _run(tiny_llama, prompts, params, **extra)  # max_draft 2: forced text cut short in the draft
        spec, st = _run(tiny_llama, prompts, params, **extra, **FORCE, **draft)
        assert [o.token_ids for o in spec] == [o.token_ids for o in base], extra
        assert st.spec_verifies > 0, st
        json.loads(spec[0].text)


def test_greedy_identity_holds_for_forks_and_under_retraction(tiny_llama):
    prefix = "A radix tree shares prefixes; an LRU policy evicts the coldest leaves first. " * 3
    prompts = [prefix + q for q in ("one", "two", "three", "four", "five", "six")]
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    for kw in ({"kv_cache_tokens": 4096}, {"kv_cache_tokens": 256, "page_size": 2}):
        base, b_st = _run(tiny_llama, prompts, params, **kw)
        spec, st = _run(tiny_llama, prompts, params, **kw, **FORCE)
        assert [o.token_ids for o in spec] == [o.token_ids for o in base], kw
        assert st.spec_verifies > 0, st
        if kw["kv_cache_tokens"] == 256:
            assert st.retractions > 0 and b_st.retractions > 0, (st, b_st)


def test_a_second_round_drafts_from_the_first_rounds_cached_outputs_in_its_namespace_only(tiny_llama):
    params = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    prompt = "Paris is the capital of France, and Berlin is"
    with Engine(str(tiny_llama), spec_ngram_min=3, **FORCE) as e:
        first = e.generate([prompt], params, tenant="a")[0]
        before = e.stats()
        again = e.generate([prompt], params, tenant="a")[0]
        mid = e.stats()
        other = e.generate([prompt], params, tenant="b")[0]
        after = e.stats()
        assert_no_leak(e)
    assert again.token_ids == first.token_ids == other.token_ids
    assert mid.spec_cache_accepted_tokens - before.spec_cache_accepted_tokens >= 16, mid
    assert after.spec_cache_draft_tokens == mid.spec_cache_draft_tokens  # tenant b never drafts from a's cache


# -- engine: sampling keeps its distribution ------------------------------------------------
def _chi2_same(a: Counter, b: Counter) -> float:
    """Two-sample chi-square statistic and its degrees of freedom, over categories with
    enough counts (the rest pooled); returns the p-value's upper-tail z approximation."""
    cats = [c for c in set(a) | set(b) if a[c] + b[c] >= 10]
    rest = (sum(a.values()) - sum(a[c] for c in cats), sum(b.values()) - sum(b[c] for c in cats))
    rows = [(a[c], b[c]) for c in cats] + ([rest] if sum(rest) else [])
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for x, y in rows:
        tot = x + y
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    dof = max(len(rows) - 1, 1)
    return (stat - dof) / math.sqrt(2 * dof)  # ~N(0, 1) under the null for a few dozen dof


def test_seeded_sampling_has_the_same_token_distribution_with_speculation(tiny_llama):
    n = 400
    params = [SamplingParams(max_new_tokens=6, temperature=0.7, top_k=8, seed=s, ignore_eos=True) for s in range(n)]
    prompts = [PROMPTS[2]] * n
    base, _ = _run(tiny_llama, prompts, params, rounds=1, kv_cache_tokens=16384, max_running_requests=16)
    spec, st = _run(tiny_llama, prompts, params, rounds=1, kv_cache_tokens=16384, max_running_requests=16, **FORCE)
    assert st.spec_accepted_tokens > 200, st  # enough samples went through accepted drafts
    for pos in range(1, 6):
        z = _chi2_same(Counter(o.token_ids[pos] for o in base), Counter(o.token_ids[pos] for o in spec))
        assert z < 4.0, (pos, z)
    pairs = _chi2_same(Counter(tuple(o.token_ids[1:3]) for o in base), Counter(tuple(o.token_ids[1:3]) for o in spec))
    assert pairs < 4.0


# -- served: flags, /server_info, /metrics, the openai client -------------------------------
def test_a_speculating_server_reports_drafts_and_answers_the_openai_client_as_without(tiny_llama, tmp_path):
    import urllib.request

    from openai import OpenAI
    from server_helpers import ServerProcess

    log = tmp_path / "server.log"
    on = ServerProcess(tiny_llama, "--speculative", "ngram", "--spec-fixed-cost-rows", "1e9", "--spec-max-draft", "6", log=log)
    try:
        client = OpenAI(base_url=on.url + "/v1", api_key="none")
        msgs = [{"role": "user", "content": "Paris is the capital of France, and Berlin is"}]
        model = client.models.list().data[0].id
        first, again = (client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0) for _ in range(2))
        assert first.choices[0].message.content == again.choices[0].message.content
        _, info = on.get("/server_info")
        assert info["speculative"]["method"] == "ngram" and info["speculative"]["max_draft"] == 6
        assert info["speculative"]["fixed_cost_rows"] == 1e9
        stats = info["speculative_stats"]
        assert stats["accepted_tokens"] > 0 and 0 < stats["acceptance_rate"] <= 1 and stats["tokens_per_verify"] > 1
        with urllib.request.urlopen(on.url + "/metrics") as r:
            metrics = r.read().decode()
        drafted = next(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("radixserve_spec_draft_tokens_total"))
        assert drafted == stats["draft_tokens"] > 0
        assert "radixserve_spec_acceptance_rate" in metrics
        kv = on.wait_idle()
        assert kv["kv_in_use_slots"] == 0
    finally:
        assert on.stop() == 0, log.read_text()
