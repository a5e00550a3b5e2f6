"""A replica's own folder under the user's --kv-disk-dir. Replicas on one node given one folder
would share it: one server's start deletes the other's temporary files (writes in flight), and
each bounds and indexes the folder as if it were alone. So each replica's server gets
DIR/ray-replica-N, the lowest N whose lock file DIR/ray-replica-N.lock no live process holds
(an exclusive flock). The server process inherits the lock (local_server.py) and holds it while
it runs; a replica that replaces a dead one takes its folder over, with the blocks it wrote (the
disk tier outlives a process by design), as a restarted server does.

DIR is made or checked private (cache.disk_guard.private_dir: 0700, ours), as data parallelism
does with its replicas' folders' parent: whoever can write DIR could plant KV blocks.
"""

from __future__ import annotations

import fcntl
import os

from radixserve.cache.disk_guard import private_dir

MAX_SLOTS = 1024  # replicas of one node under one folder


def claim(root: str) -> tuple[str, int]:
    """(the replica's folder, the lock's file descriptor: close it once the server holds it).
    ValueError for a folder that is not ours or is open to others, or that has no free slot."""
    base = private_dir(root)
    for n in range(MAX_SLOTS):
        fd = os.open(base / f"ray-replica-{n}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        except BaseException:
            os.close(fd)
            raise
        return str(base / f"ray-replica-{n}"), fd
    raise ValueError(f"kv_disk_dir: all {MAX_SLOTS} replica folders of {root} are in use")
