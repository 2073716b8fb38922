"""Whole networks: each zoo model's packed network against the same architecture under XLA, one process, one
device (a GPU, or the CPU).

    python benchmarks/model_bench.py                                  # every zoo model, bnn (~6 min on an H200 without Darknet-19)
    python benchmarks/model_bench.py --models imagenet-resnet18 --modes bnn tnn
    python benchmarks/model_bench.py --quick --out -                  # a smoke test: seconds on a CPU
    python benchmarks/model_bench.py --plot-from results.csv          # draw the plots of a run made elsewhere

Contenders, per model (`jaxbnn.models.MODEL_BUILDERS`, at its real input size and class count), all on the
same random uint8 images:

- packed: the model in network mode bnn (`--modes`: also tnn, tbn, btn) with its default (untrained)
  parameters, in eval mode, exported for the device (`target="sm90"` on a GPU, `"cpu"` on the CPU) and run
  by `jaxbnn.runtime` (the jitted forward pass of `PackedNet`, as a call runs it: the parameters as constants of
  the executable where they take at most `runtime.EMBEDDED_PARAMETERS_BYTES`, else arguments). Timing does not
  depend on the values.
- XLA bfloat16 / XLA float32: the same architecture in network mode `float`, eval mode, its float forward
  (`BinaryNet.float_forward`, on the same image levels) jitted (its state passed as arguments, as a jitted
  Flax model's is), with the floating parameters cast to the dtype. The layers' dots and convolutions ask
  for HIGHEST precision: float32 is true float32 (no TF32).

Measured:

- latency: ms per forward at batch 8 (1 on the CPU), and throughput, images per second, at the TCBNN paper's
  batch (1024 for MNIST and CIFAR-10, 512 for ImageNet; smaller on the CPU) and over a sweep of batches,
  to find where it saturates. Each point is `gpu_bench.timed` (0.1 s warm-up, then the median of 5 batches
  of calls queued back to back, ~50 ms each; on the CPU the fastest of CPU_TIMING_ROUNDS such timings, the
  contenders timed in turn so that a slow spell of a shared machine does not skew one ratio) on an
  executable compiled first: compile time is measured apart and counted nowhere else. After the two
  required batches the sweep takes the others farthest first (log scale) until the model's `--seconds` are
  spent, so that a cut sweep still spans the range; a contender skips batches from one where it ran out of
  memory, and sweep batches (not the two required ones) where a forward would take over MAX_FORWARD_S.
- the ratios against XLA bfloat16 and float32, next to the issue's targets (TARGETS), and the TCBNN
  paper's RTX 2080 Ti figures (TCBNN_2080TI);
- memory at the large batch: the compiled program's `memory_analysis()`, arguments (parameters and
  images) + outputs + temporaries;
- per node, at the large batch: each graph node alone as it runs in the whole forward
  (`jaxbnn.runtime.run_node`, jitted: on the value the node before it produced, with the input bits that
  node's epilogue wrote for it, writing the next node's), and each of the node's custom calls alone on the
  operands it received there (recorded through a debug callback), so the node's time outside the kernels is its
  time minus its custom calls' (the first layer's is one too: `ops.image_conv2d`). A node or call
  shorter than NODE_PROGRAM_S is timed as a program of several calls on distinct copies of its inputs; on a
  GPU these times are the device's, from the profiler's trace of the program (timed from the host, a small
  node's time was the host's dispatch of its program); on the CPU each is the fastest of CPU_NODE_ROUNDS
  alternating timings.

Output: one section per network mode in the machine's results file (benchmarks/results/<machine>.md, see
results_file.py), rewritten after each model; the sweep as CSV next to it; a PNG per model (images/s
against batch, log-log) under docs/model_bench/ (`--plot-from CSV` draws them where matplotlib is).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import functools
import math
import os
import pathlib
import sys
import textwrap
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import device_trace
import results_file
from gpu_bench import timed
from jaxbnn import formats, runtime
from jaxbnn.cli import integer_at_least
from jaxbnn.models import MODEL_BUILDERS, build_model

try:
    from jaxbnn.export import export_model
except ImportError:  # a source tree on PYTHONPATH without the links the wheel makes (pyproject.toml)
    from export import export_model

PACKED_MODES = ("bnn", "tnn", "tbn", "btn")
BF16, F32 = "XLA bfloat16", "XLA float32"
MAX_FORWARD_S = 1.0  # a contender whose next forward would take longer leaves the sweep
SATURATION = 0.9  # throughput "saturates" at the smallest batch reaching this share of the best measured
NODE_PROGRAM_S = 1e-3  # per-node programs hold enough calls for this much work (timed_alone)
# On the CPU each point is the fastest of this many timings: on a shared 2-core VM the packed MNIST models' batch-1
# forwards ran 0.076 and 0.141 ms (conv net), 0.037 and 0.050 (MLP) in consecutive processes, and within one
# process a slow spell of a second or more can take one timing (the MLP 0.029-0.033 ms, then 0.077-0.082).
CPU_TIMING_ROUNDS = 3
# On the CPU each node and its custom calls are timed this many times, alternating, and the fastest of each kept:
# on a shared 2-core VM one timing of a node and one of its calls differed by more than the node's work outside its
# calls (the MNIST MLP's first node at batch 256: 0.868 ms in the first round, 0.571-0.574 in the next three, its
# call 0.561-0.593), so one round read a node of a single custom call as 18-32% "outside". The GPU's times come
# from the profiler's trace and move less: one round.
CPU_NODE_ROUNDS = 4
MAX_COPIES, COPY_BYTES = 16, 2e9
PLOTS_DIR = results_file.REPO_DIR / "docs" / "model_bench"

# "Accelerating Binarized Neural Networks via Bit-Tensor-Cores in Turing GPUs" (TCBNN), Table VII (NVIDIA
# RTX 2080 Ti), row BTC-FMT (its best design): latency at batch 8 in ms, throughput in images/s at batch
# 1024 (MNIST, CIFAR-10) or 512 (ImageNet). The paper has no MNIST conv net.
TCBNN_2080TI = {
    "mnist-mlp": (0.053, 6.78e6),
    "cifar10-vgg": (0.276, 5.06e4),
    "cifar10-resnet14": (0.618, 2.24e4),
    "imagenet-alexnet": (1.862, 4.87e3),
    "imagenet-vgg16": (5.466, 1.76e3),
    "imagenet-resnet18": (1.438, 7.34e3),
}


@dataclasses.dataclass(frozen=True)
class Targets:
    """The issue's targets on one kind of device: packed speedups over `baseline`, and the largest share of a
    node's time spent outside the bit kernels."""

    baseline: str
    latency: float
    throughput: dict[str, float]
    node_outside: float = 0.10


TARGETS = {
    "gpu": Targets(BF16, latency=3.0, throughput={"mnist-mlp": 3.0, "mnist-conv": 3.0, **dict.fromkeys(
        ("cifar10-vgg", "cifar10-resnet14", "imagenet-alexnet", "imagenet-vgg16", "imagenet-resnet18"), 4.0)}),
    # on the CPU the issue sets 8x XLA float32 at batch 1 and at a large batch, for every model
    "cpu": Targets(F32, latency=8.0, throughput=dict.fromkeys(MODEL_BUILDERS, 8.0)),
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """The batches of one model: latency at `latency_batch`, throughput at `large_batch` (both always
    measured) and over `sweep` (which holds both)."""

    latency_batch: int
    large_batch: int
    sweep: tuple[int, ...]


def dataset(model: str) -> str:
    return model.split("-")[0]


def plan_for(model: str, platform: str, quick: bool = False, batches=None) -> Plan:
    """The batches a model is measured at on `platform` ("gpu" or "cpu"): TCBNN's on a GPU (batch 8;
    1024 for MNIST and CIFAR-10, 512 for ImageNet), the issue's CPU measurements on the CPU (batch 1;
    256 / 64 / 16). `batches` replaces the sweep's other batches."""
    if quick:
        latency, large, sweep = 1, 16, (1, 4, 16)
    elif platform == "gpu":
        latency, large = 8, {"mnist": 1024, "cifar10": 1024, "imagenet": 512}[dataset(model)]
        sweep = {"mnist": (8, 64, 256, 1024, 4096, 16384, 32768),  # TCBNN's MNIST MLP still gains at 32K
                 "cifar10": (8, 32, 128, 512, 1024, 2048, 4096),
                 "imagenet": (8, 32, 128, 512, 1024, 2048)}[dataset(model)]
    else:
        latency, large = 1, {"mnist": 256, "cifar10": 64, "imagenet": 16}[dataset(model)]
        sweep = {"mnist": (1, 16, 256, 1024), "cifar10": (1, 8, 64, 256), "imagenet": (1, 4, 16, 64)}[dataset(model)]
    if batches:
        sweep = tuple(batches)
    return Plan(latency, large, tuple(sorted({latency, large, *sweep})))


# --- contenders and measurements ----------------------------------------------------------------------------


@dataclasses.dataclass
class Contender:
    """One way to run a model: `forward(params, uint8 images)`, jitted, or, for a packed model, `forward` on the
    arguments a call passes (`call_arguments(images)`: the images alone, and its uniform parameter arrays, where
    its executable holds the parameters, `params_embedded`: a small packed model's call)."""

    name: str
    forward: object
    params: object
    input_shape: tuple[int, ...]
    weight_bytes: int
    setup_s: float  # build (and export) time
    nodes: list[dict] | None = None  # the packed graph's nodes
    stream_dtypes: list | None = None  # per node, the type of its stream output (runtime.stream_dtypes)
    params_embedded: bool = False
    call_arguments: object = None  # images -> the forward's arguments (packed models)

    def args(self, images) -> tuple:
        """The forward's arguments for `images`."""
        return self.call_arguments(images) if self.call_arguments is not None else (self.params, images)

    def embedded_bytes(self) -> int:
        """The bytes of the parameters the executable holds (memory_analysis counts arguments, not those)."""
        return sum(a.nbytes for a in jax.tree.leaves(self.params)) if self.params_embedded else 0


@dataclasses.dataclass
class Point:
    """One contender at one batch: seconds per forward, or why there is none."""

    batch: int
    seconds: float | None = None
    compile_s: float | None = None
    memory: int | None = None  # bytes: arguments + outputs + temporaries of the compiled program
    failure: str | None = None

    @property
    def images_per_s(self) -> float | None:
        return self.batch / self.seconds if self.seconds else None


def packed_contender(model_name: str, mode: str, target: str) -> Contender:
    start = time.perf_counter()
    model = build_model(model_name, mode)
    model.eval()
    net = runtime.from_packed(export_model(model, target=target))
    # the forward a call runs (`PackedNet.__call__` without its input checks)
    return Contender(f"packed {mode}", net._call_forward, net.params, net.input_shape, net.packed_bytes,
                     time.perf_counter() - start, net.graph["nodes"], net.stream_dtypes, net.embeds_parameters,
                     net._call_arguments)


def float_contenders(model_name: str) -> list[Contender]:
    """The float network mode of the architecture, eval mode, in bfloat16 and in float32."""
    start = time.perf_counter()
    model = build_model(model_name, "float")
    model.eval()
    graphdef, state = nnx.split(model)
    setup = time.perf_counter() - start
    contenders = []
    for name, dtype in ((BF16, jnp.bfloat16), (F32, jnp.float32)):
        cast = jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, state)
        forward = jax.jit(lambda s, x, dtype=dtype: nnx.merge(graphdef, s).float_forward(x, dtype))
        size = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cast))
        contenders.append(Contender(name, forward, cast, model.input_shape, size, setup))
    return contenders


def random_images(batch: int, shape, seed: int = 0) -> jax.Array:
    return jax.random.bits(jax.random.key(seed), (batch, *shape), jnp.uint8)


def memory_bytes(compiled) -> int | None:
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes


def is_out_of_memory(err: Exception) -> bool:
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def compiled_point(forward, args, batch: int, embedded_bytes: int = 0):
    """`forward` compiled for `args` and its Point so far (compile time, memory), or (None, a Point that says
    why it failed: out of memory or an error)."""
    try:
        start = time.perf_counter()
        compiled = forward.lower(*args).compile()
        compile_s = time.perf_counter() - start
        memory = memory_bytes(compiled)
        return compiled, Point(batch, None, compile_s, memory + embedded_bytes if memory is not None else None)
    except Exception as err:  # noqa: BLE001  the sweep goes on without this contender; the table says why
        return None, failed_point(err, batch)


def failed_point(err: Exception, batch: int) -> Point:
    if is_out_of_memory(err):
        return Point(batch, failure="out of memory")
    print(f"batch {batch}: {type(err).__name__}: {err}", file=sys.stderr)
    return Point(batch, failure=f"failed ({type(err).__name__})")


def measure(contenders: list, images, batch: int) -> dict[str, Point]:
    """Each of `contenders` compiled for `images` (its arguments made here), then timed
    (gpu_bench.timed). On the CPU, the fastest of CPU_TIMING_ROUNDS timings, the contenders' timings taken in
    turn, so that a slow spell of a shared machine weighs on all of them rather than on one's ratio."""
    points, ready = {}, {}
    for c in contenders:
        args = c.args(images)
        compiled, points[c.name] = compiled_point(c.forward, args, batch, c.embedded_bytes())
        if compiled is not None:
            ready[c.name] = (compiled, args)
    for _ in range(1 if on_gpu() else CPU_TIMING_ROUNDS):
        for name, (compiled, args) in list(ready.items()):
            try:
                seconds = timed(compiled, args, 1)
            except Exception as err:  # noqa: BLE001  as a failed compile
                points[name] = failed_point(err, batch)
                del ready[name]
                continue
            best = points[name].seconds
            points[name].seconds = seconds if best is None else min(best, seconds)
    return points


def sweep_order(plan: Plan) -> list[int]:
    """The two required batches, then the others, each the farthest (log scale) from those before it: a
    sweep cut short by the time budget still spans the range."""
    order = sorted({plan.latency_batch, plan.large_batch})
    rest = [b for b in plan.sweep if b not in order]
    while rest:
        far = max(rest, key=lambda b: (min(abs(math.log(b / m)) for m in order), b))
        order.append(far)
        rest.remove(far)
    return order


def blocked(points: dict[int, Point], batch: int, required: bool = False) -> str | None:
    """Why a contender skips `batch`: it ran out of memory at a batch no larger, or (not for a `required`
    batch, the targets' latency and large batches) its forward at the largest smaller batch measured, scaled
    to this one, would take over MAX_FORWARD_S."""
    for b, p in points.items():
        if p.failure and not p.failure.startswith("not measured") and b <= batch:
            return f"not measured ({p.failure} at batch {b})"
    below = [b for b, p in points.items() if p.seconds and b < batch]
    if not required and below and points[max(below)].seconds * batch / max(below) > MAX_FORWARD_S:
        return f"not measured (a forward would take over {MAX_FORWARD_S:g} s)"
    return None


def sweep(contenders: list[Contender], plan: Plan, seconds: float) -> dict[str, dict[int, Point]]:
    """Every contender at every batch of the plan (sweep_order): the required batches, then the others
    while `seconds` last."""
    points: dict[str, dict[int, Point]] = {c.name: {} for c in contenders}
    required = {plan.latency_batch, plan.large_batch}
    deadline = None
    for batch in sweep_order(plan):
        if batch not in required:
            deadline = deadline or time.perf_counter() + seconds
            if time.perf_counter() > deadline:
                for c in contenders:
                    points[c.name][batch] = Point(batch, failure="not measured (time budget)")
                continue
        images = random_images(batch, contenders[0].input_shape, seed=batch)
        unblocked = []
        for c in contenders:
            reason = blocked(points[c.name], batch, required=batch in required)
            if reason:
                points[c.name][batch] = Point(batch, failure=reason)
            else:
                unblocked.append(c)
        if on_gpu():  # one at a time: a contender's compiled program and buffers gone before the next's
            measured = {}
            for c in unblocked:
                measured |= measure([c], images, batch)
        else:
            measured = measure(unblocked, images, batch)
        for c in contenders:
            if c.name in measured:
                points[c.name][batch] = measured[c.name]
            print(f"  batch {batch:>6} {c.name:<13} {describe(points[c.name][batch])}", flush=True)
        del images, unblocked
    return points


def describe(point: Point) -> str:
    if point.failure:
        return point.failure
    memory = f", {point.memory / 2**20:,.0f} MiB" if point.memory is not None else ""
    return (f"{point.seconds * 1e3:9.3f} ms, {point.images_per_s:>12,.0f} images/s "
            f"(compile {point.compile_s:.1f} s{memory})")


def saturation(points: dict[int, Point]) -> str:
    """The smallest batch whose throughput reaches SATURATION of the best measured ("≥ B" where it still
    rises that much at B, the largest batch measured)."""
    measured = {b: p.images_per_s for b, p in sorted(points.items()) if p.images_per_s}
    if not measured:
        return "—"
    batches = list(measured)
    if len(batches) > 1 and measured[batches[-1]] * SATURATION > measured[batches[-2]]:
        return f"≥ {batches[-1]}"
    best = max(measured.values())
    return str(min(b for b, v in measured.items() if v >= SATURATION * best))


# --- per node ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CustomCall:
    """One custom call as a node executed it: the call (`make()` gives the ffi callable), attributes,
    operand values."""

    target: str
    make: object
    attrs: dict
    operands: tuple


@contextlib.contextmanager
def recording_custom_calls():
    """Within: every `jax.ffi.ffi_call` traced also records its target and, when the program runs, its
    operands (a debug callback). The jit caches are cleared on entry, so that the ops' inner jitted
    functions are traced again through the recorder, and on exit, so that no executable holding the
    callback outlives it."""
    calls: list[CustomCall] = []
    original = jax.ffi.ffi_call

    def recording(target, result_shape_dtypes, *args, **kwargs):
        make = functools.partial(original, target, result_shape_dtypes, *args, **kwargs)

        def run(*operands, **attrs):
            jax.debug.callback(lambda *values: calls.append(CustomCall(target, make, attrs, values)), *operands)
            return make()(*operands, **attrs)

        return run

    jax.clear_caches()
    jax.ffi.ffi_call = recording
    try:
        yield calls
    finally:
        jax.ffi.ffi_call = original
        jax.clear_caches()


@dataclasses.dataclass
class NodeRow:
    """A graph node's time alone, and its custom calls' times alone."""

    index: int
    node: dict  # a fused dense chain's row: its own summary (`chain_summary`)
    seconds: float
    calls: list[tuple[str, float]]  # (target, seconds alone)
    through: int | None = None  # a fused dense chain's last node

    @property
    def outside(self) -> float:
        """The share of the node's time spent outside its custom calls."""
        return (self.seconds - sum(s for _, s in self.calls)) / self.seconds


def node_output(node: dict, output):
    """What the next node reads of a node's output (a residual node gives (conv1's output, the stream))."""
    return output[1] if node["kind"] == "residual" else output


def on_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


def timed_alone(fn, args) -> float:
    """Seconds per call of fn(*args), jitted, as the per-node table counts them. A call shorter than
    NODE_PROGRAM_S runs again as a program of several calls on distinct copies of `args` (up to MAX_COPIES,
    within COPY_BYTES). On a GPU the time is the device's (`device_trace.device_seconds`: the program under the
    profiler, from its first kernel's start to its last one's end): timed from the host, a small node's
    program ran at the pace of the host's dispatch of its arguments (ResNet-14's dense nodes at batch 1024:
    about 10 us a call for 3.9 us of kernels), so the node's extra arguments read as time outside its kernels.
    On the CPU the host's time is the work."""
    one = jax.jit(fn).lower(*args).compile()
    seconds = timed(one, args, 1)
    size = sum(a.nbytes for a in jax.tree.leaves(args))
    copies = min(MAX_COPIES, math.ceil(NODE_PROGRAM_S / seconds), max(1, int(COPY_BYTES // max(size, 1))))
    if copies < 2:
        return device_trace.device_seconds(one, args) if on_gpu() else seconds
    sets = [jax.tree.map(jnp.copy, args) for _ in range(copies)]
    several = jax.jit(lambda sets_: [fn(*a) for a in sets_]).lower(sets).compile()
    if on_gpu():
        return device_trace.device_seconds(several, [sets], copies)
    return timed(several, [sets], copies)


class StackedPlanes(NamedTuple):
    """A ternary value between two node programs as the forward holds it: the one array (..., 2, W) of its planes
    that an epilogue wrote (the forward's next kernel reads it as it lies; `runtime.run_node` gives its planes)."""
    planes: Any


def _is_plane_pair(value) -> bool:
    """A ternary value as `runtime.run_node` gives it: a pair of uint32 arrays of one shape (its planes)."""
    return (isinstance(value, tuple) and not isinstance(value, StackedPlanes) and len(value) == 2
            and all(getattr(v, "dtype", None) == jnp.uint32 for v in value) and value[0].shape == value[1].shape)


def _is_planes(value) -> bool:
    return isinstance(value, StackedPlanes) or _is_plane_pair(value)


def carried(tree):
    """The ternary values of a node program's outputs as the forward holds them (`StackedPlanes`): so that, as in
    the forward, the program writes no copy of the planes (XLA folds the stack of the output's slices)."""
    return jax.tree.map(lambda v: StackedPlanes(jnp.stack(v, axis=-2)) if _is_plane_pair(v) else v, tree,
                        is_leaf=_is_planes)


def unstacked(tree):
    """The node's inputs as `runtime.run_node` takes them: `StackedPlanes` as their `TernaryPlanes`."""
    return jax.tree.map(lambda v: formats.TernaryPlanes(v.planes[..., 0, :], v.planes[..., 1, :])
                        if isinstance(v, StackedPlanes) else v, tree, is_leaf=_is_planes)


def node_in_graph(node: dict, stream_dtype, next_node: dict | None):
    """The node as it runs in the whole forward (`runtime.run_node`), a function of its parameters, its input,
    the input bits the node before it wrote (or None) and the next node's parameters (or None): returns its
    output and the bits it writes for the next node (or None); ternary values in and out as `StackedPlanes`."""
    def run(p, x, bits, next_params):
        following = (next_node, next_params) if next_node is not None else None
        x, bits = unstacked((x, bits))
        return carried(runtime.run_node(node, p, x, stream_dtype, input_bits=bits, following=following))
    return run


def time_node(fn, args) -> tuple[float, list[CustomCall]]:
    """Seconds per call of fn(*args) alone (a node_in_graph), and its custom calls with the operands they got."""
    seconds = timed_alone(fn, args)
    with recording_custom_calls() as calls:
        jax.block_until_ready(jax.jit(fn)(*args))
        jax.effects_barrier()
    return seconds, list(calls)


def time_custom_call(call: CustomCall) -> float:
    operands = tuple(jax.device_put(v, jax.devices()[0]) for v in call.operands)  # the callback gave host arrays
    return timed_alone(lambda *ops: call.make()(*ops, **call.attrs), operands)


def chain_in_graph(nodes: list[dict]):
    """A fused dense chain of the forward (`runtime.dense_chains_of`) as the forward runs it, one `ops.bmm_chain`:
    a function of its nodes' parameters, its input, and two unused arguments (as `node_in_graph`'s), returning its
    last node's output and no bits."""
    def run(p, x, bits, next_params):
        return carried(runtime.run_dense_chain(nodes, p, unstacked(x))), None
    return run


def chain_summary(nodes: list[dict]) -> dict:
    """The per-node table's description of a fused dense chain: its first node's input, its last node's output."""
    return {"kind": "dense chain", "name": f"{nodes[0].get('name', '')} .. {nodes[-1].get('name', '')}",
            "input": nodes[0].get("input", "stream"), "output": nodes[-1]["output"],
            "out_shape": nodes[-1].get("out_shape", ())}


def per_node(contender: Contender, images, dense_chains: bool | None = None) -> list[NodeRow]:
    """Every graph node alone as it runs in the whole forward (`runtime.run_node`): on the value the node before
    it produced, with the input bits that node's epilogue wrote for it, writing the next node's where its own
    epilogue does; and its custom calls alone. A run of dense nodes the forward fuses into one `ops.bmm_chain`
    (`runtime.dense_chains_of`, where the platform fuses them: `dense_chains` None) is one row, its chain.
    dense_chains: fuse them or not, whatever the platform does."""
    nodes, params, dtypes = contender.nodes, contender.params, contender.stream_dtypes
    x, bits = jnp.asarray(images), None  # the pixels, as the forward gives them to the first layer
    fuse = runtime.fuses_dense_chains() if dense_chains is None else dense_chains
    chain_ends = dict(runtime.dense_chains_of(nodes, x.shape[0])) if fuse else {}
    rows, index = [], 0
    while index < len(nodes):
        node, p, dtype, end = nodes[index], params[index], dtypes[index], chain_ends.get(index)
        last = index if end is None else end
        next_node, next_params = (nodes[last + 1], params[last + 1]) if last + 1 < len(nodes) else (None, None)
        if end is None:
            fn, args, shown = node_in_graph(node, dtype, next_node), (p, x, bits, next_params), node
        else:
            fn, args, shown = chain_in_graph(nodes[index:end + 1]), (params[index:end + 1], x, None, None), \
                chain_summary(nodes[index:end + 1])
        seconds, calls = time_node(fn, args)
        call_seconds = [time_custom_call(c) for c in calls]
        for _ in range((1 if on_gpu() else CPU_NODE_ROUNDS) - 1):
            seconds = min(seconds, timed_alone(fn, args))
            call_seconds = [min(t, time_custom_call(c)) for t, c in zip(call_seconds, calls)]
        rows.append(NodeRow(index, shown, seconds, [(c.target, t) for c, t in zip(calls, call_seconds)], end))
        out, bits = jax.jit(fn)(*args)
        x = node_output(nodes[last], out)
        index = last + 1
    if not any(row.calls for row in rows):
        print("no custom call recorded in any node: the ops ran their pure-JAX reference (no native module for "
              "this platform), or they no longer call jax.ffi.ffi_call", file=sys.stderr)
    return rows


# --- rendering ------------------------------------------------------------------------------------------------


def verdict(speedup: float | None, target: float) -> str:
    """'met', or by how much the speedup falls short of the target."""
    if speedup is None:
        return "not measured"
    return "met" if speedup >= target else f"missed by {(1 - speedup / target) * 100:.0f}%"


def images_per_s(p: Point | None) -> float | None:
    return p.images_per_s if p else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt_ratio(r: float | None) -> str:
    return f"{r:.2f}x" if r is not None else "—"


def fmt_rate(p: Point | None) -> str:
    if p is None:
        return "—"
    return f"{p.images_per_s:,.0f}" if p.images_per_s else p.failure


def fmt_ms(p: Point | None) -> str:
    if p is None:
        return "—"
    return f"{p.seconds * 1e3:.3f}" if p.seconds else p.failure


def fmt_mib(n: int | None) -> str:
    return f"{n / 2**20:,.0f}" if n is not None else "—"


@dataclasses.dataclass
class ModelResult:
    """One model in one packed mode: its contenders' points and the packed model's per-node rows."""

    name: str
    mode: str
    plan: Plan
    contenders: list[Contender]
    points: dict[str, dict[int, Point]]
    nodes: list[NodeRow] | None

    @property
    def packed(self) -> str:
        return f"packed {self.mode}"

    def at(self, contender: str, batch: int) -> Point | None:
        return self.points.get(contender, {}).get(batch)

    def speedup(self, baseline: str, batch: int) -> float | None:
        return ratio(images_per_s(self.at(self.packed, batch)), images_per_s(self.at(baseline, batch)))

    def best(self, contender: str) -> Point | None:
        """The contender's point of most images/s over the sweep (None where none was measured)."""
        measured = [p for p in self.points.get(contender, {}).values() if p.images_per_s]
        return max(measured, key=lambda p: p.images_per_s) if measured else None

    def best_speedup(self, baseline: str) -> float | None:
        """Saturated throughput: the packed model's best images/s over `baseline`'s best, each at its own batch."""
        return ratio(images_per_s(self.best(self.packed)), images_per_s(self.best(baseline)))

    def worst_node(self) -> NodeRow | None:
        return max(self.nodes, key=lambda r: r.outside) if self.nodes else None

    def outside_all(self) -> float | None:
        """The share of the nodes' summed time spent outside their custom calls."""
        if not self.nodes:
            return None
        total = sum(row.seconds for row in self.nodes)
        return sum(row.seconds * row.outside for row in self.nodes) / total


def outside_cell(r: ModelResult, target: float) -> str:
    worst = r.worst_node()
    if worst is None:
        return "not measured"
    verdict_text = "met" if worst.outside <= target else f"missed ({sum(n.outside > target for n in r.nodes)} nodes)"
    where = worst.index if worst.through is None else f"{worst.index}-{worst.through}"
    return f"{worst.outside:.0%} (node {where}, {worst.node['kind']}), {r.outside_all():.0%}: {verdict_text}"


def summary_lines(results: list[ModelResult], targets: Targets) -> list[str]:
    base = "bf16" if targets.baseline == BF16 else "f32"
    lines = [
        f"### Targets (issue 55): packed against {targets.baseline}",
        "",
        *paragraph(
            f"Speedup: packed images/s over {targets.baseline}'s at the same batch; \"missed by N%\": the speedup is "
            "N% short of its target. Saturated: each contender's most images/s over the sweep, at its own batch (the "
            "batch in brackets), against the same throughput target. Outside the bit kernels: a node's time minus its "
            "custom calls' (per-node tables below), for the worst node and for all nodes' summed time."),
        "",
        f"| model | latency batch: packed ms, {base} ms | speedup (target ≥ {targets.latency:g}x) "
        f"| large batch: packed images/s, {base} images/s | speedup (target) "
        f"| saturated: packed images/s (batch), {base} images/s (batch) | speedup "
        f"| outside the bit kernels: worst node, all nodes (target: every node ≤ {targets.node_outside:.0%}) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lat, big = r.plan.latency_batch, r.plan.large_batch
        s_lat, s_big = r.speedup(targets.baseline, lat), r.speedup(targets.baseline, big)
        goal = targets.throughput.get(r.name)  # none for Darknet-19 (TAB's network, not TCBNN's)
        node_cell = outside_cell(r, targets.node_outside)
        s_best = r.best_speedup(targets.baseline)
        best = ", ".join(f"{fmt_rate(p)} ({p.batch})" if p else "—"
                         for p in (r.best(r.packed), r.best(targets.baseline)))
        lines.append(
            f"| {r.name} | {lat}: {fmt_ms(r.at(r.packed, lat))}, {fmt_ms(r.at(targets.baseline, lat))} "
            f"| {fmt_ratio(s_lat)}: {verdict(s_lat, targets.latency)} "
            f"| {big}: {fmt_rate(r.at(r.packed, big))}, {fmt_rate(r.at(targets.baseline, big))} "
            f"| {fmt_ratio(s_big)} {f'(≥ {goal:g}x): {verdict(s_big, goal)}' if goal else '(no target)'} "
            f"| {best} | {fmt_ratio(s_best)}{f': {verdict(s_best, goal)}' if goal else ''} "
            f"| {node_cell} |")
    lines += [
        "",
        "### Against float32, the TCBNN paper, memory, saturation",
        "",
        *paragraph(
            "TCBNN: \"Accelerating Binarized Neural Networks via Bit-Tensor-Cores in Turing GPUs\", Table VII (RTX "
            "2080 Ti, BTC-FMT): batch-8 latency and images/s at batch 1024 (MNIST, CIFAR-10) / 512 (ImageNet); "
            "packed / TCBNN compares at those batches (GPU runs). Memory: arguments (parameters, images) + outputs + "
            "temporaries of the compiled program at the large batch (`memory_analysis()`; parameters the executable "
            "holds as constants added), MiB. Saturation: the "
            f"smallest batch reaching {SATURATION:.0%} of the contender's best images/s in the sweep."),
        "",
        "| model | packed / f32: latency batch, large batch | TCBNN 2080 Ti: ms, images/s | packed speedup over "
        "TCBNN: latency, images/s | memory MiB: packed, bf16, f32 | saturates at: packed, bf16, f32 |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lat, big = r.plan.latency_batch, r.plan.large_batch
        paper = TCBNN_2080TI.get(r.name)
        vs_paper = "—"
        if paper and lat == 8 and big == plan_for(r.name, "gpu").large_batch:
            packed_ms = ratio(1e3 * lat, images_per_s(r.at(r.packed, lat)))
            vs_paper = (f"{fmt_ratio(ratio(paper[0], packed_ms))}, "
                        f"{fmt_ratio(ratio(images_per_s(r.at(r.packed, big)), paper[1]))}")
        paper_cell = f"{paper[0]:.3f}, {paper[1]:,.0f}" if paper else "— (not in the paper)"
        memory = ", ".join(fmt_mib(p.memory) if (p := r.at(c, big)) else "—" for c in (r.packed, BF16, F32))
        sat = ", ".join(saturation(r.points.get(c, {})) for c in (r.packed, BF16, F32))
        lines.append(f"| {r.name} | {fmt_ratio(r.speedup(F32, lat))}, {fmt_ratio(r.speedup(F32, big))} | {paper_cell} "
                     f"| {vs_paper} | {memory} | {sat} |")
    return lines


def model_lines(r: ModelResult, machine_kind: str, plots_dir: pathlib.Path) -> list[str]:
    names = [c.name for c in r.contenders]
    weights = ", ".join(f"{c.name} {c.weight_bytes / 2**20:,.1f}" for c in r.contenders)
    compiled = [(n, r.at(n, r.plan.large_batch)) for n in names]
    compile_big = ", ".join(f"{n} {p.compile_s:.1f} s" for n, p in compiled if p and p.compile_s)
    lines = [
        f"### {r.name}, {r.mode}",
        "",
        f"- parameters, MiB: {weights}; the packed model built and exported in {r.contenders[0].setup_s:.0f} s",
        f"- compile at batch {r.plan.large_batch}: {compile_big}",
        f"- plot: `{shown_path(plots_dir / plot_name(machine_kind, r.name))}`",
        "",
        "| batch | " + " | ".join(f"{n} images/s" for n in names) + " | packed / bf16 | packed / f32 |",
        "|---" * (len(names) + 3) + "|",
    ]
    for batch in r.plan.sweep:
        cells = [fmt_rate(r.at(n, batch)) for n in names]
        lines.append(f"| {batch} | " + " | ".join(cells) + f" | {fmt_ratio(r.speedup(BF16, batch))} "
                     f"| {fmt_ratio(r.speedup(F32, batch))} |")
    lines.append("")
    lines += node_lines(r)
    return lines


DEVICE_TIME_NOTE = ("On the GPU, times are the device time of each program per call (jax.profiler: its first kernel "
                    "start to its last end, the gaps between kernels included). ")


CPU_ROUNDS_NOTE = (f"On the CPU, each node and each call the fastest of {CPU_NODE_ROUNDS} timings, node and calls "
                   "alternating. ")


def node_lines(r: ModelResult) -> list[str]:
    if r.nodes is None:
        return []
    whole = r.at(r.packed, r.plan.large_batch)
    total = sum(row.seconds for row in r.nodes)
    whole_text = f"{whole.seconds * 1e3:.3f} ms" if whole and whole.seconds else "not measured"
    lines = [
        *paragraph(
            f"Per node at batch {r.plan.large_batch}: each node alone, jitted, as it runs in the forward (the "
            f"whole forward {whole_text}, the nodes' sum {total * 1e3:.3f} ms); each of its custom calls alone on the "
            "operands it received there; either, when shorter than "
            f"{NODE_PROGRAM_S * 1e3:g} ms, as a program of several calls on distinct copies of its inputs. "
            f"{DEVICE_TIME_NOTE if on_gpu() else CPU_ROUNDS_NOTE}"
            "Outside: the node's time less its calls', "
            "over its time (below 0: the calls alone took longer, timing noise). As in the forward "
            "(`runtime.run_node`), a node reads the previous node's output and, where that node's epilogue wrote "
            "them (the stem's, a fused residual block's), its input bits, and writes the next node's input bits "
            "where its own epilogue does; a run of dense nodes the forward fuses into one chain "
            "(`runtime.dense_chains_of`) is one row."),
        "",
        "| node | kind | wires | out shape | ms | share | custom calls (ms alone) | outside the bit kernels |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in r.nodes:
        calls = ", ".join(f"{t.removeprefix('jaxbnn_')} {s * 1e3:.3f}" for t, s in row.calls) or "none"
        shown = row.index if row.through is None else f"{row.index}-{row.through}"
        lines.append(f"| {shown} {row.node.get('name', '')} | {row.node['kind']} | {wires(row.node)} "
                     f"| {tuple(row.node.get('out_shape', ()))} | {row.seconds * 1e3:.3f} | {row.seconds / total:.0%} "
                     f"| {calls} | {row.outside:.0%} |")
    return lines


def wires(node: dict) -> str:
    if node["kind"] == "residual":
        return f"{node['conv1']['input']} -> {node['conv2']['output']}"
    return f"{node.get('input', 'stream')} -> {node['output']}"


def paragraph(text: str) -> list[str]:
    return textwrap.wrap(text, 110, break_on_hyphens=False)


def shown_path(path: pathlib.Path) -> str:
    """`path` relative to the repository where it lies inside it."""
    path = path.resolve()
    return str(path.relative_to(results_file.REPO_DIR)) if path.is_relative_to(results_file.REPO_DIR) else str(path)


def section(mode: str, results: list[ModelResult], header: list[str], targets: Targets, machine_kind: str,
            target: str, plots_dir: pathlib.Path) -> str:
    lines = [
        f"## Whole networks, {mode}: packed against the same architecture under XLA (`benchmarks/model_bench.py`)",
        "",
        *header,
        "",
        *paragraph(
            f"Zoo models with default (untrained) parameters in eval mode, random uint8 images. Packed: exported for "
            f"{target}, `jaxbnn.runtime`'s jitted forward as a call runs it (the parameters as constants of the "
            f"executable where they take at most {runtime.EMBEDDED_PARAMETERS_BYTES / 2**20:g} MiB). XLA bfloat16 / "
            "float32: the same architecture in network "
            "mode float (`float_forward`, its dots at HIGHEST precision: float32 is true float32), jitted. Time per "
            "forward of calls queued back to back (`gpu_bench.timed`"
            f"{'' if on_gpu() else f'; the fastest of {CPU_TIMING_ROUNDS} such timings, the contenders timed in turn'}),"
            " compile time excluded."),
        "",
        *summary_lines(results, targets),
        "",
    ]
    for r in results:
        lines += model_lines(r, machine_kind, plots_dir) + [""]
    return "\n".join(lines)


# --- sweep data and plots ------------------------------------------------------------------------------------

CSV_FIELDS = ("machine_kind", "machine", "model", "contender", "batch", "images_per_s", "ms_per_forward",
              "compile_s", "memory_bytes", "failure")


def csv_rows(result: ModelResult, machine_kind: str, machine: str) -> list[dict]:
    rows = []
    for contender, points in result.points.items():
        for batch, p in sorted(points.items()):
            rows.append(dict(machine_kind=machine_kind, machine=machine, model=result.name, contender=contender,
                             batch=batch, images_per_s=p.images_per_s or "", failure=p.failure or "",
                             ms_per_forward=p.seconds * 1e3 if p.seconds else "", compile_s=p.compile_s or "",
                             memory_bytes=p.memory if p.memory is not None else ""))
    return rows


def merge_csv(path: pathlib.Path, rows: list[dict]) -> None:
    """The CSV at `path` with `rows` replacing the rows of the same machine kind, model and contender."""
    keys = {(r["machine_kind"], r["model"], r["contender"]) for r in rows}
    old = []
    if path.exists():
        with path.open() as f:
            old = [r for r in csv.DictReader(f) if (r["machine_kind"], r["model"], r["contender"]) not in keys]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, CSV_FIELDS)
        writer.writeheader()
        writer.writerows(old + rows)
    os.replace(tmp, path)


def plot_name(machine_kind: str, model: str) -> str:
    return f"{machine_kind}-{model}.png"


def draw_plots(csv_path: pathlib.Path, plots_dir: pathlib.Path, models=None) -> list[pathlib.Path]:
    """One PNG per (machine kind, model) of the CSV: images/s against batch, log-log, every contender, and
    (for a GPU) TCBNN's RTX 2080 Ti figures as points."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plots. Draw them elsewhere with `python benchmarks/model_bench.py "
              f"--plot-from {csv_path}`", file=sys.stderr)
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with csv_path.open() as f:
        rows = [r for r in csv.DictReader(f) if r["images_per_s"] and (models is None or r["model"] in models)]
    plots_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for kind, model in sorted({(r["machine_kind"], r["model"]) for r in rows}):
        mine = [r for r in rows if (r["machine_kind"], r["model"]) == (kind, model)]
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        for contender in sorted({r["contender"] for r in mine}, key=lambda c: (not c.startswith("packed"), c)):
            line = sorted((int(r["batch"]), float(r["images_per_s"])) for r in mine if r["contender"] == contender)
            ax.plot(*zip(*line), marker="o", label=contender)
        if model in TCBNN_2080TI and not kind.startswith("cpu-"):  # a GPU's figures
            ms, rate = TCBNN_2080TI[model]
            large = plan_for(model, "gpu").large_batch
            ax.plot([8, large], [8 / ms * 1e3, rate], "k*", markersize=10, linestyle="none",
                    label="TCBNN, RTX 2080 Ti (paper)")
        ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="images / s",
               title=f"{model} on {mine[0]['machine']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = plots_dir / plot_name(kind, model)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written




# --- the run --------------------------------------------------------------------------------------------------


def run_model(name: str, modes, platform: str, args) -> list[ModelResult]:
    """All contenders of one model over its plan, then each packed mode's per-node table."""
    plan = plan_for(name, platform, args.quick, args.batches)
    print(f"{name}: batches {', '.join(map(str, plan.sweep))}", flush=True)
    target = "cpu" if platform == "cpu" else "sm90"
    packed = [packed_contender(name, mode, target) for mode in modes]
    floats = float_contenders(name)
    print(f"  built and exported: {', '.join(f'{c.name} {c.setup_s:.0f} s' for c in packed)}", flush=True)
    start = time.perf_counter()
    points = sweep(packed + floats, plan, args.seconds)
    print(f"  sweep: {time.perf_counter() - start:.0f} s", flush=True)
    results = []
    for mode, contender in zip(modes, packed):
        nodes = None
        if args.per_node:
            start = time.perf_counter()
            nodes = per_node(contender, random_images(plan.large_batch, contender.input_shape))
            print(f"  per node, {contender.name}, batch {plan.large_batch}: {time.perf_counter() - start:.0f} s",
                  flush=True)
        keep = [contender, *floats]
        results.append(ModelResult(name, mode, plan, keep, {c.name: points[c.name] for c in keep}, nodes))
    return results


def section_name(mode: str, models, quick: bool) -> str:
    """One section per run configuration: the mode, and the models where not all of them."""
    parts = ["model_bench.py", mode]
    if list(models) != list(MODEL_BUILDERS):
        parts += models
    if quick:
        parts.append("quick")
    return " ".join(parts)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODEL_BUILDERS), metavar="MODEL",
                        help=f"the models to run (default: all; --quick: mnist-mlp): {', '.join(MODEL_BUILDERS)}")
    parser.add_argument("--modes", nargs="+", choices=PACKED_MODES, default=["bnn"],
                        help="the packed models' network modes (default: bnn)")
    parser.add_argument("--batches", type=integer_at_least(1), nargs="+",
                        help="the sweep's batches (the latency and large batches are always measured)")
    parser.add_argument("--seconds", type=float,
                        help="per model, after the two required batches: the sweep's time for the others (default: "
                        "10 on a GPU, 60 on the CPU, 5 with --quick)")
    parser.add_argument("--no-per-node", dest="per_node", action="store_false", help="skip the per-node tables")
    parser.add_argument("--quick", action="store_true", help="a smoke test: batches 1, 4, 16, the MNIST MLP")
    parser.add_argument("--commit", default="", help="the commit the results name (default: the checkout's HEAD)")
    parser.add_argument("--out", help="the results file whose sections the run replaces (default: "
                        "benchmarks/results/<machine>.md; '-': print only, no CSV, no plots)")
    parser.add_argument("--plots", type=pathlib.Path, default=PLOTS_DIR,
                        help="where the PNGs go (default: docs/model_bench)")
    parser.add_argument("--no-plots", dest="draw", action="store_false", help="write the CSV only")
    parser.add_argument("--plot-from", type=pathlib.Path, metavar="CSV",
                        help="draw the plots of a CSV this script wrote, and do nothing else")
    args = parser.parse_args(argv)
    if args.models is None:
        args.models = ["mnist-mlp"] if args.quick else list(MODEL_BUILDERS)
    return args


def csv_path_for(out: pathlib.Path) -> pathlib.Path:
    return out.with_name(out.stem + "-model_bench.csv")


def main(argv=None):
    args = parse_args(argv)
    if args.plot_from:
        for path in draw_plots(args.plot_from, args.plots):
            print(f"wrote {path}")
        return
    device = jax.devices()[0]
    platform = "cpu" if device.platform == "cpu" else "gpu"
    if args.seconds is None:
        args.seconds = 5.0 if args.quick else {"gpu": 10.0, "cpu": 60.0}[platform]
    machine, machine_kind = results_file.device_machine(device), results_file.device_kind(device)
    header = results_file.run_header(machine, args.commit or results_file.git_commit(),
                                     driver=results_file.device_driver(device))
    render = functools.partial(section, header=header, targets=TARGETS[platform], machine_kind=machine_kind,
                               target="cpu" if platform == "cpu" else "sm90", plots_dir=args.plots)
    out = None if args.out == "-" else pathlib.Path(args.out or results_file.default_path(machine_kind))
    by_mode: dict[str, list[ModelResult]] = {mode: [] for mode in args.modes}
    start = time.perf_counter()
    for name in args.models:
        model_start = time.perf_counter()
        for result in run_model(name, args.modes, platform, args):
            by_mode[result.mode].append(result)
            if out:
                merge_csv(csv_path_for(out), csv_rows(result, machine_kind, machine))
        if out:  # after every model: a run cut short keeps what it measured
            for mode, results in by_mode.items():
                results_file.write_section(out, section_name(mode, args.models, args.quick), render(mode, results),
                                           machine)
        print(f"{name}: {time.perf_counter() - model_start:.0f} s", flush=True)
    for mode, results in by_mode.items():
        print()
        print(render(mode, results))
    if out:
        names = ", ".join(section_name(mode, args.models, args.quick) for mode in by_mode)
        print(f"written to {out} (sections {names}) and {csv_path_for(out)}")
        if args.draw:
            for path in draw_plots(csv_path_for(out), args.plots, set(args.models)):
                print(f"wrote {path}")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
