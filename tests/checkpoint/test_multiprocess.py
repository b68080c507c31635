"""Two processes, one 2x4 mesh: the same sharded training steps as one process, same result.

The test starts 2 worker processes on loopback (``jax.distributed.initialize``,
CPU collectives), each with 4 virtual CPU devices, so the 8 devices of the
(data x model) mesh span both processes: each process holds one row of the
mesh. They train twice: with the state laid out like the params, and with the
state also split over the "data" axis (ZeRO-1, ``shard_state_over="data"``),
which here splits it across the two processes. They gather the results, and
process 0 writes them out; the test compares them with the same steps run
here on 8 devices of one process: equal up to the rounding of sums that the
cross-process all-reduce adds in another order (rtol 1e-6). Both processes
also write checkpoints together (a ``CheckpointManager`` per job, then a
single directory), which restore onto the shardings exactly as saved: the
directory's lock is the job's (the primary process takes it), not each
process's; while another writer holds the directory, the job's save is
refused on both processes, neither waits for the other.

The workers are this file run as a script (``python test_multiprocess.py
--worker ...``). Every wait has a deadline and the workers are killed when it
passes, so a stuck coordinator cannot hang the test run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import treeopt
from treeopt.partitioning import init_sharded, named_shardings, optimizer_shardings

from _helpers import device_mesh

ROOT = Path(__file__).resolve().parents[2]
NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 4
TIMEOUT_S = 240  # for the whole run of both workers (start-up included)
STEPS = 3
RTOL, ATOL = 1e-6, 1e-7  # as tests/core/test_parity.py for reductions: float summation order

LAYOUTS = {"like_params": None, "zero": "data"}  # shard_state_over of each run
SHAPES = {"w1": (8, 32), "b1": (32,), "w2": (32, 8), "b2": (8,)}
PARAM_SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}


def make_tx():
    # Factored statistics (sharded with an axis dropped) and a global-norm reduction.
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adafactor(1e-2, min_dim_size_to_factor=2))


def global_array(host, sharding):
    """A global array from the same host data on every process (each fills its own shards)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def train(mesh, shard_state_over=None):
    """``STEPS`` sharded training steps; returns every leaf of (params, opt), gathered to the host."""
    rng = np.random.default_rng(0)
    host_params = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    x = rng.standard_normal((16, 8)).astype(np.float32)
    y = rng.standard_normal((16, 8)).astype(np.float32)

    param_sh = named_shardings(PARAM_SPECS, mesh)
    batch_sh = NamedSharding(mesh, P("data"))
    params = {name: global_array(host_params[name], param_sh[name]) for name in SHAPES}
    opt = init_sharded(
        treeopt.Optimizer(make_tx()), params, mesh, PARAM_SPECS, shard_state_over=shard_state_over
    )
    opt_sh = optimizer_shardings(opt, PARAM_SPECS, mesh, shard_state_over=shard_state_over)

    def loss_fn(params, x, y):
        hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
        return jnp.mean((hidden @ params["w2"] + params["b2"] - y) ** 2)

    def train_step(params, opt, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        return opt.update(grads, params), opt

    train_step = jax.jit(
        train_step,
        in_shardings=(param_sh, opt_sh, batch_sh, batch_sh),
        out_shardings=(param_sh, opt_sh),
    )
    x, y = global_array(x, batch_sh), global_array(y, batch_sh)
    for _ in range(STEPS):
        params, opt = train_step(params, opt, x, y)

    # The factored statistics of w1 (8, 32): v_col (32,) keeps its "model" axis, 32/4 per
    # device, and with ZeRO "data" joins it there (32/8); v_row (8,) is replicated, or with ZeRO
    # split over "data", i.e. over the processes.
    v_col, v_row = opt.opt_state[1][0].v_col["w1"], opt.opt_state[1][0].v_row["w1"]
    if shard_state_over is None:
        assert v_col.sharding.spec == P("model"), v_col.sharding
        assert {s.data.shape for s in v_col.addressable_shards} == {(8,)}
        assert v_row.sharding.spec == P(), v_row.sharding
    else:
        assert v_col.sharding.spec == P(("model", "data")), v_col.sharding
        assert {s.data.shape for s in v_col.addressable_shards} == {(4,)}
        assert v_row.sharding.spec == P("data"), v_row.sharding
        assert {s.data.shape for s in v_row.addressable_shards} == {(4,)}
    leaves = jax.tree.leaves((params, opt))
    return [np.asarray(leaf) for leaf in multihost_utils.process_allgather(leaves, tiled=True)]


def make_mesh(devices):
    return device_mesh((2, 4), ("data", "model"), devices=devices)


def refused_together(directory):
    """While another writer holds the directory, the job's first save is refused on every process.

    Only the primary process takes the lock; the others learn its outcome, so
    no process goes on into orbax's save to wait there for the others.
    """
    from treeopt import checkpoint
    from treeopt._checkpoint.writer_lock import WriterLock
    from treeopt.errors import CheckpointInUseError

    run = Path(directory) / "run"
    run.mkdir(exist_ok=True)
    other = WriterLock(str(run / ".treeopt-lock"), str(run))  # another job's writer, here on process 0
    if jax.process_index() == 0:
        other.acquire()
    multihost_utils.sync_global_devices("another writer holds the directory")
    opt = treeopt.Optimizer(optax.sgd(0.1)).init({"w": jnp.zeros(2)})
    manager = checkpoint.CheckpointManager(run)
    try:
        manager.save(0, opt)
    except CheckpointInUseError as e:
        assert str(run) in str(e), e
    else:
        raise AssertionError(f"process {jax.process_index()} saved while another writer held {run}")
    finally:
        manager.close()
        other.release()
    multihost_utils.sync_global_devices("the other writer is gone")


def checkpoint_round_trip(mesh, directory):
    """Both processes save sharded steps through one manager per job, then a single-directory checkpoint;
    each restores onto the shardings. Returns the restored leaves, gathered to the host."""
    from treeopt import checkpoint

    param_sh = named_shardings(PARAM_SPECS, mesh)
    rng = np.random.default_rng(1)
    host = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    params = {name: global_array(host[name], param_sh[name]) for name in SHAPES}
    opt = init_sharded(treeopt.Optimizer(make_tx()), params, mesh, PARAM_SPECS, shard_state_over="data")
    opt_sh = optimizer_shardings(opt, PARAM_SPECS, mesh, shard_state_over="data")
    target, abstract = jax.eval_shape(lambda: opt), jax.eval_shape(lambda: params)
    restored = []
    for step in (1, 2):  # two jobs one after the other: each is one writer, whatever its process count
        with checkpoint.CheckpointManager(Path(directory) / "run") as manager:
            assert manager.save(step, opt, params)
            manager.wait_until_finished()
            assert list(manager.all_steps()) == list(range(1, step + 1))
            got_opt, got_params = manager.restore(
                target, abstract, shardings=opt_sh, param_shardings=param_sh
            )
            restored.append((got_params, got_opt))
    checkpoint.save(Path(directory) / "one", opt, params)
    got_opt, got_params = checkpoint.restore(
        Path(directory) / "one", target, abstract, shardings=opt_sh, param_shardings=param_sh
    )
    restored.append((got_params, got_opt))
    leaves = jax.tree.leaves((params, opt, restored))
    return [np.asarray(leaf) for leaf in multihost_utils.process_allgather(leaves, tiled=True)]


# -- the worker ------------------------------------------------------------------------


def worker(process_id: int, port: int, out_dir: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the default in recent JAX
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=NUM_PROCESSES,
        process_id=process_id,
        initialization_timeout=60,
    )
    assert jax.process_count() == NUM_PROCESSES
    assert jax.local_device_count() == DEVICES_PER_PROCESS
    devices = jax.devices()  # process 0's devices, then process 1's: one mesh row each
    assert len(devices) == NUM_PROCESSES * DEVICES_PER_PROCESS
    for label, over in LAYOUTS.items():
        leaves = train(make_mesh(devices), over)
        if process_id == 0:
            np.savez(Path(out_dir) / f"{label}.npz", *leaves)
    refused_together(out_dir)
    leaves = checkpoint_round_trip(make_mesh(devices), out_dir)
    if process_id == 0:
        np.savez(Path(out_dir) / "checkpoints.npz", *leaves)
    jax.distributed.shutdown()


# -- the test --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_workers(out_dir: Path) -> list[tuple[int | None, str]]:
    """Starts the workers and waits for them (killing them at the deadline): [(returncode, output)]."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}",
        JAX_PLATFORMS="cpu",
        # The repository for treeopt, tests/ for the shared helpers (the worker imports _helpers).
        PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")) if p
        ),
    )
    port = free_port()
    logs = [out_dir / f"worker{i}.log" for i in range(NUM_PROCESSES)]
    procs = []
    try:
        for i, log in enumerate(logs):
            with open(log, "wb") as out:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, __file__, "--worker", str(i), str(port), str(out_dir)],
                        cwd=ROOT,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # its own process group: killed as a whole
                    )
                )
        deadline = time.monotonic() + TIMEOUT_S
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                break
            if proc.returncode != 0:
                break  # one failed: the other would wait for it until its own timeout
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    return [(proc.returncode, log.read_text(errors="replace")) for proc, log in zip(procs, logs, strict=True)]


@pytest.mark.slow  # two Python workers on loopback: the slow tier (-m slow) runs it
def test_two_processes_match_one_process(tmp_path):
    for attempt in range(2):  # a second try only if the free port was taken meanwhile
        results = run_workers(tmp_path)
        if all(code == 0 for code, _ in results):
            break
        port_taken = any("address already in use" in out.lower() for _, out in results)
        if not port_taken or attempt == 1:
            report = "\n".join(
                f"--- worker {i}: exit code {code} (None or negative: killed after {TIMEOUT_S}s)\n{out[-4000:]}"
                for i, (code, out) in enumerate(results)
            )
            raise AssertionError(f"the multi-process run failed:\n{report}")

    singles = {}
    for label, over in LAYOUTS.items():
        with np.load(tmp_path / f"{label}.npz") as data:
            multi = [data[f"arr_{i}"] for i in range(len(data.files))]
        single = singles[label] = train(make_mesh(jax.devices()[:8]), over)
        assert len(multi) == len(single)
        for got, want in zip(multi, single, strict=True):
            assert got.shape == want.shape and got.dtype == want.dtype
            # Same program, same shards; only the order in which cross-process all-reduces
            # (gloo) add the 4 "model" partial sums may differ: at most an ulp or so.
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=label)
    # Splitting the state over "data" leaves the numbers as they were.
    for got, want in zip(singles["zero"], singles["like_params"], strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    # Checkpoints both processes wrote together restore exactly what was saved, three times over.
    with np.load(tmp_path / "checkpoints.npz") as data:
        leaves = [data[f"arr_{i}"] for i in range(len(data.files))]
    saved = len(leaves) // 4  # (params, opt), then steps 1 and 2 and the single directory restored
    assert saved * 4 == len(leaves) and saved > 0
    for copy in range(1, 4):
        for got, want in zip(leaves[copy * saved : (copy + 1) * saved], leaves[:saved], strict=True):
            np.testing.assert_array_equal(got, want)
    assert sorted(os.listdir(tmp_path / "run")) == ["1", "2"]  # no lock file or debris left


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        sys.exit(f"usage: {sys.argv[0]} --worker PROCESS_ID PORT OUT_DIR")
