"""The step: what it takes and gives back, and how each param is held.

- ``traced``: the step itself, ``flat_step`` (its public face is ``treeopt.step``):
  ``tx.update`` through the params' precision, low-bit state decoded and
  encoded around it.
- ``step_io``: the step corridor: what one step takes (its static data
  included) and gives back, and the count's increment.
- ``precision``: one precision layer: how a param is held and takes a float32
  update (as is, master weights, Kahan, stochastic rounding), each way with
  its own state type, one ``narrower`` predicate, and the one step every way
  takes.
- ``options``: the precision options checked (``master_dtype``,
  ``param_rounding``, ``rounding_seed``), and the precision they choose.
- ``rounding``: stochastic rounding into a narrow float dtype, unbiased.
- ``initial``: the transformation checked, and what ``tx.init`` sees for fresh params.

May import: ``treeopt._compat``, ``treeopt._tree``, ``treeopt._sharding``
(explicit-axes resharding), ``treeopt._lowbit`` (low-bit state around the
step), ``treeopt.errors``, ``treeopt.typing``. It is handed
the optimizer's parts (layout, state, params, precision) and returns parts,
never the optimizer.
"""
