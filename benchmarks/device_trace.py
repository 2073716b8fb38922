"""The GPU's own record of a program's work (jax.profiler's perfetto trace): its kernels and copies, and the
device time a call takes, for `kernel_times.py` and `model_bench.py`'s per-node table."""

from __future__ import annotations

import glob
import gzip
import json
import tempfile

import jax


def short_name(name: str) -> str:
    """'void jaxbnn::cuda::ResidentWgmmaKernel<(jaxbnn::cuda::ALayout)1, 128, false>(...)' ->
    'ResidentWgmmaKernel<(ALayout)1, 128, false>'; XLA's fusions keep their names."""
    for noise in ("void ", "(anonymous namespace)::", "jaxbnn::cuda::"):
        name = name.replace(noise, "")
    depth = 0
    for i, ch in enumerate(name):
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0 and i > 0:
            return name[:i]
    return name


def device_events(trace_dir: str) -> list[dict]:
    """The GPU's events ("X" slices of the GPU processes) in the trace's perfetto file, in time order."""
    paths = sorted(glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True))
    if not paths:
        raise RuntimeError(f"jax.profiler wrote no perfetto trace under {trace_dir}")
    with gzip.open(paths[-1]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, name in names.items() if "GPU" in name.upper()}
    return sorted((e for e in events if e.get("ph") == "X" and e.get("pid") in gpu), key=lambda e: e["ts"])


def traced_events(compiled, args, warmup: int = 5) -> list[dict]:
    """The device events of one call of `compiled(*args)`, after `warmup` calls (clocks and caches settle)."""
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        jax.block_until_ready(compiled(*args))
        jax.profiler.stop_trace()
        return device_events(trace_dir)


def device_seconds(compiled, args, calls: int = 1) -> float:
    """Seconds of device time per call of a program that makes `calls` calls: from its first event's start to
    its last one's end (the gaps between its kernels included), over `calls`. Raises where the trace holds no
    device event (a CPU run)."""
    events = traced_events(compiled, args)
    if not events:
        raise RuntimeError("the trace holds no GPU events")
    start = float(events[0]["ts"])
    end = max(float(e["ts"]) + float(e["dur"]) for e in events)
    return (end - start) * 1e-6 / calls
