"""T5X's legacy Adafactor module (``t5x/adafactor.py``): ``from treeopt.t5x import adafactor``.

Replace ``from t5x import adafactor`` with ``from treeopt.t5x import adafactor``
and nothing else changes: every name of T5X's module keeps its signature and
meaning (``Adafactor``, ``FactorDim``, ``HParamMap``, ``HEURISTIC_RULE``,
``standard_logical_factor_rules``, ``factor_name_to_factordim``, the private
``_AdafactorHyperParams`` and ``_AdafactorParamState``), the per-parameter
state is ``(v_row, v_col, v, m)`` with ``(1,)`` placeholders for unused slots,
and checkpoints are laid out as T5X writes them
(``state/param_states/<path>/{v_row,v_col,v,m}``).

Factoring follows T5X's rules. Without a rule a parameter of rank 2 is
factored over its two largest dimensions when the smaller of them is at least
``min_dim_size_to_factor``. A rule (``factor_map``, or ``logical_factor_rules``
turned into one by :meth:`Adafactor.set_param_axes`) gives one
:class:`FactorDim` per dimension; it decides the factoring only for
parameters of rank above 2 or with a ``BATCH`` dimension: for any other
parameter T5X ignores it (and logs a warning) and uses the size heuristic.
A rule of ``None`` means unfactored; ``HEURISTIC_RULE`` asks for the heuristic.

One deliberate difference: :meth:`Adafactor.derive_logical_axes` shards the
factored statistics (``v_row``/``v_col`` get their parameter's logical axes
without the reduced ones) where T5X replicates them.

Example:
    >>> import jax.numpy as jnp
    >>> from treeopt.t5x import adafactor
    >>> opt = adafactor.Adafactor(learning_rate=0.1, min_dim_size_to_factor=8).create({"w": jnp.ones((24, 16))})
    >>> state = opt.state.param_states["w"]
    >>> state.v_row.shape, state.v_col.shape, state.v.shape, state.m.shape
    ((16,), (24,), (1,), (1,))
"""

from __future__ import annotations

import enum
import functools
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from flax.core import freeze
from jax.sharding import PartitionSpec

from treeopt import leaf_names
from treeopt.errors import TreeMismatchError
from treeopt.partitioning import spec_leaves_with_names
from treeopt.t5x._partition_rules import missing_axes_error
from treeopt.t5x._zero import with_zero_sharding
from treeopt.t5x.optimizers import Optimizer, OptimizerDef, OptimizerState

__all__ = [
    "HEURISTIC_RULE",
    "Adafactor",
    "Dtype",
    "FactorDim",
    "FactorRule",
    "HParamMap",
    "HeuristicRule",
    "factor_name_to_factordim",
    "standard_logical_factor_rules",
]

logger = logging.getLogger(__name__)

Dtype = Any
"""A dtype, as T5X's alias (``dtype_momentum``)."""


class FactorDim(enum.Enum):
    """How Adafactor treats one dimension of a parameter in its second-moment statistics.

    ``ROW`` dimensions are averaged out of ``v_col``, ``COLUMN`` dimensions out
    of ``v_row``; ``BATCH`` dimensions (stacked layers, fused projections) keep
    separate statistics and are left out of the RMS of the parameter scale and
    of update clipping; ``NONE`` dimensions are not factored.

    Example:
        >>> FactorDim.ROW, FactorDim.NONE.value
        (<FactorDim.ROW: 2>, None)
    """

    NONE = None
    BATCH = 1
    ROW = 2
    COLUMN = 3


class HeuristicRule(enum.Enum):
    """The type of :data:`HEURISTIC_RULE`: a factor rule that asks for the size heuristic.

    Example:
        >>> HEURISTIC_RULE is HeuristicRule.token
        True
    """

    token = 1


HEURISTIC_RULE = HeuristicRule.token
FactorRule = Union[HeuristicRule, tuple[FactorDim, ...]]  # noqa: UP007 - T5X's alias, a runtime value
"""A factor rule: :data:`HEURISTIC_RULE` or one :class:`FactorDim` per dimension."""

_FACTOR_NAMES = {
    "row": FactorDim.ROW,
    "col": FactorDim.COLUMN,
    "column": FactorDim.COLUMN,
    "batch": FactorDim.BATCH,
    "none": FactorDim.NONE,
    "unfactorized": FactorDim.NONE,
}


def factor_name_to_factordim(name: Any) -> Any:
    """The :class:`FactorDim` a name spells (any case); anything that is not a string comes back as given.

    Names: ``"row"``, ``"col"``/``"column"``, ``"batch"``, ``"none"``/``"unfactorized"``.
    Another string raises ``KeyError``.

    Example:
        >>> factor_name_to_factordim("Col"), factor_name_to_factordim(FactorDim.ROW)
        (<FactorDim.COLUMN: 3>, <FactorDim.ROW: 2>)
    """
    if not isinstance(name, str):
        return name
    try:
        return _FACTOR_NAMES[name.lower()]
    except KeyError:
        raise KeyError(
            f"Unknown factor dimension name {name!r}; known names: {sorted(_FACTOR_NAMES)}."
        ) from None


def standard_logical_factor_rules() -> Any:
    """Factoring of T5X's standard logical axis names, for ``Adafactor(logical_factor_rules=...)``.

    Example:
        >>> rules = standard_logical_factor_rules()
        >>> rules["embed"], rules["mlp"], rules["layers"]
        (<FactorDim.ROW: 2>, <FactorDim.COLUMN: 3>, <FactorDim.BATCH: 1>)
    """
    return freeze(
        {
            "vocab": FactorDim.COLUMN,
            "embed": FactorDim.ROW,
            "mlp": FactorDim.COLUMN,
            "heads": FactorDim.COLUMN,
            "kv": FactorDim.COLUMN,
            "joined_kv": FactorDim.COLUMN,
            "relpos_buckets": FactorDim.NONE,
            "layers": FactorDim.BATCH,
            "stack": FactorDim.BATCH,
            "q_wi_fused": FactorDim.COLUMN,
            "o_wo_fused": FactorDim.COLUMN,
            "multiquery_heads": FactorDim.COLUMN,
            "kv_fused": FactorDim.COLUMN,
            "layer_norm_scale": FactorDim.NONE,
            "mlp_activations": FactorDim.COLUMN,
        }
    )


class HParamMap:
    """Parameter path → hyperparameter by regular expressions (``re.search``): the first match wins.

    Paths join the keys to a parameter with ``"/"``
    (``"encoder/layers_0/mlp/wi/kernel"``). A path no rule matches raises
    ``KeyError``.

    Example:
        >>> hp = HParamMap([("bias$", False), (".*", True)])
        >>> hp["dense/bias"], hp["dense/kernel"]
        (False, True)
        >>> hp({"dense": {"bias": 0.0, "kernel": 0.0}})
        {'dense': {'bias': False, 'kernel': True}}
    """

    def __init__(self, rules: Sequence[tuple[str, Any]]):
        self._rules = [(re.compile(pattern), value) for pattern, value in rules]

    def __getitem__(self, key: str) -> Any:
        for regex, value in self._rules:
            if regex.search(key):
                return value
        raise KeyError(f"No factor rule found for parameter: {key}")

    def __call__(self, params: Any) -> Any:
        """A tree shaped like ``params`` holding each parameter's value."""
        values = [self[name] for name in leaf_names(params)]
        return jax.tree.unflatten(jax.tree.structure(params), values)


@struct.dataclass
class _AdafactorHyperParams:
    """Adafactor's hyper params, in T5X's field order; ``apply_gradient(grads, learning_rate=...)`` replaces fields.

    The fields that decide the state's structure are static (not pytree leaves).

    Example:
        >>> hp = _AdafactorHyperParams(0.1, True, True, None, 0.8, 0, 1.0, None, 128, 1e-30, 1e-3)
        >>> hp == Adafactor(0.1).hyper_params, hp.replace(learning_rate=0.2).learning_rate
        (True, 0.2)
    """

    learning_rate: float | None
    factored: bool = struct.field(pytree_node=False)
    multiply_by_parameter_scale: bool | HParamMap = struct.field(pytree_node=False)
    beta1: float | None
    decay_rate: float
    step_offset: int
    clipping_threshold: float | None
    weight_decay_rate: float | None
    min_dim_size_to_factor: int = struct.field(pytree_node=False)
    epsilon1: float
    epsilon2: float
    factor_map: Any = struct.field(pytree_node=False, default=None)
    logical_factor_rules: Any = struct.field(pytree_node=False, default=None)
    weight_decay_rate_lr_exponent: float | None = None
    global_norm_clip_threshold: float | None = None
    max_parameter_scale: float | None = None
    skip_nan_updates: bool | None = struct.field(pytree_node=False, default=False)


@struct.dataclass
class _AdafactorParamState:
    """One parameter's Adafactor state; the slots it does not use hold ``zeros((1,))``.

    Example:
        >>> import flax, jax.numpy as jnp
        >>> s = _AdafactorParamState(jnp.zeros(3), jnp.zeros(2), jnp.zeros(1), jnp.zeros(1))
        >>> sorted(flax.serialization.to_state_dict(s))
        ['m', 'v', 'v_col', 'v_row']
    """

    v_row: Any
    v_col: Any
    v: Any
    m: Any


_SLOTS = ("v_row", "v_col", "v", "m")

# Numeric hyper params. learning_rate is always an argument of the compiled step (a new
# value never recompiles); the others are compile-time constants when they are Python
# or NumPy scalars (as in T5X's own jitted step) and arguments when they are arrays.
_NUMERIC = (
    "beta1",
    "decay_rate",
    "step_offset",
    "clipping_threshold",
    "weight_decay_rate",
    "epsilon1",
    "epsilon2",
    "weight_decay_rate_lr_exponent",
    "global_norm_clip_threshold",
    "max_parameter_scale",
)


def _read_rule(
    rule: Any, shape: Sequence[int], path: str, fallback_to_heuristics: bool
) -> tuple[Any, Any, bool]:
    """``(averaging_dims, factored_dims, fell_back)`` of a rule: T5X's ``_parse_rule`` without its log line."""
    ndim = len(shape)
    every_dim = tuple(range(ndim))
    if rule is None:
        return every_dim, None, False
    if rule is HEURISTIC_RULE:
        if ndim > 2:
            raise ValueError(
                f"A parameter of rank above 2 needs an explicit factorization rule: '{path}' has shape "
                f"{tuple(shape)}. Give one with factor_map=HParamMap([...]) or logical_factor_rules "
                "and set_param_axes."
            )
        return every_dim, HEURISTIC_RULE, False
    if len(rule) != ndim:
        raise ValueError(
            f"Factorization rule {rule} has {len(rule)} entries but parameter '{path}' has rank {ndim} "
            f"(shape {tuple(shape)})."
        )
    rows = tuple(i for i, d in enumerate(rule) if d == FactorDim.ROW)
    columns = tuple(i for i, d in enumerate(rule) if d == FactorDim.COLUMN)
    batch = tuple(i for i, d in enumerate(rule) if d == FactorDim.BATCH)
    if fallback_to_heuristics and ndim <= 2 and not batch:
        return every_dim, HEURISTIC_RULE, True
    averaging = tuple(i for i in every_dim if i not in batch)
    factored = None if not rows and not columns else (rows, columns)
    return averaging, factored, False


def _log_fallback(path: str, ndim: int, rule: Any) -> None:
    logger.warning(
        "Adafactor: parameter %s has rank %d <= 2 and no BATCH dimension, so its factor rule %s is "
        "ignored and the size heuristic decides its factoring (as in T5X).",
        path,
        ndim,
        rule,
    )


class _Plan(NamedTuple):
    """How one parameter is updated: dims of its RMS, its factored dims ``(d1, d0)`` or None, parameter scaling."""

    averaging: tuple[int, ...]
    factored: tuple[tuple[int, ...], tuple[int, ...]] | None
    scale_by_param: bool


class Adafactor(OptimizerDef):
    """T5X's legacy Adafactor (``t5x.adafactor.Adafactor``): same arguments, state, numbers and checkpoints.

    Args:
        learning_rate: the step size (or pass ``learning_rate=`` to ``apply_gradient``).
        factored: use factored second-moment statistics where the rules allow.
        multiply_by_parameter_scale: scale updates by the parameter's RMS (a bool,
            or an :class:`HParamMap` per parameter path).
        beta1: momentum (``None``: no ``m`` slot).
        decay_rate: the exponent of the second-moment decay ``1 - (step + 1) ** -decay_rate``.
        step_offset: subtracted from the step in that decay.
        clipping_threshold: RMS threshold of update clipping (``None``: off).
        weight_decay_rate: decoupled weight decay (``None``: off).
        min_dim_size_to_factor: the heuristic factors a matrix only when its
            second largest dimension is at least this.
        epsilon1: added to squared gradients.
        epsilon2: lower bound of the parameter scale.
        dtype_momentum: dtype of ``m``.
        factor_map: :class:`HParamMap` from path to a factor rule.
        logical_factor_rules: logical axis name → :class:`FactorDim` (or its
            name), turned into ``factor_map`` by :meth:`set_param_axes`.
        weight_decay_rate_lr_exponent: if set (and nonzero), the weight decay is
            ``(weight_decay_rate or 1) * learning_rate ** exponent``.
        global_norm_clip_threshold: if set (and nonzero), clip the gradients' global norm first.
        max_parameter_scale: upper bound of the parameter scale.
        skip_nan_updates: keep the old parameter and state wherever the new one is NaN.

    Two definitions are equal when their hyper params and ``dtype_momentum`` are.
    ``apply_gradient`` runs as one compiled program per parameter structure; a
    new ``learning_rate`` value does not recompile.

    Example:
        >>> import jax.numpy as jnp
        >>> opt = Adafactor(learning_rate=0.1, min_dim_size_to_factor=0).create({"x": jnp.ones((3, 2))})
        >>> opt = opt.apply_gradient({"x": jnp.ones((3, 2))})
        >>> opt.target["x"][0], Adafactor(0.1) == Adafactor(0.1)
        (Array([0.9, 0.9], dtype=float32), True)
    """

    def __init__(
        self,
        learning_rate: float | None = None,
        factored: bool = True,
        multiply_by_parameter_scale: bool | HParamMap = True,
        beta1: float | None = None,
        decay_rate: float = 0.8,
        step_offset: int = 0,
        clipping_threshold: float | None = 1.0,
        weight_decay_rate: float | None = None,
        min_dim_size_to_factor: int = 128,
        epsilon1: float = 1e-30,
        epsilon2: float = 1e-3,
        dtype_momentum: Dtype = jnp.float32,
        factor_map: HParamMap | None = None,
        logical_factor_rules: Mapping[str, FactorDim] | None = None,
        weight_decay_rate_lr_exponent: float | None = None,
        global_norm_clip_threshold: float | None = None,
        max_parameter_scale: float | None = None,
        skip_nan_updates: bool | None = False,
    ):
        if not factored and factor_map is not None:
            raise ValueError("Adafactor: factored=False, but factorization rules (factor_map) were given.")
        if not isinstance(multiply_by_parameter_scale, (bool, HParamMap)):
            raise TypeError(
                "`multiply_by_parameter_scale` must be a bool or an `HParamMap`, got "
                f"{type(multiply_by_parameter_scale)}."
            )
        if not isinstance(factor_map, (type(None), HParamMap)):
            raise TypeError(f"`factor_map` must be None or an `HParamMap`, got {type(factor_map)}.")
        super().__init__(
            _AdafactorHyperParams(
                learning_rate,
                factored,
                multiply_by_parameter_scale,
                beta1,
                decay_rate,
                step_offset,
                clipping_threshold,
                weight_decay_rate,
                min_dim_size_to_factor,
                epsilon1,
                epsilon2,
                factor_map,
                logical_factor_rules,
                weight_decay_rate_lr_exponent,
                global_norm_clip_threshold,
                max_parameter_scale,
                skip_nan_updates,
            )
        )
        self.dtype_momentum = jax.dtypes.canonicalize_dtype(dtype_momentum)
        self._warned: set[str] = set()
        self._plans: tuple[Any, ...] | None = None

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, Adafactor):
            return False
        return self.hyper_params == other.hyper_params and self.dtype_momentum == other.dtype_momentum

    def __hash__(self) -> int:
        # T5X's: hyper params may hold unhashable values (a dict factor_map) and change in place.
        return id(self)

    # -- factoring -----------------------------------------------------------------------

    @staticmethod
    def _decay_rate_pow(i: Any, exponent: float = 0.8) -> Any:
        """The second-moment decay at step ``i``: ``1 - (i + 1) ** -exponent``.

        Example:
            >>> float(Adafactor._decay_rate_pow(0)), round(float(Adafactor._decay_rate_pow(1)), 6)
            (0.0, 0.425651)
        """
        t = jnp.array(i, jnp.float32) + 1.0
        return 1.0 - t ** (-exponent)

    @staticmethod
    def _parse_rule(
        rule: FactorRule | None, shape: Sequence[int], path: str, fallback_to_heuristics: bool = True
    ) -> tuple[tuple[int, ...], Any]:
        """``(averaging_dims, factored_dims)`` of a factor rule, as T5X parses it.

        ``factored_dims`` is ``(row_dims, column_dims)``, ``None`` (unfactored) or
        :data:`HEURISTIC_RULE` (decide by size). ``rule=None`` is unfactored; a
        rule for a parameter of rank <= 2 without a ``BATCH`` dimension is
        ignored for the heuristic (logged as a warning) when
        ``fallback_to_heuristics``. Raises ``ValueError`` for ``HEURISTIC_RULE``
        on a parameter of rank above 2 and for a rule of the wrong length.

        Example:
            >>> B, R, C = FactorDim.BATCH, FactorDim.ROW, FactorDim.COLUMN
            >>> Adafactor._parse_rule((B, R, C), (2, 8, 16), "wi")
            ((1, 2), ((1,), (2,)))
            >>> Adafactor._parse_rule(None, (8, 16), "w")
            ((0, 1), None)
        """
        averaging, factored, fell_back = _read_rule(rule, shape, path, fallback_to_heuristics)
        if fell_back:
            _log_fallback(path, len(shape), rule)
        return averaging, factored

    def _factored_dims(self, shape: Sequence[int]) -> tuple[tuple[int], tuple[int]] | None:
        """The size heuristic: ``((d1,), (d0,))``, the second largest and largest dims, or None.

        None when not ``factored``, for rank < 2, or when the second largest dimension
        is below ``min_dim_size_to_factor``.

        Example:
            >>> Adafactor(min_dim_size_to_factor=8)._factored_dims((24, 16))
            ((1,), (0,))
            >>> Adafactor()._factored_dims((24, 16)) is None
            True
        """
        if not self.hyper_params.factored or len(shape) < 2:
            return None
        order = np.argsort(shape)
        if shape[order[-2]] < self.hyper_params.min_dim_size_to_factor:
            return None
        return (int(order[-2]),), (int(order[-1]),)

    def _factor_rule(self, path: str) -> Any:
        hp = self.hyper_params
        if not hp.factored:
            return None
        return hp.factor_map[path] if hp.factor_map else HEURISTIC_RULE

    def _factoring(self, shape: Sequence[int], path: str) -> tuple[tuple[int, ...], Any]:
        """``(averaging_dims, (d1, d0) or None)``: the rule, else the heuristic; an ignored rule is logged once per path."""
        rule = self._factor_rule(path)
        averaging, factored, fell_back = _read_rule(rule, shape, path, True)
        if fell_back and path not in self._warned:
            self._warned.add(path)
            _log_fallback(path, len(shape), rule)
        if factored is HEURISTIC_RULE:
            factored = self._factored_dims(shape)
        return tuple(int(d) for d in averaging), factored

    def _plan(self, shape: Sequence[int], path: str, multiply_by_parameter_scale: Any) -> _Plan:
        averaging, factored = self._factoring(shape, path)
        scale = multiply_by_parameter_scale
        if isinstance(scale, HParamMap):
            scale = scale[path]
        return _Plan(averaging, factored, bool(scale))

    # -- state ---------------------------------------------------------------------------

    def init_param_state(self, param: Any, path: str) -> _AdafactorParamState:
        """The initial state of the parameter at ``path`` (the name its factor rule is looked up by).

        Example:
            >>> import jax.numpy as jnp
            >>> s = Adafactor(min_dim_size_to_factor=8).init_param_state(jnp.ones((24, 16)), "dense/kernel")
            >>> s.v_row.shape, s.v_col.shape, s.v.shape
            ((16,), (24,), (1,))
        """
        shape = tuple(param.shape)
        slots = {k: jnp.zeros((1,)) for k in _SLOTS}
        factored = self._factoring(shape, path)[1]
        if factored is None:
            slots["v"] = jnp.zeros(shape, dtype=jnp.float32)
        else:
            d1, d0 = factored
            slots["v_row"] = jnp.zeros(tuple(np.delete(shape, d0)), dtype=jnp.float32)
            slots["v_col"] = jnp.zeros(tuple(np.delete(shape, d1)), dtype=jnp.float32)
        if self.hyper_params.beta1 is not None:
            slots["m"] = jnp.zeros(shape, dtype=self.dtype_momentum)
        return _AdafactorParamState(**slots)

    def init_state(self, params: Any) -> OptimizerState:
        """Per-parameter states shaped like ``params``, at step 0.

        Example:
            >>> import jax.numpy as jnp
            >>> state = Adafactor().init_state({"dense": {"bias": jnp.ones(4)}})
            >>> int(state.step), state.param_states["dense"]["bias"].v.shape
            (0, (4,))
        """
        leaves, treedef = jax.tree.flatten(params)
        states = [self.init_param_state(p, n) for p, n in zip(leaves, leaf_names(params), strict=True)]
        return OptimizerState(jnp.asarray(0, dtype=jnp.int32), jax.tree.unflatten(treedef, states))

    # -- update --------------------------------------------------------------------------

    def apply_param_gradient(
        self, step: Any, hyper_params: Any, param: Any, state: _AdafactorParamState, grad: Any, path: str
    ) -> tuple[Any, _AdafactorParamState]:
        """One parameter's Adafactor step: ``(new_param, new_state)``.

        Example:
            >>> import jax.numpy as jnp
            >>> opt_def = Adafactor(learning_rate=0.1, beta1=0.0, min_dim_size_to_factor=32)
            >>> state = _AdafactorParamState(jnp.zeros(1), jnp.zeros(1), jnp.full((3, 2), 0.5), jnp.zeros((3, 2)))
            >>> p, s = opt_def.apply_param_gradient(1, opt_def.hyper_params, jnp.ones((3, 2)), state, jnp.ones((3, 2)), "x")
            >>> round(float(s.v[0, 0]), 5), round(float(p[0, 0]), 5)
            (0.78717, 0.9)
        """
        _check_learning_rate(hyper_params)
        plan = self._plan(tuple(param.shape), path, hyper_params.multiply_by_parameter_scale)
        values = {name: getattr(hyper_params, name) for name in ("learning_rate", *_NUMERIC)}
        flags = _flags(values, hyper_params.skip_nan_updates)
        return _param_update(plan, values, flags, self.dtype_momentum, step, param, state, grad)

    def apply_gradient(self, hyper_params: Any, params: Any, state: OptimizerState, grads: Any) -> Any:
        """One Adafactor step over all parameters: ``(new_params, new_state)``, as one compiled program.

        Example:
            >>> import jax.numpy as jnp
            >>> opt_def = Adafactor(learning_rate=0.1, min_dim_size_to_factor=0)
            >>> params = {"x": jnp.ones((3, 2))}
            >>> new_params, new_state = opt_def.apply_gradient(
            ...     opt_def.hyper_params, params, opt_def.init_state(params), {"x": jnp.ones((3, 2))})
            >>> new_params["x"][0], int(new_state.step)
            (Array([0.9, 0.9], dtype=float32), 1)
        """
        leaves, treedef = jax.tree.flatten(params)
        names, plans = self._plans_for(treedef, leaves, params, hyper_params.multiply_by_parameter_scale)
        states = _leaves_like(treedef, names, state.param_states, _is_param_state)
        grad_leaves = _leaves_like(treedef, names, grads, None)
        if not leaves:
            return params, OptimizerState(state.step + 1, state.param_states)
        _check_learning_rate(hyper_params)
        if type(self).apply_param_gradient is not Adafactor.apply_param_gradient:
            # A subclass's own per-parameter rule runs as T5X runs it: one call per parameter.
            if _truthy(hyper_params.global_norm_clip_threshold):
                grad_leaves = _clip_global_norm(hyper_params.global_norm_clip_threshold, grad_leaves)
            out = [
                self.apply_param_gradient(state.step, hyper_params, p, s, g, n)
                for p, s, g, n in zip(leaves, states, grad_leaves, names, strict=True)
            ]
            new_leaves, new_states, new_step = [p for p, _ in out], [s for _, s in out], state.step + 1
        else:
            static: dict[str, Any] = {}
            dynamic: dict[str, Any] = {"learning_rate": hyper_params.learning_rate}
            for name in _NUMERIC:
                value = getattr(hyper_params, name)
                (dynamic if _is_array(value) else static)[name] = value
            flags = _flags({**static, **dynamic}, hyper_params.skip_nan_updates)
            constants = tuple(sorted((k, type(v).__name__, v) for k, v in static.items()))
            config = _Config(plans, constants, flags, self.dtype_momentum)
            new_leaves, new_states, new_step = _compiled_update(
                config, dynamic, state.step, leaves, states, grad_leaves
            )
        return jax.tree.unflatten(treedef, new_leaves), OptimizerState(
            new_step, jax.tree.unflatten(treedef, new_states)
        )

    def _plans_for(
        self, treedef: Any, leaves: list[Any], params: Any, multiply_by_parameter_scale: Any
    ) -> tuple[list[str], tuple[_Plan, ...]]:
        """Names and plans of the params, cached while the structure and the hyper params stay the same."""
        shapes = tuple(tuple(np.shape(p)) for p in leaves)
        cached = self._plans
        if (
            cached is not None
            and cached[0] is self.hyper_params
            and cached[1] is multiply_by_parameter_scale
            and cached[2] == treedef
            and cached[3] == shapes
        ):
            return cached[4], cached[5]
        names = leaf_names(params)
        plans = tuple(
            self._plan(shape, name, multiply_by_parameter_scale)
            for shape, name in zip(shapes, names, strict=True)
        )
        self._plans = (self.hyper_params, multiply_by_parameter_scale, treedef, shapes, names, plans)
        return names, plans

    # -- logical axes --------------------------------------------------------------------

    def set_param_axes(self, param_logical_axes: Any) -> None:
        """Sets ``factor_map`` from the params' logical axes through ``logical_factor_rules``, as T5X.

        ``factor_map`` becomes a plain dict ``{"a/b/kernel": rule}``. Each axis
        name must have a rule (``KeyError`` otherwise); a rule without both a
        ``ROW`` and a ``COLUMN`` dimension keeps only its ``BATCH`` dimensions
        (the others become ``NONE``); ``ROW`` and ``COLUMN`` together with a
        ``NONE`` dimension raise ``ValueError`` ("Incomplete adafactor spec"). A
        parameter whose axes are ``None`` gets the rule ``None`` (unfactored).
        Does nothing when ``logical_factor_rules`` is ``None``.

        Example:
            >>> from jax.sharding import PartitionSpec as P
            >>> opt_def = Adafactor(0.1, logical_factor_rules=standard_logical_factor_rules())
            >>> opt_def.set_param_axes({"mlp": {"wi": P("layers", "embed", "mlp")}, "scale": P("embed")})
            >>> opt_def.hyper_params.factor_map
            {'mlp/wi': (<FactorDim.BATCH: 1>, <FactorDim.ROW: 2>, <FactorDim.COLUMN: 3>), 'scale': (<FactorDim.NONE: None>,)}
        """
        rules = self.hyper_params.logical_factor_rules
        if rules is None:
            return
        factor_map = {
            name: None if axes is None else _axes_to_rule(rules, tuple(axes), name)
            for name, axes in spec_leaves_with_names(param_logical_axes)
        }
        self.hyper_params = self.hyper_params.replace(factor_map=factor_map)

    def derive_logical_axes(
        self,
        optimizer_state: Optimizer,
        param_logical_axes: Any,
        *,
        shard_state_over: str | None = None,
        mesh: Any = None,
        logical_axis_rules: Any = None,
    ) -> Optimizer:
        """The optimizer's logical axes from the params': an ``Optimizer`` of specs.

        As T5X: ``step`` ``None``, the target the params' axes, ``v`` the param's
        axes unless it is a ``(1,)`` placeholder, ``m`` the param's axes when
        ``beta1`` is set (nonzero). Unlike T5X, which replicates them, ``v_row``
        and ``v_col`` get the param's axes without the ones they average over.
        Params whose axes are ``None`` get ``None`` everywhere.
        ``shard_state_over``, ``mesh`` and ``logical_axis_rules`` apply ZeRO-1 to
        ``v_row``/``v_col``/``v``/``m``, as in ``OptaxWrapper.derive_logical_axes``.

        Example:
            >>> import jax.numpy as jnp
            >>> from jax.sharding import PartitionSpec as P
            >>> opt_def = Adafactor(0.1, min_dim_size_to_factor=2)
            >>> opt = opt_def.create({"w": jnp.ones((4, 8))})
            >>> axes = opt_def.derive_logical_axes(opt, {"w": P("embed", "mlp")}).state.param_states["w"]
            >>> axes.v_row == P("embed"), axes.v_col == P("mlp"), axes.v, axes.m
            (True, True, None, None)
        """
        target = optimizer_state.target
        leaves, treedef = jax.tree.flatten(target)
        names = leaf_names(target)
        by_name = dict(spec_leaves_with_names(param_logical_axes))
        missing = [name for name in names if name not in by_name]
        if missing:
            raise missing_axes_error(missing)
        states = _leaves_like(treedef, names, optimizer_state.state.param_states, _is_param_state)
        out = [
            self._state_axes(tuple(np.shape(p)), name, by_name[name], s)
            for p, name, s in zip(leaves, names, states, strict=True)
        ]
        axes = optimizer_state.replace(
            state=OptimizerState(None, jax.tree.unflatten(treedef, out)), target=param_logical_axes
        )
        return with_zero_sharding(axes, optimizer_state, shard_state_over, mesh, logical_axis_rules)

    def _state_axes(self, shape: tuple[int, ...], path: str, axes: Any, state: Any) -> _AdafactorParamState:
        if axes is None:
            return _AdafactorParamState(None, None, None, None)
        entries = (*axes, *([None] * (len(shape) - len(axes))))

        def without(dims: tuple[int, ...]) -> PartitionSpec:
            return PartitionSpec(*(e for i, e in enumerate(entries) if i not in dims))

        factored = self._factoring(shape, path)[1]
        v_row = v_col = None
        if factored is not None:
            d1, d0 = factored
            v_row, v_col = without(d0), without(d1)
        v = axes if tuple(np.shape(state.v)) != (1,) else None
        m = axes if self.hyper_params.beta1 else None
        return _AdafactorParamState(v_row, v_col, v, m)


def _axes_to_rule(rules: Mapping[str, Any], axes: tuple[Any, ...], path: str) -> tuple[Any, ...]:
    """A parameter's factor rule from its logical axis names, as T5X's ``set_param_axes`` builds it."""
    missing = [axis for axis in axes if axis not in rules]
    if missing:
        raise KeyError(
            f"logical_factor_rules has no rule for axis {missing[0]!r} of parameter '{path}' (axes {axes})."
        )
    dims = tuple(factor_name_to_factordim(rules[axis]) for axis in axes)
    has_row, has_column = FactorDim.ROW in dims, FactorDim.COLUMN in dims
    if has_row and has_column and FactorDim.NONE in dims:
        raise ValueError(
            f"Incomplete adafactor spec {dims} for {axes} (parameter '{path}'): ROW and COLUMN axes "
            "together with a NONE axis."
        )
    if not (has_row and has_column):
        dims = tuple(FactorDim.NONE if d in (FactorDim.ROW, FactorDim.COLUMN) else d for d in dims)
    return dims


# -- the compiled step ---------------------------------------------------------------------


class _Flags(NamedTuple):
    """Truth tests T5X makes on hyper params (``if threshold:``), taken before compiling."""

    clip_global_norm: bool
    lr_exponent: bool
    skip_nan_updates: bool


class _Config(NamedTuple):
    """The static part of a step: per-parameter plans, constant hyper params, flags, momentum dtype."""

    plans: tuple[_Plan, ...]
    constants: tuple[tuple[str, str, Any], ...]  # (name, type name, value): 1 and 1.0 compile apart
    flags: _Flags
    dtype_momentum: Any


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) or not _hashable(x)


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _truthy(x: Any) -> bool:
    """``bool(x)``, with a traced value counting as set."""
    if isinstance(x, jax.core.Tracer):
        return True
    return bool(x)


def _flags(values: Mapping[str, Any], skip_nan_updates: Any) -> _Flags:
    return _Flags(
        _truthy(values["global_norm_clip_threshold"]),
        _truthy(values["weight_decay_rate_lr_exponent"]),
        bool(skip_nan_updates),
    )


def _check_learning_rate(hyper_params: Any) -> None:
    if hyper_params.learning_rate is None:
        # T5X asserts; the same exception type, with the way out.
        raise AssertionError(
            "no learning rate provided: pass Adafactor(learning_rate=...) or "
            "optimizer.apply_gradient(grads, learning_rate=...)."
        )


def _is_param_state(x: Any) -> bool:
    return isinstance(x, _AdafactorParamState)


def _leaves_like(treedef: Any, names: list[str], tree: Any, is_leaf: Any) -> list[Any]:
    """``tree``'s entries at the params' positions; by name when its containers differ (dict vs FrozenDict)."""
    try:
        return treedef.flatten_up_to(tree)
    except (ValueError, TypeError):
        pass
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    by_name = dict(
        zip(leaf_names(jax.tree.map(lambda _: 0, tree, is_leaf=is_leaf)), (x for _, x in flat), strict=True)
    )
    missing = [n for n in names if n not in by_name]
    if missing:
        unexpected = sorted(set(by_name) - set(names))
        raise TreeMismatchError.between(
            "the tree does not match the params", missing=missing, unexpected=unexpected
        )
    return [by_name[n] for n in names]


def _clip_global_norm(threshold: Any, grads: list[Any]) -> list[Any]:
    norm = jnp.sqrt(jnp.sum(jnp.array([jnp.sum(jnp.square(g)) for g in grads])))
    scale = threshold * jnp.minimum(1.0 / threshold, 1.0 / norm)
    return [g * scale for g in grads]


@functools.partial(jax.jit, static_argnums=0)
def _compiled_update(
    config: _Config,
    dynamic: dict[str, Any],
    step: Any,
    params: list[Any],
    states: list[Any],
    grads: list[Any],
) -> tuple[list[Any], list[Any], Any]:
    """All parameters' steps in one program: pure in everything but ``config``."""
    values = {**{name: value for name, _, value in config.constants}, **dynamic}
    if config.flags.clip_global_norm:
        grads = _clip_global_norm(values["global_norm_clip_threshold"], grads)
    new_params, new_states = [], []
    for plan, param, state, grad in zip(config.plans, params, states, grads, strict=True):
        p, s = _param_update(plan, values, config.flags, config.dtype_momentum, step, param, state, grad)
        new_params.append(p)
        new_states.append(s)
    return new_params, new_states, step + 1


def _param_update(
    plan: _Plan,
    hp: Mapping[str, Any],
    flags: _Flags,
    dtype_momentum: Any,
    step: Any,
    param: Any,
    state: _AdafactorParamState,
    grad: Any,
) -> tuple[Any, _AdafactorParamState]:
    """One parameter's step; ``hp`` maps hyper param names to constants or traced values."""
    learning_rate = hp["learning_rate"]
    weight_decay_rate = hp["weight_decay_rate"]
    if flags.lr_exponent:
        base = weight_decay_rate
        if isinstance(base, jax.Array):
            base = jnp.where(base != 0, base, 1.0)
        elif not base:
            base = 1.0
        weight_decay_rate = base * learning_rate ** hp["weight_decay_rate_lr_exponent"]

    grad = grad.astype(jnp.float32)
    new = {k: jnp.zeros((1,)) for k in _SLOTS}
    decay = Adafactor._decay_rate_pow(step - hp["step_offset"], exponent=hp["decay_rate"])
    mixing = 1.0 - decay

    update_scale = learning_rate
    if plan.scale_by_param:
        param_scale = jnp.sqrt(jnp.mean(param * param, axis=plan.averaging, keepdims=True))
        param_scale = jnp.maximum(param_scale, hp["epsilon2"])
        if hp["max_parameter_scale"] is not None:
            param_scale = jnp.minimum(param_scale, hp["max_parameter_scale"])
        update_scale = update_scale * param_scale

    grad_sqr = grad * grad + hp["epsilon1"]
    if plan.factored is None:
        new["v"] = decay * state.v + mixing * grad_sqr
        y = grad * new["v"] ** -0.5
    else:
        d1, d0 = plan.factored
        new["v_row"] = decay * state.v_row + mixing * jnp.mean(grad_sqr, axis=d0)
        new["v_col"] = decay * state.v_col + mixing * jnp.mean(grad_sqr, axis=d1)
        # d1's positions among v_row's axes, once the d0 axes are gone.
        d1_in_row = tuple(d - sum(1 for e in d0 if e < d) for d in d1)
        row_mean = jnp.mean(new["v_row"], axis=d1_in_row, keepdims=True)
        row_factor = (new["v_row"] / row_mean) ** -0.5
        col_factor = new["v_col"] ** -0.5
        y = grad * jnp.expand_dims(row_factor, axis=d0) * jnp.expand_dims(col_factor, axis=d1)

    if hp["clipping_threshold"] is not None:
        rms = jnp.sqrt(jnp.mean(y * y, axis=plan.averaging, keepdims=True))
        y = y / jnp.maximum(1.0, rms / hp["clipping_threshold"])

    subtrahend = update_scale * y
    beta1 = hp["beta1"]
    if beta1 is not None:
        m = beta1 * state.m + (1.0 - beta1) * subtrahend
        subtrahend = m
        new["m"] = m.astype(dtype_momentum)

    if weight_decay_rate is not None:
        new_param = (1.0 - weight_decay_rate) * param - subtrahend
    else:
        new_param = param - subtrahend

    if flags.skip_nan_updates:
        for k in _SLOTS:
            new[k] = jnp.where(jnp.isnan(new[k]), getattr(state, k), new[k])
        new_param = jnp.where(jnp.isnan(new_param), param, new_param)
    return new_param.astype(param.dtype), _AdafactorParamState(**new)
