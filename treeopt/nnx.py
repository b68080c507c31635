"""A drop-in for ``flax.nnx.Optimizer`` and ``nnx.ModelAndOptimizer``, on :class:`treeopt.Optimizer`.

Swap the name and nothing else changes::

    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)          # before
    optimizer = treeopt.nnx.Optimizer(model, tx, wrt=nnx.Param)  # after

The constructor, ``update(model, grads, **kwargs)`` (the model updated in
place, the updates returned), ``step``, ``opt_state``, ``nnx.jit``,
``nnx.split`` / ``nnx.merge``, ``nnx.state`` and ``nnx.cached_partial`` work
as with nnx. The optimizer is an nnx ``Pytree`` holding one
:class:`treeopt.Optimizer` as ``treeopt``, an ``nnx.OptState`` per array; it
has no optimizer logic of its own, so treeopt's features come with it:
``opt.learning_rate = x`` with no recompilation, ``state_dict()`` keyed by
parameter name, ``partition_specs`` (ZeRO-1 with ``shard_state_over=``), and
checkpoints through :mod:`treeopt.serialization`.

Example:
    >>> import jax.numpy as jnp, optax, treeopt.nnx
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> optimizer = treeopt.nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    >>> @nnx.jit
    ... def train_step(model, optimizer, x, y):
    ...     loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    ...     optimizer.update(model, grads)
    ...     return loss
    >>> losses = [float(train_step(model, optimizer, jnp.ones((4, 2)), jnp.zeros((4, 1)))) for _ in range(3)]
    >>> losses[2] < losses[0], int(optimizer.step[...]), optimizer.paths
    (True, 3, ('bias', 'kernel'))
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import flax
import jax
import optax
from flax import nnx
from jax.sharding import PartitionSpec

from treeopt.internal import (
    STATE_VIEWS,
    flat_param_specs,
    hyperparameter_attribute,
    placed_like,
    placements,
    sets_hyperparameter,
    state_views,
    with_state_views,
)
from treeopt.optimizer import Optimizer as CoreOptimizer
from treeopt.partitioning import named_shardings, param_specs_of
from treeopt.typing import OptState, ParamSpecs, StateDict, Updates

__all__ = ["ModelAndOptimizer", "Optimizer"]

M = TypeVar("M")

_OWN = frozenset({"treeopt", "tx", "wrt", "graph", "model", "placements", "optimizer_sharding"})
# One compiled program eagerly, not an op per leaf; inside a jit it is inlined (the same arithmetic).
_apply_updates = jax.jit(optax.apply_updates)


class Optimizer(nnx.Pytree, Generic[M]):
    """``nnx.Optimizer(model, tx, wrt=...)`` on a :class:`treeopt.Optimizer`: same constructor, same ``update``.

    The state is ``treeopt``, which holds the :class:`treeopt.Optimizer`
    trained on ``nnx.state(model, wrt)`` as ``nnx.Optimizer`` holds its state,
    an ``nnx.OptState`` per array (:class:`HeldOptimizer`): read it
    with ``optimizer.treeopt.get_value()`` (``.value`` on flax 0.12.0) and replace it (a restored
    checkpoint, a sharded copy) with ``optimizer.treeopt.set_value(...)``.

    Args:
        model: the nnx Module whose ``wrt`` variables are trained.
        tx: the optax transformation.
        wrt: an nnx filter (``nnx.Param``, ``(nnx.Param, nnx.LoRAParam)``,
            ``nnx.PathContains(...)``, ...), read as nnx reads it; required, as
            in nnx. It must select at least one variable of ``model``.
        graph: as ``nnx.Optimizer``'s: graph mode (``True``), tree mode
            (``False``), or the current ``nnx.set_graph_mode`` (``None``).
        **kwargs: passed to :class:`treeopt.Optimizer` (its options beyond ``tx``).

    Example:
        >>> import jax.numpy as jnp, optax, treeopt.nnx
        >>> from flax import nnx
        >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
        >>> optimizer = treeopt.nnx.Optimizer(model, tx, wrt=nnx.Param)
        >>> grads = nnx.grad(lambda m: m(jnp.ones((1, 2))).sum())(model)
        >>> updates = optimizer.update(model, grads)    # model updated in place
        >>> updates["bias"], model.bias[...]
        (Array([-0.1], dtype=float32), Array([-0.1], dtype=float32))
        >>> optimizer.learning_rate = 0.01              # no recompilation
        >>> sorted(optimizer.state_dict()["opt_state"]["hyperparams"])
        ['learning_rate']
    """

    def __init__(
        self,
        model: M,
        tx: optax.GradientTransformation,
        *,
        wrt: Any,
        graph: bool | None = None,
        **kwargs: Any,
    ):
        _refuse_swapped(model, tx)
        variables = _state(model, wrt, graph=graph)
        params = _as_pure(variables)
        if not jax.tree.leaves(params):
            raise ValueError(_empty_selection_message(model, wrt, graph))
        self.tx = tx
        self.wrt = wrt
        self.graph = graph
        # Where the trained variables live: under auto mesh axes a traced update cannot read it, and the
        # new values would take the layout of the (ZeRO-split) state instead.
        self.placements = placements(params)
        core = CoreOptimizer(tx, **kwargs).init(params)
        self.optimizer_sharding = _optimizer_sharding(variables, core)
        if self.optimizer_sharding:
            core = _laid_out(core, self.optimizer_sharding, params, self.placements)
        self.treeopt = HeldOptimizer(core)

    # -- what nnx.Optimizer has ------------------------------------------------------

    @property
    def step(self) -> nnx.OptState:
        """The number of updates applied, as an ``nnx.OptState`` variable (read it with ``step[...]``).

        A snapshot of the treeopt optimizer's ``step`` (int32; ``nnx.Optimizer``'s is
        uint32): setting it changes nothing.

        Example:
            >>> import jax.numpy as jnp, optax, treeopt.nnx
            >>> from flax import nnx
            >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
            >>> optimizer = treeopt.nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
            >>> _ = optimizer.update(model, nnx.grad(lambda m: m(jnp.ones((1, 2))).sum())(model))
            >>> int(optimizer.step[...])
            1
        """
        return nnx.OptState(self._core().step)

    @property
    def opt_state(self) -> OptState:
        """The optax state, over the flat ``{name: param}`` dict (``opt_state[0].mu["kernel"]`` for adam).

        As ``nnx.Optimizer``'s, each array is an ``nnx.OptState`` variable held
        by this optimizer: ``opt_state.hyperparams["learning_rate"][...] = x``
        sets an injected hyperparameter in place (as ``optimizer.learning_rate = x``
        does), and ``nnx.state(optimizer)`` lists every one of them.

        Example:
            >>> import optax, treeopt.nnx
            >>> from flax import nnx
            >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
            >>> optimizer = treeopt.nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
            >>> optimizer.opt_state[0].mu["kernel"].shape
            (2, 1)
        """
        return self.treeopt.opt_state

    def update(self, model: M, grads: Any, /, **kwargs: Any) -> Updates:
        """One step: updates ``model``'s ``wrt`` variables in place and returns the updates.

        As ``nnx.Optimizer.update``: ``grads`` (from ``nnx.grad``, or a State
        shaped like ``nnx.state(model, wrt)``) are filtered by ``wrt``; keyword
        arguments go to ``tx.update`` (``value``, ``grad``, ``value_fn`` for
        line searches), and a ``value_fn`` is called with an ``nnx.State`` of
        the trained values, as nnx calls it.

        Returns:
            The updates, an ``nnx.State`` of arrays shaped like ``nnx.state(model, wrt)``.

        Example:
            >>> import jax.numpy as jnp, optax, treeopt.nnx
            >>> from flax import nnx
            >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
            >>> optimizer = treeopt.nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
            >>> grads = nnx.grad(lambda m: m(jnp.ones((1, 2))).sum())(model)
            >>> optimizer.update(model, grads)["kernel"]
            Array([[-0.5],
                   [-0.5]], dtype=float32)
        """
        if isinstance(grads, nnx.Pytree) and not isinstance(model, nnx.Pytree):
            raise TypeError(
                "update takes the model first and the gradients second, as nnx.Optimizer does: "
                f"optimizer.update(model, grads); got {type(model).__name__} where the model goes and the "
                f"nnx Module {type(grads).__name__} where the gradients go."
            )
        params = _as_pure(_state(model, self.wrt, graph=self.graph))
        grads = _as_pure(_state(grads, self.wrt, graph=self.graph))
        core = self._core()
        before = jax.tree.leaves(core)
        updates = core.update(grads, params, apply_updates=False, **_as_pure(kwargs))
        nnx.update(model, placed_like(_apply_updates(params, updates), params, self.placements))
        # The state where it was placed (under auto axes the compiler would choose for a traced step).
        kept = placed_like(jax.tree.leaves(core), before, vars(self.treeopt).get("placements"))
        _set_value(self.treeopt, jax.tree.unflatten(jax.tree.structure(core), kept))
        return updates

    # -- what treeopt adds -----------------------------------------------------------

    @property
    def paths(self) -> tuple[str, ...]:
        """Names of the trained variables, e.g. ``("linear1/kernel", ...)``: the keys of the state.

        Example:
            >>> import optax, treeopt.nnx
            >>> from flax import nnx
            >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
            >>> treeopt.nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param).paths
            ('bias', 'kernel')
        """
        return self._core().paths

    def ema_params(self, model: M) -> Any:
        """The averages of ``ema=`` as an ``nnx.State`` like ``nnx.state(model, wrt)``, in the variables' dtypes.

        Variables ``ema=`` does not average keep ``model``'s values; ``model``
        is not changed. Evaluate a copy with them: ``nnx.update(eval_model,
        optimizer.ema_params(model))``.

        Example:
            >>> import jax.numpy as jnp, optax, treeopt.nnx
            >>> from flax import nnx
            >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
            >>> optimizer = treeopt.nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param, ema=0.5)
            >>> _ = optimizer.update(model, nnx.grad(lambda m: m(jnp.ones((1, 2))).sum())(model))
            >>> model.bias[...], optimizer.ema_params(model)["bias"]
            (Array([-1.], dtype=float32), Array([-0.5], dtype=float32))
        """
        return self._core().ema_params(_as_pure(_state(model, self.wrt, graph=self.graph)))

    @property
    def hyperparams(self) -> dict[str, Any]:
        """The injected hyperparameters (``optax.inject_hyperparams``) by name.

        Example:
            >>> import optax, treeopt.nnx
            >>> from flax import nnx
            >>> tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
            >>> optimizer = treeopt.nnx.Optimizer(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), tx, wrt=nnx.Param)
            >>> round(float(optimizer.hyperparams["learning_rate"]), 6)
            0.1
        """
        return self._core().hyperparams

    def set_hyperparams(self, values: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        """Sets injected hyperparameters in place (``optimizer.learning_rate = x`` does the same).

        Example:
            >>> import optax, treeopt.nnx
            >>> from flax import nnx
            >>> tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
            >>> optimizer = treeopt.nnx.Optimizer(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), tx, wrt=nnx.Param)
            >>> optimizer.set_hyperparams(learning_rate=0.05, b1=0.8)
            >>> round(float(optimizer.b1), 3)
            0.8
        """
        core = self._core()
        core.set_hyperparams(values, **kwargs)
        _set_value(self.treeopt, core)

    def state_dict(self) -> StateDict:
        """The state as nested plain dicts keyed by parameter name (:meth:`treeopt.Optimizer.state_dict`).

        Example:
            >>> import optax, treeopt.nnx
            >>> from flax import nnx
            >>> optimizer = treeopt.nnx.Optimizer(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), optax.adam(1e-3), wrt=nnx.Param)
            >>> sorted(optimizer.state_dict()["opt_state"]["0"]["mu"])
            ['bias', 'kernel']
        """
        return self._core().state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Loads ``state_dict`` in place, matched by name (:meth:`treeopt.Optimizer.load_state_dict`).

        Example:
            >>> import jax.numpy as jnp, optax, treeopt.nnx
            >>> from flax import nnx
            >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
            >>> trained = treeopt.nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
            >>> _ = trained.update(model, nnx.grad(lambda m: m(jnp.ones((1, 2))).sum())(model))
            >>> fresh = treeopt.nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
            >>> fresh.load_state_dict(trained.state_dict())
            >>> int(fresh.step[...])
            1
        """
        _set_value(self.treeopt, self._core().load_state_dict(state_dict, strict=strict))

    def partition_specs(
        self,
        param_specs: ParamSpecs,
        *,
        shard_state_over: str | Sequence[str] | None = None,
        mesh: jax.sharding.Mesh | None = None,
    ) -> CoreOptimizer:
        """A ``PartitionSpec`` for every leaf of ``optimizer.treeopt``'s value (:meth:`treeopt.Optimizer.partition_specs`).

        ``param_specs`` is a tree of specs by name, such as
        ``nnx.get_partition_spec(nnx.state(model))``; variables outside ``wrt``
        are ignored. Place the state with
        ``optimizer.treeopt.set_value(jax.device_put(optimizer.treeopt.get_value(),
        treeopt.partitioning.named_shardings(specs, mesh)))``.

        Example:
            >>> import optax, treeopt.nnx
            >>> from flax import nnx
            >>> from jax.sharding import PartitionSpec as P
            >>> model = nnx.Linear(2, 4, rngs=nnx.Rngs(0))
            >>> optimizer = treeopt.nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
            >>> specs = optimizer.partition_specs({"kernel": P(None, "model"), "bias": P("model")})
            >>> specs.opt_state[0].mu["kernel"] == P(None, "model")
            True
        """
        if isinstance(param_specs, nnx.State) and _holds_variables(param_specs):
            param_specs = _as_pure(nnx.filter_state(param_specs, self.wrt))
        core = self._core()
        if self.optimizer_sharding:  # the state's own layout, where a Variable names one
            param_specs = {**flat_param_specs(param_specs, core.layout), **dict(self.optimizer_sharding)}
        return core.partition_specs(param_specs, shard_state_over=shard_state_over, mesh=mesh)

    # -- hyperparameters as attributes, as treeopt.Optimizer reads them ---------------

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails.
        state = vars(self).get("treeopt")
        if name.startswith("_") or state is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        if name == "model":
            raise AttributeError(
                f"{type(self).__name__} has no 'model', as nnx.Optimizer has none: "
                "use treeopt.nnx.ModelAndOptimizer, which keeps the model."
            )
        return hyperparameter_attribute(self, name, _raw_value(state).hyperparams)

    def __setattr__(self, name: str, value: Any) -> None:
        # The core's rule (sets_hyperparameter): a hyperparameter is set in the state, the object's own
        # attributes are its own; as an nnx Pytree it holds any other name as an ordinary attribute.
        state = vars(self).get("treeopt")
        own = name in _OWN or name in vars(self) or hasattr(type(self), name)
        if sets_hyperparameter(name, own, None if state is None else _raw_value(state).hyperparams):
            self.set_hyperparams({name: value})  # a clear error where tx has no such hyperparameter
            return
        super().__setattr__(name, value)

    def _core(self) -> CoreOptimizer:
        core: CoreOptimizer = _raw_value(self.treeopt)
        return core

    # -- checkpoints: treeopt.checkpoint saves the optimizer held, and restores into a copy -----

    def __treeopt_optimizer__(self) -> CoreOptimizer:
        """The :class:`treeopt.Optimizer` held, which ``treeopt.checkpoint.save`` writes."""
        return self._core()

    def __treeopt_with__(self, core: CoreOptimizer) -> Optimizer[M]:
        """A copy of this drop-in holding ``core``: what ``treeopt.checkpoint.restore`` returns."""
        new = nnx.clone(self)
        _set_value(new.treeopt, core)
        return new


class HeldOptimizer(nnx.Pytree):
    """A :class:`treeopt.Optimizer` held by nnx as ``nnx.Optimizer`` holds its state: an ``nnx.OptState`` per array.

    ``nnx.state(optimizer)`` then lists ``treeopt/step``,
    ``treeopt/opt_state/0/mu/<name>``, ... so flax's checkpoint recipe
    (``nnx.to_pure_dict`` → orbax → ``nnx.replace_by_pure_dict``) finds every
    key it saved. Read the optimizer with :meth:`get_value` and replace it with
    :meth:`set_value`, as with a Variable.

    Example:
        >>> import jax.numpy as jnp, optax, treeopt
        >>> held = HeldOptimizer(treeopt.Optimizer(optax.adam(1e-3)).init({"w": jnp.ones(2)}))
        >>> int(held.get_value().step), type(held.step).__name__
        (0, 'OptState')
    """

    if TYPE_CHECKING:  # set by set_value, one attribute per state view (STATE_VIEWS)
        step: Any
        opt_state: Any

    def __init__(self, value: CoreOptimizer):
        self.set_value(value)

    def get_value(self) -> CoreOptimizer:
        """The :class:`treeopt.Optimizer`, rebuilt from the variables' values, view by view by name."""
        structure: Any = self.structure
        template = jax.tree.unflatten(structure, [None] * structure.num_leaves)
        views = {view: jax.tree.map(_raw_value, getattr(self, view), is_leaf=_is_variable) for view in STATE_VIEWS}
        return with_state_views(template, views)

    get_raw_value = get_value

    def set_value(self, value: CoreOptimizer) -> None:
        """Replaces the optimizer: in place, variable by variable, where its structure is unchanged.

        Given concrete arrays (a state placed with ``jax.device_put``), it also
        records where each one lies: a traced step under auto mesh axes cannot
        read that, and the drop-in keeps the new state there.
        """
        structure = jax.tree.structure(value)
        if not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(value)):
            self.placements = placements(value)
        current = vars(self).get("structure")
        if current is not None and current == structure:
            for view, tree in state_views(value).items():  # view by view, by name
                variables = jax.tree.leaves(getattr(self, view), is_leaf=_is_variable)
                for variable, leaf in zip(variables, jax.tree.leaves(tree), strict=True):
                    _set_value(variable, leaf)
            return
        self.structure = nnx.static(structure) if hasattr(nnx, "static") else structure
        for view, tree in state_views(jax.tree.map(nnx.OptState, value)).items():
            setattr(self, view, tree if isinstance(tree, nnx.Variable) or not hasattr(nnx, "data") else nnx.data(tree))

    @property
    def value(self) -> CoreOptimizer:
        """The :class:`treeopt.Optimizer` (``get_value()``; the name flax 0.12.0 reads)."""
        return self.get_value()

    @value.setter
    def value(self, value: CoreOptimizer) -> None:
        self.set_value(value)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


class ModelAndOptimizer(Optimizer[M]):
    """``nnx.ModelAndOptimizer(model, tx, wrt=nnx.Param)``: the optimizer keeps the model; ``update(grads)``.

    Example:
        >>> import jax.numpy as jnp, optax, treeopt.nnx
        >>> from flax import nnx
        >>> state = treeopt.nnx.ModelAndOptimizer(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), optax.sgd(0.1))
        >>> @nnx.jit
        ... def train_step(state, x):
        ...     grads = nnx.grad(lambda m: m(x).sum())(state.model)
        ...     state.update(grads)
        >>> train_step(state, jnp.ones((1, 2)))
        >>> state.model.bias[...], int(state.step[...])
        (Array([-0.1], dtype=float32), 1)
    """

    def __init__(
        self,
        model: M,
        tx: optax.GradientTransformation,
        *,
        wrt: Any = nnx.Param,
        graph: bool | None = None,
        **kwargs: Any,
    ):
        super().__init__(model, tx, wrt=wrt, graph=graph, **kwargs)
        self.model = model

    def update(self, grads: Any, /, **kwargs: Any) -> Updates:  # type: ignore[override]
        """One step on ``self.model``: ``Optimizer.update(self.model, grads, **kwargs)``.

        Example:
            >>> import jax.numpy as jnp, optax, treeopt.nnx
            >>> from flax import nnx
            >>> state = treeopt.nnx.ModelAndOptimizer(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), optax.sgd(0.1))
            >>> grads = nnx.grad(lambda m: m(jnp.ones((1, 2))).sum())(state.model)
            >>> state.update(grads)["bias"]
            Array([-0.1], dtype=float32)
        """
        return super().update(self.model, grads, **kwargs)


def _optimizer_sharding(variables: Any, core: CoreOptimizer) -> tuple[tuple[str, Any], ...]:
    """``((name, spec), ...)`` of the trained Variables whose ``optimizer_sharding`` metadata lays out their state."""
    by_path = {tuple(path): variable for path, variable in nnx.to_flat_state(variables)}
    paths = core.layout.nnx_paths or ()
    out = []
    for name, path in zip(core.layout.names, paths, strict=True):
        variable = by_path.get(tuple(path))
        metadata = variable.get_metadata() if isinstance(variable, nnx.Variable) else {}
        spec = metadata.get("optimizer_sharding")
        if spec is not None:
            out.append((name, spec if isinstance(spec, PartitionSpec) else PartitionSpec(*spec)))
    return tuple(out)


def _laid_out(
    core: CoreOptimizer, specs: tuple[tuple[str, Any], ...], params: Any, placed: tuple[Any, ...]
) -> CoreOptimizer:
    """``core`` with the state of each named param on its ``optimizer_sharding``, as ``nnx.Optimizer`` lays it out.

    The others' state keeps its param's layout. The mesh is the params' (or
    the one set with ``jax.set_mesh``); on one device there is nothing to lay out.
    """
    meshes = [sharding.mesh for sharding in placed if sharding is not None]
    mesh = meshes[0] if meshes else _context_mesh()
    if mesh is None:
        return core
    own = flat_param_specs(param_specs_of(params), core.layout)
    state_specs = core.partition_specs({**own, **dict(specs)}, mesh=mesh)
    return jax.device_put(core, named_shardings(state_specs, mesh))


def _context_mesh() -> Any:
    """The concrete mesh set with ``jax.set_mesh``, or ``None``."""
    get_mesh = getattr(jax.sharding, "get_mesh", None)
    mesh = get_mesh() if get_mesh is not None else None
    return mesh if mesh is not None and not getattr(mesh, "empty", True) and mesh.size > 1 else None


def _refuse_swapped(model: Any, tx: Any) -> None:
    """``Optimizer(tx, model, ...)``: the arguments in the wrong order, named before ``wrt`` is blamed."""
    if isinstance(model, optax.GradientTransformation) and not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            "Optimizer(model, tx, wrt=...) takes the model first and the optax transformation second, "
            f"as nnx.Optimizer does; got the transformation first and a {type(tx).__name__} second: "
            "the two are swapped."
        )


def _holds_variables(state: Any) -> bool:
    return any(
        isinstance(x, nnx.Variable)
        for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    )


# flax 0.12.0 reads and writes a Variable's value as `.value`; later versions deprecate that
# for get_value / set_value (get_raw_value: without the Variable's hooks).
def _raw_value(variable: nnx.Variable[Any] | HeldOptimizer) -> Any:
    return variable.get_raw_value() if hasattr(type(variable), "get_raw_value") else variable.value


def _set_value(variable: nnx.Variable[Any] | HeldOptimizer, value: Any) -> None:
    if hasattr(type(variable), "set_value"):
        variable.set_value(value)
    else:
        variable.value = value


# A tree with every nnx Variable replaced by its value: nnx.pure before flax 0.12.7.
_as_pure: Callable[[Any], Any] = getattr(nnx, "as_pure", None) or nnx.pure

# Graph and tree modes (graph=) came in flax 0.12.8; read once, not on every update.
_GRAPH_MODES = "graph" in inspect.signature(nnx.state).parameters


def _state(node: Any, *filters: Any, graph: bool | None) -> Any:
    """``nnx.state(node, *filters, graph=graph)``; flax before 0.12.8 has only the default mode."""
    if graph is None:
        return nnx.state(node, *filters)
    if not _GRAPH_MODES:
        raise TypeError(
            f"graph={graph} needs flax 0.12.8 or newer (nnx graph and tree modes); flax "
            f"{flax.__version__} is installed. Leave graph=None, or upgrade flax."
        )
    return nnx.state(node, *filters, graph=graph)


def _empty_selection_message(model: Any, wrt: Any, graph: bool | None) -> str:
    """Why nothing would train: the ``wrt``, and a few of the model's variables with their types."""
    variables = nnx.to_flat_state(_state(model, graph=graph))
    found = [f"'{'/'.join(map(str, path))}' ({type(v).__name__})" for path, v in list(variables)[:8]]
    more = f", ... ({len(variables)} in all)" if len(variables) > len(found) else ""
    text = wrt.__name__ if isinstance(wrt, type) else repr(wrt)
    message = (
        f"wrt={text} selects no variable of the {type(model).__name__} given to the optimizer: nothing "
        "would train. " + (f"Its variables: {', '.join(found)}{more}." if found else "It has no variables.")
    )
    if isinstance(wrt, str):
        message += (
            f"\nnnx reads a string as a tag, nnx.WithTag({wrt!r}), and no variable has it; "
            "select by type with the class itself (nnx.Param, nnx.LoRAParam)."
        )
    return message
