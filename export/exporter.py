"""Walk a trained BinaryNet and build its packed inference graph (TCBNN section 6.1 order).

Each block becomes a node of `jaxbnn.packed_model`'s graph; between the image and the logits every value
on the wire is an integer (docs/export.md):

- the image: int8 levels of the pixels; the first layer multiplies them with its ±1 / ternary weights;
- bits: a batch norm and the quantizer of the layer that reads it become integer thresholds
  (`jaxbnn.thresholds`, the rule the Flax eval forward uses), max-pool moves after them (OR / AND on the
  bits, done by the op on the dot products);
- the integer residual stream (int32) of a ResNet: its stem's output divided by 2**shift, each block's
  conv2 output added to the shortcut; its readers (a block's conv1, the global pool) hold the thresholds;
- the logits: the classifier's affine epilogue (alpha and bn folded into scale / bias), the only floats.

Weights are quantized with the layer's own quantizer and written as the ops take them: the first layer's
as int8 values in its kernel layout, every other layer's as FSB tiles of the target's tile with their
popcounts, ternary weights as their two ±1 planes (nonneg, pos) stacked along the output axis.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx

from jaxbnn import formats, packed_model
from jaxbnn.layers import MODES, BinaryConv, BinaryLinear, chain_parameters, ternary_levels
from jaxbnn.models import (BinaryNet, ConvBlock, DenseBlock, GlobalPool, ResidualBlock, StreamStem,
                           reader_layer)
from jaxbnn.thresholds import BnChain, classifier_affine, integer_thresholds, ternary_levels_cross

__all__ = ["ExportError", "export_model", "bn_chain"]


# Packing runs once per layer: one compiled function each instead of a compile per eager op.
_pack_conv_weights = jax.jit(formats.pack_conv_weights, static_argnames="tile")
_pack_dense_weights = jax.jit(formats.pack_dense_weights, static_argnames="tile")


class ExportError(ValueError):
    """A model (or layer setting) the packed format cannot represent exactly."""


def bn_chain(bn: nnx.BatchNorm, layer: BinaryLinear | BinaryConv | None = None) -> BnChain:
    """The path integer -> (`layer`'s XNOR alpha, bias) -> `bn`, as `jaxbnn.thresholds` folds it."""
    try:
        mean, var, gamma, beta, alpha, bias = (None if v is None else np.asarray(v, np.float32)
                                               for v in chain_parameters(bn, layer))
    except ValueError as error:
        raise ExportError(str(error)) from None
    return BnChain(mean, var, float(bn.epsilon), gamma, beta, alpha, bias)


def _layer_domains(name: str, layer, first: bool) -> tuple[str, str]:
    operand, weights = MODES[layer.mode]
    if weights == "float":
        raise ExportError(f"{name}: layer in mode {layer.mode!r} has float weights: nothing to pack (export a "
                          "bnn, tnn, tbn or btn model)")
    if layer.input_scaling:
        raise ExportError(f"{name}: XNOR-Net input scaling (K) needs the float activations at every layer; "
                          "it cannot run on packed activations")
    if first:
        if operand != "float" or layer.input_quantizer is not None:
            raise ExportError(f"{name}: the first layer reads the image levels: mode bwn or twn without an input "
                              f"quantizer, got {layer.mode!r} with {layer.input_quantizer!r}")
        return "image", weights
    if operand == "float":
        raise ExportError(f"{name}: a {layer.mode} layer after the first one reads float activations: only the "
                          "first layer may (the packed graph is integer between layers)")
    return operand, weights


def _quantizer_thresholds(chain: BnChain, reader, sample_shape, prefix: str = "") -> tuple[dict, dict]:
    """(attributes, tensors) of `reader`'s quantizer applied to `chain`'s output: one threshold per channel
    (binary), or per plane at the ternary levels (pos: v > alpha; nonneg: v >= beta, or pos's comparison where
    `ternary_levels_cross`)."""
    operand, _ = MODES[reader.mode]  # binary or ternary (export_model checks every layer's modes first)
    if operand == "binary":
        threshold, flip = integer_thresholds(chain, 0.0, False)
        return {}, {f"{prefix}threshold": threshold, f"{prefix}flip": flip}
    try:
        alpha, beta = (np.asarray(ternary_levels(v, tuple(sample_shape))) for v in reader.input_thresholds())
    except ValueError as error:
        raise ExportError(str(error)) from None
    tensors = {}
    for plane, level, strict in (("nonneg", beta, False), ("pos", alpha, True)):
        tensors[f"{prefix}threshold_{plane}"], tensors[f"{prefix}flip_{plane}"] = integer_thresholds(chain, level, strict)
    crossed = ternary_levels_cross(alpha, beta)
    for kind in ("threshold", "flip"):
        nonneg, pos = tensors[f"{prefix}{kind}_nonneg"], tensors[f"{prefix}{kind}_pos"]
        tensors[f"{prefix}{kind}_nonneg"] = np.where(crossed, pos, nonneg).astype(nonneg.dtype)
    return {f"{prefix}level_shape": list(tensors[f"{prefix}threshold_nonneg"].shape)}, tensors


def _weight_tensors(name, layer, node: dict, tile) -> dict[str, np.ndarray]:
    """The node's weights as its op takes them (docs/export.md): int8 values for the image operand, else the
    FSB-tiled ±1 matrix (ternary weights as their nonneg and pos planes) and its row or per-tap popcounts."""
    w = np.asarray(layer.quantized_kernel(), np.float32)
    allowed = (-1.0, 1.0) if node["weights"] == "binary" else (-1.0, 0.0, 1.0)
    if not np.isin(w, allowed).all():
        raise ExportError(f"{name}: the kernel quantizer {layer.kernel_quantizer!r} gives values other than "
                          f"{allowed}: {np.unique(w[~np.isin(w, allowed)])[:5].tolist()}")
    if node["operand"] == "image":
        return {"kernel": w.astype(np.int8)}
    if node["weights"] == "ternary":
        w = np.asarray(formats.ternary_weight_signs(w))
    if packed_model.uses_conv_layout(node):
        _, _, (kh, kw), c = packed_model.weight_geometry(node)
        packed = _pack_conv_weights(w.reshape(kh, kw, c, w.shape[-1]), tile=tile)  # a dense kernel over (H, W, C)
        return {"weight": np.asarray(packed.bits), "weight_tap_popcount": np.asarray(packed.tap_popcount)}
    packed = _pack_dense_weights(w.reshape(-1, w.shape[-1]), tile=tile)
    return {"weight": np.asarray(packed.bits), "weight_popcount": np.asarray(packed.popcount)}


def _linear_node(name, layer, in_shape, wire, tile, *, first=False, pool=None):
    """The node (attributes, tensors) of one layer, its output not yet decided."""
    operand, weights = _layer_domains(name, layer, first)
    if wire not in ("image", "stream") and wire != operand:
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
        if operand != "image" and len(in_shape) not in (1, 3):
            raise ExportError(f"{name}: a packed input of shape {list(in_shape)} (not [K] or [H, W, C])")
        node["out_shape"] = [node["out_channels"]]
    return node, _weight_tensors(name, layer, node, tile)


def _check_affine(name, chain: BnChain, scale, bias) -> None:
    """Refuse a classifier whose folded `scale * dot + bias` (the eval forward's and the packed model's
    logits) does not stand for its batch norm: a channel whose scale or bias is infinite in float32
    (gamma / sqrt(var + eps) overflows, or a parameter is infinite: the batch norm gives +-inf by the sign of
    its input, the folded form inf - inf = NaN), or whose var + eps is subnormal in float32 (the batch norm of
    the training and float forwards then depends on the platform: XLA's CPU flushes it to 0, its GPU does
    not). NaN parameters give NaN logits either way."""
    variance = chain.var.astype(np.float32) + np.float32(chain.epsilon)
    subnormal = (variance != 0) & (np.abs(variance) < np.finfo(np.float32).tiny)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        multiplier = np.float32(1) / np.sqrt(variance)  # in float32, as the model's batch norm computes it
        if chain.gamma is not None:
            multiplier = multiplier * chain.gamma.astype(np.float32)
    infinite = np.isinf(scale) | np.isinf(bias) | np.isinf(multiplier)
    bad = np.flatnonzero(np.broadcast_to(subnormal, infinite.shape) | infinite)
    if bad.size:
        raise ExportError(f"{name}: the classifier's batch norm on channel(s) {bad[:8].tolist()} folds to an "
                          "infinite scale or bias in float32 (gamma / sqrt(var + eps) overflows, or var + eps is "
                          "subnormal), which no float32 affine reproduces; check those channels' statistics")


def _finish(node, tensors, layer, bn, reader, last):
    """Decide what a conv / dense block outputs: the logits (affine), or bits for `reader`."""
    chain = bn_chain(bn, layer)
    if last:
        node["output"] = "affine"
        tensors["scale"], tensors["bias"] = classifier_affine(chain)  # what is not finite, _check_affine judges
        _check_affine(node["name"], chain, tensors["scale"], tensors["bias"])
        return
    if reader is None:
        raise ExportError(f"{node['name']}: its batch norm feeds no quantizing layer")
    node["output"] = MODES[reader.mode][0]
    attributes, folded = _quantizer_thresholds(chain, reader, node["out_shape"])
    node.update(attributes)
    tensors.update(folded)


def export_model(model: BinaryNet, target: str = "cpu",
                 input_range=packed_model.TRAINING_INPUT_RANGE) -> packed_model.PackedModel:
    """The packed inference graph of a BinaryNet (its eval-mode function) for `target`.

    `input_range` (low, high) is the float scale that float images given to the runtime are on
    (`formats.quantize_images` turns them into the uint8 pixels the model computes on); the file records
    it."""
    if not packed_model.is_known_target(target):
        raise ExportError(f"unknown target {target!r}; known: {sorted(packed_model.TARGETS)}")
    if not isinstance(model, BinaryNet):
        raise ExportError(f"export takes a jaxbnn BinaryNet, got {type(model).__name__}")
    try:
        input_range = [float(v) for v in input_range]
    except (TypeError, ValueError, OverflowError):  # not a pair of numbers, or an integer beyond any float
        raise ExportError(f"input_range must be (low, high), two finite numbers, got {input_range!r}") from None
    tile = packed_model.TARGETS[target]
    blocks = list(model.blocks)
    nodes, tensors = [], {}
    wire, shape = "image", list(model.input_shape)
    # each block's type and layer modes first: a block's thresholds are the next layer's quantizer
    for index, block in enumerate(blocks):
        if not isinstance(block, (ConvBlock, DenseBlock, StreamStem, ResidualBlock, GlobalPool)):
            raise ExportError(f"blocks.{index}: block type {type(block).__name__} is not exportable")
        layer = block.conv if isinstance(block, StreamStem) and index == 0 else reader_layer(block)
        if layer is not None:
            _layer_domains(f"blocks.{index}", layer, first=index == 0)
    for index, block in enumerate(blocks):
        name = f"blocks.{index}"
        last = index == len(blocks) - 1
        reader = reader_layer(blocks[index + 1]) if not last else None
        first = index == 0
        if (first and not isinstance(block, (ConvBlock, DenseBlock, StreamStem))) or (
                not first and isinstance(block, StreamStem)):
            raise ExportError(f"{name}: a {type(block).__name__} cannot be block {index} (the first block, and "
                              "only it, reads the image: a conv, dense or stem block)")
        if isinstance(block, (ConvBlock, DenseBlock)):
            layer = block.conv if isinstance(block, ConvBlock) else block.linear
            pool = block.pool if isinstance(block, ConvBlock) else None
            node, node_tensors = _linear_node(name, layer, shape, wire, tile, first=first, pool=pool)
            _finish(node, node_tensors, layer, block.bn, reader, last)
        elif isinstance(block, StreamStem):
            node, node_tensors = _linear_node(name, block.conv, shape, wire, tile, first=True)
            node.update(output="stream", stream_shift=block.shift)
        elif isinstance(block, ResidualBlock):
            node, node_tensors = _residual_node(name, block, shape, wire, tile)
        elif isinstance(block, GlobalPool):
            if wire != "stream" or len(shape) != 3:
                raise ExportError(f"{name}: global pooling reads the integer stream of an image, got {wire} {shape}")
            if reader is None:
                raise ExportError(f"{name}: global pooling must feed a conv or dense layer")
            node = {"name": name, "kind": "global_pool", "in_shape": list(shape), "out_shape": shape[-1:],
                    "output": MODES[reader.mode][0]}
            attributes, node_tensors = _quantizer_thresholds(bn_chain(block.bn), reader, shape[-1:])
            node.update(attributes)
        if last and node.get("output") != "affine":
            raise ExportError(f"{name}: the last block must be the classifier (a conv or dense block)")
        nodes.append(node)
        tensors.update({f"nodes.{index}.{k}": np.asarray(v) for k, v in node_tensors.items()})
        wire, shape = packed_model.node_output(node)
    graph = {"name": model.name, "mode": model.mode, "input_shape": list(model.input_shape),
             "input_range": input_range, "num_classes": int(model.num_classes),
             "nodes": nodes}
    packed = packed_model.PackedModel(graph=graph, tensors=tensors, target=target)
    try:
        packed_model.validate_graph(graph)
    except packed_model.PackedModelError as error:
        raise ExportError(str(error)) from None
    return packed


def _residual_node(name, block: ResidualBlock, shape, wire, tile):
    """A residual block on the integer stream: conv1 reads the stream through bn_in's thresholds, conv2's
    integer output joins the shortcut."""
    if wire != "stream":
        raise ExportError(f"{name}: a residual block reads the integer stream, got {wire}")
    conv1, t1 = _linear_node(f"{name}.conv1", block.conv1, shape, "stream", tile)
    attributes, folded = _quantizer_thresholds(bn_chain(block.bn_in), block.conv1, shape, prefix="input_")
    conv1.update(attributes)
    t1.update(folded)
    _finish(conv1, t1, block.conv1, block.bn1, block.conv2, last=False)
    conv2, t2 = _linear_node(f"{name}.conv2", block.conv2, conv1["out_shape"], conv1["output"], tile)
    conv2.update(output="stream", stream_shift=0)
    node = {"name": name, "kind": "residual", "in_shape": list(shape), "out_shape": conv2["out_shape"],
            "shortcut_stride": int(block.shortcut_stride), "conv1": conv1, "conv2": conv2}
    tensors = {**{f"conv1.{k}": v for k, v in t1.items()}, **{f"conv2.{k}": v for k, v in t2.items()}}
    return node, tensors
