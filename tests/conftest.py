"""Test set-up, done before any test module imports JAX.

- 8 virtual CPU devices, so sharding tests run on any machine. XLA reads the
  flag when JAX initializes its backend.
- One persistent compilation cache for the whole run: the xdist workers and
  every Python child a test starts (crash kills, multiprocess runs, the
  example, notebooks, the benchmark smoke run) inherit these variables, so a
  program one of them compiled is loaded by the others instead of compiled
  again. A hit skips only XLA's compilation: the function is still traced and
  lowered, and the loaded program runs. The key covers the lowered program,
  the devices, the compile options, the XLA flags and the jax/jaxlib versions,
  so a hit is the program that compiling would give.

  The cache is a fresh directory, deleted when the run ends: each run starts
  cold and nothing carries over from an earlier one. To keep one between
  runs, point ``JAX_COMPILATION_CACHE_DIR`` at a directory of your own; it is
  then used and left in place.
- The notebooks belong to the slow tier (``-m slow``), with the tests marked
  ``slow``.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Set by the process that starts the run (the xdist controller, or pytest alone); its
# workers and children inherit the variable, find it set, and share the directory.
_CACHE_IS_OURS = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _CACHE_IS_OURS:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="treeopt-tests-jax-cache-")
# Programs that compile in under this many seconds are not written: JAX compiles thousands
# of small ones op by op, and caching those too saved nothing measurable.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")  # any size


def pytest_unconfigure(config):
    if _CACHE_IS_OURS and not hasattr(config, "workerinput"):  # the run is over: its cache goes
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)
