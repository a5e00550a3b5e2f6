"""Only the model's thread starts an OpenMP team (radixserve_kernels.threads): a helper thread's
torch ops run serially, and the thread that loaded the model ends its workers before the loop's
thread takes over. Otherwise GNU OpenMP, counting more threads than CPUs, stops spin-waiting
and every parallel region of the model's thread gets several times slower."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch

SCRIPT = textwrap.dedent("""
    import json, os, time
    from concurrent.futures import ThreadPoolExecutor
    import torch
    from radixserve_kernels.threads import helper_thread, release_workers

    torch.set_num_threads(2)

    def tasks(settle=None):  # this process's threads (a pool's ending threads take a moment to go)
        for _ in range(200):
            n = len(os.listdir("/proc/self/task"))
            if settle is None or n == settle:
                return n
            time.sleep(0.01)
        return n

    def parallel_op():
        torch.zeros(1 << 22).fill_(1.0)  # 4M elements: a parallel region on 2 threads

    out = {"start": tasks()}
    parallel_op()
    out["main"] = tasks()  # + main's OpenMP worker
    with ThreadPoolExecutor(1, initializer=helper_thread) as pool:
        pool.submit(parallel_op).result()
        out["helper"] = tasks()
        out["helper_threads"] = pool.submit(torch.get_num_threads).result()
    tasks(out["main"])
    with ThreadPoolExecutor(1) as pool:  # what every helper did before
        pool.submit(parallel_op).result()
        out["plain"] = tasks()
    tasks(out["main"])
    release_workers()
    out["released"] = tasks(out["start"])
    out["main_threads"] = torch.get_num_threads()
    parallel_op()  # starts them again
    out["again"] = tasks()
    print(json.dumps(out))
""")


def test_a_helper_thread_starts_no_openmp_team_and_the_loading_thread_ends_its_workers():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    n = json.loads(r.stdout.strip().splitlines()[-1])
    assert n["main"] == n["start"] + 1  # the premise: 2 threads' team = main + one worker
    assert n["plain"] == n["main"] + 2  # a plain helper thread: itself and a worker of its own team
    assert n["helper"] == n["main"] + 1 and n["helper_threads"] == 1  # itself only; its ops run serially
    assert n["released"] == n["start"] and n["main_threads"] == 2  # main's worker gone, main still runs 2
    assert n["again"] == n["main"]


def test_the_engines_helper_threads_run_torch_serially(tiny_engine):
    """The thread that fills the grammar masks while the model runs is a helper."""
    assert tiny_engine.runner._mask_pool.submit(torch.get_num_threads).result() == 1


def test_a_quantized_linears_panels_taken_as_threads_come_give_one_threads_numbers(ops):
    """The native linears hand out their output panels at run time (csrc/common.h
    parallel_dynamic): whichever thread takes a panel, the numbers are the same."""
    from test_quant import gguf_blocks

    before = torch.get_num_threads()
    try:
        for kind, n, k in (("q4_k", 2000, 512), ("q4_0", 1040, 256)):
            raw, _ = gguf_blocks(kind, n, k, 3)
            packed = ops.pack_quant(raw, kind, n, k)
            for m in (1, 3, 40):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                outs = []
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    outs.append(ops.qlinear(x, packed, n, None, True, False, 8))
                assert torch.equal(outs[0], outs[1]), (kind, m)
    finally:
        torch.set_num_threads(before)
