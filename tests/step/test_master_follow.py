"""Masters follow their params; and the small rules around the step count and load reports.

- A param changed behind the optimizer (weights loaded after ``init``, an nnx
  model written in place) wins at the next ``update``: its master is taken
  from it again, instead of the param being reverted to the stale master.
- A state dict without masters loaded with ``strict=False`` into a master
  optimizer keeps its fresh masters, but the trained params given at the next
  update win: they are not reset to their initial values.
- A ``master_dtype`` not wider than any trainable param is an error at ``init``.
- ``opt.step`` saturates at the int32 maximum instead of wrapping.
- A strict-load report lists at most ``MAX_LISTED`` paths per kind and says
  how many more it left out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treeopt
from treeopt.errors import MAX_LISTED, LoadReport, StateDictError

F32, BF16 = jnp.float32, jnp.bfloat16


def bf16_params():
    return {"w": jnp.linspace(0.5, 1.5, 8).astype(BF16), "b": jnp.full((4,), 0.75, BF16)}


def grads_like(params):
    return jax.tree.map(lambda p: jnp.full(p.shape, 0.5, p.dtype), params)


@jax.jit
def train_step(params, opt):
    return opt.update(grads_like(params), params), opt


def test_params_loaded_after_init_win_over_the_stale_masters():
    opt = treeopt.Optimizer(optax.sgd(1e-3), master_dtype=F32).init(bf16_params())
    loaded = {"w": jnp.full((8,), 3.0, BF16), "b": jnp.full((4,), -2.0, BF16)}
    params, opt = train_step(loaded, opt)
    np.testing.assert_allclose(np.asarray(opt.master["w"]), 3.0 - 5e-4, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(opt.master["b"]), -2.0 - 5e-4, rtol=1e-6)
    np.testing.assert_array_equal(params["w"], opt.master["w"].astype(BF16))


def test_params_the_step_returned_keep_their_masters_bits():
    opt = treeopt.Optimizer(optax.sgd(1e-4), master_dtype=F32).init(bf16_params())
    params = bf16_params()
    for _ in range(5):
        params, opt = train_step(params, opt)
    # a step of 5e-5 per update is below bfloat16's spacing: only the masters hold it
    np.testing.assert_allclose(opt.master["b"], 0.75 - 5 * 5e-5, rtol=1e-6)
    assert np.all(np.asarray(params["b"]) == np.asarray(opt.master["b"].astype(BF16)))


def test_an_nnx_kernel_written_in_place_wins():
    from flax import nnx

    model = nnx.Linear(8, 4, param_dtype=BF16, rngs=nnx.Rngs(0))
    opt = treeopt.Optimizer(optax.sgd(1e-3), master_dtype=F32).init(model)
    model.kernel[...] = jnp.full((8, 4), 2.0, BF16)
    grads = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
    opt.update(grads, model)
    np.testing.assert_array_equal(np.asarray(model.kernel[...], np.float32), 2.0)
    np.testing.assert_array_equal(opt.master["kernel"], 2.0)


def test_a_non_strict_load_without_masters_does_not_reset_the_trained_params():
    init = bf16_params()
    trainer = treeopt.Optimizer(optax.adam(1e-2), master_dtype=F32).init(init)
    params = init
    for _ in range(20):
        params, trainer = train_step(params, trainer)
    sd = trainer.state_dict()
    del sd["master"]
    fresh = treeopt.Optimizer(optax.adam(1e-2), master_dtype=F32).init(init)
    with pytest.warns(UserWarning):
        resumed = fresh.load_state_dict(sd, strict=False)
    new_params, resumed = train_step(params, resumed)
    moved = np.abs(np.asarray(new_params["w"], np.float32) - np.asarray(params["w"], np.float32))
    assert moved.max() < 0.05  # one more adam step of 1e-2, not back to init
    back = np.abs(np.asarray(new_params["w"], np.float32) - np.asarray(init["w"], np.float32))
    assert back.min() > 0.1


def test_a_master_dtype_not_wider_than_any_param_is_an_error_naming_both():
    with pytest.raises(ValueError, match=r"master_dtype=bfloat16 is not wider.*bfloat16"):
        treeopt.Optimizer(optax.sgd(0.1), master_dtype=BF16).init(bf16_params())
    with pytest.raises(ValueError, match=r"master_dtype=float32 is not wider.*float32"):
        treeopt.Optimizer(optax.sgd(0.1), master_dtype=F32).init({"w": jnp.ones(2)})
    # one narrower param is enough; an integer-only tree has nothing to warn about
    opt = treeopt.Optimizer(optax.sgd(0.1), master_dtype=F32).init({"w": jnp.ones(2), "b": jnp.ones(2, BF16)})
    assert sorted(opt.master) == ["b"]


def test_the_step_count_saturates_at_the_int32_maximum():
    params = {"w": jnp.ones(2)}
    opt = treeopt.Optimizer(optax.sgd(0.1)).init(params)
    sd = opt.state_dict()
    sd["step"] = np.int32(2**31 - 2)
    opt = opt.load_state_dict(sd)
    for _ in range(3):
        params, opt = train_step(params, opt)
        assert int(opt.step) == 2**31 - 1
    assert opt.step.dtype == jnp.int32


def test_a_report_of_many_paths_is_capped_and_says_how_many_it_left_out():
    report = LoadReport(unexpected=tuple(f"extra/{i}" for i in range(300_000)))
    text = report.problems()
    assert len(text) < 20_000
    assert text.splitlines()[0] == "unexpected (300000):"
    assert f"... and {300_000 - MAX_LISTED} more (all of them in the report's .unexpected)" in text
    opt = treeopt.Optimizer(optax.sgd(0.1)).init({"w": jnp.ones(2)})
    sd = opt.state_dict()
    sd["opt_state"] = {**sd["opt_state"], **{f"x{i}": np.zeros(()) for i in range(3000)}}
    with pytest.raises(StateDictError) as err:
        opt.load_state_dict(sd)
    assert len(str(err.value)) < 20_000 and "more (all of them" in str(err.value)
    assert len(err.value.report.unexpected) == 3000
