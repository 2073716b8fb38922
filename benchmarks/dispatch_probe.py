"""How many calls a timed program needs before host dispatch stops limiting a small op through XLA.

    python benchmarks/dispatch_probe.py [SIZE]      (default 4096; run on the GPU machine)

Times the packed-in -> packed-out BMM (wgmma engine) of SIZE^3 in jitted programs of 1, 4, 16 and 32 calls
on distinct inputs, in batches of 5, 50 and 400 programs queued back to back (median of 5 batches), and the
host time to dispatch one program. Set XLA_FLAGS=--xla_gpu_enable_command_buffer= to compare without
XLA's command buffers. Session 8 (benchmarks/gpu_results.md, job X) chose gpu_bench's copies_for from it.
"""

import statistics
import sys
import time

import numpy as np

import jax
import jax.numpy as jnp

from jaxbnn import _ffi, formats  # noqa: F401  (_ffi registers the native targets)
import jaxbnn._cuda as _cuda
from gpu_bench import bmm_call, signs

CALLS = (1, 4, 16, 32)
PROGRAMS_PER_BATCH = (5, 50, 400)


def main():
    s = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    ops = 2.0 * s**3
    keys = jax.random.split(jax.random.PRNGKey(0), max(CALLS) + 1)
    w = formats.pack_dense_weights(signs(keys[0], (s, s)))
    packed = [formats.pack_bits(signs(k, (s, s)) >= 0) for k in keys[1:]]
    thr, flip = jnp.zeros((s,), jnp.int32), jnp.zeros((s,), jnp.uint8)
    attrs = dict(k=np.int64(s), n=np.int64(s))
    _cuda.set_kernel_path("wgmma")
    for calls in CALLS:
        fn = jax.jit(lambda wb, wp, t_, f_, *a: [bmm_call("bits", s, s, s)(x, wb, wp, t_, f_, **attrs) for x in a])
        args = [w.bits, w.popcount, thr, flip, *packed[:calls]]
        jax.block_until_ready(fn(*args))
        for programs in PROGRAMS_PER_BATCH:
            samples = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(programs):
                    out = fn(*args)
                jax.block_until_ready(out)
                samples.append((time.perf_counter() - t0) / (programs * calls))
            t0 = time.perf_counter()
            for _ in range(programs):
                out = fn(*args)
            host = (time.perf_counter() - t0) / programs
            jax.block_until_ready(out)
            print(f"{s}^3, {calls:2d} calls per program, {programs:3d} programs per batch: "
                  f"{ops / statistics.median(samples) / 1e12:8.1f} TOPS; host dispatch {host * 1e6:7.1f} us per program",
                  flush=True)


if __name__ == "__main__":
    main()
