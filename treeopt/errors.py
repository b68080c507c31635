"""Trees that do not match the one expected: the report, its one text form, the errors that carry it.

Every check that compares a tree with the one an optimizer expects (gradients
against params, a spec tree, a state dict, a checkpoint, T5X logical axes)
reports by path what is missing, unexpected, shaped differently or nested
differently, formats it with :meth:`LoadReport.problems`, and raises a
:class:`TreeMismatchError` (a ``ValueError``) holding the report.
``StateDictError`` is the one state dicts and checkpoints raise.

This module is the bottom of the ladder: it imports nothing from treeopt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import numpy as np

__all__ = [
    "CheckpointError",
    "CheckpointInUseError",
    "DonatedOptimizerError",
    "LoadReport",
    "StateDictError",
    "StateDictWarning",
    "TreeMismatchError",
    "describe",
]

# A report of 300k unexpected keys would otherwise make a message of megabytes.
MAX_LISTED = 200
_MISNESTED_HINT = (
    "  These entries are in the state dict, but nested differently: the optimizer keys "
    "each parameter's state by its full name, which contains '/', and these names were "
    "split into nested dicts (or nested dicts were joined into one key), e.g. by "
    "flax.traverse_util.flatten_dict/unflatten_dict with sep='/'. Key each entry as "
    "opt.state_dict() does."
)


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What matched between a tree and the one expected, by path, and what did not.

    Loading a state dict fills every field; the other checks (gradients,
    specs, logical axes) use ``missing``, ``unexpected`` and ``mismatched``.

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
        cast: for ``warm_start`` only: ``(path, from, to)`` of the values cast up to
            the target's wider floating dtype, e.g. ``("opt_state/0/mu/w",
            "bfloat16", "float32")``.
        converted: for ``warm_start`` only: ``(path, from, to)`` of the values converted
            between full precision and low-bit codes (``state_bits``), e.g.
            ``("opt_state/0/mu/w", "float32[64,64]", "8-bit codes")``.
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
    cast: tuple[tuple[str, str, str], ...] = ()
    converted: tuple[tuple[str, str, str], ...] = ()

    @property
    def ok(self) -> bool:
        """True when every path matched: nothing missing, unexpected, mismatched or misnested."""
        return not (self.missing or self.unexpected or self.mismatched or self.misnested)

    def problems(self) -> str:
        """The missing, unexpected, mismatched and misnested paths, one per line ("" when ``ok``).

        Each kind lists at most ``MAX_LISTED`` paths, then says how many more it
        left out (every one is in the report's field of that name).

        Example:
            >>> last = LoadReport(unexpected=tuple(f"x{i}" for i in range(202))).problems().splitlines()[-1]
            >>> last.endswith("... and 2 more (all of them in the report's .unexpected)")
            True
        """
        lines: list[str] = []
        sections = (
            ("missing", "missing", self.missing, lambda p: p),
            ("unexpected", "unexpected", self.unexpected, lambda p: p),
            (
                "shape/dtype mismatch",
                "mismatched",
                self.mismatched,
                lambda m: f"{m[0]}: expected {m[1]}, got {m[2]}",
            ),
            (
                "nested differently, names split or joined on '/'",
                "misnested",
                self.misnested,
                lambda m: f"{m[0]}: found at {m[1]}, expected at {m[2]}",
            ),
        )
        for title, field, entries, line in sections:
            if not entries:
                continue
            lines.append(f"{title} ({len(entries)}):")
            lines.extend(f"  {line(entry)}" for entry in entries[:MAX_LISTED])
            if len(entries) > MAX_LISTED:
                lines.append(
                    f"  ... and {len(entries) - MAX_LISTED} more (all of them in the report's .{field})"
                )
        if self.misnested:
            lines.append(_MISNESTED_HINT)
        return "\n".join(lines)

    def __str__(self) -> str:
        head = f"loaded {len(self.loaded)} leaves"
        if self.renamed:
            head += f" ({len(self.renamed)} matched by field and parameter name)"
        if self.cast:
            head += (
                f" ({len(self.cast)} cast up: " + ", ".join(f"{p} {a}->{b}" for p, a, b in self.cast) + ")"
            )
        if self.converted:
            head += (
                f" ({len(self.converted)} converted: "
                + ", ".join(f"{p} {a}->{b}" for p, a, b in self.converted)
                + ")"
            )
        return head if self.ok else f"{head}; not loaded:\n{self.problems()}"


class TreeMismatchError(ValueError):
    """A tree that does not match the one expected; ``.report`` lists the paths that differ.

    Raised for gradients that do not match the params, spec trees and logical
    axes of another shape, and (as :class:`StateDictError`) state dicts and
    checkpoints of another model.

    Example:
        >>> import jax.numpy as jnp, optax, treeopt
        >>> opt = treeopt.Optimizer(optax.sgd(0.1)).init({"w": jnp.ones(2), "b": jnp.ones(2)})
        >>> try:
        ...     opt.update({"w": jnp.ones(2), "c": jnp.ones(2)}, {"w": jnp.ones(2), "b": jnp.ones(2)})
        ... except treeopt.errors.TreeMismatchError as e:
        ...     print(e.report.missing, e.report.unexpected)
        ('b',) ('c',)
    """

    def __init__(self, message: str, report: LoadReport | None = None):
        super().__init__(message)
        self.report = report if report is not None else LoadReport()

    @classmethod
    def between(
        cls,
        lead: str,
        *,
        missing: Iterable[str] = (),
        unexpected: Iterable[str] = (),
        mismatched: Iterable[tuple[str, str, str]] = (),
        hint: str = "",
    ) -> TreeMismatchError:
        """The error whose message is ``lead``, then the paths (sorted) as :meth:`LoadReport.problems` lists them.

        Example:
            >>> err = TreeMismatchError.between(
            ...     "grads do not match the params", missing=["b"], hint="Pass grads of params."
            ... )
            >>> print(err)
            grads do not match the params:
            missing (1):
              b
            Pass grads of params.
        """
        report = LoadReport(
            missing=tuple(sorted(missing)),
            unexpected=tuple(sorted(unexpected)),
            mismatched=tuple(sorted(mismatched)),
        )
        return cls.of(lead, report, hint)

    @classmethod
    def of(cls, lead: str, report: LoadReport, hint: str = "") -> TreeMismatchError:
        """The error whose message is ``lead``, then the report's problems, then ``hint``.

        Example:
            >>> print(StateDictError.of("The state dict does not match", LoadReport(unexpected=("x",))))
            The state dict does not match:
            unexpected (1):
              x
        """
        message = f"{lead}:\n{report.problems()}"
        return cls(message + (f"\n{hint}" if hint else ""), report)


class StateDictError(TreeMismatchError):
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

    @classmethod
    def of(cls, lead: str, report: LoadReport) -> StateDictWarning:
        """The warning whose message is ``lead``, then the paths that did not load.

        Example:
            >>> print(StateDictWarning.of("kept", LoadReport(missing=("step",))))
            kept:
            missing (1):
              step
        """
        return cls(f"{lead}:\n{report.problems()}", report)


class CheckpointError(ValueError):
    """A checkpoint (or serialized bytes) that cannot be read: incomplete, truncated or corrupted.

    Example:
        >>> import jax.numpy as jnp, optax, treeopt
        >>> opt = treeopt.Optimizer(optax.adam(1e-3)).init({"w": jnp.ones(2)})
        >>> data = treeopt.serialization.to_bytes(opt)
        >>> try:
        ...     treeopt.serialization.from_bytes(opt, data[: len(data) // 2])
        ... except CheckpointError as e:
        ...     print(str(e).split(":")[0])
        Could not decode 77 bytes as a msgpack state dict
    """


class CheckpointInUseError(RuntimeError):
    """Another process writes this checkpoint directory; ``.directory`` and ``.holder`` name them.

    A ``CheckpointManager`` takes its directory's lock at its first save and
    keeps it until closed; ``save(directory, ...)`` holds it while it writes.

    Example:
        >>> import tempfile, jax.numpy as jnp, optax, treeopt
        >>> opt = treeopt.Optimizer(optax.sgd(0.1)).init({"w": jnp.ones(2)})
        >>> directory = tempfile.mkdtemp()
        >>> first = treeopt.checkpoint.CheckpointManager(directory, enable_async_checkpointing=False)
        >>> first.save(0, opt)
        True
        >>> second = treeopt.checkpoint.CheckpointManager(directory, enable_async_checkpointing=False)
        >>> try:
        ...     second.save(1, opt)
        ... except CheckpointInUseError as e:
        ...     print(e.holder.split(" (")[0])
        this process
        >>> first.close(); second.save(1, opt)
        True
        >>> second.close()
    """

    def __init__(self, message: str, *, directory: str = "", holder: str = ""):
        super().__init__(message)
        self.directory = directory
        self.holder = holder


class DonatedOptimizerError(RuntimeError):
    """An optimizer whose buffers were donated to a jitted step (they are deleted): use the one it returned.

    Example:
        >>> import jax, jax.numpy as jnp, optax, treeopt
        >>> opt = treeopt.Optimizer(optax.sgd(0.1)).init({"w": jnp.ones(2)})
        >>> step = jax.jit(lambda opt: opt, donate_argnums=0)
        >>> new_opt = step(opt)
        >>> try:
        ...     opt.state_dict()
        ... except DonatedOptimizerError as e:
        ...     print(str(e).split(":")[0])
        This optimizer's buffers were donated to a jitted step (donate_argnums/donate_argnames) and are deleted
    """


def describe(x: object) -> str:
    """A value as an error message shows it: ``dtype[shape]`` for arrays, else its type and value.

    Arrays (jax, numpy, traced, abstract ``ShapeDtypeStruct``s) read
    ``float32[2, 3]``; scalars (Python's and NumPy's) and other objects their
    type and value, cut at 60 characters; strings are quoted.

    Example:
        >>> import numpy as np
        >>> describe(np.zeros((2, 3), np.float32)), describe(None), describe([1])
        ('float32[2, 3]', 'None', 'list [1]')
        >>> describe(float("nan")), describe(np.float32(0.5)), describe("lr")
        ('float nan', 'float32 0.5', "the string 'lr'")
    """
    if x is None:
        return "None"
    if isinstance(x, (str, bytes)):
        return f"the string {x!r}"[:60]
    if isinstance(x, np.generic):
        return f"{dtype_name(x.dtype)} {x}"
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{dtype_name(dtype)}{list(shape)}"
    text = repr(x)
    return f"{type(x).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def dtype_name(dtype: object) -> str:
    """``np.dtype(dtype).name``, or ``str(dtype)`` for dtypes NumPy does not know (PRNG keys).

    Example:
        >>> import numpy as np
        >>> dtype_name(np.float32), dtype_name("key<fry>")
        ('float32', 'key<fry>')
    """
    try:
        return np.dtype(dtype).name  # type: ignore[call-overload]
    except TypeError:
        return str(dtype)
