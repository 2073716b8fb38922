"""Per-layer parameter and memory summary of a BinaryNet (in the spirit of larq.models.summary).

Quantized parameters are the latent kernels of binary (1 bit each) and ternary (2 bits each) layers;
everything else (batch norm scale/bias/statistics, biases, learned thresholds, float kernels) counts as
float32. Packed bytes estimate a layer's part of the file from its own shape: its kernel as the exporter
stores it (the first layer's int8 weight values, which multiply the image levels; every other layer's FSB
tiles of 8 rows x 128 bits, ``formats.fsb_shape``, docs/formats.md, ternary weights as one matrix of twice
the rows; conv taps padded to whole 32-bit words) and, per batch-norm channel, the smallest fold: an int32
threshold and its flip byte. The file holds more: the weights' popcounts, two thresholds per channel for a
ternary reader, a float scale and bias for the classifier, and a dense layer after a conv reads the conv's
taps padded to whole words; the exact bytes of an exported model are ``jaxbnn.export.size_report``'s.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxbnn.formats import fsb_shape
from jaxbnn.layers import MODES, BinaryConv, BinaryLinear
from jaxbnn.models import BinaryNet

__all__ = ["LayerSummary", "model_summary", "format_summary", "print_summary"]

_BITS = {"binary": 1, "ternary": 2}


class LayerSummary(NamedTuple):
    name: str
    kind: str
    mode: str
    output_shape: tuple[int, ...]
    quantized_params: int
    float_params: int
    memory_bits: int
    packed_bytes: int


def _packed_kernel_bytes(layer, planes: int) -> int:
    if MODES[layer.mode][0] == "float":  # the image operand: one int8 per weight
        return math.prod(layer.kernel.shape)
    if isinstance(layer, BinaryConv):
        kh, kw = layer.kernel_size
        k_bits = kh * kw * (-(-layer.in_features // 32) * 32)
    else:
        k_bits = layer.in_features
    return 4 * math.prod(fsb_shape(planes * layer.out_features, k_bits))  # ternary: one matrix of 2N rows


def _count(module) -> tuple[int, int, int]:
    """(quantized params, float params, packed bytes) of all layers under module."""
    quantized = floats = packed = 0
    for _, sub in nnx.iter_modules(module):
        if isinstance(sub, (BinaryLinear, BinaryConv)):
            weight_domain = MODES[sub.mode][1]
            n = math.prod(sub.kernel.shape)
            if weight_domain == "float":
                floats += n
            else:
                quantized += n
                packed += _packed_kernel_bytes(sub, _BITS[weight_domain])
            others = [v for path, v in nnx.to_flat_state(nnx.state(sub, nnx.Param)) if path != ("kernel",)]
            floats += sum(math.prod(v.shape) for v in others)
        elif isinstance(sub, nnx.BatchNorm):
            floats += sum(math.prod(v.shape) for _, v in nnx.to_flat_state(nnx.state(sub)))
            packed += 5 * sub.num_features  # folded at least into an int32 threshold and a flip byte per channel
    return quantized, floats, packed


def _bits_per_quantized(module) -> int:
    for _, sub in nnx.iter_modules(module):
        if isinstance(sub, (BinaryLinear, BinaryConv)):
            return _BITS.get(MODES[sub.mode][1], 32)
    return 0


def model_summary(model: BinaryNet, batch_size: int = 1) -> list[LayerSummary]:
    """One row per block, output shapes traced abstractly (no computation)."""
    if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, (bool, np.bool_)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    rows = []
    shape = jax.ShapeDtypeStruct((int(batch_size), *model.input_shape), jnp.float32)
    for index, block in enumerate(model.blocks):
        # Traced on a merged copy, so batch statistics of the real block are never touched.
        graphdef, state = nnx.split(block)
        shape = jax.eval_shape(lambda s, x, g=graphdef: nnx.merge(g, s)(x), state, shape)
        quantized, floats, packed = _count(block)
        kind = type(block).__name__
        mode = ""
        for _, sub in nnx.iter_modules(block):
            if isinstance(sub, (BinaryLinear, BinaryConv)):
                mode = sub.mode
                break
        bits = quantized * _bits_per_quantized(block) + 32 * floats
        rows.append(LayerSummary(f"blocks.{index}", kind, mode, tuple(shape.shape), quantized, floats, bits, packed))
    return rows


def format_summary(model: BinaryNet, batch_size: int = 1) -> str:
    rows = model_summary(model, batch_size)
    header = ("layer", "type", "mode", "output", "quantized", "float", "memory (bits)", "packed (KiB)")
    table = [header] + [
        (r.name, r.kind, r.mode, str(r.output_shape), f"{r.quantized_params:,}", f"{r.float_params:,}",
         f"{r.memory_bits:,}", f"{r.packed_bytes / 1024:.1f}")
        for r in rows
    ]
    quantized = sum(r.quantized_params for r in rows)
    floats = sum(r.float_params for r in rows)
    bits = sum(r.memory_bits for r in rows)
    packed = sum(r.packed_bytes for r in rows)
    table.append(("total", "", "", "", f"{quantized:,}", f"{floats:,}", f"{bits:,}", f"{packed / 1024:.1f}"))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [f"{model.name} ({model.mode}), input {model.input_shape}, {model.num_classes} classes"]
    for i, row in enumerate(table):
        lines.append("  ".join(cell.ljust(w) if j < 3 else cell.rjust(w) for j, (cell, w) in enumerate(zip(row, widths))))
        if i == 0 or i == len(table) - 2:
            lines.append("-" * (sum(widths) + 2 * (len(widths) - 1)))
    float_bits = 32 * (quantized + floats)
    lines.append(f"memory: {bits / 8 / 2**20:.2f} MiB quantized vs {float_bits / 8 / 2**20:.2f} MiB in float32 "
                 f"({float_bits / max(bits, 1):.1f}x smaller)")
    return "\n".join(lines)


def print_summary(model: BinaryNet, batch_size: int = 1) -> None:
    print(format_summary(model, batch_size))
