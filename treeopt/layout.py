"""ParamLayout: where the trainable leaves of a params tree are, and their names.

Computed once at ``Optimizer.init`` and kept as static aux data, so flattening
params to the flat named dict (and back) costs one ``jax.tree.flatten`` and an
index lookup; names are never recomputed on the hot path. Public, so layers
built on the core (``treeopt.t5x``) flatten and re-nest params the same way.

Example:
    >>> import jax.numpy as jnp
    >>> from treeopt.layout import ParamLayout
    >>> layout = ParamLayout.of({"dense": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}})
    >>> flat, leaves = layout.split_params({"dense": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}})
    >>> sorted(flat)
    ['dense/bias', 'dense/kernel']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from treeopt._paths import check_unique, leaf_names, path_to_name
from treeopt.masks import name_matcher

__all__ = ["ParamLayout", "Wrt", "is_float_array", "is_lookahead", "leaf_names", "path_to_name"]

Wrt = Callable[[str, Any], bool] | str | Sequence[str] | None


def is_float_array(leaf: Any) -> bool:
    """True for array leaves (numpy, jax, tracers) of a floating or complex dtype."""
    dtype = getattr(leaf, "dtype", None)
    return (
        dtype is not None
        and hasattr(leaf, "shape")
        and not isinstance(leaf, (int, float, complex, bool))
        and jnp.issubdtype(dtype, jnp.inexact)
    )


def _selector(wrt: Wrt) -> Callable[[str, Any], bool]:
    if wrt is None:
        return lambda name, leaf: is_float_array(leaf)
    if callable(wrt):
        return wrt
    match = name_matcher(wrt)
    return lambda name, leaf: match(name) and is_float_array(leaf)


def _describe(leaf: Any) -> str:
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return f"{np.dtype(leaf.dtype).name}{list(leaf.shape)}"
    return type(leaf).__name__


class ParamLayout:
    """Positions, names, shapes and dtypes of the trainable leaves of a params tree.

    Equality and hash are by value (so a jitted step never retraces for an equal
    layout), with an identity fast path and a hash computed once.

    Example:
        >>> import jax.numpy as jnp
        >>> layout = ParamLayout.of({"w": jnp.ones(2), "n": jnp.int32(3)})
        >>> layout.names
        ('w',)
    """

    __slots__ = ("_expected", "_hash", "_positions", "all_names", "avals", "index", "names", "treedef")

    def __init__(
        self,
        treedef: Any,
        index: tuple[int, ...],
        names: tuple[str, ...],
        avals: tuple[tuple[tuple[int, ...], np.dtype], ...],
        all_names: tuple[str, ...],
    ):
        self.treedef = treedef
        self.index = index
        self.names = names
        self.avals = avals
        self.all_names = all_names
        self._hash = hash((treedef, index, names, avals))
        # Precomputed for the per-call paths (eager update): name -> leaf position,
        # and the expected (shape, dtype) of each trainable leaf as one list.
        self._positions = dict(zip(names, index, strict=True))
        self._expected = [(tuple(shape), np.dtype(dtype)) for shape, dtype in avals]

    @classmethod
    def of(cls, params: Any, wrt: Wrt = None) -> ParamLayout:
        """The layout of ``params``; ``wrt`` selects trainable leaves (default: float arrays)."""
        leaves, treedef = jax.tree.flatten(params)
        names = leaf_names(params)
        check_unique(names)
        select = _selector(wrt)
        index = tuple(i for i, (n, leaf) in enumerate(zip(names, leaves, strict=True)) if select(n, leaf))
        for i in index:
            if not hasattr(leaves[i], "shape"):
                raise TypeError(
                    f"wrt selected parameter '{names[i]}', which is a "
                    f"{type(leaves[i]).__name__}, not an array."
                )
        avals = tuple((tuple(leaves[i].shape), np.dtype(leaves[i].dtype)) for i in index)
        return cls(treedef, index, tuple(names[i] for i in index), avals, tuple(names))

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, ParamLayout) or self._hash != other._hash:
            return False
        return (
            self.treedef == other.treedef
            and self.index == other.index
            and self.names == other.names
            and self.avals == other.avals
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"ParamLayout({len(self.names)} trainable of {len(self.all_names)} leaves)"

    # -- params --------------------------------------------------------------

    def split_params(self, params: Any) -> tuple[dict[str, Any], list[Any]]:
        """``({name: trainable leaf}, all leaves)`` of ``params``, checked against this layout."""
        leaves, treedef = jax.tree.flatten(params)
        if treedef != self.treedef:
            self._raise_structure_error(params, "params")
        trainable = [leaves[i] for i in self.index]
        self._check_avals(trainable, "params")
        return dict(zip(self.names, trainable, strict=True)), leaves

    def merge_params(self, leaves: list[Any], flat: dict[str, Any]) -> Any:
        """``params`` rebuilt from its ``leaves`` with the trainable ones taken from ``flat``."""
        leaves = list(leaves)
        for name, i in zip(self.names, self.index, strict=True):
            leaves[i] = flat[name]
        return self.treedef.unflatten(leaves)

    # -- grads ---------------------------------------------------------------

    def split_grads(self, grads: Any) -> tuple[dict[str, Any], Callable[[dict[str, Any]], Any]]:
        """``({name: grad}, rebuild)`` where ``rebuild(updates)`` puts a flat dict back in grads' shape.

        Grads shaped exactly like params are matched by position. Others (an
        equinox ``filter_grad`` with ``None`` for non-arrays, a dict holding
        only the trainable entries) are matched by name.
        """
        leaves, treedef = jax.tree.flatten(grads)
        treedef_: Any = treedef
        if treedef == self.treedef:
            positions = self._positions
        else:
            names = leaf_names(grads)
            known = set(self.all_names)
            unexpected = sorted(n for n in names if n not in known)
            by_name = {n: i for i, n in enumerate(names)}
            missing = [n for n in self.names if n not in by_name]
            if missing or unexpected:
                raise ValueError(
                    "grads do not match the params this optimizer was initialized with:"
                    + (f"\n  missing gradients for {missing}" if missing else "")
                    + (f"\n  unexpected gradients {unexpected}" if unexpected else "")
                    + "\nPass gradients of the same params tree given to init "
                    "(e.g. jax.grad(loss)(params))."
                )
            positions = {n: by_name[n] for n in self.names}
        flat = {name: leaves[positions[name]] for name in self.names}
        self._check_avals(list(flat.values()), "grads")

        def rebuild(updates: dict[str, Any]) -> Any:
            out = [jnp.zeros_like(leaf) if is_float_array(leaf) else leaf for leaf in leaves]
            for name, i in positions.items():
                out[i] = updates[name]
            return treedef_.unflatten(out)

        return flat, rebuild

    # -- checks --------------------------------------------------------------

    def _check_avals(self, trainable: list[Any], what: str) -> None:
        try:
            # Fast path: every leaf matches (one list comparison instead of the loop below).
            if [(leaf.shape, leaf.dtype) for leaf in trainable] == self._expected:
                return
        except Exception:  # a leaf without shape/dtype, or an odd dtype: the checks below explain
            pass
        bad = []
        for name, leaf, (shape, dtype) in zip(self.names, trainable, self.avals, strict=True):
            if not hasattr(leaf, "shape") or tuple(leaf.shape) != shape or np.dtype(leaf.dtype) != dtype:
                bad.append(f"'{name}': expected {np.dtype(dtype).name}{list(shape)}, got {_describe(leaf)}")
        if bad:
            raise ValueError(
                f"{what} do not match the params this optimizer was initialized with:\n  "
                + "\n  ".join(bad)
            )

    def _raise_structure_error(self, tree: Any, what: str) -> None:
        names = leaf_names(tree)
        got, expected = set(names), set(self.all_names)
        missing = sorted(expected - got)
        unexpected = sorted(got - expected)
        details = ""
        if missing:
            details += f"\n  missing {missing}"
        if unexpected:
            details += f"\n  unexpected {unexpected}"
        if not details:
            details = (
                f"\n  same names, other containers: got {jax.tree.structure(tree)},"
                f" expected {self.treedef}"
            )
        raise ValueError(
            f"{what} do not match the params this optimizer was initialized with:{details}\n"
            "Call opt.init(params) again for a new model."
        )


def is_lookahead(params: Any) -> bool:
    """True for ``optax.LookaheadParams`` (fast and slow copies of the params)."""
    return isinstance(params, optax.LookaheadParams)
