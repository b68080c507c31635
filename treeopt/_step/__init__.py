"""The step: what it takes and gives back, and how each param is held.

- ``traced``: the step itself, ``flat_step`` (the public face is ``treeopt.step``).
- ``step_io``: the step corridor: what one step takes and gives back.
- ``initial``: the transformation checked, and what ``tx.init`` sees for fresh params.
- ``precision``: one precision layer: how a param is held and takes a float32
  update (as is, master weights, Kahan, stochastic rounding), one ``narrower``
  predicate, and the one step every way takes.
- ``rounding``: stochastic rounding into a narrow float dtype, unbiased.

May import: ``treeopt._compat``, ``treeopt._tree``, ``treeopt._sharding``
(explicit-axes resharding), ``treeopt._lowbit`` (low-bit state), ``treeopt.errors``, ``treeopt.keys``,
``treeopt.typing``. It is handed the optimizer's parts (layout, state,
params) and returns parts, never the optimizer.
"""
