"""radixserve: an LLM serving engine for agents.

`from radixserve import Engine, SamplingParams`. Importing the package is cheap: torch,
transformers and triton load only when an Engine is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixserve.request import FinishReason, SamplingParams

if TYPE_CHECKING:
    from radixserve.engine.engine import Engine
    from radixserve.engine.outputs import Delta, Output

__version__ = "0.1.0"
__all__ = ["Delta", "Engine", "FinishReason", "Output", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from radixserve.engine.engine import Engine

        return Engine
    if name in ("Output", "Delta"):
        from radixserve.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
