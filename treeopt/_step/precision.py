"""One precision layer: how a trainable param is held, and how it takes a float32 update.

Four answers to that one question, each a :class:`Precision`: static data
of the optimizer, chosen once at construction from its options
(:func:`treeopt._step.options.precision_of`), with a state type of its own, as optax gives
``apply_if_finite`` its ``ApplyIfFiniteState``:

- :class:`AsIs` (no option): every param as it is; ``tx`` runs in its dtype.
  State: :class:`AsIsState`, empty.
- :class:`MasterWeights` (``master_dtype=jnp.float32``): a copy in the wider
  dtype of each narrower param, which ``tx`` steps instead; the param is its
  copy cast down. A param changed behind the optimizer wins (:func:`follow`).
  State: :class:`MasterWeightsState`, the copies.
- :class:`Kahan` (``param_rounding="kahan"``): ``tx`` on each narrow param
  cast to float32; the sum written back into the param's dtype with a
  compensation buffer that keeps what the rounding lost. State:
  :class:`KahanState`, the buffers.
- :class:`Stochastic` (``param_rounding="stochastic"``, ``rounding_seed=``):
  the same, written back by unbiased stochastic rounding, with one PRNG key
  for the whole model. State: :class:`StochasticState`, the key.

Which params a precision holds otherwise is one predicate, :func:`narrower`.
The options are checked, and the precision they choose made, in
:mod:`treeopt._step.options`. A precision says what ``tx.init`` sees and makes its state
(:meth:`Precision.init`), the values ``tx`` steps (:meth:`Precision.widened`),
how the new values are written back (:meth:`Precision.written`), its
state-dict entries (:meth:`Precision.entries`) and how the optimizer shows
its state (:meth:`Precision.views`: ``opt.master`` and ``opt.rounding``);
:func:`precision_step` is the one step they all take. Nothing reads back
from a state which precision it belongs to: the optimizer hands its
precision and that precision's state to whoever needs them, so another way
to hold params is one more class here (and, for a new ``param_rounding``
choice, one more entry of :data:`ROUNDINGS`). Specs and ZeRO-1 placement need
nothing of a precision: a leaf keyed by a parameter's name and of its shape
gets that parameter's spec, and the data axis if it is floating
(``treeopt._sharding``).

Example:
    >>> import jax.numpy as jnp
    >>> precision = MasterWeights(jnp.dtype("float32"))
    >>> flat, state = precision.init({"w": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2)})
    >>> type(precision).__name__, type(state).__name__, {name: m.dtype.name for name, m in state.master.items()}
    ('MasterWeights', 'MasterWeightsState', {'w': 'float32'})
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from treeopt._sharding.explicit import resharded_like
from treeopt._step.rounding import is_float8, saturated, stochastic_round
from treeopt._step.step_io import FlatStep, StepInputs, next_step
from treeopt._tree.children import COMPENSATION, MASTER, ROUNDING_KEY, VIEWS, StateChild

__all__ = [
    "AS_IS",
    "ROUNDINGS",
    "AsIs",
    "AsIsState",
    "Kahan",
    "KahanState",
    "MasterWeights",
    "MasterWeightsState",
    "Precision",
    "Stochastic",
    "StochasticState",
    "narrower",
    "precision_step",
]

F32 = jnp.dtype(jnp.float32)


def _held(state: Any, child: StateChild) -> Any:
    """The child's value in ``state``: a dict of arrays copied (a view never aliases the state's own dict)."""
    value = getattr(state, child.attribute)
    return dict(value) if isinstance(value, Mapping) else value


def narrower(dtype: Any, than: Any = F32) -> bool:
    """Whether ``dtype`` is a real floating dtype with fewer bits than ``than``: a param held otherwise.

    Example:
        >>> narrower(jnp.bfloat16), narrower(jnp.float32), narrower(jnp.int8), narrower(None)
        (True, False, False, False)
        >>> narrower(jnp.float32, than=jnp.float64)
        True
    """
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        return False
    return bool(jnp.finfo(dtype).bits < jnp.finfo(than).bits)


# -- the state of each way: one type per precision ------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AsIsState:
    """The state of :class:`AsIs`: none (a pytree without leaves)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MasterWeightsState:
    """The state of :class:`MasterWeights`: ``master``, the copies ``{name: array}``.

    ``param_dtypes`` (static) are the dtypes of the params they are copies
    of, ``((name, dtype name), ...)``: the dtype each new param is written
    in when a step is not handed the params.
    """

    master: dict[str, Any]
    param_dtypes: tuple[tuple[str, str], ...] = dataclasses.field(default=(), metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KahanState:
    """The state of :class:`Kahan`: ``compensation``, a buffer ``{name: array}`` per narrow param."""

    compensation: dict[str, Any]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StochasticState:
    """The state of :class:`Stochastic`: ``key``, one typed PRNG key, split every step."""

    key: Any


# -- the ways ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Precision:
    """How the trainable params are held and take a float32 update (the base of the four ways).

    A precision holds its *narrow* params (:meth:`narrow`) otherwise than as
    they are, and keeps its own state for them. Instances are hashable and
    static under ``jax.jit``: the optimizer's static data, and a key of the
    compiled step.
    """

    option: ClassVar[str | None] = None
    """The constructor option that chooses it, which its errors name (``None``: as is)."""
    children: ClassVar[tuple[StateChild, ...]] = ()
    """The children its state holds, as :mod:`treeopt._tree.children` declares them (each a field of its state)."""

    @property
    def master_dtype(self) -> np.dtype | None:
        """The ``master_dtype`` option that chose it (``None``: not master weights)."""
        return None

    @property
    def param_rounding(self) -> str | None:
        """The ``param_rounding`` option that chose it (``None``: not a rounding)."""
        return None

    def narrow(self, dtype: Any) -> bool:
        """Whether a trainable param of ``dtype`` is held otherwise."""
        return False

    def init(self, flat: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
        """``(what tx.init sees, this precision's state)`` for fresh flat params."""
        return dict(flat), AsIsState()

    def widened(self, state: Any, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """``{name: value}`` that ``tx`` steps for each narrow param, from the state and the params given."""
        return {}

    def narrow_dtypes(
        self, state: Any, wide: Mapping[str, Any], params: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        """``{name: dtype}`` of the narrow params: the dtypes their new values are written in."""
        return {name: params[name].dtype for name in wide} if params is not None else {}

    def written(
        self, wide: Mapping[str, Any], updates: Mapping[str, Any], dtypes: Mapping[str, Any], state: Any
    ) -> tuple[dict[str, Any], Any]:
        """``({name: new param in its dtype}, new state)``: the wide values plus their updates, written back."""
        return {}, state

    def entries(self, state: Any) -> dict[str, Any]:
        """This precision's entries of the optimizer's state dict, from its state (before their plain form):
        each child under its declared name."""
        return {child.name: _held(state, child) for child in self.children}

    def views(self, state: Any) -> dict[str, Any]:
        """``{"master": ..., "rounding": ...}``: the optimizer's read-only views of ``state``.

        Each child in its declared view (under its declared key there), ``{}``
        in a view that shows none of them.
        """
        out: dict[str, Any] = {view: {} for view in VIEWS}
        for child in self.children:
            if child.shown_under is None:
                out[child.view] = _held(state, child)
            else:
                out[child.view][child.shown_under] = _held(state, child)
        return out

    def from_views(self, state: Any, views: Mapping[str, Any]) -> Any:
        """``state`` with each child taken from ``views`` (shaped like :meth:`views`' result), by name.

        Example:
            >>> import jax.numpy as jnp
            >>> _, state = Kahan().init({"w": jnp.ones(2, jnp.bfloat16)})
            >>> Kahan().from_views(state, {"rounding": {"compensation": {"w": "spec"}}}).compensation
            {'w': 'spec'}
        """
        return dataclasses.replace(
            state,
            **{
                child.attribute: views[child.view] if child.shown_under is None else views[child.view][child.shown_under]
                for child in self.children
            },
        )

    def exact_values(self, state: Any, new: Mapping[str, Any]) -> dict[str, Any]:
        """``{name: the param's exact new value in float32}`` of ``new`` (new params, or the wide values the
        state holds in their place): never a value rounded to a narrow dtype (what ``ema=`` averages).

        Example:
            >>> import jax.numpy as jnp
            >>> _, state = Kahan().init({"w": jnp.ones(1, jnp.bfloat16)})
            >>> state = KahanState({"w": jnp.full(1, 2**-10, jnp.bfloat16)})
            >>> Kahan().exact_values(state, {"w": jnp.ones(1, jnp.bfloat16)})["w"].tolist()
            [1.0009765625]
        """
        return {name: jnp.asarray(value, F32) for name, value in new.items()}

    def refuse_nothing_narrow(self, flat: Mapping[str, Any]) -> None:
        """A ``ValueError`` naming the option when no floating param is narrow: it would do nothing."""
        floating = sorted({str(leaf.dtype) for leaf in flat.values() if jnp.issubdtype(leaf.dtype, jnp.floating)})
        if floating and not any(self.narrow(leaf.dtype) for leaf in flat.values()):
            raise ValueError(self.nothing_narrow(", ".join(floating)))

    def nothing_narrow(self, dtypes: str) -> str:
        """The message of :meth:`refuse_nothing_narrow`, given the params' floating dtypes."""
        return f"{self.option} would do nothing: no trainable param is held otherwise (their dtypes are {dtypes})."


@dataclasses.dataclass(frozen=True)
class AsIs(Precision):
    """Every param as it is: ``tx`` runs on the params in their own dtypes (no option)."""


AS_IS = AsIs()


@dataclasses.dataclass(frozen=True)
class MasterWeights(Precision):
    """A copy in ``dtype`` of each trainable param narrower than it, which ``tx`` steps instead.

    The new param is its new copy cast down.

    Example:
        >>> import jax.numpy as jnp
        >>> flat, state = MasterWeights(jnp.dtype("float32")).init({"w": jnp.ones(2, jnp.bfloat16)})
        >>> flat["w"].dtype, state.master["w"].dtype, state.param_dtypes
        (dtype('float32'), dtype('float32'), (('w', 'bfloat16'),))
    """

    dtype: np.dtype

    option: ClassVar[str | None] = "master_dtype"
    children: ClassVar[tuple[StateChild, ...]] = (MASTER,)

    @property
    def master_dtype(self) -> np.dtype | None:
        return self.dtype

    def narrow(self, dtype: Any) -> bool:
        return narrower(dtype, self.dtype)

    def init(self, flat: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
        self.refuse_nothing_narrow(flat)
        narrow = {name: leaf for name, leaf in flat.items() if self.narrow(leaf.dtype)}
        master = {name: leaf.astype(self.dtype) for name, leaf in narrow.items()}
        dtypes = tuple((name, np.dtype(leaf.dtype).name) for name, leaf in narrow.items())
        return {**flat, **master}, MasterWeightsState(master, dtypes)  # tx.init sees the masters

    def nothing_narrow(self, dtypes: str) -> str:
        name = np.dtype(self.dtype).name
        return (
            f"master_dtype={name} is not wider than any trainable floating param: their dtypes are "
            f"{dtypes}, so no param would get a master copy. Pass a wider master_dtype (jnp.float32 for "
            "bfloat16 or float16 params), or none."
        )

    def widened(self, state: Any, params: Mapping[str, Any] | None) -> dict[str, Any]:
        return dict(state.master) if params is None else follow(state.master, params)

    def exact_values(self, state: Any, new: Mapping[str, Any]) -> dict[str, Any]:
        return {**super().exact_values(state, new), **{k: m.astype(F32) for k, m in state.master.items()}}

    def narrow_dtypes(
        self, state: Any, wide: Mapping[str, Any], params: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        if params is None:
            return {name: jnp.dtype(dtype) for name, dtype in state.param_dtypes}
        return super().narrow_dtypes(state, wide, params)

    def written(
        self, wide: Mapping[str, Any], updates: Mapping[str, Any], dtypes: Mapping[str, Any], state: Any
    ) -> tuple[dict[str, Any], Any]:
        new_master = applied(dict(wide), {name: updates[name] for name in wide})
        # A float8 param's master stays within the param's range, so that the param turns when its grad does.
        new_master = {name: saturated(m, dtypes[name]) for name, m in new_master.items()}
        new = {name: m.astype(dtypes[name]) for name, m in new_master.items()}
        return new, dataclasses.replace(state, master=new_master)


def follow(master: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """Each master, or its param cast up where the param no longer equals the master cast down.

    A param the step itself returned equals its master cast down, so its
    master (with the bits the param lacks) is kept; a param changed behind the
    optimizer (loaded, written in place) wins. The compare-and-select runs in
    a loop of one trip if any param changed and of none otherwise, so it never
    joins the step's own arithmetic: unchanged, the step is the program it
    would be without it (fused into it, the select made XLA order the
    reductions over the masters otherwise, and they drifted from float32
    optax). A loop, not a ``lax.cond``: its carry is updated in place, where a
    cond's result is a copy of the masters on a GPU.

    Example:
        >>> import jax.numpy as jnp
        >>> master = {"w": jnp.asarray([1.0001, 2.0001], jnp.float32)}
        >>> params = {"w": jnp.asarray([1.0, 5.0], jnp.bfloat16)}
        >>> follow(master, params)["w"].tolist()
        [1.000100016593933, 5.0]
    """
    given = {name: resharded_like(params[name], m) for name, m in master.items() if name in params}
    if not given:
        return dict(master)
    changed = functools.reduce(
        jnp.logical_or, [jnp.any(p != master[name].astype(p.dtype)) for name, p in given.items()]
    )

    def taken(carry: tuple[Any, dict[str, Any]]) -> tuple[Any, dict[str, Any]]:
        _, masters = carry
        return jnp.zeros((), bool), {
            name: jnp.where(given[name] == m.astype(given[name].dtype), m, given[name].astype(m.dtype))
            if name in given
            else m
            for name, m in masters.items()
        }

    return jax.lax.while_loop(lambda carry: carry[0], taken, (changed, dict(master)))[1]


@dataclasses.dataclass(frozen=True)
class _Rounded(Precision):
    """Narrow params without a copy: ``tx`` steps them cast to float32, the sum is rounded back.

    The view ``opt.rounding`` shows its state's fields by name.
    """

    option: ClassVar[str | None] = "param_rounding"
    choice: ClassVar[str] = ""

    @property
    def param_rounding(self) -> str | None:
        return self.choice

    def narrow(self, dtype: Any) -> bool:
        return narrower(dtype)

    def init(self, flat: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
        self.refuse_nothing_narrow(flat)
        seen = {name: leaf.astype(F32) if self.narrow(leaf.dtype) else leaf for name, leaf in flat.items()}
        return seen, self.fresh(flat)

    def fresh(self, flat: Mapping[str, Any]) -> Any:
        """The state of fresh params."""
        raise NotImplementedError

    def nothing_narrow(self, dtypes: str) -> str:
        return (
            f"param_rounding={self.choice!r} rounds params narrower than float32, and no trainable "
            f"floating param is (their dtypes are {dtypes}): it would do nothing. Pass "
            "param_rounding=None for float32 params, or train them in bfloat16."
        )

    def widened(self, state: Any, params: Mapping[str, Any] | None) -> dict[str, Any]:
        if params is None:
            raise ValueError(
                "param_rounding needs the current params to round into: call "
                "opt.update(grads, params, apply_updates=False)."
            )
        return {name: p.astype(F32) for name, p in params.items() if self.narrow(p.dtype)}


def _compensation_dtype(dtype: Any) -> Any:
    """The dtype of a Kahan buffer: the param's own, float32 for a one-byte float.

    A buffer keeps residues of up to half the param's step; a small update
    counts only where it is more than half the buffer's own step there. A
    float8 param's step is an eighth (e4m3) or a quarter (e5m2) of its value,
    so a 16-bit buffer still rounded updates away or inflated them (Adam at
    1e-4 moved e4m3fn params near 1.0 a tenth as far as masters with a
    bfloat16 buffer; at 1e-5, e5m2 params near 0.25 moved 7x as far with a
    float16 one); a float32 buffer followed the masters in every case measured.
    """
    return jnp.float32 if jnp.dtype(dtype).itemsize == 1 else dtype

@dataclasses.dataclass(frozen=True)
class Kahan(_Rounded):
    """Kahan-compensated summation: a buffer in each narrow param's dtype keeps what rounding lost.

    The next update adds it back first, so small updates add up instead of
    rounding away (+2 bytes per bfloat16 parameter). A float8 param keeps its
    buffer in float32 (+4 bytes, what a master copy costs): with 2 or 3
    mantissa bits, the param's step is so coarse that a narrower buffer rounds
    small updates away or inflates them (:func:`_compensation_dtype`).

    Example:
        >>> import jax.numpy as jnp
        >>> _, state = Kahan().init({"w": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2)})
        >>> {name: c.dtype.name for name, c in state.compensation.items()}
        {'w': 'bfloat16'}
    """

    choice: ClassVar[str] = "kahan"
    children: ClassVar[tuple[StateChild, ...]] = (COMPENSATION,)

    def fresh(self, flat: Mapping[str, Any]) -> Any:
        return KahanState(
            {
                k: jnp.zeros_like(v, dtype=_compensation_dtype(v.dtype))
                for k, v in flat.items()
                if self.narrow(v.dtype)
            }
        )

    def written(
        self, wide: Mapping[str, Any], updates: Mapping[str, Any], dtypes: Mapping[str, Any], state: Any
    ) -> tuple[dict[str, Any], Any]:
        compensation, new = dict(state.compensation), {}
        for k, w in wide.items():
            total = updates[k] + compensation[k].astype(F32)  # what this step adds, and what the last one lost
            if is_float8(dtypes[k]):  # what passes a float8's range is not carried over to the next step
                total = saturated(w + total, dtypes[k]) - w
            new[k] = (w + total).astype(dtypes[k])
            compensation[k] = (total - (new[k].astype(F32) - w)).astype(compensation[k].dtype)
        return new, KahanState(compensation)

    def exact_values(self, state: Any, new: Mapping[str, Any]) -> dict[str, Any]:
        exact = super().exact_values(state, new)
        return {k: v + state.compensation[k].astype(F32) if k in state.compensation else v for k, v in exact.items()}


@dataclasses.dataclass(frozen=True)
class Stochastic(_Rounded):
    """Unbiased stochastic rounding: each new value rounds up or down at random, by its nearness.

    One PRNG key in the state, ``jax.random.key(seed)`` at ``init`` and split
    every step, makes the draws deterministic given the state (+0 bytes per
    parameter): a resumed run draws what the uninterrupted one would have.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> _, state = Stochastic(seed=7).init({"w": jnp.ones(2, jnp.bfloat16)})
        >>> bool((jax.random.key_data(state.key) == jax.random.key_data(jax.random.key(7))).all())
        True
        >>> sorted(Stochastic().entries(state))
        ['rounding_key']
    """

    seed: int = 0
    choice: ClassVar[str] = "stochastic"
    children: ClassVar[tuple[StateChild, ...]] = (ROUNDING_KEY,)  # written as its key data, as every typed key

    def fresh(self, flat: Mapping[str, Any]) -> Any:
        return StochasticState(jax.random.key(self.seed))

    def written(
        self, wide: Mapping[str, Any], updates: Mapping[str, Any], dtypes: Mapping[str, Any], state: Any
    ) -> tuple[dict[str, Any], Any]:
        key, draw = jax.random.split(state.key)
        keys = jax.random.split(draw, max(len(wide), 1))
        new = {k: stochastic_round(w + updates[k], dtypes[k], keys[i]) for i, (k, w) in enumerate(wide.items())}
        return new, StochasticState(key)


ROUNDINGS: dict[str, type[_Rounded]] = {"kahan": Kahan, "stochastic": Stochastic}
"""The choices of ``param_rounding``, by name."""

# -- the one step --------------------------------------------------------------------------------


def applied(params: Any, updates: Any) -> Any:
    """``optax.apply_updates(params, updates)``, with a float8 param saturating at its largest value.

    Example:
        >>> import jax.numpy as jnp
        >>> applied({"w": jnp.full(2, 440.0, jnp.float8_e5m2)}, {"w": jnp.full(2, 6e4, jnp.float32)})["w"].tolist()
        [57344.0, 57344.0]
    """
    if not any(is_float8(p.dtype) for p in jax.tree.leaves(params) if hasattr(p, "dtype")):
        return optax.apply_updates(params, updates)

    def one(p: Any, u: Any) -> Any:
        if p is None or not is_float8(p.dtype):
            return optax.apply_updates(p, u)
        return saturated(p.astype(F32) + jnp.asarray(u).astype(F32), p.dtype).astype(p.dtype)

    return jax.tree.map(one, params, updates, is_leaf=lambda x: x is None)


def precision_step(inputs: StepInputs, extra: Mapping[str, Any]) -> FlatStep:
    """``tx.update`` through the inputs' precision: the one step of every way a param is held.

    ``tx`` steps each narrow param as the value its precision gives
    (:meth:`Precision.widened`), its grad cast to that value's dtype, and the
    new value is written back into the param's dtype
    (:meth:`Precision.written`). The output of a narrow param is its new
    value, or (the updates) that minus the param given, in the wide dtype, so
    that ``optax.apply_updates(params, updates)`` gives the new params. The
    other params are stepped as they are, and :class:`AsIs` hands ``tx`` the
    trees as given (any structure).
    """
    precision, params, state = inputs.precision or AS_IS, inputs.params, inputs.precision_state
    if precision.option is None:
        updates, new_state = inputs.tx.update(inputs.grads, inputs.opt_state, params, **extra)
        output = applied(params, updates) if inputs.apply_updates else updates
        return FlatStep(next_step(inputs.step), new_state, output, state)
    wide = precision.widened(state, params)
    dtypes = precision.narrow_dtypes(state, wide, params)
    grads = {k: g.astype(wide[k].dtype) if k in wide else g for k, g in inputs.grads.items()}
    seen: dict[str, Any] | None
    if params is not None:
        seen = {k: wide[k] if k in wide else p for k, p in params.items()}
    else:  # tx reads the wide values, if every trained param has one
        seen = {k: wide[k] for k in inputs.grads} if set(inputs.grads) <= set(wide) else None
    updates, new_state = inputs.tx.update(grads, inputs.opt_state, seen, **extra)
    new, new_held = precision.written(wide, updates, dtypes, state)
    out = {}
    for k in inputs.grads:
        if k not in wide:
            out[k] = applied(params[k], updates[k]) if inputs.apply_updates else updates[k]
        elif inputs.apply_updates:
            out[k] = new[k]
        else:
            given = params[k] if params is not None else wide[k].astype(dtypes[k])
            out[k] = new[k].astype(wide[k].dtype) - given.astype(wide[k].dtype)
    return FlatStep(next_step(inputs.step), new_state, out, new_held)
