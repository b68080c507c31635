"""One writer per checkpoint directory, nothing half-done left behind, only complete steps listed.

- A second writer of a directory (a restarted job while its zombie
  predecessor still runs), in another process, is refused with an error
  naming the directory and the first writer; the first writer's saves stay
  whole, it exits promptly, and once it is gone (closed, or killed: its stale
  lock is taken over) the next writer saves.
- A save that fails on a full disk (a tiny tmpfs where the test may mount
  one, else a file-size limit: writes fail the same way) removes what it
  wrote, keeps the last good checkpoint restorable, and the process exits
  promptly.
- Opening a directory that no one writes removes what killed saves left; a
  live writer's files are never touched by a reader.
- Step directories that are not complete checkpoints are left out, with a
  warning naming them; a renamed step directory is reported.
- Empty params save and restore.
- Links inside a checkpoint are followed: the checksums saved with it catch
  a link to other data, and deleting a checkpoint never deletes what a link
  points to.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treeopt
from treeopt import checkpoint
from treeopt.errors import CheckpointError, CheckpointInUseError, StateDictError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARAMS = {"w": jnp.zeros(4)}
BASE = treeopt.Optimizer(optax.adam(0.1)).init(PARAMS)
TARGET = jax.eval_shape(treeopt.Optimizer(optax.adam(0.1)).init, PARAMS)
ABSTRACT_PARAMS = jax.eval_shape(lambda: PARAMS)
DEADLINE_S = 120  # for a child process to reach the next line of its script: only a hang takes that long


def state_at(step):
    """``(optimizer, params)`` whose every value is ``step`` (params: ``-step``)."""
    sd = jax.tree.map(lambda x: np.full(x.shape, step, x.dtype), BASE.state_dict())
    return copy.copy(BASE).load_state_dict(sd), {"w": jnp.full(4, -step, jnp.float32)}


# What every child script starts with: the same imports, BASE and state_at as here.
_PRELUDE = textwrap.dedent(
    """
        import copy, json, os, shutil, sys
        import jax, jax.numpy as jnp, numpy as np, optax
        import treeopt
        from treeopt import checkpoint

        BASE = treeopt.Optimizer(optax.adam(0.1)).init({"w": jnp.zeros(4)})
        """
) + inspect.getsource(state_at)


def manager(directory, **kwargs):
    return checkpoint.CheckpointManager(directory, enable_async_checkpointing=False, **kwargs)


def restored_step(reader, **kwargs):
    """The step of what ``reader`` (a manager) restores, after checking every value is that step's."""
    opt, params = reader.restore(TARGET, params=ABSTRACT_PARAMS, **kwargs)
    step = int(opt.step)
    for leaf in jax.tree.leaves(opt):
        np.testing.assert_array_equal(np.asarray(leaf), step)
    np.testing.assert_array_equal(np.asarray(params["w"]), -step)
    return step


def steps_that_restore(directory):
    """The steps a freshly opened manager lists, after checking that each restores whole."""
    with manager(directory) as reader:
        steps = list(reader.all_steps())
        assert [restored_step(reader, step=step) for step in steps] == steps
    return steps


def child_env():
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO, "XLA_FLAGS": ""}


@contextlib.contextmanager
def child_process(script, *args, **popen):
    """A Python child running ``script``, killed at the end whatever happens (a watchdog kills a hung one)."""
    child = subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
        **popen,
    )
    watchdog = threading.Timer(4 * DEADLINE_S, child.kill)
    watchdog.start()
    try:
        yield child
    finally:
        watchdog.cancel()
        if child.poll() is None:
            child.kill()
        child.wait(timeout=60)


def read_until(child, word):
    """The child's output up to and including the line starting with ``word`` (all of it if it ends first)."""
    lines = []
    for line in child.stdout:
        lines.append(line)
        if line.startswith(word):
            return "".join(lines)
    raise AssertionError(f"the child ended before printing {word}:\n{''.join(lines)[-4000:]}")


# -- two writers ---------------------------------------------------------------------------------

_WRITER = _PRELUDE + textwrap.dedent(
    """
    directory, first, then = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    manager = checkpoint.CheckpointManager(directory, enable_async_checkpointing=False)
    print("SAVED", manager.save(first, *state_at(first)), flush=True)
    sys.stdin.readline()  # the test says when to go on, or kills this process
    print("SAVED", manager.save(then, *state_at(then)), flush=True)
    manager.close()
    print("CLOSED", flush=True)
    """
)


def lock_record(directory):
    with open(os.path.join(directory, ".treeopt-lock")) as f:
        return json.load(f)


def test_a_second_writer_is_refused_naming_the_first_which_saves_on_and_exits(tmp_path):
    directory = tmp_path / "run"
    with child_process(_WRITER, directory, 1, 2) as zombie:
        assert "SAVED True" in read_until(zombie, "SAVED")
        assert lock_record(directory)["pid"] == zombie.pid
        with manager(directory) as restarted:
            assert restarted.latest_step() == 1  # reading is not writing: unaffected
            assert restored_step(restarted) == 1
            with pytest.raises(CheckpointInUseError) as info:
                restarted.save(1, *state_at(100))
            message = str(info.value)
            assert f"checkpoint directory {directory}" in message
            assert f"process {zombie.pid} on host {socket.gethostname()}" in message
            assert info.value.directory == str(directory)
            assert str(zombie.pid) in info.value.holder
            with pytest.raises(CheckpointInUseError):  # and again: nothing changed meanwhile
                restarted.save(3, *state_at(300), force=True)
            assert restored_step(restarted) == 1  # the refused saves wrote nothing
        zombie.stdin.write("go on\n")
        zombie.stdin.flush()
        assert "SAVED True" in read_until(zombie, "CLOSED")
        assert zombie.wait(timeout=DEADLINE_S) == 0  # no thread of the first writer keeps it alive
    assert not os.path.exists(directory / ".treeopt-lock")  # closed: the lock is given up
    with manager(directory) as restarted:
        assert restarted.save(3, *state_at(3))
    assert steps_that_restore(directory) == [1, 2, 3]
    assert sorted(os.listdir(directory)) == ["1", "2", "3"]


def test_the_lock_of_a_killed_writer_is_taken_over(tmp_path):
    directory = tmp_path / "run"
    with child_process(_WRITER, directory, 1, 2) as dead:
        read_until(dead, "SAVED")
        dead.kill()  # SIGKILL: no close, no cleanup; the kernel releases its lock
        dead.wait(timeout=60)
    assert lock_record(directory)["pid"] == dead.pid  # the stale lock file is still there
    with manager(directory) as restarted:
        assert restarted.save(3, *state_at(3))
        assert lock_record(directory)["pid"] == os.getpid()  # taken over
    assert steps_that_restore(directory) == [1, 3]


def test_two_managers_of_one_process_are_two_writers_too(tmp_path):
    first = manager(tmp_path)
    assert first.save(1, *state_at(1))
    second = manager(tmp_path)
    with pytest.raises(CheckpointInUseError, match=r"this process .* another CheckpointManager"):
        second.save(2, *state_at(2))
    first.close()
    assert second.save(2, *state_at(2))
    second.close()
    assert steps_that_restore(tmp_path) == [1, 2]


def test_a_writer_waits_for_a_reader_tidying_the_directory_but_not_for_a_writer(tmp_path):
    from treeopt._checkpoint.writer_lock import TIDYING, WriterLock

    tidying = WriterLock(str(tmp_path / ".treeopt-lock"), str(tmp_path))
    tidying.acquire(TIDYING)  # as a manager opening the directory holds it for a moment
    threading.Timer(0.2, tidying.release).start()
    with manager(tmp_path) as writer:
        assert writer.save(1, *state_at(1))  # waited for the tidying, then took the lock
        with manager(tmp_path) as reader:  # a reader opening meanwhile does not wait for a writer
            assert reader.all_steps() == [1]
    assert steps_that_restore(tmp_path) == [1]


def test_a_lock_file_deleted_while_being_locked_is_not_held(tmp_path, monkeypatch):
    """The holder releases (deletes the file) between a second process's open and its flock: that
    process must lock the file now at the path, not the deleted one, or a third would get in too."""
    from treeopt._checkpoint import writer_lock as _writer_lock
    from treeopt._checkpoint.writer_lock import WriterLock

    path = str(tmp_path / ".treeopt-lock")
    holder, racer = WriterLock(path, str(tmp_path)), WriterLock(path, str(tmp_path))
    holder.acquire()
    real_flock = _writer_lock.fcntl.flock
    calls = []

    def flock_after_the_holder_released(fd, operation):
        if not calls:
            holder.release()  # between the racer's open and its flock
        calls.append(fd)
        return real_flock(fd, operation)

    monkeypatch.setattr(_writer_lock.fcntl, "flock", flock_after_the_holder_released)
    racer.acquire()
    monkeypatch.undo()
    assert len(calls) == 2  # the first lock was on the deleted file: it started again
    with pytest.raises(CheckpointInUseError):
        WriterLock(path, str(tmp_path)).acquire()
    racer.release()


def test_a_manager_dropped_without_close_gives_its_lock_up_when_collected(tmp_path):
    dropped = manager(tmp_path)
    dropped.save(1, *state_at(1))
    del dropped
    gc.collect()
    with manager(tmp_path) as next_one:
        assert next_one.save(2, *state_at(2))


def test_a_single_directory_save_is_refused_while_another_writes_it(tmp_path):
    from treeopt._checkpoint.writer_lock import WriterLock

    path = tmp_path / "ckpt"
    checkpoint.save(path, *state_at(1))
    other = WriterLock(f"{path}.treeopt-lock", str(path))
    other.acquire()
    with pytest.raises(CheckpointInUseError, match=f"checkpoint directory {path}: this process"):
        checkpoint.save(path, *state_at(2), force=True)
    other.release()
    checkpoint.save(path, *state_at(2), force=True)
    assert int(checkpoint.restore(path, TARGET).step) == 2
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # the lock file goes with the save


# -- a full disk ---------------------------------------------------------------------------------

_FULL = _PRELUDE + textwrap.dedent(
    """
    import contextlib, resource, signal

    root, how = sys.argv[1], sys.argv[2]  # how: "tmpfs" (1 MiB) or "rlimit" (no tmpfs could be mounted)
    one, run = os.path.join(root, "one"), os.path.join(root, "run")
    big_params = {"w": jax.random.normal(jax.random.key(0), (300_000,))}  # 3.6 MB with adam's state
    big = treeopt.Optimizer(optax.adam(0.1)).init(big_params)
    target = jax.eval_shape(BASE.init, {"w": jnp.zeros(4)})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past a file-size limit a write fails, not the process
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)


    @contextlib.contextmanager
    def disk_with(free):
        # Writes fail past about `free` bytes: a filler file on the tmpfs, or a limit on the size
        # of each file (a tenth of that: a checkpoint is a dozen files).
        if how == "tmpfs":
            stat = os.statvfs(root)
            with open(os.path.join(root, "filler"), "wb") as f:
                f.write(b"x" * max(stat.f_bavail * stat.f_frsize - free, 0))
        else:
            resource.setrlimit(resource.RLIMIT_FSIZE, (free // 10, hard))
        try:
            yield
        finally:
            if how == "tmpfs":
                os.remove(os.path.join(root, "filler"))
            else:
                resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))


    def report(what, error, directory):
        notes = getattr(error, "__notes__", [])
        listing = sorted(os.listdir(directory))
        print(json.dumps({"what": what, "failed": error is not None, "notes": notes, "listing": listing}))


    os.makedirs(one)
    checkpoint.save(os.path.join(one, "ckpt"), *state_at(1))
    error = None
    try:
        with disk_with(1 << 20):
            checkpoint.save(os.path.join(one, "ckpt"), big, big_params, force=True)
    except Exception as e:
        error = e
    report("one directory", error, one)
    print("RESTORED", int(checkpoint.restore(os.path.join(one, "ckpt"), target).step), flush=True)
    with contextlib.suppress(OSError, ValueError), disk_with(0):  # not even room for the lock file's record
        checkpoint.save(os.path.join(one, "ckpt"), *state_at(2), force=True)
    checkpoint.save(os.path.join(one, "ckpt"), *state_at(2), force=True)  # room again: it saves
    print("RESTORED", int(checkpoint.restore(os.path.join(one, "ckpt"), target).step), flush=True)

    # A save too big for the disk, then one on a disk with almost no room left (it fails in
    # orbax's metadata writes, whose error orbax would raise again at the next save).
    for asynchronous, free, too_big in [(False, 1 << 20, True), (True, 1 << 20, True), (True, 2000, False)]:
        with checkpoint.CheckpointManager(run, enable_async_checkpointing=asynchronous) as manager:
            manager.save(1, *state_at(1))
            manager.wait_until_finished()
            error = None
            try:
                with disk_with(free):
                    manager.save(2, *((big, big_params) if too_big else state_at(2)))
                    manager.wait_until_finished()  # where an asynchronous save fails
            except Exception as e:
                error = e
            report("manager", error, run)
            print("SAVED", manager.save(3, *state_at(3)), flush=True)
        with checkpoint.CheckpointManager(run) as reader:
            print("RESTORED", [int(reader.restore(target, step=step).step) for step in reader.all_steps()])
        shutil.rmtree(run)
    print("END", flush=True)
    """
)


@contextlib.contextmanager
def small_disk(path):
    """``(directory, how)``: a 1 MiB tmpfs mounted there where this process may mount one (root).

    Elsewhere ``how`` is ``"rlimit"``: the child limits the size of the files
    it writes instead, so that writes fail past the limit with EFBIG, as
    writes to the full tmpfs fail with ENOSPC.
    """
    path.mkdir()
    try:
        command = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)]
        mounted = subprocess.run(command, capture_output=True, check=False).returncode == 0
    except OSError:  # no mount command
        mounted = False
    try:
        yield path, "tmpfs" if mounted else "rlimit"
    finally:
        if mounted:
            subprocess.run(["umount", str(path)], check=True)


def _reports(output):
    """The child's JSON reports, wherever they stand in its output: orbax's threads log to the same
    pipe, and a log line may land inside a report's line, before or after it."""
    decoder, reports = json.JSONDecoder(), []
    for line in output.splitlines():
        start = line.find('{"what"')
        if start != -1:
            reports.append(decoder.raw_decode(line, start)[0])
    return reports


def test_a_save_that_fails_on_a_full_disk_leaves_nothing_and_the_last_checkpoint_restores(tmp_path):
    with small_disk(tmp_path / "disk") as (disk, how), child_process(_FULL, disk, how) as child:
        output = read_until(child, "END")
        assert child.wait(timeout=DEADLINE_S) == 0, output  # nothing left running: it exits
    reports = _reports(output)
    assert [r["what"] for r in reports] == ["one directory", "manager", "manager", "manager"], output
    assert all(r["failed"] for r in reports), output
    assert reports[0]["listing"] == ["ckpt"], output  # no ckpt.treeopt-new.orbax-checkpoint-tmp
    for failed in reports[1:]:  # synchronous, asynchronous, asynchronous on a nearly full disk
        assert failed["listing"] == [".treeopt-lock", "1"], output  # no 2.orbax-checkpoint-tmp
        assert any("was removed, and the latest complete step is 1" in note for note in failed["notes"])
    # The next save works (no error of the failed one raised again), and every step restores.
    assert output.count("SAVED True") == 3 and output.count("RESTORED [1, 3]") == 3, output
    assert "RESTORED 1" in output and "RESTORED 2" in output, output


# -- debris of killed saves ----------------------------------------------------------------------


def test_opening_a_directory_no_one_writes_removes_what_killed_saves_left(tmp_path):
    with manager(tmp_path) as writer:
        writer.save(1, *state_at(1))
    debris = ["2.orbax-checkpoint-tmp", ".treeopt-deleted/0", ".treeopt-trash-0123456789ab"]
    for entry in debris:
        os.makedirs(tmp_path / entry / "optimizer")
    with manager(tmp_path) as reader:
        assert sorted(os.listdir(tmp_path)) == ["1"]
        assert reader.all_steps() == [1]


def test_a_reader_never_removes_what_a_live_writer_is_writing(tmp_path):
    writer = manager(tmp_path)
    writer.save(1, *state_at(1))
    in_flight = tmp_path / "2.orbax-checkpoint-tmp"  # as the writer's next save has it, half-written
    os.makedirs(in_flight / "optimizer")
    with manager(tmp_path) as reader:
        assert reader.all_steps() == [1]
    assert in_flight.is_dir()
    shutil.rmtree(in_flight)
    writer.close()


def test_the_writer_removes_what_a_killed_save_left_before_it_saves(tmp_path):
    with manager(tmp_path) as writer:
        writer.save(1, *state_at(1))
        os.makedirs(tmp_path / "7.orbax-checkpoint-tmp" / "optimizer")  # debris of a save that died
        assert writer.save(2, *state_at(2))
        assert sorted(os.listdir(tmp_path)) == [".treeopt-lock", "1", "2"]
    assert steps_that_restore(tmp_path) == [1, 2]


# -- steps that are not checkpoints ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["empty", "no metadata", "no optimizer item"])
def test_an_incomplete_step_directory_is_not_a_step(tmp_path, kind):
    holder = manager(tmp_path)
    for step in (1, 2):
        holder.save(step, *state_at(step))
    shutil.copytree(tmp_path / "2", tmp_path / "9")
    if kind == "empty":
        shutil.rmtree(tmp_path / "9")
        os.mkdir(tmp_path / "9")
    elif kind == "no metadata":
        os.remove(tmp_path / "9" / "_CHECKPOINT_METADATA")
    else:
        shutil.rmtree(tmp_path / "9" / "optimizer")

    # While a writer holds the directory, a reader leaves the step where it is, and out.
    with pytest.warns(UserWarning, match=rf"{tmp_path / '9'} is not a complete checkpoint"):
        with manager(tmp_path) as reader:
            assert reader.all_steps() == [1, 2] and reader.latest_step() == 2
            assert restored_step(reader) == 2
            with pytest.raises(FileNotFoundError, match=r"No checkpoint of step 9 .* steps: \[1, 2\]"):
                reader.restore(TARGET, step=9)
    assert (tmp_path / "9").is_dir()
    holder.close()

    # Once no one writes, opening the directory moves it aside, and step 9 can be saved again.
    with pytest.warns(UserWarning, match=r"is not a complete checkpoint .* moved to .*\.treeopt-incomplete"):
        with manager(tmp_path) as writer:
            assert writer.all_steps() == [1, 2]
            assert writer.save(9, *state_at(9))
    assert steps_that_restore(tmp_path) == [1, 2, 9]
    assert os.listdir(tmp_path / ".treeopt-incomplete") == ["9"]


def test_a_renamed_step_directory_is_reported_naming_both_steps(tmp_path):
    with manager(tmp_path) as writer:
        writer.save(2, *state_at(2))
    os.rename(tmp_path / "2", tmp_path / "20")
    with manager(tmp_path) as reader:
        assert reader.latest_step() == 20
        with pytest.warns(UserWarning, match=r"step 20 by its directory name, but it was saved as step 2"):
            opt = reader.restore(TARGET)
        assert int(opt.step) == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with manager(tmp_path) as writer:
            writer.save(21, *state_at(21))
            assert int(writer.restore(TARGET, step=21).step) == 21
    assert not [w for w in caught if "saved as step" in str(w.message)]  # not renamed: no word


# -- empty params --------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [{}, {"step_count": 3, "name": "model"}])
def test_params_without_arrays_save_and_restore(tmp_path, params):
    checkpoint.save(tmp_path / "one", BASE, params)
    opt, restored = checkpoint.restore(tmp_path / "one", TARGET, params=params)
    assert int(opt.step) == 0 and restored == params
    with manager(tmp_path / "run") as steps:
        assert steps.save(0, BASE, params)
        opt, restored = steps.restore(TARGET, params=params)
    assert restored == params
    with pytest.raises(StateDictError, match=r"missing \(1\):\n  w"):  # it holds no arrays to restore
        checkpoint.restore(tmp_path / "one", TARGET, params=ABSTRACT_PARAMS)


# -- links ---------------------------------------------------------------------------------------


def test_a_link_to_other_data_fails_its_checksum_and_deleting_never_follows_a_link(tmp_path):
    checkpoint.save(tmp_path / "a", *state_at(1))
    checkpoint.save(tmp_path / "elsewhere", *state_at(2))
    shutil.rmtree(tmp_path / "a" / "optimizer")
    os.symlink(tmp_path / "elsewhere" / "optimizer", tmp_path / "a" / "optimizer")
    with pytest.raises(CheckpointError, match="does not match the checksum it was saved with"):
        checkpoint.restore(tmp_path / "a", TARGET)
    checkpoint.save(tmp_path / "a", *state_at(3), force=True)  # deletes the old "a", link included
    assert int(checkpoint.restore(tmp_path / "elsewhere", TARGET).step) == 2  # what it pointed to is intact

    with manager(tmp_path / "run", max_to_keep=1) as steps:
        steps.save(1, *state_at(1))
        os.symlink(tmp_path / "elsewhere", tmp_path / "run" / "1" / "outside")
        steps.save(2, *state_at(2))  # drops step 1, and its link
    assert steps_that_restore(tmp_path / "run") == [2]
    assert int(checkpoint.restore(tmp_path / "elsewhere", TARGET).step) == 2
