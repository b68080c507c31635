"""Adafactor and logical axes: factor rules from the params' axes, and the axes of the state.

Example:
    >>> from jax.sharding import PartitionSpec as P
    >>> from treeopt.t5x._adafactor_rules import standard_logical_factor_rules
    >>> factor_map_of(standard_logical_factor_rules(), {"wi": P("embed", "mlp")})
    {'wi': (<FactorDim.ROW: 2>, <FactorDim.COLUMN: 3>)}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from treeopt.internal import spec_leaves_with_names
from treeopt.t5x._adafactor_rules import axes_to_rule
from treeopt.t5x._adafactor_step import AdafactorParamState


def factor_map_of(rules: Mapping[str, Any], param_logical_axes: Any) -> dict[str, Any]:
    """``{path: factor rule}`` of the params, from their logical axes, as T5X's ``set_param_axes``.

    A parameter whose axes are ``None`` gets the rule ``None`` (unfactored).
    """
    return {
        name: None if axes is None else axes_to_rule(rules, tuple(axes), name)
        for name, axes in spec_leaves_with_names(param_logical_axes)
    }


def state_axes(
    shape: Sequence[int], axes: Any, state: AdafactorParamState, factored: Any, beta1: Any
) -> AdafactorParamState:
    """The logical axes of one parameter's state, from the parameter's ``axes``.

    ``v`` gets them unless it is a ``(1,)`` placeholder, ``m`` when ``beta1`` is
    set (nonzero); the factored ``v_row``/``v_col`` get them without the
    dimensions they average over (``factored``: ``(d1, d0)`` or ``None``).
    All ``None`` when ``axes`` is ``None``.
    """
    if axes is None:
        return AdafactorParamState(None, None, None, None)
    entries = (*axes, *([None] * (len(shape) - len(axes))))

    def without(dims: tuple[int, ...]) -> PartitionSpec:
        return PartitionSpec(*(e for i, e in enumerate(entries) if i not in dims))

    v_row = v_col = None
    if factored is not None:
        d1, d0 = factored
        v_row, v_col = without(d0), without(d1)
    v = axes if tuple(np.shape(state.v)) != (1,) else None
    m = axes if beta1 else None
    return AdafactorParamState(v_row, v_col, v, m)
