"""Continuous batching: batch invariance, chunked prefill, retraction, abort, no leaked slots."""

from __future__ import annotations

import asyncio
import random

from helpers import assert_no_leak as _assert_no_leak

from radixserve import Engine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(rng.randint(3, 150))] for _ in range(n)]




def test_greedy_output_is_identical_alone_and_in_a_mixed_batch(tiny_engine):
    prompts = _prompts(16)
    solo = [tiny_engine.generate([p], GREEDY)[0].token_ids for p in prompts]
    before = tiny_engine.stats().steps
    batched = tiny_engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in batched] == solo
    s = tiny_engine.stats()
    # 16 prompts of up to 150 tokens with 64-token chunks took far fewer steps than solo runs would
    assert s.steps - before < 16 * 24
    _assert_no_leak(tiny_engine)


def test_chunked_prefill_splits_long_prompts_and_mixes_with_decodes(tiny_llama):
    with Engine(str(tiny_llama), kv_cache_tokens=4096, chunked_prefill_size=32) as engine:
        seen: list[tuple[int, int]] = []
        orig = engine.runner.run

        def spy(plan, *tables):
            decodes = sum(1 for it in plan.items if it.is_decode)
            seen.append((plan.num_tokens - decodes, decodes))
            return orig(plan, *tables)

        engine.runner.run = spy
        long = list(range(3, 203))
        short = [5, 6, 7]
        outs = engine.generate([short, long], GREEDY)
        assert all(o.completion_tokens == 24 for o in outs)
        assert max(p for p, _ in seen) <= 32, "no step prefilled more than the chunk budget"
        assert any(p > 0 and d > 0 for p, d in seen), "a prefill chunk ran in the same forward as a decode"
        assert engine.stats().prefill_tokens_computed == 203
        _assert_no_leak(engine)


def test_retraction_under_a_small_pool_keeps_solo_greedy_outputs(tiny_llama):
    prompts = _prompts(12, seed=1)
    with Engine(str(tiny_llama), kv_cache_tokens=4096) as big:
        solo = [big.generate([p], GREEDY)[0].token_ids for p in prompts]
    need = sum(len(p) for p in prompts) + 24 * len(prompts)
    with Engine(str(tiny_llama), kv_cache_tokens=need // 3, chunked_prefill_size=512) as small:
        outs = small.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == solo
        assert small.stats().retractions > 0
        _assert_no_leak(small)


def test_higher_priority_waiting_request_is_served_first(tiny_llama):
    with Engine(str(tiny_llama), kv_cache_tokens=4096, max_running_requests=1) as engine:
        order: list[str] = []

        async def one(prio: int, name: str, n: int = 4) -> None:
            params = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
            req = engine.make_req([5, 6, 7, 8], params, rid=name, priority=prio)
            async for d in engine.submit(req):
                if d.finished:
                    order.append(name)

        async def main() -> None:
            blocker = asyncio.create_task(one(0, "first", n=300))
            await asyncio.sleep(0)
            await asyncio.gather(blocker, one(0, "low"), one(5, "high"))

        asyncio.run(main())
        assert order.index("high") < order.index("low")


def test_abort_mid_decode_frees_the_requests_slots(tiny_engine):
    async def main() -> str:
        got = 0
        reason = ""
        req = tiny_engine.make_req(list(range(3, 60)), SamplingParams(temperature=0, max_new_tokens=400, ignore_eos=True))
        async for d in tiny_engine.submit(req):
            got += len(d.token_ids)
            if got == 3:
                assert tiny_engine.stats().kv_in_use_slots > 0
                tiny_engine.abort(req.rid)
            if d.finished:
                reason = d.output.finish_reason
        return reason

    assert asyncio.run(main()) == "abort"
    _assert_no_leak(tiny_engine)


def test_leaving_a_stream_early_aborts_and_frees(tiny_engine):
    async def main() -> None:
        stream = tiny_engine.submit(list(range(3, 40)), SamplingParams(temperature=0, max_new_tokens=400, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(main())
    _assert_no_leak(tiny_engine)


def test_a_failing_forward_step_errors_its_requests_and_the_engine_goes_on(tiny_engine):
    def boom(plan):
        raise RuntimeError("injected fault")

    tiny_engine.runner.fault_hook = boom
    out = tiny_engine.generate([[5, 6, 7]], GREEDY)[0]
    assert out.finish_reason == "error" and "injected fault" in out.error
    tiny_engine.runner.fault_hook = None
    assert tiny_engine.generate([[5, 6, 7]], GREEDY)[0].completion_tokens == 24
    _assert_no_leak(tiny_engine)
