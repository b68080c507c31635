"""Names that moved: the old import keeps working, with a ``DeprecationWarning`` naming the new one."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def moved_names(module: str, moved: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving each old name of ``moved`` from its new module, with a warning.

    ``moved`` maps a name to the module it now lives in.

    Example:
        >>> import warnings
        >>> getattr_ = moved_names("treeopt.optimizer", {"flat_step": "treeopt.step"})
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     getattr_("flat_step").__module__
        'treeopt.step'
        >>> str(caught[0].message)
        'treeopt.optimizer.flat_step moved: import it from treeopt.step.'
    """

    def __getattr__(name: str) -> Any:
        home = moved.get(name)
        if home is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} moved: import it from {home}.", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), name)

    return __getattr__
