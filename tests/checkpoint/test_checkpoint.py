"""Orbax checkpoints of treeopt.Optimizer: save / restore, CheckpointManager, shardings, damage.

Every transformation of the core parity list is saved with its params,
restored into an abstract target from ``jax.eval_shape`` and trains on
bit-identically. Restoring onto NamedShardings (8 virtual CPU devices, see
conftest.py) gives each leaf the requested sharding. A checkpoint of another
model/optimizer raises naming the paths; a corrupted checkpoint directory
raises (never a silently wrong optimizer); a save killed mid-write leaves the
previous checkpoint restorable. Arrays are tiny so the suite stays quick.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import (
    CASES,
    abstract,
    as_numpy,
    assert_same_state,
    assert_trains_identically,
    fresh,
    initial_params,
    trained,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import treeopt
from treeopt import checkpoint as ckpt
from treeopt import serialization as ser
from treeopt.errors import CheckpointError

from _helpers import device_mesh

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def abstract_params(name):
    return jax.eval_shape(lambda: initial_params(name))


def assert_same_params(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# -- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_orbax_round_trip(name, tmp_path):
    params, opt = trained(name)
    ckpt.save(tmp_path / "ckpt", opt, params)
    restored, restored_params = ckpt.restore(
        tmp_path / "ckpt", abstract(name, opt), params=abstract_params(name)
    )
    assert_same_state(restored, opt)
    assert_same_params(restored_params, params)
    assert type(restored_params) is type(params)
    assert_trains_identically(restored_params, opt, restored)


def test_optimizer_alone_into_a_concrete_target(tmp_path):
    params, opt = trained("adafactor")
    ckpt.save(tmp_path / "opt", opt)
    restored = ckpt.restore(tmp_path / "opt", fresh("adafactor"))
    assert_same_state(restored, opt)
    with pytest.raises(CheckpointError, match="holds no params"):
        ckpt.restore(tmp_path / "opt", fresh("adafactor"), params=params)


def test_params_are_stored_by_name_and_restore_into_another_container(tmp_path):
    import flax

    params, opt = trained("adam")
    ckpt.save(tmp_path / "c", opt, params)
    import orbax.checkpoint as ocp

    raw = ocp.StandardCheckpointer().restore(tmp_path / "c" / "params")
    assert sorted(raw) == ["dense/bias", "dense/kernel", "out/0"]
    frozen = flax.core.FrozenDict(jax.eval_shape(lambda: params))
    _, restored_params = ckpt.restore(tmp_path / "c", abstract("adam"), params=frozen)
    assert isinstance(restored_params, flax.core.FrozenDict)
    assert_same_params(flax.core.unfreeze(restored_params), params)


def test_save_refuses_to_overwrite_unless_forced(tmp_path):
    params, opt = trained("sgd")
    ckpt.save(tmp_path / "c", opt)
    with pytest.raises(Exception, match="exists"):  # orbax's own error
        ckpt.save(tmp_path / "c", opt)
    newer = opt.load_state_dict({**opt.state_dict(), "step": 7})
    ckpt.save(tmp_path / "c", newer, params, force=True)
    restored, _ = ckpt.restore(tmp_path / "c", fresh("sgd"), params=params)
    assert int(restored.step) == 7
    assert os.listdir(tmp_path) == ["c"]  # nothing left beside it
    ckpt.save(tmp_path / "new" / "d", opt, force=True)  # forced, where nothing exists yet
    assert_same_state(ckpt.restore(tmp_path / "new" / "d", fresh("sgd")), opt)
    assert os.listdir(tmp_path / "new") == ["d"]


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        ckpt.restore(tmp_path / "nothing", fresh("adam"))


# -- CheckpointManager -----------------------------------------------------------------------


def test_checkpoint_manager_keeps_the_latest_steps(tmp_path):
    params = initial_params("adam")
    opt = treeopt.Optimizer(optax.adam(1e-2)).init(params)
    states = {}
    with ckpt.CheckpointManager(tmp_path, max_to_keep=2) as manager:
        assert manager.latest_step() is None
        with pytest.raises(FileNotFoundError, match="No checkpoint"):
            manager.restore(abstract("adam"))
        for step in range(1, 5):
            params = opt.update(jax.tree.map(jnp.ones_like, params), params)
            assert manager.save(step, opt, params)
            states[step] = as_numpy(opt)
        manager.wait_until_finished()
        assert list(manager.all_steps()) == [3, 4] and manager.latest_step() == 4
    assert sorted(os.listdir(tmp_path)) == ["3", "4"]  # the dropped steps are gone from the disk

    manager = ckpt.CheckpointManager(tmp_path, max_to_keep=2)  # a fresh process would do this
    latest, latest_params = manager.restore(abstract("adam"), params=abstract_params("adam"))
    got = as_numpy(latest)
    assert got.keys() == states[4].keys() and int(latest.step) == 4
    for k in got:
        np.testing.assert_array_equal(got[k], states[4][k])
    assert_same_params(latest_params, params)
    older = manager.restore(abstract("adam"), step=3)
    assert int(older.step) == 3
    with pytest.raises(FileNotFoundError, match="step 1"):
        manager.restore(abstract("adam"), step=1)
    sd = manager.restore_state_dict()
    assert int(sd["step"]) == 4
    manager.close()


def test_options_with_their_own_todelete_subdir_keep_the_dropped_steps_there(tmp_path):
    import orbax.checkpoint as ocp

    _, opt = trained("sgd")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=1, todelete_subdir="trash", enable_async_checkpointing=False
    )
    with ckpt.CheckpointManager(tmp_path, options=options) as manager:
        for step in (1, 2):
            assert manager.save(step, opt)
        assert list(manager.all_steps()) == [2]
    assert sorted(os.listdir(tmp_path)) == ["2", "trash"]
    assert os.listdir(tmp_path / "trash") == ["1"]  # kept there, as orbax does


def test_checkpoint_manager_save_interval(tmp_path):
    _, opt = trained("sgd")
    with ckpt.CheckpointManager(tmp_path, save_interval_steps=2, enable_async_checkpointing=False) as m:
        saved = [m.save(step, opt) for step in range(5)]
        assert saved == [True, False, True, False, True]
        assert m.save(5, opt, force=True)
        assert list(m.all_steps()) == [0, 2, 4, 5]


# -- shardings -------------------------------------------------------------------------------


def _requested_shardings(target, mesh):
    def pick(leaf):
        divisible = leaf.ndim > 0 and leaf.shape[0] % mesh.size == 0
        return NamedSharding(mesh, P("x") if divisible else P())

    return jax.tree.map(pick, target)


@pytest.mark.parametrize("name", ["adafactor", "noisy_sgd", "multi_transform"])
def test_restore_onto_named_shardings(name, tmp_path):
    assert len(jax.devices()) == 8
    mesh = device_mesh((8,), ("x",), "default")
    params = {
        "dense": {"kernel": jnp.arange(32.0).reshape(8, 4), "bias": jnp.ones(4)},
        "table": jnp.ones((16, 2)),
    }
    opt = treeopt.Optimizer(CASES[name]()).init(params)
    params = opt.update(jax.tree.map(jnp.cos, params), params)
    ckpt.save(tmp_path / "c", opt, params)

    target = jax.eval_shape(treeopt.Optimizer(opt.tx).init, params)
    shardings = _requested_shardings(target, mesh)
    param_shardings = _requested_shardings(params, mesh)
    restored, restored_params = ckpt.restore(
        tmp_path / "c",
        target,
        params=jax.eval_shape(lambda: params),
        shardings=shardings,
        param_shardings=param_shardings,
    )
    for leaf, wanted in zip(jax.tree.leaves(restored), jax.tree.leaves(shardings), strict=True):
        assert leaf.sharding == wanted
    if name != "noisy_sgd":  # its state is a count and a key: nothing to shard
        assert any(s.spec == P("x") for s in jax.tree.leaves(shardings))
    for leaf, wanted in zip(jax.tree.leaves(restored_params), jax.tree.leaves(param_shardings), strict=True):
        assert leaf.sharding == wanted
    assert_same_state(restored, opt)
    assert_same_params(restored_params, params)

    # the same through the abstract target's own shardings
    annotated = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), target, shardings
    )
    again = ckpt.restore(tmp_path / "c", annotated)
    for leaf, wanted in zip(jax.tree.leaves(again), jax.tree.leaves(shardings), strict=True):
        assert leaf.sharding == wanted

    # one sharding for every leaf
    replicated = NamedSharding(mesh, P())
    everywhere = ckpt.restore(tmp_path / "c", target, shardings=replicated)
    assert all(leaf.sharding == replicated for leaf in jax.tree.leaves(everywhere))


def test_load_state_dict_places_values_on_the_targets_shardings():
    mesh = device_mesh((8,), ("x",), "default")
    params = {"w": jnp.ones((8, 2))}
    opt = treeopt.Optimizer(optax.adam(1e-2)).init(params)
    sharded = jax.device_put(opt, _requested_shardings(opt, mesh))
    restored = sharded.load_state_dict(opt.state_dict())
    assert restored.opt_state[0].mu["w"].sharding == NamedSharding(mesh, P("x"))


# -- mismatches ---------------------------------------------------------------------------------


def test_checkpoint_of_another_optimizer_names_every_path(tmp_path):
    params, opt = trained("sgd_momentum")
    ckpt.save(tmp_path / "c", opt, params)
    with pytest.raises(ser.StateDictError) as info:
        ckpt.restore(tmp_path / "c", abstract("adam"))
    message = str(info.value)
    assert str(tmp_path / "c") in message
    assert "opt_state/0/mu/dense/kernel" in message and "opt_state/0/trace/out/0" in message

    with pytest.warns(ser.StateDictWarning, match="opt_state/0/trace"):
        partial = ckpt.restore(tmp_path / "c", fresh("adam"), strict=False)
    assert int(partial.step) == 2


def test_checkpoint_of_another_model_names_every_param(tmp_path):
    params, opt = trained("adam")
    ckpt.save(tmp_path / "c", opt, params)
    other = {"dense": {"kernel": jnp.ones((3, 5)), "bias": jnp.ones(4)}, "out": [jnp.ones((4, 2))]}
    with pytest.raises(
        ser.StateDictError, match=r"dense/kernel: expected float32\[3, 5\], got float32\[3, 4\]"
    ):
        ckpt.restore(tmp_path / "c", treeopt.Optimizer(optax.adam(1e-2)).init(other))
    with pytest.raises(ser.StateDictError, match=r"params to restore into:\nshape/dtype mismatch"):
        ckpt.restore(tmp_path / "c", abstract("adam"), params=jax.eval_shape(lambda: other))


def test_warm_start_from_a_checkpoint(tmp_path):
    params, adam = trained("adam", steps=3)
    ckpt.save(tmp_path / "c", adam, params)
    adamw = treeopt.Optimizer(optax.adamw(1e-3)).init(params)
    adamw, report = ser.warm_start(adamw, ckpt.restore_state_dict(tmp_path / "c"))
    assert report.ok
    np.testing.assert_array_equal(adamw.opt_state[0].mu["dense/kernel"], adam.opt_state[0].mu["dense/kernel"])


# -- damage ------------------------------------------------------------------------------------


def _files(directory):
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs)


def _damaged_copies(good, tmp_path, needle):
    """Yields ``(description, directory)``: a copy of ``good`` with one file damaged."""
    for path in _files(good):
        relative = os.path.relpath(path, good)
        data = open(path, "rb").read()
        damages = {"delete": None, "truncate": data[: len(data) // 2]}
        if data:
            flipped = bytearray(data)
            flipped[len(data) // 2] ^= 0xFF
            damages["flip"] = bytes(flipped)
        at = data.find(needle)
        if at >= 0:  # the array's own bytes, stored uncompressed: the quiet kind of damage
            flipped = bytearray(data)
            flipped[at + 5] ^= 0x10
            damages["flip data"] = bytes(flipped)
        for damage, content in damages.items():
            bad = tmp_path / "bad"
            shutil.rmtree(bad, ignore_errors=True)
            shutil.copytree(good, bad)
            target = os.path.join(bad, relative)
            if content is None:
                os.remove(target)
            else:
                with open(target, "wb") as f:
                    f.write(content)
            yield (relative, damage), bad


# orbax leaves "Event loop is closed" noise from its reader threads after a failed read
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupted_checkpoint_directory_never_restores_silently(tmp_path):
    """Flip a byte of, truncate, or delete each file: restore raises, or gives the same state."""
    params = {"w": jax.random.normal(jax.random.key(0), (64,))}  # incompressible values
    opt = treeopt.Optimizer(optax.adam(1e-2)).init(params)
    params = opt.update(jax.tree.map(jnp.sin, params), params)
    good = tmp_path / "good"
    ckpt.save(good, opt, params)
    expected = as_numpy(opt)
    needle = np.asarray(opt.opt_state[0].mu["w"]).tobytes()

    raised = set()
    for case, bad in _damaged_copies(good, tmp_path, needle):
        try:
            restored, restored_params = ckpt.restore(
                bad, treeopt.Optimizer(opt.tx).init(params), params=params
            )
        except (CheckpointError, ser.StateDictError, FileNotFoundError):
            raised.add(case)
            continue
        got = as_numpy(restored)
        assert got.keys() == expected.keys()
        for k in got:
            np.testing.assert_array_equal(got[k], expected[k], err_msg=str(case))
        assert_same_params(restored_params, params)
    gc.collect()  # orbax's abandoned reads complain here, under this test's filter (one full pass)
    for essential in ("_CHECKPOINT_METADATA", os.path.join("optimizer", "_METADATA")):
        assert (essential, "delete") in raised and (essential, "truncate") in raised
    assert any(damage == "flip data" for _, damage in raised)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_checksum_mismatch_is_reported(tmp_path):
    import json

    _, opt = trained("adam")
    ckpt.save(tmp_path / "c", opt)
    meta_path = tmp_path / "c" / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_path.read_text())
    meta["custom_metadata"]["treeopt"]["checksums"]["optimizer"][0] ^= 1
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="checksum"):
        ckpt.restore(tmp_path / "c", fresh("adam"))
    # without its metadata there is nothing to check against: refused unless verify=False
    meta_path.unlink()
    with pytest.raises(CheckpointError, match="no checksum"):
        ckpt.restore(tmp_path / "c", fresh("adam"))
    assert_same_state(ckpt.restore(tmp_path / "c", fresh("adam"), verify=False), opt)


def test_a_directory_that_is_not_a_treeopt_checkpoint(tmp_path):
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "plain", {"a": jnp.ones(2)})
    checkpointer.wait_until_finished()
    with pytest.raises(CheckpointError):
        ckpt.restore(tmp_path / "plain", fresh("adam"))


# -- interrupted saves ---------------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import sys, time
    import jax.numpy as jnp, optax
    import treeopt
    from treeopt import checkpoint as ckpt

    directory, mode = sys.argv[1], sys.argv[2]
    params = {"w": jnp.arange(4.0)}
    opt = treeopt.Optimizer(optax.adam(0.1)).init(params)
    manager = ckpt.CheckpointManager(directory, max_to_keep=3)
    step = 0
    while True:
        step += 1
        params = opt.update({"w": jnp.ones(4)}, params)
        if mode == "hang" and step == 2:
            # Let every file of step 2 be written, then stop before orbax commits it.
            import orbax.checkpoint._src.path.atomicity as atomicity

            async def hang(self, *args, **kwargs):
                print("WRITING", step, flush=True)
                time.sleep(600)

            atomicity.AtomicRenameTemporaryPath.finalize = hang
        manager.save(step, opt, params)
        manager.wait_until_finished()
        print("SAVED", step, flush=True)
    """
)


def _run_child(directory, mode, stop_after):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    env["XLA_FLAGS"] = ""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(directory), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    seen = []
    try:
        assert child.stdout is not None
        for line in child.stdout:
            seen.append(line.split())
            if seen[-1][0] == stop_after[0] and int(seen[-1][1]) >= stop_after[1]:
                break
            if int(seen[-1][1]) > stop_after[1] + 3:
                break  # it went past the point it should stop at: the caller's checks fail, nothing hangs
    finally:
        child.kill()  # SIGKILL: no cleanup, no atexit, as a preempted job
        child.wait(timeout=60)
    return seen


def _check_latest(directory, expected_step):
    with ckpt.CheckpointManager(directory) as manager:
        assert manager.latest_step() == expected_step
        opt = manager.restore(jax.eval_shape(treeopt.Optimizer(optax.adam(0.1)).init, {"w": jnp.ones(4)}))
    assert int(opt.step) == expected_step
    # the Adam state of `expected_step` updates with gradient 1: count == step
    assert int(opt.opt_state[0].count) == expected_step
    return opt


def test_save_killed_before_commit_leaves_the_previous_checkpoint(tmp_path):
    seen = _run_child(tmp_path, "hang", ("WRITING", 2))
    assert ["SAVED", "1"] in seen and seen[-1] == ["WRITING", "2"]
    leftovers = [name for name in os.listdir(tmp_path) if name.startswith("2")]
    assert leftovers and all("tmp" in name for name in leftovers)  # step 2 was mid-write
    _check_latest(tmp_path, 1)

    # the next run saves over the debris
    _, opt = trained("adam")
    with ckpt.CheckpointManager(tmp_path) as manager:
        assert manager.save(2, opt)
        manager.wait_until_finished()
        assert list(manager.all_steps()) == [1, 2]


@pytest.mark.parametrize("after", [1, 3])
def test_save_killed_at_a_random_moment_leaves_a_restorable_checkpoint(tmp_path, after):
    seen = _run_child(tmp_path, "loop", ("SAVED", after))
    last_reported = int(seen[-1][1])
    with ckpt.CheckpointManager(tmp_path) as manager:
        latest = manager.latest_step()
    # killed right after reporting `last_reported`, maybe while writing the next one
    assert latest is not None and latest >= last_reported
    _check_latest(tmp_path, latest)
