"""Shared fixtures: tiny random-weight models of each architecture (fast), and the real
SmolLM2 (converted once into the radixserve cache) where output meaning matters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Two test workers, each with torch's two OpenMP threads, and the servers they start, share 2
# cores: OpenMP's default spin-waiting at its barriers then burns the core another process needs
# (a quarter of the suite's modules took 116 s spinning, 64 s passive, on a 2-core Xeon). Set
# before torch is imported; servers the tests start inherit it. Speed is measured by the
# benchmarks, which leave it unset.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _import_triton_for_the_interpreter() -> None:
    """Triton's own library functions (tl.max, tl.sum, ...) are built when triton is first
    imported, compiled or interpreted by TRITON_INTERPRET at that moment, and torch imports
    triton early (creating a module does). Without a GPU, import it with the interpreter on,
    so the tests that switch TRITON_INTERPRET=1 on for themselves work in any order; every
    other test still sees the variable unset (CPU dispatch takes the torch paths)."""
    import torch

    if torch.cuda.is_available() or "TRITON_INTERPRET" in os.environ:
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    finally:
        del os.environ["TRITON_INTERPRET"]


_import_triton_for_the_interpreter()


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built():
    """radixserve's CPU kernels are built before any test (scripts/setup.sh builds them at
    install; a cold build is paid here, not inside a server start that a test waits for)."""
    from radixserve_kernels import cpu

    for isa in cpu.runnable_isas():
        cpu.ops_for(isa)


def _isas() -> tuple[str, ...]:
    from radixserve_kernels import cpu

    return cpu.ISAS


@pytest.fixture(params=_isas())
def ops(request):
    """Each build of the CPU kernels this CPU runs (avx512, avx2, generic), chosen for the test's
    duration so the dispatchers (radixserve_kernels.decode_attention, models.layers...) use it too; a
    build this CPU cannot run is skipped with the reason, a failed build fails the test."""
    from radixserve_kernels import cpu

    if request.param not in cpu.runnable_isas():
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    mod = cpu.ops_for(request.param)
    assert mod is not None, f"the {request.param} CPU kernels did not build (see the warning logged by radixserve_kernels.cpu)"
    cpu.set_isa(request.param)
    yield mod
    cpu.set_isa(None)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", help="the full soak (3,000 requests) instead of CI's bounded one (600)")


# What makes a test slow, found in its source or its fixtures' (so a new test needs no mark): a
# server or engine process (directly, through a module's Servers helper or frontend_lang's
# Runtime), a Ray cluster, any other subprocess, or the real SmolLM2 weights. A module whose
# helpers start them all says so itself (test_data_parallel.py: pytestmark).
_SLOW_SIGNS = ("ServerProcess(", "EngineProcess(", "Servers(", "Runtime(", "ray.init", "subprocess", "smollm2_dir")


def _slow(fn: object) -> bool:
    import inspect

    try:
        source = inspect.getsource(fn)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return False
    return any(sign in source for sign in _SLOW_SIGNS)


# The suite runs on two pytest-xdist workers, a module to a worker (pyproject.toml: `-n 2 --dist
# loadfile`), handed out in collection order: these modules, the longest (each 30-90 s of
# servers, clusters and soaks, measured), go first, so the run does not end on one of them while
# the other worker idles.
LONGEST_FIRST = ("test_reliability.py", "test_ray.py", "test_autoscale.py", "test_tensor_parallel.py", "test_quant.py",
                 "test_spec.py", "test_attention.py", "test_frontend.py", "test_reliability_hostile.py",
                 "test_disaggregation.py", "test_data_parallel.py", "test_kernels.py", "test_server.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`slow` on every test that starts a process or loads the real model (`pytest -m "not slow"`:
    the fast loop, every module's in-process tests); the longest modules first."""
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        fixtures = [d.func for ds in defs.values() for d in ds]
        if item.get_closest_marker("smollm2") or any(_slow(f) for f in [getattr(item, "function", None), *fixtures]):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module's own order kept


_MYPY = pytest.StashKey["subprocess.Popen[bytes]"]()


def _mypy_files() -> tuple[Path, Path]:
    """Where this run's type check writes its output and, once done, its exit status: one run
    for every xdist worker (PYTEST_XDIST_TESTRUNUID is the same in each)."""
    import tempfile

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    base = Path(tempfile.gettempdir()) / f"radixserve-mypy-{run}"
    return base.with_suffix(".out"), base.with_suffix(".rc")


def _start_mypy() -> subprocess.Popen[bytes]:
    out, rc = _mypy_files()
    script = f'"$0" -m mypy > "{out}" 2>&1; echo $? > "{rc}.part" && mv "{rc}.part" "{rc}"'
    return subprocess.Popen(["sh", "-c", script, sys.executable], cwd=Path(__file__).parents[1],
                            preexec_fn=lambda: os.nice(19), start_new_session=True)  # (a group: killed whole)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The type check (tens of seconds of CPU) starts as the run does, at the lowest priority: it
    takes what the other tests leave idle (servers starting, streams waiting), and
    `mypy_check` collects it. With xdist, the first worker starts it for all."""
    first = os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0"
    if first and any(item.name == "test_mypy_finds_no_type_error_in_radixserve" for item in session.items):
        session.config.stash[_MYPY] = _start_mypy()


def pytest_unconfigure(config: pytest.Config) -> None:
    """A run that ends without the check's test (interrupted, or alone) stops it and removes its
    files; under xdist the other worker may still wait for it, so it is left to finish."""
    import signal

    proc = config.stash.get(_MYPY, None)
    if proc is not None and "PYTEST_XDIST_WORKER" not in os.environ:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for f in _mypy_files():
            f.unlink(missing_ok=True)


_MYPY_RESULT = pytest.StashKey[tuple[int, str]]()


@pytest.fixture
def mypy_check(request: pytest.FixtureRequest) -> tuple[int, str]:
    """`python -m mypy`'s exit status and output (the run begun at collection, or a new one;
    read once, then kept for a rerun)."""
    import time

    if (done := request.config.stash.get(_MYPY_RESULT, None)) is not None:
        return done
    out, rc = _mypy_files()
    proc = request.config.stash.get(_MYPY, None)
    if proc is None and "PYTEST_XDIST_WORKER" not in os.environ:
        proc = _start_mypy()
    if proc is not None:
        proc.wait()
    deadline = time.monotonic() + 900
    while not rc.exists() and time.monotonic() < deadline:  # another worker's run
        time.sleep(0.5)
    if not rc.exists():
        pytest.fail(f"the type check did not finish in 15 minutes ({out})")
    result = int(rc.read_text()), out.read_text()
    rc.unlink()
    out.unlink()
    request.config.stash[_MYPY_RESULT] = result
    return result

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Agents call tools, read JSON, and branch into many parallel calls.",
    "def add(a, b):\n    return a + b\n",
    "A radix tree shares prefixes; an LRU policy evicts the coldest leaves first.",
    "Ünïcödé text, emoji 🙂 and numbers 12345 must round-trip through the tokenizer.",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM",
         "SmolLM3ForCausalLM")
MOE_ARCHS = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")  # (each also as a GGUF file)
ALL_MOE_ARCHS = (*MOE_ARCHS, "GptOssForCausalLM")


def _train_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return len(fast)


def _config(arch: str, vocab: int, eos: int) -> dict:
    cfg = {
        "architectures": [arch],
        "vocab_size": vocab,
        "hidden_size": 96,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.2,
        "eos_token_id": eos,
        "bos_token_id": 1,
        "tie_word_embeddings": arch in ("LlamaForCausalLM", "Gemma3ForCausalLM"),
        "model_type": {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                       "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3_text", "SmolLM3ForCausalLM": "smollm3",
                       "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe", "MixtralForCausalLM": "mixtral",
                       "GptOssForCausalLM": "gpt_oss"}[arch],
    }
    if arch == "Qwen3MoeForCausalLM":  # 8 experts, top 3 renormalised; the middle layer dense
        cfg.update(num_hidden_layers=3, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
                   mlp_only_layers=[1], decoder_sparse_step=1)
    elif arch == "Qwen2MoeForCausalLM":  # 6 experts, top 2 as routed (not renormalised), a gated shared expert
        cfg.update(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                   norm_topk_prob=False, qkv_bias=True)
    elif arch == "MixtralForCausalLM":  # 4 experts as wide as intermediate_size, top 2
        cfg.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=None)
    elif arch == "GptOssForCausalLM":  # 8 experts, top 4; a window of 8 then full attention; YaRN; a tight clamp
        cfg.update(num_local_experts=8, num_experts_per_tok=4, intermediate_size=32, sliding_window=8, attention_bias=True,
                   layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.5,
                   rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})
        return cfg
    if arch == "Gemma3ForCausalLM":  # a window of 8 (prompts of 16 run past it), its own softmax scale
        cfg.update(num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh",
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"], final_logit_softcapping=None,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})
        return cfg
    if arch == "LlamaForCausalLM":  # 4.x dialect with llama3 scaling
        cfg["rope_theta"] = 50000.0
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    else:  # 5.x dialect
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 20000.0}
    if arch == "MistralForCausalLM":
        cfg["sliding_window"] = None
    if arch == "SmolLM3ForCausalLM":  # the second layer without rope
        cfg.update(no_rope_layers=[1, 0], use_sliding_window=False, pad_token_id=None)
    return cfg


def make_tiny_model(folder: Path, arch: str, cfg: dict, tok_dir: Path, seed: int) -> Path:
    """A model folder: `cfg` as config.json (the dialect as written), random weights (seeded;
    Gemma's norms moved off w = 0, its scale of 1 + w), the tokenizer files of `tok_dir`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)), dtype=torch.float32)
    if arch in ("Gemma3ForCausalLM", "GptOssForCausalLM"):  # parameters transformers starts at 0 made to matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") and arch == "Gemma3ForCausalLM":
                    p.normal_(0.0, 0.3)
                elif name.endswith(("sinks", "bias")) and arch == "GptOssForCausalLM":  # (and the experts' biases)
                    p.normal_(0.0, 1.0 if name.endswith("sinks") else 0.3)
    model.save_pretrained(str(folder))
    (folder / "config.json").write_text(json.dumps(cfg))  # keep the dialect we wrote
    for f in tok_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, int]:
    """The trained tiny tokenizer's folder, its vocabulary size and its EOS id."""
    tok_dir = tmp_path_factory.mktemp("tiny") / "tokenizer"
    vocab = _train_tokenizer(tok_dir)
    eos = json.loads((tok_dir / "tokenizer.json").read_text())["model"]["vocab"]["<|im_end|>"]
    return tok_dir, vocab, eos


@pytest.fixture(scope="session")
def tiny_models(tiny_tokenizer: tuple[Path, int, int]) -> dict[str, Path]:
    """A folder per architecture: random weights (seeded), config.json, tokenizer, chat template."""
    tok_dir, vocab, eos = tiny_tokenizer
    return {arch: make_tiny_model(tok_dir.parent / arch, arch, _config(arch, vocab, eos), tok_dir, 1234 + i)
            for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="session")
def tiny_moe_models(tiny_tokenizer: tuple[Path, int, int]) -> dict[str, Path]:
    """A folder per mixture-of-experts architecture, as `tiny_models`."""
    tok_dir, vocab, eos = tiny_tokenizer
    return {arch: make_tiny_model(tok_dir.parent / arch, arch, _config(arch, vocab, eos), tok_dir, 4321 + i)
            for i, arch in enumerate(ALL_MOE_ARCHS)}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["LlamaForCausalLM"]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from radixserve.models.loader import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_dir: Path):
    from radixserve import Engine

    with Engine(str(smollm2_dir), kv_cache_tokens=8192) as e:
        yield e


@pytest.fixture
def tiny_engine(tiny_llama: Path):
    """A fresh engine on the tiny Llama; small chunks so prefills split and mix with decodes."""
    from radixserve import Engine

    with Engine(str(tiny_llama), kv_cache_tokens=4096, chunked_prefill_size=64) as e:
        yield e


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    """A `radixserve serve` on the tiny model with small chunks and a small body limit, per module."""
    from server_helpers import MAX_BODY, ServerProcess

    log = tmp_path_factory.mktemp("server") / "server.log"
    s = ServerProcess(tiny_llama, "--kv-cache-tokens", "8192", "--chunked-prefill-size", "128",
                      "--max-request-bytes", str(MAX_BODY), log=log)
    yield s
    assert s.stop() == 0, log.read_text()


@pytest.fixture(autouse=True, scope="session")
def _fp32_engines():
    """`dtype=auto` is bf16 on CPUs with AVX512-BF16 or AMX; in-process engines of the suite run
    in fp32, where its token-exact checks (against Hugging Face, between engine variants) hold.
    test_units checks what `auto` picks."""
    mp = pytest.MonkeyPatch()
    mp.setattr("radixserve.engine.engine.cpu_has_bf16", lambda: False)
    yield
    mp.undo()
