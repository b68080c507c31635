"""float8 params at the top of their range: saturated at the largest finite value, never NaN or infinite.

float8_e4m3fn has no infinity (a cast past 448 gives NaN) and float8_e5m2
overflows to an infinity no later step comes back from. Every way a param is
held (as it is, master weights, Kahan, stochastic rounding) saturates instead,
and a param held with a wider value moves back down once its gradient turns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treeopt

HELD = {
    "as is": {},
    "master": {"master_dtype": jnp.float32},
    "kahan": {"param_rounding": "kahan"},
    "stochastic": {"param_rounding": "stochastic"},
}


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("held", sorted(HELD))
def test_saturates_at_the_largest_value_and_turns_back(dtype, held):
    top = float(jnp.finfo(dtype).max)
    params = {"w": jnp.full(8, top * 0.98, dtype)}
    opt = treeopt.Optimizer(optax.adam(top / 8), **HELD[held]).init(params)

    @jax.jit
    def step(params, opt, sign):
        return opt.update({"w": jnp.full(8, sign, dtype)}, params), opt

    seen = []
    for i in range(60):  # pushed up for 20 steps, then down for 40
        params, opt = step(params, opt, -1.0 if i < 20 else 1.0)
        seen.append(np.asarray(params["w"].astype(jnp.float32)))
    seen = np.stack(seen)
    assert np.isfinite(seen).all()
    np.testing.assert_array_equal(seen[10:20], top)  # saturated, not NaN, not infinite
    if held != "as is":  # a wider value behind the param: it comes back down (as is, adam's step rounds away)
        assert (seen[-1] < top).all()
    held_values = [x for x in jax.tree.leaves(opt.precision_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert all(np.isfinite(np.asarray(x.astype(jnp.float32))).all() for x in held_values)


def test_the_issue_reproduction_stays_at_448():
    params = {"w": jnp.full(8, 440.0, jnp.float8_e4m3fn)}
    opt = treeopt.Optimizer(optax.adam(1.0), master_dtype=jnp.float32).init(params)
    for _ in range(20):
        params = opt.update({"w": -jnp.ones(8, jnp.float8_e4m3fn)}, params)
    assert np.asarray(params["w"].astype(jnp.float32)).tolist() == [448.0] * 8
    assert float(opt.master["w"].max()) == 448.0
