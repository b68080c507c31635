"""What the layers built on the core (``treeopt.t5x``, ``treeopt.nnx``) use of it, beyond the public API.

Not part of the public API: these names may change in any release. Users
call the public modules (``treeopt``, ``treeopt.serialization``,
``treeopt.checkpoint``, ``treeopt.partitioning``, ...); a layer that keeps
the optimizer's state in another shape uses these to share the core's work
rather than repeat it: the state-dict engine and its policies, the checksum,
the checked conversion of hyperparameter values, their reading as
attributes and the one rule of assigning them, the refusal of a negative
step, the names of key paths, the spec derivation that ZeRO-1 builds on, the
check of a spec tree against the params, and the placement of new params on
their old shardings.

Example:
    >>> import jax.numpy as jnp
    >>> from treeopt import internal
    >>> target = internal.Target.of({"w": jnp.zeros(2)}, plain=lambda tree: tree)
    >>> tree, report = internal.load(
    ...     target, internal.StateDictSource({"w": jnp.ones(2)}), internal.EXACT, internal.Messages("", "", ""))
    >>> tree["w"], report.ok
    (Array([1., 1.], dtype=float32), True)
"""

from treeopt._optimizer.parts import STATE_VIEWS, state_views, with_state_views
from treeopt._sharding.explicit import placed_like, placements
from treeopt._sharding.specs import (
    derive_spec,
    flat_param_specs,
    is_spec,
    per_dimension_axes,
    spec_leaves_with_names,
)
from treeopt._sharding.zero import ZeroLeafSpec, zero_leaf_spec
from treeopt._state.checksum import with_checksum
from treeopt._state.engine import Messages, StateDictSource, Target, load
from treeopt._state.policies import BY_KIND, EXACT, Policy
from treeopt._state.step_rule import refuse_a_negative_step
from treeopt._tree.paths import path_to_name
from treeopt.hyperparams import checked_value, hyperparameter_attribute, sets_hyperparameter

__all__ = [
    "BY_KIND",
    "EXACT",
    "STATE_VIEWS",
    "Messages",
    "Policy",
    "StateDictSource",
    "Target",
    "ZeroLeafSpec",
    "checked_value",
    "derive_spec",
    "flat_param_specs",
    "hyperparameter_attribute",
    "is_spec",
    "load",
    "path_to_name",
    "per_dimension_axes",
    "placed_like",
    "placements",
    "refuse_a_negative_step",
    "sets_hyperparameter",
    "spec_leaves_with_names",
    "state_views",
    "with_checksum",
    "with_state_views",
    "zero_leaf_spec",
]
