"""The params tree: names of leaves, which leaves are trained, and the way back.

- ``paths``: any pytree's leaves as ``{"encoder/layers_0/kernel": leaf}``.
- ``nnx_graph``: the one home of flax.nnx knowledge (Variables, Modules, filters,
  writing new values into a Module in place). treeopt never imports flax.nnx
  itself; these functions look for it only once the user has imported it.
- ``masks``: masks and labels from names (the public face is ``treeopt.masks``).
- ``layout``: ``ParamLayout``, the static aux data that flattens params by name
  and rebuilds the caller's type (the public face is ``treeopt.layout``).
- ``children``: the children of the optimizer's state (master copies,
  compensation, key, ...), each declared once, which every other wing reads.

May import: jax, optax, numpy, ``treeopt.errors``, ``treeopt.typing``. Nothing
else of treeopt: every other wing builds on this one.
"""
