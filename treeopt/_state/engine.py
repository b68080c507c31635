"""The state-dict engine: one plan loads a source into a target tree, by name.

Every way state comes back in (``load_state_dict``, ``warm_start``, a
checkpoint restore, ``treeopt.t5x``'s ``restore_state`` and bytes) is one
call of :func:`load`, which carries the source through four steps:

1. **match** each slot of the target (a leaf, at the path its state dict
   gives it) with the source's entry at the same path (for a warm start,
   also with the one entry of the same state field and parameter name);
2. **report** what matched and what did not in a
   :class:`~treeopt.errors.LoadReport`: strict loading raises it, lenient
   loading warns with it;
3. **place**: the source is read with each matched entry on the sharding of
   its target leaf (a checkpoint reads only what matched);
4. **fill**: the values read are verified against the source's checksum and
   become the target's leaves.

A :class:`Policy` says what differs between callers: the core loads exact
dtypes and copies (:data:`EXACT`); T5X loads any value of the right kind and
shape as given, and reads the digest earlier treeopt.t5x bytes carry
(:data:`BY_KIND`).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np

from treeopt._state.checksum import CHECKSUM_KEY, matches
from treeopt._state.plain import flatten_paths
from treeopt._state.policies import EXACT, Policy, Slot, slot_of, widens
from treeopt._tree.paths import Path, leaf_names, path_str
from treeopt.errors import LoadReport, StateDictError, StateDictWarning, describe, dtype_name

# -- the target: its slots -------------------------------------------------------------------


class Target(NamedTuple):
    """The leaves of a target tree by path, and how to rebuild the tree from new leaves.

    ``fixed``: entries of the state dict that are not leaves but constants the
    source must hold as they are (a low-bit leaf's ``format``); each binds the
    slots beside it into one unit that loads whole or not at all.
    ``describe_fixed`` says what a fixed value means, for the report.
    """

    slots: dict[Path, Slot]
    treedef: Any
    leaves: list[Any]
    fixed: dict[Path, Any] = {}  # noqa: RUF012  # NamedTuple defaults are shared: never mutated
    describe_fixed: Callable[[Any], str] | None = None

    @classmethod
    def of(
        cls, tree: Any, plain: Callable[[Any], Any], describe_fixed: Callable[[Any], str] | None = None
    ) -> Target:
        """The slots of ``tree``, at the paths of ``plain(tree)``, its state dict.

        Example:
            >>> import jax.numpy as jnp
            >>> target = Target.of({"w": jnp.ones(2)}, plain=lambda tree: {"params": tree})
            >>> list(target.slots)
            [('params', 'w')]
        """
        leaves, treedef = jax.tree.flatten(tree)
        indexed = flatten_paths(plain(jax.tree.unflatten(treedef, list(range(len(leaves))))))
        slots, fixed = {}, {}
        for path, index in indexed.items():
            if isinstance(index, int) and not isinstance(index, bool):
                slots[path] = slot_of(index, leaves[index])
            else:
                fixed[path] = index
        if sorted(s.index for s in slots.values()) != list(range(len(leaves))):
            raise AssertionError("treeopt: the state dict does not cover every leaf of the target")
        return cls(slots, treedef, leaves, fixed, describe_fixed)

    def units(self) -> dict[Path, tuple[Path, ...]]:
        """``{fixed path: the slot paths beside it}``: what loads together or not at all."""
        return {
            path: tuple(p for p in self.slots if len(p) == len(path) and p[:-1] == path[:-1])
            for path in self.fixed
        }

    @classmethod
    def named(cls, tree: Any) -> Target:
        """The slots of the array leaves of ``tree``, each at the path ``(its name,)``.

        Example:
            >>> import jax.numpy as jnp
            >>> list(Target.named({"dense": {"kernel": jnp.ones(2)}, "n": 3}).slots)
            [('dense/kernel',)]
        """
        leaves, treedef = jax.tree.flatten(tree)
        slots: dict[Path, Slot] = {
            (name,): slot_of(index, leaf)
            for index, (name, leaf) in enumerate(zip(leaf_names(tree), leaves, strict=True))
            if hasattr(leaf, "shape") and hasattr(leaf, "dtype")
        }
        return cls(slots, treedef, leaves)


def _same_fixed(expected: Any, got: Any) -> bool | None:
    """Whether a source's value equals a fixed entry; ``None`` when it holds metadata, not values."""
    if not isinstance(got, (np.ndarray, jax.Array, np.generic, list, tuple, int)):
        return None
    try:
        return bool(np.array_equal(np.asarray(expected), np.asarray(got)))
    except (TypeError, ValueError):
        return False


def _fixed_str(target: Target, value: Any) -> str:
    if target.describe_fixed is not None:
        try:
            return target.describe_fixed(value)
        except Exception:  # a value that is not one of the target's kind: shown as it is
            pass
    return describe(value) if not isinstance(value, np.ndarray) else str(value.tolist())


# -- the source ------------------------------------------------------------------------------


class Source(Protocol):
    """Where loaded values come from: a state dict in memory, an item of a checkpoint.

    ``entries()`` describes what it holds (values, or metadata with ``shape``
    and ``dtype``) by path; ``read(placements)`` returns the nested state dict
    with each entry of ``placements`` on that sharding; ``stored_checksum()``
    is the checksum to verify the values read against (``None``: none), and
    ``corrupted()`` the error to raise when they do not match it.
    ``fresh``: whether ``read`` returns new buffers (no copy needed).
    """

    fresh: bool

    def entries(self) -> Mapping[Path, Any]: ...

    def read(self, placements: Mapping[Path, Any]) -> Any: ...

    def stored_checksum(self) -> Any: ...

    def corrupted(self) -> Exception: ...


class StateDictSource:
    """A nested state dict in memory (its ``"checksum"`` entry, if any, is the one to verify).

    Example:
        >>> source = StateDictSource({"step": 3, "checksum": [1, 2]})
        >>> dict(source.entries()), source.stored_checksum()
        ({('step',): 3}, [1, 2])
    """

    fresh = False

    def __init__(self, state_dict: Any, caller: str = "load_state_dict", name: str = "state dict"):
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"{caller} needs a state dict: the nested dict that opt.state_dict() returns "
                f"(or that went through numpy / msgpack / orbax), got {type(state_dict).__name__}."
            )
        self.name = name
        self.nested = {k: v for k, v in state_dict.items() if k != CHECKSUM_KEY}
        self._stored = state_dict.get(CHECKSUM_KEY)
        self._flat = flatten_paths(self.nested, keep_none=True)

    def entries(self) -> Mapping[Path, Any]:
        return self._flat

    def read(self, placements: Mapping[Path, Any]) -> Any:
        return self.nested

    def stored_checksum(self) -> Any:
        return self._stored

    def corrupted(self) -> Exception:
        return StateDictError(
            f"The {self.name}'s checksum does not match its data: it is corrupted (or was edited "
            f"after it was saved). To load a deliberately edited state dict, delete its "
            f"'{CHECKSUM_KEY}' entry first."
        )


# -- the four steps ---------------------------------------------------------------------------


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


class Roles(NamedTuple):
    """How a warm start matches what exact paths do not: by state field and parameter name.

    ``role(path)`` is the part of a path that names what a leaf is, wherever
    the optax state nests it: ``("opt_state", "inner_state", "0", "mu", "w")``
    -> ``("mu", "w")``; a leaf of no parameter (``count``) -> its last key.
    ``wanted(path)``: whether a target path may be loaded at all.
    """

    names: frozenset[str]
    wanted: Callable[[Path], bool]

    def role(self, path: Path) -> Path:
        for i in range(len(path) - 1, 0, -1):
            if path[i] in self.names:
                return path[i - 1 :]
        return path[-1:]


def match(
    target: Target, entries: Mapping[Path, Any], policy: Policy, roles: Roles | None = None
) -> tuple[dict[Path, Path], LoadReport]:
    """Steps 1 and 2: ``({target path: source path}, report)``.

    A ``None`` entry at a target path is a mismatch; elsewhere it is ignored.
    """
    pairs: dict[Path, Path] = {}
    mismatched: dict[Path, tuple[str, str, str]] = {}
    for path, slot in target.slots.items():
        if path in entries:
            misfit = policy.misfit(slot, entries[path])
            if misfit is None:
                pairs[path] = path
            else:
                mismatched[path] = (path_str(path), *misfit)
    renamed: dict[Path, Path] = {}
    if roles is not None:
        renamed = _match_roles(target, entries, policy, roles, pairs)
        pairs = {t: s for t, s in pairs.items() if roles.wanted(t)}
        renamed = {t: s for t, s in renamed.items() if t in pairs}
    mismatched = {p: m for p, m in mismatched.items() if p not in pairs}
    fixed_missing, fixed_taken = _refuse_broken_units(target, entries, pairs, mismatched, renamed)
    taken = set(pairs.values()) | fixed_taken
    missing = [p for p in target.slots if p not in pairs and p not in mismatched] + fixed_missing
    unexpected = [p for p, v in entries.items() if p not in taken and p not in mismatched and v is not None]
    missing, unexpected, misnested = _misnested(missing, unexpected)
    report = LoadReport(
        loaded=tuple(sorted(path_str(p) for p in pairs)),
        missing=tuple(sorted(path_str(p) for p in missing)),
        unexpected=tuple(sorted(path_str(p) for p in unexpected)),
        mismatched=tuple(sorted(mismatched.values())),
        renamed={path_str(t): path_str(s) for t, s in sorted(renamed.items())},
        misnested=tuple(sorted(misnested)),
        cast=_casts(target, entries, pairs) if policy.casts else (),
    )
    return pairs, report


def _refuse_broken_units(
    target: Target,
    entries: Mapping[Path, Any],
    pairs: dict[Path, Path],
    mismatched: dict[Path, tuple[str, str, str]],
    renamed: dict[Path, Path],
) -> tuple[list[Path], set[Path]]:
    """Takes every unit whose fixed entry or any member does not fit out of ``pairs``, reporting why.

    A unit is one value: loading part of it would corrupt it. Returns the
    fixed paths the source lacks and the source paths of the fixed entries it
    holds (found beside the members, wherever a warm start found those).
    """
    missing: list[Path] = []
    taken: set[Path] = set()
    for fixed_path, members in target.units().items():
        parents = {pairs[m][:-1] for m in members if m in pairs}
        source_path = (*parents.pop(), fixed_path[-1]) if len(parents) == 1 else fixed_path
        if source_path not in entries:
            if any(m in pairs for m in members):
                missing.append(fixed_path)
            broken = True
        else:
            taken.add(source_path)
            broken = _same_fixed(target.fixed[fixed_path], entries[source_path]) is False
            if broken:
                mismatched[fixed_path] = (
                    path_str(fixed_path),
                    _fixed_str(target, target.fixed[fixed_path]),
                    _fixed_str(target, entries[source_path]),
                )
        if not (broken or any(m not in pairs for m in members)):
            continue
        for member in members:
            if member in pairs:
                got = describe(entries.get(pairs[member]))
                del pairs[member]
                renamed.pop(member, None)
                mismatched[member] = (
                    path_str(member),
                    target.slots[member].expected,
                    f"{got}, not loaded without the rest of its value ({path_str(fixed_path)})",
                )
    return missing, taken


def _casts(
    target: Target, entries: Mapping[Path, Any], pairs: Mapping[Path, Path]
) -> tuple[tuple[str, str, str], ...]:
    """``(path, from, to)`` of the matched values whose dtype differs from their slot's."""
    out = []
    for path, source in pairs.items():
        slot, value = target.slots[path], entries[source]
        if widens(slot, value):
            out.append((path_str(path), dtype_name(value.dtype), dtype_name(slot.dtype)))
    return tuple(sorted(out))


def _match_roles(
    target: Target, entries: Mapping[Path, Any], policy: Policy, roles: Roles, pairs: dict[Path, Path]
) -> dict[Path, Path]:
    """Adds to ``pairs`` the target paths whose role only one fitting source entry has; returns those."""
    by_role: dict[Path, list[Path]] = {}
    for path in entries:
        by_role.setdefault(roles.role(path), []).append(path)
    renamed = {}
    for path, slot in target.slots.items():
        if path in pairs:
            continue
        candidates = by_role.get(roles.role(path), [])
        if len(candidates) == 1 and policy.misfit(slot, entries[candidates[0]]) is None:
            pairs[path] = renamed[path] = candidates[0]
    return renamed


class Messages(NamedTuple):
    """What a caller says when a source does not fit: the error's lead and hint, the warning's lead."""

    lead: str
    hint: str
    warning: str


def _judge(report: LoadReport, strict: bool | None, messages: Messages) -> None:
    """Raises (``strict``), warns (``strict=False``) or says nothing (``None``) about a report not ok."""
    if report.ok or strict is None:
        return
    if strict:
        cause = (
            "It was saved from another model or optimizer. " if report.missing or report.unexpected else ""
        )
        raise StateDictError.of(messages.lead, report, f"{cause}{messages.hint}".strip())
    warnings.warn(StateDictWarning.of(messages.warning, report), stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside treeopt: a warning points at the user's line."""
    frame, level = inspect.currentframe(), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "treeopt":
        frame, level = frame.f_back, level + 1
    return level


def _fixed_read_late(
    target: Target, entries: Mapping[Path, Any], values: Mapping[Path, Any], pairs: dict[Path, Path]
) -> list[tuple[str, str, str]]:
    """Fixed entries whose source held only metadata, checked on the values read; their units are dropped."""
    late = []
    for fixed_path, members in target.units().items():
        if (
            fixed_path not in entries
            or _same_fixed(target.fixed[fixed_path], entries[fixed_path]) is not None
        ):
            continue
        got = values.get(fixed_path)
        if _same_fixed(target.fixed[fixed_path], got):
            continue
        late.append(
            (path_str(fixed_path), _fixed_str(target, target.fixed[fixed_path]), _fixed_str(target, got))
        )
        for member in members:
            pairs.pop(member, None)
    return late


def _fill(
    target: Target, pairs: Mapping[Path, Path], values: Mapping[Path, Any], policy: Policy, copy: bool
) -> Any:
    """Step 4: the target rebuilt with its leaves at ``pairs`` taken from ``values``.

    A leaf of an abstract target (``jax.eval_shape``) that the source does not
    provide has no value to keep: an error naming every such path.
    """
    leaves = list(target.leaves)
    abstract_left = []
    for path, slot in target.slots.items():
        if path in pairs:
            leaves[slot.index] = policy.convert(slot, values[pairs[path]], copy)
        elif slot.abstract:
            abstract_left.append(path_str(path))
    if abstract_left:
        raise StateDictError(
            "The target is abstract (jax.eval_shape), so leaves the source does not provide have "
            f"no value to keep: {abstract_left}. Load into a concrete target instead "
            "(opt.init(params) for an optimizer)."
        )
    return jax.tree.unflatten(target.treedef, leaves)


def read_verified(source: Source, placements: Mapping[Path, Any], policy: Policy = EXACT) -> Any:
    """Step 3 and the check of step 4: the source's nested values, placed, verified against its checksum."""
    return _verified(source, placements, policy)[0]


def _verified(source: Source, placements: Mapping[Path, Any], policy: Policy) -> tuple[Any, dict[Path, Any]]:
    """``(nested, {path: value})`` of the source read and verified: flattened once, for the check and the fill."""
    nested = source.read(placements)
    values = flatten_paths(nested, keep_none=True)
    if not matches(values, source.stored_checksum(), nested=nested if policy.legacy_digest else None):
        raise source.corrupted()
    return nested, values


def load(
    target: Target,
    source: Source,
    policy: Policy,
    messages: Messages,
    *,
    strict: bool | None = True,
    roles: Roles | None = None,
) -> tuple[Any, LoadReport]:
    """The four steps: ``(the target rebuilt with the source's values, report)``.

    ``strict``: raise a :class:`~treeopt.errors.StateDictError` for any path
    that does not match (``True``), warn and load what matches (``False``), or
    load what matches silently (``None``, a warm start, whose report says it).
    ``roles``: also match by state field and parameter name (a warm start).

    Example:
        >>> import jax.numpy as jnp
        >>> target = Target.of({"w": jnp.zeros(2)}, plain=lambda tree: tree)
        >>> tree, report = load(target, StateDictSource({"w": jnp.ones(2)}), EXACT, Messages("", "", ""))
        >>> tree["w"], report.loaded
        (Array([1., 1.], dtype=float32), ('w',))
    """
    pairs, report = match(target, source.entries(), policy, roles)
    _judge(report, strict, messages)
    placements = {pairs[path]: target.slots[path].sharding for path in pairs}
    placements |= {p: None for p in target.fixed if p in source.entries()}
    values = _verified(source, placements, policy)[1]
    late = _fixed_read_late(target, source.entries(), values, pairs)
    if late:  # a checkpoint's metadata could not tell: the values read do
        report = dataclasses.replace(report, mismatched=tuple(sorted((*report.mismatched, *late))))
        _judge(report, strict, messages)
    return _fill(target, pairs, values, policy, copy=not source.fresh), report
