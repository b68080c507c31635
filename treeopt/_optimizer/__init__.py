"""The optimizer itself: the pytree that holds its state and hands each job to the wing that does it.

- ``optimizer``: :class:`Optimizer` (its public face is ``treeopt.optimizer``).
- ``parts``: its state as the wings below take it, and back.

May import: ``treeopt._compat``, ``treeopt._tree``, ``treeopt._sharding``,
``treeopt._lowbit``, ``treeopt._step``, ``treeopt._state``, ``treeopt._update``,
``treeopt.hyperparams``, ``treeopt.errors``,
``treeopt.typing``. Never a face above it (``treeopt.optimizer``, the
package), the drop-ins or ``treeopt._checkpoint``: the wings below are handed
its parts and return parts, and nothing calls it back.
"""
