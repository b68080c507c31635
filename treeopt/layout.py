"""Where the trainable leaves of a params tree are, and their names: ``opt.layout``.

Code built on the core (``treeopt.t5x``) flattens params to the flat, named
dict and re-nests them exactly as an optimizer does, through its layout.

Example:
    >>> import jax.numpy as jnp
    >>> from treeopt.layout import ParamLayout
    >>> layout = ParamLayout.of({"dense": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}})
    >>> layout.names
    ('dense/bias', 'dense/kernel')
"""

from treeopt._tree.layout import Flattened as Flattened
from treeopt._tree.layout import ParamLayout as ParamLayout
from treeopt._tree.layout import Wrt as Wrt

__all__ = ["Flattened", "ParamLayout", "Wrt"]
