"""treeopt.t5x in a T5X-style sharded step on 8 virtual CPU devices.

The trainer's recipe: ``jax.eval_shape`` of ``create``, ``derive_logical_axes``,
logical axes to mesh axes with flax linen's rules, then ``jax.jit`` with those
shardings for ``create`` and the train step. Results must equal the unsharded
run (rtol=1e-6: a sharded reduction may sum in another order).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import grads_at
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from treeopt.t5x import optimizers

from _helpers import device_mesh, is_spec

RULES = [("embed", "data"), ("mlp", "model"), ("vocab", None), ("layers", None)]


def mesh():
    return device_mesh((4, 2), ("data", "model"))


def to_shardings(logical, the_mesh):
    mesh_axes = jax.tree.map(
        lambda s: None if s is None else nn.logical_to_mesh_axes(s, RULES), logical, is_leaf=is_spec
    )
    return jax.tree.map(
        lambda s: NamedSharding(the_mesh, P() if s is None else s), mesh_axes, is_leaf=is_spec
    )


def run(opt_def, params, axes, the_mesh, steps=2):
    """Sharded create + steps; returns the sharded optimizer, its shardings and the unsharded result."""
    abstract = jax.eval_shape(opt_def.create, params)
    logical = opt_def.derive_logical_axes(abstract, axes)
    shardings = to_shardings(logical, the_mesh)
    opt = jax.jit(opt_def.create, out_shardings=shardings)(params)

    def train_step(opt, lr, i):
        return opt.apply_gradient(grads_at(opt.target, i), learning_rate=lr)

    step = jax.jit(train_step, in_shardings=(shardings, None, None), out_shardings=shardings)
    plain = opt_def.create(params)
    for i in range(steps):
        opt = step(opt, jnp.float32(0.01), i)
        plain = jax.jit(train_step)(plain, jnp.float32(0.01), i)
    return opt, shardings, plain


def assert_close(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-6, atol=1e-7)


PARAMS = {
    "embed": {"embedding": jnp.linspace(-1.0, 1.0, 16 * 8).reshape(16, 8)},
    "mlp": {"wi": jnp.linspace(-0.5, 0.5, 8 * 12).reshape(8, 12), "bias": jnp.linspace(0.0, 1.0, 12)},
}
AXES = {
    "embed": {"embedding": P("vocab", "embed")},
    "mlp": {"wi": P("embed", "mlp"), "bias": P("mlp")},
}


def test_adamw_state_is_sharded_like_its_params_and_matches_unsharded():
    the_mesh = mesh()
    opt, _, plain = run(optimizers.adamw(learning_rate=1.0, honor_learning_rate=True), PARAMS, AXES, the_mesh)
    adam_state = opt.state.param_states[0]
    assert adam_state.mu["mlp"]["wi"].sharding.spec == P("data", "model")
    assert adam_state.nu["embed"]["embedding"].sharding.spec == P(None, "data")
    assert adam_state.count.sharding.spec == P()
    assert opt.target["mlp"]["wi"].addressable_shards[0].data.shape == (2, 6)
    assert_close(opt, plain)


def test_factored_optax_statistics_are_sharded_not_replicated():
    the_mesh = mesh()
    opt_def = optimizers.wrap_optax_optimizer(optax.adafactor)(
        learning_rate=1.0, min_dim_size_to_factor=4, honor_learning_rate=True
    )
    opt, _, plain = run(opt_def, PARAMS, AXES, the_mesh)
    factored = opt.state.param_states[0]
    # wi (8, 12) with (embed, mlp): v_row keeps embed, v_col keeps mlp.
    assert factored.v_row["mlp"]["wi"].sharding.spec == P("data")
    assert factored.v_col["mlp"]["wi"].sharding.spec == P("model")
    assert factored.v_row["mlp"]["wi"].addressable_shards[0].data.shape == (2,)
    assert_close(opt, plain)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_multi_optimizer_runs_sharded():
    from flax import traverse_util

    the_mesh = mesh()
    opt_def = optimizers.MultiOptimizer(
        [
            (
                traverse_util.ModelParamTraversal(lambda path, _: "mlp" in path),
                optimizers.adam(learning_rate=1.0, honor_learning_rate=True),
            ),
            (
                traverse_util.ModelParamTraversal(lambda path, _: "embed" in path),
                optimizers.sgd(learning_rate=1.0, honor_learning_rate=True),
            ),
        ]
    )
    opt, _, plain = run(opt_def, PARAMS, AXES, the_mesh)
    assert opt.state.param_states[0][0].mu["mlp"]["wi"].sharding.spec == P("data", "model")
    assert_close(opt, plain)


def test_a_state_type_t5x_has_no_rule_for_derives_and_runs_sharded():
    # A contrib optimizer T5X's rule table does not know: derives and runs sharded.
    the_mesh = mesh()
    opt_def = optimizers.wrap_optax_optimizer(optax.contrib.ademamix)(
        learning_rate=1.0, honor_learning_rate=True
    )
    opt, _, plain = run(opt_def, PARAMS, AXES, the_mesh)
    leaves = jax.tree.leaves(opt.state.param_states[0])
    assert any(leaf.sharding.spec == P("data", "model") for leaf in leaves)
    assert_close(opt, plain)


def test_legacy_adafactor_factored_statistics_are_split_across_devices():
    from treeopt.t5x.adafactor import Adafactor, standard_logical_factor_rules

    the_mesh = mesh()
    params = {
        "embed": {"embedding": PARAMS["embed"]["embedding"]},
        "layers": {"wi": jnp.linspace(-1.0, 1.0, 2 * 8 * 12).reshape(2, 8, 12)},
    }
    axes = {"embed": {"embedding": P("vocab", "embed")}, "layers": {"wi": P("layers", "embed", "mlp")}}
    opt_def = Adafactor(learning_rate=1.0, beta1=0.9, logical_factor_rules=standard_logical_factor_rules())
    opt_def.set_param_axes(axes)
    opt, _, plain = run(opt_def, params, axes, the_mesh)
    wi = opt.state.param_states["layers"]["wi"]
    # (layers, embed, mlp) with rule (BATCH, ROW, COLUMN): v_row (2, 8) keeps embed -> data,
    # v_col (2, 12) keeps mlp -> model; each device holds a quarter / half of them.
    assert wi.v_row.sharding.spec == P(None, "data") and wi.v_row.addressable_shards[0].data.shape == (2, 2)
    assert wi.v_col.sharding.spec == P(None, "model") and wi.v_col.addressable_shards[0].data.shape == (2, 6)
    assert wi.m.sharding.spec == P(None, "data", "model")
    assert wi.v.sharding.spec == P()  # the (1,) placeholder
    embedding = opt.state.param_states["embed"]["embedding"]
    # A rank-2 param without a BATCH axis: T5X's size heuristic leaves it unfactored here.
    assert embedding.v.sharding.spec == P(None, "data") and embedding.v_row.shape == (1,)
    assert_close(opt, plain)
