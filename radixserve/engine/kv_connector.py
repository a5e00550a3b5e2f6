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

Against other local users and idle clients: a shm producer stages in a private directory of
its own (0700, under /dev/shm), creates each file O_EXCL|O_NOFOLLOW 0600, and the consumer opens
it O_NOFOLLOW|O_NONBLOCK and takes only a regular file of ours of the expected size; anything
else there is a miss (the decode replica computes those pages). A TCP producer serves at most
TCP_MAX_CONNECTIONS connections at once (one more is closed at once), gives each
TCP_HANDLER_TIMEOUT_S to send its request line and each chunk of pages that long to be read,
and reads at most one short line.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import socketserver
import stat
import struct
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path

from radixserve.cache.disk_guard import is_private_dir

log = logging.getLogger(__name__)

CONNECTORS = ("shm", "tcp")
STAGED_TTL_S = 120.0  # pages published and never taken are dropped after this
TCP_TIMEOUT_S = 30.0
TCP_HANDLER_TIMEOUT_S = 10.0  # a connection's request line, and each chunk of pages sent to it
TCP_MAX_CONNECTIONS = 32  # served at once by a TCP producer; one more is closed at once
MAX_REQUEST_BYTES = 128  # "GET <key>\n"
MAX_KEY_CHARS = 64
_CHUNK = 4 << 20
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


def _check_key(key: str) -> str:
    if not (key.isascii() and key.isalnum() and len(key) <= MAX_KEY_CHARS):
        raise ValueError(f"KV hand-off key: up to {MAX_KEY_CHARS} letters and digits, got {key[:80]!r}")
    return key


def _shm_path(directory: str, key: str) -> Path:
    return Path(directory) / f"radixserve-kv-{_check_key(key)}"


class ShmConnector(KVConnector):
    """Pages staged as files in a private directory of this producer's (0700, removed at close):
    other users cannot list, read, pre-create or replace them."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="radixserve-kv-", dir=_shm_dir())
        self.location = f"shm:{self.dir}"

    def _put(self, key: str, data: memoryview) -> None:
        """Raises (FileExistsError...) where the name is taken: that hand-off fails, a miss."""
        path = _shm_path(self.dir, key)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
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

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _shm_take(directory: str, key: str, nbytes: int) -> bytearray | None:
    """The pages, if `directory` is a private one of ours and the file in it a regular file of
    ours, `nbytes` long; None otherwise (a symlink, a FIFO, another user's file: never followed,
    never waited on)."""
    path = _shm_path(directory, key)
    try:
        if not is_private_dir(os.lstat(directory)):
            log.warning("KV hand-off: %s is not a private directory of ours; its pages are not taken", directory)
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # not there (dropped, taken), or a symlink
        return None
    with os.fdopen(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        path.unlink(missing_ok=True)  # taken: the open file stays readable
        if st.st_size != nbytes:
            return None
        buf = bytearray(nbytes)
        got = f.readinto(buf)
        return buf if got == nbytes and not f.read(1) else None


# -- TCP: the producer serves its staged pages ----------------------------------------------------
class _BoundedServer(socketserver.ThreadingTCPServer):
    """A thread per connection, at most `limit` at once: a connection over it is closed at once
    (its client sees the pages missing: a miss)."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: a burst of connections is accepted (and refused) at once

    def __init__(self, address: tuple[str, int], handler: type[socketserver.BaseRequestHandler], limit: int) -> None:
        self.slots = threading.BoundedSemaphore(limit)
        self.refused = 0
        super().__init__(address, handler)

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        if not self.slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: object, client_address: object) -> None:
        log.debug("KV hand-off: a connection from %s failed", client_address, exc_info=True)


def _read_line(sock: socket.socket, timeout_s: float) -> bytes | None:
    """One request line (without its newline) within `timeout_s` in all; None if it does not
    come whole, in time, within MAX_REQUEST_BYTES."""
    deadline = time.monotonic() + timeout_s
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or len(buf) > MAX_REQUEST_BYTES:
            return None
        sock.settimeout(left)
        chunk = sock.recv(MAX_REQUEST_BYTES + 1 - len(buf))
        if not chunk:
            return None
        buf += chunk
    line = buf.partition(b"\n")[0]
    return line if len(line) <= MAX_REQUEST_BYTES else None


class TcpConnector(KVConnector):
    """A request is one line, `GET <key>` (answered with the length, 8 bytes big-endian, then the
    pages; a missing key's length is 2**64-1) or `DROP <key>`; one request per connection."""

    def __init__(self, host: str = "127.0.0.1", advertise: str | None = None) -> None:
        super().__init__()
        self._data: dict[str, memoryview] = {}
        owner = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    owner._serve(self.request)
                except OSError:  # a client gone, or too slow (TCP_HANDLER_TIMEOUT_S)
                    pass

        self._server = _BoundedServer((host, 0), Handler, TCP_MAX_CONNECTIONS)
        port = self._server.server_address[1]
        self.location = f"tcp:{advertise or host}:{port}"
        threading.Thread(target=self._server.serve_forever, name="radixserve-kv-serve", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        raw = _read_line(sock, TCP_HANDLER_TIMEOUT_S)
        line = raw.decode("ascii", "replace").split() if raw is not None else []
        if len(line) != 2 or line[0] not in ("GET", "DROP"):
            return
        data = self._pop(line[1])
        if line[0] == "GET":
            sock.settimeout(TCP_HANDLER_TIMEOUT_S)  # each sendall below: its whole chunk within it
            if data is None:
                sock.sendall(_LEN.pack(_MISSING))
                return
            view = data.cast("B")
            sock.sendall(_LEN.pack(len(view)))
            for at in range(0, len(view), _CHUNK):
                sock.sendall(view[at : at + _CHUNK])

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


def _tcp_call(address: str, verb: str, key: str) -> socket.socket:
    _check_key(key)
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=TCP_TIMEOUT_S)
    sock.sendall(f"{verb} {key}\n".encode("ascii"))
    return sock


def _tcp_take(address: str, key: str, nbytes: int) -> bytearray | None:
    with _tcp_call(address, "GET", key) as sock:
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


def forget(location: str) -> None:
    """A producer gone (killed): remove its shm staging directory, if it is a private one of
    ours (never raises)."""
    kind, _, where = location.partition(":")
    if kind != "shm" or not os.path.basename(where).startswith("radixserve-kv-"):
        return
    try:
        if is_private_dir(os.lstat(where)):
            shutil.rmtree(where, ignore_errors=True)
    except OSError:
        pass


def release(location: str, key: str) -> None:
    """Drop the pages under `key` at `location` if they are still there (never raises)."""
    kind, _, where = location.partition(":")
    try:
        if kind == "shm":
            _shm_path(where, key).unlink(missing_ok=True)
        elif kind == "tcp":
            _tcp_call(where, "DROP", key).close()
    except (OSError, ValueError):
        pass  # a producer gone takes its pages with it
