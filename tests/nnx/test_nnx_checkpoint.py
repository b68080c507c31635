"""The nnx drop-in checkpointed as an nnx user holds it.

- ``treeopt.checkpoint.save`` / ``restore`` and ``CheckpointManager.save`` /
  ``restore`` take a ``treeopt.nnx.Optimizer`` (or a ``ModelAndOptimizer``)
  as the optimizer, and ``restore`` into a drop-in returns a drop-in.
- flax's own recipe, ``nnx.to_pure_dict(nnx.state(optimizer))`` through
  orbax's ``StandardCheckpointer`` and back with ``nnx.replace_by_pure_dict``,
  works on the drop-in as on ``nnx.Optimizer``.
- A checkpoint of a flax ``nnx.Optimizer`` (or ``nnx.ModelAndOptimizer``), in
  the layouts orbax writes its state in, is refused by ``restore`` with an
  error that names the mismatch and the ``warm_start`` migration, never
  restored half-way or reported as damaged.
- nnx's hyperparameter idiom, ``opt_state.hyperparams["learning_rate"][...] = x``,
  sets the learning rate; ``Optimizer(tx, model, wrt=...)`` names the swap.

Each resumed run is compared with an uninterrupted one, loss for loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import treeopt
import treeopt.checkpoint
import treeopt.nnx
from treeopt.errors import StateDictError

STEPS = 6
X = jnp.linspace(-1.0, 1.0, 24).reshape(8, 3)
Y = jnp.sin(X[:, :2])


def make_model(seed=3):
    return nnx.Sequential(
        nnx.Linear(3, 8, rngs=nnx.Rngs(seed)), nnx.tanh, nnx.Linear(8, 2, rngs=nnx.Rngs(seed + 1))
    )


def tx():
    return optax.inject_hyperparams(optax.adamw)(learning_rate=3e-2, weight_decay=1e-2)


@nnx.jit
def train_step(model, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(X) - Y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def losses(model, optimizer, steps):
    return [float(train_step(model, optimizer)) for _ in range(steps)]


def uninterrupted():
    model = make_model()
    return losses(model, treeopt.nnx.Optimizer(model, tx(), wrt=nnx.Param), STEPS)


def test_save_and_restore_take_the_drop_in(tmp_path):
    expected = uninterrupted()
    model = make_model()
    optimizer = treeopt.nnx.Optimizer(model, tx(), wrt=nnx.Param)
    assert losses(model, optimizer, 2) == expected[:2]
    treeopt.checkpoint.save(tmp_path / "ckpt", optimizer, nnx.state(model))

    model = make_model(seed=9)  # another process: other numbers until restored
    target = treeopt.nnx.Optimizer(model, tx(), wrt=nnx.Param)
    optimizer, state = treeopt.checkpoint.restore(tmp_path / "ckpt", target, params=nnx.state(model))
    assert isinstance(optimizer, treeopt.nnx.Optimizer) and int(optimizer.step[...]) == 2
    nnx.update(model, state)
    assert losses(model, optimizer, STEPS - 2) == expected[2:]


def test_checkpoint_manager_takes_the_drop_in_and_an_abstract_target(tmp_path):
    expected = uninterrupted()
    model = make_model()
    optimizer = treeopt.nnx.Optimizer(model, tx(), wrt=nnx.Param)
    with treeopt.checkpoint.CheckpointManager(tmp_path / "run") as manager:
        for step in range(3):
            train_step(model, optimizer)
            manager.save(step + 1, optimizer, nnx.state(model))

    abstract = nnx.eval_shape(lambda: treeopt.nnx.Optimizer(make_model(seed=9), tx(), wrt=nnx.Param))
    model = make_model(seed=9)
    with treeopt.checkpoint.CheckpointManager(tmp_path / "run") as manager:
        optimizer, state = manager.restore(abstract, nnx.state(model))
    assert isinstance(optimizer, treeopt.nnx.Optimizer) and int(optimizer.step[...]) == 3
    nnx.update(model, state)
    assert losses(model, optimizer, STEPS - 3) == expected[3:]


def test_model_and_optimizer_round_trip(tmp_path):
    state = treeopt.nnx.ModelAndOptimizer(make_model(), tx())
    grads = nnx.grad(lambda m: jnp.mean((m(X) - Y) ** 2))(state.model)
    state.update(grads)
    treeopt.checkpoint.save(tmp_path / "ckpt", state)
    restored = treeopt.checkpoint.restore(
        tmp_path / "ckpt", treeopt.nnx.ModelAndOptimizer(make_model(), tx())
    )
    assert isinstance(restored, treeopt.nnx.ModelAndOptimizer) and int(restored.step[...]) == 1
    for got, want in zip(
        jax.tree.leaves(restored.state_dict()), jax.tree.leaves(state.state_dict()), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_save_still_refuses_what_is_not_an_optimizer(tmp_path):
    with pytest.raises(TypeError, match=r"save needs an initialized treeopt\.Optimizer"):
        treeopt.checkpoint.save(tmp_path / "ckpt", make_model())


@pytest.mark.parametrize("kind", ["nnx.Optimizer", "treeopt.nnx.Optimizer"])
def test_flax_pure_dict_recipe_with_orbax(kind, tmp_path):
    """flax's checkpointing guide, verbatim, on both optimizers."""
    optimizer_type = nnx.Optimizer if kind == "nnx.Optimizer" else treeopt.nnx.Optimizer
    model = make_model()
    optimizer = optimizer_type(model, tx(), wrt=nnx.Param)
    first = losses(model, optimizer, 2)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "model", nnx.to_pure_dict(nnx.state(model)))
    checkpointer.save(tmp_path / "optimizer", nnx.to_pure_dict(nnx.state(optimizer)))
    checkpointer.wait_until_finished()
    expected = first + losses(model, optimizer, STEPS - 2)

    model = make_model(seed=9)
    optimizer = optimizer_type(model, tx(), wrt=nnx.Param)
    for node, name in ((model, "model"), (optimizer, "optimizer")):
        state = nnx.state(node)
        nnx.replace_by_pure_dict(state, checkpointer.restore(tmp_path / name))
        nnx.update(node, state)
    assert int(optimizer.step[...]) == 2
    assert first + losses(model, optimizer, STEPS - 2) == expected


def save_nnx_checkpoint(path, layout):
    """Writes an ``nnx.Optimizer``'s (or ``nnx.ModelAndOptimizer``'s) state to ``path`` as orbax does.

    Returns where ``treeopt.checkpoint.restore`` reads it: ``path``, or the step of a manager in it.
    """
    nnx_type = nnx.ModelAndOptimizer if layout == "ModelAndOptimizer" else nnx.Optimizer
    state = nnx.state(nnx_type(make_model(), tx(), wrt=nnx.Param))
    if layout == "manager item 'optimizer'":  # an orbax CheckpointManager with treeopt's item name
        with ocp.CheckpointManager(path, item_names=("optimizer",)) as manager:
            manager.save(1, args=ocp.args.Composite(optimizer=ocp.args.StandardSave(nnx.to_pure_dict(state))))
        return path / "1"
    checkpointer = ocp.StandardCheckpointer()  # flax's checkpointing guide
    checkpointer.save(path, nnx.to_pure_dict(state) if layout == "pure dict" else state)
    checkpointer.wait_until_finished()
    return path


NNX_LAYOUTS = ["nnx.state", "pure dict", "ModelAndOptimizer", "manager item 'optimizer'"]


@pytest.mark.parametrize("layout", NNX_LAYOUTS)
def test_an_nnx_optimizer_checkpoint_names_the_mismatch_and_the_warm_start_migration(tmp_path, layout):
    where = save_nnx_checkpoint(tmp_path / "nnx", layout)
    model = make_model()
    dropin = treeopt.nnx.Optimizer(model, tx(), wrt=nnx.Param)
    reads = [
        lambda: treeopt.checkpoint.restore(where, dropin),
        lambda: treeopt.checkpoint.restore(where, dropin, strict=False, verify=False),
        lambda: treeopt.checkpoint.restore(where, jax.eval_shape(treeopt.Optimizer(tx()).init, model)),
        lambda: treeopt.checkpoint.restore_state_dict(where, verify=False),
    ]
    if layout == "manager item 'optimizer'":
        manager = treeopt.checkpoint.CheckpointManager(where.parent)
        reads.append(lambda: manager.restore(dropin))
    for read in reads:
        with pytest.raises(StateDictError) as caught:
            read()
        message = str(caught.value)
        assert message.startswith(f"The checkpoint at {where} holds the state of a flax nnx.Optimizer"), message
        assert "keys it by the parameter's full name" in message and "uint32" in message, message
        assert "treeopt.serialization.warm_start" in message and "docs/migration/from-nnx.md" in message, message
        assert "ArrayMetadata" not in message and "damaged" not in message, message  # no orbax dump, no false alarm


def test_nnx_hyperparameter_idiom_sets_the_learning_rate():
    model = make_model()
    optimizer = treeopt.nnx.Optimizer(model, tx(), wrt=nnx.Param)
    optimizer.opt_state.hyperparams["learning_rate"][...] = 1e-3
    assert float(optimizer.learning_rate) == pytest.approx(1e-3)
    assert optimizer.learning_rate.dtype == jnp.float32  # the state keeps its dtype: no recompilation
    train_step(model, optimizer)

    reference_model = make_model()
    reference = treeopt.nnx.Optimizer(reference_model, tx(), wrt=nnx.Param)
    reference.learning_rate = 1e-3
    train_step(reference_model, reference)
    for got, want in zip(
        jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(reference_model)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_swapped_model_and_tx_are_named():
    with pytest.raises(TypeError, match=r"Optimizer\(model, tx, wrt=...\).*swapped"):
        treeopt.nnx.Optimizer(tx(), make_model(), wrt=nnx.Param)
