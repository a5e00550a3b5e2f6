"""`--kv-events-config`: the prefix cache's and the disk tier's KV events (cache/events.py),
published over ZMQ as vLLM publishes them (`vllm/distributed/kv_events.py`), so a subscriber
written for vLLM (NVIDIA Dynamo's KV router, llm-d's KV-cache manager) reads ours unchanged.

- A PUB socket sends each batch as three frames: the topic, an 8-byte big-endian sequence
  number (from 0 at the engine's start, one per batch), and the msgpack `KVEventBatch`
  (ts, events, data-parallel rank; array-like, the events tagged by class name). The first
  batch is an `AllBlocksCleared`: an engine that starts (or restarts) holds nothing.
- A ROUTER socket (`replay_endpoint`) answers a request of one frame, an 8-byte big-endian
  sequence number, with every batch still buffered from that number on (`buffer_steps` of
  them), each as [seq, payload], then [-1 as 8 signed bytes, b""].
- Endpoints are bound when they hold "*" or "::" or are ipc:// or inproc://, else connected.
  Data-parallel replica r publishes on the endpoints' ports + r (ipc and inproc: a "_dp<r>" suffix).

The JSON is vLLM's KVEventsConfig: `enable_kv_cache_events` (needed, as in vLLM), `publisher` ("zmq" or "null"),
`endpoint`, `replay_endpoint`, `buffer_steps`, `hwm`, `max_queue_size`, `topic`; and
radixserve's `block_size` (tokens per block told; default: the page size, or 16 for pages of
fewer tokens) and `data_parallel_rank` (set for each data-parallel replica).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import overload

import msgspec

from radixserve.cache.events import AllBlocksCleared, BlockEvents, batch
from radixserve.config import KVEventsConfig

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_BLOCK = 16  # vLLM's default block size


@overload
def offset_endpoint(endpoint: str, rank: int) -> str: ...


@overload
def offset_endpoint(endpoint: None, rank: int) -> None: ...


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """A data-parallel replica's endpoint: the port + its rank (inproc/ipc: a suffix)."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqPublisher:
    """One thread: takes the recorder's events, sends them as a batch, keeps the last
    `buffer_steps` batches for replay and answers replay requests."""

    def __init__(self, cfg: KVEventsConfig, events: BlockEvents) -> None:
        import zmq

        self.events, self.rank = events, cfg.data_parallel_rank
        self._topic = cfg.topic.encode()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=cfg.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._replay = None
        endpoint = offset_endpoint(cfg.endpoint, self.rank)
        replay = offset_endpoint(cfg.replay_endpoint, self.rank)
        try:
            self._pub.bind(endpoint) if _binds(endpoint) else self._pub.connect(endpoint)
            if replay is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay)
        except zmq.ZMQError as e:
            self._close()
            raise ValueError(f"kv_events_config: cannot open {endpoint if self._replay is None else replay}: {e}") from None
        self.endpoint, self.replay_endpoint = endpoint, replay
        self.published = 0  # batches sent
        self._seq = 0
        self._encode = msgspec.msgpack.Encoder().encode
        self._stop = threading.Event()
        self.on_batch: Callable[[], None] | None = None  # after each batch sent (the engine refreshes its stats)
        self._send([AllBlocksCleared()])
        self._thread = threading.Thread(target=self._run, name="radixserve-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events: publishing on %s%s (rank %d, %d-token blocks)", endpoint,
                 f", replay on {replay}" if replay else "", self.rank, events.block_size)

    def _send(self, events: list) -> None:
        payload = self._encode(batch(events, self.rank))
        seq = self._seq.to_bytes(8, "big")
        self._pub.send_multipart((self._topic, seq, payload))
        self._buffer.append((self._seq, payload))
        self._seq += 1
        self.published += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._serve_replay()
                if evs := self.events.take(0.05):
                    self._send(evs)
                    if self.on_batch is not None:
                        self.on_batch()
            except Exception:
                log.exception("KV events: publishing failed")
                self._stop.wait(0.1)
        if evs := self.events.take(0):  # what the engine told before it stopped
            self._send(evs)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._close()

    def _close(self) -> None:
        self._pub.close(linger=200)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
