"""What treeopt must know of other versions: JAX private APIs and its own moved names.

- ``jax_private``: the one module that touches JAX private APIs, each with
  the public behaviour it stands in for, so a JAX release that changes them
  breaks one file.
- ``optax_private``: the same for the private members of optax objects
  (what ``optax.MultiSteps`` was built from).
- ``deprecations``: names that moved, each with the release that removes the
  old path, in one table.

May import: jax, optax and the standard library only.
"""
