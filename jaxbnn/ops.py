"""Public binary ops: argument checks, platform dispatch to the native kernels, vmap rules.

Every op validates shapes, dtypes and attributes here, before lowering, and raises `ValueError` /
`TypeError` with the offending name. On a platform with a registered native handler (`jaxbnn._ffi`) the
op lowers to that XLA FFI custom call; elsewhere it lowers to `jaxbnn.reference`, the spec the kernels are
tested against. Layouts: docs/formats.md; native contract: docs/ops.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxbnn import _ffi, formats, reference
from jaxbnn.formats import ConvBits, DenseBits

__all__ = ["pack_bits", "unpack_bits", "bmm", "bconv2d", "pool_threshold_bits"]


def pack_bits(x, threshold=None, flip=None):
    """Binarize `x` (bit = x >= threshold, or x <= threshold where flip; default threshold 0, so
    sign(0) = +1) and pack its last axis into uint32 words."""
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("pack_bits needs at least one axis to pack")
    channels = x.shape[-1]
    if threshold is not None:
        threshold = _vector("threshold", threshold, channels, None, allow_scalar=True)
    if flip is not None:
        flip = _vector("flip", flip, channels, jnp.bool_, allow_scalar=True)
    return formats.pack_bits(formats.binarize(x, threshold, flip))


def unpack_bits(words, k, dtype=jnp.float32):
    """±1 values `(..., k)` of packed words `(..., ceil(k/32))`."""
    k = _positive_int("k", k)
    words = _packed("words", words, min_rank=1)
    _check_words("words", words, k)
    return jnp.where(formats.unpack_bits(words, k), 1, -1).astype(dtype)


def bmm(a, b, k=None, *, n=None, b_popcount=None, scale=None, bias=None, threshold=None, flip=None):
    """±1 matrix product `a @ b.T` of packed operands, with a fused epilogue.

    a: packed activations uint32 `(..., M, ceil(k/32))`.
    b: weights, FSB tiles uint32 `(NT, KT, BH, BW/32)` (`n` rows; default NT*BH), a row-packed matrix
       uint32 `(N, ceil(k/32))`, or a `formats.DenseBits` (then `k`, `n`, `b_popcount` come from it).
    Epilogue: none -> int32 `(..., M, N)`; `scale`/`bias` -> float32 `scale * dot + bias`;
    `threshold`/`flip` -> packed bits uint32 `(..., M, ceil(N/32))` of `dot >= threshold`
    (`dot <= threshold` where flip).
    """
    if isinstance(b, DenseBits):
        k = b.k if k is None else k
        n = b.n if n is None else n
        b_popcount = b.popcount if b_popcount is None else b_popcount
        b = b.bits
    if k is None:
        raise ValueError("bmm needs k, the number of real bits per row")
    k = _positive_int("k", k)
    a = _packed("a", a, min_rank=2)
    _check_words("a", a, k)
    b, n = _weights_fsb("b", b, k, n)
    b_popcount = _popcount_or_derive("b_popcount", b_popcount, b, (n,))
    kind, epi = _epilogue(n, scale, bias, threshold, flip)

    out_cols, out_dtype = _epilogue_output(kind, n)
    rows = a.reshape(-1, a.shape[-1])  # batch dims fold into M: one kernel call
    if rows.shape[0] == 0:
        return jnp.zeros(a.shape[:-1] + (out_cols,), out_dtype)
    attrs = dict(k=np.int64(k), n=np.int64(n))

    def single(a2d, *weights):
        out_type = jax.ShapeDtypeStruct((a2d.shape[0], out_cols), out_dtype)
        return _dispatch(
            f"jaxbnn_bmm_{kind}",
            out_type,
            attrs,
            lambda a_, b_, _popc, *e: reference.bmm(a_, b_, k, n, **dict(zip(epi, e))),
            a2d,
            *weights,
        )

    out = _fold_rows(single)(rows, b, b_popcount, *epi.values())
    return out.reshape(a.shape[:-1] + out.shape[-1:])


def bconv2d(
    x,
    w,
    *,
    in_channels=None,
    kernel_size=None,
    out_channels=None,
    stride=1,
    padding="SAME",
    pad_value="zero",
    w_tap_popcount=None,
    pool=None,
    scale=None,
    bias=None,
    threshold=None,
    flip=None,
):
    """Binary 2-D convolution of a packed NHWC image, with optional fused max-pool and epilogue.

    x: uint32 `(..., B, H, W, ceil(C/32))`, packed along channels.
    w: FSB tiles of the conv bit matrix (docs/formats.md), a row-packed uint32 `(O, KH, KW, ceil(C/32))`,
       or a `formats.ConvBits` (then sizes and tap popcounts come from it).
    padding: "SAME", "VALID" or ((top, bottom), (left, right)). pad_value: "zero" (out-of-frame taps add
    nothing, as a float convolution with zero padding) or "one" (pad with -1, bit 0).
    pool: None or (PH, PW): max-pool of the dot products (window = stride, no padding) before the epilogue.
    Epilogues as in `bmm`; outputs `(..., B, OH, OW, O)` (int32 / float32) or `(..., B, OH, OW, ceil(O/32))`.
    """
    if isinstance(w, ConvBits):
        in_channels = w.in_channels if in_channels is None else in_channels
        kernel_size = w.kernel_size if kernel_size is None else kernel_size
        out_channels = w.out_channels if out_channels is None else out_channels
        w_tap_popcount = w.tap_popcount if w_tap_popcount is None else w_tap_popcount
        w = w.bits
    if in_channels is None:
        raise ValueError("bconv2d needs in_channels, the number of real channels of x")
    c = _positive_int("in_channels", in_channels)
    x = _packed("x", x, min_rank=4)
    _check_words("x", x, c)
    if kernel_size is None:
        raise ValueError("bconv2d needs kernel_size (KH, KW)")
    kh, kw = _pair("kernel_size", kernel_size)
    sh, sw = _pair("stride", stride)
    cw = formats.num_words(c)
    k_bits = kh * kw * cw * formats.WORD_BITS
    w = _packed("w", w, min_rank=2)
    if w.ndim == 4 and w.shape[1:] == (kh, kw, cw):  # row-packed (O, KH, KW, Cw)
        if out_channels is not None and out_channels != w.shape[0]:
            raise ValueError(f"out_channels={out_channels} but w has {w.shape[0]} output channels")
        out_channels = w.shape[0]
        w = w.reshape(out_channels, kh * kw * cw)
    w, o = _weights_fsb("w", w, k_bits, out_channels)
    h, wd = x.shape[-3:-1]
    (pt, pb), (pl, pr) = _conv_padding(padding, (h, wd), (kh, kw), (sh, sw))
    if pad_value not in ("zero", "one"):
        raise ValueError(f"pad_value must be 'zero' or 'one', got {pad_value!r}")
    oh, ow = (h + pt + pb - kh) // sh + 1, (wd + pl + pr - kw) // sw + 1
    if oh < 1 or ow < 1:
        raise ValueError(f"a {kh}x{kw} kernel does not fit the padded {h}x{wd} input")
    ph, pw = (1, 1) if pool is None else _pair("pool", pool)
    if oh < ph or ow < pw:
        raise ValueError(f"pool {pool} is larger than the {oh}x{ow} convolution output")
    conv_hw = (oh, ow)
    oh, ow = oh // ph, ow // pw
    if w_tap_popcount is None:
        rows = formats.from_fsb(w, o, k_bits).reshape(o, kh * kw, cw)
        w_tap_popcount = formats.popcount(rows).T
    w_tap_popcount = _int32_array("w_tap_popcount", w_tap_popcount, (kh * kw, o))
    kind, epi = _epilogue(o, scale, bias, threshold, flip)

    out_ch, out_dtype = _epilogue_output(kind, o)
    attrs = dict(
        c=np.int64(c), o=np.int64(o), kh=np.int64(kh), kw=np.int64(kw),
        stride_h=np.int64(sh), stride_w=np.int64(sw),
        pad_top=np.int64(pt), pad_bottom=np.int64(pb), pad_left=np.int64(pl), pad_right=np.int64(pr),
        pad_one=pad_value == "one", pool_h=np.int64(ph), pool_w=np.int64(pw),
    )  # fmt: skip
    images = x.reshape((-1,) + x.shape[-3:])  # batch dims fold into B: one kernel call
    if images.shape[0] == 0:
        return jnp.zeros(x.shape[:-3] + (oh, ow, out_ch), out_dtype)

    def single(x_, *weights):
        out_type = jax.ShapeDtypeStruct((x_.shape[0], oh, ow, out_ch), out_dtype)
        ref = lambda x_, w_, _popc, *e: reference.bconv2d(  # noqa: E731
            x_, w_, in_channels=c, out_channels=o, kernel_size=(kh, kw), stride=(sh, sw),
            padding=((pt, pb), (pl, pr)), pad_value=pad_value,
            pool=None if pool is None else (ph, pw), **dict(zip(epi, e)),
        )  # fmt: skip
        target = f"jaxbnn_bconv2d_{kind}"
        cuda = None
        if kind == "bits" and ph * pw > 1 and _ffi.has_target("cuda", target):
            # On CUDA, a pooled threshold convolution runs unpooled (the image-band and resident kernels take
            # no pool; the pooled tiles' staged epilogue ran VGG-16's 1_2 ~25x slower, docs/design/decisions.md)
            # and its bits are pooled after: the threshold test is monotone in the dot product,
            # so the bit of a window's max is the OR of the window's bits, and with `flip` their AND.
            unpooled = jax.ShapeDtypeStruct((x_.shape[0], *conv_hw, out_ch), out_dtype)
            flat = dict(attrs, pool_h=np.int64(1), pool_w=np.int64(1))
            cuda = lambda x_, *ws: pool_threshold_bits(  # noqa: E731
                jax.ffi.ffi_call(target, unpooled)(x_, *ws, **flat), (ph, pw), formats.pack_bits(ws[-1] != 0))
        return _dispatch(target, out_type, attrs, ref, x_, *weights, cuda=cuda)

    out = _fold_rows(single)(images, w, w_tap_popcount, *epi.values())
    return out.reshape(x.shape[:-3] + out.shape[1:])


def pool_threshold_bits(bits, pool, flip_words):
    """Max-pool of threshold bits over `pool` windows (window = stride, no padding; rows and columns past the
    last whole window dropped), as `bconv2d(..., pool=pool, threshold=..., flip=...)` pools its dots before
    the test: the threshold test is monotone in the dot, so a window's bit is the OR of its bits, or their
    AND in the columns whose bit is set in `flip_words` (there each bit is the test's complement).

    bits: uint32 `(B, H, W, words)`, an unpooled threshold output. flip_words: uint32 `(words,)`, the
    `flip` vector packed (`pack_bits`). Returns uint32 `(B, H // PH, W // PW, words)`.
    """
    bits = _packed("bits", bits, min_rank=4)
    if bits.ndim != 4:
        raise ValueError(f"bits must be (B, H, W, words), got shape {bits.shape}")
    ph, pw = _pair("pool", pool)
    b, h, w, words = bits.shape
    if h < ph or w < pw:
        raise ValueError(f"pool {pool} is larger than the {h}x{w} bits")
    flip_words = _packed("flip_words", flip_words, min_rank=1)
    if flip_words.shape != (words,):
        raise ValueError(f"flip_words must have shape ({words},), got {flip_words.shape}")
    windows = bits[:, : h // ph * ph, : w // pw * pw].reshape(b, h // ph, ph, w // pw, pw, words)
    parts = [windows[:, :, i, :, j] for i in range(ph) for j in range(pw)]
    any_set, all_set = functools.reduce(jnp.bitwise_or, parts), functools.reduce(jnp.bitwise_and, parts)
    return (any_set & ~flip_words) | (all_set & flip_words)


# --- dispatch -------------------------------------------------------------------------------------


def _dispatch(target, out_type, attrs, reference_fn, *operands, cuda=None):
    """Lower to the native handler of the platform the computation runs on, else to the reference.
    cuda: the CUDA branch, where it is not the handler alone."""
    native = lambda *ops: jax.ffi.ffi_call(target, out_type)(*ops, **attrs)  # noqa: E731
    branches = {p: native for p in ("cpu", "cuda") if _ffi.has_target(p, target)}
    if cuda is not None:
        branches["cuda"] = cuda
    if not branches:
        return reference_fn(*operands)
    return jax.lax.platform_dependent(*operands, default=reference_fn, **branches)


def _fold_rows(single):
    """Make `single(rows, *weights)` vmappable: a batch of `rows` only folds into its leading axis (one
    kernel call); batched weights fall back to a sequential map."""

    @jax.custom_batching.custom_vmap
    def call(rows, *weights):
        return single(rows, *weights)

    @call.def_vmap
    def _rule(axis_size, in_batched, rows, *weights):
        rows_batched, *weights_batched = in_batched
        if not any(weights_batched):
            rows = rows if rows_batched else jnp.broadcast_to(rows, (axis_size,) + rows.shape)
            out = call(rows.reshape((-1,) + rows.shape[2:]), *weights)
            return out.reshape((axis_size, rows.shape[1]) + out.shape[1:]), True
        args = [
            arg if batched else jnp.broadcast_to(arg, (axis_size,) + arg.shape)
            for arg, batched in zip((rows, *weights), in_batched)
        ]
        return jax.lax.map(lambda xs: call(*xs), args), True

    return call


# --- argument checks ------------------------------------------------------------------------------


def _positive_int(name, value):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _pair(name, value):
    values = (value, value) if isinstance(value, (int, np.integer)) else tuple(value)
    if len(values) != 2:
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
    return tuple(_positive_int(name, v) for v in values)


def _packed(name, value, min_rank):
    value = value if isinstance(value, jax.Array) else jnp.asarray(value)
    if value.dtype != formats.WORD_DTYPE:
        raise TypeError(f"{name} must hold packed uint32 words, got dtype {value.dtype}")
    if value.ndim < min_rank:
        raise ValueError(f"{name} must have rank >= {min_rank}, got shape {value.shape}")
    return value


def _check_words(name, value, k):
    if value.shape[-1] != formats.num_words(k):
        raise ValueError(
            f"{name} has {value.shape[-1]} words on its last axis, but {k} bits pack into "
            f"{formats.num_words(k)} words"
        )


def _weights_fsb(name, b, k, n):
    """FSB tiles (and the row count) of weights given as FSB tiles or as a row-packed matrix."""
    b = _packed(name, b, min_rank=2)
    if b.ndim == 2:
        _check_words(name, b, k)
        if n is not None and n != b.shape[0]:
            raise ValueError(f"n={n} but the row-packed {name} has {b.shape[0]} rows")
        return formats.to_fsb(b), b.shape[0]
    if b.ndim != 4:
        raise ValueError(f"{name} must be FSB tiles (NT, KT, BH, BW/32) or row-packed (N, Kw), got {b.shape}")
    nt, kt, bh, ww = b.shape
    if kt != -(-k // (ww * formats.WORD_BITS)):
        raise ValueError(f"FSB {name} of shape {b.shape} has {kt} tile columns, {k} bits need "
                         f"{-(-k // (ww * formats.WORD_BITS))}")  # fmt: skip
    n = nt * bh if n is None else _positive_int("n", n)
    if not (nt - 1) * bh < n <= nt * bh:
        raise ValueError(f"FSB {name} of shape {b.shape} holds {(nt - 1) * bh + 1}..{nt * bh} rows, not {n}")
    return b, n


def _popcount_or_derive(name, popc, fsb, shape):
    if popc is None:
        nt, kt, bh, ww = fsb.shape
        rows = fsb.transpose(0, 2, 1, 3).reshape(nt * bh, kt * ww)
        return formats.popcount(rows)[: shape[0]]
    return _int32_array(name, popc, shape)


def _int32_array(name, value, shape):
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {value.dtype}")
    if value.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {value.shape}")
    return value.astype(jnp.int32)


def _vector(name, value, n, dtype, allow_scalar=False):
    value = jnp.asarray(value)
    if allow_scalar and value.ndim == 0:
        value = jnp.broadcast_to(value, (n,))
    if value.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},), one value per output channel, got {value.shape}")
    return value if dtype is None else value.astype(dtype)


def _epilogue(n, scale, bias, threshold, flip):
    """(kind, operands) of the epilogue chosen by which parameters are given."""
    if threshold is not None:
        if scale is not None or bias is not None:
            raise ValueError("give either threshold/flip (packed output) or scale/bias (float output), not both")
        threshold = jnp.asarray(threshold)
        if not jnp.issubdtype(threshold.dtype, jnp.integer):
            raise TypeError(f"threshold must be integer (the dot products are integers), got {threshold.dtype}")
        threshold = _vector("threshold", threshold, n, jnp.int32)
        flip = jnp.zeros((n,), jnp.uint8) if flip is None else _vector("flip", flip, n, jnp.bool_).astype(jnp.uint8)
        return "bits", {"threshold": threshold, "flip": flip}
    if flip is not None:
        raise ValueError("flip only applies with a threshold")
    if scale is not None or bias is not None:
        scale = jnp.ones((n,), jnp.float32) if scale is None else _float_vector("scale", scale, n)
        bias = jnp.zeros((n,), jnp.float32) if bias is None else _float_vector("bias", bias, n)
        return "f32", {"scale": scale, "bias": bias}
    return "i32", {}


def _epilogue_output(kind, n):
    """(last-axis length, dtype) of an epilogue's output for n output channels."""
    if kind == "bits":
        return formats.num_words(n), jnp.uint32
    return n, {"i32": jnp.int32, "f32": jnp.float32}[kind]


def _float_vector(name, value, n):
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(f"{name} must be floating point, got {value.dtype}")
    return _vector(name, value, n, jnp.float32)


def _conv_padding(padding, size, kernel, stride):
    if isinstance(padding, str):
        mode = padding.upper()
        if mode == "VALID":
            return (0, 0), (0, 0)
        if mode == "SAME":
            pads = []
            for n, k, s in zip(size, kernel, stride):
                total = max((-(-n // s) - 1) * s + k - n, 0)
                pads.append((total // 2, total - total // 2))
            return tuple(pads)
        raise ValueError(f"padding must be 'SAME', 'VALID' or ((top, bottom), (left, right)), got {padding!r}")
    try:
        (pt, pb), (pl, pr) = padding
        pads = tuple(int(v) for v in (pt, pb, pl, pr))
    except (TypeError, ValueError):
        raise ValueError(f"padding must be 'SAME', 'VALID' or ((top, bottom), (left, right)), got {padding!r}")
    if min(pads) < 0:
        raise ValueError(f"padding must be non-negative, got {padding!r}")
    return (pads[0], pads[1]), (pads[2], pads[3])
