"""The T5X surface follows the core's step rule: a negative step in a state dict is refused."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from treeopt.errors import StateDictError


@pytest.mark.parametrize("step", [-1, np.int32(-3)])
def test_t5x_restore_state_refuses_a_negative_step_as_the_core_does(step):
    from treeopt.t5x import optimizers

    opt = optimizers.sgd(learning_rate=0.5).create({"w": jnp.ones(2)})
    sd = opt.state_dict()
    sd["state"]["step"] = step
    with pytest.raises(StateDictError, match=r"state/step: expected a non-negative integer"):
        opt.restore_state(sd)
