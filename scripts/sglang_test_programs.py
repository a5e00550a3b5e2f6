"""Run SGLang's own test programs (sglang/test/test_programs.py of an installed sglang) against
a server, on SGLang's frontend or, with its imports changed to frontend_lang, on ours.

    python scripts/sglang_test_programs.py frontend_lang URL PATH/TO/sglang/test/test_programs.py
    .venv-sglang/bin/python scripts/sglang_test_programs.py sglang URL PATH/TO/sglang/test/test_programs.py

Prints {test: "ok" or the failure} as JSON. Tests that take `check_answer` run with
check_answer=False (the model's facts are not what is compared).
"""

from __future__ import annotations

import inspect
import json
import sys
import types


def load(front: str, path: str) -> types.ModuleType:
    src = open(path).read()
    if front == "frontend_lang":  # the port: one import (and the ir module's path)
        src = src.replace("import sglang as sgl", "import frontend_lang as sgl")
        src = src.replace("from sglang.lang.ir import", "from frontend_lang.ir import")
        src = src.replace("from sglang.srt.utils import is_hip", "def is_hip():\n    return False")
    module = types.ModuleType("sglang_test_programs")
    exec(compile(src, path, "exec"), module.__dict__)
    return module


def main(front: str, url: str, path: str) -> dict[str, str]:
    module = load(front, path)
    module.sgl.set_default_backend(module.sgl.RuntimeEndpoint(url))
    report = {}
    for name, test in module.__dict__.items():
        if not name.startswith("test_") or not callable(test):
            continue
        kwargs = {"check_answer": False} if "check_answer" in inspect.signature(test).parameters else {}
        try:
            test(**kwargs)
            report[name] = "ok"
        except Exception as e:
            report[name] = f"{type(e).__name__}: {e}"[:300]
    return report


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4]), indent=1))
