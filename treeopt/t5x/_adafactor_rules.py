"""Adafactor's factoring rules, as T5X writes them: factor dims, rule maps, and how a rule is read.

A rule gives one :class:`FactorDim` per dimension of a parameter, or asks for
the size heuristic (:data:`HEURISTIC_RULE`); :func:`read_rule` turns it into
the dimensions Adafactor averages over and the ones it factors, as T5X's
``Adafactor._parse_rule`` does.
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Union

import jax
from flax.core import freeze

from treeopt import leaf_names

logger = logging.getLogger("treeopt.t5x.adafactor")  # the module users configure logging for


class FactorDim(enum.Enum):
    """How Adafactor treats one dimension of a parameter in its second-moment statistics.

    ``ROW`` dimensions are averaged out of ``v_col``, ``COLUMN`` dimensions out
    of ``v_row``; ``BATCH`` dimensions (stacked layers, fused projections) keep
    separate statistics and are left out of the RMS of the parameter scale and
    of update clipping; ``NONE`` dimensions are not factored.

    Example:
        >>> FactorDim.ROW, FactorDim.NONE.value
        (<FactorDim.ROW: 2>, None)
    """

    NONE = None
    BATCH = 1
    ROW = 2
    COLUMN = 3


class HeuristicRule(enum.Enum):
    """The type of :data:`HEURISTIC_RULE`: a factor rule that asks for the size heuristic.

    Example:
        >>> HEURISTIC_RULE is HeuristicRule.token
        True
    """

    token = 1


HEURISTIC_RULE = HeuristicRule.token
FactorRule = Union[HeuristicRule, tuple[FactorDim, ...]]  # noqa: UP007 - T5X's alias, a runtime value
"""A factor rule: :data:`HEURISTIC_RULE` or one :class:`FactorDim` per dimension."""

_FACTOR_NAMES = {
    "row": FactorDim.ROW,
    "col": FactorDim.COLUMN,
    "column": FactorDim.COLUMN,
    "batch": FactorDim.BATCH,
    "none": FactorDim.NONE,
    "unfactorized": FactorDim.NONE,
}


def factor_name_to_factordim(name: Any) -> Any:
    """The :class:`FactorDim` a name spells (any case); anything that is not a string comes back as given.

    Names: ``"row"``, ``"col"``/``"column"``, ``"batch"``, ``"none"``/``"unfactorized"``.
    Another string raises ``KeyError``.

    Example:
        >>> factor_name_to_factordim("Col"), factor_name_to_factordim(FactorDim.ROW)
        (<FactorDim.COLUMN: 3>, <FactorDim.ROW: 2>)
    """
    if not isinstance(name, str):
        return name
    try:
        return _FACTOR_NAMES[name.lower()]
    except KeyError:
        raise KeyError(
            f"Unknown factor dimension name {name!r}; known names: {sorted(_FACTOR_NAMES)}."
        ) from None


def standard_logical_factor_rules() -> Any:
    """Factoring of T5X's standard logical axis names, for ``Adafactor(logical_factor_rules=...)``.

    Example:
        >>> rules = standard_logical_factor_rules()
        >>> rules["embed"], rules["mlp"], rules["layers"]
        (<FactorDim.ROW: 2>, <FactorDim.COLUMN: 3>, <FactorDim.BATCH: 1>)
    """
    return freeze(
        {
            "vocab": FactorDim.COLUMN,
            "embed": FactorDim.ROW,
            "mlp": FactorDim.COLUMN,
            "heads": FactorDim.COLUMN,
            "kv": FactorDim.COLUMN,
            "joined_kv": FactorDim.COLUMN,
            "relpos_buckets": FactorDim.NONE,
            "layers": FactorDim.BATCH,
            "stack": FactorDim.BATCH,
            "q_wi_fused": FactorDim.COLUMN,
            "o_wo_fused": FactorDim.COLUMN,
            "multiquery_heads": FactorDim.COLUMN,
            "kv_fused": FactorDim.COLUMN,
            "layer_norm_scale": FactorDim.NONE,
            "mlp_activations": FactorDim.COLUMN,
        }
    )


class HParamMap:
    """Parameter path → hyperparameter by regular expressions (``re.search``): the first match wins.

    Paths join the keys to a parameter with ``"/"``
    (``"encoder/layers_0/mlp/wi/kernel"``). A path no rule matches raises
    ``KeyError``.

    Example:
        >>> hp = HParamMap([("bias$", False), (".*", True)])
        >>> hp["dense/bias"], hp["dense/kernel"]
        (False, True)
        >>> hp({"dense": {"bias": 0.0, "kernel": 0.0}})
        {'dense': {'bias': False, 'kernel': True}}
    """

    def __init__(self, rules: Sequence[tuple[str, Any]]):
        self._rules = [(re.compile(pattern), value) for pattern, value in rules]

    def __getitem__(self, key: str) -> Any:
        for regex, value in self._rules:
            if regex.search(key):
                return value
        raise KeyError(f"No factor rule found for parameter: {key}")

    def __call__(self, params: Any) -> Any:
        """A tree shaped like ``params`` holding each parameter's value."""
        values = [self[name] for name in leaf_names(params)]
        return jax.tree.unflatten(jax.tree.structure(params), values)


def read_rule(
    rule: Any, shape: Sequence[int], path: str, fallback_to_heuristics: bool
) -> tuple[Any, Any, bool]:
    """``(averaging_dims, factored_dims, fell_back)`` of a rule: T5X's ``_parse_rule`` without its log line."""
    ndim = len(shape)
    every_dim = tuple(range(ndim))
    if rule is None:
        return every_dim, None, False
    if rule is HEURISTIC_RULE:
        if ndim > 2:
            raise ValueError(
                f"A parameter of rank above 2 needs an explicit factorization rule: '{path}' has shape "
                f"{tuple(shape)}. Give one with factor_map=HParamMap([...]) or logical_factor_rules "
                "and set_param_axes."
            )
        return every_dim, HEURISTIC_RULE, False
    if len(rule) != ndim:
        raise ValueError(
            f"Factorization rule {rule} has {len(rule)} entries but parameter '{path}' has rank {ndim} "
            f"(shape {tuple(shape)})."
        )
    rows = tuple(i for i, d in enumerate(rule) if d == FactorDim.ROW)
    columns = tuple(i for i, d in enumerate(rule) if d == FactorDim.COLUMN)
    batch = tuple(i for i, d in enumerate(rule) if d == FactorDim.BATCH)
    if fallback_to_heuristics and ndim <= 2 and not batch:
        return every_dim, HEURISTIC_RULE, True
    averaging = tuple(i for i in every_dim if i not in batch)
    factored = None if not rows and not columns else (rows, columns)
    return averaging, factored, False


def log_fallback(path: str, ndim: int, rule: Any) -> None:
    logger.warning(
        "Adafactor: parameter %s has rank %d <= 2 and no BATCH dimension, so its factor rule %s is "
        "ignored and the size heuristic decides its factoring (as in T5X).",
        path,
        ndim,
        rule,
    )


class Plan(NamedTuple):
    """How one parameter is updated: dims of its RMS, its factored dims ``(d1, d0)`` or None, parameter scaling."""

    averaging: tuple[int, ...]
    factored: tuple[tuple[int, ...], tuple[int, ...]] | None
    scale_by_param: bool


def axes_to_rule(rules: Mapping[str, Any], axes: tuple[Any, ...], path: str) -> tuple[Any, ...]:
    """A parameter's factor rule from its logical axis names, as T5X's ``set_param_axes`` builds it."""
    missing = [axis for axis in axes if axis not in rules]
    if missing:
        raise KeyError(
            f"logical_factor_rules has no rule for axis {missing[0]!r} of parameter '{path}' (axes {axes})."
        )
    dims = tuple(factor_name_to_factordim(rules[axis]) for axis in axes)
    has_row, has_column = FactorDim.ROW in dims, FactorDim.COLUMN in dims
    if has_row and has_column and FactorDim.NONE in dims:
        raise ValueError(
            f"Incomplete adafactor spec {dims} for {axes} (parameter '{path}'): ROW and COLUMN axes "
            "together with a NONE axis."
        )
    if not (has_row and has_column):
        dims = tuple(FactorDim.NONE if d in (FactorDim.ROW, FactorDim.COLUMN) else d for d in dims)
    return dims
