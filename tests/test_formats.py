"""The packed formats: conventions, round trips, FSB tiles, ternary planes, popcounts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxbnn import formats

SETTINGS = settings(max_examples=20, deadline=None)


def random_bits(seed, shape):
    return np.random.default_rng(seed).integers(0, 2, shape).astype(bool)


def test_sign_of_zero_is_plus_one():
    assert formats.binarize(jnp.array([-0.5, 0.0, -0.0, 2.0])).tolist() == [False, True, True, True]


def test_threshold_and_flip_per_channel():
    x = jnp.array([[1.0, 1.0, 5.0, 5.0]])
    bits = formats.binarize(x, threshold=jnp.array([1.0, 2.0, 5.0, 4.0]), flip=jnp.array([0, 0, 1, 1]))
    assert bits.tolist() == [[True, False, True, False]]


def test_bit_order_is_lsb_first_with_zero_padding():
    bits = np.zeros(40, bool)
    bits[[0, 3, 31, 32, 39]] = True
    words = formats.pack_bits(bits)
    assert words.dtype == jnp.uint32
    assert words.tolist() == [(1 << 0) | (1 << 3) | (1 << 31), (1 << 0) | (1 << 7)]


def test_two_words_read_as_one_little_endian_uint64():
    bits = random_bits(1, 64)
    as64 = np.asarray(formats.pack_bits(bits)).view("<u8")[0]
    assert [(int(as64) >> j) & 1 for j in range(64)] == bits.astype(int).tolist()


@SETTINGS
@given(st.integers(1, 300), st.integers(1, 4), st.integers(0, 2**31))
def test_pack_unpack_round_trip(k, rows, seed):
    bits = random_bits(seed, (rows, k))
    words = formats.pack_bits(bits)
    assert words.shape == (rows, -(-k // 32))
    np.testing.assert_array_equal(formats.unpack_bits(words, k), bits)
    # padding bits are zero: the popcount of the words is the number of set bits
    np.testing.assert_array_equal(formats.popcount(words), bits.sum(-1))


@SETTINGS
@given(
    st.integers(1, 40),
    st.integers(1, 400),
    st.sampled_from([(8, 128), (1, 32), (4, 64), (16, 256), (3, 96)]),
    st.integers(0, 2**31),
)
def test_fsb_round_trip_any_tile(rows, k, tile, seed):
    words = formats.pack_bits(random_bits(seed, (rows, k)))
    tiles = formats.to_fsb(words, tile)
    assert tiles.shape == formats.fsb_shape(rows, k, tile)
    np.testing.assert_array_equal(formats.from_fsb(tiles, rows, k), words)
    # padding rows and padding bits are zero: no bit is gained or lost
    assert int(formats.popcount(tiles.reshape(-1))) == int(formats.popcount(words.reshape(-1)))


def test_fsb_tile_is_row_major_inside_and_across_tiles():
    rows, k = 16, 256
    words = jnp.arange(rows * k // 32, dtype=jnp.uint32).reshape(rows, k // 32)
    tiles = np.asarray(formats.to_fsb(words, (8, 128)))
    assert tiles.shape == (2, 2, 8, 4)
    # tile (1, 0), row 2, word 3 holds matrix row 8 + 2, word 0 * 4 + 3
    assert tiles[1, 0, 2, 3] == words[10, 3]
    # tile (0, 1) follows tile (0, 0) in memory: the tile columns of a row band are contiguous
    flat = tiles.reshape(-1)
    assert flat[32] == words[0, 4]


def test_fsb_rejects_bad_tiles():
    with pytest.raises(ValueError, match="multiple of 32"):
        formats.to_fsb(jnp.zeros((2, 2), jnp.uint32), (8, 100))
    with pytest.raises(ValueError, match="cannot hold"):
        formats.from_fsb(jnp.zeros((1, 1, 8, 4), jnp.uint32), 9, 128)


def test_unpack_rejects_wrong_word_count_and_dtype():
    with pytest.raises(ValueError, match="need 2 words"):
        formats.unpack_bits(jnp.zeros((3,), jnp.uint32), 40)
    with pytest.raises(TypeError, match="uint32"):
        formats.unpack_bits(jnp.zeros((2,), jnp.int32), 40)


@SETTINGS
@given(st.integers(1, 200), st.integers(0, 2**31))
def test_ternary_planes_round_trip(k, seed):
    x = np.random.default_rng(seed).integers(-1, 2, (3, k)).astype(np.float32)
    sign, nonzero = formats.pack_ternary(x)
    np.testing.assert_array_equal(formats.unpack_ternary(sign, nonzero, k), x)


def test_ternary_encoding_table():
    sign, nonzero = formats.ternary_planes(jnp.array([1.0, 0.0, -1.0]))
    assert list(zip(sign.tolist(), nonzero.tolist())) == [(False, True), (False, False), (True, True)]


@SETTINGS
@given(st.integers(1, 150), st.integers(0, 2**31))
def test_ternary_dot_from_and_popcounts(k, seed):
    rng = np.random.default_rng(seed)
    x, w = rng.integers(-1, 2, (2, k))
    sx, zx = (np.asarray(p) for p in formats.pack_ternary(x))
    sw, zw = (np.asarray(p) for p in formats.pack_ternary(w))
    popc = lambda v: int(formats.popcount(v))  # noqa: E731
    dot = popc(zx & zw) - 2 * popc(sx & zw) - 2 * popc(zx & sw) + 4 * popc(sx & sw)
    assert dot == int(x @ w)


def test_ternary_pm_planes_table():
    nonneg, pos = formats.ternary_pm_planes(jnp.array([1.0, 0.0, -1.0]))
    assert list(zip(nonneg.tolist(), pos.tolist())) == [(True, True), (True, False), (False, False)]


@SETTINGS
@given(st.integers(1, 150), st.integers(1, 9), st.integers(0, 2**31))
def test_ternary_weights_as_stacked_pm_planes(k, n, seed):
    """Ternary weights run as ±1 weights of 2N outputs whose halves sum to twice the ternary product."""
    rng = np.random.default_rng(seed)
    x, w = rng.integers(-1, 2, (3, k)).astype(np.float32), rng.integers(-1, 2, (k, n)).astype(np.float32)
    signs = np.asarray(formats.ternary_weight_signs(w))
    assert signs.shape == (k, 2 * n) and set(np.unique(signs)) <= {-1.0, 1.0}
    np.testing.assert_array_equal((signs[:, :n] + signs[:, n:]) / 2, w)
    np.testing.assert_array_equal(x @ signs[:, :n] + x @ signs[:, n:], 2 * (x @ w))


@SETTINGS
@given(st.integers(1, 300), st.integers(0, 2**31))
def test_and_popc_identity_with_zero_padding(k, seed):
    a, b = random_bits(seed, (2, k))
    pa, pb = formats.pack_bits(a), formats.pack_bits(b)
    popc = lambda v: int(formats.popcount(v))  # noqa: E731
    exact = int(np.where(a, 1, -1) @ np.where(b, 1, -1))
    assert k - 2 * popc(pa ^ pb) == exact
    assert k - 2 * popc(pa) - 2 * popc(pb) + 4 * popc(pa & pb) == exact


def test_dense_weights_layout_and_popcounts():
    w = np.random.default_rng(3).standard_normal((300, 20)).astype(np.float32)
    packed = formats.pack_dense_weights(w)
    assert (packed.k, packed.n) == (300, 20)
    assert packed.bits.shape == (3, 3, 8, 4)
    rows = formats.from_fsb(packed.bits, 20, 300)
    np.testing.assert_array_equal(formats.unpack_bits(rows, 300), (w >= 0).T)
    np.testing.assert_array_equal(packed.popcount, (w >= 0).sum(0))


def test_conv_weights_layout_and_tap_popcounts():
    kh, kw, c, o = 3, 2, 40, 5
    w = np.random.default_rng(4).standard_normal((kh, kw, c, o)).astype(np.float32)
    packed = formats.pack_conv_weights(w)
    cw = 2
    rows = np.asarray(formats.from_fsb(packed.bits, o, kh * kw * cw * 32)).reshape(o, kh, kw, cw)
    # bit c of tap (i, j) is reduction element ((i * KW + j) * Cw) * 32 + c
    np.testing.assert_array_equal(formats.unpack_bits(rows, c), np.transpose(w >= 0, (3, 0, 1, 2)))
    expected = np.transpose(w >= 0, (0, 1, 3, 2)).sum(-1).reshape(kh * kw, o)
    np.testing.assert_array_equal(packed.tap_popcount, expected)


@pytest.mark.parametrize("packer, shape", [
    (formats.pack_dense_weights, (300, 20)), (formats.pack_conv_weights, (3, 2, 40, 5)),
    (formats.pack_ternary_dense_weights, (70, 9)), (formats.pack_ternary_conv_weights, (3, 3, 33, 4)),
])  # fmt: skip
def test_packers_give_the_same_arrays_eagerly_and_in_nested_programs(packer, shape):
    """Eagerly a packer runs as one compiled program; under a trace it adds no call level of its own: XLA (CPU and
    CUDA) gets a bitcast comparison of a transposed constant wrong three calls deep, which a program packing a
    constant inside its own nested function would have reached."""
    w = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    w[0] = 0.0  # ties: sign(0) = +1, and 0 for ternary weights
    want = jax.tree.leaves(packer(w))
    inner = jax.jit(lambda w: packer(w))
    for got in (jax.jit(lambda: packer(w))(), jax.jit(lambda: inner(jnp.asarray(w)))(),
                jax.jit(lambda: jax.jit(lambda: inner(jnp.asarray(w)))())()):
        jax.tree.map(np.testing.assert_array_equal, jax.tree.leaves(got), want)


def test_packed_bits_the_same_eagerly_and_in_nested_programs():
    x = np.random.default_rng(6).standard_normal((37, 45)).astype(np.float32)
    want_bits = formats.pack_bits(formats.binarize(jnp.asarray(x).T))
    inner = jax.jit(lambda x: formats.pack_bits(formats.binarize(x.T)))
    np.testing.assert_array_equal(want_bits, formats.pack_bits((x >= 0).T))
    np.testing.assert_array_equal(jax.jit(lambda: inner(jnp.asarray(x)))(), want_bits)
    np.testing.assert_array_equal(formats.unpack_bits(want_bits, 37), (x >= 0).T)
    np.testing.assert_array_equal(jax.jit(lambda w: formats.unpack_bits(w, 37))(want_bits), (x >= 0).T)


# --- images: uint8 pixels, their int8 levels, float images quantized to pixels -----------------------------


def test_image_levels_are_the_pixels_less_128_as_int8():
    pixels = np.arange(256, dtype=np.uint8).reshape(4, 8, 8, 1)
    levels = formats.image_levels(pixels)
    assert levels.dtype == jnp.int8 and levels.shape == pixels.shape
    np.testing.assert_array_equal(np.asarray(levels).reshape(-1), np.arange(-128, 128))
    assert formats.PIXEL_OFFSET == 128 and int(formats.image_levels(np.uint8(128))) == 0  # "zero" padding
    np.testing.assert_array_equal(formats.image_levels(jnp.asarray(pixels)), levels)  # a device array
    np.testing.assert_array_equal(jax.jit(formats.image_levels)(pixels), levels)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.uint16, np.float16, np.float32, bool])
def test_image_levels_take_uint8_pixels_only(dtype):
    """Levels (int8), wider integers and floats are refused by name, never reinterpreted."""
    with pytest.raises(TypeError, match=rf"images must be uint8 pixels \(0..255\), got {np.dtype(dtype)}; float "
                                        r"images: formats.quantize_images\(images, input_range\)"):
        formats.image_levels(np.zeros((1, 2, 2, 1), dtype))


@pytest.mark.parametrize("input_range", [(-1.0, 1.0), (0.0, 1.0), (0.0, 255.0), (-0.5, 3.0), (-2.0, -1.0)])
def test_quantize_images_inverts_the_float_scale_of_every_pixel(input_range):
    """low + p * (high - low) / 255, computed in float32 as training computed it or in float64, gives p back
    for every pixel p."""
    low, high = input_range
    p = np.arange(256)
    in_float32 = p.astype(np.float32) * np.float32((high - low) / 255) + np.float32(low)
    in_float64 = low + p * (high - low) / 255
    for floats in (in_float32, in_float64, in_float64.astype(np.float32)):
        got = formats.quantize_images(floats, input_range)
        assert got.dtype == jnp.uint8
        np.testing.assert_array_equal(got, p)
    if input_range == (-1.0, 1.0):  # the default
        np.testing.assert_array_equal(formats.quantize_images(in_float32), p)


def test_quantize_images_rounds_half_to_even():
    """On the scale (0, 255) a float is its pixel value: ties at .5 go to the even pixel."""
    ties = np.array([0.5, 1.5, 2.5, 3.5, 126.5, 127.5, 253.5, 254.5], np.float32)
    np.testing.assert_array_equal(formats.quantize_images(ties, (0, 255)), [0, 2, 2, 4, 126, 128, 254, 254])
    near = np.array([0.49999997, 0.50000006, 2.4999998, 2.5000002], np.float32)
    np.testing.assert_array_equal(formats.quantize_images(near, (0, 255)), [0, 1, 2, 3])
    # the default scale: 0.0 is pixel 127.5, a tie, so 128; -0.0 the same
    np.testing.assert_array_equal(formats.quantize_images(np.array([0.0, -0.0], np.float32)), [128, 128])


def test_quantize_images_clips_and_maps_non_finite_values():
    x = np.array([-1.0, -1.5, -1e30, -np.inf, 1.0, 1.5, 1e30, np.inf, np.nan, -np.nan, 1e-45, -1e-45], np.float32)
    np.testing.assert_array_equal(formats.quantize_images(x), [0, 0, 0, 0, 255, 255, 255, 255, 0, 0, 128, 128])
    np.testing.assert_array_equal(jax.jit(formats.quantize_images)(x), formats.quantize_images(x))
    np.testing.assert_array_equal(formats.quantize_images(x.astype(np.float64)), formats.quantize_images(x))


def test_quantize_images_keeps_the_shape():
    x = np.random.default_rng(0).uniform(-1, 1, (3, 5, 4, 2)).astype(np.float32)
    got = formats.quantize_images(jnp.asarray(x))
    assert got.shape == x.shape and got.dtype == jnp.uint8
    np.testing.assert_array_equal(got, np.clip(np.round((x + 1) * np.float32(127.5)), 0, 255))


@pytest.mark.parametrize("input_range", [(1.0, -1.0), (0.0, 0.0), (float("nan"), 1.0), (0.0, float("inf")),
                                         (-float("inf"), 0.0)])
def test_quantize_images_refuses_an_invalid_range(input_range):
    with pytest.raises(ValueError, match=r"input_range must be \(low, high\), finite with low < high"):
        formats.quantize_images(np.zeros(3, np.float32), input_range)


@pytest.mark.parametrize("input_range", [(1.0, 2.0, 3.0), (1.0,), 1.0, ("a", "b")])
def test_quantize_images_refuses_a_range_of_other_than_two_numbers(input_range):
    with pytest.raises(ValueError, match=r"input_range must be \(low, high\), two numbers"):
        formats.quantize_images(np.zeros(3, np.float32), input_range)


@pytest.mark.parametrize("images", [np.array([0, 64, 255], np.uint8), np.array([True]), np.array([0.5 + 9j]),
                                    np.array(["0.5"]), np.array([1, 2], np.int32)])
def test_quantize_images_takes_float_images_only(images):
    with pytest.raises(TypeError, match="quantize_images takes float images"):
        formats.quantize_images(images)


@pytest.mark.parametrize("low, high", [(1.0, 1.0), (0, 0), (2.0, 1.0), (float("nan"), 1.0)])
def test_resolves_pixels_is_false_for_an_empty_or_reversed_range(low, high):
    assert formats.resolves_pixels(low, high) is False


@pytest.mark.parametrize("input_range", [(0.0, 5e-324), (0.0, 1e-45), (-1e308, 1e308), (-3e38, 3e38),
                                         (1e20, 1e20 + 1e6), (1000.0, 1000.001)])
def test_quantize_images_refuses_a_range_float32_does_not_resolve(input_range):
    """An infinite or zero float32 scale, or a range too narrow for its magnitude, would put the images on
    pixel 0 or 255."""
    assert not formats.resolves_pixels(*input_range)
    with pytest.raises(ValueError, match="is beyond float32"):
        formats.quantize_images(np.zeros(3, np.float32), input_range)
