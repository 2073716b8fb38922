"""The zoo's first layers on the GPU: `ops.image_conv2d` (int8 image levels x int8 weights, pool and epilogue
in one custom call) against XLA's convolution of the same operands, one process, one GPU.

    python benchmarks/first_layer_bench.py [--batches 8 1024] [--layers cifar10-vgg imagenet-alexnet] [--out PATH]

Each layer is the first layer of a zoo model as `jaxbnn.runtime` runs it (docs/formats.md): uint8 images as
int8 levels, the model's kernel, stride, SAME padding and pool, and its epilogue: the next layer's packed
bits (one threshold plane; `--planes 2` for a ternary output's two), or the residual stem's int32 stream.
Batches: 8 (latency) and the TCBNN paper's (1024 for MNIST / CIFAR, 512 for ImageNet), unless --batches.
Contenders on the same levels and weights, convolution only (no pool, threshold or packing, which favours
them): XLA int8 (int32 accumulation; where XLA refuses it, as on an H200 with jax 0.11, the row says so) and
XLA bf16 (float32 accumulation, bf16 out).
Timing as gpu_bench.py (`timed`, `copies_for` distinct inputs per program). The table replaces this
script's section of the machine's results file (benchmarks/results/<gpu>.md).
"""

from __future__ import annotations

import argparse
import math

import numpy as np

import jax
import jax.numpy as jnp

import results_file
from gpu_bench import copies_for, timed
from jaxbnn import ops

SECTION = "first_layer_bench.py"
# model: (input (H, W, C), output channels N, kernel, stride, pool, epilogue, TCBNN batch); a fully connected
# first layer (the MLP) is the 1 x 1 convolution of a 1 x 1 image of H * W * C channels
LAYERS = {
    "mnist-mlp": ((1, 1, 784), 1024, 1, 1, None, "bits", 1024),
    "mnist-conv": ((28, 28, 1), 32, 3, 1, None, "bits", 1024),
    "cifar10-vgg": ((32, 32, 3), 128, 3, 1, None, "bits", 1024),
    "cifar10-resnet14": ((32, 32, 3), 128, 3, 2, None, "stream", 1024),
    "imagenet-alexnet": ((224, 224, 3), 128, 11, 4, 2, "bits", 512),
    "imagenet-vgg16": ((224, 224, 3), 64, 3, 1, None, "bits", 512),
    "imagenet-resnet18": ((224, 224, 3), 64, 7, 4, None, "stream", 512),
}


def layer_call(shape, n, kernel_size, stride, pool, epilogue, planes):
    """(our jitted layer, XLA int8 conv, XLA bf16 conv, operand builder) for one layer."""
    h, w, c = shape
    conv = dict(window_strides=(stride, stride), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def ours(levels, kernel, threshold, flip):
        if epilogue == "stream":
            return ops.image_conv2d(levels, kernel, stride=stride, padding="SAME", pool=pool, shift=7)
        return ops.image_conv2d(levels, kernel, stride=stride, padding="SAME", pool=pool,
                                threshold=threshold if planes > 1 else threshold[0],
                                flip=flip if planes > 1 else flip[0])

    def xla_int8(levels, kernel):
        return jax.lax.conv_general_dilated(levels, kernel, preferred_element_type=jnp.int32, **conv)

    def xla_bf16(levels, kernel):
        return jax.lax.conv_general_dilated(levels.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16), **conv)

    def operands(key, batch):
        k1, k2, k3 = jax.random.split(key, 3)
        levels = jax.random.randint(k1, (batch, h, w, c), -128, 128, jnp.int32).astype(jnp.int8)
        kernel = jax.random.randint(k2, (kernel_size, kernel_size, c, n), -128, 128, jnp.int32).astype(jnp.int8)
        spread = 128 * 64 * int(math.sqrt(kernel_size * kernel_size * c))
        threshold = jax.random.randint(k3, (planes, n), -spread, spread, jnp.int32)
        flip = jnp.zeros((planes, n), jnp.uint8)
        return levels, kernel, threshold, flip

    return ours, xla_int8, xla_bf16, operands


def program(fn, copies):
    """fn over `copies` operand sets in one jitted program."""
    return jax.jit(lambda sets: [fn(*s) for s in sets])


def bench(name, batch, planes, xla=True):
    shape, n, kernel_size, stride, pool, epilogue, _ = LAYERS[name]
    ours, xla_int8, xla_bf16, operands = layer_call(shape, n, kernel_size, stride, pool, epilogue, planes)
    h, w, c = shape
    oh, ow = -(-h // stride), -(-w // stride)
    macs = batch * oh * ow * n * kernel_size * kernel_size * c
    # int8 work runs ~50x slower than binary per operation; XLA's int32 output is the largest array
    copies = copies_for(2 * macs * 50, batch * h * w * c + 4 * batch * oh * ow * n)
    sets = [operands(jax.random.PRNGKey(i), batch) for i in range(copies)]
    row = {"layer": name, "batch": batch,
           "epilogue": "int32 stream" if epilogue == "stream" else f"bits, {planes} plane{'s' * (planes > 1)}"}
    row["ours ms"] = 1e3 * timed(program(ours, copies), (sets,), copies)
    row["TOPS"] = 2 * macs / (row["ours ms"] * 1e-3) / 1e12
    if not xla:
        return row
    for label, fn in (("int8", xla_int8), ("bf16", xla_bf16)):
        try:
            row[f"xla {label} ms"] = 1e3 * timed(program(fn, copies), ([s[:2] for s in sets],), copies)
            row[f"vs {label}"] = row[f"xla {label} ms"] / row["ours ms"]
        except jax.errors.JaxRuntimeError as err:  # e.g. no cuDNN algorithm for the integer convolution
            row[f"xla {label} ms"] = "refused: " + str(err).strip().split(":")[0]
    return row


def table(rows):
    keys = ["layer", "batch", "epilogue", "ours ms", "TOPS", "xla int8 ms", "xla bf16 ms", "vs int8", "vs bf16"]
    fmt = {"ours ms": "{:.4f}", "xla int8 ms": "{:.4f}", "xla bf16 ms": "{:.4f}", "TOPS": "{:.1f}",
           "vs int8": "{:.2f}x", "vs bf16": "{:.2f}x"}
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = [fmt.get(k, "{}").format(r[k]) if k in r and not isinstance(r[k], str) else r.get(k, "—")
                 for k in keys]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def section(header, rows):
    return "\n".join([
        "## The zoo's first layers against XLA (`benchmarks/first_layer_bench.py`)",
        "",
        *header,
        "",
        "`ops.image_conv2d` on int8 levels and weights, one custom call with the pool and the epilogue (the next",
        "layer's packed bits, or the residual stem's int32 stream), against XLA's convolution of the same operands",
        "(int8 with int32 accumulation; bf16), which stops at the pre-activations. TOPS: 2 x MACs of the",
        "convolution / our time. `vs`: XLA's time over ours.",
        "",
        table(rows),
        "",
    ])  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="+", choices=list(LAYERS), default=list(LAYERS))
    parser.add_argument("--batches", type=int, nargs="+", help="default: 8 and each model's TCBNN batch")
    parser.add_argument("--planes", type=int, default=1, choices=[1, 2], help="threshold planes of the bits layers")
    parser.add_argument("--out", help="the results file whose section this run replaces")
    parser.add_argument("--commit", default="")
    parser.add_argument("--no-xla", action="store_true", help="time ours only (an A/B of kernel builds)")
    args = parser.parse_args()
    out, machine, header = results_file.gpu_run(parser, args)
    rows = []
    for name in args.layers:
        for batch in args.batches or [8, LAYERS[name][-1]]:
            rows.append(bench(name, batch, args.planes, xla=not args.no_xla))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
            results_file.write_section(out, SECTION, section(header, rows), machine)
    print(section(header, rows))
    print(f"(written to {out}, section {SECTION})")


if __name__ == "__main__":
    main()
