"""The pure-JAX definition of every jaxbnn op: the spec the native kernels are tested against.

Written for clarity, not speed: operands are unpacked to ±1 values and multiplied with XLA's int32
arithmetic, never through the bit tricks the kernels use. Integer dot products are exact on every
platform whatever algorithm XLA picks; a float convolution is not guaranteed to be (a backend may run it
in reduced precision or through a transform), so the convolution is a sum of per-tap int32 products.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxbnn import formats

__all__ = ["bmm", "bconv2d", "residual_epilogue", "image_matmul", "image_conv2d", "image_epilogue", "epilogue",
           "max_pool"]


def _signs(bits, dtype):
    return jnp.where(bits, 1, -1).astype(dtype)


def epilogue(dot, scale=None, bias=None, threshold=None, flip=None):
    """What an int32 dot product becomes: itself, `scale * dot + bias` (float32), or packed bits."""
    if threshold is not None:
        return formats.pack_bits(formats.binarize(dot, threshold, flip))
    if scale is not None:
        return dot.astype(jnp.float32) * scale + bias
    return dot


def max_pool(dot, pool):
    """Max over non-overlapping (PH, PW) windows of an NHWC int32 tensor (no padding, floor)."""
    ph, pw = pool
    b, h, w, o = dot.shape
    oh, ow = h // ph, w // pw
    dot = dot[:, : oh * ph, : ow * pw].reshape(b, oh, ph, ow, pw, o)
    return dot.max(axis=(2, 4))


def bmm(a, b, k, n, *, scale=None, bias=None, threshold=None, flip=None):
    """±1 matrix product of packed `a` (M, ceil(k/32)) and FSB-tiled `b` (n x k bits), then the epilogue."""
    a_signs = _signs(formats.unpack_bits(a, k), jnp.int32)
    b_signs = _signs(formats.unpack_bits(formats.from_fsb(b, n, k), k), jnp.int32)
    dot = jax.lax.dot_general(
        a_signs, b_signs, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32
    )
    return epilogue(dot, scale, bias, threshold, flip)


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
    pool=None,
    scale=None,
    bias=None,
    threshold=None,
    flip=None,
):
    """Binary convolution of a packed NHWC image with FSB-tiled weights, then pool and epilogue.

    `padding` is ((top, bottom), (left, right)). `pad_value` "zero": out-of-frame taps contribute 0, as a
    float convolution of ±1 values with zero padding; "one": the frame is padded with -1 (bit 0).
    The dot products are int32 sums, tap by tap, of int32 products of ±1 values: exact on every platform.
    """
    kh, kw = kernel_size
    sh, sw = stride
    c, o = in_channels, out_channels
    cw = formats.num_words(c)
    if pad_value not in ("zero", "one"):
        raise ValueError(f"pad_value must be 'zero' or 'one', got {pad_value!r}")
    x_signs = _signs(formats.unpack_bits(x, c), jnp.int32)
    taps = formats.from_fsb(w, o, kh * kw * cw * formats.WORD_BITS).reshape(o, kh, kw, cw)
    w_signs = _signs(formats.unpack_bits(taps, c), jnp.int32)  # (o, kh, kw, c)
    # "zero": out-of-frame taps add 0 * w = 0; "one": they are -1 inputs.
    x_signs = jnp.pad(x_signs, ((0, 0), *padding, (0, 0)), constant_values=-1 if pad_value == "one" else 0)
    b, hp, wp, _ = x_signs.shape
    oh, ow = (hp - kh) // sh + 1, (wp - kw) // sw + 1
    dot = jnp.zeros((b, oh, ow, o), jnp.int32)
    for i in range(kh):
        for j in range(kw):
            window = jax.lax.slice(x_signs, (0, i, j, 0), (b, i + sh * (oh - 1) + 1, j + sw * (ow - 1) + 1, c),
                                   (1, sh, sw, 1))  # fmt: skip
            dot = dot + jax.lax.dot_general(window, w_signs[:, i, j, :], (((3,), (1,)), ((), ())),
                                            preferred_element_type=jnp.int32)  # fmt: skip
    if pool is not None:
        dot = max_pool(dot, pool)
    return epilogue(dot, scale, bias, threshold, flip)


def residual_epilogue(dot, shortcut, *, stride, shift, threshold=None, flip=None):
    """A residual block's new stream from its second convolution's int32 dot products (B, OH, OW, O):
    `(dot >> shift) + shortcut[:, ::stride, ::stride, :]`, the shortcut's channels zero-padded to O (type A),
    in int32 arithmetic (wrapping); with `threshold` / `flip` (O,) also the stream's packed bits."""
    shortcut = shortcut[:, ::stride, ::stride, :]
    extra = dot.shape[-1] - shortcut.shape[-1]
    if extra:
        shortcut = jnp.pad(shortcut, ((0, 0), (0, 0), (0, 0), (0, extra)))
    stream = (dot >> shift) + shortcut
    if threshold is None:
        return stream
    return stream, formats.pack_bits(formats.binarize(stream, threshold, flip))


def image_matmul(levels, kernel):
    """int32 products of int8 image levels (M, K) with int8 weight values (K, N): exact integer arithmetic.

    The operands are widened to int32 first: XLA's GPU backend gave wrong int8 x int8 -> int32 products for a
    3x3 one-channel image convolution (K = 9) on an H200 (jax 0.11.2), while its int32 products are exact."""
    return jax.lax.dot_general(levels.astype(jnp.int32), kernel.astype(jnp.int32), (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.int32)


def image_conv2d(levels, kernel, *, stride, padding, pool=None, shift=0, threshold=None, flip=None):
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
    return image_epilogue(pre, pool=pool, shift=shift, threshold=threshold, flip=flip)


def image_epilogue(pre, *, pool=None, shift=0, threshold=None, flip=None):
    """What the first layer's int32 pre-activations (B, OH, OW, N) become: max-pooled over `pool` windows,
    then `pre >> shift` (an arithmetic shift: floor division by 2**shift), or with `threshold` (P, N) and
    `flip` (P, N) the packed bits of each of the P threshold planes, uint32 (B, OH', OW', P, ceil(N/32))."""
    if pool is not None:
        pre = max_pool(pre, pool)
    if threshold is None:
        return pre >> shift
    planes = [formats.pack_bits(formats.binarize(pre, t, f)) for t, f in zip(threshold, flip)]
    return jnp.stack(planes, axis=-2)
