"""``OptimizerState``, ``OptimizerDef`` and ``Optimizer``: T5X's optimizer protocol.

An ``OptimizerDef`` holds hyper params and the update rule; ``create(target)``
returns an ``Optimizer`` (a flax ``PyTreeNode``: the definition is static, the
state and target are leaves), whose ``apply_gradient`` returns a new one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Union

import flax.serialization
import jax
from flax import struct

from treeopt.internal import with_checksum
from treeopt.layout import ParamLayout
from treeopt.t5x import _state


def check_grads(params: Any, grads: Any, per_example: bool = False) -> None:
    """Refuses ``grads`` that do not match ``params`` with the core's error, naming each entry.

    Grads of the params' structure and shapes pass on a comparison of the two
    (under ``jax.jit``, once, when traced); with ``per_example`` so do grads
    that all carry the same leading batch axes (``optax.dpsgd`` takes
    per-example grads). Others are matched by name as
    :meth:`treeopt.Optimizer.update` matches them, which raises one
    :class:`treeopt.errors.TreeMismatchError` listing the missing, unexpected
    and misshaped entries; grads in other containers (a ``dict`` for a
    ``FrozenDict``) with the same names and shapes pass.

    Example:
        >>> import jax.numpy as jnp
        >>> try:
        ...     check_grads({"w": jnp.ones((2, 3)), "b": jnp.ones(3)}, {"w": jnp.ones((3, 2))})
        ... except ValueError as e:
        ...     print(e.report.missing, e.report.mismatched)
        ('b',) ()
        >>> check_grads({"w": jnp.ones((2, 3))}, {"w": jnp.ones((8, 2, 3))}, per_example=True)
    """
    param_leaves, param_treedef = jax.tree.flatten(params)
    grad_leaves, grad_def = jax.tree.flatten(grads)
    param_def: Any = param_treedef
    if param_def == grad_def:
        shapes = [
            (tuple(getattr(p, "shape", ())), tuple(getattr(g, "shape", ())))
            for p, g in zip(param_leaves, grad_leaves, strict=True)
        ]
        if all(p == g for p, g in shapes):
            return
        leading = {g[: len(g) - len(p)] for p, g in shapes if len(g) > len(p) and g[len(g) - len(p) :] == p}
        if per_example and len(leading) == 1 and all(len(g) > len(p) for p, g in shapes):
            return
    ParamLayout.of(params).split_grads(grads)


@struct.dataclass
class OptimizerState:
    """The step count and the per-parameter (or optax) state of an optimizer.

    Example:
        >>> import jax.numpy as jnp
        >>> state = OptimizerState(step=jnp.asarray(0), param_states={"w": None})
        >>> int(state.replace(step=3).step)
        3
    """

    step: Any
    param_states: Any


class OptimizerDef:
    """Base class of an optimizer definition: hyper params plus the update rule.

    Subclasses implement ``init_state(params)`` and ``apply_gradient(hyper_params,
    params, state, grads)``; ``create``, ``update_hyper_params``, ``state_dict``
    and ``restore_state`` come from here.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from flax import struct
        >>> @struct.dataclass
        ... class HyperParams:
        ...     learning_rate: float
        >>> class PlainSGD(OptimizerDef):
        ...     def init_state(self, params):
        ...         return OptimizerState(jnp.asarray(0), jax.tree.map(lambda _: None, params))
        ...     def apply_gradient(self, hyper_params, params, state, grads):
        ...         new = jax.tree.map(lambda p, g: p - hyper_params.learning_rate * g, params, grads)
        ...         return new, state.replace(step=state.step + 1)
        >>> opt = PlainSGD(HyperParams(0.5)).create({"w": jnp.ones(2)})
        >>> opt.apply_gradient({"w": jnp.ones(2)}, learning_rate=0.25).target["w"]
        Array([0.75, 0.75], dtype=float32)
    """

    def __init__(self, hyper_params: Any):
        self.hyper_params = hyper_params

    def apply_gradient(self, hyper_params: Any, params: Any, state: OptimizerState, grads: Any) -> Any:
        """Applies a gradient for a set of parameters: returns ``(new_params, new_state)``."""
        raise NotImplementedError()

    def init_state(self, params: Any) -> OptimizerState:
        """The initial :class:`OptimizerState` for ``params``."""
        raise NotImplementedError()

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
        """``(target, state)`` with their values from ``state_dict``, checked against them.

        Missing and unexpected entries, shape mismatches, values of another
        kind (an integer where a float is stored, ``None``, a string) raise one
        :class:`treeopt.serialization.StateDictError` (a ``ValueError``)
        listing every such path. Empty entries T5X leaves out are put back.
        Other top-level keys of ``state_dict`` (``flax_mutables``) are ignored;
        a ``"checksum"`` (bytes written by treeopt.t5x) is verified.
        """
        target, state = _state.restore(opt_target, opt_state, state_dict)
        return target, state


OptimizerDefType = OptimizerDef


class Optimizer(struct.PyTreeNode):
    """An optimizer definition (static) with its state and target: T5X's ``Optimizer``.

    A pytree: pass it through ``jax.jit`` and return it. ``apply_gradient``
    returns a new optimizer.

    Example:
        >>> import jax.numpy as jnp
        >>> from treeopt.t5x import optimizers
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

        ``hyper_params=...`` replaces all hyper params.
        """
        hyper_params = self.optimizer_def.update_hyper_params(**hyper_param_overrides)
        new_target, new_state = self.optimizer_def.apply_gradient(
            hyper_params, self.target, self.state, grads
        )
        return self.replace(target=new_target, state=new_state)

    def state_dict(self) -> dict[str, Any]:
        """T5X's state dict: ``{"target": ..., "state": {"step": ..., "param_states": ...}}``."""
        return self.optimizer_def.state_dict(self.target, self.state)

    def restore_state(self, state: Mapping[str, Any]) -> Optimizer:
        """A new optimizer with target and state restored from a state dict."""
        target, opt_state = self.optimizer_def.restore_state(self.target, self.state, state)
        return self.replace(target=target, state=opt_state)


OptimizerType = Optimizer
OptimizerStateType = Union[OptimizerState, Mapping[str, Any]]  # noqa: UP007 - T5X's alias, a runtime value


def _to_flax(opt: Optimizer) -> dict[str, Any]:
    return with_checksum(opt.state_dict())


def _from_flax(opt: Optimizer, state_dict: Any) -> Optimizer:
    _state.check_parts(state_dict, allowed_others=False)  # in bytes, another key is a corrupted one
    return opt.restore_state(state_dict)


# flax.serialization.to_bytes(opt) is msgpack of the T5X state dict plus the core's checksum,
# so a corrupted blob raises instead of loading other numbers; blobs without one (written by
# T5X) load unverified, and those of earlier treeopt.t5x versions verify their SHA-256 digest.
flax.serialization.register_serialization_state(Optimizer, _to_flax, _from_flax, override=True)
