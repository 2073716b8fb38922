"""Walk a trained BinaryNet and build its packed inference graph (TCBNN section 6.1 order).

Each block becomes a node of `jaxbnn.packed_model`'s graph. What a node outputs depends on who reads it:

- the next block's binary / ternary layer: bits. bn + that layer's quantizer fold into integer thresholds
  (`folding`), max-pool moves after them (OR / AND on the bits, done by the op on the dot products);
- a residual block or global pooling (the real-valued stream): float, the bn computed in the model's order;
- nobody (the classifier): float logits through the affine epilogue (alpha and bn folded into scale/bias).

Weights are quantized with the layer's own quantizer and written as the ops take them: the first layer's
(float operand) as int8 values in its kernel layout, every other layer's as FSB tiles of the target's tile
with their popcounts, ternary weights as their two ±1 planes (nonneg, pos) stacked along the output axis.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx

from jaxbnn import formats, packed_model
from jaxbnn.layers import MODES, BinaryConv, BinaryLinear
from jaxbnn.models import BinaryNet, ConvBlock, DenseBlock, GlobalAvgPool, ResidualBlock

from .folding import BnChain, float_thresholds, integer_thresholds

__all__ = ["ExportError", "export_model", "bn_chain"]


# Packing runs once per layer: one compiled function each instead of a compile per eager op.
_pack_conv_weights = jax.jit(formats.pack_conv_weights, static_argnames="tile")
_pack_dense_weights = jax.jit(formats.pack_dense_weights, static_argnames="tile")


class ExportError(ValueError):
    """A model (or layer setting) the packed format cannot represent exactly."""


def bn_chain(layer: BinaryLinear | BinaryConv, bn: nnx.BatchNorm) -> BnChain:
    """The float path dot -> (alpha, bias) -> bn of one layer and the batch norm after it."""
    if bn.axis not in (-1, (-1,)):
        raise ExportError(f"batch norm over axis {bn.axis} (only the channel axis is supported)")
    alpha = layer.kernel_scale()
    return BnChain(
        mean=np.asarray(bn.mean[...], np.float32),
        var=np.asarray(bn.var[...], np.float32),
        epsilon=float(bn.epsilon),
        gamma=None if bn.scale is None else np.asarray(bn.scale[...], np.float32),
        beta=None if bn.bias is None else np.asarray(bn.bias[...], np.float32),
        alpha=None if alpha is None else np.asarray(alpha, np.float32),
        bias=None if layer.bias is None else np.asarray(layer.bias[...], np.float32),
    )


def _layer_domains(layer) -> tuple[str, str]:
    operand, weights = MODES[layer.mode]
    if weights == "float":
        raise ExportError(f"layer in mode {layer.mode!r} has float weights: nothing to pack (export a "
                          "bnn, tnn, tbn or btn model)")
    if layer.input_scaling:
        raise ExportError("XNOR-Net input scaling (K) needs the float activations at every layer; "
                          "it cannot run on packed activations")
    if operand == "float" and layer.input_quantizer is not None:
        raise ExportError(f"float-activation layer with input quantizer {layer.input_quantizer!r}")
    return operand, weights


def _reader(block) -> tuple[str, object]:
    """How the block after a layer reads its output: ("binary" | "ternary", layer) or ("float", None)."""
    layer = {ConvBlock: "conv", DenseBlock: "linear"}.get(type(block))
    if layer is None:
        return "float", None
    return _layer_reader(getattr(block, layer))


def _layer_reader(layer) -> tuple[str, object]:
    operand, _ = _layer_domains(layer)
    if operand == "float":
        raise ExportError(f"a {layer.mode} layer after the first one reads float activations: only the "
                          "first layer may (the packed graph is binary between layers)")
    return operand, layer


def _input_levels(layer, shape) -> tuple[np.ndarray, np.ndarray]:
    """The ternary input quantizer of `layer` as the two float thresholds of its planes, broadcast to
    (C,) or the full per-sample `shape`: nonneg = x >= beta, pos = x > alpha = x >= next float after alpha."""
    alpha, beta = (np.asarray(v, np.float32).reshape(-1) for v in layer.input_thresholds())
    shape = tuple(shape)

    def spread(values):  # a scalar or one value per channel -> (C,); one per feature -> the full shape
        if values.size in (1, shape[-1]):
            return np.broadcast_to(values, shape[-1:]).copy()
        if values.size == math.prod(shape):
            return values.reshape(shape)
        raise ExportError(f"{values.size} ternary input thresholds do not fit an input of shape {shape}")

    alpha, beta = spread(alpha), spread(beta)
    if alpha.shape != beta.shape:
        alpha, beta = np.broadcast_arrays(alpha, beta)
    return beta, np.nextafter(alpha, np.float32(np.inf))


def _weight_tensors(name, layer, node: dict, tile) -> dict[str, np.ndarray]:
    """The node's weights as its op takes them (docs/export.md): int8 values for a float operand, else the
    FSB-tiled ±1 matrix (ternary weights as their nonneg and pos planes) and its row or per-tap popcounts."""
    w = np.asarray(layer.quantized_kernel(), np.float32)
    allowed = (-1.0, 1.0) if node["weights"] == "binary" else (-1.0, 0.0, 1.0)
    if not np.isin(w, allowed).all():
        raise ExportError(f"{name}: the kernel quantizer {layer.kernel_quantizer!r} gives values other than "
                          f"{allowed}: {np.unique(w[~np.isin(w, allowed)])[:5].tolist()}")
    if node["operand"] == "float":
        return {"kernel": w.astype(np.int8)}
    if node["weights"] == "ternary":
        w = np.asarray(formats.ternary_weight_signs(w))
    if packed_model.uses_conv_layout(node):
        _, _, (kh, kw), c = packed_model.weight_geometry(node)
        packed = _pack_conv_weights(w.reshape(kh, kw, c, w.shape[-1]), tile=tile)  # a dense kernel over (H, W, C)
        return {"weight": np.asarray(packed.bits), "weight_tap_popcount": np.asarray(packed.tap_popcount)}
    packed = _pack_dense_weights(w.reshape(-1, w.shape[-1]), tile=tile)
    return {"weight": np.asarray(packed.bits), "weight_popcount": np.asarray(packed.popcount)}


def _linear_node(name, layer, bn, pool, in_shape, wire, reader, tile, last):
    """The node (attributes, tensors) of one binary layer followed by its batch norm."""
    operand, weights = _layer_domains(layer)
    if wire != "float" and wire != operand:
        raise ExportError(f"{name}: a {operand} layer cannot read the {wire} output of the previous layer")
    kind = "conv" if isinstance(layer, BinaryConv) else "dense"
    node = {"name": name, "kind": kind, "input": wire, "operand": operand, "weights": weights,
            "in_shape": list(in_shape), "out_channels": int(layer.out_features)}
    if kind == "conv":
        h, w, _ = in_shape
        padding = layer.explicit_padding(h, w)
        node.update(kernel_size=list(layer.kernel_size), stride=list(layer.strides),
                    padding=[list(p) for p in padding], pad_value=layer.padding_value,
                    pool=None if pool is None else list(pool))
        node["out_shape"] = [*packed_model.conv_output_hw(node), node["out_channels"]]
    else:
        if math.prod(in_shape) != layer.in_features:
            raise ExportError(f"{name}: {layer.in_features} input features, but the input is {list(in_shape)}")
        if operand != "float" and len(in_shape) not in (1, 3):
            raise ExportError(f"{name}: a packed input of shape {list(in_shape)} (not [K] or [H, W, C])")
        node["out_shape"] = [node["out_channels"]]
    tensors = _weight_tensors(name, layer, node, tile)

    if wire == "float" and operand == "ternary":
        nonneg, pos = _input_levels(layer, in_shape)
        node["input_level_shape"] = list(nonneg.shape)
        tensors.update(input_threshold_nonneg=nonneg, input_threshold_pos=pos)

    chain = bn_chain(layer, bn)
    reach = _dot_range(node)
    fold = (lambda level, strict: float_thresholds(chain, level, strict)) if operand == "float" else (
        lambda level, strict: integer_thresholds(chain, reach, level, strict))
    reader_domain, reader_layer = reader
    if last:
        node["output"] = "affine"
        mul = chain.multiplier().astype(np.float64)
        alpha = 1.0 if chain.alpha is None else chain.alpha.astype(np.float64)
        bias = 0.0 if chain.bias is None else chain.bias.astype(np.float64)
        beta = 0.0 if chain.beta is None else chain.beta.astype(np.float64)
        tensors["scale"] = np.broadcast_to(alpha * mul, mul.shape).astype(np.float32)
        tensors["bias"] = ((bias - chain.mean) * mul + beta).astype(np.float32)
    elif reader_domain == "binary":
        node["output"] = "binary"
        tensors["threshold"], tensors["flip"] = fold(0.0, False)
    elif reader_domain == "ternary":
        node["output"] = "ternary"
        nonneg, pos = _input_levels(reader_layer, node["out_shape"])
        tensors["threshold_nonneg"], tensors["flip_nonneg"] = fold(nonneg, False)
        tensors["threshold_pos"], tensors["flip_pos"] = fold(pos, False)
        node["level_shape"] = list(tensors["threshold_nonneg"].shape)
    else:
        node.update(output="float", kernel_scale=chain.alpha is not None, bias=chain.bias is not None)
        tensors.update(bn_mean=chain.mean, bn_mul=chain.multiplier(),
                       bn_bias=np.zeros_like(chain.mean) if chain.beta is None else chain.beta)
        if chain.alpha is not None:
            tensors["kernel_scale"] = chain.alpha
        if chain.bias is not None:
            tensors["bias"] = chain.bias
    return node, tensors


def _dot_range(node: dict) -> int:
    """Largest |dot| the layer's ±1 / ternary dot product can reach: its number of real reduction elements."""
    if node["kind"] == "conv":
        kh, kw = node["kernel_size"]
        return kh * kw * node["in_shape"][-1]
    return math.prod(node["in_shape"])


def export_model(model: BinaryNet, target: str = "cpu",
                 input_range=packed_model.TRAINING_INPUT_RANGE) -> packed_model.PackedModel:
    """The packed inference graph of a BinaryNet (its eval-mode function) for `target`.

    `input_range` (low, high) is the float range the model was trained on, uint8 pixels p mapped to
    low + p * (high - low) / 255: by default jaxbnn.train's [-1, 1]. The file records it; the runtime
    converts uint8 images with it and warns about float images outside it."""
    if target not in packed_model.TARGETS:
        raise ExportError(f"unknown target {target!r}; known: {sorted(packed_model.TARGETS)}")
    if not isinstance(model, BinaryNet):
        raise ExportError(f"export takes a jaxbnn BinaryNet, got {type(model).__name__}")
    tile = packed_model.TARGETS[target]
    blocks = list(model.blocks)
    nodes, tensors = [], {}
    wire, shape = "float", list(model.input_shape)
    for index, block in enumerate(blocks):
        name = f"blocks.{index}"
        prefix = f"nodes.{index}."
        last = index == len(blocks) - 1
        reader = _reader(blocks[index + 1]) if not last else ("float", None)
        if isinstance(block, (ConvBlock, DenseBlock)):
            layer = block.conv if isinstance(block, ConvBlock) else block.linear
            pool = block.pool if isinstance(block, ConvBlock) else None
            node, node_tensors = _linear_node(name, layer, block.bn, pool, shape, wire, reader, tile, last)
        elif isinstance(block, ResidualBlock):
            if wire != "float" or last:
                raise ExportError(f"{name}: a residual block must read the float stream and not be last")
            conv1, t1 = _linear_node(f"{name}.conv1", block.conv1, block.bn1, None, shape, "float",
                                     _layer_reader(block.conv2), tile, False)
            conv2, t2 = _linear_node(f"{name}.conv2", block.conv2, block.bn2, None, conv1["out_shape"],
                                     conv1["output"], ("float", None), tile, False)
            node = {"name": name, "kind": "residual", "in_shape": list(shape), "out_shape": conv2["out_shape"],
                    "shortcut_stride": int(block.shortcut_stride), "conv1": conv1, "conv2": conv2}
            node_tensors = {**{f"conv1.{k}": v for k, v in t1.items()}, **{f"conv2.{k}": v for k, v in t2.items()}}
        elif isinstance(block, GlobalAvgPool):
            if wire != "float" or len(shape) != 3:
                raise ExportError(f"{name}: global pooling needs the float image stream, got {wire} {shape}")
            node = {"name": name, "kind": "global_avg_pool", "in_shape": list(shape), "out_shape": shape[-1:]}
            node_tensors = {}
        else:
            raise ExportError(f"{name}: block type {type(block).__name__} is not exportable")
        nodes.append(node)
        tensors.update({prefix + k: np.asarray(v) for k, v in node_tensors.items()})
        wire = "float" if node["kind"] != "dense" and node["kind"] != "conv" else (
            node["output"] if node["output"] in ("binary", "ternary") else "float")
        shape = list(node["out_shape"])
    graph = {"name": model.name, "mode": model.mode, "input_shape": list(model.input_shape),
             "input_range": [float(v) for v in input_range], "num_classes": int(model.num_classes),
             "nodes": nodes}
    packed = packed_model.PackedModel(graph=graph, tensors=tensors, target=target)
    try:
        packed_model.validate_graph(graph)
    except packed_model.PackedModelError as error:
        raise ExportError(str(error)) from None
    return packed
