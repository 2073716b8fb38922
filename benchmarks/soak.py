"""Soak: a packed model called many times under jit, and the eager ops many times, with memory watched.

    python benchmarks/soak.py [--model-calls 100000] [--eager-calls 10000]

Prints the resident memory after a warm-up and at the end of each phase, and each phase's time per call.
A leak shows as growth that scales with the calls (an eager op that recompiled per call kept ~1.5 MiB each).
docs/reliability.md records the figures of a run with the commit that produced them.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxbnn.cli import integer_at_least


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def phase(name, call, count, warm=20):
    for _ in range(warm):
        call()
    before, start = rss_mib(), time.perf_counter()
    for _ in range(count):
        call()
    seconds = time.perf_counter() - start
    after = rss_mib()
    print(f"{name}: {count} calls, {seconds / count * 1e6:.1f} us per call, RSS {before:.1f} -> {after:.1f} MiB "
          f"({after - before:+.1f} MiB)")
    return after - before


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-calls", type=integer_at_least(1), default=100_000)
    parser.add_argument("--eager-calls", type=integer_at_least(1), default=10_000)
    args = parser.parse_args(argv)

    from flax import nnx

    from jaxbnn import formats, ops, packed_model, runtime
    from jaxbnn.export import export_model
    from jaxbnn.models import build_model

    model = build_model("mnist-conv", "bnn", input_shape=(12, 12, 1), num_classes=10, width=0.25, rngs=nnx.Rngs(0))
    model.eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "soak.jbnn"
        packed_model.save(path, export_model(model))
        net = runtime.load(path)
    images = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (8, 12, 12, 1)), jnp.float32)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
    model_growth = phase("packed model (jit)", lambda: net(images).block_until_ready(), args.model_calls)

    rng = np.random.default_rng(1)
    a = ops.pack_bits(jnp.asarray(rng.standard_normal((8, 64)), jnp.float32))
    dense = formats.pack_dense_weights(rng.standard_normal((64, 16)).astype(np.float32))
    x = ops.pack_bits(jnp.asarray(rng.standard_normal((1, 6, 6, 40)), jnp.float32))
    conv = formats.pack_conv_weights(rng.standard_normal((3, 3, 40, 8)).astype(np.float32))
    threshold = np.arange(16, dtype=np.int32) - 8

    def eager():
        ops.bmm(a, dense).block_until_ready()
        ops.bmm(a, dense, threshold=threshold).block_until_ready()
        ops.bconv2d(x, conv, pool=(2, 2)).block_until_ready()

    eager_growth = phase("eager ops (bmm, bmm + threshold, pooled bconv2d)", eager, args.eager_calls)
    return 0 if max(model_growth, eager_growth) < 50 else 1


if __name__ == "__main__":
    sys.exit(main())
