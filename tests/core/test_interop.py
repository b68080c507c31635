"""Interop: one small model, its params held by every framework treeopt supports.

The same 2-layer MLP regression (4 -> 8 -> 1, tanh) is trained for ``STEPS``
steps of Adam through ``jax.jit`` with params coming from flax.linen (dict and
FrozenDict), flax.nnx (``nnx.split`` state, with and without BatchNorm), an
equinox module passed whole, a treeo ``Tree`` and a plain nested dict/list.
Each run must: lower the loss, return params of the input's type and
structure, leave non-trainable leaves untouched, and match the same steps of
raw ``optax.adam`` on the same pytree.

Tolerance: Adam is elementwise, so treeopt's flat named state and optax's
nested state compute the same float32 arithmetic; only XLA fusion may differ.
Params are compared with ``rtol=1e-5, atol=1e-6`` (``TOL``).
"""

from __future__ import annotations

import functools

import equinox as eqx
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import treeo as to
from flax import nnx

import treeopt

import _helpers
from _helpers import device_mesh

STEPS = 30
LR = 3e-2
TOL = {"rtol": 1e-5, "atol": 1e-6}

_kx, _kw = jax.random.split(jax.random.key(0))
X = jax.random.normal(_kx, (32, 4))
Y = jnp.sin(X @ jax.random.normal(_kw, (4, 1)))


def mse(pred: jax.Array) -> jax.Array:
    return jnp.mean((pred - Y) ** 2)


def mlp_arrays(seed: int = 1) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (4, 8)) * 0.5,
        "b1": jnp.zeros(8),
        "w2": jax.random.normal(k2, (8, 1)) * 0.5,
        "b2": jnp.zeros(1),
    }


def train_treeopt(loss_fn, params, steps: int = STEPS, **opt_kwargs):
    """``steps`` jitted Adam steps with treeopt; returns (params, opt, losses)."""
    opt = treeopt.Optimizer(optax.adam(LR), **opt_kwargs).init(params)

    @jax.jit
    def step(params, opt):
        loss, grads = jax.value_and_grad(loss_fn, allow_int=True)(params)
        params = opt.update(grads, params)
        return params, opt, loss

    return run_steps(step, params, opt, loss_fn, steps)


def run_steps(step, params, opt, loss_fn, steps: int = STEPS):
    """``steps`` calls of ``step(params, opt) -> (params, opt, loss)``; the losses end with the final one."""
    losses = []
    for _ in range(steps):
        params, opt, loss = step(params, opt)
        losses.append(float(loss))
    losses.append(float(loss_fn(params)))
    return params, opt, losses


def train_optax(loss_fn, params, steps: int = STEPS):
    """The same steps with raw ``optax.adam`` on the same pytree."""
    tx = optax.adam(LR)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        grads = jax.grad(loss_fn)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(steps):
        params, state = step(params, state)
    return params


assert_trees_close = functools.partial(_helpers.assert_trees_close, **TOL)


def assert_loss_went_down(losses: list[float]) -> None:
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], losses


# -- flax.linen -------------------------------------------------------------------


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.tanh(nn.Dense(8)(x)))


@pytest.mark.parametrize("frozen", [False, True], ids=["dict", "FrozenDict"])
def test_flax_linen_params(frozen):
    model = LinenMLP()
    variables = model.init(jax.random.key(1), X[:1])
    assert type(variables) is dict  # flax.linen init returns a plain dict nowadays
    if frozen:
        variables = flax.core.freeze(variables)

    def loss_fn(variables):
        return mse(model.apply(variables, X))

    new, opt, losses = train_treeopt(loss_fn, variables)

    assert_loss_went_down(losses)
    assert type(new) is type(variables)
    assert type(new["params"]) is type(variables["params"])
    assert jax.tree.structure(new) == jax.tree.structure(variables)
    assert opt.paths == (
        "params/Dense_0/bias",
        "params/Dense_0/kernel",
        "params/Dense_1/bias",
        "params/Dense_1/kernel",
    )
    assert int(opt.step) == STEPS
    assert_trees_close(new, train_optax(loss_fn, variables))


def test_flax_linen_batch_stats_pass_through_with_wrt():
    """The whole linen variables dict, with ``wrt`` selecting only the "params" collection."""

    class BNMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.BatchNorm(use_running_average=True)(nn.Dense(8)(x))
            return nn.Dense(1)(nn.tanh(h))

    model = BNMLP()
    variables = model.init(jax.random.key(1), X[:1])
    # Make the running statistics non-trivial so "untouched" means something.
    variables["batch_stats"] = jax.tree.map(lambda s: s + 0.25, variables["batch_stats"])

    def loss_fn(variables):
        return mse(model.apply(variables, X))

    new, opt, losses = train_treeopt(loss_fn, variables, wrt="params/*")

    assert_loss_went_down(losses)
    assert all(name.startswith("params/") for name in opt.paths)
    assert len(opt.paths) == 6  # 2 Dense x (kernel, bias) + BatchNorm (scale, bias)
    for a, e in zip(
        jax.tree.leaves(new["batch_stats"]), jax.tree.leaves(variables["batch_stats"]), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))

    expected_params = train_optax(
        lambda p: loss_fn({"params": p, "batch_stats": variables["batch_stats"]}), variables["params"]
    )
    assert_trees_close(new["params"], expected_params)


# -- flax.nnx ---------------------------------------------------------------------


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, batch_norm: bool = False):
        self.layers = nnx.List([nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 1, rngs=rngs)])
        self.norm = nnx.BatchNorm(8, rngs=rngs) if batch_norm else None
        self.calls = nnx.Variable(jnp.int32(5))  # a non-trainable int Variable
        self.tag = "mlp"  # a static, non-array attribute

    def __call__(self, x):
        h = self.layers[0](x)
        if self.norm is not None:
            h = self.norm(h)
        return self.layers[1](jnp.tanh(h))


# What NnxMLP(..., batch_norm=True) trains: its Params, not the BatchNorm statistics.
NNX_MLP_PARAM_NAMES = (
    "layers/0/bias",
    "layers/0/kernel",
    "layers/1/bias",
    "layers/1/kernel",
    "norm/bias",
    "norm/scale",
)


def test_flax_nnx_split_state():
    model = NnxMLP(nnx.Rngs(1))
    graphdef, state = nnx.split(model)

    def loss_fn(state):
        return mse(nnx.merge(graphdef, state)(X))

    new, opt, losses = train_treeopt(loss_fn, state)

    assert_loss_went_down(losses)
    # Names read like the module's attributes: no inner "value" key.
    assert opt.paths == ("layers/0/bias", "layers/0/kernel", "layers/1/bias", "layers/1/kernel")
    assert type(new) is type(state)
    assert jax.tree.structure(new) == jax.tree.structure(state)
    assert isinstance(new["layers"][0]["kernel"], nnx.Param)
    assert new["calls"][...].dtype == jnp.int32 and int(new["calls"][...]) == 5

    merged = nnx.merge(graphdef, new)
    assert isinstance(merged, NnxMLP) and merged.tag == "mlp"
    np.testing.assert_allclose(float(mse(merged(X))), losses[-1], rtol=1e-6)

    # Raw optax on the float params of the same state (the int Variable kept aside).
    _, params, rest = nnx.split(model, nnx.Param, ...)
    expected = train_optax(lambda p: mse(nnx.merge(graphdef, p, rest)(X)), params)
    _, new_params, _ = nnx.split(nnx.merge(graphdef, new), nnx.Param, ...)
    assert_trees_close(new_params, expected)


def test_flax_nnx_batchnorm_only_params_trained():
    """BatchNorm statistics flow through the forward pass; only nnx.Param is optimized."""
    model = NnxMLP(nnx.Rngs(1), batch_norm=True)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, rest):
        # copy=True: fresh Variables in this trace, so BatchNorm may update its statistics.
        model = nnx.merge(graphdef, params, rest, copy=True)
        loss = mse(model(X))  # train mode: updates the running statistics
        return loss, nnx.split(model, nnx.Param, ...)[2]

    opt = treeopt.Optimizer(optax.adam(LR)).init(params)
    assert opt.paths == NNX_MLP_PARAM_NAMES

    @jax.jit
    def step(params, rest, opt):
        (loss, rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest)
        return opt.update(grads, params), rest, opt, loss

    tx = optax.adam(LR)

    @jax.jit
    def raw_step(params, rest, state):
        grads, rest = jax.grad(loss_fn, has_aux=True)(params, rest)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), rest, state

    p, r, losses = params, rest, []
    raw_p, raw_r, raw_state = params, rest, tx.init(params)
    for _ in range(STEPS):
        p, r, opt, loss = step(p, r, opt)
        raw_p, raw_r, raw_state = raw_step(raw_p, raw_r, raw_state)
        losses.append(float(loss))
    losses.append(float(loss_fn(p, r)[0]))

    assert_loss_went_down(losses)
    assert type(p) is type(params)
    assert jax.tree.structure(p) == jax.tree.structure(params)
    assert_trees_close(p, raw_p)
    assert_trees_close(r, raw_r)
    # The running mean moved (forward pass), so the split really kept it out of the optimizer.
    assert not np.allclose(np.asarray(r["norm"]["mean"][...]), np.asarray(rest["norm"]["mean"][...]))


def test_flax_nnx_whole_state_with_wrt_leaves_batch_stats_untouched():
    """The whole nnx state given to the optimizer; ``wrt`` (a callable) trains no statistics."""
    model = NnxMLP(nnx.Rngs(1), batch_norm=True)
    graphdef, state = nnx.split(model)
    state["norm"]["mean"][...] = jnp.full((8,), 0.3)
    state["norm"]["var"][...] = jnp.full((8,), 2.0)

    def is_param(name, leaf):
        return not name.endswith(("/mean", "/var")) and name != "calls"

    def loss_fn(state):
        # Evaluation mode: the statistics are inputs of the loss, so they get (nonzero) gradients.
        model = nnx.merge(graphdef, state)
        model.eval()
        return mse(model(X))

    new, opt, losses = train_treeopt(loss_fn, state, wrt=is_param)

    assert_loss_went_down(losses)
    assert "norm/mean" not in opt.paths and "norm/var" not in opt.paths
    assert "norm/scale" in opt.paths and "layers/0/kernel" in opt.paths
    grads = jax.grad(loss_fn, allow_int=True)(state)
    assert float(jnp.abs(grads["norm"]["mean"][...]).max()) > 0  # would move if trained
    for key in ("mean", "var"):
        np.testing.assert_array_equal(np.asarray(new["norm"][key][...]), np.asarray(state["norm"][key][...]))
    assert type(new) is type(state)

    _, params, rest = nnx.split(nnx.merge(graphdef, state), nnx.Param, ...)

    def raw_loss(params):
        model = nnx.merge(graphdef, params, rest)
        model.eval()
        return mse(model(X))

    expected = train_optax(raw_loss, params)
    _, new_params, _ = nnx.split(nnx.merge(graphdef, new), nnx.Param, ...)
    assert_trees_close(new_params, expected)


def test_flax_nnx_module_passed_whole_through_jax_jit():
    """An nnx Module is a pytree: passed whole, only its nnx.Param are trained (not the int
    Variable, not the BatchNorm statistics), and update writes into it and returns it."""
    model = NnxMLP(nnx.Rngs(1), batch_norm=True)
    _, params, rest = nnx.split(model, nnx.Param, ...)
    mean_before = np.asarray(model.norm.mean[...])

    def loss_fn(model):
        model.eval()  # statistics fixed: the loss is a function of the Params only
        return mse(model(X))

    opt = treeopt.Optimizer(optax.adam(LR)).init(model)
    assert opt.paths == NNX_MLP_PARAM_NAMES

    @jax.jit
    def step(model, opt):
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        assert opt.update(grads, model) is model  # in place, on this trace's copy
        return model, opt, loss

    model, opt, losses = run_steps(step, model, opt, loss_fn)

    assert_loss_went_down(losses)
    assert isinstance(model, NnxMLP) and model.tag == "mlp" and int(model.calls[...]) == 5
    np.testing.assert_array_equal(np.asarray(model.norm.mean[...]), mean_before)

    graphdef = nnx.graphdef(model)

    def raw_loss(params):
        return loss_fn(nnx.merge(graphdef, params, rest))

    assert_trees_close(nnx.state(model, nnx.Param), train_optax(raw_loss, params))


# -- equinox ----------------------------------------------------------------------


def test_equinox_module_passed_whole():
    model = eqx.nn.MLP(4, 1, width_size=8, depth=1, activation=jnp.tanh, key=jax.random.key(1))
    # Non-array fields are present in the pytree (activation functions) and as static ints.
    assert any(callable(leaf) and not eqx.is_array(leaf) for leaf in jax.tree.leaves(model))

    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    opt = treeopt.Optimizer(optax.adam(LR)).init(model)
    assert opt.paths == ("layers/0/weight", "layers/0/bias", "layers/1/weight", "layers/1/bias")

    @eqx.filter_jit
    def step(model, opt, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        model = opt.update(grads, model)  # grads hold None for the activation fields
        return model, opt, loss

    tx = optax.adam(LR)

    @eqx.filter_jit
    def raw_step(model, state, x, y):
        grads = eqx.filter_grad(loss_fn)(model, x, y)
        updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    new, losses = model, []
    raw, raw_state = model, tx.init(eqx.filter(model, eqx.is_array))
    for _ in range(STEPS):
        new, opt, loss = step(new, opt, X, Y)
        raw, raw_state = raw_step(raw, raw_state, X, Y)
        losses.append(float(loss))
    losses.append(float(loss_fn(new, X, Y)))

    assert_loss_went_down(losses)
    assert type(new) is type(model)
    assert jax.tree.structure(new) == jax.tree.structure(model)
    assert new.activation is model.activation and new.final_activation is model.final_activation
    assert (new.in_size, new.out_size, new.width_size, new.depth) == (4, 1, 8, 1)
    assert int(opt.step) == STEPS
    new_arrays, raw_arrays = eqx.filter(new, eqx.is_array), eqx.filter(raw, eqx.is_array)
    assert_trees_close(new_arrays, raw_arrays)


def test_equinox_partitioned_params():
    """The other common eqx pattern: ``eqx.partition`` into (params, static), train params only."""
    model = eqx.nn.MLP(4, 1, width_size=8, depth=1, activation=jnp.tanh, key=jax.random.key(1))
    params, static = eqx.partition(model, eqx.is_array)

    def loss_fn(params):
        return jnp.mean((jax.vmap(eqx.combine(params, static))(X) - Y) ** 2)

    new, _, losses = train_treeopt(loss_fn, params)

    assert_loss_went_down(losses)
    assert type(new) is type(model)
    assert jax.tree.structure(new) == jax.tree.structure(params)
    assert_trees_close(new, train_optax(loss_fn, params))


def test_an_equinox_module_where_treeopt_evaluates_shapes_gets_the_fix_in_the_error():
    """init_sharded runs jax.eval_shape(opt.init, params): a module's functions fail there, and
    the error says what to use instead (jax.eval_shape's own failure, with a note)."""

    from treeopt._sharding.abstract import NON_ARRAY_HINT
    from treeopt.partitioning import init_sharded

    model = eqx.nn.MLP(4, 1, width_size=8, depth=1, key=jax.random.key(1))
    mesh = device_mesh((1,), ("data",))
    specs = jax.tree.map(lambda _: None, model)
    with pytest.raises(TypeError, match="as an abstract array") as info:
        init_sharded(treeopt.Optimizer(optax.adam(1e-2)), model, mesh, specs)
    assert NON_ARRAY_HINT in info.value.__notes__
    assert "eqx.filter_eval_shape" in NON_ARRAY_HINT


# -- treeo --------------------------------------------------------------------------


class TreeoMLP(to.Tree):
    w1: jax.Array = to.field(node=True)
    b1: jax.Array = to.field(node=True)
    w2: jax.Array = to.field(node=True)
    b2: jax.Array = to.field(node=True)
    activation: object = to.field(node=False)
    name: str = to.field(node=False)
    width: int = to.field(node=False)

    def __init__(self, seed: int = 1):
        arrays = mlp_arrays(seed)
        self.w1, self.b1, self.w2, self.b2 = arrays["w1"], arrays["b1"], arrays["w2"], arrays["b2"]
        self.activation = jnp.tanh
        self.name = "treeo-mlp"
        self.width = 8

    def __call__(self, x):
        return self.activation(x @ self.w1 + self.b1) @ self.w2 + self.b2


def treeo_loss(model: TreeoMLP) -> jax.Array:
    return mse(model(X))


def test_treeo_tree():
    model = TreeoMLP()
    new, opt, losses = train_treeopt(treeo_loss, model)

    assert_loss_went_down(losses)
    assert type(new) is TreeoMLP
    assert jax.tree.structure(new) == jax.tree.structure(model)
    assert new.activation is model.activation
    assert (new.name, new.width) == ("treeo-mlp", 8)
    assert len(opt.paths) == 4
    assert_trees_close(new, train_optax(treeo_loss, model))


def test_treeo_names_read_like_attributes():
    """A treeo field is named as the user writes it (``model.w1`` -> "w1").

    treeo registers ``Tree`` without keys and flattens its fields into one dict
    inside a 1-tuple, so JAX's key path is ``(FlattenedIndexKey(0), DictKey('w1'))``:
    the lone flattened index carries no information and must not appear in names.
    """
    opt = treeopt.Optimizer(optax.adam(LR)).init(TreeoMLP())
    assert opt.paths == ("b1", "b2", "w1", "w2")


# -- plain nested dict / list -------------------------------------------------------


def plain_params():
    arrays = mlp_arrays()
    return {
        "layers": [{"w": arrays["w1"], "b": arrays["b1"]}, {"w": arrays["w2"], "b": arrays["b2"]}],
        "seen": jnp.int32(7),  # a non-trainable int leaf
    }


def plain_forward(layers, x):
    h = jnp.tanh(x @ layers[0]["w"] + layers[0]["b"])
    return h @ layers[1]["w"] + layers[1]["b"]


def test_plain_nested_dict_and_list():
    params = plain_params()

    def loss_fn(params):
        return mse(plain_forward(params["layers"], X))

    new, opt, losses = train_treeopt(loss_fn, params)

    assert_loss_went_down(losses)
    assert type(new) is dict and type(new["layers"]) is list and type(new["layers"][0]) is dict
    assert jax.tree.structure(new) == jax.tree.structure(params)
    assert opt.paths == ("layers/0/b", "layers/0/w", "layers/1/b", "layers/1/w")
    assert new["seen"].dtype == jnp.int32 and int(new["seen"]) == 7

    expected = train_optax(lambda layers: mse(plain_forward(layers, X)), params["layers"])
    assert_trees_close(new["layers"], expected)


def test_plain_tree_eager_keeps_python_leaves():
    """Outside jit, str/int/None/function leaves come back as the very same objects."""
    arrays = mlp_arrays()
    params = {"w1": arrays["w1"], "name": "mlp", "n": 3, "none": None, "act": jnp.tanh, "lr": 0.5}
    opt = treeopt.Optimizer(optax.adam(LR)).init(params)
    assert opt.paths == ("w1",)  # a Python float is not an array leaf

    grads = {"w1": jnp.ones_like(arrays["w1"])}  # only the trainable entry, matched by name
    new = opt.update(grads, params)

    assert type(new) is dict and set(new) == set(params)
    for key in ("name", "n", "none", "act", "lr"):
        assert new[key] is params[key]
    tx = optax.adam(LR)
    updates, _ = tx.update(grads, tx.init(grads))
    np.testing.assert_allclose(np.asarray(new["w1"]), np.asarray(arrays["w1"] + updates["w1"]), **TOL)


# -- wrt ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "wrt",
    ["layers/1/*", lambda name, leaf: name.startswith("layers/1/")],
    ids=["glob", "callable"],
)
def test_wrt_freezes_unselected_float_leaves(wrt):
    params = plain_params()

    def loss_fn(params):
        return mse(plain_forward(params["layers"], X))

    new, opt, losses = train_treeopt(loss_fn, params, wrt=wrt)

    assert opt.paths == ("layers/1/b", "layers/1/w")
    assert losses[-1] < losses[0]
    for key in ("w", "b"):  # frozen float leaves: bit for bit the input
        np.testing.assert_array_equal(np.asarray(new["layers"][0][key]), np.asarray(params["layers"][0][key]))
    assert int(new["seen"]) == 7
    assert jax.tree.structure(new) == jax.tree.structure(params)

    frozen = params["layers"][0]
    expected = train_optax(lambda last: mse(plain_forward([frozen, last], X)), params["layers"][1])
    assert_trees_close(new["layers"][1], expected)
    # Adam state exists only for the trained leaves.
    assert set(opt.opt_state[0].mu) == {"layers/1/b", "layers/1/w"}
