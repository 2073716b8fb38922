"""GPU benchmark of the CUDA bit kernels against XLA's own dot / convolution, one process, one GPU.

    python benchmarks/gpu_bench.py [--ceiling-log ceiling.log] [--out PATH] [--quick]
    python benchmarks/gpu_bench.py --modes bnn tnn tbn btn --modes-only --batches 256   # TAB's products only

BMM (square sizes): each engine of jaxbnn._cuda, "BNN-specific" (packed in -> packed out, threshold
epilogue) and "general" (float in -> pack -> BMM -> float out), against XLA bf16 / int8 / fp8 e4m3 `dot`
on the same ±1 data. BConv: the TCBNN sweep (batch 16, 64x64, 3x3, stride 1, C = O) and the ResNet-18 /
VGG-16 layers (and the zoo AlexNet's conv2 and binarized conv1, VGG-16's first two fully connected layers, the
zoo CIFAR-10 VGG-small's binary layers; a fully connected layer as a 1x1 convolution over a 1 x 1 image) at batch
8 and 256 (--batches), ours (packed in -> packed out) against XLA bf16 convolution; where a layer's output
can be its input (C = O, stride 1), also both chained, each call's output the next's input,
and both as a digest: the same calls on distinct inputs, the program returning one element of each output
(one small array leaves the program instead of `copies` outputs, whose host dispatch alone can take longer
than the 32 C = 128 calls' ~260 us on the GPU).
Binary TOPS count 2 operations per multiply-accumulate. Each timing: a jitted program runs the op on
`copies` distinct input sets (copies_for: enough for ~1 ms of our kernels' work, 4 to 32; host dispatch of
a program takes ~45 us plus ~15-25 us per call, so programs of 4 small ops would leave the GPU waiting);
after a 0.1 s warm-up, the median over 5 batches of calls queued back to back (wall clock around the batch,
ending in block_until_ready), each batch about 50 ms of work (2 to 50 calls).

--modes (any of bnn tnn tbn btn) adds TAB's products, after the sections above (--modes-only: alone, the
shape options then choosing its shapes; it needs no CUDA module, so it runs on the CPU too): BMM 4096^3 and
16384^3 (or --bmm-sizes), the TCBNN sweep and the ResNet-18 layers at --batches, each product through the
public op (`ops.bmm` / `ops.bconv2d` on packed bits, `formats.TernaryPlanes` and binary or ternary weights)
with a threshold epilogue of one plane and, for ternary activations (tnn, tbn), of two (a ternary output);
per row its time, TOPS, time over bnn's on the same shape next to issue 56's targets (tnn <= 3.3x, tbn and
btn <= 2.2x), and the speed-up over XLA int8 and bf16 `dot` / convolution on the same ternary values.

The results replace this script's section of the machine's results file (benchmarks/results/<gpu>.md, e.g.
nvidia-h200.md; see benchmarks/results_file.py) after every row, so a run cut short keeps what it measured;
the modes have their own section, "gpu_bench.py modes".
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time

import numpy as np

import jax
import jax.numpy as jnp

import results_file
from jaxbnn import _ffi, formats, ops
from jaxbnn.cli import integer_at_least

PROGRAM_OPS = 1e13  # binary ops per timed program: ~1 ms at 10 POPS


def copies_for(ops, bytes_per_copy):
    """Distinct input sets per timed program (no common-subexpression elimination): enough that a program
    holds ~PROGRAM_OPS (host dispatch of small ops does not starve the GPU; at 4096^3 BMM, 4 calls per
    program measured 4,549-5,179 TOPS and 16-32 calls 5,542-5,708 in one job), 4 to 32, and inputs and
    outputs of at most 3 GB per program (queued programs each hold theirs; at 8 GB of inputs alone, XLA's
    VGG-16 conv 1_1 at batch 256 ran out of memory after the 32-copy layers)."""
    return max(1, min(32, max(4, math.ceil(PROGRAM_OPS / ops)), int(3e9 // bytes_per_copy)))


def timed(fn, args, copies):
    """Median seconds per op of fn(*args), fn running the op `copies` times.

    Warms up for 0.1 s (clocks and caches settle; a GPU found idle starts at low clocks), then times 5
    batches of calls queued back to back (no host synchronisation between them), as many calls per batch
    as make about 50 ms by the warm-up's pace (2 to 50)."""
    jax.block_until_ready(fn(*args))
    calls, start = 0, time.perf_counter()
    while time.perf_counter() < start + 0.1:
        jax.block_until_ready(fn(*args))
        calls += 1
    per_call = (time.perf_counter() - start) / calls
    reps = max(2, min(50, int(0.05 / per_call)))
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)  # earlier results are released as they are replaced; the stream keeps order
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / (reps * copies))
    return statistics.median(samples)


def signs(key, shape, dtype=jnp.float32):
    return jnp.where(jax.random.bernoulli(key, 0.5, shape), 1, -1).astype(dtype)


def bmm_call(kind, m, n, k):
    cols = formats.num_words(n) if kind == "bits" else n
    dtype = {"bits": jnp.uint32, "f32": jnp.float32, "i32": jnp.int32}[kind]
    return jax.ffi.ffi_call(f"jaxbnn_bmm_{kind}", jax.ShapeDtypeStruct((m, cols), dtype))


def cuda_module():
    """jaxbnn._cuda, imported where the benchmark runs (the script's options and helpers need no CUDA module)."""
    import jaxbnn._cuda

    return jaxbnn._cuda


def bench_bmm(sizes, engines, rows, save, deadline=float("inf")):
    _cuda = cuda_module()
    key = jax.random.PRNGKey(0)
    for s in sizes:
        if time.time() > deadline:
            print(f"deadline reached: BMM {s}^3 and later sizes not measured", flush=True)
            rows.append({"size": f"{s} and later: not measured (--deadline)"})
            save()
            return
        m = n = k = s
        ops = 2.0 * m * n * k
        copies = copies_for(ops, m * (k + n) * 4)  # the largest operands: float32 in (general path) and out
        keys = jax.random.split(key, copies + 1)
        w = formats.pack_dense_weights(signs(keys[0], (k, n)))
        xs = [signs(kk, (m, k)) for kk in keys[1:]]
        packed = [formats.pack_bits(x >= 0) for x in xs]
        thr = jnp.zeros((n,), jnp.int32)
        flip = jnp.zeros((n,), jnp.uint8)
        one = jnp.ones((n,), jnp.float32)
        zero = jnp.zeros((n,), jnp.float32)
        attrs = dict(k=np.int64(k), n=np.int64(n))
        # Operands are arguments, never closed-over constants (XLA would embed them in the program).
        def bits_program(wb, wp, t_, f_, *a):
            return [bmm_call("bits", m, n, k)(x, wb, wp, t_, f_, **attrs) for x in a]

        def general_program(wb, wp, s_, b_, *a):
            return [bmm_call("f32", m, n, k)(formats.pack_bits(x >= 0), wb, wp, s_, b_, **attrs) for x in a]

        row = {"size": s}
        for engine in engines:
            _cuda.set_kernel_path(engine)
            # A fresh executable per engine: XLA may replay a captured CUDA graph (command buffer), in which
            # the handler, and so its engine choice, ran once at capture.
            # (a new function object: jax caches executables per function)
            bits_fn = jax.jit(lambda *a: bits_program(*a))
            general_fn = jax.jit(lambda *a: general_program(*a))
            t = timed(bits_fn, [w.bits, w.popcount, thr, flip, *packed], copies)
            row[f"{engine} packed"] = ops / t / 1e12
            row[f"{engine} ran"] = _cuda.last_kernel_path()
            t = timed(general_fn, [w.bits, w.popcount, one, zero, *xs], copies)
            row[f"{engine} general"] = ops / t / 1e12
        _cuda.set_kernel_path("auto")
        wt = signs(keys[0], (k, n))
        for name, dt, acc in (("xla bf16", jnp.bfloat16, jnp.float32), ("xla int8", jnp.int8, jnp.int32),
                              ("xla fp8", jnp.float8_e4m3fn, jnp.float32)):
            b = wt.astype(dt)
            aa = [x.astype(dt) for x in xs]
            fn = jax.jit(lambda b_, *a, acc=acc: [jnp.dot(x, b_, preferred_element_type=acc) for x in a])
            try:
                row[name] = ops / timed(fn, [b, *aa], copies) / 1e12
            except Exception as err:  # an XLA that refuses a dtype: record it, keep going
                row[name] = float("nan")
                print(f"{name} at {s}: {err}", file=sys.stderr)
        del xs, packed, w, aa, b
        best = max(row[f"{e} packed"] for e in engines)
        row["best packed / xla int8"] = best / row["xla int8"]
        rows.append(row)
        save()
        print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


def conv_out(size, kernel, stride):
    pad = kernel // 2
    return (size + 2 * pad - kernel) // stride + 1


def bench_conv(layers, engines, rows, save, deadline=float("inf")):
    _cuda = cuda_module()
    key = jax.random.PRNGKey(1)
    for name, batch, hw, c, o, kernel, stride in layers:
        if time.time() > deadline:
            print(f"deadline reached: {name} batch {batch} and later layers not measured", flush=True)
            rows.append({"layer": f"{name} batch {batch} and later: not measured (--deadline)"})
            save()
            return
        pad = kernel // 2
        oh = conv_out(hw, kernel, stride)
        ops = 2.0 * batch * oh * oh * o * kernel * kernel * c
        copies = copies_for(ops, (batch * hw * hw * c + batch * oh * oh * o) * 2)  # XLA's bfloat16 in and out
        keys = jax.random.split(key, copies + 1)
        wf = signs(keys[0], (kernel, kernel, c, o))
        w = formats.pack_conv_weights(wf)
        xs = [signs(kk, (batch, hw, hw, c), jnp.bfloat16) for kk in keys[1:1 + copies]]
        packed = [formats.pack_bits(x >= 0) for x in xs]
        thr = jnp.zeros((o,), jnp.int32)
        flip = jnp.zeros((o,), jnp.uint8)
        i64 = np.int64
        attrs = dict(c=i64(c), o=i64(o), kh=i64(kernel), kw=i64(kernel), stride_h=i64(stride), stride_w=i64(stride),
                     pad_top=i64(pad), pad_bottom=i64(pad), pad_left=i64(pad), pad_right=i64(pad), pad_one=False,
                     pool_h=i64(1), pool_w=i64(1), x_repeats=i64(1))
        call = jax.ffi.ffi_call("jaxbnn_bconv2d_bits",
                                jax.ShapeDtypeStruct((batch, oh, oh, formats.num_words(o)), jnp.uint32))
        def program(wb, wp, t_, f_, *a):
            return [call(x, wb, wp, t_, f_, **attrs) for x in a]

        def digest(outputs):  # one element of each output: one small array leaves the program
            return jnp.stack([y[0, 0, 0, 0] for y in outputs])

        def chained_program(wb, wp, t_, f_, x):
            for _ in range(copies):  # each packed output is the next call's input, as in a network
                x = call(x, wb, wp, t_, f_, **attrs)
            return x

        def xla_conv(x, w_):
            return jax.lax.conv_general_dilated(x, w_, (stride, stride), ((pad, pad), (pad, pad)),
                                                dimension_numbers=("NHWC", "HWIO", "NHWC"))

        def xla_chained(w_, x):
            for _ in range(copies):
                x = xla_conv(x, w_)
            return x

        row = {"layer": name, "batch": batch}
        operands = [w.bits, w.tap_popcount, thr, flip]
        for engine in engines:
            _cuda.set_kernel_path(engine)
            ours = jax.jit(lambda *a: program(*a))  # a fresh executable per engine (see bench_bmm)
            row[f"{engine} packed"] = ops / timed(ours, [*operands, *packed], copies) / 1e12
            row[f"{engine} ran"] = _cuda.last_kernel_path()
        _cuda.set_kernel_path("auto")
        wb = wf.astype(jnp.bfloat16)
        row["xla bf16"] = ops / timed(jax.jit(lambda w_, *a: [xla_conv(x, w_) for x in a]), [wb, *xs], copies) / 1e12
        # Chained (where a layer's output can be its input): the intermediates are XLA's temporaries and one
        # output leaves the program, whose dispatch then stops limiting a short op (a program returning 32
        # outputs can take 160-390 us of host dispatch). XLA's weights are scaled by a power of two near
        # 1 / sqrt(K) so that the values stay finite along the chain.
        if c == o and stride == 1:
            row["auto chained"] = ops / timed(jax.jit(chained_program), [*operands, packed[0]], copies) / 1e12
            scaled = (wf * 2.0 ** -round(math.log2(math.sqrt(kernel * kernel * c)))).astype(jnp.bfloat16)
            row["xla bf16 chained"] = ops / timed(jax.jit(xla_chained), [scaled, xs[0]], copies) / 1e12
            row["auto digest"] = ops / timed(jax.jit(lambda *a: digest(program(*a))), [*operands, *packed], copies) / 1e12
            row["xla bf16 digest"] = ops / timed(jax.jit(lambda w_, *a: digest([xla_conv(x, w_) for x in a])),
                                                 [wb, *xs], copies) / 1e12
        del xs, packed
        rows.append(row)
        save()
        print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


RESNET18 = [  # (name, input size, c, o, kernel, stride): the distinct conv layers at 224x224
    ("r18.conv1", 224, 3, 64, 7, 2), ("r18.l1", 56, 64, 64, 3, 1), ("r18.l2.s2", 56, 64, 128, 3, 2),
    ("r18.l2", 28, 128, 128, 3, 1), ("r18.l2.down", 56, 64, 128, 1, 2), ("r18.l3.s2", 28, 128, 256, 3, 2),
    ("r18.l3", 14, 256, 256, 3, 1), ("r18.l3.down", 28, 128, 256, 1, 2), ("r18.l4.s2", 14, 256, 512, 3, 2),
    ("r18.l4", 7, 512, 512, 3, 1), ("r18.l4.down", 14, 256, 512, 1, 2),
]
ALEXNET = [  # the zoo's AlexNet at 224 x 224: conv2 (5x5 over 28 x 28, compact border classes), conv1 binarized
    ("alex.conv2", 28, 128, 256, 5, 1), ("alex.conv1", 224, 3, 128, 11, 4),
]
VGG16 = [
    ("vgg.1_1", 224, 3, 64, 3, 1), ("vgg.1_2", 224, 64, 64, 3, 1), ("vgg.2_1", 112, 64, 128, 3, 1),
    ("vgg.2_2", 112, 128, 128, 3, 1), ("vgg.3_1", 56, 128, 256, 3, 1), ("vgg.3_2", 56, 256, 256, 3, 1),
    ("vgg.4_1", 28, 256, 512, 3, 1), ("vgg.4_2", 28, 512, 512, 3, 1), ("vgg.5", 14, 512, 512, 3, 1),
    ("vgg.fc1", 1, 25088, 4096, 1, 1), ("vgg.fc2", 1, 4096, 4096, 1, 1),
]
CIFAR10_VGG = [  # the zoo's CIFAR-10 VGG-small at 32 x 32: its binary convolutions and first fully connected layers
    ("cifar-vgg.1_2", 32, 128, 128, 3, 1), ("cifar-vgg.2_1", 16, 128, 256, 3, 1), ("cifar-vgg.2_2", 16, 256, 256, 3, 1),
    ("cifar-vgg.3_1", 8, 256, 512, 3, 1), ("cifar-vgg.3_2", 8, 512, 512, 3, 1), ("cifar-vgg.fc1", 1, 8192, 1024, 1, 1),
    ("cifar-vgg.fc2", 1, 1024, 1024, 1, 1),
]


MODES = ("bnn", "tnn", "tbn", "btn")  # TAB's products, bnn first: the others' reference
MODE_TARGETS = {"tnn": 3.3, "tbn": 2.2, "btn": 2.2}  # issue 56: at most this many times bnn's kernel time
MODE_BMM_SIZES = [4096, 16384]


def ternary(key, shape):
    return jax.random.randint(key, shape, -1, 2, jnp.int8)


def bmm_problem(size):
    """A square BMM as bench_modes takes it: the op on packed operands, XLA's dot on their values."""
    m = n = k = size
    return dict(
        shape=f"BMM {size}^3", ops=2.0 * m * n * k, n=n, x_shape=(m, k), w_shape=(k, n),
        bytes_per_copy=m * k * 2 + m * n * 4,  # the largest contender's: bf16 in, float32 out
        pack=(formats.pack_dense_weights, formats.pack_ternary_dense_weights),
        ours=lambda x, w, threshold, side_by_side: ops.bmm(x, w, threshold=threshold, side_by_side=side_by_side),
        xla=lambda x, w, dtype: jnp.dot(x, w, preferred_element_type=jnp.int32 if dtype == jnp.int8 else jnp.float32),
    )  # fmt: skip


def conv_problem(name, batch, hw, c, o, kernel, stride):
    """A convolution layer as bench_modes takes it (zero padding of kernel // 2, as bench_conv's)."""
    pad = kernel // 2
    oh = conv_out(hw, kernel, stride)
    padding = ((pad, pad), (pad, pad))

    def xla(x, w, dtype):  # int8 accumulates into int32; bf16 writes bf16, as bench_conv's contender
        return jax.lax.conv_general_dilated(x, w, (stride, stride), padding, dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                            preferred_element_type=jnp.int32 if dtype == jnp.int8 else None)

    return dict(
        shape=f"{name} batch {batch}", ops=2.0 * batch * oh * oh * o * kernel * kernel * c, n=o,
        x_shape=(batch, hw, hw, c), w_shape=(kernel, kernel, c, o),
        bytes_per_copy=batch * hw * hw * c * 2 + batch * oh * oh * o * 4,  # bf16 in, int8's int32 out
        pack=(formats.pack_conv_weights, formats.pack_ternary_conv_weights),
        ours=lambda x, w, threshold, side_by_side: ops.bconv2d(x, w, stride=stride, padding=padding, pad_value="zero",
                                                               threshold=threshold, side_by_side=side_by_side),
        xla=xla,
    )  # fmt: skip


def mode_kernel(mode, op):
    """What runs a mode's threshold product on this platform: its own kernel, the op's composite (one binary
    product over the planes side by side, docs/ops.md), or the pure-JAX reference where no native kernel is
    registered."""
    platform = "cpu" if jax.devices()[0].platform == "cpu" else "cuda"
    binary = "jaxbnn_bmm" if op == "bmm" else "jaxbnn_bconv2d"
    own = f"{binary}_bits" if mode == "bnn" else f"jaxbnn_{mode}_{op}_bits"
    if _ffi.has_target(platform, own):
        return "native"
    return "composite" if mode != "bnn" and _ffi.has_target(platform, f"{binary}_i32") else "reference"


def bench_modes(problems, modes, rows, save, deadline=float("inf")):
    """Each of TAB's products on each problem through the public op under jax.jit, with a threshold epilogue
    of one plane (binary output) and, where the activations are ternary, of two (a ternary output, the next
    ternary layer's planes); XLA int8 and bf16 on the ternary values first, the rows of a problem sharing them."""
    key = jax.random.PRNGKey(2)
    for p in problems:
        if time.time() > deadline:
            print(f"deadline reached: {p['shape']} and later shapes not measured", flush=True)
            rows.append({"shape": f"{p['shape']} and later: not measured (--deadline)"})
            save()
            return
        copies = copies_for(p["ops"], p["bytes_per_copy"])
        key, *keys = jax.random.split(key, 2 * copies + 3)
        w_values = {"binary": signs(keys[0], p["w_shape"], jnp.int8), "ternary": ternary(keys[1], p["w_shape"])}
        x_values = {"binary": [signs(kk, p["x_shape"], jnp.int8) for kk in keys[2:2 + copies]],
                    "ternary": [ternary(kk, p["x_shape"]) for kk in keys[2 + copies:]]}
        xla = {}
        for dtype, name in ((jnp.int8, "xla int8"), (jnp.bfloat16, "xla bf16")):
            fn = jax.jit(lambda w_, *a, dtype=dtype: [p["xla"](x, w_, dtype) for x in a])
            try:
                xla[name] = timed(fn, [w_values["ternary"].astype(dtype),
                                       *(x.astype(dtype) for x in x_values["ternary"])], copies)
            except Exception as err:  # an XLA that refuses a dtype or layout: record it, keep going
                xla[name] = float("nan")
                print(f"{name} on {p['shape']}: {err}", file=sys.stderr)
        n = p["n"]
        epilogues = {"binary": jnp.zeros((n,), jnp.int32),
                     # (lo, hi) = (0, 1): the planes (nonneg, pos) of sign(dot)
                     "ternary": jnp.stack([jnp.zeros((n,), jnp.int32), jnp.ones((n,), jnp.int32)])}
        op = "bmm" if p["shape"].startswith("BMM") else "conv2d"
        for mode in modes:
            x_kind = "ternary" if mode in ("tnn", "tbn") else "binary"
            w_kind = "ternary" if mode in ("tnn", "btn") else "binary"
            w = p["pack"][w_kind == "ternary"](w_values[w_kind])
            xs = [formats.pack_ternary_pm_planes(x) if x_kind == "ternary" else formats.pack_bits(x >= 0)
                  for x in x_values[x_kind]]
            kernel = mode_kernel(mode, op)
            for output in ("binary", "ternary") if x_kind == "ternary" else ("binary",):
                # the composite's weights side by side built once, as the runtime holds them (not per call)
                side_by_side = (ops.side_by_side_weights(w, ternary_activations=x_kind == "ternary",
                                                         threshold_planes=2 if output == "ternary" else 0)
                                if kernel == "composite" else None)
                # a new function object per program: jax caches executables per function
                fn = jax.jit(lambda w_, t_, s_, *a: [p["ours"](x, w_, t_, s_) for x in a])
                t = timed(fn, [w, epilogues[output], side_by_side, *xs], copies)
                rows.append(dict(shape=p["shape"], mode=mode, output=output, kernel=kernel, ops=p["ops"], seconds=t,
                                 **xla))  # fmt: skip
                save()
                print(modes_table(rows).splitlines()[-1], flush=True)
            del w, xs
        del w_values, x_values


def modes_table(rows):
    """The modes rows with each product's time over bnn's on the same shape (a ternary output against bnn's
    binary one: each network's own layer) and the speed-ups over XLA."""
    bnn = {r["shape"]: r["seconds"] for r in rows if r.get("mode") == "bnn"}
    lines = ["| shape | mode | output | kernel | ms | TOPS | / bnn | target | XLA int8 (ms) | XLA bf16 (ms) "
             "| vs XLA int8 | vs XLA bf16 |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "mode" not in r:  # a shape the deadline cut
            lines.append(f"| {r['shape']} |" + " |" * 11)
            continue
        t = r["seconds"]
        ratio = t / bnn[r["shape"]] if r["shape"] in bnn else None
        target = MODE_TARGETS.get(r["mode"])
        verdict = "" if target is None else f"<= {target}x" + (
            "" if ratio is None else (": met" if ratio <= target else ": missed"))
        xla = [r[name] for name in ("xla int8", "xla bf16")]
        xla_ms = ["refused" if math.isnan(x) else f"{x * 1e3:.3f}" for x in xla]  # XLA that refused the dtype
        speedups = ["" if math.isnan(x) else f"{x / t:.1f}x" for x in xla]
        lines.append(
            f"| {r['shape']} | {r['mode']} | {r['output']} | {r['kernel']} | {t * 1e3:.3f} | {r['ops'] / t / 1e12:,.1f} | "
            f"{'' if ratio is None else f'{ratio:.2f}x'} | {verdict} | {' | '.join(xla_ms)} | {' | '.join(speedups)} |")
    return "\n".join(lines)


def mode_target_lines(rows):
    """Per product with a target: on how many rows it was met, and its worst ratio to bnn."""
    bnn = {r["shape"]: r["seconds"] for r in rows if r.get("mode") == "bnn"}
    lines = []
    for mode, target in MODE_TARGETS.items():
        ratios = [(r["seconds"] / bnn[r["shape"]], r) for r in rows
                  if r.get("mode") == mode and r["shape"] in bnn]
        if ratios:
            worst, r = max(ratios, key=lambda pair: pair[0])
            met = sum(ratio <= target for ratio, _ in ratios)
            lines.append(f"- {mode} (<= {target}x bnn): met on {met} of {len(ratios)} rows; worst {worst:.2f}x "
                         f"({r['shape']}, {r['output']} output)")
    return lines


def table(rows, keys=None):
    if not rows:
        return "(not run)"
    if keys is None:  # every key, in order of first appearance
        keys = list(dict.fromkeys(k for r in rows for k in r))
    out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k, "")
            cells.append(f"{v:,.1f}" if isinstance(v, float) else str(v))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def ceiling_numbers(path):
    if not path:
        return {}
    text = open(path).read()
    found = {}
    for label, pattern in (("wgmma b1 m64n256k256", r"wgmma b1 m64n256k256.*?([\d.]+) TOPS"),
                           ("mma.sync b1 and", r"mma.sync b1 and.*?([\d.]+) TOPS"),
                           ("wgmma s8", r"wgmma s8 m64n224k32.*?([\d.]+) TOPS")):
        values = [float(v) for v in re.findall(pattern, text)]
        if values:
            found[label] = max(values)
    return found


SECTION = "gpu_bench.py"
MODES_SECTION = "gpu_bench.py modes"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ceiling-log", help="output of the ceiling probe (ceiling.cu) run in the same job, for "
                        "the ceiling line of the results")
    parser.add_argument("--out", help="the results file whose gpu_bench.py section this run replaces (default: "
                        "benchmarks/results/<gpu>.md, e.g. nvidia-h200.md)")
    parser.add_argument("--quick", action="store_true", help="a few sizes only")
    parser.add_argument("--commit", default="", help="the commit the results name (default: the checkout's HEAD)")
    parser.add_argument("--bmm-sizes", type=integer_at_least(1), nargs="*",
                        help="override the BMM sizes (none: no BMM)")
    parser.add_argument("--conv-channels", type=integer_at_least(1), nargs="*",
                        help="override the BConv sweep's C = O (none: no sweep)")
    parser.add_argument("--no-models", action="store_true", help="skip the ResNet-18 / VGG-16 layers")
    parser.add_argument("--layers", nargs="*", help="only these ResNet-18 / VGG-16 layers (e.g. r18.conv1 vgg.1_1)")
    parser.add_argument("--deadline", type=float, default=float("inf"), help="unix time after which no new layer starts")
    parser.add_argument("--batches", type=integer_at_least(1), nargs="+", default=[8, 256],
                        help="the model layers' batches")
    parser.add_argument("--modes", nargs="+", choices=MODES,
                        help="TAB's products on the BMM sizes (default 4096 16384), the BConv sweep and the ResNet-18 "
                        "layers, in a 'gpu_bench.py modes' section after the others (bnn: the ratios' reference)")
    parser.add_argument("--modes-only", action="store_true", help="only the modes section: the options above choose "
                        "its shapes alone, and it runs without the CUDA module")
    args = parser.parse_args()
    if args.modes_only and not args.modes:
        parser.error("--modes-only needs --modes")
    if not args.modes_only and jax.devices()[0].platform != "gpu":
        parser.error("a GPU benchmark (only --modes-only runs without one): jax's default device is "
                     + jax.devices()[0].platform)
    engines = ["wgmma", "mma_sync", "simt"]
    sizes = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    sweep = [128, 256, 512, 1024, 2048]
    if args.quick:
        sizes, sweep = [1024, 4096, 16384], [128, 512]
    sizes = sizes if args.bmm_sizes is None else args.bmm_sizes
    sweep = sweep if args.conv_channels is None else args.conv_channels
    sweep_layers = [(f"tcbnn C=O={c}", 16, 64, c, c, 3, 1) for c in sweep]
    with_models = not (args.quick or args.no_models)
    device = jax.devices()[0]
    out = args.out or results_file.default_path(results_file.device_kind(device))
    commit = args.commit or results_file.git_commit()
    machine = results_file.device_machine(device)
    header = results_file.run_header(machine, commit, driver=results_file.device_driver(device))

    if not args.modes_only:
        bmm_rows, conv_rows = [], []
        ceiling = ceiling_numbers(args.ceiling_log)

        def save():
            # after every row, so that a run cut short keeps what it measured
            body = section(header, ceiling, engines, bmm_rows, conv_rows)
            results_file.write_section(out, SECTION, body, machine)
            return body

        bench_bmm(sizes, engines, bmm_rows, save, args.deadline)
        bench_conv(sweep_layers, engines, conv_rows, save, args.deadline)
        if with_models:
            model_layers = [(n, b, hw, c, o, k, s) for b in args.batches
                            for (n, hw, c, o, k, s) in RESNET18 + VGG16 + ALEXNET + CIFAR10_VGG
                            if args.layers is None or n in args.layers]
            bench_conv(model_layers, ["auto"], conv_rows, save, args.deadline)  # the engine the op would pick
        print(save())
        print(f"(written to {out}, section {SECTION})")

    if args.modes:
        modes = [m for m in MODES if m in args.modes]
        mode_rows = []

        def save_modes():
            body = modes_section(header, mode_rows)
            results_file.write_section(out, MODES_SECTION, body, machine)
            return body

        problems = [bmm_problem(s) for s in (MODE_BMM_SIZES if args.bmm_sizes is None else args.bmm_sizes)]
        problems += [conv_problem(*layer) for layer in sweep_layers]
        if with_models:
            problems += [conv_problem(n, b, hw, c, o, k, s) for b in args.batches for (n, hw, c, o, k, s) in RESNET18
                         if args.layers is None or n in args.layers]
        bench_modes(problems, modes, mode_rows, save_modes, args.deadline)
        print(save_modes())
        print(f"(written to {out}, section {MODES_SECTION})")


def modes_section(header, rows):
    """The modes section of the results file: the run's header, what the rows measure, the table, the targets."""
    return "\n".join([
        "## TAB's products against BNN and XLA (`benchmarks/gpu_bench.py --modes`)",
        "",
        *header,
        "",
        "Each shape in each of TAB's products: BNN (binary activations x binary weights), TNN (ternary x ternary),",
        "TBN (ternary activations x binary weights), BTN (binary activations x ternary weights), through the public",
        "op (`ops.bmm` / `ops.bconv2d`, zero padding) under `jax.jit` on packed operands: binary activations as",
        "packed bits, ternary ones as `formats.TernaryPlanes`, weights as `DenseBits` / `ConvBits` or",
        "`TernaryDenseBits` / `TernaryConvBits`. `output`: `binary`, a threshold epilogue of one plane (threshold",
        "`(N,)`); `ternary`, thresholds `(2, N)` = (0, 1), the (nonneg, pos) planes of sign(dot) that a ternary",
        "layer writes for the next (products with ternary activations). `kernel`: `native`, the platform's kernel",
        "of the product; `composite`, where the platform has none, the op's one binary product over the planes",
        "side by side (docs/ops.md), its weights built once outside the timed program as `jaxbnn.runtime` holds",
        "them (`ops.side_by_side_weights`); `reference`, the pure-JAX spec (no native module). TOPS = 2 x M x N x K /",
        "time in every product. `/ bnn`: time over BNN's on the same shape (a ternary output against BNN's",
        "binary one: each network's own layer); `target`: issue 56's bound on it. XLA: the ternary values",
        "(-1 / 0 / +1) as int8 (int32 out) and bf16 (`dot`: float32 out; convolution: bf16 out, as the BConv",
        "table), one timing per shape shared by its rows; `vs XLA`: XLA's time over ours. Timing as the",
        "sections above (`copies_for` distinct input sets per program, `timed`).",
        "",
        modes_table(rows),
        "",
        "Targets (issue 56: TNN <= 3.3x BNN, TBN and BTN <= 2.2x BNN):",
        "",
        *(mode_target_lines(rows) or ["- none measured (the ratios need bnn and one of tnn, tbn, btn)"]),
        "",
    ])  # fmt: skip


def section(header, ceiling, engines, bmm_rows, conv_rows):
    """This script's section of the results file: the run's header, the BMM table, the BConv table."""
    lines = [
        "## BMM and BConv against XLA (`benchmarks/gpu_bench.py`)",
        "",
        *header,
        "- ceiling probe (ceiling.cu, same job): "
        + (", ".join(f"{k} {v:,.0f} TOPS" for k, v in ceiling.items()) or "not run"),
        "",
        "Binary TOPS = 2 x M x N x K / time. `packed`: packed in -> packed out (threshold epilogue); `general`:",
        "float32 in -> pack -> BMM -> float32 out. `ran`: the engine that ran (wgmma needs an even number of words",
        "per tap); `auto`: the engine the op picks. `chained`: each call's output the next call's input; `digest`:",
        "the packed calls, the program returning one element of each output.",
        "",
        "### BMM, M = N = K (TOPS)",
        "",
        table(bmm_rows),
        "",
    ]
    measured = [r for r in bmm_rows if "xla int8" in r]
    if measured:
        big = measured[-1]
        best = max(big.get(f"{e} packed", 0.0) for e in engines)
        lines += [f"Largest BMM ({big['size']}^3): best packed {best:,.0f} TOPS = "
                  f"{best / big['xla int8']:.1f}x XLA int8"
                  + (f", {100 * best / ceiling['wgmma b1 m64n256k256']:.0f}% of the wgmma ceiling"
                     if "wgmma b1 m64n256k256" in ceiling else ""), ""]
    for r in conv_rows:
        if "xla bf16" in r:
            r["best / xla bf16"] = max(v for k, v in r.items() if k.endswith("packed")) / r["xla bf16"]
        if "xla bf16 chained" in r:
            r["chained / xla bf16 chained"] = r["auto chained"] / r["xla bf16 chained"]
        if "xla bf16 digest" in r:
            r["digest / xla bf16 digest"] = r["auto digest"] / r["xla bf16 digest"]
    lines += ["### BConv (TOPS)", "", table(conv_rows), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
