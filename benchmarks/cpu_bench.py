"""CPU benchmark: jaxbnn's packed bmm / bconv2d against XLA's own float32 dot / convolution on the same
±1 data, in one process, under jax.jit.

Ours takes packed activations and packed weights (the inference layout) and returns int32 dot products;
XLA takes the float32 ±1 tensors and returns float32 (the same numbers, checked before timing). Timings
are medians after warm-up, each call ending in block_until_ready, taken two ways:
- interleaved (ours, XLA, ours, ...): every call starts with the caches the other side left (cold for us:
  XLA's float32 tensors are 32x larger than the packed ones), as in a single pass through unrelated work;
- back to back (alternating blocks of calls of one side, first call of each block dropped): each side in its
  steady state, as layers of one network run repeatedly on warm weights.
Both alternate between the sides, so background load on the machine hits both alike.

    python benchmarks/cpu_bench.py --runs 3      # the record: replaces this machine's cpu_bench.py section
    python benchmarks/cpu_bench.py --out -       # print only

With --runs N the whole sweep is repeated N times and every cell of the table is the median over the runs
(a shared 2-core machine varies by tens of percent from run to run). The results replace this script's
section of the machine's results file (benchmarks/results/cpu-<model>-<cores>core.md; see
benchmarks/results_file.py).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import results_file
from jaxbnn import _cpu, formats, ops

BMM_SIZES = [128, 256, 512, 1024, 2048, 4096]  # TCBNN's square BMM sizes: M = N = K
# ResNet-18 3x3 convolutions (stride 1, SAME): (batch, height/width, in channels, out channels)
CONV_LAYERS = [(b, hw, c, c) for b in (1, 8) for hw, c in ((56, 64), (28, 128), (14, 256), (7, 512))]


def signs(rng, shape):
    return rng.choice(np.array([-1.0, 1.0], np.float32), shape)


def interleaved_medians(ours, xla, min_reps=5, budget_s=3.0):
    """Median seconds of `ours()` and `xla()` (each returns a jax array), alternating calls."""
    for _ in range(3):
        jax.block_until_ready(ours())
        jax.block_until_ready(xla())
    times = {"ours": [], "xla": []}
    start = time.perf_counter()
    while len(times["ours"]) < min_reps or (time.perf_counter() - start < budget_s and len(times["ours"]) < 200):
        for name, fn in (("ours", ours), ("xla", xla)):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t)
    return float(np.median(times["ours"])), float(np.median(times["xla"]))


def back_to_back_medians(ours, xla, block=8, min_blocks=3, budget_s=3.0):
    """Median seconds of `ours()` and `xla()`, each called `block` times in a row, blocks alternating."""
    times = {"ours": [], "xla": []}
    start = time.perf_counter()
    blocks = 0
    while blocks < min_blocks or (time.perf_counter() - start < budget_s and blocks < 50):
        for name, fn in (("ours", ours), ("xla", xla)):
            jax.block_until_ready(fn())  # the first call of a block sees the other side's caches: dropped
            for _ in range(block):
                t = time.perf_counter()
                jax.block_until_ready(fn())
                times[name].append(time.perf_counter() - t)
        blocks += 1
    return float(np.median(times["ours"])), float(np.median(times["xla"]))


def timings(ours, xla):
    t_ours, t_xla = interleaved_medians(ours, xla)
    w_ours, w_xla = back_to_back_medians(ours, xla)
    return dict(ours=t_ours, xla=t_xla, ours_warm=w_ours, xla_warm=w_xla)


def bench_bmm(size, rng):
    a_signs, w_signs = signs(rng, (size, size)), signs(rng, (size, size))  # y = a @ w
    a_packed = ops.pack_bits(a_signs)
    weights = formats.pack_dense_weights(w_signs)
    ours = jax.jit(lambda a: ops.bmm(a, weights))
    xla = jax.jit(lambda a, w: a @ w)
    a_f32, w_f32 = jnp.asarray(a_signs), jnp.asarray(w_signs)
    np.testing.assert_array_equal(np.asarray(ours(a_packed)), np.asarray(xla(a_f32, w_f32)).astype(np.int32))
    times = timings(lambda: ours(a_packed), lambda: xla(a_f32, w_f32))
    return dict(layer=f"{size} x {size} x {size}", k=size, ops=2.0 * size**3, **times)


def bench_conv(batch, hw, c, o, rng):
    x_signs, w_signs = signs(rng, (batch, hw, hw, c)), signs(rng, (3, 3, c, o))
    x_packed = ops.pack_bits(x_signs)
    weights = formats.pack_conv_weights(w_signs)
    ours = jax.jit(lambda x: ops.bconv2d(x, weights, padding="SAME", pad_value="zero"))
    xla = jax.jit(
        lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    )
    x_f32, w_f32 = jnp.asarray(x_signs), jnp.asarray(w_signs)
    np.testing.assert_array_equal(np.asarray(ours(x_packed)), np.asarray(xla(x_f32, w_f32)).astype(np.int32))
    times = timings(lambda: ours(x_packed), lambda: xla(x_f32, w_f32))
    k = 9 * c
    return dict(layer=f"b{batch} {hw}x{hw}x{c} -> {o}, 3x3", k=k, ops=2.0 * batch * hw * hw * o * k, **times)


def machine_description():
    return f"{results_file.cpu_model()}, {os.cpu_count()} cores, kernel tier {_cpu.active_isa()}"


def table(rows):
    lines = [
        "| layer | K | jaxbnn (ms) | jaxbnn (GOPS) | XLA f32 (ms) | XLA f32 (GFLOPS) | speed-up "
        "| back to back: jaxbnn (ms) | XLA f32 (ms) | speed-up |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['layer']} | {r['k']} | {r['ours'] * 1e3:.3f} | {r['ops'] / r['ours'] / 1e9:.0f} | "
            f"{r['xla'] * 1e3:.3f} | {r['ops'] / r['xla'] / 1e9:.1f} | {r['xla'] / r['ours']:.1f}x | "
            f"{r['ours_warm'] * 1e3:.3f} | {r['xla_warm'] * 1e3:.3f} | {r['xla_warm'] / r['ours_warm']:.1f}x |"
        )
    return "\n".join(lines)


def median_rows(runs):
    """Per layer, the median of every timing over the runs (runs: lists of rows in the same layer order)."""
    keys = ("ours", "xla", "ours_warm", "xla_warm")
    return [{**rows[0], **{k: float(np.median([r[k] for r in rows])) for k in keys}} for rows in zip(*runs)]


def sweep():
    rng = np.random.default_rng(0)
    bmm_rows = []
    for size in BMM_SIZES:
        bmm_rows.append(bench_bmm(size, rng))
        print(table(bmm_rows[-1:]).splitlines()[-1], flush=True)
    conv_rows = []
    for layer in CONV_LAYERS:
        conv_rows.append(bench_conv(*layer, rng))
        print(table(conv_rows[-1:]).splitlines()[-1], flush=True)
    return bmm_rows, conv_rows


SECTION = "cpu_bench.py"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", "--write", dest="out", metavar="PATH",
                        help="the results file whose cpu_bench.py section this run replaces (default: "
                        "benchmarks/results/<this machine's kind>.md; '-': print only)")
    parser.add_argument("--runs", type=int, default=1, help="repeat the sweep; report per-cell medians")
    args = parser.parse_args()
    runs = [sweep() for _ in range(args.runs)]
    bmm_rows = median_rows([bmm for bmm, _ in runs])
    conv_rows = median_rows([conv for _, conv in runs])
    commit = results_file.git_commit(("xla_ffi/cpu", "xla_ffi/common", "jaxbnn"))

    body = "\n".join([
        "## CPU kernels against XLA float32 (`benchmarks/cpu_bench.py`)",
        "",
        *results_file.run_header(machine_description(), commit),
        f"- runs: {args.runs} full sweep(s) in one process; every cell is the median over the runs",
        "",
        "Both sides under `jax.jit` in one process, medians after warm-up, each call ending in",
        "`block_until_ready`; interleaved calls (each side starts on the caches the other left) and back-to-back",
        "blocks (each side warm). jaxbnn: packed uint32 activations and FSB weights in, int32 dot products out.",
        "XLA: float32 ±1 tensors in, float32 out (checked equal). GOPS counts 2 ops (multiply, add) per ±1",
        "multiply-accumulate on both sides.",
        "",
        "### bmm (M = N = K), `ops.bmm` vs `a @ w`",
        "",
        table(bmm_rows),
        "",
        "### ResNet-18 3x3 convolutions (stride 1, SAME, zero padding), `ops.bconv2d` vs `lax.conv_general_dilated`",
        "",
        table(conv_rows),
        "",
    ])  # fmt: skip
    print()
    print(body)
    if args.out != "-":
        out = args.out or results_file.default_path(results_file.cpu_kind())
        results_file.write_section(out, SECTION, body, f"{results_file.cpu_model()}, {os.cpu_count()} cores")
        print(f"(written to {out}, section {SECTION})")


if __name__ == "__main__":
    main()
