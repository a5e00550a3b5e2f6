"""Grammars: backend masks against a brute-force oracle on a small vocabulary, rollback, the
compile cache (hits, cached failures and timeouts, busy), the bitmask kernel against its reference,
and constrained generation end to end (every finished output validates)."""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time

import jsonschema
import pytest
import regex
import torch
from grammar_fakes import FakeBackend, compiles, fake, fake_cache

from grammars import GrammarError, GrammarSpec, create_backend
from grammars.base import bitmask_words
from grammars.cache import CompileCache
from grammars.outlines_backend import token_bytes
from grammars.schema_check import unenforced
from radixserve import Engine, SamplingParams
from radixserve_kernels.bitmask import apply_bitmask_ref, apply_bitmask_triton


@pytest.fixture(scope="module")
def tok(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama))


@pytest.fixture(scope="module", params=["xgrammar", "outlines"])
def backend(tok, request):
    return create_backend(request.param, tok, len(tok), [tok.eos_token_id])


def _allowed(matcher, vocab: int) -> set[int]:
    mask = torch.zeros(1, bitmask_words(vocab), dtype=torch.int32)
    matcher.fill_bitmask(mask, 0)
    bits = ((mask[0][:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return set(torch.nonzero(bits).flatten().tolist())


def _walk(backend, tok, spec: GrammarSpec, oracle, seed: int, steps: int = 12) -> None:
    """Follow random allowed tokens; at every step the mask must equal the oracle's set."""
    vocab, eos = len(tok), tok.eos_token_id
    texts = {t: tok.decode([t]) for t in range(vocab)}
    special = set(tok.all_special_ids)
    m, text, rng = backend.compile(spec).matcher(), "", random.Random(seed)
    for _ in range(steps):
        got = _allowed(m, vocab)
        want = {t for t in range(vocab) if t not in special and texts[t] and oracle(text + texts[t], partial=True)}
        complete = oracle(text, partial=False)
        if complete:
            want.add(eos)
        if complete and backend.name == "outlines":
            # outlines-core 0.2.14: at an accepting state its index keeps only tokens that lead to
            # accepting states (after "a" in a(yz)?, "y" is missing): stricter, never invalid
            assert got <= want, (text, sorted(got - want)[:10])
        else:
            assert got == want, (text, sorted(got ^ want)[:10])
        choices = sorted(got - {eos})
        if not choices:
            assert m.accept(eos) and m.is_terminated()
            return
        t = rng.choice(choices)
        assert m.accept(t)
        text += texts[t]


@pytest.mark.parametrize("seed", range(3))
def test_regex_masks_match_a_brute_force_prefix_check(backend, tok, seed):
    pattern = r"(ab|ba)[0-9]{1,3}(x|yz)?"
    _walk(backend, tok, GrammarSpec("regex", pattern), lambda s, partial: bool(regex.fullmatch(pattern, s, partial=partial)), seed)


def test_choice_masks_match_a_brute_force_prefix_check(backend, tok):
    options = ["Paris", "Parma", "Berlin"]

    def oracle(s: str, partial: bool) -> bool:
        return any(o.startswith(s) for o in options) if partial else s in options

    for seed in range(3):
        _walk(backend, tok, GrammarSpec.choice(options), oracle, seed)


def test_rollback_restores_the_earlier_mask(backend, tok):
    m = backend.compile(GrammarSpec.choice(["yes", "no", "maybe"])).matcher()
    first = _allowed(m, len(tok))
    t = sorted(first)[0]
    assert m.accept(t) and _allowed(m, len(tok)) != first
    m.rollback(1)
    assert _allowed(m, len(tok)) == first
    assert not m.accept(tok.eos_token_id)  # incomplete output: the stop token is refused


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "boolean"}, {"type": "null"}, {"type": "number"}]},
                                      "opt": {"type": "string", "maxLength": 3}}, "required": ["v"], "additionalProperties": False},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                      "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}, "required": ["a"],
     "additionalProperties": False},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "array-enum", "anyOf", "ref"])
def test_random_walks_through_a_schema_end_in_valid_json(backend, tok, schema):
    spec = GrammarSpec.json_schema(schema)
    missing = unenforced(schema, backend.name)
    if missing:  # strict: a backend that would not enforce a keyword refuses the schema, naming it
        with pytest.raises(GrammarError, match=f"{missing[0][1]} at {missing[0][0]}"):
            backend.compile(spec)
        return
    vocab, eos = len(tok), tok.eos_token_id
    for seed in range(5):
        m, ids, rng = backend.compile(spec).matcher(), [], random.Random(seed)
        for _ in range(400):
            allowed = sorted(_allowed(m, vocab))
            t = eos if eos in allowed and rng.random() < 0.5 else rng.choice(allowed)
            assert m.accept(t), (tok.decode(ids), t)
            if m.is_terminated():
                break
            ids.append(t)
        if m.is_terminated():
            jsonschema.validate(json.loads(tok.decode(ids)), schema)


def test_strict_schemas_are_refused_naming_the_unenforced_keyword_and_pointer(tok):
    xgr = create_backend("xgrammar", tok, len(tok), [tok.eos_token_id])
    schema = {"type": "object", "properties": {"x": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}
    with pytest.raises(GrammarError, match="oneOf at /properties/x/oneOf"):
        xgr.compile(GrammarSpec.json_schema(schema))
    xgr.compile(GrammarSpec.json_schema(schema, strict=False))  # non-strict: enforced as far as possible
    assert ("/properties/x/pattern", "x") not in unenforced(schema, "xgrammar")
    assert unenforced({"$ref": "https://example.com/s.json"}, "xgrammar") == [("/$ref", "$ref (not local)")]
    assert unenforced({"type": "string", "format": "email", "maxLength": 9}, "xgrammar") == [("/maxLength", "maxLength")]
    assert unenforced({"type": "string", "x-vendor": 1, "readonly": True}, "xgrammar") == []  # not validation keywords
    assert unenforced({"oneOf": [{"type": "string"}, {"type": "null"}]}, "xgrammar") == []  # disjoint: anyOf enforces it
    props = {"a": {"type": "string"}, "b": {"type": "string"}}
    for combo in ({"anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, {"allOf": [{"required": ["a"]}]}):
        kw = next(iter(combo))
        assert unenforced({"type": "object", "properties": props, **combo}, "xgrammar")[0][0] == f"/{kw}"


def test_the_chain_falls_back_to_the_next_backend_and_reports_the_first_failure():
    from grammars.chain import Chain

    class Fails(FakeBackend):
        name = "xgrammar"

        def compile(self, spec):
            raise GrammarError(f"{spec.kind}: first backend cannot", spec.kind)

    class Works(FakeBackend):
        name = "outlines"
        calls = 0

        def compile(self, spec):
            self.calls += 1
            return super().compile(spec)

    works = Works()
    assert Chain([Fails(), works]).compile(GrammarSpec("regex", "a+")) is not None and works.calls == 1
    with pytest.raises(GrammarError, match="first backend cannot"):
        Chain([Fails(), Fails()]).compile(GrammarSpec("regex", "a+"))


def test_a_pattern_next_to_a_length_limit_is_refused_when_strict_as_no_backend_enforces_both(tok):
    """xgrammar drops the length limit, outlines-core the pattern (found by the sampler fuzz:
    "\uc7a6" came out for {"pattern": "^[a-z]*$", "maxLength": 1}); strict refuses, naming it."""
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$", "maxLength": 4}},
              "required": ["code"], "additionalProperties": False}
    auto = create_backend("auto", tok, len(tok), [tok.eos_token_id])
    with pytest.raises(GrammarError, match="maxLength at /properties/code/maxLength cannot be enforced"):
        auto.compile(GrammarSpec.json_schema(schema))
    assert unenforced(schema, "outlines") == [("/properties/code/pattern", "pattern")]
    assert auto.compile(GrammarSpec.json_schema(schema, strict=False)) is not None  # best effort when asked


def test_length_bounded_json_strings_never_take_raw_control_characters(backend, tok):
    """xgrammar 0.2.9 lets them into minLength/maxLength strings; the backend tightens that."""
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}}, "required": ["s"]})
    m = backend.compile(spec).matcher()
    for t in tok.encode('{"s": "a'):
        assert m.accept(t)
    bad = [t for t in range(len(tok)) if any(ord(ch) < 0x20 for ch in tok.decode([t])) and t not in tok.all_special_ids]
    assert bad and not _allowed(m, len(tok)) & set(bad)


def _byte_tokens(tok) -> dict[int, int]:
    """Each byte's own token in the byte-level BPE vocabulary."""
    return {raw[0]: ids[0] for raw, ids in token_bytes(tok, set()).items() if len(raw) == 1}


_BOUNDED = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}}, "required": ["s"]}
_UNBOUNDED = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
_TAG = {"structures": [{"begin": "<f>", "schema": {"type": "string"}, "end": "</f>"}], "triggers": ["<f"]}


@pytest.mark.parametrize("backend, spec, head", [
    *[(name, spec, head) for name in ("xgrammar", "outlines") for spec, head in (
        (GrammarSpec.json_schema(_BOUNDED), '{"s": "a'), (GrammarSpec.json_schema(_UNBOUNDED), '{"s": "a'),
        (GrammarSpec("regex", "a.{1,4}"), "a"))],
    ("xgrammar", GrammarSpec("ebnf", 'root ::= "a" [^"]+'), "a"),  # (outlines-core compiles neither of these)
    ("xgrammar", GrammarSpec("structural_tag", json.dumps(_TAG)), '<f>"a'),
], indirect=["backend"])
def test_no_grammar_lets_a_utf8_surrogate_into_the_text(backend, tok, spec, head):
    """ED A0..BF is U+D800-DFFF, which UTF-8 forbids: decoded, three U+FFFD. xgrammar 0.2.9 lets it
    into every class over code points; the backend leaves the surrogates out of each."""
    m, byte = backend.compile(spec).matcher(), _byte_tokens(tok)
    for t in tok.encode(head):
        assert m.accept(t)
    assert m.accept(byte[0xED])  # may still begin U+D000-U+D7FF
    allowed = _allowed(m, len(tok))
    assert byte[0x9F] in allowed and not {byte[b] for b in range(0xA0, 0xC0)} & allowed


def test_bad_grammars_fail_with_a_message_naming_the_kind(backend):
    with pytest.raises(GrammarError, match="regex: .*could not compile"):
        backend.compile(GrammarSpec("regex", "(?<=a)b"))
    with pytest.raises(GrammarError, match="json_schema: not valid JSON"):
        GrammarSpec.json_schema("{nope")
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(regex="a", ebnf='root ::= "a"').grammar_spec()


def test_compile_cache_entries_are_per_tenant_so_a_hit_tells_nothing_of_another_tenant(tmp_path):
    log = tmp_path / "compiles.log"
    with fake_cache(log, timeout_s=5, workers=1) as cache:
        spec = GrammarSpec("regex", "a+")
        assert cache.get(spec, "alice") is cache.get(spec, "alice") and compiles(log) == ["a+"]
        cache.get(spec, "bob")  # no faster for bob because alice compiled it: his own compile
        assert compiles(log) == ["a+", "a+"] and cache.hits == 1


def test_compile_cache_hits_and_caches_failures_and_timeouts_but_not_busy(tmp_path):
    log = tmp_path / "compiles.log"
    with fake_cache(log, timeout_s=0.5, workers=2, tenant_compiles=1) as cache:
        ok = GrammarSpec("regex", "a+")
        assert cache.get(ok) is cache.get(ok) and compiles(log) == ["a+"]
        for _ in range(2):
            with pytest.raises(GrammarError, match="bad on purpose"):
                cache.get(GrammarSpec("regex", "bad"))
        assert compiles(log).count("bad") == 1  # the failure was cached
        for _ in range(2):
            with pytest.raises(GrammarError, match="took longer than the grammar_compile_timeout of 0.5 s"):
                cache.get(GrammarSpec("regex", "spin"))
        assert compiles(log).count("spin") == 1  # so was the timeout: a resent bomb takes no worker
        # one tenant, one compile at a time: "late" waits behind two slow ones and cannot start in time
        first, second, late = (cache.submit(GrammarSpec("regex", s)) for s in ("spin1", "spin2", "late"))
        with pytest.raises(GrammarError, match="busy with slow grammars; its compile did not start within the "
                                               "grammar_compile_timeout of 0.5 s"):
            late.result(10)
        with pytest.raises(GrammarError, match="took longer"):
            first.result(10)
        # second starts when first is killed, at its own start deadline: either end is right (a loaded
        # machine tips it to busy)
        with pytest.raises(GrammarError, match="took longer|busy with slow grammars"):
            second.result(10)
        assert cache.get(GrammarSpec("regex", "late")).source == "late"  # busy is not cached


def test_a_compile_cache_hit_never_times_out_however_old(monkeypatch, tmp_path):
    """A hit compiled longer than timeout_s ago used to fail in get_async: its remaining time was
    0 s and wait_for saw the wrapped (not yet copied) future as pending."""
    log = tmp_path / "compiles.log"
    cache = CompileCache(functools.partial(fake, str(log)), timeout_s=5)
    try:
        spec, bad = GrammarSpec("regex", "a+"), GrammarSpec("regex", "bad")
        compiled = asyncio.run(cache.get_async(spec))
        with pytest.raises(GrammarError, match="bad on purpose"):
            asyncio.run(cache.get_async(bad))
        now = time.monotonic()
        monkeypatch.setattr(time, "monotonic", lambda: now + 60)  # a minute later
        assert asyncio.run(cache.get_async(spec)) is compiled and cache.get(spec) is compiled
        with pytest.raises(GrammarError, match="bad on purpose"):  # a cached failure stays that failure, not a timeout
            asyncio.run(cache.get_async(bad))
        assert len(compiles(log)) == 2
    finally:
        monkeypatch.undo()
        cache.shutdown()


@pytest.mark.parametrize("vocab", [31, 32, 257, 1000])
def test_bitmask_kernel_matches_its_reference(vocab, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import radixserve_kernels.bitmask as kb

    monkeypatch.setattr(kb, "_KERNEL", None)  # build it under the interpreter
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, bitmask_words(vocab) * 32 + 5, generator=g)  # padded embeddings past the mask
    mask = torch.randint(-(2**31), 2**31 - 1, (4, bitmask_words(vocab)), dtype=torch.int32, generator=g)
    rows = torch.tensor([5, 0, 3, 6])
    ref, got = logits.clone(), logits.clone()
    apply_bitmask_ref(ref, mask, rows)
    apply_bitmask_triton(got, mask, rows)
    assert torch.equal(ref, got)
    untouched = [1, 2, 4]
    assert torch.equal(got[untouched], logits[untouched])
    assert torch.isinf(got[rows][:, bitmask_words(vocab) * 32 :]).all()  # columns past the mask: never allowed
    monkeypatch.setattr(kb, "_KERNEL", None)


def test_constrained_generation_on_a_random_model_always_validates(tiny_llama):
    with Engine(str(tiny_llama), kv_cache_tokens=8192) as e:
        params = [SamplingParams(temperature=1.0, seed=i, max_new_tokens=300, json_schema=json.dumps(s))
                  for i, s in enumerate(SCHEMAS * 2)]
        outs = e.generate([[5, 6, 7, 8]] * len(params), params)
        finished = [(o, s) for o, s in zip(outs, SCHEMAS * 2) if o.finish_reason == "stop"]
        assert len(finished) >= len(outs) // 2
        for o, s in finished:
            jsonschema.validate(json.loads(o.text), s)
        regex_out = e.generate([[5, 6]], SamplingParams(temperature=1.0, seed=3, regex=r"[A-C]{2}-[0-9]{3}"))[0]
        assert regex.fullmatch(r"[A-C]{2}-[0-9]{3}", regex_out.text) and regex_out.finish_reason == "stop"


def test_output_pushed_toward_surrogate_bytes_still_decodes_and_validates(tiny_llama, tok):
    """A logit bias toward ED and A0-BF (U+D800-DFFF's UTF-8 form, which decoders refuse) once wrote
    three U+FFFD into a maxLength-10 string; the grammar now never lets the pair through."""
    byte = _byte_tokens(tok)
    bias = {byte[b]: 8.0 for b in [0xED, *range(0xA0, 0xC0)]}
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
              "additionalProperties": False}
    with Engine(str(tiny_llama), kv_cache_tokens=8192) as e:
        params = [SamplingParams(temperature=1.0, seed=i, max_new_tokens=60, json_schema=json.dumps(schema), logit_bias=bias)
                  for i in range(24)]
        outs = e.generate([[5, 6, 7, 8]] * len(params), params)
    finished = [o.text for o in outs if o.finish_reason == "stop"]
    assert finished and not any("\ufffd" in o.text for o in outs)
    for text in finished:
        jsonschema.validate(json.loads(text), schema)


def test_smollm2_answers_in_valid_json(smollm2_engine):
    text = {"type": "string", "maxLength": 30}
    schema = {"type": "object", "properties": {"city": text, "country": text}, "required": ["city", "country"],
              "additionalProperties": False}
    question = "What is the capital of France? Answer in JSON with city and country."
    ids = smollm2_engine.chat_ids([{"role": "user", "content": question}])
    out = smollm2_engine.generate([ids], SamplingParams(temperature=0, max_new_tokens=60, json_schema=json.dumps(schema)))[0]
    assert out.finish_reason == "stop"
    value = json.loads(out.text)
    jsonschema.validate(value, schema)
    assert value["city"] == "Paris"
    asks = ["Describe a person as JSON.", "Give a few tags as JSON.", "Give a JSON value.", "Give two points as JSON."]
    prompts = [smollm2_engine.chat_ids([{"role": "user", "content": a}]) for a in asks]
    outs = smollm2_engine.generate(prompts, [SamplingParams(temperature=0, max_new_tokens=120, json_schema=json.dumps(s))
                                             for s in SCHEMAS])
    assert sum(o.finish_reason == "stop" for o in outs) >= 3
    for o, s in zip(outs, SCHEMAS):  # nested objects, bounded arrays, enums, anyOf, $ref, optional fields
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), s)


def test_jump_forward_appends_forced_text_as_the_tokenizer_would_and_still_validates(smollm2_engine):
    """Constrained greedy decoding spells a key the model did not expect letter by letter
    ('f', 'ir', ...); jump-forward appends the canonical tokens of the forced text instead,
    in fewer steps. Both outputs validate; they need not be equal."""
    text = {"type": "string", "maxLength": 20}
    schema = {"type": "object", "properties": {"first_name": text, "last_name": text, "home_city": text},
              "required": ["first_name", "last_name", "home_city"], "additionalProperties": False}
    e = smollm2_engine
    ids = e.chat_ids([{"role": "user", "content": "Describe Ada Lovelace of London as JSON."}])
    params = SamplingParams(temperature=0, max_new_tokens=80, json_schema=json.dumps(schema))
    outs, jumped, steps = {}, {}, {}
    for jf in (False, True):
        e.post.jump_forward = jf
        before = e.stats()
        outs[jf] = e.generate([ids], params)[0]
        jumped[jf] = e.stats().jump_forward_tokens - before.jump_forward_tokens
        steps[jf] = e.stats().steps - before.steps
    e.post.jump_forward = True
    for out in outs.values():
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)
    assert jumped[False] == 0 and jumped[True] >= 6 and steps[True] < steps[False]
    for k in range(3, 12):  # forced tokens never take a request past its max_new_tokens
        cut = e.generate([ids], SamplingParams(temperature=0, max_new_tokens=k, json_schema=json.dumps(schema)))[0]
        assert cut.completion_tokens == k and cut.finish_reason == "length"
    canonical = e.tokenizer.encode("first_name", add_special_tokens=False)
    got = outs[True].token_ids
    assert any(got[i : i + len(canonical)] == canonical for i in range(len(got)))


def test_structural_tags_constrain_only_the_tagged_regions(tok):
    xgr = create_backend("xgrammar", tok, len(tok), [tok.eos_token_id])
    tag = {"structures": [{"begin": "<f>", "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                      "required": ["a"], "additionalProperties": False}, "end": "</f>"}],
           "triggers": ["<f>"]}
    spec = SamplingParams(structural_tag=json.dumps(tag)).grammar_spec()

    def accepts(text: str) -> bool:
        m = xgr.compile(spec).matcher()
        return all(m.accept(t) for t in tok.encode(text))

    assert accepts('free text, then <f>{"a": 12}</f> and more')
    assert not accepts('free text, then <f>{"b"')
    with pytest.raises(GrammarError, match="structural_tag"):
        GrammarSpec.structural_tag('{"structures": [{"begin": 1}]}')


def test_an_auto_tool_call_is_free_text_until_the_call_opens_then_a_valid_call(tok):
    """tool_choice auto's constraint (server.chat.tools.auto_tag): text, code and JSON that is no call
    pass; once a call opens in the model's format, only a call of an offered tool whose arguments
    follow its schema does: hermes tags (compact or on lines of their own, one or several, one
    only with parallel_tool_calls false), Qwen2.5-Coder's fenced call, Llama 3 JSON, Qwen3-Coder XML."""
    from radixserve.server.chat.tools import Tool, auto_tag

    weather = Tool("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                                       "additionalProperties": False})
    assert auto_tag([], "hermes") is None  # Mistral's token-triggered form: tests/test_mistral_tools.py
    xgr = create_backend("xgrammar", tok, len(tok), [tok.eos_token_id])

    def acceptor(fmt: str, one_call: bool = False):
        grammar = xgr.compile(SamplingParams(structural_tag=auto_tag([weather], fmt, one_call)).grammar_spec())

        def accepts(text: str) -> bool:
            m = grammar.matcher()
            return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False))
        return accepts

    accepts = acceptor("hermes")
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert accepts('It is sunny. {"a": 1} and def f(): pass\n```python\nx = 1\n```\n```json\n{"a": 1}\n```')
    assert accepts(f"Let me look.<tool_call>{call}</tool_call>") and accepts(f"<tool_call>\n{call}\n</tool_call>")
    assert accepts(f"<tool_call>{call}</tool_call> and <tool_call>\n{call}\n</tool_call>")
    fenced = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'
    assert accepts(f"Sure:\n{fenced}") and accepts(fenced.replace('{\n    "city": "Paris"\n  }', '{"city": "Paris"}'))
    for bad in ['<tool_call>{"name": "rm_rf", "arguments": {}}', '<tool_call>{"name": "get_weather", "arguments": {}}',
                '<tool_call>{"name": "get_weather", "arguments": {"city": 3}}', "<tool_call>I will call it",
                '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "x": 1}}',
                fenced.replace('"Paris"', "3"), fenced.replace('"city"', '"town"')]:
        assert not accepts(bad), bad
    assert accepts(fenced.replace("get_weather", "multiply"))  # no offered tool: free text, left as content
    assert not acceptor("hermes", one_call=True)(f"<tool_call>{call}</tool_call> and more")  # parallel_tool_calls false
    llama = acceptor("llama3_json")
    assert llama("No call here.") and llama('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert not llama('{"name": "get_weather", "parameters": {"town": "Paris"}}')
    coder = acceptor("qwen3_coder")
    xml = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    assert coder("Text, then " + xml) and not coder(xml.replace("city", "town"))


def test_grammar_after_leaves_the_reasoning_free_and_constrains_what_follows(tiny_llama):
    with Engine(str(tiny_llama), kv_cache_tokens=4096) as e:
        free = e.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))[0]
        k = next(k for k in range(1, 8) if "\ufffd" not in e.tokenizer.decode(free.token_ids[:k]))
        marker = e.tokenizer.decode(free.token_ids[:k])  # what the model "thinks" first, greedily
        out = e.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=40, regex=r"[0-9]{2}",
                                                     grammar_after=marker))[0]
        assert out.token_ids[:k] == free.token_ids[:k]  # unconstrained until the marker
        assert out.finish_reason == "stop" and regex.fullmatch(r"[0-9]{2}", out.text[len(marker):]), out.text
