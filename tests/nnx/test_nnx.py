"""flax.nnx habits: Param-only by default, nnx filters as ``wrt=``, the gradients-first order, and
training loops that give ``nnx.Optimizer``'s losses bit for bit, across a checkpoint and resume.

The model has Dropout and BatchNorm, so its non-Param state (RNG counts, batch
statistics) changes every step and must be carried and checkpointed for the
losses to match. Loops are compared with ``==`` on the float32 losses: both
sides compile the same elementwise optimizer arithmetic inside one jitted step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import treeopt
import treeopt.serialization
from treeopt.errors import TreeMismatchError

from _helpers import assert_trees_equal

STEPS = 100
RESUME_AT = 50
TX = optax.adamw(1e-2, weight_decay=1e-3)

PARAM_PATHS = ("bn/bias", "bn/scale", "l1/bias", "l1/kernel", "l2/bias", "l2/kernel")

_kx, _ky = jax.random.split(jax.random.key(0))
X = jax.random.normal(_kx, (32, 4))
Y = jnp.sin(X @ jax.random.normal(_ky, (4, 1)))


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(4, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def new_net(seed: int = 0) -> Net:
    return Net(nnx.Rngs(seed, dropout=seed + 1))


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def not_params(model) -> list[np.ndarray]:
    """The non-Param state (batch statistics, RNG counts and keys) as plain arrays."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Not(nnx.Param)))
    return [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x) for x in leaves]


def assert_same_state(a, b) -> None:
    for x, y in zip(not_params(a), not_params(b), strict=True):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(jax.tree.leaves(nnx.state(a, nnx.Param)), jax.tree.leaves(nnx.state(b, nnx.Param)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# -- which Variables are trained ------------------------------------------------------


def test_module_and_state_train_nnx_params_only_by_default():
    model = new_net()
    _, state = nnx.split(model)
    for params in (model, state, nnx.state(model)):
        assert treeopt.Optimizer(TX).init(params).paths == PARAM_PATHS, type(params)


def test_plain_float_variables_are_not_trained_by_default():
    class WithCounter(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))
            self.ema = nnx.Variable(jnp.zeros(2))  # float, but not a Param

    assert treeopt.Optimizer(TX).init(WithCounter()).paths == ("w",)


def test_default_for_other_trees_is_every_float_leaf():
    params = {"a": jnp.ones(2), "b": {"c": jnp.zeros(3)}, "n": jnp.int32(1)}
    assert treeopt.Optimizer(TX).init(params).paths == ("a", "b/c")


@pytest.mark.parametrize(
    ("wrt", "expected"),
    [
        (nnx.Param, PARAM_PATHS),
        ((nnx.Param, nnx.BatchStat), ("bn/bias", "bn/mean", "bn/scale", "bn/var", *PARAM_PATHS[2:])),
        (nnx.BatchStat, ("bn/mean", "bn/var")),
        (nnx.PathContains("l1"), ("l1/bias", "l1/kernel")),
        (nnx.All(nnx.Param, nnx.PathContains("bn")), ("bn/bias", "bn/scale")),
        (nnx.Not(nnx.Param), ("bn/mean", "bn/var")),  # RNG counts and keys are not floats
        (..., ("bn/bias", "bn/mean", "bn/scale", "bn/var", *PARAM_PATHS[2:])),
        (nnx.Any(lambda path, variable: path[-1] == "kernel"), ("l1/kernel", "l2/kernel")),
        (["l2/*", nnx.BatchStat], ("bn/mean", "bn/var", "l2/bias", "l2/kernel")),
    ],
    ids=["Param", "tuple", "BatchStat", "PathContains", "All", "Not", "Ellipsis", "Any(fn)", "glob+type"],
)
def test_wrt_accepts_nnx_filters(wrt, expected):
    model = new_net()
    assert treeopt.Optimizer(TX, wrt=wrt).init(model).paths == expected
    assert treeopt.Optimizer(TX, wrt=wrt).init(nnx.split(model)[1]).paths == expected


def test_a_plain_callable_is_a_name_and_leaf_predicate():
    seen = {}

    def kernels(name, leaf):
        seen[name] = leaf
        return name.endswith("kernel")

    assert treeopt.Optimizer(TX, wrt=kernels).init(new_net()).paths == ("l1/kernel", "l2/kernel")
    assert all(isinstance(leaf, jax.Array) for leaf in seen.values())  # the raw array, not the Variable
    assert "bn/mean" in seen


def test_an_optimizer_with_an_nnx_filter_passes_jit_without_retracing():
    model = new_net()
    _, params, _ = nnx.split(model, nnx.Param, ...)
    traces = 0

    @jax.jit
    def step(params, opt):
        nonlocal traces
        traces += 1
        return opt.update(jax.tree.map(jnp.ones_like, params), params), opt

    opt = treeopt.Optimizer(TX, wrt=(nnx.Param, nnx.PathContains("l1"))).init(params)
    for _ in range(3):
        params, opt = step(params, opt)
    assert traces == 1 and int(opt.step) == 3


# -- the order of update's arguments ----------------------------------------------------


def test_nnx_order_with_a_module_is_an_error_showing_the_right_order():
    model = new_net()
    opt = treeopt.Optimizer(TX).init(model)
    grads = nnx.grad(loss_fn)(model, X, Y)
    with pytest.raises(TypeError, match=r"opt\.update\(grads, model\)") as info:
        opt.update(model, grads)
    assert "nnx.Optimizer's order" in str(info.value)
    assert int(opt.step) == 0  # refused before touching the state


def test_nnx_order_with_param_state_is_an_error_not_a_silent_wrong_step():
    model = new_net()
    _, params, _ = nnx.split(model, nnx.Param, ...)
    opt = treeopt.Optimizer(TX).init(params)
    grads = nnx.grad(loss_fn)(model, X, Y)  # a State of the same structure as params
    with pytest.raises(TypeError, match=r"opt\.update\(grads, params\)"):
        opt.update(model, grads)
    assert int(opt.step) == 0


def test_nnx_order_with_the_whole_state_is_an_error_showing_the_right_order():
    model = new_net()
    opt = treeopt.Optimizer(TX).init(nnx.state(model))  # every Variable; Params trained
    grads = nnx.grad(loss_fn)(model, X, Y)  # the Params only
    with pytest.raises(TypeError, match=r"an nnx State holding model state \(batch statistics, RNG state\) where"):
        opt.update(nnx.state(model), grads)
    assert int(opt.step) == 0


def test_nnx_order_is_refused_inside_nnx_jit_too():
    model = new_net()
    opt = treeopt.Optimizer(TX).init(model)

    @nnx.jit
    def wrong(model, opt):
        grads = nnx.grad(loss_fn)(model, X, Y)
        opt.update(model, grads)
        return opt

    with pytest.raises(TypeError, match="Swap the two arguments"):
        wrong(model, opt)


def test_nnx_order_with_model_state_where_the_gradients_go_is_an_error():
    """init on the Params; update(nnx.state(model), grads): batch statistics and RNG state where the
    gradients go, and none where the params go."""
    model = new_net()
    _, params, _ = nnx.split(model, nnx.Param, ...)
    opt = treeopt.Optimizer(TX).init(params)
    grads = nnx.grad(loss_fn)(model, X, Y)
    with pytest.raises(TypeError, match=r"an nnx State holding model state .* where the gradients go"):
        opt.update(nnx.state(model), grads)
    assert int(opt.step) == 0


def test_gradients_of_batch_statistics_that_do_not_match_are_a_mismatch_not_a_swap():
    """wrt=(Param, BatchStat): gradients may hold BatchStats; a wrong one is reported as what it is."""
    model = new_net()
    opt = treeopt.Optimizer(TX, wrt=(nnx.Param, nnx.BatchStat)).init(model)
    grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, (nnx.Param, nnx.BatchStat)))(model, X, Y)
    del grads["bn"]["mean"]
    with pytest.raises(TreeMismatchError, match="missing \\(1\\):\n  bn/mean"):
        opt.update(grads, model)


def test_the_limit_same_structure_and_types_cannot_be_told_apart():
    """Two States of Params: a swapped call runs and takes the params for gradients (documented)."""
    model = new_net()
    _, params, _ = nnx.split(model, nnx.Param, ...)
    grads = nnx.grad(loss_fn)(model, X, Y)
    swapped = treeopt.Optimizer(optax.sgd(0.1)).init(params).update(params, grads)
    as_if = treeopt.Optimizer(optax.sgd(0.1)).init(params).update(grads=params, params=grads)
    assert_trees_equal(swapped, as_if)


def test_module_shaped_gradients_are_gradients():
    """``jax.grad`` of a Module gives a Module of gradients: with the model as params, that is no swap."""
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    opt = treeopt.Optimizer(optax.sgd(0.1)).init(model)
    grads = jax.grad(lambda m: jnp.sum(m(X[:, :3]) ** 2))(model)
    assert isinstance(grads, nnx.Linear)
    updates = opt.update(grads, apply_updates=False)
    assert isinstance(updates, nnx.Linear)
    before = np.asarray(model.kernel[...])
    assert opt.update(grads, model) is model
    np.testing.assert_allclose(np.asarray(model.kernel[...]), before - 0.1 * np.asarray(grads.kernel[...]), rtol=1e-6)


# -- updating a Module --------------------------------------------------------------------


def test_a_module_is_updated_in_place_like_nnx_optimizer_does():
    # SGD: adam would blow up the rounding noise of l1/bias, whose gradient (before BatchNorm) is ~0.
    tx = optax.sgd(0.1, momentum=0.9)
    model, reference = new_net(), new_net()
    opt = treeopt.Optimizer(tx).init(model)
    optimizer = nnx.Optimizer(reference, tx, wrt=nnx.Param)
    stats_before = not_params(model)
    for _ in range(3):
        grads = nnx.grad(loss_fn)(model, X, Y)
        assert opt.update(grads, model) is model
        optimizer.update(reference, nnx.grad(loss_fn)(reference, X, Y))
    assert int(opt.step) == 3
    # Eager treeopt runs one compiled step and eager nnx.Optimizer op by op: float rounding only.
    for a, b in zip(
        jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(reference, nnx.Param)), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # The forward passes moved the statistics and RNG counts; the optimizer did not touch them.
    assert any(not np.array_equal(a, b) for a, b in zip(stats_before, not_params(model), strict=True))
    for a, b in zip(not_params(model), not_params(reference), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_module_in_eval_mode_is_still_the_module_given_to_init():
    """``model.eval()`` changes static attributes (part of the Module's pytree structure);
    the Params are then found by name."""
    model = new_net()
    opt = treeopt.Optimizer(optax.sgd(0.1)).init(model)
    model.eval()
    grads = nnx.grad(loss_fn)(model, X, Y)
    kernel = np.asarray(model.l1.kernel[...])
    assert opt.update(grads, model) is model
    np.testing.assert_allclose(
        np.asarray(model.l1.kernel[...]), kernel - 0.1 * np.asarray(grads["l1"]["kernel"][...]), rtol=1e-6
    )
    model.train()
    opt.update(nnx.grad(loss_fn)(model, X, Y), model)
    assert int(opt.step) == 2


def test_value_fn_gets_the_trained_values_of_a_module_in_eval_mode():
    """L-BFGS on a Module put in eval mode after init: value_fn gets an nnx.State of the Params, as
    nnx.Optimizer gives it, and evaluates it with the graphdef of the model as it is now."""
    model = new_net()
    opt = treeopt.Optimizer(optax.lbfgs()).init(model)
    model.eval()
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    seen = []

    def objective(state):
        seen.append(sorted(nnx.to_flat_state(state).paths))
        model = nnx.merge(graphdef, state, rest, copy=True)
        assert model.drop.deterministic and model.bn.use_running_average
        return loss_fn(model, X, Y)

    first = float(loss_fn(model, X, Y))
    for _ in range(3):
        value, grads = nnx.value_and_grad(loss_fn)(model, X, Y)
        opt.update(grads, model, value=value, grad=grads, value_fn=objective)
    expected = [tuple(path.split("/")) for path in PARAM_PATHS]
    assert seen and all(paths == expected for paths in seen)
    assert float(loss_fn(model, X, Y)) < first


# -- training loops: nnx.Optimizer's losses, bit for bit, across a checkpoint --------------


def nnx_optimizer_losses() -> tuple[list[float], Net]:
    model = new_net()
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss

    return [float(train_step(model, optimizer, X, Y)) for _ in range(STEPS)], model


_REFERENCE: list = []


def reference() -> tuple[list[float], Net]:
    if not _REFERENCE:
        _REFERENCE.append(nnx_optimizer_losses())
    return _REFERENCE[0]


@nnx.jit
def nnx_jit_step(model, opt, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    opt.update(grads, model)  # the model's Params are updated in place
    return loss, opt


def test_nnx_jit_loop_equals_nnx_optimizer_across_a_resume(tmp_path):
    expected, expected_model = reference()
    model = new_net()
    opt = treeopt.Optimizer(TX).init(model)
    losses = []
    for _ in range(RESUME_AT):
        loss, opt = nnx_jit_step(model, opt, X, Y)
        losses.append(float(loss))
    treeopt.checkpoint.save(tmp_path / "ckpt", opt, nnx.state(model))  # every Variable, not only Params
    saved = not_params(model)
    del model, opt  # the crash

    model = new_net(seed=7)  # other numbers everywhere: the checkpoint must bring all of them back
    target = jax.eval_shape(treeopt.Optimizer(TX).init, model)
    opt, state = treeopt.checkpoint.restore(tmp_path / "ckpt", target, params=nnx.state(model))
    nnx.update(model, state)
    for a, b in zip(saved, not_params(model), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(opt.step) == RESUME_AT
    for _ in range(STEPS - RESUME_AT):
        loss, opt = nnx_jit_step(model, opt, X, Y)
        losses.append(float(loss))

    assert losses == expected
    assert_same_state(model, expected_model)


def test_jax_jit_over_split_state_equals_nnx_optimizer_across_a_resume(tmp_path):
    expected, expected_model = reference()
    graphdef, params, rest = nnx.split(new_net(), nnx.Param, ...)
    opt = treeopt.Optimizer(TX).init(params)

    @jax.jit
    def train_step(params, rest, opt, x, y):
        def loss_and_rest(params):
            model = nnx.merge(graphdef, params, rest, copy=True)
            return loss_fn(model, x, y), nnx.state(model, nnx.Not(nnx.Param))

        (loss, rest), grads = jax.value_and_grad(loss_and_rest, has_aux=True)(params)
        params = opt.update(grads, params)
        return params, rest, opt, loss

    losses = []
    for _ in range(RESUME_AT):
        params, rest, opt, loss = train_step(params, rest, opt, X, Y)
        losses.append(float(loss))
    treeopt.checkpoint.save(tmp_path / "ckpt", opt, {"params": params, "rest": rest})
    del params, rest, opt

    graphdef, params, rest = nnx.split(new_net(seed=7), nnx.Param, ...)
    target = jax.eval_shape(treeopt.Optimizer(TX).init, params)
    opt, restored = treeopt.checkpoint.restore(
        tmp_path / "ckpt", target, params={"params": params, "rest": rest}
    )
    params, rest = restored["params"], restored["rest"]
    for _ in range(STEPS - RESUME_AT):
        params, rest, opt, loss = train_step(params, rest, opt, X, Y)
        losses.append(float(loss))

    assert losses == expected
    assert_same_state(nnx.merge(graphdef, params, rest), expected_model)


def test_cached_partial_loop_equals_nnx_optimizer():
    expected, _ = reference()
    model = new_net()
    opt = treeopt.Optimizer(TX).init(model)
    train_step = nnx.cached_partial(nnx_jit_step, model)
    losses = []
    for _ in range(STEPS):
        loss, opt = train_step(opt, X, Y)
        losses.append(float(loss))
    assert losses == expected


def test_resuming_without_the_non_param_state_changes_the_losses(tmp_path):
    """Why the checkpoint holds every Variable: Params and optimizer alone do not resume the run."""
    expected, _ = reference()
    model = new_net()
    opt = treeopt.Optimizer(TX).init(model)
    for _ in range(RESUME_AT):
        _, opt = nnx_jit_step(model, opt, X, Y)
    treeopt.checkpoint.save(tmp_path / "ckpt", opt, nnx.state(model, nnx.Param))

    model = new_net(seed=7)
    target = jax.eval_shape(treeopt.Optimizer(TX).init, model)
    opt, params = treeopt.checkpoint.restore(tmp_path / "ckpt", target, params=nnx.state(model, nnx.Param))
    nnx.update(model, params)
    loss, opt = nnx_jit_step(model, opt, X, Y)
    assert float(loss) != expected[RESUME_AT]


def test_nnx_jit_step_traces_once():
    model = new_net()
    opt = treeopt.Optimizer(TX).init(model)
    traces = 0

    @nnx.jit
    def train_step(model, opt):
        nonlocal traces
        traces += 1
        grads = nnx.grad(loss_fn)(model, X, Y)
        opt.update(grads, model)
        return opt

    for _ in range(4):
        opt = train_step(model, opt)
    assert traces == 1 and int(opt.step) == 4
