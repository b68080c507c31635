"""``treeopt.nnx``: ``nnx.Optimizer`` and ``nnx.ModelAndOptimizer`` swapped for treeopt's, nothing else changed.

Every training loop here is written once and run twice, with ``nnx.Optimizer``
and with ``treeopt.nnx.Optimizer``; under a jit both compile the same
arithmetic, so losses, parameters and the non-Param state (batch statistics,
RNG counts) are compared bit for bit. Eager steps differ by float rounding
only: treeopt runs its step as one compiled program, nnx op by op.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import treeopt
import treeopt.nnx
import treeopt.serialization

from _helpers import assert_trees_close, assert_trees_equal, device_mesh

# The same tests on every supported flax: 0.12.0 reads a Variable's value as `.value` (later
# releases: get_value / set_value) and calls nnx.as_pure nnx.pure; graph modes came in 0.12.8.
GRAPH_MODES = "graph" in inspect.signature(nnx.Optimizer.__init__).parameters
as_pure = getattr(nnx, "as_pure", None) or nnx.pure


def core_of(optimizer):
    """The treeopt.Optimizer a drop-in holds."""
    variable = optimizer.treeopt
    return variable.get_value() if hasattr(type(variable), "get_value") else variable.value


def set_core(optimizer, core):
    if hasattr(type(optimizer.treeopt), "set_value"):
        optimizer.treeopt.set_value(core)
    else:
        optimizer.treeopt.value = core


STEPS = 6
TXS = {
    "adam": lambda: optax.adam(3e-2),
    "adamw": lambda: optax.adamw(3e-2, weight_decay=1e-2),
    "sgd+momentum": lambda: optax.sgd(5e-2, momentum=0.9),
}

_kx, _ky = jax.random.split(jax.random.key(42))
X = jax.random.normal(_kx, (16, 3))
Y = jnp.cos(X @ jax.random.normal(_ky, (3, 2)))


class Net(nnx.Module):
    """Linear, BatchNorm, Dropout: its forward pass moves batch statistics and RNG counts."""

    def __init__(self, seed: int = 3):
        rngs = nnx.Rngs(seed, dropout=seed + 10)
        self.inp = nnx.Linear(3, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.gelu(self.norm(self.inp(x)))))


def loss_fn(model):
    return jnp.mean((model(X) - Y) ** 2)


def everything(model) -> list[np.ndarray]:
    """Every variable of the model as plain arrays (RNG keys as their key data)."""
    leaves = jax.tree.leaves(nnx.state(model))
    return [
        np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
        for x in leaves
    ]


def assert_same_model(a, b) -> None:
    for x, y in zip(everything(a), everything(b), strict=True):
        np.testing.assert_array_equal(x, y)


# -- each nnx style, written once; `optimizer_type` is the only difference ---------------


@nnx.jit
def nnx_jit_step(model, optimizer):
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def nnx_jit_loop(optimizer_type, tx, steps=STEPS):
    model = Net()
    optimizer = optimizer_type(model, tx, wrt=nnx.Param)
    return [float(nnx_jit_step(model, optimizer)) for _ in range(steps)], model, optimizer


def split_merge_loop(optimizer_type, tx, steps=STEPS):
    model = Net()
    optimizer = optimizer_type(model, tx, wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    @jax.jit
    def train_step(state):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    losses = []
    for _ in range(steps):
        state, loss = train_step(state)
        losses.append(float(loss))
    nnx.update((model, optimizer), state)
    return losses, model, optimizer


def cached_partial_loop(optimizer_type, tx, steps=STEPS):
    model = Net()
    optimizer = optimizer_type(model, tx, wrt=nnx.Param)
    cached = nnx.cached_partial(nnx_jit_step, model, optimizer)
    return [float(cached()) for _ in range(steps)], model, optimizer


LOOPS = {"nnx.jit": nnx_jit_loop, "split/merge": split_merge_loop, "cached_partial": cached_partial_loop}


@pytest.mark.parametrize("tx_name", sorted(TXS))
@pytest.mark.parametrize("style", sorted(LOOPS))
def test_losses_equal_nnx_optimizers_bit_for_bit(style, tx_name):
    loop = LOOPS[style]
    expected, expected_model, expected_opt = loop(nnx.Optimizer, TXS[tx_name]())
    losses, model, optimizer = loop(treeopt.nnx.Optimizer, TXS[tx_name]())
    assert losses == expected
    assert losses[-1] < losses[0]
    assert_same_model(model, expected_model)  # Params, batch statistics and RNG counts
    assert int(optimizer.step[...]) == int(expected_opt.step[...]) == STEPS


def test_update_returns_the_updates_nnx_optimizer_returns():
    """The updates, as an nnx.State of arrays shaped like nnx.state(model, wrt), equal to nnx's."""
    returned = {}
    for optimizer_type in (nnx.Optimizer, treeopt.nnx.Optimizer):
        model = Net()
        optimizer = optimizer_type(model, optax.adam(1e-2), wrt=nnx.Param)
        before = as_pure(nnx.state(model, nnx.Param))

        @nnx.jit
        def train_step(model, optimizer):
            return optimizer.update(model, nnx.grad(loss_fn)(model))

        returned[optimizer_type] = updates = train_step(model, optimizer)
        if updates is None:  # nnx.Optimizer.update of flax 0.12.0 returns nothing: nothing to compare
            assert optimizer_type is nnx.Optimizer
            continue
        # The model was updated in place by those updates (inside the jit XLA may fuse the add: rounding).
        assert_trees_close(
            as_pure(nnx.state(model, nnx.Param)),
            optax.apply_updates(before, updates),
            rtol=1e-6,
            atol=1e-7,
        )
        assert not np.array_equal(before["out"]["kernel"], model.out.kernel[...])
    mine, theirs = returned[treeopt.nnx.Optimizer], returned[nnx.Optimizer]
    assert type(mine) is nnx.State
    if theirs is not None:
        assert_trees_equal(mine, theirs)


def test_eager_updates_follow_nnx_optimizer_up_to_rounding():
    models, optimizers = {}, {}
    for optimizer_type in (nnx.Optimizer, treeopt.nnx.Optimizer):
        models[optimizer_type] = model = Net()
        optimizers[optimizer_type] = optimizer_type(model, optax.sgd(5e-2, momentum=0.9), wrt=nnx.Param)
    for _ in range(3):
        for optimizer_type, model in models.items():
            optimizers[optimizer_type].update(model, nnx.grad(loss_fn)(model))
    assert_trees_close(
        as_pure(nnx.state(models[treeopt.nnx.Optimizer], nnx.Param)),
        as_pure(nnx.state(models[nnx.Optimizer], nnx.Param)),
        rtol=1e-5,
        atol=1e-6,
    )
    assert int(optimizers[treeopt.nnx.Optimizer].step[...]) == 3


def test_tree_mode_trains_like_nnx_optimizer():
    """``graph=False``: Modules as plain pytrees through ``nnx.jit(graph=False)``."""
    if not GRAPH_MODES:  # flax before 0.12.8: nnx.Optimizer has no graph=, and the drop-in says so
        with pytest.raises(TypeError, match=r"graph=False needs flax 0.12.8 or newer"):
            treeopt.nnx.Optimizer(nnx.Linear(3, 2, rngs=nnx.Rngs(1)), optax.adam(1e-2), wrt=nnx.Param, graph=False)
        return
    results = []
    for optimizer_type in (nnx.Optimizer, treeopt.nnx.Optimizer):
        model = nnx.Linear(3, 2, rngs=nnx.Rngs(1))
        optimizer = optimizer_type(model, optax.adam(1e-2), wrt=nnx.Param, graph=False)

        @nnx.jit(graph=False, graph_updates=False)
        def train_step(model, optimizer):
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(X) - Y) ** 2), graph=False)(model)
            optimizer.update(model, grads)
            return loss

        results.append([float(train_step(model, optimizer)) for _ in range(3)])
    assert results[0] == results[1]


# -- ModelAndOptimizer ----------------------------------------------------------------------


@pytest.mark.parametrize("jit", ["nnx.jit", "jax.jit"])
def test_model_and_optimizer_keeps_the_model_and_updates_it(jit):
    results = []
    for state_type in (nnx.ModelAndOptimizer, treeopt.nnx.ModelAndOptimizer):
        state = state_type(Net(), optax.adamw(1e-2))  # wrt=nnx.Param by default
        if jit == "nnx.jit":

            @nnx.jit
            def train_step(state):
                loss, grads = nnx.value_and_grad(loss_fn)(state.model)
                state.update(grads)
                return loss

            losses = [float(train_step(state)) for _ in range(3)]
        else:
            graphdef, flat = nnx.split(state)

            @jax.jit
            def train_step(flat, graphdef=graphdef):
                state = nnx.merge(graphdef, flat)
                loss, grads = nnx.value_and_grad(loss_fn)(state.model)
                state.update(grads)
                return nnx.state(state), loss

            losses = []
            for _ in range(3):
                flat, loss = train_step(flat)
                losses.append(float(loss))
            state = nnx.merge(graphdef, flat)
        results.append((losses, state))
    (expected, expected_state), (losses, state) = results
    assert isinstance(state, treeopt.nnx.Optimizer)
    assert losses == expected
    assert_same_model(state.model, expected_state.model)


def test_a_subclass_with_its_own_attributes_and_update():
    """A train state built on ModelAndOptimizer: attributes set before ``super().__init__``, an
    ``update`` of its own with keyword arguments."""

    class WithLoss(treeopt.nnx.ModelAndOptimizer):
        def __init__(self, model, tx):
            self.mean_loss = nnx.metrics.Average()
            super().__init__(model, tx)

        def update(self, *, grads, loss):
            self.mean_loss.update(values=loss)
            return super().update(grads)

    state = WithLoss(Net(), optax.sgd(0.05))

    @nnx.jit
    def train_step(state):
        loss, grads = nnx.value_and_grad(loss_fn)(state.model)
        state.update(grads=grads, loss=loss)

    train_step(state)
    first = float(state.mean_loss.compute())
    for _ in range(3):
        train_step(state)
    assert float(state.mean_loss.compute()) < first and int(state.step[...]) == 4


def test_an_optimizer_has_no_model_as_in_nnx():
    optimizer = treeopt.nnx.Optimizer(Net(), optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(AttributeError, match=r"use treeopt\.nnx\.ModelAndOptimizer"):
        _ = optimizer.model


# -- wrt: nnx filters, read as nnx reads them -------------------------------------------------


class Adapted(nnx.Module):
    """A LoRA adapter over a Linear: Params of the base, LoRAParams of the adapter."""

    def __init__(self):
        self.lora = nnx.LoRA(3, 2, 2, base_module=nnx.Linear(3, 2, rngs=nnx.Rngs(5)), rngs=nnx.Rngs(6))

    def __call__(self, x):
        return self.lora(x)


@pytest.mark.parametrize(
    "wrt", [nnx.Param, nnx.LoRAParam, (nnx.Param, nnx.LoRAParam)], ids=["Param", "LoRAParam", "both"]
)
def test_wrt_trains_the_variables_nnx_would_train_and_no_other(wrt):
    models = {}
    for optimizer_type in (nnx.Optimizer, treeopt.nnx.Optimizer):
        models[optimizer_type] = model = Adapted()
        optimizer = optimizer_type(model, optax.adam(1e-2), wrt=wrt)
        grad_fn = nnx.grad(lambda m: jnp.mean((m(X) - Y) ** 2), argnums=nnx.DiffState(0, wrt))
        for _ in range(3):
            optimizer.update(model, grad_fn(model))
    mine, theirs, fresh = models[treeopt.nnx.Optimizer], models[nnx.Optimizer], Adapted()
    assert_trees_close(nnx.state(mine), nnx.state(theirs), rtol=1e-5, atol=1e-6)
    trained, frozen = nnx.state(mine, wrt, ...)
    fresh_trained, fresh_frozen = nnx.state(fresh, wrt, ...)
    assert all(
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(fresh_trained), strict=True)
    )
    assert_trees_equal(frozen, fresh_frozen)


def test_grads_of_more_variables_than_wrt_are_filtered_as_nnx_filters_them():
    model = Adapted()
    optimizer = treeopt.nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.LoRAParam)
    grads = nnx.grad(lambda m: jnp.mean((m(X) - Y) ** 2), argnums=nnx.DiffState(0, ...))(model)
    updates = optimizer.update(model, grads)
    assert sorted(nnx.to_flat_state(updates).paths) == [("lora", "lora_a"), ("lora", "lora_b")]


# -- line searches: value_fn gets what nnx gives it ---------------------------------------------


def test_lbfgs_value_fn_gets_an_nnx_state_and_follows_nnx_optimizer():
    results, seen = [], []
    for optimizer_type in (nnx.Optimizer, treeopt.nnx.Optimizer):
        model = nnx.Linear(3, 2, rngs=nnx.Rngs(2))
        optimizer = optimizer_type(model, optax.lbfgs(), wrt=nnx.Param)
        graphdef = nnx.graphdef(model)

        def value_fn(state, graphdef=graphdef):
            seen.append(state)
            return jnp.mean((nnx.merge(graphdef, state)(X) - Y) ** 2)

        @nnx.jit
        def train_step(model, optimizer, value_fn=value_fn):
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(X) - Y) ** 2))(model)
            optimizer.update(model, grads, grad=grads, value=loss, value_fn=value_fn)
            return loss

        results.append([float(train_step(model, optimizer)) for _ in range(4)])
    assert results[0] == results[1] and results[1][-1] < 0.5 * results[1][0]
    assert all(type(state) is nnx.State for state in seen)
    assert len({jax.tree.structure(state) for state in seen}) == 1


def test_lbfgs_on_the_adapter_alone_with_the_rest_merged_back():
    """wrt=LoRAParam and a value_fn that merges the adapter's state with everything else.

    treeopt's updates run eagerly; nnx.Optimizer's, the reference, under ``nnx.jit`` (op by
    op, its L-BFGS takes seconds a step): they differ by float32 rounding only.
    """
    results = {}
    for optimizer_type in (nnx.Optimizer, treeopt.nnx.Optimizer):
        model = Adapted()
        optimizer = optimizer_type(model, optax.lbfgs(), wrt=nnx.LoRAParam)
        graphdef, _, rest = nnx.split(model, nnx.LoRAParam, ...)
        frozen = nnx.clone(nnx.state(model, nnx.Not(nnx.LoRAParam)))

        def value_fn(adapter, graphdef=graphdef, rest=rest):
            return jnp.mean((nnx.merge(graphdef, adapter, rest, copy=True)(X) - Y) ** 2)

        grad_fn = nnx.grad(lambda m: jnp.mean((m(X) - Y) ** 2), argnums=nnx.DiffState(0, nnx.LoRAParam))

        def step(model, optimizer, value_fn=value_fn, grad_fn=grad_fn):
            grads = grad_fn(model)
            loss = jnp.mean((model(X) - Y) ** 2)
            optimizer.update(model, grads, grad=grads, value=loss, value_fn=value_fn)
            return loss

        step = nnx.jit(step) if optimizer_type is nnx.Optimizer else step
        losses = [float(step(model, optimizer)) for _ in range(3)]
        assert_trees_equal(nnx.state(model, nnx.Not(nnx.LoRAParam)), frozen)
        results[optimizer_type] = losses, nnx.state(model, nnx.LoRAParam)
    (losses, adapter), (expected, expected_adapter) = results[treeopt.nnx.Optimizer], results[nnx.Optimizer]
    np.testing.assert_allclose(losses, expected, rtol=1e-5)  # rounding only
    assert_trees_close(adapter, expected_adapter, rtol=1e-5, atol=1e-6)
    assert losses[-1] < losses[0]


def test_grads_of_a_split_state_update_the_model_it_came_from():
    """Gradients taken with respect to ``nnx.split`` state (a functional loss) train the model."""
    model = Adapted()
    optimizer = treeopt.nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)
    graphdef, adapter, rest = nnx.split(model, nnx.LoRAParam, ...)

    def loss_of(adapter, rest):
        return jnp.mean((nnx.merge(graphdef, adapter, rest, copy=True)(X) - Y) ** 2)

    before = nnx.clone(nnx.state(model))
    first = float(loss_of(adapter, rest))
    for _ in range(3):
        optimizer.update(model, jax.grad(loss_of)(nnx.state(model, nnx.LoRAParam), rest))
    assert float(loss_of(nnx.state(model, nnx.LoRAParam), rest)) < first
    assert_trees_equal(nnx.state(model, nnx.Not(nnx.LoRAParam)), nnx.state(before, nnx.Not(nnx.LoRAParam)))


def test_the_state_of_a_sharded_param_is_laid_out_like_it():
    mesh = device_mesh((2, 4), ("a", "b"), "auto")
    kernel_init = nnx.with_partitioning(nnx.initializers.lecun_normal(), sharding=("a", "b"))
    with jax.set_mesh(mesh):
        model = nnx.Linear(4, 8, kernel_init=kernel_init, use_bias=False, rngs=nnx.Rngs(0))
        optimizer = treeopt.nnx.Optimizer(model, optax.adamw(0.1), wrt=nnx.Param)
    assert optimizer.opt_state[0].mu["kernel"].sharding.spec == P("a", "b")
    assert optimizer.opt_state[0].nu["kernel"].sharding == model.kernel[...].sharding


# -- treeopt's features come with it ------------------------------------------------------------


def test_learning_rate_is_set_without_recompiling():
    model = Net()
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    optimizer = treeopt.nnx.Optimizer(model, tx, wrt=nnx.Param)
    traces = 0

    @nnx.jit
    def train_step(model, optimizer):
        nonlocal traces
        traces += 1
        return optimizer.update(model, nnx.grad(loss_fn)(model))

    train_step(model, optimizer)
    optimizer.learning_rate = 0.0
    before = as_pure(nnx.state(model, nnx.Param))
    train_step(model, optimizer)
    assert traces == 1
    assert float(optimizer.learning_rate) == 0.0 and float(optimizer.hyperparams["learning_rate"]) == 0.0
    assert_trees_equal(as_pure(nnx.state(model, nnx.Param)), before)  # a zero step changed nothing
    assert int(optimizer.step[...]) == 2


def test_hyperparameter_errors_are_the_cores():
    optimizer = treeopt.nnx.Optimizer(Net(), optax.adam(1e-2), wrt=nnx.Param)
    with pytest.raises(
        AttributeError, match=r"no injected hyperparameters\. Build it with optax\.inject_hyperparams"
    ):
        optimizer.learning_rate = 1e-3  # would silently set a plain attribute otherwise
    with pytest.raises(AttributeError, match="no attribute or injected hyperparameter 'momentum'"):
        _ = optimizer.momentum
    optimizer.note = "an ordinary attribute"  # other names stay ordinary nnx attributes
    assert optimizer.note == "an ordinary attribute"


def test_assigning_an_attribute_follows_the_cores_rule():
    # One rule for both: a hyperparameter, named whole or by its last part, is set in the state (an
    # ambiguous last part is refused, naming the whole names); the object's own attributes are its own.
    scale = optax.inject_hyperparams(optax.scale)
    tx = optax.chain(scale(step_size=0.1), scale(step_size=0.2))
    optimizer = treeopt.nnx.Optimizer(Net(), tx, wrt=nnx.Param)
    core = treeopt.Optimizer(tx).init(as_pure(nnx.state(Net(), nnx.Param)))
    for owner in (optimizer, core):
        with pytest.raises(AttributeError, match=r"'step_size' occurs several times; set one of \['0/step_size'"):
            owner.step_size = 0.5  # the drop-in used to keep it as an ordinary attribute, silently
        owner.set_hyperparams({"1/step_size": 0.5})
        assert float(owner.hyperparams["1/step_size"]) == 0.5
    with pytest.raises(AttributeError, match="managed by the optimizer"):
        core.precision_state = None
    optimizer.note = "an ordinary attribute"
    assert optimizer.note == "an ordinary attribute"
    # The object's own attributes come first, even where a hyperparameter has the same name.
    named_like_wrt = optax.inject_hyperparams(lambda wrt: optax.scale(wrt))(wrt=0.5)
    optimizer = treeopt.nnx.Optimizer(Net(), named_like_wrt, wrt=nnx.Param)
    core = treeopt.Optimizer(named_like_wrt).init(as_pure(nnx.state(Net(), nnx.Param)))
    optimizer.wrt = nnx.Param  # the drop-in's own filter, not the hyperparameter
    with pytest.raises(AttributeError, match="managed by the optimizer"):
        core.wrt = None
    assert float(optimizer.hyperparams["wrt"]) == float(core.hyperparams["wrt"]) == 0.5


def test_state_is_one_treeopt_optimizer_keyed_by_name():
    model = Net()
    optimizer = treeopt.nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    core = core_of(optimizer)
    assert isinstance(core, treeopt.Optimizer)
    # Held as nnx.Optimizer holds its state, an OptState per array (flax's pure-dict checkpoints find them).
    assert all(isinstance(v, nnx.OptState) for v in jax.tree.leaves(optimizer.treeopt, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    names = ("inp/bias", "inp/kernel", "norm/bias", "norm/scale", "out/bias", "out/kernel")
    assert optimizer.paths == core.paths == names
    assert sorted(optimizer.opt_state[0].mu) == list(names)
    assert sorted(optimizer.state_dict()["opt_state"]["0"]["nu"]) == list(names)
    assert list(nnx.state(optimizer)) == ["treeopt"]


def test_load_state_dict_resumes_in_place():
    expected, expected_model, _ = nnx_jit_loop(nnx.Optimizer, optax.adam(3e-2))
    _, model, optimizer = nnx_jit_loop(treeopt.nnx.Optimizer, optax.adam(3e-2), steps=3)
    saved_opt, saved_model = optimizer.state_dict(), nnx.state(model)

    fresh_model = Net(seed=9)
    fresh = treeopt.nnx.Optimizer(fresh_model, optax.adam(3e-2), wrt=nnx.Param)
    fresh.load_state_dict(saved_opt)
    nnx.update(fresh_model, saved_model)

    assert [float(nnx_jit_step(fresh_model, fresh)) for _ in range(3)] == expected[3:]
    assert_same_model(fresh_model, expected_model)


def test_a_checkpoint_of_the_treeopt_state_resumes_bit_for_bit(tmp_path):
    expected, _, _ = nnx_jit_loop(nnx.Optimizer, optax.adamw(3e-2, weight_decay=1e-2))
    _, model, optimizer = nnx_jit_loop(treeopt.nnx.Optimizer, optax.adamw(3e-2, weight_decay=1e-2), steps=2)
    treeopt.checkpoint.save(tmp_path / "ckpt", core_of(optimizer), nnx.state(model))

    model = Net(seed=9)  # another process: other numbers everywhere until restored
    optimizer = treeopt.nnx.Optimizer(model, optax.adamw(3e-2, weight_decay=1e-2), wrt=nnx.Param)
    core, state = treeopt.checkpoint.restore(
        tmp_path / "ckpt", core_of(optimizer), params=nnx.state(model)
    )
    set_core(optimizer, core)
    nnx.update(model, state)

    assert [float(nnx_jit_step(model, optimizer)) for _ in range(STEPS - 2)] == expected[2:]


def test_partition_specs_from_the_models_specs_and_zero_over_data():
    mesh = device_mesh((4, 2), ("data", "model"), "auto")
    init = functools.partial(nnx.with_partitioning, sharding=(None, "model"))
    with jax.set_mesh(mesh):
        model = nnx.Linear(8, 4, kernel_init=init(nnx.initializers.lecun_normal()), rngs=nnx.Rngs(0))
        model.count = nnx.BatchStat(jnp.zeros(4))  # outside wrt: its spec is ignored
        optimizer = treeopt.nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    param_specs = nnx.get_partition_spec(nnx.state(model))
    specs = optimizer.partition_specs(param_specs)
    assert specs.opt_state[0].mu["kernel"] == P(None, "model") and specs.opt_state[0].mu["bias"] == P()
    zero = optimizer.partition_specs(param_specs, shard_state_over="data", mesh=mesh)
    assert zero.opt_state[0].mu["kernel"] == P("data", "model") and zero.opt_state[0].nu["bias"] == P("data")
    placed = jax.device_put(core_of(optimizer), treeopt.partitioning.named_shardings(zero, mesh))
    set_core(optimizer, placed)
    assert optimizer.opt_state[0].mu["kernel"].sharding.spec == P("data", "model")


SHARDED_MLP_SPECS = {"up": P(None, "model"), "down": P("model", None), "head": P(), "bias": P()}


class ShardedMLP(nnx.Module):
    """A kernel split by columns and one by rows over "model", and replicated ones; valid on explicit axes.

    Built from arrays already placed (no ``nnx.with_partitioning``: the drop-in reads where the
    params lie from the arrays themselves).
    """

    def __init__(self, mesh, dtype):
        keys = iter(jax.random.split(jax.random.key(0), 4))
        shapes = {"up": (16, 64), "down": (64, 64), "head": (64, 8), "bias": (8,)}
        for name, shape in shapes.items():
            value = (0.2 * jax.random.normal(next(keys), shape)).astype(dtype)
            setattr(self, name, nnx.Param(jax.device_put(value, jax.sharding.NamedSharding(mesh, SHARDED_MLP_SPECS[name]))))

    def __call__(self, x):
        h = jnp.tanh(x.astype(self.up.dtype) @ self.up[...])
        h = jnp.sum(h[:, :, None] * self.down[...][None], axis=1)  # a reduction: no out_sharding needed
        return h @ self.head[...] + self.bias[...]


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
@pytest.mark.parametrize(
    "options",
    [{}, {"state_bits": 8, "param_rounding": "kahan"}],
    ids=["float32", "bf16-8bit-kahan"],
)
def test_zero_state_leaves_the_params_where_they_were(axis_type, options):
    mesh = device_mesh((4, 2), ("data", "model"), axis_type)
    model = ShardedMLP(mesh, jnp.bfloat16 if options else jnp.float32)
    with jax.set_mesh(mesh):
        optimizer = treeopt.nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param, **options)
        zero = optimizer.partition_specs(SHARDED_MLP_SPECS, shard_state_over="data", mesh=mesh)
        set_core(optimizer, jax.device_put(core_of(optimizer), treeopt.partitioning.named_shardings(zero, mesh)))
        before = {path: v[...].sharding for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
        assert before[("down",)].spec == P("model", None)

        @nnx.jit
        def train_step(model, optimizer, x):
            grads = nnx.grad(lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(model)
            optimizer.update(model, grads)

        x = jax.device_put(jnp.ones((8, 16)), jax.sharding.NamedSharding(mesh, P("data")))
        for _ in range(2):  # under explicit axes the second step's matmuls meet the first's new params
            train_step(model, optimizer, x)
    assert int(optimizer.step[...]) == 2
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        assert v[...].sharding.is_equivalent_to(before[path], v[...].ndim), (path, v[...].sharding, before[path])
    assert "data" in str(optimizer.opt_state[0].mu["up"].sharding.spec)  # the state stays ZeRO's


def test_options_of_the_treeopt_optimizer_pass_through():
    """Keyword arguments beyond nnx's go to treeopt.Optimizer, which rejects the ones it lacks."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        treeopt.nnx.Optimizer(Net(), optax.sgd(0.1), wrt=nnx.Param, no_such_option=1)


def test_split_and_merge_keep_the_optimizer_working():
    model = Net()
    optimizer = treeopt.nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    graphdef, state = nnx.split(optimizer)
    copy = nnx.merge(graphdef, state)
    assert isinstance(copy, treeopt.nnx.Optimizer) and copy.paths == optimizer.paths
    copy.update(model, nnx.grad(loss_fn)(model))
    assert int(copy.step[...]) == 1


# -- mistakes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wrt", "shown"),
    [
        (nnx.BatchStat, "wrt=BatchStat selects no variable of the Linear"),
        (nnx.PathContains("typo"), "wrt=PathContains('typo'"),
        ("lora", "nnx reads a string as a tag, nnx.WithTag('lora')"),
    ],
    ids=["type", "path", "tag"],
)
def test_a_wrt_that_selects_no_variable_is_refused(wrt, shown):
    with pytest.raises(ValueError, match="nothing would train") as err:
        treeopt.nnx.Optimizer(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), optax.sgd(0.1), wrt=wrt)
    assert shown in str(err.value)
    assert "Its variables: 'bias' (Param), 'kernel' (Param)." in str(err.value)


def test_wrt_is_required_as_in_nnx():
    with pytest.raises(TypeError, match="wrt"):
        treeopt.nnx.Optimizer(Net(), optax.sgd(0.1))  # type: ignore[call-arg]


def test_the_grads_are_required_as_in_nnx():
    optimizer = treeopt.nnx.Optimizer(Net(), optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(TypeError, match="grads"):
        optimizer.update(nnx.grad(loss_fn)(Net()))  # type: ignore[call-arg]


def test_a_module_where_the_gradients_go_is_refused():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = treeopt.nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    grads = nnx.grad(lambda m: jnp.sum(m(X)))(model)
    with pytest.raises(TypeError, match=r"optimizer\.update\(model, grads\)"):
        optimizer.update(grads, model)
    assert int(optimizer.step[...]) == 0
