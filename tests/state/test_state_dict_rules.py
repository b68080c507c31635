"""One rule for steps in state dicts and checkpoints; donated optimizers say so.

- A negative ``"step"`` is refused by ``load_state_dict`` and ``warm_start``
  as ``CheckpointManager.save`` refuses a negative step: a non-negative
  integer, in both.
- An optimizer whose buffers were donated to a jitted step raises
  ``DonatedOptimizerError`` (saying to use the optimizer the step returned)
  from ``update`` and ``state_dict()``, instead of JAX's "Array has been
  deleted", and its repr says it was donated; the returned optimizer works.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treeopt
from treeopt import checkpoint
from treeopt.errors import DonatedOptimizerError, StateDictError

PARAMS = {"w": jnp.ones(3)}
GRADS = {"w": jnp.ones(3)}


def fresh():
    return treeopt.Optimizer(optax.adam(0.1)).init(PARAMS)


@pytest.mark.parametrize("step", [-5, np.int32(-1), jnp.asarray(-7, jnp.int32)])
def test_a_negative_step_loads_nowhere_as_it_saves_nowhere(tmp_path, step):
    opt = fresh()
    sd = opt.state_dict()
    sd["step"] = step
    value = int(step)
    for strict in (True, False):
        with pytest.raises(StateDictError, match=rf"step: expected a non-negative integer .*, got {value}"):
            opt.load_state_dict(sd, strict=strict)
    with pytest.raises(StateDictError, match="non-negative integer"):
        treeopt.serialization.warm_start(opt, sd)
    with checkpoint.CheckpointManager(tmp_path, enable_async_checkpointing=False) as manager:
        with pytest.raises(ValueError, match=f"must be a non-negative integer, got {value}"):
            manager.save(step, opt)
    sd["step"] = 0  # the rule's edge, in both
    assert int(opt.load_state_dict(sd).step) == 0
    with checkpoint.CheckpointManager(tmp_path, enable_async_checkpointing=False) as manager:
        assert manager.save(sd["step"], opt)


def donated_step():
    @jax.jit
    def train_step(params, opt):
        return opt.update(GRADS, params), opt

    return jax.jit(train_step, donate_argnums=(1,))


def test_a_donated_optimizer_says_so_and_the_returned_one_works():
    opt = fresh()
    params, new_opt = donated_step()(PARAMS, opt)
    with pytest.raises(DonatedOptimizerError, match="use the optimizer that step returned"):
        opt.update(GRADS, params)
    with pytest.raises(DonatedOptimizerError, match=r"buffers were donated to a jitted step"):
        opt.state_dict()
    assert "step=donated" in repr(opt)
    assert int(new_opt.step) == 1 and "step=1" in repr(new_opt)
    new_opt.update(GRADS, params)
    assert int(new_opt.state_dict()["step"]) == 2


def test_an_optimizer_that_was_not_donated_keeps_working_after_a_step():
    opt = fresh()
    jax.jit(lambda params, opt: (opt.update(GRADS, params), opt))(PARAMS, opt)  # no donation
    assert int(opt.state_dict()["step"]) == 0
    opt.update(GRADS, PARAMS)
    assert int(opt.step) == 1
