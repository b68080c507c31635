"""Read and write the hyperparameters that ``optax.inject_hyperparams`` keeps in a state.

A hyperparameter is named by its own name (``"learning_rate"``) when it occurs
once in the state; when it occurs several times (``multi_transform`` with an
injected optimizer per label, a chain of two injected transformations) each
occurrence is qualified by the labels/indices on its way (``"decay/learning_rate"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.tree_util import DictKey, SequenceKey

from treeopt._paths import path_to_name

_INJECTED_STATES = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def _is_injected(node: Any) -> bool:
    return isinstance(node, _INJECTED_STATES)


def _locate(opt_state: Any) -> dict[str, tuple[Any, str]]:
    """``{qualified name: (path of its injected state, plain name)}``."""
    found: list[tuple[str, Any, str]] = []
    for path, node in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_injected)[0]:
        if not _is_injected(node):
            continue
        prefix = path_to_name(tuple(k for k in path if isinstance(k, (DictKey, SequenceKey))))
        for name in node.hyperparams:
            found.append((prefix, path, name))
    counts: dict[str, int] = {}
    for _, _, name in found:
        counts[name] = counts.get(name, 0) + 1
    located = {}
    for prefix, path, name in found:
        qualified = name if counts[name] == 1 or not prefix else f"{prefix}/{name}"
        located[qualified] = (path, name)
    return located


def get_hyperparams(opt_state: Any) -> dict[str, Any]:
    """All injected hyperparameters of ``opt_state`` by (qualified) name.

    Example:
        >>> import optax, jax.numpy as jnp
        >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
        >>> get_hyperparams(tx.init({"w": jnp.ones(2)}))
        {'learning_rate': Array(0.1, dtype=float32)}
    """
    nodes = {
        tuple(path): node
        for path, node in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_injected)[0]
        if _is_injected(node)
    }
    return {q: nodes[tuple(path)].hyperparams[name] for q, (path, name) in _locate(opt_state).items()}


def _resolve(located: dict[str, tuple[Any, str]], key: str) -> list[tuple[Any, str]]:
    if key in located:
        return [located[key]]
    if not located:
        raise AttributeError(
            f"Cannot set hyperparameter '{key}': the optimizer's transformation has no "
            "injected hyperparameters. Build it with optax.inject_hyperparams, e.g. "
            "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)."
        )
    qualified = sorted(q for q in located if q.rsplit("/", 1)[-1] == key)
    if qualified:
        raise AttributeError(
            f"Hyperparameter '{key}' occurs several times; set one of {qualified} "
            "with opt.set_hyperparams({...})."
        )
    raise AttributeError(
        f"The optimizer has no injected hyperparameter '{key}'; it has {sorted(located)}."
    )


def set_hyperparams(opt_state: Any, values: Mapping[str, Any]) -> Any:
    """A copy of ``opt_state`` with the given injected hyperparameters replaced.

    Values keep the dtype and shape of the value they replace, so a jitted step
    that receives the new state does not recompile.

    Example:
        >>> import optax, jax.numpy as jnp
        >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
        >>> state = set_hyperparams(tx.init({"w": jnp.ones(2)}), {"learning_rate": 0.01})
        >>> round(float(get_hyperparams(state)["learning_rate"]), 6)
        0.01
    """
    located = _locate(opt_state)
    targets: dict[tuple[Any, ...], dict[str, Any]] = {}
    for key, value in values.items():
        for path, name in _resolve(located, key):
            targets.setdefault(tuple(path), {})[name] = value

    def replace(path: Any, node: Any) -> Any:
        new = targets.get(tuple(path)) if _is_injected(node) else None
        if not new:
            return node
        hyperparams = dict(node.hyperparams)
        for name, value in new.items():
            old = hyperparams[name]
            hyperparams[name] = jnp.broadcast_to(jnp.asarray(value, dtype=jnp.result_type(old)), jnp.shape(old))
        return node._replace(hyperparams=hyperparams)

    return jax.tree_util.tree_map_with_path(replace, opt_state, is_leaf=_is_injected)
