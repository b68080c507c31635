"""``OptaxWrapper``, ``wrap_optax_optimizer`` and the wrapped optax aliases of ``t5x.optimizers``.

The optax transformation runs on the target itself (``param_states`` is
``tx.init(target)``, exactly T5X's state, and masks or labels written against
the target's tree see it), one step through :func:`treeopt.step.flat_step`:
traced inline under ``jax.jit``, one compiled program (cached per
transformation and shapes) when called eagerly.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from treeopt.hyperparams import get_hyperparams, set_hyperparams
from treeopt.internal import checked_value, placed_like
from treeopt.step import flat_step
from treeopt.t5x import _partition_rules, _state
from treeopt.t5x._base import Optimizer, OptimizerDef, OptimizerState, check_grads
from treeopt.t5x._zero import zero_sharded


@struct.dataclass
class _OptaxWrapperHyperParams:
    """The hyper params of an :class:`OptaxWrapper`: ``learning_rate`` (``None``: as built).

    T5X's trainer passes ``learning_rate=`` to every ``apply_gradient``; T5X
    drops it, and so does ``treeopt.t5x`` unless the optimizer was built with
    ``honor_learning_rate=True``.

    Example:
        >>> _OptaxWrapperHyperParams().replace(learning_rate=0.1)
        _OptaxWrapperHyperParams(learning_rate=0.1)
    """

    learning_rate: float | None = None


_OVERRIDABLE = ("learning_rate",)


_LEARNING_RATE = np.float32(0.0)  # the dtype and shape a learning rate override takes


def _learning_rate(value: Any) -> jax.Array:
    """``value`` checked and converted like a core hyperparameter: a float32 scalar.

    ``None``, strings, bools, complex numbers, arrays of another shape, NaN and
    infinities raise an error naming ``learning_rate``.
    """
    return checked_value("learning_rate", _LEARNING_RATE, value)


def _learning_rate_step(
    factory: Callable[..., optax.GradientTransformation], bound: inspect.BoundArguments
) -> optax.GradientTransformation:
    """``factory(*bound)`` with its ``learning_rate`` taken from the state: ``(learning_rate, inner state)``.

    The constructor runs inside the traced update (as ``optax.inject_hyperparams``
    does), so the value is an argument of the compiled step: a new one never
    recompiles. A schedule built in is replaced by a constant one, which keeps
    the state's structure (and the schedule's count).
    """
    scheduled = callable(bound.arguments.get("learning_rate"))

    def build(learning_rate: Any) -> optax.GradientTransformation:
        arguments = dict(bound.arguments)
        arguments["learning_rate"] = (lambda count: learning_rate) if scheduled else learning_rate
        call = inspect.BoundArguments(bound.signature, arguments)
        return factory(*call.args, **call.kwargs)

    def init(params: Any) -> Any:
        return jnp.zeros((), jnp.float32), build(jnp.zeros((), jnp.float32)).init(params)

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        learning_rate, inner = state
        updates, inner = build(learning_rate).update(updates, inner, params)
        return updates, (learning_rate, inner)

    return optax.GradientTransformation(init, update)


class OptaxWrapper(OptimizerDef):
    """An optax ``GradientTransformation`` as a T5X ``OptimizerDef``.

    ``state.param_states`` is ``optax_optimizer.init(target)``, as in T5X; the
    state dict leaves out the empty dicts of ``optax.EmptyState`` /
    ``optax.MaskedNode`` and ``restore_state`` puts them back.

    ``apply_gradient(grads, learning_rate=lr)`` is ignored by default, as T5X
    ignores it (its trainer passes its schedule's value to every step, while
    the optax optimizer follows the learning rate or schedule it was built
    with): one warning per optimizer says so. With ``honor_learning_rate=True``
    ``lr`` sets the step size instead: for the wrappers from
    :func:`wrap_optax_optimizer` (all the aliases) by re-running the
    constructor with ``lr``; for a transformation wrapped directly, when it was
    built with ``optax.inject_hyperparams``; otherwise the value is ignored
    with a warning. ``lr=None`` means "as built".

    Args:
        optax_optimizer: the optax transformation, as in T5X.
        honor_learning_rate: use the ``learning_rate`` passed to
            ``apply_gradient`` (T5X's trainer passes its schedule's value)
            instead of ignoring it as T5X does.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> opt = OptaxWrapper(optax.sgd(0.1, momentum=0.9)).create({"w": jnp.zeros(2)})
        >>> opt = opt.apply_gradient({"w": jnp.ones(2)})
        >>> opt.target["w"]
        Array([-0.1, -0.1], dtype=float32)
        >>> opt.state.param_states[0]
        TraceState(trace={'w': Array([1., 1.], dtype=float32)})
    """

    def __init__(
        self,
        optax_optimizer: optax.GradientTransformation,
        *,
        honor_learning_rate: bool = False,
    ):
        if not (
            callable(getattr(optax_optimizer, "init", None))
            and callable(getattr(optax_optimizer, "update", None))
        ):
            raise TypeError(
                "OptaxWrapper needs an optax.GradientTransformation such as optax.adam(1e-3), got "
                f"{type(optax_optimizer).__name__}; to wrap a constructor use wrap_optax_optimizer."
            )
        self.optax_optimizer = optax_optimizer
        self.constructor: (
            tuple[Callable[..., optax.GradientTransformation], inspect.BoundArguments] | None
        ) = None
        """The optax constructor that built ``optax_optimizer`` and its bound arguments, with a
        ``learning_rate`` (set by :func:`wrap_optax_optimizer`): a learning rate is set by building
        it again with another value. ``None`` for a transformation wrapped directly."""
        self.honor_learning_rate = bool(honor_learning_rate)
        self._with_learning_rate: optax.GradientTransformation | None = None
        self._warned = False
        super().__init__(hyper_params=_OptaxWrapperHyperParams())

    def __repr__(self) -> str:
        factory = self.constructor[0] if self.constructor is not None else None
        name = getattr(factory, "__name__", None) or type(self.optax_optimizer).__name__
        return f"OptaxWrapper({name})"

    # -- hyper params --------------------------------------------------------------------

    def update_hyper_params(self, **hyper_param_overrides: Any) -> _OptaxWrapperHyperParams:
        """The hyper params of one step; only ``learning_rate`` (and ``hyper_params=``) may be given.

        An unknown name raises ``TypeError`` naming the known ones; a value
        that is not a real, finite scalar raises ``TypeError``/``ValueError``
        naming ``learning_rate``, as setting a core hyperparameter does.

        Example:
            >>> import optax
            >>> OptaxWrapper(optax.sgd(0.1)).update_hyper_params(learning_rate=0.5)
            _OptaxWrapperHyperParams(learning_rate=0.5)
        """
        hyper_params = hyper_param_overrides.pop("hyper_params", self.hyper_params)
        if not isinstance(hyper_params, _OptaxWrapperHyperParams):
            raise TypeError(
                "hyper_params= of an optax optimizer must be its hyper params "
                "(optimizer_def.hyper_params.replace(learning_rate=...)), got "
                f"{type(hyper_params).__name__}."
            )
        unknown = sorted(set(hyper_param_overrides) - set(_OVERRIDABLE))
        if unknown:
            raise TypeError(
                f"apply_gradient got unknown hyper param override(s) {unknown}; an optax optimizer "
                f"takes {list(_OVERRIDABLE)} (or hyper_params=...). Other optax hyperparameters are "
                "set where the optimizer is built."
            )
        if hyper_param_overrides:
            hyper_params = hyper_params.replace(**hyper_param_overrides)  # type: ignore[attr-defined]
        if hyper_params.learning_rate is not None:
            _learning_rate(hyper_params.learning_rate)
        return hyper_params

    # -- state ----------------------------------------------------------------------------

    def init_state(self, params: Any) -> OptimizerState:
        """``OptimizerState(step=0, param_states=optax_optimizer.init(params))``, as T5X builds it."""
        return OptimizerState(step=0, param_states=self.optax_optimizer.init(params))

    def state_dict(self, target: Any, state: OptimizerState) -> dict[str, Any]:
        """The T5X state dict, without the empty dicts of ``EmptyState``/``MaskedNode``."""
        sd = super().state_dict(target, state)
        return {"target": sd["target"], "state": _state.drop_empty_dicts(sd["state"])}

    # -- update ---------------------------------------------------------------------------

    def apply_gradient(self, hyper_params: Any, params: Any, state: OptimizerState, grads: Any) -> Any:
        """One optax step: returns ``(new_params, new_state)``; see the class doc for ``learning_rate``."""
        learning_rate = getattr(hyper_params, "learning_rate", None)
        tx, opt_state, wrapped = self.optax_optimizer, state.param_states, False
        if learning_rate is not None:
            learning_rate = _learning_rate(learning_rate)  # a bad value is an error, honoured or not
        if learning_rate is not None and not self.honor_learning_rate:
            self._warn_ignored(
                "as T5X ignores it: the optax optimizer follows the learning rate or schedule it was "
                "built with. To use it instead, build the optimizer with honor_learning_rate=True "
                "(e.g. treeopt.t5x.optimizers.adamw(..., honor_learning_rate=True), or "
                "OptaxWrapper(tx, honor_learning_rate=True))."
            )
        elif learning_rate is not None:
            if self.constructor is not None:
                tx, opt_state, wrapped = (
                    self._learning_rate_transformation(),
                    (learning_rate, opt_state),
                    True,
                )
            elif "learning_rate" in get_hyperparams(opt_state):
                opt_state = set_hyperparams(opt_state, {"learning_rate": learning_rate})
            else:
                self._warn_ignored(
                    "the wrapped optax transformation has no learning rate to set. Build it with a "
                    "wrapped constructor such as treeopt.t5x.optimizers.adamw(...) (or "
                    "wrap_optax_optimizer(optax.adamw)(...)), or with optax.inject_hyperparams, to "
                    "make it count."
                )
        check_grads(params, grads, per_example=True)
        out = flat_step(tx, state.step, opt_state, grads, params)
        new_state = out.opt_state[1] if wrapped else out.opt_state
        # The target keeps its layout (under explicit axes a ZeRO-split state would pass its own on).
        return placed_like(out.output, params), OptimizerState(step=out.step, param_states=new_state)

    def _learning_rate_transformation(self) -> optax.GradientTransformation:
        # One object per wrapper: flat_step compiles once per transformation object.
        if self._with_learning_rate is None:
            assert self.constructor is not None
            self._with_learning_rate = _learning_rate_step(*self.constructor)
        return self._with_learning_rate

    def _warn_ignored(self, why: str) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"The learning_rate passed to apply_gradient of {self!r} is ignored, {why}",
            UserWarning,
            stacklevel=4,
        )

    # -- partitioning ---------------------------------------------------------------------

    @zero_sharded
    def derive_logical_axes(self, optimizer: Optimizer, param_logical_axes: Any) -> Optimizer:
        """An :class:`Optimizer` of logical specs for ``optimizer``, shaped as T5X shapes it.

        ``target`` holds ``param_logical_axes`` (in the target's containers),
        ``step`` is ``None``, ``param_states`` is the optax state with a spec at
        each per-parameter entry (the param's, or without its reduced axes for
        factored entries) and ``None`` elsewhere. Works for every optax state.

        With ``shard_state_over`` (a logical axis name that ``logical_axis_rules``
        map to the data-parallel mesh axis, e.g. T5X's ``'batch'``) and ``mesh``,
        each per-parameter state leaf also gets that name on the largest
        dimension not sharded already whose size the axis divides (ZeRO-1): see
        ``docs/sharding.md``. ``logical_axis_rules`` default to flax's active
        ``axis_rules`` context.

        Example:
            >>> import jax, jax.numpy as jnp
            >>> from jax.sharding import PartitionSpec as P
            >>> from treeopt.t5x import optimizers
            >>> opt_def = optimizers.adam(1e-3)
            >>> opt = jax.eval_shape(opt_def.create, {"w": jnp.ones((2, 3))})
            >>> axes = opt_def.derive_logical_axes(opt, {"w": P("embed", "mlp")})
            >>> axes.state.param_states[0].mu == {"w": P("embed", "mlp")}, axes.state.step
            (True, None)
        """
        _partition_rules.check_logical_axes(optimizer.target, param_logical_axes)
        shapes = _partition_rules.shapes_of(optimizer.target)
        param_states = _partition_rules.state_axes(optimizer.state.param_states, param_logical_axes, shapes)
        target = _partition_rules.axes_like(optimizer.target, param_logical_axes)
        axes = optimizer.replace(state=OptimizerState(step=None, param_states=param_states), target=target)
        return axes


# -- wrap_optax_optimizer and the aliases ------------------------------------------------------


def wrap_optax_optimizer(
    optax_optimizer: Callable[..., optax.GradientTransformation],
) -> Callable[..., OptaxWrapper]:
    """An optax constructor turned into one that returns an :class:`OptaxWrapper`.

    Same signature, plus the keyword ``honor_learning_rate`` (default False):
    whether ``apply_gradient(grads, learning_rate=...)`` sets the step size
    (by re-running the constructor with it) or is ignored, as in T5X.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> sgd = wrap_optax_optimizer(optax.sgd)
        >>> opt = sgd(learning_rate=1.0, honor_learning_rate=True).create({"w": jnp.zeros(2)})
        >>> opt.apply_gradient({"w": jnp.ones(2)}, learning_rate=0.5).target["w"]
        Array([-0.5, -0.5], dtype=float32)
    """
    try:
        signature: inspect.Signature | None = inspect.signature(optax_optimizer)
    except (TypeError, ValueError):
        signature = None

    @functools.wraps(optax_optimizer)
    def wrapped_optimizer(*args: Any, honor_learning_rate: bool = False, **kwargs: Any) -> OptaxWrapper:
        wrapper = OptaxWrapper(optax_optimizer(*args, **kwargs), honor_learning_rate=honor_learning_rate)
        if signature is not None and "learning_rate" in signature.parameters:
            bound = signature.bind(*args, **kwargs)
            bound.arguments.setdefault("learning_rate", signature.parameters["learning_rate"].default)
            wrapper.constructor = (optax_optimizer, bound)
        return wrapper

    if signature is not None:  # what gin and inspect see: optax's arguments and the opt-in
        opt_in = inspect.Parameter("honor_learning_rate", inspect.Parameter.KEYWORD_ONLY, default=False)
        parameters = list(signature.parameters.values())
        at = next(
            (i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.VAR_KEYWORD), len(parameters)
        )
        wrapped_optimizer.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[*parameters[:at], opt_in, *parameters[at:]], return_annotation=OptaxWrapper
        )
    return wrapped_optimizer


def _chain(transformations: Sequence[optax.GradientTransformation]) -> optax.GradientTransformation:
    """``optax.chain(*transformations)`` of a sequence (T5X's signature, so gin can bind it)."""
    if isinstance(transformations, optax.GradientTransformation):
        raise TypeError(
            "chain takes one sequence of transformations, e.g. chain([optax.clip(1.0), optax.adam(1e-3)]), "
            "got a single transformation."
        )
    return optax.chain(*transformations)


def _alias(factory: Callable[..., Any], name: str, example_args: str) -> Callable[..., OptaxWrapper]:
    wrapped = wrap_optax_optimizer(factory)
    wrapped.__name__ = wrapped.__qualname__ = name
    wrapped.__module__ = "treeopt.t5x.optimizers"
    wrapped.__doc__ = (
        f"optax ``{name}`` as a T5X ``OptimizerDef`` (an ``OptaxWrapper``); same arguments.\n\n"
        "Example:\n"
        "    >>> import jax, jax.numpy as jnp, optax\n"
        "    >>> from treeopt.t5x import optimizers\n"
        f"    >>> opt = optimizers.{name}({example_args}).create({{'w': jnp.ones((2, 3))}})\n"
        "    >>> int(opt.state.step)\n"
        "    0\n"
    )
    return wrapped


def _dpsgd_factory() -> Callable[..., Any]:
    contrib = getattr(optax, "contrib", None)
    dpsgd = getattr(contrib, "dpsgd", None) or optax.dpsgd

    # optax's dpsgd takes only seed= and passes it on to its own aggregate,
    # which deprecates seed= for key=: a warning no caller can act on.
    @functools.wraps(dpsgd)
    def quiet_dpsgd(*args: Any, **kwargs: Any) -> optax.GradientTransformation:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message='"seed" is deprecated', category=DeprecationWarning)
            return dpsgd(*args, **kwargs)

    return quiet_dpsgd


# The aliases of t5x.optimizers ...
chain = _alias(_chain, "chain", "[optax.clip(1.0), optax.sgd(0.1)]")
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
# ... and more optax optimizers (optax.adafactor is left out: `adafactor` is T5X's legacy module).
adadelta = _alias(optax.adadelta, "adadelta", "learning_rate=1.0")
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
