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

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from treeopt import leaf_names
from treeopt.internal import spec_leaves_with_names
from treeopt.t5x._adafactor_axes import factor_map_of, state_axes
from treeopt.t5x._adafactor_rules import (
    HEURISTIC_RULE,
    FactorDim,
    FactorRule,
    HeuristicRule,
    HParamMap,
    Plan,
    factor_name_to_factordim,
    log_fallback,
    read_rule,
    standard_logical_factor_rules,
)
from treeopt.t5x._adafactor_step import (
    NUMERIC,
    SLOTS,
    AdafactorParamState,
    Config,
    check_learning_rate,
    clip_global_norm,
    compiled_update,
    decay_rate_pow,
    flags_of,
    is_array,
    is_param_state,
    leaves_like,
    param_update,
    truthy,
)
from treeopt.t5x._base import check_grads
from treeopt.t5x._partition_rules import check_logical_axes, missing_axes_error
from treeopt.t5x._zero import zero_sharded
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

Dtype = Any
"""A dtype, as T5X's alias (``dtype_momentum``)."""


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


_AdafactorParamState = AdafactorParamState  # T5X's name for one parameter's state


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

    _decay_rate_pow = staticmethod(decay_rate_pow)

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
        averaging, factored, fell_back = read_rule(rule, shape, path, fallback_to_heuristics)
        if fell_back:
            log_fallback(path, len(shape), rule)
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
        averaging, factored, fell_back = read_rule(rule, shape, path, True)
        if fell_back and path not in self._warned:
            self._warned.add(path)
            log_fallback(path, len(shape), rule)
        if factored is HEURISTIC_RULE:
            factored = self._factored_dims(shape)
        return tuple(int(d) for d in averaging), factored

    def _plan(self, shape: Sequence[int], path: str, multiply_by_parameter_scale: Any) -> Plan:
        averaging, factored = self._factoring(shape, path)
        scale = multiply_by_parameter_scale
        if isinstance(scale, HParamMap):
            scale = scale[path]
        return Plan(averaging, factored, bool(scale))

    # -- state ---------------------------------------------------------------------------

    def init_param_state(self, param: Any, path: str) -> AdafactorParamState:
        """The initial state of the parameter at ``path`` (the name its factor rule is looked up by).

        Example:
            >>> import jax.numpy as jnp
            >>> s = Adafactor(min_dim_size_to_factor=8).init_param_state(jnp.ones((24, 16)), "dense/kernel")
            >>> s.v_row.shape, s.v_col.shape, s.v.shape
            ((16,), (24,), (1,))
        """
        shape = tuple(param.shape)
        slots = {k: jnp.zeros((1,)) for k in SLOTS}
        factored = self._factoring(shape, path)[1]
        if factored is None:
            slots["v"] = jnp.zeros(shape, dtype=jnp.float32)
        else:
            d1, d0 = factored
            slots["v_row"] = jnp.zeros(tuple(np.delete(shape, d0)), dtype=jnp.float32)
            slots["v_col"] = jnp.zeros(tuple(np.delete(shape, d1)), dtype=jnp.float32)
        if self.hyper_params.beta1 is not None:
            slots["m"] = jnp.zeros(shape, dtype=self.dtype_momentum)
        return AdafactorParamState(**slots)

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
        self, step: Any, hyper_params: Any, param: Any, state: AdafactorParamState, grad: Any, path: str
    ) -> tuple[Any, AdafactorParamState]:
        """One parameter's Adafactor step: ``(new_param, new_state)``.

        Example:
            >>> import jax.numpy as jnp
            >>> opt_def = Adafactor(learning_rate=0.1, beta1=0.0, min_dim_size_to_factor=32)
            >>> state = _AdafactorParamState(jnp.zeros(1), jnp.zeros(1), jnp.full((3, 2), 0.5), jnp.zeros((3, 2)))
            >>> p, s = opt_def.apply_param_gradient(1, opt_def.hyper_params, jnp.ones((3, 2)), state, jnp.ones((3, 2)), "x")
            >>> round(float(s.v[0, 0]), 5), round(float(p[0, 0]), 5)
            (0.78717, 0.9)
        """
        check_learning_rate(hyper_params)
        plan = self._plan(tuple(param.shape), path, hyper_params.multiply_by_parameter_scale)
        values = {name: getattr(hyper_params, name) for name in ("learning_rate", *NUMERIC)}
        flags = flags_of(values, hyper_params.skip_nan_updates)
        return param_update(plan, values, flags, self.dtype_momentum, step, param, state, grad)

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
        check_grads(params, grads)
        leaves, treedef = jax.tree.flatten(params)
        names, plans = self._plans_for(treedef, leaves, params, hyper_params.multiply_by_parameter_scale)
        states = leaves_like(treedef, names, state.param_states, is_param_state)
        grad_leaves = leaves_like(treedef, names, grads, None)
        if not leaves:
            return params, OptimizerState(state.step + 1, state.param_states)
        check_learning_rate(hyper_params)
        if type(self).apply_param_gradient is not Adafactor.apply_param_gradient:
            # A subclass's own per-parameter rule runs as T5X runs it: one call per parameter.
            if truthy(hyper_params.global_norm_clip_threshold):
                grad_leaves = clip_global_norm(hyper_params.global_norm_clip_threshold, grad_leaves)
            out = [
                self.apply_param_gradient(state.step, hyper_params, p, s, g, n)
                for p, s, g, n in zip(leaves, states, grad_leaves, names, strict=True)
            ]
            new_leaves, new_states, new_step = [p for p, _ in out], [s for _, s in out], state.step + 1
        else:
            static: dict[str, Any] = {}
            dynamic: dict[str, Any] = {"learning_rate": hyper_params.learning_rate}
            for name in NUMERIC:
                value = getattr(hyper_params, name)
                (dynamic if is_array(value) else static)[name] = value
            flags = flags_of({**static, **dynamic}, hyper_params.skip_nan_updates)
            constants = tuple(sorted((k, type(v).__name__, v) for k, v in static.items()))
            config = Config(plans, constants, flags, self.dtype_momentum)
            new_leaves, new_states, new_step = compiled_update(
                config, dynamic, state.step, leaves, states, grad_leaves
            )
        return jax.tree.unflatten(treedef, new_leaves), OptimizerState(
            new_step, jax.tree.unflatten(treedef, new_states)
        )

    def _plans_for(
        self, treedef: Any, leaves: list[Any], params: Any, multiply_by_parameter_scale: Any
    ) -> tuple[list[str], tuple[Plan, ...]]:
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
        self.hyper_params = self.hyper_params.replace(factor_map=factor_map_of(rules, param_logical_axes))

    @zero_sharded
    def derive_logical_axes(self, optimizer_state: Optimizer, param_logical_axes: Any) -> Optimizer:
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
        check_logical_axes(target, param_logical_axes)
        leaves, treedef = jax.tree.flatten(target)
        names = leaf_names(target)
        by_name = dict(spec_leaves_with_names(param_logical_axes))
        missing = [name for name in names if name not in by_name]
        if missing:
            raise missing_axes_error(missing)
        states = leaves_like(treedef, names, optimizer_state.state.param_states, is_param_state)
        beta1 = self.hyper_params.beta1
        out = [
            state_axes(np.shape(p), by_name[name], s, self._factoring(np.shape(p), name)[1], beta1)
            for p, name, s in zip(leaves, names, states, strict=True)
        ]
        axes = optimizer_state.replace(
            state=OptimizerState(None, jax.tree.unflatten(treedef, out)), target=param_logical_axes
        )
        return axes
