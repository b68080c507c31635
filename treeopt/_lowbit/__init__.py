"""Low-bit optimizer state (``state_bits=``): its codes, and which state is held in them.

- ``maps``: the non-linear maps of low-bit codes, as bit arithmetic.
- ``format``: the format of low-bit codes (bits, map, block layout) and
  where a shard may cut them.
- ``codec``: the block-wise 8- and 4-bit codes of state leaves, and their leaf.
- ``statistics``: which fields of an optax state are running statistics (the
  table the docs print).
- ``state``: which state leaves are held as codes, the codes around a step,
  and low-bit values in state dicts.
- ``legacy``: state dicts written before the format was recorded.

May import: ``treeopt._compat``, ``treeopt._tree``, ``treeopt._sharding``
(the spec contract a low-bit leaf answers to), ``treeopt.errors``,
``treeopt.typing``. It is handed the state and the layout
and returns state, never the optimizer; the step (``treeopt._step``) and the
state-dict engine (``treeopt._state``) build on it.
"""
