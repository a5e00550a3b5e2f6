"""Opt-in: SGLang's own frontend (sglang==0.5.23, `import sglang as sgl`) runs the programs of
tests/sglang_programs.py against `radixserve serve`. It needs a separate venv with SGLang's
client (docs/agents.md, "SGLang's own client"); set RADIXSERVE_SGLANG_PYTHON to its python."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import sglang_programs as programs
from server_helpers import ServerProcess

SGLANG_PYTHON = os.environ.get("RADIXSERVE_SGLANG_PYTHON")
pytestmark = pytest.mark.skipif(not SGLANG_PYTHON, reason="opt-in: set RADIXSERVE_SGLANG_PYTHON to a python with "
                                "sglang==0.5.23 (see docs/agents.md)")


def test_sglangs_own_frontend_runs_the_programs_against_radixserve(smollm2_dir, tmp_path):
    server = ServerProcess(smollm2_dir, "--kv-cache-tokens", "16384", log=tmp_path / "server.log")
    try:
        out = subprocess.run([SGLANG_PYTHON, str(Path(programs.__file__)), server.url], capture_output=True, text=True,
                             env={**os.environ, "SGL_MODULE": "sglang"}, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        report = json.loads(out.stdout)
        assert set(report) == {c.__name__ for c in programs.CHECKS}
        failed = {name: why for name, why in report.items() if why != "ok"}
        assert set(failed) == set(programs.SGLANG_CLIENT_FAILS), failed  # only SGLang's own client bug
        for name, why in programs.SGLANG_CLIENT_FAILS.items():
            assert why in failed[name], failed[name]
        assert server.wait_idle()["kv_in_use_slots"] == 0
    finally:
        assert server.stop() == 0
