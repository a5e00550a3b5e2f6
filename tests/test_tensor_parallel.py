"""Tensor and pipeline parallelism (--tensor-parallel N, --pipeline-parallel N;
engine/model_parallel.py, models/tp.py, models/pp.py): two ranks (rank 0 in the engine, one
worker process) give one rank's greedy tokens, and its logprobs to rounding. Tensor parallel:
the order of the sums over o_proj's and down_proj's input features differs (each rank sums its
part, then the parts are added); both: a micro-batch's or a shard's row and column counts may
pick another matmul kernel, and one rank's decode runs the fused native step."""

from __future__ import annotations

import pytest

from radixserve import Engine
from radixserve.models.tp import Shard, split_evenly
from radixserve.request import SamplingParams

PROMPTS = ["The cat sat on the mat and", "hello world, this is a longer prompt that takes two chunks of sixteen tokens",
           "The cat sat on the mat and then"]  # the third shares the first's prefix: a cache hit on both ranks


def _run(path, **kw) -> list:
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, return_logprob=True)
    with Engine(None if path is None else str(path), dtype="float32", kv_cache_tokens=2048, chunked_prefill_size=16, **kw) as e:
        first = e.generate(PROMPTS[:2], params)
        return first + e.generate(PROMPTS[2:], params)  # after the first two: its prefix is cached


@pytest.mark.slow  # starts a worker process
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Gemma3ForCausalLM"])
def test_two_ranks_give_one_ranks_greedy_tokens_and_logprobs_to_rounding(tiny_models, arch):
    one, two = _run(tiny_models[arch]), _run(tiny_models[arch], tensor_parallel=2)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    assert two[2].cached_tokens > 0
    for a, b in zip(one, two):
        assert a.logprobs is not None and b.logprobs is not None
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_kv_heads_split_as_evenly_as_they_go_and_each_rank_needs_one():
    assert split_evenly(3, 2) == [0, 2, 3] and split_evenly(192, 2) == [0, 96, 192]
    assert [(s.kv_lo, s.kv_hi) for s in (Shard.of(r, 2, 3, 1536) for r in range(2))] == [(0, 2), (2, 3)]
    with pytest.raises(ValueError, match="tensor_parallel: 4 ranks, but the model has 3 KV heads"):
        Shard.of(0, 4, 3, 1536)


def test_a_quantized_model_or_the_disk_tier_is_refused_by_name(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel: shards float weights only.*--quantization none"):
        Engine(None, tensor_parallel=2, kv_cache_tokens=1024)  # the default model: its GGUF's Q4_1 blocks
    with pytest.raises(ValueError, match="^kv_disk_dir: the disk tier does not hold a split pool's KV"):
        Engine(str(tiny_llama), tensor_parallel=2, kv_cache_tokens=1024, kv_disk_dir=str(tmp_path))
    with pytest.raises(ValueError, match="^tensor_parallel: 3 ranks, but the model has 2 KV heads"):
        Engine(str(tiny_llama), tensor_parallel=3, kv_cache_tokens=1024)
    with pytest.raises(ValueError, match="^pipeline_parallel: 3 stages, but the model has 2 layers"):
        Engine(str(tiny_llama), pipeline_parallel=3, kv_cache_tokens=1024)
    with pytest.raises(ValueError, match="^pipeline_parallel: not together with tensor_parallel yet"):
        Engine(str(tiny_llama), pipeline_parallel=2, tensor_parallel=2, kv_cache_tokens=1024)


@pytest.mark.slow
def test_smollm2s_q4_1_file_in_two_pipeline_stages_gives_one_ranks_greedy_tokens():
    """Pipeline stages keep whole layers: a GGUF's quantized linears split as they are."""
    one, two = _run(None), _run(None, pipeline_parallel=2)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]


@pytest.mark.slow
def test_smollm2_in_fp32_on_two_ranks_gives_one_ranks_greedy_tokens(smollm2_dir):
    """SmolLM2-135M: 9 query heads over 3 KV heads, split 6 + 3 (2 KV heads and 1)."""
    one = _run(smollm2_dir, quantization="none")
    two = _run(smollm2_dir, quantization="none", tensor_parallel=2)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    assert max(abs(x.logprob - y.logprob) for a, b in zip(one, two) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3


@pytest.mark.slow  # starts a worker process
def test_bench_tp_times_one_rank_and_two_and_the_all_reduce_share(tiny_llama, tmp_path, capsys):
    import json

    from radixserve.cli import main

    out = tmp_path / "tp.json"
    assert main(["bench", "tp", "--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-tokens", "1024",
                 "--batch", "2", "--prompt-len", "32", "--output-len", "4", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["ranks"] for r in rows] == ["1", "tensor 2", "pipeline 2"] and rows[0]["decode_allreduce_share"] == 0
    assert all(r["prefill_ms"] > 0 and r["decode_ms"] > 0 for r in rows) and 0 < rows[1]["decode_allreduce_share"] < 1
    assert "tensor 2 / 1: prefill x" in capsys.readouterr().out


@pytest.mark.slow  # starts a worker process
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Gemma3ForCausalLM", "SmolLM3ForCausalLM"])
def test_two_pipeline_stages_give_one_ranks_tokens_and_logprobs_to_rounding(tiny_models, arch):
    """Every layer computes what it does in one process; the kernels differ where a micro-batch's
    row count picks another matmul, and one rank's decode runs the fused native step."""
    one, two = _run(tiny_models[arch]), _run(tiny_models[arch], pipeline_parallel=2)
    assert [o.token_ids for o in two] == [o.token_ids for o in one] and two[2].cached_tokens > 0
    assert max(abs(x.logprob - y.logprob) for a, b in zip(one, two) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_pipeline_micro_batches_cut_whole_sequences_or_a_lone_one_as_chunked_prefill_would():
    import torch

    from radixserve.batch import ForwardBatch, SeqView
    from radixserve.models.pp import micro_batches

    def batch(seqs):
        t = sum(s.q_len for s in seqs)
        rows = torch.arange(t)
        return ForwardBatch(rows, rows, rows + 100, seqs, None)

    three = micro_batches(batch([SeqView(0, 5, 0, list(range(5))), SeqView(5, 1, 9, list(range(10))),
                                 SeqView(6, 4, 0, list(range(4)))]), 2)
    assert [[(s.q_start, s.q_len) for s in mb[3]] for mb in three] == [[(0, 5)], [(0, 1), (1, 4)]]
    assert three[1][2].tolist() == [105, 106, 107, 108, 109]  # its rows' out slots
    lone = micro_batches(batch([SeqView(0, 10, 3, list(range(13)))]), 2)
    assert [[(s.q_start, s.q_len, s.prefix_len, len(s.slots)) for s in mb[3]] for mb in lone] == [[(0, 5, 3, 8)],
                                                                                                 [(0, 5, 8, 13)]]
    assert len(micro_batches(batch([SeqView(0, 1, 7, list(range(8)))]), 2)) == 1  # one decode row: one micro-batch


# -- the workers' channel against other local users (issue 44, finding 6) -------------------------
def _listening(pid: int | str = "self") -> list[str]:
    """This process's listening TCP addresses, as /proc/net/tcp writes them (0100007F: 127.0.0.1)."""
    import os

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            found += [p[1] for p in (line.split() for line in f.readlines()[1:]) if p[3] == "0A" and p[9] in inodes]
    return found


def _outward_interface() -> str:
    """The default route's interface (an address beyond the machine)."""
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc")
    with open("/proc/net/route") as f:
        names = [p[0] for p in (line.split() for line in f.readlines()[1:]) if p[1] == "00000000"]
    if not names:
        pytest.skip("no default route: no interface but loopback to compare with")
    return names[0]


@pytest.mark.slow  # starts a worker process
def test_split_engine_meets_in_a_private_directory_and_listens_on_loopback_only(tiny_llama, monkeypatch):
    """A rendezvous file in /tmp (deleted, its name reused) let a local user who won the race
    choose whom the workers connect to; gloo listened where GLOO_SOCKET_IFNAME or the hostname
    pointed, beyond the machine."""
    import os
    import stat

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", _outward_interface())  # ignored: the ranks share a machine
    before = set(_listening())
    with Engine(str(tiny_llama), dtype="float32", kv_cache_tokens=1024, tensor_parallel=2) as e:
        spec = e.parallel.spec
        folder = os.lstat(os.path.dirname(spec.init_file))
        assert stat.S_ISDIR(folder.st_mode) and folder.st_uid == os.geteuid()
        assert stat.S_IMODE(folder.st_mode) == 0o700
        assert len(spec.shm_name) >= len("radixserve-tp-") + 32  # 128 random bits
        ours = set(_listening()) - before
        theirs = _listening(e.parallel.procs[0].pid)
        assert ours and theirs and all(a.startswith("0100007F:") for a in ours | set(theirs)), (ours, theirs)
        assert e.generate("The cat sat", SamplingParams(max_new_tokens=3, temperature=0.0))[0].token_ids
    assert not os.path.exists(os.path.dirname(spec.init_file))


def test_a_rendezvous_another_user_could_write_is_refused(tmp_path):
    import datetime

    from radixserve.engine import parallel_channel as channel

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(RuntimeError, match="rendezvous directory .* mode 0700"):
        channel.join(str(shared / "store"), 0, 1, datetime.timedelta(seconds=5))
    path = channel.new_rendezvous()
    channel.remove_rendezvous(path)
    import os

    assert not os.path.exists(os.path.dirname(path))


def _two_ranks():
    """Ranks 0 and 1 of one group, in this process (rank 1 joins on a thread)."""
    import datetime
    import threading

    from radixserve.engine import parallel_channel as channel

    path = channel.new_rendezvous()
    got = {}
    t = threading.Thread(target=lambda: got.update(pg=channel.join(path, 1, 2, datetime.timedelta(seconds=30))))
    t.start()
    pg0 = channel.join(path, 0, 2, datetime.timedelta(seconds=30))
    t.join()
    return path, pg0, got["pg"]


def test_steps_cross_the_channel_as_bytes_and_a_pickle_on_it_is_never_run(tmp_path):
    """A peer that got onto the channel sends a pickle whose loading would run code: the worker's
    side decodes typed msgpack, refuses it, and nothing runs."""
    import pickle
    import threading

    import torch

    from radixserve.batch import ForwardBatch, SeqView
    from radixserve.engine import parallel_channel as channel
    from radixserve.models.pp import micro_batches

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (marker.touch, ())

    path, pg0, pg1 = _two_ranks()
    try:
        rows = torch.arange(10)
        batch = ForwardBatch(rows, rows, rows + 100, [SeqView(0, 6, 0, list(range(6))),
                                                        SeqView(6, 4, 3, list(range(7)), True, [5, 6, 7, 8])], None)
        step = micro_batches(batch, 2)
        got: list = []
        t = threading.Thread(target=lambda: got.extend([channel.recv_step(pg1) for _ in range(3)]))
        t.start()
        channel.send_step(pg0, channel.encode_step(step))
        channel.send_step(pg0, bytearray(pickle.dumps([Evil()])))
        channel.send_step(pg0, None)
        t.join()
        back = channel.decode_step(got[0])
        assert [(m[0].tolist(), m[2].tolist(), m[3]) for m in back] == [(m[0].tolist(), m[2].tolist(), m[3]) for m in step]
        with pytest.raises(ValueError):
            channel.decode_step(got[1])
        assert got[2] is None and not marker.exists()
        for bad in (b"", b"\x93\x01\x02", pickle.dumps(Evil())):
            with pytest.raises(ValueError):
                channel.decode_step(bad)
        assert not marker.exists()
    finally:
        channel.remove_rendezvous(path)


def test_no_pickle_crosses_the_workers_channels():
    """Every channel between rank 0 and its workers carries bytes or tensors: no
    broadcast_object_list / send_object_list (pickles), no Connection.recv / Queue (unpickles)."""
    import re
    from pathlib import Path

    import radixserve

    root = Path(radixserve.__file__).parent
    files = [root / "engine" / "model_parallel.py", root / "engine" / "parallel_channel.py", root / "models" / "tp.py",
             root / "models" / "pp.py"]
    banned = re.compile(r"pickle|_object_list|init_process_group|\.recv\(\)|\.get\(timeout|Queue\(")
    for f in files:
        code = "\n".join(line for line in f.read_text().splitlines() if not line.lstrip().startswith("#"))
        code = re.sub(r'"""(.|\n)*?"""', "", code)
        assert not banned.search(code), (f.name, banned.search(code))
