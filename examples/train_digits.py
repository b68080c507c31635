"""Train a small MLP on scikit-learn's digits with treeopt, through jax.jit.

Run: python examples/train_digits.py [--steps 600]
The dataset ships with scikit-learn, so nothing is downloaded.
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import trange

import treeopt


class MLP(nn.Module):
    hidden: int = 128

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(10)(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, random_state=0, stratify=digits.target
    )

    model = MLP()
    params = model.init(jax.random.key(0), x_train[:1])["params"]
    # Weight decay on kernels only, selected by name; the learning rate is injected
    # so it can be changed between steps without recompiling.
    # (static_args: a mask is a callable, which inject_hyperparams would otherwise
    # take for a schedule.)
    tx = optax.inject_hyperparams(optax.adamw, static_args="mask")(
        learning_rate=3e-3, weight_decay=1e-4, mask=treeopt.mask("*kernel")
    )
    opt = treeopt.Optimizer(tx).init(params)

    def loss_fn(params, x, y):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def train_step(params, opt, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        params = opt.update(grads, params)
        return params, opt, loss

    @jax.jit
    def accuracy(params, x, y):
        return jnp.mean(jnp.argmax(model.apply({"params": params}, x), -1) == y)

    rng = np.random.default_rng(0)
    bar = trange(args.steps, desc="training")
    for step in bar:
        if step == args.steps // 2:
            opt.learning_rate = 1e-3  # decay halfway through: same compiled step
        idx = rng.integers(0, len(x_train), args.batch_size)
        params, opt, loss = train_step(params, opt, x_train[idx], y_train[idx])
        if step % 50 == 0:
            bar.set_postfix(loss=f"{float(loss):.4f}", lr=f"{float(opt.learning_rate):.0e}")

    acc = float(accuracy(params, x_test, y_test))
    print(f"steps: {int(opt.step)}  test accuracy: {acc:.2%}")


if __name__ == "__main__":
    main()
