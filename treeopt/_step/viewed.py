"""``tx`` over the flat, named state, seeing the params in the user's own structure.

:func:`over_names` turns the user's transformation into one over ``{name:
leaf}`` dicts, which is what the step, the low-bit wing, the precision layer
and the sharding wing work on. Inside, ``tx`` is handed the view of
:mod:`treeopt._tree.view`: the grads, params and updates in the structure
given to ``init`` (an ``nnx.State`` for nnx), and its state with each
params-shaped part in that structure. So masks and labels written for raw
optax select exactly what they select there, and what treeopt stores stays
keyed by name.

Example:
    >>> import jax.numpy as jnp, optax
    >>> from treeopt._tree.layout import ParamLayout
    >>> params = {"dense": {"kernel": jnp.ones(2), "bias": jnp.ones(2)}}
    >>> decay_kernels = lambda p: {"dense": {"kernel": True, "bias": False}}
    >>> tx = over_names(optax.masked(optax.sgd(1.0), decay_kernels), ParamLayout.of(params))
    >>> state = tx.init({"dense/kernel": jnp.ones(2), "dense/bias": jnp.ones(2)})
    >>> tx.update({"dense/kernel": jnp.ones(2), "dense/bias": jnp.ones(2)}, state)[0]
    {'dense/bias': Array([1., 1.], dtype=float32), 'dense/kernel': Array([-1., -1.], dtype=float32)}
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import optax

from treeopt._compat.optax_private import multi_steps_parts
from treeopt._tree.layout import ParamLayout
from treeopt._tree.view import TreeView, view_of

__all__ = ["over_names"]


@functools.lru_cache(maxsize=256)
def over_names(tx: optax.GradientTransformation, layout: ParamLayout) -> optax.GradientTransformation:
    """``tx`` as a transformation over ``{name: leaf}`` dicts that sees the params as ``layout``'s user gave them.

    ``tx`` itself where the two are the same (flat dict params, a bare
    array). An ``optax.MultiSteps`` keeps accumulating over the flat dicts,
    around its inner transformation seen this way. One object per ``(tx,
    layout)``, so a compiled step keyed by it is found again.
    """
    view = view_of(layout)
    if view.identity:
        return tx
    multi = getattr(tx.update, "__self__", None)
    if isinstance(multi, optax.MultiSteps):
        parts = multi_steps_parts(multi)
        inner = over_names(optax.with_extra_args_support(parts.opt), layout)
        return optax.MultiSteps(inner, *parts[1:]).gradient_transformation()
    return _Viewed(tx, view).transformation()


class _Viewed:
    """The conversions around one ``tx`` and one view."""

    def __init__(self, tx: optax.GradientTransformation, view: TreeView):
        self.tx = optax.with_extra_args_support(tx)
        self.view = view

    def transformation(self) -> optax.GradientTransformationExtraArgs:
        return optax.GradientTransformationExtraArgs(self.init, self.update)

    def _nest(self, tree: Any) -> Any:
        if tree is None:
            return None
        if isinstance(tree, optax.LookaheadParams):
            return optax.LookaheadParams(self.view.nest(tree.fast), self.view.nest(tree.slow))
        return self.view.nest(tree)

    def _flatten(self, tree: Any) -> Any:
        if isinstance(tree, optax.LookaheadParams):
            return optax.LookaheadParams(self.view.flatten(tree.fast), self.view.flatten(tree.slow))
        return self.view.flatten(tree)

    def init(self, params: Any) -> Any:
        nested = self._nest(params)
        try:
            state = self.tx.init(nested)
        except (ValueError, TypeError) as error:
            if not any(word in str(error).lower() for word in ("structure", "pytree", "mismatch")):
                raise  # not a tree that fails to fit the params
            raise ValueError(
                f"tx.init failed on the params in the structure given to init ({_shown(nested)}): "
                f"{error}\nA mask or labels tree (optax.masked, multi_transform, partition, the mask= of "
                "the aliases) must be shaped like those params, or be a prefix of them, as with raw optax; "
                "a callable gets them in that structure too. To select by parameter name instead, use "
                "treeopt.mask('*kernel') or treeopt.labels({'*kernel': 'decay'}, default='rest')."
            ) from error
        return self.view.keyed_state(state)

    def update(self, updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        keys = self.view.keys_of_flat(jax.tree.structure(state))
        if keys is None:  # a state loaded or built elsewhere: its structure as tx makes it, from shapes
            nested = jax.tree.structure(jax.eval_shape(self.tx.init, self._nest(_abstract(updates))))
            keys = self.view.keys_of_nested(nested)
            if keys.flat != jax.tree.structure(state):
                raise ValueError(
                    f"The optimizer state does not fit tx over these params: got {jax.tree.structure(state)}, "
                    f"tx makes {keys.flat}."
                )
        extra = {key: self._nest(value) if self._by_name(value) else value for key, value in extra.items()}
        new_updates, new_state = self.tx.update(
            self._nest(updates), self.view.nested_state(state, keys), self._nest(params), **extra
        )
        return self._flatten(new_updates), self.view.keyed_state(new_state)

    def _by_name(self, value: Any) -> bool:
        """Whether an extra argument is a tree by name (``grad=``): handed to ``tx`` in the view's structure."""
        return (
            isinstance(value, Mapping)
            and not isinstance(value, optax.LookaheadParams)
            and (set(value) == set(self.view.names))
        )


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x)), tree)


def _shown(tree: Any) -> str:
    text = str(jax.tree.structure(tree))
    return text if len(text) <= 300 else text[:300] + "..."
