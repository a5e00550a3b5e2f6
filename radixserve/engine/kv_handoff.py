"""Prefill/decode disaggregation, an engine's side: publishing a computed prompt's KV pages
through a KV connector (engine/kv_connector.py), and taking another engine's into the pool.

The producer (a prefill replica) runs a request marked `kv_export` (its prompt, one token to
sample, which is dropped): once the step that ends its prefill has run, the KV of tokens
[start, upto) is gathered out of the pool (KVPool.gather) and published under the key the
coordinator chose. Its pages stay in its own prefix cache, as any finished request's do: a fork
of the same prompt prefills only its own tail there.

The consumer (a decode replica) gets the request marked `kv_import`: it waits outside the
scheduler, as a disk-tier load does, while a reader thread takes the pages; the loop then puts
them into the pool and the prefix cache (CacheManager.adopt, held for the request until it is
admitted) and queues it. The prefix cache serves it as any hit: the request computes only what
is left, at least its last prompt token, whose logits give its first token, so sampling (seeds,
grammars, logprobs) runs on the decode replica alone, and greedy output is the colocated
engine's. Pages that do not arrive (a producer gone, a key dropped) are a miss: the request
computes them. The coordinator asks the consumer first how much of the prompt it already holds
(`match_len`), so only the pages past that are sent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from radixserve.cache.pool import KVPool
from radixserve.engine import kv_connector
from radixserve.request import FinishReason, Req
from radixserve.sched.cache_manager import CacheManager
from radixserve_kernels.threads import helper_thread

log = logging.getLogger(__name__)


class KVHandoff:
    def __init__(self, pool: KVPool, connector: kv_connector.KVConnector) -> None:
        self.pool = pool
        self.connector = connector
        self._reader = ThreadPoolExecutor(2, thread_name_prefix="radixserve-kv-take", initializer=helper_thread)
        self.exported_tokens = 0
        self.imported_tokens = 0

    @property
    def location(self) -> str:
        return self.connector.location

    # -- producer (engine thread) -------------------------------------------------------------
    def export(self, req: Req, slots: list[int]) -> None:
        """The request's prompt is computed, its KV in `slots`: publish its kv_export pages."""
        pages = req.kv_export
        assert pages is not None
        t0 = time.perf_counter()
        data = self.pool.gather(slots[pages.start : pages.upto])
        self.connector.publish(pages.key, memoryview(data.numpy()))  # type: ignore[arg-type]
        self.exported_tokens += pages.upto - pages.start
        log.debug("KV hand-off: %s: published %d tokens (%.1f MB) in %.1f ms", req.rid, pages.upto - pages.start,
                  data.numel() / 1e6, (time.perf_counter() - t0) * 1e3)

    # -- consumer (engine thread, the reader, then the engine thread) -------------------------
    def fetch(self, req: Req, done: Callable[[int, list[memoryview]], None]) -> None:
        """Take the request's kv_import pages on a reader thread, then `done(start, [pages])`
        (`done(start, [])` if they did not come)."""
        pages = req.kv_import
        assert pages is not None

        def read() -> None:
            t0 = time.perf_counter()
            data = None
            try:
                data = kv_connector.take(pages.location, pages.key, (pages.upto - pages.start) * self.pool.row_bytes)
            except Exception as e:  # a producer gone mid-transfer: a miss
                log.warning("KV hand-off: %s: taking its pages from %s failed (%r); it computes them", req.rid,
                            pages.location, e)
            else:
                if data is None:
                    log.warning("KV hand-off: %s: its pages were not at %s; it computes them", req.rid, pages.location)
                else:
                    log.debug("KV hand-off: %s: took %d tokens in %.1f ms", req.rid, pages.upto - pages.start,
                              (time.perf_counter() - t0) * 1e3)
            done(pages.start, [memoryview(data)] if data is not None else [])

        self._reader.submit(read)

    def put_back(self, req: Req, cache: CacheManager, first: int, payloads: list[memoryview]) -> None:
        """The pages taken (tokens [first, upto)) go into the pool and the prefix cache."""
        pages = req.kv_import
        if not payloads or pages is None or req.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
            return
        rows, data = pages.upto - first, torch.frombuffer(payloads[0], dtype=torch.uint8)

        def fill(at: int, slots: list[int]) -> None:
            self.pool.scatter(data, rows, slots, at - first)

        self.imported_tokens += cache.adopt(req, pages.upto, fill, have_from=first)

    def close(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)
        self.connector.close()

    def stats(self) -> dict[str, int]:
        return {"kv_exported_tokens": self.exported_tokens, "kv_imported_tokens": self.imported_tokens,
                "kv_staged_handoffs": self.connector.staged}
