"""Parameter naming: any pytree's leaves as ``{"encoder/layers_0/kernel": leaf}``.

A name joins the keys of a leaf's key path with ``"/"``: dict keys, sequence
indices and attribute names, as a user would write them. The inner ``value``
attribute of a ``flax.nnx.Variable`` is dropped, so an nnx state reads
``"layers/0/kernel"`` like its linen twin.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

import jax
from jax.tree_util import KeyPath

SEPARATOR = "/"


def path_to_name(path: KeyPath) -> str:
    """Joins a ``jax.tree_util`` key path into a ``"/"``-separated name.

    Example:
        >>> from jax.tree_util import DictKey, SequenceKey
        >>> path_to_name((DictKey("encoder"), SequenceKey(0), DictKey("kernel")))
        'encoder/0/kernel'
    """
    return jax.tree_util.keystr(tuple(path), simple=True, separator=SEPARATOR)


def _nnx_variable_type() -> type | None:
    # Only look for nnx when the user imported it: treeopt never imports it itself.
    nnx = sys.modules.get("flax.nnx")
    return getattr(nnx, "Variable", None) if nnx is not None else None


def _drop_lone_indices(paths: list[KeyPath]) -> list[KeyPath]:
    """Drops a ``FlattenedIndexKey(0)`` that names the only child of its node.

    A pytree registered without keys names its children by position; treeo's
    ``Tree`` flattens its fields into one dict inside a 1-tuple, so a lone
    index would turn ``model.w1`` into ``"0/w1"``. It carries no information.
    """
    children: defaultdict[KeyPath, set[Any]] = defaultdict(set)
    for path in paths:
        for depth, key in enumerate(path):
            children[path[:depth]].add(key)
    lone = jax.tree_util.FlattenedIndexKey(0)
    return [
        tuple(key for depth, key in enumerate(path) if not (key == lone and children[path[:depth]] == {lone}))
        for path in paths
    ]


def leaf_names(tree: Any) -> list[str]:
    """The name of every leaf of ``tree``, in ``jax.tree.leaves`` order.

    Example:
        >>> import jax.numpy as jnp
        >>> leaf_names({"dense": {"kernel": jnp.ones(2), "bias": jnp.zeros(2)}})
        ['dense/bias', 'dense/kernel']
    """
    variable_type = _nnx_variable_type()
    if variable_type is None:
        paths = [tuple(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        return [path_to_name(path) for path in _drop_lone_indices(paths)]

    paths = []
    outer = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, variable_type)
    )[0]
    for path, node in outer:
        if not isinstance(node, variable_type):
            paths.append(tuple(path))
            continue
        for inner_path, _ in jax.tree_util.tree_flatten_with_path(node)[0]:
            inner = tuple(inner_path)
            if inner and isinstance(inner[0], jax.tree_util.GetAttrKey) and inner[0].name == "value":
                inner = inner[1:]
            paths.append(tuple(path) + inner)
    return [path_to_name(path) for path in _drop_lone_indices(paths)]


def check_unique(names: Sequence[str]) -> None:
    """Raises ``ValueError`` naming every name that occurs more than once.

    Example:
        >>> check_unique(["a/b", "a/c"])
    """
    repeated = sorted(name for name, count in Counter(names).items() if count > 1)
    if repeated:
        raise ValueError(
            "Two or more parameters share the name(s) "
            f"{repeated}: treeopt keys its state by name, so names must be unique. "
            "Rename the clashing keys/attributes of the params tree."
        )
