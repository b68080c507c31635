"""Low-bit state (``state_bits=``): which leaves of an optax state are held as codes, and the codes around a step.

A leaf of the optax state is held as block-wise codes (:mod:`treeopt._lowbit.codec`)
when all of these hold:

- it is a known running statistic (:mod:`treeopt._lowbit.statistics`): a
  field such as ``ScaleByAdamState.mu`` that holds one value per element of
  each parameter, averaged over steps. Anything else keeps full precision by
  construction: copies of the params, values that set them directly, any
  field of a transformation treeopt does not know (reported by a warning at
  ``init``, since its state stays as large as without ``state_bits``);
- it belongs to a trained parameter, sits directly under the dict keyed by
  parameter names, and has that parameter's shape;
- it is floating-point and has at least :data:`MIN_ELEMENTS` elements
  (smaller leaves stay as optax made them, as bitsandbytes' ``min_8bit_size``);
- the parameter's name is matched by a glob of ``state_bits`` whose value is
  8 or 4 (the first matching glob decides; names no glob matches keep full
  precision; a glob that matches nothing, or only names an earlier glob
  decided, is an error).

In a step the codes are read as floats, ``tx.update`` runs, and the new
values are encoded again (:func:`encoded_after_step` says how XLA fuses
the three on a CPU and on an accelerator).

Example:
    >>> import jax.numpy as jnp, optax
    >>> from treeopt.layout import ParamLayout
    >>> params = {"w": jnp.ones((64, 64)), "b": jnp.ones(64)}
    >>> state = quantized_state(optax.adam(1e-3).init(params), ParamLayout.of(params), checked_state_bits(8))
    >>> type(state[0].mu["w"]).__name__, type(state[0].mu["b"]).__name__
    ('QuantizedLeaf', 'ArrayImpl')
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

from treeopt._lowbit.codec import (
    Format,
    QuantizedLeaf,
    block_layout,
    block_maxima,
    constant,
    encode_with,
    is_quantized,
)
from treeopt._lowbit.legacy import legacy_bits, legacy_decoded
from treeopt._lowbit.statistics import (
    field_at,
    fields_by_path,
    full_precision_reason,
    statistic_map,
    statistic_signs,
)
from treeopt._sharding.explicit import explicit_sharding, resharded_like
from treeopt._tree.layout import ParamLayout
from treeopt._tree.masks import checked_rules, values_by_name
from treeopt._tree.paths import Path, param_owners, path_str
from treeopt.errors import LoadReport, StateDictError

__all__ = [
    "CODES",
    "MIN_ELEMENTS",
    "checked_state_bits",
    "converted_source",
    "decoded",
    "in_target_form",
    "encoded_after_step",
    "has_quantized",
    "quantized_state",
]

MIN_ELEMENTS = 4096
"""Leaves with fewer elements keep full precision: their codes would save little and cost a scale a block."""

StateBits = tuple[tuple[str, int | None], ...] | None
_CHOICES = "None, 8, 4, or a mapping {glob over parameter names: 8 | 4 | None}"


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
    return checked_rules("state_bits", state_bits, _valid_bits, _CHOICES)


def _valid_bits(bits: Any, none_ok: bool) -> bool:
    if bits is None:
        return none_ok
    return isinstance(bits, int) and not isinstance(bits, bool) and bits in (8, 4)


def bits_by_name(rules: StateBits, names: Sequence[str]) -> dict[str, int]:
    """``{name: bits}`` of the parameters whose state is held in low bits.

    A glob that matches no name, or only names that an earlier glob already
    decided (``{"*": 8, "embed/*": None}``: the second one does nothing), is
    an error naming it.

    Example:
        >>> bits_by_name((("embed/*", None), ("*", 8)), ["embed/table", "dense/kernel"])
        {'dense/kernel': 8}
        >>> bits_by_name((("*", 8), ("embed/*", None)), ["embed/table", "dense/kernel"])
        Traceback (most recent call last):
        ...
        ValueError: state_bits: the glob 'embed/*' comes after '*', which already decides every name it matches (['embed/table']): it has no effect. Put the narrower glob first: state_bits={'embed/*': ..., '*': ...}.
    """
    return values_by_name("state_bits", rules, names)


# -- which leaves ----------------------------------------------------------------------------------


class Choice(NamedTuple):
    """The format a state leaf is held in, or why it keeps full precision (``fmt`` None)."""

    path: tuple[Any, ...]
    param: str | None
    fmt: Format | None
    unknown_field: str | None = None
    """``"Type.field"`` (or ``"dict['key']"``) of a params-shaped leaf kept because its field is not a known statistic."""


def choices(opt_state: Any, layout: ParamLayout, rules: StateBits) -> list[Choice]:
    """One :class:`Choice` per leaf of ``opt_state``, in tree order."""
    bits = bits_by_name(rules, layout.names)
    flat, _ = jax.tree_util.tree_flatten_with_path(opt_state)
    paths = [tuple(path) for path, _ in flat]
    if not bits:
        return [Choice(path, None, None) for path in paths]
    shapes = {name: tuple(shape) for name, (shape, _) in zip(layout.names, layout.avals, strict=True)}
    owners = param_owners(paths, set(layout.names))
    fields = fields_by_path(opt_state)
    out = []
    for path, (_, leaf), owner in zip(paths, flat, owners, strict=True):
        name = path[owner].key if owner is not None else None
        field = fields.get(path[:owner]) if owner is not None else None
        eligible = (
            name in bits
            and owner == len(path) - 1  # directly under the params dict
            and _floating(leaf)
            and tuple(leaf.shape) == shapes[name]
            and math.prod(leaf.shape) >= MIN_ELEMENTS
        )
        if not eligible:
            out.append(Choice(path, name, None))
            continue
        assert name is not None and owner is not None  # eligible: it is a trained parameter's
        if field is None:  # a dict's entry, a dataclass's field: not known either
            out.append(Choice(path, name, None, field_at(opt_state, path[:owner])))
            continue
        kind = statistic_map(*field)
        if kind is None:
            unknown = None if full_precision_reason(*field) else f"{field[0].__name__}.{field[1]}"
            out.append(Choice(path, name, None, unknown))
            continue
        axis, block = block_layout(leaf.shape, bits[name])
        out.append(Choice(path, name, Format(bits[name], kind == "signed", axis, block)))
    return out


def _floating(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))


def quantized_state(
    opt_state: Any,
    layout: ParamLayout,
    rules: StateBits,
    constants: Mapping[tuple[Any, ...], float] | None = None,
) -> Any:
    """``opt_state`` with the leaves the module doc describes held as codes; works on abstract states too.

    ``constants``: leaves known to be filled with one value (``{path: value}``,
    from :func:`constant_leaves`); their codes are built directly. A concrete
    leaf is checked for that itself. Any other traced leaf is encoded behind
    an optimization barrier, so that XLA runs the encoder rather than folding
    it on the host.
    """
    if not rules:
        return opt_state
    chosen = choices(opt_state, layout, rules)
    unknown = sorted({c.unknown_field for c in chosen if c.unknown_field})
    if unknown:
        warnings.warn(
            f"state_bits: {unknown} are not known running statistics (moments, traces, sums of squares): "
            "their leaves keep full precision. The table in docs/low-bit-state.md lists what each optax "
            "transformation keeps.",
            UserWarning,
            stacklevel=4,
        )
    leaves, treedef = jax.tree.flatten(opt_state)
    constants = constants or {}
    out = [
        _held(leaf, c.fmt, constants.get(c.path)) if c.fmt is not None else leaf
        for leaf, c in zip(leaves, chosen, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)


def _held(leaf: Any, fmt: Format, value: float | None) -> QuantizedLeaf:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.eval_shape(lambda x: encode_with(x, block_maxima(x, fmt), fmt), leaf)
    if value is None and not isinstance(leaf, jax.core.Tracer):
        low, high = (float(v) for v in _range(leaf))
        value = low if low == high or (low != low and high != high) else None
    if value is not None:
        return constant(value, leaf.shape, leaf.dtype, fmt)
    if isinstance(leaf, jax.core.Tracer):
        x, maxima = jax.lax.optimization_barrier((leaf, block_maxima(leaf, fmt)))
        return encode_with(x, maxima, fmt)
    return _encode(leaf, fmt)


# An eager init would run the encoder op by op: compiled once per shape and format, it is one dispatch.
_encode = jax.jit(lambda x, fmt: encode_with(x, block_maxima(x, fmt), fmt), static_argnums=1)
_range = jax.jit(lambda x: (jnp.min(x), jnp.max(x)))


def constant_leaves(init: Callable[[Any], Any], flat_params: Any) -> dict[tuple[Any, ...], float]:
    """``{key path: value}`` of the leaves of ``init(flat_params)`` that are one value broadcast.

    Read from the jaxpr of ``init`` (nothing runs): a leaf made by
    broadcasting a literal (``jnp.zeros_like``, ``jnp.full``), through casts
    and copies, is known without computing it.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> found = constant_leaves(optax.adagrad(0.1, initial_accumulator_value=0.1).init, {"w": jnp.ones(3)})
        >>> [round(v, 6) for v in found.values()]
        [0.1]
    """
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), flat_params)
    try:
        closed, out_shape = jax.make_jaxpr(init, return_shape=True)(abstract)
    except Exception:  # an init that cannot trace on shapes: nothing is known
        return {}
    jaxpr = closed.jaxpr
    consts = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    producer = {var: eqn for eqn in jaxpr.eqns for var in eqn.outvars}
    paths = [tuple(path) for path, _ in jax.tree_util.tree_flatten_with_path(out_shape)[0]]
    found = {}
    for path, var in zip(paths, jaxpr.outvars, strict=True):
        value = _literal_value(var, producer, consts)
        if value is not None:
            found[path] = value
    return found


def _literal_value(var: Any, producer: Mapping[Any, Any], consts: Mapping[Any, Any]) -> float | None:
    for _ in range(16):
        if isinstance(var, jax.extend.core.Literal):
            return _scalar(var.val)
        if var in consts:
            return _scalar(consts[var])
        eqn = producer.get(var)
        if eqn is None or eqn.primitive.name not in ("broadcast_in_dim", "convert_element_type", "copy", "copy_p"):
            return None
        var = eqn.invars[0]
    return None


def _scalar(value: Any) -> float | None:
    array = np.asarray(value)
    if array.size == 0 or not np.issubdtype(array.dtype, np.number):
        return None
    flat = array.reshape(-1)
    return float(flat[0]) if np.all(flat == flat[0]) else None


# -- around a step ---------------------------------------------------------------------------------


def has_quantized(opt_state: Any) -> bool:
    """Whether any leaf of ``opt_state`` is held as codes."""
    return any(is_quantized(x) for x in jax.tree.leaves(opt_state, is_leaf=is_quantized))


def decoded(opt_state: Any) -> Any:
    """``opt_state`` with every low-bit leaf read as the float array it stands for.

    Example:
        >>> import jax.numpy as jnp
        >>> from treeopt._lowbit.codec import quantize
        >>> decoded({"mu": quantize(jnp.full(4, 0.5), 8), "count": 1})
        {'count': 1, 'mu': Array([0.5, 0.5, 0.5, 0.5], dtype=float32)}
    """
    return jax.tree.map(lambda x: x.dequantize() if is_quantized(x) else x, opt_state, is_leaf=is_quantized)


def encoded_after_step(
    template: Any, new_state: Any, twin: Any | None = None, outputs: Mapping[str, Any] | None = None
) -> Any:
    """``new_state`` (floats) with each leaf that is low-bit in ``template`` encoded again, in its format.

    ``twin``: a second evaluation of the same new state, whose inputs passed an
    optimization barrier (so that XLA cannot merge the two); the block maxima
    are taken from it, and every leaf that is not low-bit too. ``outputs``: the
    twin's new params (or updates) by name, which each 8-bit leaf waits for.

    Why, on CPU: XLA cannot fuse the computation of a value into both a
    reduction over it and its other uses, and writes it out in float32 (which
    costs more than the whole float32 step). With the maxima and the params
    from the twin, the new moments of ``new_state`` have one use, their
    encoding, and fuse into it; and since 8-bit encoding waits for the params,
    which read the old codes, XLA may overwrite donated codes in place rather
    than copy them first. 4-bit codes are read through an unpacked copy
    anyway, and waiting only delays their encoding (2.9x against 2.5x float32
    on a 1024 x 1024 AdamW step here).

    Example:
        >>> import jax.numpy as jnp
        >>> from treeopt._lowbit.codec import quantize
        >>> state = {"mu": quantize(jnp.zeros(4), 8)}
        >>> type(encoded_after_step(state, {"mu": jnp.full(4, 0.5)})["mu"]).__name__
        'QuantizedLeaf'
    """
    if not has_quantized(template):
        return new_state
    held, treedef_ = jax.tree_util.tree_flatten_with_path(template, is_leaf=is_quantized)
    treedef: Any = treedef_
    new = treedef.flatten_up_to(new_state)
    source = treedef.flatten_up_to(twin) if twin is not None else new
    out = []
    for (path, old), x, other in zip(held, new, source, strict=True):
        if not is_quantized(old):
            out.append(other)
            continue
        maxima = block_maxima(other, old.format)
        name = next((k.key for k in reversed(path) if isinstance(k, jax.tree_util.DictKey)), None)
        if outputs is not None and name is not None and name in outputs and old.format.bits == 8:
            maxima = _after(maxima, outputs[name])
        new = encode_with(x, maxima, old.format)
        # The codec computes where no shard cuts a block; the codes go back to the layout they had.
        out.append(
            QuantizedLeaf(
                resharded_like(new.codes, old.codes),
                resharded_like(new.scales, old.scales),
                shape=new.shape,
                dtype=new.dtype,
                format=new.format,
            )
        )
    return treedef.unflatten(out)


def _after(value: jax.Array, other: Any) -> jax.Array:
    """``value``, made to depend on ``other``: plus zero computed from one of its elements' bits.

    An unsigned shift by the full width in two steps is 0 for any bits, and XLA
    does not fold it (it keeps the dependency); NaN and infinity pass unharmed.
    """
    other = jnp.asarray(other)
    if other.size == 0 or not jnp.issubdtype(other.dtype, jnp.number) or explicit_sharding(other) is not None:
        return value  # under explicit axes, slicing a sharded value needs a reshard: not worth it
    width = jnp.dtype(other.dtype).itemsize * 8
    unsigned = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}[width]
    bits = jax.lax.bitcast_convert_type(other.reshape(-1)[:1], unsigned)
    zero = (bits >> (width - 1)) >> 1
    return value + zero.astype(value.dtype).reshape(())


# -- state dicts -----------------------------------------------------------------------------------

CODES, SCALES, FORMAT = "codes", "scales", "format"
"""The entries of a low-bit leaf in a state dict."""


def in_target_form(
    target: Any, plain: Callable[[Any], Mapping[Path, Any]], source: Mapping[Path, Any], legacy_only: bool = False
) -> tuple[dict[Path, Any] | None, tuple[tuple[str, str, str], ...]]:
    """A state dict's entries converted to the form ``target`` holds them in: codes or full precision.

    ``target`` is the state (a tree holding low-bit leaves or not) the
    entries are loaded into; ``plain(tree)`` gives the flat state dict
    ``{path: leaf}`` of a tree shaped like it (of indices). ``source`` is the
    flat state dict to load. Returns ``(the converted entries, (path, from,
    to) of each conversion)``, or ``(None, ())`` where nothing was converted.
    ``legacy_only``: see :func:`converted_source`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from treeopt._lowbit.codec import quantize
        >>> target = {"mu": {"w": quantize(jnp.zeros((64, 64)), 8)}}
        >>> def plain(tree):
        ...     return {("mu", "w"): jax.tree.leaves(tree, is_leaf=is_quantized)[0]}
        >>> flat, done = in_target_form(target, plain, {("mu", "w"): jnp.ones((64, 64))})
        >>> sorted(flat), [to for _, _, to in done]
        ([('mu', 'w', 'codes'), ('mu', 'w', 'format'), ('mu', 'w', 'scales')], ['8-bit signed codes'])
    """
    if not (has_quantized(target) or any(path and path[-1] == CODES for path in source)):
        return None, ()  # neither side holds codes: nothing to convert, and no v1 codes to read
    leaves, treedef = jax.tree.flatten(target, is_leaf=is_quantized)
    indexed = plain(jax.tree.unflatten(treedef, list(range(len(leaves)))))
    units = {path: leaves[i] for path, i in indexed.items() if isinstance(i, int)}
    signs = statistic_signs(target, is_leaf=is_quantized)
    signed = {path: signs[i] for path, i in indexed.items() if isinstance(i, int)}
    flat, converted = converted_source(units, source, legacy_only=legacy_only, signed=signed)
    return (flat, converted) if converted else (None, ())


def converted_source(
    units: Mapping[Path, Any],
    source: Mapping[Path, Any],
    legacy_only: bool = False,
    signed: Mapping[Path, bool | None] | None = None,
) -> tuple[dict[Path, Any], tuple[tuple[str, str, str], ...]]:
    """A warm start's source, with each low-bit value converted to the target's precision at the target's paths.

    ``units`` are the target's state leaves by state-dict path, a low-bit leaf
    as one unit (its ``codes``, ``scales`` and ``format`` below it). Codes and
    scales are one value: where the source holds another precision than the
    target at a path (full precision, or codes of other bits, map or layout),
    the source's value is decoded whole and encoded again in the target's
    format; a state dict without ``format`` entries (written before formats
    were recorded) is read in that first layout. ``source`` is the state dict
    flattened (``{path: value}``); returns it converted and ``(path, from, to)``
    of each conversion. ``legacy_only``: convert only the codes written without
    a format (nothing else is read: an exact load matches the rest as it is).
    ``signed``: by path, whether the target's leaf is a signed statistic
    (``True``), an unsigned one (``False``) or neither (``None``), for a
    full-precision target.

    A ``format`` that cannot describe the source's leaf (a block or an axis its
    codes and scales do not have, or the map of the other sign than the
    target's statistic) is a :class:`~treeopt.errors.StateDictError` naming it.

    Example:
        >>> import jax.numpy as jnp
        >>> from treeopt._lowbit.codec import quantize
        >>> units = {("mu", "w"): quantize(jnp.zeros((64, 64)), 8)}
        >>> flat, done = converted_source(units, {("mu", "w"): jnp.ones((64, 64))})
        >>> sorted(flat), done
        ([('mu', 'w', 'codes'), ('mu', 'w', 'format'), ('mu', 'w', 'scales')], (('mu/w', 'float32[64, 64]', '8-bit signed codes'),))
    """
    flat = dict(source)
    signed = signed or {}
    done = []
    for path, unit in units.items():
        if legacy_only and ((*path, FORMAT) in flat or (*path, CODES) not in flat):
            continue  # not codes without a format: matched as it is, never decoded
        target_signed = unit.format.signed if is_quantized(unit) else signed.get(path)
        found = _source_value(flat, path, unit, target_signed)
        if found is None:
            continue
        value, described, same = found
        if same:
            continue
        if tuple(np.shape(value)) != tuple(unit.shape) or not _floating(value):
            continue  # another shape: the engine reports the paths as they are
        for key in (CODES, SCALES, FORMAT):
            flat.pop((*path, key), None)
        flat.pop(path, None)
        if is_quantized(unit):
            encoded = _encode(jnp.asarray(value, unit.dtype), unit.format)
            flat[(*path, CODES)], flat[(*path, SCALES)] = encoded.codes, encoded.scales
            flat[(*path, FORMAT)] = unit.format.entry()
            target = f"{unit.bits}-bit {'signed' if unit.format.signed else 'unsigned'} codes"
        else:
            flat[path] = jnp.asarray(value, unit.dtype)
            target = f"{np.dtype(unit.dtype).name}{list(unit.shape)}"
        done.append((path_str(path), described, target))
    return flat, tuple(done)


def _source_value(
    flat: Mapping[Path, Any], path: Path, unit: Any, target_signed: bool | None = None
) -> tuple[Any, str, bool] | None:
    """``(the source's value at path as floats, what it was, whether it is already the target's form)``."""
    if not (is_quantized(unit) or _floating(unit)):
        return None
    codes, scales, fmt = flat.get((*path, CODES)), flat.get((*path, SCALES)), flat.get((*path, FORMAT))
    if path in flat and codes is None:  # full precision in the source
        value = flat[path]
        return value, f"{np.dtype(getattr(value, 'dtype', np.float32)).name}{list(np.shape(value))}", not is_quantized(unit)
    if codes is None or scales is None:
        return None
    shape, dtype = tuple(unit.shape), unit.dtype
    if fmt is None:
        bits = legacy_bits(codes, scales, shape)
        if bits is None:
            return None
        value = legacy_decoded(codes, scales, shape, dtype, bits)
        return value, f"{bits}-bit codes (no format)", False
    source_fmt = _readable_format(path, fmt, codes, scales, shape, target_signed)
    if source_fmt is None:
        return None
    if is_quantized(unit) and source_fmt == unit.format:
        return flat[(*path, CODES)], source_fmt.describe(), True
    q = QuantizedLeaf(jnp.asarray(codes), jnp.asarray(scales), shape=shape, dtype=dtype, format=source_fmt)
    return _decode(q), f"{source_fmt.bits}-bit {'signed' if source_fmt.signed else 'unsigned'} codes", False


def _readable_format(
    path: Path, entry: Any, codes: Any, scales: Any, shape: tuple[int, ...], target_signed: bool | None
) -> Format | None:
    """The source's format at ``path`` (``None``: a version the engine reports), or an error naming it: decoded
    as a format that cannot describe the leaf says, its values would be wrong."""
    try:
        return Format.for_leaf(entry, shape, np.shape(codes), np.shape(scales), target_signed)
    except ValueError as error:
        got = f"format {np.asarray(entry).reshape(-1).tolist()}: {error}"
        raise StateDictError.of(
            f"The state dict's low-bit format cannot describe its leaf {path_str(path)} ({list(shape)})",
            LoadReport(mismatched=((path_str((*path, FORMAT)), "a format that fits the leaf", got),)),
            "The entry was edited or belongs to another leaf: a format travels with its codes and scales.",
        ) from None


_decode = jax.jit(lambda q: q.dequantize())
