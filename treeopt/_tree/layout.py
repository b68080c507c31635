"""ParamLayout: where the trainable leaves of a params tree are, and their names.

Computed once at ``Optimizer.init`` and kept as static aux data, so flattening
params to the flat named dict (and back) costs one ``jax.tree.flatten`` and an
index lookup; names are never recomputed on the hot path. ``opt.layout`` is
an optimizer's, so code built on the core flattens and re-nests params the
same way.

Example:
    >>> import jax.numpy as jnp
    >>> from treeopt._tree.layout import ParamLayout
    >>> layout = ParamLayout.of({"dense": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}})
    >>> flat, rebuild = layout.split_params({"dense": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}})
    >>> sorted(flat)
    ['dense/bias', 'dense/kernel']
    >>> rebuild({**flat, "dense/bias": jnp.ones(3)})["dense"]["bias"]
    Array([1., 1., 1.], dtype=float32)
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from treeopt._tree.masks import name_matcher
from treeopt._tree.nnx_graph import (
    filter_predicate,
    is_nnx_filter,
    is_nnx_graph,
    is_nnx_object,
    is_nnx_param,
    write_into,
)
from treeopt._tree.paths import LeafInfo, check_unique, leaf_infos, leaf_names
from treeopt.errors import TreeMismatchError, describe
from treeopt.typing import FlatParams, Params, Updates

__all__ = ["Flattened", "ParamLayout", "Wrt"]

Wrt = Any
"""What ``wrt=`` accepts: None, a glob or sequence of globs, a ``(name, leaf)`` predicate, or an nnx filter."""


class Flattened(NamedTuple):
    """A tree's trained leaves by name, and the way back to a tree of the caller's type.

    Attributes:
        flat: ``{name: leaf}`` of the trained leaves, in the layout's order.
        rebuild: ``rebuild(new_flat)`` gives the tree back with the trained
            leaves taken from ``new_flat`` (an nnx Module is updated in place
            and returned).

    Example:
        >>> import jax.numpy as jnp
        >>> params = {"w": jnp.ones(2), "step": 0}
        >>> flat, rebuild = ParamLayout.of(params).split_params(params)
        >>> list(flat), rebuild({"w": jnp.zeros(2)})["step"]
        (['w'], 0)
    """

    flat: FlatParams
    rebuild: Callable[[FlatParams], Params]


def is_float_array(leaf: Any) -> bool:
    """True for array leaves (numpy, jax, tracers) of a floating or complex dtype."""
    dtype = getattr(leaf, "dtype", None)
    return (
        dtype is not None
        and hasattr(leaf, "shape")
        and not isinstance(leaf, (int, float, complex, bool))
        and jnp.issubdtype(dtype, jnp.inexact)
    )


def is_array(leaf: Any) -> bool:
    """True for array leaves (numpy, jax, tracers, abstract): what a ``wrt`` predicate is asked about.

    A model's other leaves (equinox's activation functions, Python numbers,
    strings) are never trained, so a predicate never sees them.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> is_array(jnp.ones(2)), is_array(jax.nn.relu), is_array(1.0)
        (True, False, False)
    """
    return (
        hasattr(leaf, "shape")
        and hasattr(leaf, "dtype")
        and not isinstance(leaf, (int, float, complex, bool))
    )


Select = Callable[[LeafInfo, Any], bool]


def _nnx_select(wrt: Any) -> Select:
    """``wrt`` (an nnx filter) called as nnx calls it: with the path and the ``Variable``."""
    predicate = filter_predicate(wrt)
    return lambda info, leaf: bool(predicate(info.path, info.variable if info.variable is not None else leaf))


def _default_select(info: LeafInfo, leaf: Any) -> bool:
    # As nnx.Optimizer(wrt=nnx.Param): a float held by another kind of Variable
    # (BatchStat, RNG state, caches, plain Variable) is state, not a parameter.
    return is_float_array(leaf) and (info.variable is None or is_nnx_param(info.variable))


def _selector(wrt: Wrt) -> Select:
    if wrt is None:
        return _default_select
    if isinstance(wrt, str):
        match = name_matcher(wrt)
        return lambda info, leaf: match(info.name) and is_float_array(leaf)
    if isinstance(wrt, (tuple, list)):
        if all(isinstance(w, str) for w in wrt):
            match = name_matcher(list(wrt))
            return lambda info, leaf: match(info.name) and is_float_array(leaf)
        parts = [_selector(w) for w in wrt]
        return lambda info, leaf: any(select(info, leaf) for select in parts)
    if is_nnx_filter(wrt):
        predicate = _nnx_select(wrt)
        return lambda info, leaf: is_float_array(leaf) and predicate(info, leaf)
    if callable(wrt):
        return lambda info, leaf: is_array(leaf) and bool(wrt(info.name, leaf))
    raise TypeError(
        "wrt must be None, a glob over parameter names (or a list of globs), a predicate "
        "(name, leaf) -> bool, or an nnx filter (nnx.Param, (nnx.Param, nnx.BatchStat), "
        f"nnx.PathContains(...), ...); got {type(wrt).__name__}: {wrt!r}."
    )


def _variable_slots(infos: list[LeafInfo], index: tuple[int, ...]) -> tuple[int, ...] | None:
    """Where the Variable of each trained leaf sits, or None when one is not the whole value of a Variable."""
    per_node = Counter(info.node for info in infos)
    if all(infos[i].variable is not None and per_node[infos[i].node] == 1 for i in index):
        return tuple(infos[i].node for i in index)
    return None


_NOT_INITIALIZED_WITH = "do not match the params this optimizer was initialized with"


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

    __slots__ = (
        "_by_treedef",
        "_expected",
        "_hash",
        "_positions",
        "_slots",
        "_views",
        "all_names",
        "avals",
        "index",
        "masked_index",
        "names",
        "nnx_paths",
        "treedef",
    )

    def __init__(
        self,
        treedef: Any,
        index: tuple[int, ...],
        names: tuple[str, ...],
        avals: tuple[tuple[tuple[int, ...], np.dtype], ...],
        all_names: tuple[str, ...],
        variable_slots: tuple[int, ...] | None = None,
        nnx_paths: tuple[tuple[Any, ...], ...] | None = None,
        masked_index: tuple[int, ...] = (),
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
        # Where each trainable leaf's nnx Variable sits, for writing into a Module in place.
        self._slots = variable_slots
        # The nnx paths of the trained leaves of an nnx Module or State: ``tx`` sees them as an nnx.State.
        self.nnx_paths = nnx_paths
        # The untrained array leaves: tx sees them as optax.MaskedNode (the other untrained leaves as None).
        self.masked_index = masked_index
        # Grads of another structure (nnx.grad's State for a Module) matched by name, per treedef.
        self._by_treedef: dict[Any, dict[str, int]] = {}
        # A Module whose static attributes changed (model.eval()), per treedef: positions and slots.
        self._views: dict[Any, tuple[tuple[int, ...], tuple[int, ...] | None]] = {}

    @classmethod
    def of(cls, params: Params, wrt: Wrt = None) -> ParamLayout:
        """The layout of ``params``; ``wrt`` selects the trainable leaves.

        ``wrt=None`` selects the floating-point array leaves, except those held by
        an nnx ``Variable`` other than ``nnx.Param`` (so an nnx Module or State
        trains its ``nnx.Param`` only, as ``nnx.Optimizer(wrt=nnx.Param)``). See
        :class:`treeopt.Optimizer` for the other forms of ``wrt``. Params with
        leaves of which ``wrt`` (the default included) selects none are an error:
        nothing would train. Params with no leaves at all are accepted.

        Example:
            >>> import jax.numpy as jnp
            >>> ParamLayout.of({"a": jnp.ones(2), "b": jnp.ones(2)}, wrt="a").names
            ('a',)
        """
        leaves, treedef = jax.tree.flatten(params)
        infos = leaf_infos(params)
        names = [info.name for info in infos]
        check_unique(names)
        select = _selector(wrt)
        index = tuple(
            i for i, (info, leaf) in enumerate(zip(infos, leaves, strict=True)) if select(info, leaf)
        )
        for i in index:
            if not hasattr(leaves[i], "shape"):
                raise TypeError(
                    f"wrt selected parameter '{names[i]}', which is a "
                    f"{type(leaves[i]).__name__}, not an array."
                )
        if not index and leaves:
            raise ValueError(_empty_selection_message(wrt, params, infos, leaves))
        avals = tuple((tuple(leaves[i].shape), np.dtype(leaves[i].dtype)) for i in index)
        slots = _variable_slots(infos, index)
        nnx = is_nnx_object(params) or any(infos[i].variable is not None for i in index)
        paths = tuple(infos[i].path for i in index) if nnx else None
        trained = set(index)
        masked = tuple(
            i for i, leaf in enumerate(leaves) if i not in trained and hasattr(leaf, "shape") and hasattr(leaf, "dtype")
        )
        return cls(treedef, index, tuple(names[i] for i in index), avals, tuple(names), slots, paths, masked)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, ParamLayout) or hash(self) != hash(other):
            return False
        return (
            self.treedef == other.treedef
            and self.index == other.index
            and self.names == other.names
            and self.avals == other.avals
        )

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        # The per-structure caches are rebuilt on demand, not copied.
        return ParamLayout, (
            self.treedef, self.index, self.names, self.avals, self.all_names, self._slots, self.nnx_paths,
            self.masked_index,
        )

    def __copy__(self) -> ParamLayout:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ParamLayout:
        return self  # immutable: equal by value, caches shareable

    def __repr__(self) -> str:
        return f"ParamLayout({len(self.names)} trainable of {len(self.all_names)} leaves)"

    # -- params --------------------------------------------------------------

    def split_params(self, params: Params) -> Flattened:
        """The trainable leaves of ``params`` by name, checked against this layout, and ``rebuild``."""
        leaves, treedef = jax.tree.flatten(params)
        if treedef != self.treedef:
            self._raise_structure_error(params, "params")
        trainable = [leaves[i] for i in self.index]
        self._check_avals(trainable, "params")
        return Flattened(
            dict(zip(self.names, trainable, strict=True)), functools.partial(self.merge_params, leaves)
        )

    def merge_params(self, leaves: list[Any], flat: FlatParams) -> Params:
        """``params`` rebuilt from its ``leaves`` with the trainable ones taken from ``flat``."""
        leaves = list(leaves)
        for name, i in zip(self.names, self.index, strict=True):
            leaves[i] = flat[name]
        return self.treedef.unflatten(leaves)

    def split_module(self, module: Params) -> Flattened:
        """``(flat, write)`` of an nnx Module: its trainable leaves by name; ``write(flat)`` updates it in place.

        ``write`` puts new values into the module's ``Variable``s, as
        ``nnx.Optimizer.update`` does, and returns the module itself. The
        module's static attributes may differ from those seen at init
        (``model.eval()`` / ``model.train()`` flip them): its leaves are then
        matched by name.

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> class Scale(nnx.Module):
            ...     def __init__(self):
            ...         self.w = nnx.Param(jnp.ones(2))
            >>> model = Scale()
            >>> flat, write = ParamLayout.of(model).split_module(model)
            >>> write({"w": flat["w"] * 0}) is model
            True
            >>> model.w[...]
            Array([0., 0.], dtype=float32)
        """
        leaves, treedef_ = jax.tree.flatten(module)
        treedef: Any = treedef_
        if treedef == self.treedef:
            index, slots = self.index, self._slots
        else:
            index, slots = self._module_view(module, treedef)
        trainable = [leaves[i] for i in index]
        self._check_avals(trainable, "params")

        def write(flat: FlatParams) -> Params:
            values = [flat[name] for name in self.names]

            def rebuilt() -> Any:
                new = list(leaves)
                for i, value in zip(index, values, strict=True):
                    new[i] = value
                return treedef.unflatten(new)

            return write_into(module, slots, values, rebuilt)

        return Flattened(dict(zip(self.names, trainable, strict=True)), write)

    def trained_positions(self, params: Params, treedef: Any) -> tuple[int, ...]:
        """Where the trained leaves sit among ``jax.tree.leaves(params)`` (``treedef`` is its structure).

        Example:
            >>> import jax, jax.numpy as jnp
            >>> params = {"a": jnp.int32(0), "b": jnp.ones(2)}
            >>> ParamLayout.of(params).trained_positions(params, jax.tree.structure(params))
            (1,)
        """
        if treedef == self.treedef:
            return self.index
        if is_nnx_graph(params):
            return self._module_view(params, treedef)[0]
        self._raise_structure_error(params, "params")
        raise AssertionError  # unreachable: the line above raises

    def _module_view(self, module: Any, treedef: Any) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """Positions and Variable slots of the trained leaves of a Module whose static data changed."""
        cached = self._views.get(treedef)
        if cached is not None:
            return cached
        infos = leaf_infos(module)
        by_name = {info.name: i for i, info in enumerate(infos)}
        if set(by_name) != set(self.all_names):
            self._raise_structure_error(module, "params")
        index = tuple(by_name[name] for name in self.names)
        view = (index, _variable_slots(infos, index))
        if len(self._views) < 8:
            self._views[treedef] = view
        return view

    # -- grads ---------------------------------------------------------------

    def split_grads(self, grads: Updates) -> Flattened:
        """``(flat, rebuild)``: the grads by name; ``rebuild(updates)`` puts a flat dict back in grads' shape.

        Grads shaped exactly like params are matched by position. Others (an
        equinox ``filter_grad`` with ``None`` for non-arrays, a dict holding
        only the trainable entries) are matched by name.
        """
        leaves, treedef = jax.tree.flatten(grads)
        treedef_: Any = treedef
        if treedef == self.treedef:
            positions = self._positions
        else:
            positions = self._by_treedef.get(treedef) or self._positions_by_name(grads, treedef)
        flat = {name: leaves[positions[name]] for name in self.names}
        self._check_avals(list(flat.values()), "grads")

        def rebuild(updates: FlatParams) -> Updates:
            out = [jnp.zeros_like(leaf) if is_float_array(leaf) else leaf for leaf in leaves]
            for name, i in positions.items():
                out[i] = updates[name]
            return treedef_.unflatten(out)

        return Flattened(flat, rebuild)

    def _positions_by_name(self, grads: Any, treedef: Any) -> dict[str, int]:
        names = leaf_names(grads)
        known = set(self.all_names)
        unexpected = sorted(n for n in names if n not in known)
        by_name = {n: i for i, n in enumerate(names)}
        missing = [n for n in self.names if n not in by_name]
        if missing or unexpected:
            raise TreeMismatchError.between(
                f"grads {_NOT_INITIALIZED_WITH}",
                missing=missing,
                unexpected=unexpected,
                hint="Pass gradients of the same params tree given to init (e.g. jax.grad(loss)(params)).",
            )
        positions = {n: by_name[n] for n in self.names}
        if len(self._by_treedef) < 8:  # names depend on the structure only: match each one once
            self._by_treedef[treedef] = positions
        return positions

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
                bad.append((name, f"{np.dtype(dtype).name}{list(shape)}", describe(leaf)))
        if bad:
            raise TreeMismatchError.between(f"{what} {_NOT_INITIALIZED_WITH}", mismatched=bad)

    def _raise_structure_error(self, tree: Any, what: str) -> None:
        names = leaf_names(tree)
        got, expected = set(names), set(self.all_names)
        missing = sorted(expected - got)
        unexpected = sorted(got - expected)
        hint = "Call opt.init(params) again for a new model."
        if not (missing or unexpected):
            hint = (
                f"Same names, other containers: got {jax.tree.structure(tree)}, expected {self.treedef}.\n"
                + hint
            )
        raise TreeMismatchError.between(
            f"{what} {_NOT_INITIALIZED_WITH}", missing=missing, unexpected=unexpected, hint=hint
        )


_SHOWN = 8  # names an empty-selection error lists


def _selects_by_variable_type(wrt: Wrt) -> bool:
    """Whether ``wrt`` is, or lists, a class: an nnx Variable type such as ``nnx.Param``."""
    if isinstance(wrt, (tuple, list)):
        return any(_selects_by_variable_type(w) for w in wrt)
    return isinstance(wrt, type)


def _wrt_text(wrt: Wrt) -> str:
    """``wrt`` as an error message writes it: a class by its name (``Param``), the rest by ``repr``."""
    if isinstance(wrt, type):
        return wrt.__name__
    if isinstance(wrt, (tuple, list)):
        inner = ", ".join(_wrt_text(w) for w in wrt)
        return f"[{inner}]" if isinstance(wrt, list) else f"({inner}{',' if len(wrt) == 1 else ''})"
    return repr(wrt)


def _empty_selection_message(wrt: Wrt, params: Any, infos: list[LeafInfo], leaves: list[Any]) -> str:
    """Why nothing is trained: the ``wrt``, a few of the leaves there are, and a hint for the likely slip."""
    shown = [
        f"'{info.name}' ({'' if info.variable is None else type(info.variable).__name__ + ' '}{describe(leaf)})"
        for info, leaf in zip(infos[:_SHOWN], leaves, strict=False)
    ]
    more = f", ... ({len(infos)} leaves in all)" if len(infos) > _SHOWN else ""
    has_variables = any(info.variable is not None for info in infos)
    if wrt is None:
        what = "wrt=None (the default: floating-point arrays"
        what += ", of nnx Variables the nnx.Param)" if has_variables else ")"
    else:
        what = f"wrt={_wrt_text(wrt)}"
    message = (
        f"{what} selects no leaf of the {type(params).__name__} given to init: nothing would train. "
        f"Its leaves: {', '.join(shown)}{more}."
    )
    if wrt is not None and _selects_by_variable_type(wrt) and not has_variables:
        message += (
            f"\nwrt selects nnx Variables by type, but a plain {type(params).__name__} has no Variable "
            "types (only an nnx Module or nnx.State holds nnx.Param, nnx.BatchStat, ...): pass the Module "
            "or its nnx.state, or select by name with a glob (wrt='encoder/*')."
        )
    elif isinstance(wrt, str) or (isinstance(wrt, (tuple, list)) and any(isinstance(w, str) for w in wrt)):
        message += "\nA glob matches whole names, '/'-separated as listed: 'encoder/*', '*kernel'."
    elif wrt is None and not any(is_float_array(leaf) for leaf in leaves):
        message += "\nNo leaf is a floating-point array: create params as floats (jnp.array([1.0, 2.0]))."
    return message


def is_lookahead(params: Any) -> bool:
    """True for ``optax.LookaheadParams`` (fast and slow copies of the params)."""
    return isinstance(params, optax.LookaheadParams)
