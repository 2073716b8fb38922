"""The pure-JAX definition of every jaxbnn op: the spec the native kernels are tested against.

Written for clarity, not speed: operands are unpacked to their values (±1, or -1, 0, +1 for ternary
operands: t = (a + b) / 2 of the ±1 values of its nonneg and pos planes) and multiplied with XLA's int32
arithmetic, never through the bit tricks the kernels use. Integer dot products are exact on every
platform whatever algorithm XLA picks; a float convolution is not guaranteed to be (a backend may run it
in reduced precision or through a transform), so the convolution is a sum of per-tap int32 products.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxbnn import formats

__all__ = ["bmm", "bconv2d", "residual_epilogue", "global_sum_bits", "image_matmul", "image_conv2d",
           "image_epilogue", "epilogue", "max_pool"]


def _signs(bits, dtype):
    return jnp.where(bits, 1, -1).astype(dtype)


def _values(x, k):
    """int32 values (..., k) of packed activations: ±1 of bits, or (a + b) / 2 of `formats.TernaryPlanes`."""
    if isinstance(x, formats.TernaryPlanes):
        return (_values(x.nonneg, k) + _values(x.pos, k)) // 2  # exact: the sum is even
    return _signs(formats.unpack_bits(x, k), jnp.int32)


def _weight_values(rows, k, ternary):
    """int32 values (n, k) of a row-packed weight matrix: ±1, or for ternary weights (2n rows, the nonneg
    plane's then the pos plane's) their mean."""
    if ternary:
        n = rows.shape[0] // 2
        return _values(formats.TernaryPlanes(rows[:n], rows[n:]), k)
    return _values(rows, k)


def epilogue(dot, scale=None, bias=None, threshold=None, flip=None):
    """What an int32 dot product becomes: itself, `scale * dot + bias` (float32, the product rounded before the
    sum; either one alone: the other 1 / +0.0, as the ops take them; a NaN result is a NaN, its sign and payload
    the platform's: docs/formats.md), or packed bits; with `threshold` / `flip` of shape (P, N), the packed bits
    of each of the P planes (..., P, ceil(N/32))."""
    if threshold is not None and jnp.ndim(threshold) == 2:  # every plane's words from one reduction, as one array
        return formats.pack_bits(formats.binarize(dot[..., None, :], threshold, flip))
    if threshold is not None:
        return formats.pack_bits(formats.binarize(dot, threshold, flip))
    if scale is not None or bias is not None:
        n = dot.shape[-1:]
        scale = jnp.ones(n, jnp.float32) if scale is None else scale
        bias = jnp.zeros(n, jnp.float32) if bias is None else bias
        # rounded twice, as the kernels round it. Compiled, a product whose one use is the sum would be contracted
        # into an FMA (XLA drops an optimization barrier before fusing): a select on the product's own value
        # between them, which no constant folds away, keeps it rounded (and a NaN a NaN).
        dot, scale, bias = formats.same_rank(dot, jnp.asarray(scale), jnp.asarray(bias))
        product = dot.astype(jnp.float32) * scale
        return jnp.where(jnp.isnan(product), jnp.float32(jnp.nan), product) + bias
    return dot


def max_pool(dot, pool):
    """Max over non-overlapping (PH, PW) windows of an NHWC tensor (no padding, floor)."""
    ph, pw = pool
    # a window reduction, not a reshape splitting H and W: under jax's explicit sharding a reshape needs its
    # output's sharding spelled out
    lowest = jnp.array(-jnp.inf if jnp.issubdtype(dot.dtype, jnp.floating) else
                       False if dot.dtype == jnp.bool_ else jnp.iinfo(dot.dtype).min, dot.dtype)
    return jax.lax.reduce_window(dot, lowest, jax.lax.max, (1, ph, pw, 1), (1, ph, pw, 1), "VALID")


def bmm(a, b, k, n, *, ternary_weights=False, scale=None, bias=None, threshold=None, flip=None):
    """Matrix product of packed `a` (M, ceil(k/32)) (or the `formats.TernaryPlanes` of ternary activations)
    and FSB-tiled `b` (n x k bits, or with `ternary_weights` the 2n rows of ternary weights), then the
    epilogue."""
    rows = 2 * n if ternary_weights else n
    b_values = _weight_values(formats.from_fsb(b, rows, k), k, ternary_weights)
    dot = jax.lax.dot_general(
        _values(a, k), b_values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32
    )
    return epilogue(dot, scale, bias, threshold, flip)


def bmm_chain(a, layers):
    """`bmm` layer after layer: `layers` a sequence of (b, k, n, epilogue keyword arguments)."""
    for b, k, n, epi in layers:
        a = bmm(a, b, k, n, **epi)
    return a


def bconv2d(
    x,
    w,
    *,
    in_channels,
    out_channels,
    kernel_size,
    stride,
    padding,
    pad_value,
    ternary_weights=False,
    pool=None,
    scale=None,
    bias=None,
    threshold=None,
    flip=None,
):
    """Convolution of a packed NHWC image (or the `formats.TernaryPlanes` of a ternary one) with FSB-tiled
    weights (with `ternary_weights`, the 2 * out_channels rows of ternary weights), then pool and epilogue.

    `padding` is ((top, bottom), (left, right)). `pad_value` "zero": out-of-frame taps contribute 0, as a
    float convolution with zero padding; "one": the frame is padded with -1 (bits 0).
    The dot products are int32 sums, tap by tap, of int32 products of the values: exact on every platform.
    """
    kh, kw = kernel_size
    sh, sw = stride
    c, o = in_channels, out_channels
    cw = formats.num_words(c)
    if pad_value not in ("zero", "one"):
        raise ValueError(f"pad_value must be 'zero' or 'one', got {pad_value!r}")
    x_values = _values(x, c)
    rows = 2 * o if ternary_weights else o
    taps = formats.from_fsb(w, rows, kh * kw * cw * formats.WORD_BITS).reshape(rows, kh * kw * cw)
    w_values = _weight_values(taps, kh * kw * cw * formats.WORD_BITS, ternary_weights)
    w_values = w_values.reshape(o, kh, kw, cw * formats.WORD_BITS)[..., :c]  # (o, kh, kw, c)
    # "zero": out-of-frame taps add 0 * w = 0; "one": they are -1 inputs.
    padding = tuple(tuple(int(v) for v in side) for side in padding)
    dot = _tap_products(x_values, w_values, padding, -1 if pad_value == "one" else 0, (sh, sw))
    if pool is not None:
        dot = max_pool(dot, pool)
    return epilogue(dot, scale, bias, threshold, flip)


@formats._compiled_when_eager(static_argnames=("padding", "pad", "stride"))
def _tap_products(x_values, w_values, padding, pad, stride):
    """int32 (B, OH, OW, O): the tap-by-tap sum of products of padded NHWC values and (O, KH, KW, C) weights."""
    x_values = jnp.pad(x_values, ((0, 0), *padding, (0, 0)), constant_values=pad)
    o, kh, kw, c = w_values.shape
    (sh, sw), (b, hp, wp, _) = stride, x_values.shape
    oh, ow = (hp - kh) // sh + 1, (wp - kw) // sw + 1
    dot = jnp.zeros((b, oh, ow, o), jnp.int32)
    for i in range(kh):
        for j in range(kw):
            window = jax.lax.slice(x_values, (0, i, j, 0), (b, i + sh * (oh - 1) + 1, j + sw * (ow - 1) + 1, c),
                                   (1, sh, sw, 1))  # fmt: skip
            dot = dot + jax.lax.dot_general(window, w_values[:, i, j, :], (((3,), (1,)), ((), ())),
                                            preferred_element_type=jnp.int32)  # fmt: skip
    return dot


def residual_epilogue(dot, shortcut, *, stride, shift, threshold=None, flip=None):
    """A residual block's new stream from its second convolution's int32 dot products (B, OH, OW, O):
    `(dot >> shift) + shortcut[:, ::stride, ::stride, :]`, the shortcut's channels zero-padded to O (type A),
    in the shortcut's integer type (int32 or int16; wrapping); with `threshold` / `flip` (O,) or (P, O) also the
    stream's packed bits, as `epilogue` writes them."""
    shortcut = shortcut[:, ::stride, ::stride, :]
    extra = dot.shape[-1] - shortcut.shape[-1]
    if extra:
        shortcut = jnp.pad(shortcut, ((0, 0), (0, 0), (0, 0), (0, extra)))
    stream = (dot >> shift).astype(shortcut.dtype) + shortcut
    if threshold is None:
        return stream
    return stream, epilogue(stream, threshold=threshold, flip=flip)


def global_sum_bits(stream, threshold, flip=None):
    """Global pooling of a stream (B, H, W, C), int16 or int32, into threshold planes: the int32 sum over the
    pixels of each image and channel (wrapping as int32 arithmetic does), then bits (B, P, ceil(C/32)) of
    `sum >= threshold[p]` (`<=` where flip[p]) for threshold and flip (P, C)."""
    total = jnp.sum(stream, axis=(1, 2), dtype=jnp.int32)
    return epilogue(total, threshold=threshold, flip=flip)


def image_matmul(levels, kernel):
    """int32 products of int8 image levels (M, K) with int8 weight values (K, N): exact integer arithmetic.

    The operands are widened to int32 first: XLA's GPU backend gave wrong int8 x int8 -> int32 products for a
    3x3 one-channel image convolution (K = 9) on an H200 (jax 0.11.2), while its int32 products are exact."""
    return jax.lax.dot_general(levels.astype(jnp.int32), kernel.astype(jnp.int32), (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.int32)


def image_conv2d(levels, kernel, *, stride, padding, pool=None, shift=0, threshold=None, flip=None,
                 out_dtype=jnp.int32, keep_stream=False):
    """Convolution of int8 image levels (B, H, W, C) with int8 weight values (KH, KW, C, N), zero padding
    (level 0), int32: the taps gathered along the channel axis (KH * KW * C per output pixel) and one exact
    integer product; then `image_epilogue`."""
    kh, kw, c, n = kernel.shape
    sh, sw = stride
    levels = jnp.pad(levels, ((0, 0), *padding, (0, 0)))
    b, hp, wp, _ = levels.shape
    oh, ow = (hp - kh) // sh + 1, (wp - kw) // sw + 1
    taps = [jax.lax.slice(levels, (0, i, j, 0), (b, i + sh * (oh - 1) + 1, j + sw * (ow - 1) + 1, c), (1, sh, sw, 1))
            for i in range(kh) for j in range(kw)]
    patches = jnp.concatenate(taps, axis=-1)  # (B, OH, OW, KH * KW * C), tap-major like the kernel's rows
    pre = jax.lax.dot_general(patches.astype(jnp.int32), kernel.reshape(kh * kw * c, n).astype(jnp.int32),
                              (((3,), (0,)), ((), ())), preferred_element_type=jnp.int32)  # int32: image_matmul
    return image_epilogue(pre, pool=pool, shift=shift, threshold=threshold, flip=flip, out_dtype=out_dtype,
                          keep_stream=keep_stream)


def image_epilogue(pre, *, pool=None, shift=0, threshold=None, flip=None, out_dtype=jnp.int32, keep_stream=False):
    """What the first layer's int32 pre-activations (B, OH, OW, N) become: max-pooled over `pool` windows,
    then the stream `pre >> shift` (an arithmetic shift: floor division by 2**shift) in `out_dtype` (int16: the
    low 16 bits, as `astype`); with `threshold` (P, N) and `flip` (P, N) the packed bits of each of the P
    threshold planes of the stream's values, uint32 (B, OH', OW', P, ceil(N/32)), or with `keep_stream` the
    pair (stream, bits)."""
    if pool is not None:
        pre = max_pool(pre, pool)
    stream = (pre >> shift).astype(out_dtype)
    if threshold is None:
        return stream
    if jnp.ndim(threshold) != 2:  # a plane's (N,) row would be taken for N planes of one threshold each
        raise ValueError(f"threshold must be (planes, N) = (P, {stream.shape[-1]}), got shape {jnp.shape(threshold)}")
    flip = [None] * len(threshold) if flip is None else flip  # no flip: every plane's bit is stream >= threshold
    bits = jnp.stack([formats.pack_bits(formats.binarize(stream, t, f)) for t, f in zip(threshold, flip)], axis=-2)
    return (stream, bits) if keep_stream else bits
