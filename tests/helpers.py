"""Test helpers: run our model on one sequence outside the engine, HF references."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from server_helpers import scaled

from radixserve.attention import create_backend
from radixserve.batch import ForwardBatch
from radixserve.cache.pool import KVPool
from radixserve.models.loader import load_model
from radixserve.request import Req, SamplingParams
from radixserve.sched.scheduler import PlanItem, SchedulePlan


@torch.inference_mode()
def our_prompt_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """Logits (len(ids), vocab) of our model for one prompt, prefilled in one chunk."""
    return forward_prompt(load_model(str(path), torch.float32, torch.device("cpu")).model, ids)


@torch.inference_mode()
def forward_prompt(model: Any, ids: list[int]) -> torch.Tensor:
    """Logits (len(ids), vocab) of a loaded fp32 model for one prompt, prefilled in one chunk."""
    a = model.cfg
    pool = KVPool(a.num_layers, len(ids), a.num_kv_heads, a.head_dim, torch.float32, torch.device("cpu"))
    backend = create_backend("torch", pool, torch.device("cpu"))
    req = Req(ids, SamplingParams())
    plan = SchedulePlan([PlanItem(req, 0, len(ids))])
    batch = ForwardBatch.from_plan(plan, lambda r: list(range(len(ids))), backend, torch.device("cpu"))
    return model.compute_logits(model(batch))


@torch.inference_mode()
def fused_and_layered_logits(model: Any, lens: list[int], adapters: list[Any] | None = None) -> tuple[list[torch.Tensor], int]:
    """The logits of one decode step of len(lens) rows (each with that many tokens of random KV
    already stored) through the model's fused one-call step and layer by layer, from the same
    pool; and how many times the fused step ran (1: it took the step). adapters: each row's
    LoRA adapter (models.lora.Adapter or None)."""
    from radixserve.batch import LoRARows, SeqView

    arch = model.cfg
    pool = KVPool(arch.num_layers, 128, arch.num_kv_heads, arch.head_dim, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape, generator=g))
    start = [t.clone() for t in pool.k + pool.v]
    backend = create_backend("torch", pool, torch.device("cpu"))
    fused, calls, logits = model.model.fused, [], []
    run = fused.run
    fused.run = lambda *a: calls.append(1) or run(*a)
    try:
        for on in (True, False):
            model.model.fused = fused if on else None
            for t, s in zip(pool.k + pool.v, start):
                t.copy_(s)
            seqs = [SeqView(i, 1, n, list(range(32 * i, 32 * i + n + 1))) for i, n in enumerate(lens)]
            batch = ForwardBatch(torch.tensor([11 + i for i in range(len(lens))]), torch.tensor(lens),
                                 torch.tensor([s.slots[-1] for s in seqs]), seqs, backend)
            if adapters is not None:
                batch.lora = LoRARows.of([(a, i, 1) for i, a in enumerate(adapters)], torch.device("cpu"))
            backend.prepare(batch)
            with torch.inference_mode():
                logits.append(model.compute_logits(model(batch)))
    finally:
        model.model.fused, fused.run = fused, run
    return logits, len(calls)


def hf_logits_and_greedy(path: Path, ids: list[int], new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    x = torch.tensor([ids])
    logits = model(x).logits[0].float()
    out = model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, pad_token_id=0,
    )
    return logits, out[0, len(ids):].tolist()


def assert_no_leak(engine: Any) -> None:
    """Once idle: no request holds KV, every slot is free or cached, and the page ownership
    and radix-tree invariants hold."""
    deadline = time.monotonic() + scaled(10)
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.running == 0 and s.waiting == 0:
            break
        time.sleep(0.01)
    s = engine.stats()
    assert s.kv_in_use_slots == 0, s
    assert s.kv_free_slots + s.kv_cached_tokens == s.kv_total_slots, s
    engine.check_integrity()


class Sink:
    """What an SSE writer writes, kept (a stand-in for the aiohttp response)."""

    def __init__(self) -> None:
        self.data = b""

    async def write(self, b: bytes) -> None:
        self.data += b

    async def write_eof(self) -> None:
        pass


@contextlib.asynccontextmanager
async def scripted_server(posts: dict[str, Any]) -> AsyncIterator[str]:
    """An aiohttp server on a free local port answering POSTs with the given handlers
    (path -> handler), for as long as the block runs; yields its base URL."""
    from aiohttp import web

    app = web.Application()
    for path, handler in posts.items():
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
