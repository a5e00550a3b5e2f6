"""SGLang-style programs (tests/sglang_programs.py) on frontend_lang, against SmolLM2: the
program text an SGLang user writes, with `import frontend_lang as sgl`."""

from __future__ import annotations

import pytest
import sglang_programs as programs
from server_helpers import ServerProcess


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    s = ServerProcess(smollm2_dir, "--kv-cache-tokens", "16384", log=tmp_path_factory.mktemp("sglp") / "server.log")
    programs.sgl.set_default_backend(programs.sgl.RuntimeEndpoint(s.url))
    yield s
    programs.sgl.set_default_backend(None)
    assert s.wait_idle()["kv_in_use_slots"] == 0  # every program's requests freed their KV
    assert s.stop() == 0


@pytest.mark.parametrize("check", programs.CHECKS, ids=lambda c: c.__name__[len("check_"):])
def test_sglang_program_runs_on_frontend_lang(server, check):
    check()
