"""Atomic sibling directories: a forced save that never leaves a reader without a complete checkpoint.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> os.mkdir(path + ".treeopt-new")        # a forced save killed after its commit point
    >>> siblings = Siblings(path)
    >>> siblings.readable() == path + ".treeopt-new"
    True
    >>> siblings.settle()                      # the next save finishes it
    >>> sorted(os.listdir(os.path.dirname(path)))
    ['ckpt']
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid


def orbax_tmp_suffix() -> str:
    """The suffix of the temporary directory orbax writes a checkpoint into before renaming it."""
    import orbax.checkpoint as ocp  # imported on first use: it costs ~0.5 s

    return str(ocp.path.atomicity.TMP_DIR_SUFFIX)


# A forced save never removes the checkpoint at ``path`` before a complete new one exists:
#
#   1. orbax writes the new checkpoint to the sibling ``<path>.treeopt-new`` (itself
#      atomically: a temporary directory renamed into place when complete);
#   2. ``path`` is renamed to ``<path>.treeopt-old``: the commit point;
#   3. ``<path>.treeopt-new`` is renamed to ``path``;
#   4. ``<path>.treeopt-old`` is renamed to ``<path>.treeopt-trash-<random>`` and deleted.
#
# A directory is only ever deleted under a trash name, and only ever appears under
# ``path``, ``.treeopt-new`` or ``.treeopt-old`` by a rename of a complete checkpoint, so
# whichever of the three exists is complete. ``restore`` reads the first that exists, in
# that order, which is the newest committed checkpoint at any instant of a save; the next
# save settles the siblings into ``path`` alone and deletes the leftovers.
_NEW_SUFFIX = ".treeopt-new"
_OLD_SUFFIX = ".treeopt-old"
_TRASH_INFIX = ".treeopt-trash-"
# The lock file a save holds while it writes (see treeopt._checkpoint.writer_lock); deleted when it is done.
_LOCK_SUFFIX = ".treeopt-lock"


class Siblings:
    """The directories a checkpoint at ``path`` may occupy during a forced save."""

    def __init__(self, directory: str | os.PathLike[str]):
        # A link is resolved once: the lock and the renames are at the real path, whichever way it is named.
        self.path = os.path.realpath(os.fspath(directory))
        self.parent, self.name = os.path.split(self.path)
        self.new = self.path + _NEW_SUFFIX
        self.old = self.path + _OLD_SUFFIX
        self.lock = self.path + _LOCK_SUFFIX

    def readable(self) -> str:
        """The directory ``restore`` reads: ``path``, else ``.treeopt-new``, else ``.treeopt-old``."""
        for candidate in (self.path, self.new, self.old):
            if os.path.isdir(candidate):
                return candidate
        raise FileNotFoundError(f"No checkpoint directory at {self.path}.")

    def discard(self, directory: str) -> None:
        """Deletes ``directory``, first renaming it to a trash name so no reader ever sees it half-deleted."""
        if not os.path.lexists(directory):
            return
        trash = f"{self.path}{_TRASH_INFIX}{uuid.uuid4().hex[:12]}"
        os.rename(directory, trash)
        remove(trash)

    def settle(self) -> None:
        """Brings a save interrupted at any instant to ``path`` alone (plus leftovers to delete)."""
        if not os.path.lexists(self.path):
            if _real_dir(self.new):  # killed after the commit point: finish the save
                os.rename(self.new, self.path)
            elif _real_dir(self.old):
                os.rename(self.old, self.path)
        self.discard(self.new)  # written but never committed
        self.discard(self.old)
        self.remove_leftovers()

    def remove_leftovers(self) -> None:
        """Deletes trash and orbax's unfinished temporary directories of ``path`` and ``.treeopt-new``."""
        if not os.path.isdir(self.parent):
            return
        tmp_suffix = orbax_tmp_suffix()
        prefixes = (
            self.name + _TRASH_INFIX,
            self.name + tmp_suffix,
            self.name + _NEW_SUFFIX + tmp_suffix,
        )
        for entry in os.listdir(self.parent):
            if entry.startswith(prefixes):
                remove(os.path.join(self.parent, entry))


def _real_dir(path: str) -> bool:
    """A directory, not a link to one: only those are renamed into a checkpoint's place."""
    return os.path.isdir(path) and not os.path.islink(path)


def remove(path: str) -> None:
    """Deletes a file or a directory tree (never what a link points to); already gone is fine."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
