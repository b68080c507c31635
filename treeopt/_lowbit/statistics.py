"""Which fields of optax's states are running statistics of the gradients, and which keep full precision.

``state_bits=`` quantizes a state leaf only when it is known to be a running
statistic: a moment, a momentum trace, an accumulator of squares, averaged
over steps so that block-wise rounding errors average out too. Everything
else keeps full precision, by construction rather than by a list of
exceptions: copies of the params (DoG's ``init_params``, schedule-free's
``z``, mechanize's ``x0``), values that set the params directly (MADGRAD's
sums), step sizes, previous gradients, L-BFGS memories, ``MultiSteps``'
accumulator, and any field of a transformation this table does not know.

Statistics that an update reads together through a difference stay at full
precision: independent codes of each do not keep the difference. Centered
RMSprop steps by ``nu - mu**2`` under a root (codes of each can make it
negative, and the root NaN); Momo steps by ``<exp_avg, params> - gamma``
against ``gamma``, an exact running ``<grad, params>`` (the codes' error,
times the params, outweighs the difference). Sums, ratios and maxima of
statistics are encoded each on its own, since the error of such a combination
is bounded by its terms' (Adam's ``mu / sqrt(nu)``, Adan's ``m + (1 - b2) v``,
AdEMAMix's ``m1 + alpha m2``, AMSGrad's ``max(nu_max, nu)``, AdaDelta's
``e_x / e_g``, Sophia's ``mu / max(gamma nu, eps)``, AdaBelief's and ACProp's
``(g - mu)**2``, a square of the gradient's distance from the mean).

:data:`STATISTICS` names each known statistic by its state type and field,
with its map: ``"signed"`` (moments, traces) or ``"unsigned"`` (second
moments and sums of squares, never negative: their map has no zero level).
:data:`FULL_PRECISION` names the params-shaped fields known to need full
precision, with why; :func:`field_table` lists, for every optax alias and
``optax.contrib`` optimizer, what each field becomes (the table of
docs/low-bit-state.md is generated from it).

Example:
    >>> import optax
    >>> statistic_map(optax.ScaleByAdamState, "nu"), statistic_map(optax.contrib.ScheduleFreeState, "z")
    ('unsigned', None)
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from treeopt._compat.optax_private import OPTAX_ADEMAMIX, OPTAX_FACTORIZED, OPTAX_TRANSFORM, is_optax_alias

__all__ = [
    "FULL_PRECISION",
    "STATISTICS",
    "FieldRow",
    "field_at",
    "field_table",
    "full_precision_reason",
    "markdown_table",
    "statistic_map",
    "statistic_signs",
]

SIGNED, UNSIGNED = "signed", "unsigned"

# (module, state type): {field: map}. Types are looked up by name, so an optax without one still imports;
# those defined in optax's private modules are keyed by the module names of treeopt._compat.optax_private.
STATISTICS: dict[tuple[str, str], dict[str, str]] = {
    ("optax", "ScaleByAdamState"): {"mu": SIGNED, "nu": UNSIGNED},
    ("optax", "ScaleByAmsgradState"): {"mu": SIGNED, "nu": UNSIGNED, "nu_max": UNSIGNED},
    ("optax", "ScaleByBeliefState"): {"mu": SIGNED, "nu": UNSIGNED},
    ("optax", "ScaleByLionState"): {"mu": SIGNED},
    ("optax", "ScaleByRmsState"): {"nu": UNSIGNED},
    (OPTAX_TRANSFORM, "ScaleByRmsWithCountState"): {"nu": UNSIGNED},
    ("optax", "ScaleByRssState"): {"sum_of_squares": UNSIGNED},
    (OPTAX_TRANSFORM, "ScaleByAdaDeltaState"): {"e_g": UNSIGNED, "e_x": UNSIGNED},
    ("optax", "ScaleByNovogradState"): {"mu": SIGNED},
    ("optax", "ScaleBySM3State"): {"nu": SIGNED},
    (OPTAX_TRANSFORM, "ScaleByAdanState"): {"m": SIGNED, "v": SIGNED, "n": UNSIGNED},
    ("optax", "TraceState"): {"trace": SIGNED},
    ("optax", "EmaState"): {"ema": SIGNED},
    (OPTAX_FACTORIZED, "FactoredState"): {"v": UNSIGNED},
    ("optax.contrib", "ScaleByAdemamixState"): {"m1": SIGNED, "m2": SIGNED, "nu": UNSIGNED},
    (OPTAX_ADEMAMIX, "ScaleBySimplifiedAdEMAMixState"): {"m": SIGNED, "n": UNSIGNED},
    ("optax.contrib", "MuonState"): {"mu": SIGNED},
    ("optax.contrib", "SophiaState"): {"mu": SIGNED, "nu": SIGNED},
    ("optax.contrib", "DAdaptAdamWState"): {"exp_avg": SIGNED, "exp_avg_sq": UNSIGNED},
    ("optax.contrib", "ProdigyState"): {"exp_avg": SIGNED, "exp_avg_sq": UNSIGNED},
    ("optax.contrib", "MomoAdamState"): {"exp_avg_sq": UNSIGNED},
}

# Params-shaped fields that are not statistics, and why: "module state-type field: why", a line each.
_FULL_PRECISION_LINES = f"""
optax.contrib DoGState init_params: a copy of the params
optax.contrib DoWGState init_params: a copy of the params
optax.contrib MechanicState x0: a copy of the params
optax.contrib ScheduleFreeState z: the params' running iterate
optax.contrib ProdigyState params0: a copy of the params
optax.contrib ProdigyState grad_sum: sets the step size estimate
optax.contrib DAdaptAdamWState grad_sum: sets the step size estimate
optax.contrib COCOBState init_particles: a copy of the params
optax.contrib COCOBState cumulative_gradients: sets the params directly
optax.contrib COCOBState scale: sets the params directly
optax.contrib COCOBState subgradients: sets the params directly
optax.contrib COCOBState reward: sets the params directly
optax.contrib MadgradState x0: a copy of the params
optax.contrib MadgradState s: sets the params directly
optax.contrib MadgradState grad_sum_sq: sets the params directly
optax MultiStepsState acc_grads: the gradient applied, summed exactly
optax ScaleByLBFGSState params: a copy of the params
optax ScaleByLBFGSState updates: the last update, for the memories
optax ScaleByLBFGSState diff_params_memory: curvature memory
optax ScaleByLBFGSState diff_updates_memory: curvature memory
optax ScaleByZoomLinesearchState grad: the gradient of the line search
{OPTAX_TRANSFORM} ScaleByAdanState g: the previous gradient
{OPTAX_TRANSFORM} ScaleByOptimisticGradientState previous_gradient: the previous gradient
{OPTAX_TRANSFORM} ScaleByRpropState step_sizes: per-element step sizes
{OPTAX_TRANSFORM} ScaleByRpropState prev_updates: the previous update
optax.contrib GaLoreState projector: a projection basis
{OPTAX_FACTORIZED} FactoredState v_row: a factored second moment, small by design
{OPTAX_FACTORIZED} FactoredState v_col: a factored second moment, small by design
optax ScaleBySM3State mu: SM3's cover of accumulated squares, small by design
optax ScaleByRStdDevState mu: read as nu - mu², which codes of each can make negative
optax ScaleByRStdDevState nu: read as nu - mu², which codes of each can make negative
{OPTAX_TRANSFORM} ScaleByRStdDevWithCountState mu: read as nu - mu², which codes of each can make negative
{OPTAX_TRANSFORM} ScaleByRStdDevWithCountState nu: read as nu - mu², which codes of each can make negative
optax.contrib MomoState exp_avg: read as exp_avg · params - gamma, a difference its codes do not keep
optax.contrib MomoAdamState exp_avg: read as exp_avg · params - gamma, a difference its codes do not keep
"""
FULL_PRECISION: tuple[tuple[str, str, str, str], ...] = tuple(
    (*head.split(), why.strip())  # type: ignore[misc]
    for head, why in (line.split(":", 1) for line in _FULL_PRECISION_LINES.strip().splitlines())
)
"""``(module, state type, field, why)`` of every params-shaped field known to need full precision."""


@functools.cache
def _resolved(table_id: int) -> dict[type, dict[str, str]]:
    """One of the two tables by state type (the types this optax has): {type: {field: map or why}}."""
    if table_id == 0:
        rows = [(m, n, f, kind) for (m, n), fields in STATISTICS.items() for f, kind in fields.items()]
    else:
        rows = list(FULL_PRECISION)
    out: dict[type, dict[str, str]] = {}
    for module, name, field, value in rows:
        cls = getattr(_module(module), name, None)
        if isinstance(cls, type):
            out.setdefault(cls, {})[field] = value
    return out


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:  # an optax without this module
        return None


def statistic_map(state_type: type, field: str) -> str | None:
    """``"signed"`` or ``"unsigned"`` when ``state_type.field`` is a known running statistic, else ``None``.

    Example:
        >>> import optax
        >>> statistic_map(optax.TraceState, "trace"), statistic_map(optax.MultiStepsState, "acc_grads")
        ('signed', None)
    """
    return _resolved(0).get(state_type, {}).get(field)


def full_precision_reason(state_type: type, field: str) -> str | None:
    """Why ``state_type.field`` keeps full precision when it is known to (a copy of the params, ...), else ``None``.

    Example:
        >>> import optax
        >>> full_precision_reason(optax.contrib.DoGState, "init_params")
        'a copy of the params'
    """
    return _resolved(1).get(state_type, {}).get(field)


def fields_by_path(opt_state: Any) -> dict[tuple[Any, ...], tuple[type, str]]:
    """``{key path of a NamedTuple field: (its state type, the field)}`` for every field in ``opt_state``.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> paths = fields_by_path(optax.adam(1e-3).init({"w": jnp.zeros(2)}))
        >>> sorted(f"{t.__name__}.{f}" for t, f in paths.values())
        ['ScaleByAdamState.count', 'ScaleByAdamState.mu', 'ScaleByAdamState.nu']
    """
    out: dict[tuple[Any, ...], tuple[type, str]] = {}

    def visit(node: Any, path: tuple[Any, ...]) -> None:
        fields = getattr(type(node), "_fields", None)
        children = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
        for keys, child in children:
            key = keys[0] if keys else None
            child_path = (*path, *keys)
            if fields is not None and isinstance(key, jax.tree_util.GetAttrKey):
                out[child_path] = (type(node), key.name)
            if keys:
                visit(child, child_path)

    visit(opt_state, ())
    return out


def statistic_signs(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[bool | None]:
    """For each leaf of ``tree`` (as ``is_leaf`` finds them), whether it is a known signed statistic (``True``), an
    unsigned one (``False``) or neither (``None``): a leaf directly under the dict of a statistic's field.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> statistic_signs(optax.adam(1e-3).init({"w": jnp.zeros(2)}))
        [None, True, False]
    """
    fields = fields_by_path(tree)
    out: list[bool | None] = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
        field = fields.get(tuple(path[:-1]))
        kind = statistic_map(*field) if field is not None else None
        out.append(None if kind is None else kind == "signed")
    return out


def field_at(opt_state: Any, path: tuple[Any, ...]) -> str:
    """The field of ``opt_state`` at ``path`` in words: ``"Type.field"`` (a NamedTuple's or a dataclass's), or
    ``"dict['key']"``; for a warning that names a state field treeopt does not know.

    Example:
        >>> import jax
        >>> state = ({"stat": {"w": 0.0}},)
        >>> field_at(state, (jax.tree_util.SequenceKey(0), jax.tree_util.DictKey("stat")))
        "dict['stat']"
        >>> field_at({"w": 0.0}, ())
        'dict (the whole state)'
    """
    if not path:
        return f"{type(opt_state).__name__} (the whole state)"
    parent, key = _value_at(opt_state, path[:-1]), path[-1]
    if isinstance(key, jax.tree_util.GetAttrKey):
        return f"{type(parent).__name__}.{key.name}"
    if isinstance(key, jax.tree_util.DictKey):
        return f"{type(parent).__name__}[{key.key!r}]"
    if isinstance(key, jax.tree_util.SequenceKey):
        return f"{type(parent).__name__}[{key.idx}]"
    return f"{type(parent).__name__}{key}"


# -- the table of the docs -------------------------------------------------------------------------


class FieldRow(NamedTuple):
    """One params-shaped field of one transformation's state, and what ``state_bits`` makes of it."""

    transformation: str
    field: str
    held: str
    """``"8/4-bit signed"``, ``"8/4-bit unsigned"``, or ``"full precision: <why>"``."""


# Options that give an alias a state of another type: each is a row of its own in the table.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "optax.sgd(momentum=0.9)": ("sgd", {"momentum": 0.9}),
    "optax.rmsprop(centered=True)": ("rmsprop", {"centered": True}),
    "optax.rmsprop(centered=True, bias_correction=True)": ("rmsprop", {"centered": True, "bias_correction": True}),
}


def transformations() -> Iterator[tuple[str, Callable[[], optax.GradientTransformation]]]:
    """``(name, factory)`` of every optax alias and ``optax.contrib`` optimizer, and of each of :data:`VARIANTS`.

    Found by listing the modules' functions, so a new optax brings its new
    optimizers: those that take a ``learning_rate`` (or wrap an optimizer),
    built with 1e-3 (or ``optax.adam(1e-3)``); building blocks without a
    learning rate (``scale_by_*``) and those that need other arguments without
    defaults are left out.
    """
    for module, functions in (
        ("optax", _aliases()),
        ("optax.contrib", sorted(n for n, f in inspect.getmembers(optax.contrib) if inspect.isfunction(f))),
    ):
        for name in functions:
            function = getattr(importlib.import_module(module), name)
            factory = _factory(function)
            if factory is not None:
                yield f"{module}.{name}", factory
    for name, (alias, options) in VARIANTS.items():
        factory = _factory(getattr(optax, alias), options)
        if factory is not None:
            yield name, factory


def _aliases() -> list[str]:
    return sorted(name for name, f in inspect.getmembers(optax, inspect.isfunction) if is_optax_alias(f))


def _factory(function: Callable[..., Any], options: Mapping[str, Any] | None = None) -> Callable[[], Any] | None:
    kwargs: dict[str, Any] = dict(options or {})
    parameters = inspect.signature(function).parameters
    if not {"learning_rate", "optimizer", "base_optimizer"} & set(parameters) or not set(kwargs) <= set(parameters):
        return None
    for p in parameters.values():
        if p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name == "learning_rate":
            kwargs[p.name] = 1e-3
        elif p.name == "key":
            kwargs[p.name] = jax.random.key(0)
        elif p.name in ("optimizer", "base_optimizer"):
            kwargs[p.name] = optax.adam(1e-3)
        else:
            return None

    def build() -> Any:
        tx = function(**kwargs)
        return tx if isinstance(tx, optax.GradientTransformation) else None

    return build


TABLE_SHAPES: dict[str, tuple[int, ...]] = {"kernel": (128, 256), "square": (64, 64), "vector": (4096,)}
"""The params the table is generated on: some transformations hold a field otherwise for other shapes
(GaLore projects a kernel's moments to a shape of their own unless it is square; Adafactor factors
large kernels)."""


def field_table() -> list[FieldRow]:
    """What ``state_bits`` holds each params-keyed state field of every optax optimizer in, by name.

    Generated on the params of :data:`TABLE_SHAPES`; where a field is held
    otherwise for one of them, its row says which shapes get what.

    Example:
        >>> rows = [row for row in field_table() if row.transformation == "optax.adam"]
        >>> [(row.field, row.held) for row in rows]
        [('ScaleByAdamState.mu', '8/4-bit signed'), ('ScaleByAdamState.nu', '8/4-bit unsigned')]
        >>> [row.held for row in field_table() if row.transformation == "optax.contrib.galore"][0]
        'full precision for (128, 256): not shaped like its param; 8/4-bit signed for (64, 64), (4096,)'
    """
    params = {name: jnp.zeros(shape) for name, shape in TABLE_SHAPES.items()}
    rows = []
    for name, factory in transformations():
        try:
            with warnings.catch_warnings():  # deprecated aliases still get a row
                warnings.simplefilter("ignore")
                tx = factory()
                state = jax.eval_shape(tx.init, params) if tx is not None else None
        except Exception:  # an optimizer that cannot init on plain params: not listed
            continue
        if state is None:
            continue
        seen = set()
        for path, (state_type, field) in fields_by_path(state).items():
            value = _value_at(state, path)
            key = f"{state_type.__name__}.{field}"
            if not (isinstance(value, dict) and set(value) == set(params)) or key in seen:
                continue
            seen.add(key)
            held = {shape: _held(state_type, field, value[n], shape) for n, shape in TABLE_SHAPES.items()}
            rows.append(FieldRow(name, key, _by_shape(held)))
    return rows


def _held(state_type: type, field: str, leaf: Any, shape: tuple[int, ...]) -> str:
    """What ``state_bits`` makes of one param's leaf of ``state_type.field``."""
    if isinstance(leaf, optax.MaskedNode):
        return "no state (masked out)"
    reason = full_precision_reason(state_type, field)
    if getattr(leaf, "shape", None) != shape:
        return f"full precision: {reason or 'not shaped like its param'}"
    kind = statistic_map(state_type, field)
    return f"8/4-bit {kind}" if kind else f"full precision: {reason or 'not a known running statistic'}"


def _by_shape(held: Mapping[tuple[int, ...], str]) -> str:
    """One ``held`` where every shape gets it, else each with the shapes that get it."""
    groups: dict[str, list[str]] = {}
    for shape, text in held.items():
        groups.setdefault(text, []).append(str(shape))
    if len(groups) == 1:
        return next(iter(groups))
    return "; ".join(
        text.replace(":", f" for {', '.join(shapes)}:", 1) if ":" in text else f"{text} for {', '.join(shapes)}"
        for text, shapes in groups.items()
    )


def markdown_table() -> str:
    """:func:`field_table` as the Markdown table of docs/low-bit-state.md.

    Regenerate the page's table with
    ``python -c "from treeopt._lowbit.statistics import markdown_table; print(markdown_table())"``.

    Example:
        >>> markdown_table().splitlines()[:2]
        ['| optimizer | state field | with state_bits |', '|---|---|---|']
    """
    lines = ["| optimizer | state field | with state_bits |", "|---|---|---|"]
    lines += [f"| {row.transformation} | {row.field} | {row.held} |" for row in field_table()]
    return "\n".join(lines)


def _value_at(tree: Any, path: tuple[Any, ...]) -> Any:
    node = tree
    for key in path:
        node = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x, n=node: x is not n)[0]
        node = next(child for keys, child in node if keys and keys[0] == key)
    return node
