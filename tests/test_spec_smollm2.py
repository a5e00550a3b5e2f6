"""Speculative decoding on SmolLM2, where copying means something: a rewrite that copies its
prompt and a JSON extraction that copies fields, greedy-identical to decoding without drafts."""

from __future__ import annotations

import json
import random

import pytest
from helpers import assert_no_leak

from radixserve import Engine, SamplingParams
from radixserve.bench.spec_texts import DOCUMENT, LIST_ASK, LIST_SCHEMA, product_list

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def spec_engine(smollm2_dir):
    with Engine(str(smollm2_dir), kv_cache_tokens=8192, speculative="ngram") as e:
        yield e


def test_a_rewrite_and_a_json_extraction_are_identical_with_drafts_from_the_prompt(smollm2_engine, spec_engine):
    rewrite = "Rewrite the following text, fixing any typos. Output only the text.\n\n" + DOCUMENT.split("\n\n")[0]
    products = product_list(random.Random(0), 3)
    extract = LIST_ASK + products
    prompts = [smollm2_engine.chat_ids([{"role": "user", "content": c}]) for c in (rewrite, extract)]
    params = [SamplingParams(max_new_tokens=120, temperature=0),
              SamplingParams(max_new_tokens=300, temperature=0, json_schema=json.dumps({**LIST_SCHEMA, "properties": {
                  "items": {**LIST_SCHEMA["properties"]["items"], "maxItems": 3}}}))]
    base = [smollm2_engine.generate([p], sp)[0] for p, sp in zip(prompts, params)]  # one at a time, as below
    before = spec_engine.stats()
    spec = [spec_engine.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    after = spec_engine.stats()
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    assert json.loads(spec[1].text)["items"][0]["sku"] in products  # copied from the list
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    assert accepted >= 0.5 * drafted and accepted >= 60, (accepted, drafted)  # the model copies: most drafts hold
    assert after.steps - before.steps < 0.6 * sum(o.completion_tokens for o in spec)  # fewer forward passes than tokens
    assert_no_leak(spec_engine)
