"""One writer per run folder: an advisory lock held for the life of a run.

The lock is ``flock`` on ``RUN/.jmegatron-lock``, a file that also names its
holder (host, pid, start time, command). The operating system releases a
``flock`` when its process ends, however it ends (SIGKILL, a crash), so a lock
left by a dead process is stale by construction: the next run takes it over
without anyone deleting anything. On NFS (v4, and v3 with lockd) Linux maps
``flock`` to byte-range locks that the server arbitrates between hosts and
releases when a crashed client's lease expires; several hosts of one run take
the lock once, on process 0, which alone writes into the run folder.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

LOCK_NAME = ".jmegatron-lock"


class RunFolderError(RuntimeError):
    """The run folder is held by another live trainer, cannot be locked, or no longer
    suits the run once locked (the message is one line)."""


class RunLock:
    """``acquire()`` takes the folder's lock or raises RunFolderError naming the
    holder; ``release()`` (idempotent) removes the lock file and unlocks it."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> None:
        while self.fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.EWOULDBLOCK, errno.EACCES):
                    raise RunFolderError(self._refusal()) from None
                raise RunFolderError(f"cannot lock {self.path}: {err.strerror} (the file "
                                   "system of --out-dir must support flock)") from None
            # A holder releasing between our open and our flock unlinked this file: the
            # lock we hold is on a name nobody sees any more, so open the new one.
            if _same_file(fd, self.path):
                self.fd = fd
                self._write_holder()
            else:
                os.close(fd)

    def release(self) -> None:
        if self.fd is None:
            return
        # Unlink before unlocking: a waiter that opened the old file sees it is gone.
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None

    def _write_holder(self) -> None:
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": " ".join(sys.argv)}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps(holder).encode(), 0)

    def _refusal(self) -> str:
        try:
            holder = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            holder = {}
        who = (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since "
               f"{holder.get('since', '?')}") if holder else "a process that is starting"
        return (f"run folder {self.path.parent} is in use by another trainer ({who}); "
                f"wait for it to finish or stop it, or use another --name")

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        named = path.stat()
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)
