"""State dicts of an Optimizer: nested plain dicts of arrays, keyed by parameter name.

``state_dict(opt)`` is ``{"step": ..., "opt_state": ...}``. ``opt_state`` goes
through ``flax.serialization.to_state_dict``: optax's NamedTuple states become
dicts keyed by field name (``"mu"``, ``"count"``), tuples (``optax.chain``)
dicts keyed by position (``"0"``, ``"1"``), ``optax.EmptyState`` and
``optax.MaskedNode`` empty dicts. The params-shaped parts of an optax state are
already dicts keyed by parameter name (the optimizer runs optax on its flat,
named params), so a leaf reads ``opt_state/0/mu/dense/kernel`` whatever the
order of the leaves, and a new, unrelated layer only adds names.

A path is a tuple of those string keys; parameter names may contain ``"/"``,
so paths are never split on it. Typed PRNG keys (``optax.noisy_sgd``) are
stored as their ``jax.random.key_data`` (``uint32``) and wrapped back on load.

Loading matches leaves by path: every missing, unexpected and shape/dtype
mismatched path is listed in one error (``strict=True``), or loaded where it
matches and reported otherwise (``strict=False``). Python scalars load only
where nothing is lost (no fractional step, nothing out of the leaf's range);
``None`` or a string where an array is expected is a mismatch; entries whose
parameter name was split on ``"/"`` into nested dicts are reported as such.
Loaded arrays are copies, so the loaded optimizer can be donated to a jitted
step without deleting the caller's arrays.

This module only sees the Optimizer through its pytree and a few attributes,
so ``optimizer.py`` can import it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np

Path = tuple[str, ...]

CHECKSUM_KEY = "checksum"
"""Top-level key of the checksum that ``flax.serialization.to_state_dict(opt)`` adds."""

_SCALARS = (bool, int, float)


# -- errors and reports ------------------------------------------------------------


def path_str(path: Path) -> str:
    """A path as one readable string, its keys joined by ``"/"``.

    Example:
        >>> path_str(("opt_state", "0", "mu", "dense/kernel"))
        'opt_state/0/mu/dense/kernel'
    """
    return "/".join(path)


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What loading a state dict into an optimizer did, by path.

    Attributes:
        loaded: paths whose value was taken from the state dict.
        missing: paths of the optimizer the state dict lacks (they keep the
            optimizer's current values).
        unexpected: paths of the state dict the optimizer does not have (ignored).
        mismatched: ``(path, expected, got)`` for paths present in both with another
            shape or dtype, e.g. ``("opt_state/0/mu/w", "float32[3]", "float32[4]")``
            (they keep the optimizer's current values).
        renamed: for ``warm_start`` only: ``{target path: source path}`` of the leaves
            matched by their state field and parameter name rather than by full path.
        misnested: ``(path, found, expected)`` for entries present under the same
            ``"/"``-joined path but nested differently, typically a parameter name
            such as ``"dense/kernel"`` split into nested dicts, e.g.
            ``("opt_state/0/mu/dense/kernel", "sd['opt_state']['0']['mu']['dense']['kernel']",
            "sd['opt_state']['0']['mu']['dense/kernel']")`` (not loaded).

    Example:
        >>> import jax.numpy as jnp, optax, treeopt
        >>> opt = treeopt.Optimizer(optax.adam(0.1)).init({"w": jnp.ones(2)})
        >>> sd = opt.state_dict()
        >>> del sd["opt_state"]["0"]["nu"]
        >>> report = treeopt.serialization.check_state_dict(opt, sd)
        >>> report.ok, report.missing
        (False, ('opt_state/0/nu/w',))
        >>> print(report)
        loaded 3 leaves; not loaded:
        missing (1):
          opt_state/0/nu/w
    """

    loaded: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[tuple[str, str, str], ...] = ()
    renamed: Mapping[str, str] = dataclasses.field(default_factory=dict)
    misnested: tuple[tuple[str, str, str], ...] = ()

    @property
    def ok(self) -> bool:
        """True when every path matched: nothing missing, unexpected, mismatched or misnested."""
        return not (self.missing or self.unexpected or self.mismatched or self.misnested)

    def problems(self) -> str:
        """The missing, unexpected, mismatched and misnested paths, one per line ("" when ``ok``)."""
        lines = []
        if self.missing:
            lines.append(f"missing ({len(self.missing)}):")
            lines.extend(f"  {p}" for p in self.missing)
        if self.unexpected:
            lines.append(f"unexpected ({len(self.unexpected)}):")
            lines.extend(f"  {p}" for p in self.unexpected)
        if self.mismatched:
            lines.append(f"shape/dtype mismatch ({len(self.mismatched)}):")
            lines.extend(f"  {p}: expected {e}, got {g}" for p, e, g in self.mismatched)
        if self.misnested:
            lines.append(f"nested differently, names split or joined on '/' ({len(self.misnested)}):")
            lines.extend(f"  {p}: found at {f}, expected at {e}" for p, f, e in self.misnested)
            lines.append(
                "  These entries are in the state dict, but nested differently: the optimizer keys "
                "each parameter's state by its full name, which contains '/', and these names were "
                "split into nested dicts (or nested dicts were joined into one key), e.g. by "
                "flax.traverse_util.flatten_dict/unflatten_dict with sep='/'. Key each entry as "
                "opt.state_dict() does."
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        head = f"loaded {len(self.loaded)} leaves"
        if self.renamed:
            head += f" ({len(self.renamed)} matched by field and parameter name)"
        return head if self.ok else f"{head}; not loaded:\n{self.problems()}"


class StateDictError(ValueError):
    """A state dict that does not fit the optimizer; ``.report`` holds the details.

    Example:
        >>> import jax.numpy as jnp, optax, treeopt
        >>> adam = treeopt.Optimizer(optax.adam(0.1)).init({"w": jnp.ones(2)})
        >>> sgd = treeopt.Optimizer(optax.sgd(0.1)).init({"w": jnp.ones(2)})
        >>> try:
        ...     sgd.load_state_dict(adam.state_dict())
        ... except treeopt.serialization.StateDictError as e:
        ...     print(e.report.unexpected)
        ('opt_state/0/count', 'opt_state/0/mu/w', 'opt_state/0/nu/w')
    """

    def __init__(self, message: str, report: LoadReport | None = None):
        super().__init__(message)
        self.report = report


class StateDictWarning(UserWarning):
    """Emitted by ``load_state_dict(..., strict=False)`` when some paths did not load.

    ``.report`` is the :class:`LoadReport`.

    Example:
        >>> import warnings, jax.numpy as jnp, optax, treeopt
        >>> opt = treeopt.Optimizer(optax.adam(0.1)).init({"w": jnp.ones(2)})
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     opt = opt.load_state_dict({"step": 5}, strict=False)
        >>> caught[0].message.report.missing
        ('opt_state/0/count', 'opt_state/0/mu/w', 'opt_state/0/nu/w')
        >>> int(opt.step)
        5
    """

    def __init__(self, message: str, report: LoadReport):
        super().__init__(message)
        self.report = report


# -- the plain form ------------------------------------------------------------------


def is_key(x: Any) -> bool:
    """True for typed PRNG key arrays (and their abstract ``ShapeDtypeStruct``)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _entry_str(entry: Any) -> str:
    return jax.tree_util.keystr((entry,), simple=True, separator="/")


def _plain_leaf(x: Any) -> Any:
    if is_key(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.eval_shape(jax.random.key_data, x)
        return jax.random.key_data(x)
    return x


def to_plain(tree: Any) -> Any:
    """``tree`` as nested plain dicts with string keys, leaves unchanged but for PRNG keys.

    ``flax.serialization.to_state_dict`` does the work; a pytree node flax does
    not know becomes a dict keyed by its ``jax.tree_util`` key entries.

    Example:
        >>> import optax, jax.numpy as jnp
        >>> to_plain(optax.adam(0.1).init({"w": jnp.zeros(2)}))["0"]["mu"]
        {'w': Array([0., 0.], dtype=float32)}
    """
    return _plainify(flax.serialization.to_state_dict(tree))


def _plainify(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _plainify(v) for k, v in x.items()}
    if x is None or jax.tree_util.treedef_is_leaf(jax.tree.structure(x)):
        return _plain_leaf(x)
    # A pytree node flax.serialization does not know: key it by its key path.
    out: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(x)[0]:
        node = out
        keys = [_entry_str(e) for e in path]
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1] if keys else "0"] = _plain_leaf(leaf)
    return out


def flatten(state_dict: Any, prefix: Path = (), keep_none: bool = False) -> dict[Path, Any]:
    """``{path: leaf}`` of a nested state dict; empty dicts and ``None`` hold no leaves.

    Lists and tuples (as some readers return them) are keyed by position. With
    ``keep_none``, ``None`` values are kept as leaves (so that loading can say
    that a leaf is ``None`` rather than missing).

    Example:
        >>> flatten({"step": 1, "opt_state": {"0": {"mu": {"a/b": 2}}, "1": {}}})
        {('step',): 1, ('opt_state', '0', 'mu', 'a/b'): 2}
    """
    out: dict[Path, Any] = {}
    if isinstance(state_dict, Mapping):
        items: Iterable[tuple[Any, Any]] = state_dict.items()
    elif isinstance(state_dict, (list, tuple)) and not hasattr(state_dict, "_fields"):
        items = enumerate(state_dict)
    else:
        return {prefix: state_dict} if state_dict is not None or keep_none else {}
    for key, value in items:
        out.update(flatten(value, (*prefix, str(key)), keep_none))
    return out


def unflatten(flat: Mapping[Path, Any]) -> dict[str, Any]:
    """The nested dict of a ``{path: leaf}`` dict (inverse of :func:`flatten`).

    Example:
        >>> unflatten({("a", "x/y"): 1, ("b",): 2})
        {'a': {'x/y': 1}, 'b': 2}
    """
    out: dict[str, Any] = {}
    for path, leaf in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return out


def _base(opt: Any) -> dict[str, Any]:
    return {"step": opt.step, "opt_state": opt.opt_state}


def state_dict(opt: Any) -> dict[str, Any]:
    """``{"step": ..., "opt_state": ...}`` of an initialized optimizer (see the module doc)."""
    opt._require_layout()
    return {"step": _plain_leaf(opt.step), "opt_state": to_plain(opt.opt_state)}


# -- describing leaves ---------------------------------------------------------------


def _dtype_name(dtype: Any) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def _describe(x: Any) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{_dtype_name(x.dtype)}{list(x.shape)}"
    return type(x).__name__


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One leaf of a target optimizer, as the state dict must hold it."""

    index: int  # position among the leaves of {"step", "opt_state"}
    leaf: Any  # the target's leaf (array, ShapeDtypeStruct, ...)
    shape: tuple[int, ...]  # the shape expected in the state dict (key data for keys)
    dtype: Any  # the dtype expected in the state dict (uint32 for keys)

    @property
    def expected(self) -> str:
        return f"{_dtype_name(self.dtype)}{list(self.shape)}"

    @property
    def abstract(self) -> bool:
        return isinstance(self.leaf, jax.ShapeDtypeStruct)

    @property
    def sharding(self) -> Any:
        leaf = self.leaf
        if isinstance(leaf, jax.core.Tracer):
            return None
        return getattr(leaf, "sharding", None)


def slot(index: int, leaf: Any) -> _Slot:
    """The slot of a target leaf at ``index``: what shape and dtype the state dict must hold."""
    if is_key(leaf):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        return _Slot(index, leaf, tuple(data.shape), np.dtype(data.dtype))
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return _Slot(index, leaf, tuple(leaf.shape), leaf.dtype)
    return _Slot(index, leaf, tuple(np.shape(leaf)), np.result_type(leaf))


def slots(opt: Any) -> tuple[dict[Path, _Slot], Any, list[Any]]:
    """``({path: slot}, treedef, leaves)`` of the ``{"step", "opt_state"}`` tree of ``opt``."""
    opt._require_layout()
    leaves, treedef = jax.tree.flatten(_base(opt))
    indexed = flatten(to_plain(jax.tree.unflatten(treedef, list(range(len(leaves))))))
    out = {path: slot(index, leaves[index]) for path, index in indexed.items()}
    if sorted(s.index for s in out.values()) != list(range(len(leaves))):
        raise AssertionError("treeopt: the state dict does not cover every optimizer leaf")
    return out, treedef, leaves


def _given(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _scalar_misfit(slot: _Slot, value: bool | int | float) -> str | None:
    """Why a Python scalar cannot load into ``slot`` without losing part of it (None: it can)."""
    dtype = np.dtype(slot.dtype)
    if slot.shape != () or is_key(slot.leaf) or dtype.kind not in "biuf":
        return _given(value)
    if (dtype.kind == "b") != isinstance(value, bool):
        return f"{_given(value)} ({'a bool' if isinstance(value, bool) else 'not a bool'})"
    if dtype.kind in "iu":
        if isinstance(value, float) and not (np.isfinite(value) and value == int(value)):
            return f"{_given(value)} (not an integer)"
        info = np.iinfo(dtype)
        if not info.min <= int(value) <= info.max:
            return f"{_given(value)} (outside the {dtype.name} range [{info.min}, {info.max}])"
    elif dtype.kind == "f":
        try:
            x = float(value)
        except OverflowError:  # an int beyond float64
            x = None
        with np.errstate(over="ignore"):
            overflows = x is None or (np.isfinite(x) and not np.isfinite(np.asarray(x).astype(dtype)))
        if overflows:
            big = float(jnp.finfo(dtype).max)
            return f"{_given(value)} (outside the {dtype.name} range [{-big:g}, {big:g}])"
    return None


def _misfit(slot: _Slot, value: Any) -> str | None:
    """Why ``value`` cannot load into ``slot``, as the "got ..." of an error (None: it can)."""
    if isinstance(value, _SCALARS) and not isinstance(value, np.generic):
        return _scalar_misfit(slot, value)
    if value is None:
        return "None"
    if isinstance(value, (str, bytes)):
        return _given(value)
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        return _describe(value)
    if is_key(value):
        if is_key(slot.leaf) and value.dtype == slot.leaf.dtype and value.shape == slot.leaf.shape:
            return None
        return _describe(value)
    if tuple(value.shape) == slot.shape and _dtype_name(value.dtype) == _dtype_name(slot.dtype):
        return None
    return _describe(value)


def _subscript(path: Path) -> str:
    return "sd" + "".join(f"[{k!r}]" for k in path)


def _misnested(
    missing: Iterable[Path], unexpected: Iterable[Path]
) -> tuple[list[Path], list[Path], list[tuple[str, str, str]]]:
    """``(missing, unexpected, misnested)``: a missing and an unexpected path that read the same
    once joined by ``"/"`` are the same entry nested differently (a name split on ``"/"``)."""
    by_str: dict[str, list[Path]] = {}
    for path in unexpected:
        by_str.setdefault(path_str(path), []).append(path)
    still_missing, misnested, taken = [], [], set()
    for path in missing:
        found = sorted(q for q in by_str.get(path_str(path), []) if q != path)
        if not found:
            still_missing.append(path)
            continue
        taken.update(found)
        misnested.append((path_str(path), _subscript(found[0]), _subscript(path)))
    return still_missing, [p for p in unexpected if p not in taken], misnested


def match(slots_: Mapping[Path, _Slot], source: Mapping[Path, Any]) -> tuple[dict[Path, Path], LoadReport]:
    """``({target path: source path}, report)`` matching by exact path.

    A ``None`` in ``source`` at a path of ``slots_`` is a mismatch; elsewhere it is ignored.
    """
    pairs: dict[Path, Path] = {}
    missing: list[Path] = []
    mismatched = []
    for path, slot in slots_.items():
        if path not in source:
            missing.append(path)
        elif (why := _misfit(slot, source[path])) is not None:
            mismatched.append((path_str(path), slot.expected, why))
        else:
            pairs[path] = path
    unexpected = [p for p, v in source.items() if p not in slots_ and v is not None]
    missing, unexpected, misnested = _misnested(missing, unexpected)
    report = LoadReport(
        loaded=tuple(sorted(path_str(p) for p in pairs)),
        missing=tuple(sorted(path_str(p) for p in missing)),
        unexpected=tuple(sorted(path_str(p) for p in unexpected)),
        mismatched=tuple(sorted(mismatched)),
        misnested=tuple(sorted(misnested)),
    )
    return pairs, report


# -- checksum ------------------------------------------------------------------------


def _bits(dtype: Any) -> int:
    for info in (jnp.iinfo, jnp.finfo):
        try:
            return int(info(dtype).bits)
        except ValueError:
            pass
    return jnp.dtype(dtype).itemsize * 8


_UNSIGNED = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint32}


def _widen(dtype: Any) -> Any:
    """The dtype to take the bits of: ``dtype`` itself, or an exact wider one (bool, int4, ...)."""
    if dtype == np.bool_:
        return np.dtype(np.uint8)
    if _bits(dtype) not in _UNSIGNED:
        return np.dtype(np.float32 if jnp.issubdtype(dtype, jnp.floating) else np.int32)
    return dtype


def _host_sums(x: np.ndarray) -> tuple[int, int, int]:
    if np.iscomplexobj(x):
        x = np.stack([x.real, x.imag])
    x = np.ascontiguousarray(x.astype(_widen(x.dtype), copy=False)).reshape(-1)
    w = x.view(_UNSIGNED[_bits(x.dtype)]).astype(np.uint32)
    odd = np.arange(w.size, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    return int(w.sum(dtype=np.uint32)), int((w * odd).sum(dtype=np.uint32)), int(w.size)


@jax.jit
def _device_sums(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)])
    x = x.astype(_widen(x.dtype))
    w = jax.lax.bitcast_convert_type(x, _UNSIGNED[_bits(x.dtype)]).astype(jnp.uint32)
    # The row-major position of each word, without reshaping (which a sharded array may refuse).
    position = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(w.ndim)):
        position = position + jax.lax.broadcasted_iota(jnp.uint32, w.shape, dim) * jnp.uint32(stride)
        stride *= w.shape[dim]
    odd = position * jnp.uint32(2) + jnp.uint32(1)
    return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * odd, dtype=jnp.uint32)])


def _on_host(x: Any) -> bool:
    if not isinstance(x, jax.Array):
        return True
    return x.is_fully_addressable and all(getattr(d, "platform", None) == "cpu" for d in x.sharding.device_set)


def _leaf_sums(x: Any) -> tuple[int, int, int]:
    """Two sums modulo 2**32 of the bits of ``x``: a plain one (a changed word changes it)
    and one weighted by odd position factors (so does a moved word), and the word count.

    Integer sums are exact, so the result does not depend on where they run:
    host arrays in numpy, device arrays (sharded ones included) on device.
    """
    return _host_sums(np.asarray(x)) if _on_host(x) else _device_leaf_sums(x)


def _device_leaf_sums(x: jax.Array) -> tuple[int, int, int]:
    a, b = (int(v) for v in np.asarray(jax.device_get(_device_sums(x))))
    words = x.size * (2 if jnp.iscomplexobj(x) else 1) * (2 if _bits(x.dtype) == 64 else 1)
    return a, b, int(words)


def checksum(flat: Mapping[Path, Any]) -> np.ndarray:
    """A ``uint32[2]`` checksum of the array leaves of ``flat`` (``{path: leaf}``), by sorted path.

    Equal for the same values whether they are jax or numpy arrays, on host or device.

    Example:
        >>> import numpy as np, jax.numpy as jnp
        >>> a = checksum({("w",): jnp.arange(3.0)})
        >>> b = checksum({("w",): np.arange(3.0, dtype=np.float32)})
        >>> bool((a == b).all()), a.dtype.name
        (True, 'uint32')
    """
    mask = 0xFFFFFFFF
    a, b = 0x811C9DC5, 0
    for path in sorted(flat):
        leaf = flat[path]
        if isinstance(leaf, _SCALARS) or not hasattr(leaf, "dtype"):
            continue
        s1, s2, n = _leaf_sums(jax.random.key_data(leaf) if is_key(leaf) else leaf)
        a = (a * 0x01000193 + s1 + n) & mask
        b = (b * 0x9E3779B1 + s2) & mask
    return np.array([a, b], dtype=np.uint32)


def with_checksum(sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` with a top-level ``"checksum"`` of its leaves added."""
    return {**sd, CHECKSUM_KEY: checksum(flatten(sd))}


def verify_checksum(flat: dict[Path, Any], what: str = "state dict") -> dict[Path, Any]:
    """``flat`` without its ``("checksum",)`` entry, which must match its other leaves."""
    if (CHECKSUM_KEY,) not in flat:
        return flat
    rest = {p: v for p, v in flat.items() if p != (CHECKSUM_KEY,)}
    stored = flat[(CHECKSUM_KEY,)]
    try:
        stored_words = np.asarray(stored, dtype=np.uint32).reshape(-1).tolist()
    except (TypeError, ValueError):
        stored_words = None
    if stored_words != checksum(rest).tolist():
        raise StateDictError(
            f"The {what}'s checksum does not match its data: it is corrupted (or was edited "
            f"after it was saved). To load a deliberately edited state dict, delete its "
            f"'{CHECKSUM_KEY}' entry first."
        )
    return rest


# -- loading -------------------------------------------------------------------------


def _key_impl(leaf: Any) -> Any:
    if isinstance(leaf, jax.Array):
        return jax.random.key_impl(leaf)
    return getattr(leaf.dtype, "_impl", None)


def convert(slot: _Slot, value: Any, copy: bool = False) -> Any:
    """``value`` (from a state dict) as the target leaf wants it: dtype, key type, sharding.

    With ``copy``, a concrete ``jax.Array`` is never returned as is (nor placed by
    aliasing it): the result is a new buffer, so donating it leaves ``value`` alive.
    Other values become new device arrays anyway.
    """
    sharding = slot.sharding
    if sharding is not None and isinstance(slot.leaf, jax.Array) and not slot.leaf.committed:
        # A leaf of a plain init is uncommitted: committing the loaded one to one device
        # would make jit refuse it beside params placed on a mesh.
        sharding = None
    alias = copy and isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer)
    if is_key(slot.leaf):
        if not is_key(value):
            value = jax.random.wrap_key_data(jnp.asarray(value, jnp.uint32), impl=_key_impl(slot.leaf))
    elif isinstance(value, _SCALARS) and not isinstance(value, np.generic):
        value = np.asarray(value, dtype=slot.dtype)
    if isinstance(value, jax.core.Tracer):
        return value
    if sharding is not None:
        return jax.device_put(value, sharding, may_alias=False) if alias else jax.device_put(value, sharding)
    if alias:
        return jnp.array(value, copy=True)
    return value if isinstance(value, jax.Array) else jnp.asarray(value)


def rebuild(
    opt: Any,
    slots_: Mapping[Path, _Slot],
    treedef: Any,
    leaves: list[Any],
    pairs: Mapping[Path, Path],
    source: Mapping[Path, Any],
    copy: bool = False,
) -> Any:
    """A new optimizer like ``opt`` whose leaves at ``pairs`` come from ``source``.

    ``copy``: see :func:`convert`; needed where ``source`` holds arrays the caller keeps.
    """
    new = list(leaves)
    abstract_left = []
    for path, slot in slots_.items():
        if path in pairs:
            new[slot.index] = convert(slot, source[pairs[path]], copy=copy)
        elif slot.abstract:
            abstract_left.append(path_str(path))
    if abstract_left:
        raise StateDictError(
            "The target optimizer is abstract (jax.eval_shape), so leaves the state dict does "
            "not provide have no value to keep: "
            f"{abstract_left}. Load into a concrete optimizer (opt.init(params)) instead."
        )
    base = jax.tree.unflatten(treedef, new)
    return jax.tree.unflatten(jax.tree.structure(opt), jax.tree.leaves([base["step"], base["opt_state"]]))


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
    slots_, _, _ = slots(opt)
    source = verify_checksum(flatten(_as_mapping(sd), keep_none=True))
    return match(slots_, source)[1]


def _as_mapping(sd: Any) -> Mapping[str, Any]:
    if not isinstance(sd, Mapping):
        raise TypeError(
            "load_state_dict needs a state dict: the nested dict that opt.state_dict() returns "
            f"(or that went through numpy / msgpack / orbax), got {type(sd).__name__}."
        )
    return sd


def load_state_dict(opt: Any, sd: Any, strict: bool = True) -> Any:
    """A new optimizer like ``opt`` with its state from ``sd`` (see ``Optimizer.load_state_dict``)."""
    slots_, treedef, leaves = slots(opt)
    source = verify_checksum(flatten(_as_mapping(sd), keep_none=True))
    pairs, report = match(slots_, source)
    if not report.ok:
        if strict:
            other = report.missing or report.unexpected
            cause = "It was saved from another model or optimizer. " if other else ""
            raise StateDictError(
                "The state dict does not match this optimizer (paths are "
                "step | opt_state/<optax state fields>/<parameter name>):\n"
                + report.problems()
                + f"\n{cause}Use load_state_dict(sd, strict=False) to load the matching paths, or "
                "treeopt.serialization.warm_start to start from another optimizer's state.",
                report,
            )
        warnings.warn(
            StateDictWarning(
                "load_state_dict(strict=False): the following paths kept the optimizer's "
                "current values or were ignored:\n" + report.problems(),
                report,
            ),
            stacklevel=3,
        )
    return rebuild(opt, slots_, treedef, leaves, pairs, source, copy=True)


# -- warm start ----------------------------------------------------------------------


def _role(path: Path, param_names: frozenset[str]) -> Path:
    """The part of a path that names what a leaf is, wherever the optax state nests it.

    ``("opt_state", "inner_state", "0", "mu", "dense/kernel")`` -> ``("mu", "dense/kernel")``
    (the field and parameter name, and what follows: SM3's per-axis vectors);
    a leaf of no parameter (``count``) -> its last key.
    """
    for i in range(len(path) - 1, 0, -1):
        if path[i] in param_names:
            return path[i - 1 :]
    return path[-1:]


def warm_start(
    opt: Any,
    source: Any,
    include: Callable[[str], bool] | None = None,
    exclude: Callable[[str], bool] | None = None,
    hyperparams: bool = False,
) -> tuple[Any, LoadReport]:
    """Copies the leaves of ``source`` (a state dict) that fit ``opt``; see ``serialization.warm_start``."""
    slots_, treedef, leaves = slots(opt)
    src = verify_checksum(flatten(_as_mapping(source)))
    pairs, exact = match(slots_, src)
    names = frozenset(opt.paths)
    by_role: dict[Path, list[Path]] = {}
    for path in src:
        by_role.setdefault(_role(path, names), []).append(path)
    renamed: dict[Path, Path] = {}
    for path, slot in slots_.items():
        if path in pairs:
            continue
        candidates = by_role.get(_role(path, names), [])
        if len(candidates) == 1 and _misfit(slot, src[candidates[0]]) is None:
            pairs[path] = renamed[path] = candidates[0]

    def wanted(path: Path) -> bool:
        name = path_str(path)
        if not hyperparams and ("hyperparams" in path or "hyperparams_states" in path):
            return False
        return (include is None or include(name)) and not (exclude is not None and exclude(name))

    pairs = {t: s for t, s in pairs.items() if wanted(t)}
    taken = set(pairs.values())
    missing, unexpected, misnested = _misnested(
        [p for p in slots_ if p not in pairs], [p for p in src if p not in taken]
    )
    report = LoadReport(
        loaded=tuple(sorted(path_str(p) for p in pairs)),
        missing=tuple(sorted(path_str(p) for p in missing)),
        unexpected=tuple(sorted(path_str(p) for p in unexpected)),
        mismatched=tuple(m for m in exact.mismatched if m[0] not in {path_str(p) for p in pairs}),
        renamed={path_str(t): path_str(s) for t, s in sorted(renamed.items()) if t in pairs},
        misnested=tuple(sorted(misnested)),
    )
    return rebuild(opt, slots_, treedef, leaves, pairs, src, copy=True), report
