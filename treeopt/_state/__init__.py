"""The optimizer's state in its own forms: plain dicts, checksums, the one state-dict engine.

- ``plain``: the optax state as nested plain dicts keyed by field and name,
  and their leaves by path.
- ``keys``: typed PRNG keys as state-dict leaves (the public face is
  ``treeopt.keys``).
- ``checksum``: the one checksum of a state dict (a bit-sum that works on
  sharded arrays).
- ``engine``: the one state-dict engine: match by name, report, place on
  shardings, fill, verify the checksum; each caller brings its policy.
- ``policies``: a slot of a target, what a value must be to fill it, and what it becomes
  (exact, exact or wider, by kind).
- ``step_rule``: what a step count may be (a state dict's, a checkpoint's).
- ``state_dict``: the core's state dicts and ``load_state_dict``/``warm_start``
  policies, over the optimizer's parts (the precision among them writes its
  own entries).

May import: ``treeopt._compat``, ``treeopt._tree``, ``treeopt._sharding``,
``treeopt._lowbit`` (the entries a low-bit leaf writes, and their
conversions), ``treeopt.errors``, ``treeopt.typing``; never the step
(``treeopt._step``): the engine is apart from it. It is handed the
optimizer's parts and returns parts, never the optimizer.
"""
