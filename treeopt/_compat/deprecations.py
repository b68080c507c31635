"""Names that moved, in one table: the old import keeps working until the release named beside it.

Each entry maps ``(old module, name)`` to the module the name lives in now and
the treeopt release that removes the old path. The old path raises a
``DeprecationWarning`` naming both; a module serves its moved names through
``__getattr__ = moved_names(__name__)``.

Example:
    >>> MOVED["treeopt.optimizer"]["FlatStep"]
    Moved(home='treeopt.step', removed_in='0.3.0')
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["MOVED", "Moved", "moved_names"]


class Moved(NamedTuple):
    """Where a moved name lives now, and the release whose old path stops importing."""

    home: str
    removed_in: str


_SPEC_HELPERS = ("ZeroLeafSpec", "derive_spec", "is_spec", "per_dimension_axes", "spec_leaves_with_names", "zero_leaf_spec")
_CHECKPOINT_FUNCTIONS = ("CheckpointManager", "restore", "restore_state_dict", "save")

MOVED: dict[str, dict[str, Moved]] = {
    # 0.1.0: the flat step became a public module of its own.
    "treeopt.optimizer": {"FlatStep": Moved("treeopt.step", "0.3.0")},
    # 0.1.0: checkpoints got their own module, errors theirs.
    "treeopt.serialization": {
        "CheckpointError": Moved("treeopt.errors", "0.3.0"),
        **{name: Moved("treeopt.checkpoint", "0.3.0") for name in _CHECKPOINT_FUNCTIONS},
    },
    "treeopt.checkpoint": {"CheckpointError": Moved("treeopt.errors", "0.3.0")},
    # 0.1.0: helpers only the drop-ins use went to treeopt.internal.
    "treeopt.partitioning": {name: Moved("treeopt.internal", "0.3.0") for name in _SPEC_HELPERS},
}


def moved_names(module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving each moved name of ``module`` from its new home, with a warning.

    Example:
        >>> import warnings
        >>> getattr_ = moved_names("treeopt.optimizer")
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     getattr_("FlatStep") is __import__("treeopt.step").step.FlatStep
        True
        >>> str(caught[0].message)
        'treeopt.optimizer.FlatStep moved: import it from treeopt.step. The old path is removed in treeopt 0.3.0.'
    """
    moved = MOVED.get(module, {})

    def __getattr__(name: str) -> Any:
        entry = moved.get(name)
        if entry is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} moved: import it from {entry.home}. "
            f"The old path is removed in treeopt {entry.removed_in}.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(entry.home), name)

    return __getattr__
