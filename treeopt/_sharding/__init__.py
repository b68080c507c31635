"""Partition specs of any optimizer state, derived from the params' specs, ZeRO-1 and whole-leaf ownership.

- ``specs``: the spec of each state leaf from its parameter's (same shape:
  the param's spec; factored: the reduced axes dropped; the rest: ``P()``).
- ``zero``: ZeRO-1, the data-parallel axes added to one free, divisible
  dimension of every large state leaf (or joined to a split one's axes).
- ``optimizer_specs``: the specs of a state's parts (optax state, master
  copies), checked against the params and the mesh.
- ``abstract``: ``jax.eval_shape`` with an error that says how to build an
  abstract equinox target.
- ``explicit``: under JAX's explicit axes, values resharded to the sharding
  of the value they replace or meet (the new params to the types of the
  params given to ``update``, the grads to their state's layout).
- ``whole_leaf``: the one home of the optax functions whose update reads a
  leaf whole (Muon's Newton-Schulz), and the routing of their calls.
- ``ownership``: on a mesh, each such matrix computed by one owner device,
  owners balanced by cost; what ``zero_report`` lists of them.

May import: ``treeopt._compat``, ``treeopt._tree``, ``treeopt.errors``,
``treeopt.typing``. It is handed the state's parts and the layout, never the
optimizer; the step and state wings build on it, not the reverse.
"""
