"""Whole-leaf functions: functions whose result for a leaf reads the leaf whole, and the routing of their calls.

Most optax transformations update a leaf element by element, so ZeRO-1 splits
their state anywhere and each device updates its slice. A few read a leaf
whole: Muon orthogonalizes each momentum matrix by Newton-Schulz iterations,
a chain of matmuls over the whole matrix. Split over devices, such a matmul
needs the other devices' slices at every iteration.

:func:`whole_leaf` marks such a function (a user's own orthogonalizer, or one
of another library, found by module and name), with how a call's leaf splits
into independent matrices (a stacked ``(layers, m, n)`` leaf into its slices,
by the call's dimension numbers) and what one matrix costs, so that
:mod:`treeopt._sharding.ownership` can give each matrix one owner device.
optax's Newton-Schulz is registered through the same entry, from the one
home of optax's private names (:mod:`treeopt._compat.optax_private`).

Calls are found where the transformation makes them: :func:`intercepted`
routes every call of a marked function, while it is active in this thread, to
a handler (the owner's computation); outside it the function runs as written.

Found, and not registered: GaLore's projection also reads a leaf whole (a
singular value decomposition every ``update_proj_gap`` steps), but optax
computes it inside a ``lax.cond`` of a closure; its state is small (a
low-rank projector and moments), and it runs where the compiler puts it.

Example:
    >>> import jax.numpy as jnp, optax
    >>> seen = []
    >>> def handler(call):
    ...     seen.append((call.entry.what, call.leaf.shape))
    ...     return call.compute()
    >>> tx = optax.contrib.muon(1e-2)
    >>> params = {"w": jnp.ones((4, 8)), "b": jnp.ones(8)}
    >>> with intercepted(handler):
    ...     _ = tx.update(params, tx.init(params), params)
    >>> seen
    [("Muon's Newton-Schulz orthogonalization", (4, 8))]
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import inspect
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import jax

from treeopt._compat.optax_private import register_whole_leaf_functions

__all__ = ["Call", "WholeLeafFunction", "collected", "intercepted", "registered", "whole_leaf"]

F = TypeVar("F", bound=Callable[..., Any])


def default_cost(m: int, n: int) -> float:
    """The work of one ``(m, n)`` matrix under matmul iterations, up to a constant: ``max(m, n) * min(m, n) ** 2``."""
    return float(max(m, n) * min(m, n) ** 2)


@dataclasses.dataclass(frozen=True, eq=False)
class WholeLeafFunction:
    """A function that reads its leaf argument whole, as :func:`whole_leaf` marked it.

    Attributes:
        original: the function as written.
        what: what it computes, for reports.
        leaf: the name of its leaf argument.
        dimension_numbers: the name of its argument that says how the leaf
            splits into matrices (batch, reduction and output axes, as
            ``optax.contrib.MuonDimensionNumbers``); ``None`` (or the
            argument left ``None`` in a call): the leaf's last two axes are
            the matrix, any axes before them hold matrices side by side.
        cost_of: ``(m, n) -> float``, the work of one matrix (``None``:
            :func:`default_cost`).
        module, name: where another library's code finds it by name
            (``None`` for a function marked directly).
        transposable: ``f(x.T) == f(x).T`` (an orthogonalization): an owner
            may compute a matrix as its transpose, to stack it with others.
    """

    original: Callable[..., Any]
    what: str
    leaf: str
    dimension_numbers: str | None = None
    cost_of: Callable[[int, int], float] | None = None
    module: str | None = None
    name: str | None = None
    transposable: bool = False

    def cost(self, m: int, n: int) -> float:
        """The work of one ``(m, n)`` matrix, as ownership weighs it."""
        return float(self.cost_of(m, n)) if self.cost_of is not None else default_cost(m, n)


_REGISTERED: list[tuple[WholeLeafFunction, Callable[..., Any]]] = []
"""Functions of other libraries, with the routed stand-in put in their module while a handler is open."""


def whole_leaf(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    leaf: str | None = None,
    dimension_numbers: str | None = None,
    cost: Callable[[int, int], float] | None = None,
    transposable: bool = False,
    module: str | None = None,
    name: str | None = None,
) -> Any:
    """``fn``, marked as reading its matrix argument whole: on a mesh, each matrix of its calls gets one owner.

    Inside any transformation's update, run by a :class:`treeopt.Optimizer`
    on a mesh, every call of the returned function is found and its matrices
    are computed each by one owner device (balanced by ``cost``), with no
    collective inside the function; off a mesh it is ``fn``. The function
    must return an array of its leaf's shape and treat axes before the
    matrix's as independent matrices side by side.

    Args:
        fn: the function (also usable as a decorator, with or without the
            keywords).
        leaf: the name of its matrix argument (default: its first one).
        dimension_numbers: the name of its argument giving the leaf's batch,
            reduction and output axes as ``optax.contrib.MuonDimensionNumbers``
            does (default: none, the last two axes are the matrix).
        cost: ``(m, n) -> float``, one matrix's work, for balancing the owners
            (default ``max(m, n) * min(m, n) ** 2``, matmul iterations).
        transposable: the function commutes with transposition,
            ``f(x.T) == f(x).T`` (an orthogonalization does): a matrix may be
            computed as its transpose, so row- and column-split matrices of a
            shape travel together.
        module: instead of ``fn``, the module of another library's function
            that its own code calls by a module-level name (with ``name``):
            its calls are routed while an update traces.
        name: that function's name in ``module``.

    Example:
        >>> import jax.numpy as jnp, treeopt
        >>> @treeopt.whole_leaf
        ... def orthogonalize(g, steps=5):
        ...     x = g / (jnp.linalg.norm(g) + 1e-7)
        ...     for _ in range(steps):
        ...         x = 1.5 * x - 0.5 * x @ x.T @ x
        ...     return x
        >>> orthogonalize(jnp.eye(2) * 3).tolist()   # off a mesh: the function itself
        [[1.0, 0.0], [0.0, 1.0]]
    """
    if fn is None and module is None and name is None:
        return functools.partial(
            whole_leaf, leaf=leaf, dimension_numbers=dimension_numbers, cost=cost, transposable=transposable
        )
    options: dict[str, Any] = {
        "leaf": leaf,
        "dimension_numbers": dimension_numbers,
        "cost": cost,
        "transposable": transposable,
    }
    if fn is not None and (module is not None or name is not None):
        raise TypeError("whole_leaf takes a function or module= and name=, not both.")
    if fn is None:
        return _register(module, name, **options)
    if not callable(fn):
        raise TypeError(f"whole_leaf takes a function, got {fn!r}.")
    return _routed(_entry(fn, getattr(fn, "__qualname__", repr(fn)), **options))


def _entry(
    fn: Callable[..., Any],
    what: str,
    *,
    leaf: str | None,
    dimension_numbers: str | None,
    cost: Callable[[int, int], float] | None,
    transposable: bool,
    module: str | None = None,
    name: str | None = None,
) -> WholeLeafFunction:
    parameters = list(inspect.signature(fn).parameters)
    if not parameters:
        raise TypeError(f"whole_leaf: {what} takes no argument to read whole.")
    leaf = parameters[0] if leaf is None else leaf
    for option, argument in (("leaf", leaf), ("dimension_numbers", dimension_numbers)):
        if argument is not None and argument not in parameters:
            raise TypeError(
                f"whole_leaf: {what} has no argument {argument!r} ({option}=); it takes {parameters}."
            )
    if cost is not None and not callable(cost):
        raise TypeError(f"whole_leaf: cost must be a function (m, n) -> float, got {cost!r}.")
    return WholeLeafFunction(fn, what, leaf, dimension_numbers, cost, module, name, bool(transposable))


def _register(
    module: str | None,
    name: str | None,
    *,
    leaf: str | None = None,
    dimension_numbers: str | None = None,
    cost: Callable[[int, int], float] | None = None,
    transposable: bool = False,
    what: str | None = None,
) -> Callable[..., Any]:
    if not module or not name:
        raise TypeError("whole_leaf: a function of another library is named by both module= and name=.")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"whole_leaf: no function {name!r} in module {module!r} ({error}).") from None
    for entry, routed in _REGISTERED:
        if entry.module == module and entry.name == name:
            return routed
    original = getattr(found, "__wrapped_by_treeopt__", found)
    entry = _entry(
        original, what or f"{module}.{name}", leaf=leaf, dimension_numbers=dimension_numbers, cost=cost,
        transposable=transposable, module=module, name=name,
    )  # fmt: skip
    routed = _routed(entry)
    _REGISTERED.append((entry, routed))
    return routed


def registered() -> list[WholeLeafFunction]:
    """The functions of other libraries registered by module and name, optax's Newton-Schulz among them.

    Example:
        >>> [entry.name for entry in registered()]
        ['orthogonalize_via_newton_schulz']
    """
    return [entry for entry, _ in _REGISTERED]


@dataclasses.dataclass
class Call:
    """One call of a whole-leaf function: its arguments, bound to the function's signature.

    :meth:`compute` runs it as written; :meth:`on_matrices` lets an owner run
    it on a stack of matrices instead.
    """

    entry: WholeLeafFunction
    arguments: inspect.BoundArguments

    @property
    def leaf(self) -> Any:
        """The leaf argument (a momentum, for Muon)."""
        return self.arguments.arguments[self.entry.leaf]

    def compute(self, leaf: Any = None) -> Any:
        """The call as written, on ``leaf`` instead of its own when given."""
        arguments = dict(self.arguments.arguments)
        if leaf is not None:
            arguments[self.entry.leaf] = leaf
        return self.entry.original(**arguments)

    def key(self) -> tuple[Any, ...]:
        """What calls must share to run as one: the function and every argument but the leaf and its dimension
        numbers (arrays, such as Muon's coefficients, told apart by identity)."""
        out: list[Any] = [id(self.entry)]
        for name, value in self.arguments.arguments.items():
            if name not in (self.entry.leaf, self.entry.dimension_numbers):
                out.append((name, id(value) if isinstance(value, jax.Array) else _hashable(value)))
        return tuple(out)

    def _dimension_numbers(self) -> Any:
        name = self.entry.dimension_numbers
        return None if name is None else self.arguments.arguments.get(name)

    def axes(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """``(batch, reduction, output)`` axes of the leaf: its batch axes hold independent matrices."""
        ndim = len(self.leaf.shape)
        dims = self._dimension_numbers()
        if dims is None:
            if ndim < 2:
                raise ValueError(
                    f"{self.entry.what} reads a matrix, got a leaf of shape {tuple(self.leaf.shape)}"
                )
            return tuple(range(ndim - 2)), (ndim - 2,), (ndim - 1,)
        reduction = _normalized(dims.reduction_axis, ndim)
        output = _normalized(dims.output_axis, ndim)
        batch = tuple(a for a in range(ndim) if a not in reduction and a not in output)
        return batch, reduction, output

    def matrix_shape(self) -> tuple[int, int, int]:
        """``(matrices, m, n)``: how many independent matrices the leaf holds, each ``(m, n)`` (reduction rows,
        output columns)."""
        shape = tuple(self.leaf.shape)
        batch, reduction, output = self.axes()
        return (
            math.prod(shape[a] for a in batch),
            math.prod(shape[a] for a in reduction),
            math.prod(shape[a] for a in output),
        )

    def arrays(self) -> dict[str, Any]:
        """The call's array arguments but the leaf (Muon's coefficients), by name."""
        return {
            name: value
            for name, value in self.arguments.arguments.items()
            if name != self.entry.leaf and isinstance(value, jax.Array)
        }

    def on_matrices(self, stack: Any, arrays: dict[str, Any] | None = None) -> Any:
        """The function on a ``(k, m, n)`` stack of matrices like the leaf's, with the call's other arguments.

        ``arrays`` replace its array arguments (:meth:`arrays`), as a function
        mapped over devices takes them. A function given dimension numbers
        takes the stack whole; one without is mapped over it.
        """
        arguments = {**self.arguments.arguments, **(arrays or {})}
        dims = self._dimension_numbers()
        if dims is not None:
            arguments[self.entry.leaf] = stack
            assert self.entry.dimension_numbers is not None
            arguments[self.entry.dimension_numbers] = dims._replace(reduction_axis=1, output_axis=2)
            return self.entry.original(**arguments)

        def one(matrix: Any) -> Any:
            return self.entry.original(**{**arguments, self.entry.leaf: matrix})

        return jax.vmap(one)(stack)


def _normalized(axes: int | Sequence[int], ndim: int) -> tuple[int, ...]:
    return tuple(a % ndim for a in ((axes,) if isinstance(axes, int) else axes))


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


# -- interception -----------------------------------------------------------------------------------

_HANDLER: contextvars.ContextVar[Callable[[Call], Any] | None] = contextvars.ContextVar(
    "treeopt_whole_leaf_handler", default=None
)
_LOCK = threading.Lock()
_OPEN = [0]  # handlers open in any thread: the registered stand-ins sit in their modules meanwhile


def _routed(entry: WholeLeafFunction) -> Callable[..., Any]:
    signature = inspect.signature(entry.original)

    @functools.wraps(entry.original)
    def routed(*args: Any, **kwargs: Any) -> Any:
        handler = _HANDLER.get()
        if handler is None:
            return entry.original(*args, **kwargs)
        arguments = signature.bind(*args, **kwargs)
        arguments.apply_defaults()
        return handler(Call(entry, arguments))

    routed.__wrapped_by_treeopt__ = entry.original  # type: ignore[attr-defined]
    routed.__treeopt_whole_leaf__ = entry  # type: ignore[attr-defined]
    return routed


@contextlib.contextmanager
def intercepted(handler: Callable[[Call], Any]) -> Iterator[None]:
    """Within the block, every call of a whole-leaf function in this thread goes to ``handler``.

    ``handler(call)`` returns what the call returns. The registered functions
    of other libraries are routed through their stand-ins while any such
    block is open (in any thread); a thread with no open block runs them as
    written.
    """
    with _LOCK:
        if _OPEN[0] == 0:
            for entry, routed in _REGISTERED:
                setattr(importlib.import_module(entry.module or ""), entry.name or "", routed)
        _OPEN[0] += 1
    token = _HANDLER.set(handler)
    try:
        yield
    finally:
        _HANDLER.reset(token)
        with _LOCK:
            _OPEN[0] -= 1
            if _OPEN[0] == 0:
                for entry, _ in _REGISTERED:
                    setattr(importlib.import_module(entry.module or ""), entry.name or "", entry.original)


@contextlib.contextmanager
def collected() -> Iterator[list[Call]]:
    """Within the block, every call of a whole-leaf function is appended to the list it yields and returns its
    leaf unchanged: an evaluation that only finds the calls.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> tx, params = optax.contrib.muon(1e-2), {"w": jnp.ones((4, 8)), "b": jnp.ones(8)}
        >>> with collected() as calls:
        ...     _ = tx.update(params, tx.init(params), params)
        >>> [call.leaf.shape for call in calls]
        [(4, 8)]
    """
    calls: list[Call] = []

    def record(call: Call) -> Any:
        calls.append(call)
        return call.leaf

    with intercepted(record):
        yield calls


register_whole_leaf_functions(_register)
