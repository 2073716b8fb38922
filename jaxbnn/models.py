"""The TCBNN model zoo and a small MNIST conv net, as walkable NNX block sequences.

The zoo is Table V of "Accelerating Binarized Neural Networks via Bit-Tensor-Cores in Turing GPUs" (TCBNN).

Every model is a ``BinaryNet``: ``model.blocks`` is an ``nnx.List`` run in order. It takes uint8 images
(B, H, W, C) and computes on the integer levels ``p - 128`` of their pixels (``formats.image_levels``; the
first layer's padding is level 0, pixel 128), so between the pixels and the logits every pre-activation
is an integer. Blocks follow the inference order of TCBNN section 6.1, conv -> (max pool) -> batch norm,
and the sign of the next layer lives in that layer's ``input_quantizer``.

Training mode runs the blocks as written, in float32 (batch statistics, straight-through gradients). Eval
mode (``model.eval()``) is a function of integers: each batch norm and the quantizer that reads it become
the integer thresholds of ``jaxbnn.thresholds`` (``BinaryConv.quantize_integers``), the rule the exporter
writes, so the Flax model, the packed model and every platform agree bit for bit, ties and NaNs included.

Block types (attribute names are the exporter's contract):

- ``ConvBlock``: ``conv`` (BinaryConv), ``pool`` (None or (ph, pw): max pool, window = stride, VALID,
  applied to the conv output before bn), ``bn`` (nnx.BatchNorm).
- ``DenseBlock``: ``linear`` (BinaryLinear), ``bn``. Flattens its input to (batch, -1) first (NHWC order).
  The last block's bn output is the logits (TCBNN's last layer: binary in, float out, then bn).
- ``StreamStem``: ``conv`` of the image levels, without batch norm; its integer output divided by
  ``2**shift`` (floor; 128, the pixel scale, by default) starts the integer residual stream of a ResNet.
- ``ResidualBlock``: ``bn_in``, ``conv1``, ``bn1``, ``conv2`` on the integer stream s: ``s + conv2(q(bn1(
  conv1(q(bn_in(s))))))`` with q the convs' input quantizers, conv2's integer output added unscaled, the
  shortcut ResNet type A: ``s[:, ::t, ::t, :]`` with ``t = shortcut_stride``, zero-padded on the channel
  axis from ``in_channels`` to ``out_channels``. Batch norm sits only in front of each quantizer.
- ``GlobalPool``: the integer sum over H and W of the stream, then ``bn`` (read by the classifier).

Reading of Table V: "n x wFC" lists hidden fully-connected layers; the classifier (``num_classes``
outputs) follows them. MLP images are flattened by its first DenseBlock.
"""

from __future__ import annotations

import math
import operator
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxbnn import formats
from jaxbnn.layers import MODES, BinaryConv, BinaryLinear, classifier_logits

__all__ = [
    "BinaryNet",
    "ConvBlock",
    "DenseBlock",
    "StreamStem",
    "ResidualBlock",
    "GlobalPool",
    "MODEL_BUILDERS",
    "STREAM_SHIFT",
    "build_model",
    "default_rngs",
    "mnist_mlp",
    "mnist_conv",
    "cifar10_vgg",
    "cifar10_resnet14",
    "imagenet_alexnet",
    "imagenet_vgg16",
    "imagenet_resnet18",
    "imagenet_darknet19",
]

NETWORK_MODES = ("bnn", "tnn", "tbn", "btn", "float")
BN_MOMENTUM = 0.9
BN_EPSILON = 1e-5
# The image stem's output enters the residual stream in units of 128 levels: on the scale of a ±1 input,
# like the binary convolutions' outputs it is summed with.
STREAM_SHIFT = 7


def max_pool(x: jax.Array, window: tuple[int, int]) -> jax.Array:
    """Max pool with window = stride, VALID (the fused pool of bconv2d)."""
    ph, pw = window
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, ph, pw, 1), (1, ph, pw, 1), "VALID")


def _batch_norm(features: int, rngs: nnx.Rngs) -> nnx.BatchNorm:
    return nnx.BatchNorm(features, momentum=BN_MOMENTUM, epsilon=BN_EPSILON, rngs=rngs)


def _integer(z: jax.Array) -> jax.Array:
    """An eval-mode pre-activation as the integer it is (float32 holds it exactly; rounding removes any
    error a convolution algorithm adds, far below 1/2 at these magnitudes)."""
    return jnp.round(z)


def _floor_ste(x: jax.Array) -> jax.Array:
    """floor(x) forward, identity gradient."""
    return x + jax.lax.stop_gradient(jnp.floor(x) - x)


def _no_epilogue(layer, role: str) -> None:
    if layer.xnor_scaling or layer.input_scaling or layer.use_bias:
        raise ValueError(f"{role}: its integer output enters the residual stream, so it takes no XNOR scaling "
                         "or bias")


class ConvBlock(nnx.Module):
    """conv -> (max pool) -> bn."""

    def __init__(self, conv: BinaryConv, pool: int | None, *, rngs: nnx.Rngs):
        self.conv = conv
        self.pool = (pool, pool) if pool else None
        self.bn = _batch_norm(conv.out_features, rngs)

    def __call__(self, x):
        y = self.conv(x)
        if self.pool is not None:
            y = max_pool(y, self.pool)
        return self.bn(y)

    def eval_forward(self, x, quantized: bool, reader):
        # max pool commutes with the XNOR scale (>= 0) and the bias, which the thresholds fold in
        z = _integer(self.conv.dot(x, quantized=quantized))
        if self.pool is not None:
            z = max_pool(z, self.pool)
        if reader is None:
            return classifier_logits(z, self.bn, self.conv), False
        return reader.quantize_integers(z, self.bn, self.conv), True


class DenseBlock(nnx.Module):
    """flatten -> linear -> bn."""

    def __init__(self, linear: BinaryLinear, *, rngs: nnx.Rngs):
        self.linear = linear
        self.bn = _batch_norm(linear.out_features, rngs)

    def __call__(self, x):
        return self.bn(self.linear(_flatten(x)))

    def eval_forward(self, x, quantized: bool, reader):
        z = _integer(self.linear.dot(_flatten(x), quantized=quantized))
        if reader is None:
            return classifier_logits(z, self.bn, self.linear), False
        return reader.quantize_integers(z, self.bn, self.linear), True


def _flatten(x):
    return x.reshape(x.shape[0], math.prod(x.shape[1:]))


class StreamStem(nnx.Module):
    """The first conv of a ResNet: floor(conv(levels) / 2**shift), the integer residual stream's start."""

    def __init__(self, conv: BinaryConv, shift: int = STREAM_SHIFT):
        _no_epilogue(conv, "the stream stem")
        self.conv = conv
        self.shift = int(shift)

    def __call__(self, x):
        return _floor_ste(self.conv.dot(x) / 2**self.shift)

    def eval_forward(self, x, quantized: bool, reader):
        return jnp.floor(_integer(self.conv.dot(x, quantized=quantized)) / 2**self.shift), False


class ResidualBlock(nnx.Module):
    """Two binary convs on the integer residual stream, with a type-A shortcut around them."""

    def __init__(self, conv1: BinaryConv, conv2: BinaryConv, *, rngs: nnx.Rngs):
        if conv1.out_features != conv2.in_features or conv2.strides != (1, 1):
            raise ValueError("ResidualBlock: conv2 must take conv1's channels at stride 1")
        if conv1.strides[0] != conv1.strides[1]:
            raise ValueError("ResidualBlock: conv1 needs equal strides")
        _no_epilogue(conv2, "ResidualBlock's conv2")
        self.in_channels = conv1.in_features
        self.out_channels = conv2.out_features
        self.shortcut_stride = conv1.strides[0]
        if self.out_channels < self.in_channels:
            raise ValueError("ResidualBlock: type-A shortcut cannot reduce channels")
        self.bn_in = _batch_norm(conv1.in_features, rngs)
        self.conv1, self.bn1 = conv1, _batch_norm(conv1.out_features, rngs)
        self.conv2 = conv2

    def shortcut(self, x):
        s = self.shortcut_stride
        x = x[:, ::s, ::s, :]
        extra = self.out_channels - self.in_channels
        return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, extra))) if extra else x

    def __call__(self, x):
        inner = self.bn1(self.conv1(self.bn_in(x)))
        return self.conv2.dot(inner) + self.shortcut(x)

    def inner(self, x):
        """Eval mode: conv2's quantized input (conv1's output through bn1 and conv2's quantizer)."""
        a = self.conv1.quantize_integers(x, self.bn_in)
        return self.conv2.quantize_integers(_integer(self.conv1.dot(a, quantized=True)), self.bn1, self.conv1)

    def eval_forward(self, x, quantized: bool, reader, inner=None):
        inner = self.inner(x) if inner is None else inner
        y = _integer(self.conv2.dot(inner, quantized=True))
        return y + self.shortcut(x), False


class GlobalPool(nnx.Module):
    """Sum over the spatial axes of the integer stream, (B, H, W, C) -> (B, C), then batch norm."""

    def __init__(self, channels: int, *, rngs: nnx.Rngs):
        self.bn = _batch_norm(channels, rngs)

    def __call__(self, x):
        return self.bn(jnp.sum(x, axis=(1, 2)))

    def eval_forward(self, x, quantized: bool, reader):
        # int32, as the packed global pool sums (a float32 sum rounds past 2^24)
        z = jnp.sum(_integer(x).astype(jnp.int32), axis=(1, 2), dtype=jnp.int32)
        if reader is None:
            return classifier_logits(z, self.bn), False
        return reader.quantize_integers(z, self.bn), True


def reader_layer(block):
    """The layer whose quantizer reads the batch norm at the end of the block before `block`: a conv or
    dense block's layer; None for the blocks that read the integer stream themselves."""
    if isinstance(block, ConvBlock):
        return block.conv
    if isinstance(block, DenseBlock):
        return block.linear
    return None


class BinaryNet(nnx.Module):
    """A sequence of blocks. ``name``, ``mode``, ``input_shape`` (H, W, C) and ``num_classes`` describe it.

    Takes uint8 images (B, *input_shape) (`formats.quantize_images` turns float images into them)."""

    def __init__(self, blocks: list[nnx.Module], *, name: str, mode: str, input_shape: tuple[int, ...],
                 num_classes: int):
        self.blocks = nnx.List(blocks)
        self.name = name
        self.mode = mode
        self.input_shape = tuple(operator.index(v) for v in input_shape)  # numpy integers as Python ints
        self.num_classes = operator.index(num_classes)

    def __call__(self, images):
        if tuple(images.shape[1:]) != self.input_shape:
            raise ValueError(f"{self.name} expects images of shape (batch, {self.input_shape}), got {images.shape}")
        if not self.integer_eval():
            return self.float_forward(images)
        return self.trace(images)[-1]

    def trace(self, images) -> list:
        """Eval mode: every block's output as the integer forward computes it, one entry per block (what the
        exported graph's nodes output): quantized values (±1 / ternary) where the next layer reads them,
        the integer stream, the logits; a residual block gives (conv2's quantized input, the stream)."""
        if not self.integer_eval():
            raise ValueError(f"{self.name}: trace() runs the integer eval forward: call model.eval() first (and "
                             "it needs binary or ternary activations without XNOR input scaling)")
        x = formats.image_levels(images).astype(jnp.float32)
        blocks = list(self.blocks)
        quantized = False
        outputs = []
        for index, block in enumerate(blocks):
            reader = reader_layer(blocks[index + 1]) if index + 1 < len(blocks) else None
            if isinstance(block, ResidualBlock):
                inner = block.inner(x)
                x, quantized = block.eval_forward(x, quantized, reader, inner)
                outputs.append((inner, x))
            else:
                x, quantized = block.eval_forward(x, quantized, reader)
                outputs.append(x)
        return outputs

    def float_forward(self, images, dtype=jnp.float32):
        """The blocks as written, in float32: the training forward (with batch statistics), and in eval mode
        the float network the integer forward stands for (its speed is the float baseline's; `dtype`: the
        levels' type, e.g. bfloat16 with parameters cast to it)."""
        x = formats.image_levels(images).astype(dtype)
        for block in self.blocks:
            x = block(x)
        return x

    def integer_eval(self) -> bool:
        """Whether the forward runs as integers through thresholds: eval mode (running batch statistics)
        of a network whose activations are binary or ternary (not the float reference network, nor XNOR
        input scaling, whose per-sample scales are floats)."""
        norms = [m for _, m in nnx.iter_modules(self) if isinstance(m, nnx.BatchNorm)]
        layers = [m for _, m in nnx.iter_modules(self) if isinstance(m, (BinaryConv, BinaryLinear))]
        return (self.mode != "float" and bool(norms) and all(bn.use_running_average for bn in norms)
                and not any(layer.input_scaling for layer in layers))


# --- building ------------------------------------------------------------------------------------------


class _Builder:
    """Tracks the activation shape while blocks are appended; picks each layer's mode."""

    def __init__(self, mode: str, input_shape, width: float, rngs: nnx.Rngs, layer_options: dict):
        if not isinstance(mode, str) or mode not in NETWORK_MODES:
            raise ValueError(f"unknown network mode {mode!r}; known: {NETWORK_MODES}")
        if isinstance(width, (bool, np.bool_)) or not isinstance(width, (int, float, np.integer, np.floating)) \
                or not (math.isfinite(width) and width > 0):
            raise ValueError(f"width must be a finite positive number, got {width!r}")
        shape = tuple(input_shape) if isinstance(input_shape, (tuple, list)) else ()
        if not shape or not all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
                                and v > 0 for v in shape):
            raise ValueError(f"input_shape must be a tuple of positive ints, (H, W, C) for an image, got "
                             f"{input_shape!r}")
        self.mode = mode
        self.input_shape = shape
        self.shape = shape
        self.width = width
        self.rngs = rngs
        self.options = dict(layer_options)
        self.blocks: list[nnx.Module] = []
        self.first = True

    def channels(self, n: int) -> int:
        return max(1, int(round(n * self.width)))

    def _layer_kwargs(self, spatial: bool) -> dict:
        weight_domain = MODES[self.mode][1]
        if self.first:
            # First layer: image levels in (integers), quantized weights (BWN / TWN), no input quantizer.
            layer_mode = {"binary": "bwn", "ternary": "twn", "float": "float"}[weight_domain]
            kwargs = {k: v for k, v in self.options.items()
                      if k in ("kernel_quantizer", "xnor_scaling", "kernel_threshold", "kernel_delta")}
            kwargs["mode"] = layer_mode
            self.first = False
            return kwargs
        kwargs = dict(self.options)
        kwargs["mode"] = self.mode
        if self.mode == "float":
            kwargs.setdefault("input_quantizer", "hard_tanh")
        if not spatial:
            kwargs.pop("padding_value", None)
        return kwargs

    def _image_shape(self) -> tuple[int, int, int]:
        if len(self.shape) != 3:
            raise ValueError(f"a convolution takes (H, W, C) images; this network's input_shape is {self.input_shape}")
        return self.shape

    def conv(self, features: int, kernel: int, stride: int = 1, pool: int | None = None) -> None:
        h, w, c = self._image_shape()
        out = self.channels(features)
        conv = BinaryConv(c, out, kernel, stride, padding="SAME", rngs=self.rngs, **self._layer_kwargs(True))
        self.blocks.append(ConvBlock(conv, pool, rngs=self.rngs))
        h, w = -(-h // stride), -(-w // stride)
        if pool:
            h, w = h // pool, w // pool
        if h < 1 or w < 1:
            raise ValueError(f"input {self.input_shape} too small for this network (block {len(self.blocks) - 1} "
                             f"takes {self.shape} to nothing)")
        self.shape = (h, w, out)

    def stem(self, features: int, kernel: int, stride: int) -> None:
        """The first conv of a ResNet, starting the integer stream (no XNOR scale, no bias)."""
        h, w, c = self._image_shape()
        out = self.channels(features)
        kwargs = {**self._layer_kwargs(True), "xnor_scaling": False}
        conv = BinaryConv(c, out, kernel, stride, padding="SAME", rngs=self.rngs, **kwargs)
        self.blocks.append(StreamStem(conv))
        self.shape = (-(-h // stride), -(-w // stride), out)

    def residual(self, features: int, stride: int = 1) -> None:
        h, w, c = self._image_shape()
        out = self.channels(features)
        kw1 = self._layer_kwargs(True)
        # conv2's integer output joins the stream as it is: no XNOR scale, no bias
        kw2 = {**self._layer_kwargs(True), "xnor_scaling": False, "use_bias": False}
        conv1 = BinaryConv(c, out, 3, stride, padding="SAME", rngs=self.rngs, **kw1)
        conv2 = BinaryConv(out, out, 3, 1, padding="SAME", rngs=self.rngs, **kw2)
        self.blocks.append(ResidualBlock(conv1, conv2, rngs=self.rngs))
        self.shape = (-(-h // stride), -(-w // stride), out)

    def global_pool(self) -> None:
        self.blocks.append(GlobalPool(self.shape[-1], rngs=self.rngs))
        self.shape = (self.shape[-1],)

    def dense(self, features: int, *, scale: bool = True) -> None:
        k = math.prod(self.shape)
        out = self.channels(features) if scale else features
        linear = BinaryLinear(k, out, rngs=self.rngs, **self._layer_kwargs(False))
        self.blocks.append(DenseBlock(linear, rngs=self.rngs))
        self.shape = (out,)


def default_rngs(seed: int = 0) -> nnx.Rngs:
    """Rngs on an RBG key: XLA compiles threefry sampling once per kernel shape, which makes building a
    large model take a minute on a CPU; RBG initial weights are as good and build in seconds. A seed of 2^32 or
    more folds its high word into the key of its low one: without x64 jax keeps only a seed's low 32 bits, so
    seeds 2^32 apart would build the same weights (the same key with x64 on or off). Seeds are 0 .. 2^64 - 1."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an integer in [0, 2^64), got {seed!r}")
    seed = int(seed)
    if seed >= 2**32:
        return nnx.Rngs(jax.random.fold_in(jax.random.key(seed & 0xFFFFFFFF, impl="rbg"), seed >> 32))
    return nnx.Rngs(jax.random.key(seed, impl="rbg"))


def _net(name, mode, input_shape, num_classes, width, rngs, layer_options, body: Callable[[_Builder], None]):
    if isinstance(num_classes, (bool, np.bool_)) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    rngs = rngs if rngs is not None else default_rngs()
    b = _Builder(mode, input_shape, width, rngs, layer_options or {})
    body(b)
    b.dense(num_classes, scale=False)
    return BinaryNet(b.blocks, name=name, mode=mode, input_shape=input_shape, num_classes=num_classes)


def mnist_mlp(mode="bnn", *, num_classes=10, input_shape=(28, 28, 1), width=1.0, rngs=None, layer_options=None):
    """MNIST MLP, Table V: 1024FC x 4, then the classifier."""
    def body(b):
        for _ in range(4):
            b.dense(1024)
    return _net("mnist-mlp", mode, input_shape, num_classes, width, rngs, layer_options, body)


def mnist_conv(mode="bnn", *, num_classes=10, input_shape=(28, 28, 1), width=1.0, rngs=None, layer_options=None):
    """A small MNIST conv net: 32C3-(64C3-P2)-(128C3-P2)-256FC, then the classifier."""
    def body(b):
        b.conv(32, 3)
        b.conv(64, 3, pool=2)
        b.conv(128, 3, pool=2)
        b.dense(256)
    return _net("mnist-conv", mode, input_shape, num_classes, width, rngs, layer_options, body)


def cifar10_vgg(mode="bnn", *, num_classes=10, input_shape=(32, 32, 3), width=1.0, rngs=None, layer_options=None):
    """CIFAR-10 VGG-small, Table V: (2x128C3)-MP2-(2x256C3)-MP2-(2x512C3)-MP2-(3x1024FC)."""
    def body(b):
        for features in (128, 256, 512):
            b.conv(features, 3)
            b.conv(features, 3, pool=2)
        for _ in range(3):
            b.dense(1024)
    return _net("cifar10-vgg", mode, input_shape, num_classes, width, rngs, layer_options, body)


def cifar10_resnet14(mode="bnn", *, num_classes=10, input_shape=(32, 32, 3), width=1.0, rngs=None,
                     layer_options=None):
    """CIFAR-10 ResNet-14, Table V: 128C3/2-4x128C3-4x256C3-4x512C3-(2x512FC); 2 residual blocks per stage."""
    def body(b):
        b.stem(128, 3, stride=2)
        for stage, features in enumerate((128, 256, 512)):
            b.residual(features, stride=1 if stage == 0 else 2)
            b.residual(features)
        b.global_pool()
        for _ in range(2):
            b.dense(512)
    return _net("cifar10-resnet14", mode, input_shape, num_classes, width, rngs, layer_options, body)


def imagenet_alexnet(mode="bnn", *, num_classes=1000, input_shape=(224, 224, 3), width=1.0, rngs=None,
                     layer_options=None):
    """ImageNet AlexNet, Table V: (128C11/4)-P2-(256C5)-P2-(3x256C3)-P2-(3x4096FC)."""
    def body(b):
        b.conv(128, 11, stride=4, pool=2)
        b.conv(256, 5, pool=2)
        b.conv(256, 3)
        b.conv(256, 3)
        b.conv(256, 3, pool=2)
        for _ in range(3):
            b.dense(4096)
    return _net("imagenet-alexnet", mode, input_shape, num_classes, width, rngs, layer_options, body)


def imagenet_vgg16(mode="bnn", *, num_classes=1000, input_shape=(224, 224, 3), width=1.0, rngs=None,
                   layer_options=None):
    """ImageNet VGG-16, Table V: (2x64C3)-P2-(2x128C3)-P2-(3x256C3)-P2-2x(3x512C3-P2)-(3x4096FC)."""
    def body(b):
        for features, count in ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3)):
            for i in range(count):
                b.conv(features, 3, pool=2 if i == count - 1 else None)
        for _ in range(3):
            b.dense(4096)
    return _net("imagenet-vgg16", mode, input_shape, num_classes, width, rngs, layer_options, body)


def imagenet_resnet18(mode="bnn", *, num_classes=1000, input_shape=(224, 224, 3), width=1.0, rngs=None,
                      layer_options=None):
    """ImageNet ResNet-18, Table V: 64C7/4-4x64C3-4x128C3-4x256C3-4x512C3-(2x512FC)."""
    def body(b):
        b.stem(64, 7, stride=4)
        for stage, features in enumerate((64, 128, 256, 512)):
            b.residual(features, stride=1 if stage == 0 else 2)
            b.residual(features)
        b.global_pool()
        for _ in range(2):
            b.dense(512)
    return _net("imagenet-resnet18", mode, input_shape, num_classes, width, rngs, layer_options, body)


def imagenet_darknet19(mode="bnn", *, num_classes=1000, input_shape=(224, 224, 3), width=1.0, rngs=None,
                       layer_options=None):
    """ImageNet Darknet-19 (YOLOv2's backbone; TAB's second benchmark network): its 18 feature convolutions,
    32C3-P2-64C3-P2-(128C3-64C1-128C3)-P2-(256C3-128C1-256C3)-P2-(512C3-256C1-512C3-256C1-512C3)-P2-
    (1024C3-512C1-1024C3-512C1-1024C3), then the classifier. Darknet-19 classifies with a 1000C1
    convolution and a global average pool; here the classifier is the zoo's dense affine layer on the
    7 x 7 x 1024 features, as in the other zoo models."""
    stages = ((32,), (64,), (128, 64, 128), (256, 128, 256), (512, 256, 512, 256, 512),
              (1024, 512, 1024, 512, 1024))

    def body(b):
        for stage, features in enumerate(stages):
            for i, f in enumerate(features):
                last = i == len(features) - 1
                # alternating 3x3 and 1x1; each stage but the last ends in a 2x2 max-pool
                b.conv(f, 3 if i % 2 == 0 else 1, pool=2 if last and stage < len(stages) - 1 else None)
    return _net("imagenet-darknet19", mode, input_shape, num_classes, width, rngs, layer_options, body)


MODEL_BUILDERS: dict[str, Callable[..., BinaryNet]] = {
    "mnist-mlp": mnist_mlp,
    "mnist-conv": mnist_conv,
    "cifar10-vgg": cifar10_vgg,
    "cifar10-resnet14": cifar10_resnet14,
    "imagenet-alexnet": imagenet_alexnet,
    "imagenet-vgg16": imagenet_vgg16,
    "imagenet-resnet18": imagenet_resnet18,
    "imagenet-darknet19": imagenet_darknet19,
}


def build_model(name: str, mode: str = "bnn", **kwargs) -> BinaryNet:
    """Build a zoo model by name (see MODEL_BUILDERS); kwargs go to its builder."""
    try:
        builder = MODEL_BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODEL_BUILDERS)}") from None
    return builder(mode, **kwargs)
