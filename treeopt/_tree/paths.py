"""Parameter naming: any pytree's leaves as ``{"encoder/layers_0/kernel": leaf}``; paths in state dicts.

A name joins the keys of a leaf's key path with ``"/"``: dict keys, sequence
indices and attribute names, as a user would write them. The inner ``value``
attribute of a ``flax.nnx.Variable`` is dropped, so an nnx state reads
``"layers/0/kernel"`` like its linen twin.

A path (:data:`Path`) is the tuple of string keys that leads to a leaf of a
nested state dict; parameter names may contain ``"/"``, so paths are never
split on it (``treeopt._state.plain.flatten_paths`` flattens a state dict by them).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax.tree_util import DictKey, KeyPath

from treeopt._tree.nnx_graph import variable_type as nnx_variable_type

SEPARATOR = "/"


def path_to_name(path: KeyPath) -> str:
    """Joins a ``jax.tree_util`` key path into a ``"/"``-separated name.

    Example:
        >>> from jax.tree_util import DictKey, SequenceKey
        >>> path_to_name((DictKey("encoder"), SequenceKey(0), DictKey("kernel")))
        'encoder/0/kernel'
    """
    return jax.tree_util.keystr(tuple(path), simple=True, separator=SEPARATOR)


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


class _Walk(NamedTuple):
    paths: list[KeyPath]  # each leaf's key path, an nnx Variable's inner "value" key dropped
    owners: list[Any]  # the nnx Variable holding each leaf, or None
    nodes: list[int]  # the position of that Variable (or of the leaf) among the outer leaves
    leaves: list[Any]


def _walk(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> _Walk:
    """Every leaf of ``tree`` (``jax.tree.leaves(tree, is_leaf=is_leaf)``) with its path and nnx owner.

    The outer leaves are those of ``jax.tree.leaves(tree, is_leaf=is_nnx_variable)``.
    """
    variable_type = nnx_variable_type()
    if variable_type is None:
        flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
        return _Walk(
            _drop_lone_indices([tuple(path) for path, _ in flat]),
            [None] * len(flat),
            list(range(len(flat))),
            [leaf for _, leaf in flat],
        )

    def outer_leaf(x: Any) -> bool:
        return isinstance(x, variable_type) or (is_leaf is not None and is_leaf(x))

    paths: list[KeyPath] = []
    owners: list[Any] = []
    nodes: list[int] = []
    leaves: list[Any] = []
    outer = jax.tree_util.tree_flatten_with_path(tree, is_leaf=outer_leaf)[0]
    for position, (path, node) in enumerate(outer):
        if not isinstance(node, variable_type):
            paths.append(tuple(path))
            owners.append(None)
            nodes.append(position)
            leaves.append(node)
            continue
        for inner_path, leaf in jax.tree_util.tree_flatten_with_path(node, is_leaf=is_leaf)[0]:
            inner = tuple(inner_path)
            if inner and isinstance(inner[0], jax.tree_util.GetAttrKey) and inner[0].name == "value":
                inner = inner[1:]
            paths.append(tuple(path) + inner)
            owners.append(node)
            nodes.append(position)
            leaves.append(leaf)
    return _Walk(_drop_lone_indices(paths), owners, nodes, leaves)


def leaf_names(tree: Any) -> list[str]:
    """The name of every leaf of ``tree``, in ``jax.tree.leaves`` order.

    Example:
        >>> import jax.numpy as jnp
        >>> leaf_names({"dense": {"kernel": jnp.ones(2), "bias": jnp.zeros(2)}})
        ['dense/bias', 'dense/kernel']
    """
    return [path_to_name(path) for path in _walk(tree).paths]


def named_leaves(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[tuple[str, Any]]:
    """``[(name, leaf)]`` in ``jax.tree.leaves(tree, is_leaf=is_leaf)`` order, named as :func:`leaf_names`.

    Example:
        >>> named_leaves({"a": {"b": None}, "c": 1}, is_leaf=lambda x: x is None)
        [('a/b', None), ('c', 1)]
    """
    walk = _walk(tree, is_leaf)
    return [(path_to_name(path), leaf) for path, leaf in zip(walk.paths, walk.leaves, strict=True)]


def _key_part(key: Any) -> Any:
    """A key path entry as nnx writes it in a path: the bare dict key, attribute name or index."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return key


class LeafInfo(NamedTuple):
    """One leaf of a tree as ``wrt=`` sees it: name, nnx-style path, and the nnx ``Variable`` holding it."""

    name: str
    """The leaf's name, e.g. ``"layers/0/kernel"``."""
    path: tuple[Any, ...]
    """Its path as nnx filters receive it: bare keys and indices, e.g. ``("layers", 0, "kernel")``."""
    variable: Any
    """The nnx ``Variable`` holding the leaf, or None."""
    node: int
    """Position of that ``Variable`` (or of the leaf) in ``jax.tree.leaves(tree, is_leaf=is_nnx_variable)``."""


def leaf_infos(tree: Any) -> list[LeafInfo]:
    """A :class:`LeafInfo` for every leaf of ``tree``, in ``jax.tree.leaves`` order.

    Example:
        >>> import jax.numpy as jnp
        >>> leaf_infos({"layers": [jnp.ones(2)]})
        [LeafInfo(name='layers/0', path=('layers', 0), variable=None, node=0)]
    """
    paths, owners, nodes, _ = _walk(tree)
    return [
        LeafInfo(path_to_name(path), tuple(_key_part(k) for k in path), owner, node)
        for path, owner, node in zip(paths, owners, nodes, strict=True)
    ]


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


def param_owners(paths: Sequence[tuple[Any, ...]], names: set[str]) -> list[int | None]:
    """For each key path of a state over the flat, named params, the position of the ``DictKey`` naming its param, or None.

    A dict counts as params-shaped when all its keys are trainable names (a
    masked dict holds a subset: its ``MaskedNode`` entries have no leaves); the
    innermost such key on the path wins.

    Example:
        >>> from jax.tree_util import DictKey, SequenceKey
        >>> param_owners([(SequenceKey(0), DictKey("w")), (SequenceKey(1),)], {"w"})
        [1, None]
    """
    keys_of: dict[tuple[Any, ...], set[Any]] = defaultdict(set)
    for path in paths:
        for k, key in enumerate(path):
            if isinstance(key, DictKey):
                keys_of[path[:k]].add(key.key)
    params_dicts = {prefix for prefix, keys in keys_of.items() if keys <= names}
    out: list[int | None] = []
    for path in paths:
        owner = None
        for k, key in enumerate(path):
            if isinstance(key, DictKey) and path[:k] in params_dicts:
                owner = k
        out.append(owner)
    return out


Path = tuple[str, ...]
"""The string keys that lead to a leaf of a nested state dict."""


def path_str(path: Path) -> str:
    """A path as one readable string, its keys joined by ``"/"``.

    Example:
        >>> path_str(("opt_state", "0", "mu", "dense/kernel"))
        'opt_state/0/mu/dense/kernel'
    """
    return "/".join(path)
