"""One optimizer step over the flat, named state: the pure function ``Optimizer.update`` runs.

:func:`flat_step` applies ``tx.update`` to ``{name: grad}`` and ``{name:
param}`` and returns a :class:`FlatStep`. Traced inline under a JAX
transformation; called eagerly, it runs one compiled program per
transformation and shapes, so an eager step costs one dispatch.
``Optimizer.init`` also fixes the state's dtypes here (:func:`stable_dtypes`),
so that the jitted step traces once.
"""

from treeopt._step.step_io import FlatStep as FlatStep
from treeopt._step.traced import flat_step as flat_step

__all__ = ["FlatStep", "flat_step"]
