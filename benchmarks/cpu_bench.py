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
    python benchmarks/cpu_bench.py --modes --runs 3   # TAB's four products per layer: the "cpu_bench.py modes"
                                                      # section

--modes times the layers of TAB's CPU benchmark ("TAB: Unified and Optimized Ternary, Binary, and
Mixed-precision Neural Network Inference on the Edge"): ResNet-18's 3x3 convolutions and Darknet-19's layers
16 and 18, at batch 1 and 8, each as TNN (ternary activations and weights), TBN (ternary activations,
binary weights), BTN (binary activations, ternary weights) and BNN, against XLA float32 on the same values.

With --runs N the whole sweep is repeated N times and every cell of the table is the median over the runs
(a shared 2-core machine varies by tens of percent from run to run). The results replace this script's
section of the machine's results file (benchmarks/results/cpu-<model>-<cores>core.md; see
benchmarks/results_file.py).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import results_file
from jaxbnn import formats, ops
from jaxbnn.cli import integer_at_least

BMM_SIZES = [128, 256, 512, 1024, 2048, 4096]  # TCBNN's square BMM sizes: M = N = K
# ResNet-18 3x3 convolutions (stride 1, SAME): (batch, height/width, in channels, out channels)
CONV_LAYERS = [(b, hw, c, c) for b in (1, 8) for hw, c in ((56, 64), (28, 128), (14, 256), (7, 512))]
# TAB's layers (3x3, stride 1, SAME): (network, layer, height/width, in channels, out channels). Darknet-19's
# layers 16 and 18 (its 16th and 18th convolutions, YOLO9000's table at a 224 x 224 input) share one shape.
MODE_LAYERS = [("ResNet-18", "3x3", hw, c, c) for hw, c in ((56, 64), (28, 128), (14, 256), (7, 512))] + [
    ("Darknet-19", "16 / 18", 7, 512, 1024)]
MODES = ("tnn", "tbn", "btn", "bnn")
# TAB's figures for its modes, against its float32 layers (a plain C++ GEMM on Intel CPUs): the theoretical
# speedup of its bitwise GEMM (reciprocal throughputs of Intel 8th-10th generation cores, packing excluded),
# and the single-layer speedups it reports on its laptop CPU for Darknet-19's layers 16 and 18 ("more than").
TAB_THEORETICAL = {"tnn": 39.4, "tbn": 42.7, "btn": 73.1, "bnn": 85.3}
TAB_DARKNET_16_18 = {"tnn": 31.0, "tbn": 39.0, "btn": 45.0, "bnn": 62.0}
# and its largest single-layer speedups on ResNet-18 (Raspberry Pi 400 CPU; the layer is not named in the text)
TAB_RESNET_BEST = {"tnn": 38.3, "tbn": 44.8, "btn": 54.4, "bnn": 72.3}
TNN_TARGET = 15.0  # issue 56: TNN at least 15x float32 on layers of at least 256 filters


def signs(rng, shape):
    return rng.choice(np.array([-1.0, 1.0], np.float32), shape)


def ternary(rng, shape):
    return rng.integers(-1, 2, shape).astype(np.float32)


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


def bench_mode(network, layer, batch, hw, c, o, mode, rng):
    """One of TAB's products on a 3x3 convolution: packed planes in, int32 out, against XLA float32 on the
    same -1 / 0 / +1 values (results checked equal)."""
    ternary_x, ternary_w = mode in ("tnn", "tbn"), mode in ("tnn", "btn")
    x_values = (ternary if ternary_x else signs)(rng, (batch, hw, hw, c))
    w_values = (ternary if ternary_w else signs)(rng, (3, 3, c, o))
    x = formats.pack_ternary_pm_planes(x_values) if ternary_x else ops.pack_bits(x_values)
    weights = (formats.pack_ternary_conv_weights if ternary_w else formats.pack_conv_weights)(w_values)
    ours = jax.jit(lambda x: ops.bconv2d(x, weights, padding="SAME", pad_value="zero"))
    xla = jax.jit(
        lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    )
    x_f32, w_f32 = jnp.asarray(x_values), jnp.asarray(w_values)
    np.testing.assert_array_equal(np.asarray(ours(x)), np.asarray(xla(x_f32, w_f32)).astype(np.int32))
    times = timings(lambda: ours(x), lambda: xla(x_f32, w_f32))
    k = 9 * c
    return dict(network=network, layer=f"{layer}: b{batch} {hw}x{hw}x{c} -> {o}", mode=mode, filters=o, k=k,
                ops=2.0 * batch * hw * hw * o * k, **times)


def mode_table(rows):
    lines = [
        "| network, layer | mode | jaxbnn (ms) | jaxbnn (GOPS) | XLA f32 (ms) | speed-up | back to back: jaxbnn (ms) "
        "| XLA f32 (ms) | speed-up | TAB theoretical | TAB reported |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        mode = r["mode"]
        reported = (f"> {TAB_DARKNET_16_18[mode]:.1f}x" if r["network"] == "Darknet-19"
                    else f"best layer {TAB_RESNET_BEST[mode]:.1f}x")  # fmt: skip
        lines.append(
            f"| {r['network']} {r['layer']} | {mode.upper()} | {r['ours'] * 1e3:.3f} | "
            f"{r['ops'] / r['ours'] / 1e9:.0f} | {r['xla'] * 1e3:.3f} | {r['xla'] / r['ours']:.1f}x | {r['ours_warm'] * 1e3:.3f} | "
            f"{r['xla_warm'] * 1e3:.3f} | {r['xla_warm'] / r['ours_warm']:.1f}x | {TAB_THEORETICAL[mode]:.1f}x | "
            f"{reported} |"
        )
    return "\n".join(lines)


def target_lines(rows):
    """The issue's TNN target on every layer of at least 256 filters, in both timings."""
    lines = []
    for r in rows:
        if r["mode"] != "tnn" or r["filters"] < 256:
            continue
        cold, warm = r["xla"] / r["ours"], r["xla_warm"] / r["ours_warm"]
        verdict = "met" if min(cold, warm) >= TNN_TARGET else "missed"
        lines.append(f"- {r['network']} {r['layer']}: {cold:.1f}x interleaved, {warm:.1f}x back to back: {verdict}")
    return lines


def mode_sweep():
    rng = np.random.default_rng(0)
    rows = []
    for batch in (1, 8):
        for network, layer, hw, c, o in MODE_LAYERS:
            for mode in MODES:
                rows.append(bench_mode(network, layer, batch, hw, c, o, mode, rng))
                print(mode_table(rows[-1:]).splitlines()[-1], flush=True)
    return rows


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
    """Per row, the median of every timing over the runs (runs: lists of rows in the same order)."""
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
MODES_SECTION = "cpu_bench.py modes"


def modes_body(rows, runs, commit):
    return "\n".join([
        "## TAB's products per layer against XLA float32 (`benchmarks/cpu_bench.py --modes`)",
        "",
        *results_file.run_header(results_file.cpu_machine(), commit),
        f"- runs: {runs} full sweep(s) in one process; every cell is the median over the runs",
        "",
        "The layers of \"TAB: Unified and Optimized Ternary, Binary, and Mixed-precision Neural Network Inference",
        "on the Edge\" (3x3, stride 1, SAME, zero padding): ResNet-18's 3x3 convolutions and Darknet-19's layers",
        "16 and 18 (3x3, 512 -> 1024 at 7x7 for a 224 x 224 input; the two share one shape). jaxbnn: `ops.bconv2d`",
        "on packed operands, ternary activations as their (nonneg, pos) planes, ternary weights as",
        "`TernaryConvBits`, int32 out. XLA: `lax.conv_general_dilated` in float32 on the same -1 / 0 / +1 values",
        "(checked equal). Timings as in the section above (interleaved, and back to back); GOPS counts 2 ops",
        "per multiply-accumulate.",
        "",
        "TAB's columns are against its own float32 layers (a plain C++ GEMM on Intel CPUs), not XLA's: its",
        "theoretical speedup of the bitwise GEMM (reciprocal throughputs, packing excluded), and the speedups it",
        "reports on its laptop CPU for Darknet-19's layers 16 and 18 (\"more than\") or, for ResNet-18, its best",
        "single layer on a Raspberry Pi 400. XLA's float32 convolution runs near the FMA peak, and a popcount word",
        "costs (`benchmarks/ceiling/cpu_words.cc`, in float32 FMAs of its width): with AVX-512 (512 products, FMAs",
        "of 16) on the 2-core AMD EPYC Zen 4 1.5 for BNN, 1.9 with a gate (TBN, BTN) and 3.2 for TNN, so against a",
        "float32 layer at that peak TNN can reach at most 10x, TBN and BTN 17x, BNN 21x; on the 2-core Intel Xeon",
        "(two 512-bit FMAs a cycle, one VPOPCNTQ) 2.5 for BNN, TBN and BTN and 5.2 for TNN: at most 6x for TNN, 13x",
        "for the others. With AVX2's nibble lookups (the lane kernels: 256 products, FMAs of 8) on the 2-core AMD",
        "EPYC Zen 3 3.0-3.2 for BNN, 4.1-4.2 for TBN and BTN, 7.3-7.4 for TNN (four vector operations a cycle, two",
        "FMAs): at most 10x, 7.7x and 4.4x.",
        "",
        mode_table(rows),
        "",
        f"TNN against the issue's target (>= {TNN_TARGET:.0f}x XLA float32 on layers of >= 256 filters):",
        "",
        *target_lines(rows),
        "",
    ])  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", "--write", dest="out", metavar="PATH",
                        help="the results file whose section this run replaces (default: "
                        "benchmarks/results/<this machine's kind>.md; '-': print only)")
    parser.add_argument("--runs", type=integer_at_least(1), default=1, help="repeat the sweep; report per-cell medians")
    parser.add_argument("--modes", action="store_true",
                        help="TAB's four products on its layers (the 'cpu_bench.py modes' section) instead of the "
                             "bmm / ResNet-18 sweep")
    args = parser.parse_args()
    # the CPU's kernels and XLA's CPU backend, also on a machine with a GPU (jax would default to the GPU)
    jax.config.update("jax_platforms", "cpu")
    out = args.out or results_file.default_path(results_file.cpu_kind())
    commit = results_file.git_commit(("xla_ffi/cpu", "xla_ffi/common", "jaxbnn"))
    if args.modes:
        rows = median_rows([mode_sweep() for _ in range(args.runs)])
        body = modes_body(rows, args.runs, commit)
        print()
        print(body)
        if args.out != "-":
            results_file.write_section(out, MODES_SECTION, body, results_file.cpu_machine())
            print(f"(written to {out}, section {MODES_SECTION})")
        return
    runs = [sweep() for _ in range(args.runs)]
    bmm_rows = median_rows([bmm for bmm, _ in runs])
    conv_rows = median_rows([conv for _, conv in runs])

    body = "\n".join([
        "## CPU kernels against XLA float32 (`benchmarks/cpu_bench.py`)",
        "",
        *results_file.run_header(results_file.cpu_machine(), commit),
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
        results_file.write_section(out, SECTION, body, results_file.cpu_machine())
        print(f"(written to {out}, section {SECTION})")


if __name__ == "__main__":
    main()
