"""treeopt.Optimizer: a PyTree that holds its own optax state."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.tree_util import GetAttrKey

from treeopt import _state_dict
from treeopt import hyperparams as _hyperparams
from treeopt._deprecated import moved_names
from treeopt._donated import donated, refuse_donated
from treeopt._extra_args import as_optax_extra_args
from treeopt._paths import is_nnx_graph, is_nnx_object
from treeopt._state_specs import optimizer_state_specs
from treeopt._trace_guard import (
    CAPTURED,
    concrete_or_eager_autodiff,
    is_tracer,
    refuse_capture,
    refuse_foreign_trace,
    strong,
)
from treeopt.layout import ParamLayout, Wrt, is_lookahead
from treeopt.step import flat_step, stable_dtypes
from treeopt.typing import Params, ParamSpecs, StateDict, Updates

__all__ = ["Optimizer"]

__getattr__ = moved_names(__name__, {"FlatStep": "treeopt.step"})

_FIELDS = ("tx", "wrt", "_layout", "_lookahead", "step", "opt_state")


def _as_transformation(tx: Any) -> optax.GradientTransformation:
    if isinstance(tx, optax.MultiSteps):
        return tx.gradient_transformation()
    if isinstance(tx, optax.GradientTransformation):
        return tx
    hint = ""
    if callable(tx):
        hint = " It is callable: did you pass the factory instead of calling it, e.g. optax.adam(1e-3)?"
    raise TypeError(
        "Optimizer(tx) needs an optax.GradientTransformation such as optax.adam(1e-3), "
        f"got {type(tx).__name__}.{hint}"
    )


class Optimizer:
    """An optax optimizer that is a PyTree holding its own state.

    ``tx`` and the parameter names are static; ``step`` and ``opt_state`` are the
    leaves. Pass it through ``jax.jit`` (or ``vmap``) like any other state and
    return it; ``update`` changes its state in place and returns new params.

    Args:
        tx: the optax transformation (an ``optax.MultiSteps`` is accepted too).
        wrt: which leaves are trained; of the leaves selected by a glob or an
            nnx filter, the floating-point arrays.

            - ``None`` (default): every floating-point array leaf, except those
              held by an nnx ``Variable`` other than ``nnx.Param``. So an nnx
              Module or State trains its ``nnx.Param`` only (not BatchNorm
              statistics, RNG state, caches), like ``nnx.Optimizer(wrt=nnx.Param)``.
            - a string: a glob over parameter names (``"encoder/*"``); a list or
              tuple of strings: any of the globs.
            - an nnx filter: a class (``nnx.Param``, ``nnx.BatchStat``), ``...``,
              or an object of ``flax.nnx.filterlib`` (``nnx.PathContains``,
              ``nnx.Any``, ``nnx.All``, ``nnx.Not``, ``nnx.WithTag``), called as
              nnx calls it, with the nnx path and the ``Variable``.
            - any other callable: a predicate ``(name, leaf) -> bool`` on the
              parameter name and the raw array. Wrap an nnx-style
              ``(path, variable)`` function in ``nnx.Any(fn)`` to have it read
              as an nnx filter.
            - a list or tuple mixing these: a leaf any of them selects.

    Example:
        >>> import jax, jax.numpy as jnp, optax, treeopt
        >>> params = {"w": jnp.ones(3), "b": jnp.zeros(3)}
        >>> opt = treeopt.Optimizer(optax.sgd(0.1)).init(params)
        >>> @jax.jit
        ... def train_step(params, opt):
        ...     grads = jax.grad(lambda p: jnp.sum(p["w"] * 2 + p["b"]))(params)
        ...     params = opt.update(grads, params)
        ...     return params, opt
        >>> params, opt = train_step(params, opt)
        >>> params["w"], int(opt.step)
        (Array([0.8, 0.8, 0.8], dtype=float32), 1)

        An nnx Module trains its ``nnx.Param`` by default; ``wrt`` takes nnx filters:

        >>> from flax import nnx
        >>> model = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
        >>> treeopt.Optimizer(optax.sgd(0.1)).init(model).paths
        ('bias', 'scale')
        >>> treeopt.Optimizer(optax.sgd(0.1), wrt=(nnx.Param, nnx.BatchStat)).init(model).paths
        ('bias', 'mean', 'scale', 'var')
    """

    __slots__ = _FIELDS

    tx: optax.GradientTransformation
    """The optax transformation the optimizer applies (static: part of the jit cache key).

    An ``optax.GradientTransformationExtraArgs`` is kept as is; a plain
    ``GradientTransformation`` is wrapped to accept extra arguments, so this
    may be another object than the one given.

    Example: ``opt.tx.update(grads, opt.opt_state, params)`` is optax's own step.
    """
    wrt: Wrt
    """Which leaves are trained, as given to the constructor (static)."""
    step: jax.Array | None
    """The number of updates applied so far: an int32 scalar array (a leaf), ``None`` before ``init``.

    Save a checkpoint after the update under ``int(opt.step)``: it then holds
    the state after that many updates.

    Example: ``opt.update(grads, params)`` moves ``int(opt.step)`` from 0 to 1.
    """
    opt_state: optax.OptState | None
    """The optax state (leaves), ``None`` before ``init``.

    It is ``tx.init`` of the trained params as a flat dict keyed by parameter
    name, so per-parameter entries read ``opt.opt_state[0].mu["dense/kernel"]``
    for ``optax.adam``. Read it freely; to change it, use ``load_state_dict`` or
    build a new optimizer, so that the step and the names stay consistent.
    """

    def __init__(self, tx: optax.GradientTransformation, wrt: Wrt = None):
        set_ = object.__setattr__
        set_(self, "tx", _as_transformation(tx))
        set_(self, "wrt", tuple(wrt) if isinstance(wrt, list) else wrt)
        set_(self, "_layout", None)
        set_(self, "_lookahead", False)
        set_(self, "step", None)
        set_(self, "opt_state", None)

    # -- pytree ----------------------------------------------------------------

    def _tree_flatten_with_keys(self) -> tuple[Any, Any]:
        aux = (self.tx, self.wrt, self._layout, self._lookahead)
        if self._layout is None:
            return (), aux
        return ((GetAttrKey("step"), self.step), (GetAttrKey("opt_state"), self.opt_state)), aux

    def _tree_flatten(self) -> tuple[Any, Any]:
        aux = (self.tx, self.wrt, self._layout, self._lookahead)
        if self._layout is None:
            return (), aux
        return (self.step, self.opt_state), aux

    @classmethod
    def _tree_unflatten(cls, aux: Any, children: Any) -> Optimizer:
        self = object.__new__(cls)
        set_ = object.__setattr__
        tx, wrt, layout, lookahead = aux
        set_(self, "tx", tx)
        set_(self, "wrt", wrt)
        set_(self, "_layout", layout)
        set_(self, "_lookahead", lookahead)
        step, opt_state = children if layout is not None else (None, None)
        set_(self, "step", step)
        set_(self, "opt_state", opt_state)
        return self

    # -- init --------------------------------------------------------------------

    @property
    def initialized(self) -> bool:
        """Whether ``init`` produced this optimizer (it has state)."""
        return self._layout is not None

    @property
    def paths(self) -> tuple[str, ...]:
        """Names of the trainable parameters, e.g. ``("decoder/layers_0/kernel", ...)``."""
        return self.layout.names

    @property
    def layout(self) -> ParamLayout:
        """Where the trainable leaves of the params are, and their names (static, read-only).

        Raises ``RuntimeError`` before ``init``. Layers built on the core use it to
        flatten and re-nest params as the optimizer does.

        Example:
            >>> import jax.numpy as jnp, optax, treeopt
            >>> opt = treeopt.Optimizer(optax.sgd(0.1)).init({"w": jnp.ones(2), "n": 3})
            >>> opt.layout.names
            ('w',)
        """
        return self._require_layout()

    def init(self, params: Params) -> Optimizer:
        """A new, initialized optimizer for ``params`` (``self`` is left unchanged).

        Example:
            >>> import jax.numpy as jnp, optax, treeopt
            >>> opt = treeopt.Optimizer(optax.adam(1e-3)).init({"dense": {"kernel": jnp.ones((2, 3))}})
            >>> opt.paths, int(opt.step)
            (('dense/kernel',), 0)
        """
        lookahead = is_lookahead(params)
        layout = ParamLayout.of(params.fast if lookahead else params, self.wrt)
        if lookahead:
            flat: Any = optax.LookaheadParams(
                layout.split_params(params.fast)[0], layout.split_params(params.slow)[0]
            )
        else:
            flat = layout.split_params(params)[0]
        opt_state = stable_dtypes(self.tx, jax.tree.map(strong, self.tx.init(flat)), flat, lookahead)
        new = Optimizer._tree_unflatten(
            (self.tx, self.wrt, layout, lookahead), (jnp.zeros((), jnp.int32), opt_state)
        )
        return new

    # -- update ------------------------------------------------------------------

    def update(
        self,
        grads: Updates,
        params: Params = None,
        apply_updates: bool = True,
        **extra_args: Any,
    ) -> Params:
        """Applies one optimizer step: updates the state in place and returns new params.

        The gradients come first: ``params = opt.update(grads, params)``
        (``nnx.Optimizer`` takes them the other way round; an nnx Module where
        the gradients go is an error that says so).

        Args:
            grads: gradients shaped like the params given to ``init``, or any tree
                with the same names (``nnx.grad``'s State for an nnx Module); leaves
                that are not trained may be ``None`` or absent when matched by name.
            params: the current params. Required with ``apply_updates=True`` and by
                transformations that read params (weight decay, lamb, lars, ...).
                An nnx Module is updated in place (its ``Variable``s get the new
                values, as ``nnx.Optimizer.update`` does) and returned.
            apply_updates: return new params (default) or the updates themselves,
                shaped like ``grads``.
            **extra_args: passed to ``tx.update`` (``value=loss`` for
                ``optax.contrib.reduce_on_plateau``; ``value``, ``grad`` and
                ``value_fn`` for ``optax.lbfgs``). A function (``value_fn``) is
                called with params in the structure given here; a tree shaped like
                params or grads (``grad``) is matched by name like ``grads``.

        Returns:
            New params of the same type and structure as ``params``, or the updates.

        Example:
            >>> import jax.numpy as jnp, optax, treeopt
            >>> params = {"w": jnp.ones(2)}
            >>> opt = treeopt.Optimizer(optax.sgd(0.5)).init(params)
            >>> opt.update({"w": jnp.ones(2)}, params)
            {'w': Array([0.5, 0.5], dtype=float32)}
            >>> opt.update({"w": jnp.ones(2)}, apply_updates=False)
            {'w': Array([-0.5, -0.5], dtype=float32)}

            An nnx Module is updated in place:

            >>> from flax import nnx
            >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
            >>> opt = treeopt.Optimizer(optax.sgd(0.5)).init(model)
            >>> grads = nnx.grad(lambda m: m(jnp.ones((1, 2))).sum())(model)
            >>> opt.update(grads, model) is model
            True
            >>> model.bias[...]
            Array([-0.5], dtype=float32)
        """
        inputs = self._flat_inputs(grads, params, apply_updates, extra_args)
        try:
            result = flat_step(
                self.tx,
                self.step,
                self.opt_state,
                inputs.grads,
                inputs.params,
                apply_updates=apply_updates,
                extra_args=inputs.extra_args,
            )
        except RuntimeError:  # checked only once JAX refused: the step itself pays nothing
            refuse_donated(self)
            raise
        if not is_tracer(self.step) and not concrete_or_eager_autodiff(result.step):
            raise RuntimeError(CAPTURED)  # a trace we could not see from the inputs
        object.__setattr__(self, "step", result.step)
        object.__setattr__(self, "opt_state", result.opt_state)
        return inputs.rebuild(result.output)

    def _flat_inputs(
        self, grads: Any, params: Any, apply_updates: bool, extra_args: dict[str, Any]
    ) -> _FlatInputs:
        """The arguments of ``update``, checked and flattened by name, and how to rebuild its result."""
        layout = self._require_layout()
        if apply_updates and params is None:
            raise ValueError(
                "update(grads) with apply_updates=True needs the current params: "
                "call opt.update(grads, params), or opt.update(grads, apply_updates=False) "
                "to get the updates."
            )
        if params is not None and is_nnx_graph(grads) and not is_nnx_graph(params):
            raise TypeError(_swapped_message(grads, params))
        flat_grads, rebuild_grads = layout.split_grads(grads)
        try:
            flat_params, merge_params = self._split_params(params)
        except ValueError:
            if is_nnx_object(grads) and jax.tree.structure(grads) == layout.treedef:
                raise TypeError(_swapped_message(grads, params)) from None
            raise
        if extra_args:
            extra_args = as_optax_extra_args(extra_args, grads, params, layout, lookahead=self._lookahead)
        if is_tracer(self.step):
            refuse_foreign_trace(self.step)
        else:
            refuse_capture((flat_grads, flat_params, extra_args))

        def rebuild(out: Any) -> Any:
            if apply_updates:
                return merge_params(out)
            if self._lookahead:
                return optax.LookaheadParams(rebuild_grads(out.fast), rebuild_grads(out.slow))
            return rebuild_grads(out)

        return _FlatInputs(flat_grads, flat_params, extra_args, rebuild)

    def _split_params(self, params: Any) -> tuple[Any, Any]:
        """``(flat params for tx.update, merge)``; ``merge(flat)`` rebuilds params of the given type."""
        if params is None:
            return None, None
        layout = self._require_layout()
        if not self._lookahead:
            if is_nnx_graph(params):  # an nnx Module: updated in place, as nnx.Optimizer does
                return layout.split_module(params)
            return layout.split_params(params)
        if not is_lookahead(params):
            raise TypeError(
                "This optimizer was initialized with optax.LookaheadParams; pass params "
                f"of that type to update, got {type(params).__name__}."
            )
        fast, rebuild_fast = layout.split_params(params.fast)
        slow, rebuild_slow = layout.split_params(params.slow)

        def merge(flat: Any) -> Any:
            return optax.LookaheadParams(rebuild_fast(flat.fast), rebuild_slow(flat.slow))

        return optax.LookaheadParams(fast, slow), merge

    # -- hyperparameters ----------------------------------------------------------

    @property
    def hyperparams(self) -> dict[str, Any]:
        """The injected hyperparameters (``optax.inject_hyperparams``) by name.

        Example:
            >>> import jax.numpy as jnp, optax, treeopt
            >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
            >>> opt = treeopt.Optimizer(tx).init({"w": jnp.ones(2)})
            >>> opt.learning_rate = 0.01      # next step uses it, no recompilation
            >>> round(float(opt.hyperparams["learning_rate"]), 6)
            0.01
        """
        self._require_layout()
        return _hyperparams.get_hyperparams(self.opt_state)

    def set_hyperparams(self, values: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        """Sets injected hyperparameters in place; qualified names (``"decay/learning_rate"``) allowed.

        Example:
            >>> import jax.numpy as jnp, optax, treeopt
            >>> tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
            >>> opt = treeopt.Optimizer(tx).init({"w": jnp.ones(2)})
            >>> opt.set_hyperparams(learning_rate=0.05, b1=0.8)
            >>> round(float(opt.b1), 3)
            0.8
        """
        self._require_layout()
        merged = {**(values or {}), **kwargs}
        new_state = _hyperparams.set_hyperparams(self.opt_state, merged)
        object.__setattr__(self, "opt_state", new_state)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: hyperparameters read as attributes.
        if name.startswith("_") or object.__getattribute__(self, "_layout") is None:
            raise AttributeError(f"'Optimizer' object has no attribute '{name}'")
        found = _hyperparams.get_hyperparams(object.__getattribute__(self, "opt_state"))
        if name in found:
            return found[name]
        raise AttributeError(
            f"'Optimizer' object has no attribute or injected hyperparameter '{name}'"
            + (f" (hyperparameters: {sorted(found)})" if found else "")
        )

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FIELDS:
            raise AttributeError(
                f"Optimizer.{name} is managed by the optimizer; use init/update/load_state_dict."
            )
        self.set_hyperparams({name: value})

    # -- serialization (state_dict / load_state_dict) ------------------------------

    def state_dict(self) -> StateDict:
        """The state as nested plain dicts of arrays, keyed by parameter name.

        ``{"step": ..., "opt_state": ...}``; ``opt_state`` is the optax state as
        ``flax.serialization.to_state_dict`` writes it (NamedTuple fields and chain
        positions as keys), typed PRNG keys as their ``uint32`` key data. See
        ``docs/serialization.md``.

        Example:
            >>> import jax.numpy as jnp, optax, treeopt
            >>> opt = treeopt.Optimizer(optax.adam(1e-3)).init({"dense": {"kernel": jnp.ones(2)}})
            >>> sd = opt.state_dict()
            >>> sd["opt_state"]["0"]["mu"]
            {'dense/kernel': Array([0., 0.], dtype=float32)}
        """
        refuse_donated(self)
        return _state_dict.state_dict(self)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Optimizer:
        """A new optimizer like this one, with its state from ``state_dict`` (``self`` is unchanged).

        Leaves are matched by path (state field and parameter name), never by
        position. ``strict=True`` raises ``treeopt.serialization.StateDictError``
        listing every missing, unexpected and shape/dtype-mismatched path.
        ``strict=False`` loads the paths that match, keeps this optimizer's values
        for the others and emits a ``treeopt.serialization.StateDictWarning``
        listing them (its ``.report`` holds them as data). Values are placed on
        the shardings of this optimizer's leaves; ``self`` may be abstract
        (``jax.eval_shape(opt.init, params)``).

        Example:
            >>> import jax.numpy as jnp, optax, treeopt
            >>> opt = treeopt.Optimizer(optax.adam(1e-3)).init({"w": jnp.ones(2)})
            >>> opt.update({"w": jnp.ones(2)}, apply_updates=False)["w"].shape
            (2,)
            >>> restored = treeopt.Optimizer(optax.adam(1e-3)).init({"w": jnp.ones(2)})
            >>> restored = restored.load_state_dict(opt.state_dict())
            >>> int(restored.step)
            1
        """
        return _state_dict.load_state_dict(self, state_dict, strict=strict)

    # -- partitioning (partition_specs) --------------------------------------------

    def partition_specs(
        self,
        param_specs: ParamSpecs,
        *,
        shard_state_over: str | Sequence[str] | None = None,
        mesh: jax.sharding.Mesh | None = None,
    ) -> Optimizer:
        """A ``PartitionSpec`` for every leaf of this optimizer, from the params' specs.

        Works for any optax transformation, with no table of state types: a
        state leaf shaped like its param gets the param's spec; a factored leaf
        (Adafactor ``v_row``/``v_col``, SM3 per-dimension accumulators) gets it
        with the reduced axes dropped; counts, scalars, RNG keys,
        hyperparameters and ``(1,)`` placeholders get ``P()``. Also works on an
        abstract optimizer from ``jax.eval_shape(opt.init, params)``.

        With ``shard_state_over`` (ZeRO-1) every floating-point state leaf that
        belongs to a parameter also gets those mesh axes, on its largest
        dimension that is not sharded yet and that their size divides; a leaf
        that already uses them (FSDP), or has no such dimension, keeps its spec.
        :func:`treeopt.partitioning.zero_report` lists what was split and why
        the rest was not.

        Args:
            param_specs: a tree shaped like the params given to ``init`` (or the
                flat ``{name: spec}`` dict), with a ``PartitionSpec`` (mesh axes or
                logical axis names) or ``None`` (replicated) at each parameter.
            shard_state_over: a mesh axis name, or a tuple of them, to split the
                state over as well (the data-parallel axis); ``None`` (the
                default) lays the state out exactly like the params.
            mesh: the ``jax.sharding.Mesh``; needed with ``shard_state_over``
                (its axis sizes decide what divides). When given, the specs'
                axes are checked against it.

        Returns:
            An Optimizer-shaped tree (same static data) whose leaves are
            ``PartitionSpec``s: ``P()`` for ``step``, then one per state leaf.
            Use it (or :func:`treeopt.partitioning.named_shardings` of it) as
            ``in_shardings``/``out_shardings`` of ``jax.jit``, for this optimizer
            (or one over the same ``tx`` object: jit compares the static data).

        Example:
            >>> import jax, jax.numpy as jnp, numpy as np, optax, treeopt
            >>> from jax.sharding import Mesh, PartitionSpec as P
            >>> params = {"dense": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)}}
            >>> opt = treeopt.Optimizer(optax.adafactor(1e-2, min_dim_size_to_factor=2)).init(params)
            >>> specs = opt.partition_specs({"dense": {"kernel": P("data", "model"), "bias": P("model")}})
            >>> tuple(specs.opt_state[0].v_row["dense/kernel"]), tuple(specs.opt_state[0].v_col["dense/kernel"])
            (('data',), ('model',))
            >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
            >>> opt = treeopt.Optimizer(optax.adam(1e-3)).init(params)
            >>> zero = opt.partition_specs({"dense": {"kernel": P(None, "model"), "bias": P()}},
            ...                            shard_state_over="data", mesh=mesh)
            >>> zero.opt_state[0].mu["dense/kernel"], zero.opt_state[0].mu["dense/bias"], zero.opt_state[0].count
            (P('data', 'model'), P('data',), P())
        """
        layout = self._require_layout()
        state = optimizer_state_specs(
            self.opt_state, layout, param_specs, shard_state_over=shard_state_over, mesh=mesh
        )
        return Optimizer._tree_unflatten(
            (self.tx, self.wrt, layout, self._lookahead), (jax.sharding.PartitionSpec(), state)
        )

    # -- misc ----------------------------------------------------------------------

    def __reduce__(self) -> tuple[Any, ...]:
        # copy.copy / deepcopy / pickle rebuild through the pytree path, since
        # plain attribute assignment is reserved for hyperparameters.
        children, aux = self._tree_flatten()
        return Optimizer._tree_unflatten, (aux, children)

    def _require_layout(self) -> ParamLayout:
        layout = self._layout
        if layout is None:
            raise RuntimeError(
                "This Optimizer is not initialized: call `opt = opt.init(params)` first "
                "(init returns a new optimizer; it does not change the one it is called on)."
            )
        return layout

    def __repr__(self) -> str:
        if self._layout is None:
            return f"Optimizer(tx={_tx_name(self.tx)}, initialized=False)"
        step = self.step
        step_text = "traced" if is_tracer(step) else "donated" if donated(step) else str(jax.device_get(step))
        return f"Optimizer(tx={_tx_name(self.tx)}, step={step_text}, params={len(self._layout.names)})"


class _FlatInputs(NamedTuple):
    """What ``update`` hands the pure step, and how it turns the step's output into its result."""

    grads: Any
    params: Any
    extra_args: dict[str, Any]
    rebuild: Callable[[Any], Any]


def _swapped_message(grads: Any, params: Any) -> str:
    def what(x: Any) -> str:
        if is_nnx_graph(x):
            return f"the nnx Module {type(x).__name__}"
        if is_nnx_object(x):
            return f"an nnx {type(x).__name__}"
        return f"a {type(x).__name__}"

    return (
        "Optimizer.update takes the gradients first and the params second:\n"
        "    params = opt.update(grads, params)\n"
        "or, for an nnx Module (updated in place, as nnx.Optimizer does):\n"
        "    opt.update(grads, model)\n"
        f"It received {what(grads)} where the gradients go and {what(params)} where the params go: "
        "that is nnx.Optimizer's order, optimizer.update(model, grads). Swap the two arguments."
    )


def _tx_name(tx: optax.GradientTransformation) -> str:
    init = getattr(tx, "init", None)
    qualname = getattr(init, "__qualname__", "")
    return qualname.split(".<locals>")[0] or type(tx).__name__


jax.tree_util.register_pytree_with_keys(
    Optimizer,
    Optimizer._tree_flatten_with_keys,
    Optimizer._tree_unflatten,
    Optimizer._tree_flatten,
)
