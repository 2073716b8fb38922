"""What an export achieved: size (packed vs float checkpoint) and fidelity (packed run vs the Flax model).

Fidelity compares, on the same images, the packed model's jitted run (`jaxbnn.runtime`) with the Flax
model in eval mode: class predictions, logits, and every intermediate the packed graph carries. Bits must
equal ``sign(bn(x))`` (or the ternary quantizer of the next layer) computed in float by the Flax model;
a differing bit whose float value lies within rounding of its threshold is a *tie* (a float op whose
rounding may legitimately differ between two compilations), any other is a failure.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxbnn import formats, packed_model
from jaxbnn.layers import MODES
from jaxbnn.models import BinaryNet, ConvBlock, DenseBlock, ResidualBlock

__all__ = ["SizeRow", "size_report", "format_size_report", "NodeFidelity", "Fidelity", "fidelity_report"]

# A bit differs "at a tie" when its float value is this close (relative to max(1, |threshold|)) to the
# threshold: a few float32 ulps of the values batch norm produces.
TIE_TOLERANCE = 2.0**-16


# --- size -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SizeRow:
    name: str
    kind: str
    domains: str  # "operand x weights -> output"
    float_bytes: int  # float32 checkpoint of the block: kernels, biases, thresholds, batch-norm state
    packed_bytes: int  # the node's tensors in the packed checkpoint
    float_weight_bytes: int  # float32 kernels alone
    packed_weight_bytes: int  # packed kernels alone (FSB tiles and popcounts, or int8 first-layer values)


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
    if node["kind"] == "global_avg_pool":
        return "float -> float"
    return f"{node['operand']} x {node['weights']} -> {node['output']}"


def size_report(model: BinaryNet, packed: packed_model.PackedModel) -> list[SizeRow]:
    """One row per block / graph node: float32 bytes against packed bytes."""
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
    binary = [r for r in rows if r.kind in ("dense", "conv", "residual") and not r.domains.startswith("float")]
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
    kind: str  # "binary", "ternary" or "float" (what the node outputs)
    values: int  # number of bits (binary: one per value, ternary: two) or floats compared
    mismatches: int  # bits that differ from the Flax model (binary / ternary)
    ties: int  # of which within rounding of the threshold
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
        return sum(n.mismatches for n in self.nodes)

    @property
    def ties(self) -> int:
        return sum(n.ties for n in self.nodes)

    @property
    def exact(self) -> bool:
        """Same predictions everywhere and no differing bit other than ties."""
        return self.predictions_equal == self.samples and self.bit_mismatches == self.ties

    def summary(self) -> str:
        return (f"predictions equal on {self.predictions_equal}/{self.samples} samples; logits max |diff| "
                f"{self.logits_max_abs_diff:.3g} (relative {self.logits_max_rel_diff:.3g}); intermediate bits: "
                f"{self.bit_mismatches} differ, {self.ties} of them at ties")


def _apply(module, x):
    graphdef, state = nnx.split(module)
    return jax.jit(lambda s, v: nnx.merge(graphdef, s)(v))(state, x)


_unpack_bits = jax.jit(formats.unpack_bits, static_argnums=1)


def _reader_layer(block):
    return block.conv if isinstance(block, ConvBlock) else block.linear if isinstance(block, DenseBlock) else None


def _compare_bits(name, packed, reference, reader) -> NodeFidelity:
    """Packed output bits (or ternary planes) against the reader layer's quantizer applied to `reference`."""
    reference = np.asarray(reference)
    channels = reference.shape[-1]
    if MODES[reader.mode][0] == "binary":
        planes = [(packed, reference >= 0, np.abs(reference))]
    else:
        # One threshold for all, per channel (broadcast along the last axis) or per feature (reshaped).
        alpha, beta = (np.asarray(v, np.float32).reshape(-1) for v in reader.input_thresholds())
        alpha, beta = (v if v.size in (1, channels) else v.reshape(reference.shape[1:]) for v in (alpha, beta))
        scale = np.maximum(1.0, np.maximum(np.abs(alpha), np.abs(beta)))
        planes = [(packed[0], reference >= beta, np.abs(reference - beta) / scale),
                  (packed[1], reference > alpha, np.abs(reference - alpha) / scale)]
    mismatches = ties = 0
    for words, expected, distance in planes:
        got = np.asarray(_unpack_bits(jnp.asarray(words), channels)).reshape(expected.shape)
        differ = got != expected
        mismatches += int(differ.sum())
        ties += int((differ & (distance <= TIE_TOLERANCE)).sum())
    kind = "binary" if len(planes) == 1 else "ternary"
    return NodeFidelity(name, kind, reference.size * len(planes), mismatches, ties, 0.0)


def _compare_floats(name, packed, reference) -> NodeFidelity:
    diff = float(np.max(np.abs(np.asarray(packed) - np.asarray(reference)))) if np.size(reference) else 0.0
    return NodeFidelity(name, "float", int(np.size(reference)), 0, 0, diff)


def fidelity_report(model: BinaryNet, net, images) -> Fidelity:
    """Compare the packed model `net` (a `jaxbnn.runtime.PackedNet`) with the Flax `model` (put in eval
    mode) on `images`: predictions, logits and every intermediate output of the packed graph."""
    model.eval()
    images = jnp.asarray(images, jnp.float32)
    trace = net.trace(images)
    blocks = list(model.blocks)
    nodes = []
    x = images
    for index, (block, node, out) in enumerate(zip(blocks, net.graph["nodes"], trace)):
        reader = _reader_layer(blocks[index + 1]) if index + 1 < len(blocks) else None
        if isinstance(block, ResidualBlock):
            inner = _apply(_Inner(block), x)
            nodes.append(_compare_bits(f"{node['name']}.conv1", out[0], inner, block.conv2))
            x = _apply(block, x)
            nodes.append(_compare_floats(node["name"], out[1], x))
            continue
        x = _apply(block, x)
        if node["kind"] in ("dense", "conv") and node["output"] in ("binary", "ternary"):
            nodes.append(_compare_bits(node["name"], out, x, reader))
        else:
            nodes.append(_compare_floats(node["name"], out, x))
    logits = np.asarray(x)
    packed_logits = np.asarray(trace[-1])
    diff = np.abs(packed_logits - logits)
    return Fidelity(
        samples=len(logits),
        predictions_equal=int(np.sum(np.argmax(packed_logits, -1) == np.argmax(logits, -1))),
        logits_max_abs_diff=float(diff.max()) if diff.size else 0.0,
        logits_max_rel_diff=float((diff / np.maximum(1.0, np.abs(logits))).max()) if diff.size else 0.0,
        nodes=nodes,
    )


class _Inner(nnx.Module):
    """bn1(conv1(x)) of a residual block: what its conv2 quantizes."""

    def __init__(self, block: ResidualBlock):
        self.block = block

    def __call__(self, x):
        return self.block.bn1(self.block.conv1(x))
