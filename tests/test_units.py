"""Pure-Python pieces: allocator, scheduler (with a fake model), detokenizer, cheap imports, layering."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.cache.allocator import SlotAllocator
from radixserve.cache.prefix import NullPrefixCache
from radixserve.config import SchedConfig
from radixserve.engine.detokenizer import IncrementalDetokenizer
from radixserve.request import FinishReason, Req, SamplingParams
from radixserve.sched.cache_manager import CacheManager
from radixserve.sched.scheduler import Scheduler


def test_allocator_hands_out_each_slot_once_and_catches_double_free():
    a = SlotAllocator(8)
    x, y = a.alloc(5), a.alloc(3)
    assert x is not None and y is not None and len(set(x + y)) == 8
    assert a.alloc(1) is None and a.num_free == 0
    a.free(x)
    with pytest.raises(RuntimeError, match="twice"):
        a.free(x[:1])
    assert a.num_free == 5


def _sched(pool: int, **kw) -> Scheduler:
    cfg = SchedConfig(**{"chunked_prefill_size": 8, **kw})
    return Scheduler(cfg, CacheManager(SlotAllocator(pool), NullPrefixCache()))


def _fake_model(s: Scheduler, plan) -> None:
    """What the engine does after a step of a fake model that always samples token 9 (EOS is 0)."""
    s.process(plan)
    for it in plan.items:
        if it.samples and it.req.finish_reason is None:
            it.req.append_token(9, {0}, 1000)


def _drive(s: Scheduler, steps: int = 1000) -> int:
    """Run the scheduler with a fake model that always emits token 9."""
    n = 0
    while s.has_work and n < steps:
        plan = s.schedule()
        _fake_model(s, plan)
        s.reap()
        n += 1
    return n


def test_scheduler_chunks_admits_and_finishes_without_leaking():
    s = _sched(pool=200)
    reqs = [Req(list(range(1, 20)), SamplingParams(), max_new_tokens=5) for _ in range(4)]
    for r in reqs:
        s.add(r)
    first = s.schedule()
    assert first.num_tokens == 8 and len(first.items) == 1  # the budget chunks the first prompt
    _fake_model(s, first)
    _drive(s)
    assert all(r.finish_reason is FinishReason.LENGTH and r.output_ids == [9] * 5 for r in reqs)
    assert s.cache.allocator.num_free == 200 and s.counters.prefill_tokens_computed == 4 * 19


def test_scheduler_retracts_lowest_priority_newest_first_and_still_finishes():
    s = _sched(pool=60, chunked_prefill_size=100, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    low = Req(list(range(1, 11)), SamplingParams(), priority=0, max_new_tokens=30)
    high = Req(list(range(1, 11)), SamplingParams(), priority=1, max_new_tokens=30)
    s.add(low)
    s.add(high)
    _drive(s, steps=5)
    assert s.counters.retractions == 0
    _drive(s)
    assert s.counters.retractions > 0 and low.retractions > 0 and high.retractions == 0
    assert low.output_len == high.output_len == 30
    assert s.cache.allocator.num_free == 60


def test_a_lower_priority_prompt_under_way_lets_a_higher_priority_arrival_go_first():
    """A long low-priority prompt (a history precompute runs at the lowest) is mid-prefill when a
    request arrives: the arrival takes the step's budget first, the prompt's chunk what is left."""
    s = _sched(pool=400)
    low = Req(list(range(1, 60)), SamplingParams(), priority=-(2**31), max_new_tokens=0)
    s.add(low)
    _fake_model(s, s.schedule())
    assert 0 < low.computed_len < 59
    high = Req(list(range(100, 110)), SamplingParams(), max_new_tokens=2)
    s.add(high)
    plan = s.schedule()
    assert [it.req for it in plan.items][0] is high and plan.items[0].length == 8  # all of the budget: 8
    _fake_model(s, plan)
    _drive(s)
    assert high.output_len == 2 and low.finish_reason is FinishReason.LENGTH and s.cache.allocator.num_free == 400


def test_abort_of_a_waiting_request_finishes_it():
    s = _sched(pool=50)
    r = Req([1, 2, 3], SamplingParams())
    s.add(r)
    assert s.abort(r.rid) is r
    assert s.reap() == [r] and r.finish_reason is FinishReason.ABORT


class _CharTok:
    """Each token id is one byte; multi-byte UTF-8 characters span tokens."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_waits_for_whole_characters_and_holds_back_stop_prefixes():
    d = IncrementalDetokenizer(_CharTok(), [], stops=["END"])
    out = ""
    for b in "héllo E".encode():
        d.add(b)
        out += d.take_delta(finished=False)
    assert out == "héllo "  # the "E" might start "END"
    for b in b"ND tail":
        d.add(b)
    assert d.stopped_on == "END" and d.text == "héllo "
    assert out + d.take_delta(finished=True) == "héllo "


def test_stop_regex_stops_at_the_first_match_and_keeps_it():
    from radixserve.stop_regex import validate

    d = IncrementalDetokenizer(_CharTok(), [], stops=[], regexes=validate([r"[0-9]+ apples", r"zz"]))
    for b in b"I have 12 apples and more":
        d.add(b)
    assert d.stopped_on == "[0-9]+ apples" and d.text == "I have 12 apples"  # the match is kept, as SGLang does
    both = IncrementalDetokenizer(_CharTok(), [], stops=["STOP"], regexes=validate(r"a\.b"))
    for b in b"x a.b y STOP":
        both.add(b)
    assert both.stopped_on == r"a\.b" and both.text == "x a.b"  # the earlier of a regex and a string wins


def test_a_stop_regex_that_backtracks_too_long_fails_its_request_not_the_engine():
    from radixserve.stop_regex import StopRegexTimeout, validate

    d = IncrementalDetokenizer(_CharTok(), [], stops=[], regexes=validate(r"(a|aa)+b"))  # passes the upfront checks
    with pytest.raises(StopRegexTimeout, match=r"'\(a\|aa\)\+b'.*backtrack"):
        for _ in range(200):
            d.add(ord("a"))


def test_stop_regex_searches_over_their_cpu_budget_fail_their_request(monkeypatch):
    import itertools

    from radixserve import stop_regex

    clock = itertools.count()
    monkeypatch.setattr(stop_regex.time, "thread_time", lambda: next(clock) * 0.001)  # each search: 1 ms of CPU
    d = IncrementalDetokenizer(_CharTok(), [], stops=[], regexes=stop_regex.validate(r"\d+ apples"))
    for b in b"x" * 8:  # 8 ms: the budget of the first 16 tokens (0.5 ms each), spent early
        d.add(b)
    with pytest.raises(stop_regex.StopRegexTimeout, match=r"9.0 ms of CPU over 9 tokens, more than 0.5 ms a token"):
        d.add(ord("x"))


@pytest.mark.parametrize(("pattern", "why"), [
    ("(a+)+", "exponential"), (r"(\w*\s?)*x", "exponential"), ("x*", "empty string"), ("(", "not a valid"),
    ("a" * 300, "longer than"), (["a"] * 33, "more than the limit"), (5, "string or a list"),
    ("(?:a{1000}){1000}", "1000000 copies"), ("a{1100}", "longer than the 1024 characters"),
    (r"(x)?(?(1)y|(?:a+)+)b", "exponential"), ("(?>a+)+b", "exponential"),
])
def test_stop_regex_refuses_what_could_stall_the_engine(pattern, why):
    from radixserve.request import InvalidParam, SamplingParams

    with pytest.raises(InvalidParam, match=why) as e:
        SamplingParams(stop_regex=pattern).validate(1000)
    assert e.value.field == "stop_regex"


def test_import_radixserve_is_light():
    code = "import sys, radixserve; print(sorted(m for m in ('torch','transformers','triton','xgrammar') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_layer_contracts_hold():
    exe = Path(sys.executable).with_name("lint-imports")  # beside the interpreter running the tests
    assert exe.exists(), "import-linter is part of the test extras"
    r = subprocess.run([str(exe)], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow  # a minute of CPU on a clean clone
def test_mypy_finds_no_type_error_in_radixserve(mypy_check):
    """`make lint`'s type check, in the suite CI runs (pyproject.toml [tool.mypy]); started at
    collection (conftest.py), so it runs beside the other tests."""
    code, out = mypy_check
    assert code == 0, out[-5000:]


def test_auto_dtype_is_bf16_where_the_cpu_has_bf16_matmuls_and_fp32_for_quantized_weights(monkeypatch):
    import torch

    from radixserve.engine import engine as eng

    cpu = torch.device("cpu")
    monkeypatch.setattr(eng, "cpu_has_bf16", lambda: True)
    assert eng._dtype("auto", cpu, False) is torch.bfloat16
    assert eng._dtype("auto", cpu, True) is torch.float32  # quantized weights: fp32 activations on a CPU
    assert eng._dtype("auto", torch.device("cuda"), True) is torch.bfloat16
    assert eng._dtype("bfloat16", cpu, True) is torch.bfloat16  # an explicit dtype wins
    monkeypatch.setattr(eng, "cpu_has_bf16", lambda: False)
    assert eng._dtype("auto", cpu, False) is torch.float32
    assert eng._dtype("auto", torch.device("cuda"), False) is torch.bfloat16
    assert eng._dtype("float32", cpu, False) is torch.float32


def test_a_tokenizer_loads_as_autotokenizer_would_and_the_token_table_is_decode(tiny_models, tmp_path, monkeypatch):
    """load_tokenizer remembers the class AutoTokenizer chose for a folder and loads it directly
    the next time: the same class, ids, special tokens, chat template and decoding; the server's
    token table (one batch decode) equals decoding each token alone."""
    import asyncio
    import types
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoTokenizer

    from radixserve.models.files import load_tokenizer, tokenizer_dir
    from radixserve.server.state import ServerState

    folders = [tokenizer_dir(None)] + [p for p in tiny_models.values() if (p / "tokenizer.json").exists()]
    texts = ["Hello, world! 123 4567 ünïcödé 日本語  spaces\n\nnew", "<|im_start|>user\nx<|im_end|>", " lead", "def f(x):\n\treturn x"]
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "Name a prime."}]
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    for folder in folders:
        first, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
        ours = load_tokenizer(folder)  # the remembered class, without AutoTokenizer
        assert type(first) is type(ours) is type(auto), folder
        assert [ours(t).input_ids for t in texts] == [auto(t).input_ids for t in texts], folder
        assert ours.all_special_tokens == auto.all_special_tokens and len(ours) == len(auto)
        assert (ours.bos_token_id, ours.eos_token_id) == (auto.bos_token_id, auto.eos_token_id)
        if auto.chat_template:
            assert ours.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(chat, tokenize=False)
        ids = auto(texts[0]).input_ids
        assert ours.decode(ids) == auto.decode(ids)
        n = min(len(auto), 4096)
        state = types.SimpleNamespace(engine=types.SimpleNamespace(tokenizer=ours, vocab_size=n), token_texts=None)
        with ThreadPoolExecutor(1) as pool:
            state.off_loop = lambda fn: asyncio.get_running_loop().run_in_executor(pool, fn)
            asyncio.run(ServerState.build_token_table(state))
        assert state.token_texts == [auto.decode([i]) for i in range(n)]
    import json

    assert len(json.loads((tmp_path / "tokenizer_classes.json").read_text())) == len(folders)


def test_the_engines_fast_tokenizer_encodes_and_decodes_as_the_transformers_one(tiny_models, tmp_path, monkeypatch):
    """load_tokenizer(fast=True) saves the transformers tokenizer's backend once; later loads
    read it without transformers and encode, decode (every token alone, special tokens kept or
    skipped), count and name special ids exactly as transformers does; everything else (a chat
    template) goes to the transformers tokenizer behind it; a damaged saved file is a miss."""
    import pickle

    from radixserve.engine.engine import harmony_stops
    from radixserve.models import fast_tokenizer as ft
    from radixserve.models.files import load_tokenizer, tokenizer_dir

    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    folders = [tokenizer_dir(None)] + [p for p in tiny_models.values() if (p / "tokenizer.json").exists()]
    texts = ["Hello, world! 123 ünïcödé 日本語  spaces\n\nnew", "<|im_start|>user\nx<|im_end|>", " lead", "a . b , c 's n't",
             "def f(x):\n\treturn x", ""]
    chat = [{"role": "user", "content": "Name a prime."}]
    for folder in folders:
        load_tokenizer(folder, fast=True)  # the first load saves the backend
        saved = list((tmp_path / "fast_tokenizers").glob("*.json"))
        fast, full = load_tokenizer(folder, fast=True), load_tokenizer(folder)
        assert isinstance(fast, ft.FastTokenizer) and fast._full is None, folder  # transformers not loaded
        assert harmony_stops(fast) == set() and fast._full is None  # what the engine asks at its start: no transformers
        for text in texts:
            for special in (True, False):
                assert fast.encode(text, add_special_tokens=special) == full.encode(text, add_special_tokens=special)
            ids = full.encode(text)
            for skip in (True, False):
                assert fast.decode(ids, skip_special_tokens=skip) == full.decode(ids, skip_special_tokens=skip)
                assert fast.decode(ids, skip, False) == full.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        n = len(full)
        assert len(fast) == n and fast.get_vocab() == full.get_vocab()
        assert [fast.decode(i) for i in range(n)] == [full.decode(i) for i in range(n)]
        assert (fast.eos_token_id, fast.bos_token_id, fast.pad_token_id) == (full.eos_token_id, full.bos_token_id, full.pad_token_id)
        token = full.convert_ids_to_tokens(n - 1)
        assert fast.convert_tokens_to_ids(token) == n - 1 and fast.convert_tokens_to_ids([token]) == [n - 1]
        if full.chat_template:
            assert fast.apply_chat_template(chat, tokenize=False) == full.apply_chat_template(chat, tokenize=False)
        assert type(pickle.loads(pickle.dumps(fast))) is type(full)  # a grammar worker gets the transformers one
        for path in saved:
            path.write_text(path.read_text()[:100])  # torn
        again = load_tokenizer(folder, fast=True)  # a miss: loaded through transformers and saved again
        assert isinstance(again, ft.FastTokenizer) and again.encode(texts[0]) == full.encode(texts[0])
        assert all(len(p.read_text()) > 100 for p in saved)
        for path in saved:
            path.unlink()
