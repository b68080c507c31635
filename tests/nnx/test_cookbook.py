"""flax's optimization cookbook through the drop-in: ``tx`` sees an ``nnx.State``, and ``optimizer_sharding`` is honoured.

The recipes are restated here with a model and data of our own; each runs
through ``nnx.Optimizer`` and through ``treeopt.nnx.Optimizer`` in the same
process, and the losses must agree (rtol 1e-5), with the state laid out as
``nnx.Optimizer`` lays it out.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import treeopt.nnx

from _helpers import device_mesh

# A tree with every nnx Variable replaced by its value (nnx.pure before flax 0.12.7).
as_pure = getattr(nnx, "as_pure", None) or nnx.pure

RTOL = 1e-5


LECUN_NORMAL = jax.nn.initializers.lecun_normal()


def _model(rngs: nnx.Rngs, init: Any = LECUN_NORMAL) -> nnx.Module:
    return nnx.Sequential(
        nnx.Linear(2, 8, rngs=rngs, kernel_init=init),
        nnx.Linear(8, 8, rngs=rngs, kernel_init=init),
    )


def _loss(model: nnx.Module, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


def _data() -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(7))
    return jax.random.normal(kx, (16, 2)), jax.random.normal(ky, (16, 8))


def _train(
    optimizer_class: Any, make_tx: Any, steps: int = 8, init: Any = None, reshard: bool = False
) -> tuple:
    model = _model(nnx.Rngs(3), *(() if init is None else (init,)))
    optimizer = optimizer_class(model, make_tx(model), wrt=nnx.Param)

    @nnx.jit
    def step(model: Any, optimizer: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        loss, grads = nnx.value_and_grad(_loss)(model, x, y)
        optimizer.update(model, grads)
        return loss

    x, y = _data()
    losses = []
    for _ in range(steps):
        losses.append(float(step(model, optimizer, x, y)))
        if reshard:
            model = jax.sharding.reshard(model, P())
    return np.array(losses), model, optimizer


def test_per_parameter_learning_rates_from_map_state() -> None:
    def make_tx(model: Any) -> optax.GradientTransformation:
        kinds = nnx.map_state(lambda path, _: list(path)[-1], nnx.state(model, nnx.Param))
        return optax.partition({"kernel": optax.adam(1e-3), "bias": optax.adam(1e-1)}, kinds)

    expected, _, _ = _train(nnx.Optimizer, make_tx)
    got, _, optimizer = _train(treeopt.nnx.Optimizer, make_tx)
    np.testing.assert_allclose(got, expected, rtol=RTOL)
    # Two rates, two sets of moments: the kernels' under "kernel", the biases' under "bias", keyed by name.
    inner = optimizer.opt_state.inner_states
    kernel_mu, bias_mu = inner["kernel"].inner_state[0].mu, inner["bias"].inner_state[0].mu
    assert isinstance(kernel_mu["layers/0/bias"], optax.MaskedNode) and kernel_mu["layers/0/kernel"][
        ...
    ].shape == (2, 8)
    assert (
        isinstance(bias_mu["layers/0/kernel"], optax.MaskedNode)
        and float(jnp.abs(bias_mu["layers/0/bias"][...]).max()) > 0
    )


def _sharded_spec(value: Any) -> P:
    sharding = value.sharding
    return sharding.spec if isinstance(sharding, NamedSharding) else P()


@pytest.mark.parametrize("axes", ["explicit", "auto"])
def test_optimizer_sharding_metadata_lays_out_the_state_as_nnx_does(axes: str) -> None:
    mesh = device_mesh((2, 4), ("x", "y"), axes)
    init = nnx.with_metadata(jax.nn.initializers.lecun_normal(), optimizer_sharding=P("x", "y"))
    with jax.set_mesh(mesh):
        expected, _, theirs = _train(
            nnx.Optimizer, lambda m: optax.adam(1e-2), init=init, reshard=axes == "explicit"
        )
        got, model, ours = _train(
            treeopt.nnx.Optimizer, lambda m: optax.adam(1e-2), init=init, reshard=axes == "explicit"
        )
    np.testing.assert_allclose(got, expected, rtol=RTOL)
    for i in (0, 1):
        their_mu = theirs.opt_state[0][1].layers[i]["kernel"][...]
        our_mu = ours.opt_state[0].mu[f"layers/{i}/kernel"][...]
        assert _sharded_spec(their_mu) == P("x", "y")
        assert _sharded_spec(our_mu) == _sharded_spec(their_mu)
        assert our_mu.addressable_shards[0].data.shape == their_mu.addressable_shards[0].data.shape
        assert _sharded_spec(model.layers[i].kernel[...]) in (P(), P(None, None))  # the params stay whole
    assert ours.optimizer_sharding == (("layers/0/kernel", P("x", "y")), ("layers/1/kernel", P("x", "y")))


def test_optimizer_sharding_with_shard_state_over() -> None:
    mesh = device_mesh((2, 4), ("data", "model"), "default")
    init = nnx.with_metadata(jax.nn.initializers.lecun_normal(), optimizer_sharding=P(None, "model"))
    with jax.set_mesh(mesh):
        model = _model(nnx.Rngs(3), init)
        optimizer = treeopt.nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    specs = optimizer.partition_specs(
        jax.tree.map(lambda _: P(), as_pure(nnx.state(model, nnx.Param))),
        shard_state_over="data",
        mesh=mesh,
    )
    # The kernels' moments: their optimizer_sharding, and ZeRO's data axis on the dimension left free.
    assert specs.opt_state[0].mu["layers/1/kernel"] == P("data", "model")
    # The biases have none: their params' spec, and ZeRO's axis.
    assert specs.opt_state[0].mu["layers/1/bias"] == P("data")
    # Without optimizer_sharding the kernels' state would follow their replicated params.
    plain = treeopt.Optimizer(optax.adam(1e-2)).init(as_pure(nnx.state(model, nnx.Param)))
    assert (
        plain.partition_specs(jax.tree.map(lambda _: P(), as_pure(nnx.state(model, nnx.Param))))
        .opt_state[0]
        .mu["layers/1/kernel"]
        == P()
    )
