"""The models every case trains: a deep tanh MLP, as a params pytree and as an nnx Module.

Both forms hold the same numbers and compute the same loss, so every variant of
a case runs the same math and only the optimizer plumbing differs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import treeopt

OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=1e-4),
    "adafactor": lambda: optax.adafactor(1e-3),
    "sgd+momentum": lambda: optax.sgd(1e-3, momentum=0.9),
}


def optax_update(tx: optax.GradientTransformation) -> Callable[..., Any]:
    """One raw optax step over ``(params, grads, opt_state)``: the baseline of the update-only cases."""

    def update(params: Any, grads: Any, opt_state: Any) -> Any:
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return update


def treeopt_update(params: Any, grads: Any, opt: treeopt.Optimizer) -> Any:
    """The same step with a ``treeopt.Optimizer`` in place of the optax state."""
    return opt.update(grads, params), opt


def make_tx(name: str) -> optax.GradientTransformation:
    """The optax transformation a case calls ``name``."""
    return OPTIMIZERS[name]()


def mlp_params(n_layers: int, width: int, seed: int = 0) -> dict[str, Any]:
    """``{"layers": [{"kernel": (width, width), "bias": (width,)}, ...]}``: ``2 * n_layers`` leaves."""
    rng = np.random.default_rng(seed)
    scale = 1.0 / np.sqrt(width)
    return {
        "layers": [
            {
                "kernel": jnp.asarray(rng.standard_normal((width, width), np.float32) * scale),
                "bias": jnp.zeros((width,), jnp.float32),
            }
            for _ in range(n_layers)
        ]
    }


def mlp_loss(params: dict[str, Any], x: jax.Array) -> jax.Array:
    """Mean square of the MLP's output: a cheap scalar loss with a gradient for every leaf."""
    for layer in params["layers"]:
        x = jnp.tanh(x @ layer["kernel"] + layer["bias"])
    return jnp.mean(x**2)


def batch(width: int, rows: int, seed: int = 1) -> jax.Array:
    """A fixed input batch."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal((rows, width), np.float32))


def tiny_leaves(n_leaves: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(params, grads)`` with ``n_leaves`` tiny leaves, shaped like :func:`mlp_params`."""
    layers = [
        {"kernel": jnp.full((2, 2), 0.01, jnp.float32), "bias": jnp.zeros((2,), jnp.float32)}
        for _ in range(n_leaves // 2)
    ]
    params = {"layers": layers}
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.1), params)
    return params, grads


def nnx_mlp(params: dict[str, Any]) -> Any:
    """An ``nnx.Module`` holding (copies of) ``params``, whose ``loss`` matches :func:`mlp_loss`."""
    from flax import nnx

    class Dense(nnx.Module):
        def __init__(self, kernel: jax.Array, bias: jax.Array):
            self.kernel = nnx.Param(kernel.copy())
            self.bias = nnx.Param(bias.copy())

        def __call__(self, x: jax.Array) -> jax.Array:
            return jnp.tanh(x @ self.kernel[...] + self.bias[...])

    class MLP(nnx.Module):
        def __init__(self, layers: list[dict[str, jax.Array]]):
            self.layers = nnx.List([Dense(layer["kernel"], layer["bias"]) for layer in layers])

        def loss(self, x: jax.Array) -> jax.Array:
            for layer in self.layers:
                x = layer(x)
            return jnp.mean(x**2)

    return MLP(params["layers"])


def nnx_bn_mlp(n_blocks: int, width: int, seed: int = 0) -> Any:
    """An ``nnx.Module``: ``n_blocks`` x (Linear, BatchNorm, relu, Dropout) and a Linear head.

    Its forward pass in training mode moves BatchNorm's running statistics and
    Dropout's RNG count, so a training loop must carry that non-Param state.
    Built from ``seed`` alone: two calls give the same numbers.
    """
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.linear = nnx.Linear(width, width, rngs=rngs)
            self.norm = nnx.BatchNorm(width, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.drop(nnx.relu(self.norm(self.linear(x))))

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(n_blocks)])
            self.head = nnx.Linear(width, 1, rngs=rngs)

        def loss(self, x: jax.Array) -> jax.Array:
            for block in self.blocks:
                x = block(x)
            return jnp.mean((self.head(x) - 1.0) ** 2)

    return Net(nnx.Rngs(seed, dropout=seed + 1))


def nnx_optimizer_split_merge(
    model: Any, tx: optax.GradientTransformation, optimizer_type: Any = None
) -> tuple[Callable[..., Any], Any]:
    """``(step, state)``: ``nnx.Optimizer`` over ``model``, split once, merged inside ``jax.jit`` (donated).

    ``step(state, x)`` returns ``(state, loss)``, the way an nnx user writes a
    ``jax.jit`` loop with ``nnx.split`` / ``nnx.merge``. ``optimizer_type``
    replaces ``nnx.Optimizer`` (``treeopt.nnx.Optimizer``, its drop-in).
    """
    from flax import nnx

    optimizer = (optimizer_type or nnx.Optimizer)(model, tx, wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def split_merge_step(state: Any, x: jax.Array) -> Any:
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: m.loss(x))(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return jax.jit(split_merge_step, donate_argnums=(0,)), state
