"""Grammar compiles in killable worker processes: deadlines and memory caps that free the
CPU and memory at once, per-tenant fairness, crashes confined to their job, no process left
behind, and grammars compiled in a worker enforcing exactly what an in-process compile does."""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import torch
from grammar_fakes import compiles, fake, fake_cache
from server_helpers import scaled

from grammars import GrammarError, GrammarSpec, create_backend
from grammars.base import bitmask_words
from grammars.cache import CompileCache
from grammars.fair import TenantQueues, Waiting

REGEX_BOMB = "(?i)[ab]*a[ab]{18}x"  # xgrammar refuses (?i); outlines-core expands it into a 2^19-state automaton
# xgrammar refuses it (minItems without items); outlines-core's regex for it grows without end (~200 MiB/s)
MEMORY_BOMB = {"type": "array", "minItems": 50, "items": {"type": "array", "minItems": 50, "items": {"type": "array",
                                                                                                    "minItems": 50}}}


@pytest.fixture(scope="module")
def tok(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama))


def _factory(tok, name: str = "auto"):
    return functools.partial(create_backend, name, tok, len(tok), [tok.eos_token_id])


@pytest.fixture(scope="module")
def real(tok):
    """One real-backend cache (xgrammar, then outlines-core) for the module: one warm-up."""
    cache = CompileCache(_factory(tok), timeout_s=2.0, workers=2, tenant_compiles=1, memory_mb=400)
    cache.get(GrammarSpec("regex", "warm"))
    yield cache
    cache.shutdown()


def _gone(pids: list[int]) -> bool:
    """Every process exited (a zombie not yet reaped holds no CPU or memory either)."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def _wait_busy(cache: CompileCache, n: int) -> list[int]:
    """The pids of the workers compiling, once n of them are."""
    deadline = time.monotonic() + scaled(20)
    while len(cache.worker_pids(busy=True)) < n and time.monotonic() < deadline:
        time.sleep(0.005)
    busy = cache.worker_pids(busy=True)
    assert len(busy) == n, busy
    return busy


def _masks(compiled, tok, seed: int, steps: int = 10) -> list[list[int]]:
    """The allowed-token masks along a random walk (seeded: the same walk for equal grammars)."""
    m, rng, out = compiled.matcher(), random.Random(seed), []
    for _ in range(steps):
        mask = torch.zeros(1, bitmask_words(len(tok)), dtype=torch.int32)
        m.fill_bitmask(mask, 0)
        out.append(mask[0].tolist())
        bits = ((mask[0][:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[: len(tok)]
        allowed = [t for t in torch.nonzero(bits).flatten().tolist() if t != tok.eos_token_id]
        if not allowed:
            break
        assert m.accept(rng.choice(allowed))
    return out


SPECS = [GrammarSpec("regex", r"(ab|ba)[0-9]{1,3}(x|yz)?"), GrammarSpec.choice(["Paris", "Parma", "Berlin"]),
         GrammarSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string",
                                  "maxLength": 5}}, "required": ["n", "s"], "additionalProperties": False})]


@pytest.mark.parametrize("name", ["xgrammar", "outlines"])
def test_a_grammar_compiled_in_a_worker_masks_exactly_like_an_in_process_compile(tok, name):
    local = create_backend(name, tok, len(tok), [tok.eos_token_id])
    cache = CompileCache(_factory(tok, name), timeout_s=10.0, workers=1)
    try:
        for spec in SPECS:
            remote = cache.get(spec)
            assert remote.backend == name
            for seed in range(3):
                assert _masks(remote, tok, seed) == _masks(local.compile(spec), tok, seed), (spec, seed)
    finally:
        cache.shutdown()


def test_the_chain_reports_which_backend_compiled_a_grammar(real):
    assert real.get(GrammarSpec("regex", "[0-9]{3}")).backend == "xgrammar"
    assert real.get(GrammarSpec("regex", "(?i)ab")).backend == "outlines"  # xgrammar refuses (?i)


def test_slow_regexes_time_out_kill_their_workers_and_do_not_block_another_tenant(real):
    bombs = [GrammarSpec("regex", REGEX_BOMB), GrammarSpec("regex", REGEX_BOMB.replace("x", "y"))]
    with ThreadPoolExecutor(2) as pool:  # two tenants: one bomb per worker
        futures = [pool.submit(real.get, spec, f"attacker-{i}") for i, spec in enumerate(bombs)]
        busy = _wait_busy(real, 2)
        for f in futures:
            with pytest.raises(GrammarError, match="took longer than the grammar_compile_timeout of 2 s"):
                f.result()
    assert _gone(busy)  # killed and reaped: their CPU is free
    assert real.get(GrammarSpec("regex", "[0-9]{3}"), "victim") is not None  # not "busy"
    hits, misses = real.hits, real.misses
    with pytest.raises(GrammarError, match="took longer"):  # the timeout is cached: resending costs no worker
        real.get(bombs[0], "attacker-0")
    assert (real.hits, real.misses) == (hits + 1, misses) and not real.worker_pids(busy=True)


def test_a_memory_bomb_schema_is_killed_at_the_memory_cap_and_the_server_does_not_grow(tok):
    # its own cache with a long timeout: on a loaded machine the bomb may take more than the
    # module's 2 s to reach 400 MiB, and then the timeout (tested above) would fire first
    cache = CompileCache(_factory(tok), timeout_s=60.0, workers=1, memory_mb=400)
    try:
        me = psutil.Process()
        before = me.memory_info().rss
        spec = GrammarSpec.json_schema(MEMORY_BOMB)
        holder: list[int] = []

        def watch() -> None:
            while not holder:
                holder.extend(cache.worker_pids(busy=True))
                time.sleep(0.005)

        threading.Thread(target=watch, daemon=True).start()
        with pytest.raises(GrammarError, match="used more than the grammar_compile_memory_mb of 400 MiB"):
            cache.get(spec, "attacker")
        assert holder and _gone(holder[:1])
        assert me.memory_info().rss - before < 50 << 20
    finally:
        cache.shutdown()


def test_a_compiled_grammar_larger_than_the_memory_cap_never_reaches_the_server():
    cache = CompileCache(fake, timeout_s=10.0, workers=1, memory_mb=32)
    try:
        assert cache.get(GrammarSpec("regex", "big:8")).source == "big:8"
        before = psutil.Process().memory_info().rss
        with pytest.raises(GrammarError, match="used more than the grammar_compile_memory_mb of 32 MiB"):
            cache.get(GrammarSpec("regex", "big:40"))
        assert psutil.Process().memory_info().rss - before < 20 << 20
    finally:
        cache.shutdown()


def test_one_tenant_flooding_slow_compiles_does_not_delay_another(tmp_path):
    log = tmp_path / "compiles.log"
    with fake_cache(log, timeout_s=20.0, workers=2, tenant_compiles=1) as cache:
        cache.get(GrammarSpec("regex", "warm"))
        flood = [cache.submit(GrammarSpec("regex", f"sleep:30:{i}"), "a") for i in range(4)]
        _wait_busy(cache, 1)
        time.sleep(0.5)  # time enough for a second worker to take a's next compile, were a not limited to one
        victim = cache.get(GrammarSpec("regex", "quick"), "b")  # the other worker is b's, not a's
        assert victim.source == "quick"
        started = [s for s in compiles(log) if s.startswith("sleep")]
        assert len(started) == 1 and not any(f.done() for f in flood)  # a runs one at a time


def test_tenant_queues_give_a_free_worker_to_the_tenant_running_fewest():
    q, jobs = TenantQueues(limit=2), {}
    for name, tenant, at in [("a1", "a", 0), ("a2", "a", 1), ("a3", "a", 2), ("b1", "b", 3), ("c1", "c", 4)]:
        jobs[name] = Waiting(at)
        q.push(jobs[name], tenant)
    names = {id(w): n for n, w in jobs.items()}
    order = [names[id(q.pop()[0])] for _ in range(4)]
    assert order == ["a1", "b1", "c1", "a2"] and q.pop() is None  # a is at its limit of 2
    q.finished("a")
    assert q.pop()[0] is jobs["a3"] and q.pop() is None


@pytest.mark.parametrize("how", ["exit", "kill", "raise"])
def test_a_worker_that_crashes_fails_only_its_job_and_is_replaced(tmp_path, how):
    log = tmp_path / "compiles.log"
    with fake_cache(log, timeout_s=10.0, workers=2, tenant_compiles=2) as cache:
        slow = cache.submit(GrammarSpec("regex", "sleep:0.5"))
        cache.get(GrammarSpec("regex", "warm"))
        message = "MemoryError.*injected compile fault" if how == "raise" else "compiler process crashed while compiling"
        with pytest.raises(GrammarError, match=message):
            cache.get(GrammarSpec("regex", how))
        assert slow.result(10).source == "sleep:0.5"  # the job running beside it finished
        assert cache.get(GrammarSpec("regex", "after")).source == "after"
        with pytest.raises(GrammarError, match=message):
            cache.get(GrammarSpec("regex", how))
        assert compiles(log).count(how) == (1 if how == "raise" else 2)  # an exception is cached; a crash is not


def test_shutdown_kills_running_compiles_and_leaves_no_process(tmp_path):
    cache = CompileCache(fake, timeout_s=30.0, workers=2, tenant_compiles=2)
    running = [cache.submit(GrammarSpec("regex", f"spin{i}")) for i in range(2)]
    pids = _wait_busy(cache, 2)
    cache.shutdown()
    for f in running:
        with pytest.raises(GrammarError, match="shut down"):
            f.result(5)
    assert pids and _gone(pids)


def test_a_cold_cache_starts_no_worker_until_warmed_or_asked():
    """warm=False (an engine's): no compile worker starts with the pool, whose start's seconds of
    CPU would slow a server's first requests; warm() (the engine loop's idle hook) starts one."""
    cache = CompileCache(fake, timeout_s=10.0, workers=2, warm=False)
    try:
        time.sleep(0.5)
        assert cache.worker_pids() == [] and not cache._pool._launching  # none started, none starting
        cache.warm()
        deadline = time.monotonic() + 60
        while not cache.worker_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(cache.worker_pids()) == 1
    finally:
        cache.shutdown()


def test_workers_die_with_their_parent_process(tmp_path):
    """A server killed with SIGKILL leaves no compile worker (nor forkserver) running."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import functools, sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from grammar_fakes import fake\n"
        "from grammars import GrammarSpec\n"
        "from grammars.cache import CompileCache\n"
        "if __name__ == '__main__':\n"
        "    c = CompileCache(fake, timeout_s=60, workers=2, tenant_compiles=2)\n"
        "    c.submit(GrammarSpec('regex', 'spin'))\n"
        "    c.get(GrammarSpec('regex', 'x'))\n"
        "    print(' '.join(map(str, c.worker_pids())), flush=True)\n"
        "    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        family = {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        assert len(pids) == 2 and set(pids) <= family
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + scaled(10)
    while not _gone(list(family)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(list(family)), [psutil.Process(p).cmdline() for p in family if psutil.pid_exists(p)]


def test_a_factory_that_fails_in_the_worker_fails_compiles_with_its_reason():
    cache = CompileCache(functools.partial(json.loads, "{"), timeout_s=5.0, workers=1)
    try:
        with pytest.raises(GrammarError, match="could not start: JSONDecodeError"):
            cache.get(GrammarSpec("regex", "a"))
    finally:
        cache.shutdown()
