"""What the disk tier trusts, checked at start (a ValueError naming the path and the fix):

- `private_dir(path)`: the directory is this user's alone: made 0700 (its missing parents
  too), or an existing one checked: a directory, owned by this process's user, with no group or
  other permission bits (else another user could read tenants' KV there, or plant blocks);
- `DirLock(dir)`: one server per directory: an exclusive flock on `<dir>/.lock` for as long as
  the store is open (the kernel drops it when the process dies, however it dies);
- `load_key(file)`: the key that signs every block (HMAC-SHA256), kept outside the directory:
  32 random bytes made once (0600, put in place with a hard link, so two starts at once agree on
  one key), and checked to be this user's and private whenever it is read.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import stat
import weakref
from pathlib import Path

KEY_BYTES = 32
LOCK_NAME = ".lock"


def private_dir(path: str | os.PathLike[str], option: str = "kv_disk_dir") -> Path:
    """`path` as a directory only this user can read or write (see the module docstring)."""
    p = Path(path).expanduser().absolute()
    make_dirs(p)
    check_private(p, os.stat(p), option)
    return p


def is_private_dir(st: os.stat_result) -> bool:
    """A directory owned by this process's user with no group or other permission bits (the
    disk tier's, the KV hand-off's staging, the model-parallel rendezvous)."""
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def check_private(p: Path, st: os.stat_result, option: str) -> None:
    """is_private_dir, or a ValueError saying which part fails and how to fix it."""
    me = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{option}: {p} is not a directory")
    if st.st_uid != me:
        raise ValueError(f"{option}: {p} is owned by uid {st.st_uid}, not by this server's user (uid {me}): "
                         "the disk tier keeps tenants' KV there; give it a directory of its own")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise ValueError(f"{option}: {p} has mode {mode:04o}: other users could read tenants' KV there or plant "
                         f"blocks; it must be private to this server's user (chmod 700 {p}), or give a new directory")


def make_dirs(p: Path) -> None:
    """Make `p` and its missing parents, each 0700 (whatever the umask)."""
    missing = []
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:  # made meanwhile (another replica starting): checked like any existing one
            continue
        os.chmod(d, 0o700)


class DirLock:
    """An exclusive lock on a directory, held until `release`, the lock's garbage collection or
    the process's end."""

    def __init__(self, root: Path, option: str = "kv_disk_dir") -> None:
        path = root / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise ValueError(f"{option}: cannot open its lock file {path}: {e}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"{option}: its lock file {path} is not a regular file")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(f"{option}: {root} is in use by another radixserve server (it holds {path}); give each "
                             "server a directory of its own") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())  # who holds it, for a person looking
        self._close = weakref.finalize(self, os.close, fd)

    def release(self) -> None:
        self._close()  # closes the file (and so lets the lock go) once, however often called


def load_key(file: Path) -> bytes:
    """The key in `file`, made there first if there is none (see the module docstring)."""
    try:
        return _read_key(file)
    except FileNotFoundError:
        pass
    make_dirs(file.parent)
    tmp = file.with_name(f".{file.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
        os.link(tmp, file)
    except FileExistsError:  # another start made it first: its key is the key
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return _read_key(file)


def _read_key(file: Path) -> bytes:
    what = f"the KV disk tier's key file {file}"
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ValueError(f"{what} cannot be opened ({e}); it must be a regular file, not a link") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise ValueError(f"{what} must be a regular file of this server's user (uid {os.geteuid()}) with mode "
                             f"0600; it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}")
        key = f.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise ValueError(f"{what} holds {len(key)} bytes, not {KEY_BYTES}: delete it (a new key is made; the blocks "
                         "stored so far become misses)")
    return key
