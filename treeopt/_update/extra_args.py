"""Extra arguments of ``tx.update`` (``value_fn``, ``grad=``, ``value=``) turned from the user's structure into optax's.

optax sees the flat ``{name: param}`` dict, so a tree shaped like the params
is flattened by name like the grads, and a function of params is wrapped to
be called with params rebuilt in the structure the user gave ``update``; for
an nnx Module, with an ``nnx.State`` of the trained values, as
``nnx.Optimizer`` calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from treeopt._step.step_io import ARRAYS
from treeopt._tree.layout import ParamLayout
from treeopt._tree.nnx_graph import from_flat_state, is_nnx_graph
from treeopt._tree.paths import leaf_infos, leaf_names
from treeopt._tree.view import view_of

__all__ = ["as_optax_extra_args"]


def as_optax_extra_args(
    extra_args: Mapping[str, Any], grads: Any, params: Any, layout: ParamLayout, *, lookahead: bool
) -> dict[str, Any]:
    """The extra arguments of ``tx.update`` as optax must see them, from the user's structure.

    Functions of params (``value_fn``) are wrapped to receive params in the
    structure given to ``update`` (for an nnx Module, an ``nnx.State`` of the
    trained values: :func:`trained_state`); trees shaped like params or grads
    (``grad=``) become flat dicts by name, like the grads. With
    ``optax.LookaheadParams`` they are passed as given.

    Example:
        >>> import jax.numpy as jnp
        >>> from treeopt._tree.layout import ParamLayout
        >>> params = {"w": jnp.ones(2)}
        >>> layout = ParamLayout.of(params)
        >>> out = as_optax_extra_args({"value": 1.0, "grad": params}, params, params, layout, lookahead=False)
        >>> out["value"], sorted(out["grad"])
        (1.0, ['w'])
    """
    if lookahead:
        return dict(extra_args)
    structures = {layout.treedef, jax.tree.structure(grads)}
    out: dict[str, Any] = {}
    for key, value in extra_args.items():
        if _shaped_like_params(key, value, layout, structures):  # before callables: a Module is one
            out[key] = layout.split_grads(value)[0]
        elif callable(value) and params is not None:
            out[key] = _InUserStructure.wrap(value, layout, params)
        else:
            out[key] = value
    return out


def _shaped_like_params(key: str, value: Any, layout: ParamLayout, structures: set[Any]) -> bool:
    """Whether an extra argument is a tree of per-parameter values (``grad=``), to be flattened by name."""
    treedef: Any = jax.tree.structure(value)
    if treedef not in structures or treedef.num_leaves == 0:
        return False
    if treedef.num_nodes == 1:
        # Params that are one bare array: a leaf of its shape is per-parameter, but
        # never the objective's value, nor a function (value_fn, obj_fn) or another non-array.
        if key == "value" or not hasattr(value, "shape") or not hasattr(value, "dtype"):
            return False
        return layout.avals == ((tuple(np.shape(value)), np.dtype(value.dtype)),)
    return True


def trained_state(module: Any, layout: ParamLayout) -> Any:
    """An ``nnx.State`` of the trained values of an nnx Module, keyed by nnx path: what ``value_fn`` gets.

    The values are arrays, not ``Variable``s, as ``nnx.Optimizer`` hands
    ``value_fn`` ``nnx.as_pure(nnx.state(model, wrt))``: merge it with the
    rest of the model (``nnx.merge(graphdef, state, rest)``) to evaluate it.

    Example:
        >>> from flax import nnx
        >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> state = trained_state(model, ParamLayout.of(model))
        >>> type(state).__name__, sorted(state), state["bias"]
        ('State', ['bias', 'kernel'], Array([0.], dtype=float32))
    """
    leaves, treedef = jax.tree.flatten(module)
    infos = leaf_infos(module)
    index = layout.trained_positions(module, treedef)
    return from_flat_state([(infos[i].path, leaves[i]) for i in index])


class _InUserStructure:
    """A function of params that optax calls with the flat named params; it gets them as the user gave them.

    A pytree: the params' untrained array leaves are its children (traced
    inputs of a compiled step); the function, the params' structure, the
    positions of the trained leaves and the other leaves are its static data.
    So ``value_fn`` of ``optax.lbfgs`` sees a nested dict or an equinox
    module (an nnx Module: an ``nnx.State`` of its trained values), and
    eagerly it is part of the compile key, never a traced argument.
    """

    __slots__ = ("arrays", "fixed", "fn", "index", "names", "treedef", "view")

    def __init__(
        self,
        fn: Callable[..., Any],
        treedef: Any,
        names: tuple[str, ...],
        index: tuple[int, ...],
        arrays: tuple[Any, ...],
        fixed: tuple[tuple[int, Any], ...],
        view: Any = None,
    ):
        self.fn, self.treedef, self.names, self.index = fn, treedef, names, index
        self.arrays, self.fixed, self.view = arrays, fixed, view

    @classmethod
    def wrap(cls, fn: Callable[..., Any], layout: ParamLayout, params: Any) -> _InUserStructure:
        if is_nnx_graph(params):  # an nnx Module: value_fn gets an nnx.State, as nnx.Optimizer gives it
            state = trained_state(params, layout)
            names = leaf_names(state)
            at = {name: i for i, name in enumerate(names)}
            none = (None,) * len(names)
            treedef = jax.tree.structure(state)
            return cls(fn, treedef, layout.names, tuple(at[name] for name in layout.names), none, ())
        leaves, treedef = jax.tree.flatten(params)
        index = layout.trained_positions(params, treedef)
        trained = set(index)
        is_array = [i not in trained and isinstance(leaf, ARRAYS) for i, leaf in enumerate(leaves)]
        arrays = tuple(leaf if keep else None for leaf, keep in zip(leaves, is_array, strict=True))
        fixed = tuple(
            (i, leaf)
            for i, (leaf, keep) in enumerate(zip(leaves, is_array, strict=True))
            if not keep and i not in trained
        )
        # What tx hands it: the trained leaves in the params' structure, the others left out (treeopt._tree.view).
        view = view_of(layout).treedef
        return cls(fn, treedef, layout.names, index, arrays, fixed, view)

    def __call__(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        trained = None
        if (
            isinstance(params, Mapping)
            and len(params) == len(self.names)
            and all(name in params for name in self.names)
        ):
            trained = [params[name] for name in self.names]
        elif self.view is not None and jax.tree.structure(params) == self.view:
            trained = jax.tree.leaves(params)  # the view's leaves are the trained ones, in the names' order
        if trained is not None:
            leaves = list(self.arrays)
            for i, leaf in self.fixed:
                leaves[i] = leaf
            for i, leaf in zip(self.index, trained, strict=True):
                leaves[i] = leaf
            params = self.treedef.unflatten(leaves)
        return self.fn(params, *args, **kwargs)


# The untrained array leaves are its leaves; the function and where the params' leaves go are static data.
jax.tree_util.register_dataclass(
    _InUserStructure, data_fields=["arrays"], meta_fields=["fn", "treedef", "names", "index", "fixed", "view"]
)
