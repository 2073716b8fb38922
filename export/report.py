"""What an export achieved: size (packed vs float checkpoint) and fidelity (packed run vs the Flax model).

Fidelity compares, on the same images, the packed model's jitted run (`jaxbnn.runtime`) with the Flax
model's eval forward (`BinaryNet.trace`): class predictions, logits, and every intermediate the packed
graph carries. Both compute integers through the same thresholds, so every bit and every value of the
integer stream must be equal; the logits differ at most by the float32 rounding of the final affine.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxbnn import formats, packed_model
from jaxbnn.models import BinaryNet

__all__ = ["SizeRow", "size_report", "format_size_report", "NodeFidelity", "Fidelity", "fidelity_report"]

# --- size -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SizeRow:
    name: str
    kind: str
    domains: str  # "operand x weights -> output"
    float_bytes: int  # float32 checkpoint of the block: kernels, biases, thresholds, batch-norm state
    packed_bytes: int  # the node's tensors in the packed checkpoint
    float_weight_bytes: int  # float32 kernels alone
    packed_weight_bytes: int  # packed kernels alone (FSB tiles and popcounts, or the first layer's int8 values)


def _state_bytes(module, kernels_only: bool = False) -> int:
    total = 0
    for kind in (nnx.Param, nnx.BatchStat):
        for path, value in nnx.to_flat_state(nnx.state(module, kind)):
            if not kernels_only or path[-1] == "kernel":
                total += math.prod(value.shape) * np.dtype(value.dtype).itemsize
    return total


def _node_domains(node: dict) -> str:
    if node["kind"] == "residual":
        return f"{_node_domains(node['conv1'])}, {_node_domains(node['conv2'])}"
    if node["kind"] == "global_pool":
        return f"stream -> {node['output']}"
    return f"{node['operand']} x {node['weights']} -> {node['output']}"


def _block_out_channels(block):
    """The channels a block's layer writes (a residual block's conv1), None for a block without a layer."""
    for name in ("conv1", "conv", "linear"):
        layer = getattr(block, name, None)
        if layer is not None:
            return layer.out_features
    return None


def _check_pair(model: BinaryNet, graph: dict, what: str) -> None:
    """Refuse a Flax model and a packed graph that are not the same network: the graph's name, mode, input
    shape, classes, node count and every layer's channel count (a width) against the model's."""
    if not isinstance(model, BinaryNet):
        raise TypeError(f"{what} takes a jaxbnn BinaryNet as the model, got {type(model).__name__}")
    own = dict(name=model.name, mode=model.mode, input_shape=list(model.input_shape), num_classes=model.num_classes,
               nodes=len(model.blocks))
    recorded = dict(name=graph.get("name"), mode=graph.get("mode"), input_shape=list(graph.get("input_shape", [])),
                    num_classes=graph.get("num_classes"), nodes=len(graph.get("nodes", [])))
    differ = [f"{key} {recorded[key]!r} (the model's {own[key]!r})" for key in own if own[key] != recorded[key]]
    if not differ:
        for block, node in zip(model.blocks, graph["nodes"]):
            channels = node.get("conv1", node).get("out_channels")
            if channels is not None and channels != _block_out_channels(block):
                differ.append(f"{node['name']} writes {channels} channels (the model's {_block_out_channels(block)})")
                break
    if differ:
        raise ValueError(f"{what}: the packed model is not this model's export: its {', '.join(differ)}")


def size_report(model: BinaryNet, packed: packed_model.PackedModel) -> list[SizeRow]:
    """One row per block / graph node: float32 bytes against packed bytes."""
    if not isinstance(packed, packed_model.PackedModel):
        raise TypeError(f"size_report takes a PackedModel (export_model's or packed_model.load's), got "
                        f"{type(packed).__name__}")
    _check_pair(model, packed.graph, "size_report")
    rows = []
    for index, (block, node) in enumerate(zip(model.blocks, packed.graph["nodes"])):
        prefix = f"nodes.{index}."
        tensors = {k: v for k, v in packed.tensors.items() if k.startswith(prefix)}
        weights = {k: v for k, v in tensors.items() if k.split(".")[-1].startswith(("weight", "kernel"))}
        rows.append(SizeRow(node["name"], node["kind"], _node_domains(node), _state_bytes(block),
                            sum(v.nbytes for v in tensors.values()), _state_bytes(block, kernels_only=True),
                            sum(v.nbytes for v in weights.values())))
    return rows


def format_size_report(rows: list[SizeRow], file_bytes: int | None = None) -> str:
    """A table of `size_report` rows with totals and reduction factors."""
    header = ("node", "kind", "operand x weights -> output", "float32", "packed", "ratio")

    def kib(n):
        return f"{n / 1024:.1f} KiB"

    table = [header] + [(r.name, r.kind, r.domains, kib(r.float_bytes), kib(r.packed_bytes),
                         f"{r.float_bytes / max(r.packed_bytes, 1):.1f}x") for r in rows]
    float_total = sum(r.float_bytes for r in rows)
    packed_total = sum(r.packed_bytes for r in rows)
    table.append(("total", "", "", kib(float_total), kib(packed_total), f"{float_total / max(packed_total, 1):.1f}x"))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = []
    for i, row in enumerate(table):
        lines.append("  ".join(c.ljust(w) if j < 3 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0 or i == len(table) - 2:
            lines.append("-" * (sum(widths) + 2 * (len(widths) - 1)))
    binary = [r for r in rows if r.kind in ("dense", "conv", "residual") and not r.domains.startswith("image")]
    fw = sum(r.float_weight_bytes for r in binary)
    pw = sum(r.packed_weight_bytes for r in binary)
    if pw:
        lines.append(f"weights of the packed-input layers: {kib(fw)} float32 -> {kib(pw)} packed "
                     f"({fw / pw:.1f}x smaller)")
    if file_bytes is not None:
        lines.append(f"checkpoint file: {kib(file_bytes)} (float32 parameters: {kib(float_total)}, "
                     f"{float_total / file_bytes:.1f}x smaller)")
    return "\n".join(lines)


# --- fidelity ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class NodeFidelity:
    name: str
    kind: str  # "binary", "ternary", "stream" or "float" (what the node outputs)
    values: int  # number of bits (binary: one per value, ternary: two), stream integers or floats compared
    mismatches: int  # bits, stream integers or logits that differ from the Flax model
    max_abs_diff: float  # float outputs


@dataclasses.dataclass
class Fidelity:
    samples: int
    predictions_equal: int
    logits_max_abs_diff: float
    logits_max_rel_diff: float
    nodes: list[NodeFidelity]

    @property
    def bit_mismatches(self) -> int:
        """Intermediate values (bits, ternary values, stream integers) that differ."""
        return sum(n.mismatches for n in self.nodes if n.kind != "float")

    @property
    def logits_mismatches(self) -> int:
        """Logits that differ (equal infinities and NaNs count as equal)."""
        return sum(n.mismatches for n in self.nodes if n.kind == "float")

    @property
    def exact(self) -> bool:
        """Same predictions everywhere, every intermediate equal and every logit equal."""
        return (self.predictions_equal == self.samples and self.bit_mismatches == 0
                and self.logits_mismatches == 0)

    def summary(self) -> str:
        return (f"predictions equal on {self.predictions_equal}/{self.samples} samples; logits: "
                f"{self.logits_mismatches} differ, max |diff| {self.logits_max_abs_diff:.3g} (relative "
                f"{self.logits_max_rel_diff:.3g}); intermediate values: {self.bit_mismatches} differ")


_unpack_bits = jax.jit(formats.unpack_bits, static_argnums=1)


def _compare_quantized(name, packed, reference) -> NodeFidelity:
    """Packed bits (or the ternary plane pair) against the Flax model's quantized values."""
    reference = np.asarray(reference)
    channels = reference.shape[-1]
    planes = packed if isinstance(packed, tuple) else (packed,)
    bits = [np.asarray(_unpack_bits(jnp.asarray(words), channels)).reshape(reference.shape) for words in planes]
    # a binary bit is the sign; a ternary value is nonneg + pos - 1
    values = 2 * bits[0] - 1 if len(bits) == 1 else bits[0].astype(int) + bits[1] - 1
    kind = "binary" if len(bits) == 1 else "ternary"
    return NodeFidelity(name, kind, reference.size, int((values != reference).sum()), 0.0)


def _compare_stream(name, packed, reference) -> NodeFidelity:
    packed, reference = np.asarray(packed), np.asarray(reference)
    return NodeFidelity(name, "stream", int(reference.size), int((packed != reference).sum()), 0.0)


def fidelity_report(model: BinaryNet, net, images) -> Fidelity:
    """Compare the packed model `net` (a `jaxbnn.runtime.PackedNet`) with the Flax `model` (put in eval
    mode) on uint8 `images`: predictions, logits and every intermediate output of the packed graph."""
    from jaxbnn.runtime import PackedNet  # the runtime, and its native modules, loaded only to run one

    if not isinstance(net, PackedNet):
        raise TypeError(f"fidelity_report takes the packed model as a jaxbnn.runtime.PackedNet (runtime.load, or "
                        f"runtime.from_packed of a PackedModel), got {type(net).__name__}")
    _check_pair(model, net.graph, "fidelity_report")
    model.eval()
    images = np.asarray(images)
    trace = net.trace(images)
    graphdef, state = nnx.split(model)
    flax_trace = jax.jit(lambda s, x: nnx.merge(graphdef, s).trace(x))(state, images)
    nodes = []
    for node, out, ref in zip(net.graph["nodes"], trace[:-1], flax_trace[:-1]):
        if node["kind"] == "residual":
            nodes.append(_compare_quantized(f"{node['name']}.conv1", out[0], ref[0]))
            nodes.append(_compare_stream(node["name"], out[1], ref[1]))
        elif packed_model.node_output(node)[0] == "stream":
            nodes.append(_compare_stream(node["name"], out, ref))
        else:
            nodes.append(_compare_quantized(node["name"], out, ref))
    logits = np.asarray(flax_trace[-1])
    packed_logits = np.asarray(trace[-1])
    same = (packed_logits == logits) | (np.isnan(packed_logits) & np.isnan(logits))  # infinities, NaNs included
    with np.errstate(invalid="ignore"):
        diff = np.where(same, 0.0, np.abs(packed_logits - logits))
    diff = np.where(np.isnan(diff), np.inf, diff)  # a NaN against a number: as far apart as logits get
    with np.errstate(invalid="ignore"):  # relative to max(1, |logit|); an infinite difference stays infinite
        relative = np.where(np.isinf(diff), np.inf, diff / np.fmax(1.0, np.abs(logits)))
    nodes.append(NodeFidelity(net.graph["nodes"][-1]["name"], "float", int(logits.size), int((~same).sum()),
                              float(diff.max()) if diff.size else 0.0))
    return Fidelity(
        samples=len(logits),
        predictions_equal=int(np.sum(np.argmax(packed_logits, -1) == np.argmax(logits, -1))),
        logits_max_abs_diff=float(diff.max()) if diff.size else 0.0,
        logits_max_rel_diff=float(relative.max()) if diff.size else 0.0,
        nodes=nodes,
    )
