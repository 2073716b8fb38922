"""The packed BMM and XLA's int8 dot under sustained load: time per op in 50 ms windows.

    python benchmarks/sustained.py [--size 16384] [--seconds 1.5]

gpu_bench.py reports one median over ~0.35 s of load; this shows how the rate moves within a longer run
(clock ramps, the board's power limit), to be read beside nvidia-smi samples taken alongside, e.g.
`nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv -lms 100`.
Each line carries a wall-clock timestamp for that purpose.
"""

from __future__ import annotations

import argparse
import datetime
import time

import numpy as np

import jax
import jax.numpy as jnp

from jaxbnn import _ffi, formats  # noqa: F401  (_ffi registers the native targets)


def windows(name, fn, args, ops, seconds):
    jax.block_until_ready(fn(*args))
    time.sleep(1.0)  # start each contender from the same idle state
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start, calls = time.perf_counter(), 0
        while time.perf_counter() < start + 0.05:
            out = fn(*args)  # queued back to back; the stream keeps order
            calls += 1
        jax.block_until_ready(out)
        per_op = (time.perf_counter() - start) / calls
        stamp = datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]
        print(f"{stamp} {name} {per_op * 1e3:.3f} ms/op {ops / per_op / 1e12:,.1f} TOPS", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=16384, help="M = N = K")
    parser.add_argument("--seconds", type=float, default=1.5, help="load per contender")
    args = parser.parse_args()
    s = args.size
    key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
    a_bits = jax.random.bernoulli(key_a, 0.5, (s, s))
    b_bits = jax.random.bernoulli(key_b, 0.5, (s, s))
    weights = formats.pack_dense_weights(jnp.where(b_bits, 1.0, -1.0))
    call = jax.ffi.ffi_call("jaxbnn_bmm_bits", jax.ShapeDtypeStruct((s, formats.num_words(s)), jnp.uint32))
    ours = jax.jit(lambda *a: call(*a, k=np.int64(s), n=np.int64(s)))
    thresholds, flips = jnp.zeros((s,), jnp.int32), jnp.zeros((s,), jnp.uint8)
    windows("jaxbnn packed", ours, (formats.pack_bits(a_bits), weights.bits, weights.popcount, thresholds, flips),
            2.0 * s**3, args.seconds)
    a8, b8 = (jnp.where(bits, 1, -1).astype(jnp.int8) for bits in (a_bits, b_bits))
    int8 = jax.jit(lambda x, y: jax.lax.dot(x, y, preferred_element_type=jnp.int32))
    windows("xla int8", int8, (a8, b8), 2.0 * s**3, args.seconds)


if __name__ == "__main__":
    main()
