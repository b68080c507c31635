"""What treeopt must know of other versions: JAX private APIs and its own moved names.

- ``jax_private``: the one module that touches JAX private APIs, each with
  the public behaviour it stands in for, so a JAX release that changes them
  breaks one file.
- ``optax_private``: the same for optax's private names: the private
  members of its objects (what ``optax.MultiSteps`` was built from), and its
  private modules that treeopt names (where Muon's Newton-Schulz and some
  state types are defined, and its module of optimizers).
- ``deprecations``: names that moved, each with the release that removes the
  old path, in one table.

May import: jax, optax and the standard library only.
"""
