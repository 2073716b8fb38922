"""The TCBNN model zoo and a small MNIST conv net, as walkable NNX block sequences.

The zoo is Table V of "Accelerating Binarized Neural Networks via Bit-Tensor-Cores in Turing GPUs" (TCBNN).

Every model is a ``BinaryNet``: ``model.blocks`` is an ``nnx.List`` run in order. Blocks follow the
inference-friendly order of TCBNN section 6.1, conv -> (max pool) -> batch norm, and the sign of the
next layer lives in that layer's ``input_quantizer``, so an exporter folds ``bn`` of one block with the
input quantizer of the next layer's ``conv`` / ``linear`` into an integer threshold.

Block types (attribute names are the exporter's contract):

- ``ConvBlock``: ``conv`` (BinaryConv), ``pool`` (None or (ph, pw): max pool, window = stride, VALID,
  applied to the conv output before bn), ``bn`` (nnx.BatchNorm).
- ``DenseBlock``: ``linear`` (BinaryLinear), ``bn``. Flattens its input to (batch, -1) first (NHWC order).
  The last block's bn output is the logits (TCBNN's last layer: binary in, float out, then bn).
- ``ResidualBlock``: ``conv1``, ``bn1``, ``conv2``, ``bn2``; output ``bn2(conv2(bn1(conv1(x)))) +
  shortcut(x)``, the shortcut real-valued, ResNet type A: ``x[:, ::s, ::s, :]`` with ``s =
  shortcut_stride``, zero-padded on the channel axis from ``in_channels`` to ``out_channels``.
- ``GlobalAvgPool``: mean over H and W (float), before the classifier of the ResNets.

Reading of Table V: "n x wFC" lists hidden fully-connected layers; the classifier (``num_classes``
outputs) follows them. Input images are float, NHWC (MLP: flattened by its first DenseBlock).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxbnn.layers import MODES, BinaryConv, BinaryLinear

__all__ = [
    "BinaryNet",
    "ConvBlock",
    "DenseBlock",
    "ResidualBlock",
    "GlobalAvgPool",
    "MODEL_BUILDERS",
    "build_model",
    "default_rngs",
    "mnist_mlp",
    "mnist_conv",
    "cifar10_vgg",
    "cifar10_resnet14",
    "imagenet_alexnet",
    "imagenet_vgg16",
    "imagenet_resnet18",
]

NETWORK_MODES = ("bnn", "tnn", "tbn", "btn", "float")
BN_MOMENTUM = 0.9
BN_EPSILON = 1e-5


def max_pool(x: jax.Array, window: tuple[int, int]) -> jax.Array:
    """Max pool with window = stride, VALID (the fused pool of bconv2d)."""
    ph, pw = window
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, ph, pw, 1), (1, ph, pw, 1), "VALID")


def _batch_norm(features: int, rngs: nnx.Rngs) -> nnx.BatchNorm:
    return nnx.BatchNorm(features, momentum=BN_MOMENTUM, epsilon=BN_EPSILON, rngs=rngs)


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


class DenseBlock(nnx.Module):
    """flatten -> linear -> bn."""

    def __init__(self, linear: BinaryLinear, *, rngs: nnx.Rngs):
        self.linear = linear
        self.bn = _batch_norm(linear.out_features, rngs)

    def __call__(self, x):
        return self.bn(self.linear(x.reshape(x.shape[0], math.prod(x.shape[1:]))))


class ResidualBlock(nnx.Module):
    """Two binary convs with a real-valued type-A shortcut around them."""

    def __init__(self, conv1: BinaryConv, conv2: BinaryConv, *, rngs: nnx.Rngs):
        if conv1.out_features != conv2.in_features or conv2.strides != (1, 1):
            raise ValueError("ResidualBlock: conv2 must take conv1's channels at stride 1")
        if conv1.strides[0] != conv1.strides[1]:
            raise ValueError("ResidualBlock: conv1 needs equal strides")
        self.conv1, self.bn1 = conv1, _batch_norm(conv1.out_features, rngs)
        self.conv2, self.bn2 = conv2, _batch_norm(conv2.out_features, rngs)
        self.in_channels = conv1.in_features
        self.out_channels = conv2.out_features
        self.shortcut_stride = conv1.strides[0]
        if self.out_channels < self.in_channels:
            raise ValueError("ResidualBlock: type-A shortcut cannot reduce channels")

    def shortcut(self, x):
        s = self.shortcut_stride
        x = x[:, ::s, ::s, :]
        extra = self.out_channels - self.in_channels
        return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, extra))) if extra else x

    def __call__(self, x):
        y = self.bn1(self.conv1(x))
        y = self.bn2(self.conv2(y))
        return y + self.shortcut(x)


class GlobalAvgPool(nnx.Module):
    """Mean over the spatial axes: (B, H, W, C) -> (B, C)."""

    def __call__(self, x):
        return jnp.mean(x, axis=(1, 2))


class BinaryNet(nnx.Module):
    """A sequence of blocks. ``name``, ``mode``, ``input_shape`` (H, W, C) and ``num_classes`` describe it."""

    def __init__(self, blocks: list[nnx.Module], *, name: str, mode: str, input_shape: tuple[int, ...],
                 num_classes: int):
        self.blocks = nnx.List(blocks)
        self.name = name
        self.mode = mode
        self.input_shape = tuple(input_shape)
        self.num_classes = num_classes

    def __call__(self, x):
        if tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(f"{self.name} expects inputs of shape (batch, {self.input_shape}), got {x.shape}")
        for block in self.blocks:
            x = block(x)
        return x


# --- building ------------------------------------------------------------------------------------------


class _Builder:
    """Tracks the activation shape while blocks are appended; picks each layer's mode."""

    def __init__(self, mode: str, input_shape, width: float, rngs: nnx.Rngs, layer_options: dict):
        if mode not in NETWORK_MODES:
            raise ValueError(f"unknown network mode {mode!r}; known: {NETWORK_MODES}")
        if width <= 0:
            raise ValueError(f"width must be positive, got {width}")
        self.mode = mode
        self.shape = tuple(input_shape)
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
            # First layer: float image in, quantized weights (BWN / TWN), never a float-input quantizer.
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

    def conv(self, features: int, kernel: int, stride: int = 1, pool: int | None = None) -> None:
        h, w, c = self.shape
        out = self.channels(features)
        conv = BinaryConv(c, out, kernel, stride, padding="SAME", rngs=self.rngs, **self._layer_kwargs(True))
        self.blocks.append(ConvBlock(conv, pool, rngs=self.rngs))
        h, w = -(-h // stride), -(-w // stride)
        if pool:
            h, w = h // pool, w // pool
        if h < 1 or w < 1:
            raise ValueError(f"input {self.shape} too small for this network")
        self.shape = (h, w, out)

    def residual(self, features: int, stride: int = 1) -> None:
        h, w, c = self.shape
        out = self.channels(features)
        kw1, kw2 = self._layer_kwargs(True), self._layer_kwargs(True)
        conv1 = BinaryConv(c, out, 3, stride, padding="SAME", rngs=self.rngs, **kw1)
        conv2 = BinaryConv(out, out, 3, 1, padding="SAME", rngs=self.rngs, **kw2)
        self.blocks.append(ResidualBlock(conv1, conv2, rngs=self.rngs))
        self.shape = (-(-h // stride), -(-w // stride), out)

    def global_pool(self) -> None:
        self.blocks.append(GlobalAvgPool())
        self.shape = (self.shape[-1],)

    def dense(self, features: int, *, scale: bool = True) -> None:
        k = math.prod(self.shape)
        out = self.channels(features) if scale else features
        linear = BinaryLinear(k, out, rngs=self.rngs, **self._layer_kwargs(False))
        self.blocks.append(DenseBlock(linear, rngs=self.rngs))
        self.shape = (out,)


def default_rngs(seed: int = 0) -> nnx.Rngs:
    """Rngs on an RBG key: XLA compiles threefry sampling once per kernel shape, which makes building a
    large model take a minute on a CPU; RBG initial weights are as good and build in seconds."""
    return nnx.Rngs(jax.random.key(seed, impl="rbg"))


def _net(name, mode, input_shape, num_classes, width, rngs, layer_options, body: Callable[[_Builder], None]):
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
        b.conv(128, 3, stride=2)
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
        b.conv(64, 7, stride=4)
        for stage, features in enumerate((64, 128, 256, 512)):
            b.residual(features, stride=1 if stage == 0 else 2)
            b.residual(features)
        b.global_pool()
        for _ in range(2):
            b.dense(512)
    return _net("imagenet-resnet18", mode, input_shape, num_classes, width, rngs, layer_options, body)


MODEL_BUILDERS: dict[str, Callable[..., BinaryNet]] = {
    "mnist-mlp": mnist_mlp,
    "mnist-conv": mnist_conv,
    "cifar10-vgg": cifar10_vgg,
    "cifar10-resnet14": cifar10_resnet14,
    "imagenet-alexnet": imagenet_alexnet,
    "imagenet-vgg16": imagenet_vgg16,
    "imagenet-resnet18": imagenet_resnet18,
}


def build_model(name: str, mode: str = "bnn", **kwargs) -> BinaryNet:
    """Build a zoo model by name (see MODEL_BUILDERS); kwargs go to its builder."""
    try:
        builder = MODEL_BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODEL_BUILDERS)}") from None
    return builder(mode, **kwargs)
