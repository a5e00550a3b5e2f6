"""Process-wide settings of the frontend (SGLang's `sgl.global_config`)."""

from __future__ import annotations

from typing import Any


class GlobalConfig:
    def __init__(self) -> None:
        self.verbosity = 0  # 2: print each program's text after it runs
        self.default_backend: Any = None  # set_default_backend sets it
        self.skip_special_tokens_in_output = True
        self.spaces_between_special_tokens_in_out = True
        self.enable_precache_with_tracing = True  # run_batch computes the programs' shared prefix first
        self.enable_parallel_encoding = True  # join("concate_and_append") tells the server (SGLang's protocol)


global_config = GlobalConfig()
