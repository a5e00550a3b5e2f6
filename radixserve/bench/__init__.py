"""Benchmarks, run as `radixserve bench ...`; each compares against a baseline in the same run."""

from __future__ import annotations

from typing import overload


def bearer(key: str | None) -> dict[str, str]:
    """The request headers that send an API key (none for an open server)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


@overload
def percentile(xs: list[float], q: float) -> float: ...


@overload
def percentile(xs: list[float], q: float, empty: float | None) -> float | None: ...


def percentile(xs: list[float], q: float, empty: float | None = float("nan")) -> float | None:
    """The q-quantile (0..1) of xs by rank (no interpolation); `empty` when there is none."""
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)] if xs else empty
