"""Low-bit state (``state_bits=``): which leaves of any optax state are held as codes, and the codes around a step.

A leaf of the optax state is held as block-wise codes (:mod:`treeopt._state.lowbit`)
when all of these hold:

- it belongs to a trained parameter: its key path goes through the dict keyed
  by parameter names that optax made from the flat, named params, and it has
  that parameter's shape (moments, accumulators of squares, traces; factored
  statistics such as Adafactor's ``v_row`` are small and stay as they are);
- it is floating-point and has at least :data:`MIN_ELEMENTS` elements (smaller
  leaves stay as optax made them, as bitsandbytes' ``min_8bit_size``);
- the parameter's name matches a glob of ``state_bits`` whose value is 8 or 4
  (the first matching glob decides; names no glob matches keep full precision);
- it is not state whose precision is the algorithm: the gradient accumulator
  of ``optax.MultiSteps`` (``acc_grads``) and the copy of the params that
  schedule-free optimizers keep (``z``) stay as they are, as do master
  weights, which live outside the optax state. For a transformation of your
  own that keeps such values, exclude its parameters by name
  (``state_bits={"*": 8}`` → ``{"embed/*": None, "*": 8}``).

In a step the codes are read as floats, ``tx.update`` runs, and the new values
are encoded again; traced inside the step, XLA fuses the three.

Example:
    >>> import jax.numpy as jnp, optax
    >>> from treeopt.layout import ParamLayout
    >>> params = {"w": jnp.ones((64, 64)), "b": jnp.ones(64)}
    >>> state = quantized_state(optax.adam(1e-3).init(params), ParamLayout.of(params), checked_state_bits(8))
    >>> type(state[0].mu["w"]).__name__, type(state[0].mu["b"]).__name__
    ('QuantizedLeaf', 'ArrayImpl')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from treeopt._state.lowbit import QuantizedLeaf, block_size, is_quantized, quantize
from treeopt._state.plain import Path, flatten_paths, path_str
from treeopt._tree.layout import ParamLayout
from treeopt._tree.masks import name_matcher
from treeopt._tree.paths import param_owners

__all__ = [
    "MIN_ELEMENTS",
    "checked_state_bits",
    "converted_source",
    "decoded",
    "encoded_like",
    "quantized_state",
]

MIN_ELEMENTS = 4096
"""Leaves with fewer elements keep full precision: their codes would save little and cost a scale a block."""

StateBits = tuple[tuple[str, int | None], ...] | None
_CHOICES = "None, 8, 4, or a mapping {glob over parameter names: 8 | 4 | None}"

# State whose precision is the algorithm: (state type, field). Everything else is read by shape and name.
_KEPT_FIELDS: tuple[tuple[type, str], ...] = (
    (optax.MultiStepsState, "acc_grads"),
    (optax.contrib.ScheduleFreeState, "z"),
)


def checked_state_bits(state_bits: Any) -> StateBits:
    """``state_bits`` as ``((glob, bits), ...)`` read in order (``None`` stays ``None``), or an error naming the choices.

    Example:
        >>> checked_state_bits(8), checked_state_bits({"embed/*": None, "*": 4}), checked_state_bits(None)
        ((('*', 8),), (('embed/*', None), ('*', 4)), None)
        >>> checked_state_bits(16)
        Traceback (most recent call last):
        ...
        ValueError: state_bits must be None, 8, 4, or a mapping {glob over parameter names: 8 | 4 | None}, got 16.
    """
    if state_bits is None:
        return None
    if isinstance(state_bits, Mapping):
        rules = tuple(state_bits.items())
        bad = [
            (glob, bits) for glob, bits in rules if not isinstance(glob, str) or not _valid_bits(bits, True)
        ]
        if not bad and rules:
            return rules
        shown = f"the entries {dict(bad)}" if bad else "an empty mapping"
        raise ValueError(f"state_bits must be {_CHOICES}, got {shown}.")
    if _valid_bits(state_bits, False):
        return (("*", state_bits),)
    raise ValueError(f"state_bits must be {_CHOICES}, got {state_bits!r}.")


def _valid_bits(bits: Any, none_ok: bool) -> bool:
    if bits is None:
        return none_ok
    return isinstance(bits, int) and not isinstance(bits, bool) and bits in (8, 4)


def bits_by_name(rules: StateBits, names: Sequence[str]) -> dict[str, int]:
    """``{name: bits}`` of the parameters whose state is held in low bits; a glob matching no name is an error.

    Example:
        >>> bits_by_name((("embed/*", None), ("*", 8)), ["embed/table", "dense/kernel"])
        {'dense/kernel': 8}
    """
    if not rules:
        return {}
    matchers = [(glob, name_matcher(glob), bits) for glob, bits in rules]
    unmatched = [glob for glob, match, _ in matchers if not any(match(name) for name in names)]
    if unmatched:
        shown = ", ".join(repr(n) for n in list(names)[:8]) + (", ..." if len(names) > 8 else "")
        raise ValueError(
            f"state_bits: the glob(s) {unmatched} match no trained parameter: a typo, or a name "
            f"that changed? The parameters are {shown}. A glob matches whole '/'-separated names: "
            "'encoder/*', '*kernel'."
        )
    out = {}
    for name in names:
        bits = next((bits for _, match, bits in matchers if match(name)), None)
        if bits is not None:
            out[name] = bits
    return out


def _kept_prefixes(opt_state: Any) -> list[tuple[Any, ...]]:
    """Key paths of the state whose precision is the algorithm (see the module doc)."""
    types = tuple(cls for cls, _ in _KEPT_FIELDS)
    found = []
    for path, node in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=lambda x: isinstance(x, types))[
        0
    ]:
        for cls, field in _KEPT_FIELDS:
            if isinstance(node, cls):
                found.append((*path, jax.tree_util.GetAttrKey(field)))
                inner = {f: getattr(node, f) for f in getattr(type(node), "_fields", ()) if f != field}
                found += [
                    (*path, jax.tree_util.GetAttrKey(f), *p)
                    for f, v in inner.items()
                    for p in _kept_prefixes(v)
                ]
    return found


def quantized_state(opt_state: Any, layout: ParamLayout, rules: StateBits) -> Any:
    """``opt_state`` with the leaves the module doc describes held as codes; works on abstract states too."""
    bits = bits_by_name(rules, layout.names)
    if not bits:
        return opt_state
    shapes = {name: tuple(shape) for name, (shape, _) in zip(layout.names, layout.avals, strict=True)}
    flat, treedef_ = jax.tree_util.tree_flatten_with_path(opt_state)
    treedef: Any = treedef_
    paths = [tuple(path) for path, _ in flat]
    owners = param_owners(paths, set(layout.names))
    kept = _kept_prefixes(opt_state)
    leaves = []
    for path, (_, leaf), owner in zip(paths, flat, owners, strict=True):
        name = path[owner].key if owner is not None else None
        if (
            name in bits
            and _floating(leaf)
            and tuple(leaf.shape) == shapes[name]
            and int(np.prod(leaf.shape)) >= MIN_ELEMENTS
            and not any(path[: len(prefix)] == prefix for prefix in kept)
        ):
            leaf = _quantize(leaf, bits[name])
        leaves.append(leaf)
    return treedef.unflatten(leaves)


# An eager init would run the codec op by op: compiled once per shape, it is one dispatch a leaf.
_quantize = jax.jit(quantize, static_argnums=1)


def _floating(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))


def decoded(opt_state: Any) -> Any:
    """``opt_state`` with every low-bit leaf read as the float array it stands for.

    Example:
        >>> import jax.numpy as jnp
        >>> decoded({"mu": quantize(jnp.full(4, 0.5), 8), "count": 1})
        {'count': 1, 'mu': Array([0.5, 0.5, 0.5, 0.5], dtype=float32)}
    """
    return jax.tree.map(lambda x: x.dequantize() if is_quantized(x) else x, opt_state, is_leaf=is_quantized)


def encoded_like(template: Any, new_state: Any) -> Any:
    """``new_state`` (floats) with each leaf that is low-bit in ``template`` encoded again, in its bits.

    Example:
        >>> import jax.numpy as jnp
        >>> state = {"mu": quantize(jnp.zeros(4), 8)}
        >>> type(encoded_like(state, {"mu": jnp.full(4, 0.5)})["mu"]).__name__
        'QuantizedLeaf'
    """
    if not any(is_quantized(x) for x in jax.tree.leaves(template, is_leaf=is_quantized)):
        return new_state
    return jax.tree.map(
        lambda old, new: quantize(new, old.bits) if is_quantized(old) else new,
        template,
        new_state,
        is_leaf=is_quantized,
    )


def converted_source(
    units: Mapping[Path, Any], source: Any
) -> tuple[dict[Path, Any], tuple[tuple[str, str, str], ...]]:
    """A warm start's source with values converted to the target's precision at the target's paths.

    ``units`` are the target's state leaves by state-dict path, a low-bit leaf
    as one unit (its ``codes`` and ``scales`` below it). Where the target holds
    codes and the source a float array of the same shape at the same path, the
    array is encoded; where the target holds a float array and the source
    codes and scales, they are decoded to the target's shape and dtype.
    Returns the source flattened (``{path: value}``) and ``(path, from, to)``
    of each conversion.

    Example:
        >>> import jax.numpy as jnp
        >>> units = {("mu", "w"): quantize(jnp.zeros((64, 64)), 8)}
        >>> flat, done = converted_source(units, {"mu": {"w": jnp.ones((64, 64))}})
        >>> sorted(flat), done
        ([('mu', 'w', 'codes'), ('mu', 'w', 'scales')], (('mu/w', 'float32[64, 64]', '8-bit codes'),))
    """
    flat = flatten_paths(source)
    done = []
    for path, unit in units.items():
        codes, scales = (*path, "codes"), (*path, "scales")
        if is_quantized(unit) and path in flat and codes not in flat:
            value = flat.pop(path)
            if tuple(np.shape(value)) != tuple(unit.shape):
                flat[path] = value  # another shape: the engine reports it
                continue
            encoded = quantize(jnp.asarray(value, unit.dtype), unit.bits)
            flat[codes], flat[scales] = encoded.codes, encoded.scales
            done.append(
                (
                    path_str(path),
                    f"{np.dtype(value.dtype).name}{list(np.shape(value))}",
                    f"{unit.bits}-bit codes",
                )
            )
        elif (
            not is_quantized(unit)
            and _floating(unit)
            and codes in flat
            and scales in flat
            and path not in flat
        ):
            shape = tuple(unit.shape)
            bits = 8 if tuple(np.shape(flat[codes])) == shape else 4
            block = block_size(shape[-1] if shape else 1, bits)
            leaf = QuantizedLeaf(
                flat.pop(codes),
                flat.pop(scales),
                shape=shape,
                dtype=np.dtype(unit.dtype).name,
                bits=bits,
                block=block,
            )
            flat[path] = leaf.dequantize()
            done.append((path_str(path), f"{bits}-bit codes", f"{np.dtype(unit.dtype).name}{list(shape)}"))
    return flat, tuple(done)
