"""The optimizer's partition specs: a ``PartitionSpec`` for each of its leaves, from the params' specs.

:class:`Partitioned` is a base of :class:`treeopt.Optimizer`. The sharding
wing derives the specs of the state's parts (:mod:`treeopt._sharding.optimizer_specs`),
with ZeRO-1 where the state's children allow it (:mod:`treeopt._tree.children`),
and the optimizer is rebuilt holding them, child by child, by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import jax

from treeopt._optimizer.parts import HoldsState, state_parts, with_state_parts
from treeopt._sharding.optimizer_specs import optimizer_state_specs
from treeopt._step.viewed import over_names
from treeopt.typing import ParamSpecs

__all__ = ["Partitioned"]


class Partitioned:
    """``partition_specs`` of an optimizer (its ``tx``, ``owned`` rules, layout and state).

    Example:
        >>> import jax, jax.numpy as jnp, optax, treeopt
        >>> opt = treeopt.Optimizer(optax.sgd(0.1)).init({"w": jnp.ones(2)})
        >>> isinstance(opt, Partitioned), opt.partition_specs({"w": None}).step == jax.sharding.PartitionSpec()
        (True, True)
    """

    __slots__ = ()

    if TYPE_CHECKING:
        tx: Any
        owned: Any

        @property
        def layout(self) -> Any: ...

    def partition_specs(
        self,
        param_specs: ParamSpecs,
        *,
        shard_state_over: str | Sequence[str] | None = None,
        mesh: jax.sharding.Mesh | None = None,
    ) -> Any:
        """A ``PartitionSpec`` for every leaf of this optimizer, from the params' specs.

        Works for any optax transformation, with no table of state types: a
        state leaf shaped like its param gets the param's spec; a factored leaf
        (Adafactor ``v_row``/``v_col``, SM3 per-dimension accumulators) gets it
        with the reduced axes dropped; counts, scalars, RNG keys,
        hyperparameters and ``(1,)`` placeholders get ``P()``. Also works on an
        abstract optimizer from ``jax.eval_shape(opt.init, params)``.

        With ``shard_state_over`` (ZeRO-1) every floating-point state leaf that
        belongs to a parameter also gets those mesh axes, on its largest
        dimension that is not sharded yet and that their size divides; a leaf
        that already uses them (FSDP), or has no such dimension, keeps its spec.
        :func:`treeopt.partitioning.zero_report` lists what was split and why
        the rest was not.

        Args:
            param_specs: a tree shaped like the params given to ``init`` (or the
                flat ``{name: spec}`` dict), with a ``PartitionSpec`` (mesh axes or
                logical axis names) or ``None`` (replicated) at each parameter.
            shard_state_over: a mesh axis name, or a tuple of them, to split the
                state over as well (the data-parallel axis); ``None`` (the
                default) lays the state out exactly like the params.
            mesh: the ``jax.sharding.Mesh``; needed with ``shard_state_over``
                (its axis sizes decide what divides). When given, the specs'
                axes are checked against it.

        Returns:
            An Optimizer-shaped tree (same static data) whose leaves are
            ``PartitionSpec``s: ``P()`` for ``step``, then one per state leaf.
            Use it (or :func:`treeopt.partitioning.named_shardings` of it) as
            ``in_shardings``/``out_shardings`` of ``jax.jit``, for this optimizer
            (or one over the same ``tx`` object: jit compares the static data).

        Example:
            >>> import jax, jax.numpy as jnp, numpy as np, optax, treeopt
            >>> from jax.sharding import Mesh, PartitionSpec as P
            >>> params = {"dense": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)}}
            >>> opt = treeopt.Optimizer(optax.adafactor(1e-2, min_dim_size_to_factor=2)).init(params)
            >>> specs = opt.partition_specs({"dense": {"kernel": P("data", "model"), "bias": P("model")}})
            >>> tuple(specs.opt_state[0].v_row["dense/kernel"]), tuple(specs.opt_state[0].v_col["dense/kernel"])
            (('data',), ('model',))
            >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
            >>> opt = treeopt.Optimizer(optax.adam(1e-3)).init(params)
            >>> zero = opt.partition_specs({"dense": {"kernel": P(None, "model"), "bias": P()}},
            ...                            shard_state_over="data", mesh=mesh)
            >>> zero.opt_state[0].mu["dense/kernel"] == P("data", "model"), zero.opt_state[0].count == P()
            (True, True)
        """
        layout, held = self.layout, state_parts(cast(HoldsState, self))
        specs = optimizer_state_specs(
            held.by_part(), layout, param_specs, shard_state_over=shard_state_over, mesh=mesh,
            tx=over_names(self.tx, layout), owned=self.owned, unsplit=held.unsplit_parts(),
        )  # fmt: skip
        return with_state_parts(self, held.from_parts(specs, step=jax.sharding.PartitionSpec()))
