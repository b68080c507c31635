"""Typed PRNG keys as state-dict leaves: their ``uint32`` key data, and back.

State dicts, checkpoints and checksums hold plain arrays, so a typed key
(``jax.random.key``, as ``optax.noisy_sgd`` keeps in its state) is written as
its key data and wrapped back with the template leaf's key implementation on
load. Abstract keys (``ShapeDtypeStruct``) map to abstract key data.
"""

from treeopt._state.keys import is_key as is_key
from treeopt._state.keys import key_data as key_data
from treeopt._state.keys import wrap_key_like as wrap_key_like

__all__ = ["is_key", "key_data", "wrap_key_like"]
