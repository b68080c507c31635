"""Read and write the hyperparameters that ``optax.inject_hyperparams`` keeps in a state.

A hyperparameter is named by its own name (``"learning_rate"``) when it occurs
once in the state; when it occurs several times (``multi_transform`` with an
injected optimizer per label, a chain of two injected transformations) each
occurrence is qualified by the labels/indices on its way (``"decay/learning_rate"``).

Setting a hyperparameter checks the value and never loses part of it: a real
number keeps the dtype and shape of the value it replaces (no recompilation),
an integer hyperparameter given a float becomes a float, and ``None``,
strings, bools, complex numbers, NaN, infinities and arrays of another shape
are refused with an error naming the hyperparameter. The stored value is a new
array, never the caller's, so donating the optimizer cannot delete it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.tree_util import DictKey, SequenceKey

from treeopt._compat.jax_private import weakly_typed
from treeopt._tree.paths import path_to_name
from treeopt.errors import describe
from treeopt.typing import OptState

__all__ = ["Hyperparams", "get_hyperparams", "set_hyperparams"]

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


class Hyperparams(dict):
    """The injected hyperparameters by name; ``scheduled`` names those a schedule computes.

    A plain ``dict`` of values, whose ``repr`` marks the scheduled ones:
    ``optax.inject_hyperparams`` recomputes them from the step count before
    every update, so they can be read but not set.

    Example:
        >>> import optax, jax.numpy as jnp
        >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=optax.linear_schedule(1.0, 0.0, 10))
        >>> hp = get_hyperparams(tx.init({"w": jnp.ones(2)}))
        >>> hp.scheduled, float(hp["learning_rate"])
        (frozenset({'learning_rate'}), 1.0)
        >>> hp
        {'learning_rate': Array(1., dtype=float32) (from a schedule)}
    """

    scheduled: frozenset[str]

    def __init__(self, values: Mapping[str, Any], scheduled: frozenset[str] = frozenset()):
        super().__init__(values)
        self.scheduled = frozenset(scheduled)

    def __repr__(self) -> str:
        if not self.scheduled:
            return super().__repr__()
        items = (
            f"{k!r}: {v!r}" + (" (from a schedule)" if k in self.scheduled else "") for k, v in self.items()
        )
        return "{" + ", ".join(items) + "}"


def _is_scheduled(node: Any, name: str) -> bool:
    # inject_hyperparams keeps a state for each hyperparameter it computes from a
    # schedule (optax >= 0.2.4); a plain number has none.
    return name in (getattr(node, "hyperparams_states", None) or {})


def _nodes(opt_state: Any) -> dict[tuple[Any, ...], Any]:
    return {
        tuple(path): node
        for path, node in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_injected)[0]
        if _is_injected(node)
    }


def get_hyperparams(opt_state: OptState) -> Hyperparams:
    """All injected hyperparameters of ``opt_state`` by (qualified) name.

    The result is a dict; its ``scheduled`` attribute names the hyperparameters
    that come from a schedule (read-only: see :func:`set_hyperparams`).

    Example:
        >>> import optax, jax.numpy as jnp
        >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
        >>> get_hyperparams(tx.init({"w": jnp.ones(2)}))
        {'learning_rate': Array(0.1, dtype=float32)}
    """
    nodes = _nodes(opt_state)
    located = _locate(opt_state)
    values = {q: nodes[tuple(path)].hyperparams[name] for q, (path, name) in located.items()}
    scheduled = frozenset(q for q, (path, name) in located.items() if _is_scheduled(nodes[tuple(path)], name))
    return Hyperparams(values, scheduled)


def hyperparameter_attribute(owner: object, name: str, found: Mapping[str, Any]) -> Any:
    """``found[name]``, a hyperparameter read as an attribute of ``owner``; else the ``AttributeError`` listing them.

    What ``__getattr__`` of an optimizer that reads its injected
    hyperparameters as attributes returns (``opt.learning_rate``).

    Example:
        >>> hyperparameter_attribute(object(), "lr", {"learning_rate": 0.1})
        Traceback (most recent call last):
        ...
        AttributeError: 'object' object has no attribute or injected hyperparameter 'lr' (hyperparameters: ['learning_rate'])
    """
    if name in found:
        return found[name]
    raise AttributeError(
        f"'{type(owner).__name__}' object has no attribute or injected hyperparameter '{name}'"
        + (f" (hyperparameters: {sorted(found)})" if found else "")
    )


def sets_hyperparameter(name: str, own: bool, found: Mapping[str, Any] | None) -> bool:
    """Whether ``optimizer.name = value`` sets an injected hyperparameter: one rule for every optimizer.

    ``treeopt.Optimizer`` and the ``treeopt.nnx`` drop-in both follow it. A
    name that is ``own``, an attribute of the object itself (the optimizer's
    fields and properties, the drop-in's attributes), is the object's. Any
    other name sets a hyperparameter when ``found`` (the state's
    hyperparameters by qualified name; ``None`` before there is a state)
    names it, whole or by its last part (an ambiguous one is then refused,
    naming the qualified ones), and so does ``learning_rate``, which every
    optimizer is expected to have: where ``tx`` injects none, setting it is
    the error that says how. What else is assigned is up to the object: the
    core holds nothing else (an error), an nnx drop-in an ordinary attribute.

    Example:
        >>> sets_hyperparameter("b1", False, {"adam/b1": 0.9}), sets_hyperparameter("note", False, {"adam/b1": 0.9})
        (True, False)
        >>> sets_hyperparameter("learning_rate", False, {}), sets_hyperparameter("step", True, {"step": 1})
        (True, False)
    """
    if own or found is None:
        return False
    return name == "learning_rate" or any(q == name or q.rsplit("/", 1)[-1] == name for q in found)


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
    raise AttributeError(f"The optimizer has no injected hyperparameter '{key}'; it has {sorted(located)}.")


# -- checking a new value ------------------------------------------------------------


def _aval(x: Any) -> tuple[np.dtype, tuple[int, ...], bool]:
    """``(dtype, shape, weak_type)`` of a hyperparameter's current value."""
    if isinstance(x, jax.Array):  # concrete arrays and tracers
        aval = x.aval
        return np.dtype(aval.dtype), tuple(aval.shape), bool(getattr(aval, "weak_type", False))
    if isinstance(x, (int, float)) and not isinstance(x, np.generic):
        return np.dtype(jnp.result_type(x)), (), True
    return np.dtype(np.result_type(x)), tuple(np.shape(x)), False


def _spec(dtype: np.dtype, shape: tuple[int, ...]) -> str:
    return f"{dtype.name}{list(shape)}"


def _default_float() -> np.dtype:
    return np.dtype(jax.dtypes.canonicalize_dtype(np.float64))


def checked_value(key: str, old: Any, value: Any) -> jax.Array:
    """``value`` as the new value of the hyperparameter ``key`` whose value is ``old``.

    A real scalar (or an array of exactly ``old``'s shape) is cast to ``old``'s
    dtype and weak type, so a jitted step taking the new state does not
    recompile. Nothing is truncated: a float value for an integer
    hyperparameter makes it a float of the default float dtype (its dtype
    changes once). Refused, with an error naming ``key``: ``None``, strings,
    bools, complex numbers, arrays of another shape, NaN and infinities, and
    values outside the range of the dtype. The result is always a new buffer,
    never ``value`` itself, so donating the optimizer's state cannot delete an
    array of the caller's. Values of traced arrays are not checked (they are
    not known), their dtype and shape are.

    Example:
        >>> import jax.numpy as jnp
        >>> checked_value("learning_rate", jnp.array(1, jnp.int32), 0.5)
        Array(0.5, dtype=float32)
        >>> try:
        ...     checked_value("learning_rate", jnp.float32(0.1), float("nan"))
        ... except ValueError as e:
        ...     print(e)
        Cannot set hyperparameter 'learning_rate' (float32[]): expected a finite number, got float nan.
    """
    dtype, shape, weak = _aval(old)
    refuse = _Refusal(key, dtype, shape, value)
    a_number = "a real number" + (f" or a {_spec(dtype, shape)} array" if shape else "")
    if value is None or isinstance(value, (str, bytes)):
        raise refuse(TypeError, a_number)
    given_dtype, given_shape, host = _given(value, dtype, refuse, a_number)
    if jnp.issubdtype(given_dtype, jnp.complexfloating):
        raise refuse(TypeError, "a real number (complex values are not hyperparameters)")
    if not (jnp.issubdtype(given_dtype, jnp.integer) or jnp.issubdtype(given_dtype, jnp.floating)):
        raise refuse(TypeError, a_number)
    if given_shape not in {(), shape}:
        raise refuse(ValueError, "a scalar" + (f" or a {_spec(dtype, shape)} array" if shape else ""))
    promote = jnp.issubdtype(dtype, jnp.integer) and jnp.issubdtype(given_dtype, jnp.floating)
    target = _default_float() if promote else dtype
    if host is not None:
        _check_representable(host, target, refuse)
    # Always a new buffer: the caller keeps its array, even when the optimizer's state is donated.
    if host is not None:
        # A host-to-device transfer makes the new buffer: unlike an on-device copy,
        # it compiles no program, so setting a value never shows up as a compile.
        new = jax.device_put(np.array(host, dtype=target))
    else:  # traced, or spread over other processes' devices
        new = jnp.array(value, dtype=target, copy=True)
    if shape and new.shape != shape:
        new = jnp.broadcast_to(new, shape)
    if weak and target == dtype:
        new = weakly_typed(new)
    return new


class _Refusal:
    """The error for a value a hyperparameter cannot take: ``refuse(TypeError, "a real number")``."""

    def __init__(self, key: str, dtype: np.dtype, shape: tuple[int, ...], value: Any):
        self.key, self.dtype, self.shape, self.value = key, dtype, shape, value

    def __call__(self, error: type[Exception], expected: str) -> Exception:
        return error(
            f"Cannot set hyperparameter '{self.key}' ({_spec(self.dtype, self.shape)}): expected {expected}, "
            f"got {describe(self.value)}."
        )


def _in_range(target: np.dtype) -> str:
    if jnp.issubdtype(target, jnp.integer):
        info = jnp.iinfo(target)
        return f"a value in the {target.name} range [{info.min}, {info.max}]"
    big = float(jnp.finfo(target).max)
    return f"a value in the {target.name} range [{-big:g}, {big:g}]"


def _given(
    value: Any, dtype: np.dtype, refuse: _Refusal, a_number: str
) -> tuple[np.dtype, tuple[int, ...], np.ndarray | None]:
    """``(dtype, shape, host copy or None)`` of a new value; ``None`` when traced or not addressable."""
    if isinstance(value, jax.Array):
        host = None
        if not isinstance(value, jax.core.Tracer) and value.is_fully_addressable:
            host = np.asarray(value)
        return np.dtype(value.dtype), tuple(value.shape), host
    try:
        host = np.asarray(value)
    except (TypeError, ValueError, OverflowError):
        raise refuse(TypeError, a_number) from None
    if host.dtype == object and isinstance(value, int):  # beyond int64
        if not jnp.issubdtype(dtype, jnp.floating):
            raise refuse(ValueError, _in_range(dtype))
        try:
            host = np.asarray(float(value))  # range-checked as a float
        except OverflowError:
            raise refuse(ValueError, _in_range(dtype)) from None
    return host.dtype, host.shape, host


def _check_representable(host: np.ndarray, target: np.dtype, refuse: _Refusal) -> None:
    """Refuses NaN, infinities and values outside ``target``'s range."""
    if jnp.issubdtype(host.dtype, jnp.floating) and not np.isfinite(host).all():
        raise refuse(ValueError, "a finite number")
    if jnp.issubdtype(target, jnp.integer):
        info = jnp.iinfo(target)
        if host.size and (host.min() < info.min or host.max() > info.max):
            raise refuse(ValueError, _in_range(target))
    elif jnp.issubdtype(target, jnp.floating):
        with np.errstate(over="ignore"):
            overflows = not np.isfinite(host.astype(target)).all()
        if overflows:
            raise refuse(ValueError, _in_range(target))


def _scheduled_error(key: str, name: str) -> ValueError:
    return ValueError(
        f"Cannot set hyperparameter '{key}': it comes from a schedule, which "
        "optax.inject_hyperparams evaluates at the step count before every update, so a value "
        "set here would be overwritten and never used. To control it by hand, build the "
        f"transformation with a number instead ({name}=1e-3) and set that; or keep the "
        "schedule and scale it with another injected factor, e.g. "
        "optax.chain(tx, optax.inject_hyperparams(optax.scale)(step_size=1.0)), then set "
        "'step_size'."
    )


def set_hyperparams(opt_state: OptState, values: Mapping[str, Any]) -> OptState:
    """A copy of ``opt_state`` with the given injected hyperparameters replaced.

    Each value is checked and converted by :func:`checked_value`: a real
    number keeps the dtype, shape and weak type of the value it replaces, so a
    jitted step that receives the new state does not recompile; an integer
    hyperparameter given a float becomes a float rather than truncating it;
    ``None``, strings, bools, complex numbers, NaN, infinities and arrays of
    another shape raise an error naming the hyperparameter. The new values are
    the state's own arrays, never the caller's. A hyperparameter that comes
    from a schedule is refused: ``inject_hyperparams`` would overwrite it
    before the next update.

    Example:
        >>> import optax, jax.numpy as jnp
        >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
        >>> state = set_hyperparams(tx.init({"w": jnp.ones(2)}), {"learning_rate": 0.01})
        >>> round(float(get_hyperparams(state)["learning_rate"]), 6)
        0.01
        >>> set_hyperparams(state, {"learning_rate": None})
        Traceback (most recent call last):
        ...
        TypeError: Cannot set hyperparameter 'learning_rate' (float32[]): expected a real number, got None.
    """
    located = _locate(opt_state)
    nodes = _nodes(opt_state)
    targets: dict[tuple[Any, ...], dict[str, tuple[str, Any]]] = {}
    for key, value in values.items():
        for path, name in _resolve(located, key):
            if _is_scheduled(nodes[tuple(path)], name):
                raise _scheduled_error(key, name)
            targets.setdefault(tuple(path), {})[name] = (key, value)

    def replace(path: Any, node: Any) -> Any:
        new = targets.get(tuple(path)) if _is_injected(node) else None
        if not new:
            return node
        hyperparams = dict(node.hyperparams)
        for name, (key, value) in new.items():
            hyperparams[name] = checked_value(key, hyperparams[name], value)
        return node._replace(hyperparams=hyperparams)

    return jax.tree_util.tree_map_with_path(replace, opt_state, is_leaf=_is_injected)
