"""One precision layer: how a trainable param is held, and how it takes a float32 update.

Four answers to that one question, each a :class:`Precision`, chosen by the
optimizer's options (:func:`precision_of`):

- :class:`AsIs` (no option): every param as it is; ``tx`` runs in its dtype.
- :class:`MasterWeights` (``master_dtype=jnp.float32``): a copy in the wider
  dtype of each narrower param, which ``tx`` steps instead; the param is its
  copy cast down. A param changed behind the optimizer wins (:func:`follow`).
- :class:`Kahan` (``param_rounding="kahan"``): ``tx`` on each narrow param
  cast to float32; the sum written back into the param's dtype with a
  compensation buffer that keeps what the rounding lost.
- :class:`Stochastic` (``param_rounding="stochastic"``): the same, written back
  by unbiased stochastic rounding, with one PRNG key for the whole model.

Which params a precision holds otherwise is one predicate, :func:`narrower`.
A precision says what ``tx.init`` sees (:meth:`Precision.init`), the values
``tx`` steps (:meth:`Precision.widened`), how the new values are written back
(:meth:`Precision.written`) and its state-dict entries
(:meth:`Precision.entries`); :func:`precision_step` is the one step they all
take. Its state is a leaf of the optimizer, in one part
(:attr:`Precision.part`): ``master`` for master weights, ``rounding`` for the
roundings. Specs and ZeRO-1 placement need nothing of a precision: a leaf
keyed by a parameter's name and of its shape gets that parameter's spec, and
the data axis if it is floating (``treeopt._sharding``).

Example:
    >>> import jax.numpy as jnp
    >>> precision = precision_of(jnp.dtype("float32"), None)
    >>> flat, held = precision.init({"w": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2)})
    >>> type(precision).__name__, {name: m.dtype.name for name, m in held.items()}
    ('MasterWeights', {'w': 'float32'})
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
from treeopt._step.rounding import stochastic_round
from treeopt._step.step_io import FlatStep, StepInputs, next_step
from treeopt.keys import key_data

__all__ = [
    "AS_IS",
    "AsIs",
    "Kahan",
    "MasterWeights",
    "Precision",
    "Stochastic",
    "checked_master_dtype",
    "checked_param_rounding",
    "held_as",
    "narrower",
    "precision_of",
    "precision_step",
]

F32 = jnp.dtype(jnp.float32)


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


@dataclasses.dataclass(frozen=True)
class Precision:
    """How the trainable params are held and take a float32 update (the base of the four ways).

    A precision holds its *narrow* params (:meth:`narrow`) otherwise than as
    they are, and keeps a state for them (``{}`` when it needs none) in the
    optimizer's part :attr:`part`. Instances are hashable and static under
    ``jax.jit``: they key the compiled step.
    """

    option: ClassVar[str | None] = None
    """The constructor option that chooses it, which its errors name."""
    part: ClassVar[str | None] = None
    """The optimizer's part that holds its state: ``"master"``, ``"rounding"``, or ``None`` (as is)."""

    def narrow(self, dtype: Any) -> bool:
        """Whether a trainable param of ``dtype`` is held otherwise."""
        return False

    def init(self, flat: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
        """``(what tx.init sees, this precision's state)`` for fresh flat params."""
        return dict(flat), {}

    def widened(self, held: Any, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """``{name: value}`` that ``tx`` steps for each narrow param, from the state and the params given."""
        return {}

    def narrow_dtypes(self, wide: Mapping[str, Any], params: Mapping[str, Any] | None) -> dict[str, Any]:
        """``{name: dtype}`` of the narrow params: the dtypes their new values are written in."""
        return {name: params[name].dtype for name in wide} if params is not None else {}

    def written(
        self, wide: Mapping[str, Any], updates: Mapping[str, Any], dtypes: Mapping[str, Any], held: Any
    ) -> tuple[dict[str, Any], Any]:
        """``({name: new param in its dtype}, new state)``: the wide values plus their updates, written back."""
        return {}, held

    def entries(self, held: Any) -> dict[str, Any]:
        """This precision's entries of the optimizer's state dict, from its state."""
        return {}

    def placed(self, held: Any) -> dict[str, Any]:
        """``{part: state}``: where the optimizer keeps this precision's state (nothing as is)."""
        return {self.part: held} if self.part is not None else {}

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

    The new param is its new copy cast down. ``dtype`` is ``None`` for a step
    handed the copies (their dtype is theirs); ``param_dtypes`` are the params'
    dtypes ``((name, dtype name), ...)`` for a step not handed the params.

    Example:
        >>> import jax.numpy as jnp
        >>> flat, master = MasterWeights(jnp.dtype("float32")).init({"w": jnp.ones(2, jnp.bfloat16)})
        >>> flat["w"].dtype, master["w"].dtype
        (dtype('float32'), dtype('float32'))
    """

    dtype: np.dtype | None = None
    param_dtypes: tuple[tuple[str, str], ...] | None = None

    option: ClassVar[str | None] = "master_dtype"
    part: ClassVar[str | None] = "master"

    def narrow(self, dtype: Any) -> bool:
        return narrower(dtype, self.dtype)

    def init(self, flat: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
        self.refuse_nothing_narrow(flat)
        master = {name: leaf.astype(self.dtype) for name, leaf in flat.items() if self.narrow(leaf.dtype)}
        return {**flat, **master}, master  # tx.init sees the masters

    def nothing_narrow(self, dtypes: str) -> str:
        name = np.dtype(self.dtype).name
        return (
            f"master_dtype={name} is not wider than any trainable floating param: their dtypes are "
            f"{dtypes}, so no param would get a master copy. Pass a wider master_dtype (jnp.float32 for "
            "bfloat16 or float16 params), or none."
        )

    def widened(self, held: Any, params: Mapping[str, Any] | None) -> dict[str, Any]:
        return dict(held) if params is None else follow(held, params)

    def narrow_dtypes(self, wide: Mapping[str, Any], params: Mapping[str, Any] | None) -> dict[str, Any]:
        if params is None:
            return {name: jnp.dtype(dtype) for name, dtype in self.param_dtypes or ()}
        return super().narrow_dtypes(wide, params)

    def written(
        self, wide: Mapping[str, Any], updates: Mapping[str, Any], dtypes: Mapping[str, Any], held: Any
    ) -> tuple[dict[str, Any], Any]:
        new_master = optax.apply_updates(dict(wide), {name: updates[name] for name in wide})
        return {name: m.astype(dtypes[name]) for name, m in new_master.items()}, new_master

    def entries(self, held: Any) -> dict[str, Any]:
        return {"master": dict(held)} if held else {}


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
    """Narrow params without a copy: ``tx`` steps them cast to float32, the sum is rounded back."""

    option: ClassVar[str | None] = "param_rounding"
    part: ClassVar[str | None] = "rounding"
    choice: ClassVar[str] = ""

    def narrow(self, dtype: Any) -> bool:
        return narrower(dtype)

    def init(self, flat: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
        self.refuse_nothing_narrow(flat)
        seen = {name: leaf.astype(F32) if self.narrow(leaf.dtype) else leaf for name, leaf in flat.items()}
        return seen, self.fresh(flat)

    def fresh(self, flat: Mapping[str, Any]) -> dict[str, Any]:
        """The state of fresh params."""
        raise NotImplementedError

    def nothing_narrow(self, dtypes: str) -> str:
        return (
            f"param_rounding={self.choice!r} rounds params narrower than float32, and no trainable "
            f"floating param is (their dtypes are {dtypes}): it would do nothing. Pass "
            "param_rounding=None for float32 params, or train them in bfloat16."
        )

    def widened(self, held: Any, params: Mapping[str, Any] | None) -> dict[str, Any]:
        if params is None:
            raise ValueError(
                "param_rounding needs the current params to round into: call "
                "opt.update(grads, params, apply_updates=False)."
            )
        return {name: p.astype(F32) for name, p in params.items() if self.narrow(p.dtype)}


def _compensation_dtype(dtype: Any) -> Any:
    """The dtype of a Kahan buffer: the param's own, bfloat16 for a one-byte float."""
    return jnp.bfloat16 if jnp.dtype(dtype).itemsize == 1 else dtype

@dataclasses.dataclass(frozen=True)
class Kahan(_Rounded):
    """Kahan-compensated summation: a buffer in each narrow param's dtype keeps what rounding lost.

    The next update adds it back first, so small updates add up instead of
    rounding away (+2 bytes per bfloat16 parameter). A float8 param keeps its
    buffer in bfloat16: with 2 or 3 mantissa bits, a float8 buffer would
    round each new residue away once the sum nears a quarter of the param's
    step, and the param would never move.

    Example:
        >>> import jax.numpy as jnp
        >>> _, held = Kahan().init({"w": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2)})
        >>> {name: c.dtype.name for name, c in held["compensation"].items()}
        {'w': 'bfloat16'}
    """

    choice: ClassVar[str] = "kahan"

    def fresh(self, flat: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "compensation": {
                k: jnp.zeros_like(v, dtype=_compensation_dtype(v.dtype))
                for k, v in flat.items()
                if self.narrow(v.dtype)
            }
        }

    def written(
        self, wide: Mapping[str, Any], updates: Mapping[str, Any], dtypes: Mapping[str, Any], held: Any
    ) -> tuple[dict[str, Any], Any]:
        compensation, new = dict(held["compensation"]), {}
        for k, w in wide.items():
            total = updates[k] + compensation[k].astype(F32)  # what this step adds, and what the last one lost
            new[k] = (w + total).astype(dtypes[k])
            compensation[k] = (total - (new[k].astype(F32) - w)).astype(compensation[k].dtype)
        return new, {"compensation": compensation}

    def entries(self, held: Any) -> dict[str, Any]:
        return {"compensation": dict(held["compensation"])}


@dataclasses.dataclass(frozen=True)
class Stochastic(_Rounded):
    """Unbiased stochastic rounding: each new value rounds up or down at random, by its nearness.

    One PRNG key in the state, split every step, makes the draws deterministic
    given the state (+0 bytes per parameter).

    Example:
        >>> import jax.numpy as jnp
        >>> _, held = Stochastic().init({"w": jnp.ones(2, jnp.bfloat16)})
        >>> sorted(held), sorted(Stochastic().entries(held))
        (['key'], ['rounding_key'])
    """

    seed: int = 0
    choice: ClassVar[str] = "stochastic"

    def fresh(self, flat: Mapping[str, Any]) -> dict[str, Any]:
        return {"key": jax.random.key(self.seed)}

    def written(
        self, wide: Mapping[str, Any], updates: Mapping[str, Any], dtypes: Mapping[str, Any], held: Any
    ) -> tuple[dict[str, Any], Any]:
        key, draw = jax.random.split(held["key"])
        keys = jax.random.split(draw, max(len(wide), 1))
        new = {k: stochastic_round(w + updates[k], dtypes[k], keys[i]) for i, (k, w) in enumerate(wide.items())}
        return new, {"key": key}

    def entries(self, held: Any) -> dict[str, Any]:
        return {"rounding_key": key_data(held["key"])}


ROUNDINGS: dict[str, type[_Rounded]] = {"kahan": Kahan, "stochastic": Stochastic}


def checked_master_dtype(master_dtype: Any) -> np.dtype | None:
    """``master_dtype`` as a floating NumPy dtype (``None`` stays ``None``), or an error saying why not.

    Example:
        >>> import jax.numpy as jnp
        >>> checked_master_dtype(jnp.float32), checked_master_dtype("float32"), checked_master_dtype(None)
        (dtype('float32'), dtype('float32'), None)
        >>> checked_master_dtype(jnp.int32)
        Traceback (most recent call last):
        ...
        TypeError: master_dtype must be a floating-point dtype such as jnp.float32, got int32.
    """
    if master_dtype is None:
        return None
    try:
        dtype = jnp.dtype(master_dtype)
    except TypeError:
        raise TypeError(
            f"master_dtype must be a floating-point dtype such as jnp.float32, got {master_dtype!r}."
        ) from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"master_dtype must be a floating-point dtype such as jnp.float32, got {dtype.name}.")
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        raise ValueError(
            f"master_dtype={dtype.name} needs 64-bit JAX: set jax.config.update('jax_enable_x64', True) "
            "first, or use jnp.float32."
        )
    return dtype


def checked_param_rounding(param_rounding: Any, master_dtype: Any) -> str | None:
    """``param_rounding`` checked: ``None``, ``"kahan"`` or ``"stochastic"``, and never beside ``master_dtype``.

    Example:
        >>> checked_param_rounding("kahan", None)
        'kahan'
        >>> checked_param_rounding("nearest", None)
        Traceback (most recent call last):
        ...
        ValueError: param_rounding must be None, 'kahan' or 'stochastic', got 'nearest'.
    """
    if not (param_rounding is None or (isinstance(param_rounding, str) and param_rounding in ROUNDINGS)):
        raise ValueError(f"param_rounding must be None, 'kahan' or 'stochastic', got {param_rounding!r}.")
    if param_rounding is not None and master_dtype is not None:
        raise ValueError(
            f"param_rounding={param_rounding!r} and master_dtype={np.dtype(master_dtype).name} are two ways "
            "to train narrow params: master_dtype keeps a wider copy of each, param_rounding keeps none. "
            "Pass one of them."
        )
    return param_rounding


@functools.cache
def precision_of(master_dtype: np.dtype | None, param_rounding: str | None) -> Precision:
    """The precision that the optimizer's checked options choose.

    Example:
        >>> precision_of(None, "kahan"), precision_of(None, None)
        (Kahan(), AsIs())
    """
    if master_dtype is not None:
        return MasterWeights(master_dtype)
    if param_rounding is not None:
        return ROUNDINGS[param_rounding]()
    return AS_IS


def held_as(
    master: Mapping[str, Any] | None,
    rounding: Mapping[str, Any] | None,
    param_dtypes: Mapping[str, Any] | None = None,
) -> tuple[Precision, Any]:
    """``(precision, state)`` of the optimizer's parts ``master`` and ``rounding``: the precision whose state they hold.

    ``param_dtypes``: ``{name: dtype}`` of the params with a master, for a
    step that is not handed the params.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> held_as({}, {"key": jax.random.key(0)})[0], held_as({}, {})
        (Stochastic(seed=0), (AsIs(), {}))
    """
    if master:
        dtypes = None if param_dtypes is None else tuple((k, jnp.dtype(d).name) for k, d in param_dtypes.items())
        return MasterWeights(param_dtypes=dtypes), dict(master)
    rounding = dict(rounding or {})
    if "compensation" in rounding:
        return Kahan(), rounding
    if "key" in rounding:
        return Stochastic(), rounding
    return AS_IS, {}


def param_dtypes_of(layout: Any, master: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: dtype}`` of the params that have a master, as ``init`` saw them (from the layout).

    Example:
        >>> import jax.numpy as jnp
        >>> from treeopt.layout import ParamLayout
        >>> layout = ParamLayout.of({"w": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2)})
        >>> param_dtypes_of(layout, {"w": jnp.ones(2)})
        {'w': dtype(bfloat16)}
    """
    return {
        name: dtype for name, (_, dtype) in zip(layout.names, layout.avals, strict=True) if name in master
    }


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
    precision, params = inputs.precision or AS_IS, inputs.params
    if precision.part is None:
        updates, new_state = inputs.tx.update(inputs.grads, inputs.opt_state, params, **extra)
        output = optax.apply_updates(params, updates) if inputs.apply_updates else updates
        return FlatStep(next_step(inputs.step), new_state, output)
    wide = precision.widened(inputs.held, params)
    dtypes = precision.narrow_dtypes(wide, params)
    grads = {k: g.astype(wide[k].dtype) if k in wide else g for k, g in inputs.grads.items()}
    seen: dict[str, Any] | None
    if params is not None:
        seen = {k: wide[k] if k in wide else p for k, p in params.items()}
    else:  # tx reads the wide values, if every trained param has one
        seen = {k: wide[k] for k in inputs.grads} if set(inputs.grads) <= set(wide) else None
    updates, new_state = inputs.tx.update(grads, inputs.opt_state, seen, **extra)
    new, held = precision.written(wide, updates, dtypes, inputs.held)
    out = {}
    for k in inputs.grads:
        if k not in wide:
            out[k] = optax.apply_updates(params[k], updates[k]) if inputs.apply_updates else updates[k]
        elif inputs.apply_updates:
            out[k] = new[k]
        else:
            given = params[k] if params is not None else wide[k].astype(dtypes[k])
            out[k] = new[k].astype(wide[k].dtype) - given.astype(wide[k].dtype)
    return FlatStep(next_step(inputs.step), new_state, out)._replace(**precision.placed(held))
