"""The end of a run: the manager knows its own saves in flight.

docs/resume.md ends a run with a forced save of the final step unless
``latest_step()`` already is it. With orbax's default asynchronous save the
last ``save`` is usually still being written when the loop ends; the manager
must wait for it rather than call it incomplete, report the step before it,
and then refuse the forced save with ``StepAlreadyExistsError``. The run is a
real child process (the timing of a background write is what matters), with
a state large enough (about 24 MB a save) that its write is still under way
when the next call comes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

import treeopt
import treeopt.checkpoint

REPO = str(Path(__file__).resolve().parents[2])
N = 2_000_000

RUN = textwrap.dedent(
    """
    import sys, warnings
    import jax.numpy as jnp, optax, treeopt, treeopt.checkpoint

    warnings.simplefilter("error")  # "... is not a complete checkpoint" fails the run
    directory, final = sys.argv[1], 40
    params = {"w": jnp.zeros((N,))}
    opt = treeopt.Optimizer(optax.adam(1e-3)).init(params)
    with treeopt.checkpoint.CheckpointManager(directory, save_interval_steps=5) as manager:
        for step in range(1, final + 1):
            params = opt.update({"w": jnp.full((N,), 1e-3 * step)}, params)
            manager.save(int(opt.step), opt, params)
        # The recipe of docs/resume.md, right after the last save.
        latest = manager.latest_step()
        if latest != int(opt.step):
            manager.save(int(opt.step), opt, params, force=True)
        print("latest", latest, "steps", list(manager.all_steps()), flush=True)
    """
)


def test_latest_step_waits_for_the_save_in_flight(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO, "XLA_FLAGS": ""}
    directory = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", f"N = {N}\n" + RUN, str(directory)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "latest 40 steps [" in done.stdout, done.stdout
    assert "not a complete checkpoint" not in done.stderr, done.stderr

    target = jax.eval_shape(treeopt.Optimizer(optax.adam(1e-3)).init, {"w": jnp.zeros((N,))})
    with treeopt.checkpoint.CheckpointManager(directory) as manager:
        assert manager.latest_step() == 40
        assert int(manager.restore(target).step) == 40


def test_restore_and_all_steps_wait_for_own_saves(tmp_path):
    params = {"w": jnp.zeros((N,))}
    opt = treeopt.Optimizer(optax.adam(1e-3)).init(params)
    target = jax.eval_shape(treeopt.Optimizer(optax.adam(1e-3)).init, params)
    with treeopt.checkpoint.CheckpointManager(tmp_path / "run") as manager:
        for step in range(3):
            params = opt.update({"w": jnp.ones((N,))}, params)
            manager.save(step + 1, opt, params)
            assert list(manager.all_steps())[-1] == step + 1  # the save just made, waited for
        manager.save(4, opt, params, force=True)
        assert int(manager.restore(target, step=4).step) == 3
