"""The exponential moving average of the params (``ema=``): its rules, its start and its update.

After each update, ``ema <- decay * ema + (1 - decay) * new`` for every
param a rule selects, where ``new`` is the param's exact new value in
float32: its master copy under master weights, the param plus its Kahan
compensation under Kahan rounding, the param itself otherwise
(:meth:`treeopt._step.precision.Precision.exact_values`), never a value
rounded to a narrow dtype. The average starts from the params given to
``init``, is float32 whatever the params' dtype, and is a state child of its
own (:data:`treeopt._tree.children.EMA`): never quantized, split by ZeRO-1
like the masters, written to state dicts under ``"ema"``.

Under ``optax.MultiSteps`` the average moves only on the calls that apply
an update (``gradient_step`` advances), so the decay counts updates of the
params, not micro-batches. A decay may be a schedule of the step count
before the update, as optax schedules are.

Example:
    >>> import jax.numpy as jnp
    >>> rules = checked_ema(0.9)
    >>> ema = fresh_ema(rules, {"w": jnp.ones(2, jnp.bfloat16)})
    >>> ema["w"].dtype, averaged(ema, decays_by_name(rules, ["w"]), 0, {"w": jnp.zeros(2)}, None)["w"].tolist()
    (dtype('float32'), [0.8999999761581421, 0.8999999761581421])
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from treeopt._tree.children import NO_AVERAGE
from treeopt._tree.masks import checked_rules, values_by_name

__all__ = ["EmaRules", "after_update", "averaged", "checked_ema", "decays_by_name", "fresh_ema"]

EmaRules = tuple[tuple[str, Any], ...] | None
_CHOICES = "None, a decay in [0, 1) or a schedule of the step, or a mapping {glob over parameter names: decay | None}"


def _valid(decay: Any, none_ok: bool) -> bool:
    if decay is None:
        return none_ok
    if callable(decay):
        return True
    return isinstance(decay, (int, float)) and not isinstance(decay, bool) and 0.0 <= float(decay) < 1.0


def checked_ema(ema: Any) -> EmaRules:
    """``ema`` as ``((glob, decay), ...)`` read in order (``None`` stays ``None``), or an error naming the choices.

    Example:
        >>> checked_ema(0.999), checked_ema({"embed/*": None, "*": 0.99}), checked_ema(None)
        ((('*', 0.999),), (('embed/*', None), ('*', 0.99)), None)
        >>> checked_ema(1.0)
        Traceback (most recent call last):
        ...
        ValueError: ema must be None, a decay in [0, 1) or a schedule of the step, or a mapping {glob over parameter names: decay | None}, got 1.0.
    """
    return checked_rules("ema", ema, _valid, _CHOICES)


def decays_by_name(rules: EmaRules, names: Sequence[str]) -> dict[str, Any]:
    """``{name: decay}`` of the params whose average is kept; globs checked as ``state_bits=``'s are.

    Example:
        >>> decays_by_name((("embed/*", None), ("*", 0.99)), ["embed/table", "dense/kernel"])
        {'dense/kernel': 0.99}
    """
    return values_by_name("ema", rules, names)


def fresh_ema(rules: EmaRules, flat: Mapping[str, Any]) -> dict[str, Any] | tuple[()]:
    """The averages at ``init``: a float32 copy of each selected param (``NO_AVERAGE`` without ``ema=``)."""
    if rules is None:
        return NO_AVERAGE
    return {name: jnp.array(flat[name], jnp.float32, copy=True) for name in decays_by_name(rules, list(flat))}


def averaged(
    ema: Mapping[str, Any], decays: Mapping[str, Any], step: Any, new: Mapping[str, Any], applied: Any
) -> dict[str, Any]:
    """``decay * ema + (1 - decay) * new`` of each average, where ``applied`` (``None``: always).

    ``decays``: ``{name: decay or schedule}``; ``step``: the count before the
    update, which a schedule is called with; ``new``: the exact new values.
    """
    out = {}
    for name, decay in decays.items():
        d = jnp.asarray(decay(step) if callable(decay) else decay, jnp.float32)
        average = d * ema[name] + (1 - d) * jnp.asarray(new[name], jnp.float32)
        out[name] = average if applied is None else jnp.where(applied, average, ema[name])
    return out


@functools.lru_cache(maxsize=64)
def _decays(rules: EmaRules, names: tuple[str, ...]) -> tuple[tuple[str, Any], ...]:
    """``decays_by_name`` as static data of the compiled average: the same rules read the same each step."""
    return tuple(decays_by_name(rules, names).items())


def after_update(
    ema: Mapping[str, Any],
    rules: EmaRules,
    names: tuple[str, ...],
    step: Any,
    precision: Any,
    old_opt_state: Any,
    out: Any,
    params: Mapping[str, Any] | None,
    apply_updates: bool,
) -> dict[str, Any]:
    """The averages after one step (``out``, a :class:`~treeopt._step.step_io.FlatStep` by name), in one program.

    ``names`` are the trained params' names; ``step`` is the count before the
    step and ``old_opt_state`` the optax state before it; ``params`` the flat
    params given (read with ``apply_updates=False``, where the new params are
    the given ones plus the updates). Under ``optax.MultiSteps`` the averages
    move only where ``gradient_step`` advanced.
    """
    if not apply_updates and params is None:
        missing = [name for name in ema if name not in precision.exact_values(out.precision_state, {})]
        if missing:
            raise ValueError(
                f"ema= averages the new params, and this update returns only their updates without the params "
                f"of {missing[:4]}{' ...' if len(missing) > 4 else ''}: call opt.update(grads, params, "
                "apply_updates=False)."
            )
    before = optax.tree_utils.tree_get(old_opt_state, "gradient_step")
    after = optax.tree_utils.tree_get(out.opt_state, "gradient_step")
    return _next_averages(
        _decays(rules, names), precision, apply_updates,
        dict(ema), step, out.output, out.precision_state, params, before, after,
    )  # fmt: skip


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _next_averages(
    decays: tuple[tuple[str, Any], ...],
    precision: Any,
    apply_updates: bool,
    ema: dict[str, Any],
    step: Any,
    output: Mapping[str, Any],
    precision_state: Any,
    params: Mapping[str, Any] | None,
    before: Any,
    after: Any,
) -> dict[str, Any]:
    if apply_updates:
        new = {name: output[name] for name in ema}
    elif params is not None:
        new = {
            name: jnp.asarray(params[name], jnp.float32) + jnp.asarray(output[name], jnp.float32)
            for name in ema
        }
    else:
        new = {}
    applied = None if before is None or after is None else after != before
    return averaged(ema, dict(decays), step, precision.exact_values(precision_state, new), applied)
