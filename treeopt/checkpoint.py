"""Orbax checkpoints of an Optimizer (and its params): one directory, or numbered steps.

:func:`save` / :func:`restore` for one directory and :class:`CheckpointManager`
for numbered steps (``max_to_keep``, latest step), built on orbax's own
``CheckpointManager`` / ``StandardSave``. A save is atomic: a save killed half-way
leaves the previous checkpoint as the latest; a forced overwrite writes the new
checkpoint completely before the old one is moved aside; steps dropped by
``max_to_keep`` are renamed away before they are deleted. A checkpoint holds an
``optimizer`` item (the state dict) and optionally a ``params`` item (``{name:
array}``, the names of :func:`treeopt.leaf_names`), each readable with plain
orbax, and checksums of both in the step's orbax custom metadata. Restore into
an abstract target from ``jax.eval_shape`` and onto shardings.

These names are also importable from :mod:`treeopt.serialization`.
See ``docs/serialization.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from treeopt import _state_dict as _sd
from treeopt._checksum import checksum
from treeopt._paths import leaf_names
from treeopt.errors import CheckpointError, LoadReport, StateDictError, StateDictWarning
from treeopt.keys import key_data
from treeopt.optimizer import Optimizer

if TYPE_CHECKING:
    import orbax.checkpoint as ocp

__all__ = ["CheckpointError", "CheckpointManager", "restore", "restore_state_dict", "save"]

OPTIMIZER_ITEM = "optimizer"
PARAMS_ITEM = "params"
_METADATA_KEY = "treeopt"
_FORMAT = 1


# -- orbax: the items ----------------------------------------------------------------------


def _ocp() -> Any:
    import orbax.checkpoint as ocp  # imported on first use: it costs ~0.5 s

    return ocp


def _array_like(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _flat_params(params: Any) -> dict[str, Any]:
    """``{name: array}`` of every array leaf of ``params``."""
    out = {}
    for name, leaf in zip(leaf_names(params), jax.tree.leaves(params), strict=True):
        if _array_like(leaf):
            out[name] = key_data(leaf)
    return out


def _checksum_list(tree: Any) -> list[int]:
    return [int(x) for x in checksum(_sd.flatten_paths(tree))]


def _save_items(opt: Optimizer, params: Any) -> tuple[Any, dict[str, Any]]:
    """``(ocp.args.Composite, custom metadata)`` of a checkpoint of ``opt`` (and ``params``)."""
    ocp = _ocp()
    if not isinstance(opt, Optimizer) or not opt.initialized:
        raise TypeError(
            f"save needs an initialized treeopt.Optimizer (opt = Optimizer(tx).init(params)), got {opt!r}."
        )
    items = {OPTIMIZER_ITEM: opt.state_dict()}
    if params is not None:
        items[PARAMS_ITEM] = _flat_params(params)
    checksums = {name: _checksum_list(tree) for name, tree in items.items()}
    args = ocp.args.Composite(**{name: ocp.args.StandardSave(tree) for name, tree in items.items()})
    return args, {_METADATA_KEY: {"format": _FORMAT, "checksums": checksums}}


def _with_shardings(tree: Any, shardings: Any, what: str) -> Any:
    """``tree`` with its array leaves placed on (or, if abstract, annotated with) ``shardings``."""
    if shardings is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    if isinstance(shardings, jax.sharding.Sharding):
        flat_shardings: Sequence[Any] = [shardings] * len(leaves)
    else:
        flat_shardings, sharding_def = jax.tree.flatten(
            shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
        )
        if len(flat_shardings) != len(leaves):
            raise ValueError(
                f"{what} shardings must be one Sharding or a tree shaped like the {what} "
                f"({len(leaves)} leaves), got {len(flat_shardings)} leaves: {sharding_def}."
            )

    def place(leaf: Any, sharding: Any) -> Any:
        if isinstance(leaf, jax.Array):
            return jax.device_put(leaf, sharding)
        if _array_like(leaf):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
        return leaf

    return jax.tree.unflatten(treedef, [place(x, s) for x, s in zip(leaves, flat_shardings, strict=True)])


def _default_sharding() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _abstract_item(meta: Any, shardings: Mapping[tuple[str, ...], Any], prefix: tuple[str, ...] = ()) -> Any:
    """The orbax restore target for a saved item: every saved leaf (empty dicts kept), on its sharding."""
    if isinstance(meta, Mapping):
        return {k: _abstract_item(v, shardings, (*prefix, k)) for k, v in meta.items()}
    if meta is None or not _array_like(meta):
        return meta
    sharding = shardings.get(prefix) or _default_sharding()
    return jax.ShapeDtypeStruct(tuple(meta.shape), meta.dtype, sharding=sharding)


def _mismatch_error(where: str, what: str, report: LoadReport) -> StateDictError:
    return StateDictError(
        f"The checkpoint at {where} does not match the {what} to restore into:\n"
        + report.problems()
        + "\nIt was saved from another model or optimizer. Pass strict=False to restore the "
        "matching paths, or restore_state_dict + warm_start to start from another optimizer.",
        report,
    )


class _Reader:
    """Metadata and restore of one checkpoint: a directory, or a step of a manager."""

    def __init__(
        self, where: str, metadata: Callable[[], Any], restore: Callable[[Any], Any], verify: bool = True
    ):
        self.where = where
        self.verify_checksums = verify
        self._metadata = metadata
        self._restore = restore

    def metadata(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``({item name: saved tree metadata}, treeopt's custom metadata)``."""
        try:
            step_metadata = self._metadata()
            items = step_metadata.item_metadata
            trees = {}
            for name in (OPTIMIZER_ITEM, PARAMS_ITEM):
                item = items.get(name) if items is not None else None
                if item is not None:
                    trees[name] = getattr(item, "tree", item)
            custom = (step_metadata.custom_metadata or {}).get(_METADATA_KEY, {})
        except FileNotFoundError as e:  # the directory exists: a file of it is missing
            raise FileNotFoundError(
                f"The checkpoint at {self.where} is damaged or incomplete: a file of it is missing ({e})."
            ) from e
        except Exception as e:
            raise CheckpointError(
                f"Could not read the metadata of the checkpoint at {self.where}: it is damaged "
                f"or incomplete (truncated, corrupted or partly deleted) ({type(e).__name__}: {e})."
            ) from e
        if OPTIMIZER_ITEM not in trees:
            if _saved_items(custom):
                raise CheckpointError(
                    f"The checkpoint at {self.where} is damaged or incomplete: its "
                    f"'{OPTIMIZER_ITEM}' item is missing or unreadable (partly deleted?)."
                )
            raise CheckpointError(
                f"The checkpoint at {self.where} has no '{OPTIMIZER_ITEM}' item: it is damaged "
                "or incomplete, or it was not written by treeopt.serialization.save / "
                "CheckpointManager.save."
            )
        return trees, custom

    def restore(self, items: Mapping[str, Any]) -> Any:
        ocp = _ocp()
        args = ocp.args.Composite(**{name: ocp.args.StandardRestore(item) for name, item in items.items()})
        try:
            return self._restore(args)
        except Exception as e:
            raise CheckpointError(
                f"Could not restore the checkpoint at {self.where}: it is damaged or incomplete, "
                "its files truncated, corrupted or partly deleted "
                f"({type(e).__name__}: {str(e)[:2000]})."
            ) from e

    def verify(self, name: str, tree: Any, custom: Mapping[str, Any]) -> None:
        stored = custom.get("checksums", {}).get(name) if isinstance(custom, Mapping) else None
        if stored is None:
            if self.verify_checksums:
                raise CheckpointError(
                    f"The checkpoint at {self.where} has no checksum for its '{name}' item: its "
                    "_CHECKPOINT_METADATA file is missing or damaged, or treeopt did not write it. "
                    "Pass verify=False to restore it unchecked."
                )
            return
        if [int(x) for x in stored] != _checksum_list(tree):
            raise CheckpointError(
                f"The '{name}' item of the checkpoint at {self.where} does not match the "
                "checksum it was saved with: its files are damaged (corrupted)."
            )

    def restore_state_dict(self) -> dict[str, Any]:
        trees, custom = self.metadata()
        restored = self.restore({OPTIMIZER_ITEM: _abstract_item(trees[OPTIMIZER_ITEM], {})})[OPTIMIZER_ITEM]
        self.verify(OPTIMIZER_ITEM, restored, custom)
        return restored

    def restore_into(
        self,
        target: Optimizer,
        params: Any,
        shardings: Any,
        param_shardings: Any,
        strict: bool,
    ) -> Any:
        if not isinstance(target, Optimizer) or not target.initialized:
            raise TypeError(
                "restore needs a target optimizer with the state's structure: an initialized "
                "one (opt.init(params)) or an abstract one (jax.eval_shape(opt.init, params)), "
                f"got {target!r}."
            )
        target = _with_shardings(target, shardings, "optimizer")
        trees, custom = self.metadata()
        slots = _sd.slots(target)
        saved = _sd.flatten_paths(trees[OPTIMIZER_ITEM])
        pairs, report = _sd.match_paths(slots.slots, saved)
        if strict and not report.ok:
            raise _mismatch_error(self.where, "optimizer", report)
        items = {
            OPTIMIZER_ITEM: _abstract_item(trees[OPTIMIZER_ITEM], {p: slots.slots[p].sharding for p in pairs})
        }

        if params is not None:
            if PARAMS_ITEM not in trees:
                raise _no_params_error(self.where, custom)
            params = _with_shardings(params, param_shardings, "params")
            p_slots = _sd.param_slots(params)
            p_saved = _sd.flatten_paths(trees[PARAMS_ITEM])
            p_pairs, p_report = _sd.match_paths(p_slots.slots, p_saved)
            if strict and not p_report.ok:
                raise _mismatch_error(self.where, "params", p_report)
            items[PARAMS_ITEM] = _abstract_item(
                trees[PARAMS_ITEM], {p: p_slots.slots[p].sharding for p in p_pairs}
            )

        restored = self.restore(items)
        for name, tree in restored.items():
            self.verify(name, tree, custom)
        if not report.ok:
            _warn(report, self.where, "optimizer")
        opt = _sd.with_loaded_leaves(target, slots, pairs, _sd.flatten_paths(restored[OPTIMIZER_ITEM]))
        if params is None:
            return opt
        if not p_report.ok:
            _warn(p_report, self.where, "params")
        p_source = _sd.flatten_paths(restored[PARAMS_ITEM])
        leaves = _sd.fill_leaves(p_slots, p_pairs, p_source, what="params")
        return opt, jax.tree.unflatten(p_slots.treedef, leaves)


def _saved_items(custom: Any) -> set[str]:
    """The items treeopt's custom metadata says were saved (empty when that metadata is missing)."""
    checksums = custom.get("checksums") if isinstance(custom, Mapping) else None
    return set(checksums) if isinstance(checksums, Mapping) else set()


def _no_params_error(where: str, custom: Any) -> CheckpointError:
    saved = _saved_items(custom)
    if PARAMS_ITEM in saved:
        return CheckpointError(
            f"The checkpoint at {where} is damaged or incomplete: it was saved with params, "
            f"but its '{PARAMS_ITEM}' item is missing or unreadable (partly deleted?)."
        )
    if saved:
        return CheckpointError(
            f"The checkpoint at {where} holds no params: its metadata says it was saved "
            "without them (save(directory, opt)). Restore without params=."
        )
    return CheckpointError(
        f"The checkpoint at {where} holds no params: it was saved without them, or it is "
        "damaged or incomplete (its metadata, which would say which, is missing too). "
        "Restore without params=, or from another checkpoint."
    )


def _warn(report: LoadReport, where: str, what: str) -> None:
    import warnings

    warnings.warn(
        StateDictWarning(
            f"restore(strict=False) from {where}: these {what} paths kept the target's values "
            "or were ignored:\n" + report.problems(),
            report,
        ),
        stacklevel=4,
    )


# -- orbax: one directory --------------------------------------------------------------------


def _checkpointer() -> Any:
    ocp = _ocp()
    handler = ocp.StandardCheckpointHandler
    return ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(**{OPTIMIZER_ITEM: handler(), PARAMS_ITEM: handler()})
    )


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


class _Siblings:
    """The directories a checkpoint at ``path`` may occupy during a forced save."""

    def __init__(self, directory: str | os.PathLike[str]):
        self.path = os.path.abspath(os.fspath(directory))
        self.parent, self.name = os.path.split(self.path)
        self.new = self.path + _NEW_SUFFIX
        self.old = self.path + _OLD_SUFFIX

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
        _remove(trash)

    def settle(self) -> None:
        """Brings a save interrupted at any instant to ``path`` alone (plus leftovers to delete)."""
        if not os.path.lexists(self.path):
            if os.path.isdir(self.new):  # killed after the commit point: finish the save
                os.rename(self.new, self.path)
            elif os.path.isdir(self.old):
                os.rename(self.old, self.path)
        self.discard(self.new)  # written but never committed
        self.discard(self.old)
        self.remove_leftovers()

    def remove_leftovers(self) -> None:
        """Deletes trash and orbax's unfinished temporary directories of ``path`` and ``.treeopt-new``."""
        if not os.path.isdir(self.parent):
            return
        tmp_suffix = _ocp().path.atomicity.TMP_DIR_SUFFIX
        prefixes = (
            self.name + _TRASH_INFIX,
            self.name + tmp_suffix,
            self.name + _NEW_SUFFIX + tmp_suffix,
        )
        for entry in os.listdir(self.parent):
            if entry.startswith(prefixes):
                _remove(os.path.join(self.parent, entry))


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


@contextlib.contextmanager
def _directory_reader(directory: str | os.PathLike[str], verify: bool = True) -> Iterator[_Reader]:
    path = _Siblings(directory).readable()
    ckptr = _checkpointer()
    try:
        yield _Reader(
            path,
            lambda: ckptr.metadata(path),
            lambda args: ckptr.restore(path, args=args),
            verify,
        )
    finally:
        ckptr.close()


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
    :class:`CheckpointManager`.

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
    args, metadata = _save_items(opt, params)
    siblings = _Siblings(directory)
    siblings.settle()
    ckptr = _checkpointer()
    try:
        if force and os.path.lexists(siblings.path):
            ckptr.save(siblings.new, args=args, custom_metadata=metadata)
            os.rename(siblings.path, siblings.old)
            os.rename(siblings.new, siblings.path)
            siblings.discard(siblings.old)
        else:  # orbax refuses an existing directory unless forced
            ckptr.save(siblings.path, args=args, force=force, custom_metadata=metadata)
    finally:
        ckptr.close()
    siblings.remove_leftovers()


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
            the first local device.
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
        StateDictError: it does not match ``target`` / ``params``.

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
    with _directory_reader(directory, verify) as reader:
        return reader.restore_into(target, params, shardings, param_shardings, strict)


def restore_state_dict(directory: str | os.PathLike[str], *, verify: bool = True) -> dict[str, Any]:
    """The optimizer state dict in a checkpoint of :func:`save`, with no target (for ``warm_start``).

    Arrays land on the first local device. The checkpoint is found as
    :func:`restore` finds it (the sibling of an interrupted forced save included).

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
    with _directory_reader(directory, verify) as reader:
        return reader.restore_state_dict()


# -- orbax: numbered steps -----------------------------------------------------------------

# Steps that max_to_keep drops are renamed into this subdirectory of the manager's
# directory by orbax (its ``todelete_subdir`` option) and only then deleted, so a
# process killed while deleting never leaves a half-deleted step under a step's name.
_DELETED_SUBDIR = ".treeopt-deleted"


def _integer(value: Any) -> int | None:
    """``value`` as an int if it is an integer (not a bool): int, numpy integer, 0-d integer array."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    dtype = getattr(value, "dtype", None)
    if getattr(value, "shape", None) == () and dtype is not None and np.issubdtype(dtype, np.integer):
        return int(value)
    return None


def _check_step(step: Any) -> int:
    """``step`` as a non-negative int, or a TypeError / ValueError saying what is expected."""
    value = _integer(step)
    if value is None:
        raise TypeError(
            "A checkpoint step must be a non-negative integer (an int, a numpy integer or a "
            f"0-d integer array such as opt.step), got {step!r} of type {type(step).__name__}."
        )
    if value < 0:
        raise ValueError(f"A checkpoint step must be a non-negative integer, got {value}.")
    return value


def _check_at_least_one(name: str, value: Any, none_means: str | None = None) -> None:
    expected = f"None ({none_means}) or an int >= 1" if none_means else "an int >= 1"
    if value is None and none_means:
        return
    number = _integer(value)
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
    :meth:`close` and when a manager opens the directory.

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
        ocp = _ocp()
        if options is None:
            _check_at_least_one("max_to_keep", max_to_keep, "keep every step")
            _check_at_least_one("save_interval_steps", save_interval_steps)
            options = ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                save_interval_steps=save_interval_steps,
                enable_async_checkpointing=enable_async_checkpointing,
                create=True,
            )
        else:
            _check_at_least_one("options.max_to_keep", options.max_to_keep, "keep every step")
        self.directory = os.path.abspath(os.fspath(directory))
        self._deleted: str | None = None
        if options.todelete_subdir is None and options.todelete_full_path is None and not options.read_only:
            options = dataclasses.replace(options, todelete_subdir=_DELETED_SUBDIR)
            self._deleted = os.path.join(self.directory, _DELETED_SUBDIR)
        handler = ocp.StandardCheckpointHandler
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={OPTIMIZER_ITEM: handler(), PARAMS_ITEM: handler()},
        )
        self._empty_deleted(remove=True)

    def _empty_deleted(self, remove: bool = False) -> None:
        """Deletes the steps orbax has moved into the deleted subdirectory, then (``remove``) it.

        The subdirectory itself is removed only when no save is under way:
        orbax creates it before moving a step in.
        """
        if self._deleted is None or not os.path.isdir(self._deleted):
            return
        for entry in os.listdir(self._deleted):
            _remove(os.path.join(self._deleted, entry))
        if remove:
            with contextlib.suppress(OSError):
                os.rmdir(self._deleted)

    def save(self, step: int, opt: Optimizer, params: Any = None, *, force: bool = False) -> bool:
        """Saves ``opt`` (and ``params``) as ``step``; False when the save interval skips it.

        The state is copied off the device before this returns, so the next
        (donating) train step may run while it is written. ``step`` is a
        non-negative integer (``TypeError`` / ``ValueError`` otherwise).

        Example:
            >>> import tempfile, jax.numpy as jnp, optax, treeopt
            >>> opt = treeopt.Optimizer(optax.sgd(0.1)).init({"w": jnp.ones(2)})
            >>> with CheckpointManager(tempfile.mkdtemp(), save_interval_steps=2) as manager:
            ...     manager.save(0, opt), manager.save(1, opt), manager.save(opt.step + 2, opt)
            (True, False, True)
        """
        step = _check_step(step)
        if not force and not self.manager.should_save(step):
            return False
        args, metadata = _save_items(opt, params)
        saved = bool(self.manager.save(step, args=args, force=force, custom_metadata=metadata))
        self._empty_deleted()  # orbax waited for the previous save, and its deletions, to finish
        return saved

    def _reader(self, step: int | None, verify: bool) -> _Reader:
        if step is None:
            self.manager.reload()
            step = self.manager.latest_step()
            if step is None:
                raise FileNotFoundError(f"No checkpoint in {self.directory}.")
        else:
            step = _check_step(step)
            if step not in self.manager.all_steps():
                raise FileNotFoundError(
                    f"No checkpoint of step {step} in {self.directory}; steps: {list(self.all_steps())}."
                )
        where = os.path.join(self.directory, str(step))
        return _Reader(
            where,
            lambda: self.manager.metadata(step),
            lambda args: self.manager.restore(step, args=args),
            verify,
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
        reader = self._reader(step, verify)
        return reader.restore_into(target, params, shardings, param_shardings, strict)

    def restore_state_dict(self, step: int | None = None, *, verify: bool = True) -> dict[str, Any]:
        """The optimizer state dict of ``step`` (default: the latest), with no target."""
        return self._reader(step, verify).restore_state_dict()

    def latest_step(self) -> int | None:
        """The newest complete step, or None."""
        return self.manager.latest_step()

    def all_steps(self) -> Sequence[int]:
        """The complete steps, oldest first."""
        return self.manager.all_steps()

    def wait_until_finished(self) -> None:
        """Blocks until pending (async) saves are written and the steps they drop deleted."""
        self.manager.wait_until_finished()
        self._empty_deleted(remove=True)

    def close(self) -> None:
        """Waits for pending saves and releases orbax's resources."""
        self.manager.close()
        self._empty_deleted(remove=True)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
