"""treeopt.Optimizer: a PyTree that holds its own optax state (its face is ``treeopt.optimizer``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import optax

from treeopt._lowbit import checked_state_bits
from treeopt._optimizer.hyperparameters import HyperparameterAccess
from treeopt._optimizer.initial import initial_parts
from treeopt._optimizer.partitioned import Partitioned
from treeopt._optimizer.parts import state_parts, with_state_parts
from treeopt._optimizer.views import StateViews
from treeopt._sharding.explicit import like_inputs
from treeopt._sharding.ownership import checked_owned
from treeopt._state import state_dict as _state_dict
from treeopt._state.state_dict import StateParts
from treeopt._step.ema import after_update, checked_ema
from treeopt._step.initial import as_transformation, transformation_name
from treeopt._step.options import (
    checked_master_dtype,
    checked_param_rounding,
    checked_rounding_seed,
    precision_of,
)
from treeopt._step.precision import Precision
from treeopt._step.traced import flat_step
from treeopt._step.viewed import over_names
from treeopt._tree.children import averaging
from treeopt._tree.layout import ParamLayout, Wrt
from treeopt._update.donated import donated, refuse_donated
from treeopt._update.inputs import FlatInputs, flat_inputs
from treeopt._update.trace_guard import CAPTURED, concrete_or_eager_autodiff, is_tracer
from treeopt.typing import Params, StateDict, Updates

__all__ = ["Optimizer"]

if TYPE_CHECKING:
    from treeopt._step.step_io import FlatStep

# The fields, declared once: static data (the jit cache key) and the leaves.
_META = ("tx", "wrt", "state_bits", "owned", "precision", "ema_rules", "_layout", "_lookahead")
_DATA = StateParts.leaf_fields()
_FIELDS = (*_META, *_DATA)
# What JAX passes when it rebuilds an optimizer, beyond the constructor's own arguments.
_REBUILT = frozenset(_FIELDS) - {"tx", "wrt", "state_bits", "owned"}


class Optimizer(HyperparameterAccess, StateViews, Partitioned):
    """An optax optimizer that is a PyTree holding its own state.

    ``tx``, the parameter names and how the params are held (its
    ``precision``) are static; ``step``, ``opt_state`` and ``precision_state``
    are the leaves. Pass it through ``jax.jit`` (or ``vmap``) like any other
    state and return it; ``update`` changes its state in place and returns
    new params.

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
              parameter name and the array; it is asked about array leaves
              only (an equinox model's functions, Python numbers and strings
              are never trained, and never passed to it). Wrap an nnx-style
              ``(path, variable)`` function in ``nnx.Any(fn)`` to have it read
              as an nnx filter.
            - a list or tuple mixing these: a leaf any of them selects.
        master_dtype: keep a copy in this floating dtype (``jnp.float32``) of
            every trainable floating leaf narrower than it (bfloat16 params),
            and step the copies: ``update`` casts the grads up, runs ``tx`` on
            the copies and returns each param as its copy cast back to the
            param's dtype. ``None`` (default): no copies. See
            ``docs/mixed-precision.md``.
        state_bits: hold the optimizer's statistics in 8 or 4 bits: block-wise
            codes with a float32 scale per block of at most 256 elements,
            through a non-linear map (second moments through one without zero).
            ``None`` (default): the state as optax makes it. ``8`` or ``4`` for
            every parameter, or a mapping ``{glob: 8 | 4 | None}`` read in
            order, the first matching glob deciding. Only the params-shaped
            floating statistics of at least 4,096 elements are quantized, of
            any optax transformation; see ``docs/low-bit-state.md``.
        param_rounding: train narrow params (bfloat16) without a float32
            copy: ``tx`` runs on them cast to float32 and the new values are
            written back into their dtype by Kahan-compensated summation
            (``"kahan"``: a compensation buffer in the param's dtype, +2 bytes
            per bfloat16 parameter) or unbiased stochastic rounding
            (``"stochastic"``: one PRNG key). ``None`` (default): rounded to
            nearest. Not together with ``master_dtype``, and refused at
            ``init`` where no trainable param is narrower than float32. See
            ``docs/mixed-precision.md``.
        rounding_seed: the seed of the PRNG key of
            ``param_rounding="stochastic"`` (``jax.random.key(rounding_seed)``
            at ``init``, split every step), an integer in [0, 2**32). ``None``
            (default): 0, the same draws in every run. Refused with any other
            ``param_rounding``, where nothing would draw from it.
        owned: on a mesh, each matrix an update reads whole (Muon's, or a
            ``treeopt.whole_leaf`` function's) is computed by one owner: ``True``
            (default), ``False`` (as written), or ``{glob: bool}`` by param
            name, the first match deciding, checked as ``state_bits`` globs.
        ema: keep an exponential moving average of the trained params in
            float32, moved after each update towards their exact new values
            (the masters where there are some): a decay in [0, 1), a schedule
            of the step, or ``{glob: decay | None}`` by name, checked as
            ``state_bits`` globs. Read it as :attr:`ema` or :meth:`ema_params`.
        **fields: only for JAX, which rebuilds an optimizer from its fields
            (``jax.tree_util.register_dataclass``); never needed in user code.

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

        bfloat16 params with float32 master copies: a step too small for
        bfloat16 is kept in the copy, and the params follow once it adds up.

        >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
        >>> opt = treeopt.Optimizer(optax.sgd(1e-4), master_dtype=jnp.float32).init(params)
        >>> params = opt.update({"w": jnp.ones(3, jnp.bfloat16)}, params)
        >>> params["w"], opt.master["w"]
        (Array([1, 1, 1], dtype=bfloat16), Array([0.9999, 0.9999, 0.9999], dtype=float32))
    """

    __slots__ = _FIELDS

    tx: optax.GradientTransformation
    """The optax transformation the optimizer applies (static: part of the jit cache key).

    It is the object given (an ``optax.MultiSteps``: its ``gradient_transformation()``), and sees the
    params in the structure given to ``init``; what it returns is keyed by name (:attr:`opt_state`).
    """
    wrt: Wrt
    """Which leaves are trained, as given to the constructor (static)."""
    step: jax.Array | None
    """The number of ``update`` calls so far: an int32 scalar array (a leaf), ``None`` before ``init``.

    Save a checkpoint after the update under ``int(opt.step)``. It counts calls:
    under ``optax.MultiSteps`` the updates applied are ``gradient_step``
    (``optax.tree_utils.tree_get(opt.opt_state, "gradient_step")``). It
    saturates at 2**31 - 1, the most a state dict's ``"step"`` may hold.

    Example: ``opt.update(grads, params)`` moves ``int(opt.step)`` from 0 to 1.
    """
    opt_state: optax.OptState | None
    """The optax state (leaves), ``None`` before ``init``.

    It is ``tx.init`` of the trained params with every params-shaped part keyed by
    name, so per-parameter entries read ``opt.opt_state[0].mu["dense/kernel"]``
    for ``optax.adam``. Read it freely; to change it, use ``load_state_dict`` or
    build a new optimizer, so that the step and the names stay consistent.
    """
    state_bits: tuple[tuple[str, int | None], ...] | None
    """The low-bit rules ``((glob, bits), ...)`` read from the constructor's ``state_bits`` (static); ``None``: none.

    Example: ``Optimizer(tx, state_bits=8).state_bits`` is ``(("*", 8),)``.
    """
    owned: tuple[tuple[str, bool], ...]
    """Whose whole-leaf matrices one owner device computes on a mesh: ``((glob, owned), ...)`` (static)."""
    precision: Precision
    """How the trainable params are held and take an update (static), chosen once from ``master_dtype``,
    ``param_rounding`` and ``rounding_seed``: as they are, master weights, Kahan or stochastic rounding."""
    precision_state: Any
    """The state of :attr:`precision` (leaves), one type per way: the master copies, the compensation
    buffers or the PRNG key (none as is). ``None`` before ``init``; read it through :attr:`master` and
    :attr:`rounding`."""
    ema_rules: tuple[tuple[str, Any], ...] | None
    """The rules ``((glob, decay), ...)`` read from the constructor's ``ema`` (static); ``None``: no average."""
    ema_state: dict[str, jax.Array] | tuple[()] | None
    """The float32 averages ``{name: array}`` of ``ema=`` (leaves), ``()`` without it; read it as :attr:`ema`."""

    def __init__(
        self,
        tx: optax.GradientTransformation,
        wrt: Wrt = None,
        master_dtype: Any = None,
        state_bits: int | Mapping[str, int | None] | None = None,
        param_rounding: str | None = None,
        *,
        rounding_seed: int | None = None,
        owned: bool | Mapping[str, bool] = True,
        ema: Any = None,
        **fields: Any,
    ):
        if fields:  # JAX rebuilding a flattened optimizer: its fields, checked when it was built
            if set(fields) != _REBUILT or (master_dtype, param_rounding, rounding_seed, ema) != (None,) * 4:
                unexpected = sorted(set(fields) - _REBUILT) or sorted(fields)
                raise TypeError(f"Optimizer() got an unexpected keyword argument {unexpected[0]!r}")
            for name, value in {"tx": tx, "wrt": wrt, "state_bits": state_bits, "owned": owned, **fields}.items():
                object.__setattr__(self, name, value)
            return
        master_dtype = checked_master_dtype(master_dtype)
        param_rounding = checked_param_rounding(param_rounding, master_dtype)
        seed = checked_rounding_seed(rounding_seed, param_rounding)
        object.__setattr__(self, "tx", as_transformation(tx))
        object.__setattr__(self, "wrt", tuple(wrt) if isinstance(wrt, list) else wrt)
        object.__setattr__(self, "state_bits", checked_state_bits(state_bits))
        object.__setattr__(self, "owned", checked_owned(owned))
        object.__setattr__(self, "precision", precision_of(master_dtype, param_rounding, seed))
        object.__setattr__(self, "ema_rules", checked_ema(ema))
        for name in ("_layout", *_DATA):
            object.__setattr__(self, name, None)
        object.__setattr__(self, "_lookahead", False)

    def _with(self, **changes: Any) -> Optimizer:
        """A new optimizer with these fields changed (the others as ``self``'s)."""
        return Optimizer(**{**{name: getattr(self, name) for name in _FIELDS}, **changes})

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
        layout, lookahead, parts = initial_parts(
            self.tx, self.wrt, self.precision, self.state_bits, self.owned, params, self.ema_rules
        )
        return with_state_parts(self._with(_layout=layout, _lookahead=lookahead), parts)

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
        (``nnx.Optimizer`` takes them the other way round). Swapped arguments
        are an error where they can be told apart (an nnx Module, or model state
        such as ``nnx.BatchStat``, where the gradients go), not where both have
        the same structure and leaf types (two States of Params, two dicts).

        Args:
            grads: gradients shaped like the params given to ``init``, or any tree
                with the same names (``nnx.grad``'s State for an nnx Module); leaves
                that are not trained may be ``None`` or absent when matched by name.
            params: the current params. Required with ``apply_updates=True`` and by
                transformations that read params (weight decay, lamb, lars, ...).
                An nnx Module is updated in place (its ``Variable``s get the new
                values, as ``nnx.Optimizer.update`` does) and returned.
            apply_updates: return new params (default) or the updates themselves,
                shaped like ``grads``. With ``master_dtype``, the update of a leaf
                that has a master is, in ``master_dtype``, the new param minus the
                one given, so ``optax.apply_updates(params, updates)`` gives the
                params the default returns.
            **extra_args: passed to ``tx.update`` (``value=loss`` for
                ``optax.contrib.reduce_on_plateau``; ``value``, ``grad`` and
                ``value_fn`` for ``optax.lbfgs``). ``value_fn`` is called with
                params in the structure given here (for an nnx Module, an
                ``nnx.State`` of the trained values, as ``nnx.Optimizer`` calls
                it); a tree like params or grads (``grad``) is matched by name.

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
        inputs = flat_inputs(
            self._require_layout(), self._lookahead, self.step, grads, params, apply_updates, extra_args
        )
        result = self._step_on(inputs, apply_updates)
        if not is_tracer(self.step) and not concrete_or_eager_autodiff(result.step):
            raise RuntimeError(CAPTURED)  # a trace we could not see from the inputs
        ema_state = self.ema_state
        if averaging(ema_state):  # after the update, from its exact new values
            ema_state = after_update(
                ema_state, self.ema_rules, self._require_layout().names, self.step, self.precision,
                self.opt_state, result, inputs.params, apply_updates,
            )  # fmt: skip
        stepped = StateParts(result.step, result.opt_state, result.precision_state, ema_state=ema_state)
        for name in _DATA:
            object.__setattr__(self, name, getattr(stepped, name))
        return inputs.rebuild(like_inputs(result.output, inputs.params if apply_updates else inputs.grads))

    def _step_on(self, inputs: FlatInputs, apply_updates: bool) -> FlatStep:
        """``flat_step`` on checked inputs; a donated optimizer is named only once JAX refused it."""
        try:
            return flat_step(
                over_names(self.tx, self._require_layout()), self.step, self.opt_state, inputs.grads,
                inputs.params, apply_updates=apply_updates, extra_args=inputs.extra_args,
                precision=self.precision, precision_state=self.precision_state, owned=self.owned,
            )  # fmt: skip
        except RuntimeError:  # checked only after the failure: the step itself pays nothing
            refuse_donated(self)
            raise

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
        return _state_dict.state_dict(state_parts(self))

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Optimizer:
        """Loads ``state_dict`` into this optimizer, as ``update`` changes it, and returns it.

        So ``opt.load_state_dict(sd)`` (the ``torch.optim`` habit) and ``opt = opt.load_state_dict(sd)``
        both work. Leaves are matched by path (state field and parameter name), never by position.
        ``strict=True`` raises ``treeopt.serialization.StateDictError`` listing every missing, unexpected
        and shape/dtype-mismatched path, and loads nothing. ``strict=False`` loads the paths that match,
        keeps this optimizer's values for the others and emits a ``treeopt.serialization.StateDictWarning``
        listing them (its ``.report`` holds them as data). Values are placed on the shardings of this
        optimizer's leaves; ``self`` may be abstract (``jax.eval_shape(opt.init, params)``).

        Example:
            >>> import jax.numpy as jnp, optax, treeopt
            >>> opt = treeopt.Optimizer(optax.adam(1e-3)).init({"w": jnp.ones(2)})
            >>> opt.update({"w": jnp.ones(2)}, apply_updates=False)["w"].shape
            (2,)
            >>> restored = treeopt.Optimizer(optax.adam(1e-3)).init({"w": jnp.ones(2)})
            >>> _ = restored.load_state_dict(opt.state_dict())
            >>> int(restored.step)
            1
        """
        loaded = _state_dict.load_state_dict(state_parts(self), state_dict, strict=strict)
        for name in _DATA:
            object.__setattr__(self, name, getattr(loaded, name))
        return self

    # -- misc ----------------------------------------------------------------------

    def __reduce__(self) -> tuple[Any, ...]:
        # copy.copy / deepcopy / pickle rebuild from the fields, since plain attribute
        # assignment is reserved for hyperparameters.
        return _rebuilt, ({name: getattr(self, name) for name in _FIELDS},)

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
            return f"Optimizer(tx={transformation_name(self.tx)}, initialized=False)"
        step = self.step
        step_text = "traced" if is_tracer(step) else "donated" if donated(step) else str(jax.device_get(step))
        return f"Optimizer(tx={transformation_name(self.tx)}, step={step_text}, params={len(self._layout.names)})"


def _rebuilt(fields: dict[str, Any]) -> Optimizer:
    return Optimizer(**fields)


# Static data (part of the jit cache key) and leaves, as declared above; an optimizer before init has
# no leaves (its step, state and precision state are None).
jax.tree_util.register_dataclass(Optimizer, data_fields=list(_DATA), meta_fields=list(_META))
