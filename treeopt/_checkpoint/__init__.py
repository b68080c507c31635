"""Checkpoints on disk: orbax items, the directory and its one writer, atomic siblings, the manager.

- ``manager``: ``save`` / ``restore`` of one directory and the
  ``CheckpointManager`` of numbered steps (the public face is ``treeopt.checkpoint``).
- ``items``: what one checkpoint step holds (the optimizer's state dict with
  its checksum, the params) as orbax items, and their restore.
- ``directory``: a manager's directory: complete steps, debris of interrupted
  saves moved aside, housekeeping.
- ``writer_lock``: the one writer per checkpoint directory.
- ``siblings``: a checkpoint replaced atomically through sibling directories.
- ``held``: the drop-ins that hold a ``treeopt.Optimizer``, recognised by two methods.

May import: ``treeopt._compat``, ``treeopt._tree``, ``treeopt._sharding``,
``treeopt._state``, ``treeopt._optimizer`` (what a checkpoint holds and restores into),
``treeopt.errors``. The public face is ``treeopt.checkpoint``.
"""
