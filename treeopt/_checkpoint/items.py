"""The items of a treeopt checkpoint in orbax: what a save writes, and a reader that restores them.

A checkpoint holds an ``optimizer`` item (the optimizer's state dict) and
optionally a ``params`` item (``{name: array}``, the names of
:func:`treeopt.leaf_names`), each readable with plain orbax, and the checksum
of each in the step's orbax custom metadata. :class:`Reader` restores one
checkpoint, a directory or a manager's step: each item is a source of the
state-dict engine, which matches it against the target by name, reads it
onto the target's shardings and verifies it.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax

from treeopt._checkpoint.foreign import nnx_optimizer_error, nnx_optimizer_signs, single_item_tree
from treeopt._checkpoint.siblings import Siblings
from treeopt._state import state_dict as _state_dict
from treeopt._state.checksum import checksum
from treeopt._state.engine import Messages, Target, load, read_verified
from treeopt._state.keys import key_data
from treeopt._state.plain import flatten_paths
from treeopt._state.policies import EXACT
from treeopt._state.state_dict import StateParts
from treeopt._tree.paths import Path, leaf_names
from treeopt.errors import CheckpointError

OPTIMIZER_ITEM = "optimizer"
PARAMS_ITEM = "params"
_METADATA_KEY = "treeopt"
_FORMAT = 1


def orbax_checkpoint() -> Any:
    """``orbax.checkpoint``, imported on first use (it costs ~0.5 s)."""
    import orbax.checkpoint

    return orbax.checkpoint


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
    return [int(x) for x in checksum(flatten_paths(tree))]


def save_items(state_dict: Any, params: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
    """``(ocp.args.Composite, custom metadata)`` of a checkpoint of an optimizer's ``state_dict`` (and ``params``).

    Params with no array (``{}``) are saved as an empty item: orbax refuses to
    write one, so only the metadata records it (``"empty"``) with its checksum.
    ``step`` is the manager's step, recorded so that a renamed step directory
    can be told.
    """
    items = {OPTIMIZER_ITEM: state_dict}
    if params is not None:
        items[PARAMS_ITEM] = _flat_params(params)
    checksums = {name: _checksum_list(tree) for name, tree in items.items()}
    empty = sorted(name for name, tree in items.items() if not flatten_paths(tree))
    written = {name: tree for name, tree in items.items() if name not in empty}
    args = orbax_checkpoint().args.Composite(
        **{name: orbax_checkpoint().args.StandardSave(tree) for name, tree in written.items()}
    )
    metadata: dict[str, Any] = {"format": _FORMAT, "checksums": checksums}
    if empty:
        metadata["empty"] = empty
    if step is not None:
        metadata["step"] = step
    return args, {_METADATA_KEY: metadata}


def checkpointer() -> Any:
    """An orbax ``Checkpointer`` for the two items of a treeopt checkpoint in one directory."""
    handler = orbax_checkpoint().StandardCheckpointHandler
    return orbax_checkpoint().Checkpointer(
        orbax_checkpoint().CompositeCheckpointHandler(**{OPTIMIZER_ITEM: handler(), PARAMS_ITEM: handler()})
    )


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


def _abstract_item(meta: Any, shardings: Mapping[Path, Any], prefix: Path = ()) -> Any:
    """The orbax restore target for a saved item: every saved leaf (empty dicts kept), on its sharding."""
    if isinstance(meta, Mapping):
        return {k: _abstract_item(v, shardings, (*prefix, k)) for k, v in meta.items()}
    if meta is None or not _array_like(meta):
        return meta
    sharding = shardings.get(prefix) or _default_sharding()
    return jax.ShapeDtypeStruct(tuple(meta.shape), meta.dtype, sharding=sharding)


def _messages(where: str, what: str) -> Messages:
    return Messages(
        lead=f"The checkpoint at {where} does not match the {what} to restore into",
        hint="Pass strict=False to restore the matching paths, or restore_state_dict + warm_start to "
        "start from another optimizer.",
        warning=f"restore(strict=False) from {where}: these {what} paths kept the target's values "
        "or were ignored",
    )


class _Item:
    """One item of a checkpoint as a source of the state-dict engine: read from orbax, fresh buffers."""

    fresh = True

    def __init__(self, reader: Reader, name: str, tree: Any, custom: Mapping[str, Any]):
        self.reader, self.name, self.tree = reader, name, tree
        self.custom = custom

    def entries(self) -> Mapping[Path, Any]:
        return flatten_paths(self.tree)

    def read(self, placements: Mapping[Path, Any]) -> Any:
        if not flatten_paths(self.tree):  # saved empty: nothing in orbax to read
            return self.tree
        return self.reader.restore({self.name: _abstract_item(self.tree, placements)})[self.name]

    def stored_checksum(self) -> Any:
        custom = self.custom
        checksums = custom.get("checksums") if isinstance(custom, Mapping) else None
        stored = (
            checksums.get(self.name) if isinstance(checksums, Mapping) else None
        )  # a damaged file: not one
        if stored is None and self.reader.verify_checksums:
            raise CheckpointError(
                f"The checkpoint at {self.reader.where} has no checksum for its '{self.name}' item: its "
                "_CHECKPOINT_METADATA file is missing or damaged, or treeopt did not write it. "
                "Pass verify=False to restore it unchecked."
            )
        return stored

    def corrupted(self) -> Exception:
        return CheckpointError(
            f"The '{self.name}' item of the checkpoint at {self.reader.where} does not match the "
            "checksum it was saved with: its files are damaged (corrupted)."
        )


class Reader:
    """Metadata and restore of one checkpoint: a directory, or a step of a manager."""

    def __init__(
        self,
        where: str,
        metadata: Callable[[], Any],
        restore: Callable[[Any], Any],
        verify: bool = True,
        step: int | None = None,
    ):
        self.where = where
        self.verify_checksums = verify
        self.step = step
        self._metadata = metadata
        self._restore = restore

    def items(self) -> dict[str, _Item]:
        """The items the checkpoint holds, as sources of the state-dict engine."""
        try:
            step_metadata = self._metadata()
            items = step_metadata.item_metadata
            trees = {}
            for name in (OPTIMIZER_ITEM, PARAMS_ITEM):
                item = items.get(name) if items is not None else None
                if item is not None:
                    trees[name] = getattr(item, "tree", item)
            custom = (step_metadata.custom_metadata or {}).get(_METADATA_KEY, {})
            for name in _listed(custom, "empty"):
                trees.setdefault(name, {})
        except FileNotFoundError as e:  # the directory exists: a file of it is missing
            raise FileNotFoundError(
                f"The checkpoint at {self.where} is damaged or incomplete: a file of it is missing ({e})."
            ) from e
        except Exception as e:
            signs = nnx_optimizer_signs(single_item_tree(self.where))  # flax's guide writes one item alone
            if signs:
                raise nnx_optimizer_error(self.where, signs) from None
            raise CheckpointError(
                f"Could not read the metadata of the checkpoint at {self.where}: it is damaged "
                f"or incomplete (truncated, corrupted or partly deleted) ({type(e).__name__}: {e})."
            ) from e
        signs = nnx_optimizer_signs(trees.get(OPTIMIZER_ITEM)) if not custom else []
        if signs:  # treeopt did not write it: an nnx.Optimizer's state under treeopt's item name
            raise nnx_optimizer_error(self.where, signs)
        if OPTIMIZER_ITEM not in trees:
            if _saved_items(custom):
                raise CheckpointError(
                    f"The checkpoint at {self.where} is damaged or incomplete: its "
                    f"'{OPTIMIZER_ITEM}' item is missing or unreadable (partly deleted?)."
                )
            raise CheckpointError(
                f"The checkpoint at {self.where} has no '{OPTIMIZER_ITEM}' item: it is damaged "
                "or incomplete, or it was not written by treeopt.checkpoint.save / "
                "CheckpointManager.save."
            )
        self._check_step(custom)
        return {name: _Item(self, name, tree, custom) for name, tree in trees.items()}

    def _check_step(self, custom: Any) -> None:
        """Warns when the step a manager saved this checkpoint as is not the step its directory names."""
        saved = custom.get("step") if isinstance(custom, Mapping) else None
        if self.step is not None and isinstance(saved, int) and saved != self.step:
            warnings.warn(
                f"The checkpoint at {self.where} is step {self.step} by its directory name, but it was "
                f"saved as step {saved}: the directory was renamed or copied. Its contents are step "
                f"{saved}'s.",
                UserWarning,
                stacklevel=5,
            )

    def restore(self, items: Mapping[str, Any]) -> Any:
        """Orbax's restore of ``items`` (``{name: abstract tree}``); damage raises ``CheckpointError``."""
        args = orbax_checkpoint().args.Composite(
            **{name: orbax_checkpoint().args.StandardRestore(item) for name, item in items.items()}
        )
        try:
            return self._restore(args)
        except Exception as e:
            raise CheckpointError(
                f"Could not restore the checkpoint at {self.where}: it is damaged or incomplete, "
                "its files truncated, corrupted or partly deleted "
                f"({type(e).__name__}: {str(e)[:2000]})."
            ) from e

    def restore_state_dict(self) -> dict[str, Any]:
        """The optimizer item as a state dict on the first local device, verified."""
        return read_verified(self.items()[OPTIMIZER_ITEM], {})

    def restore_into(
        self, target: StateParts, params: Any, shardings: Any, param_shardings: Any, strict: bool
    ) -> Any:
        """The state's parts (and ``params``) restored into ``target``'s: see ``treeopt.checkpoint.restore``."""
        items = self.items()
        if params is not None and PARAMS_ITEM not in items:
            raise _no_params_error(self.where, items[OPTIMIZER_ITEM].custom)
        target = _with_shardings(target, shardings, "optimizer")
        parts, _ = load(
            _state_dict.target(target),
            items[OPTIMIZER_ITEM],
            EXACT,
            _messages(self.where, "optimizer"),
            strict=strict,
        )
        if params is None:
            return parts
        params = _with_shardings(params, param_shardings, "params")
        params, _ = load(
            Target.named(params), items[PARAMS_ITEM], EXACT, _messages(self.where, "params"), strict=strict
        )
        return parts, params


def _saved_items(custom: Any) -> set[str]:
    """The items treeopt's custom metadata says were saved (empty when that metadata is missing)."""
    checksums = custom.get("checksums") if isinstance(custom, Mapping) else None
    return set(checksums) if isinstance(checksums, Mapping) else set()


def _listed(custom: Any, key: str) -> list[str]:
    """The item names under ``key`` in treeopt's custom metadata (``[]`` when absent or malformed)."""
    names = custom.get(key) if isinstance(custom, Mapping) else None
    return [n for n in names if n in (OPTIMIZER_ITEM, PARAMS_ITEM)] if isinstance(names, list) else []


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


@contextlib.contextmanager
def directory_reader(directory: str | os.PathLike[str], verify: bool = True) -> Iterator[Reader]:
    """A :class:`Reader` of the checkpoint in ``directory`` (or the sibling of an interrupted forced save)."""
    path = Siblings(directory).readable()
    ckptr = checkpointer()
    try:
        yield Reader(path, lambda: ckptr.metadata(path), lambda args: ckptr.restore(path, args=args), verify)
    finally:
        ckptr.close()
