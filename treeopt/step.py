"""One optimizer step over the flat, named state: the pure function ``Optimizer.update`` runs.

:func:`flat_step` applies ``tx.update`` to ``{name: grad}`` and ``{name:
param}`` and returns a :class:`FlatStep`. Traced inline under a JAX
transformation; called eagerly, it runs one compiled program per
transformation and shapes, so an eager step costs one dispatch.
The params' precision (master weights, Kahan or stochastic rounding) comes
in as ``precision=`` and ``precision_state=``; low-bit state is read as floats
and encoded again around ``tx.update``. The implementation lives in
``treeopt._step``.
"""

from treeopt._step.step_io import FlatStep as FlatStep
from treeopt._step.traced import flat_step as flat_step

__all__ = ["FlatStep", "flat_step"]
