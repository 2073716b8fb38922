"""Binary and ternary layers in Flax NNX, and lax-compatible binary dot/conv functions.

A layer's ``mode`` names the value domains of its two operands (activations x weights):

| mode  | activations | weights | use |
| ----- | ----------- | ------- | --- |
| bnn   | binary      | binary  | hidden layers of a BNN |
| tnn   | ternary     | ternary | hidden layers of a TNN |
| tbn   | ternary     | binary  | TAB's mixed precision |
| btn   | binary      | ternary | TAB's mixed precision |
| bwn   | float       | binary  | first layer (image levels, binary weights) |
| twn   | float       | ternary | first layer of ternary-weight nets |
| float | float       | float   | the full-precision reference of the same network |

Exactness: quantized operands are exact small integers in float32, and the dot/conv runs at
``Precision.HIGHEST``, so the pre-activation equals the integer dot product the packed kernels compute
(exact while |sum| < 2**24). XNOR scaling multiplies the integer result afterwards, per output channel.

What an exporter reads from a layer: ``mode``, ``input_quantizer`` / ``kernel_quantizer`` (names or
None), ``padding`` / ``padding_value`` / ``strides`` / ``kernel_size`` (conv), ``xnor_scaling``,
``input_scaling``, ``use_bias``, and the methods ``quantized_kernel()``, ``kernel_scale()``,
``input_thresholds()`` / ``kernel_thresholds()`` (ternary operands: (alpha, beta), scalars or vectors),
``explicit_padding(h, w)`` (conv).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxbnn import formats
from jaxbnn import quantizers as q
from jaxbnn import thresholds

__all__ = [
    "MODES",
    "BinaryLinear",
    "BinaryConv",
    "binary_dot_general",
    "binary_conv_general_dilated",
    "make_binary_dot_general",
    "make_binary_conv_general_dilated",
    "clip_latent_weights",
    "same_padding",
]

HIGHEST = jax.lax.Precision.HIGHEST

# mode -> (activation domain, weight domain)
MODES: dict[str, tuple[str, str]] = {
    "bnn": ("binary", "binary"),
    "tnn": ("ternary", "ternary"),
    "tbn": ("ternary", "binary"),
    "btn": ("binary", "ternary"),
    "bwn": ("float", "binary"),
    "twn": ("float", "ternary"),
    "float": ("float", "float"),
}

_DEFAULT_QUANTIZER = {"binary": "sign_ste", "ternary": "ternarize_ste", "float": None}
_KERNEL_THRESHOLDS = ("twn", "twn_channel", "fixed", "learned")
_INPUT_THRESHOLDS = ("fixed", "learned")


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """lax's "SAME" padding for one spatial axis: output ceil(size / stride), extra pixel at the end."""
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def _check_quantizer(name: str | None, domain: str, role: str) -> str | None:
    if name is None:
        if domain != "float":
            raise ValueError(f"{role} is required for {domain} values")
        return None
    spec = q.get_quantizer(name)
    allowed = {"float": ("float",), "binary": ("binary",), "ternary": ("ternary",)}[domain]
    if spec.domain not in allowed:
        raise ValueError(f"{role} {name!r} produces {spec.domain} values; this mode needs {domain} values")
    return name


class _QuantizedOperands(nnx.Module):
    """Quantization shared by BinaryLinear and BinaryConv (kernel layout: reduction axes first, N last)."""

    def _setup_quantization(
        self,
        *,
        mode: str,
        in_features: int,
        out_features: int,
        kernel_shape: tuple[int, ...],
        input_quantizer: str | None,
        kernel_quantizer: str | None,
        xnor_scaling: bool,
        input_scaling: bool,
        kernel_clip: float | None,
        kernel_threshold: str,
        kernel_delta: float,
        input_threshold: str,
        input_delta: float,
        use_bias: bool,
        rngs: nnx.Rngs,
    ):
        if not isinstance(mode, str) or mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; known: {sorted(MODES)}")
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            _positive_int(name, value)
        if kernel_clip is not None and not (_is_real(kernel_clip) and np.float32(kernel_clip) > 0):
            raise ValueError("kernel_clip must be a positive finite number within float32's range, or None; got "
                             f"{kernel_clip!r}")
        act_domain, weight_domain = MODES[mode]
        if input_quantizer is None and act_domain != "float":
            input_quantizer = _DEFAULT_QUANTIZER[act_domain]
        if kernel_quantizer is None:
            kernel_quantizer = _DEFAULT_QUANTIZER[weight_domain]
        self.mode = mode
        self.in_features = in_features
        self.out_features = out_features
        self.input_quantizer = _check_quantizer(input_quantizer, act_domain, "input_quantizer")
        self.kernel_quantizer = _check_quantizer(kernel_quantizer, weight_domain, "kernel_quantizer")
        if _flag("input_scaling", input_scaling) and act_domain == "float":
            raise ValueError("input_scaling (XNOR-Net K) needs quantized activations")
        self.xnor_scaling = _flag("xnor_scaling", xnor_scaling)
        self.input_scaling = _flag("input_scaling", input_scaling)
        self.kernel_clip = kernel_clip
        self.use_bias = _flag("use_bias", use_bias)

        init = nnx.initializers.glorot_uniform()
        kernel = init(rngs.params(), kernel_shape, jnp.float32)
        if kernel_clip is not None:
            kernel = jnp.clip(kernel, -kernel_clip, kernel_clip)
        self.kernel = nnx.Param(kernel)
        self.bias = nnx.Param(jnp.zeros((out_features,), jnp.float32)) if use_bias else None

        # Threshold settings exist only for ternary operands (None otherwise); learned thresholds are
        # Params of shape (out_features,) for kernels and (in_features,) for inputs.
        kernel_alpha = kernel_beta = input_alpha = input_beta = None
        if weight_domain == "ternary":
            if kernel_threshold not in _KERNEL_THRESHOLDS:
                raise ValueError(f"kernel_threshold must be one of {_KERNEL_THRESHOLDS}, got {kernel_threshold!r}")
            _check_delta("kernel_delta", kernel_delta)
            if kernel_threshold == "learned":
                alpha, _ = q.twn_thresholds(kernel, kernel_delta, per_channel=True)
                kernel_alpha, kernel_beta = nnx.Param(alpha), nnx.Param(-alpha)
        else:
            kernel_threshold = kernel_delta = None
        if act_domain == "ternary":
            if input_threshold not in _INPUT_THRESHOLDS:
                raise ValueError(f"input_threshold must be one of {_INPUT_THRESHOLDS}, got {input_threshold!r}")
            _check_delta("input_delta", input_delta)
            if input_threshold == "learned":
                input_alpha = nnx.Param(jnp.full((in_features,), input_delta, jnp.float32))
                input_beta = nnx.Param(jnp.full((in_features,), -input_delta, jnp.float32))
        else:
            input_threshold = input_delta = None
        self.kernel_threshold = kernel_threshold
        self.kernel_delta = None if kernel_delta is None else float(kernel_delta)
        self.kernel_alpha, self.kernel_beta = kernel_alpha, kernel_beta
        self.input_threshold = input_threshold
        self.input_delta = None if input_delta is None else float(input_delta)
        self.input_alpha, self.input_beta = input_alpha, input_beta

    # -- thresholds -----------------------------------------------------------------------------------

    def input_thresholds(self):
        """(alpha, beta) of the ternary input quantizer (scalars or (C,) vectors), None otherwise."""
        if self.input_threshold is None:
            return None
        if self.input_threshold == "learned":
            return self.input_alpha[...], self.input_beta[...]
        return jnp.float32(self.input_delta), jnp.float32(-self.input_delta)

    def kernel_thresholds(self):
        """(alpha, beta) of the ternary kernel quantizer (scalars or (N,) vectors), None otherwise."""
        if self.kernel_threshold is None:
            return None
        w = self.kernel[...]
        if self.kernel_threshold == "twn":
            return q.twn_thresholds(w, self.kernel_delta, per_channel=False)
        if self.kernel_threshold == "twn_channel":
            return q.twn_thresholds(w, self.kernel_delta, per_channel=True)
        if self.kernel_threshold == "fixed":
            return jnp.float32(self.kernel_delta), jnp.float32(-self.kernel_delta)
        return self.kernel_alpha[...], self.kernel_beta[...]

    # -- operands -------------------------------------------------------------------------------------

    def quantize_input(self, x: jax.Array) -> jax.Array:
        """The activation operand: ±1, {-1,0,1}, or float (hard_tanh / identity)."""
        if self.input_quantizer is None:
            return x
        fn = q.get_quantizer(self.input_quantizer).fn
        if self.input_threshold is not None:
            alpha, beta = self.input_thresholds()
            return fn(x, alpha, beta)
        return fn(x)

    def quantized_kernel(self) -> jax.Array:
        """The weight operand in the layout of ``kernel``: ±1, {-1,0,1} (unscaled), or the float kernel."""
        w = self.kernel[...]
        if self.kernel_quantizer is None:
            return w
        fn = q.get_quantizer(self.kernel_quantizer).fn
        if self.kernel_threshold is not None:
            alpha, beta = self.kernel_thresholds()
            return fn(w, alpha, beta)
        return fn(w)

    def kernel_scale(self, w_quantized: jax.Array | None = None) -> jax.Array | None:
        """Per-output-channel XNOR alpha (N,), applied after the integer dot product; None when off."""
        if not self.xnor_scaling:
            return None
        w = self.kernel[...]
        if self.kernel_threshold is not None:
            w_q = self.quantized_kernel() if w_quantized is None else w_quantized
            return q.ternary_weight_scale(w, w_q)
        return q.xnor_weight_scale(w)

    def quantize_integers(self, z: jax.Array, bn: nnx.BatchNorm, producer: "_QuantizedOperands | None" = None):
        """This layer's quantized input from integer pre-activations `z` (B, ..., C), through the batch norm
        `bn` (and `producer`'s XNOR scale and bias before it): the eval forward's quantizer.

        The bits come from comparing `z` with the integer thresholds of `jaxbnn.thresholds` (the exact
        batch norm of each integer), the ones the exporter writes, so eval, export and every platform agree
        at ties, NaNs and infinities. The thresholds are derived on the host (`jax.pure_callback`)."""
        act = MODES[self.mode][0]
        if act not in ("binary", "ternary"):
            raise ValueError(f"a {self.mode} layer does not quantize its input")
        chain = chain_parameters(bn, producer)
        z = jnp.round(z).astype(jnp.int32)  # integers in float32; round() absorbs any conv algorithm's error
        if act == "binary":
            return jnp.where(_threshold_bits(z, chain, bn.epsilon, jnp.zeros((), jnp.float32), False),
                             jnp.float32(1.0), jnp.float32(-1.0))
        alpha, beta = (ternary_levels(v, z.shape[1:]) for v in self.input_thresholds())
        pos = _threshold_bits(z, chain, bn.epsilon, alpha, True)
        nonneg = _threshold_bits(z, chain, bn.epsilon, beta, False)
        nonneg = jnp.where(*formats.same_rank(thresholds.ternary_levels_cross(alpha, beta), pos, nonneg))
        return nonneg.astype(jnp.float32) + pos.astype(jnp.float32) - 1.0

    def _epilogue(self, y, input_scale):
        scale = self.kernel_scale()
        if scale is not None:
            y = jnp.multiply(*formats.same_rank(y, scale))
        if input_scale is not None:
            y = jnp.multiply(*formats.same_rank(y, input_scale))
        if self.bias is not None:
            y = jnp.add(*formats.same_rank(y, self.bias[...]))
        return y


class BinaryLinear(_QuantizedOperands):
    """y = q_in(x) @ q_w(W) (then XNOR alpha, K, bias if enabled). Kernel (in_features, out_features).

    Without bias by default: the batch norm that follows absorbs it (TCBNN section 6.1).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        mode: str = "bnn",
        input_quantizer: str | None = None,
        kernel_quantizer: str | None = None,
        xnor_scaling: bool = False,
        input_scaling: bool = False,
        kernel_clip: float | None = 1.0,
        kernel_threshold: str = "twn",
        kernel_delta: float = 0.7,
        input_threshold: str = "fixed",
        input_delta: float = 0.5,
        use_bias: bool = False,
        rngs: nnx.Rngs,
    ):
        self._setup_quantization(
            mode=mode, in_features=in_features, out_features=out_features,
            kernel_shape=(in_features, out_features), input_quantizer=input_quantizer,
            kernel_quantizer=kernel_quantizer, xnor_scaling=xnor_scaling, input_scaling=input_scaling,
            kernel_clip=kernel_clip, kernel_threshold=kernel_threshold, kernel_delta=kernel_delta,
            input_threshold=input_threshold, input_delta=input_delta, use_bias=use_bias, rngs=rngs,
        )

    def dot(self, x: jax.Array, *, quantized: bool = False) -> jax.Array:
        """The dot product of the quantized operands, before any scale or bias (`quantized`: x already holds
        the quantized values, as the eval forward passes them)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"BinaryLinear expects {self.in_features} input features, got shape {x.shape}")
        x_q = x if quantized else self.quantize_input(x)
        return jax.lax.dot_general(x_q, self.quantized_kernel(), (((x.ndim - 1,), (0,)), ((), ())), precision=HIGHEST)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.dot(x)
        input_scale = q.xnor_input_scale_dense(x) if self.input_scaling else None
        return self._epilogue(y, input_scale)


class BinaryConv(_QuantizedOperands):
    """2-D convolution, NHWC input, HWIO kernel, of the quantized operands.

    The input is quantized first, then padded explicitly with ``padding_value``: "zero" pads with 0
    (out-of-frame taps contribute nothing), "one" pads with -1 (bit 0, docs/formats.md). The conv itself
    then runs VALID, so what the layer computes is exactly what ``bconv2d(pad_value=...)`` computes.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kernel_size: int | Sequence[int],
        strides: int | Sequence[int] = 1,
        *,
        padding: str | Sequence[tuple[int, int]] = "SAME",
        padding_value: str = "zero",
        mode: str = "bnn",
        input_quantizer: str | None = None,
        kernel_quantizer: str | None = None,
        xnor_scaling: bool = False,
        input_scaling: bool = False,
        kernel_clip: float | None = 1.0,
        kernel_threshold: str = "twn",
        kernel_delta: float = 0.7,
        input_threshold: str = "fixed",
        input_delta: float = 0.5,
        use_bias: bool = False,
        rngs: nnx.Rngs,
    ):
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.strides = _pair(strides, "strides")
        if isinstance(padding, str):
            if padding not in ("SAME", "VALID"):
                raise ValueError(f"padding must be 'SAME', 'VALID' or ((top, bottom), (left, right)); got {padding!r}")
            self.padding = padding
        else:
            self.padding = _explicit_padding(padding)
        if padding_value not in ("zero", "one"):
            raise ValueError(f"padding_value must be 'zero' or 'one', got {padding_value!r}")
        if padding_value == "one" and MODES.get(mode, ("",))[0] == "float":
            raise ValueError("padding_value 'one' (pad with -1) needs quantized activations")
        self.padding_value = padding_value
        kh, kw = self.kernel_size
        self._setup_quantization(
            mode=mode, in_features=in_features, out_features=out_features,
            kernel_shape=(kh, kw, in_features, out_features), input_quantizer=input_quantizer,
            kernel_quantizer=kernel_quantizer, xnor_scaling=xnor_scaling, input_scaling=input_scaling,
            kernel_clip=kernel_clip, kernel_threshold=kernel_threshold, kernel_delta=kernel_delta,
            input_threshold=input_threshold, input_delta=input_delta, use_bias=use_bias, rngs=rngs,
        )

    def explicit_padding(self, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """((top, bottom), (left, right)) for an input of this size."""
        if self.padding == "VALID":
            return (0, 0), (0, 0)
        if self.padding == "SAME":
            return (same_padding(height, self.kernel_size[0], self.strides[0]),
                    same_padding(width, self.kernel_size[1], self.strides[1]))
        return self.padding

    def dot(self, x: jax.Array, *, quantized: bool = False) -> jax.Array:
        """The convolution of the quantized operands, before any scale or bias (`quantized`: x already holds
        the quantized values, as the eval forward passes them)."""
        if x.ndim != 4 or x.shape[-1] != self.in_features:
            raise ValueError(f"BinaryConv expects NHWC input with {self.in_features} channels, got shape {x.shape}")
        pads = self.explicit_padding(x.shape[1], x.shape[2])
        x_q = x if quantized else self.quantize_input(x)
        fill = 0.0 if self.padding_value == "zero" else -1.0
        x_q = jnp.pad(x_q, ((0, 0), pads[0], pads[1], (0, 0)), constant_values=fill)
        kernel = self.quantized_kernel()
        dtype = jnp.promote_types(x_q.dtype, kernel.dtype)  # int8 levels, bfloat16: as dot_general promotes them
        return jax.lax.conv_general_dilated(
            x_q.astype(dtype), kernel.astype(dtype), self.strides, "VALID",
            dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=HIGHEST,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.dot(x)
        input_scale = None
        if self.input_scaling:
            pads = self.explicit_padding(x.shape[1], x.shape[2])
            input_scale = q.xnor_input_scale_conv(x, self.kernel_size, self.strides, pads)
        return self._epilogue(y, input_scale)


def chain_parameters(bn: nnx.BatchNorm, producer=None) -> tuple:
    """(mean, var, gamma, beta, alpha, bias) of the path from an integer through `producer`'s XNOR scale and
    bias to the batch-norm output (`thresholds.BnChain`'s fields); None where absent."""
    if bn.axis not in (-1, (-1,)):
        raise ValueError(f"batch norm over axis {bn.axis}: only the channel axis folds into thresholds")
    alpha = bias = None
    if producer is not None:
        alpha = producer.kernel_scale()
        bias = None if producer.bias is None else producer.bias[...]
    return (bn.mean[...], bn.var[...], None if bn.scale is None else bn.scale[...],
            None if bn.bias is None else bn.bias[...], alpha, bias)


def ternary_levels(values, sample_shape) -> jax.Array:
    """Ternary input thresholds as levels for pre-activations of per-sample shape `sample_shape`: one value,
    one per channel, or one per feature (a dense layer's per-input thresholds over its flattened input)."""
    values = jnp.asarray(values, jnp.float32).reshape(-1)
    if values.size == 1 or values.size == sample_shape[-1]:
        return jnp.broadcast_to(values, sample_shape[-1:])
    if values.size == math.prod(sample_shape):
        return values.reshape(sample_shape)
    raise ValueError(f"{values.size} ternary input thresholds do not fit pre-activations of shape {sample_shape}")


def _threshold_bits(z, chain, epsilon, level, strict):
    """Bits of int32 `z` (B, ..., C) through the integer thresholds of `chain` at `level` (host-derived)."""
    channels = z.shape[-1]
    shape = np.broadcast_shapes(level.shape, (channels,))
    present = tuple(a is not None for a in chain)
    arrays = [jnp.asarray(a, jnp.float32) for a in chain if a is not None]

    def host(level, *arrays):
        arrays = tuple(np.ascontiguousarray(a, np.float32) for a in (level, *arrays))
        key = (present, float(epsilon), bool(strict), tuple((a.shape, a.tobytes()) for a in arrays))
        return _host_thresholds(key)

    result = (jax.ShapeDtypeStruct(shape, jnp.int32), jax.ShapeDtypeStruct(shape, jnp.bool_))
    threshold, flip = jax.pure_callback(host, result, level, *arrays, vmap_method="sequential")
    z, threshold, flip = formats.same_rank(z, threshold, flip)
    return jnp.where(flip, z <= threshold, z >= threshold)


def classifier_logits(z, bn: nnx.BatchNorm, producer=None) -> jax.Array:
    """Eval-mode logits of the integer pre-activations `z` (B, C) through `producer`'s XNOR scale and bias and
    `bn`: ``float32(z) * scale + bias`` with `thresholds.classifier_affine`'s scale and bias (derived on the
    host), the product rounded before the sum, as the exported model's affine epilogue computes them: the
    same float32 logits on every platform, whatever XLA fuses. Differentiable in the parameters: the
    derivative is the float32 batch norm's."""
    chain = chain_parameters(bn, producer)
    present = tuple(a is not None for a in chain)
    arrays = [jnp.asarray(a, jnp.float32) for a in chain if a is not None]
    epsilon = float(bn.epsilon)

    def host(*arrays):
        arrays = tuple(np.ascontiguousarray(a, np.float32) for a in arrays)
        return _host_affine((present, epsilon, tuple((a.shape, a.tobytes()) for a in arrays)))

    result = (jax.ShapeDtypeStruct(z.shape[-1:], jnp.float32),) * 2

    @jax.custom_jvp
    def fold(*arrays):
        return jax.pure_callback(host, result, *arrays, vmap_method="sequential")

    @fold.defjvp
    def fold_jvp(primals, tangents):
        _, tangent = jax.jvp(lambda *a: _float32_affine(present, epsilon, a), primals, tangents)
        return fold(*primals), tangent

    scale, bias = fold(*arrays)
    z, scale, bias = formats.same_rank(z, scale, bias)
    product = z.astype(jnp.float32) * scale
    # a select on the product's own value between the product and the sum keeps XLA from contracting them
    # into a fused multiply-add, which rounds once
    return jnp.where(jnp.isnan(product), jnp.float32(jnp.nan), product) + bias


def _float32_affine(present, epsilon, arrays):
    """(scale, bias) of the classifier as the batch norm's float32 steps give them: the derivative of the fold."""
    values = iter(arrays)
    mean, var, gamma, beta, alpha, bias = (next(values) if p else None for p in present)
    mul = jax.lax.rsqrt(var + jnp.float32(epsilon)) * (1.0 if gamma is None else gamma)
    scale = jnp.broadcast_to(mul if alpha is None else alpha * mul, mean.shape)
    shift = ((0.0 if bias is None else bias) - mean) * mul + (0.0 if beta is None else beta)
    return scale, shift


def _decoded_chain(present, epsilon, arrays) -> thresholds.BnChain:
    values = iter(np.frombuffer(data, np.float32).reshape(shape) for shape, data in arrays)
    mean, var, gamma, beta, alpha, bias = (next(values) if p else None for p in present)
    return thresholds.BnChain(mean, var, epsilon, gamma, beta, alpha, bias)


@functools.lru_cache(maxsize=1024)
def _host_affine(key):
    """`thresholds.classifier_affine` of a chain given as bytes (derived once per eval loop)."""
    present, epsilon, arrays = key
    return thresholds.classifier_affine(_decoded_chain(present, epsilon, arrays))


@functools.lru_cache(maxsize=1024)
def _host_thresholds(key):
    """`thresholds.integer_thresholds` of a chain given as bytes: an eval loop over a test set derives each
    layer's thresholds once."""
    present, epsilon, strict, (level, *arrays) = key
    level = np.frombuffer(level[1], np.float32).reshape(level[0])
    return thresholds.integer_thresholds(_decoded_chain(present, epsilon, arrays), level, strict)


def _pair(value, name) -> tuple[int, int]:
    """A positive int, or a pair of them, as a pair."""
    values = (value, value) if not isinstance(value, (tuple, list)) else tuple(value)
    if len(values) != 2 or not all(_is_positive_int(v) for v in values):
        raise ValueError(f"{name} must be a positive int or a pair of them, got {value!r}")
    return tuple(int(v) for v in values)


def _explicit_padding(padding) -> tuple[tuple[int, int], tuple[int, int]]:
    """((top, bottom), (left, right)) of ints >= 0, or a ValueError naming the expected form."""
    def pair(value):
        return isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_int(p) and p >= 0 for p in value)

    if not (isinstance(padding, (tuple, list)) and len(padding) == 2 and all(pair(p) for p in padding)):
        raise ValueError("padding must be 'SAME', 'VALID' or ((top, bottom), (left, right)) of ints >= 0; got "
                         f"{padding!r}")
    return tuple((int(a), int(b)) for a, b in padding)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_positive_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and value > 0


def _positive_int(name, value) -> int:
    if not _is_positive_int(value):
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _check_delta(name, value) -> None:
    """A ternary threshold's delta (alpha = delta, beta = -delta, or TWN's factor of mean |w|): a finite number
    >= 0, so that alpha >= beta (a negative one would leave no zeros)."""
    if not (_is_real(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0 within float32's range, got {value!r}")


def _flag(name, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _is_real(value) -> bool:
    """A finite number that float32 holds: the layers keep their clips and deltas as float32."""
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, (bool, np.bool_)):
        return False
    try:
        with np.errstate(over="ignore"):
            return bool(np.isfinite(np.float32(value)))
    except OverflowError:  # a Python int past float's range
        return False


def clip_latent_weights(model: nnx.Module) -> None:
    """Clip the latent kernel of every binary/ternary layer to [-kernel_clip, kernel_clip], in place.

    Run after each optimizer step (BinaryConnect): latent weights far outside [-1, 1] could never flip.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"clip_latent_weights takes an nnx.Module, got {type(model).__name__}")
    for _, module in nnx.iter_modules(model):
        if isinstance(module, _QuantizedOperands) and module.kernel_clip is not None:
            if module.kernel_quantizer is not None:
                c = module.kernel_clip
                module.kernel[...] = jnp.clip(module.kernel[...], -c, c)


# --- drop-in lax-compatible functions ---------------------------------------------------------------


def _resolve(quantizer: str | Callable | None) -> Callable:
    if quantizer is None:
        return lambda v: v
    if callable(quantizer):
        return quantizer
    spec = q.get_quantizer(quantizer)
    if spec.domain == "ternary":
        raise ValueError(
            f"{quantizer!r} needs thresholds; pass a callable, e.g. functools.partial(ternarize_ste, alpha=.5, beta=-.5)"
        )
    return spec.fn


def make_binary_dot_general(lhs_quantizer: str | Callable | None = "sign_ste",
                            rhs_quantizer: str | Callable | None = "sign_ste") -> Callable:
    """A ``jax.lax.dot_general`` replacement that quantizes both operands first (at HIGHEST precision).

    Usable as ``nnx.Linear(..., dot_general=make_binary_dot_general())`` or in Linen's ``nn.Dense``.
    """
    quantize_lhs, quantize_rhs = _resolve(lhs_quantizer), _resolve(rhs_quantizer)

    def binary_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *,
                           out_sharding=None):
        del precision  # quantized products must be exact: always HIGHEST
        return jax.lax.dot_general(
            quantize_lhs(lhs), quantize_rhs(rhs), dimension_numbers, precision=HIGHEST,
            preferred_element_type=preferred_element_type, out_sharding=out_sharding,
        )

    return binary_dot_general


def make_binary_conv_general_dilated(lhs_quantizer: str | Callable | None = "sign_ste",
                                     rhs_quantizer: str | Callable | None = "sign_ste") -> Callable:
    """A ``jax.lax.conv_general_dilated`` replacement that quantizes input and kernel first.

    lax pads the quantized input with zeros, i.e. ``padding_value="zero"`` semantics.
    """
    quantize_lhs, quantize_rhs = _resolve(lhs_quantizer), _resolve(rhs_quantizer)

    def binary_conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                                    dimension_numbers=None, feature_group_count=1, batch_group_count=1,
                                    precision=None, preferred_element_type=None, out_sharding=None):
        del precision  # quantized products must be exact: always HIGHEST
        return jax.lax.conv_general_dilated(
            quantize_lhs(lhs), quantize_rhs(rhs), window_strides, padding, lhs_dilation=lhs_dilation,
            rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
            feature_group_count=feature_group_count, batch_group_count=batch_group_count, precision=HIGHEST,
            preferred_element_type=preferred_element_type, out_sharding=out_sharding,
        )

    return binary_conv_general_dilated


binary_dot_general = make_binary_dot_general()
binary_dot_general.__doc__ = (
    "``jax.lax.dot_general`` of sign_ste(lhs) and sign_ste(rhs) at HIGHEST precision, in lax's result type: exact "
    "where that type holds the sums (float32 up to 2**24 terms); with bfloat16, float16 or int8 operands pass "
    "``preferred_element_type`` (float32, int32), or the sums round or wrap as lax's do."
)
binary_conv_general_dilated = make_binary_conv_general_dilated()
binary_conv_general_dilated.__doc__ = (
    "``jax.lax.conv_general_dilated`` of sign_ste(lhs) and sign_ste(rhs) at HIGHEST precision, zero padding, in "
    "lax's result type: exact where that type holds the sums (float32 up to 2**24 terms); with bfloat16, float16 "
    "or int8 operands pass ``preferred_element_type`` (float32, int32), or the sums round or wrap as lax's do."
)
