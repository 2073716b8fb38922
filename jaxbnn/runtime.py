"""Inference from a packed checkpoint: `load(path)` -> a model whose call is one `jax.jit` function.

The graph of the file (`jaxbnn.packed_model`, docs/export.md) runs node by node through `jaxbnn.ops`:

- binary x binary layers are one custom call each, with the threshold epilogue writing the next layer's
  packed input (max-pool fused as OR / AND on the bits) or the affine epilogue writing the logits;
- ternary operands are sums of ±1 products: a ternary t is (a + b) / 2 with the ±1 vectors a = [t >= 0]
  and b = [t > 0], so a ternary dot product is a sum of 2 (one ternary operand) or 4 (both) ±1 dot
  products, each one int32 custom call (planes stacked along the batch / output axes into one call); the
  thresholds then run in jnp;
- only the first layer reads floats (float input times the ±1 / ternary weight values, in jnp), and only
  float-output nodes (the classifier, the residual stream) write floats.

Images are uint8 pixels, converted exactly as training converted them (the file records the input range
the model was trained on), or floats on that scale; floats outside it draw an `InputRangeWarning`.

The file holds every operand as the ops take it (ternary weights already as their two ±1 planes, stacked
along the output axis; popcounts per row or per conv tap), so loading moves the arrays to the device as
they are (the first layer's int8 weight values widened to float32) and packs, unpacks and derives nothing.

This module never imports the exporter or the training code.
"""

from __future__ import annotations

import math
import os
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxbnn import formats, ops, packed_model
from jaxbnn.packed_model import PackedModel, uses_conv_layout, weight_geometry

__all__ = ["PackedNet", "InputRangeWarning", "load", "from_packed"]

HIGHEST = jax.lax.Precision.HIGHEST


class InputRangeWarning(UserWarning):
    """Float images that do not look like the scale the model was trained on (its predictions on them are
    not what its accuracy promises). `warnings.simplefilter("error", InputRangeWarning)` makes it an error."""


def load(path: str | os.PathLike) -> "PackedNet":
    """Load and validate a `.jbnn` packed checkpoint; returns the jitted inference model."""
    return PackedNet(packed_model.load(path))


def from_packed(packed: PackedModel) -> "PackedNet":
    """The inference model of an in-memory packed model (the exporter returns one), validated as `load`
    validates a file."""
    packed_model.validate(packed)
    return PackedNet(packed)


class PackedNet:
    """A packed model ready to run: ``logits = net(images)`` (float32 (B, num_classes)).

    ``images``: uint8 pixels (B, *input_shape), converted to the model's input exactly as in training
    (``low + p * (high - low) / 255`` in float32, ``input_range = (low, high)`` as the file records it), or
    floats already on that scale. ``params`` holds the packed parameters (a pytree of arrays); the graph is
    static. ``trace(images)`` returns every node's output as it travels (packed bits, ternary plane pairs or
    floats).
    """

    def __init__(self, packed: PackedModel):
        self.graph = packed.graph
        self.target = packed.target
        self.tile = packed.tile
        self.packed_bytes = packed.nbytes()
        self.input_shape = tuple(self.graph["input_shape"])
        self.input_range = tuple(float(v) for v in self.graph["input_range"])
        self.num_classes = self.graph["num_classes"]
        self.params = [_prepare_node(node, _node_tensors(packed.tensors, f"nodes.{i}."))
                       for i, node in enumerate(self.graph["nodes"])]
        self._pixel_values = jnp.asarray(packed_model.pixel_values(self.input_range))
        nodes = self.graph["nodes"]
        self._forward = jax.jit(lambda params, x: _run(nodes, params, x)[-1])
        self._trace = jax.jit(lambda params, x: _run(nodes, params, x))

    def _check_input(self, images):
        images = images if isinstance(images, jax.Array) else np.asarray(images)
        if images.ndim != len(self.input_shape) + 1 or tuple(images.shape[1:]) != self.input_shape:
            raise ValueError(f"{self.graph['name']} takes images of shape (batch, {', '.join(map(str, self.input_shape))}),"
                             f" got {tuple(images.shape)}")
        low, high = self.input_range
        if images.dtype == np.uint8:
            return self._pixel_values[images]
        if not jnp.issubdtype(images.dtype, jnp.floating):
            raise TypeError(f"images must be uint8 pixels (0..255) or floats in [{low:g}, {high:g}] (the scale "
                            f"{self.graph['name']} was trained on), got {images.dtype}")
        # host images only: a device array's range would cost a reduction and a sync on every call
        if isinstance(images, np.ndarray) and images.size:
            self._warn_outside_range(float(images.min()), float(images.max()))
        return jnp.asarray(images, jnp.float32)

    def _warn_outside_range(self, smallest: float, largest: float) -> None:
        """Warn about float images off the training scale: beyond its range (by more than 1% of its
        width), or none negative where the range is centred below zero (images scaled to [0, 1])."""
        low, high = self.input_range
        slack = 0.01 * (high - low)
        scaled = f"{low:g} + p * {high - low:g} / 255"
        trained = (f"{self.graph['name']} was trained on images in [{low:g}, {high:g}] (uint8 pixels p -> "
                   f"{scaled}); these span [{smallest:g}, {largest:g}]")
        if not low - slack <= smallest <= largest <= high + slack:  # NaN included
            advice = "scale them as in training, or pass the uint8 pixels, which are converted exactly"
        elif low < 0 <= smallest and (low + high) / 2 <= 0:
            advice = (f"none is negative: images scaled to [0, 1] need {low:g} + x * {high - low:g}; or pass the "
                      "uint8 pixels, which are converted exactly")
        else:
            return
        warnings.warn(f"{trained}: {advice}", InputRangeWarning, stacklevel=4)

    def __call__(self, images) -> jax.Array:
        return self._forward(self.params, self._check_input(images))

    def trace(self, images) -> list:
        """Every node's output for `images`: a list, one entry per graph node (residual nodes give the
        pair (conv1 output, block output))."""
        return self._trace(self.params, self._check_input(images))

    def predict(self, images, batch_size: int = 500) -> np.ndarray:
        """Class indices for `images` (uint8 pixels or floats, as for a call), in batches of one shape (the
        last padded) so it compiles once."""
        if isinstance(batch_size, (bool, np.bool_)) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        images = np.asarray(images)
        if images.dtype != np.uint8:
            images = images.astype(np.float32)
        out = []
        for start in range(0, len(images), batch_size):
            chunk = images[start:start + batch_size]
            count = len(chunk)
            if count < batch_size and len(images) > batch_size:
                chunk = np.concatenate([chunk, np.zeros((batch_size - count, *chunk.shape[1:]), chunk.dtype)])
            out.append(np.asarray(jnp.argmax(self(chunk), axis=-1))[:count])
        return np.concatenate(out) if out else np.zeros((0,), np.int64)

    def throughput(self, images, repeats: int = 5) -> float:
        """Images per second of the jitted call on `images` (one batch, compiled first)."""
        images = self._check_input(images)
        self._forward(self.params, images).block_until_ready()
        start = time.perf_counter()
        for _ in range(repeats):
            out = self._forward(self.params, images)
        out.block_until_ready()
        return repeats * images.shape[0] / (time.perf_counter() - start)


def _node_tensors(tensors: dict, prefix: str) -> dict:
    return {name[len(prefix):]: value for name, value in tensors.items() if name.startswith(prefix)}


# --- parameters: what each node needs at run time -------------------------------------------------------


def _prepare_node(node: dict, tensors: dict) -> dict:
    if node["kind"] in ("dense", "conv"):
        return _prepare_linear(node, tensors)
    if node["kind"] == "residual":
        return {key: _prepare_linear(node[key], _node_tensors(tensors, f"{key}.")) for key in ("conv1", "conv2")}
    return {}


def _prepare_linear(node: dict, tensors: dict) -> dict:
    """The node's tensors as the ops take them: no unpacking, no packing, nothing derived."""
    params = {name: jnp.asarray(value) for name, value in tensors.items()}
    if node["operand"] == "float":
        # ±1 / 0 values in the layer's kernel layout; the float conv / dot takes them as float32 (exact).
        params["kernel"] = params["kernel"].astype(jnp.float32)
        return params
    rows, k_bits, kernel, c = weight_geometry(node)
    if uses_conv_layout(node):
        params["weight"] = formats.ConvBits(params["weight"], params.pop("weight_tap_popcount"), kernel_size=kernel,
                                            in_channels=c, out_channels=rows)
    else:
        params["weight"] = formats.DenseBits(params["weight"], params.pop("weight_popcount"), k=k_bits, n=rows)
    return params


# --- the forward pass ----------------------------------------------------------------------------------------


def _run(nodes, params, x):
    """Outputs of every node, in order (the last one is the logits)."""
    outputs = []
    for node, p in zip(nodes, params):
        if node["kind"] in ("dense", "conv"):
            x = _linear(node, p, x)
            outputs.append(x)
        elif node["kind"] == "residual":
            inner = _linear(node["conv1"], p["conv1"], x)
            x = _linear(node["conv2"], p["conv2"], inner) + _shortcut(node, x)
            outputs.append((inner, x))
        else:
            x = jnp.mean(x, axis=(1, 2))
            outputs.append(x)
    return outputs


def _shortcut(node, x):
    """ResNet type A: subsample by the stride, zero-pad the channels."""
    s = node["shortcut_stride"]
    x = x[:, ::s, ::s, :]
    extra = node["out_shape"][-1] - node["in_shape"][-1]
    return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, extra))) if extra else x


def _binarize_input(node, p, x):
    """Float stream -> the packed operand of a binary / ternary layer (its input quantizer)."""
    if node["operand"] == "binary":
        return formats.pack_bits(formats.binarize(x))
    return (formats.pack_bits(formats.binarize(x, p["input_threshold_nonneg"])),
            formats.pack_bits(formats.binarize(x, p["input_threshold_pos"])))


def _linear(node, p, x):
    if node["input"] == "float" and node["operand"] != "float":
        if node["kind"] == "dense" and len(node["in_shape"]) == 1:
            x = _flatten(x)
        x = _binarize_input(node, p, x)
    if node["operand"] == "float":
        pre = _float_operand(node, p, x)
    elif node["operand"] == "binary" and node["weights"] == "binary" and node["output"] in ("binary", "affine"):
        return _fused(node, p, x)
    else:
        pre = _composite_dot(node, p, x)
    if node["kind"] == "conv" and node["pool"] is not None:
        pre = _max_pool(pre, node["pool"])
    return _output(node, p, pre)


def _flatten(x):
    """(B, ...) -> (B, features); explicit sizes, as a -1 cannot be resolved for an empty batch."""
    return x.reshape(x.shape[0], math.prod(x.shape[1:]))


def _max_pool(x, pool):
    ph, pw = pool
    b, h, w, c = x.shape
    oh, ow = h // ph, w // pw
    return x[:, : oh * ph, : ow * pw].reshape(b, oh, ph, ow, pw, c).max(axis=(2, 4))


def _conv_args(node):
    """bconv2d keyword arguments of a node: its own conv, or the VALID conv covering a packed image."""
    if node["kind"] == "conv":
        return dict(stride=tuple(node["stride"]), padding=tuple(tuple(p) for p in node["padding"]),
                    pad_value=node["pad_value"])
    return dict(stride=1, padding="VALID", pad_value="zero")


def _fused(node, p, x):
    """binary x binary: one custom call with the epilogue (threshold -> packed bits, affine -> float)."""
    if node["output"] == "binary":
        epilogue = dict(threshold=p["threshold"], flip=p["flip"])
    else:
        epilogue = dict(scale=p["scale"], bias=p["bias"])
    if uses_conv_layout(node):
        pool = node.get("pool") if node["kind"] == "conv" else None
        out = ops.bconv2d(x, p["weight"], pool=None if pool is None else tuple(pool), **_conv_args(node), **epilogue)
        return out if node["kind"] == "conv" else _flatten(out)
    return ops.bmm(x, p["weight"], **epilogue)


def _pm_dot(node, p, x):
    """int32 ±1 dot products of packed `x` with the node's packed ±1 weights (one custom call)."""
    if uses_conv_layout(node):
        out = ops.bconv2d(x, p["weight"], **_conv_args(node))
        return out if node["kind"] == "conv" else _flatten(out)
    return ops.bmm(x, p["weight"])


def _composite_dot(node, p, x):
    """The int32 dot product of a layer with a ternary operand, from ±1 dot products (module docstring)."""
    n = node["out_channels"]
    if node["operand"] == "ternary":
        nonneg, pos = x
        batch = nonneg.shape[0]
        x = jnp.concatenate([nonneg, pos], axis=0)
    dot = _pm_dot(node, p, x)
    parts = 1
    if node["weights"] == "ternary":
        dot = dot[..., :n] + dot[..., n:]
        parts *= 2
    if node["operand"] == "ternary":
        dot = dot[:batch] + dot[batch:]
        parts *= 2
    return dot // parts  # exact: the sum of the ±1 products is a multiple of `parts`


def _float_operand(node, p, x):
    """First layer: float input times the weight values, exactly as the Flax layer computes it."""
    if node["kind"] == "conv":
        (pt, pb), (pl, pr) = node["padding"]
        x = jnp.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)))
        return jax.lax.conv_general_dilated(x, p["kernel"], tuple(node["stride"]), "VALID",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=HIGHEST)
    x = _flatten(x)
    return jax.lax.dot_general(x, p["kernel"], (((1,), (0,)), ((), ())), precision=HIGHEST)


def _output(node, p, pre):
    """What a (pooled) pre-activation becomes: bits, ternary planes, logits or the float stream."""
    output = node["output"]
    if output == "binary":
        return formats.pack_bits(formats.binarize(pre, p["threshold"], p["flip"]))
    if output == "ternary":
        return (formats.pack_bits(formats.binarize(pre, p["threshold_nonneg"], p["flip_nonneg"])),
                formats.pack_bits(formats.binarize(pre, p["threshold_pos"], p["flip_pos"])))
    y = pre.astype(jnp.float32)
    if output == "affine":
        return y * p["scale"] + p["bias"]
    # The float stream: the batch norm in nnx.BatchNorm's order of operations, so it matches bit for bit.
    if node["kernel_scale"]:
        y = y * p["kernel_scale"]
    if node["bias"]:
        y = y + p["bias"]
    return (y - p["bn_mean"]) * p["bn_mul"] + p["bn_bias"]
