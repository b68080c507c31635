"""Masks and labels from parameter names, for ``optax.masked``, ``multi_transform`` and friends.

Patterns are globs matched against the whole name (``"*/kernel"``, ``"encoder/*"``;
``*`` also crosses ``"/"``), or regular expressions searched in the name with
``regex=True`` (``r"kernel$"``). The returned callables take any params tree
(treeopt's flat named dict, or a nested tree when used with raw optax) and
return a tree of the same structure.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from treeopt._tree.paths import leaf_names
from treeopt.typing import Params, TreeFn

__all__ = ["checked_globs", "labels", "mask", "name_matcher"]


def name_matcher(patterns: str | Iterable[str], regex: bool = False) -> Callable[[str], bool]:
    """A predicate that is True for names matching any of ``patterns``.

    Example:
        >>> is_kernel = name_matcher("*kernel")
        >>> is_kernel("dense/kernel"), is_kernel("dense/bias")
        (True, False)
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    compiled = [re.compile(p if regex else fnmatch.translate(p)) for p in patterns]
    if regex:
        return lambda name: any(c.search(name) for c in compiled)
    return lambda name: any(c.match(name) for c in compiled)


def checked_globs(option: str, rules: Sequence[tuple[str, Any]], names: Sequence[str]) -> None:
    """An error naming ``option`` if a glob of ``rules`` (``((glob, value), ...)``, the first match deciding)
    matches no name, or only names an earlier glob already decides (it has no effect).

    Example:
        >>> checked_globs("owned", (("*", True), ("embed/*", False)), ["embed/table", "dense/kernel"])
        Traceback (most recent call last):
        ...
        ValueError: owned: the glob 'embed/*' comes after '*', which already decides every name it matches (['embed/table']): it has no effect. Put the narrower glob first: owned={'embed/*': ..., '*': ...}.
    """
    matchers = [(glob, name_matcher(glob)) for glob, _ in rules]
    unmatched = [glob for glob, match in matchers if not any(match(name) for name in names)]
    if unmatched:
        shown = ", ".join(repr(n) for n in list(names)[:8]) + (", ..." if len(names) > 8 else "")
        raise ValueError(
            f"{option}: the glob(s) {unmatched} match no trained parameter: a typo, or a name "
            f"that changed? The parameters are {shown}. A glob matches whole '/'-separated names: "
            "'encoder/*', '*kernel'."
        )
    deciding: dict[str, str] = {}  # name -> the glob that decides it
    for glob, match in matchers:
        matched = [name for name in names if match(name)]
        if all(name in deciding for name in matched):
            earlier = sorted({deciding[name] for name in matched}, key=[g for g, _ in matchers].index)
            shown = ", ".join(repr(g) for g in earlier)
            raise ValueError(
                f"{option}: the glob {glob!r} comes after {shown}, which already decides every name it "
                f"matches ({matched[:8]}): it has no effect. Put the narrower glob first: "
                f"{option}={{{glob!r}: ..., {earlier[0]!r}: ...}}."
            )
        for name in matched:
            deciding.setdefault(name, glob)


def checked_rules(
    option: str, value: Any, valid: Callable[[Any, bool], bool], choices: str
) -> tuple[tuple[str, Any], ...] | None:
    """An option given for every parameter or by name, as rules ``((glob, value), ...)`` read in order.

    ``None`` stays ``None``; a mapping ``{glob: value}`` is its rules, each
    value checked by ``valid(value, True)`` (``True``: in a mapping, where
    ``None`` leaves a name out); any other value is ``(("*", value),)``,
    checked by ``valid(value, False)``. A ``ValueError`` names the option and
    ``choices`` otherwise.

    Example:
        >>> valid = lambda v, in_mapping: v in (8, 4) or (in_mapping and v is None)
        >>> checked_rules("state_bits", 8, valid, "8 or 4"), checked_rules("state_bits", {"b": None, "*": 4}, valid, "")
        ((('*', 8),), (('b', None), ('*', 4)))
        >>> checked_rules("state_bits", 16, valid, "8 or 4")
        Traceback (most recent call last):
        ...
        ValueError: state_bits must be 8 or 4, got 16.
    """
    if value is None:
        return None
    if isinstance(value, Mapping):
        rules = tuple(value.items())
        bad = [(glob, v) for glob, v in rules if not isinstance(glob, str) or not valid(v, True)]
        if not bad and rules:
            return rules
        shown = f"the entries {dict(bad)}" if bad else "an empty mapping"
        raise ValueError(f"{option} must be {choices}, got {shown}.")
    if valid(value, False):
        return (("*", value),)
    raise ValueError(f"{option} must be {choices}, got {value!r}.")


def values_by_name(option: str, rules: Sequence[tuple[str, Any]] | None, names: Sequence[str]) -> dict[str, Any]:
    """``{name: value}`` of the names whose first matching glob of ``rules`` gives a value other than ``None``.

    The globs are checked first (:func:`checked_globs`): each must decide a name.

    Example:
        >>> values_by_name("ema", (("embed/*", None), ("*", 0.9)), ["embed/table", "dense/kernel"])
        {'dense/kernel': 0.9}
    """
    if not rules:
        return {}
    checked_globs(option, rules, names)
    matchers = [(name_matcher(glob), value) for glob, value in rules]
    out = {}
    for name in names:
        value = next((value for match, value in matchers if match(name)), None)
        if value is not None:
            out[name] = value
    return out


def _map_names(fn: Callable[[str], Any], params: Params) -> Any:
    dtype = getattr(params, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jnp.integer):
        # optax.inject_hyperparams calls non-static callables with the integer step count;
        # a params tree (even a single array, named "") is a container or a float leaf.
        raise TypeError(
            "A name mask/labels callable got a single unnamed value instead of a params "
            "tree. Inside optax.inject_hyperparams, declare it static: "
            "optax.inject_hyperparams(optax.adamw, static_args='mask')(...)."
        )
    names = iter(leaf_names(params))
    return jax.tree.map(lambda _: fn(next(names)), params)


def mask(*patterns: str, regex: bool = False, invert: bool = False) -> TreeFn:
    """A mask callable: True where a parameter's name matches one of ``patterns``.

    Use it wherever optax takes a mask (``optax.masked``, ``optax.adamw(mask=...)``).

    Example:
        >>> import optax, jax.numpy as jnp
        >>> no_decay_on_bias = mask("*bias", invert=True)
        >>> no_decay_on_bias({"dense/kernel": jnp.ones(2), "dense/bias": jnp.ones(2)})
        {'dense/bias': False, 'dense/kernel': True}
        >>> tx = optax.adamw(1e-3, mask=no_decay_on_bias)
    """
    if not patterns:
        raise ValueError("mask() needs at least one pattern, e.g. mask('*kernel').")
    match = name_matcher(patterns, regex)
    return lambda params: _map_names(lambda name: match(name) != invert, params)


def labels(
    rules: Mapping[str, str] | Sequence[tuple[str, str]],
    default: str | None = None,
    regex: bool = False,
) -> TreeFn:
    """A labels callable for ``optax.multi_transform`` / ``optax.partition``: first matching rule wins.

    Names that match no rule get ``default``; with no default they are an error
    that names them.

    Example:
        >>> import optax, jax.numpy as jnp
        >>> by_kind = labels({"*kernel": "decay", "*bias": "no_decay"})
        >>> by_kind({"dense/kernel": jnp.ones(2), "dense/bias": jnp.ones(2)})
        {'dense/bias': 'no_decay', 'dense/kernel': 'decay'}
        >>> tx = optax.multi_transform(
        ...     {"decay": optax.adamw(1e-3), "no_decay": optax.adam(1e-3)}, by_kind)
    """
    items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
    matchers = [(name_matcher(pattern, regex), label) for pattern, label in items]

    def label_of(name: str) -> str:
        for match, label in matchers:
            if match(name):
                return label
        if default is None:
            raise ValueError(
                f"Parameter '{name}' matches no label rule {[p for p, _ in items]}; "
                "add a rule for it or pass default=..."
            )
        return default

    return lambda params: _map_names(label_of, params)
