"""Prometheus metrics (prometheus_client): latency histograms per request, counters, and
gauges read from the engine's published stats at scrape time (never blocking on a step).

The gateway gauges are what Kubernetes inference gateways' endpoint pickers read to choose a
pod (the Gateway API Inference Extension's model-server protocol, and llm-d's router, which
carries it on): a queue length, a running count and the KV-cache utilisation, per pod (summed
over data-parallel replicas), named like vLLM's and SGLang's so an endpoint picker maps them
one to one (examples/kubernetes/README.md):

    radixserve:num_requests_waiting   vllm:num_requests_waiting   sglang:num_queue_reqs
    radixserve:num_requests_running   vllm:num_requests_running   sglang:num_running_reqs
    radixserve:kv_cache_usage_perc    vllm:kv_cache_usage_perc    sglang:token_usage
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from radixserve.engine.protocol import EngineStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
REJECT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineStats], queued: Callable[[], int], connections: Callable[[], int]) -> None:
        self.snapshot = snapshot
        self.queued = queued
        self.connections = connections

    def collect(self) -> Iterator[Any]:
        s = self.snapshot()
        gauges = {
            "radixserve_queued_requests": ("requests accepted that have no first token yet", self.queued()),
            "radixserve_open_connections": ("client connections open", self.connections()),
            "radixserve_running_requests": ("requests the scheduler is running", s.running),
            "radixserve_waiting_requests": ("requests waiting in the scheduler", s.waiting),
            "radixserve_kv_total_tokens": ("KV pool size in tokens", s.kv_total_slots),
            "radixserve_kv_bytes_per_token": ("KV bytes of one token in every layer, scales included", s.kv_bytes_per_token),
            "radixserve_kv_in_use_tokens": ("KV tokens held by requests", s.kv_in_use_slots),
            "radixserve_kv_pool_bytes": ("bytes of the KV pools (the window pool included), scales included", s.kv_pool_bytes),
            "radixserve_kv_window_total_tokens": ("the sliding-window layers' own pool, in tokens (0: none)",
                                                  s.kv_window_total_slots),
            "radixserve_kv_window_free_tokens": ("free tokens of the sliding-window layers' pool", s.kv_window_free_slots),
            "radixserve_kv_cached_tokens": ("KV tokens held by the prefix cache", s.kv_cached_tokens),
            "radixserve_cache_hit_rate": ("cached prompt tokens / prompt tokens", s.cache_hit_rate),
            "radixserve_kv_disk_blocks": ("blocks on the KV cache's disk tier (0: none)", s.kv_disk_blocks),
            "radixserve_kv_disk_bytes": ("bytes on the KV cache's disk tier", s.kv_disk_bytes),
            "radixserve_kv_disk_capacity_bytes": ("the disk tier's bound in bytes (0: no disk tier)", s.kv_disk_capacity_bytes),
            "radixserve_kv_namespaces": ("prefix-cache namespaces (tenant, cache_salt) holding tokens", s.kv_namespaces),
            "radixserve_engine_resident_memory_bytes": ("the engine process's resident memory (0: in-process)", s.engine_rss_bytes),
            "radixserve_spec_acceptance_rate": ("speculative draft tokens accepted / drafted", s.spec_acceptance_rate),
            "radixserve_spec_tokens_per_verify": ("tokens a decode with a draft produced, on average (accepted + 1)",
                                                  s.spec_tokens_per_verify),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        dtype = GaugeMetricFamily("radixserve_kv_cache_dtype_info", "what the KV pool stores (1 for its dtype)", labels=["dtype"])
        dtype.add_metric([s.kv_dtype], 1)
        yield dtype
        counters = {
            "radixserve_prefill_tokens_computed": ("prompt tokens run through the model", "prefill_tokens_computed"),
            "radixserve_prompt_tokens_cached": ("prompt tokens served from the prefix cache", "cached_prompt_tokens"),
            "radixserve_prompt_tokens_cached_disk": ("of the cached prompt tokens, those read back from the disk tier",
                                                     "cached_prompt_tokens_disk"),
            "radixserve_kv_disk_written_tokens": ("prompt tokens written to the disk tier", "kv_disk_written_tokens"),
            "radixserve_kv_disk_skipped_tokens": ("prompt tokens not written to the disk tier (writer behind, or no room)",
                                                  "kv_disk_skipped_tokens"),
            "radixserve_kv_disk_loaded_tokens": ("tokens put back into the pool from the disk tier", "kv_disk_loaded_tokens"),
            "radixserve_kv_disk_corrupt_blocks": ("disk-tier blocks found torn or corrupt (misses)", "kv_disk_corrupt_blocks"),
            "radixserve_prompt_tokens": ("prompt tokens of admitted requests", "prompt_tokens"),
            "radixserve_generation_tokens": ("tokens decoded", "decode_tokens"),
            "radixserve_retractions": ("requests retracted under memory pressure", "retractions"),
            "radixserve_evicted_tokens": ("prefix-cache tokens evicted", "evicted_tokens"),
            "radixserve_spec_draft_tokens": ("speculative draft tokens fed to the model", "spec_draft_tokens"),
            "radixserve_spec_accepted_tokens": ("speculative draft tokens the sampler agreed with", "spec_accepted_tokens"),
            "radixserve_spec_verifies": ("decodes that carried a speculative draft", "spec_verifies"),
            "radixserve_spec_cache_draft_tokens": ("draft tokens found in the namespace's cached branches", "spec_cache_draft_tokens"),
        }
        for name, (doc, key) in counters.items():
            yield CounterMetricFamily(name, doc, value=getattr(s, key))


TTFT_WINDOW_S = 30.0  # the TTFT p90 an autoscaler reads (/server_info's autoscaling) is over this window
PER_TOKENS = 1000  # the autoscaler's TTFT is per this many computed prompt tokens (a shorter prompt counts as this many)
GATEWAY_NAMESPACE = "radixserve"  # the gateway gauges: radixserve:num_requests_waiting, ...
VLLM_NAMESPACE = "vllm"  # the same gauges under vLLM's names, for an endpoint picker's default mapping
Replicas = Callable[[], list[EngineStats]]


def kv_cache_usage(s: EngineStats) -> float:
    """The fraction of the KV pool that cannot be had now, in [0, 1]: slots held by requests
    plus cached prefixes a request has locked. Free slots and evictable cached prefixes count
    as free (vLLM counts its unreferenced prefix-cached blocks as free, SGLang its evictable
    tokens), so an idle server reads 0 however much it has cached."""
    if s.kv_total_slots <= 0:
        return 0.0
    held = s.kv_total_slots - s.kv_free_slots - s.kv_evictable_tokens
    return min(max(held / s.kv_total_slots, 0.0), 1.0)


def gateway_gauges(s: EngineStats) -> dict[str, tuple[str, float]]:
    """name -> (help, value) of the three gauges an endpoint picker reads."""
    return {
        "num_requests_waiting": ("requests in the engine's waiting queue: submitted, not yet admitted to a batch "
                                 "(retracted ones included; requests still tokenizing or compiling a grammar are not)",
                                 s.waiting),
        "num_requests_running": ("requests the engine is prefilling or decoding", s.running),
        "kv_cache_usage_perc": ("fraction of the KV pool held by requests or locked prefixes, 0 to 1 (evictable "
                                "cached prefixes count as free)", kv_cache_usage(s)),
    }


PER_REPLICA = {  # name -> (help, the gateway gauge it is of one replica)
    "radixserve_replica_waiting_requests": ("one data-parallel replica's num_requests_waiting", "num_requests_waiting"),
    "radixserve_replica_running_requests": ("one data-parallel replica's num_requests_running", "num_requests_running"),
    "radixserve_replica_kv_cache_usage_perc": ("one data-parallel replica's kv_cache_usage_perc", "kv_cache_usage_perc"),
}


class _GatewayCollector(Collector):
    """The gateway gauges of the pod (from the aggregate snapshot: the healthy replicas' sum),
    under each namespace asked for, and each data-parallel replica's, labelled by its index."""

    def __init__(self, snapshot: Callable[[], EngineStats], replicas: Replicas, namespaces: tuple[str, ...]) -> None:
        self.snapshot, self.replicas, self.namespaces = snapshot, replicas, namespaces

    def collect(self) -> Iterator[Any]:
        for name, (doc, value) in gateway_gauges(self.snapshot()).items():
            for ns in self.namespaces:
                yield GaugeMetricFamily(f"{ns}:{name}", doc, value=value)
        families = {name: GaugeMetricFamily(name, doc, labels=["replica"]) for name, (doc, _) in PER_REPLICA.items()}
        for i, s in enumerate(self.replicas()):
            gauges = gateway_gauges(s)
            for name, (_, key) in PER_REPLICA.items():
                families[name].add_metric([str(i)], gauges[key][1])
        yield from families.values()


class CountersCollector(Collector):
    """Counters kept elsewhere (a dataclass of ints), each exported as `{prefix}{field}` (a
    counter: `_total`), read at scrape time."""

    def __init__(self, prefix: str, counters: Any, help: dict[str, str]) -> None:
        self.prefix, self.counters, self.help = prefix, counters, help

    def collect(self) -> Iterator[Any]:
        for name, value in vars(self.counters).items():
            yield CounterMetricFamily(self.prefix + name, self.help.get(name, name), value=value)


class Metrics:
    def __init__(
        self, snapshot: Callable[[], EngineStats], queued: Callable[[], int], slo_ttft_s: float, slo_tpot_s: float,
        connections: Callable[[], int] = lambda: 0, *, replicas: Replicas | None = None, vllm_names: bool = False,
    ) -> None:
        """`replicas`: each data-parallel replica's stats (EngineClient.replica_snapshots; default:
        the snapshot is the one replica). `vllm_names`: also export the gateway gauges as vllm:*, so an
        endpoint picker with its default (vLLM) mapping reads them unconfigured."""
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes, open fds, CPU seconds
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.ttft = Histogram("radixserve_time_to_first_token_seconds", "TTFT", registry=r, buckets=LATENCY_BUCKETS)
        self._recent_ttft: deque[tuple[float, float]] = deque(maxlen=4096)  # (when, TTFT): the autoscaling signal
        self._recent_ttft_per_1k: deque[tuple[float, float]] = deque(maxlen=4096)  # (when, TTFT per PER_TOKENS)
        self.ttft_per_1k = Histogram("radixserve_time_to_first_token_per_1k_prompt_tokens_seconds",
                                     "TTFT per 1,000 computed prompt tokens (a shorter prompt counts as 1,000): the "
                                     "autoscaling signal, which more replicas shorten", registry=r, buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("radixserve_time_per_output_token_seconds", "TPOT", registry=r, buckets=TPOT_BUCKETS)
        self.e2e = Histogram("radixserve_e2e_request_latency_seconds", "end-to-end latency", registry=r, buckets=LATENCY_BUCKETS)
        self.finished = Counter("radixserve_requests", "finished requests by finish reason", ["finish_reason"], registry=r)
        self.goodput = Counter("radixserve_goodput_requests", "finished requests within the TTFT and TPOT SLOs", registry=r)
        self.rejected = Counter("radixserve_rejected_requests", "requests rejected by reason", ["reason"], registry=r)
        self.rejection_latency = Histogram("radixserve_rejection_latency_seconds", "arrival to a 429/503 answer (overload)",
                                           registry=r, buckets=REJECT_BUCKETS)
        r.register(_EngineCollector(snapshot, queued, connections))
        namespaces = (GATEWAY_NAMESPACE, VLLM_NAMESPACE) if vllm_names else (GATEWAY_NAMESPACE,)
        r.register(_GatewayCollector(snapshot, replicas or (lambda: [snapshot()]), namespaces))

    def observe(self, ttft: float | None, e2e: float, completion_tokens: int, finish_reason: str,
                computed_prompt_tokens: int = 0) -> None:
        """`computed_prompt_tokens`: the prompt tokens the request's prefill computed (not cached)."""
        self.finished.labels(finish_reason).inc()
        self.e2e.observe(e2e)
        if ttft is None:
            return
        self.ttft.observe(ttft)
        self._recent_ttft.append((time.monotonic(), ttft))
        per_1k = ttft * PER_TOKENS / max(computed_prompt_tokens, PER_TOKENS)
        self.ttft_per_1k.observe(per_1k)
        self._recent_ttft_per_1k.append((time.monotonic(), per_1k))
        tpot = (e2e - ttft) / (completion_tokens - 1) if completion_tokens > 1 else 0.0
        if completion_tokens > 1:
            self.tpot.observe(tpot)
        if finish_reason in ("stop", "length") and ttft <= self.slo_ttft_s and tpot <= self.slo_tpot_s:
            self.goodput.inc()

    def ttft_p90(self, window_s: float = TTFT_WINDOW_S) -> float:
        """The 90th percentile of the TTFTs observed in the last window_s (0 if none)."""
        return _recent_p90(self._recent_ttft, window_s)

    def ttft_per_1k_p90(self, window_s: float = TTFT_WINDOW_S) -> float:
        """The same of each TTFT per PER_TOKENS computed prompt tokens: what more replicas shorten
        (a long prompt's prefill takes as long on any replica; time spent waiting does not)."""
        return _recent_p90(self._recent_ttft_per_1k, window_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _recent_p90(samples: deque[tuple[float, float]], window_s: float) -> float:
    since = time.monotonic() - window_s
    recent = sorted(v for at, v in samples if at >= since)
    return recent[min(len(recent) - 1, int(0.9 * len(recent)))] if recent else 0.0
