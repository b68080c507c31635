"""treeopt benchmark suite: treeopt side by side with raw optax, flax.nnx and flax TrainState.

Run every case with ``python -m benchmarks.run`` (``--quick`` for the headline ratios, ``--smoke`` to check that it runs);
see ``docs/benchmarks.md`` for what each case measures and the figures.
"""
