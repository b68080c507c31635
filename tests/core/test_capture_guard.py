"""An optimizer captured by a closure inside a transformation is refused, and stays usable."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treeopt

PARAMS = {"w": jnp.array([1.0, -2.0, 3.0])}
GRADS = {"w": jnp.array([0.5, 0.5, -1.0])}


def fresh():
    return treeopt.Optimizer(optax.adam(0.1)).init(PARAMS)


CAPTURES = {
    "jit, concrete grads, traced params": lambda opt: jax.jit(lambda p: opt.update(GRADS, p))(PARAMS),
    "jit, everything closed over": lambda opt: jax.jit(lambda: opt.update(GRADS, PARAMS))(),
    "jit, traced grads": lambda opt: jax.jit(lambda g: opt.update(g, PARAMS))(GRADS),
    "lax.scan body": lambda opt: jax.lax.scan(
        lambda p, _: (opt.update(GRADS, p), None), PARAMS, jnp.arange(3)
    ),
    "vmap, nothing batched reaches update": lambda opt: jax.vmap(
        lambda x: opt.update(GRADS, PARAMS)["w"] * x
    )(jnp.ones(4)),
    "vmap over grads": lambda opt: jax.vmap(lambda g: opt.update({"w": g}, PARAMS))(jnp.ones((4, 3))),
    "grad inside vmap, params batched": lambda opt: jax.vmap(
        jax.grad(lambda p: jnp.sum(opt.update(GRADS, {"w": p})["w"]))
    )(jnp.ones((2, 3))),
    "extra argument traced": lambda opt: jax.jit(
        lambda v: opt.update(GRADS, PARAMS, apply_updates=True, **{"value": v})
    )(1.0),
}


@pytest.mark.parametrize("capture", list(CAPTURES), ids=list(CAPTURES))
def test_captured_optimizer_is_refused_and_left_untouched(capture):
    opt = fresh()
    before = jax.tree.map(np.asarray, opt.state_dict())
    with pytest.raises(RuntimeError, match="not passed into it"):
        CAPTURES[capture](opt)
    # Nothing leaked: the state is the one it had, concrete, and the optimizer still steps.
    after = jax.tree.map(np.asarray, opt.state_dict())
    jax.tree.map(np.testing.assert_array_equal, after, before)
    assert not isinstance(opt.step, jax.core.Tracer)
    new = opt.update(GRADS, PARAMS)
    assert int(opt.step) == 1
    reference = fresh()
    np.testing.assert_array_equal(new["w"], reference.update(GRADS, PARAMS)["w"])


def test_inner_jit_over_an_outer_traced_optimizer_gets_treeopts_error():
    @jax.jit
    def outer(opt, params):
        return jax.jit(lambda p: opt.update(GRADS, p))(params), opt

    with pytest.raises(RuntimeError, match="inner JAX transformation"):
        outer(fresh(), PARAMS)


def test_scan_inside_jit_outer_lax_scan_capture_is_refused():
    @jax.jit
    def outer(opt, params):
        params, _ = jax.lax.scan(lambda p, _: (opt.update(GRADS, p), None), params, jnp.arange(2))
        return params, opt

    with pytest.raises(RuntimeError, match="inner JAX transformation"):
        outer(fresh(), PARAMS)


def test_optimizer_carried_through_scan_and_vmapped_optimizers_still_work():
    @jax.jit
    def three_steps(opt, params):
        def body(carry, _):
            opt, params = carry
            return (opt, opt.update(GRADS, params)), None

        (opt, params), _ = jax.lax.scan(body, (opt, params), jnp.arange(3))
        return opt, params

    opt, params = three_steps(fresh(), PARAMS)
    reference, ref_params = fresh(), PARAMS
    for _ in range(3):
        ref_params = reference.update(GRADS, ref_params)
    assert int(opt.step) == 3
    np.testing.assert_allclose(params["w"], ref_params["w"], rtol=1e-6)

    batch = jax.vmap(lambda p: treeopt.Optimizer(optax.sgd(0.1)).init(p))({"w": jnp.ones((2, 3))})

    def step(opt, p):
        return opt.update({"w": jnp.ones(3)}, p), opt

    new_params, batch = jax.vmap(step)(batch, {"w": jnp.ones((2, 3))})
    np.testing.assert_allclose(new_params["w"], 0.9)
    np.testing.assert_array_equal(batch.step, [1, 1])


def test_grad_of_a_function_that_builds_and_updates_its_optimizer_still_works():
    def loss(params):
        opt = fresh()
        new = opt.update(jax.tree.map(lambda x: 2 * x, params), params)
        return jnp.sum(new["w"] ** 2)

    def raw_loss(params):
        tx = optax.adam(0.1)
        updates, _ = tx.update(jax.tree.map(lambda x: 2 * x, params), tx.init(params), params)
        return jnp.sum(optax.apply_updates(params, updates)["w"] ** 2)

    grads = jax.grad(loss)(PARAMS)
    # Adam's first step moves each param by 0.1 against its gradient's sign, [1, -2, 3] to
    # [0.9, -1.9, 2.9]; that step's own derivative is about eps / |g|: the gradient is 2 * new.
    np.testing.assert_allclose(grads["w"], [1.8, -3.8, 5.8], rtol=1e-6)
    np.testing.assert_allclose(grads["w"], jax.grad(raw_loss)(PARAMS)["w"], rtol=1e-6)
