"""State dicts of an Optimizer: nested plain dicts of arrays, keyed by parameter name.

``state_dict(opt)`` is ``{"step": ..., "opt_state": ...}``: ``opt_state`` in
the plain form of :mod:`treeopt._state.plain`; with master weights also
``"master": {name: array}``. The params-shaped parts of an optax
state are already dicts keyed by parameter name (the optimizer runs optax on
its flat, named params), so a leaf reads ``opt_state/0/mu/dense/kernel``
whatever the order of the leaves, and a new, unrelated layer only adds names.

Loading is one call of the state-dict engine (:mod:`treeopt._state.engine`) with
the core's policy: every missing, unexpected and shape/dtype mismatched path
is listed in one error (``strict=True``), or loaded where it matches and
reported otherwise (``strict=False``). Python scalars load only where nothing
is lost; loaded arrays are copies, so the loaded optimizer can be donated to a
jitted step without deleting the caller's arrays. A warm start matches by
state field and parameter name too, casts a narrower floating value up where
that loses nothing (a bfloat16 run's moments into float32 state), and never
raises for a mismatch.

This module only sees the Optimizer through its pytree and public
attributes, so ``optimizer.py`` can import it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from treeopt._state.engine import (
    EXACT,
    EXACT_OR_WIDER,
    Messages,
    Roles,
    StateDictSource,
    Target,
    load,
    match,
    read_verified,
)
from treeopt._state.plain import Path, path_str, to_plain
from treeopt._state.step_rule import EXPECTED, negative
from treeopt.errors import LoadReport, StateDictError
from treeopt.keys import key_data

_LOAD = Messages(
    lead="The state dict does not match this optimizer (paths are "
    "step | opt_state/<optax state fields>/<parameter name> | master/<parameter name>)",
    hint="Use load_state_dict(sd, strict=False) to load the matching paths, or "
    "treeopt.serialization.warm_start to start from another optimizer's state.",
    warning="load_state_dict(strict=False): the following paths kept the optimizer's "
    "current values or were ignored",
)


def plain_state(opt: Any) -> dict[str, Any]:
    """The state dict of ``opt`` built from its leaves as they are (also for a tree of indices)."""
    plain = {"step": key_data(opt.step), "opt_state": to_plain(opt.opt_state)}
    if opt.master:
        plain["master"] = dict(opt.master)
    return plain


def _initialized(opt: Any) -> Any:
    opt.layout  # noqa: B018 - reading it raises the error that says to call init first
    return opt


def state_dict(opt: Any) -> dict[str, Any]:
    """``{"step": ..., "opt_state": ...}`` of an initialized optimizer (see the module doc)."""
    return plain_state(_initialized(opt))


def target(opt: Any) -> Target:
    """The slots of an initialized optimizer, at the paths of its state dict."""
    return Target.of(_initialized(opt), plain=plain_state)


def check_state_dict(opt: Any, sd: Any) -> LoadReport:
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
    source = StateDictSource(sd, "check_state_dict")
    read_verified(source, {})
    return match(target(opt), source.entries(), EXACT)[1]


def _refuse_a_negative_step(sd: Any) -> None:
    """A negative ``"step"`` is refused, strict or not: checkpoint steps follow the same rule."""
    value = negative(sd.get("step")) if isinstance(sd, Mapping) else None
    if value is not None:
        raise StateDictError.between(
            _LOAD.lead,
            mismatched=[("step", f"{EXPECTED} (the rule of checkpoint steps too)", str(value))],
        )


def load_state_dict(opt: Any, sd: Any, strict: bool = True) -> Any:
    """A new optimizer like ``opt`` with its state from ``sd`` (see ``Optimizer.load_state_dict``)."""
    _refuse_a_negative_step(sd)
    return load(target(opt), StateDictSource(sd), EXACT, _LOAD, strict=strict)[0]


def warm_start(
    opt: Any,
    source: Any,
    include: Callable[[str], bool] | None = None,
    exclude: Callable[[str], bool] | None = None,
    hyperparams: bool = False,
) -> tuple[Any, LoadReport]:
    """Copies the leaves of ``source`` (a state dict) that fit ``opt``; see ``serialization.warm_start``."""

    def wanted(path: Path) -> bool:
        name = path_str(path)
        if not hyperparams and ("hyperparams" in path or "hyperparams_states" in path):
            return False
        return (include is None or include(name)) and not (exclude is not None and exclude(name))

    _refuse_a_negative_step(source)
    roles = Roles(frozenset(opt.paths), wanted)
    source_ = StateDictSource(source, "warm_start")
    return load(target(opt), source_, EXACT_OR_WIDER, _LOAD, strict=None, roles=roles)
