"""The one home of flax.nnx knowledge: Variables, Modules, filters, and writing into a Module in place.

treeopt never imports flax.nnx to look at a tree: the predicates here answer
``False`` until the user has imported it (an nnx object cannot exist before).
Only the functions that must build nnx objects (a filter's predicate, a
``State`` for ``value_fn``, a write that ``nnx.update`` does) import it, and
they are reached only with nnx objects in hand.

Example:
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> is_nnx_graph(model), is_nnx_param(model.kernel), is_nnx_filter(nnx.Param)
    (True, True, True)
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax

__all__ = [
    "filter_predicate",
    "from_flat_state",
    "holds_model_state",
    "is_nnx_filter",
    "is_nnx_graph",
    "is_nnx_object",
    "is_nnx_param",
    "is_nnx_variable",
    "variable_type",
    "write_into",
]


def _loaded(module: str = "flax.nnx") -> Any:
    return sys.modules.get(module)


def _nnx_class(*names: str) -> type | None:
    nnx = _loaded()
    for name in names:
        cls = getattr(nnx, name, None) if nnx is not None else None
        if isinstance(cls, type):
            return cls
    return None


def variable_type() -> type | None:
    """``flax.nnx.Variable``, or ``None`` while nnx is not imported."""
    return _nnx_class("Variable")


def is_nnx_variable(x: Any) -> bool:
    """True for a ``flax.nnx.Variable`` (``nnx.Param``, ``nnx.BatchStat``, ...).

    Example:
        >>> import jax.numpy as jnp
        >>> is_nnx_variable(jnp.ones(2))
        False
    """
    cls = variable_type()
    return cls is not None and isinstance(x, cls)


def is_nnx_param(x: Any) -> bool:
    """True for a ``flax.nnx.Param`` (or a subclass, such as ``nnx.LoRAParam``)."""
    cls = _nnx_class("Param")
    return cls is not None and isinstance(x, cls)


def is_nnx_graph(x: Any) -> bool:
    """True for an nnx graph object: an ``nnx.Module`` (an ``nnx.Pytree`` / ``nnx.Object``).

    Example:
        >>> is_nnx_graph({"w": 1.0})
        False
    """
    cls = _nnx_class("Pytree", "Object")
    return cls is not None and isinstance(x, cls)


def is_nnx_object(x: Any) -> bool:
    """True for an nnx Module, ``nnx.State`` or ``nnx.Variable``: what nnx puts where treeopt wants grads."""
    if is_nnx_graph(x) or is_nnx_variable(x):
        return True
    cls = _nnx_class("State")
    return cls is not None and isinstance(x, cls)


def holds_model_state(tree: Any) -> bool:
    """Whether ``tree`` holds an nnx Variable that is not a Param: batch statistics, RNG state, caches.

    Example:
        >>> from flax import nnx
        >>> holds_model_state(nnx.BatchNorm(2, rngs=nnx.Rngs(0))), holds_model_state({"w": 1.0})
        (True, False)
    """
    nodes = jax.tree.leaves(tree, is_leaf=is_nnx_variable)
    return any(is_nnx_variable(node) and not is_nnx_param(node) for node in nodes)


def is_nnx_filter(wrt: Any) -> bool:
    """True where ``wrt`` is read as an nnx filter rather than a glob or a ``(name, leaf)`` predicate.

    A class (``nnx.Param``, ``nnx.BatchStat``, any ``Variable`` type), ``...``,
    ``True``/``False`` and the filter objects of ``flax.nnx.filterlib``
    (``nnx.PathContains``, ``nnx.Any``, ``nnx.All``, ``nnx.Not``, ``nnx.WithTag``,
    ...) are nnx filters; a string is a glob over names and any other callable
    a ``(name, leaf)`` predicate. Wrap an nnx-style ``(path, variable)``
    function in ``nnx.Any(fn)`` to have it read as an nnx filter.

    Example:
        >>> from flax import nnx
        >>> is_nnx_filter(nnx.Param), is_nnx_filter(nnx.Not(nnx.Param))
        (True, True)
        >>> is_nnx_filter("encoder/*"), is_nnx_filter(lambda name, leaf: True)
        (False, False)
    """
    if isinstance(wrt, (type, bool)) or wrt is Ellipsis:
        return True
    filterlib = _loaded("flax.nnx.filterlib")
    return filterlib is not None and type(wrt).__module__ == filterlib.__name__


def filter_predicate(wrt: Any) -> Callable[[tuple[Any, ...], Any], bool]:
    """``wrt`` (an nnx filter) as nnx calls it: ``predicate(path, variable)``, by ``nnx.filterlib.to_predicate``.

    Example:
        >>> from flax import nnx
        >>> predicate = filter_predicate(nnx.Param)
        >>> predicate(("kernel",), nnx.Param(1.0)), predicate(("mean",), nnx.BatchStat(1.0))
        (True, False)
    """
    from flax.nnx import filterlib  # a filter was given: the user works with nnx

    return filterlib.to_predicate(wrt)


def from_flat_state(pairs: Sequence[tuple[tuple[Any, ...], Any]]) -> Any:
    """An ``nnx.State`` of ``(nnx path, value)`` pairs: what ``value_fn`` gets for an nnx Module.

    Example:
        >>> import jax.numpy as jnp
        >>> state = from_flat_state([(("linear", "bias"), jnp.zeros(1))])
        >>> type(state).__name__, state["linear"]["bias"]
        ('State', Array([0.], dtype=float32))
    """
    from flax import nnx  # params are an nnx Module: nnx is imported

    return nnx.from_flat_state(list(pairs))


def _set_variable(variable: Any, value: Any) -> None:
    if hasattr(variable, "set_value"):
        variable.set_value(value)
    else:  # pragma: no cover - flax before 0.12
        variable.value = value


def write_into(module: Any, slots: Sequence[int] | None, values: Sequence[Any], rebuilt: Callable[[], Any]) -> Any:
    """Writes new values into ``module`` in place, as ``nnx.Optimizer.update`` does, and returns it.

    ``slots`` are the positions of the Variables that hold ``values`` (each the
    whole value of its Variable) among ``jax.tree.leaves(module,
    is_leaf=is_nnx_variable)``; where a trained array is not the whole value
    of a Variable (``slots`` is ``None``), ``rebuilt()`` gives the module's
    pytree with the new leaves, and ``nnx.update`` copies its state in.
    """
    if slots is not None:
        nodes = jax.tree.leaves(module, is_leaf=is_nnx_variable)
        for slot, value in zip(slots, values, strict=True):
            _set_variable(nodes[slot], value)
        return module
    from flax import nnx  # the module is an nnx Module: nnx is imported

    nnx.update(module, nnx.state(rebuilt()))
    return module
