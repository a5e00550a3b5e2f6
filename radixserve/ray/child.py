"""`python -m radixserve.ray.child PARENT_PID radixserve-args...`: a replica's `radixserve serve`,
killed when the replica process dies (Linux PR_SET_PDEATHSIG; the server's engine process dies
with the server in turn). PARENT_PID closes the race with a parent that died before prctl."""

from __future__ import annotations

import os
import signal
import sys


def die_with_parent(parent_pid: int) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the replica stops its server on shutdown only
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def main(argv: list[str]) -> int:
    die_with_parent(int(argv[0]))
    from radixserve.server.cli import main as cli_main

    return cli_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
