"""The state-dict surface of an Optimizer: checks, flax serialization, bytes, warm start.

- ``opt.state_dict()`` / ``opt.load_state_dict(sd, strict=True)``: nested plain
  dicts of arrays keyed by parameter name; :func:`check_state_dict` says what
  would load, :class:`LoadReport` / :class:`StateDictError` /
  :class:`StateDictWarning` (defined in :mod:`treeopt.errors`) what did not.
- ``flax.serialization.to_bytes(opt)`` / ``from_bytes(opt, data)`` and
  ``to_state_dict`` / ``from_state_dict`` work on an Optimizer (registered when
  ``treeopt`` is imported). The flax state dict is ``opt.state_dict()`` plus a
  ``"checksum"`` of its arrays, so a corrupted blob raises instead of loading.
  :func:`to_bytes` / :func:`from_bytes` here are the same with a clearer error
  for undecodable bytes.
- Orbax checkpoints are in :mod:`treeopt.checkpoint` (``save``, ``restore``,
  ``CheckpointManager``).
- :func:`warm_start`: start a new optimizer from another one's state, by name
  (e.g. adam -> adamw keeping ``mu``/``nu``).

See ``docs/serialization.md``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import flax.serialization

from treeopt import errors
from treeopt._compat.deprecations import moved_names
from treeopt._optimizer.optimizer import Optimizer
from treeopt._optimizer.parts import state_parts, with_state_parts
from treeopt._state import state_dict as _sd
from treeopt._state.checksum import CHECKSUM_KEY, with_checksum
from treeopt._tree.masks import name_matcher
from treeopt.errors import LoadReport, StateDictError, StateDictWarning

__all__ = [
    "CHECKSUM_KEY",
    "LoadReport",
    "StateDictError",
    "StateDictWarning",
    "check_state_dict",
    "from_bytes",
    "to_bytes",
    "warm_start",
]

__getattr__ = moved_names(__name__)

# -- flax.serialization ----------------------------------------------------------------


def _flax_to_state_dict(opt: Optimizer) -> dict[str, Any]:
    if not opt.initialized:
        return {}
    return with_checksum(opt.state_dict())


def _flax_from_state_dict(opt: Optimizer, state: Any) -> Optimizer:
    if not opt.initialized:
        if not state:
            return opt
        raise StateDictError(
            "Cannot restore state into an Optimizer that is not initialized: its structure "
            "is unknown. Pass `opt.init(params)`, or an abstract one from "
            "`jax.eval_shape(opt.init, params)`, as the target."
        )
    return copy.copy(opt).load_state_dict(state, strict=True)  # from_bytes leaves its target as it was


flax.serialization.register_serialization_state(
    Optimizer, _flax_to_state_dict, _flax_from_state_dict, override=True
)


def to_bytes(opt: Optimizer) -> bytes:
    """``flax.serialization.to_bytes(opt)``: msgpack of the state dict and its checksum.

    Example:
        >>> import jax.numpy as jnp, optax, treeopt
        >>> opt = treeopt.Optimizer(optax.adam(1e-3)).init({"w": jnp.ones(2)})
        >>> data = to_bytes(opt)
        >>> int(from_bytes(opt, data).step)
        0
    """
    return flax.serialization.to_bytes(opt)


def from_bytes(target: Optimizer, data: bytes) -> Optimizer:
    """``flax.serialization.from_bytes(target, data)``, with a clear error for bad bytes.

    ``target`` is an initialized optimizer or an abstract one
    (``jax.eval_shape(opt.init, params)``). Raises :class:`~treeopt.errors.CheckpointError` when
    ``data`` is not a msgpack blob (truncated, corrupted) and
    :class:`StateDictError` when it decodes but does not match ``target`` or its
    checksum.

    Example:
        >>> import jax, jax.numpy as jnp, optax, treeopt
        >>> params = {"w": jnp.ones(2)}
        >>> opt = treeopt.Optimizer(optax.adam(1e-3)).init(params)
        >>> params = opt.update({"w": jnp.ones(2)}, params)
        >>> target = jax.eval_shape(treeopt.Optimizer(optax.adam(1e-3)).init, params)
        >>> restored = from_bytes(target, to_bytes(opt))
        >>> int(restored.step), restored.opt_state[0].mu["w"]
        (1, Array([0.1, 0.1], dtype=float32))
    """
    try:
        state = flax.serialization.msgpack_restore(bytes(data))
    except Exception as e:
        raise errors.CheckpointError(
            f"Could not decode {len(data)} bytes as a msgpack state dict: they are truncated "
            f"or corrupted ({type(e).__name__}: {e})."
        ) from e
    if not isinstance(state, Mapping):
        raise errors.CheckpointError(
            f"The bytes decode to a {type(state).__name__}, not a state dict: they are corrupted."
        )
    return flax.serialization.from_state_dict(target, dict(state))


# -- warm start ------------------------------------------------------------------------


def _matcher(patterns: str | Iterable[str] | None) -> Callable[[str], bool] | None:
    return None if patterns is None else name_matcher(patterns)


def warm_start(
    opt: Optimizer,
    source: Optimizer | Mapping[str, Any],
    *,
    include: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    hyperparams: bool = False,
) -> tuple[Optimizer, LoadReport]:
    """Starts ``opt`` from the state of another optimizer, by name: ``(new optimizer, report)``.

    ``source`` is an optimizer or its state dict (``opt.state_dict()``, a flax
    state dict, or :func:`restore_state_dict` of a checkpoint). A leaf of ``opt``
    is copied when the source has the same path with the same shape and dtype
    (``opt_state/0/mu/dense/kernel`` from adam to adamw), else when exactly one
    source leaf has the same state field and parameter name wherever it is
    nested (``mu/dense/kernel`` from adam into ``inject_hyperparams(adamw)``,
    ``count`` for a leaf of no parameter). Everything else keeps ``opt``'s
    values; nothing raises for a mismatch. Injected hyperparameters keep
    ``opt``'s values unless ``hyperparams=True``. ``include`` / ``exclude`` are
    globs over the target paths (``exclude="step"`` restarts the step count,
    ``exclude="*count"`` restarts bias corrections and schedules).

    Example:
        >>> import jax.numpy as jnp, optax, treeopt
        >>> params = {"w": jnp.ones(2)}
        >>> adam = treeopt.Optimizer(optax.adam(1e-3)).init(params)
        >>> params = adam.update({"w": jnp.ones(2)}, params)
        >>> adamw = treeopt.Optimizer(optax.adamw(1e-3)).init(params)
        >>> adamw, report = warm_start(adamw, adam)
        >>> report.loaded
        ('opt_state/0/count', 'opt_state/0/mu/w', 'opt_state/0/nu/w', 'step')
        >>> int(adamw.step)
        1
    """
    sd = source.state_dict() if isinstance(source, Optimizer) else source
    parts, report = _sd.warm_start(
        state_parts(opt),
        opt.paths,
        sd,
        include=_matcher(include),
        exclude=_matcher(exclude),
        hyperparams=hyperparams,
    )
    return with_state_parts(opt, parts), report


def check_state_dict(opt: Optimizer, sd: Mapping[str, Any]) -> LoadReport:
    """What ``opt.load_state_dict(sd)`` would load, and what it would not, without loading.

    Example:
        >>> import jax.numpy as jnp, optax, treeopt
        >>> adam = treeopt.Optimizer(optax.adam(0.1)).init({"w": jnp.ones(2)})
        >>> sgd = treeopt.Optimizer(optax.sgd(0.1, momentum=0.9)).init({"w": jnp.ones(2)})
        >>> print(check_state_dict(sgd, adam.state_dict()).problems())
        missing (1):
          opt_state/0/trace/w
        unexpected (3):
          opt_state/0/count
          opt_state/0/mu/w
          opt_state/0/nu/w
    """
    return _sd.check_state_dict(state_parts(opt), sd)
