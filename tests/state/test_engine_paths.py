"""The state-dict engine's three guarantees, on every path into it.

State comes back in through ``load_state_dict`` (the core), a checkpoint
restore (orbax) and ``restore_state`` / bytes (``treeopt.t5x``). On each:

- a value changed after the checksum was taken is refused as corrupted;
- a value of another dtype (the core) or kind (T5X) is refused, by path;
- an entry the target does not have is refused, by path.
"""

from __future__ import annotations

import flax.serialization as fs
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import treeopt
from treeopt.errors import CheckpointError, StateDictError
from treeopt.t5x import optimizers

PARAMS = {"dense": {"kernel": jnp.arange(6.0).reshape(2, 3), "bias": jnp.ones(3)}}
GRADS = jax.tree.map(jnp.ones_like, PARAMS)


def core_optimizer():
    opt = treeopt.Optimizer(optax.adam(1e-2)).init(PARAMS)
    opt.update(GRADS, PARAMS)
    return opt


def t5x_optimizer():
    return optimizers.adam(1e-2).create(PARAMS).apply_gradient(GRADS)


def nudged(x):
    """``x`` with its first element one float step up: a change no shape or dtype check sees."""
    x = np.array(x)
    x.reshape(-1)[0] = np.nextafter(x.reshape(-1)[0], np.float32(np.inf))
    return x


# -- the core: load_state_dict ------------------------------------------------------------------------


def test_core_refuses_a_corrupted_state_dict():
    opt = core_optimizer()
    sd = fs.to_state_dict(opt)  # with its checksum
    sd["opt_state"]["0"]["mu"]["dense/kernel"] = nudged(sd["opt_state"]["0"]["mu"]["dense/kernel"])
    with pytest.raises(StateDictError, match="checksum does not match"):
        opt.load_state_dict(sd)


def test_core_refuses_another_dtype():
    opt = core_optimizer()
    sd = opt.state_dict()
    sd["opt_state"]["0"]["nu"]["dense/bias"] = sd["opt_state"]["0"]["nu"]["dense/bias"].astype(jnp.bfloat16)
    with pytest.raises(
        StateDictError, match=r"opt_state/0/nu/dense/bias: expected float32\[3\], got bfloat16\[3\]"
    ):
        opt.load_state_dict(sd)


def test_core_refuses_an_unexpected_entry():
    opt = core_optimizer()
    sd = opt.state_dict()
    sd["opt_state"]["0"]["mu"]["dense/extra"] = jnp.ones(3)
    with pytest.raises(StateDictError) as err:
        opt.load_state_dict(sd)
    assert err.value.report.unexpected == ("opt_state/0/mu/dense/extra",)


# -- checkpoints -----------------------------------------------------------------------------------------


def _write_raw(directory, opt_sd, checksums):
    """A checkpoint in treeopt's layout written with plain orbax: the state dict and checksums as given."""
    args = ocp.args.Composite(optimizer=ocp.args.StandardSave(opt_sd))
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler(optimizer=ocp.StandardCheckpointHandler())) as ckptr:
        ckptr.save(directory, args=args, custom_metadata={"treeopt": {"format": 1, "checksums": checksums}})


def test_checkpoint_refuses_corrupted_files(tmp_path):
    opt = core_optimizer()
    sd = opt.state_dict()
    checksum = [int(x) for x in fs.to_state_dict(opt)["checksum"]]
    sd["opt_state"]["0"]["mu"]["dense/kernel"] = nudged(sd["opt_state"]["0"]["mu"]["dense/kernel"])
    _write_raw(tmp_path / "c", sd, {"optimizer": checksum})
    with pytest.raises(CheckpointError, match="does not match the checksum it was saved with"):
        treeopt.checkpoint.restore(tmp_path / "c", jax.eval_shape(lambda: opt))


def test_checkpoint_refuses_another_dtype(tmp_path):
    opt = core_optimizer()
    sd = opt.state_dict()
    sd["opt_state"]["0"]["nu"]["dense/bias"] = np.asarray(
        sd["opt_state"]["0"]["nu"]["dense/bias"], np.float16
    )
    _write_raw(tmp_path / "c", sd, {"optimizer": [0, 0]})
    with pytest.raises(
        StateDictError, match=r"opt_state/0/nu/dense/bias: expected float32\[3\], got float16\[3\]"
    ):
        treeopt.checkpoint.restore(tmp_path / "c", opt)


def test_checkpoint_refuses_an_unexpected_entry(tmp_path):
    opt = core_optimizer()
    treeopt.checkpoint.save(tmp_path / "c", opt)
    smaller = treeopt.Optimizer(optax.adam(1e-2)).init({"dense": {"kernel": PARAMS["dense"]["kernel"]}})
    with pytest.raises(StateDictError) as err:
        treeopt.checkpoint.restore(tmp_path / "c", smaller)
    assert err.value.report.unexpected == ("opt_state/0/mu/dense/bias", "opt_state/0/nu/dense/bias")


# -- treeopt.t5x: restore_state and bytes ------------------------------------------------------------


def test_t5x_refuses_corrupted_bytes():
    opt = t5x_optimizer()
    sd = fs.msgpack_restore(fs.to_bytes(opt))
    sd["target"]["dense"]["kernel"] = nudged(sd["target"]["dense"]["kernel"])
    with pytest.raises(StateDictError, match="checksum does not match"):
        fs.from_bytes(opt, fs.msgpack_serialize(sd))


def test_t5x_refuses_another_kind():
    opt = t5x_optimizer()
    sd = opt.state_dict()
    sd["state"]["param_states"]["0"]["mu"]["dense"]["bias"] = np.ones(3, np.int32)
    with pytest.raises(
        StateDictError, match=r"dense/bias: expected float32\[3\] \(float\), got int32\[3\] \(integer\)"
    ):
        opt.restore_state(sd)


def test_t5x_refuses_an_unexpected_entry():
    opt = t5x_optimizer()
    sd = opt.state_dict()
    sd["target"]["dense"]["extra"] = np.ones(3, np.float32)
    with pytest.raises(StateDictError) as err:
        opt.restore_state(sd)
    assert err.value.report.unexpected == ("target/dense/extra",)
