"""T5X's legacy Adafactor ``OptimizerDef``: the optimizer T5 was trained with.

Written from its published behaviour: the same hyperparameters and defaults,
the same per-parameter state ``(v_row, v_col, v, m)`` with ``(1,)``
placeholders for the slots a parameter does not use, and the same
checkpoint layout (``state/param_states/<path>/{v_row,v_col,v,m}``), so T5
checkpoints restore into it. Unlike T5X, :meth:`Adafactor.derive_logical_axes`
shards the factored statistics: ``v_row``/``v_col`` get their parameter's
logical axes minus the reduced axes instead of being replicated.

Factoring: without a rule, a parameter of rank 2 is factored over its two
largest dimensions when the second largest is at least
``min_dim_size_to_factor``; rank above 2 needs an explicit rule (``factor_map``,
or ``logical_factor_rules`` with :meth:`Adafactor.set_param_axes`). A rule has
one :class:`FactorDim` per dimension: ``ROW`` dims are reduced in ``v_col``,
``COLUMN`` dims in ``v_row``, ``BATCH`` dims keep separate statistics (and are
excluded from the RMS of parameter scale and update clipping), ``NONE`` dims
are kept; a rule without both a ``ROW`` and a ``COLUMN`` dim leaves the
parameter unfactored.

Example:
    >>> import jax.numpy as jnp
    >>> from treeopt.t5x import Adafactor
    >>> opt = Adafactor(learning_rate=0.1, min_dim_size_to_factor=8).create({"w": jnp.ones((24, 16))})
    >>> state = opt.state.param_states["w"]
    >>> state.v_row.shape, state.v_col.shape, state.v.shape, state.m.shape
    ((16,), (24,), (1,), (1,))
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from flax.core import FrozenDict
from jax.sharding import PartitionSpec

from treeopt._paths import leaf_names
from treeopt.t5x import _state
from treeopt.t5x.optimizers import Optimizer, OptimizerDef, OptimizerState

__all__ = [
    "Adafactor",
    "AdafactorHyperParams",
    "AdafactorParamState",
    "FactorDim",
    "HParamMap",
    "factor_name_to_factordim",
    "standard_logical_factor_rules",
]


class FactorDim(enum.Enum):
    """How Adafactor treats one dimension of a parameter in its factored statistics.

    Example:
        >>> FactorDim.ROW, FactorDim.NONE.value
        (<FactorDim.ROW: 2>, None)
    """

    NONE = None
    BATCH = 1
    ROW = 2
    COLUMN = 3


_FACTOR_NAMES = {
    "none": FactorDim.NONE,
    "unfactored": FactorDim.NONE,
    "batch": FactorDim.BATCH,
    "row": FactorDim.ROW,
    "column": FactorDim.COLUMN,
}


def factor_name_to_factordim(name: Any) -> FactorDim:
    """A :class:`FactorDim` from itself, ``None``, or its name (``"row"``, ``"column"``, ``"batch"``, ``"none"``).

    Example:
        >>> factor_name_to_factordim("row"), factor_name_to_factordim(None)
        (<FactorDim.ROW: 2>, <FactorDim.NONE: None>)
    """
    if isinstance(name, FactorDim):
        return name
    if name is None:
        return FactorDim.NONE
    if isinstance(name, str) and name.lower() in _FACTOR_NAMES:
        return _FACTOR_NAMES[name.lower()]
    raise ValueError(f"Unknown factor dimension {name!r}; use a FactorDim or one of {sorted(_FACTOR_NAMES)}.")


class HParamMap:
    """Parameter path → hyperparameter value by regular expressions: the first rule that matches wins.

    Paths join the keys to a parameter with ``"/"`` (``"encoder/layers_0/mlp/wi/kernel"``);
    rules are searched in them (``re.search``). A path that no rule matches is a ``KeyError``.

    Example:
        >>> hp = HParamMap([("bias$", False), (".*", True)])
        >>> hp["dense/bias"], hp["dense/kernel"]
        (False, True)
        >>> HParamMap([("kernel", 1)])["dense/bias"]
        Traceback (most recent call last):
        ...
        KeyError: "No HParamMap rule matches parameter 'dense/bias' (rules: ['kernel'])"
    """

    def __init__(self, rules: Sequence[tuple[str, Any]] | Mapping[str, Any]):
        items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
        self._rules = tuple((str(pattern), _freeze(value)) for pattern, value in items)
        self._compiled = [re.compile(pattern) for pattern, _ in self._rules]

    def __getitem__(self, path: str) -> Any:
        for regex, (_, value) in zip(self._compiled, self._rules, strict=True):
            if regex.search(path):
                return value
        raise KeyError(f"No HParamMap rule matches parameter '{path}' (rules: {[p for p, _ in self._rules]})")

    def __call__(self, params: Any) -> Any:
        """A tree shaped like ``params`` with each parameter's value."""
        values = [self[name] for name in leaf_names(params)]
        return jax.tree.unflatten(_state.structure(params), values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HParamMap) and self._rules == other._rules

    def __hash__(self) -> int:
        return hash(self._rules)

    def __repr__(self) -> str:
        return f"HParamMap({list(self._rules)!r})"


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(value)
    return value


def standard_logical_factor_rules() -> FrozenDict:
    """Factoring of T5X's standard logical axis names (for ``logical_factor_rules``).

    Example:
        >>> rules = standard_logical_factor_rules()
        >>> rules["embed"], rules["mlp"], rules["layers"]
        (<FactorDim.ROW: 2>, <FactorDim.COLUMN: 3>, <FactorDim.BATCH: 1>)
    """
    return FrozenDict(
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


@struct.dataclass
class AdafactorHyperParams:
    """Adafactor's hyper params; ``apply_gradient(grads, learning_rate=...)`` replaces fields per step.

    Fields that decide the state's structure (factoring, rules) are static.

    Example:
        >>> hp = Adafactor(learning_rate=0.1).hyper_params
        >>> hp.decay_rate, hp.replace(learning_rate=0.2).learning_rate
        (0.8, 0.2)
    """

    learning_rate: Any
    factored: bool = struct.field(pytree_node=False)
    multiply_by_parameter_scale: bool | HParamMap = struct.field(pytree_node=False)
    beta1: Any
    decay_rate: Any
    step_offset: Any
    clipping_threshold: Any
    weight_decay_rate: Any
    min_dim_size_to_factor: int = struct.field(pytree_node=False)
    epsilon1: Any
    epsilon2: Any
    factor_map: HParamMap | None = struct.field(pytree_node=False, default=None)
    logical_factor_rules: Any = struct.field(pytree_node=False, default=None)
    weight_decay_rate_lr_exponent: Any = None
    global_norm_clip_threshold: Any = None
    max_parameter_scale: Any = None
    skip_nan_updates: bool = struct.field(pytree_node=False, default=False)


@struct.dataclass
class AdafactorParamState:
    """One parameter's Adafactor state; unused slots hold ``zeros((1,))``.

    Example:
        >>> import jax.numpy as jnp
        >>> s = AdafactorParamState(jnp.zeros(3), jnp.zeros(2), jnp.zeros(1), jnp.zeros(1))
        >>> sorted(__import__("flax").serialization.to_state_dict(s))
        ['m', 'v', 'v_col', 'v_row']
    """

    v_row: Any
    v_col: Any
    v: Any
    m: Any


_HEURISTIC = "heuristic"


class _Factoring:
    """How one parameter is factored: reduced dims of ``v_row`` (d0) and ``v_col`` (d1), RMS dims."""

    __slots__ = ("averaging", "d0", "d1")

    def __init__(
        self, d1: tuple[int, ...] | None, d0: tuple[int, ...] | None, averaging: tuple[int, ...] | None
    ):
        self.d1, self.d0, self.averaging = d1, d0, averaging

    @property
    def factored(self) -> bool:
        return self.d0 is not None


class Adafactor(OptimizerDef):
    """T5X's legacy Adafactor (``t5x.adafactor.Adafactor``), numerically identical.

    Args:
        learning_rate: the step size (or pass ``learning_rate=`` to ``apply_gradient``).
        factored: use factored second-moment statistics where possible.
        multiply_by_parameter_scale: scale updates by the parameter's RMS (a bool,
            or an :class:`HParamMap` per parameter path).
        beta1: momentum (``None``: no ``m`` slot).
        decay_rate: the exponent of the second-moment decay ``1 - (step + 1) ** -decay_rate``.
        step_offset: subtracted from the step in that decay.
        clipping_threshold: RMS threshold of update clipping (``None``: off).
        weight_decay_rate: decoupled weight decay (``None``: off).
        min_dim_size_to_factor: the heuristic factors a matrix only when its second
            largest dimension is at least this.
        epsilon1: added to squared gradients.
        epsilon2: lower bound of the parameter scale.
        dtype_momentum: dtype of ``m``.
        factor_map: :class:`HParamMap` from path to a rule (one :class:`FactorDim` per dim).
        logical_factor_rules: logical axis name → :class:`FactorDim`, turned into a
            ``factor_map`` by :meth:`set_param_axes`.
        weight_decay_rate_lr_exponent: weight decay is ``(weight_decay_rate or 1) * lr ** exponent``.
        global_norm_clip_threshold: clip the gradients' global norm first.
        max_parameter_scale: upper bound of the parameter scale.
        skip_nan_updates: keep the old parameter and state where the update is NaN.

    Example:
        >>> import jax.numpy as jnp
        >>> opt = Adafactor(learning_rate=0.1, min_dim_size_to_factor=0).create({"x": jnp.ones((3, 2))})
        >>> opt = opt.apply_gradient({"x": jnp.ones((3, 2))})
        >>> opt.target["x"][0]
        Array([0.9, 0.9], dtype=float32)
    """

    per_param_state = True

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
        dtype_momentum: Any = jnp.float32,
        factor_map: HParamMap | None = None,
        logical_factor_rules: Mapping[str, Any] | None = None,
        weight_decay_rate_lr_exponent: float | None = None,
        global_norm_clip_threshold: float | None = None,
        max_parameter_scale: float | None = None,
        skip_nan_updates: bool = False,
    ):
        if not factored and factor_map is not None:
            raise ValueError("Adafactor: factored=False, but a factor_map was given.")
        if not isinstance(multiply_by_parameter_scale, (bool, HParamMap)):
            raise TypeError(
                "multiply_by_parameter_scale must be a bool or an HParamMap, got "
                f"{type(multiply_by_parameter_scale).__name__}."
            )
        if not isinstance(factor_map, (type(None), HParamMap)):
            raise TypeError(f"factor_map must be None or an HParamMap, got {type(factor_map).__name__}.")
        if logical_factor_rules is not None:
            logical_factor_rules = FrozenDict(
                {k: factor_name_to_factordim(v) for k, v in dict(logical_factor_rules).items()}
            )
        self.dtype_momentum = jax.dtypes.canonicalize_dtype(dtype_momentum)
        super().__init__(
            AdafactorHyperParams(
                learning_rate=learning_rate,
                factored=factored,
                multiply_by_parameter_scale=multiply_by_parameter_scale,
                beta1=beta1,
                decay_rate=decay_rate,
                step_offset=step_offset,
                clipping_threshold=clipping_threshold,
                weight_decay_rate=weight_decay_rate,
                min_dim_size_to_factor=min_dim_size_to_factor,
                epsilon1=epsilon1,
                epsilon2=epsilon2,
                factor_map=factor_map,
                logical_factor_rules=logical_factor_rules,
                weight_decay_rate_lr_exponent=weight_decay_rate_lr_exponent,
                global_norm_clip_threshold=global_norm_clip_threshold,
                max_parameter_scale=max_parameter_scale,
                skip_nan_updates=skip_nan_updates,
            )
        )

    def __repr__(self) -> str:
        return f"Adafactor(learning_rate={self.hyper_params.learning_rate})"

    # -- factoring -----------------------------------------------------------------------

    @staticmethod
    def _decay_rate_pow(i: Any, exponent: Any = 0.8) -> Any:
        """The default second-moment decay: ``1 - (i + 1) ** -exponent``."""
        t = jnp.asarray(i, jnp.float32) + 1.0
        return 1.0 - t ** (-exponent)

    def _heuristic(self, shape: tuple[int, ...]) -> _Factoring:
        if not self.hyper_params.factored or len(shape) < 2:
            return _Factoring(None, None, None)
        order = np.argsort(shape, kind="stable")
        if shape[order[-2]] < self.hyper_params.min_dim_size_to_factor:
            return _Factoring(None, None, None)
        return _Factoring((int(order[-2]),), (int(order[-1]),), None)

    def _factoring(self, shape: tuple[int, ...], path: str) -> _Factoring:
        """The factoring of a parameter from its rule (or the heuristic); T5X's errors."""
        hp = self.hyper_params
        rule = hp.factor_map[path] if (hp.factored and hp.factor_map is not None) else None
        if rule is None or rule == _HEURISTIC:
            if hp.factored and len(shape) > 2:
                raise ValueError(
                    f"Adafactor: parameter '{path}' has shape {shape}; a parameter of rank > 2 needs "
                    "an explicit factorization rule (factor_map=HParamMap([...]), or "
                    "logical_factor_rules and set_param_axes)."
                )
            return self._heuristic(shape)
        dims = tuple(
            factor_name_to_factordim(x) for x in (rule if isinstance(rule, (tuple, list)) else (rule,))
        )
        if len(dims) != len(shape):
            raise ValueError(
                f"Adafactor: the factorization rule {dims} of parameter '{path}' has {len(dims)} "
                f"entries, but the parameter has shape {shape}."
            )
        averaging = tuple(i for i, d in enumerate(dims) if d is not FactorDim.BATCH)
        d1 = tuple(i for i, d in enumerate(dims) if d is FactorDim.ROW)
        d0 = tuple(i for i, d in enumerate(dims) if d is FactorDim.COLUMN)
        if not d1 or not d0:
            return _Factoring(None, None, averaging)
        return _Factoring(d1, d0, averaging)

    # -- state ---------------------------------------------------------------------------

    def _init_param_state(self, param: Any, path: str) -> AdafactorParamState:
        shape = tuple(param.shape)
        slots = {k: jnp.zeros((1,), jnp.float32) for k in ("v_row", "v_col", "v", "m")}
        f = self._factoring(shape, path)
        if f.factored:
            assert f.d0 is not None and f.d1 is not None
            slots["v_row"] = jnp.zeros(tuple(np.delete(shape, f.d0)), jnp.float32)
            slots["v_col"] = jnp.zeros(tuple(np.delete(shape, f.d1)), jnp.float32)
        else:
            slots["v"] = jnp.zeros(shape, jnp.float32)
        if self.hyper_params.beta1 is not None:
            slots["m"] = jnp.zeros(shape, self.dtype_momentum)
        return AdafactorParamState(**slots)

    def init_param_state(self, param: Any) -> AdafactorParamState:
        """One parameter's initial state (factor rules matched against the empty path)."""
        return self._init_param_state(param, "")

    def init_state(self, params: Any) -> OptimizerState:
        """Per-parameter states shaped like ``params``, at step 0."""
        leaves, treedef = _state.flatten(params)
        states = [self._init_param_state(p, n) for p, n in zip(leaves, leaf_names(params), strict=True)]
        return OptimizerState(jnp.asarray(0, jnp.int32), treedef.unflatten(states))

    # -- update --------------------------------------------------------------------------

    def apply_gradient(self, hyper_params: Any, params: Any, state: OptimizerState, grads: Any) -> Any:
        """One Adafactor step over all parameters: returns ``(new_params, new_state)``."""
        if hyper_params.learning_rate is None:
            raise ValueError(
                "Adafactor has no learning rate: pass Adafactor(learning_rate=...) or "
                "optimizer.apply_gradient(grads, learning_rate=...)."
            )
        return _state.call_compiled(self._apply_gradient, hyper_params, params, state, grads)

    def _apply_gradient(self, hyper_params: Any, params: Any, state: OptimizerState, grads: Any) -> Any:
        params_flat, treedef = _state.flatten(params)
        states_flat = treedef.flatten_up_to(state.param_states)
        grads_flat = treedef.flatten_up_to(grads)
        if hyper_params.global_norm_clip_threshold is not None:
            threshold = hyper_params.global_norm_clip_threshold
            global_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grads_flat))
            scale = threshold * jnp.minimum(1.0 / threshold, 1.0 / global_norm)
            grads_flat = [g * scale for g in grads_flat]
        out = [
            self._apply_param_gradient(state.step, hyper_params, p, s, g, n)
            for p, s, g, n in zip(params_flat, states_flat, grads_flat, leaf_names(params), strict=True)
        ]
        new_params = treedef.unflatten([p for p, _ in out])
        new_states = treedef.unflatten([s for _, s in out])
        return new_params, OptimizerState(state.step + 1, new_states)

    def apply_param_gradient(
        self, step: Any, hyper_params: Any, param: Any, state: Any, grad: Any, path: str = ""
    ) -> tuple[Any, AdafactorParamState]:
        """One parameter's step: returns ``(new_param, new_state)``.

        Example:
            >>> import jax.numpy as jnp
            >>> opt_def = Adafactor(learning_rate=0.1, beta1=0.0, min_dim_size_to_factor=32)
            >>> state = AdafactorParamState(jnp.zeros(1), jnp.zeros(1), jnp.full((3, 2), 0.5), jnp.zeros((3, 2)))
            >>> p, s = opt_def.apply_param_gradient(1, opt_def.hyper_params, jnp.ones((3, 2)), state, jnp.ones((3, 2)))
            >>> round(float(s.v[0, 0]), 5), round(float(p[0, 0]), 5)
            (0.78717, 0.9)
        """
        return self._apply_param_gradient(step, hyper_params, param, state, grad, path)

    def _apply_param_gradient(
        self, step: Any, hp: Any, param: Any, state: Any, grad: Any, path: str
    ) -> tuple[Any, AdafactorParamState]:
        learning_rate = hp.learning_rate
        weight_decay_rate = hp.weight_decay_rate
        if hp.weight_decay_rate_lr_exponent is not None:
            base = 1.0 if weight_decay_rate is None else weight_decay_rate
            weight_decay_rate = base * learning_rate**hp.weight_decay_rate_lr_exponent
        f = self._factoring(tuple(param.shape), path)
        grad = grad.astype(jnp.float32)
        slots = {k: jnp.zeros((1,), jnp.float32) for k in ("v_row", "v_col", "v", "m")}
        decay_rate = self._decay_rate_pow(step - hp.step_offset, exponent=hp.decay_rate)
        update_scale = learning_rate
        scale_by_param = hp.multiply_by_parameter_scale
        if isinstance(scale_by_param, HParamMap):
            scale_by_param = scale_by_param[path]
        if scale_by_param:
            param_scale = jnp.sqrt(jnp.mean(param * param, axis=f.averaging, keepdims=True))
            param_scale = jnp.maximum(param_scale, hp.epsilon2)
            if hp.max_parameter_scale is not None:
                param_scale = jnp.minimum(param_scale, hp.max_parameter_scale)
            update_scale = update_scale * param_scale
        mixing_rate = 1.0 - decay_rate
        grad_sqr = grad * grad + hp.epsilon1
        if f.factored:
            assert f.d0 is not None and f.d1 is not None
            d1, d0 = f.d1, f.d0
            new_v_row = decay_rate * state.v_row + mixing_rate * jnp.mean(grad_sqr, axis=d0)
            new_v_col = decay_rate * state.v_col + mixing_rate * jnp.mean(grad_sqr, axis=d1)
            slots["v_row"], slots["v_col"] = new_v_row, new_v_col
            reduced_d1 = tuple(d - sum(1 for e in d0 if e < d) for d in d1)
            row_col_mean = jnp.mean(new_v_row, axis=reduced_d1, keepdims=True)
            row_factor = (new_v_row / row_col_mean) ** -0.5
            col_factor = new_v_col**-0.5
            y = grad * jnp.expand_dims(row_factor, axis=d0) * jnp.expand_dims(col_factor, axis=d1)
        else:
            new_v = decay_rate * state.v + mixing_rate * grad_sqr
            slots["v"] = new_v
            y = grad * new_v**-0.5
        if hp.clipping_threshold is not None:
            rms = jnp.sqrt(jnp.mean(y * y, axis=f.averaging, keepdims=True))
            y = y / jnp.maximum(1.0, rms / hp.clipping_threshold)
        subtrahend = update_scale * y
        if hp.beta1 is not None:
            new_m = hp.beta1 * state.m + (1.0 - hp.beta1) * subtrahend
            subtrahend = new_m
            slots["m"] = new_m.astype(self.dtype_momentum)
        if weight_decay_rate is not None:
            new_param = (1.0 - weight_decay_rate) * param - subtrahend
        else:
            new_param = param - subtrahend
        if hp.skip_nan_updates:
            for key in ("v_row", "v_col", "v", "m"):
                slots[key] = jnp.where(jnp.isnan(slots[key]), getattr(state, key), slots[key])
            new_param = jnp.where(jnp.isnan(new_param), param, new_param)
        return new_param.astype(param.dtype), AdafactorParamState(**slots)

    # -- logical axes --------------------------------------------------------------------

    def set_param_axes(self, param_logical_axes: Any) -> None:
        """Builds ``factor_map`` from the params' logical axes and ``logical_factor_rules``.

        Each parameter's rule maps its logical axis names through
        ``logical_factor_rules`` (names without a rule: ``FactorDim.NONE``). A
        no-op when ``logical_factor_rules`` is ``None``, as in T5X.

        Example:
            >>> from jax.sharding import PartitionSpec as P
            >>> opt_def = Adafactor(0.1, logical_factor_rules=standard_logical_factor_rules())
            >>> opt_def.set_param_axes({"wi": P("layers", "embed", "mlp")})
            >>> opt_def.hyper_params.factor_map["wi"]
            (<FactorDim.BATCH: 1>, <FactorDim.ROW: 2>, <FactorDim.COLUMN: 3>)
        """
        rules = self.hyper_params.logical_factor_rules
        if rules is None:
            return
        entries = []
        for name, spec in _state.specs_engine().spec_leaves_with_names(param_logical_axes):
            rule = None if spec is None else tuple(rules.get(axis, FactorDim.NONE) for axis in spec)
            entries.append((f"^{re.escape(name)}$", rule))
        self.hyper_params = self.hyper_params.replace(factor_map=HParamMap(entries))

    def derive_logical_axes(self, optimizer: Optimizer, param_logical_axes: Any) -> Optimizer:
        """Logical axes of the state, with the factored statistics sharded.

        ``v``/``m`` get the param's spec; ``v_row``/``v_col`` the param's spec
        without the reduced axes (T5X replicates them); ``(1,)`` placeholders
        ``P()``; ``step`` ``None``. Params whose axes are ``None`` get ``None``.

        Example:
            >>> import jax.numpy as jnp
            >>> from jax.sharding import PartitionSpec as P
            >>> opt_def = Adafactor(0.1, min_dim_size_to_factor=2)
            >>> opt = opt_def.create({"w": jnp.ones((4, 8))})
            >>> axes = opt_def.derive_logical_axes(opt, {"w": P("embed", "mlp")})
            >>> axes.state.param_states["w"].v_row == P("embed"), axes.state.param_states["w"].v_col == P("mlp")
            (True, True)
        """
        target = optimizer.target
        leaves, treedef = _state.flatten(target)
        names = leaf_names(target)
        by_name = dict(_state.specs_engine().spec_leaves_with_names(param_logical_axes))
        missing = [n for n in names if n not in by_name]
        if missing:
            raise ValueError(f"param_logical_axes has no entry for parameter(s) {missing}.")
        states = treedef.flatten_up_to(optimizer.state.param_states)
        out = []
        for param, name, param_state in zip(leaves, names, states, strict=True):
            spec = by_name[name]
            out.append(self._state_axes(tuple(param.shape), name, spec, param_state))
        return Optimizer(self, OptimizerState(None, treedef.unflatten(out)), param_logical_axes)

    def _state_axes(self, shape: tuple[int, ...], path: str, spec: Any, state: Any) -> AdafactorParamState:
        if spec is None:
            return AdafactorParamState(None, None, None, None)
        entries = (*spec, *([None] * (len(shape) - len(spec))))

        def without(dims: tuple[int, ...]) -> PartitionSpec:
            kept = [e for i, e in enumerate(entries) if i not in dims]
            while kept and kept[-1] is None:
                kept.pop()
            return PartitionSpec(*kept)

        f = self._factoring(shape, path)
        placeholder = PartitionSpec()
        full = spec
        if f.factored:
            assert f.d0 is not None and f.d1 is not None
            v_row, v_col, v = without(f.d0), without(f.d1), placeholder
        else:
            v_row, v_col, v = placeholder, placeholder, full
        m = (
            full
            if tuple(jnp.shape(state.m)) == shape and self.hyper_params.beta1 is not None
            else placeholder
        )
        return AdafactorParamState(v_row, v_col, v, m)
