"""Nothing lost, no one in: links, readers without write access, closed managers, forks, a lost lock.

- Links: nothing under a checkpoint directory is written, moved or deleted
  through a symbolic link. Each crafted directory points a link at a file
  (or folder) outside it whose bytes are checked afterwards. A checkpoint
  path that is itself a link is resolved once: the lock and the save are at
  the real path, and the link stays a link.
- Reading never needs write access: a manager that cannot write the lock
  (an immutable or unwritable lock file, an immutable directory) lists and
  restores, and says it is read-only only when asked to save.
- A manager opened with ``read_only=True`` refuses every save, forced or not,
  beside a live writer or alone, and writes nothing: no lock, no tidying.
- A closed manager refuses ``save`` naming ``close``, and its process exits
  promptly (a child process with a deadline).
- The lock is the taking process's own: a fork()ed child's ``close()`` leaves
  it alone, and a forked worker that outlives a killed writer does not hold it.
- A lock file removed or replaced while its writer lives stops that writer.
- A hand-edited ``_CHECKPOINT_METADATA`` whose checksums are not a mapping is
  a ``CheckpointError``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import treeopt
from treeopt import checkpoint
from treeopt.errors import CheckpointError, CheckpointInUseError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARAMS = {"w": jnp.arange(4.0)}
OPT = treeopt.Optimizer(optax.adam(0.1)).init(PARAMS)
TARGET = jax.eval_shape(treeopt.Optimizer(optax.adam(0.1)).init, PARAMS)
DEADLINE_S = 120  # only a hang takes that long
SECRET = b"bytes outside the checkpoint directory\n"


def manager(directory, **kwargs):
    return checkpoint.CheckpointManager(directory, enable_async_checkpointing=False, **kwargs)


def outside(tmp_path, name="victim"):
    """A file outside every checkpoint directory of the test, whose bytes are checked afterwards."""
    victim = tmp_path / "elsewhere" / name
    victim.parent.mkdir(exist_ok=True)
    victim.write_bytes(SECRET)
    return victim


def with_steps(directory, *steps):
    with manager(directory) as writer:
        for step in steps:
            assert writer.save(step, OPT, PARAMS)


def run_child(script, *args, timeout=DEADLINE_S):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO, "XLA_FLAGS": ""}
    prelude = "import os, sys, jax.numpy as jnp, optax, treeopt\nfrom treeopt import checkpoint\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


# -- links ---------------------------------------------------------------------------------


def test_a_reader_and_a_writer_never_write_through_a_linked_lock(tmp_path):
    victim = outside(tmp_path)
    root = tmp_path / "run"
    with_steps(root, 1)
    os.symlink(victim, root / ".treeopt-lock")
    with manager(root) as reader:
        assert reader.latest_step() == 1
        assert int(reader.restore(TARGET).step) == 0
        with pytest.raises(CheckpointError, match=r"\.treeopt-lock is a symbolic link"):
            reader.save(2, OPT)
    assert victim.read_bytes() == SECRET
    assert os.path.islink(root / ".treeopt-lock")


def test_a_single_directory_save_refuses_a_planted_linked_lock(tmp_path):
    victim = outside(tmp_path)
    os.symlink(victim, tmp_path / "ckpt.treeopt-lock")
    with pytest.raises(CheckpointError, match=r"ckpt\.treeopt-lock is a symbolic link"):
        checkpoint.save(tmp_path / "ckpt", OPT)
    assert victim.read_bytes() == SECRET
    assert not (tmp_path / "ckpt").exists()


def test_tidying_moves_nothing_through_a_linked_incomplete_folder(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / "run"
    with_steps(root, 1)
    (root / "3").mkdir()  # a hand-made step directory
    (root / "3" / "notes").write_bytes(SECRET)
    os.symlink(elsewhere, root / ".treeopt-incomplete")
    with pytest.warns(UserWarning, match=r"\.treeopt-incomplete is not a directory"), manager(root) as opened:
        assert opened.all_steps() == [1]
        opened.save(4, OPT)
    assert os.listdir(elsewhere) == []
    assert (root / "3" / "notes").read_bytes() == SECRET


def test_debris_and_deleted_folders_that_are_links_are_removed_as_links(tmp_path):
    victim = outside(tmp_path)
    root = tmp_path / "run"
    with_steps(root, 1)
    os.symlink(victim.parent, root / "7.orbax-checkpoint-tmp-123")
    os.symlink(victim.parent, root / ".treeopt-deleted")
    with manager(root, max_to_keep=1) as writer:
        writer.save(2, OPT)
        writer.save(3, OPT)
    assert sorted(os.listdir(root)) == ["3"]
    assert victim.read_bytes() == SECRET and os.listdir(victim.parent) == ["victim"]


def test_a_linked_sibling_of_a_forced_save_is_never_renamed_into_place(tmp_path):
    victim = outside(tmp_path)
    os.symlink(victim.parent, tmp_path / "ckpt.treeopt-new")
    checkpoint.save(tmp_path / "ckpt", OPT, force=True)
    assert not os.path.islink(tmp_path / "ckpt") and not os.path.lexists(tmp_path / "ckpt.treeopt-new")
    assert victim.read_bytes() == SECRET


def test_a_linked_checkpoint_path_is_resolved_once(tmp_path):
    real = tmp_path / "real"
    link = tmp_path / "link"
    real.mkdir()
    os.symlink(real, link)
    checkpoint.save(link / "ckpt", OPT)
    os.symlink(real / "ckpt", tmp_path / "ckpt-link")
    checkpoint.save(tmp_path / "ckpt-link", OPT, force=True)
    assert os.path.islink(tmp_path / "ckpt-link") and os.path.isdir(real / "ckpt")
    assert int(checkpoint.restore(tmp_path / "ckpt-link", TARGET).step) == 0
    os.symlink(real / "steps", tmp_path / "steps-link")
    with manager(real / "steps") as by_path, manager(tmp_path / "steps-link") as by_link:
        assert by_path.save(1, OPT)
        with pytest.raises(CheckpointInUseError):
            by_link.save(2, OPT)
    assert sorted(os.listdir(real / "steps")) == ["1"]


# -- readers without write access -------------------------------------------------------------


@contextlib.contextmanager
def unwritable(path):
    """``path`` made unwritable: immutable as root (chmod does not stop root), else mode 0444/0555."""
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False).returncode:
            pytest.skip("chattr +i is not available here")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=True)
    else:
        mode = os.stat(path).st_mode
        os.chmod(path, 0o555 if os.path.isdir(path) else 0o444)
        try:
            yield
        finally:
            os.chmod(path, mode)


@pytest.mark.parametrize("what", ["lock", "directory"])
def test_a_reader_needs_no_write_access_and_says_read_only_only_at_a_save(tmp_path, what):
    root = tmp_path / "run"
    with_steps(root, 1, 2)
    lock = root / ".treeopt-lock"
    if what == "lock":
        lock.write_bytes(b"")
    before = sorted(os.listdir(root))
    with unwritable(lock if what == "lock" else root):
        with manager(root) as reader:
            assert list(reader.all_steps()) == [1, 2] and reader.latest_step() == 2
            assert int(reader.restore(TARGET, step=1).step) == 0
            with pytest.raises(PermissionError, match=r"This CheckpointManager is read-only.*Reading"):
                reader.save(3, OPT)
        assert sorted(os.listdir(root)) == before


def test_a_read_only_manager_refuses_every_save_beside_a_live_writer_and_takes_no_lock(tmp_path):
    read_only = ocp.CheckpointManagerOptions(read_only=True)
    lock = tmp_path / ".treeopt-lock"
    with manager(tmp_path) as writer:
        assert writer.save(1, OPT)
        held, before = lock.read_bytes(), sorted(os.listdir(tmp_path))
        with checkpoint.CheckpointManager(tmp_path, options=read_only) as reader:
            for step, force in ((6, True), (6, False), (1, True)):
                with pytest.raises(PermissionError, match=r"^This CheckpointManager is read-only.*read_only=True"):
                    reader.save(step, OPT, PARAMS, force=force)
            assert list(reader.all_steps()) == [1] and int(reader.restore(TARGET).step) == 0
            reader.wait_until_finished()
        assert sorted(os.listdir(tmp_path)) == before and lock.read_bytes() == held
        assert writer.save(2, OPT)  # the live writer's lock is its own still
    # Alone in a directory with a killed save's debris: it tidies nothing and takes no lock either.
    os.mkdir(tmp_path / "3.orbax-checkpoint-tmp")
    before = sorted(os.listdir(tmp_path))
    with checkpoint.CheckpointManager(tmp_path, options=read_only) as reader:
        with pytest.raises(PermissionError, match=r"read-only"):
            reader.save(7, OPT, force=True)
    assert sorted(os.listdir(tmp_path)) == before and ".treeopt-lock" not in before


# -- closed managers ------------------------------------------------------------------------


def test_a_closed_manager_refuses_save_naming_close_and_its_process_exits(tmp_path):
    child = run_child(
        """
        params = {"w": jnp.ones(4)}
        opt = treeopt.Optimizer(optax.sgd(0.1)).init(params)
        manager = checkpoint.CheckpointManager(sys.argv[1])
        manager.save(0, opt, params)
        manager.close()
        for _ in range(2):
            try:
                manager.save(1, opt, params)
            except RuntimeError as e:
                print("REFUSED", "close" in str(e))
        other = checkpoint.CheckpointManager(sys.argv[1])
        print("SAVED", other.save(2, opt, params)); other.close()
        """,
        tmp_path,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.split() == ["REFUSED", "True", "REFUSED", "True", "SAVED", "True"]
    assert sorted(os.listdir(tmp_path)) == ["0", "2"]


# -- forks ------------------------------------------------------------------------------------


def _wait(pid, deadline_s=DEADLINE_S):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child hung")


@pytest.mark.filterwarnings("ignore:os.fork")
def test_a_forked_child_closing_its_inherited_manager_leaves_the_lock_alone(tmp_path):
    writer = manager(tmp_path)
    try:
        assert writer.save(1, OPT)
        pid = os.fork()
        if pid == 0:  # the child: run the inherited close, as an exiting worker would
            code = 1
            try:
                writer.close()
                code = 0
            finally:
                os._exit(code)
        assert _wait(pid) == 0
        assert (tmp_path / ".treeopt-lock").exists()
        third = run_child(
            """
            opt = treeopt.Optimizer(optax.sgd(0.1)).init({"w": jnp.ones(4)})
            try:
                checkpoint.CheckpointManager(sys.argv[1]).save(9, opt)
                print("WROTE")
            except treeopt.errors.CheckpointInUseError as e:
                print("REFUSED", e.holder)
            """,
            tmp_path,
        )
        assert third.stdout.startswith(f"REFUSED process {os.getpid()} "), third.stdout + third.stderr[-2000:]
        assert writer.save(2, OPT)
    finally:
        writer.close()


def test_a_forked_worker_that_outlives_a_killed_writer_does_not_hold_the_lock(tmp_path):
    script = """
        import time
        opt = treeopt.Optimizer(optax.sgd(0.1)).init({"w": jnp.ones(4)})
        manager = checkpoint.CheckpointManager(sys.argv[1], enable_async_checkpointing=False)
        manager.save(1, opt)
        worker = os.fork()
        if worker == 0:
            time.sleep(600)
            os._exit(0)
        print("WORKER", worker, flush=True)
        time.sleep(600)
    """
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO, "XLA_FLAGS": ""}
    prelude = "import os, sys, jax.numpy as jnp, optax, treeopt\nfrom treeopt import checkpoint\n"
    writer = subprocess.Popen(
        [sys.executable, "-c", prelude + textwrap.dedent(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    worker = None
    try:
        line = writer.stdout.readline()
        assert line.startswith("WORKER"), line
        worker = int(line.split()[1])
        writer.kill()  # the writer dies; its forked worker lives on
        writer.wait(timeout=60)
        with manager(tmp_path) as restarted:
            assert restarted.save(2, OPT)
            assert restarted.all_steps() == [1, 2]
    finally:
        if writer.poll() is None:
            writer.kill()
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)


# -- a lock lost while its writer lives ---------------------------------------------------------


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_writer_whose_lock_file_was_removed_or_replaced_stops(tmp_path, how):
    lock = tmp_path / ".treeopt-lock"
    with manager(tmp_path) as writer:
        assert writer.save(1, OPT)
        lock.unlink()
        if how == "replaced":
            lock.write_bytes(SECRET)
        with pytest.raises(CheckpointInUseError, match=r"removed or replaced while it was writing"):
            writer.save(2, OPT)
    assert sorted(os.listdir(tmp_path)) == (["1"] if how == "removed" else [".treeopt-lock", "1"])
    if how == "replaced":
        assert lock.read_bytes() == SECRET  # another's file now: closing does not delete it


# -- damaged metadata ---------------------------------------------------------------------------


@pytest.mark.parametrize("checksums", [5, "x", [1, 2]])
def test_checksums_that_are_not_a_mapping_are_a_checkpoint_error(tmp_path, checksums):
    checkpoint.save(tmp_path / "c", OPT, PARAMS)
    meta_path = tmp_path / "c" / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_path.read_text())
    meta["custom_metadata"]["treeopt"]["checksums"] = checksums
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError):
        checkpoint.restore(tmp_path / "c", TARGET)
    np.testing.assert_array_equal(
        checkpoint.restore(tmp_path / "c", TARGET, verify=False).opt_state[0].mu["w"],
        OPT.opt_state[0].mu["w"],
    )
