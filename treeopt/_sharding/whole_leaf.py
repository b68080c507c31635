"""Whole-leaf computations: the one home of the optax functions whose update of a leaf reads it whole.

Most optax transformations update a leaf element by element, so ZeRO-1 splits
their state anywhere and each device updates its slice. A few read a leaf
whole: Muon orthogonalizes each momentum matrix by Newton-Schulz iterations,
a chain of matmuls over the whole matrix. Split over devices, such a matmul
needs the other devices' slices at every iteration. :data:`WHOLE_LEAF` names
these functions, how a call's leaf splits into independent matrices (a
stacked ``(layers, m, n)`` leaf into its slices, by the call's own dimension
numbers) and what one matrix costs, so that :mod:`treeopt._sharding.ownership`
can give each matrix one owner device.

The functions are found where optax calls them: :func:`intercepted` routes
every call of a listed function, while it is active in this thread, to a
handler (the owner's computation); outside it the function runs as optax wrote
it. A call made inside control flow of the transformation (``lax.cond``) is
seen too, but its values cannot leave the branch: the handler then computes
it as optax does.

Found, and not listed: GaLore's projection also reads a leaf whole (a singular
value decomposition every ``update_proj_gap`` steps), but optax computes it
inside a ``lax.cond`` of a closure, out of reach; its state is small (a
low-rank projector and moments), and it runs where the compiler puts it.

Example:
    >>> import jax.numpy as jnp, optax
    >>> seen = []
    >>> def handler(call):
    ...     seen.append((call.entry.name, call.leaf.shape))
    ...     return call.compute()
    >>> tx = optax.contrib.muon(1e-2)
    >>> params = {"w": jnp.ones((4, 8)), "b": jnp.ones(8)}
    >>> with intercepted(handler):
    ...     _ = tx.update(params, tx.init(params), params)
    >>> seen
    [('orthogonalize_via_newton_schulz', (4, 8))]
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import inspect
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = ["WHOLE_LEAF", "Call", "WholeLeafFunction", "collected", "intercepted"]


@dataclasses.dataclass(frozen=True)
class WholeLeafFunction:
    """An optax function that reads its leaf argument whole.

    Attributes:
        module: the module that holds the function and calls it by name.
        name: the function's name there.
        what: what it computes, for reports.
        leaf: the name of its leaf argument.
        dimension_numbers: the name of its argument that says how the leaf
            splits into matrices (batch, reduction and output axes, as
            ``optax.contrib.MuonDimensionNumbers``); ``None`` (or the
            argument left ``None``) means a 2-d leaf is one matrix.
    """

    module: str
    name: str
    what: str
    leaf: str
    dimension_numbers: str

    def original(self) -> Callable[..., Any] | None:
        """The function as optax defines it, or ``None`` where this optax has no such function."""
        module = _module(self.module)
        found = getattr(module, self.name, None) if module is not None else None
        return getattr(found, "__wrapped_by_treeopt__", found)

    def cost(self, m: int, n: int) -> float:
        """The work of one ``(m, n)`` matrix, up to a constant: ``max(m, n) * min(m, n) ** 2``."""
        return float(max(m, n) * min(m, n) ** 2)


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:  # an optax without it
        return None


MUON_NEWTON_SCHULZ = WholeLeafFunction(
    module="optax.contrib._muon",
    name="orthogonalize_via_newton_schulz",
    what="Muon's Newton-Schulz orthogonalization",
    leaf="x",
    dimension_numbers="dimension_numbers",
)

WHOLE_LEAF: tuple[WholeLeafFunction, ...] = (MUON_NEWTON_SCHULZ,)
"""The optax functions whose update of a leaf reads it whole."""


@dataclasses.dataclass
class Call:
    """One call of a whole-leaf function: its arguments, bound to the function's signature.

    :meth:`compute` runs it as optax would; :meth:`matrices` and
    :meth:`on_matrices` let an owner run it on a stack of matrices instead.
    """

    entry: WholeLeafFunction
    arguments: inspect.BoundArguments

    @property
    def leaf(self) -> Any:
        """The leaf argument (a momentum, for Muon)."""
        return self.arguments.arguments[self.entry.leaf]

    def compute(self, leaf: Any = None) -> Any:
        """The call as optax makes it, on ``leaf`` instead of its own when given."""
        original = self.entry.original()
        assert original is not None
        arguments = dict(self.arguments.arguments)
        if leaf is not None:
            arguments[self.entry.leaf] = leaf
        return original(**arguments)

    def key(self) -> tuple[Any, ...]:
        """What calls must share to run as one: every argument but the leaf and its dimension numbers.

        Arrays (Muon's coefficients, from the state) are told apart by identity.
        """
        out = []
        for name, value in self.arguments.arguments.items():
            if name in (self.entry.leaf, self.entry.dimension_numbers):
                continue
            out.append((name, id(value) if isinstance(value, jax.Array) else _hashable(value)))
        return (self.entry.module, self.entry.name, *out)

    def axes(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """``(batch, reduction, output)`` axes of the leaf: its batch axes hold independent matrices."""
        shape = tuple(self.leaf.shape)
        dims = self.arguments.arguments.get(self.entry.dimension_numbers)
        if dims is None:
            if len(shape) != 2:
                raise ValueError(f"{self.entry.what} takes a 2-d leaf without dimension numbers, got {shape}")
            return (), (0,), (1,)
        reduction = _normalized(dims.reduction_axis, len(shape))
        output = _normalized(dims.output_axis, len(shape))
        batch = tuple(a for a in range(len(shape)) if a not in reduction and a not in output)
        return batch, reduction, output

    def matrix_shape(self) -> tuple[int, int, int]:
        """``(matrices, m, n)``: how many independent matrices the leaf holds, each seen as ``(m, n)``, ``m <= n``.

        A matrix with more rows than columns is seen transposed, as optax
        orthogonalizes it: so both orientations of one shape stack together.
        """
        k, rows, cols = self._natural_shape()
        return (k, min(rows, cols), max(rows, cols))

    def _natural_shape(self) -> tuple[int, int, int]:
        shape = tuple(self.leaf.shape)
        batch, reduction, output = self.axes()
        return (
            math.prod(shape[a] for a in batch),
            math.prod(shape[a] for a in reduction),
            math.prod(shape[a] for a in output),
        )

    def _transposed(self) -> bool:
        _, rows, cols = self._natural_shape()
        return rows > cols

    def matrices(self, leaf: Any = None) -> Any:
        """The leaf as a ``(matrices, m, n)`` stack: batch axes first, then reduction and output (swapped where
        there are more rows than columns)."""
        leaf = self.leaf if leaf is None else leaf
        batch, reduction, output = self.axes()
        stack = jnp.transpose(leaf, (*batch, *reduction, *output)).reshape(self._natural_shape())
        return jnp.swapaxes(stack, 1, 2) if self._transposed() else stack

    def from_matrices(self, stack: Any) -> Any:
        """The inverse of :meth:`matrices`: a ``(matrices, m, n)`` stack in the leaf's shape."""
        if self._transposed():
            stack = jnp.swapaxes(stack, 1, 2)
        shape = tuple(self.leaf.shape)
        batch, reduction, output = self.axes()
        order = (*batch, *reduction, *output)
        moved = stack.reshape(tuple(shape[a] for a in order))
        return jnp.transpose(moved, tuple(order.index(a) for a in range(len(shape))))

    def arrays(self) -> dict[str, Any]:
        """The call's array arguments but the leaf (Muon's coefficients), by name."""
        return {
            name: value
            for name, value in self.arguments.arguments.items()
            if name != self.entry.leaf and isinstance(value, jax.Array)
        }

    def on_matrices(self, stack: Any, arrays: dict[str, Any] | None = None) -> Any:
        """The call's function on a ``(k, m, n)`` stack of matrices like the leaf's, with its other arguments.

        ``arrays`` replace its array arguments (:meth:`arrays`), as a function
        mapped over devices takes them.
        """
        arguments = {**self.arguments.arguments, **(arrays or {})}
        arguments[self.entry.leaf] = stack
        arguments[self.entry.dimension_numbers] = optax.contrib.MuonDimensionNumbers(
            reduction_axis=1, output_axis=2
        )
        original = self.entry.original()
        assert original is not None
        return original(**arguments)


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
_INSTALLED: dict[WholeLeafFunction, int] = {}


def _wrapper(entry: WholeLeafFunction, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def routed(*args: Any, **kwargs: Any) -> Any:
        handler = _HANDLER.get()
        if handler is None:
            return original(*args, **kwargs)
        arguments = signature.bind(*args, **kwargs)
        arguments.apply_defaults()
        return handler(Call(entry, arguments))

    routed.__wrapped_by_treeopt__ = original  # type: ignore[attr-defined]
    routed.__doc__ = original.__doc__
    return routed


@contextlib.contextmanager
def intercepted(handler: Callable[[Call], Any]) -> Iterator[None]:
    """Within the block, every call of a function of :data:`WHOLE_LEAF` in this thread goes to ``handler``.

    ``handler(call)`` returns what the call returns. The functions are routed
    through a wrapper while any such block is open (in any thread); a thread
    with no open block runs them as optax wrote them.
    """
    with _LOCK:
        for entry in WHOLE_LEAF:
            original = entry.original()
            if original is None:
                continue
            if _INSTALLED.get(entry, 0) == 0:
                setattr(_module(entry.module), entry.name, _wrapper(entry, original))
            _INSTALLED[entry] = _INSTALLED.get(entry, 0) + 1
    token = _HANDLER.set(handler)
    try:
        yield
    finally:
        _HANDLER.reset(token)
        with _LOCK:
            for entry in list(_INSTALLED):
                _INSTALLED[entry] -= 1
                if _INSTALLED[entry] == 0:
                    del _INSTALLED[entry]
                    original = entry.original()
                    setattr(_module(entry.module), entry.name, original)


@contextlib.contextmanager
def collected() -> Iterator[list[Call]]:
    """Within the block, every call of a function of :data:`WHOLE_LEAF` is appended to the list it yields and
    returns its leaf unchanged: an evaluation that only finds the calls (its results are discarded).

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
