"""The directory of a ``CheckpointManager``: one writer, no debris, only complete steps.

- **One writer.** A manager takes the directory's :class:`~treeopt._checkpoint.writer_lock.WriterLock`
  (the file ``.treeopt-lock``) at its first save and keeps it until it is
  closed; a second writer's save raises
  :class:`~treeopt.errors.CheckpointInUseError` naming the first. In a
  multi-process job (``jax.distributed``) the processes write each checkpoint
  together: only the primary process takes the lock, and the others learn
  its outcome, so the job is one writer.
- **No debris.** What a failed or killed save left (orbax's
  ``N.orbax-checkpoint-tmp`` directories, steps ``max_to_keep`` was deleting
  in ``.treeopt-deleted``) is removed by the writer before each save and
  when it waits or closes, and when a manager opens a directory no one is
  writing. Only a holder of the lock removes anything, so a reader opening
  the directory never deletes what a live writer is writing; and a writer
  whose lock file was removed or replaced by hand removes nothing more, so
  it never deletes a second writer's saves in flight.
- **Only complete steps.** A step directory without orbax's
  ``_CHECKPOINT_METADATA`` or the ``optimizer`` item (made by hand, or by an
  interrupted save in a layout orbax does not mark) is not a step: it is left
  out of the steps with a warning naming it, and moved into
  ``.treeopt-incomplete`` (never deleted) when the directory is tidied, so it
  cannot stand in for the latest step or block saving its number again.
- **Nothing outside.** Nothing is written, moved or deleted through a
  symbolic link: the lock is opened without following one, and a link where
  a housekeeping folder (``.treeopt-incomplete``, the deleted subdirectory)
  belongs is removed as the link it is, or refused with a warning naming it.
- **Reading needs no write access.** A process that cannot write the lock
  file (a read-only file system or directory) lists and restores steps; it is
  read-only, and says so only when asked to save.

Example:
    >>> import os, tempfile
    >>> root = tempfile.mkdtemp()
    >>> os.mkdir(os.path.join(root, "3"))                      # a step directory with nothing in it
    >>> os.mkdir(os.path.join(root, "4.orbax-checkpoint-tmp"))  # a save that never finished
    >>> directory = ManagedDirectory(root, name=str, deleted_subdir=None)
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     directory.complete([3]), directory.tidy_if_free([3])
    ([], True)
    >>> sorted(os.listdir(root)), "is not a complete checkpoint" in str(caught[0].message)
    (['.treeopt-incomplete'], True)
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from treeopt._checkpoint.siblings import orbax_tmp_suffix, remove
from treeopt._checkpoint.writer_lock import TIDYING, LockUnavailable, WriterLock
from treeopt.errors import CheckpointError, CheckpointInUseError

LOCK_NAME = ".treeopt-lock"
INCOMPLETE_SUBDIR = ".treeopt-incomplete"
_TRASH_PREFIX = ".treeopt-trash-"
_METADATA_FILE = "_CHECKPOINT_METADATA"  # orbax writes it last, when it finalizes a step
_OPTIMIZER_ITEM = "optimizer"


def _orbax_multihost() -> Any:
    import orbax.checkpoint as ocp  # imported on first use: it costs ~0.5 s

    return ocp.multihost


def is_complete(step_dir: str) -> bool:
    """Whether ``step_dir`` holds a finished treeopt checkpoint: orbax's metadata and the optimizer item."""
    return os.path.isfile(os.path.join(step_dir, _METADATA_FILE)) and os.path.isdir(
        os.path.join(step_dir, _OPTIMIZER_ITEM)
    )


def is_primary(primary_host: int | None) -> bool:
    """Whether this process writes the files only one process writes (orbax's primary host)."""
    return bool(_orbax_multihost().is_primary_host(primary_host))


def process_count() -> int:
    """The number of processes of this job (``jax.distributed``), as orbax counts them."""
    return int(_orbax_multihost().process_count())


def agreed(ok: bool) -> bool:
    """The primary process's ``ok``, on every process of a multi-process job (``ok`` itself in one process)."""
    multihost = _orbax_multihost()
    if multihost.process_count() == 1:
        return ok
    return bool(multihost.broadcast_one_to_all(np.int32(ok)))


class ManagedDirectory:
    """Housekeeping of a manager's ``root``: its lock, its debris and its incomplete steps.

    Args:
        root: the manager's directory.
        name: the directory name of a step (orbax's step name format).
        deleted_subdir: the subdirectory where orbax moves the steps it drops
            (emptied here), or None when the user keeps them.
        primary: whether this process takes the lock and removes files.
    """

    def __init__(
        self, root: str, name: Callable[[int], str], deleted_subdir: str | None, primary: bool = True
    ):
        self.root = root
        self.name = name
        self.deleted_subdir = deleted_subdir
        self.lock = WriterLock(os.path.join(root, LOCK_NAME), root) if primary else None
        self.writing = False
        self.read_only_reason: str | None = None  # why this process cannot write, once it found out
        self._complete: set[int] = set()
        self._warned: set[str] = set()

    # -- steps ---------------------------------------------------------------------------------

    def complete(self, steps: Iterable[int]) -> list[int]:
        """The steps whose directories are complete checkpoints; a warning names each other one, once."""
        out = []
        for step in steps:
            if step in self._complete or is_complete(os.path.join(self.root, self.name(step))):
                self._complete.add(step)
                out.append(step)
            else:
                self._warn(os.path.join(self.root, self.name(step)), "it is left out of the steps")
        return out

    def _warn(self, path: str, what_now: str, once: bool = True) -> None:
        if once and path in self._warned:
            return
        self._warned.add(path)
        warnings.warn(
            f"{path} is not a complete checkpoint (it lacks orbax's {_METADATA_FILE} or the "
            f"'{_OPTIMIZER_ITEM}' item: a directory made by hand, or a save interrupted in a layout "
            f"orbax does not mark): {what_now}.",
            UserWarning,
            stacklevel=4,
        )

    # -- writing -------------------------------------------------------------------------------

    def become_writer(self, steps: Iterable[int]) -> bool:
        """Takes the lock (or raises ``CheckpointInUseError``) and tidies; True if incomplete steps moved.

        Called before each save: once writing, it checks that the lock file is still the one held.
        """
        error: Exception | None = None
        if self.lock is not None:
            try:
                if self.writing:
                    self.lock.check()
                else:
                    self.lock.acquire()
            except (CheckpointInUseError, CheckpointError) as e:
                error = e
            except LockUnavailable as e:
                self.read_only_reason = str(e)
                error = LockUnavailable(
                    e.errno, f"This CheckpointManager is read-only: {e.strerror}.", self.lock.path
                )
        # Every process learns the primary's outcome before any goes on: a save they made alone would hang.
        if not agreed(error is None):
            raise error or CheckpointInUseError(
                f"The primary process of this job could not take (or keep) the lock of the checkpoint "
                f"directory {self.root}: the primary's error says why.",
                directory=self.root,
            )
        if self.writing:
            return False
        self.writing = True
        moved = False
        if self.lock is not None:
            moved, trash = self._tidy(steps)
            self._remove(trash)
        return agreed(moved)  # every process reloads its steps if the primary moved some

    def tidy_if_free(self, steps: Iterable[int]) -> bool:
        """When no one writes the directory, tidies it (at open); True if incomplete steps moved."""
        if self.lock is None or self.writing or not os.path.isdir(self.root):
            return False
        try:
            self.lock.acquire(TIDYING)
        except CheckpointInUseError:
            return False  # a live writer: its debris is its own, and it tidies
        except (LockUnavailable, CheckpointError) as e:  # reading needs no lock: it says why at a save
            self.read_only_reason = str(e)
            return False
        try:
            moved, trash = self._tidy(steps)
        finally:
            self.lock.release()
        self._remove(trash)  # renamed out of every writer's way: no lock needed
        return moved

    def _tidy(self, steps: Iterable[int]) -> tuple[bool, list[str]]:
        """Moves incomplete steps aside and renames debris to trash names; ``(moved any, trash)``."""
        moved = False
        for step in steps:
            path = os.path.join(self.root, self.name(step))
            if os.path.isdir(path) and not is_complete(path):
                destination = os.path.join(self.root, INCOMPLETE_SUBDIR, self.name(step))
                if not self._incomplete_dir():
                    continue
                if os.path.lexists(destination):
                    destination += f"-{uuid.uuid4().hex[:8]}"
                os.rename(path, destination)
                self._warn(
                    path,
                    f"moved to {destination}, out of the steps; delete it once you have looked",
                    once=False,
                )
                moved = True
        trash = []
        for entry in self._debris():
            path = os.path.join(self.root, entry)
            if not entry.startswith(_TRASH_PREFIX):
                renamed = os.path.join(self.root, f"{_TRASH_PREFIX}{uuid.uuid4().hex[:12]}")
                os.rename(path, renamed)
                path = renamed
            trash.append(path)
        return moved, trash

    def _incomplete_dir(self) -> bool:
        """Makes ``.treeopt-incomplete`` if needed; False (with a warning) where it is not a real directory."""
        path = os.path.join(self.root, INCOMPLETE_SUBDIR)
        if not os.path.lexists(path):
            os.mkdir(path)
        if os.path.isdir(path) and not os.path.islink(path):
            return True
        if path not in self._warned:
            self._warned.add(path)
            warnings.warn(
                f"{path} is not a directory (a symbolic link or a file): incomplete steps are not "
                "moved into it, nothing is moved outside the checkpoint directory. Remove it.",
                UserWarning,
                stacklevel=5,
            )
        return False

    def _debris(self) -> list[str]:
        tmp = orbax_tmp_suffix()
        return [
            entry
            for entry in os.listdir(self.root)
            if tmp in entry or entry.startswith(_TRASH_PREFIX) or entry == self.deleted_subdir
        ]

    def owns(self) -> bool:
        """Whether this process writes the directory now: it became the writer and its lock is still its own.

        A lock file removed or replaced by hand may have let a second writer
        in: the debris in the directory may then be that writer's saves in
        flight, and this one removes nothing more.
        """
        return self.writing and (self.lock is None or self.lock.still_held())

    def remove_unfinished(self) -> None:
        """Deletes what failed or killed saves left (no save of this writer may be under way)."""
        if self.lock is not None and self.owns():
            self._remove(os.path.join(self.root, e) for e in self._debris() if e != self.deleted_subdir)

    @staticmethod
    def _remove(paths: Iterable[str]) -> None:
        for path in paths:
            remove(path)

    def release(self) -> None:
        """Gives the directory up: the next writer may take it."""
        self.writing = False
        if self.lock is not None:
            self.lock.release()
