"""treeopt.Optimizer: a PyTree that holds its own optax state.

The implementation lives in ``treeopt._optimizer``; this module is its face.
"""

from treeopt._compat.deprecations import moved_names
from treeopt._optimizer.optimizer import Optimizer as Optimizer

__all__ = ["Optimizer"]

__getattr__ = moved_names(__name__)
