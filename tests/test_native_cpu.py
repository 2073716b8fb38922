"""The native CPU module jaxbnn._cpu: its format constants, every kernel ISA tier against the reference
(odd shapes, parallel sizes, other FSB tiles, garbage in padding bits), exact epilogues, and the FFI
handlers' own validation, exercised by calling jax.ffi.ffi_call directly with bad operands."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbnn import _cpu, formats, ops, reference  # the CPU module is part of every build: no skip
from numpy_spec import numpy_conv


# --- format constants -------------------------------------------------------------------------------


def test_native_format_constants_equal_jaxbnn_formats():
    native = _cpu.format_constants()
    assert native["word_bits"] == formats.WORD_BITS
    assert tuple(native["fsb_tile"]) == tuple(formats.FSB_TILE)
    first_element_only = formats.pack_bits(jnp.arange(formats.WORD_BITS) == 0)
    assert native["lsb_first"] == (int(first_element_only[0]) == 1)
    assert native["bit_plus_one"] == int(formats.binarize(jnp.float32(1.0)))
    assert native["bit_minus_one"] == int(formats.binarize(jnp.float32(-1.0)))
    values = jnp.array([1, 0, -1])
    sign, nonzero = formats.ternary_planes(values)
    assert native["ternary_sign_bit"] == {int(v): int(s) for v, s in zip(values, sign)}
    assert native["ternary_nonzero_bit"] == {int(v): int(z) for v, z in zip(values, nonzero)}


def test_isa_tiers_best_first_and_unknown_tier_refused():
    tiers = _cpu.supported_isas()
    assert tiers[-1] == "generic" and _cpu.active_isa() in tiers
    with pytest.raises(ValueError, match="unsupported kernel ISA tier 'sse9'"):
        _cpu.set_isa("sse9")


@pytest.fixture(params=_cpu.supported_isas())
def isa(request):
    """Runs the test once per kernel tier this CPU supports (AVX-512, AVX2, popcnt, generic)."""
    previous = _cpu.active_isa()
    _cpu.set_isa(request.param)
    yield request.param
    _cpu.set_isa(previous)


# --- helpers ----------------------------------------------------------------------------------------


def signs(rng, shape):
    return rng.choice(np.array([-1.0, 1.0], np.float32), shape)


def poison_row_padding(words, bits_per_row):
    """Set every padding bit of row-packed words (..., ceil(bits/32)) to 1."""
    words = np.array(words, np.uint32)
    if bits_per_row % 32:
        words[..., -1] |= np.uint32(~((1 << (bits_per_row % 32)) - 1) & 0xFFFFFFFF)
    return words


def poison_fsb_padding(tiles, rows, k_words):
    """Set every word of FSB tiles outside the rows x k_words matrix to all ones."""
    tiles = np.array(tiles, np.uint32)
    rt, kt, bh, ww = tiles.shape
    matrix = tiles.transpose(0, 2, 1, 3).reshape(rt * bh, kt * ww)
    matrix[rows:, :] = 0xFFFFFFFF
    matrix[:, k_words:] = 0xFFFFFFFF
    return matrix.reshape(rt, bh, kt, ww).transpose(0, 2, 1, 3).copy()


def epilogue_operands(rng, dots):
    """Random scale/bias, and thresholds that hit actual dot values so that ties (dot == threshold) occur."""
    n = dots.shape[-1]
    flat = np.asarray(dots).reshape(-1, n)
    threshold = np.where(rng.random(n) < 0.5, flat[rng.integers(0, flat.shape[0], n), np.arange(n)],
                         rng.integers(-50, 51, n)).astype(np.int32)  # fmt: skip
    return dict(
        scale=rng.standard_normal(n).astype(np.float32),
        bias=rng.standard_normal(n).astype(np.float32),
        threshold=threshold,
        flip=rng.random(n) < 0.5,
    )


def assert_all_epilogues(run, want_dots, epi):
    """`run(**epilogue)` equals the reference epilogue of `want_dots` for int32, affine and threshold."""
    dots = np.asarray(run())
    np.testing.assert_array_equal(dots, want_dots)
    affine = np.asarray(run(scale=epi["scale"], bias=epi["bias"]))
    # Exactly float(dot) * scale + bias in float32, two roundings (numpy does not fuse multiply-add).
    np.testing.assert_array_equal(affine, want_dots.astype(np.float32) * epi["scale"] + epi["bias"])
    bits = np.asarray(run(threshold=epi["threshold"], flip=epi["flip"]))
    want_bits = reference.epilogue(jnp.asarray(want_dots), threshold=epi["threshold"], flip=epi["flip"])
    np.testing.assert_array_equal(bits, np.asarray(want_bits))


# --- every tier against the reference ---------------------------------------------------------------

BMM_CASES = [
    # m, k, n, FSB tile: odd sizes, M = 1, K below one word, sizes that run on several threads
    (1, 1, 1, (8, 128)),
    (3, 31, 33, (8, 128)),
    (17, 200, 40, (8, 128)),
    (70, 257, 70, (16, 64)),
    (5, 1000, 9, (4, 256)),
    (300, 1500, 200, (8, 128)),
    (64, 4096, 96, (8, 32)),
    (40, 700, 65, (1, 32)),
    # K a multiple of 128 (the kernels' unmasked path): row groups with remainders, an odd number of 8-column
    # tile rows, one tile row, columns split over tasks (M = 100, K = 4096 runs as 4 panels x 2 column blocks)
    (45, 384, 40, (8, 128)),
    (33, 128, 8, (8, 128)),
    (100, 4096, 136, (8, 128)),
    # one row (a dense layer at batch 1) and 8n + 1 rows, whose last group is one row, over long reductions,
    # unmasked and masked
    (1, 4096, 24, (8, 128)),
    (9, 8392, 17, (8, 128)),
    # the AVX2 tier's table kernel (64 rows and more): one bit, one column; one word and a bit, a partial last pass
    (65, 1, 1, (8, 128)),
    (64, 33, 31, (1, 32)),
]


@pytest.mark.parametrize("m,k,n,tile", BMM_CASES)
def test_bmm_every_tier_matches_reference(isa, m, k, n, tile):
    rng = np.random.default_rng(m * 7919 + k * 31 + n)
    a_signs, w_signs = signs(rng, (m, k)), signs(rng, (n, k))
    a = ops.pack_bits(a_signs)
    rows = ops.pack_bits(w_signs)
    b = formats.to_fsb(rows, tile)
    want = (a_signs @ w_signs.T).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(reference.bmm(a, b, k, n)), want)  # the spec agrees with numpy
    popcount = formats.popcount(rows)
    run = lambda **epi: jax.jit(lambda a, b: ops.bmm(a, b, k, n=n, b_popcount=popcount, **epi))(a, b)  # noqa: E731
    assert_all_epilogues(run, want, epilogue_operands(rng, want))


# 32 chunks of 128 bits, unmasked; 66 chunks, the last one masked; 15 and 16 whole chunks and a half chunk (the
# AVX2 tier folds 15 chunks' byte counts pairwise and adds the half chunk's to the last group's)
@pytest.mark.parametrize("k", [4096, 8392, 1984, 2112])
def test_bmm_extreme_dots_over_long_reductions(isa, k):
    """Rows equal to every column and rows opposite to it: every bit of the reduction agrees or differs, the
    counts the kernels' partial sums must hold without wrapping (dots of exactly +k and -k)."""
    rng = np.random.default_rng(k)
    w_signs = signs(rng, (16, k))
    a_signs = np.concatenate([w_signs[:3], -w_signs[3:6]])
    rows = ops.pack_bits(w_signs)
    want = (a_signs @ w_signs.T).astype(np.int32)
    assert (np.diag(want[:3]) == k).all() and (np.diag(want[3:, 3:]) == -k).all()
    got = jax.jit(lambda a, b: ops.bmm(a, b, k, n=16, b_popcount=formats.popcount(rows)))(
        ops.pack_bits(a_signs), formats.to_fsb(rows, (8, 128)))
    np.testing.assert_array_equal(np.asarray(got), want)


# The AVX2 tier runs products of at least 64 rows on its table kernel (16-bit counts, up to 2,047 words = 65,504
# bits), past that on its panel kernel: rows equal and opposite to the columns give its counts' extremes.
@pytest.mark.parametrize("k", [1024, 8392, 65504, 65536])
def test_bmm_extreme_dots_of_many_rows(isa, k):
    """85 rows, each equal or opposite to one of 40 columns or to none: every bit of the reduction agrees or differs
    (dots of exactly +k and -k), in row groups of 4 with a remainder and a last pass of one 32-column group."""
    rng = np.random.default_rng(k + 1)
    w_signs = signs(rng, (40, k))
    a_signs = np.concatenate([w_signs, -w_signs, signs(rng, (5, k))])
    rows = ops.pack_bits(w_signs)
    want = (a_signs @ w_signs.T).astype(np.int32)
    assert (np.diag(want[:40]) == k).all() and (np.diag(want[40:80]) == -k).all()
    got = jax.jit(lambda a, b: ops.bmm(a, b, k, n=40, b_popcount=formats.popcount(rows)))(
        ops.pack_bits(a_signs), formats.to_fsb(rows, (8, 128)))
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("m", [9, 70])  # the AVX2 tier's panel kernel, then its table kernel
@pytest.mark.parametrize("k", [165, 96])  # padding bits in the last word; whole padding words in the last chunk
def test_bmm_ignores_garbage_in_padding_bits(isa, k, m):
    """Padding bits are 0 by the format; the kernels mask them anyway, so garbage cannot leak in."""
    rng = np.random.default_rng(11)
    n = 13
    a_signs, w_signs = signs(rng, (m, k)), signs(rng, (n, k))
    rows = ops.pack_bits(w_signs)
    a = poison_row_padding(ops.pack_bits(a_signs), k)
    b = poison_fsb_padding(formats.to_fsb(poison_row_padding(rows, k)), n, formats.num_words(k))
    got = jax.jit(lambda a, b: ops.bmm(a, b, k, n=n, b_popcount=formats.popcount(rows)))(a, b)
    np.testing.assert_array_equal(np.asarray(got), (a_signs @ w_signs.T).astype(np.int32))


CONV_CASES = [
    # b, h, w, c, o, kernel, stride, padding, pad_value, pool, FSB tile
    (2, 20, 20, 70, 50, (3, 3), 1, "SAME", "zero", None, (8, 128)),
    (1, 9, 7, 33, 17, (3, 3), 2, ((2, 0), (1, 3)), "one", (2, 2), (8, 128)),
    (3, 11, 13, 100, 40, (5, 5), 1, "SAME", "zero", (2, 2), (8, 128)),
    (2, 8, 8, 256, 64, (3, 3), 1, "SAME", "one", (1, 2), (16, 64)),
    (1, 5, 4, 31, 9, (1, 1), 1, "VALID", "zero", None, (8, 128)),
    (1, 6, 6, 3, 5, (7, 7), 1, "SAME", "zero", (3, 3), (4, 256)),
    (2, 10, 9, 64, 33, (3, 1), (2, 1), ((1, 1), (0, 0)), "zero", (2, 1), (1, 32)),
    # whole 128-bit chunks per tap (the kernels' unmasked path) with excluded taps, with and without pooling
    (2, 9, 11, 128, 24, (3, 3), 1, "SAME", "zero", (2, 2), (8, 128)),
    (1, 7, 7, 512, 40, (3, 3), 1, "SAME", "zero", None, (8, 128)),
    (3, 6, 5, 128, 8, (3, 3), 1, "SAME", "one", None, (8, 128)),
    # more columns than one 128-column strip of the epilogue, the last strip not a whole word, pooled
    (2, 6, 7, 40, 150, (3, 3), 1, "SAME", "zero", (2, 2), (8, 128)),
    # whole channel words, each receptive field in frame gathered run by run: runs of 3, 6, 9 and 25 words, rows
    # ending inside a chunk (3 x 3 fields of 1, 2, 4, 8 and 16 channel words take a form of their own)
    (2, 9, 8, 32, 20, (3, 3), 1, "SAME", "zero", (2, 2), (8, 128)),
    (1, 9, 10, 64, 24, (3, 3), 1, "SAME", "zero", (2, 2), (8, 128)),
    (2, 7, 8, 32, 9, (3, 3), 2, "SAME", "one", None, (8, 128)),
    (1, 7, 9, 96, 16, (3, 3), 1, "SAME", "one", None, (8, 128)),
    (1, 8, 8, 160, 12, (5, 5), 1, "SAME", "zero", None, (8, 128)),
    # short reductions (the AVX2 tier's lane kernel, which pools and corrects excluded taps itself): a kernel
    # taller than the image, one wider and taller over one channel, whole channel words strided and pooled
    (2, 2, 3, 20, 11, (3, 3), 1, "SAME", "zero", (1, 2), (8, 128)),
    (1, 3, 4, 1, 7, (5, 5), 1, "SAME", "zero", (2, 2), (8, 128)),
    (2, 9, 9, 32, 40, (3, 3), 2, "SAME", "zero", (2, 2), (8, 128)),
    # long reductions over enough rows for the lane kernel, its byte counts folded every 31 words: padding bits in
    # every tap, 9 tile rows of columns, pooled with zero padding
    (2, 10, 10, 100, 70, (3, 3), 1, "SAME", "zero", (2, 2), (8, 128)),
    # a reduction counted in blocks (135 words: 62, 62, 11) over runs of whole 3 x 3 windows (63 rows, the last run
    # shorter), "one" padding's corrections, columns past a whole tile
    (2, 12, 12, 480, 20, (3, 3), 1, "SAME", "one", (3, 3), (8, 128)),
    (1, 9, 9, 160, 24, (5, 5), 1, "SAME", "zero", (2, 2), (8, 128)),
]


def numpy_max_pool(dots, pool):
    if pool is None:
        return dots
    ph, pw = pool
    b, h, w, o = dots.shape
    oh, ow = h // ph, w // pw
    return dots[:, : oh * ph, : ow * pw].reshape(b, oh, ph, ow, pw, o).max(axis=(2, 4))


@pytest.mark.parametrize("b,h,w,c,o,kernel,stride,padding,pad_value,pool,tile", CONV_CASES)
def test_bconv2d_every_tier_matches_reference(isa, b, h, w, c, o, kernel, stride, padding, pad_value, pool, tile):
    rng = np.random.default_rng(b * 1009 + h * 101 + c * 7 + o)
    x_signs, w_signs = signs(rng, (b, h, w, c)), signs(rng, kernel + (c, o))
    stride = (stride, stride) if isinstance(stride, int) else stride
    pads = ops._conv_padding(padding, (h, w), kernel, stride)
    want = numpy_max_pool(numpy_conv(x_signs, w_signs, stride, pads, pad_value), pool)
    x = ops.pack_bits(x_signs)
    weights = formats.pack_conv_weights(w_signs, tile)
    spec = reference.bconv2d(x, weights.bits, in_channels=c, out_channels=o, kernel_size=kernel, stride=stride,
                             padding=pads, pad_value=pad_value, pool=pool)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(spec), want)  # the spec agrees with numpy

    def run(**epi):
        conv = lambda x: ops.bconv2d(x, weights, stride=stride, padding=padding, pad_value=pad_value, pool=pool, **epi)  # noqa: E731
        return jax.jit(conv)(x)

    assert_all_epilogues(run, want, epilogue_operands(rng, want))


# 31, 64, 96, 144 and 192 words: one run of byte counts, several, counted in blocks of 62 words (the last one whole
# or short); 193 words: past the AVX2 lane kernel's reductions
@pytest.mark.parametrize("c", [992, 2048, 3072, 4608, 6144, 6176])
def test_bconv2d_extreme_dots_over_long_reductions(isa, c):
    """Pixels equal to a column's weights and pixels opposite to them, over 64 rows (1 x 1 fields): every bit of
    the reduction agrees or differs (dots of exactly +c and -c)."""
    rng = np.random.default_rng(c)
    w_signs = signs(rng, (1, 1, c, 16))
    columns = w_signs[0, 0].T  # (16, c)
    pixels = np.stack([columns[p % 16] * (1 if p < 32 else -1) for p in range(64)])
    x_signs = pixels.reshape(1, 8, 8, c)
    want = numpy_conv(x_signs, w_signs, (1, 1), ((0, 0), (0, 0)), "zero")
    assert (want.reshape(64, 16)[np.arange(64), np.arange(64) % 16] == np.where(np.arange(64) < 32, c, -c)).all()
    got = jax.jit(lambda x: ops.bconv2d(x, formats.pack_conv_weights(w_signs), padding="VALID"))(ops.pack_bits(x_signs))
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("pad_value", ["zero", "one"])
# padding bits in each tap; whole padding words in the last chunk (its second half, or only its last word)
@pytest.mark.parametrize("c", [45, 64, 96, 150])
def test_bconv2d_ignores_garbage_in_channel_padding_bits(isa, pad_value, c):
    rng = np.random.default_rng(5)
    b, h, w, o, kernel = 2, 7, 6, 11, (3, 3)
    x_signs, w_signs = signs(rng, (b, h, w, c)), signs(rng, kernel + (c, o))
    weights = formats.pack_conv_weights(w_signs)
    k_words = kernel[0] * kernel[1] * formats.num_words(c)
    taps = formats.from_fsb(weights.bits, o, k_words * 32).reshape(o, *kernel, formats.num_words(c))
    poisoned_w = poison_fsb_padding(formats.to_fsb(poison_row_padding(taps, c).reshape(o, k_words)), o, k_words)
    x = poison_row_padding(ops.pack_bits(x_signs), c)
    got = jax.jit(
        lambda x, w: ops.bconv2d(x, w, in_channels=c, kernel_size=kernel, out_channels=o, pad_value=pad_value,
                                 w_tap_popcount=weights.tap_popcount)  # fmt: skip
    )(x, poisoned_w)
    want = numpy_conv(x_signs, w_signs, (1, 1), ((1, 1), (1, 1)), pad_value)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_repeated_parallel_calls_are_identical():
    """Work is split over XLA's thread pool; the split must not change a single bit."""
    rng = np.random.default_rng(3)
    a = ops.pack_bits(signs(rng, (257, 2000)))
    w = formats.pack_dense_weights(rng.standard_normal((2000, 300)).astype(np.float32))
    f = jax.jit(lambda a: ops.bmm(a, w))
    first = np.asarray(f(a))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(a)), first)


# --- dense chains in one call (ops.bmm_chain) ---------------------------------------------------------

CHAIN_CASES = [
    # rows, widths (k_0, n_0 = k_1, ...), FSB tile of every layer's weights
    (1, (1024, 1024, 1024, 1024, 10), (8, 128)),  # the MNIST MLP's hidden layers at batch 1
    (3, (77, 45, 300, 33), (8, 128)),  # padding bits in every layer's activations
    (70, (257, 70, 1, 95), (16, 64)),  # a one-bit layer, other tiles
    (130, (4096, 136, 40), (8, 32)),
    (600, (64, 32768, 10), (8, 128)),  # 32,768 bits between the layers: rounds of 256 rows (1 MiB of bits)
]


@pytest.mark.parametrize("last", ["bits", "f32"])
@pytest.mark.parametrize("m,widths,tile", CHAIN_CASES)
def test_bmm_chain_every_tier_is_bmm_layer_after_layer(isa, m, widths, tile, last):
    """The chain's one call gives bit for bit what its layers' bmm calls give, its thresholds at the dot
    products' ties and beyond their range, any nonzero flip byte set."""
    rng = np.random.default_rng(m * 31 + len(widths) + (last == "f32"))
    layers = []
    for i, (k, n) in enumerate(zip(widths[:-1], widths[1:])):
        rows = ops.pack_bits(signs(rng, (n, k)))
        layer = dict(b=formats.to_fsb(rows, tile), k=k, n=n, b_popcount=formats.popcount(rows))
        if i == len(widths) - 2 and last == "f32":
            layer.update(scale=rng.standard_normal(n).astype(np.float32), bias=rng.standard_normal(n).astype(np.float32))
        else:
            spread = int(np.sqrt(k)) + 1
            threshold = np.where(rng.random(n) < 0.1, rng.choice([-k - 5, k + 5], n), rng.integers(-spread, spread + 1, n))
            layer.update(threshold=threshold.astype(np.int32), flip=rng.choice(np.array([0, 1, 2, 255], np.uint8), n))
        layers.append(layer)
    x = ops.pack_bits(signs(rng, (m, widths[0])))
    chain = jax.jit(lambda a: ops.bmm_chain(a, layers))
    assert f"jaxbnn_bmm_chain_{last}" in chain.lower(x).as_text()
    want = x
    for layer in layers:
        want = ops.bmm(want, **layer)
    got = chain(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(chain(poison_row_padding(x, widths[0]))), np.asarray(want))


def test_repeated_parallel_chains_are_identical():
    """The chain's layers split over the pool's threads, each layer after the one before: every call the same."""
    rng = np.random.default_rng(4)
    layers = []
    for k, n in ((700, 1000), (1000, 1000), (1000, 10)):
        layer = dict(b=formats.pack_dense_weights(signs(rng, (k, n))))
        layer.update(dict(scale=np.ones(n, np.float32), bias=np.zeros(n, np.float32)) if n == 10
                     else dict(threshold=rng.integers(-20, 21, n).astype(np.int32), flip=rng.random(n) < 0.5))
        layers.append(layer)
    f = jax.jit(lambda a: ops.bmm_chain(a, layers))
    for m in (1, 2, 9, 200):
        a = ops.pack_bits(signs(rng, (m, 700)))
        first = np.asarray(f(a))
        for _ in range(20):
            np.testing.assert_array_equal(np.asarray(f(a)), first)


# --- the handlers' own validation -------------------------------------------------------------------


def ffi(target, out_shape, out_dtype, *operands, **attrs):
    """Call a native target directly (bypassing jaxbnn.ops and its Python-side checks)."""
    call = lambda *xs: jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(out_shape, out_dtype))(*xs, **attrs)  # noqa: E731
    return jax.block_until_ready(jax.jit(call)(*operands))


def u32(*shape):
    return jnp.asarray(np.random.default_rng(0).integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32))


I64 = np.int64
# A valid bmm call: M=4, k=100 (4 words), n=10 (FSB tiles (2, 1, 8, 4)).
BMM = dict(a=u32(4, 4), b=u32(2, 1, 8, 4), popc=jnp.zeros(10, jnp.int32), k=I64(100), n=I64(10))


def bmm_call(target="jaxbnn_bmm_i32", out=((4, 10), jnp.int32), extra=(), **change):
    args = {**BMM, **change}
    return ffi(target, *out, args["a"], args["b"], args["popc"], *extra, k=args["k"], n=args["n"])


def test_valid_direct_calls_run():
    assert bmm_call().shape == (4, 10)
    scale_bias = (jnp.ones(10, jnp.float32), jnp.zeros(10, jnp.float32))
    assert bmm_call("jaxbnn_bmm_f32", ((4, 10), jnp.float32), scale_bias).dtype == jnp.float32
    threshold_flip = (jnp.zeros(10, jnp.int32), jnp.zeros(10, jnp.uint8))
    assert bmm_call("jaxbnn_bmm_bits", ((4, 1), jnp.uint32), threshold_flip).shape == (4, 1)
    assert conv_call().shape == (1, 5, 5, 9)


BMM_ERRORS = [
    ("a float32", dict(a=jnp.zeros((4, 4), jnp.float32)), r"operand `a` must be uint32 of rank 2 .*got float32"),
    ("a rank 3", dict(a=u32(1, 4, 4)), r"operand `a` must be uint32 of rank 2"),
    ("a words != ceil(k/32)", dict(a=u32(4, 3)), r"operand `a` has shape \(4, 3\) but k = 100 requires \(4, 4\)"),
    ("b too few reduction tiles", dict(k=I64(200), a=u32(4, 7)), r"operand `b` has shape \(2, 1, 8, 4\)"),
    ("b too few row tiles", dict(n=I64(17), popc=jnp.zeros(17, jnp.int32)), r"operand `b` has shape"),
    ("b empty tile", dict(b=u32(2, 1, 8, 0)), r"operand `b` has an empty tile"),
    ("b rank 2", dict(b=u32(10, 4)), r"operand `b` must be uint32 of rank 4"),
    ("b_popcount length", dict(popc=jnp.zeros(9, jnp.int32)), r"operand `b_popcount` has shape \(9,\)"),
    ("b_popcount dtype", dict(popc=jnp.zeros(10, jnp.float32)), r"operand `b_popcount` must be int32"),
    ("negative k", dict(k=I64(-1)), r"attribute k = -1 is out of range"),
    ("k beyond int32", dict(k=I64(2**31)), r"attribute k = 2147483648 is out of range"),
    ("negative n", dict(n=I64(-3)), r"attribute n = -3 is out of range"),
]


@pytest.mark.parametrize("what,change,message", BMM_ERRORS, ids=[e[0] for e in BMM_ERRORS])
def test_bmm_handler_refuses_bad_operands(what, change, message):
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_bmm_i32: " + message):
        bmm_call(**change)


def test_bmm_handler_refuses_bad_results_and_epilogue_operands():
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_bmm_i32: result has shape \(4, 11\)"):
        bmm_call(out=((4, 11), jnp.int32))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_bmm_i32: result must be int32, got float32"):
        bmm_call(out=((4, 10), jnp.float32))
    good_scale, good_bias = jnp.ones(10, jnp.float32), jnp.zeros(10, jnp.float32)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_bmm_f32: operand `scale` must be float32"):
        bmm_call("jaxbnn_bmm_f32", ((4, 10), jnp.float32), (jnp.ones(10, jnp.int32), good_bias))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_bmm_f32: operand `bias` has shape \(9,\)"):
        bmm_call("jaxbnn_bmm_f32", ((4, 10), jnp.float32), (good_scale, jnp.zeros(9, jnp.float32)))
    threshold, flip = jnp.zeros(10, jnp.int32), jnp.zeros(10, jnp.uint8)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_bmm_bits: operand `flip` must be uint8.*bool"):
        bmm_call("jaxbnn_bmm_bits", ((4, 1), jnp.uint32), (threshold, jnp.zeros(10, bool)))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_bmm_bits: operand `threshold` must be int32"):
        bmm_call("jaxbnn_bmm_bits", ((4, 1), jnp.uint32), (jnp.zeros(10, jnp.float32), flip))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_bmm_bits: result has shape \(4, 10\)"):
        bmm_call("jaxbnn_bmm_bits", ((4, 10), jnp.uint32), (threshold, flip))


def chain_call(operands, ks=(64, 40), ns=(40, 10), out=((5, 10), jnp.float32), target="jaxbnn_bmm_chain_f32"):
    return ffi(target, *out, *operands, ks=np.array(ks, I64), ns=np.array(ns, I64))


def test_bmm_chain_handler_refuses_inconsistent_calls():
    rng = np.random.default_rng(3)
    w1, w2 = (formats.pack_dense_weights(signs(rng, kn)) for kn in ((64, 40), (40, 10)))
    x = u32(5, 2)
    t40, f40 = jnp.zeros(40, jnp.int32), jnp.zeros(40, jnp.uint8)
    s10, b10 = jnp.ones(10, jnp.float32), jnp.zeros(10, jnp.float32)
    good = [x, w1.bits, w1.popcount, t40, f40, w2.bits, w2.popcount, s10, b10]
    assert chain_call(good).shape == (5, 10)
    assert chain_call([u32(0, 2)] + good[1:], out=((0, 10), jnp.float32)).shape == (0, 10)
    # nine 1024-wide layers: more and wider than the CUDA kernel takes, one call here
    wide = [u32(5, 32)] + [u32(128, 8, 8, 4), jnp.zeros(1024, jnp.int32), t40[:1].repeat(1024), f40[:1].repeat(1024)] * 9
    assert chain_call(wide, ks=(1024,) * 9, ns=(1024,) * 9, out=((5, 32), jnp.uint32),
                      target="jaxbnn_bmm_chain_bits").shape == (5, 32)
    for change, message in [
            (dict(operands=good[:-1]), "takes four operands a layer .* got 7 for 2 layers"),
            (dict(operands=good, ns=(40,)), "takes at least one layer, each with its k and n; got 2 k and 1 n"),
            (dict(operands=good, ks=(64, 41)), "layer 1 reduces over k=41 bits, but the layer before writes n=40"),
            (dict(operands=good, ks=(0, 40)), r"layer 0 has k=0, n=40; k must lie in \[1, "),
            (dict(operands=[u32(5, 3)] + good[1:]), r"operand `a` has shape \(5, 3\) but layer 0's k = 64 requires"),
            (dict(operands=[x.astype(jnp.int32)] + good[1:]), r"operand `a` must be uint32 of rank 2"),
            (dict(operands=good[:1] + [w1.bits[:, :, :4]] + good[2:]), r"operand `w` of layer 0 has shape \(5, 1, 4, 4\)"),
            (dict(operands=good[:2] + [w1.popcount[:-1]] + good[3:]), r"operand `popc` of layer 0 has shape \(39,\)"),
            (dict(operands=good[:3] + [t40[:-1]] + good[4:]), r"operand `threshold` has shape \(39,\) .*layer 0's n = 40"),
            (dict(operands=good[:3] + [t40.astype(jnp.float32)] + good[4:]), r"operand `threshold` must be int32"),
            (dict(operands=good[:7] + [s10.astype(jnp.int32)] + good[8:]), r"operand `scale` must be float32"),
            (dict(operands=good, out=((5, 11), jnp.float32)), r"result has shape \(5, 11\)"),
            (dict(operands=good, out=((5, 10), jnp.int32)), r"result must be float32"),
            (dict(operands=good, out=((5, 1), jnp.uint32), target="jaxbnn_bmm_chain_bits"),
             r"operand `threshold` must be int32 of rank 1 \(N,\), got float32 of shape \(10,\)")]:
        with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_bmm_chain_.*: " + message):
            chain_call(**change)


def test_binary_bits_handlers_take_threshold_planes_as_one_call_each():
    """A threshold of shape (P, N) gives P planes of bits from one product, each the bits of its own row of
    thresholds (what a ternary output asks of a binary product where the ternary kernels are absent)."""
    threshold = jnp.array([[-3, 0, 2, 5, -1, 0, 1, 7, -8, 4], [0] * 10], jnp.int32)
    flip = jnp.array([[0, 1] * 5, [1, 1, 0, 0, 1] * 2], jnp.uint8)
    planes = bmm_call("jaxbnn_bmm_bits", ((4, 2, 1), jnp.uint32), (threshold, flip))
    for plane in range(2):
        one = bmm_call("jaxbnn_bmm_bits", ((4, 1), jnp.uint32), (threshold[plane], flip[plane]))
        np.testing.assert_array_equal(np.asarray(planes[:, plane]), np.asarray(one))
    conv_planes = conv_call("jaxbnn_bconv2d_bits", ((1, 5, 5, 2, 1), jnp.uint32), (threshold[:, :9], flip[:, :9]))
    for plane in range(2):
        one = conv_call("jaxbnn_bconv2d_bits", ((1, 5, 5, 1), jnp.uint32), (threshold[plane, :9], flip[plane, :9]))
        np.testing.assert_array_equal(np.asarray(conv_planes[..., plane, :]), np.asarray(one))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_bmm_bits: operand `threshold` of shape \(9, 10\) "
                                                          r"has 9 planes; 1 to 8 are supported"):
        bmm_call("jaxbnn_bmm_bits", ((4, 9, 1), jnp.uint32), (jnp.zeros((9, 10), jnp.int32), jnp.zeros((9, 10), jnp.uint8)))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_bmm_bits: result has shape \(4, 1\), expected "
                                                          r"leading dims \(4, 2\)"):
        bmm_call("jaxbnn_bmm_bits", ((4, 1), jnp.uint32), (threshold, flip))


def test_handler_refuses_wrongly_typed_or_missing_attributes():
    """Decoding errors come from XLA's FFI layer itself: still an error, not a crash."""
    with pytest.raises(jax.errors.JaxRuntimeError, match="expected S64 but got S32"):
        bmm_call(k=np.int32(100))
    with pytest.raises(jax.errors.JaxRuntimeError, match="Wrong number of attributes"):
        ffi("jaxbnn_bmm_i32", (4, 10), jnp.int32, BMM["a"], BMM["b"], BMM["popc"], n=I64(10))


# A valid bconv2d call: 1x5x5 image, c=40 (2 words), o=9, 3x3 kernel, stride 1, padding 1.
CONV_ATTRS = dict(c=I64(40), o=I64(9), kh=I64(3), kw=I64(3), stride_h=I64(1), stride_w=I64(1), pad_top=I64(1),
                  pad_bottom=I64(1), pad_left=I64(1), pad_right=I64(1), pad_one=False, pool_h=I64(1),
                  pool_w=I64(1))  # fmt: skip
CONV = dict(x=u32(1, 5, 5, 2), w=u32(2, 5, 8, 4), taps=jnp.zeros((9, 9), jnp.int32))


def conv_call(target="jaxbnn_bconv2d_i32", out=((1, 5, 5, 9), jnp.int32), extra=(), **change):
    operands = {k: change.pop(k) if k in change else v for k, v in CONV.items()}
    attrs = {**CONV_ATTRS, **change}
    return ffi(target, *out, operands["x"], operands["w"], operands["taps"], *extra, **attrs)


CONV_ERRORS = [
    ("x float32", dict(x=jnp.zeros((1, 5, 5, 2), jnp.float32)), r"operand `x` must be uint32 of rank 4"),
    ("x channel words", dict(x=u32(1, 5, 5, 3)), r"operand `x` has shape \(1, 5, 5, 3\) but c = 40 requires"),
    ("w reduction tiles", dict(w=u32(2, 4, 8, 4)), r"operand `w` has shape \(2, 4, 8, 4\)"),
    ("w output tiles", dict(w=u32(1, 5, 8, 4)), r"operand `w` has shape \(1, 5, 8, 4\)"),
    ("tap popcount shape", dict(taps=jnp.zeros((9, 8), jnp.int32)), r"operand `w_tap_popcount` has shape \(9, 8\)"),
    ("tap popcount dtype", dict(taps=jnp.zeros((9, 9), jnp.uint8)), r"operand `w_tap_popcount` must be int32"),
    ("zero stride", dict(stride_h=I64(0)), r"attribute stride_h = 0 is out of range"),
    ("negative padding", dict(pad_left=I64(-1)), r"attribute pad_left = -1 is out of range"),
    ("zero pool", dict(pool_w=I64(0)), r"attribute pool_w = 0 is out of range"),
    ("zero channels", dict(c=I64(0)), r"attribute c = 0 is out of range"),
    ("kernel larger than input", dict(kh=I64(9)), r"the kernel 9 x 3 is larger than the padded input 7 x 7"),
    ("reduction beyond int32", dict(c=I64(2**30)), r"the reduction kh \* kw \* c = 3 \* 3 \* 1073741824 does not fit int32"),
    ("padding 2**31", dict(pad_top=I64(2**31)), r"attribute pad_top = 2147483648 is out of range \[0, 2147483647\]"),
    ("padding 2**62", dict(pad_left=I64(2**62)), r"attribute pad_left = 4611686018427387904 is out of range"),
    ("padding int64 max", dict(pad_right=I64(2**63 - 1)), r"attribute pad_right = 9223372036854775807 is out"),
    ("padded extent beyond int32", dict(pad_top=I64(2**31 - 1), pad_bottom=I64(2**31 - 1)),
     r"the padded input 4294967299 x 7 has an extent beyond int32"),
    ("kernel beyond int32", dict(kw=I64(2**40)), r"attribute kw = 1099511627776 is out of range"),
    ("reduction words beyond int32", dict(c=I64(33), kh=I64(2**14), kw=I64(2**11)),
     r"the reduction row of kh \* kw = 33554432 taps of 2 words does not fit int32 bits"),
]


@pytest.mark.parametrize("what,change,message", CONV_ERRORS, ids=[e[0] for e in CONV_ERRORS])
def test_bconv2d_handler_refuses_bad_operands(what, change, message):
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_bconv2d_i32: " + message):
        conv_call(**change)


def test_bconv2d_handler_refuses_bad_results():
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_bconv2d_i32: result has shape \(1, 5, 5, 8\)"):
        conv_call(out=((1, 5, 5, 8), jnp.int32))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"result has shape \(1, 4, 4, 9\)"):
        conv_call(out=((1, 4, 4, 9), jnp.int32), pad_top=I64(0))  # OH = 4 but OW = 5
    threshold, flip = jnp.zeros(9, jnp.int32), jnp.zeros(9, jnp.uint8)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_bconv2d_bits: result has shape \(1, 5, 5, 9\)"):
        conv_call("jaxbnn_bconv2d_bits", ((1, 5, 5, 9), jnp.uint32), (threshold, flip))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_bconv2d_f32: operand `scale` has shape \(8,\)"):
        conv_call("jaxbnn_bconv2d_f32", ((1, 5, 5, 9), jnp.float32),
                  (jnp.ones(8, jnp.float32), jnp.zeros(9, jnp.float32)))  # fmt: skip


def residual_call(shortcut, out, extra=(), stride=1, shift=0, target=None, **attrs):
    """A jaxbnn_bconv2d_residual_* call on CONV's operands (bits: `extra` = threshold, flip; `out` two results;
    `target` by default the int32 stream's)."""
    target = target or "jaxbnn_bconv2d_residual_" + ("bits" if extra else "i32")
    results = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in out]
    call = lambda *xs: jax.ffi.ffi_call(target, results if extra else results[0])(  # noqa: E731
        *xs, **{**CONV_ATTRS, **attrs}, shortcut_stride=I64(stride), shift=I64(shift))
    return jax.block_until_ready(jax.jit(call)(CONV["x"], CONV["w"], CONV["taps"], shortcut, *extra))


STREAM = ((1, 5, 5, 9), jnp.int32)
STREAM_BITS = ((1, 5, 5, 1), jnp.uint32)
RESIDUAL_ERRORS = [
    ("shortcut float32", dict(shortcut=jnp.zeros((1, 5, 5, 9), jnp.float32)),
     r"operand `shortcut` must be int32 of rank 4"),
    ("shortcut too short", dict(shortcut=jnp.zeros((1, 4, 5, 9), jnp.int32)),
     r"operand `shortcut` has shape \(1, 4, 5, 9\); with shortcut_stride 1 it must be \(1, SH, SW, SC\) with "
     r"ceil\(SH / stride\) = 5, ceil\(SW / stride\) = 5 and 1 <= SC <= 9"),
    ("shortcut wider than o", dict(shortcut=jnp.zeros((1, 5, 5, 10), jnp.int32)),
     r"operand `shortcut` has shape \(1, 5, 5, 10\).* and 1 <= SC <= 9"),
    ("stride 0", dict(stride=0), r"attribute shortcut_stride = 0 is out of range"),
    ("shift 32", dict(shift=32), r"attribute shift = 32 is out of range \[0, 31\]"),
    ("pool", dict(pool_h=I64(2), pool_w=I64(2), out=[((1, 2, 2, 9), jnp.int32)]),
     r"the residual epilogue takes no pool"),
]


@pytest.mark.parametrize("what,change,message", RESIDUAL_ERRORS, ids=[e[0] for e in RESIDUAL_ERRORS])
def test_residual_handlers_refuse_bad_operands(what, change, message):
    shortcut = change.pop("shortcut", jnp.zeros((1, 5, 5, 9), jnp.int32))
    out = change.pop("out", [STREAM])
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_bconv2d_residual_i32: " + message):
        residual_call(shortcut, out, **change)


def test_int16_residual_handlers_take_int16_streams_only():
    shortcut16 = jnp.zeros((1, 5, 5, 9), jnp.int16)
    stream16 = ((1, 5, 5, 9), jnp.int16)
    assert residual_call(shortcut16, [stream16], target="jaxbnn_bconv2d_residual_i16").dtype == jnp.int16
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"jaxbnn_bconv2d_residual_i16: operand `shortcut` must be int16 of rank 4"):
        residual_call(jnp.zeros((1, 5, 5, 9), jnp.int32), [stream16], target="jaxbnn_bconv2d_residual_i16")
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_bconv2d_residual_i16: result must be int16"):
        residual_call(shortcut16, [STREAM], target="jaxbnn_bconv2d_residual_i16")
    good = (jnp.zeros((2, 9), jnp.int32), jnp.zeros((2, 9), jnp.uint8))
    stream, bits = residual_call(shortcut16, [stream16, ((1, 5, 5, 2, 1), jnp.uint32)], good,
                                 target="jaxbnn_bconv2d_residual_i16_bits")
    assert bits.shape == (1, 5, 5, 2, 1)
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"jaxbnn_bconv2d_residual_i16_bits: result has shape \(1, 5, 5, 1\)"):
        residual_call(shortcut16, [stream16, STREAM_BITS], good, target="jaxbnn_bconv2d_residual_i16_bits")


def test_residual_bits_handler_checks_its_thresholds_and_bits():
    shortcut = jnp.zeros((1, 5, 5, 9), jnp.int32)
    good = (jnp.zeros(9, jnp.int32), jnp.zeros(9, jnp.uint8))
    stream, bits = residual_call(shortcut, [STREAM, STREAM_BITS], good)
    assert stream.shape == (1, 5, 5, 9) and bits.shape == (1, 5, 5, 1)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_bconv2d_residual_bits: operand `flip` has shape"):
        residual_call(shortcut, [STREAM, STREAM_BITS], (good[0], jnp.zeros(8, jnp.uint8)))
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"jaxbnn_bconv2d_residual_bits: result has shape \(1, 5, 5, 2\)"):
        residual_call(shortcut, [STREAM, ((1, 5, 5, 2), jnp.uint32)], good)


@pytest.mark.parametrize("stream_dtype", [jnp.int32, jnp.int16])
@pytest.mark.parametrize("stride", [1, 2])
def test_the_residual_op_is_one_native_call_on_the_cpu(isa, stride, stream_dtype):
    """`bconv2d(..., shortcut=...)` on the CPU, every tier: one jaxbnn_bconv2d_residual_* call (the stream in the
    shortcut's type, and with a threshold its bits), the same integers as the int32 convolution plus the
    reference epilogue (shortcut channels zero-padded, output channels past a whole word, a stride-2 shortcut,
    shortcuts over the type's whole range: sums that wrap)."""
    rng = np.random.default_rng(23 + stride)
    x = ops.pack_bits(signs(rng, (2, 7, 5, 40)))
    w = formats.pack_conv_weights(signs(rng, (3, 3, 40, 48)))
    limits = np.iinfo(stream_dtype)
    shortcut = jnp.asarray(rng.integers(limits.min, limits.max, (2, 7, 5, 40), endpoint=True), stream_dtype)
    threshold = jnp.asarray(rng.integers(-9, 9, 48), jnp.int32)
    flip = jnp.asarray(rng.random(48) < 0.5)
    conv = dict(stride=stride, shortcut_stride=stride, shift=1)
    block = jax.jit(lambda x, s: ops.bconv2d(x, w, shortcut=s, threshold=threshold, flip=flip, **conv))
    text = block.lower(x, shortcut).as_text()
    narrow = "_i16" if stream_dtype == jnp.int16 else ""
    assert f"@jaxbnn_bconv2d_residual{narrow}_bits(" in text and "@jaxbnn_bconv2d_i32(" not in text
    stream, bits = block(x, shortcut)
    dot = ops.bconv2d(x, w, stride=stride)
    want = reference.residual_epilogue(dot, shortcut, stride=stride, shift=1, threshold=threshold, flip=flip)
    assert stream.dtype == stream_dtype
    np.testing.assert_array_equal(np.asarray(stream), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(bits), np.asarray(want[1]))
    alone = jax.jit(lambda x, s: ops.bconv2d(x, w, shortcut=s, **conv))
    assert f"@jaxbnn_bconv2d_residual_{narrow[1:] or 'i32'}(" in alone.lower(x, shortcut).as_text()
    np.testing.assert_array_equal(np.asarray(alone(x, shortcut)), np.asarray(want[0]))


def test_the_int16_residual_op_writes_two_threshold_planes_in_its_call(isa):
    """A ternary conv1's (nonneg, pos) thresholds of the int16 stream, (2, O): the one residual call writes both
    planes, (..., 2, ceil(O/32)), as the reference epilogue does (thresholds at the stream's values: ties)."""
    rng = np.random.default_rng(5)
    x = ops.pack_bits(signs(rng, (3, 6, 6, 64)))
    w = formats.pack_conv_weights(signs(rng, (3, 3, 64, 70)))
    shortcut = jnp.asarray(rng.integers(-40, 40, (3, 6, 6, 70)), jnp.int16)
    threshold = jnp.asarray(rng.integers(-30, 30, (2, 70)), jnp.int32)
    flip = jnp.asarray(rng.random((2, 70)) < 0.5)
    block = jax.jit(lambda x, s: ops.bconv2d(x, w, shortcut=s, threshold=threshold, flip=flip))
    text = block.lower(x, shortcut).as_text()
    assert text.count("@jaxbnn_bconv2d_residual_i16_bits(") == 1 and "jaxbnn_stream_bits" not in text
    stream, bits = block(x, shortcut)
    want = reference.residual_epilogue(ops.bconv2d(x, w), shortcut, stride=1, shift=0, threshold=threshold,
                                       flip=flip)
    assert bits.shape == (3, 6, 6, 2, 3)
    np.testing.assert_array_equal(np.asarray(stream), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(bits), np.asarray(want[1]))


def test_handlers_accept_empty_outputs():
    """Zero rows, or a pool window larger than the conv output, give empty results (nothing to compute)."""
    assert bmm_call(a=u32(0, 4), out=((0, 10), jnp.int32)).shape == (0, 10)
    assert conv_call(pool_h=I64(6), out=((1, 0, 5, 9), jnp.int32)).shape == (1, 0, 5, 9)
