"""The T5X optimizer surface (``t5x.optimizers``), built on :class:`treeopt.Optimizer`.

Replace ``from t5x import optimizers`` with ``from treeopt.t5x import optimizers``
(or ``import treeopt.t5x as optimizers``): ``OptimizerDef``/``Optimizer``/
``OptimizerState``, ``OptaxWrapper``, ``wrap_optax_optimizer`` and the wrapped
optax aliases, ``OptaxStatePartitionRules`` and ``MultiOptimizer`` keep their
names, behaviour and checkpoint format. What T5X gets wrong works here:
``apply_gradient(grads, learning_rate=lr)`` really sets the step size of a
wrapped optax optimizer (no recompilation when ``lr`` changes), logical axes
derive for every optax state (factored ones included), and ``MultiOptimizer``
runs optax sub-optimizers and has a state dict.

Example:
    >>> import jax.numpy as jnp
    >>> from treeopt.t5x import optimizers
    >>> opt = optimizers.adamw(learning_rate=0.1).create({"dense": {"kernel": jnp.ones((2, 2))}})
    >>> opt = opt.apply_gradient({"dense": {"kernel": jnp.ones((2, 2))}}, learning_rate=0.01)
    >>> int(opt.state.step), sorted(opt.state_dict()["state"]["param_states"]["0"])
    (1, ['count', 'mu', 'nu'])
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.serialization
import jax
import jax.numpy as jnp
import optax
from flax import struct, traverse_util
from flax.core import FrozenDict, unfreeze
from jax.sharding import PartitionSpec
from jax.tree_util import DictKey, GetAttrKey, SequenceKey

from treeopt.layout import ParamLayout
from treeopt._paths import leaf_names, path_to_name
from treeopt.hyperparams import get_hyperparams, set_hyperparams
from treeopt.optimizer import Optimizer as CoreOptimizer
from treeopt.t5x import _state

__all__ = [
    "MultiOptimizer",
    "OptaxHyperParams",
    "OptaxStatePartitionRules",
    "OptaxWrapper",
    "Optimizer",
    "OptimizerDef",
    "OptimizerDefType",
    "OptimizerState",
    "OptimizerType",
    "adabelief",
    "adadelta",
    "adafactor",
    "adagrad",
    "adam",
    "adamax",
    "adamaxw",
    "adamw",
    "adan",
    "amsgrad",
    "chain",
    "dpsgd",
    "fromage",
    "lamb",
    "lars",
    "lion",
    "nadam",
    "nadamw",
    "noisy_sgd",
    "novograd",
    "optimistic_adam_v2",
    "optimistic_gradient_descent",
    "radam",
    "rmsprop",
    "rprop",
    "sgd",
    "sign_sgd",
    "signum",
    "sm3",
    "wrap_optax_optimizer",
    "yogi",
]


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _specs_by_name(param_logical_axes: Any) -> dict[str, Any]:
    return dict(_state.specs_engine().spec_leaves_with_names(param_logical_axes))


def _axes_for(names: Sequence[str], param_logical_axes: Any) -> list[Any]:
    """The spec of each of ``names`` in ``param_logical_axes`` (matched by name, any containers)."""
    by_name = _specs_by_name(param_logical_axes)
    missing = [name for name in names if name not in by_name]
    if missing:
        raise ValueError(
            f"param_logical_axes has no entry for parameter(s) {missing}; it must be shaped like "
            "the optimizer target, with a PartitionSpec (or None) at each parameter."
        )
    return [by_name[name] for name in names]


# -- OptimizerState / OptimizerDef / Optimizer ------------------------------------------


@struct.dataclass
class OptimizerState:
    """The step count and the per-parameter (or optax) state of an optimizer.

    Example:
        >>> import jax.numpy as jnp
        >>> state = OptimizerState(jnp.asarray(0), {"w": None})
        >>> int(state.replace(step=3).step)
        3
    """

    step: Any
    param_states: Any


class OptimizerDef:
    """Base class of an optimizer definition: hyper params plus the update rule.

    Subclasses either override ``init_state``/``apply_gradient`` (as
    :class:`OptaxWrapper` does) or, flax.optim style, implement
    ``init_param_state(param)`` and ``apply_param_gradient(step, hyper_params,
    param, state, grad)`` and get one state per parameter (``per_param_state``
    stays True; :class:`MultiOptimizer` relies on it).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import struct
        >>> @struct.dataclass
        ... class HP:
        ...     learning_rate: float
        >>> class PlainSGD(OptimizerDef):
        ...     def init_param_state(self, param):
        ...         return ()
        ...     def apply_param_gradient(self, step, hyper_params, param, state, grad):
        ...         return param - hyper_params.learning_rate * grad, state
        >>> opt = PlainSGD(HP(0.5)).create({"w": jnp.ones(2)})
        >>> opt.apply_gradient({"w": jnp.ones(2)}, learning_rate=0.25).target["w"]
        Array([0.75, 0.75], dtype=float32)
    """

    per_param_state: bool = True
    """Whether ``param_states`` holds one state per parameter, shaped like the target."""

    def __init__(self, hyper_params: Any):
        self.hyper_params = hyper_params

    def apply_param_gradient(self, step: Any, hyper_params: Any, param: Any, state: Any, grad: Any) -> Any:
        """Applies a gradient to one parameter: returns ``(new_param, new_state)``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement apply_param_gradient")

    def init_param_state(self, param: Any) -> Any:
        """The initial state of one parameter."""
        raise NotImplementedError(f"{type(self).__name__} does not implement init_param_state")

    def apply_gradient(self, hyper_params: Any, params: Any, state: OptimizerState, grads: Any) -> Any:
        """Applies a gradient for a set of parameters: returns ``(new_params, new_state)``."""
        step = state.step
        params_flat, treedef = _state.flatten(params)
        states_flat = treedef.flatten_up_to(state.param_states)
        grads_flat = treedef.flatten_up_to(grads)
        out = [
            self.apply_param_gradient(step, hyper_params, param, param_state, grad)
            for param, param_state, grad in zip(params_flat, states_flat, grads_flat, strict=True)
        ]
        new_params = treedef.unflatten([p for p, _ in out])
        new_states = treedef.unflatten([s for _, s in out])
        return new_params, OptimizerState(step + 1, new_states)

    def init_state(self, params: Any) -> OptimizerState:
        """The initial :class:`OptimizerState` for ``params`` (step 0)."""
        param_states = jax.tree.map(self.init_param_state, params)
        return OptimizerState(jnp.asarray(0, dtype=jnp.int32), param_states)

    def update_hyper_params(self, **hyper_param_overrides: Any) -> Any:
        """The hyper params of one step: ``hyper_params=`` replaces them, other kwargs ``.replace()`` fields."""
        hyper_params = hyper_param_overrides.pop("hyper_params", self.hyper_params)
        if hyper_param_overrides:
            hyper_params = hyper_params.replace(**hyper_param_overrides)
        return hyper_params

    def create(self, target: Any) -> Optimizer:
        """A new :class:`Optimizer` for ``target`` (a params tree), its state initialized."""
        return Optimizer(self, self.init_state(target), target)

    def state_dict(self, target: Any, state: OptimizerState) -> dict[str, Any]:
        """``{"target": ..., "state": {"step": ..., "param_states": ...}}`` as nested plain dicts.

        Typed PRNG keys (``optax.noisy_sgd``) are written as their ``uint32`` key data.
        """
        return {"target": _state.to_state_dict(target), "state": _state.to_state_dict(state)}

    def restore_state(self, opt_target: Any, opt_state: OptimizerState, state_dict: Mapping[str, Any]) -> Any:
        """``(target, state)`` with their values from ``state_dict``; mismatches raise ``ValueError`` by path."""
        for key in ("target", "state"):
            if key not in state_dict:
                raise ValueError(
                    f"The optimizer state dict has no '{key}' entry (keys: {sorted(state_dict)})."
                )
        target, state = _state.restore(
            (opt_target, state_dict["target"], "target"), (opt_state, state_dict["state"], "state")
        )
        return target, state

    def set_param_axes(self, param_logical_axes: Any) -> None:
        """Lets the optimizer read the params' logical axes (used by Adafactor's factor rules)."""
        del param_logical_axes

    def derive_logical_axes(self, optimizer: Optimizer, param_logical_axes: Any) -> Optimizer:
        """An :class:`Optimizer` of logical ``PartitionSpec``s for ``optimizer``'s target and state.

        This generic rule is for per-parameter states: a state leaf gets its
        param's spec where it has the param's shape, the spec with the removed
        axes dropped where it is reduced, ``P()`` otherwise; ``step`` is None.
        """
        target = optimizer.target
        treedef = _state.structure(target)
        params = treedef.flatten_up_to(target)
        axes = _axes_for(leaf_names(target), param_logical_axes)
        states = treedef.flatten_up_to(optimizer.state.param_states)

        def one(param: Any, spec: Any, state: Any) -> Any:
            if spec is None:
                return jax.tree.map(lambda _: None, state)
            shape = tuple(param.shape)
            return jax.tree.map(
                lambda leaf: _state.specs_engine().derive_spec(shape, spec, tuple(jnp.shape(leaf))), state
            )

        param_states = treedef.unflatten([one(p, a, s) for p, a, s in zip(params, axes, states, strict=True)])
        return Optimizer(self, OptimizerState(None, param_states), param_logical_axes)


OptimizerDefType = OptimizerDef
"""Alias of :class:`OptimizerDef` (as in T5X)."""


class Optimizer(struct.PyTreeNode):
    """An optimizer definition (static) with its state and target: the T5X ``Optimizer``.

    A pytree: pass it through ``jax.jit`` and return it. ``apply_gradient``
    returns a new optimizer; outside jit each step runs as one compiled program.

    Example:
        >>> import jax.numpy as jnp
        >>> import treeopt.t5x as optimizers
        >>> opt = optimizers.sgd(learning_rate=0.5).create({"w": jnp.ones(2)})
        >>> opt = opt.apply_gradient({"w": jnp.ones(2)})
        >>> opt.target["w"], int(opt.state.step)
        (Array([0.5, 0.5], dtype=float32), 1)
    """

    optimizer_def: OptimizerDef = struct.field(pytree_node=False)
    state: Any = struct.field(pytree_node=True)
    target: Any = struct.field(pytree_node=True)

    def apply_gradient(self, grads: Any, **hyper_param_overrides: Any) -> Optimizer:
        """A new optimizer with ``grads`` applied; kwargs override hyper params for this step.

        ``learning_rate=lr`` changes the step size (for wrapped optax
        optimizers too); ``hyper_params=...`` replaces all hyper params.
        """
        hyper_params = self.optimizer_def.update_hyper_params(**hyper_param_overrides)
        new_target, new_state = self.optimizer_def.apply_gradient(
            hyper_params, self.target, self.state, grads
        )
        return self.replace(target=new_target, state=new_state)

    def state_dict(self) -> dict[str, Any]:
        """The T5X state dict: ``{"target": ..., "state": {"step": ..., "param_states": ...}}``."""
        return self.optimizer_def.state_dict(self.target, self.state)

    def restore_state(self, state: Mapping[str, Any]) -> Optimizer:
        """A new optimizer with target and state restored from a state dict."""
        target, opt_state = self.optimizer_def.restore_state(self.target, self.state, state)
        return self.replace(target=target, state=opt_state)


OptimizerType = Optimizer
"""Alias of :class:`Optimizer` (as in T5X)."""

flax.serialization.register_serialization_state(
    Optimizer,
    lambda opt: opt.state_dict(),
    lambda opt, state_dict: opt.restore_state(state_dict),
    override=True,
)


# -- OptaxWrapper -----------------------------------------------------------------------


class OptaxHyperParams:
    """Hyper params of a wrapped optax optimizer that ``apply_gradient`` may override.

    Fields are ``None`` (the value the optax optimizer was built with) until set
    for a step; a field set to a number overrides that hyperparameter for the
    step (``optax.inject_hyperparams`` does it, so a new value does not
    recompile). ``replace`` rejects names that are not fields.

    Example:
        >>> hp = OptaxHyperParams(("learning_rate", "b1"))
        >>> hp.learning_rate is None, hp.replace(learning_rate=0.1).overrides()
        (True, {'learning_rate': 0.1})
    """

    __slots__ = ("_any", "_values")

    def __init__(
        self,
        names: Sequence[str] = ("learning_rate",),
        values: Mapping[str, Any] | None = None,
        *,
        any_name: bool = False,
    ):
        base = dict.fromkeys(names)
        base.update(values or {})
        object.__setattr__(self, "_values", base)
        object.__setattr__(self, "_any", any_name)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        if object.__getattribute__(self, "_any") and not name.startswith("_"):
            return None
        raise AttributeError(f"OptaxHyperParams has no field '{name}' (fields: {sorted(values)})")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("OptaxHyperParams is immutable; use .replace(...)")

    def replace(self, **updates: Any) -> OptaxHyperParams:
        """A copy with the given fields set."""
        unknown = sorted(set(updates) - set(self._values))
        if unknown and not self._any:
            raise TypeError(
                f"{unknown} cannot be overridden for this optax optimizer; its overridable "
                f"hyperparameters are {sorted(self._values)}."
            )
        return OptaxHyperParams((), {**self._values, **updates}, any_name=self._any)

    def overrides(self) -> dict[str, Any]:
        """The fields that are set (not ``None``)."""
        return {k: v for k, v in self._values.items() if v is not None}

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._values.items())
        return f"OptaxHyperParams({inner})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_make_hyper_params, (self._values, self._any))


def _make_hyper_params(values: Mapping[str, Any], any_name: bool) -> OptaxHyperParams:
    return OptaxHyperParams((), values, any_name=any_name)


def _hp_flatten(hp: OptaxHyperParams) -> tuple[Any, Any]:
    values = hp._values
    return tuple(values.values()), (tuple(values), hp._any)


def _hp_unflatten(aux: Any, children: Any) -> OptaxHyperParams:
    names, any_name = aux
    return OptaxHyperParams((), dict(zip(names, children, strict=True)), any_name=any_name)


jax.tree_util.register_pytree_node(OptaxHyperParams, _hp_flatten, _hp_unflatten)


class _ConstantSchedule:
    """A schedule that returns one (possibly traced) value: overrides a scheduled hyperparameter."""

    def __init__(self, value: Any):
        self.value = value

    def __call__(self, count: Any) -> Any:
        del count
        return self.value


def _is_number(x: Any) -> bool:
    """A hyperparameter value that ``optax.inject_hyperparams`` can inject (not a flag, key or function)."""
    if isinstance(x, bool) or callable(x):
        return False
    if isinstance(x, (int, float)):
        return True
    dtype = getattr(x, "dtype", None)
    return dtype is not None and hasattr(x, "shape") and not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


class OptaxWrapper(OptimizerDef):
    """An optax ``GradientTransformation`` as a T5X ``OptimizerDef``, run by :class:`treeopt.Optimizer`.

    ``state.param_states`` is the optax state shaped like the target, exactly
    as T5X stores it (``mu``/``nu`` nested like the params). The state dict
    drops the empty dicts of ``optax.EmptyState``/``optax.MaskedNode`` and
    ``restore_state`` puts them back.

    ``apply_gradient(grads, learning_rate=lr)`` sets the step size: for
    optimizers from :func:`wrap_optax_optimizer` (all the aliases here) through
    ``optax.inject_hyperparams``; for a transformation wrapped directly, when
    it was built with ``optax.inject_hyperparams`` (otherwise the value is
    ignored with a warning, as there is nothing to set).

    Example:
        >>> import jax.numpy as jnp, optax
        >>> opt = OptaxWrapper(optax.sgd(0.1, momentum=0.9)).create({"w": jnp.zeros(2)})
        >>> opt = opt.apply_gradient({"w": jnp.ones(2)})
        >>> opt.target["w"]
        Array([-0.1, -0.1], dtype=float32)
        >>> opt.state.param_states[0]
        TraceState(trace={'w': Array([1., 1.], dtype=float32)})
    """

    per_param_state = False

    def __init__(self, optax_optimizer: optax.GradientTransformation):
        if isinstance(optax_optimizer, optax.MultiSteps):
            optax_optimizer = optax_optimizer.gradient_transformation()
        if not isinstance(optax_optimizer, optax.GradientTransformation):
            raise TypeError(
                "OptaxWrapper needs an optax.GradientTransformation such as optax.adam(1e-3), got "
                f"{type(optax_optimizer).__name__}; to wrap a constructor use wrap_optax_optimizer."
            )
        self.optax_optimizer = optax_optimizer
        self._factory: Callable[..., Any] | None = None
        self._signature: inspect.Signature | None = None
        self._arguments: dict[str, Any] = {}
        self._warned = False
        super().__init__(hyper_params=OptaxHyperParams(("learning_rate",), any_name=True))

    @classmethod
    def _from_factory(
        cls, tx: optax.GradientTransformation, factory: Callable[..., Any], bound: inspect.BoundArguments
    ) -> OptaxWrapper:
        self = cls(tx)
        signature = bound.signature
        self._factory, self._signature, self._arguments = factory, signature, dict(bound.arguments)
        kinds = {name: p.kind for name, p in signature.parameters.items()}
        names: tuple[str, ...] = ()
        if inspect.Parameter.VAR_POSITIONAL not in kinds.values():
            names = tuple(
                name
                for name, value in bound.arguments.items()
                if kinds[name] is not inspect.Parameter.VAR_KEYWORD
                and (_is_number(value) or (name == "learning_rate" and callable(value)))
            )
        self.hyper_params = OptaxHyperParams(names)
        return self

    def __repr__(self) -> str:
        name = getattr(self._factory, "__name__", None) or type(self.optax_optimizer).__name__
        return f"OptaxWrapper({name})"

    # -- state -------------------------------------------------------------------------

    def init_state(self, params: Any) -> OptimizerState:
        """Initial state: optax's state over ``params``, shaped like them, at step 0."""
        layout = ParamLayout.of(params)
        core = CoreOptimizer(self.optax_optimizer).init(params)
        return OptimizerState(core.step, _state.to_target_shape(core.opt_state, layout))

    def _flat_state(self, param_states: Any, layout: ParamLayout) -> Any:
        return _state.to_flat(param_states, layout, _state.flat_template(self.optax_optimizer, layout))

    def state_dict(self, target: Any, state: OptimizerState) -> dict[str, Any]:
        """The T5X state dict, without the empty dicts of ``EmptyState``/``MaskedNode``."""
        sd = super().state_dict(target, state)
        return {"target": sd["target"], "state": _state.drop_empty_dicts(sd["state"])}

    # -- update ------------------------------------------------------------------------

    def apply_gradient(self, hyper_params: Any, params: Any, state: OptimizerState, grads: Any) -> Any:
        """Applies one optax step: returns ``(new_params, new_state)``; hyper params set are honoured."""
        return _state.call_compiled(self._apply_gradient, hyper_params, params, state, grads)

    def _apply_gradient(self, hyper_params: Any, params: Any, state: OptimizerState, grads: Any) -> Any:
        layout = ParamLayout.of(params)
        flat_state = self._flat_state(state.param_states, layout)
        overrides = hyper_params.overrides() if isinstance(hyper_params, OptaxHyperParams) else {}
        tx = self.optax_optimizer
        injected = False
        if overrides and self._factory is not None:
            tx = self._step_transformation(overrides)
            flat_params = layout.split_params(params)[0]
            inject_state = tx.init(flat_params)
            flat_state = inject_state._replace(
                count=jnp.asarray(state.step, jnp.int32), inner_state=flat_state
            )
            injected = True
        elif overrides:
            flat_state = self._set_injected(flat_state, overrides)
        core = _state.core_optimizer(tx, layout, state.step, flat_state)
        new_params = self._update(core, layout, params, grads)
        new_flat: Any = core.opt_state
        if injected:
            new_flat = new_flat.inner_state
        return new_params, OptimizerState(core.step, _state.to_target_shape(new_flat, layout))

    @staticmethod
    def _update(core: CoreOptimizer, layout: ParamLayout, params: Any, grads: Any) -> Any:
        grad_leaves = jax.tree.leaves(grads)
        param_leaves = jax.tree.leaves(params)
        per_example = len(grad_leaves) == len(param_leaves) and any(
            jnp.ndim(g) == jnp.ndim(p) + 1 for g, p in zip(grad_leaves, param_leaves, strict=True)
        )
        if not per_example:
            return core.update(grads, params)
        # Per-example gradients (optax dpsgd): one more leading axis than the params.
        flat_grads = _state.unnest(grads, layout)
        flat_params, leaves = layout.split_params(params)
        new_flat = core._update_flat(flat_grads, flat_params, True, {})
        return layout.merge_params(leaves, new_flat)

    def _step_transformation(self, overrides: Mapping[str, Any]) -> optax.GradientTransformation:
        """The wrapped constructor through ``optax.inject_hyperparams``, the overrides injected."""
        assert self._factory is not None and self._signature is not None
        arguments = dict(self._arguments)
        static = set(self._signature.parameters)
        for name, value in overrides.items():
            if callable(self._arguments[name]):
                # A schedule overridden: a constant schedule keeps the state's structure.
                arguments[name] = _ConstantSchedule(value)
            else:
                arguments[name] = value
                static.discard(name)
        bound = inspect.BoundArguments(self._signature, arguments)
        return optax.inject_hyperparams(self._factory, static_args=static)(*bound.args, **bound.kwargs)

    def _set_injected(self, flat_state: Any, overrides: Mapping[str, Any]) -> Any:
        found = get_hyperparams(flat_state)
        settable = {k: v for k, v in overrides.items() if k in found}
        unknown = [k for k in overrides if k not in found]
        if unknown == ["learning_rate"] or (unknown and set(unknown) <= {"learning_rate"}):
            if not self._warned:
                self._warned = True
                warnings.warn(
                    "learning_rate passed to apply_gradient is ignored: the wrapped optax "
                    "transformation has no injected learning_rate. Build it with "
                    "treeopt.t5x.wrap_optax_optimizer(optax.adam)(...) (or the aliases such as "
                    "treeopt.t5x.adam), or with optax.inject_hyperparams, to make it count.",
                    UserWarning,
                    stacklevel=2,
                )
        elif unknown:
            raise ValueError(
                f"Cannot override {unknown}: the wrapped optax transformation has no such injected "
                f"hyperparameter (injected: {sorted(found)})."
            )
        return set_hyperparams(flat_state, settable) if settable else flat_state

    # -- partitioning ------------------------------------------------------------------

    def derive_logical_axes(self, optimizer: Optimizer, param_logical_axes: Any) -> Optimizer:
        """An :class:`Optimizer` of logical specs for ``optimizer``, shaped as T5X shapes it.

        ``target`` is ``param_logical_axes``, ``step`` is ``None``, and
        ``param_states`` is the optax state with: the param's spec on entries
        shaped like it, the spec minus the reduced axes on factored entries
        (Adafactor, SM3), ``P()`` on per-parameter scalars and placeholders,
        ``None`` on everything that is not per parameter (counts, RNG keys,
        hyperparameters). Works for every optax transformation.
        """
        target = optimizer.target
        layout = ParamLayout.of(target)
        flat_state = self._flat_state(optimizer.state.param_states, layout)
        core = _state.core_optimizer(self.optax_optimizer, layout, optimizer.state.step, flat_state)
        specs = core.partition_specs(param_logical_axes)
        unspecified = {name for name, spec in _specs_by_name(param_logical_axes).items() if spec is None}
        named = _named_specs_with_none(specs.opt_state, layout, unspecified)
        param_states = _state.to_target_shape(named, layout, leaf=lambda _: None)
        return Optimizer(self, OptimizerState(None, param_states), param_logical_axes)


def _named_specs_with_none(spec_state: Any, layout: ParamLayout, unspecified: set[str]) -> Any:
    """Specs of the entries of params whose logical axes are ``None`` become ``None`` (T5X style)."""
    if not unspecified:
        return spec_state
    names = frozenset(layout.names)

    def is_named(x: Any) -> bool:
        return bool(names) and isinstance(x, dict) and x.keys() == names

    def fix(x: Any) -> Any:
        if not is_named(x):
            return x
        return {
            k: (jax.tree.map(lambda _: None, v, is_leaf=_is_spec) if k in unspecified else v)
            for k, v in x.items()
        }

    return jax.tree.map(fix, spec_state, is_leaf=is_named)


class OptaxStatePartitionRules:
    """Logical axes of an optax state from the params' logical axes.

    T5X keeps a table of optax state types here and raises for any other;
    treeopt reads the params-shaped parts of any state by structure and
    derives each entry's spec from shapes, so every state works: factored
    (Adafactor, SM3), combinators (chain, masked, multi_transform,
    inject_hyperparams, MultiSteps, apply_if_finite) and contrib ones.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> from jax.sharding import PartitionSpec as P
        >>> state = optax.adam(0.1).init({"w": jnp.ones((2, 3))})
        >>> axes = OptaxStatePartitionRules.derive_optax_logical_axes(state, {"w": P("embed", "mlp")})
        >>> axes == (optax.ScaleByAdamState(None, {"w": P("embed", "mlp")}, {"w": P("embed", "mlp")}), optax.EmptyState())
        True
    """

    @classmethod
    def derive_optax_logical_axes(cls, optax_state: Any, params_axes: Any, *, params: Any = None) -> Any:
        """The state's logical axes: shaped like ``optax_state``, T5X conventions (``None`` = replicated).

        Args:
            optax_state: an optax state over params shaped like ``params_axes``.
            params_axes: the params' logical ``PartitionSpec``s (``None`` where replicated).
            params: the params (or their ``jax.ShapeDtypeStruct``s). Optional: without
                them each param's shape is read from its state entries of full rank;
                factored entries need it when no such entry exists.
        """
        axes_plain = unfreeze(params_axes) if isinstance(params_axes, (dict, FrozenDict)) else params_axes
        named_axes = _state.specs_engine().spec_leaves_with_names(axes_plain)
        names = [name for name, _ in named_axes]
        treedef = _state.structure(axes_plain, is_leaf=_is_spec)
        if treedef.num_leaves == 1 and treedef.num_nodes == 1:
            raise ValueError(
                "derive_optax_logical_axes needs params_axes shaped like a params tree "
                "(e.g. {'w': P('embed', 'mlp')}), got a single spec."
            )

        def is_params(x: Any) -> bool:
            if _is_spec(x) or not isinstance(x, (dict, FrozenDict, list, tuple)):
                return False
            try:
                treedef.flatten_up_to(unfreeze(x) if isinstance(x, FrozenDict) else x)
            except (ValueError, TypeError):
                return False
            return True

        def to_named(x: Any) -> Any:
            if not is_params(x):
                return x
            parts = treedef.flatten_up_to(unfreeze(x) if isinstance(x, FrozenDict) else x)
            return dict(zip(names, parts, strict=True))

        flat_state = jax.tree.map(to_named, optax_state, is_leaf=is_params)
        name_set = frozenset(names)

        def is_named(x: Any) -> bool:
            return isinstance(x, dict) and x.keys() == name_set

        shapes = cls._param_shapes(flat_state, names, named_axes, params, is_named)
        known = [name for name in names if shapes[name] is not None]
        layout = ParamLayout.of({name: jax.ShapeDtypeStruct(shapes[name], jnp.float32) for name in known})
        specs = {name: (PartitionSpec() if spec is None else spec) for name, spec in named_axes}
        axes = dict(named_axes)

        def derive(x: Any) -> Any:
            if not is_named(x):
                return None
            known_part = {name: x[name] for name in known}
            derived = (
                _state.specs_engine().state_specs(known_part, layout, {n: specs[n] for n in known})
                if known
                else {}
            )
            out = []
            for name in names:
                if axes[name] is None:
                    out.append(jax.tree.map(lambda _: None, x[name]))
                elif name in derived:
                    out.append(derived[name])
                else:  # shape unknown: full-rank entries get the spec, others replicate
                    rank = len(axes[name])
                    out.append(
                        jax.tree.map(
                            lambda leaf, s=axes[name], r=rank: s if jnp.ndim(leaf) == r else None, x[name]
                        )
                    )
            return treedef.unflatten(out)

        return jax.tree.map(derive, flat_state, is_leaf=is_named)

    @staticmethod
    def _param_shapes(
        flat_state: Any,
        names: list[str],
        named_axes: list[tuple[str, Any]],
        params: Any,
        is_named: Callable[[Any], bool],
    ) -> dict[str, tuple[int, ...] | None]:
        if params is not None:
            by_name = dict(zip(leaf_names(params), jax.tree.leaves(params), strict=True))
            missing = [n for n in names if n not in by_name]
            if missing:
                raise ValueError(f"params has no parameter(s) {missing} named in params_axes.")
            return {n: tuple(jnp.shape(by_name[n])) for n in names}
        candidates: dict[str, set[tuple[int, ...]]] = {n: set() for n in names}
        axes = dict(named_axes)
        for entry in jax.tree.leaves(flat_state, is_leaf=is_named):
            if not is_named(entry):
                continue
            for n in names:
                rank = None if axes[n] is None else len(axes[n])
                for leaf in jax.tree.leaves(entry[n]):
                    if rank is not None and jnp.ndim(leaf) == rank:
                        candidates[n].add(tuple(jnp.shape(leaf)))
        return {n: (next(iter(c)) if len(c) == 1 else None) for n, c in candidates.items()}

    @classmethod
    def derive_params_axes(cls, optax_params: Any, params_axes: Any) -> Any:
        """Axes of a params-shaped part of an optax state: the params' axes, ``MaskedNode`` kept.

        Example:
            >>> import optax
            >>> from jax.sharding import PartitionSpec as P
            >>> axes = OptaxStatePartitionRules.derive_params_axes(
            ...     {"a": 1.0, "b": optax.MaskedNode()}, {"a": P("x"), "b": P("y")})
            >>> axes == {"a": P("x"), "b": optax.MaskedNode()}
            True
        """
        treedef = _state.structure(params_axes, is_leaf=_is_spec)
        parts = treedef.flatten_up_to(optax_params)
        axes = treedef.flatten_up_to(params_axes)
        return treedef.unflatten(
            [part if isinstance(part, optax.MaskedNode) else ax for part, ax in zip(parts, axes, strict=True)]
        )


# -- wrap_optax_optimizer and the aliases ------------------------------------------------


def wrap_optax_optimizer(
    optax_optimizer: Callable[..., optax.GradientTransformation],
) -> Callable[..., OptaxWrapper]:
    """An optax constructor turned into one that returns an :class:`OptaxWrapper`.

    The wrapper remembers the constructor and its arguments, so numeric
    hyperparameters (``learning_rate``, ``b1``, ``weight_decay``, ...) can be
    overridden per step with ``apply_gradient(grads, learning_rate=...)``.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> sgd = wrap_optax_optimizer(optax.sgd)
        >>> opt = sgd(learning_rate=1.0).create({"w": jnp.zeros(2)})
        >>> opt.apply_gradient({"w": jnp.ones(2)}, learning_rate=0.5).target["w"]
        Array([-0.5, -0.5], dtype=float32)
    """
    signature = inspect.signature(optax_optimizer)
    name = str(
        getattr(optax_optimizer, "__name__", None)
        or getattr(getattr(optax_optimizer, "func", None), "__name__", "optimizer")
    )

    def wrapped_optimizer(*args: Any, **kwargs: Any) -> OptaxWrapper:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return OptaxWrapper._from_factory(optax_optimizer(*args, **kwargs), optax_optimizer, bound)

    wrapped_optimizer.__name__ = wrapped_optimizer.__qualname__ = name
    wrapped_optimizer.__signature__ = signature  # type: ignore[attr-defined]
    wrapped_optimizer.__doc__ = f"``{name}`` of optax as a T5X ``OptimizerDef`` (an :class:`OptaxWrapper`)."
    return wrapped_optimizer


def _alias(factory: Callable[..., Any], name: str, example_args: str) -> Callable[..., OptaxWrapper]:
    wrapped = wrap_optax_optimizer(factory)
    wrapped.__name__ = wrapped.__qualname__ = name
    wrapped.__module__ = __name__
    wrapped.__doc__ = (
        f"optax ``{name}`` as a T5X ``OptimizerDef`` (an :class:`OptaxWrapper`); same arguments.\n\n"
        "Example:\n"
        "    >>> import jax, jax.numpy as jnp, optax\n"
        "    >>> import treeopt.t5x as optimizers\n"
        f"    >>> opt = optimizers.{name}({example_args}).create({{'w': jnp.ones((2, 3))}})\n"
        "    >>> int(opt.state.step)\n"
        "    0\n"
    )
    return wrapped


def _dpsgd_factory() -> Callable[..., Any]:
    contrib = getattr(optax, "contrib", None)
    return getattr(contrib, "dpsgd", None) or optax.dpsgd


# The aliases of t5x.optimizers ...
chain = _alias(optax.chain, "chain", "optax.clip(1.0), optax.sgd(0.1)")
adabelief = _alias(optax.adabelief, "adabelief", "learning_rate=1e-3")
adagrad = _alias(optax.adagrad, "adagrad", "learning_rate=1e-3")
adam = _alias(optax.adam, "adam", "learning_rate=1e-3")
adamw = _alias(optax.adamw, "adamw", "learning_rate=1e-3")
fromage = _alias(optax.fromage, "fromage", "learning_rate=1e-3")
lars = _alias(optax.lars, "lars", "learning_rate=1e-3")
lamb = _alias(optax.lamb, "lamb", "learning_rate=1e-3")
lion = _alias(optax.lion, "lion", "learning_rate=1e-4")
noisy_sgd = _alias(optax.noisy_sgd, "noisy_sgd", "learning_rate=1e-3, key=jax.random.key(0)")
radam = _alias(optax.radam, "radam", "learning_rate=1e-3")
rmsprop = _alias(optax.rmsprop, "rmsprop", "learning_rate=1e-3")
sgd = _alias(optax.sgd, "sgd", "learning_rate=1e-3")
yogi = _alias(optax.yogi, "yogi", "learning_rate=1e-3")
dpsgd = _alias(
    _dpsgd_factory(), "dpsgd", "learning_rate=1e-3, l2_norm_clip=1.0, noise_multiplier=0.1, seed=0"
)
# ... and the other optax aliases.
adadelta = _alias(optax.adadelta, "adadelta", "learning_rate=1.0")
adafactor = _alias(optax.adafactor, "adafactor", "learning_rate=1e-3")
adamax = _alias(optax.adamax, "adamax", "learning_rate=1e-3")
adamaxw = _alias(optax.adamaxw, "adamaxw", "learning_rate=1e-3")
adan = _alias(optax.adan, "adan", "learning_rate=1e-3")
amsgrad = _alias(optax.amsgrad, "amsgrad", "learning_rate=1e-3")
nadam = _alias(optax.nadam, "nadam", "learning_rate=1e-3")
nadamw = _alias(optax.nadamw, "nadamw", "learning_rate=1e-3")
novograd = _alias(optax.novograd, "novograd", "learning_rate=1e-3")
optimistic_adam_v2 = _alias(optax.optimistic_adam_v2, "optimistic_adam_v2", "learning_rate=1e-3")
optimistic_gradient_descent = _alias(
    optax.optimistic_gradient_descent, "optimistic_gradient_descent", "learning_rate=1e-3"
)
rprop = _alias(optax.rprop, "rprop", "learning_rate=1e-3")
sign_sgd = _alias(optax.sign_sgd, "sign_sgd", "learning_rate=1e-3")
signum = _alias(optax.signum, "signum", "learning_rate=1e-3")
sm3 = _alias(optax.sm3, "sm3", "learning_rate=1e-3")


# -- MultiOptimizer ---------------------------------------------------------------------


class _Match:
    """Marks a value a traversal selected."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def _key_of(key: Any) -> Any:
    if isinstance(key, DictKey):
        return key.key
    if isinstance(key, SequenceKey):
        return key.idx
    if isinstance(key, GetAttrKey):
        return key.name
    return str(key)


def _get(tree: Any, keys: tuple[Any, ...]) -> Any:
    for key in keys:
        tree = tree[key]
    return tree


class _Split:
    """Which positions of a params-shaped tree each traversal owns, and their keys."""

    def __init__(self, treedef: Any, names: list[str], keys: list[tuple[Any, ...]], groups: list[list[int]]):
        self.treedef, self.names, self.keys, self.groups = treedef, names, keys, groups

    def subtree(self, index: int, values: Sequence[Any]) -> dict[Any, Any]:
        """The sub-target of traversal ``index``: nested dicts keyed like the target, its leaves only."""
        return traverse_util.unflatten_dict({self.keys[i]: values[i] for i in self.groups[index]})

    def read(self, index: int, subtree: Any) -> Iterator[tuple[int, Any]]:
        for i in self.groups[index]:
            yield i, _get(subtree, self.keys[i])


class MultiOptimizer(OptimizerDef):
    """Different optimizers for disjoint subsets of the params, picked by ``flax.traverse_util`` traversals.

    ``MultiOptimizer((traversal, optimizer_def), ...)`` (or one sequence of
    such pairs). Each sub-optimizer sees the params its traversal selects,
    with their full names (so Adafactor factor rules and name masks still
    apply); params no traversal selects are not trained. Overlapping
    traversals raise ``ValueError`` naming the shared params.

    State layout: when every sub-optimizer keeps one state per parameter
    (legacy Adafactor, flax.optim-style defs) ``param_states`` is shaped like
    the target with ``None`` for unselected params, as T5X stores it. With
    optax sub-optimizers (``OptaxWrapper``; T5X cannot run these) it is a
    tuple with each sub-optimizer's state, shaped like its subset.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import traverse_util
        >>> import treeopt.t5x as optimizers
        >>> kernels = traverse_util.ModelParamTraversal(lambda path, _: "kernel" in path)
        >>> biases = traverse_util.ModelParamTraversal(lambda path, _: "bias" in path)
        >>> opt_def = optimizers.MultiOptimizer(
        ...     (kernels, optimizers.sgd(learning_rate=0.1)), (biases, optimizers.sgd(learning_rate=1.0)))
        >>> opt = opt_def.create({"kernel": jnp.ones(2), "bias": jnp.ones(2)})
        >>> opt.apply_gradient({"kernel": jnp.ones(2), "bias": jnp.ones(2)}).target
        {'bias': Array([0., 0.], dtype=float32), 'kernel': Array([0.9, 0.9], dtype=float32)}
    """

    per_param_state = False

    def __init__(self, *traversals_and_optimizers: Any):
        pairs: Sequence[Any] = traversals_and_optimizers
        if (
            len(pairs) == 1
            and isinstance(pairs[0], (list, tuple))
            and pairs[0]
            and all(isinstance(p, (list, tuple)) for p in pairs[0])
        ):
            pairs = tuple(pairs[0])
        if not pairs:
            raise ValueError("MultiOptimizer needs at least one (traversal, optimizer_def) pair.")
        for i, pair in enumerate(pairs):
            if not (
                isinstance(pair, (list, tuple))
                and len(pair) == 2
                and isinstance(pair[0], traverse_util.Traversal)
                and isinstance(pair[1], OptimizerDef)
            ):
                raise TypeError(
                    f"MultiOptimizer argument {i} must be a (flax.traverse_util.Traversal, OptimizerDef) "
                    f"pair, got {pair!r}."
                )
        self.traversals = tuple(p[0] for p in pairs)
        self.sub_optimizers = tuple(p[1] for p in pairs)
        self._per_param = all(opt.per_param_state for opt in self.sub_optimizers)
        super().__init__([opt.hyper_params for opt in self.sub_optimizers])

    # -- which params each sub-optimizer owns ----------------------------------------------

    def _split(self, tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> _Split:
        flat, treedef_ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
        treedef: Any = treedef_
        names = [path_to_name(path) for path, _ in flat]
        keys = [tuple(_key_of(k) for k in path) for path, _ in flat]
        owner: dict[int, int] = {}
        overlaps: dict[str, list[int]] = {}
        groups = []
        for t, traversal in enumerate(self.traversals):
            marked = traversal.update(_Match, tree)
            found = {
                path_to_name(path)
                for path, leaf in jax.tree_util.tree_flatten_with_path(
                    marked, is_leaf=lambda x: isinstance(x, _Match) or (is_leaf is not None and is_leaf(x))
                )[0]
                if isinstance(leaf, _Match)
            }
            group = []
            for i, name in enumerate(names):
                parts = name.split("/")
                if (
                    not any("/".join(parts[:k]) in found for k in range(1, len(parts) + 1))
                    and name not in found
                ):
                    continue
                if i in owner:
                    overlaps.setdefault(name, [owner[i]]).append(t)
                    continue
                owner[i] = t
                group.append(i)
            groups.append(group)
        if overlaps:
            details = ", ".join(f"'{n}' (traversals {ts})" for n, ts in sorted(overlaps.items()))
            raise ValueError(
                f"MultiOptimizer traversals overlap: {details}. Each parameter may be selected by one "
                "traversal only; make the filters disjoint."
            )
        return _Split(treedef, names, keys, groups)

    def _sub_states(self, split: _Split, param_states: Any) -> list[Any]:
        if not self._per_param:
            return list(param_states)
        per_position = split.treedef.flatten_up_to(param_states)
        return [split.subtree(i, per_position) for i in range(len(self.sub_optimizers))]

    def _merge_states(self, split: _Split, sub_states: Sequence[Any]) -> Any:
        if not self._per_param:
            return tuple(sub_states)
        per_position: list[Any] = [None] * len(split.names)
        for i, sub in enumerate(sub_states):
            for position, value in split.read(i, sub):
                per_position[position] = value
        return split.treedef.unflatten(per_position)

    # -- OptimizerDef --------------------------------------------------------------------

    def init_state(self, params: Any) -> OptimizerState:
        """Each sub-optimizer's state for its subset; see the class docstring for the layout."""
        split = self._split(params)
        leaves = split.treedef.flatten_up_to(params)
        sub_states = [
            opt.init_state(split.subtree(i, leaves)).param_states for i, opt in enumerate(self.sub_optimizers)
        ]
        return OptimizerState(jnp.asarray(0, dtype=jnp.int32), self._merge_states(split, sub_states))

    def update_hyper_params(self, **hyper_param_overrides: Any) -> Any:
        """Per sub-optimizer hyper params: ``hyper_params=[...]`` replaces them, other kwargs go to each."""
        hyper_params = hyper_param_overrides.pop("hyper_params", self.hyper_params)
        if hyper_param_overrides:
            hyper_params = [hp.replace(**hyper_param_overrides) for hp in hyper_params]
        return hyper_params

    def apply_gradient(self, hyper_params: Any, params: Any, state: OptimizerState, grads: Any) -> Any:
        """Applies each sub-optimizer to its subset: returns ``(new_params, new_state)``."""
        if len(hyper_params) != len(self.sub_optimizers):
            raise ValueError(
                f"MultiOptimizer has {len(self.sub_optimizers)} sub-optimizers but got "
                f"{len(hyper_params)} hyper params."
            )
        return _state.call_compiled(self._apply_gradient, list(hyper_params), params, state, grads)

    def _apply_gradient(self, hyper_params: Any, params: Any, state: OptimizerState, grads: Any) -> Any:
        split = self._split(params)
        leaves = split.treedef.flatten_up_to(params)
        grad_leaves = split.treedef.flatten_up_to(grads)
        new_leaves = list(leaves)
        sub_states = self._sub_states(split, state.param_states)
        new_sub_states = []
        for i, (opt, hp) in enumerate(zip(self.sub_optimizers, hyper_params, strict=True)):
            if not split.groups[i]:
                new_sub_states.append(sub_states[i])
                continue
            sub_params, new_sub_state = opt.apply_gradient(
                hp,
                split.subtree(i, leaves),
                OptimizerState(state.step, sub_states[i]),
                split.subtree(i, grad_leaves),
            )
            for position, value in split.read(i, sub_params):
                new_leaves[position] = value
            new_sub_states.append(new_sub_state.param_states)
        new_params = split.treedef.unflatten(new_leaves)
        return new_params, OptimizerState(state.step + 1, self._merge_states(split, new_sub_states))

    def state_dict(self, target: Any, state: OptimizerState) -> dict[str, Any]:
        """The T5X state dict (empty dicts of optax sub-states dropped, as for ``OptaxWrapper``)."""
        sd = super().state_dict(target, state)
        return {"target": sd["target"], "state": _state.drop_empty_dicts(sd["state"])}

    def set_param_axes(self, param_logical_axes: Any) -> None:
        """Passes each sub-optimizer the logical axes of its subset (for Adafactor factor rules)."""
        split = self._split(param_logical_axes, is_leaf=_is_spec)
        leaves = split.treedef.flatten_up_to(param_logical_axes)
        for i, opt in enumerate(self.sub_optimizers):
            opt.set_param_axes(split.subtree(i, leaves))

    def derive_logical_axes(self, optimizer: Optimizer, param_logical_axes: Any) -> Optimizer:
        """Each sub-optimizer's logical axes for its subset, in this optimizer's state layout."""
        target = optimizer.target
        split = self._split(target)
        leaves = split.treedef.flatten_up_to(target)
        axes = _axes_for(split.names, param_logical_axes)
        sub_states = self._sub_states(split, optimizer.state.param_states)
        derived = []
        for i, opt in enumerate(self.sub_optimizers):
            sub_target = split.subtree(i, leaves)
            sub_opt = Optimizer(opt, OptimizerState(optimizer.state.step, sub_states[i]), sub_target)
            derived.append(opt.derive_logical_axes(sub_opt, split.subtree(i, axes)).state.param_states)
        return Optimizer(self, OptimizerState(None, self._merge_states(split, derived)), param_logical_axes)
