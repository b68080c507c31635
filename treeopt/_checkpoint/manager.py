"""Orbax checkpoints of an Optimizer: save, restore and CheckpointManager (its face is ``treeopt.checkpoint``)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from treeopt._checkpoint.directory import ManagedDirectory, agreed, is_primary, process_count
from treeopt._checkpoint.held import held_optimizer
from treeopt._checkpoint.items import (
    OPTIMIZER_ITEM,
    PARAMS_ITEM,
    Reader,
    checkpointer,
    directory_reader,
    orbax_checkpoint,
    save_items,
)
from treeopt._checkpoint.siblings import Siblings
from treeopt._checkpoint.siblings import remove as remove_path
from treeopt._checkpoint.writer_lock import WriterLock
from treeopt._compat.deprecations import moved_names
from treeopt._optimizer.optimizer import Optimizer
from treeopt._optimizer.parts import state_parts, with_state_parts
from treeopt._state.step_rule import check_step, integer
from treeopt.errors import CheckpointError as _CheckpointError  # not re-exported: a moved name warns
from treeopt.errors import CheckpointInUseError

if TYPE_CHECKING:
    import orbax.checkpoint as ocp

__all__ = ["CheckpointManager", "restore", "restore_state_dict", "save"]

__getattr__ = moved_names(__name__)


def save(
    directory: str | os.PathLike[str], opt: Optimizer, params: Any = None, *, force: bool = False
) -> None:
    """Saves ``opt`` (and ``params``) as an orbax checkpoint in ``directory``; blocks until written.

    The write is atomic: orbax writes a temporary directory and renames it when
    complete. Without ``force`` an existing checkpoint is an error.
    ``force=True`` replaces it, still atomically: the new checkpoint is written
    completely to the sibling ``<directory>.treeopt-new`` before the old one is
    renamed aside (``<directory>.treeopt-old``) and deleted, so a process
    killed at any instant leaves a checkpoint that :func:`restore` finds (the
    old one, or the new one once it is complete), and the next ``save`` removes
    what is left over. For numbered steps, keeping the last few, use
    :class:`CheckpointManager`. ``opt`` may be a ``treeopt.nnx.Optimizer`` or
    ``ModelAndOptimizer``: the optimizer it holds is saved.

    Example:
        >>> import tempfile, jax, jax.numpy as jnp, optax, treeopt
        >>> params = {"w": jnp.ones(2)}
        >>> opt = treeopt.Optimizer(optax.adam(1e-3)).init(params)
        >>> path = tempfile.mkdtemp() + "/ckpt"
        >>> save(path, opt, params)
        >>> params = opt.update({"w": jnp.ones(2)}, params)
        >>> save(path, opt, params, force=True)
        >>> target = jax.eval_shape(opt.init, params)
        >>> opt2, params2 = restore(path, target, params=jax.eval_shape(lambda: params))
        >>> int(opt2.step), params2["w"].tolist()
        (1, [0.9990000128746033, 0.9990000128746033])
    """
    args, metadata = save_items(_saved_state(opt), params)
    siblings = Siblings(directory)
    with _writing(siblings):
        siblings.settle()
        ckptr = checkpointer()
        try:
            if force and os.path.lexists(siblings.path):
                ckptr.save(siblings.new, args=args, custom_metadata=metadata)
                os.rename(siblings.path, siblings.old)
                os.rename(siblings.new, siblings.path)
                siblings.discard(siblings.old)
            else:  # orbax refuses an existing directory unless forced
                ckptr.save(siblings.path, args=args, force=force, custom_metadata=metadata)
        except BaseException:
            siblings.remove_leftovers()  # what this failed save wrote: the last checkpoint stays as it was
            raise
        finally:
            ckptr.close()
        siblings.remove_leftovers()


@contextlib.contextmanager
def _writing(siblings: Siblings) -> Iterator[None]:
    """Holds the lock of a single-directory checkpoint while it is written (the primary process's)."""
    lock = WriterLock(siblings.lock, siblings.path) if is_primary(0) else None
    error: Exception | None = None
    if lock is not None:
        os.makedirs(siblings.parent, exist_ok=True)  # as orbax would make it
        try:
            lock.acquire()
        except (CheckpointInUseError, _CheckpointError, PermissionError) as e:  # in use, a link, read-only
            error = e
    if not agreed(error is None):
        raise error or CheckpointInUseError(
            f"The primary process of this job could not take the lock of {siblings.path}: "
            "another writer holds it (the primary's error names it).",
            directory=siblings.path,
        )
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def restore(
    directory: str | os.PathLike[str],
    target: Optimizer,
    params: Any = None,
    *,
    shardings: Any = None,
    param_shardings: Any = None,
    strict: bool = True,
    verify: bool = True,
) -> Any:
    """Restores the checkpoint that :func:`save` wrote: an Optimizer, or ``(opt, params)``.

    Args:
        directory: the checkpoint directory. If a forced :func:`save` was
            killed after renaming the old checkpoint aside, the complete new
            one is read from ``<directory>.treeopt-new`` (or, failing that,
            the old one from ``<directory>.treeopt-old``).
        target: an optimizer with the state's structure: initialized
            (``opt.init(params)``) or abstract (``jax.eval_shape(opt.init, params)``).
            Each leaf is restored onto the sharding of the target's leaf (a
            ``jax.Array``'s, or a ``ShapeDtypeStruct``'s ``sharding``), else onto
            the first local device. A ``treeopt.nnx`` drop-in (built, or from
            ``nnx.eval_shape``) gives a copy of it holding the restored optimizer.
        params: also restore the params saved with the optimizer, into this
            tree (concrete or abstract); they are matched by name.
        shardings: a ``jax.sharding.Sharding`` for every optimizer leaf, or a tree
            shaped like ``target`` with one per leaf (e.g. ``NamedSharding``s).
        param_shardings: the same for ``params``.
        strict: raise :class:`StateDictError` listing every missing, unexpected and
            mismatched path (default), or restore what matches and warn.
        verify: check the restored arrays against the checksums saved in the
            checkpoint's metadata, and refuse a checkpoint without them (default).

    Raises:
        FileNotFoundError: no such directory (nor a sibling of a forced save), or
            a file of the checkpoint is missing (the message says it is damaged).
        CheckpointError: the checkpoint is damaged or incomplete: truncated,
            corrupted (a checksum mismatch included) or partly deleted.
        StateDictError: it does not match ``target`` / ``params``, or it is a
            flax ``nnx.Optimizer``'s checkpoint (the message says so and points
            to the ``warm_start`` migration of ``docs/migration/from-nnx.md``).

    Example:
        >>> import tempfile, jax, jax.numpy as jnp, optax, treeopt
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> params = {"w": jnp.ones((4, 2))}
        >>> opt = treeopt.Optimizer(optax.adam(1e-3)).init(params)
        >>> path = tempfile.mkdtemp() + "/ckpt"
        >>> save(path, opt)
        >>> target = jax.eval_shape(treeopt.Optimizer(optax.adam(1e-3)).init, params)
        >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
        >>> restored = restore(path, target, shardings=NamedSharding(mesh, P()))
        >>> restored.opt_state[0].mu["w"].sharding == NamedSharding(mesh, P())
        True
    """
    with directory_reader(directory, verify) as reader:
        return _restored(reader, target, params, shardings, param_shardings, strict)


def restore_state_dict(directory: str | os.PathLike[str], *, verify: bool = True) -> dict[str, Any]:
    """The optimizer state dict in a checkpoint of :func:`save`, with no target (for ``warm_start``).

    Arrays land on the first local device. The checkpoint is found as
    :func:`restore` finds it (the sibling of an interrupted forced save included),
    and refused as it refuses it (a flax ``nnx.Optimizer``'s checkpoint included).

    Example:
        >>> import tempfile, jax.numpy as jnp, optax, treeopt
        >>> params = {"w": jnp.ones(2)}
        >>> adam = treeopt.Optimizer(optax.adam(1e-3)).init(params)
        >>> path = tempfile.mkdtemp() + "/ckpt"
        >>> save(path, adam)
        >>> sd = restore_state_dict(path)
        >>> sorted(sd["opt_state"]["0"])
        ['count', 'mu', 'nu']
        >>> adamw, report = treeopt.serialization.warm_start(treeopt.Optimizer(optax.adamw(1e-3)).init(params), sd)
        >>> report.ok
        True
    """
    with directory_reader(directory, verify) as reader:
        return reader.restore_state_dict()


# -- orbax: numbered steps -----------------------------------------------------------------

# Steps that max_to_keep drops are renamed into this subdirectory of the manager's
# directory by orbax (its ``todelete_subdir`` option) and only then deleted, so a
# process killed while deleting never leaves a half-deleted step under a step's name.
_DELETED_SUBDIR = ".treeopt-deleted"


def _check_at_least_one(name: str, value: Any, none_means: str | None = None) -> None:
    expected = f"None ({none_means}) or an int >= 1" if none_means else "an int >= 1"
    if value is None and none_means:
        return
    number = integer(value)
    if number is None:
        raise TypeError(f"{name} must be {expected}, got {value!r} of type {type(value).__name__}.")
    if number < 1:
        raise ValueError(f"{name} must be {expected}, got {number}.")


class CheckpointManager:
    """Numbered checkpoints of an Optimizer (and params) over ``orbax.checkpoint.CheckpointManager``.

    Args:
        directory: where the step directories go (created if needed).
        max_to_keep: keep only the newest ``max_to_keep`` steps, an int >= 1
            (``None``: all).
        save_interval_steps: ``save`` writes only steps that are multiples of it
            (or when ``force=True``), an int >= 1.
        enable_async_checkpointing: save in a background thread (orbax's default);
            ``wait_until_finished`` / ``close`` block until written.
        options: a full ``ocp.CheckpointManagerOptions`` instead of the above.

    Steps are non-negative integers (``int``, numpy integers, or a 0-d integer
    array such as ``opt.step``); anything else raises ``TypeError`` /
    ``ValueError``. A step is written atomically (orbax renames its temporary
    directory when complete), and a step that ``max_to_keep`` drops is first
    renamed into the ``.treeopt-deleted`` subdirectory and deleted there, so a
    process killed at any instant leaves only complete steps in
    :meth:`all_steps`. Unless ``options`` sets its own ``todelete_subdir`` (then
    the dropped steps are kept there, as orbax does), that subdirectory is
    emptied after each save, and removed by :meth:`wait_until_finished`,
    :meth:`close` and when a manager opens a directory no one writes.

    One writer: the first :meth:`save` makes this manager the directory's
    writer until :meth:`close` (a lock file, ``.treeopt-lock``, that names it);
    another writer's save raises :class:`~treeopt.errors.CheckpointInUseError`.
    What failed or killed saves left (orbax's ``N.orbax-checkpoint-tmp``) is
    removed by the writer before each save and when it waits or closes, and
    when a manager opens a directory no one writes; a writer whose lock file
    was removed or replaced by hand removes nothing (another writer may have
    taken the directory). A step directory that is
    not a complete checkpoint is left out of :meth:`all_steps` with a warning
    naming it (and moved into ``.treeopt-incomplete`` when the directory is
    tidied). See ``docs/resume.md``.

    Threads may share a manager: its calls run one at a time (a lock held
    while a call runs, not while orbax writes in the background), so saves
    from several threads are serialized, never refused. Each waits for the
    save before it, as orbax's next save does; one whose step is not above
    the latest is skipped (``False``) unless forced. Every save that returned
    True is on disk after :meth:`wait_until_finished`.

    Reading needs no write access: a manager on a directory this process
    cannot write lists and restores, and is read-only (a ``PermissionError``
    says so at :meth:`save`). One opened with
    ``options=ocp.CheckpointManagerOptions(read_only=True)`` is read-only on
    purpose: it takes no lock, removes nothing, and refuses every
    :meth:`save`, forced or not, with a ``PermissionError`` that says it is
    read-only. Nothing is written, moved or deleted through a
    symbolic link in the directory, and a ``directory`` that is a link is
    resolved once. A closed manager refuses :meth:`save`.

    Example:
        >>> import tempfile, jax, jax.numpy as jnp, optax, treeopt
        >>> params = {"w": jnp.ones(2)}
        >>> opt = treeopt.Optimizer(optax.adam(1e-3)).init(params)
        >>> with CheckpointManager(tempfile.mkdtemp(), max_to_keep=2) as manager:
        ...     for step in range(3):
        ...         params = opt.update({"w": jnp.ones(2)}, params)
        ...         _ = manager.save(step, opt, params)
        ...     manager.wait_until_finished()
        ...     restored = manager.restore(jax.eval_shape(opt.init, params))
        ...     manager.all_steps(), manager.latest_step(), int(restored.step)
        ([1, 2], 2, 3)
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = None,
        save_interval_steps: int = 1,
        enable_async_checkpointing: bool = True,
        options: ocp.CheckpointManagerOptions | None = None,
    ):
        if options is None:
            _check_at_least_one("max_to_keep", max_to_keep, "keep every step")
            _check_at_least_one("save_interval_steps", save_interval_steps)
            options = orbax_checkpoint().CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                save_interval_steps=save_interval_steps,
                enable_async_checkpointing=enable_async_checkpointing,
                create=True,
            )
        else:
            _check_at_least_one("options.max_to_keep", options.max_to_keep, "keep every step")
        # A link is resolved once: the lock and the steps are at the real path, whichever way it is named.
        self.directory = os.path.realpath(os.fspath(directory))
        # One call at a time, from any thread (see the class doc): orbax's manager is not made for
        # concurrent calls. Reentrant: a call's error note asks latest_step, restore asks all_steps.
        self._calls = threading.RLock()
        self._closed = False
        deleted_subdir = None
        if options.todelete_subdir is None and options.todelete_full_path is None and not options.read_only:
            options = dataclasses.replace(options, todelete_subdir=_DELETED_SUBDIR)
            deleted_subdir = _DELETED_SUBDIR
        self._deleted = os.path.join(self.directory, deleted_subdir) if deleted_subdir else None
        self._options = options
        self.manager = self._orbax_manager()
        self._saving = False  # a save of this manager may still be writing in the background
        names = options.step_name_format or orbax_checkpoint().step.standard_name_format(
            step_prefix=options.step_prefix, step_format_fixed_length=options.step_format_fixed_length
        )
        primary = is_primary(options.multiprocessing_options.primary_host) and not options.read_only
        self._dir = ManagedDirectory(self.directory, names.build_name, deleted_subdir, primary)
        # What killed saves left is removed now if no one writes the directory (else its writer does).
        if agreed(self._dir.tidy_if_free(self.manager.all_steps())):
            self.manager.reload()

    def _orbax_manager(self) -> ocp.CheckpointManager:
        handler = orbax_checkpoint().StandardCheckpointHandler
        return orbax_checkpoint().CheckpointManager(
            self.directory,
            options=self._options,
            item_handlers={OPTIMIZER_ITEM: handler(), PARAMS_ITEM: handler()},
        )

    def _empty_deleted(self, remove: bool = False) -> None:
        """Deletes the steps orbax has moved into the deleted subdirectory, then (``remove``) it.

        The subdirectory itself is removed only when no save is under way:
        orbax creates it before moving a step in. Only the writer touches it,
        and only while its lock is still its own.
        """
        deleted = self._deleted
        if deleted is None or not self._dir.owns() or os.path.islink(deleted) or not os.path.isdir(deleted):
            return
        for entry in os.listdir(deleted):
            remove_path(os.path.join(deleted, entry))
        if remove:
            with contextlib.suppress(OSError):
                os.rmdir(deleted)

    def save(self, step: int, opt: Optimizer, params: Any = None, *, force: bool = False) -> bool:
        """Saves ``opt`` (and ``params``) as ``step``; False when the save interval skips it.

        The state is copied off the device before this returns, so the next
        (donating) train step may run while it is written. ``step`` is a
        non-negative integer (``TypeError`` / ``ValueError`` otherwise).

        The first call makes this manager the directory's one writer until
        :meth:`close`: if another process (or another open manager) writes it,
        it raises :class:`~treeopt.errors.CheckpointInUseError` naming that
        writer. Each call first removes what a failed or killed save left.
        Saves from several threads run one after another. A
        read-only manager (``CheckpointManagerOptions(read_only=True)``, or a
        directory this process cannot write) raises ``PermissionError``.

        Example:
            >>> import tempfile, jax.numpy as jnp, optax, treeopt
            >>> opt = treeopt.Optimizer(optax.sgd(0.1)).init({"w": jnp.ones(2)})
            >>> with CheckpointManager(tempfile.mkdtemp(), save_interval_steps=2) as manager:
            ...     manager.save(0, opt), manager.save(1, opt), manager.save(opt.step + 2, opt)
            (True, False, True)
        """
        with self._calls:
            if self._closed:
                raise RuntimeError(
                    f"This CheckpointManager of {self.directory} is closed (close() was called): it saves "
                    "nothing more. Open a new CheckpointManager to save again."
                )
            if self._options.read_only:
                raise PermissionError(
                    f"This CheckpointManager is read-only: it was opened with "
                    f"CheckpointManagerOptions(read_only=True), so it writes nothing in {self.directory} "
                    f"(save of step {step!r} refused, forced or not). Open a CheckpointManager without "
                    "read_only=True to save."
                )
            step = check_step(step)
            if self._dir.become_writer(self.manager.all_steps()):  # the first save: the lock, then tidy
                self.manager.reload()
            if not force and not self.manager.should_save(step):
                return False
            args, metadata = save_items(_saved_state(opt), params, step=step)
            with self._cleaning_up(f"an earlier asynchronous save (step {step} was not saved)", always=True):
                self.manager.wait_until_finished()  # as orbax's save does first; then nothing is in flight
            with self._cleaning_up(f"saving step {step}"):
                saved = bool(self.manager.save(step, args=args, force=force, custom_metadata=metadata))
            self._saving = self._saving or saved
            self._empty_deleted()  # orbax waited for the previous save, and its deletions, to finish
            return saved

    @contextlib.contextmanager
    def _cleaning_up(self, doing: str, always: bool = False, closing: bool = False) -> Iterator[None]:
        """On failure (or ``always``) removes what unfinished saves left, noting so on the error."""
        try:
            yield
        except BaseException as e:
            self._drain(restart=not closing)
            self._dir.remove_unfinished()
            e.add_note(
                f"treeopt: {doing} in {self.directory} failed; what unfinished saves wrote there was "
                f"removed, and the latest complete step is {self.latest_step()}."
            )
            raise
        if always:
            self._dir.remove_unfinished()

    def _drain(self, restart: bool) -> None:
        """Waits out a failed save's background threads (they may still be writing), then, in one
        process, starts orbax afresh: its handlers keep a failed write's error and raise it again
        at the next save, which would fail a save that has nothing wrong with it."""
        for _ in range(3):
            try:
                self.manager.wait_until_finished()
                break
            except Exception:
                continue
        if restart and process_count() == 1:
            with contextlib.suppress(Exception):
                self.manager.close()
            self.manager = self._orbax_manager()

    def _reader(self, step: int | None, verify: bool) -> Reader:
        if step is None:
            # The save in flight first: orbax forgets a step that is not on disk when it reloads.
            self._finish_own_saves()
            self.manager.reload()  # steps another writer made meanwhile
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"No checkpoint in {self.directory}.")
        else:
            step = check_step(step)
            if step not in self.all_steps():
                raise FileNotFoundError(
                    f"No checkpoint of step {step} in {self.directory}; steps: {list(self.all_steps())}."
                )
        where = os.path.join(self.directory, self._dir.name(step))
        return Reader(
            where,
            lambda: self.manager.metadata(step),
            lambda args: self.manager.restore(step, args=args),
            verify,
            step=step,
        )

    def restore(
        self,
        target: Optimizer,
        params: Any = None,
        *,
        step: int | None = None,
        shardings: Any = None,
        param_shardings: Any = None,
        strict: bool = True,
        verify: bool = True,
    ) -> Any:
        """Restores ``step`` (default: the latest); arguments and result as :func:`restore`."""
        with self._calls:
            return _restored(self._reader(step, verify), target, params, shardings, param_shardings, strict)

    def restore_state_dict(self, step: int | None = None, *, verify: bool = True) -> dict[str, Any]:
        """The optimizer state dict of ``step`` (default: the latest), with no target."""
        with self._calls:
            return self._reader(step, verify).restore_state_dict()

    def latest_step(self) -> int | None:
        """The newest complete step, or None."""
        steps = self.all_steps()  # one call at a time there
        return steps[-1] if steps else None

    def all_steps(self) -> Sequence[int]:
        """The complete steps, oldest first; a warning names each step directory that is not complete.

        This manager's own saves count: one still being written is waited for
        first, so the step just saved is listed (not warned about as incomplete).
        """
        with self._calls:
            self._finish_own_saves()
            return self._dir.complete(self.manager.all_steps())

    def _finish_own_saves(self) -> None:
        """Waits for this manager's asynchronous saves, if one may still be in flight."""
        if self._saving:
            self._saving = False  # first: a failed wait notes latest_step, which comes back here
            self.wait_until_finished()

    def wait_until_finished(self) -> None:
        """Blocks until pending (async) saves are written and the steps they drop deleted."""
        with self._calls:
            with self._cleaning_up("an asynchronous save", always=True):
                self.manager.wait_until_finished()
            self._empty_deleted(remove=True)

    def close(self) -> None:
        """Waits for pending saves, releases orbax's resources and gives the directory up to other writers.

        A closed manager refuses :meth:`save` (a ``RuntimeError`` naming ``close``); closing again does nothing.
        """
        with self._calls:
            if self._closed:
                return
            self._closed = True
            try:
                with self._cleaning_up("an asynchronous save", always=True, closing=True):
                    self.manager.close()
                self._empty_deleted(remove=True)
            finally:
                self._dir.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _saved_state(opt: Any) -> Any:
    """The state dict that a checkpoint of ``opt`` (or of the drop-in holding it) holds.

    Anything but an initialized optimizer, or an object holding one, is refused.
    """
    opt, _ = held_optimizer(opt)
    if not isinstance(opt, Optimizer) or not opt.initialized:
        raise TypeError(
            f"save needs an initialized treeopt.Optimizer (opt = Optimizer(tx).init(params)), got {opt!r}."
        )
    return opt.state_dict()


def _restored(
    reader: Any, target: Any, params: Any, shardings: Any, param_shardings: Any, strict: bool
) -> Any:
    """``target`` (and ``params``) with the values ``reader`` holds, of ``target``'s kind; see :func:`restore`."""
    target, wrap = held_optimizer(target)
    if not isinstance(target, Optimizer) or not target.initialized:
        raise TypeError(
            "restore needs a target optimizer with the state's structure: an initialized "
            "one (opt.init(params)) or an abstract one (jax.eval_shape(opt.init, params)), "
            f"got {target!r}."
        )
    restored = reader.restore_into(state_parts(target), params, shardings, param_shardings, strict)
    if params is None:
        return wrap(with_state_parts(target, restored))
    parts, params = restored
    return wrap(with_state_parts(target, parts)), params
