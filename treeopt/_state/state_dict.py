"""State dicts of an optimizer's state parts: nested plain dicts of arrays, keyed by parameter name.

``state_dict(parts)`` of the :class:`StateParts` (step, optax state, the
params' precision and its state) is ``{"step": ..., "opt_state": ...}``:
``opt_state`` in the plain form of :mod:`treeopt._state.plain`, and the
entries the precision writes (:meth:`treeopt._step.precision.Precision.entries`):
``"master": {name: array}`` with master weights, ``"compensation"`` or
``"rounding_key"`` with ``param_rounding``. The params-shaped parts of an optax
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

This module is handed the state's parts and returns parts: the optimizer
rebuilds itself from them (``treeopt._optimizer.parts.with_state_parts``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import traverse_util

from treeopt._lowbit import describe_entry, in_target_form
from treeopt._state.checksum import CHECKSUM_KEY
from treeopt._state.engine import (
    Messages,
    Roles,
    StateDictSource,
    Target,
    load,
    match,
    read_verified,
)
from treeopt._state.keys import key_data
from treeopt._state.plain import flatten_paths, to_plain
from treeopt._state.policies import EXACT, EXACT_OR_WIDER
from treeopt._state.step_rule import refuse_a_negative_step
from treeopt._tree.children import CHILDREN, EMA, NO_AVERAGE, OPT_STATE, STEP, averaging, child_named
from treeopt._tree.paths import Path, path_str
from treeopt.errors import LoadReport

_PATHS = " | ".join(
    f"{child.name}/<optax state fields>/<parameter name>" if child is OPT_STATE
    else f"{child.name}/<parameter name>" if child.per_parameter else child.name
    for child in CHILDREN
)  # fmt: skip
_LOAD = Messages(
    lead=f"The state dict does not match this optimizer (paths are {_PATHS})",
    hint="Use load_state_dict(sd, strict=False) to load the matching paths, or "
    "treeopt.serialization.warm_start to start from another optimizer's state.",
    warning="load_state_dict(strict=False): the following paths kept the optimizer's "
    "current values or were ignored",
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StateParts:
    """An optimizer's state: the step count, the optax state and the state of the params' precision (leaves).

    ``precision`` is static: how the params are held
    (:class:`treeopt._step.precision.Precision`, ``None``: as they are),
    which says what its state writes into a state dict and how the optimizer
    shows it. The leaves come in the optimizer's own order, so an optimizer
    is rebuilt from the leaves of its parts.

    Example:
        >>> import jax.numpy as jnp
        >>> parts = StateParts(jnp.int32(3), {"w": jnp.zeros(2)})
        >>> sorted(state_dict(parts)), list(parts.by_part())
        (['opt_state', 'step'], ['opt_state'])
    """

    step: Any
    opt_state: Any
    precision_state: Any = None
    ema_state: Any = NO_AVERAGE
    precision: Any = dataclasses.field(default=None, metadata={"static": True})

    @classmethod
    def leaf_fields(cls) -> tuple[str, ...]:
        """The fields holding leaves: the optimizer holds each under the same name.

        Example:
            >>> StateParts.leaf_fields()
            ('step', 'opt_state', 'precision_state', 'ema_state')
        """
        return tuple(field.name for field in dataclasses.fields(cls) if not field.metadata.get("static"))

    def entries(self) -> dict[str, Any]:
        """The state dict's entries beyond the step and the optax state: each child under its declared name."""
        out = {} if self.precision is None else self.precision.entries(self.precision_state)
        return {**out, EMA.name: dict(self.ema_state)} if averaging(self.ema_state) else out

    def by_part(self) -> dict[str, Any]:
        """The trees whose leaves may belong to parameters, by the names ``zero_report`` gives them.

        ``opt_state``, then the precision's views (``master``, ``rounding``), as
        the children declare them (:mod:`treeopt._tree.children`).
        """
        views = {} if self.precision is None else self.precision.views(self.precision_state)
        ema = {EMA.view: self.ema_state} if averaging(self.ema_state) else {}
        return {OPT_STATE.view: self.opt_state, **views, **ema}

    def unsplit_parts(self) -> frozenset[str]:
        """The parts of :meth:`by_part` whose children ZeRO-1 never splits (a rounding key), as declared."""
        children = (OPT_STATE, *(() if self.precision is None else self.precision.children), EMA)
        split = {child.view for child in children if child.zero}
        return frozenset(child.view for child in children if child.view not in split)

    def from_parts(self, by_part: Mapping[str, Any], step: Any) -> StateParts:
        """Parts like these holding ``by_part`` (shaped like :meth:`by_part`'s result) and ``step``, by name.

        Example:
            >>> import jax.numpy as jnp
            >>> parts = StateParts(jnp.int32(0), {"w": jnp.zeros(2)})
            >>> parts.from_parts({"opt_state": {"w": "spec"}}, step="spec").opt_state
            {'w': 'spec'}
        """
        precision_state = self.precision_state
        if self.precision is not None:
            precision_state = self.precision.from_views(precision_state, by_part)
        ema_state = by_part[EMA.view] if averaging(self.ema_state) else self.ema_state
        return dataclasses.replace(
            self, step=step, opt_state=by_part[OPT_STATE.view], precision_state=precision_state, ema_state=ema_state
        )


def plain_state(parts: StateParts) -> dict[str, Any]:
    """The state dict of ``parts`` built from its leaves as they are (also for a tree of indices)."""
    return {
        STEP.name: key_data(parts.step),
        OPT_STATE.name: to_plain(parts.opt_state),
        **to_plain(parts.entries()),
    }


def state_dict(parts: StateParts) -> dict[str, Any]:
    """``{"step": ..., "opt_state": ...}`` (and ``"master"``) of the state's parts (see the module doc)."""
    return plain_state(parts)


def target(parts: StateParts) -> Target:
    """The slots of the state's parts, at the paths of their state dict."""
    return Target.of(parts, plain=plain_state, describe_fixed=describe_entry)


def check_state_dict(parts: StateParts, sd: Any) -> LoadReport:
    """What loading ``sd`` into ``parts`` would load, and what it would not (see ``serialization.check_state_dict``)."""
    source = StateDictSource(sd, "check_state_dict")
    read_verified(source, {})
    source = StateDictSource(_in_target_form(parts, sd, legacy_only=True)[0], "check_state_dict")
    return match(target(parts), source.entries(), EXACT)[1]


def load_state_dict(parts: StateParts, sd: Any, strict: bool = True) -> StateParts:
    """New parts like ``parts`` with the values of ``sd`` (see ``Optimizer.load_state_dict``)."""
    refuse_a_negative_step(sd, _LOAD.lead)
    sd = _in_target_form(parts, sd, legacy_only=True)[0]
    return load(target(parts), StateDictSource(sd), EXACT, _LOAD, strict=strict)[0]


def warm_start(
    parts: StateParts,
    names: Sequence[str],
    source: Any,
    include: Callable[[str], bool] | None = None,
    exclude: Callable[[str], bool] | None = None,
    hyperparams: bool = False,
) -> tuple[StateParts, LoadReport]:
    """Copies the leaves of ``source`` (a state dict) that fit ``parts``; see ``serialization.warm_start``.

    ``names`` are the trained parameters' names.
    """

    def wanted(path: Path) -> bool:
        child = child_named(path[0]) if path else None
        if child is not None and not child.warm_start:
            return False
        name = path_str(path)
        if not hyperparams and ("hyperparams" in path or "hyperparams_states" in path):
            return False
        return (include is None or include(name)) and not (exclude is not None and exclude(name))

    refuse_a_negative_step(source, _LOAD.lead)
    roles = Roles(frozenset(names), wanted)
    source, converted = _in_target_form(parts, source)
    source_ = StateDictSource(source, "warm_start")
    loaded, report = load(target(parts), source_, EXACT_OR_WIDER, _LOAD, strict=None, roles=roles)
    return loaded, dataclasses.replace(report, converted=converted)


def _in_target_form(
    parts: StateParts, source: Any, legacy_only: bool = False
) -> tuple[Any, tuple[tuple[str, str, str], ...]]:
    """``source`` with full-precision and low-bit values converted where the target holds another form.

    The low-bit wing converts (:func:`treeopt._lowbit.in_target_form`).
    ``legacy_only``: convert only low-bit values written before their format
    was recorded (an exact load reads them in the current format, decoded
    and encoded again); everything else stays for the engine to match or
    refuse. A converted source is verified against its checksum first, then
    loses it: its values are no longer the ones the checksum covers.
    """
    if not isinstance(source, Mapping):
        return source, ()
    flat, converted = in_target_form(
        parts, lambda tree: flatten_paths(plain_state(tree)), flatten_paths(source), legacy_only
    )
    if flat is None:
        return source, ()
    read_verified(StateDictSource(source, "warm_start"), {})
    flat.pop((CHECKSUM_KEY,), None)
    return traverse_util.unflatten_dict(flat), converted
