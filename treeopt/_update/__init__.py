"""The arguments of ``Optimizer.update``: checked, flattened by name, and the way back.

- ``inputs``: ``update(grads, params, **extra)`` turned into the flat inputs of
  the pure step, and its output turned back into the caller's types.
- ``extra_args``: extra arguments of ``tx.update`` (``value``, ``grad``,
  ``value_fn``) matched by name.
- ``argument_order``: grads and params given in ``nnx.Optimizer``'s order,
  named as swapped.
- ``trace_guard``: an optimizer captured by closure inside ``jax.jit``, or
  stepped under a trace it was not passed into.
- ``donated``: an optimizer whose buffers were donated to a jitted step.

May import: ``treeopt._compat``, ``treeopt._tree``, ``treeopt._sharding``,
``treeopt._step`` (what counts as an array input of the step),
``treeopt.errors``, ``treeopt.typing``. Never ``treeopt.optimizer``: it is handed the layout and
the step count, not the optimizer.
"""
