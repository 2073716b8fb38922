"""Quantizers: plain JAX functions with surrogate ("straight-through") gradients.

Conventions (docs/formats.md): binarization is ``x >= 0 -> +1`` (sign(0) = +1); ternarization follows
TAB eq. 1 ("TAB: Unified and Optimized Ternary, Binary, and Mixed-precision Neural Network Inference on the
Edge", section 3.1.1): ``+1 if x > alpha, -1 if x < beta, 0 otherwise``, with alpha > beta.

Every quantizer is usable in any JAX code and is registered by name so that layers can select it
(``get_quantizer("sign_ste")``). The registry also records the value domain a quantizer produces
("binary" {-1,+1}, "ternary" {-1,0,+1}, "heaviside" {0,1}, "float"), which layers and the exporter check.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxbnn import formats

__all__ = [
    "binarize",
    "sign_ste",
    "approx_sign",
    "swish_sign",
    "ste_heaviside",
    "hard_tanh",
    "ternarize",
    "ternarize_ste",
    "twn_thresholds",
    "fixed_order_sum",
    "xnor_weight_scale",
    "ternary_weight_scale",
    "xnor_input_scale_dense",
    "xnor_input_scale_conv",
    "QuantizerSpec",
    "QUANTIZERS",
    "get_quantizer",
]


def binarize(x: jax.Array) -> jax.Array:
    """+1 where x >= 0, else -1, in x's dtype, with `formats.binarize`'s semantics on every platform (NaN
    -> -1, -0.0 -> +1, a negative subnormal -> -1). No gradient definition (use sign_ste for training)."""
    return jnp.where(formats.binarize(x), 1, -1).astype(x.dtype)


def ternarize(x: jax.Array, alpha, beta) -> jax.Array:
    """TAB eq. 1: +1 where x > alpha, else 0 where x >= beta, else -1 (alpha > beta; where learned thresholds
    cross, +1 above alpha and -1 at or below it). Forward only. Compared as `formats.binarize` compares: a float
    x with the thresholds converted to x's dtype, in IEEE order (subnormals are numbers on every platform); an
    integer x exactly. A comparison with NaN (in x or a threshold) is false, as through the exported integer
    thresholds: NaN x gives -1. In x's dtype, or for unsigned / bool x the signed type that holds both."""
    x = jnp.asarray(x)
    # host thresholds stay on the host (a 64-bit one is compared exactly, not narrowed to jax's 32 bits first);
    # formats' comparisons: the thresholds in x's dtype, subnormals compared as numbers on every platform
    # (XLA's CPU flushes them to zero in a float comparison, the GPU does not)
    above_alpha, at_most_alpha = formats._compare(x, _threshold_operand(alpha))
    at_least_beta, _ = formats._compare(x, _threshold_operand(beta))
    above_alpha, at_most_alpha, at_least_beta = formats.same_rank(above_alpha, at_most_alpha, at_least_beta)
    values = jnp.where(above_alpha & ~at_most_alpha, 1, jnp.where(at_least_beta, 0, -1))
    signed = jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.signedinteger)
    return values.astype(x.dtype if signed else jnp.promote_types(x.dtype, jnp.int8))  # -1 wraps in uint8


def _threshold_operand(t):
    return t if isinstance(t, jax.Array) else np.asarray(t)


# --- binary quantizers --------------------------------------------------------------------------------


@jax.custom_vjp
def sign_ste(x: jax.Array, clip_value: float = 1.0) -> jax.Array:
    """Binarize to ±1 (sign(0) = +1); gradient passes straight through where |x| <= clip_value.

    The clipped identity gradient is the derivative of hard_tanh (BinaryNet's STE). `clip_value` may be traced
    (an argument of a jitted function); it gets no gradient.
    """
    return binarize(x)


def _sign_ste_fwd(x, clip_value):
    return binarize(x), (x, clip_value)


def _clipped_identity_bwd(res, g):
    x, clip_value = res
    return jnp.where(jnp.abs(x) <= clip_value, g, jnp.zeros_like(g)), None


sign_ste.defvjp(_sign_ste_fwd, _clipped_identity_bwd)


@jax.custom_vjp
def approx_sign(x: jax.Array) -> jax.Array:
    """Bi-Real Net's ApproxSign: forward ±1, gradient 2 - 2|x| inside |x| <= 1 (the derivative of a piecewise
    quadratic)."""
    return binarize(x)


def _approx_sign_fwd(x):
    return binarize(x), x


def _approx_sign_bwd(x, g):
    slope = jnp.where(jnp.abs(x) <= 1.0, 2.0 - 2.0 * jnp.abs(x), 0.0).astype(g.dtype)
    return (g * slope,)


approx_sign.defvjp(_approx_sign_fwd, _approx_sign_bwd)


@jax.custom_vjp
def swish_sign(x: jax.Array, beta: float = 5.0) -> jax.Array:
    """BNN+ SwishSign: forward ±1, gradient of 2 sigmoid(beta x)(1 + beta x (1 - sigmoid(beta x))) - 1.
    `beta` may be traced; it gets no gradient."""
    return binarize(x)


def _swish_sign_fwd(x, beta):
    return binarize(x), (x, beta)


def _swish_sign_bwd(res, g):
    x, beta = res
    x = jnp.asarray(x)
    # at least float32 (cosh overflows float16 past 11), and 0 past |beta x| = 80, where the slope is below
    # 1e-32 and cosh(beta x) would overflow to inf / inf = NaN
    bx = beta * x.astype(jnp.promote_types(x.dtype, jnp.float32))
    steep = jnp.abs(bx) <= 80.0
    bx = jnp.where(steep, bx, 0.0)
    slope = jnp.where(steep, beta * (2.0 - bx * jnp.tanh(bx / 2.0)) / (1.0 + jnp.cosh(bx)), 0.0)
    return g * slope.astype(g.dtype), None


swish_sign.defvjp(_swish_sign_fwd, _swish_sign_bwd)


@jax.custom_vjp
def ste_heaviside(x: jax.Array, clip_value: float = 1.0) -> jax.Array:
    """Heaviside step to {0, 1} (x >= 0 -> 1, the same bit as binarize); STE gradient where |x| <= clip
    (`clip_value` may be traced; it gets no gradient)."""
    return _heaviside(x)


def _heaviside(x):
    x = jnp.asarray(x)
    return formats.binarize(x).astype(x.dtype)


def _ste_heaviside_fwd(x, clip_value):
    return _heaviside(x), (x, clip_value)


ste_heaviside.defvjp(_ste_heaviside_fwd, _clipped_identity_bwd)


def hard_tanh(x: jax.Array) -> jax.Array:
    """clip(x, -1, 1); its gradient is the STE mask |x| <= 1 (1 at +-1 too, where clip's would be 1/2)."""
    return jnp.where(jnp.abs(x) <= 1.0, x, jnp.sign(x))


# --- ternary ------------------------------------------------------------------------------------------


@jax.custom_vjp
def ternarize_ste(x: jax.Array, alpha, beta) -> jax.Array:
    """TAB eq. 1 ternarization with a straight-through backward.

    The backward treats each of the two steps (0 -> +1 at alpha, -1 -> 0 at beta) as a ramp of height 1
    and width 2 centred on its threshold, so

        d/dx     = (1[|x - alpha| <= 1] + 1[|x - beta| <= 1]) / 2
        d/dalpha = -1[|x - alpha| <= 1] / 2,   d/dbeta = -1[|x - beta| <= 1] / 2

    which makes learned thresholds trainable; with small symmetric thresholds d/dx is the usual clipped
    STE. ``alpha`` and ``beta`` broadcast against ``x`` (scalars, per-channel vectors, ...); their
    gradients are summed back to their own shapes.
    """
    return ternarize(x, alpha, beta)


def _ternarize_fwd(x, alpha, beta):
    return ternarize(x, alpha, beta), (x, alpha, beta)


def _reduce_to_shape(g, shape):
    """Sum a broadcast gradient back to the shape of the operand it came from."""
    shape = tuple(shape)
    lead = g.ndim - len(shape)
    g = g.sum(axis=tuple(range(lead))) if lead else g
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


def _ternarize_bwd(res, g):
    x, alpha, beta = res
    alpha, beta = jnp.asarray(alpha), jnp.asarray(beta)
    ranked_x, ranked_alpha, ranked_beta = formats.same_rank(x, alpha, beta)
    near_alpha = (jnp.abs(ranked_x - ranked_alpha) <= 1.0).astype(g.dtype)
    near_beta = (jnp.abs(ranked_x - ranked_beta) <= 1.0).astype(g.dtype)
    grad_x = _reduce_to_shape(0.5 * g * (near_alpha + near_beta), jnp.shape(x))
    grad_alpha = _reduce_to_shape(-0.5 * g * near_alpha, alpha.shape).astype(alpha.dtype)
    grad_beta = _reduce_to_shape(-0.5 * g * near_beta, beta.shape).astype(beta.dtype)
    return grad_x, grad_alpha, grad_beta


ternarize_ste.defvjp(_ternarize_fwd, _ternarize_bwd)


def twn_thresholds(w: jax.Array, factor: float = 0.7, per_channel: bool = False):
    """Ternary Weight Networks thresholds: alpha = factor * mean|w|, beta = -alpha.

    ``per_channel`` takes the mean over all axes but the last (the output channel of dense (K, N) and
    HWIO conv kernels), giving vectors of shape (N,); otherwise scalars. Gradients are stopped: the
    thresholds follow the weights, they are not trained through.
    """
    w = jax.lax.stop_gradient(_weights("twn_thresholds", w))
    n = math.prod(w.shape[:-1]) if per_channel else w.size
    alpha = fixed_order_sum(_mean_operand(w), per_channel) * jnp.asarray(factor / max(n, 1), _mean_dtype(w))
    alpha = alpha.astype(_mean_result_dtype(w))
    return alpha, -alpha


def _weights(name: str, w) -> jax.Array:
    w = jnp.asarray(w)
    if w.ndim == 0:
        raise ValueError(f"{name}: weights need at least one axis (the output channels last), got a scalar")
    if not (jnp.issubdtype(w.dtype, jnp.floating) or jnp.issubdtype(w.dtype, jnp.integer)):
        raise TypeError(f"{name}: weights must be real numbers, got dtype {w.dtype}")
    return w


def _mean_dtype(w):
    """The type a mean of |w| is summed in: at least float32 (a float16 sum overflows, an integer 1/n is 0)."""
    return jnp.promote_types(w.dtype, jnp.float32) if jnp.issubdtype(w.dtype, jnp.floating) else jnp.float32


def _mean_result_dtype(w):
    """A mean of |w| in w's float type (no larger than max |w|, it fits), float32 for integer weights."""
    return w.dtype if jnp.issubdtype(w.dtype, jnp.floating) else jnp.float32


def _mean_operand(w):
    return jnp.abs(w.astype(_mean_dtype(w)))


def fixed_order_sum(x: jax.Array, per_channel: bool = False) -> jax.Array:
    """The sum of ``x`` (per_channel: over all axes but the last, shape (N,)), added in one fixed order on every
    platform: pairwise, as explicit float adds of halves (padded with zeros to a power of two). XLA's reductions
    add in an order of the platform's choosing, so a threshold from ``jnp.mean`` differed by an ulp between the
    CPU and the GPU, and a weight equal to it ternarized differently (a random-init BTN ResNet-18's Flax forward,
    off by one in one channel on an H200). Differentiable, as the sum."""
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]) if per_channel else x.reshape(-1)
    if not per_channel:  # blocks of 1024: each level's adds run in parallel, not as one serial chain
        blocks = -(-rows.shape[0] // 1024) if rows.shape[0] else 1
        rows = jnp.pad(rows, (0, blocks * 1024 - rows.shape[0])).reshape(blocks, 1024)
        return _pairwise_leading_sum(_pairwise_leading_sum(rows))
    return _pairwise_leading_sum(rows)


def _pairwise_leading_sum(x: jax.Array) -> jax.Array:
    """Sum over the leading axis: halves added until one row is left (padded with zero rows to 2^k)."""
    size = 1 << max(x.shape[0] - 1, 0).bit_length()
    x = jnp.pad(x, [(0, size - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    while x.shape[0] > 1:
        x = x[: x.shape[0] // 2] + x[x.shape[0] // 2:]
    return x[0]


# --- XNOR-Net scaling -------------------------------------------------------------------------------------
# (section 2 of "Optimization of XNOR Convolution for Binary Convolutional Neural Networks on GPU")


def xnor_weight_scale(w: jax.Array) -> jax.Array:
    """Per-output-channel alpha = mean|W| over all axes but the last; shape (N,). Trained through. Summed in a
    fixed order (`fixed_order_sum`): the same float on every platform."""
    w = _weights("xnor_weight_scale", w)
    scale = fixed_order_sum(_mean_operand(w), per_channel=True) * jnp.asarray(
        1.0 / max(math.prod(w.shape[:-1]), 1), _mean_dtype(w))
    return scale.astype(_mean_result_dtype(w))


def ternary_weight_scale(w: jax.Array, w_ternary: jax.Array) -> jax.Array:
    """TWN scale per output channel: mean |w| over the entries whose `w_ternary` is non-zero; shape (N,). Summed in
    a fixed order (`fixed_order_sum`) and divided by the integer count correctly rounded: the same float on every
    platform."""
    w = _weights("ternary_weight_scale", w)
    axes = tuple(range(w.ndim - 1))
    nonzero = jax.lax.stop_gradient(jnp.asarray(w_ternary) != 0)
    kept = fixed_order_sum(jnp.where(nonzero, _mean_operand(w), 0), per_channel=True)  # inf * 0 would be NaN
    count = jnp.maximum(jnp.sum(nonzero, axis=axes, dtype=jnp.int32), 1)
    return _divide_by_count(kept, count).astype(_mean_result_dtype(w))


@jax.custom_jvp
def _divide_by_count(total, count):
    """`total / count` (count an int32 >= 1), correctly rounded on every platform. XLA's GPU divides float32 by
    an approximation (30000 / 300 gave 99.99999 on an H100), so a float32 quotient is formed here from integers
    (`_float32_quotient`); other float types divide as they are (their division is exact on both)."""
    if total.dtype != jnp.float32:
        return total / count.astype(total.dtype)
    return _float32_quotient(total, count)


@_divide_by_count.defjvp
def _divide_by_count_jvp(primals, tangents):
    total, count = primals
    return _divide_by_count(total, count), tangents[0] / count.astype(total.dtype)


def _float32_quotient(x, n):
    """float32 `x / n` rounded to nearest even, for int32 `n >= 1`, in integer operations only: x's significand
    m and exponent e (x = m 2^e), then the binary long division of m by n until the quotient Q holds 27 bits
    (the 24 kept, a guard bit and two more) and whether a remainder is left (the sticky bit), then the rounding
    at the ulp of the result's binade (or of the subnormals)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    sign, field = bits & jnp.uint32(0x80000000), (bits >> 23) & 0xFF
    m = jnp.where(field == 0, bits & 0x7FFFFF, (bits & 0x7FFFFF) | 0x800000)
    e = jnp.where(field == 0, -149, field.astype(jnp.int32) - 150)
    n = n.astype(jnp.uint32)
    q, r = m // n, m % n

    f = jnp.zeros_like(e)
    for _ in range(60):  # one more quotient bit while Q has fewer than 27 (m / n >= 2^-31: 58 steps at most);
        more = q < (1 << 26)  # unrolled, so that XLA fuses the steps into one elementwise pass
        r2 = r << 1  # r < n <= 2^31: no wrap
        bit = (r2 >= n) & more
        q = jnp.where(more, (q << 1) | bit.astype(jnp.uint32), q)
        r = jnp.where(more, r2 - jnp.where(bit, n, 0), r)
        f = f + more.astype(jnp.int32)
    exponent = e - f  # x / n = (q + r / n) 2^exponent, q in [2^26, 2^27) for m > 0
    ulp = jnp.maximum(exponent + 26 - 23, -149)
    shift = jnp.minimum(ulp - exponent, 28).astype(jnp.uint32)  # >= 3; q < 2^27 rounds to 0 past 28
    kept, low = q >> shift, q & ((jnp.uint32(1) << shift) - 1)
    half = jnp.uint32(1) << (shift - 1)
    up = (low > half) | ((low == half) & ((r != 0) | ((kept & 1) == 1)))
    significand = kept + up.astype(jnp.uint32)  # at most 2^24: its carry lands in the exponent field below
    magnitude = jnp.where(significand == 0, 0, ((ulp + 149).astype(jnp.uint32) << 23) + significand)
    magnitude = jnp.where(field == 0xFF, bits & 0x7FFFFFFF, jnp.where(m == 0, 0, magnitude))  # inf, NaN; zero
    return jax.lax.bitcast_convert_type(sign | magnitude, jnp.float32)


def _magnitudes(x) -> jax.Array:
    """|x| in a float: integers converted first (|int8(-128)|, a black pixel's level, wraps in int8)."""
    x = jnp.asarray(x)
    return jnp.abs(x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.float32))


def xnor_input_scale_dense(x: jax.Array) -> jax.Array:
    """XNOR-Net input scale for a dense layer: mean |x| over features, shape (..., 1)."""
    return jnp.mean(_magnitudes(x), axis=-1, keepdims=True)


def xnor_input_scale_conv(x: jax.Array, kernel_size, strides, padding) -> jax.Array:
    """XNOR-Net K map: channel mean of |x| (A), box-filtered by a kh x kw kernel of 1/(kh*kw).

    ``x`` NHWC; ``padding`` as for lax.conv_general_dilated (explicit pairs or "SAME"/"VALID").
    Returns (B, OH, OW, 1), aligned with the conv's output.
    """
    kh, kw = kernel_size
    mean_abs = jnp.mean(_magnitudes(x), axis=-1, keepdims=True)
    box = jnp.full((kh, kw, 1, 1), 1.0 / (kh * kw), dtype=mean_abs.dtype)  # a float: x may be integers
    return jax.lax.conv_general_dilated(
        mean_abs, box, tuple(strides), padding, dimension_numbers=("NHWC", "HWIO", "NHWC"),
        precision=jax.lax.Precision.HIGHEST,
    )


# --- registry -------------------------------------------------------------------------------------------


class QuantizerSpec(NamedTuple):
    fn: Callable
    domain: str  # "binary" {-1,+1}, "ternary" {-1,0,+1}, "heaviside" {0,1}, "float"


QUANTIZERS: dict[str, QuantizerSpec] = {
    "sign_ste": QuantizerSpec(sign_ste, "binary"),
    "approx_sign": QuantizerSpec(approx_sign, "binary"),
    "swish_sign": QuantizerSpec(swish_sign, "binary"),
    "ste_heaviside": QuantizerSpec(ste_heaviside, "heaviside"),
    "ternarize_ste": QuantizerSpec(ternarize_ste, "ternary"),
    "hard_tanh": QuantizerSpec(hard_tanh, "float"),
}


def get_quantizer(name: str) -> QuantizerSpec:
    try:
        return QUANTIZERS[name]
    except KeyError:
        raise ValueError(f"unknown quantizer {name!r}; known: {sorted(QUANTIZERS)}") from None
