"""Low-bit optimizer state (``state_bits=``): its codes, and which state is held in them.

- ``maps``: the non-linear maps of low-bit codes, as bit arithmetic.
- ``format``: the format of low-bit codes (bits, map, block layout) and
  where a shard may cut them.
- ``codec``: the block-wise 8- and 4-bit codes of state leaves, and their leaf.
- ``statistics``: which fields of an optax state are running statistics (the
  table the docs print).
- ``state``: which state leaves are held as codes, the codes around a step,
  and low-bit values in state dicts.
- ``legacy``: state dicts written before the format was recorded.

May import: ``treeopt._compat``, ``treeopt._tree``, ``treeopt._sharding``
(the spec contract a low-bit leaf answers to), ``treeopt.errors``,
``treeopt.typing``. It is handed the state and the layout
and returns state, never the optimizer; the step (``treeopt._step``) and the
state-dict engine (``treeopt._state``) build on it.

Its one face is this package: every other wing imports the names below from
``treeopt._lowbit``, never a module of it.
"""

from treeopt._lowbit.codec import describe_entry as describe_entry
from treeopt._lowbit.codec import is_quantized as is_quantized
from treeopt._lowbit.codec import quantize as quantize
from treeopt._lowbit.maps import levels as levels
from treeopt._lowbit.maps import looked_up as looked_up
from treeopt._lowbit.state import checked_state_bits as checked_state_bits
from treeopt._lowbit.state import constant_leaves as constant_leaves
from treeopt._lowbit.state import decoded as decoded
from treeopt._lowbit.state import encoded_after_step as encoded_after_step
from treeopt._lowbit.state import has_quantized as has_quantized
from treeopt._lowbit.state import in_target_form as in_target_form
from treeopt._lowbit.state import quantized_state as quantized_state
from treeopt._lowbit.statistics import FULL_PRECISION as FULL_PRECISION
from treeopt._lowbit.statistics import STATISTICS as STATISTICS
from treeopt._lowbit.statistics import transformations as transformations
