"""Orbax checkpoints of an Optimizer (and its params): one directory, or numbered steps.

:func:`save` / :func:`restore` for one directory and :class:`CheckpointManager`
for numbered steps (``max_to_keep``, latest step), built on orbax's own
``CheckpointManager`` / ``StandardSave``. A save is atomic: a save killed half-way
leaves the previous checkpoint as the latest; a forced overwrite writes the new
checkpoint completely before the old one is moved aside; steps dropped by
``max_to_keep`` are renamed away before they are deleted. A checkpoint holds an
``optimizer`` item (the state dict) and optionally a ``params`` item (``{name:
array}``, the names of :func:`treeopt.leaf_names`), each readable with plain
orbax, and checksums of both in the step's orbax custom metadata. Restore into
an abstract target from ``jax.eval_shape`` and onto shardings.

Errors are :class:`treeopt.errors.CheckpointError` (damaged or incomplete
checkpoints) and :class:`treeopt.errors.StateDictError` (another model's).
See ``docs/serialization.md``.
"""

from treeopt._checkpoint.manager import CheckpointManager as CheckpointManager
from treeopt._checkpoint.manager import restore as restore
from treeopt._checkpoint.manager import restore_state_dict as restore_state_dict
from treeopt._checkpoint.manager import save as save
from treeopt._compat.deprecations import moved_names

__all__ = ["CheckpointManager", "restore", "restore_state_dict", "save"]

__getattr__ = moved_names(__name__)
