"""The task on which a way of holding the state or the params is measured: a teacher-student regression.

A student fits a fixed teacher over fresh minibatches ``x ~ N(0, 1)``, one
batch per step (step ``i`` always draws the same batch, so two runs from the
same state see the same data). Each test module brings its model (params and
``loss_fn``) and keeps its numbers; this module trains it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np


class TeacherStudent:
    """Trains ``loss_fn(params, x)`` with an optimizer, one jitted step per minibatch of ``batch_size`` rows."""

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], Any],
        make_params: Callable[[], Any],
        d_in: int,
        batch_size: int,
        steps: int,
    ):
        self.loss_fn, self.make_params = loss_fn, make_params
        self.d_in, self.batch_size, self.steps = d_in, batch_size, steps
        self.step = jax.jit(self._step)

    def batch(self, i: Any) -> jax.Array:
        """The minibatch of step ``i``."""
        return jax.random.normal(jax.random.fold_in(jax.random.key(1), i), (self.batch_size, self.d_in))

    def _step(self, params: Any, opt: Any, i: Any) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(self.loss_fn)(params, self.batch(i))
        return opt.update(grads, params), opt, loss

    def train(
        self, opt: Any, params: Any = None, steps: int | None = None, start: int = 0
    ) -> tuple[Any, Any, list[float]]:
        """``(params, opt, losses)`` after ``steps`` steps (the task's count) from step ``start``; fresh params by default."""
        params = self.make_params() if params is None else params
        losses = []
        for i in range(start, start + (self.steps if steps is None else steps)):
            params, opt, loss = self.step(params, opt, i)
            losses.append(float(loss))
        return params, opt, losses


def final_loss(losses: list[float]) -> float:
    """The mean loss of the last 100 steps: one run's minibatch noise averages out."""
    return float(np.mean(losses[-100:]))
