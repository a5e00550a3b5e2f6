"""KV connectors: how a prompt's KV pages go from the engine that computed them (a prefill
replica) to the engine that continues the request (a decode replica), in prefill/decode
disaggregation (engine/data_parallel.py's --disaggregate). Bytes in, bytes out: no torch here
(the coordinator, in the server process, releases pages too); engine/kv_handoff.py moves them
between these bytes and the KV pool.

The interface is pull-shaped, as vLLM's NIXL connector (the decode side READs what the prefill
side registered) and Mooncake's transfer engine are:

    publish(key, data)               producer: the pages are readable under `key` at `location`
                                     (NIXL: register_memory + the descriptors sent in the handshake;
                                     Mooncake: register_memory of the staging buffer)
    take(location, key, nbytes)      consumer: read them, and they are gone from the producer
                                     (NIXL: initialize_xfer("READ", local, remote, agent), transfer,
                                     check_xfer_state until DONE, then a notification that frees
                                     the producer's blocks; Mooncake: transfer_sync_read)
    release(location, key)           anyone (coordinator or producer): drop them if still there;
                                     idempotent (an abort, a failed hand-off, a replica gone)

A GPU fleet's connector would implement the same three calls with the KV pool itself registered
(zero copy, RDMA/NVLink); the two here stage a copy: `shm` (a file in /dev/shm, one machine,
one copy each way) and `tcp` (the producer serves its staged pages on a socket, between
machines). Pages not taken within STAGED_TTL_S are dropped by the producer, so nothing outlives
a consumer that died mid-transfer; the coordinator also releases every hand-off it began, and
`close` drops what is left.

Keys are 128 random bits, chosen by the coordinator: unguessable, so a TCP producer (bound to
127.0.0.1 unless told otherwise) serves pages only to whoever was given their key.
"""

from __future__ import annotations

import logging
import os
import socket
import socketserver
import struct
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path

log = logging.getLogger(__name__)

CONNECTORS = ("shm", "tcp")
STAGED_TTL_S = 120.0  # pages published and never taken are dropped after this
TCP_TIMEOUT_S = 30.0
_LEN = struct.Struct(">Q")
_MISSING = (1 << 64) - 1


class KVConnector(ABC):
    location: str  # where consumers find what this producer publishes ("shm:<dir>", "tcp:<host>:<port>")

    def __init__(self) -> None:
        self._staged: dict[str, float] = {}  # key -> when published
        self._lock = threading.Lock()

    def publish(self, key: str, data: memoryview) -> None:
        self._sweep()
        self._put(key, data)
        with self._lock:
            self._staged[key] = time.monotonic()

    def _sweep(self) -> None:
        now = time.monotonic()
        with self._lock:
            old = [k for k, t in self._staged.items() if now - t > STAGED_TTL_S]
        for key in old:
            if self.drop(key):
                log.warning("KV hand-off: pages %s were never taken in %.0f s; dropped", key[:8], STAGED_TTL_S)

    def drop(self, key: str) -> bool:
        """Drop the pages under `key` if they are still here (True if they were)."""
        with self._lock:
            self._staged.pop(key, None)
        return self._drop(key)

    def close(self) -> None:
        with self._lock:
            keys = list(self._staged)
        for key in keys:
            self.drop(key)

    @property
    def staged(self) -> int:
        """Pages published and not yet taken or dropped (the taken ones are forgotten here, so
        each step's stats look at the few still waiting only)."""
        with self._lock:
            for key in [k for k in self._staged if not self._there(k)]:
                del self._staged[key]
            return len(self._staged)

    def _there(self, key: str) -> bool:
        return True

    @abstractmethod
    def _put(self, key: str, data: memoryview) -> None: ...

    @abstractmethod
    def _drop(self, key: str) -> bool: ...


# -- shared memory: producer and consumer on one machine ------------------------------------------
def _shm_dir() -> Path:
    d = Path("/dev/shm")
    return d if d.is_dir() and os.access(d, os.W_OK) else Path(tempfile.gettempdir())


def _shm_path(directory: str, key: str) -> Path:
    if not key.isalnum():
        raise ValueError(f"KV hand-off key: letters and digits only, got {key!r}")
    return Path(directory) / f"radixserve-kv-{key}"


class ShmConnector(KVConnector):
    def __init__(self) -> None:
        super().__init__()
        self.dir = str(_shm_dir())
        self.location = f"shm:{self.dir}"

    def _put(self, key: str, data: memoryview) -> None:
        path = _shm_path(self.dir, key)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.rename(tmp, path)  # a consumer sees all of it or nothing
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _there(self, key: str) -> bool:
        return _shm_path(self.dir, key).exists()

    def _drop(self, key: str) -> bool:
        try:
            _shm_path(self.dir, key).unlink()
            return True
        except FileNotFoundError:
            return False  # taken


def _shm_take(directory: str, key: str, nbytes: int) -> bytearray | None:
    path = _shm_path(directory, key)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return None
    with f:
        path.unlink(missing_ok=True)  # taken: the open file stays readable
        buf = bytearray(nbytes)
        got = f.readinto(buf)
        return buf if got == nbytes and not f.read(1) else None


# -- TCP: the producer serves its staged pages ----------------------------------------------------
class TcpConnector(KVConnector):
    """A request is one line, `GET <key>` (answered with the length, 8 bytes big-endian, then the
    pages; a missing key's length is 2**64-1) or `DROP <key>`; one request per connection."""

    def __init__(self, host: str = "127.0.0.1", advertise: str | None = None) -> None:
        super().__init__()
        self._data: dict[str, memoryview] = {}
        owner = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline(256).decode("ascii", "replace").split()
                if len(line) != 2 or line[0] not in ("GET", "DROP"):
                    return
                data = owner._pop(line[1])
                if line[0] == "GET":
                    self.wfile.write(_LEN.pack(_MISSING if data is None else len(data)))
                    if data is not None:
                        self.wfile.write(data)

        self._server = socketserver.ThreadingTCPServer((host, 0), Handler)
        self._server.daemon_threads = True
        port = self._server.server_address[1]
        self.location = f"tcp:{advertise or host}:{port}"
        threading.Thread(target=self._server.serve_forever, name="radixserve-kv-serve", daemon=True).start()

    def _pop(self, key: str) -> memoryview | None:
        with self._lock:
            self._staged.pop(key, None)
            return self._data.pop(key, None)

    def _put(self, key: str, data: memoryview) -> None:
        with self._lock:
            self._data[key] = data

    def _drop(self, key: str) -> bool:
        return self._pop(key) is not None

    def close(self) -> None:
        super().close()
        self._server.shutdown()
        self._server.server_close()


def _tcp_call(address: str, line: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=TCP_TIMEOUT_S)
    sock.sendall(line.encode("ascii") + b"\n")
    return sock


def _tcp_take(address: str, key: str, nbytes: int) -> bytearray | None:
    with _tcp_call(address, f"GET {key}") as sock:
        head = _recv(sock, _LEN.size)
        if head is None or (n := _LEN.unpack(head)[0]) != nbytes:
            return None
        return _recv(sock, n)


def _recv(sock: socket.socket, n: int) -> bytearray | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        r = sock.recv_into(view[got:])
        if r == 0:
            return None
        got += r
    return buf


# -- either -----------------------------------------------------------------------------------------
def make_connector(kind: str, host: str = "127.0.0.1") -> KVConnector:
    if kind == "shm":
        return ShmConnector()
    if kind == "tcp":
        return TcpConnector(host)
    raise ValueError(f"kv_connector: {kind!r} is not one of {', '.join(CONNECTORS)}")


def take(location: str, key: str, nbytes: int) -> bytearray | None:
    """The pages published under `key` at `location`, if they are all there (then they are gone
    from the producer); None if not (never published, dropped, taken, or not nbytes long)."""
    kind, _, where = location.partition(":")
    if kind == "shm":
        return _shm_take(where, key, nbytes)
    if kind == "tcp":
        return _tcp_take(where, key, nbytes)
    raise ValueError(f"KV hand-off location: {location!r} is not shm:... or tcp:...")


def release(location: str, key: str) -> None:
    """Drop the pages under `key` at `location` if they are still there (never raises)."""
    kind, _, where = location.partition(":")
    try:
        if kind == "shm":
            _shm_path(where, key).unlink(missing_ok=True)
        elif kind == "tcp":
            _tcp_call(where, f"DROP {key}").close()
    except (OSError, ValueError):
        pass  # a producer gone takes its pages with it
