"""`jaxbnn bench`: a packed model's throughput against the same architecture under XLA, on the default
device.

The XLA side is the zoo model the file was exported from: its recorded name, input shape and class count,
at the width its layers' shapes give, in network mode float (eval mode, random weights: timing does not
depend on the values), its float forward jitted with the floating parameters cast to bfloat16 on a GPU and
kept float32 on the CPU (the layers ask for HIGHEST precision: true float32). Both sides take the same
random uint8 images, and each is compiled before it is timed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jaxbnn import formats, runtime
from jaxbnn.models import MODEL_BUILDERS, build_model, default_rngs

__all__ = ["BenchRow", "BenchReport", "describe_device", "default_batch_sizes", "model_width", "xla_forward",
           "seconds_per_forward", "is_out_of_memory", "bench"]

# (latency batch, throughput batch) per dataset: the TCBNN paper's on a GPU, smaller ones on the CPU
DEFAULT_BATCH_SIZES = {
    "gpu": {"mnist": (8, 1024), "cifar10": (8, 1024), "imagenet": (8, 512)},
    "cpu": {"mnist": (1, 256), "cifar10": (1, 64), "imagenet": (1, 16)},
}
SAMPLES = 5  # timed samples per side and batch; the median is reported


def describe_device(device) -> str:
    """'cuda:0 (NVIDIA H200)' for an accelerator, 'cpu (N cores)' for the CPU."""
    if device.platform == "cpu":
        return f"cpu ({os.cpu_count()} cores)"
    return f"{device} ({device.device_kind})"


def _kind(device) -> str:
    return "cpu" if device.platform == "cpu" else "gpu"


def default_batch_sizes(model_name: str, device) -> tuple[int, ...]:
    """The batches `bench` times when none are given: a latency batch and a throughput batch for the
    model's dataset on the device's kind (DEFAULT_BATCH_SIZES)."""
    return DEFAULT_BATCH_SIZES[_kind(device)][model_name.split("-")[0]]


def _block_output_shapes(name: str, width: float, input_shape, num_classes: int) -> list[tuple[int, ...]]:
    """Each block's output shape (batch excluded) of a zoo model, from shapes alone (nothing computed)."""
    model = nnx.eval_shape(lambda: build_model(name, "float", input_shape=tuple(input_shape),
                                               num_classes=num_classes, width=width))
    model.eval()
    graphdef, state = nnx.split(model)

    def outputs(state, images):
        x = formats.image_levels(images).astype(jnp.float32)
        shapes = []
        for block in nnx.merge(graphdef, state).blocks:
            x = block(x)
            shapes.append(x)
        return shapes

    images = jax.ShapeDtypeStruct((1, *input_shape), jnp.uint8)
    return [tuple(out.shape[1:]) for out in jax.eval_shape(outputs, state, images)]


def model_width(graph: dict) -> float:
    """The width multiplier of the zoo model a packed graph was exported from: each layer below the
    classifier (whose channel count the width does not scale) has round(width * its full-width channels)
    channels, which bounds the width; the middle of the bounds, checked against every node's output shape."""
    name = graph["name"]
    if name not in MODEL_BUILDERS:
        raise ValueError(f"model {name!r} is not a zoo model ({', '.join(MODEL_BUILDERS)}): bench rebuilds the "
                         "XLA side from the zoo")
    input_shape, num_classes = tuple(graph["input_shape"]), graph["num_classes"]
    recorded = [tuple(node["out_shape"]) for node in graph["nodes"]]
    full = _block_output_shapes(name, 1.0, input_shape, num_classes)
    if len(full) != len(recorded):
        raise ValueError(f"this {name} has {len(recorded)} layers, the zoo's {name} {len(full)}")
    low, high = 0.0, math.inf
    for full_shape, shape in zip(full[:-1], recorded[:-1]):
        channels, full_channels = shape[-1], full_shape[-1]
        low = max(low, (channels - 0.5) / full_channels if channels > 1 else 0.0)  # at least 1 channel
        high = min(high, (channels + 0.5) / full_channels)
    width = (low + high) / 2
    shapes = _block_output_shapes(name, width, input_shape, num_classes) if low < high else None
    if shapes != recorded:
        raise ValueError(f"the layers of this {name} (output shapes {recorded}) are not those of the zoo's "
                         f"{name} at any width")
    return width


def xla_forward(name: str, width: float, input_shape, num_classes: int, dtype):
    """(forward, params): the zoo model in network mode float, eval mode, random weights, its floating
    parameters cast to `dtype`; `forward(params, uint8 images)` is its float forward, jitted."""
    model = build_model(name, "float", input_shape=tuple(input_shape), num_classes=num_classes, width=width,
                        rngs=default_rngs(0))
    model.eval()
    graphdef, state = nnx.split(model)
    params = jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, state)
    return jax.jit(lambda p, images: nnx.merge(graphdef, p).float_forward(images, dtype)), params


def seconds_per_forward(forward, args, seconds: float) -> float:
    """Median seconds per call of `forward(*args)` over SAMPLES samples of calls queued back to back, the
    samples taking about `seconds` in all; the first call (compilation) and one more are not counted."""
    jax.block_until_ready(forward(*args))
    start = time.perf_counter()
    jax.block_until_ready(forward(*args))
    once = max(time.perf_counter() - start, 1e-6)
    calls = max(1, min(1000, int(seconds / SAMPLES / once)))
    samples = []
    for _ in range(SAMPLES):
        start = time.perf_counter()
        for _ in range(calls):
            out = forward(*args)  # no host synchronisation between the calls of a sample
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """Images per second of both sides at one batch (None: the device ran out of memory)."""

    batch: int
    packed_images_per_s: float | None
    xla_images_per_s: float | None

    @property
    def speedup(self) -> float | None:
        if self.packed_images_per_s is None or self.xla_images_per_s is None:
            return None
        return self.packed_images_per_s / self.xla_images_per_s


@dataclasses.dataclass(frozen=True)
class BenchReport:
    """What `bench` measured: the packed model (name, mode, width, target), the device, the jax version,
    the XLA side's dtype, and one row per batch."""

    model: str
    mode: str
    width: float
    target: str
    device: str
    jax_version: str
    xla_dtype: str
    rows: list[BenchRow]

    def title(self) -> str:
        return (f"{self.model} ({self.mode}, width {self.width:.3g}, target {self.target}) against XLA "
                f"{self.xla_dtype} (the same architecture, random weights) on {self.device}")

    def table(self) -> str:
        """A Markdown table: batch, images/s of both sides, speedup, device, jax version."""
        def rate(value):
            return f"{value:,.0f}" if value is not None else "out of memory"

        lines = [f"| batch | jaxbnn images/s | XLA {self.xla_dtype} images/s | speedup | device | jax |",
                 "| ---: | ---: | ---: | ---: | --- | --- |"]
        for row in self.rows:
            speedup = f"{row.speedup:.2f}x" if row.speedup is not None else "-"
            lines.append(f"| {row.batch} | {rate(row.packed_images_per_s)} | {rate(row.xla_images_per_s)} | "
                         f"{speedup} | {self.device} | {self.jax_version} |")
        return "\n".join(lines)


def _images_per_s(forward, args, batch: int, seconds: float) -> float | None:
    try:
        return batch / seconds_per_forward(forward, args, seconds)
    except jax.errors.JaxRuntimeError as error:
        if is_out_of_memory(error):
            return None
        raise


def is_out_of_memory(error: BaseException) -> bool:
    """Whether jax or XLA could not allocate what a forward (or a model) needs on its device."""
    return isinstance(error, jax.errors.JaxRuntimeError) and (
        "RESOURCE_EXHAUSTED" in str(error) or "Out of memory" in str(error))  # the GPU's wording, the CPU's


def bench(path: str | os.PathLike, batch_sizes=None, seconds: float = 0.5) -> BenchReport:
    """Time the packed model of `path` (`runtime.load`) and the same architecture under XLA on the default
    device, at each of `batch_sizes` (default: `default_batch_sizes`), each side for about `seconds` per
    batch."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds) \
            or seconds <= 0:
        raise ValueError(f"seconds must be a finite number > 0, got {seconds!r}")
    device = jax.devices()[0]
    net = runtime.load(path)
    name = net.graph["name"]
    width = model_width(net.graph)
    if batch_sizes is None:
        batch_sizes = default_batch_sizes(name, device)
    if not batch_sizes:
        raise ValueError(f"batch_sizes must name at least one batch, got {batch_sizes!r}")
    for batch in batch_sizes:
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ValueError(f"batch sizes must be integers >= 1, got {batch!r}")
    dtype = jnp.float32 if _kind(device) == "cpu" else jnp.bfloat16
    forward, params = xla_forward(name, width, net.input_shape, net.num_classes, dtype)
    rows = []
    for batch in batch_sizes:
        images = jax.random.bits(jax.random.key(batch), (batch, *net.input_shape), jnp.uint8)
        rows.append(BenchRow(batch, _images_per_s(net, (images,), batch, seconds),
                             _images_per_s(forward, (params, images), batch, seconds)))
    return BenchReport(name, net.graph["mode"], width, net.target, describe_device(device), jax.__version__,
                       jnp.dtype(dtype).name, rows)
