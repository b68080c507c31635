"""The optimizer itself: the pytree that holds its state and hands each job to the wing that does it.

- ``optimizer``: :class:`Optimizer` (its public face is ``treeopt.optimizer``):
  its fields, ``init``, ``update``, its state dict and its pytree nature.
- ``initial``: what ``init`` makes of fresh params (the layout and the state's children).
- ``hyperparameters``, ``views``, ``partitioned``: its bases, one concern
  each: injected hyperparameters by name, the read-only views of the
  precision's state, and ``partition_specs``.
- ``parts``: its state as the wings below take it, and back, child by child by name.

May import: ``treeopt._compat``, ``treeopt._tree``, ``treeopt._sharding``,
``treeopt._lowbit``, ``treeopt._step``, ``treeopt._state``, ``treeopt._update``,
``treeopt.hyperparams``, ``treeopt.errors``,
``treeopt.typing``. Never a face above it (``treeopt.optimizer``, the
package), the drop-ins or ``treeopt._checkpoint``: the wings below are handed
its parts and return parts, and nothing calls it back.
"""
