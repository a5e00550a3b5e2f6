"""`python -m radixserve.ray.child PARENT_PID serve-args...`: a replica's `radixserve serve`,
which exits when the replica process (PARENT_PID) is gone, as an engine process exits with its
server (engine.process.die_with_parent); the server's engine process dies with it in turn."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from radixserve.engine.process import die_with_parent
    from radixserve.server.serve import main as serve_main

    die_with_parent(int(argv[0]))
    return serve_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
