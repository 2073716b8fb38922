"""Ternary and mixed products on the CPU (TAB's TNN, TBN, BTN): `ops.bmm` / `ops.bconv2d` with ternary
activations (`formats.TernaryPlanes`) and / or ternary weights (`formats.TernaryDenseBits` /
`TernaryConvBits`), every kernel ISA tier against the pure-JAX reference and plain numpy (odd shapes, conv
borders, strides, pools, FSB tiles, garbage in padding bits), exact epilogues, the Python-side argument
checks and the FFI handlers' own validation."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbnn import _cpu, _ffi, formats, ops, reference  # the CPU module is part of every build: no skip
from numpy_spec import numpy_conv

MODES = ["tnn", "tbn", "btn"]


# --- format constants -------------------------------------------------------------------------------


def test_native_plane_bits_equal_the_ternary_planes_of_formats():
    native = _cpu.format_constants()
    values = jnp.array([1, 0, -1])
    nonneg, pos = formats.ternary_pm_planes(values)
    assert native["ternary_nonneg_bit"] == {int(v): int(b) for v, b in zip(values, nonneg)}
    assert native["ternary_pos_bit"] == {int(v): int(b) for v, b in zip(values, pos)}


def test_every_product_has_its_native_targets():
    for mode in MODES:
        for op in ("bmm", "conv2d"):
            for kind in ("i32", "f32", "bits"):
                assert _ffi.has_target("cpu", f"jaxbnn_{mode}_{op}_{kind}")


@pytest.fixture(params=_cpu.supported_isas())
def isa(request):
    """Runs the test once per kernel tier this CPU supports (AVX-512, AVX2, popcnt, generic)."""
    previous = _cpu.active_isa()
    _cpu.set_isa(request.param)
    yield request.param
    _cpu.set_isa(previous)


# --- helpers ----------------------------------------------------------------------------------------


def ternary(rng, shape):
    return rng.integers(-1, 2, shape).astype(np.float32)


def signs(rng, shape):
    return rng.choice(np.array([-1.0, 1.0], np.float32), shape)


def operands(rng, mode, x_shape, w_shape, conv, tile=formats.FSB_TILE):
    """(packed activations, their values, packed weights, their values) of a product `mode`."""
    x = ternary(rng, x_shape) if mode in ("tnn", "tbn") else signs(rng, x_shape)
    w = ternary(rng, w_shape) if mode in ("tnn", "btn") else signs(rng, w_shape)
    packed_x = formats.pack_ternary_pm_planes(x) if mode in ("tnn", "tbn") else ops.pack_bits(x)
    if mode in ("tnn", "btn"):
        packed_w = (formats.pack_ternary_conv_weights if conv else formats.pack_ternary_dense_weights)(w, tile)
    else:
        packed_w = (formats.pack_conv_weights if conv else formats.pack_dense_weights)(w, tile)
    return packed_x, x, packed_w, w


def epilogue_operands(rng, dots, planes=3):
    """Random scale/bias, and thresholds that hit actual dot values so that ties (dot == threshold) occur:
    one plane, and `planes` planes."""
    n = dots.shape[-1]
    flat = np.asarray(dots).reshape(-1, n)
    threshold = np.where(rng.random((planes, n)) < 0.5, flat[rng.integers(0, flat.shape[0], (planes, n)), np.arange(n)],
                         rng.integers(-50, 51, (planes, n))).astype(np.int32)  # fmt: skip
    flip = rng.random((planes, n)) < 0.5
    return dict(scale=rng.standard_normal(n).astype(np.float32), bias=rng.standard_normal(n).astype(np.float32),
                threshold=threshold[0], flip=flip[0], threshold_planes=threshold, flip_planes=flip)


def assert_all_epilogues(run, want_dots, epi, fused_affine=False):
    """`run(**epilogue)` equals the reference epilogue of `want_dots` for int32, affine, threshold and
    threshold planes. `fused_affine`: the affine is XLA's, which may fuse its multiply-add (one rounding
    fewer), so it may differ by the product's rounding."""
    np.testing.assert_array_equal(np.asarray(run()), want_dots)
    affine = np.asarray(run(scale=epi["scale"], bias=epi["bias"]))
    product = want_dots.astype(np.float32) * epi["scale"]
    want_affine = product + epi["bias"]
    slack = np.spacing(np.abs(product)) + np.spacing(np.abs(want_affine)) if fused_affine else 0
    assert np.all(np.abs(affine - want_affine) <= slack)
    for threshold, flip in ((epi["threshold"], epi["flip"]), (epi["threshold_planes"], epi["flip_planes"])):
        bits = np.asarray(run(threshold=threshold, flip=flip))
        want_bits = reference.epilogue(jnp.asarray(want_dots), threshold=threshold, flip=flip)
        np.testing.assert_array_equal(bits, np.asarray(want_bits))


def numpy_max_pool(dots, pool):
    if pool is None:
        return dots
    ph, pw = pool
    b, h, w, o = dots.shape
    oh, ow = h // ph, w // pw
    return dots[:, : oh * ph, : ow * pw].reshape(b, oh, ph, ow, pw, o).max(axis=(2, 4))


def weights_of(packed_w):
    """(raw FSB bits, whether ternary) of packed weights, as the reference takes them."""
    return packed_w.bits, isinstance(packed_w, (formats.TernaryDenseBits, formats.TernaryConvBits))


# --- bmm: every tier against the reference ----------------------------------------------------------

BMM_CASES = [
    # m, k, n, FSB tile: K below one word, K not a multiple of 32 / 64 / 128 / 512, M and N odd, N not a
    # multiple of 8 (the pos plane's rows start inside a tile: the kernels copy them), other FSB tiles,
    # sizes that run on several threads, K a multiple of 128 (every chunk whole)
    (1, 1, 1, (8, 128)),
    (3, 31, 33, (8, 128)),
    (17, 200, 40, (8, 128)),
    (9, 513, 7, (8, 128)),
    (70, 257, 70, (16, 64)),
    (5, 1000, 9, (4, 256)),
    (45, 384, 40, (8, 128)),
    (40, 700, 65, (1, 32)),
    (300, 1500, 200, (8, 128)),
    (100, 4096, 136, (8, 128)),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,k,n,tile", BMM_CASES)
def test_bmm_every_tier_matches_reference(isa, mode, m, k, n, tile):
    rng = np.random.default_rng(m * 7919 + k * 31 + n)
    a, a_values, w, w_values = operands(rng, mode, (m, k), (k, n), conv=False, tile=tile)
    want = (a_values @ w_values).astype(np.int32)
    bits, ternary_weights = weights_of(w)
    spec = reference.bmm(a, bits, k, n, ternary_weights=ternary_weights)
    np.testing.assert_array_equal(np.asarray(spec), want)  # the spec agrees with numpy
    run = lambda **epi: jax.jit(lambda a, w: ops.bmm(a, w, **epi))(a, w)  # noqa: E731
    assert_all_epilogues(run, want, epilogue_operands(rng, want))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", [4096, 8392])  # 32 chunks of 128 bits; 66 chunks, the last one partly padding
def test_bmm_extreme_dots_over_long_reductions(isa, mode, k):
    """Activations equal to a weight column and opposite to it, no zeros: every position of the reduction
    counts in the same direction, the counts the kernels' partial sums must hold without wrapping (+k, -k)."""
    rng = np.random.default_rng(k)
    w = signs(rng, (k, 16))  # ternary weights without zeros where the mode has them
    x = np.concatenate([w[:, :3].T, -w[:, 3:6].T])
    packed_x = formats.pack_ternary_pm_planes(x) if mode in ("tnn", "tbn") else ops.pack_bits(x)
    packed_w = formats.pack_ternary_dense_weights(w) if mode in ("tnn", "btn") else formats.pack_dense_weights(w)
    want = (x @ w).astype(np.int32)
    assert (np.diag(want[:3]) == k).all() and (np.diag(want[3:, 3:]) == -k).all()
    np.testing.assert_array_equal(np.asarray(jax.jit(ops.bmm)(packed_x, packed_w)), want)


@pytest.mark.parametrize("mode", MODES)
# 15 and 16 words (TNN's lane kernel sums signed byte counts over 15 words at a time), 31 and 36 (TBN's and BTN's
# over 31), 72 and 144 (TNN's, in blocks of 36 words)
@pytest.mark.parametrize("c", [480, 512, 992, 1152, 2304, 4608])
def test_conv2d_extreme_dots_over_the_lane_kernels_reductions(isa, mode, c):
    """Pixels equal to a column's weights and pixels opposite to them, no zeros, over 64 rows (1 x 1 fields): every
    position of the reduction counts in the same direction (dots of exactly +c and -c)."""
    rng = np.random.default_rng(c)
    w_values = signs(rng, (1, 1, c, 16))
    columns = w_values[0, 0].T  # (16, c)
    pixels = np.stack([columns[p % 16] * (1 if p < 32 else -1) for p in range(64)])
    x_values = pixels.reshape(1, 8, 8, c)
    x = formats.pack_ternary_pm_planes(x_values) if mode in ("tnn", "tbn") else ops.pack_bits(x_values)
    pack = formats.pack_ternary_conv_weights if mode in ("tnn", "btn") else formats.pack_conv_weights
    want = numpy_conv(x_values, w_values, (1, 1), ((0, 0), (0, 0)), "zero")
    assert (want.reshape(64, 16)[np.arange(64), np.arange(64) % 16] == np.where(np.arange(64) < 32, c, -c)).all()
    got = jax.jit(lambda x: ops.bconv2d(x, pack(w_values), padding="VALID"))(x)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("mode", MODES)
def test_bmm_batch_dims_fold_and_vmap(mode):
    rng = np.random.default_rng(1)
    a, a_values, w, w_values = operands(rng, mode, (2, 3, 11, 90), (90, 21), conv=False)
    want = (a_values @ w_values).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(ops.bmm(a, w)), want)
    np.testing.assert_array_equal(np.asarray(jax.vmap(lambda a: ops.bmm(a, w))(a)), want)


# --- conv2d: every tier against the reference -------------------------------------------------------

CONV_CASES = [
    # b, h, w, c, o, kernel, stride, padding, pad_value, pool, FSB tile
    (2, 9, 7, 70, 21, (3, 3), 1, "SAME", "zero", None, (8, 128)),
    (1, 9, 8, 33, 17, (3, 3), 2, ((2, 0), (1, 3)), "one", (2, 2), (8, 128)),
    (2, 10, 9, 64, 33, (3, 1), (2, 1), ((1, 1), (0, 0)), "zero", (2, 1), (1, 32)),
    (3, 11, 13, 100, 40, (5, 5), 1, "SAME", "zero", (2, 2), (8, 128)),
    (2, 8, 8, 256, 64, (3, 3), 2, "SAME", "one", (1, 2), (16, 64)),
    (1, 5, 4, 31, 9, (1, 1), 1, "VALID", "zero", None, (8, 128)),
    (1, 6, 6, 3, 5, (7, 7), 1, "SAME", "zero", (3, 3), (4, 256)),
    # whole 128-bit chunks per tap (no masked words) with out-of-frame taps, with and without pooling
    (2, 9, 11, 128, 24, (3, 3), 1, "SAME", "zero", (2, 2), (8, 128)),
    (1, 7, 7, 512, 40, (3, 3), 1, "SAME", "zero", None, (8, 128)),
    (3, 6, 5, 128, 8, (3, 3), 1, "SAME", "one", None, (8, 128)),
    # more columns than one 128-column strip of the epilogue, the last strip not a whole word, pooled
    (2, 6, 7, 40, 150, (3, 3), 1, "SAME", "zero", (2, 2), (8, 128)),
    # 3 x 3 fields of one and two whole channel words, those in frame copied straight into the panel
    (2, 9, 8, 32, 20, (3, 3), 1, "SAME", "zero", (2, 2), (8, 128)),
    (1, 9, 10, 64, 24, (3, 3), 1, "SAME", "one", None, (8, 128)),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("b,h,w,c,o,kernel,stride,padding,pad_value,pool,tile", CONV_CASES)
def test_conv2d_every_tier_matches_reference(isa, mode, b, h, w, c, o, kernel, stride, padding, pad_value, pool,
                                             tile):  # fmt: skip
    rng = np.random.default_rng(b * 1009 + h * 101 + c * 7 + o)
    x, x_values, weights, w_values = operands(rng, mode, (b, h, w, c), kernel + (c, o), conv=True, tile=tile)
    stride = (stride, stride) if isinstance(stride, int) else stride
    pads = ops._conv_padding(padding, (h, w), kernel, stride)
    want = numpy_max_pool(numpy_conv(x_values, w_values, stride, pads, pad_value), pool)
    bits, ternary_weights = weights_of(weights)
    spec = reference.bconv2d(x, bits, in_channels=c, out_channels=o, kernel_size=kernel, stride=stride,
                             padding=pads, pad_value=pad_value, ternary_weights=ternary_weights, pool=pool)
    np.testing.assert_array_equal(np.asarray(spec), want)  # the spec agrees with numpy

    def run(**epi):
        conv = lambda x: ops.bconv2d(x, weights, stride=stride, padding=padding, pad_value=pad_value, pool=pool,
                                     **epi)  # noqa: E731
        return jax.jit(conv)(x)

    assert_all_epilogues(run, want, epilogue_operands(rng, want))


# --- the bits the kernels must ignore, and the planes' meaning -------------------------------------


def poison_row_padding(words, bits_per_row):
    """Set every padding bit of row-packed words (..., ceil(bits/32)) to 1."""
    words = np.array(words, np.uint32)
    if bits_per_row % 32:
        words[..., -1] |= np.uint32(~((1 << (bits_per_row % 32)) - 1) & 0xFFFFFFFF)
    return words


def poisoned(x, bits_per_row):
    if isinstance(x, formats.TernaryPlanes):
        return formats.TernaryPlanes(*(poison_row_padding(p, bits_per_row) for p in x))
    return poison_row_padding(x, bits_per_row)


def poisoned_weights(weights, rows, taps, c):
    """Weights whose padding bits (past c in each tap, and past the matrix in the FSB tiles) are all 1."""
    cw = formats.num_words(c)
    matrix = np.asarray(formats.from_fsb(weights.bits, rows, taps * cw * 32)).reshape(rows, taps, cw)
    matrix = poison_row_padding(matrix, c).reshape(rows, taps * cw)
    tiles = np.array(formats.to_fsb(matrix), np.uint32)
    rt, kt, bh, ww = tiles.shape
    full = tiles.transpose(0, 2, 1, 3).reshape(rt * bh, kt * ww)
    full[rows:, :] = 0xFFFFFFFF
    full[:, taps * cw:] = 0xFFFFFFFF
    return full.reshape(rt, bh, kt, ww).transpose(0, 2, 1, 3).copy()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", [165, 96])  # padding bits in the last word; whole padding words in the last chunk
@pytest.mark.parametrize("m", [9, 70])  # the panel kernels; the lane kernels (AVX2) from 64 rows
def test_bmm_ignores_garbage_in_padding_bits(isa, mode, k, m):
    rng = np.random.default_rng(11)
    n = 13
    a, a_values, w, w_values = operands(rng, mode, (m, k), (k, n), conv=False)
    rows = 2 * n if mode in ("tnn", "btn") else n
    bits = poisoned_weights(w, rows, 1, k)
    dataclass = formats.TernaryDenseBits if mode in ("tnn", "btn") else formats.DenseBits
    got = jax.jit(lambda a, b: ops.bmm(a, dataclass(b, w.popcount, k=k, n=n)))(poisoned(a, k), bits)
    np.testing.assert_array_equal(np.asarray(got), (a_values @ w_values).astype(np.int32))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pad_value", ["zero", "one"])
@pytest.mark.parametrize("c", [45, 64])  # padding bits in each tap; whole padding words in the last chunk
def test_conv2d_ignores_garbage_in_channel_padding_bits(isa, mode, pad_value, c):
    rng = np.random.default_rng(5)
    b, h, w, o, kernel = 2, 7, 6, 11, (3, 3)
    x, x_values, weights, w_values = operands(rng, mode, (b, h, w, c), kernel + (c, o), conv=True)
    rows = 2 * o if mode in ("tnn", "btn") else o
    bits = poisoned_weights(weights, rows, 9, c)
    dataclass = formats.TernaryConvBits if mode in ("tnn", "btn") else formats.ConvBits
    got = jax.jit(
        lambda x, w: ops.bconv2d(x, dataclass(w, weights.tap_popcount, kernel_size=kernel, in_channels=c,
                                              out_channels=o), pad_value=pad_value)  # fmt: skip
    )(poisoned(x, c), bits)
    want = numpy_conv(x_values, w_values, (1, 1), ((1, 1), (1, 1)), pad_value)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("mode", ["tnn", "tbn"])
@pytest.mark.parametrize("m", [12, 64])  # the panel kernels; the lane kernels (AVX2) from 64 rows
def test_a_pos_bit_without_its_nonneg_bit_is_zero_as_the_reference_says(isa, mode, m):
    """The planes' values are (a + b) / 2 whatever the bits: a pos bit set without its nonneg bit (which no
    quantizer writes) is 0 in the kernels as in the reference."""
    rng = np.random.default_rng(8)
    k, n = 300, 24
    nonneg, pos = (ops.pack_bits(signs(rng, (m, k))) for _ in range(2))  # every combination of bits
    a = formats.TernaryPlanes(nonneg, pos)
    _, _, w, _ = operands(rng, mode, (m, k), (k, n), conv=False)
    bits, ternary_weights = weights_of(w)
    want = reference.bmm(a, bits, k, n, ternary_weights=ternary_weights)
    np.testing.assert_array_equal(np.asarray(ops.bmm(a, w)), np.asarray(want))


def test_ternary_planes_equal_the_mean_of_two_binary_products():
    """The runtime's composition (the mean of ±1 products of the planes) and the ternary op agree."""
    rng = np.random.default_rng(2)
    x, w = ternary(rng, (4, 9, 9, 40)), ternary(rng, (3, 3, 40, 16))
    planes = formats.pack_ternary_pm_planes(x)
    stacked = formats.pack_conv_weights(formats.ternary_weight_signs(w))
    parts = [ops.bconv2d(p, stacked) for p in planes]
    composed = (parts[0][..., :16] + parts[0][..., 16:] + parts[1][..., :16] + parts[1][..., 16:]) // 4
    ternary_weights = formats.TernaryConvBits(stacked.bits, stacked.tap_popcount, kernel_size=(3, 3),
                                              in_channels=40, out_channels=16)
    np.testing.assert_array_equal(np.asarray(ops.bconv2d(planes, ternary_weights)), np.asarray(composed))


@pytest.mark.parametrize("mode", ["tnn", "tbn"])
def test_two_threshold_planes_are_the_next_layers_ternary_activations(mode):
    """Thresholds (lo, hi) per channel give the planes of t = +1 where dot >= hi, 0 where lo <= dot < hi,
    -1 below lo: nonneg = [dot >= lo], pos = [dot >= hi], which the next ternary layer takes as they are."""
    rng = np.random.default_rng(12)
    x, _, weights, _ = operands(rng, mode, (2, 8, 8, 48), (3, 3, 48, 40), conv=True)
    dots = np.asarray(ops.bconv2d(x, weights))
    lo, hi = rng.integers(-20, 1, 40), rng.integers(0, 21, 40)
    out = ops.bconv2d(x, weights, threshold=np.stack([lo, hi]))
    assert out.shape == (2, 8, 8, 2, 2)
    t = np.where(dots >= hi, 1, np.where(dots >= lo, 0, -1))
    planes = formats.TernaryPlanes(out[..., 0, :], out[..., 1, :])
    expected = formats.pack_ternary_pm_planes(t)
    np.testing.assert_array_equal(np.asarray(planes.nonneg), np.asarray(expected.nonneg))
    np.testing.assert_array_equal(np.asarray(planes.pos), np.asarray(expected.pos))
    next_weights = formats.pack_ternary_conv_weights(ternary(rng, (3, 3, 40, 8)))
    np.testing.assert_array_equal(np.asarray(ops.bconv2d(planes, next_weights)),
                                  np.asarray(ops.bconv2d(expected, next_weights)))


def test_repeated_parallel_calls_are_identical():
    """Work is split over XLA's thread pool; the split must not change a single bit."""
    rng = np.random.default_rng(3)
    a, _, w, _ = operands(rng, "tnn", (257, 2000), (2000, 300), conv=False)
    f = jax.jit(lambda a: ops.bmm(a, w))
    first = np.asarray(f(a))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(a)), first)


@pytest.mark.parametrize("mode", MODES)
def test_without_a_native_target_the_ops_run_the_reference(mode, monkeypatch):
    rng = np.random.default_rng(4)
    x, x_values, weights, w_values = operands(rng, mode, (1, 6, 7, 50), (3, 3, 50, 12), conv=True)
    native = np.asarray(ops.bconv2d(x, weights, stride=2))
    monkeypatch.setattr(_ffi, "has_target", lambda platform, target: False)
    jax.clear_caches()
    np.testing.assert_array_equal(np.asarray(ops.bconv2d(x, weights, stride=2)), native)
    jax.clear_caches()


@pytest.fixture
def without_ternary_kernels(monkeypatch):
    """The platform as one without kernels of the ternary and mixed products (the GPU's case): the binary
    targets stay."""
    has_target = _ffi.has_target
    monkeypatch.setattr(_ffi, "has_target", lambda platform, target: has_target(platform, target) and not any(
        target.startswith(f"jaxbnn_{mode}_") for mode in MODES))  # fmt: skip
    jax.clear_caches()
    yield
    jax.clear_caches()


def custom_calls(fn, *args):
    """The custom-call targets of `fn`'s lowering."""
    return set(re.findall(r"custom_call_target\s*=\s*\"(\w+)\"", jax.jit(fn).lower(*args).as_text("hlo")))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,k,n,tile", [BMM_CASES[1], BMM_CASES[4], BMM_CASES[6]])
def test_without_ternary_kernels_bmm_is_one_binary_product_with_its_epilogue(without_ternary_kernels, mode, m, k, n,
                                                                             tile):  # fmt: skip
    """The planes side by side along the reduction: one binary call whose epilogue is the product's (the
    affine rounds as the kernels do, the threshold planes are its columns)."""
    rng = np.random.default_rng(m * 7919 + k * 31 + n + 1)
    a, a_values, w, w_values = operands(rng, mode, (m, k), (k, n), conv=False, tile=tile)
    want = (a_values @ w_values).astype(np.int32)
    epi = epilogue_operands(rng, want)
    assert custom_calls(lambda a, w: ops.bmm(a, w, threshold=epi["threshold_planes"]), a, w) == {"jaxbnn_bmm_bits"}
    assert custom_calls(lambda a, w: ops.bmm(a, w, scale=epi["scale"]), a, w) == {"jaxbnn_bmm_f32"}
    run = lambda **e: jax.jit(lambda a, w: ops.bmm(a, w, **e))(a, w)  # noqa: E731
    assert_all_epilogues(run, want, epi)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("b,h,w,c,o,kernel,stride,padding,pad_value,pool,tile",
                         [CONV_CASES[1], CONV_CASES[4], CONV_CASES[6], CONV_CASES[10]])
def test_without_ternary_kernels_conv2d_is_one_binary_convolution(without_ternary_kernels, mode, b, h, w, c, o,
                                                                  kernel, stride, padding, pad_value, pool,
                                                                  tile):  # fmt: skip
    rng = np.random.default_rng(b * 1009 + h * 101 + c * 7 + o + 1)
    x, x_values, weights, w_values = operands(rng, mode, (b, h, w, c), kernel + (c, o), conv=True, tile=tile)
    stride = (stride, stride) if isinstance(stride, int) else stride
    pads = ops._conv_padding(padding, (h, w), kernel, stride)
    want = numpy_max_pool(numpy_conv(x_values, w_values, stride, pads, pad_value), pool)

    def run(**epi):
        conv = lambda x: ops.bconv2d(x, weights, stride=stride, padding=padding, pad_value=pad_value, pool=pool,
                                     **epi)  # noqa: E731
        return jax.jit(conv)(x)

    epi = epilogue_operands(rng, want)
    assert custom_calls(lambda x: ops.bconv2d(x, weights, stride=stride, threshold=epi["threshold_planes"]),
                        x) == {"jaxbnn_bconv2d_bits"}
    assert_all_epilogues(run, want, epi)
    np.testing.assert_array_equal(np.asarray(jax.vmap(lambda x: ops.bconv2d(x, weights, stride=stride, padding=padding,
                                                                            pad_value=pad_value, pool=pool))(
        jax.tree.map(lambda p: p[None], x)))[0], want)  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("b,h,w,c,o,kernel,stride,padding,pad_value,pool", [
    (2, 9, 8, 5, 13, (3, 3), 2, "SAME", "one", None),    # 10 / 20 channels side by side
    (1, 7, 9, 8, 40, (5, 3), 1, "SAME", "zero", (2, 2)),  # TNN's 4 x 8: the whole word; TBN / BTN 16
])  # fmt: skip
def test_without_ternary_kernels_few_channels_lie_side_by_side_in_one_word(without_ternary_kernels, mode, b, h, w, c,
                                                                          o, kernel, stride, padding, pad_value,
                                                                          pool):  # fmt: skip
    """Where all the blocks' channels fit one word (a first layer on colour planes), the binary product reduces
    parts * C channels a tap, not parts word-aligned blocks: the same results, both paddings."""
    parts = {"tnn": 4, "tbn": 2, "btn": 2}[mode]
    rng = np.random.default_rng(b * 1009 + h * 101 + c * 7 + o + 3)
    x, x_values, weights, w_values = operands(rng, mode, (b, h, w, c), kernel + (c, o), conv=True)
    pads = ops._conv_padding(padding, (h, w), kernel, (stride, stride))
    want = numpy_max_pool(numpy_conv(x_values, w_values, (stride, stride), pads, pad_value), pool)
    prepared = ops.side_by_side_weights(weights, ternary_activations=mode != "btn")
    assert prepared.in_channels == (parts * c if parts * c <= 32 else parts * 32)

    def run(**epi):
        return jax.jit(lambda x: ops.bconv2d(x, weights, stride=stride, padding=padding, pad_value=pad_value,
                                             pool=pool, **epi))(x)

    assert_all_epilogues(run, want, epilogue_operands(rng, want))
    a, a_values, dense, d_values = operands(rng, mode, (6, c), (c, o), conv=False)
    np.testing.assert_array_equal(np.asarray(ops.bmm(a, dense)), (a_values @ d_values).astype(np.int32))
    assert ops.side_by_side_weights(dense, ternary_activations=mode != "btn").k == prepared.in_channels


@pytest.mark.parametrize("m,k,n", [(5, 500, 33), (3, 1000, 70), (2, 1500, 9), (1, 4096, 1)])
def test_without_ternary_kernels_long_tnn_bmm_runs_as_three_blocks_the_first_two_doubled(without_ternary_kernels, m,
                                                                                        k, n):
    """A dense TNN product where three blocks are shorter than four: P, N and Z of the activations against P, N
    and E of the weights, the first two blocks' counts doubled, is 4 times the ternary product (on CUDA one
    bmm_doubled call; here its jnp form), with every epilogue, and the same from weights built once."""
    rng = np.random.default_rng(k * 31 + n)
    a, a_values, w, w_values = operands(rng, "tnn", (m, k), (k, n), conv=False)
    want = (a_values @ w_values).astype(np.int32)
    epi = epilogue_operands(rng, want)
    run = lambda **e: jax.jit(lambda a, w: ops.bmm(a, w, **e))(a, w)  # noqa: E731
    assert_all_epilogues(run, want, epi)
    prepared = ops.side_by_side_weights(w, ternary_activations=True, threshold_planes=2)
    assert prepared.k == 3 * 512 * -(-k // 512)
    np.testing.assert_array_equal(
        np.asarray(ops.bmm(a, w, threshold=epi["threshold_planes"][:2], flip=epi["flip_planes"][:2],
                           side_by_side=prepared)),
        np.asarray(reference.epilogue(jnp.asarray(want), threshold=epi["threshold_planes"][:2],
                                      flip=epi["flip_planes"][:2])))  # fmt: skip


def test_without_ternary_kernels_the_three_blocks_read_a_pos_bit_without_its_nonneg_bit_as_zero(
        without_ternary_kernels):
    """Activation planes with pos bits set where nonneg bits are not (values (a + b) / 2 = 0, docs/formats.md):
    the three-block product (dense and convolution) gives the reference's products, as the four blocks do."""
    rng = np.random.default_rng(5)
    k, n = 512, 6
    w = formats.pack_ternary_dense_weights(rng.integers(-1, 2, (k, n)).astype(np.float32))
    nonneg, pos = rng.random((3, k)) < 0.5, rng.random((3, k)) < 0.5  # every pair, (0, 1) among them
    x = formats.TernaryPlanes(formats.pack_bits(nonneg), formats.pack_bits(pos))
    np.testing.assert_array_equal(np.asarray(ops.bmm(x, w)),
                                  np.asarray(reference.bmm(x, w.bits, k, n, ternary_weights=True)))
    conv = formats.pack_ternary_conv_weights(rng.integers(-1, 2, (3, 3, 512, 5)).astype(np.float32))
    cn, cp = rng.random((1, 4, 4, 512)) < 0.5, rng.random((1, 4, 4, 512)) < 0.5
    planes = formats.TernaryPlanes(formats.pack_bits(cn), formats.pack_bits(cp))
    np.testing.assert_array_equal(
        np.asarray(ops.bconv2d(planes, conv)),
        np.asarray(reference.bconv2d(planes, conv.bits, in_channels=512, out_channels=5, kernel_size=(3, 3),
                                     stride=(1, 1), padding=((1, 1), (1, 1)), pad_value="zero", ternary_weights=True)))


@pytest.mark.parametrize("b,h,w,c,o,kernel,stride,padding,pad_value,pool", [
    (2, 6, 7, 512, 40, (3, 3), 1, "SAME", "zero", None),     # a tap's third block half a K block
    (1, 5, 5, 1000, 33, (3, 3), 2, "SAME", "zero", None),    # channels short of whole blocks, strided
    (2, 8, 6, 450, 70, (3, 3), 1, "VALID", "one", (2, 2)),   # no padding: "one" changes nothing, pooled
    (1, 4, 4, 2048, 20, (1, 3), 1, "SAME", "zero", None),
])  # fmt: skip
def test_without_ternary_kernels_long_tnn_conv_runs_as_three_blocks_a_tap_the_first_two_doubled(
        without_ternary_kernels, b, h, w, c, o, kernel, stride, padding, pad_value, pool):
    """A TNN convolution whose four blocks a tap would be longer (past what the resident kernel keeps): each
    pixel's P, N and Z against each tap's P, N and E, every tap's first two blocks first and counted twice, is 4
    times the ternary convolution (on CUDA one bconv2d_doubled call; here its jnp form), with every epilogue and
    both threshold planes, and the same from weights built once."""
    rng = np.random.default_rng(c * 13 + o)
    x, x_values, weights, w_values = operands(rng, "tnn", (b, h, w, c), kernel + (c, o), conv=True)
    pads = ops._conv_padding(padding, (h, w), kernel, (stride, stride))
    want = numpy_max_pool(numpy_conv(x_values, w_values, (stride, stride), pads, pad_value), pool)
    assert ops._takes_doubled_conv("tnn", c, kernel[0] * kernel[1])
    prepared = ops.side_by_side_weights(weights, ternary_activations=True, threshold_planes=2)
    assert prepared.in_channels == 3 * 512 * -(-c // 512)

    def run(**epi):
        return jax.jit(lambda x: ops.bconv2d(x, weights, stride=stride, padding=padding, pad_value=pad_value,
                                             pool=pool, **epi))(x)

    epi = epilogue_operands(rng, want)
    assert_all_epilogues(run, want, epi)
    assert "jaxbnn_bconv2d_doubled_bits" not in custom_calls(run)  # the CPU runs its jnp form
    planes = dict(threshold=epi["threshold_planes"][:2], flip=epi["flip_planes"][:2])
    np.testing.assert_array_equal(
        np.asarray(ops.bconv2d(x, weights, stride=stride, padding=padding, pad_value=pad_value, pool=pool,
                               side_by_side=prepared, **planes)),
        np.asarray(reference.epilogue(jnp.asarray(want), **planes)))


@pytest.mark.parametrize("padding", ["SAME", "VALID"])
def test_without_ternary_kernels_a_tnn_conv_takes_either_weights_built_once(without_ternary_kernels, padding):
    """The three-block weights of a plain convolution and the four-block ones of a residual convolution
    (`shortcut=True`) give a TNN convolution the same results; "one" padding runs the four blocks from either."""
    rng = np.random.default_rng(5)
    x, x_values, weights, w_values = operands(rng, "tnn", (2, 5, 5, 512), (3, 3, 512, 24), conv=True)
    three = ops.side_by_side_weights(weights, ternary_activations=True)
    four = ops.side_by_side_weights(weights, ternary_activations=True, shortcut=True)
    assert (three.in_channels, four.in_channels) == (3 * 512, 4 * 512)
    for pad_value in ("zero", "one"):
        pads = ops._conv_padding(padding, (5, 5), (3, 3), (1, 1))
        want = numpy_conv(x_values, w_values, (1, 1), pads, pad_value)
        for prepared in (None, three, four):
            got = ops.bconv2d(x, weights, padding=padding, pad_value=pad_value, side_by_side=prepared)
            np.testing.assert_array_equal(np.asarray(got), want)


def test_the_doubled_convolution_counts_every_taps_first_words_twice():
    """The doubled binary convolution's jnp form (the CUDA handlers' spec), against the same counts in numpy: per
    output pixel, over the taps in frame, tap_c - 2 popc(a) - 2 popc(tap) + 4 (2 S_1 + S_2), tap_c = 2 (D + c),
    S_1 over each tap's first D bits (every tap's come first in the weights' reduction), S_2 over the rest."""
    rng = np.random.default_rng(8)
    b, h, w, c, o, doubled_words = 2, 4, 5, 96 * 32, 7, 64
    x_bits, w_bits = rng.integers(0, 2, (b, h, w, c)), rng.integers(0, 2, (o, 3, 3, c))
    popcount = rng.integers(0, 2 * c, (9, o)).astype(np.int32)
    d = doubled_words * 32
    order = np.concatenate([w_bits[..., :d].reshape(o, -1), w_bits[..., d:].reshape(o, -1)], axis=-1)
    got = ops._doubled_binary_conv(ops.pack_bits(2 * x_bits - 1), formats.to_fsb(ops.pack_bits(2 * order - 1)),
                                   jnp.asarray(popcount), {}, attrs=(c, o, 3, 3, 1, 1, 1, 1, 1, 1, False, 1, 1),
                                   kind="i32", pooled=False, doubled_tap_words=doubled_words)
    padded = np.pad(x_bits, ((0, 0), (1, 1), (1, 1), (0, 0)))
    inside = np.pad(np.ones((h, w), np.int64), 1)
    want = np.zeros((b, h, w, o), np.int64)
    for i in range(3):
        for j in range(3):
            a = padded[:, i:i + h, j:j + w]
            sums = 2 * a[..., :d] @ w_bits[:, i, j, :d].T + a[..., d:] @ w_bits[:, i, j, d:].T
            term = 2 * (d + c) - 2 * a.sum(-1, keepdims=True) - 2 * popcount[3 * i + j] + 4 * sums
            want += inside[i:i + h, j:j + w, None] * term
    np.testing.assert_array_equal(np.asarray(got), want)


def test_the_doubled_product_counts_the_first_blocks_twice():
    """The doubled binary product's jnp form (the CUDA handlers' spec): R - 2 popc(a) - 2 popcount + 4 (2 S_1 + S_2),
    R = 2 (D + K), S_1 / S_2 the AND counts of the first D bits and the rest."""
    rng = np.random.default_rng(21)
    m, n, k, doubled = 4, 5, 2048 + 96, 2
    a_bits, w_bits = rng.integers(0, 2, (m, k)), rng.integers(0, 2, (n, k))
    popcount = rng.integers(0, k, n).astype(np.int32)
    got = ops._doubled_binary_bmm(ops.pack_bits(2 * a_bits - 1), formats.to_fsb(ops.pack_bits(2 * w_bits - 1)),
                                  jnp.asarray(popcount), {}, k=k, n=n, kind="i32", doubled_k_blocks=doubled)
    split = 1024 * doubled
    sums = 2 * a_bits[:, :split] @ w_bits[:, :split].T + a_bits[:, split:] @ w_bits[:, split:].T
    want = 2 * (split + k) - 2 * a_bits.sum(1)[:, None] - 2 * popcount[None, :] + 4 * sums
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("mode", MODES)
def test_without_ternary_kernels_too_long_a_reduction_runs_as_separate_binary_products(without_ternary_kernels,
                                                                                      mode, monkeypatch):
    """Where the planes side by side would exceed the kernels' longest reduction, the 2 or 4 binary products
    run as separate blocks of one int32 call, summed in XLA."""
    monkeypatch.setattr(ops, "_KERNEL_REDUCTION_WORDS", 3)
    rng = np.random.default_rng(14)
    a, a_values, w, w_values = operands(rng, mode, (9, 70), (70, 33), conv=False)
    want = (a_values @ w_values).astype(np.int32)
    assert custom_calls(lambda a, w: ops.bmm(a, w, threshold=np.zeros((2, 33), np.int32)), a, w) == {"jaxbnn_bmm_i32"}
    run = lambda **e: jax.jit(lambda a, w: ops.bmm(a, w, **e))(a, w)  # noqa: E731
    assert_all_epilogues(run, want, epilogue_operands(rng, want), fused_affine=True)


@pytest.mark.parametrize("mode", MODES)
def test_side_by_side_weights_built_once_give_what_each_call_builds(without_ternary_kernels, mode):
    rng = np.random.default_rng(15)
    x, x_values, weights, w_values = operands(rng, mode, (2, 7, 6, 40), (3, 3, 40, 21), conv=True)
    want = numpy_conv(x_values, w_values, (1, 1), ((1, 1), (1, 1)), "zero")
    epi = epilogue_operands(rng, want, planes=2)
    three = dict(threshold=np.concatenate([epi["threshold_planes"], epi["threshold"][None]]),
                 flip=np.concatenate([epi["flip_planes"], epi["flip"][None]]))
    for planes, epilogue in ((0, {}), (0, dict(scale=epi["scale"], bias=epi["bias"])),
                             (0, dict(threshold=epi["threshold"], flip=epi["flip"])),
                             (2, dict(threshold=epi["threshold_planes"], flip=epi["flip_planes"])), (3, three)):
        prepared = ops.side_by_side_weights(weights, ternary_activations=mode != "btn", threshold_planes=planes)
        conv = jax.jit(lambda x, w, s: ops.bconv2d(x, w, side_by_side=s, **epilogue))
        np.testing.assert_array_equal(np.asarray(conv(x, weights, prepared)), np.asarray(conv(x, weights, None)))
    a, a_values, dense, d_values = operands(rng, mode, (5, 70), (70, 9), conv=False)
    prepared = ops.side_by_side_weights(dense, ternary_activations=mode != "btn", threshold_planes=2)
    threshold = np.stack([np.full(9, -3), np.full(9, 4)]).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(ops.bmm(a, dense, threshold=threshold, side_by_side=prepared)),
                                  np.asarray(reference.epilogue(jnp.asarray((a_values @ d_values).astype(np.int32)),
                                                                threshold=threshold)))  # fmt: skip


def test_side_by_side_weights_of_a_ternary_output_are_the_product_s_own():
    """The kernels' bit epilogue writes a ternary output's two planes from one product: the side-by-side weights
    of two threshold planes have the product's N columns, not a copy per plane, unless every plane's columns fit
    one narrow tile (2 x 32 ceil(N/32) <= 128), or there are more than two planes."""
    rng = np.random.default_rng(18)
    _, _, w, _ = operands(rng, "tnn", (5, 70), (70, 70), conv=False)
    two_planes = ops.side_by_side_weights(w, ternary_activations=True, threshold_planes=2)
    one_plane = ops.side_by_side_weights(w, ternary_activations=True)
    assert (two_planes.k, two_planes.n) == (one_plane.k, one_plane.n) == (384, 70)
    np.testing.assert_array_equal(np.asarray(two_planes.bits), np.asarray(one_plane.bits))
    assert ops.side_by_side_weights(w, ternary_activations=True, threshold_planes=3).n == 3 * 96
    _, _, narrow, _ = operands(rng, "tnn", (5, 70), (70, 64), conv=False)
    assert ops.side_by_side_weights(narrow, ternary_activations=True, threshold_planes=2).n == 128


@pytest.mark.parametrize("o", [64, 96])  # its planes as columns side by side / as the epilogue's planes
def test_without_ternary_kernels_a_ternary_output_is_the_next_products_operand_as_it_lies(without_ternary_kernels, o):
    """TBN layer to TBN layer: the first call's (..., 2, W) planes are the second's side-by-side operand
    `[nonneg | pos]` as they lie, so the compiled program copies nothing between the two calls (XLA folds the
    stack of the pair's slices back into the first call's output)."""
    rng = np.random.default_rng(o)
    x, x_values, w1, w1_values = operands(rng, "tbn", (2, 6, 6, 64), (3, 3, 64, o), conv=True)
    _, _, w2, w2_values = operands(rng, "tbn", (2, 6, 6, o), (3, 3, o, 32), conv=True)
    threshold = np.stack([np.full(o, -2), np.full(o, 3)]).astype(np.int32)
    first = ops.side_by_side_weights(w1, ternary_activations=True, threshold_planes=2)
    second = ops.side_by_side_weights(w2, ternary_activations=True)

    def two_layers(x):
        planes = ops.bconv2d(x, w1, padding="SAME", threshold=threshold, side_by_side=first)
        return ops.bconv2d(formats.TernaryPlanes(planes[..., 0, :], planes[..., 1, :]), w2, padding="SAME",
                           side_by_side=second)

    hlo = jax.jit(two_layers).lower(x).compile().as_text()
    entry = {name: (op, operand) for name, op, operand in
             re.findall(r"(%[\w.]+) = \S+ ([\w-]+)\((%[\w.]+)", hlo[hlo.index("ENTRY"):])}
    first_call, second_call = [name for name, (op, _) in entry.items() if op == "custom-call"]
    operand = entry[second_call][1]
    while entry[operand][0] == "bitcast":  # a bitcast reinterprets the buffer: no copy
        operand = entry[operand][1]
    assert operand == first_call, hlo
    same = ((1, 1), (1, 1))
    first_dot = numpy_conv(x_values, w1_values, (1, 1), same, "zero")
    ternary_output = (first_dot >= -2).astype(np.float32) + (first_dot >= 3) - 1
    np.testing.assert_array_equal(np.asarray(jax.jit(two_layers)(x)),
                                  numpy_conv(ternary_output, w2_values, (1, 1), same, "zero"))


def test_side_by_side_weights_of_another_product_are_refused():
    rng = np.random.default_rng(16)
    a, _, w, _ = operands(rng, "tnn", (5, 70), (70, 9), conv=False)
    one_plane = ops.side_by_side_weights(w, ternary_activations=True)
    with pytest.raises(ValueError, match=r"side_by_side has \{'k': 384, 'n': 9\}; this call's product \(tnn, 2 "
                                         r"threshold planes\) needs \{'k': 384, 'n': 64\}"):
        ops.bmm(a, w, threshold=np.zeros((2, 9), np.int32), side_by_side=one_plane)
    with pytest.raises(ValueError, match=r"needs \{'k': 192"):
        ops.bmm(ops.pack_bits(signs(rng, (5, 70))), w, side_by_side=one_plane)
    with pytest.raises(ValueError, match="side_by_side weights belong to a product with a ternary operand"):
        binary = formats.pack_dense_weights(signs(rng, (70, 9)))
        ops.bmm(ops.pack_bits(signs(rng, (5, 70))), binary, side_by_side=one_plane)
    with pytest.raises(ValueError, match="binary activations times binary weights run as they are"):
        ops.side_by_side_weights(formats.pack_dense_weights(signs(rng, (70, 9))), ternary_activations=False)
    with pytest.raises(TypeError, match=r"side_by_side must be the formats.ConvBits"):
        x, _, cw, _ = operands(rng, "tnn", (1, 5, 5, 40), (3, 3, 40, 6), conv=True)
        ops.bconv2d(x, cw, side_by_side=one_plane)


# --- the residual epilogue: a ternary or mixed ResNet block's second convolution ---------------------

# (batch dims, h, w, c, o, pad_value, shortcut (SH, SW, SC), shortcut stride, shift, stream type): the identity
# shortcut; type A (stride 2, fewer channels) over leading batch dims with a shift; a few channels (the dense
# blocks of the side-by-side product)
TERNARY_RESIDUAL_CASES = [
    ((2,), 6, 7, 40, 40, "zero", (6, 7, 40), 1, 0, np.int16),
    ((2, 1), 5, 4, 33, 70, "one", (9, 8, 30), 2, 3, np.int32),
    ((1,), 6, 6, 5, 9, "zero", (6, 6, 9), 1, 1, np.int16),
]


@pytest.mark.parametrize("mode, case, kernels", [("tnn", TERNARY_RESIDUAL_CASES[0], "side by side"),
                                                 ("tbn", TERNARY_RESIDUAL_CASES[1], "side by side"),
                                                 ("btn", TERNARY_RESIDUAL_CASES[2], "side by side"),
                                                 ("tnn", TERNARY_RESIDUAL_CASES[1], "native")],
                         ids=lambda v: v if isinstance(v, str) else f"c{v[3]}_o{v[4]}_s{v[7]}")
def test_residual_epilogue_of_a_ternary_product_is_its_dot_plus_the_shortcut(request, mode, kernels, case):
    """`(dot >> shift) + shortcut` in the shortcut's type, and the stream's bits through one threshold or a
    ternary pair of planes: from the product's own kernel, and from the side-by-side binary product (the GPU's
    way: `parts` times the dot, shifted by log2(parts) more)."""
    if kernels == "side by side":
        request.getfixturevalue("without_ternary_kernels")
    lead, h, w, c, o, pad_value, (sh, sw, sc), stride, shift, stream_dtype = case
    rng = np.random.default_rng(h * 31 + c * 7 + o + stride)
    x, x_values, weights, w_values = operands(rng, mode, lead + (h, w, c), (3, 3, c, o), conv=True)
    flat = x_values.reshape((-1, h, w, c))
    dot = numpy_conv(flat, w_values, (1, 1), ((1, 1), (1, 1)), pad_value).reshape(lead + (h, w, o))
    epi = epilogue_operands(rng, dot, planes=2)
    shortcut = rng.integers(-300, 300, lead + (sh, sw, sc)).astype(stream_dtype)
    shortcut.reshape(-1)[0] = np.iinfo(stream_dtype).max  # the sum wraps as the stream's type does
    short = np.zeros(lead + (h, w, o), np.int64)
    short[..., :sc] = shortcut[..., ::stride, ::stride, :]
    unsigned = np.uint16 if stream_dtype == np.int16 else np.uint32
    want = ((dot.astype(np.int64) >> shift) + short).astype(np.uint64).astype(unsigned).view(stream_dtype)
    epilogues = ((None, None), (epi["threshold"], epi["flip"]), (epi["threshold_planes"], epi["flip_planes"]))
    for threshold, flip in epilogues:
        conv = jax.jit(lambda x, s: ops.bconv2d(x, weights, padding="SAME", pad_value=pad_value, shortcut=s,
                                                shortcut_stride=stride, shift=shift, threshold=threshold, flip=flip))
        got = conv(x, shortcut)
        stream = got if threshold is None else got[0]
        assert stream.dtype == stream_dtype
        np.testing.assert_array_equal(np.asarray(stream), want)
        if threshold is not None:
            want_bits = reference.epilogue(jnp.asarray(want.astype(np.int32)), threshold=threshold, flip=flip)
            np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want_bits))
    prepared = ops.side_by_side_weights(weights, ternary_activations=mode != "btn")
    with_prepared = ops.bconv2d(x, weights, padding="SAME", pad_value=pad_value, shortcut=shortcut,
                                shortcut_stride=stride, shift=shift, side_by_side=prepared)
    np.testing.assert_array_equal(np.asarray(with_prepared), want)


NATIVE_RESIDUAL_CASES = [  # as TERNARY_RESIDUAL_CASES, every stream int16
    ((2,), 6, 7, 40, 40, "zero", (6, 7, 40), 1, 0),
    ((2, 1), 5, 4, 33, 70, "one", (9, 8, 30), 2, 3),
    ((1,), 6, 6, 5, 9, "zero", (6, 6, 9), 1, 1),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", NATIVE_RESIDUAL_CASES, ids=lambda v: f"c{v[3]}_o{v[4]}_s{v[7]}")
def test_the_cpu_adds_an_int16_shortcut_in_the_products_own_kernel(isa, mode, case):
    """Over an int16 stream the product's own kernel adds the shortcut in its strip epilogue, one
    jaxbnn_{mode}_conv2d_residual_i16 / _i16_bits call, every tier: the stream wrapping as int16 and its bits
    through one threshold or a ternary pair of planes, as numpy says."""
    lead, h, w, c, o, pad_value, (sh, sw, sc), stride, shift = case
    rng = np.random.default_rng(h * 37 + c * 5 + o + stride)
    x, x_values, weights, w_values = operands(rng, mode, lead + (h, w, c), (3, 3, c, o), conv=True)
    flat = x_values.reshape((-1, h, w, c))
    dot = numpy_conv(flat, w_values, (1, 1), ((1, 1), (1, 1)), pad_value).reshape(lead + (h, w, o))
    epi = epilogue_operands(rng, dot, planes=2)
    shortcut = rng.integers(-32768, 32768, lead + (sh, sw, sc)).astype(np.int16)  # sums that wrap
    short = np.zeros(lead + (h, w, o), np.int64)
    short[..., :sc] = shortcut[..., ::stride, ::stride, :]
    want = ((dot.astype(np.int64) >> shift) + short).astype(np.uint64).astype(np.uint16).view(np.int16)
    epilogues = ((None, None), (epi["threshold"], epi["flip"]), (epi["threshold_planes"], epi["flip_planes"]))
    for threshold, flip in epilogues:
        conv = jax.jit(lambda x, s: ops.bconv2d(x, weights, padding="SAME", pad_value=pad_value, shortcut=s,
                                                shortcut_stride=stride, shift=shift, threshold=threshold, flip=flip))
        target = f"jaxbnn_{mode}_conv2d_residual_i16" + ("" if threshold is None else "_bits")
        assert f"@{target}(" in conv.lower(x, shortcut).as_text()
        got = conv(x, shortcut)
        stream = got if threshold is None else got[0]
        assert stream.dtype == np.int16
        np.testing.assert_array_equal(np.asarray(stream), want)
        if threshold is not None:
            want_bits = reference.epilogue(jnp.asarray(want.astype(np.int32)), threshold=threshold, flip=flip)
            np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want_bits))


@pytest.fixture(params=["this platform", "every CUDA branch traced"])
def cuda_branches(request, monkeypatch):
    """The ops as traced here, and with every CUDA target taken as registered: `platform_dependent` traces each
    platform's branch, so a CUDA branch that cannot be vmapped fails here too (its lowering is never asked)."""
    if request.param != "this platform":
        registered = _ffi.has_target
        monkeypatch.setattr(_ffi, "has_target",
                            lambda platform, target: platform == "cuda" or registered(platform, target))
    jax.clear_caches()  # the ops' jitted functions would keep the traces of the other registrations
    yield request.param
    jax.clear_caches()


@pytest.mark.parametrize("mode", ["bnn"] + MODES)
@pytest.mark.parametrize("stream_dtype", [np.int16, np.int32])
def test_the_residual_op_under_vmap_is_its_loop(cuda_branches, mode, stream_dtype):
    """vmap of `bconv2d(..., shortcut=...)` over the activations, the shortcut or both: each vmapped row with its
    own shortcut, as a loop over them gives (an unbatched shortcut goes with every row)."""
    rng = np.random.default_rng(31)
    x, _, weights, _ = operands(rng, mode, (3, 2, 5, 6, 40), (3, 3, 40, 36), conv=True)
    shortcut = rng.integers(-300, 300, (3, 2, 5, 6, 36)).astype(stream_dtype)
    threshold, flip = rng.integers(-9, 9, (2, 36)).astype(np.int32), rng.random((2, 36)) < 0.5

    def block(x, s):
        return ops.bconv2d(x, weights, shortcut=s, threshold=threshold, flip=flip)

    def row(tree, i):
        return jax.tree.map(lambda v: v[i], tree)

    for in_axes, pick in (((0, 0), lambda i: (row(x, i), shortcut[i])), ((0, None), lambda i: (row(x, i), shortcut[0])),
                          ((None, 0), lambda i: (row(x, 0), shortcut[i]))):
        got = jax.jit(jax.vmap(block, in_axes=in_axes))(x, shortcut if in_axes[1] == 0 else shortcut[0]) \
            if in_axes[0] == 0 else jax.jit(jax.vmap(block, in_axes=in_axes))(row(x, 0), shortcut)
        for i in range(3):
            want = block(*pick(i))
            for got_part, want_part in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_array_equal(np.asarray(got_part[i]), np.asarray(want_part), err_msg=str(in_axes))


def test_residual_epilogue_of_a_ternary_product_refuses_side_by_side_weights_of_another_epilogue():
    rng = np.random.default_rng(16)
    x, _, weights, _ = operands(rng, "tnn", (1, 5, 5, 40), (3, 3, 40, 40), conv=True)
    planes = ops.side_by_side_weights(weights, ternary_activations=True, threshold_planes=3)
    with pytest.raises(ValueError, match="threshold_planes=0"):
        ops.bconv2d(x, weights, padding="SAME", shortcut=np.zeros((1, 5, 5, 40), np.int16), side_by_side=planes)


@pytest.mark.parametrize("mode", ["bnn"] + MODES)
def test_batches_past_the_kernels_int32_indexing_run_in_chunks(mode, monkeypatch):
    """A call whose input words or output elements exceed int32 (VGG-16's first layers at batch 512 with a
    ternary output) runs as several calls on consecutive rows: the same result."""
    rng = np.random.default_rng(17)
    x, _, weights, _ = operands(rng, mode, (5, 6, 7, 40), (3, 3, 40, 21), conv=True)
    a, _, dense, _ = operands(rng, mode, (11, 70), (70, 9), conv=False)
    planes = 2 if mode in ("tnn", "tbn") else 1
    threshold = np.zeros((planes, 21), np.int32) if mode in ("tnn", "tbn") else np.zeros(21, np.int32)
    dense_threshold = threshold[..., :9]
    want = [np.asarray(ops.bconv2d(x, weights, pool=(2, 2), threshold=threshold)),
            np.asarray(ops.bmm(a, dense, threshold=dense_threshold)), np.asarray(ops.bmm(a, dense))]
    monkeypatch.setattr(ops, "_KERNEL_INDEX_LIMIT", 2 * 6 * 7 * 21 * planes)
    jax.clear_caches()
    conv_hlo = jax.jit(lambda x: ops.bconv2d(x, weights, pool=(2, 2), threshold=threshold)).lower(x).as_text("hlo")
    # (on CUDA the pooled bits come from an unpooled call, and a ternary product's columns split it again)
    batches = {int(b) for b in re.findall(r"= u32\[(\d+),\d+,\d+,[\d,]+\]\S* custom-call\(", conv_hlo)}
    assert batches and max(batches) <= 2
    got = [np.asarray(ops.bconv2d(x, weights, pool=(2, 2), threshold=threshold)),
           np.asarray(ops.bmm(a, dense, threshold=dense_threshold)), np.asarray(ops.bmm(a, dense))]
    jax.clear_caches()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("mode", MODES)
def test_dense_batches_chunk_by_the_side_by_side_operand_s_words(without_ternary_kernels, mode, monkeypatch):
    """Where the platform runs a product with a ternary operand side by side, a dense call's rows are chunked by
    the side-by-side operand's words (2, 3 or 4 times the planes' words), which the kernels index: the same
    result from calls of at most limit / words rows."""
    rng = np.random.default_rng(19)
    a, a_values, w, w_values = operands(rng, mode, (13, 1000), (1000, 9), conv=False)
    want = (a_values @ w_values).astype(np.int32)
    words = ops._dense_side_by_side_channels(mode, 1000) // 32
    monkeypatch.setattr(ops, "_KERNEL_INDEX_LIMIT", 4 * words)
    jax.clear_caches()
    hlo = jax.jit(lambda a, w: ops.bmm(a, w)).lower(a, w).as_text("hlo")
    rows = {int(m) for m in re.findall(r"s32\[(\d+),\d+\]\S* (?:custom-call|dot)\(", hlo)}
    assert rows and max(rows) <= 4
    np.testing.assert_array_equal(np.asarray(ops.bmm(a, w)), want)
    jax.clear_caches()


@pytest.mark.parametrize("mode", MODES)
def test_empty_batches_give_empty_results(mode):
    rng = np.random.default_rng(6)
    a, _, w, _ = operands(rng, mode, (0, 70), (70, 9), conv=False)
    assert ops.bmm(a, w).shape == (0, 9)
    x, _, weights, _ = operands(rng, mode, (0, 5, 5, 40), (3, 3, 40, 9), conv=True)
    assert ops.bconv2d(x, weights, threshold=np.zeros(9, np.int32)).shape == (0, 5, 5, 1)


# --- what the Python front refuses ------------------------------------------------------------------


def test_front_refuses_planes_of_different_shapes_or_dtypes():
    rng = np.random.default_rng(7)
    a, _, w, _ = operands(rng, "tnn", (5, 70), (70, 9), conv=False)
    with pytest.raises(ValueError, match=r"the planes of ternary a must have one shape, got a.nonneg \(5, 3\) and "
                                         r"a.pos \(4, 3\)"):
        ops.bmm(formats.TernaryPlanes(a.nonneg, a.pos[:4]), w)
    with pytest.raises(TypeError, match="a.pos must hold packed uint32 words, got dtype int32"):
        ops.bmm(formats.TernaryPlanes(a.nonneg, np.zeros((5, 3), np.int32)), w)
    with pytest.raises(ValueError, match="x.nonneg has 3 words on its last axis, but 40 bits pack into 2 words"):
        ops.bconv2d(formats.TernaryPlanes(np.zeros((1, 4, 4, 3), np.uint32), np.zeros((1, 4, 4, 3), np.uint32)),
                    formats.pack_ternary_conv_weights(np.ones((3, 3, 40, 4))))  # fmt: skip


def test_front_refuses_threshold_planes_of_the_binary_product_and_of_the_wrong_shape():
    rng = np.random.default_rng(13)
    a, _, w, _ = operands(rng, "tbn", (5, 70), (70, 9), conv=False)
    binary_a = ops.pack_bits(signs(rng, (5, 70)))
    with pytest.raises(ValueError, match=r"threshold planes of shape \(2, 9\) are taken by the products with a "
                                         r"ternary operand; the binary product takes a threshold of shape \(9,\)"):
        ops.bmm(binary_a, w, threshold=np.zeros((2, 9), np.int32))
    with pytest.raises(ValueError, match=r"threshold must have shape \(9,\) or \(planes, 9\) with 1 to 8 planes"):
        ops.bmm(a, w, threshold=np.zeros((9, 9), np.int32))
    with pytest.raises(ValueError, match=r"flip must have the shape of threshold, \(2, 9\), got \(9,\)"):
        ops.bmm(a, w, threshold=np.zeros((2, 9), np.int32), flip=np.zeros(9, bool))


def test_front_checks_the_popcounts_of_ternary_weights():
    rng = np.random.default_rng(9)
    a, _, w, _ = operands(rng, "btn", (5, 70), (70, 9), conv=False)
    with pytest.raises(ValueError, match=r"b_popcount must have shape \(18,\), got \(9,\)"):
        ops.bmm(a, w, b_popcount=np.zeros(9, np.int32))
    wrong = np.asarray(w.popcount).copy()
    wrong[11] += 1
    with pytest.raises(ValueError, match=r"b_popcount does not count the \+1 bits of the weights: at \(11,\)"):
        ops.bmm(a, w, b_popcount=wrong)
    x, _, weights, _ = operands(rng, "tnn", (1, 5, 5, 40), (3, 3, 40, 6), conv=True)
    with pytest.raises(ValueError, match=r"w_tap_popcount must have shape \(9, 12\), got \(9, 6\)"):
        ops.bconv2d(x, weights, w_tap_popcount=np.zeros((9, 6), np.int32))


def test_front_refuses_ternary_weights_of_the_wrong_size():
    rng = np.random.default_rng(10)
    a, _, w, _ = operands(rng, "tnn", (5, 70), (70, 9), conv=False)
    with pytest.raises(ValueError, match=r"FSB b of shape \(3, 1, 8, 4\) holds 17..24 rows, not 26"):
        ops.bmm(a, formats.TernaryDenseBits(w.bits, w.popcount, k=70, n=13))
    x, _, weights, _ = operands(rng, "btn", (1, 5, 5, 40), (3, 3, 40, 6), conv=True)
    row_packed = formats.from_fsb(weights.bits, 12, 9 * 2 * 32).reshape(12, 3, 3, 2)
    with pytest.raises(ValueError, match="out_channels=5 but w has 12 rows"):
        ops.bconv2d(x, formats.TernaryConvBits(row_packed, weights.tap_popcount, kernel_size=(3, 3), in_channels=40,
                                               out_channels=5))  # fmt: skip
    got = ops.bconv2d(x, formats.TernaryConvBits(row_packed, weights.tap_popcount, kernel_size=(3, 3),
                                                 in_channels=40, out_channels=6))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ops.bconv2d(x, weights)))


# --- the handlers' own validation -------------------------------------------------------------------


def ffi(target, out_shape, out_dtype, *operands, **attrs):
    """Call a native target directly (bypassing jaxbnn.ops and its Python-side checks)."""
    call = lambda *xs: jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(out_shape, out_dtype))(*xs, **attrs)  # noqa: E731
    return jax.block_until_ready(jax.jit(call)(*operands))


def u32(*shape):
    return jnp.asarray(np.random.default_rng(0).integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32))


I64 = np.int64
# Valid calls: M = 4, k = 100 (4 words), n = 10: ternary weights FSB (3, 1, 8, 4) of 20 rows, binary (2, 1, 8, 4).
BMM_OPERANDS = {
    "tnn": dict(x=u32(4, 2, 4), w=u32(3, 1, 8, 4)),  # ternary activations: both planes of a row side by side
    "tbn": dict(x=u32(4, 2, 4), w=u32(2, 1, 8, 4)),
    "btn": dict(a=u32(4, 4), w=u32(3, 1, 8, 4), w_popcount=jnp.zeros(20, jnp.int32)),
}


def bmm_call(mode, kind="i32", out=((4, 10), jnp.int32), extra=(), k=I64(100), n=I64(10), **change):
    operands = {**BMM_OPERANDS[mode], **change}
    return ffi(f"jaxbnn_{mode}_bmm_{kind}", *out, *operands.values(), *extra, k=k, n=n)


# A valid conv2d call: 1x5x5 image, c = 40 (2 words), o = 9, 3x3 kernel, stride 1, padding 1.
CONV_ATTRS = dict(c=I64(40), o=I64(9), kh=I64(3), kw=I64(3), stride_h=I64(1), stride_w=I64(1), pad_top=I64(1),
                  pad_bottom=I64(1), pad_left=I64(1), pad_right=I64(1), pad_one=False, pool_h=I64(1),
                  pool_w=I64(1))  # fmt: skip
CONV_OPERANDS = {
    "tnn": dict(x=u32(1, 5, 5, 2, 2), w=u32(3, 5, 8, 4)),
    "tbn": dict(x=u32(1, 5, 5, 2, 2), w=u32(2, 5, 8, 4)),
    "btn": dict(x=u32(1, 5, 5, 2), w=u32(3, 5, 8, 4), taps=jnp.zeros((9, 18), jnp.int32)),
}


def conv_call(mode, kind="i32", out=((1, 5, 5, 9), jnp.int32), extra=(), **change):
    operands = {k: change.pop(k) if k in change else v for k, v in CONV_OPERANDS[mode].items()}
    return ffi(f"jaxbnn_{mode}_conv2d_{kind}", *out, *operands.values(), *extra, **{**CONV_ATTRS, **change})


@pytest.mark.parametrize("mode", MODES)
def test_valid_direct_calls_run(mode):
    assert bmm_call(mode).shape == (4, 10)
    scale_bias = (jnp.ones(10, jnp.float32), jnp.zeros(10, jnp.float32))
    assert bmm_call(mode, "f32", ((4, 10), jnp.float32), scale_bias).dtype == jnp.float32
    threshold_flip = (jnp.zeros(10, jnp.int32), jnp.zeros(10, jnp.uint8))
    assert bmm_call(mode, "bits", ((4, 1), jnp.uint32), threshold_flip).shape == (4, 1)
    assert conv_call(mode).shape == (1, 5, 5, 9)
    assert conv_call(mode, "bits", ((1, 5, 5, 1), jnp.uint32), (jnp.zeros(9, jnp.int32), jnp.zeros(9, jnp.uint8)),
                     ).shape == (1, 5, 5, 1)  # fmt: skip


BMM_ERRORS = [
    ("tnn", "x without its planes", dict(x=u32(4, 4)), r"operand `x` must be uint32 of rank 3"),
    ("tbn", "x float32", dict(x=jnp.zeros((4, 2, 4), jnp.float32)), r"operand `x` must be uint32 of rank 3"),
    ("tnn", "x words != ceil(k/32)", dict(x=u32(4, 2, 3)),
     r"operand `x` has shape \(4, 2, 3\) but k = 100 and the 2 planes of ternary activations requires \(4, 2, 4\)"),
    ("tbn", "three planes", dict(x=u32(4, 3, 4)), r"operand `x` has shape \(4, 3, 4\) but .* requires \(4, 2, 4\)"),
    ("btn", "a rank 3", dict(a=u32(1, 4, 4)), r"operand `a` must be uint32 of rank 2"),
    ("tnn", "ternary weights of n rows", dict(w=u32(2, 1, 8, 4)),
     r"operand `w` has shape \(2, 1, 8, 4\) but \(2 \* n = 20, 100 reduction bits"),
    ("tbn", "binary weights of 2n rows", dict(w=u32(3, 1, 8, 4)),
     r"operand `w` has shape \(3, 1, 8, 4\) but \(n = 10, 100 reduction bits"),
    ("btn", "popcount of n rows", dict(w_popcount=jnp.zeros(10, jnp.int32)),
     r"operand `w_popcount` has shape \(10,\) but the two planes of n = 10 output columns requires \(20,\)"),
    ("btn", "popcount dtype", dict(w_popcount=jnp.zeros(20, jnp.uint32)), r"operand `w_popcount` must be int32"),
    ("btn", "negative k", dict(k=I64(-1)), r"attribute k = -1 is out of range"),
    ("tnn", "n beyond half of int32", dict(n=I64(2**30)), r"attribute n = 1073741824 is out of range"),
]


@pytest.mark.parametrize("mode,what,change,message", BMM_ERRORS, ids=[e[1] for e in BMM_ERRORS])
def test_bmm_handlers_refuse_bad_operands(mode, what, change, message):
    with pytest.raises(jax.errors.JaxRuntimeError, match=rf"jaxbnn_{mode}_bmm_i32: " + message):
        bmm_call(mode, **change)


@pytest.mark.parametrize("mode", MODES)
def test_handlers_take_threshold_planes(mode):
    threshold, flip = jnp.zeros((2, 10), jnp.int32), jnp.zeros((2, 10), jnp.uint8)
    assert bmm_call(mode, "bits", ((4, 2, 1), jnp.uint32), (threshold, flip)).shape == (4, 2, 1)
    conv_planes = (jnp.zeros((2, 9), jnp.int32), jnp.zeros((2, 9), jnp.uint8))
    assert conv_call(mode, "bits", ((1, 5, 5, 2, 1), jnp.uint32), conv_planes).shape == (1, 5, 5, 2, 1)
    with pytest.raises(jax.errors.JaxRuntimeError, match=rf"jaxbnn_{mode}_bmm_bits: operand `threshold` of shape "
                                                          r"\(9, 10\) has 9 planes; 1 to 8 are supported"):
        bmm_call(mode, "bits", ((4, 9, 1), jnp.uint32), (jnp.zeros((9, 10), jnp.int32), jnp.zeros((9, 10), jnp.uint8)))
    with pytest.raises(jax.errors.JaxRuntimeError, match=rf"jaxbnn_{mode}_bmm_bits: operand `flip` must be uint8 of "
                                                          r"rank 2"):
        bmm_call(mode, "bits", ((4, 2, 1), jnp.uint32), (threshold, jnp.zeros(10, jnp.uint8)))
    with pytest.raises(jax.errors.JaxRuntimeError, match=rf"jaxbnn_{mode}_bmm_bits: result has shape \(4, 1\), "
                                                          r"expected leading dims \(4, 2\)"):
        bmm_call(mode, "bits", ((4, 1), jnp.uint32), (threshold, flip))
    with pytest.raises(jax.errors.JaxRuntimeError, match=rf"jaxbnn_{mode}_conv2d_bits: result has shape"):
        conv_call(mode, "bits", ((1, 5, 5, 1), jnp.uint32), conv_planes)


@pytest.mark.parametrize("mode", MODES)
def test_bmm_handlers_refuse_bad_results_and_epilogue_operands(mode):
    with pytest.raises(jax.errors.JaxRuntimeError, match=rf"jaxbnn_{mode}_bmm_i32: result has shape \(4, 11\)"):
        bmm_call(mode, out=((4, 11), jnp.int32))
    with pytest.raises(jax.errors.JaxRuntimeError, match=rf"jaxbnn_{mode}_bmm_f32: operand `scale` must be float32"):
        bmm_call(mode, "f32", ((4, 10), jnp.float32), (jnp.ones(10, jnp.int32), jnp.zeros(10, jnp.float32)))
    with pytest.raises(jax.errors.JaxRuntimeError, match=rf"jaxbnn_{mode}_bmm_bits: operand `flip` has shape"):
        bmm_call(mode, "bits", ((4, 1), jnp.uint32), (jnp.zeros(10, jnp.int32), jnp.zeros(9, jnp.uint8)))


def test_handlers_refuse_a_missing_operand():
    """Decoding errors come from XLA's FFI layer itself: still an error, not a crash."""
    operands = BMM_OPERANDS["tnn"]
    with pytest.raises(jax.errors.JaxRuntimeError, match="Wrong number of arguments"):
        ffi("jaxbnn_tnn_bmm_i32", (4, 10), jnp.int32, operands["x"], k=I64(100), n=I64(10))


CONV_ERRORS = [
    ("tnn", "x without its planes", dict(x=u32(1, 5, 5, 2)), r"operand `x` must be uint32 of rank 5"),
    ("tbn", "x channel words", dict(x=u32(1, 5, 5, 2, 3)),
     r"operand `x` has shape \(1, 5, 5, 2, 3\) but c = 40 and the 2 planes of ternary activations requires"),
    ("btn", "x float32", dict(x=jnp.zeros((1, 5, 5, 2), jnp.float32)), r"operand `x` must be uint32 of rank 4"),
    ("tnn", "ternary weights of o rows", dict(w=u32(2, 5, 8, 4)),
     r"operand `w` has shape \(2, 5, 8, 4\) but \(2 \* o = 18"),
    ("btn", "tap popcount of o rows", dict(taps=jnp.zeros((9, 9), jnp.int32)),
     r"operand `w_tap_popcount` has shape \(9, 9\) but kh \* kw = 9 taps and the two planes of o = 9 output "
     r"channels requires \(9, 18\)"),
    ("tnn", "zero stride", dict(stride_h=I64(0)), r"attribute stride_h = 0 is out of range"),
    ("tbn", "kernel larger than input", dict(kh=I64(9)), r"the kernel 9 x 3 is larger than the padded input 7 x 7"),
    ("btn", "o beyond half of int32", dict(o=I64(2**30)), r"attribute o = 1073741824 is out of range"),
]


@pytest.mark.parametrize("mode,what,change,message", CONV_ERRORS, ids=[e[1] for e in CONV_ERRORS])
def test_conv2d_handlers_refuse_bad_operands(mode, what, change, message):
    with pytest.raises(jax.errors.JaxRuntimeError, match=rf"jaxbnn_{mode}_conv2d_i32: " + message):
        conv_call(mode, **change)


@pytest.mark.parametrize("mode", MODES)
def test_handlers_accept_empty_outputs(mode):
    """Zero rows, or a pool window larger than the conv output, give empty results (nothing to compute)."""
    empty = {"x": u32(0, 2, 4)} if mode != "btn" else {"a": u32(0, 4)}
    assert bmm_call(mode, out=((0, 10), jnp.int32), **empty).shape == (0, 10)
    assert conv_call(mode, pool_h=I64(6), out=((1, 0, 5, 9), jnp.int32)).shape == (1, 0, 5, 9)
