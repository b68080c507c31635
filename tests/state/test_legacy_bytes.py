"""Bytes written by earlier treeopt versions still load, bit for bit (see fixtures/README.md).

T5X optimizers serialized with ``flax.serialization.to_bytes`` used to carry
a SHA-256 ``"checksum"``; T5X itself writes none. Both must load, the old
checksum must still catch a corrupted blob, and training must continue from
them exactly as from the optimizer that wrote them.
"""

from __future__ import annotations

import pathlib
import shutil

import flax.serialization as fs
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

import treeopt
from treeopt.errors import StateDictError
from treeopt.t5x import adafactor, optimizers

from _helpers import assert_trees_equal

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def params():
    return {"dense": {"kernel": jax.random.normal(jax.random.key(0), (3, 4)), "bias": jnp.arange(4.0)}}


def grads(i):
    return jax.tree.map(lambda x: jnp.cos(x + i), params())


def _t5x_defs():
    kernels = traverse_util.ModelParamTraversal(lambda path, _: "kernel" in path)
    biases = traverse_util.ModelParamTraversal(lambda path, _: "bias" in path)
    # The release that wrote the fixtures honoured the learning rate passed to apply_gradient.
    honor = {"honor_learning_rate": True}
    return {
        "t5x_adamw": optimizers.adamw(learning_rate=1e-2, weight_decay=0.1, **honor),
        "t5x_adafactor": adafactor.Adafactor(learning_rate=0.1, min_dim_size_to_factor=2),
        "t5x_multi": optimizers.MultiOptimizer(
            [(kernels, optimizers.sgd(0.1, momentum=0.9, **honor)), (biases, optimizers.adam(1e-2, **honor))]
        ),
    }


def _t5x_trained(name, steps=2):
    opt = _t5x_defs()[name].create(params())
    for i in range(steps):
        opt = opt.apply_gradient(grads(i), learning_rate=0.01)
    return opt


T5X_FILES = [
    (name, kind) for name in ("t5x_adamw", "t5x_adafactor", "t5x_multi") for kind in ("sha256", "unchecked")
]


@pytest.mark.parametrize(("name", "kind"), T5X_FILES)
def test_t5x_bytes_of_earlier_versions_load_and_train_on(name, kind):
    data = (FIXTURES / f"{name}.{kind}.msgpack").read_bytes()
    template = _t5x_defs()[name].create(params())
    restored = fs.from_bytes(template, data)
    expected = _t5x_trained(name)
    assert_trees_equal(restored.target, expected.target)
    assert_trees_equal(restored.state, expected.state)
    # One more step from the restored optimizer equals the third step of the original run.
    assert_trees_equal(
        restored.apply_gradient(grads(2), learning_rate=0.01).target,
        _t5x_trained(name, steps=3).target,
    )


@pytest.mark.parametrize("name", ["t5x_adamw", "t5x_adafactor", "t5x_multi"])
def test_the_old_sha256_checksum_still_catches_a_changed_value(name):
    state = fs.msgpack_restore((FIXTURES / f"{name}.sha256.msgpack").read_bytes())
    assert np.asarray(state["checksum"]).shape == (4,)
    kernel = np.array(state["target"]["dense"]["kernel"])
    kernel[0, 0] = np.nextafter(kernel[0, 0], np.float32(np.inf))
    state["target"]["dense"]["kernel"] = kernel
    template = _t5x_defs()[name].create(params())
    with pytest.raises(StateDictError, match="checksum does not match"):
        fs.from_bytes(template, fs.msgpack_serialize(state))


def _core_trained():
    p = params()
    opt = treeopt.Optimizer(optax.adam(1e-2)).init(p)
    for i in range(2):
        p = opt.update(grads(i), p)
    return opt, p


def test_core_bytes_of_earlier_versions_load():
    opt, _ = _core_trained()
    target = jax.eval_shape(treeopt.Optimizer(optax.adam(1e-2)).init, params())
    restored = treeopt.serialization.from_bytes(target, (FIXTURES / "core_adam.msgpack").read_bytes())
    assert_trees_equal(restored.state_dict(), opt.state_dict())


def _multi_transform():
    return optax.multi_transform(
        {"k": optax.adamw(1e-2, weight_decay=0.1, mask=treeopt.mask("*kernel")), "b": optax.sgd(0.1, momentum=0.9)},
        treeopt.labels({"*kernel": "k"}, default="b"),
    )


def test_masked_state_written_when_tx_saw_the_flat_dict_loads_and_trains_on():
    """Before tx saw the params' own structure it saw {name: leaf}; the state it wrote still loads, and the
    masked entries (MaskedNode per name) land where today's view puts them."""
    tx = _multi_transform()
    opt = treeopt.Optimizer(tx).init(params())
    p = params()
    for i in range(2):
        p = opt.update(grads(i), p)
    target = jax.eval_shape(treeopt.Optimizer(tx).init, params())
    restored = treeopt.serialization.from_bytes(target, (FIXTURES / "core_multi_transform.msgpack").read_bytes())
    assert_trees_equal(restored.state_dict(), opt.state_dict())
    assert isinstance(restored.opt_state.inner_states["k"].inner_state[0].mu["dense/bias"], optax.MaskedNode)
    assert_trees_equal(restored.update(grads(2), p), opt.update(grads(2), p))


def test_core_checkpoint_of_earlier_versions_restores(tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "core_adam_ckpt", directory)
    opt, p = _core_trained()
    with treeopt.checkpoint.CheckpointManager(directory) as manager:
        assert manager.all_steps() == [2]
        target = jax.eval_shape(treeopt.Optimizer(optax.adam(1e-2)).init, params())
        restored, restored_params = manager.restore(target, params=jax.eval_shape(params))
    assert_trees_equal(restored.state_dict(), opt.state_dict())
    assert_trees_equal(restored_params, p)
