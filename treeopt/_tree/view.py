"""What ``tx`` sees: the trained params in the structure the user gave them, and the way back to names.

treeopt stores its state flat and keyed by parameter name, but an optax
transformation reads the params' structure (a mask or labels tree, a
``flatten_dict`` callable, ``optax.partition``). So ``tx`` is handed a *view*:
the trained leaves put back in the user's own structure, with the leaves that
are not trained left out: an untrained array as ``optax.masked`` leaves it
out (an ``optax.MaskedNode``), any other leaf (a function, a Python number)
as ``eqx.filter(model, eqx.is_array)`` leaves it out (``None``), and an
untrained nnx Variable absent, as ``nnx.state(model, wrt)`` leaves it out. What ``tx`` returns is keyed by name
again: the updates, and every params-shaped part of its state.

A view is static: it is computed from the layout of ``init``'s params, so a
changed static field of a module does not change what ``tx`` sees, and the
conversions cost nothing in a compiled step (they move leaves, nothing else).

Example:
    >>> import jax.numpy as jnp
    >>> from treeopt._tree.layout import ParamLayout
    >>> params = {"dense": {"kernel": jnp.ones(2), "bias": jnp.ones(2)}, "n": 3, "step": jnp.int32(0)}
    >>> view = view_of(ParamLayout.of(params))
    >>> view.nest({"dense/kernel": 1, "dense/bias": 2})
    {'dense': {'bias': 2, 'kernel': 1}, 'n': None, 'step': MaskedNode()}
    >>> view.flatten({"dense": {"bias": 2, "kernel": 1}, "n": None, "step": None})
    {'dense/bias': 2, 'dense/kernel': 1}
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import optax

from treeopt._tree.layout import ParamLayout
from treeopt._tree.nnx_graph import from_flat_state

__all__ = ["StateKeys", "TreeView", "view_of"]


class StateKeys(NamedTuple):
    """How one structure of ``tx``'s state (over the view) and its form keyed by name trade leaves."""

    nested: Any
    """The treedef of the state as ``tx`` makes it, over the view."""
    flat: Any
    """The treedef of the same state with each params-shaped part a ``{name: value}`` dict."""
    order: tuple[int, ...]
    """Leaf ``i`` of the keyed form is leaf ``order[i]`` of the nested one."""
    inverse: tuple[int, ...]
    """Leaf ``j`` of the nested form is leaf ``inverse[j]`` of the keyed one."""


class TreeView:
    """The trained params of one layout in the user's structure, and back to ``{name: leaf}``.

    ``identity`` is true where the view is the flat dict itself (params that
    are a flat dict of trained leaves, or one bare array, which ``tx`` sees
    as ``{name: array}``): then nothing is converted.

    Example:
        >>> import jax.numpy as jnp
        >>> from treeopt._tree.layout import ParamLayout
        >>> view_of(ParamLayout.of({"w": jnp.ones(2)})).identity
        True
    """

    def __init__(self, layout: ParamLayout):
        self.names = layout.names
        self._layout = layout
        self._nnx_paths = layout.nnx_paths
        single = layout.treedef.num_nodes == 1 and layout.treedef.num_leaves == 1
        placeholders = self.nest({name: name for name in self.names}) if not single else None
        flat_structure: Any = jax.tree.structure({name: name for name in self.names})
        self.identity = single or flat_structure == jax.tree.structure(placeholders)
        self.treedef = jax.tree.structure(placeholders) if not self.identity else None
        # The names in the order of the view's leaves (an nnx.State sorts its keys).
        self.order: tuple[str, ...] = (
            tuple(jax.tree.leaves(placeholders)) if not self.identity else tuple(sorted(self.names))
        )
        self._keys: dict[Any, StateKeys] = {}
        root = self.treedef.node_data() if self.treedef is not None else None
        self._sequence_root = root is not None and root[0] in (tuple, list)

    # -- params, grads and updates ---------------------------------------------------

    def nest(self, flat: dict[str, Any]) -> Any:
        """The view of ``{name: leaf}``: the leaves in the user's structure (an ``nnx.State`` for nnx)."""
        if self._nnx_paths is not None:
            return from_flat_state(
                [(path, flat[name]) for name, path in zip(self.names, self._nnx_paths, strict=True)]
            )
        layout = self._layout
        leaves: list[Any] = [None] * layout.treedef.num_leaves
        for i in layout.masked_index:
            leaves[i] = optax.MaskedNode()
        for name, i in zip(layout.names, layout.index, strict=True):
            leaves[i] = flat[name]
        return layout.treedef.unflatten(leaves)

    def flatten(self, tree: Any) -> dict[str, Any]:
        """``{name: leaf}`` of a tree in the view's structure (the updates ``tx`` returns)."""
        leaves = jax.tree.leaves(tree)
        if len(leaves) != len(self.order):
            raise ValueError(
                f"tx returned a tree of {len(leaves)} leaves where the params have {len(self.order)} "
                f"trained ones: {jax.tree.structure(tree)}, expected {self.treedef}."
            )
        return dict(zip(self.order, leaves, strict=True))

    # -- state -----------------------------------------------------------------------

    def keys_of_nested(self, nested: Any) -> StateKeys:
        """How a state of treedef ``nested`` (``tx``'s, over the view) is keyed by name; cached per treedef."""
        found = self._keys.get(nested)
        if found is None:
            positions = nested.unflatten(range(nested.num_leaves))
            order, flat = jax.tree.flatten(self._keyed(positions))
            inverse = [0] * len(order)
            for i, j in enumerate(order):
                inverse[j] = i
            found = StateKeys(nested, flat, tuple(order), tuple(inverse))
            self._keys[nested] = found
            self._keys[("flat", flat)] = found
        return found

    def keys_of_flat(self, flat: Any) -> StateKeys | None:
        """The :class:`StateKeys` whose keyed form has treedef ``flat``, where one was seen."""
        return self._keys.get(("flat", flat))

    def keyed_state(self, state: Any) -> Any:
        """``tx``'s state over the view, with each params-shaped part a ``{name: value}`` dict."""
        leaves, nested = jax.tree.flatten(state)
        keys = self.keys_of_nested(nested)
        return keys.flat.unflatten([leaves[j] for j in keys.order])

    def nested_state(self, state: Any, keys: StateKeys) -> Any:
        """The state keyed by name (treedef ``keys.flat``) in the structure ``tx`` made it."""
        leaves = jax.tree.leaves(state)
        return keys.nested.unflatten([leaves[i] for i in keys.inverse])

    def _keyed(self, x: Any) -> Any:
        parts = _parts_at(x, self.treedef)
        if parts is not None and _per_param(parts, strict=self._sequence_root):
            return {name: part for name, part in sorted(zip(self.order, parts, strict=True))}
        children, node_ = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)
        node: Any = node_
        if node.num_nodes == 1 and node.num_leaves == 1 and node.node_data() is None:
            return x  # a leaf
        return node.unflatten([self._keyed(child) for child in children])


def _parts_at(x: Any, treedef: Any) -> list[Any] | None:
    """The subtrees of ``x`` at the leaves of ``treedef``, if ``x`` has that structure down to them.

    A ``MaskedNode`` where ``treedef`` has a subtree (``optax.masked`` with a
    mask prefix) stands for each of its leaves.
    """
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return [x]
    if isinstance(x, optax.MaskedNode):
        return [x] * treedef.num_leaves
    children, node_ = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)
    node: Any = node_
    if node.node_data() != treedef.node_data():
        return None
    below = treedef.children()
    if len(children) != len(below):
        return None
    out: list[Any] = []
    for child, sub in zip(children, below, strict=True):
        parts = _parts_at(child, sub)
        if parts is None:
            return None
        out.extend(parts)
    return out


def _per_param(parts: list[Any], *, strict: bool) -> bool:
    """Whether subtrees found at the params' leaves are per-parameter values.

    Any subtree may stand for one parameter (SM3 keeps a list of accumulators
    per parameter), except where the params are a tuple or list: a chain's
    state is a tuple too, so there each must be one leaf or masked. At least
    one holds an array (or all are masked): empty states are no one's.
    """
    if not parts:
        return False
    leaves = 0
    for part in parts:
        count = len(jax.tree.leaves(part))
        if strict and (count > 1 or (count == 1 and not _is_leaf(part))):
            return False
        leaves += count
    return leaves > 0 or all(isinstance(part, optax.MaskedNode) for part in parts)


def _is_leaf(x: Any) -> bool:
    return x is not None and jax.tree_util.treedef_is_leaf(jax.tree.structure(x))


@functools.lru_cache(maxsize=256)
def view_of(layout: ParamLayout) -> TreeView:
    """The view of ``layout``'s params that ``tx`` sees (one per layout, so that it is static data)."""
    return TreeView(layout)
