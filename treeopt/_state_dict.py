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
from typing import Any, NamedTuple

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np

from treeopt._checksum import verify_checksum
from treeopt._paths import leaf_names
from treeopt.errors import LoadReport, StateDictError, StateDictWarning, describe, dtype_name
from treeopt.keys import is_key, key_data, wrap_key_like

Path = tuple[str, ...]

_SCALARS = (bool, int, float)


# -- paths ---------------------------------------------------------------------------


def path_str(path: Path) -> str:
    """A path as one readable string, its keys joined by ``"/"``.

    Example:
        >>> path_str(("opt_state", "0", "mu", "dense/kernel"))
        'opt_state/0/mu/dense/kernel'
    """
    return "/".join(path)


# -- the plain form ------------------------------------------------------------------


def _entry_str(entry: Any) -> str:
    return jax.tree_util.keystr((entry,), simple=True, separator="/")


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
        return key_data(x)
    # A pytree node flax.serialization does not know: key it by its key path.
    out: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(x)[0]:
        node = out
        keys = [_entry_str(e) for e in path]
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1] if keys else "0"] = key_data(leaf)
    return out


def flatten_paths(state_dict: Any, prefix: Path = (), keep_none: bool = False) -> dict[Path, Any]:
    """``{path: leaf}`` of a nested state dict; empty dicts and ``None`` hold no leaves.

    Lists and tuples (as some readers return them) are keyed by position. With
    ``keep_none``, ``None`` values are kept as leaves (so that loading can say
    that a leaf is ``None`` rather than missing).

    Example:
        >>> flatten_paths({"step": 1, "opt_state": {"0": {"mu": {"a/b": 2}}, "1": {}}})
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
        out.update(flatten_paths(value, (*prefix, str(key)), keep_none))
    return out


def _base(opt: Any) -> dict[str, Any]:
    return {"step": opt.step, "opt_state": opt.opt_state}


def state_dict(opt: Any) -> dict[str, Any]:
    """``{"step": ..., "opt_state": ...}`` of an initialized optimizer (see the module doc)."""
    opt._require_layout()
    return {"step": key_data(opt.step), "opt_state": to_plain(opt.opt_state)}


# -- describing leaves ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One leaf of a target optimizer, as the state dict must hold it."""

    index: int  # position among the leaves of {"step", "opt_state"}
    leaf: Any  # the target's leaf (array, ShapeDtypeStruct, ...)
    shape: tuple[int, ...]  # the shape expected in the state dict (key data for keys)
    dtype: Any  # the dtype expected in the state dict (uint32 for keys)

    @property
    def expected(self) -> str:
        return f"{dtype_name(self.dtype)}{list(self.shape)}"

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


class TreeSlots(NamedTuple):
    """The leaves of a target tree, by state-dict path, with what each must be given."""

    slots: dict[Path, _Slot]  # {path: slot}
    treedef: Any  # of the tree whose leaves these are
    leaves: list[Any]  # the target's leaves, in treedef order


def slots(opt: Any) -> TreeSlots:
    """The slots of the ``{"step", "opt_state"}`` tree of ``opt``, by state-dict path."""
    opt._require_layout()
    leaves, treedef = jax.tree.flatten(_base(opt))
    indexed = flatten_paths(to_plain(jax.tree.unflatten(treedef, list(range(len(leaves))))))
    out = {path: slot(index, leaves[index]) for path, index in indexed.items()}
    if sorted(s.index for s in out.values()) != list(range(len(leaves))):
        raise AssertionError("treeopt: the state dict does not cover every optimizer leaf")
    return TreeSlots(out, treedef, leaves)


def param_slots(params: Any) -> TreeSlots:
    """The slots of the array leaves of ``params``, each at the path ``(its name,)``."""
    leaves, treedef = jax.tree.flatten(params)
    out: dict[Path, _Slot] = {
        (name,): slot(index, leaf)
        for index, (name, leaf) in enumerate(zip(leaf_names(params), leaves, strict=True))
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype")
    }
    return TreeSlots(out, treedef, leaves)


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
        return describe(value)
    if is_key(value):
        if is_key(slot.leaf) and value.dtype == slot.leaf.dtype and value.shape == slot.leaf.shape:
            return None
        return describe(value)
    if tuple(value.shape) == slot.shape and dtype_name(value.dtype) == dtype_name(slot.dtype):
        return None
    return describe(value)


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


def match_paths(
    slots_: Mapping[Path, _Slot], source: Mapping[Path, Any]
) -> tuple[dict[Path, Path], LoadReport]:
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


# -- loading -------------------------------------------------------------------------


def as_target_leaf(slot: _Slot, value: Any, copy: bool = False) -> Any:
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
        value = wrap_key_like(slot.leaf, value)
    elif isinstance(value, _SCALARS) and not isinstance(value, np.generic):
        value = np.asarray(value, dtype=slot.dtype)
    if isinstance(value, jax.core.Tracer):
        return value
    if sharding is not None:
        return jax.device_put(value, sharding, may_alias=False) if alias else jax.device_put(value, sharding)
    if alias:
        return jnp.array(value, copy=True)
    return value if isinstance(value, jax.Array) else jnp.asarray(value)


def fill_leaves(
    target: TreeSlots,
    pairs: Mapping[Path, Path],
    source: Mapping[Path, Any],
    *,
    copy: bool = False,
    what: str,
) -> list[Any]:
    """The target's leaves, those at ``pairs`` taken from ``source``, in treedef order.

    A leaf of an abstract target (``jax.eval_shape``) that ``source`` does not
    provide has no value to keep: an error naming every such path. ``copy``:
    see :func:`as_target_leaf`; needed where ``source`` holds arrays the caller keeps.
    """
    new = list(target.leaves)
    abstract_left = []
    for path, slot in target.slots.items():
        if path in pairs:
            new[slot.index] = as_target_leaf(slot, source[pairs[path]], copy=copy)
        elif slot.abstract:
            abstract_left.append(path_str(path))
    if abstract_left:
        raise StateDictError(
            f"The target {what} is abstract (jax.eval_shape), so leaves the source does not "
            f"provide have no value to keep: {abstract_left}. Load into concrete {what} instead "
            "(opt.init(params) for an optimizer)."
        )
    return new


def with_loaded_leaves(
    opt: Any, target: TreeSlots, pairs: Mapping[Path, Path], source: Mapping[Path, Any], copy: bool = False
) -> Any:
    """A new optimizer like ``opt`` whose leaves at ``pairs`` come from ``source``."""
    base = jax.tree.unflatten(target.treedef, fill_leaves(target, pairs, source, copy=copy, what="optimizer"))
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
    source = verify_checksum(flatten_paths(_as_mapping(sd), keep_none=True))
    return match_paths(slots(opt).slots, source)[1]


def _as_mapping(sd: Any) -> Mapping[str, Any]:
    if not isinstance(sd, Mapping):
        raise TypeError(
            "load_state_dict needs a state dict: the nested dict that opt.state_dict() returns "
            f"(or that went through numpy / msgpack / orbax), got {type(sd).__name__}."
        )
    return sd


def load_state_dict(opt: Any, sd: Any, strict: bool = True) -> Any:
    """A new optimizer like ``opt`` with its state from ``sd`` (see ``Optimizer.load_state_dict``)."""
    target = slots(opt)
    source = verify_checksum(flatten_paths(_as_mapping(sd), keep_none=True))
    pairs, report = match_paths(target.slots, source)
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
    return with_loaded_leaves(opt, target, pairs, source, copy=True)


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
    target = slots(opt)
    slots_ = target.slots
    src = verify_checksum(flatten_paths(_as_mapping(source)))
    pairs, exact = match_paths(slots_, src)
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
    return with_loaded_leaves(opt, target, pairs, src, copy=True), report
