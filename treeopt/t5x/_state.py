"""Plumbing shared by the T5X surface: state reshaping, T5X state dicts, one-program eager steps.

treeopt keeps an optax state over the flat dict ``{name: param}``; T5X shows
and checkpoints the same state shaped like the target (``mu`` is a nested
dict like the params). The two differ only inside the params-shaped dicts, so
converting is a matter of finding those dicts (their keys are exactly the
trainable names) and nesting/flattening them with the target's layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np

from treeopt.layout import ParamLayout
from treeopt.optimizer import Optimizer as CoreOptimizer

# -- flat named state <-> target-shaped state -----------------------------------------


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], Any]:
    """``jax.tree.flatten`` with the treedef typed loosely (``flatten_up_to``/``unflatten`` are used)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_leaf)
    return leaves, treedef


def structure(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """``jax.tree.structure``, typed loosely."""
    return jax.tree.structure(tree, is_leaf=is_leaf)


def _named_dict(layout: ParamLayout) -> Callable[[Any], bool]:
    names = frozenset(layout.names)
    return lambda x: bool(names) and isinstance(x, dict) and len(x) == len(names) and x.keys() == names


def nest(flat: Mapping[str, Any], layout: ParamLayout) -> Any:
    """``{name: value}`` placed at the params' positions; untrained positions hold ``None``."""
    leaves: list[Any] = [None] * len(layout.all_names)
    for name, i in zip(layout.names, layout.index, strict=True):
        leaves[i] = flat[name]
    return layout.treedef.unflatten(leaves)


def unnest(tree: Any, layout: ParamLayout) -> dict[str, Any]:
    """The inverse of :func:`nest`: a target-shaped tree back to ``{name: value}``."""
    at = layout.treedef.flatten_up_to(tree)
    return {name: at[i] for name, i in zip(layout.names, layout.index, strict=True)}


def to_target_shape(flat_state: Any, layout: ParamLayout, leaf: Callable[[Any], Any] | None = None) -> Any:
    """The optax state over ``{name: param}`` with every params-shaped dict nested like the target.

    ``leaf`` (optional) maps the leaves outside the params-shaped dicts.
    """
    is_named = _named_dict(layout)

    def convert(x: Any) -> Any:
        if is_named(x):
            return nest(x, layout)
        return x if leaf is None else leaf(x)

    return jax.tree.map(convert, flat_state, is_leaf=is_named)


def to_flat(state: Any, layout: ParamLayout, template: Any) -> Any:
    """The inverse of :func:`to_target_shape`; ``template`` is a flat state of the same transformation."""
    is_named = _named_dict(layout)
    entries, treedef = flatten(template, is_leaf=is_named)
    try:
        parts = treedef.flatten_up_to(state)
    except (ValueError, TypeError) as err:
        raise ValueError(
            "param_states does not have the structure this optimizer's optax state has for "
            f"these params: {err}"
        ) from None
    out = [
        unnest(part, layout) if is_named(entry) else part for entry, part in zip(entries, parts, strict=True)
    ]
    return treedef.unflatten(out)


@functools.lru_cache(maxsize=256)
def flat_template(tx: Any, layout: ParamLayout) -> Any:
    """The abstract optax state of ``tx`` over the flat params of ``layout`` (structure only)."""
    avals = {
        name: jax.ShapeDtypeStruct(shape, dtype)
        for name, (shape, dtype) in zip(layout.names, layout.avals, strict=True)
    }
    return jax.eval_shape(tx.init, avals)


def specs_engine() -> Any:
    """The core's partition-spec engine (``treeopt._specs``), imported when logical axes are derived."""
    from treeopt import _specs

    return _specs


def core_optimizer(tx: Any, layout: ParamLayout, step: Any, opt_state: Any) -> CoreOptimizer:
    """A :class:`treeopt.Optimizer` holding ``step`` and the flat ``opt_state`` for ``layout``."""
    return CoreOptimizer._tree_unflatten((tx, None, layout, False), (step, opt_state))


# -- T5X state dicts -----------------------------------------------------------------


def drop_empty_dicts(tree: Any) -> Any:
    """``tree`` without its empty dicts (recursively: a dict left empty goes too), as T5X writes state.

    Example:
        >>> drop_empty_dicts({"0": {"count": 1, "mu": {}}, "1": {}, "2": {"a": {}}})
        {'0': {'count': 1}}
    """
    if not isinstance(tree, dict):
        return tree
    out = {}
    for key, value in tree.items():
        value = drop_empty_dicts(value)
        if isinstance(value, dict) and not value:
            continue
        out[key] = value
    return out


def _has_data(tree: Any) -> bool:
    if isinstance(tree, dict):
        return any(_has_data(v) for v in tree.values())
    return tree is not None


def _leaf_paths(tree: Any, prefix: str) -> list[str]:
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in _leaf_paths(v, f"{prefix}/{k}")]
    return [prefix] if tree is not None else []


def _fill(template: Any, given: Any, path: str, problems: list[str]) -> Any:
    """``given`` with the empty entries of ``template`` put back; problems collected by path."""
    if isinstance(template, dict):
        if not isinstance(given, Mapping):
            problems.append(f"'{path}': expected a dict of entries, got {type(given).__name__}")
            return given
        out = {}
        for key, sub in template.items():
            key = str(key)
            if key in given:
                out[key] = _fill(sub, given[key], f"{path}/{key}", problems)
            elif _has_data(sub):
                problems.extend(f"'{p}': missing" for p in _leaf_paths(sub, f"{path}/{key}"))
            else:
                out[key] = sub
        extra = sorted(str(k) for k in given if str(k) not in {str(k2) for k2 in template})
        problems.extend(f"'{path}/{key}': unexpected" for key in extra)
        return out
    t_shape, g_shape = getattr(template, "shape", None), getattr(given, "shape", None)
    if t_shape is not None and g_shape is not None and tuple(t_shape) != tuple(g_shape):
        problems.append(f"'{path}': expected shape {tuple(t_shape)}, got {tuple(g_shape)}")
    return given


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _key_data(x: Any) -> Any:
    if not _is_key(x):
        return x
    if isinstance(x, jax.Array):
        return jax.random.key_data(x)
    return jax.eval_shape(jax.random.key_data, x)  # an abstract key


def _wrap_key(template: Any, value: Any) -> Any:
    if not _is_key(template) or _is_key(value) or not isinstance(template, jax.Array):
        return value
    return jax.random.wrap_key_data(jnp.asarray(value), impl=jax.random.key_impl(template))


def to_state_dict(tree: Any) -> Any:
    """``flax.serialization.to_state_dict``, typed PRNG keys written as their ``uint32`` key data.

    Example:
        >>> import jax
        >>> to_state_dict({"key": jax.random.key(0)})["key"].dtype
        dtype('uint32')
    """
    return jax.tree.map(_key_data, flax.serialization.to_state_dict(tree))


def restore(*entries: tuple[Any, Any, str]) -> list[Any]:
    """Each ``(template, state_dict, path)``: the template with its values from the state dict.

    ``template`` is any pytree with flax serialization. Empty entries that T5X
    drops when writing (``optax.EmptyState``, ``optax.MaskedNode``) are put
    back. Every missing real entry, unexpected entry and shape mismatch of all
    the entries is listed, by path, in one ``ValueError``.
    """
    problems: list[str] = []
    filled = [
        _fill(to_state_dict(template), state_dict, path, problems) for template, state_dict, path in entries
    ]
    if problems:
        raise ValueError(
            f"The state dict does not match this optimizer at {len(problems)} path(s):\n  "
            + "\n  ".join(problems)
        )
    restored = [
        flax.serialization.from_state_dict(t, f) for (t, _, _), f in zip(entries, filled, strict=True)
    ]
    return [jax.tree.map(_wrap_key, t, r) for (t, _, _), r in zip(entries, restored, strict=True)]


# -- eager steps as one compiled program ------------------------------------------------


def _is_dynamic(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    return isinstance(x, (int, float, complex, np.ndarray, np.generic, jax.Array))


class _Static:
    """Hashable holder of the non-array leaves of the hyper params (part of the compile key)."""

    __slots__ = ("items",)

    def __init__(self, items: tuple[Any, ...]):
        self.items = items

    def __hash__(self) -> int:
        return hash(self.items)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self.items == other.items


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _compiled(
    method: Callable[..., Any], treedef: Any, static: _Static, dynamic: list[Any], *args: Any
) -> Any:
    values = iter(dynamic)
    leaves = [next(values) if is_dyn else value for is_dyn, value in static.items]
    return method(treedef.unflatten(leaves), *args)


def call_compiled(method: Callable[..., Any], hyper_params: Any, *args: Any) -> Any:
    """``method(hyper_params, *args)``, compiled once per optimizer and hyper-params structure.

    Numeric hyper params (a learning rate) are arguments of the program, so
    changing them never recompiles; other leaves (flags, rules) are part of its
    key. Inside a trace the call is traced like any other function; if the
    hyper params hold something unhashable the call runs as is.
    """
    leaves, treedef = flatten(hyper_params)
    items = tuple((True, None) if _is_dynamic(x) else (False, x) for x in leaves)
    # Python and numpy numbers as (strongly typed) jax arrays: 0.1, np.float32(0.1) and
    # jnp.float32(0.1) then share one program and one dispatch entry.
    dynamic = [
        x if isinstance(x, jax.Array) else jnp.asarray(np.asarray(x)) for x in leaves if _is_dynamic(x)
    ]
    static = _Static(items)
    try:
        hash((method, treedef, static))
    except TypeError:
        return method(hyper_params, *args)
    return _compiled(method, treedef, static, dynamic, *args)


__all__ = [
    "call_compiled",
    "core_optimizer",
    "drop_empty_dicts",
    "flat_template",
    "nest",
    "restore",
    "specs_engine",
    "to_state_dict",
    "to_flat",
    "to_target_shape",
    "unnest",
]
