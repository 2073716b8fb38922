"""End to end on the GPU: a packed BNN zoo model through jaxbnn.runtime against the same architecture's
float model under XLA (float32 at XLA's default precision, and bfloat16), one process, one GPU.

    python benchmarks/model_bench.py [--model imagenet-resnet18] [--batches 8 256] [--size 224]

The BNN is built with its default (untrained) parameters, put in eval mode and exported for sm90: the packed
network computes the same function a trained one would at the same shapes (timing does not depend on the
values). Its first layer takes the float image (float32 weights at HIGHEST precision, as the Flax layer
computes it, so that the exported thresholds see the same pre-activations); every later binary layer runs
packed through the CUDA custom calls. Each row: images per second of one jitted forward pass on a batch of
random images (gpu_bench.timed: 0.1 s warm-up, the median of 5 batches of calls queued back to back), and the
first layer alone, timed the same way.

The results replace the section of this model and image size in the machine's results file
(benchmarks/results/<gpu>.md, e.g. nvidia-h200.md; see benchmarks/results_file.py).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import results_file
from gpu_bench import timed
from jaxbnn import runtime
from jaxbnn.export import export_model
from jaxbnn.models import build_model


def float_forward(model, dtype):
    """The eval-mode Flax model as one jitted function of (state, images), its parameters cast to `dtype`."""
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, state)
    forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x.astype(dtype)))
    return forward, state


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="imagenet-resnet18")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 256])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--commit", default="", help="the commit the results name (default: the checkout's HEAD)")
    parser.add_argument("--per-node", action="store_true", help="also time each graph node alone at the largest batch")
    parser.add_argument("--out", help="the results file whose section of this model and size the run replaces "
                        "(default: benchmarks/results/<gpu>.md; '-': print only)")
    args = parser.parse_args()
    shape = (args.size, args.size, 3)
    bnn = build_model(args.model, "bnn", num_classes=1000, input_shape=shape, rngs=nnx.Rngs(0))
    bnn.eval()
    net = runtime.from_packed(export_model(bnn, target="sm90"))
    reference = build_model(args.model, "float", num_classes=1000, input_shape=shape, rngs=nnx.Rngs(0))
    reference.eval()
    first = jax.jit(lambda params, x: runtime._run(net.graph["nodes"][:1], params[:1], x)[-1])
    floats = [float_forward(reference, dtype) for dtype in (jnp.float32, jnp.bfloat16)]
    device = jax.devices()[0]
    name = f"model_bench.py {args.model} {args.size}"
    lines = [
        f"## {args.model} at {args.size} x {args.size}: packed BNN against the float model under XLA "
        "(`benchmarks/model_bench.py`)",
        "",
        *results_file.run_header(results_file.device_machine(device), args.commit or results_file.git_commit(),
                                 driver=results_file.device_driver(device)),
        f"- packed weights: {net.packed_bytes / 2**20:.1f} MiB",
        "",
        "The BNN with its default (untrained) parameters, exported for sm90 and run by `jaxbnn.runtime` (one jitted",
        "forward pass; its first layer takes the float image in float32 at HIGHEST precision); the same",
        "architecture's float model under XLA in float32 (XLA's default precision) and bfloat16. Images per second.",
        "",
        "| batch | packed BNN, images/s | its first (float) layer alone, ms | XLA float32, images/s | XLA bfloat16, images/s "
        "| BNN / float32 | BNN / bfloat16 |",
        "|---|---|---|---|---|---|---|",
    ]

    def save():
        if args.out != "-":
            out = args.out or results_file.default_path(results_file.device_kind(device))
            results_file.write_section(out, name, "\n".join(lines) + "\n", results_file.device_machine(device))
            return out

    print("\n".join(lines), flush=True)
    for batch in args.batches:
        images = jnp.asarray(np.random.default_rng(batch).uniform(-1, 1, (batch, *shape)), jnp.float32)
        t_bnn = timed(net._forward, [net.params, images], 1)
        t_first = timed(first, [net.params, images], 1)
        row = [batch / t_bnn, t_first * 1e3]
        for forward, state in floats:
            row.append(batch / timed(forward, [state, images], 1))
        lines.append(f"| {batch} | {row[0]:,.0f} | {row[1]:.3f} | {row[2]:,.0f} | {row[3]:,.0f} | {row[0] / row[2]:.2f}x "
                     f"| {row[0] / row[3]:.2f}x |")
        print(lines[-1], flush=True)
        save()
    if args.per_node:
        lines.append("")
        lines.extend(per_node_lines(net, images))
    out = save()
    if out:
        print(f"(written to {out}, section {name})")


def per_node_lines(net, images):
    """Each graph node alone, on the output the node before it gives for `images` (its own jitted call)."""
    nodes, params = net.graph["nodes"], net.params
    inputs = [images] + [out[-1] if isinstance(out, tuple) else out for out in net.trace(images)[:-1]]
    lines = [f"| node (batch {len(images)}) | kind | in -> out | kernel, stride, pool | input -> output | ms |",
             "|---|---|---|---|---|---|"]
    print()
    print("\n".join(lines))
    for i, (node, p, x) in enumerate(zip(nodes, params, inputs)):
        one = jax.jit(lambda p_, x_, node=node: runtime._run([node], [p_], x_)[-1])
        ms = timed(one, [p, x], 1) * 1e3
        conv = node["conv1"] if node["kind"] == "residual" else node
        geometry = f"{conv.get('kernel_size')}, {conv.get('stride')}, {conv.get('pool')}" if "kernel_size" in conv else ""
        lines.append(f"| {i} {node.get('name', '')} | {node['kind']} | {node.get('in_shape')} -> {node.get('out_shape')} "
                     f"| {geometry} | {conv.get('input')} -> {node.get('output', conv.get('output'))} | {ms:.3f} |")
        print(lines[-1], flush=True)
    return lines


if __name__ == "__main__":
    main()
