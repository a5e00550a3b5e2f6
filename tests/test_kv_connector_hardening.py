"""The KV connectors against idle clients and other local users (issue 44, finding 10): a TCP
producer drops a client that sends nothing, serves a bounded number of connections (one more is
closed at once: a miss, never a thread), and a shm producer stages in a private directory where
no name can be planted, read or followed; whatever is found at a name is a miss, never a hang."""

from __future__ import annotations

import os
import secrets
import socket
import stat
import threading
import time

import pytest

from radixserve.engine import kv_connector

DATA = os.urandom(256 << 10)


def _idle(c: kv_connector.TcpConnector) -> socket.socket:
    host, _, port = c.location.removeprefix("tcp:").rpartition(":")
    return socket.create_connection((host, int(port)), timeout=5)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def _handed_over(c: kv_connector.KVConnector) -> bool:
    key = secrets.token_hex(16)
    c.publish(key, memoryview(DATA))
    return bytes(kv_connector.take(c.location, key, len(DATA)) or b"") == DATA


def test_an_idle_tcp_client_is_dropped_after_the_timeout_and_blocks_nobody(monkeypatch):
    monkeypatch.setattr(kv_connector, "TCP_HANDLER_TIMEOUT_S", 0.5, raising=False)
    c = kv_connector.TcpConnector()
    try:
        idle, trickle = _idle(c), _idle(c)
        assert _handed_over(c)  # while both wait on their request line
        t0 = time.monotonic()
        for _ in range(4):  # a byte now and then, never a whole line: the deadline is for the line
            trickle.sendall(b"G")
            time.sleep(0.2)
        assert _closed_within(idle, 3) and _closed_within(trickle, 3)
        assert time.monotonic() - t0 < 3
    finally:
        c.close()


def test_many_idle_connections_hold_no_more_threads_than_the_bound(monkeypatch):
    monkeypatch.setattr(kv_connector, "TCP_MAX_CONNECTIONS", 4, raising=False)
    monkeypatch.setattr(kv_connector, "TCP_HANDLER_TIMEOUT_S", 1.5, raising=False)
    before = threading.active_count()
    c = kv_connector.TcpConnector()
    socks = []
    try:
        t0 = time.monotonic()
        socks = [_idle(c) for _ in range(40)]
        assert time.monotonic() - t0 < 1  # a burst is not held in a short listen backlog
        refused = [s for s in socks if _closed_within(s, 0.2)]
        assert len(refused) == 36  # over the bound: closed at once
        assert threading.active_count() - before <= 4 + 1  # the bound, and the accept loop
        key = secrets.token_hex(16)
        c.publish(key, memoryview(DATA))
        t0 = time.monotonic()
        assert kv_connector.take(c.location, key, len(DATA)) is None  # full: a miss, at once
        assert time.monotonic() - t0 < 1
        assert all(_closed_within(s, 5) for s in socks if s not in refused)  # the idle ones time out...
        assert _handed_over(c)  # ...and their places serve again
    finally:
        for s in socks:
            s.close()
        c.close()


def test_a_request_line_is_bounded(monkeypatch):
    c = kv_connector.TcpConnector()
    try:
        s = _idle(c)
        s.sendall(b"GET " + b"a" * 10_000)  # no newline within the bound: dropped, nothing read on
        assert _closed_within(s, 3)
        with pytest.raises(ValueError, match="key"):
            kv_connector.take(c.location, "a" * 65, 1)
    finally:
        c.close()


def test_shm_pages_are_staged_in_a_private_directory_of_their_own():
    c = kv_connector.ShmConnector()
    try:
        st = os.lstat(c.dir)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
        key = secrets.token_hex(16)
        c.publish(key, memoryview(DATA))
        assert stat.S_IMODE(os.stat(os.path.join(c.dir, f"radixserve-kv-{key}")).st_mode) == 0o600
        assert bytes(kv_connector.take(c.location, key, len(DATA)) or b"") == DATA
    finally:
        c.close()
    assert not os.path.exists(c.dir)


def test_a_planted_name_is_never_followed_and_fails_that_hand_off_only(tmp_path):
    c = kv_connector.ShmConnector()
    victim = tmp_path / "victim"
    victim.write_bytes(DATA)
    try:
        key = secrets.token_hex(16)  # the producer's side: a symlink where it stages
        os.symlink(victim, os.path.join(c.dir, f"radixserve-kv-{key}.tmp"))
        with pytest.raises(OSError):
            c.publish(key, memoryview(b"x" * 100))
        assert victim.read_bytes() == DATA
        assert _handed_over(c)  # the next hand-off goes through

        linked = secrets.token_hex(16)  # the consumer's side: a symlink, a wrong size
        os.symlink(victim, os.path.join(c.dir, f"radixserve-kv-{linked}"))
        assert kv_connector.take(c.location, linked, len(DATA)) is None and victim.read_bytes() == DATA
        short = secrets.token_hex(16)
        c.publish(short, memoryview(DATA[:100]))
        assert kv_connector.take(c.location, short, len(DATA)) is None
        assert kv_connector.take("shm:/dev/shm", short, 100) is None  # not a private directory of ours
    finally:
        c.close()


def test_a_fifo_at_a_name_is_a_miss_not_a_hang():
    c = kv_connector.ShmConnector()
    key = secrets.token_hex(16)
    fifo = os.path.join(c.dir, f"radixserve-kv-{key}")
    os.mkfifo(fifo, 0o600)
    got: list = []
    t = threading.Thread(target=lambda: got.append(kv_connector.take(c.location, key, 10)), daemon=True)
    try:
        t.start()
        t.join(5)
        hung = t.is_alive()
        if hung:  # release it: open the FIFO's other end
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        assert not hung and got == [None]
    finally:
        c.close()


def test_a_killed_producers_staging_directory_is_forgotten(tmp_path):
    c = kv_connector.ShmConnector()
    c.publish(secrets.token_hex(16), memoryview(DATA))
    kv_connector.forget(c.location)  # what the coordinator does when the replica dies
    assert not os.path.exists(c.dir)
    c.close()
    shared, other = tmp_path / "radixserve-kv-shared", tmp_path / "elsewhere"
    shared.mkdir(mode=0o755)
    other.mkdir(mode=0o700)
    for d in (shared, other):  # never a directory that is not a private staging one
        kv_connector.forget(f"shm:{d}")
        assert d.is_dir()
