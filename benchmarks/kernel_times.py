"""Where a whole forward's time goes on the GPU itself: each kernel of a packed zoo forward and of its XLA
bf16 contender, from the device's own record (jax.profiler), next to the host's dispatch of one forward.

    python benchmarks/kernel_times.py [--models mnist-mlp mnist-conv] [--batches 8 1024] [--mode tnn] [--out PATH]

`model_bench.py` times forwards queued back to back: a forward whose kernels take less time than the host
needs to dispatch it is paced by the host, and its per-node table cannot tell the two apart. Here one
forward (after warm-up) runs under `jax.profiler.trace`; its perfetto trace's device events give every
kernel's and copy's duration (`device us`: their sum; a forward replayed from XLA's command buffer leaves
no gaps between them). `host us`: the median time one call takes to return on an idle queue (the host's
dispatch of the whole forward). Where host us exceeds device us, queued forwards run at the host's pace.
Batches: 8 and the TCBNN paper's (1024 for MNIST / CIFAR, 512 for ImageNet), unless --batches. --mode: the
packed models' mode (bnn unless given: tnn, tbn, btn). The table replaces this script's section for the mode
in the machine's results file (benchmarks/results/<gpu>.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

import device_trace
import model_bench
import results_file

SECTION = "kernel_times.py"
DEFAULT_MODELS = ("mnist-mlp", "mnist-conv", "cifar10-vgg", "cifar10-resnet14", "imagenet-alexnet")
HOST_CALLS = 100


def profile(compiled, args) -> dict:
    """One forward's device events and the host's median dispatch time of a call on an idle queue."""
    events = device_trace.traced_events(compiled, args)
    host = []
    for _ in range(HOST_CALLS):
        start = time.perf_counter()
        out = compiled(*args)
        host.append(time.perf_counter() - start)
        jax.block_until_ready(out)
    kernels = [(device_trace.short_name(e["name"]), float(e["dur"])) for e in events]
    return {"kernels": kernels, "device_us": sum(d for _, d in kernels), "host_us": statistics.median(host) * 1e6}


def measure(name: str, batches, mode: str = "bnn") -> list[dict]:
    packed = model_bench.packed_contender(name, mode, "sm90")
    bf16 = model_bench.float_contenders(name)[0]
    plan = model_bench.plan_for(name, "gpu")
    rows = []
    for batch in batches or (plan.latency_batch, plan.large_batch):
        images = model_bench.random_images(batch, packed.input_shape, seed=batch)
        row = {"model": name, "batch": batch, "mode": mode}
        for key, c in (("packed", packed), ("bf16", bf16)):
            compiled = c.forward.lower(*c.args(images)).compile()
            row[key] = profile(compiled, c.args(images))
        print(summary_table([row]).splitlines()[-1], flush=True)
        rows.append(row)
    return rows


def summary_table(rows) -> str:
    lines = ["| model | batch | packed: kernels, device us, host us | XLA bf16: kernels, device us, host us | "
             "device time bf16 / packed | paced by (packed) |", "|---|---|---|---|---|---|"]
    for r in rows:
        p, b = r["packed"], r["bf16"]
        paced = "host" if p["host_us"] > p["device_us"] else "device"
        lines.append(f"| {r['model']} | {r['batch']} | {len(p['kernels'])}, {p['device_us']:.1f}, {p['host_us']:.1f} | "
                     f"{len(b['kernels'])}, {b['device_us']:.1f}, {b['host_us']:.1f} | "
                     f"{model_bench.fmt_ratio(model_bench.ratio(b['device_us'], p['device_us']))} | {paced} |")
    return "\n".join(lines)


def kernel_table(row) -> str:
    p = row["packed"]
    lines = [f"{row['model']}, batch {row['batch']}, packed {row['mode']} ({p['device_us']:.1f} us on the device):", "",
             "| # | kernel | us | share |", "|---|---|---|---|"]
    for i, (name, us) in enumerate(p["kernels"]):
        share = us / p["device_us"] if p["device_us"] else 0.0
        lines.append(f"| {i} | `{name}` | {us:.1f} | {share:.0%} |")
    return "\n".join(lines)


def section_name(mode: str) -> str:
    return SECTION if mode == "bnn" else f"{SECTION} {mode}"


def section(header, rows, mode: str = "bnn") -> str:
    parts = [*header, "",
             f"One forward of each zoo model ({mode}, random-init eval mode, random uint8 images) under jax.profiler:",
             "the device's kernels and copies (`device us`, their sum) and the host's dispatch of one call on an",
             "idle queue (`host us`, median of 100). A forward whose host us exceeds its device us runs, queued,",
             "at the host's pace (`model_bench.py`'s figures). XLA bf16: the same architecture as",
             "`model_bench.py` builds it.", "", summary_table(rows), ""]
    for r in rows:
        parts += [kernel_table(r), ""]
    return "\n".join(parts)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(model_bench.MODEL_BUILDERS), default=list(DEFAULT_MODELS))
    parser.add_argument("--batches", type=int, nargs="+", help="default: 8 and each model's TCBNN batch")
    parser.add_argument("--mode", choices=("bnn", "tnn", "tbn", "btn"), default="bnn")
    parser.add_argument("--out", help="the results file whose section this run replaces")
    parser.add_argument("--commit", default="")
    args = parser.parse_args()
    out, machine, header = results_file.gpu_run(parser, args)
    rows = []
    for name in args.models:
        rows += measure(name, args.batches, args.mode)
        results_file.write_section(out, section_name(args.mode), section(header, rows, args.mode), machine)
    print(section(header, rows, args.mode))
    print(f"(written to {out}, section {section_name(args.mode)})")


if __name__ == "__main__":
    main()
