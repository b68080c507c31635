"""One writer per checkpoint directory: a lock file that names the process holding it.

Two jobs writing one directory (a restarted job and its zombie predecessor)
would overwrite or delete each other's checkpoints. So a writer holds an
exclusive ``fcntl.flock`` on a lock file while it writes, and writes its
host, pid and start time into the file so that a second writer's error can
name it. The kernel releases the lock when its holder exits, however it
exits (SIGKILL included): a lock file that a dead process left behind is not
locked, and the next writer takes it over without having to guess from a
pid whether its holder is alive (on NFS the server releases it once the
dead client's lease expires).

The holder deletes the file when it releases the lock. A process that opened
the file just before that and locks it just after holds a lock on a deleted
file, so :meth:`WriterLock.acquire` checks that the path still names the
file it locked, and starts again otherwise.

The lock is the taking process's own. The file is opened without following
links (a link planted at its path is refused, never written through), and
without needing write access to read (:class:`LockUnavailable` says why a
process that cannot write may still read). A child of ``os.fork`` closes its
inherited descriptor at once, without unlocking (an ``flock`` is shared by
every descriptor of one open file): its parent keeps the lock, and a worker
that outlives a killed writer does not hold it. A file removed or replaced
while its writer lives is noticed by :meth:`WriterLock.check` before each
save, which refuses to go on rather than let two writers write.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), ".treeopt-lock")
    >>> first, second = WriterLock(path, "/data/run"), WriterLock(path, "/data/run")
    >>> first.acquire()
    >>> try:
    ...     second.acquire()
    ... except CheckpointInUseError as e:
    ...     print(str(e).split(":")[0])
    Another writer holds the checkpoint directory /data/run
    >>> first.release(); second.acquire(); second.held
    True
    >>> second.release(); os.path.exists(path)
    False
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import stat
import time
import weakref
from typing import Any

from treeopt.errors import CheckpointError, CheckpointInUseError

__all__ = ["TIDYING", "LockUnavailable", "WriterLock", "refuse_link"]


# A manager that opens a directory no one writes holds the lock for a moment to tidy it; a
# writer that meets such a holder waits for it (polling), up to this long, instead of failing.
TIDYING = "tidying"
_WAIT_FOR_TIDYING_S = 30.0
_POLL_S = 0.05


class LockUnavailable(PermissionError):
    """This process cannot write the lock file (a read-only file system or directory, a file it may
    not write): it may read the checkpoint directory, never write it."""


def refuse_link(path: str) -> None:
    """Raises :class:`CheckpointError` naming ``path`` if it is a symbolic link: nothing under a
    checkpoint directory is ever written, moved or deleted through a link."""
    if os.path.islink(path):
        raise CheckpointError(
            f"{path} is a symbolic link (to {os.readlink(path)!r}); treeopt never writes, moves or "
            "deletes through a link in a checkpoint directory. Remove the link."
        )


_LOCKS: weakref.WeakSet[WriterLock] = weakref.WeakSet()


def _forget_in_child() -> None:
    """In a fork()ed child: close every inherited lock descriptor, never unlocking (the parent holds it)."""
    for lock in list(_LOCKS):
        lock.abandon()


os.register_at_fork(after_in_child=_forget_in_child)


def _record(purpose: str) -> bytes:
    """What the lock file says about its holder: this process, and what it holds the lock for."""
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    record = {"host": socket.gethostname(), "pid": os.getpid(), "since": now, "purpose": purpose}
    return json.dumps(record).encode()


def _read(fd: int) -> Any:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        return None


def _holder(record: Any) -> str:
    """The holder a lock file's record names, in words."""
    try:
        host, pid, since = record["host"], int(record["pid"]), record["since"]
    except (TypeError, KeyError, ValueError):
        return "a process that has not written its name yet (it is starting)"
    if host == socket.gethostname() and pid == os.getpid():
        return (
            f"this process (pid {pid} on host {host}, since {since}): another CheckpointManager "
            "or save of this directory is still open in it; close that one first"
        )
    return f"process {pid} on host {host} (since {since})"


class WriterLock:
    """The exclusive right to write the checkpoint ``directory``, held through the lock file ``path``."""

    def __init__(self, path: str, directory: str):
        self.path = path
        self.directory = directory
        self._fd: int | None = None
        self._pid = 0  # the process that took it
        _LOCKS.add(self)

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self, purpose: str = "writing") -> None:
        """Takes the lock, or raises :class:`CheckpointInUseError` naming its holder.

        It waits only for a holder that is tidying the directory (a moment);
        for a writer it fails at once.
        """
        deadline = time.monotonic() + _WAIT_FOR_TIDYING_S
        while self._fd is None:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                record = _read(fd)
                os.close(fd)
                tidying = isinstance(record, dict) and record.get("purpose") == TIDYING
                if tidying and purpose != TIDYING and time.monotonic() < deadline:
                    time.sleep(_POLL_S)
                    continue
                raise self._in_use(_holder(record)) from None
            if not self._is_at_path(fd):  # its previous holder deleted it meanwhile: lock the one there now
                os.close(fd)
                continue
            self._fd, self._pid = fd, os.getpid()
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, _record(purpose), 0)
            except OSError:  # a full disk: the lock holds all the same, its file just does not name us
                pass

    def _open(self) -> int:
        """The lock file's descriptor: never through a link, and a clear error where it cannot be written."""
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP or os.path.islink(self.path):
                refuse_link(self.path)
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise LockUnavailable(
                    e.errno,
                    f"Cannot write the checkpoint directory {self.directory}: its lock file "
                    f"{self.path} cannot be opened for writing ({os.strerror(e.errno)}). Reading "
                    "(listing and restoring steps) works without it; saving needs write access",
                    self.path,
                ) from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointError(f"{self.path} is not a regular file: it cannot be {self.directory}'s lock.")
        return fd

    def still_held(self) -> bool:
        """Whether this object holds the lock and its file is still the one at the path.

        False once the file was removed or replaced by hand: another writer may
        hold the lock at the path now, and what is in the directory may be its own.
        """
        fd = self._fd
        return fd is not None and self._is_at_path(fd)

    def check(self) -> None:
        """Raises :class:`CheckpointInUseError` if the held lock file was removed or replaced at its path.

        Another writer could then take a new lock beside this one; writing on would lose steps.
        """
        if self._fd is None or self.still_held():
            return
        raise CheckpointInUseError(
            f"The lock file {self.path} of the checkpoint directory {self.directory}, held by this "
            "process, was removed or replaced while it was writing: another writer may now write "
            "the directory too, so this one stops rather than overwrite its steps. Close this "
            "manager; find out what deleted the lock file.",
            directory=self.directory,
            holder="unknown (the lock file was removed or replaced)",
        )

    def _in_use(self, holder: str) -> CheckpointInUseError:
        return CheckpointInUseError(
            f"Another writer holds the checkpoint directory {self.directory}: {holder}. Its lock "
            f"file is {self.path}. Two writers on one directory would overwrite and delete each "
            "other's checkpoints. Stop the other job (a previous run of this one still running?) "
            "or write to another directory; reading is unaffected. The lock is released when its "
            "holder closes the directory or exits, however it exits.",
            directory=self.directory,
            holder=holder,
        )

    def _is_at_path(self, fd: int) -> bool:
        try:
            here, held = os.lstat(self.path), os.fstat(fd)
        except FileNotFoundError:
            return False
        return (here.st_ino, here.st_dev) == (held.st_ino, held.st_dev)

    def abandon(self) -> None:
        """Lets the lock go as the death of the process would: the file stays, for the next writer to take over."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:
        try:
            self.abandon()  # dropped without release (a manager never closed)
        except Exception:  # at interpreter exit the os module may be gone: the kernel closes it then
            pass

    def release(self) -> None:
        """Deletes the lock file and releases the lock (a no-op when not held, or held by another process).

        A lock file no longer at its path (replaced by hand) is not deleted: it is another's now.
        """
        if self._fd is None or self._pid != os.getpid():
            self.abandon()  # an inherited copy: the lock is its taker's
            return
        fd, self._fd = self._fd, None
        if not self._is_at_path(fd):
            os.close(fd)
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        finally:
            os.close(fd)
