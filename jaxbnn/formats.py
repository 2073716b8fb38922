"""The packed bit formats of jaxbnn, defined once (see docs/formats.md).

Everything that produces or consumes packed bits (exporter, ops, reference, kernels) goes through this
module; `xla_ffi/common/formats.h` mirrors its constants and a test checks that the two agree.

Conventions:
- a binary value +1 is bit 1, -1 is bit 0; binarization is `x >= 0` (sign(0) = +1, -0.0 -> +1, NaN -> -1);
- bits are packed along the last axis into uint32 words, least significant bit first, padding bits 0;
- weights are stored as FSB tiles (BH rows x BW bits, row-major inside and across tiles);
- a ternary value t is two ±1 planes of the same layout, nonneg [t >= 0] and pos [t > 0] (t is their
  mean): ternary activations travel as the pair of packed planes (`TernaryPlanes`); ternary weights are
  stored as the ±1 weights of twice the output rows, the nonneg plane's rows then the pos plane's
  (`TernaryDenseBits`, `TernaryConvBits`), which the ternary kernels read as they lie;
- TAB's (sign, non-zero) encoding of ternary values is defined too (`ternary_planes`), with the AND-popcount
  formula it gives.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

WORD_BITS = 32
WORD_DTYPE = jnp.uint32
FSB_TILE = (8, 128)  # (BH rows, BW bits): one TCBNN tile, one Hopper wgmma core matrix.

__all__ = [
    "PIXEL_OFFSET",
    "image_levels",
    "quantize_images",
    "resolves_pixels",
    "WORD_BITS",
    "WORD_DTYPE",
    "FSB_TILE",
    "num_words",
    "binarize",
    "pack_bits",
    "unpack_bits",
    "to_fsb",
    "from_fsb",
    "fsb_shape",
    "popcount",
    "ternary_planes",
    "pack_ternary",
    "unpack_ternary",
    "ternary_pm_planes",
    "ternary_weight_signs",
    "TernaryPlanes",
    "pack_ternary_pm_planes",
    "DenseBits",
    "ConvBits",
    "pack_dense_weights",
    "pack_conv_weights",
    "TernaryDenseBits",
    "TernaryConvBits",
    "pack_ternary_dense_weights",
    "pack_ternary_conv_weights",
    "ImageKernelMasks",
    "image_kernel_masks",
]


def host_or_device(value):
    """`value` where it is: a jax array as it is, anything else as a numpy array in the machine's byte order
    (`native_byte_order`; the dtype is otherwise kept as given, so that a wrong one is reported as it is)."""
    return value if isinstance(value, jax.Array) else native_byte_order(np.asarray(value))


def native_byte_order(value):
    """A numpy array in the other byte order converted to the machine's (jax refuses one); anything else (jax
    arrays, tracers, lists of them, array-likes) as it is."""
    if isinstance(value, np.ndarray) and not value.dtype.isnative:
        return value.astype(value.dtype.newbyteorder("="))
    return value


def same_rank(*arrays):
    """The arrays (numpy or jax) with unit axes in front up to the largest rank among them: numpy's broadcasting
    spelled out, so that the library's per-channel operations hold under jax_numpy_rank_promotion="raise"."""
    rank = max(np.ndim(a) for a in arrays)
    return tuple(a.reshape((1,) * (rank - np.ndim(a)) + np.shape(a)) if 0 < np.ndim(a) < rank else a for a in arrays)


# Every size, padding, stride, pool and extent fits int32, as the kernels' attributes and indices do (the ops'
# arguments and a packed graph's attributes).
MAX_EXTENT = 2**31 - 1

# int8 x int8 products reach 2**14 in magnitude: this many of them always sum within int32 (a first layer's
# products per output, `ops.image_conv2d` / `image_matmul` and the packed files).
MAX_IMAGE_REDUCTION = (2**31 - 1) // 2**14

PIXEL_OFFSET = 128  # pixel p enters a network as the integer level p - 128; level 0 (pixel 128) pads images


def image_levels(pixels):
    """int8 levels ``p - 128`` of uint8 pixels `p`: the integers every network computes on."""
    pixels = host_or_device(pixels)  # the dtype as given
    if pixels.dtype != np.uint8:
        raise TypeError(f"images must be uint8 pixels (0..255), got {pixels.dtype}; float images: "
                        "formats.quantize_images(images, input_range)")
    return (jnp.asarray(pixels).astype(jnp.int32) - PIXEL_OFFSET).astype(jnp.int8)


def quantize_images(images, input_range=(-1.0, 1.0)):
    """uint8 pixels of float images on the scale `input_range` = (low, high), the inverse of
    ``low + p * (high - low) / 255``: ``p = round((x - low) * (255 / (high - low)))`` in float32, half to
    even, clipped to [0, 255]; NaN gives 0. The same integers on every platform (a subtraction, one
    multiplication by a constant and a rounding to integers)."""
    try:
        low, high = (float(v) for v in input_range)
    except (TypeError, ValueError):
        raise ValueError(f"input_range must be (low, high), two numbers, got {input_range!r}") from None
    if not (np.isfinite(low) and np.isfinite(high) and low < high):
        raise ValueError(f"input_range must be (low, high), finite with low < high, got {input_range!r}")
    images = host_or_device(images)
    if not jnp.issubdtype(images.dtype, jnp.floating):
        raise TypeError(f"quantize_images takes float images, got {images.dtype}; uint8 pixels are the network's "
                        "input as they are")
    if not resolves_pixels(low, high):
        raise ValueError(f"input_range {input_range!r} is beyond float32: the floats of its pixels do not quantize "
                         "back to them")
    return _pixels_of_floats(jnp.asarray(images, jnp.float32), low=low, scale=255.0 / (high - low))


def resolves_pixels(low: float, high: float) -> bool:
    """Whether the floats of the pixels on the scale (low, high), low + p * (high - low) / 255 as float32 images
    hold them, quantize back to p = 0..255 in `quantize_images`' float32 arithmetic (its float32 low and scale
    255 / (high - low)). A range float32 cannot resolve (too narrow for its magnitude, too wide, or with an
    infinite or zero scale) would put most images on pixel 0 or 255."""
    def flushed(x):  # XLA's CPU computes float32 with subnormals flushed to zero
        return np.where(np.abs(x) < np.finfo(np.float32).tiny, np.float32(0), x)

    if not low < high:  # NaN included
        return False
    pixels = np.arange(256)
    with np.errstate(over="ignore", invalid="ignore"):
        low32, high32, scale32 = np.float32(low), np.float32(high), np.float32(255.0 / (high - low))
        if not (np.isfinite([low32, high32, scale32]).all() and scale32 > 0):
            return False
        floats = flushed((low + pixels * ((high - low) / 255)).astype(np.float32))
        back = np.clip(np.round(flushed(floats - flushed(low32)) * scale32), 0, 255)
    return bool(np.array_equal(back, pixels))


def _compiled_when_eager(fn=None, *, static_argnames=()):
    """`fn` run as one compiled program when called eagerly, where each of its jnp operations would otherwise
    compile on its own for every new shape (an export packs every layer's weights); inline when any argument is
    traced, so that it adds no call level to the caller's program: XLA (jax 0.10.2 and 0.11.2, CPU and CUDA)
    gives wrong bits for a bitcast comparison of a transposed constant three calls deep."""
    if fn is None:
        return functools.partial(_compiled_when_eager, static_argnames=static_argnames)
    compiled = jax.jit(fn, static_argnames=static_argnames)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        traced = any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((args, kwargs)))
        return (fn if traced else compiled)(*args, **kwargs)

    return call


@functools.partial(_compiled_when_eager, static_argnames=("low", "scale"))
def _pixels_of_floats(x, *, low: float, scale: float):
    """`quantize_images` of float32 `x`: one program when called eagerly, where op by op its seven operations would
    be seven dispatches (on an H100 host 726-973 us against 79-82 for the soak's batch of 8 images)."""
    scaled = jnp.round((x - np.float32(low)) * np.float32(scale))
    return jnp.where(jnp.isnan(x), 0, jnp.clip(scaled, 0, 255)).astype(jnp.uint8)


def num_words(k: int) -> int:
    """Number of uint32 words holding `k` packed bits."""
    return -(-int(k) // WORD_BITS)


def binarize(x, threshold=None, flip=None):
    """Bits of `x` (bool): `x >= threshold` (default 0, so sign(0) = +1), `x <= threshold` where `flip`.

    `threshold` and `flip` broadcast against `x` (per-channel vectors along the last axis). The comparison
    is exact in the operands' own dtypes, the same on every platform: host (numpy / Python) operands are
    compared on the host, so 64-bit values are never narrowed to jax's 32-bit types first (a 64-bit host `x`
    given with a device threshold or flip is compared on the host with their values; with a traced one it is
    refused with a TypeError); a bool `x` is the integer 0 / 1; integers of
    mixed jax dtypes are compared without wrapping, and an integer `x` with a float threshold exactly (not in
    a float that would round it); complex values are refused; a float `x` is compared with the threshold converted to
    `x`'s dtype, in IEEE order (subnormals are numbers, not zero, whatever the backend's flush mode).
    Special values (docs/formats.md): NaN gives bit 0 in either direction (every comparison with NaN is
    false), as does a NaN threshold; -0.0 == 0, so -0.0 gives bit 1; +inf gives 1 and -inf 0 against any
    finite threshold; a negative subnormal gives 0.
    """
    x, threshold, flip = (native_byte_order(v) for v in (x, threshold, flip))
    if _all_on_host(x) and not _all_on_host(threshold, flip) and _narrowed_by_jax(np.asarray(x).dtype):
        # a host x that jax would narrow (64-bit): compared on the host, with the device operands' values
        if any(isinstance(v, jax.core.Tracer) for v in (threshold, flip)):
            raise TypeError(f"binarize: a host x of dtype {np.asarray(x).dtype} would be narrowed to compare it with "
                            "a traced threshold or flip; give x as a jax array, or the threshold and flip as values")
        threshold, flip = (None if v is None else np.asarray(v) for v in (threshold, flip))
    if _all_on_host(x, threshold, flip):
        x = np.asarray(x)
        t = np.asarray(0 if threshold is None else threshold)
        _check_numeric("x", x)
        _check_numeric("threshold", t)
        if jnp.issubdtype(x.dtype, jnp.floating):
            t = t.astype(x.dtype)  # as on a device: the threshold in x's dtype
            at_least, at_most = x >= t, x <= t
        elif jnp.issubdtype(t.dtype, jnp.floating):  # numpy would round a 64-bit x to float64
            at_least, at_most = _compare_with_float_threshold(x.astype(np.uint8) if x.dtype == bool else x, t, np)
        else:
            at_least, at_most = x >= t, x <= t
        bits = at_least if flip is None else np.where(np.asarray(flip, bool), at_most, at_least)
        return jnp.asarray(bits)
    x = jnp.asarray(x)
    _check_numeric("x", x)
    at_least, at_most = _compare(x, 0 if threshold is None else threshold)
    if flip is None:
        return at_least
    return jnp.where(jnp.asarray(flip, bool), at_most, at_least)


def _all_on_host(*values) -> bool:
    return not any(isinstance(v, jax.Array) for v in values)


def _narrowed_by_jax(dtype) -> bool:
    """Whether jax would convert an array of `dtype` to a narrower type (64-bit ones, without jax_enable_x64)."""
    return jax.dtypes.canonicalize_dtype(dtype) != dtype


def _check_numeric(name, value) -> None:
    real_number = np.issubdtype(value.dtype, np.number) and not np.issubdtype(value.dtype, np.complexfloating)
    if not (real_number or jnp.issubdtype(value.dtype, jnp.floating) or value.dtype == bool):
        raise TypeError(f"binarize: {name} must be numeric (integers within 64 bits or floats), got dtype "
                        f"{value.dtype}")


def _compare(x, threshold):
    """(x >= threshold, x <= threshold) of a jax array `x`, exactly.

    jnp would promote mixed integer dtypes (int32 and uint32) to int64, which 32-bit jax narrows back to
    int32, and would narrow a host int64 threshold the same way: both wrap. Here an integer threshold is
    clipped into the range both dtypes share, and the thresholds outside it set the bits they decide
    (above every `x`: `>=` never holds, `<=` always does; below: the converse)."""
    if isinstance(threshold, jax.Array):
        t, xp = threshold, jnp
    else:
        t, xp = np.asarray(threshold), np
        _check_numeric("threshold", t)
    if x.dtype == bool:
        x = x.astype(jnp.uint8)  # 0 / 1, compared as an integer: a wide integer threshold is clipped, not wrapped
    if t.dtype == bool:
        t = t.astype(np.uint8)
    if jnp.issubdtype(x.dtype, jnp.floating):
        # in x's dtype, converted on the host for a host threshold: an int64 one is rounded, never wrapped
        t = jnp.asarray(t.astype(np.dtype(x.dtype)) if xp is np else t.astype(x.dtype))
        if jnp.finfo(x.dtype).bits < 16:  # float8 / float4 formats (some without infinities): exact in float32
            x, t = x.astype(jnp.float32), t.astype(jnp.float32)
        return _ordered_compare(x, t)
    if not jnp.issubdtype(t.dtype, jnp.integer):
        return _compare_with_float_threshold(x, t, xp)
    x, t = same_rank(x, t)
    if t.dtype == x.dtype:
        return x >= t, x <= t
    xi, ti = jnp.iinfo(x.dtype), np.iinfo(t.dtype)
    lo, hi = max(int(xi.min), int(ti.min)), min(int(xi.max), int(ti.max))
    above = t > xp.asarray(hi, t.dtype) if ti.max > hi else xp.zeros(t.shape, bool)
    below = t < xp.asarray(lo, t.dtype) if ti.min < lo else xp.zeros(t.shape, bool)
    clipped = xp.clip(t, xp.asarray(lo, t.dtype), xp.asarray(hi, t.dtype))
    clipped = jnp.asarray(clipped.astype(np.dtype(x.dtype)) if xp is np else clipped.astype(x.dtype))
    above, below = jnp.asarray(above), jnp.asarray(below)
    x, clipped, above, below = same_rank(x, clipped, above, below)
    at_least = jnp.where(above, False, jnp.where(below, True, x >= clipped))
    at_most = jnp.where(above, True, jnp.where(below, False, x <= clipped))
    return at_least, at_most


def _compare_with_float_threshold(x, t, xp):
    """(x >= t, x <= t) of an integer array `x` and a float threshold (numpy where `xp` is np), exactly:
    x >= t where x >= ceil(t), x <= t where x <= floor(t), both false where t is NaN. Promoting x to a float
    instead would round integers beyond the float's mantissa (int32 past 2**24 in float32). The rounded
    thresholds are compared in a float of at least 32 bits, which holds every threshold and the ends of x's
    range (powers of two) exactly, before any is converted to x's dtype."""
    t = t.astype(np.float64) if xp is np else t.astype(jnp.promote_types(t.dtype, jnp.float32))
    info = jnp.iinfo(x.dtype)
    low, past_high = float(info.min), float(info.max) + 1  # -2**(n-1) or 0, and 2**(n-1) or 2**n
    defined = ~xp.isnan(t)
    up, down = xp.ceil(t), xp.floor(t)
    up_above, up_below = up >= past_high, up <= low  # x >= t never holds; always holds
    down_above, down_below = down >= past_high, down < low  # x <= t always holds; never holds
    up_in = xp.where(defined & ~up_above & ~up_below, up, 0).astype(np.dtype(x.dtype))
    down_in = xp.where(defined & ~down_above & ~down_below, down, 0).astype(np.dtype(x.dtype))
    if isinstance(x, jax.Array):
        defined, up_above, up_below, down_above, down_below, up_in, down_in = map(
            jnp.asarray, (defined, up_above, up_below, down_above, down_below, up_in, down_in))
    x, defined, up_above, up_below, down_above, down_below, up_in, down_in = same_rank(
        x, defined, up_above, up_below, down_above, down_below, up_in, down_in)
    at_least = defined & ~up_above & (up_below | (x >= up_in))
    at_most = defined & ~down_below & (down_above | (x <= down_in))
    return at_least, at_most


@_compiled_when_eager
def _ordered_compare(x, t):
    """(x >= t, x <= t) of floats of one dtype in IEEE order (`_order_key`); false where either is NaN."""
    x, t = same_rank(x, t)
    (kx, x_nan), (kt, t_nan) = _order_key(x), _order_key(t)
    defined = ~(x_nan | t_nan)
    return defined & (kx >= kt), defined & (kx <= kt)


def _order_key(x):
    """(key, is_nan): a signed integer of x's width ordered as the float values are (-0.0 and +0.0 equal),
    and whether x is NaN, from x's bits alone.

    Float comparisons on XLA's CPU backend treat subnormal inputs as zero (its threads run with
    denormals-are-zero), on the GPU they do not: integer keys give IEEE order, subnormals included, on
    every platform and on the host alike. No float operation touches x here (the compiler could otherwise
    fold the bit arithmetic back into a float comparison, which the flush mode then changes)."""
    width = jnp.finfo(x.dtype).bits
    unsigned, signed = {16: (jnp.uint16, jnp.int16), 32: (jnp.uint32, jnp.int32), 64: (jnp.uint64, jnp.int64)}[width]
    infinity = int(np.array(np.inf, np.dtype(x.dtype)).view(np.dtype(unsigned)))
    bits = jax.lax.bitcast_convert_type(x, unsigned)
    sign = jnp.asarray(1 << (width - 1), unsigned)
    magnitude = bits & ~sign
    key = magnitude.astype(signed)
    return jnp.where((bits & sign) != 0, -key, key), magnitude > jnp.asarray(infinity, unsigned)


def pack_bits(bits):
    """Pack a boolean array along its last axis into uint32 words (LSB first, zero padding bits)."""
    return _packed_words(jnp.asarray(native_byte_order(bits), bool))


@_compiled_when_eager
def _packed_words(bits):
    k = bits.shape[-1]
    words = num_words(k)
    pad = words * WORD_BITS - k
    if pad:
        bits = jnp.pad(bits, [(0, 0)] * (bits.ndim - 1) + [(0, pad)])
    bits = bits.reshape(bits.shape[:-1] + (words, WORD_BITS)).astype(WORD_DTYPE)
    shifts = jnp.arange(WORD_BITS, dtype=WORD_DTYPE)
    # Distinct bit positions: the sum is the bitwise OR.
    return jnp.sum(jnp.left_shift(*same_rank(bits, shifts)), axis=-1, dtype=WORD_DTYPE)


def unpack_bits(words, k: int):
    """Inverse of `pack_bits`: boolean array `(..., k)` from uint32 words `(..., ceil(k/32))`."""
    words = jnp.asarray(native_byte_order(words))
    if words.dtype != WORD_DTYPE:
        raise TypeError(f"packed bits must be uint32 words, got {words.dtype}")
    if words.shape[-1] != num_words(k):
        raise ValueError(f"{k} bits need {num_words(k)} words, the array has {words.shape[-1]}")
    return _unpacked_bits(words, int(k))


@_compiled_when_eager(static_argnames="k")
def _unpacked_bits(words, k):
    shifts = jnp.arange(WORD_BITS, dtype=WORD_DTYPE)
    bits = jnp.right_shift(*same_rank(words[..., None], shifts)) & 1
    # explicit sizes: a -1 cannot be resolved when a batch axis is empty
    return bits.reshape(words.shape[:-1] + (words.shape[-1] * WORD_BITS,))[..., :k].astype(bool)


def fsb_shape(rows: int, k: int, tile=FSB_TILE) -> tuple[int, int, int, int]:
    """Shape of the FSB array of a `rows` x `k`-bit matrix."""
    bh, bw = _check_tile(tile)
    return (-(-rows // bh), -(-k // bw), bh, bw // WORD_BITS)


def to_fsb(words, tile=FSB_TILE):
    """FSB tiles `(ceil(R/BH), ceil(K/BW), BH, BW/32)` of a row-packed bit matrix `(R, Kw)`."""
    words = jnp.asarray(words, WORD_DTYPE)
    if words.ndim != 2:
        raise ValueError(f"to_fsb takes a row-packed matrix (R, Kw), got shape {words.shape}")
    bh, bw = _check_tile(tile)
    ww = bw // WORD_BITS
    rows, kw = words.shape
    rt, kt = -(-rows // bh), -(-kw // ww)
    words = jnp.pad(words, ((0, rt * bh - rows), (0, kt * ww - kw)))
    return words.reshape(rt, bh, kt, ww).transpose(0, 2, 1, 3)


def from_fsb(tiles, rows: int, k: int):
    """Row-packed matrix `(rows, ceil(k/32))` from FSB tiles (inverse of `to_fsb`)."""
    tiles = jnp.asarray(tiles)
    if tiles.ndim != 4:
        raise ValueError(f"FSB tiles have rank 4 (RT, KT, BH, BW/32), got shape {tiles.shape}")
    rt, kt, bh, ww = tiles.shape
    if rt * bh < rows or kt * ww * WORD_BITS < k:
        raise ValueError(f"FSB tiles of shape {tiles.shape} cannot hold a {rows} x {k}-bit matrix")
    matrix = tiles.transpose(0, 2, 1, 3).reshape(rt * bh, kt * ww)
    return matrix[:rows, : num_words(k)]


def popcount(words, axis=-1):
    """Number of 1 bits, summed over `axis` (int32)."""
    counts = jax.lax.population_count(jnp.asarray(native_byte_order(words), WORD_DTYPE))
    return jnp.sum(counts, axis=axis, dtype=jnp.int32)  # int32 under jax_enable_x64 too


def ternary_planes(x):
    """(sign, nonzero) boolean planes of a ternary array with values in {-1, 0, +1}."""
    x = jnp.asarray(x)
    return x < 0, x != 0


def pack_ternary(x):
    """Packed (sign, nonzero) planes of a ternary array, each `(..., ceil(K/32))` uint32."""
    sign, nonzero = ternary_planes(x)
    return pack_bits(sign), pack_bits(nonzero)


def unpack_ternary(sign_words, nonzero_words, k: int, dtype=jnp.float32):
    """Ternary values `(..., k)` from packed planes; a set sign bit without its non-zero bit is invalid."""
    sign = unpack_bits(sign_words, k)
    nonzero = unpack_bits(nonzero_words, k)
    return (nonzero.astype(dtype) - 2 * (sign & nonzero).astype(dtype)).astype(dtype)


def ternary_pm_planes(x):
    """(nonneg, pos) boolean planes of a ternary array: the bits of the ±1 arrays a = [x >= 0] and b = [x > 0],
    whose mean is x, so a product with a ternary operand is the mean of two ±1 products."""
    x = jnp.asarray(x)
    return x >= 0, x > 0


def ternary_weight_signs(w):
    """The ±1 weights (..., 2N) that ternary weights (..., N) are stored and run as: the nonneg plane's
    output columns, then the pos plane's (one ±1 product whose two output halves sum to twice the ternary one)."""
    nonneg, pos = ternary_pm_planes(w)
    return jnp.where(jnp.concatenate([nonneg, pos], axis=-1), 1.0, -1.0).astype(jnp.float32)


class TernaryPlanes(NamedTuple):
    """Packed ternary activations: the planes of `ternary_pm_planes`, nonneg = [t >= 0] and pos = [t > 0],
    each packed like binary bits (uint32 words along the last axis, padding bits 0), of one shape. The ops
    read t = (a + b) / 2 from the ±1 values a, b of the two bits (a pos bit without its nonneg bit is 0)."""

    nonneg: Any
    pos: Any


def pack_ternary_pm_planes(x) -> TernaryPlanes:
    """The packed (nonneg, pos) planes of a ternary array (values by their sign: > 0 is +1, 0 is 0, < 0 is -1)."""
    nonneg, pos = ternary_pm_planes(x)
    return TernaryPlanes(pack_bits(nonneg), pack_bits(pos))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseBits:
    """Packed ±1 weights of a dense layer `y = x @ W`, W of shape (k, n).

    `bits`: FSB tiles of the (n, k) bit matrix (one row per output column); `popcount`: int32 (n,), the
    number of +1 entries of each output column (the AND-popc formula needs it).
    """

    bits: jax.Array
    popcount: jax.Array
    k: int = dataclasses.field(metadata=dict(static=True))
    n: int = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ConvBits:
    """Packed ±1 weights of a convolution with HWIO kernel (kh, kw, c, o).

    `bits`: FSB tiles of the (o, kh*kw*ceil(c/32)*32) bit matrix, reduction order (kh, kw, c) with each
    tap padded to whole words; `tap_popcount`: int32 (kh*kw, o), +1 entries per tap and output channel
    (the exact "zero" padding correction needs them).
    """

    bits: jax.Array
    tap_popcount: jax.Array
    kernel_size: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    in_channels: int = dataclasses.field(metadata=dict(static=True))
    out_channels: int = dataclasses.field(metadata=dict(static=True))


def pack_dense_weights(w, tile=FSB_TILE) -> DenseBits:
    """Binarize (sign(0) = +1) and pack float weights `(k, n)` of `y = x @ W`."""
    w = jnp.asarray(native_byte_order(w))
    if w.ndim != 2:
        raise ValueError(f"dense weights have shape (k, n), got {w.shape}")
    k, n = w.shape
    return DenseBits(*_packed_dense_arrays(w, _check_tile(tile), ternary=False), k=k, n=n)


def pack_conv_weights(w, tile=FSB_TILE) -> ConvBits:
    """Binarize (sign(0) = +1) and pack a float HWIO convolution kernel `(kh, kw, c, o)`."""
    w = jnp.asarray(native_byte_order(w))
    if w.ndim != 4:
        raise ValueError(f"convolution kernels have shape (kh, kw, c, o), got {w.shape}")
    kh, kw, c, o = w.shape
    return ConvBits(*_packed_conv_arrays(w, _check_tile(tile), ternary=False), kernel_size=(kh, kw),
                    in_channels=c, out_channels=o)


@_compiled_when_eager(static_argnames=("tile", "ternary"))
def _packed_dense_arrays(w, tile, ternary):
    """(FSB tiles, popcount) of `DenseBits`, of the ±1 weights of `ternary_weight_signs(w)` where `ternary`."""
    rows = pack_bits(binarize((ternary_weight_signs(w) if ternary else w).T))
    return to_fsb(rows, tile), popcount(rows)


@_compiled_when_eager(static_argnames=("tile", "ternary"))
def _packed_conv_arrays(w, tile, ternary):
    """(FSB tiles, tap popcounts) of `ConvBits`, of `ternary_weight_signs(w)` where `ternary`."""
    if ternary:
        w = ternary_weight_signs(w)
    kh, kw, _, o = w.shape
    taps = pack_bits(binarize(jnp.transpose(w, (3, 0, 1, 2))))  # (o, kh, kw, cw)
    tap_popcount = popcount(taps).reshape(o, kh * kw).T
    return to_fsb(taps.reshape(o, kh * kw * taps.shape[-1]), tile), tap_popcount


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TernaryDenseBits:
    """Packed ternary weights of a dense layer `y = x @ W`, W of shape (k, n) with values in {-1, 0, +1}.

    `bits`: FSB tiles of the (2n, k) bit matrix of `ternary_weight_signs(W)` (rows 0..n-1: the nonneg plane
    of each output column, rows n..2n-1: its pos plane), as a packed checkpoint stores ternary weights;
    `popcount`: int32 (2n,), the +1 count of each of those rows.
    """

    bits: jax.Array
    popcount: jax.Array
    k: int = dataclasses.field(metadata=dict(static=True))
    n: int = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TernaryConvBits:
    """Packed ternary weights of a convolution with HWIO kernel (kh, kw, c, o), values in {-1, 0, +1}.

    `bits`: FSB tiles of the (2o, kh*kw*ceil(c/32)*32) bit matrix of `ternary_weight_signs(W)` (the nonneg
    plane's o rows, then the pos plane's), in `ConvBits`' reduction order; `tap_popcount`: int32
    (kh*kw, 2o), +1 entries per tap and row.
    """

    bits: jax.Array
    tap_popcount: jax.Array
    kernel_size: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    in_channels: int = dataclasses.field(metadata=dict(static=True))
    out_channels: int = dataclasses.field(metadata=dict(static=True))


def pack_ternary_dense_weights(w, tile=FSB_TILE) -> TernaryDenseBits:
    """Pack ternary weights `(k, n)` of `y = x @ W` (values by their sign: > 0 is +1, 0 is 0, < 0 is -1)."""
    w = jnp.asarray(native_byte_order(w))
    if w.ndim != 2:
        raise ValueError(f"dense weights have shape (k, n), got {w.shape}")
    return TernaryDenseBits(*_packed_dense_arrays(w, _check_tile(tile), ternary=True), k=w.shape[0], n=w.shape[1])


def pack_ternary_conv_weights(w, tile=FSB_TILE) -> TernaryConvBits:
    """Pack a ternary HWIO convolution kernel `(kh, kw, c, o)` (values by their sign, as
    `pack_ternary_dense_weights`)."""
    w = jnp.asarray(native_byte_order(w))
    if w.ndim != 4:
        raise ValueError(f"convolution kernels have shape (kh, kw, c, o), got {w.shape}")
    kh, kw, c, o = w.shape
    return TernaryConvBits(*_packed_conv_arrays(w, _check_tile(tile), ternary=True), kernel_size=(kh, kw),
                           in_channels=c, out_channels=o)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ImageKernelMasks:
    """A first layer's int8 kernel of -1, 0 and +1, (K, N) with K = KH * KW * C in (dy, dx, c) order, as sign
    masks: the CPU's VNNI tier reads them instead of the kernel in a call of few gathered rows (a dense first
    layer at a small batch), an eighth (binary) or a quarter (ternary) of the kernel's bytes.

    `masks`: uint32 (P, ceil(K/4), ceil(N/16), 2), P = 1 for a binary kernel (plane [w = +1]) and 2 for a
    ternary one ([w = +1], [w = -1]); per reduction quad g and 16-column group j one 64-bit word as two
    uint32 (low, high), its bit 4 (col % 16) + e set where weight (4 g + e, col) is in the plane.
    `counts`: int32 (P, N), each column's weights in each plane. Build them with `image_kernel_masks`.
    """

    masks: jax.Array
    counts: jax.Array
    k: int = dataclasses.field(metadata=dict(static=True))
    n: int = dataclasses.field(metadata=dict(static=True))


def image_kernel_masks(kernel) -> ImageKernelMasks:
    """The sign masks of a first layer's int8 kernel, (K, N) or (KH, KW, C, N), whose every value is -1, 0 or
    +1 (a binary or ternary first layer's): one plane where no value is 0, two otherwise. Needs the kernel's
    values (not a traced array): build them once where the weights stay, as `jaxbnn.runtime` does at load."""
    if isinstance(kernel, jax.core.Tracer):
        raise TypeError("image_kernel_masks needs the kernel's values; build the masks outside jit")
    w = np.asarray(kernel)
    if w.dtype != np.int8 or w.ndim not in (2, 4):
        raise TypeError(f"kernel must be int8 of shape (K, N) or (KH, KW, C, N), got {w.dtype} {w.shape}")
    w = w.reshape(-1, w.shape[-1])
    k, n = w.shape
    if k < 1 or n < 1:
        raise ValueError(f"kernel must have at least one row and one column, got shape {w.shape}")
    if not np.isin(w, (-1, 0, 1)).all():
        raise ValueError("image_kernel_masks takes kernels of -1, 0 and +1 only (a binary or ternary first layer)")
    planes = [w == 1] if not (w == 0).any() else [w == 1, w == -1]
    quads, groups = -(-k // 4), -(-n // 16)
    masks = np.zeros((len(planes), quads, groups), np.uint64)
    for index, plane in enumerate(planes):
        padded = np.zeros((quads * 4, groups * 16), np.uint64)
        padded[:k, :n] = plane
        # (g, e, j, c) -> bit 4 c + e of word (g, j)
        bits = padded.reshape(quads, 4, groups, 16).transpose(0, 2, 3, 1).reshape(quads, groups, 64)
        masks[index] = (bits << np.arange(64, dtype=np.uint64)).sum(axis=-1, dtype=np.uint64)
    words = np.stack([masks & np.uint64(0xFFFFFFFF), masks >> np.uint64(32)], axis=-1).astype(np.uint32)
    counts = np.stack([plane.sum(axis=0) for plane in planes]).astype(np.int32)
    return ImageKernelMasks(jnp.asarray(words), jnp.asarray(counts), k=k, n=n)


def _check_tile(tile) -> tuple[int, int]:
    bh, bw = (int(v) for v in tile)
    if bh < 1 or bw < WORD_BITS or bw % WORD_BITS:
        raise ValueError(f"FSB tile (BH, BW) needs BH >= 1 and BW a positive multiple of 32, got {tile}")
    return bh, bw
