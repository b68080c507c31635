"""A manager's own saves in flight: seen by its reads, kept whole under threads, never removed by another.

Orbax commits an asynchronous save in the background by renaming its
temporary directory into place. The ``held_commits`` fixture holds that
rename until the test lets it go, so a save is surely still in flight when
the next call comes, without a large state or a sleep to make it so.

- ``restore``, ``restore_state_dict``, ``latest_step`` and ``all_steps``
  right after ``save`` wait for the step in flight and see it, and the
  manager's steps stay right afterwards.
- Saves from several threads through one manager are serialized: every save
  that returned True is on disk after ``wait_until_finished``.
- A writer whose lock file was removed by hand, while a second writer saves,
  leaves the second writer's step in flight alone when it waits and closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treeopt
from treeopt import checkpoint
from treeopt.errors import CheckpointInUseError

PARAMS = {"w": jnp.zeros(4)}
BASE = treeopt.Optimizer(optax.adam(0.1)).init(PARAMS)
TARGET = jax.eval_shape(treeopt.Optimizer(optax.adam(0.1)).init, PARAMS)
DEADLINE_S = 60  # only a hang waits that long
RELEASE_AFTER_S = 0.2  # how long a held commit stays held once the reader is (or should be) waiting


def state_at(step):
    """The optimizer whose every value is ``step``."""
    return copy.copy(BASE).load_state_dict(jax.tree.map(lambda x: np.full(x.shape, step, x.dtype), BASE.state_dict()))


def step_of(state_dict):
    """The step whose values ``state_dict`` holds, after checking every value is that step's."""
    values = {float(np.asarray(x).reshape(-1)[0]) for x in jax.tree.leaves(state_dict)}
    assert len(values) == 1, values
    return int(values.pop())


class Commits:
    """Orbax's commits of asynchronous saves, held while ``held`` is set, counted as they arrive."""

    def __init__(self):
        self.open = threading.Event()
        self.open.set()
        self.arrived = threading.Semaphore(0)

    def hold(self):
        self.open.clear()

    @contextlib.contextmanager
    def held(self):
        """Holds the commits in the block; lets them go at its end, however it ends (a failed assert too)."""
        self.hold()
        try:
            yield
        finally:
            self.release()

    def release(self, after_s=0.0):
        """Lets the held commits go, at once or from a timer (while the caller is blocked in a call)."""
        if after_s:
            threading.Timer(after_s, self.open.set).start()
        else:
            self.open.set()

    def wait_for_one(self):
        """Blocks until a save's files are written and its commit is waiting."""
        assert self.arrived.acquire(timeout=DEADLINE_S), "no save reached its commit"


@pytest.fixture
def held_commits(monkeypatch):
    from orbax.checkpoint._src.path import atomicity

    commits = Commits()
    commit = atomicity.AtomicRenameTemporaryPath.finalize

    async def held_commit(self):
        commits.arrived.release()
        await asyncio.to_thread(commits.open.wait, DEADLINE_S)
        return await commit(self)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", held_commit)
    yield commits
    commits.release()


# -- reads wait for the save in flight -------------------------------------------------------------

READS = {
    "restore": lambda manager: int(manager.restore(TARGET).step),
    "restore_state_dict": lambda manager: step_of(manager.restore_state_dict()),
    "latest_step": lambda manager: manager.latest_step(),
    "all_steps": lambda manager: list(manager.all_steps())[-1],
}


@pytest.mark.parametrize("earlier", [None, 3], ids=["first-save", "after-step-3"])
@pytest.mark.parametrize("read", sorted(READS))
def test_reads_right_after_an_async_save_wait_for_it(tmp_path, held_commits, read, earlier):
    with checkpoint.CheckpointManager(tmp_path) as manager:
        if earlier is not None:
            assert manager.save(earlier, state_at(earlier))
            manager.wait_until_finished()
        held_commits.hold()
        assert manager.save(5, state_at(5))
        held_commits.wait_for_one()  # written, not yet renamed into place: in flight
        assert "5" not in os.listdir(tmp_path)
        held_commits.release(after_s=RELEASE_AFTER_S)
        assert READS[read](manager) == 5
        assert manager.latest_step() == 5
        assert list(manager.all_steps()) == ([] if earlier is None else [earlier]) + [5]
        assert step_of(manager.restore_state_dict()) == 5


# -- saves from several threads ---------------------------------------------------------------------


def saves_from_threads(manager, steps, commits):
    """``{step: what manager.save returned or raised}``, each step saved by its own thread, all at once.

    The first save to reach orbax stays in flight a moment, so the others come while it is.
    """
    results = {}
    start = threading.Barrier(len(steps))

    def save(step):
        start.wait()
        try:
            results[step] = manager.save(step, state_at(step))
        except Exception as e:
            results[step] = e

    commits.hold()
    threads = [threading.Thread(target=save, args=(step,)) for step in steps]
    for thread in threads:
        thread.start()
    commits.wait_for_one()
    commits.release(after_s=RELEASE_AFTER_S)
    for thread in threads:
        thread.join(DEADLINE_S)
    assert not any(thread.is_alive() for thread in threads), "a save hung"
    return results


def test_saves_from_three_threads_are_serialized_and_every_true_one_is_on_disk(tmp_path, held_commits):
    for trial in range(3):
        with checkpoint.CheckpointManager(tmp_path / str(trial)) as manager:
            results = saves_from_threads(manager, (1, 2, 3), held_commits)
            assert all(isinstance(result, bool) for result in results.values()), results
            manager.wait_until_finished()
            saved = sorted(step for step, result in results.items() if result)
            # Serialized in the order they came: a step below the latest is skipped (False), as orbax skips it.
            assert saved and list(manager.all_steps()) == saved, results
            for step in saved:
                assert step_of(manager.restore_state_dict(step)) == step


# -- a lock removed by hand --------------------------------------------------------------------------


@pytest.mark.parametrize("refused_save", [True, False], ids=["after a refused save", "closed at once"])
def test_a_writer_that_lost_its_lock_leaves_the_next_writers_save_in_flight_alone(
    tmp_path, held_commits, refused_save
):
    first = checkpoint.CheckpointManager(tmp_path)
    assert first.save(1, state_at(1))
    first.wait_until_finished()
    (tmp_path / ".treeopt-lock").unlink()  # by hand: a second writer may now take the directory
    with checkpoint.CheckpointManager(tmp_path) as second, held_commits.held():
        assert second.save(2, state_at(2))
        held_commits.wait_for_one()
        in_flight = sorted(entry for entry in os.listdir(tmp_path) if entry.startswith("2."))
        assert in_flight, os.listdir(tmp_path)  # the second writer's temporary directory
        dropping = tmp_path / ".treeopt-deleted" / "0"  # a step the second writer is deleting (max_to_keep)
        dropping.mkdir(parents=True)
        if refused_save:
            with pytest.raises(CheckpointInUseError, match=r"removed or replaced while it was writing"):
                first.save(3, state_at(3))
            first.wait_until_finished()
        first.close()  # its cleanup: nothing of the second writer's is its to remove
        assert set(in_flight) <= set(os.listdir(tmp_path)) and (tmp_path / ".treeopt-lock").exists()
        assert dropping.is_dir()
        held_commits.release()
        second.wait_until_finished()
        assert list(second.all_steps()) == [1, 2]
        assert step_of(second.restore_state_dict()) == 2
        assert second.save(4, state_at(4))  # still the directory's writer
    assert sorted(os.listdir(tmp_path)) == ["1", "2", "4"]
