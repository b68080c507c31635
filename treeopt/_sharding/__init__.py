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
- ``whole_leaf``: ``treeopt.whole_leaf``, the marking of functions whose
  result reads a leaf whole (Muon's Newton-Schulz, registered from
  ``_compat``, or a user's own), and the routing of their calls.
- ``ownership``: the wrapper that, on a mesh, has each such matrix computed
  by one owner device: calls matched to params by data flow, owners
  balanced by cost; what ``zero_report`` lists of them.
- ``exchange``: the owners' exchange itself: stacks, one all-to-all over the
  axes that split the matrices, the per-device computation, and back.

May import: ``treeopt._compat``, ``treeopt._tree``, ``treeopt.errors``,
``treeopt.typing``. It is handed the state's parts and the layout, never the
optimizer; the step and state wings build on it, not the reverse.
"""
