"""ZeRO-1 in treeopt.t5x: ``derive_logical_axes(..., shard_state_over="batch", mesh=...)``.

T5X's recipe (logical axes, then mesh axes by the logical axis rules) on 8
virtual CPU devices: the state leaves of each parameter gain the ``batch``
logical axis, which the rules map to the ``data`` mesh axis, so each device
holds 1/data of them; the steps give the same params as the unsharded run
(rtol=1e-6: sharded reductions may sum in another order).
"""

from __future__ import annotations

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import grads_at
from flax import traverse_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from treeopt.t5x import adafactor, optimizers

from _helpers import device_mesh, is_spec

# T5X's standard rules, trimmed to the axes used here.
RULES = [
    ("batch", "data"),
    ("vocab", "model"),
    ("embed", None),
    ("mlp", "model"),
    ("joined_kv", "model"),
    ("heads", "model"),
    ("relpos_buckets", None),
]

PARAMS = {
    "token_embedder": {"embedding": jnp.linspace(-1.0, 1.0, 32 * 16).reshape(32, 16)},
    "attention": {
        "query": jnp.linspace(-0.5, 0.5, 16 * 32).reshape(16, 32),
        "out": jnp.linspace(0.5, -0.5, 32 * 16).reshape(32, 16),
    },
    "relpos_bias": jnp.linspace(0.0, 1.0, 4 * 6).reshape(6, 4),
    "mlp": {
        "wi": jnp.linspace(-0.3, 0.3, 16 * 64).reshape(16, 64),
        "bias": jnp.linspace(0.0, 1.0, 6),
    },
    "layer_norm": {"scale": jnp.ones(16)},
}
AXES = {
    "token_embedder": {"embedding": P("vocab", "embed")},
    "attention": {"query": P("embed", "joined_kv"), "out": P("joined_kv", "embed")},
    "relpos_bias": P("relpos_buckets", "heads"),
    "mlp": {"wi": P("embed", "mlp"), "bias": P("mlp")},
    "layer_norm": {"scale": P("embed")},
}


def make_mesh(data, model):
    return device_mesh((data, model), ("data", "model"))


def shardings_of(logical, mesh):
    return jax.tree.map(
        lambda s: NamedSharding(mesh, P() if s is None else nn.logical_to_mesh_axes(s, RULES)),
        logical,
        is_leaf=is_spec,
    )


def logical_axes(opt_def):
    return opt_def.derive_logical_axes(jax.eval_shape(opt_def.create, PARAMS), AXES)


def zero_axes(opt_def, mesh):
    abstract = jax.eval_shape(opt_def.create, PARAMS)
    return opt_def.derive_logical_axes(
        abstract, AXES, shard_state_over="batch", mesh=mesh, logical_axis_rules=RULES
    )


def device0_state_bytes(opt):
    device = jax.devices()[0]
    return sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(opt.state.param_states)
        for shard in leaf.addressable_shards
        if shard.device == device
    )


def train_step(opt, i):
    return opt.apply_gradient(grads_at(opt.target, i), learning_rate=jnp.float32(0.01))


def sharded_run(opt_def, mesh, logical, steps):
    shardings = shardings_of(logical, mesh)
    opt = jax.jit(opt_def.create, out_shardings=shardings)(PARAMS)
    step = jax.jit(train_step, in_shardings=(shardings, None), out_shardings=shardings, donate_argnums=0)
    for i in range(steps):
        opt = step(opt, i)
    return opt


# -- which leaf gets the axis, on which dimension ----------------------------------------------


def test_adam_moments_gain_batch_on_a_free_divisible_dimension():
    axes = zero_axes(optimizers.adam(1e-3), {"data": 4, "model": 2})
    mu = axes.state.param_states[0].mu
    assert mu["mlp"]["wi"] == P("batch", "mlp")  # embed is unsharded: 16 % 4 == 0
    assert mu["token_embedder"]["embedding"] == P("vocab", "batch")  # vocab holds model
    assert mu["attention"]["out"] == P("joined_kv", "batch")
    assert mu["relpos_bias"] == P("relpos_buckets", "heads")  # 6 is not divisible by 4
    assert mu["mlp"]["bias"] == P("mlp")  # its only dimension holds model
    assert mu["layer_norm"]["scale"] == P("batch")
    assert axes.state.param_states[0].nu == mu
    assert axes.state.param_states[0].count is None
    assert axes.state.step is None
    assert axes.target == AXES  # the params keep their layout


def test_default_and_none_keep_the_t5x_axes():
    opt_def = optimizers.adam(1e-3)
    abstract = jax.eval_shape(opt_def.create, PARAMS)
    plain = opt_def.derive_logical_axes(abstract, AXES)
    assert opt_def.derive_logical_axes(abstract, AXES, shard_state_over=None) == plain
    assert plain.state.param_states[0].mu == AXES


def test_legacy_adafactor_factored_statistics_gain_batch():
    opt_def = adafactor.Adafactor(learning_rate=0.1, min_dim_size_to_factor=8)
    axes = zero_axes(opt_def, {"data": 4, "model": 2}).state.param_states
    wi = axes["mlp"]["wi"]  # (16, 64): v_row averages over 64 → (16,), v_col over 16 → (64,)
    assert (wi.v_row, wi.v_col, wi.v, wi.m) == (P("batch"), P("mlp"), None, None)
    embedding = axes["token_embedder"]["embedding"]
    assert (embedding.v_row, embedding.v_col) == (P("batch"), P("vocab"))  # (16,) embed, (32,) vocab
    bias = axes["mlp"]["bias"]  # unfactored, (6,): its one dimension holds model
    assert (bias.v_row, bias.v_col, bias.v) == (None, None, P("mlp"))


def test_momentum_of_legacy_adafactor_is_sharded_when_it_exists():
    opt_def = adafactor.Adafactor(learning_rate=0.1, beta1=0.9, min_dim_size_to_factor=8)
    wi = zero_axes(opt_def, {"data": 8, "model": 1}).state.param_states["mlp"]["wi"]
    assert wi.m == P("batch", "mlp")  # mlp maps to model (size 1); batch goes on the larger free dim... 16
    no_m = zero_axes(adafactor.Adafactor(learning_rate=0.1), {"data": 8, "model": 1})
    assert no_m.state.param_states["mlp"]["wi"].m is None  # the (1,) placeholder stays replicated


def test_multi_optimizer_shards_every_sub_state():
    embeddings = traverse_util.ModelParamTraversal(lambda path, _: "embedding" in path)
    rest = traverse_util.ModelParamTraversal(lambda path, _: "embedding" not in path)
    multi = optimizers.MultiOptimizer(
        [(embeddings, optimizers.sgd(0.1, momentum=0.9)), (rest, optimizers.adam(1e-3))]
    )
    states = zero_axes(multi, {"data": 4, "model": 2}).state.param_states
    momentum = states[0][0].trace
    assert momentum["token_embedder"]["embedding"] == P("vocab", "batch")
    assert states[1][0].mu["mlp"]["wi"] == P("batch", "mlp")


def test_params_already_sharded_over_data_do_not_get_it_twice():
    fsdp_rules = [("batch", "data"), ("embed", "data"), *RULES[1:]]
    opt_def = optimizers.adam(1e-3)
    abstract = jax.eval_shape(opt_def.create, PARAMS)
    axes = opt_def.derive_logical_axes(
        abstract, AXES, shard_state_over="batch", mesh={"data": 4, "model": 2}, logical_axis_rules=fsdp_rules
    )
    assert axes.state.param_states[0].mu["mlp"]["wi"] == P("embed", "mlp")


def test_a_name_the_rules_cannot_place_whole_is_left_alone():
    # 'batch' means data *and* model here; where model is taken, the rules would
    # drop the name altogether, so the leaf keeps its axes rather than lose them.
    rules = [("batch", ("data", "model")), *RULES[1:]]
    opt_def = optimizers.adam(1e-3)
    abstract = jax.eval_shape(opt_def.create, PARAMS)
    axes = opt_def.derive_logical_axes(
        abstract, AXES, shard_state_over="batch", mesh={"data": 2, "model": 2}, logical_axis_rules=rules
    )
    mu = axes.state.param_states[0].mu
    assert mu["mlp"]["wi"] == P("embed", "mlp")
    assert mu["layer_norm"]["scale"] == P("batch")  # nothing else holds model: 16 % 4 == 0


def test_the_rules_default_to_flax_axis_rules_context():
    opt_def = optimizers.adam(1e-3)
    abstract = jax.eval_shape(opt_def.create, PARAMS)
    with nn.partitioning.axis_rules(RULES):
        axes = opt_def.derive_logical_axes(
            abstract, AXES, shard_state_over="batch", mesh={"data": 4, "model": 2}
        )
    assert axes.state.param_states[0].mu["mlp"]["wi"] == P("batch", "mlp")


def test_leaves_left_alone_are_logged_with_why(caplog):
    with caplog.at_level(logging.INFO, logger="treeopt.t5x._zero"):
        zero_axes(optimizers.adam(1e-3), {"data": 4, "model": 2})
    text = caplog.text
    assert "10 optimizer-state leaves sharded, 4 kept" in text
    assert "[0].mu['relpos_bias'] (6, 4): not divisible" in text
    assert "[0].nu['mlp']['bias'] (6,): every dimension already sharded" in text


def test_bad_arguments_are_refused_with_what_was_expected():
    opt_def = optimizers.adam(1e-3)
    abstract = jax.eval_shape(opt_def.create, PARAMS)
    sizes = {"data": 4, "model": 2}
    with pytest.raises(ValueError, match="needs the mesh"):
        opt_def.derive_logical_axes(abstract, AXES, shard_state_over="batch", logical_axis_rules=RULES)
    with pytest.raises(ValueError, match="needs the logical axis rules"):
        opt_def.derive_logical_axes(abstract, AXES, shard_state_over="batch", mesh=sizes)
    with pytest.raises(ValueError, match="map it to no mesh axis"):
        opt_def.derive_logical_axes(
            abstract, AXES, shard_state_over="embed", mesh=sizes, logical_axis_rules=RULES
        )
    with pytest.raises(ValueError, match=r"\['data'\] are not axes of the mesh"):
        opt_def.derive_logical_axes(
            abstract, AXES, shard_state_over="batch", mesh={"replica": 8}, logical_axis_rules=RULES
        )
    with pytest.raises(TypeError, match="one logical axis name"):
        opt_def.derive_logical_axes(
            abstract, AXES, shard_state_over=("batch",), mesh=sizes, logical_axis_rules=RULES
        )
    with pytest.raises(TypeError, match="only take effect with shard_state_over"):
        opt_def.derive_logical_axes(abstract, AXES, mesh=sizes)


# -- memory and numbers on 8 virtual devices ----------------------------------------------------


@pytest.mark.parametrize(
    "opt_def",
    [optimizers.adam(1e-3), adafactor.Adafactor(learning_rate=0.1, beta1=0.9, min_dim_size_to_factor=8)],
    ids=["adam", "legacy_adafactor"],
)
@pytest.mark.parametrize("data,model", [(8, 1), (4, 2)])
def test_each_device_holds_a_data_sized_share_of_the_state(opt_def, data, model):
    mesh = make_mesh(data, model)
    plain = sharded_run(opt_def, mesh, logical_axes(opt_def), steps=0)
    logical = zero_axes(opt_def, mesh)
    zero = sharded_run(opt_def, mesh, logical, steps=0)
    # Leaf by leaf: a sharded leaf keeps 1/data of its model-sharded bytes, the others all.
    expected = 0
    flat_logical = jax.tree.leaves(logical.state.param_states, is_leaf=is_spec)
    flat_plain_logical = jax.tree.leaves(logical_axes(opt_def).state.param_states, is_leaf=is_spec)
    for leaf, spec, before in zip(
        jax.tree.leaves(plain.state.param_states), flat_logical, flat_plain_logical, strict=True
    ):
        shard = leaf.addressable_shards[0].data.nbytes
        expected += shard // data if spec != before else shard
    assert device0_state_bytes(zero) == expected
    assert device0_state_bytes(zero) < device0_state_bytes(plain) / 2  # most bytes are in sharded leaves


@pytest.mark.parametrize(
    "name",
    ["adam", "adamw_masked", "legacy_adafactor", "multi"],
)
def test_twenty_steps_match_the_unsharded_run(name):
    # The trainer's learning rate (train_step passes one) counts, so that the override is sharded too.
    if name == "adam":
        opt_def = optimizers.adam(1e-2, honor_learning_rate=True)
    elif name == "adamw_masked":
        decay = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # noqa: E731
        opt_def = optimizers.wrap_optax_optimizer(optax.adamw)(
            1e-2, weight_decay=0.1, mask=decay, honor_learning_rate=True
        )
    elif name == "legacy_adafactor":
        opt_def = adafactor.Adafactor(learning_rate=0.1, beta1=0.9, min_dim_size_to_factor=8)
    else:
        embeddings = traverse_util.ModelParamTraversal(lambda path, _: "embedding" in path)
        rest = traverse_util.ModelParamTraversal(lambda path, _: "embedding" not in path)
        opt_def = optimizers.MultiOptimizer(
            [
                (embeddings, optimizers.sgd(0.1, momentum=0.9, honor_learning_rate=True)),
                (rest, optimizers.adam(1e-2, honor_learning_rate=True)),
            ]
        )
    mesh = make_mesh(4, 2)
    zero = sharded_run(opt_def, mesh, zero_axes(opt_def, mesh), steps=20)
    plain = opt_def.create(PARAMS)
    step = jax.jit(train_step)
    for i in range(20):
        plain = step(plain, i)
    for a, e in zip(jax.tree.leaves(zero.target), jax.tree.leaves(plain.target), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-6, atol=1e-7)
    sharded_over_data = [
        leaf
        for leaf in jax.tree.leaves(zero.state.param_states)
        if "data" in jax.tree.leaves(tuple(leaf.sharding.spec))
    ]
    assert sharded_over_data, "no state leaf is sharded over the data axis"


def test_derive_logical_axes_takes_t5xs_own_argument_names_with_the_zero_keywords():
    from treeopt.t5x.adafactor import Adafactor

    opt_def = Adafactor(0.1, min_dim_size_to_factor=2)
    opt = opt_def.create({"w": jnp.ones((16, 8))})
    rules = [("batch", "data"), ("embed", None), ("mlp", None)]
    zero = {"shard_state_over": "batch", "mesh": {"data": 4}, "logical_axis_rules": rules}
    by_name = opt_def.derive_logical_axes(optimizer_state=opt, param_logical_axes={"w": P("embed", "mlp")}, **zero)
    by_position = opt_def.derive_logical_axes(opt, {"w": P("embed", "mlp")}, **zero)
    assert by_name.state.param_states == by_position.state.param_states
    assert "batch" in tuple(by_name.state.param_states["w"].v_row)
    plain = opt_def.derive_logical_axes(optimizer_state=opt, param_logical_axes={"w": P("embed", "mlp")})
    assert "batch" not in tuple(plain.state.param_states["w"].v_row)
