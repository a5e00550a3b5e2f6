"""A replica's own `radixserve serve` on 127.0.0.1 (an ephemeral port), as a child process.

The child exits when the replica process is gone, even by SIGKILL (`ray.kill`): it watches its
parent's pid (radixserve.ray.child), and its engine process dies with it. It is started and
watched from a thread of its own; its output goes to the replica's stderr (Ray's replica log),
and the last lines are kept for the error a failed start raises.

What a replica's spec holds beyond flags reaches the server off its command line (which every
local user can read in /proc): the tenants through a pipe, the keys in its environment (the
replica's own environment's keys left out), and its --kv-disk-dir is a folder of its own
under the user's (disk_slot.py), whose lock the server inherits.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections import deque

from radixserve.ray import disk_slot
from radixserve.ray.options import ReplicaSpec
from radixserve.server.serve import SECRET_ENV

READY = re.compile(r"radixserve ready at http://\S+?:(\d+) ")
TAIL_LINES = 40


def replica_server(spec: ReplicaSpec, start_timeout: float = 600.0) -> LocalServer:
    """The server of a replica built from `spec` (see the module docstring)."""
    argv, lock = list(spec.argv), None
    if spec.kv_disk_dir is not None:
        folder, lock = disk_slot.claim(spec.kv_disk_dir)
        argv += ["--kv-disk-dir", folder]
    return LocalServer(argv, start_timeout, spec.tenants, dict(spec.secrets), lock)


class LocalServer:
    def __init__(self, argv: list[str], start_timeout: float = 600.0, tenants: bytes | None = None,
                 env: dict[str, str] | None = None, lock_fd: int | None = None) -> None:
        """Start `radixserve serve ARGV` and wait until it listens (RuntimeError, with the
        server's last output, if it exits or times out first). `tenants` (a tenants file's
        JSON) reaches the server through a pipe, as --tenants /dev/fd/N: never on disk. `env`:
        variables set in its environment (the keys). `lock_fd` (owned from here on) is handed
        to the server, which holds it while it runs."""
        self.argv, self._tenants, self._lock_fd = argv, tenants, lock_fd
        self._env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV.values()} | (env or {})
        self.url: str | None = None
        self.exit_code: int | None = None
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._proc: subprocess.Popen[bytes] | None = None
        self._started = threading.Event()
        self._keeper = threading.Thread(target=self._keep, name="radixserve-replica-server", daemon=True)
        self._keeper.start()
        self._started.wait(start_timeout)
        if self.url is None:
            self.stop(grace=0)
            why = f"exited with code {self.exit_code}" if self.exit_code is not None else f"not ready in {start_timeout:g} s"
            raise RuntimeError(f"the replica's radixserve server {why}:\n" + "\n".join(self.tail))

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def gone(self) -> str | None:
        """Why the server is gone (it exited), or None while it runs."""
        code = self.exit_code if self.exit_code is not None else (self._proc.poll() if self._proc else None)
        return None if code is None else f"its radixserve server exited with code {code}"

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM (the server drains for up to `grace` s), then SIGKILL."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM if grace > 0 else signal.SIGKILL)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._keeper.join(5.0)  # it reads the server's last output, then ends

    def _keep(self) -> None:
        cmd = [sys.executable, "-m", "radixserve.ray.child", str(os.getpid()), "--log-level", "info", *self.argv,
               "--host", "127.0.0.1", "--port", "0"]
        read, write = os.pipe() if self._tenants is not None else (-1, -1)
        if self._tenants is not None:
            cmd += ["--tenants", f"/dev/fd/{read}"]  # not .toml: read as JSON
        inherit = [fd for fd in (read, self._lock_fd) if fd is not None and fd >= 0]
        try:
            proc = self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                 stderr=subprocess.STDOUT, pass_fds=inherit, env=self._env)
        except OSError as e:
            self.tail.append(f"cannot start {cmd[0]}: {e}")
            self.exit_code = -1
            self._started.set()
            return
        finally:
            for fd in inherit:
                os.close(fd)
        if write >= 0:
            threading.Thread(target=_feed, args=(write, self._tenants), name="radixserve-replica-tenants", daemon=True).start()
        assert proc.stdout is not None
        for raw in proc.stdout:  # until the server exits (and closes its output)
            line = raw.decode("utf-8", "replace").rstrip()
            sys.stderr.write(line + "\n")
            self.tail.append(line)
            if self.url is None and (m := READY.search(line)):
                self.url = f"http://127.0.0.1:{m.group(1)}"
                self._started.set()
        self.exit_code = proc.wait()
        self._started.set()


def _feed(fd: int, data: bytes) -> None:
    """Write `data` into the pipe the server reads its tenants from (it may be larger than the
    pipe's buffer: the server reads it while it starts)."""
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError:  # the server exited first: its output says why
        pass
