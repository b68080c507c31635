"""Partition specs and shardings for the optimizer state of any optax transformation.

The specs of every transformation are checked leaf by leaf against the rule
each leaf should follow (written here from what each optax state holds,
independently of how treeopt derives them), then used for real: ``jax.jit``
with ``in_shardings`` / ``out_shardings`` on a 2x4 mesh of the 8 virtual CPU
devices, measuring every state leaf's per-device shard.

The mesh runs compile, so they run on ``ON_THE_MESH``: one transformation for
each distinct state structure (``state_structure``: where each state leaf sits
in the tree, how it relates to its parameter, its dtype kind, and the
``MaskedNode`` placeholders). Transformations of the same structure get the same
specs leaf for leaf and the same sharded init and step; what tells them apart is
only their arithmetic, which the parity tests check on one device.
``test_the_mesh_runs_cover_every_state_structure`` fails when a transformation
with a new structure joins the list and no transformation of that structure is
run on the mesh.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import TRANSFORMATIONS as PARITY_TRANSFORMATIONS
from _cases import grads_at
from flax.core import FrozenDict
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import DictKey, GetAttrKey, SequenceKey

import treeopt
from treeopt.partitioning import (
    init_sharded,
    logical_to_mesh_specs,
    named_shardings,
    optimizer_shardings,
    optimizer_specs,
    param_specs_of,
)

from _helpers import device_mesh, python_blocks

MIN_DIM = 2  # adafactor's min_dim_size_to_factor: small, so the test params get factored

# The core parity list, with adafactor factoring these small params, masks and labels
# written for them, and more transformations whose state has other shapes.
TRANSFORMATIONS = {
    **PARITY_TRANSFORMATIONS,
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=MIN_DIM),
    "adan": lambda: optax.adan(1e-2),
    "masked": lambda: optax.masked(optax.adam(1e-2), treeopt.mask("*kernel")),
    "masked_adafactor": lambda: optax.masked(
        optax.adafactor(1e-2, min_dim_size_to_factor=MIN_DIM), treeopt.mask("conv/*", "square")
    ),
    "multi_transform": lambda: optax.multi_transform(
        {"fast": optax.adam(1e-2), "slow": optax.sgd(1e-3, momentum=0.9)},
        treeopt.labels({"*kernel": "fast"}, default="slow"),
    ),
    "multi_transform_sm3": lambda: optax.multi_transform(
        {"sm3": optax.sm3(1e-2), "sgd": optax.sgd(1e-3)},
        treeopt.labels({"scale": "sgd"}, default="sm3"),
    ),
    "inject_schedule": lambda: optax.inject_hyperparams(
        optax.adafactor, static_args=("min_dim_size_to_factor",)
    )(learning_rate=optax.linear_schedule(1e-2, 1e-3, 10), min_dim_size_to_factor=MIN_DIM),
    "reduce_on_plateau": lambda: optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau()),
    "adopt": lambda: optax.contrib.adopt(1e-2),
    "muon": lambda: optax.contrib.muon(1e-2),
    "momo": lambda: optax.contrib.momo(1e-2),
    "dog": lambda: optax.contrib.dog(),
    "galore": lambda: optax.contrib.galore(1e-2, rank=2),
    "lbfgs": lambda: optax.lbfgs(memory_size=3),
}
# Transformations whose update needs more than (grads, state, params).
NEEDS_VALUE = {"reduce_on_plateau", "momo"}
# Specs checked, no sharded steps: lbfgs' update needs value_fn; optax.sm3 cannot
# update a rank-0 param (multi_transform_sm3 runs sm3 on the others).
SPECS_ONLY = {"lbfgs", "sm3"}
# Run on the mesh: one transformation of each state structure (the module's docstring).
# Those of the same structure as one here: adam for adabelief, adamax, adamaxw, adamw,
# adan, ademamix, adopt, amsgrad, lamb, lion, madgrad, nadam, nadamw, radam, signum and
# yogi; sgd_momentum for adadelta, adagrad, cocob, lars, rmsprop, rmsprop_momentum and
# rprop; sgd for fromage and sign_sgd; momo for dadapt_adamw and prodigy.
ON_THE_MESH = (
    "adafactor",
    "adam",
    "apply_if_finite",
    "clip_adamw",
    "dog",
    "galore",
    "inject_hyperparams",
    "inject_schedule",
    "masked",
    "masked_adafactor",
    "mechanize",
    "momo",
    "multi_steps",
    "multi_transform",
    "multi_transform_sm3",
    "muon",
    "noisy_sgd",
    "novograd",
    "optimistic_adam_v2",
    "optimistic_gradient_descent",
    "reduce_on_plateau",
    "schedule_free_adamw",
    "sgd",
    "sgd_momentum",
)

SHAPES = {
    "dense": {"kernel": (16, 8), "bias": (8,)},
    "conv": {"kernel": (3, 3, 8, 16)},
    "embed": {"embedding": (32, 8)},
    "square": (8, 8),
    "scale": (),
}
PARAM_SPECS: dict[str, Any] = {
    "dense": {"kernel": P("data", "model"), "bias": P("model")},
    "conv": {"kernel": P(None, None, "data", "model")},
    "embed": {"embedding": P("model")},  # shorter than the rank: the rest replicated
    "square": P("data", "model"),
    "scale": P(),
    "n": None,  # not trained
}


def make_params():
    keys = iter(jax.random.split(jax.random.key(0), 8))
    params = jax.tree.map(
        lambda shape: jax.random.normal(next(keys), shape), SHAPES, is_leaf=lambda x: isinstance(x, tuple)
    )
    params["n"] = jnp.int32(7)
    return params


def make_mesh():
    return device_mesh((2, 4), ("data", "model"))


# -- the expected rule, leaf by leaf ------------------------------------------------

FLAT_SPECS = {
    "dense/kernel": PARAM_SPECS["dense"]["kernel"],
    "dense/bias": PARAM_SPECS["dense"]["bias"],
    "conv/kernel": PARAM_SPECS["conv"]["kernel"],
    "embed/embedding": PARAM_SPECS["embed"]["embedding"],
    "square": PARAM_SPECS["square"],
    "scale": PARAM_SPECS["scale"],
}
FLAT_SHAPES = {
    "dense/kernel": (16, 8),
    "dense/bias": (8,),
    "conv/kernel": (3, 3, 8, 16),
    "embed/embedding": (32, 8),
    "square": (8, 8),
    "scale": (),
}


def strip(entries):
    entries = list(entries)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def padded(name):
    spec = FLAT_SPECS[name]
    return [*spec, *([None] * (len(FLAT_SHAPES[name]) - len(spec)))]


def adafactor_factored_dims(shape):
    """optax's choice: the two largest axes, (second largest, largest)."""
    if len(shape) < 2:
        return None
    order = np.argsort(shape)
    if shape[order[-2]] < MIN_DIM:
        return None
    return int(order[-2]), int(order[-1])


def expected_spec(path, shape):
    """The spec a state leaf must get, from what the leaf is."""
    owner = [k for k in path if isinstance(k, DictKey) and k.key in FLAT_SPECS]
    if not owner:
        return P()  # counts, hyperparameters, RNG keys, schedule states, ...
    name = owner[-1].key
    rest = path[path.index(owner[-1]) + 1 :]
    fields = [k.name for k in path if isinstance(k, GetAttrKey)]
    if tuple(shape) == FLAT_SHAPES[name]:
        return FLAT_SPECS[name]
    if rest and isinstance(rest[0], SequenceKey) and fields[-1] == "mu":
        # SM3: one accumulator per dimension, each keeps its own axis.
        return strip([padded(name)[rest[0].idx]])
    if fields[-1] in ("v_row", "v_col") and tuple(shape) != (1,):
        # Adafactor: v_row drops the largest axis, v_col the second largest.
        d1, d0 = adafactor_factored_dims(FLAT_SHAPES[name])
        dropped = d0 if fields[-1] == "v_row" else d1
        if name == "square":  # (8, 8): which axis was dropped cannot be told: replicated
            return P()
        return strip([e for i, e in enumerate(padded(name)) if i != dropped])
    if fields[-1] in ("diff_params_memory", "diff_updates_memory"):
        return strip([None, *padded(name)])  # L-BFGS: a stack of past differences
    if tuple(shape) in ((), (1,), (0, 0)):
        return P()  # per-param scalars (novograd), (1,) placeholders, galore's empty projectors
    if "projector" in fields or "base_optimizer_state" in fields:
        return P()  # galore: projectors and low-rank moments match no axis of the param as a whole
    raise AssertionError(f"no expectation for {jax.tree_util.keystr(path)} of shape {shape}")


def check_specs(opt, specs):
    assert isinstance(specs, treeopt.Optimizer)
    assert jax.tree.structure(specs) == jax.tree.structure(opt), "spec tree shaped like the optimizer"
    assert specs.step == P()
    state_leaves = jax.tree_util.tree_flatten_with_path(opt.opt_state)[0]
    spec_leaves = jax.tree.leaves(specs.opt_state)
    assert len(state_leaves) == len(spec_leaves)
    for (path, leaf), spec in zip(state_leaves, spec_leaves, strict=True):
        assert isinstance(spec, P)
        want = expected_spec(tuple(path), leaf.shape)
        assert spec == want, f"{jax.tree_util.keystr(path)} {leaf.shape}: got {spec}, expected {want}"


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
def test_specs_follow_the_rule_leaf_by_leaf(name):
    # Abstract (shapes only): what one would use before allocating anything.
    opt = jax.eval_shape(treeopt.Optimizer(TRANSFORMATIONS[name]()).init, make_params())
    check_specs(opt, opt.partition_specs(PARAM_SPECS))


def test_every_parity_transformation_gets_specs():
    # The parametrized tests here run over TRANSFORMATIONS: every optimizer the parity
    # tests check against raw optax (every optax alias, see test_parity) is among them.
    assert set(PARITY_TRANSFORMATIONS) <= set(TRANSFORMATIONS)


def test_factored_leaves_drop_the_reduced_axis():
    tx = optax.adafactor(1e-2, min_dim_size_to_factor=MIN_DIM)
    opt = treeopt.Optimizer(tx).init(make_params())
    state = opt.partition_specs(PARAM_SPECS).opt_state[0]
    # dense/kernel (16, 8) P("data", "model"): v_row (8,) keeps "model", v_col (16,) keeps "data".
    assert state.v_row["dense/kernel"] == P("model")
    assert state.v_col["dense/kernel"] == P("data")
    # conv/kernel (3, 3, 8, 16): v_row (3, 3, 8), v_col (3, 3, 16).
    assert opt.opt_state[0].v_row["conv/kernel"].shape == (3, 3, 8)
    assert state.v_row["conv/kernel"] == P(None, None, "data")
    assert state.v_col["conv/kernel"] == P(None, None, "model")
    assert state.v["conv/kernel"] == P()  # the (1,) placeholder
    assert state.v["dense/bias"] == P("model")  # not factored: shaped like the param


def test_sm3_accumulators_keep_their_own_axis():
    opt = treeopt.Optimizer(optax.sm3(1e-2)).init(make_params())
    mu = opt.partition_specs(PARAM_SPECS).opt_state[0].mu
    assert mu["conv/kernel"] == [P(), P(), P("data"), P("model")]
    assert mu["square"] == [P("data"), P("model")]  # square: resolved by position in the list
    assert mu["dense/kernel"] == [P("data"), P("model")]


def test_masked_nodes_are_kept():
    for name in ("masked", "masked_adafactor", "multi_transform", "multi_transform_sm3"):
        opt = treeopt.Optimizer(TRANSFORMATIONS[name]()).init(make_params())
        specs = opt.partition_specs(PARAM_SPECS)
        is_masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
        masked_state = [x for x in jax.tree.leaves(opt.opt_state, is_leaf=is_masked) if is_masked(x)]
        masked_specs = [x for x in jax.tree.leaves(specs.opt_state, is_leaf=is_masked) if is_masked(x)]
        assert masked_state and len(masked_specs) == len(masked_state), name


def test_abstract_optimizer_gives_the_same_specs():
    opt = treeopt.Optimizer(TRANSFORMATIONS["inject_schedule"]())
    concrete = opt.init(make_params()).partition_specs(PARAM_SPECS)
    abstract = jax.eval_shape(opt.init, make_params()).partition_specs(PARAM_SPECS)
    assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
    assert jax.tree.leaves(abstract) == jax.tree.leaves(concrete)


def test_any_params_container_and_flat_names():
    params = make_params()
    opt = treeopt.Optimizer(optax.adam(1e-2)).init(FrozenDict(params))
    nested = opt.partition_specs(FrozenDict(PARAM_SPECS))
    plain = opt.partition_specs(PARAM_SPECS)  # same names, other container
    flat = opt.partition_specs(FLAT_SPECS)  # the flat {name: spec} dict
    assert jax.tree.leaves(nested) == jax.tree.leaves(plain) == jax.tree.leaves(flat)
    assert nested.opt_state[0].mu["dense/kernel"] == P("data", "model")


def test_nnx_state_specs():
    from flax import nnx

    mesh = make_mesh()
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("data", "model"))
    with jax.set_mesh(mesh):  # nnx shards variables on creation
        model = nnx.Linear(16, 8, kernel_init=init, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    opt = treeopt.Optimizer(optax.adafactor(1e-2, min_dim_size_to_factor=MIN_DIM)).init(state)
    specs = opt.partition_specs(nnx.get_partition_spec(state))
    assert opt.paths == ("bias", "kernel")
    assert specs.opt_state[0].v_row["kernel"] == P("model")
    assert specs.opt_state[0].v_col["kernel"] == P("data")
    assert specs.opt_state[0].v["bias"] == P()


def test_lookahead():
    params = {"w": jnp.ones((8, 4)), "b": jnp.zeros(4)}
    lp = optax.LookaheadParams.init_synced(params)
    opt = treeopt.Optimizer(optax.lookahead(optax.adam(1e-2), 2, 0.5)).init(lp)
    specs = {"w": P("data", "model"), "b": P("model")}
    for given in (specs, optax.LookaheadParams(specs, specs)):
        state = opt.partition_specs(given).opt_state
        assert state.fast_state[0].mu["w"] == P("data", "model")
        assert state.steps_since_sync == P()


def test_wrt_ignores_specs_of_untrained_params():
    params = make_params()
    opt = treeopt.Optimizer(optax.adam(1e-2), wrt="dense/*").init(params)
    specs = opt.partition_specs({"dense": PARAM_SPECS["dense"]})  # only the trained ones
    assert set(specs.opt_state[0].mu) == {"dense/bias", "dense/kernel"}
    assert jax.tree.leaves(opt.partition_specs(PARAM_SPECS)) == jax.tree.leaves(specs)


# -- on 8 devices --------------------------------------------------------------------


def shard_shape(shape, spec, mesh):
    """The per-device shard: each axis divided by the mesh axes its spec entry names."""
    out = list(shape)
    for axis, entry in enumerate(spec):
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        out[axis] //= math.prod(mesh.shape[n] for n in names)
    return tuple(out)


def assert_sharded_like(tree, specs, mesh):
    """Every leaf is laid out by its spec; each device holds exactly 1/N along split axes."""
    split = 0
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    for (path, leaf), spec in zip(leaves, jax.tree.leaves(specs), strict=True):
        where = jax.tree_util.keystr(path)
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), where
        want = shard_shape(leaf.shape, spec, mesh)
        shards = leaf.addressable_shards
        assert len(shards) == 8
        assert all(s.data.shape == want for s in shards), (where, [s.data.shape for s in shards], want)
        n_split = math.prod(leaf.shape) // max(math.prod(want), 1) if math.prod(leaf.shape) else 1
        assert len({str(s.index) for s in shards}) == n_split, where
        split += want != tuple(leaf.shape)
    return split


def sharded_step(tx_name, mesh, opt_sh, param_sh):
    extra = {"value": jnp.float32(1.0)} if tx_name in NEEDS_VALUE else {}

    def step(params, opt, i):
        params = opt.update(grads_at(params, i), params, **extra)
        return params, opt

    return jax.jit(step, in_shardings=(param_sh, opt_sh, None), out_shardings=(param_sh, opt_sh))


def state_structure(name):
    """What a mesh run of ``name`` depends on besides arithmetic, as a set: for each state leaf,
    its place in the tree (the kinds of its path's keys, its parameter's name as ``N``), its
    shape beside its parameter's (or its rank, when no parameter owns it) and its dtype kind;
    and where ``MaskedNode`` placeholders sit."""
    opt = jax.eval_shape(treeopt.Optimizer(TRANSFORMATIONS[name]()).init, make_params())
    is_masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    found = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt.opt_state, is_leaf=is_masked)[0]:
        owner = [i for i, k in enumerate(path) if isinstance(k, DictKey) and k.key in FLAT_SHAPES]
        where = "".join("N" if i in owner else type(k).__name__[0] for i, k in enumerate(path))
        if is_masked(leaf):
            found.add((where, "masked"))
            continue
        dtype = "key" if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf.dtype.kind
        if owner:
            shape = FLAT_SHAPES[path[owner[-1]].key]
            relation = "its param's shape" if leaf.shape == shape else f"rank {leaf.ndim} of {len(shape)}"
        else:
            relation = f"no param's, rank {leaf.ndim}"
        found.add((where, relation, dtype))
    return frozenset(found)


def test_the_mesh_runs_cover_every_state_structure():
    assert set(ON_THE_MESH) <= set(TRANSFORMATIONS) - SPECS_ONLY
    on_the_mesh = {state_structure(name) for name in ON_THE_MESH}
    compiled_elsewhere = sorted(set(TRANSFORMATIONS) - SPECS_ONLY - set(ON_THE_MESH))
    missing = [name for name in compiled_elsewhere if state_structure(name) not in on_the_mesh]
    assert not missing, f"no transformation of the state structure of {missing} is in ON_THE_MESH: add one"
    assert len(on_the_mesh) == len(ON_THE_MESH), "two of ON_THE_MESH have the same structure: one is enough"


@pytest.mark.parametrize("name", ON_THE_MESH)
def test_jit_on_a_2x4_mesh_keeps_the_state_sharded(name):
    mesh = make_mesh()
    param_sh = named_shardings(PARAM_SPECS, mesh)
    params = jax.device_put(make_params(), param_sh)
    opt = init_sharded(treeopt.Optimizer(TRANSFORMATIONS[name]()), params, mesh, PARAM_SPECS)
    specs = opt.partition_specs(PARAM_SPECS)
    opt_sh = optimizer_shardings(opt, PARAM_SPECS, mesh)
    splits = any(spec != P() for spec in jax.tree.leaves(specs.opt_state))
    assert assert_sharded_like(opt, specs, mesh) > 0 or not splits  # born sharded
    step = sharded_step(name, mesh, opt_sh, param_sh)

    # The same steps on one device, to check sharding does not change the math.
    ref_params = make_params()
    ref_opt = treeopt.Optimizer(TRANSFORMATIONS[name]()).init(ref_params)
    extra = {"value": jnp.float32(1.0)} if name in NEEDS_VALUE else {}

    @jax.jit
    def ref_step(params, opt, i):
        return opt.update(grads_at(params, i), params, **extra), opt

    for i in range(2):
        params, opt = step(params, opt, jnp.float32(i))
        ref_params, ref_opt = ref_step(ref_params, ref_opt, jnp.float32(i))
        assert assert_sharded_like(opt, specs, mesh) > 0 or not splits, f"step {i}: not sharded"
        assert_sharded_like(params, {**PARAM_SPECS, "n": P()}, mesh)
    assert int(opt.step) == 2
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=1e-6)


def test_shards_are_a_fraction_of_the_full_array():
    mesh = make_mesh()
    params = jax.device_put(make_params(), named_shardings(PARAM_SPECS, mesh))
    opt = init_sharded(
        treeopt.Optimizer(optax.adafactor(1e-2, min_dim_size_to_factor=MIN_DIM)), params, mesh, PARAM_SPECS
    )
    state = opt.opt_state[0]
    # conv/kernel v_row (3, 3, 8) split over "data" (2): each device holds (3, 3, 4).
    assert {s.data.shape for s in state.v_row["conv/kernel"].addressable_shards} == {(3, 3, 4)}
    # conv/kernel v_col (3, 3, 16) split over "model" (4): each device holds (3, 3, 4).
    assert {s.data.shape for s in state.v_col["conv/kernel"].addressable_shards} == {(3, 3, 4)}
    # dense/kernel v_row (8,) over "model": 2 elements per device; v_col (16,) over "data": 8.
    assert {s.data.shape for s in state.v_row["dense/kernel"].addressable_shards} == {(2,)}
    assert {s.data.shape for s in state.v_col["dense/kernel"].addressable_shards} == {(8,)}
    # square (8, 8): ambiguous, replicated.
    assert {s.data.shape for s in state.v_row["square"].addressable_shards} == {(8,)}


def test_one_axis_split_over_two_mesh_axes():
    mesh = make_mesh()
    specs = {"w": P(("data", "model"), None), "v": P(None, ("model", "data"))}
    params = {"w": jnp.ones((16, 6)), "v": jnp.ones((6, 16))}
    tx = optax.chain(optax.sgd(0.1, momentum=0.9), optax.adafactor(1e-2, min_dim_size_to_factor=MIN_DIM))
    opt = init_sharded(
        treeopt.Optimizer(tx), jax.device_put(params, named_shardings(specs, mesh)), mesh, specs
    )
    trace = opt.opt_state[0][0].trace["w"]
    assert trace.sharding.spec == P(("data", "model"), None)
    assert {s.data.shape for s in trace.addressable_shards} == {(2, 6)}  # 16 / (2 * 4)
    factored = opt.opt_state[1][0]
    assert factored.v_col["w"].sharding.spec == P(("data", "model"))  # (16,)
    assert factored.v_row["w"].sharding.spec == P()  # (6,)
    assert factored.v_col["v"].sharding.spec == P(("model", "data"))  # (16,)
    assert {s.data.shape for s in factored.v_col["v"].addressable_shards} == {(2,)}


# -- the worked example (docs/sharding.md): an MLP on a 2x4 (data x model) mesh ------


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        kernel = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        x = nn.relu(nn.Dense(32, kernel_init=kernel, name="hidden")(x))
        kernel = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed"))
        return nn.Dense(8, kernel_init=kernel, name="out")(x)


RULES = [("batch", "data"), ("embed", None), ("mlp", "model")]


def test_flax_linen_logical_axes():
    mesh = make_mesh()
    model = MLP()
    boxed = model.init(jax.random.key(0), jnp.ones((4, 8)))["params"]
    logical = nn.get_partition_spec(boxed)
    assert logical["hidden"]["kernel"] == P("embed", "mlp")
    mesh_specs = logical_to_mesh_specs(logical, RULES)
    assert mesh_specs["hidden"]["kernel"] == P(None, "model")
    assert mesh_specs["out"]["kernel"] == P("model", None)
    assert param_specs_of(boxed)["hidden"]["kernel"] == P("embed", "mlp")

    tx = optax.adafactor(1e-2, min_dim_size_to_factor=MIN_DIM)
    # Boxed params go straight in: specs read from the boxes, translated by the rules.
    opt = init_sharded(treeopt.Optimizer(tx), boxed, mesh, rules=RULES)
    state = opt.opt_state[0]
    # hidden/kernel (8, 32) -> P(None, "model"): v_col (32,) keeps "model", v_row (8,) replicated.
    assert state.v_col["hidden/kernel"].sharding.spec == P("model")
    assert {s.data.shape for s in state.v_col["hidden/kernel"].addressable_shards} == {(8,)}
    assert state.v_row["hidden/kernel"].sharding.spec == P()
    # The same from logical specs, and from already translated ones.
    for specs, rules in ((logical, RULES), (boxed, RULES), (mesh_specs, None)):
        shardings = optimizer_shardings(opt, specs, mesh, rules=rules)
        assert shardings.opt_state[0].v_col["hidden/kernel"].spec == P("model")
    derived = optimizer_specs(opt, logical, rules=RULES)
    assert jax.tree.leaves(derived) == jax.tree.leaves(opt.partition_specs(mesh_specs))


def train_mlp(mesh, steps=3):
    """The docs' worked example: returns (params, opt) after ``steps`` sharded steps."""
    model = MLP()
    x = jax.random.normal(jax.random.key(1), (16, 8))
    y = jax.random.normal(jax.random.key(2), (16, 8))
    logical = nn.get_partition_spec(jax.eval_shape(model.init, jax.random.key(0), x[:1]))["params"]
    param_specs = logical_to_mesh_specs(logical, RULES)
    param_sh = named_shardings(param_specs, mesh)
    init_params = jax.jit(lambda k: nn.unbox(model.init(k, x[:1])["params"]), out_shardings=param_sh)
    params = init_params(jax.random.key(0))

    opt = init_sharded(treeopt.Optimizer(optax.adamw(1e-2)), params, mesh, param_specs)
    opt_sh = optimizer_shardings(opt, param_specs, mesh)
    batch_sh = NamedSharding(mesh, P("data"))

    def loss_fn(params, x, y):
        return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

    def train_step(params, opt, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        return opt.update(grads, params), opt

    train_step = jax.jit(
        train_step,
        in_shardings=(param_sh, opt_sh, batch_sh, batch_sh),
        out_shardings=(param_sh, opt_sh),
        donate_argnums=(0, 1),
    )
    x, y = jax.device_put(x, batch_sh), jax.device_put(y, batch_sh)
    for _ in range(steps):
        params, opt = train_step(params, opt, x, y)
    return params, opt, param_specs


def test_worked_example_mlp_on_2x4_mesh():
    mesh = make_mesh()
    params, opt, param_specs = train_mlp(mesh)
    assert int(opt.step) == 3
    mu = opt.opt_state[0].mu["hidden/kernel"]  # (8, 32) split over "model" (4)
    assert mu.sharding.spec == P(None, "model")
    assert {s.data.shape for s in mu.addressable_shards} == {(8, 8)}
    assert assert_sharded_like(opt, opt.partition_specs(param_specs), mesh) > 0
    assert params["hidden"]["kernel"].sharding.spec == P(None, "model")


@pytest.mark.slow  # with the other pages' code, in the slow tier (-m slow)
def test_docs_page_code_runs_pasted_top_to_bottom():
    """docs/sharding.md: its ```python blocks (not the ```py fragments), run in order as one
    program in a fresh Python, as a reader pastes them: its own set-up provides the 8 devices."""
    root = Path(__file__).resolve().parents[2]
    blocks = [code for _, code in python_blocks((root / "docs" / "sharding.md").read_text())]
    assert len(blocks) >= 3
    program = "\n".join([*blocks, "assert int(opt.step) == 3 and int(zero_opt.step) == 3  # both sections ran"])
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # no devices from this test run
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


# -- bad input ---------------------------------------------------------------------


@pytest.fixture
def adam_opt():
    return treeopt.Optimizer(optax.adam(1e-2)).init(make_params())


def test_error_missing_and_unexpected_names(adam_opt):
    specs = {**PARAM_SPECS, "dense": {"kernel": P("data", "model"), "bais": P("model")}}
    with pytest.raises(treeopt.errors.TreeMismatchError, match="param_specs do not match") as err:
        adam_opt.partition_specs(specs)
    assert err.value.report.missing == ("dense/bias",)
    assert err.value.report.unexpected == ("dense/bais",)


def test_error_spec_tree_deeper_than_params(adam_opt):
    specs = {**PARAM_SPECS, "square": {"w": P("data")}}
    with pytest.raises(treeopt.errors.TreeMismatchError) as err:
        adam_opt.partition_specs(specs)
    assert (err.value.report.missing, err.value.report.unexpected) == (("square",), ("square/w",))


def test_error_spec_longer_than_rank(adam_opt):
    specs = {**PARAM_SPECS, "dense": {"kernel": P("data", "model"), "bias": P(None, "model")}}
    with pytest.raises(ValueError, match=r"'dense/bias'.*2 entries.*1 axes"):
        adam_opt.partition_specs(specs)


def test_error_axis_not_in_mesh(adam_opt):
    mesh = make_mesh()
    specs = {**PARAM_SPECS, "embed": {"embedding": P("modle")}}
    with pytest.raises(ValueError, match=r"'embed/embedding'.*\['modle'\].*\('data', 'model'\)"):
        optimizer_shardings(adam_opt, specs, mesh)
    with pytest.raises(ValueError, match=r"embed.*embedding.*\['modle'\]"):
        named_shardings(specs, mesh)
    with pytest.raises(ValueError, match=r"'embed/embedding'.*rules="):
        init_sharded(treeopt.Optimizer(optax.adam(1e-2)), make_params(), mesh, specs)


def test_error_not_a_spec(adam_opt):
    with pytest.raises(TypeError, match=r"'square': str"):
        adam_opt.partition_specs({**PARAM_SPECS, "square": "data"})
    with pytest.raises(TypeError, match="tree of PartitionSpecs"):
        adam_opt.partition_specs(P("data"))


def test_error_uninitialized():
    with pytest.raises(RuntimeError, match="not initialized"):
        treeopt.Optimizer(optax.adam(1e-2)).partition_specs(PARAM_SPECS)


def test_partition_specs_checks_the_specs_axes_against_the_mesh_naming_the_parameter():
    params = {"dense": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)}}
    opt = treeopt.Optimizer(optax.adam(1e-3)).init(params)
    specs = {"dense": {"kernel": P(None, "tensor"), "bias": P()}}
    assert opt.partition_specs(specs).opt_state[0].mu["dense/kernel"] == P(None, "tensor")  # no mesh: not checked
    with pytest.raises(ValueError, match=r"PartitionSpec of parameter 'dense/kernel'.*\['tensor'\].*'data', 'model'"):
        opt.partition_specs(specs, mesh=make_mesh())


def test_none_for_param_specs_is_named_with_where_to_read_them():
    mesh = make_mesh()
    opt = jax.eval_shape(treeopt.Optimizer(optax.adam(1e-3)).init, {"w": jnp.ones((8, 8))})
    for call in (
        lambda: optimizer_shardings(opt, None, mesh, shard_state_over="data"),
        lambda: treeopt.partitioning.zero_report(opt, None, mesh),
        lambda: opt.partition_specs(None),
    ):
        with pytest.raises(TypeError, match=r"param_specs is None: expected a tree of PartitionSpecs.*param_specs_of"):
            call()
