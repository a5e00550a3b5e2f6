"""Reading a server's Prometheus /metrics from a benchmark."""

from __future__ import annotations

import re
from typing import Any

from radixserve.bench import bearer


async def scrape(session: Any, url: str, key: str | None) -> dict[str, float]:
    """GET /metrics as {sample name with its labels: value}."""
    async with session.get(url + "/metrics", headers=bearer(key)) as r:
        text = await r.text()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}


def histogram_quantile(q: float, before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    """Prometheus' histogram_quantile over the observations between two scrapes (linear in a bucket)."""
    pat = re.compile(re.escape(name) + r'_bucket\{le="([^"]+)"\}')
    buckets = sorted((float(m.group(1)), after[k] - before.get(k, 0.0)) for k in after if (m := pat.fullmatch(k)))
    total = buckets[-1][1] if buckets else 0.0
    if not total:
        return None
    lo, below = 0.0, 0.0
    for le, count in buckets:
        if count >= q * total:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * (q * total - below) / max(count - below, 1e-12)
        lo, below = le, count
    return lo
