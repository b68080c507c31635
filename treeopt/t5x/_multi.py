"""``MultiOptimizer``: different optimizer definitions for disjoint subsets of the params."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util
from flax.core import FrozenDict

from treeopt.internal import is_spec, path_to_name
from treeopt.t5x import _state
from treeopt.t5x._base import Optimizer, OptimizerDef, OptimizerState, check_grads
from treeopt.t5x._optax import OptaxWrapper
from treeopt.t5x._partition_rules import check_logical_axes, key_path, missing_axes_error
from treeopt.t5x._zero import zero_sharded


class _Match:
    """Marks a value a traversal selected."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def _get(tree: Any, keys: tuple[Any, ...]) -> Any:
    for key in keys:
        tree = tree[key]
    return tree


class _Split:
    """Which positions of a params-shaped tree each traversal owns, and their keys."""

    def __init__(
        self,
        treedef: Any,
        names: list[str],
        keys: list[tuple[Any, ...]],
        groups: list[list[int]],
        frozen: bool,
    ):
        self.treedef, self.names, self.keys, self.groups, self.frozen = treedef, names, keys, groups, frozen

    def subtree(self, index: int, values: Sequence[Any]) -> Any:
        """The sub-target of traversal ``index``: nested dicts keyed like the target, its leaves only."""
        tree = traverse_util.unflatten_dict({self.keys[i]: values[i] for i in self.groups[index]})
        return FrozenDict(tree) if self.frozen else tree

    def read(self, index: int, subtree: Any) -> Iterator[tuple[int, Any]]:
        for i in self.groups[index]:
            yield i, _get(subtree, self.keys[i])


def _keeps_tuple_state(opt_def: OptimizerDef) -> bool:
    """Whether a sub-optimizer's state is not one entry per parameter (an optax state)."""
    if isinstance(opt_def, OptaxWrapper):
        return True
    return isinstance(opt_def, MultiOptimizer) and opt_def.tuple_layout


class MultiOptimizer(OptimizerDef):
    """Different optimizers for disjoint subsets of the params, picked by ``flax.traverse_util`` traversals.

    ``MultiOptimizer(traversals_and_optimizers)`` takes one sequence of
    ``(traversal, optimizer_def)`` pairs, as T5X's. Each sub-optimizer sees the
    params its traversal selects (nested like the target); params no traversal
    selects are not trained. Overlapping traversals raise ``ValueError``.
    ``hyper_params`` is the list of the sub-optimizers' hyper params.

    State layout: when the sub-optimizers keep one state per parameter (the
    legacy Adafactor) ``param_states`` is shaped like the target with ``None``
    for unselected params, as T5X stores it. With optax sub-optimizers
    (``OptaxWrapper``, which T5X's cannot run) it is a tuple of each
    sub-optimizer's state, shaped like its subset; its state dict leaves out
    empty dicts, as ``OptaxWrapper``'s does.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import traverse_util
        >>> from treeopt.t5x import optimizers
        >>> kernels = traverse_util.ModelParamTraversal(lambda path, _: "kernel" in path)
        >>> biases = traverse_util.ModelParamTraversal(lambda path, _: "bias" in path)
        >>> opt_def = optimizers.MultiOptimizer(
        ...     [(kernels, optimizers.sgd(learning_rate=0.1)), (biases, optimizers.sgd(learning_rate=1.0))])
        >>> opt = opt_def.create({"kernel": jnp.ones(2), "bias": jnp.ones(2)})
        >>> opt.apply_gradient({"kernel": jnp.ones(2), "bias": jnp.ones(2)}).target
        {'bias': Array([0., 0.], dtype=float32), 'kernel': Array([0.9, 0.9], dtype=float32)}
    """

    def __init__(self, traversals_and_optimizers: Sequence[tuple[traverse_util.Traversal, OptimizerDef]]):
        pairs = list(traversals_and_optimizers)
        if not pairs:
            raise ValueError("MultiOptimizer needs at least one (traversal, optimizer_def) pair.")
        for i, pair in enumerate(pairs):
            if not (
                isinstance(pair, (list, tuple))
                and len(pair) == 2
                and isinstance(pair[0], traverse_util.Traversal)
                and isinstance(pair[1], OptimizerDef)
            ):
                raise TypeError(
                    f"MultiOptimizer takes a sequence of (flax.traverse_util.Traversal, OptimizerDef) "
                    f"pairs; entry {i} is {pair!r}."
                )
        traversals, sub_optimizers = zip(*pairs, strict=True)
        super().__init__([opt.hyper_params for opt in sub_optimizers])
        self.traversals = traversals
        self.sub_optimizers = sub_optimizers
        self._tuple_layout = any(_keeps_tuple_state(opt) for opt in sub_optimizers)

    @property
    def tuple_layout(self) -> bool:
        """Whether ``param_states`` is a tuple of the sub-optimizers' states (optax ones among them).

        Otherwise it is shaped like the target, as T5X stores it.

        Example:
            >>> from flax import traverse_util
            >>> from treeopt.t5x import adafactor, optimizers
            >>> everything = traverse_util.ModelParamTraversal(lambda path, _: True)
            >>> optimizers.MultiOptimizer([(everything, optimizers.sgd(1.0))]).tuple_layout
            True
            >>> optimizers.MultiOptimizer([(everything, adafactor.Adafactor(0.1))]).tuple_layout
            False
        """
        return self._tuple_layout

    # -- which params each sub-optimizer owns ---------------------------------------------------

    def _split(self, tree: Any, is_leaf: Any = None) -> _Split:
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
        names = [path_to_name(path) for path, _ in flat]
        keys = [key_path(path) for path, _ in flat]
        owner: dict[int, int] = {}
        overlaps: dict[str, list[int]] = {}
        groups = []
        for t, traversal in enumerate(self.traversals):
            marked = traversal.update(_Match, tree)
            found = {
                key_path(path)
                for path, leaf in jax.tree_util.tree_flatten_with_path(
                    marked, is_leaf=lambda x: isinstance(x, _Match) or (is_leaf is not None and is_leaf(x))
                )[0]
                if isinstance(leaf, _Match)
            }
            group = []
            for i, key in enumerate(keys):
                if not any(key[:end] in found for end in range(1, len(key) + 1)):
                    continue
                if i in owner:
                    overlaps.setdefault(names[i], [owner[i]]).append(t)
                    continue
                owner[i] = t
                group.append(i)
            groups.append(group)
        if overlaps:
            details = ", ".join(f"'{n}' (traversals {ts})" for n, ts in sorted(overlaps.items()))
            raise ValueError(
                f"Multiple optimizers match the same leaves: {details}. Each parameter may be selected "
                "by one traversal only; make the filters disjoint."
            )
        return _Split(treedef, names, keys, groups, isinstance(tree, FrozenDict))

    def _sub_states(self, split: _Split, param_states: Any) -> list[Any]:
        if self._tuple_layout:
            return list(param_states)
        per_position = split.treedef.flatten_up_to(param_states)
        return [split.subtree(i, per_position) for i in range(len(self.sub_optimizers))]

    def _merge_states(self, split: _Split, sub_states: Sequence[Any]) -> Any:
        if self._tuple_layout:
            return tuple(sub_states)
        per_position: list[Any] = [None] * len(split.names)
        for i, sub in enumerate(sub_states):
            if sub is None:
                continue
            for position, value in split.read(i, sub):
                per_position[position] = value
        return split.treedef.unflatten(per_position)

    # -- OptimizerDef ---------------------------------------------------------------------------

    def init_state(self, params: Any) -> OptimizerState:
        """Each sub-optimizer's state for its subset; see the class docstring for the layout."""
        split = self._split(params)
        leaves = split.treedef.flatten_up_to(params)
        sub_states = [
            opt.init_state(split.subtree(i, leaves)).param_states for i, opt in enumerate(self.sub_optimizers)
        ]
        return OptimizerState(jnp.asarray(0, dtype=jnp.int32), self._merge_states(split, sub_states))

    def update_hyper_params(self, **hyper_param_overrides: Any) -> list[Any]:
        """Per sub-optimizer hyper params: ``hyper_params=[...]`` replaces them, other kwargs go to each.

        Each sub-optimizer checks its own (an unknown name or a bad value raises).

        Example:
            >>> from flax import traverse_util
            >>> from treeopt.t5x import optimizers
            >>> everything = traverse_util.ModelParamTraversal(lambda path, _: True)
            >>> multi = optimizers.MultiOptimizer([(everything, optimizers.sgd(1.0))])
            >>> multi.update_hyper_params(learning_rate=0.5)
            [_OptaxWrapperHyperParams(learning_rate=0.5)]
        """
        hyper_params = hyper_param_overrides.pop("hyper_params", self.hyper_params)
        if not isinstance(hyper_params, (list, tuple)) or len(hyper_params) != len(self.sub_optimizers):
            raise TypeError(
                f"hyper_params= of a MultiOptimizer must be a list with one entry per sub-optimizer "
                f"({len(self.sub_optimizers)}), got {hyper_params!r}."
            )
        return [
            opt.update_hyper_params(hyper_params=hp, **hyper_param_overrides)
            for opt, hp in zip(self.sub_optimizers, hyper_params, strict=True)
        ]

    def apply_gradient(self, hyper_params: Any, params: Any, state: OptimizerState, grads: Any) -> Any:
        """Applies each sub-optimizer to its subset: returns ``(new_params, new_state)``."""
        if len(hyper_params) != len(self.sub_optimizers):
            raise ValueError(
                f"MultiOptimizer has {len(self.sub_optimizers)} sub-optimizers but got "
                f"{len(hyper_params)} hyper params."
            )
        check_grads(params, grads, per_example=True)
        split = self._split(params)
        leaves = split.treedef.flatten_up_to(params)
        grad_leaves = split.treedef.flatten_up_to(grads)
        new_leaves = list(leaves)
        sub_states = self._sub_states(split, state.param_states)
        new_sub_states = []
        for i, (opt, hp) in enumerate(zip(self.sub_optimizers, hyper_params, strict=True)):
            if not split.groups[i]:
                new_sub_states.append(sub_states[i])
                continue
            sub_params, new_sub_state = opt.apply_gradient(
                hp,
                split.subtree(i, leaves),
                OptimizerState(state.step, sub_states[i]),
                split.subtree(i, grad_leaves),
            )
            for position, value in split.read(i, sub_params):
                new_leaves[position] = value
            new_sub_states.append(new_sub_state.param_states)
        new_params = split.treedef.unflatten(new_leaves)
        return new_params, OptimizerState(state.step + 1, self._merge_states(split, new_sub_states))

    def state_dict(self, target: Any, state: OptimizerState) -> dict[str, Any]:
        """T5X's state dict; with optax sub-optimizers their empty dicts are left out."""
        sd = super().state_dict(target, state)
        if not self._tuple_layout:
            return sd
        return {"target": sd["target"], "state": _state.drop_empty_dicts(sd["state"])}

    def set_param_axes(self, param_logical_axes: Any) -> None:
        """Passes each sub-optimizer that takes them the logical axes of its subset.

        Example:
            >>> from flax import traverse_util
            >>> from jax.sharding import PartitionSpec as P
            >>> from treeopt.t5x import optimizers
            >>> everything = traverse_util.ModelParamTraversal(lambda path, _: True)
            >>> optimizers.MultiOptimizer([(everything, optimizers.sgd(1.0))]).set_param_axes({"w": P("embed")})
        """
        split = self._split(param_logical_axes, is_leaf=is_spec)
        leaves = split.treedef.flatten_up_to(param_logical_axes)
        for i, opt in enumerate(self.sub_optimizers):
            set_axes = getattr(opt, "set_param_axes", None)
            if set_axes is not None:
                set_axes(split.subtree(i, leaves))

    @zero_sharded
    def derive_logical_axes(self, optimizer: Optimizer, param_logical_axes: Any) -> Optimizer:
        """Each sub-optimizer's logical axes for its subset, in this optimizer's state layout.

        Entries of params no sub-optimizer derives axes for are ``None``.
        ``shard_state_over``, ``mesh`` and ``logical_axis_rules`` apply ZeRO-1 to
        every sub-optimizer's state, as in ``OptaxWrapper.derive_logical_axes``.

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import traverse_util
            >>> from jax.sharding import PartitionSpec as P
            >>> from treeopt.t5x import optimizers
            >>> everything = traverse_util.ModelParamTraversal(lambda path, _: True)
            >>> multi = optimizers.MultiOptimizer([(everything, optimizers.adam(1.0))])
            >>> axes = multi.derive_logical_axes(multi.create({"w": jnp.ones(3)}), {"w": P("embed")})
            >>> axes.state.param_states[0][0].mu == {"w": P("embed")}
            True
        """
        target = optimizer.target
        check_logical_axes(target, param_logical_axes)
        split = self._split(target)
        leaves = split.treedef.flatten_up_to(target)
        by_key = {
            key_path(path): spec
            for path, spec in jax.tree_util.tree_flatten_with_path(param_logical_axes, is_leaf=is_spec)[0]
        }
        missing = [name for name, key in zip(split.names, split.keys, strict=True) if key not in by_key]
        if missing:
            raise missing_axes_error(missing)
        axes = [by_key[key] for key in split.keys]
        sub_states = self._sub_states(split, optimizer.state.param_states)
        derived = []
        for i, opt in enumerate(self.sub_optimizers):
            derive = getattr(opt, "derive_logical_axes", None)
            if derive is None:
                derived.append(
                    None if not self._tuple_layout else jax.tree.map(lambda _: None, sub_states[i])
                )
                continue
            sub_opt = Optimizer(opt, OptimizerState(None, sub_states[i]), split.subtree(i, leaves))
            derived.append(derive(sub_opt, split.subtree(i, axes)).state.param_states)
        state = OptimizerState(None, self._merge_states(split, derived))
        target_axes = split.treedef.unflatten(axes)
        derived_axes = Optimizer(optimizer.optimizer_def, state, target_axes)
        return derived_axes
