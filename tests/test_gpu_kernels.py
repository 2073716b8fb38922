"""The CUDA FFI targets (jaxbnn._cuda) held bit for bit to the pure-JAX reference, on every engine.

Each test calls the native targets of docs/ops.md directly through `jax.ffi.ffi_call` on the GPU, once per
engine (wgmma, mma.sync, CUDA cores), and compares with `jaxbnn.reference` evaluated on the CPU (and with
the CPU handlers where they are built). Inputs are random, shapes odd (K not a multiple of 32/128/256,
M = 1, borders with both padding modes, strides, pools).
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxbnn import formats, reference

pytestmark = pytest.mark.gpu


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


# Without a GPU or the CUDA module, conftest.py skips every test here (marker `gpu`), or fails them when
# JAXBNN_REQUIRE_GPU=1: the module must still import.
try:
    import jaxbnn._cuda as _cuda
except ImportError:
    _cuda = None
from jaxbnn import _ffi  # noqa: E402, F401  (registers the targets of the built modules)

GPU = _gpus()[0] if _gpus() else None
CPU = jax.devices("cpu")[0]
ENGINES = ["wgmma", "mma_sync", "simt"]
EPILOGUES = ["i32", "i16", "f32", "bits"]


@pytest.fixture(params=ENGINES)
def engine(request):
    _cuda.set_kernel_path(request.param)
    yield request.param
    _cuda.set_kernel_path("auto")


def _epilogue_operands(rng, n, k_real, kind):
    if kind == "f32":
        scale = rng.uniform(-2, 2, n).astype(np.float32)
        bias = rng.uniform(-2, 2, n).astype(np.float32)
        return dict(scale=scale, bias=bias), [scale, bias]
    if kind == "bits":
        # where the dot products lie: a few standard deviations (sqrt(k_real)), at most k_real / 4
        spread = min(k_real // 4, 4 * int(np.sqrt(k_real))) + 2
        threshold = rng.integers(-spread, spread + 1, n).astype(np.int32)
        flip = rng.integers(0, 2, n).astype(bool)
        return dict(threshold=threshold, flip=flip), [threshold, flip.astype(np.uint8)]
    return {}, []


def _result(kind, rows_shape, n):
    if kind == "bits":
        return jax.ShapeDtypeStruct(rows_shape + (formats.num_words(n),), jnp.uint32)
    return jax.ShapeDtypeStruct(rows_shape + (n,), {"f32": jnp.float32, "i16": jnp.int16}.get(kind, jnp.int32))


def _call(target, device, result, operands, attrs):
    operands = [jax.device_put(np.asarray(x), device) for x in operands]
    return np.asarray(jax.ffi.ffi_call(target, result)(*operands, **attrs))


def _random_signs(rng, shape):
    return np.where(rng.random(shape) < 0.5, -1.0, 1.0).astype(np.float32)


def _check_against_cpu_handler(target, result, operands, attrs, got):
    if _ffi.has_target("cpu", target):
        cpu_attrs = {name: v for name, v in attrs.items() if name != "x_repeats"}  # (a CUDA attribute)
        np.testing.assert_array_equal(got, _call(target, CPU, result, operands, cpu_attrs))


# Small grids (N > 128 over few row tiles: the wgmma engine's 128-column tiles, the last one partial; a batch-8
# fully connected layer whose 256-column tiles' weights would not fit in shared memory), and one of enough row
# tiles to keep 256-column tiles on an H100 / H200 (9000 rows); reductions of 8192 (N ending inside a word),
# 16383 and 16384 bits
BMM_SHAPES = [(1, 3, 100), (5, 33, 31), (1, 1, 1), (129, 257, 1000), (64, 64, 128), (300, 520, 2144), (17, 300, 4096),
              (8, 1000, 8192), (9000, 300, 1000), (40, 320, 16383), (20, 64, 16384)]


@pytest.mark.parametrize("kind", EPILOGUES)
@pytest.mark.parametrize("m,n,k", BMM_SHAPES)
def test_bmm_matches_reference(engine, m, n, k, kind):
    rng = np.random.default_rng(zlib.crc32(repr((m, n, k, kind)).encode()))
    a = np.asarray(formats.pack_bits(_random_signs(rng, (m, k)) >= 0))
    w = formats.pack_dense_weights(_random_signs(rng, (k, n)))
    epi_kwargs, epi_operands = _epilogue_operands(rng, n, k, kind)
    with jax.default_device(CPU):
        want = np.asarray(reference.bmm(a, w.bits, k, n, **epi_kwargs))
    target = f"jaxbnn_bmm_{kind}"
    operands = [a, w.bits, w.popcount, *epi_operands]
    attrs = dict(k=np.int64(k), n=np.int64(n))
    got = _call(target, GPU, _result(kind, (m,), n), operands, attrs)
    np.testing.assert_array_equal(got, want)
    _check_against_cpu_handler(target, _result(kind, (m,), n), operands, attrs, got)


# (batch, h, w, c, o, kernel, stride, ((top, bottom), (left, right)), pad_value, pool)
CONV_CASES = [
    (2, 9, 7, 128, 40, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero", None),
    (2, 9, 7, 128, 40, (3, 3), (1, 1), ((1, 1), (1, 1)), "one", None),
    (3, 8, 8, 64, 70, (3, 3), (2, 2), ((1, 1), (1, 1)), "zero", None),
    (1, 11, 10, 100, 33, (5, 5), (1, 1), ((2, 2), (2, 2)), "zero", None),
    (2, 13, 12, 256, 64, (7, 7), (2, 2), ((3, 3), (3, 3)), "zero", None),
    (1, 20, 19, 3, 16, (11, 11), (4, 4), ((2, 2), (2, 2)), "zero", None),
    (2, 6, 6, 512, 130, (1, 1), (1, 1), ((0, 0), (0, 0)), "zero", None),
    (2, 8, 8, 128, 96, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero", (2, 2)),
    (2, 9, 9, 128, 64, (3, 3), (1, 1), ((1, 1), (1, 1)), "one", (3, 3)),
    (2, 7, 9, 32, 50, (2, 3), (1, 2), ((0, 1), (2, 0)), "zero", (2, 1)),
    # stride 1, 128-pixel tiles of whole output rows: the wgmma engine loads activations by TMA boxes per tap
    (2, 8, 16, 128, 40, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero", None),
    (2, 8, 16, 512, 40, (3, 3), (1, 1), ((1, 1), (1, 1)), "one", None),
    (1, 4, 32, 1024, 24, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero", None),
    # more 64-position tiles than SMs, not a multiple of them per image: the band kernel's items run from one
    # image into the next
    (40, 20, 20, 128, 72, (5, 5), (1, 1), ((2, 2), (2, 2)), "zero", None),
    (30, 17, 23, 256, 100, (3, 3), (1, 1), ((1, 1), (1, 1)), "one", None),
    (60, 15, 21, 128, 128, (3, 3), (1, 1), ((1, 0), (0, 1)), "zero", None),
    # C = 64 with an even input width: the band kernel's pixel pairs, N <= 64 (two output words a row) and more,
    # items crossing images, no left padding
    (3, 17, 24, 64, 100, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero", None),
    (2, 12, 16, 64, 40, (5, 5), (1, 1), ((2, 2), (2, 2)), "one", None),
    (40, 20, 28, 64, 64, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero", None),
    (60, 15, 22, 64, 128, (3, 3), (1, 1), ((1, 0), (0, 1)), "zero", None),
    # one short K block by cp.async (the case with C = 64 and stride 2 above has 3 steps): ResNet's 1x1 stride-2
    # shortcuts, 2 and 4 words, the second over two column tiles
    (3, 13, 11, 64, 70, (1, 1), (2, 2), ((0, 0), (0, 0)), "zero", None),
    (2, 14, 14, 128, 136, (1, 1), (2, 2), ((0, 0), (0, 0)), "zero", None),
    # dense taps (C <= 32, one channel word, at most 1024 real bits; the 11x11 C = 3 case above too): a
    # binarized image's first layers, C = 5 pooled, C = 17 with asymmetric padding and stride, N = 3
    (2, 20, 19, 3, 64, (7, 7), (2, 2), ((3, 3), (3, 3)), "zero", None),
    (3, 17, 15, 3, 70, (3, 3), (1, 1), ((1, 1), (1, 1)), "one", None),
    (2, 9, 11, 5, 33, (5, 5), (1, 1), ((2, 2), (2, 2)), "zero", (2, 2)),
    (1, 9, 9, 17, 3, (3, 3), (2, 1), ((0, 1), (1, 0)), "zero", None),
    # more tiles than the dense kernel's CTAs: each keeps its column tile (of two) over several row tiles
    (64, 64, 64, 3, 70, (7, 7), (2, 2), ((3, 3), (3, 3)), "zero", None),
    # dense taps of a whole word a tap (C = 32): MNIST conv's pooled 64C3 at 28 x 28, with more row tiles than
    # the dense kernel's CTAs; 5x5 at stride 2 in "one" padding; 6x6 (1152 bits: the word layout)
    (3, 28, 28, 32, 64, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero", (2, 2)),
    (160, 28, 28, 32, 70, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero", (2, 2)),
    (2, 15, 13, 32, 40, (5, 5), (2, 2), ((2, 2), (2, 2)), "one", None),
    (2, 11, 10, 32, 24, (6, 6), (1, 1), ((2, 3), (3, 2)), "zero", None),
    # 3 x 2 pool windows (the last two rows of a 128-row tile hold no pooled pixel) at C = 32 and C = 5; C = 32
    # unpooled at stride 2 with asymmetric padding
    (2, 12, 12, 32, 33, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero", (3, 2)),
    (2, 12, 12, 5, 20, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero", (3, 2)),
    (2, 13, 11, 32, 40, (3, 3), (2, 2), ((1, 0), (0, 1)), "zero", None),
    # AlexNet's conv2 in small (5x5, N = 256: compact classes), 5x5 at stride 2 with asymmetric padding over two
    # column tiles (compact classes), padding 3 around a 3x3 filter (fields wholly outside the frame: the edge
    # table), AlexNet's binarized conv1 in small (11x11 stride 4, C = 3: the dense kernel, the edge table)
    (3, 14, 14, 128, 256, (5, 5), (1, 1), ((2, 2), (2, 2)), "zero", None),
    (2, 13, 12, 128, 300, (5, 5), (2, 2), ((2, 1), (1, 2)), "zero", None),
    (2, 6, 7, 128, 40, (3, 3), (1, 1), ((3, 3), (3, 3)), "zero", None),
    (2, 40, 37, 3, 70, (11, 11), (4, 4), ((3, 4), (3, 4)), "zero", None),
    # the class table's compact classes (3x3 with padding 2: 25 (vertical, horizontal) pairs, not 81) and 5x5
    # with padding 1 (16 classes), both filled class by class
    (2, 9, 11, 128, 40, (3, 3), (1, 1), ((2, 2), (2, 2)), "zero", None),
    (2, 10, 9, 64, 72, (5, 5), (1, 1), ((1, 1), (1, 1)), "zero", None),
    # the dense kernel's border rows of filters past 7x7, spread over its threads: 9x9 taller than the frame (no
    # edge table: every out-of-frame tap summed) and 8x8 at stride 2 with asymmetric padding (the edge table)
    (2, 6, 7, 3, 40, (9, 9), (1, 1), ((4, 4), (4, 4)), "zero", None),
    (3, 20, 22, 3, 70, (8, 8), (2, 2), ((1, 2), (1, 2)), "zero", None),
    # small grids whose tiles no TMA box takes (7 x 7, stride 2): the wgmma engine's cp.async resident tiles of 128
    # columns, the last one partial
    (2, 7, 7, 512, 300, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero", None),
    (3, 14, 14, 256, 200, (3, 3), (2, 2), ((1, 1), (1, 1)), "one", None),
    # the wgmma engine's TMA boxes over strided taps (16 x 16 -> 8 x 8: every other pixel, 16-byte chunks; 8 x 8 ->
    # 4 x 4: 32-byte tap rows) and over whole 4 x 4 images (four a box, the last box past the batch)
    (2, 16, 16, 128, 256, (3, 3), (2, 2), ((1, 1), (1, 1)), "zero", None),
    (3, 8, 8, 256, 130, (3, 3), (2, 2), ((1, 1), (1, 1)), "one", None),
    (5, 4, 4, 512, 70, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero", None),
]


def _conv_attrs(c, o, kernel, stride, padding, pad_value, pool, x_repeats=1):
    (pt, pb), (pl, pr) = padding
    ph, pw = pool or (1, 1)
    i64 = np.int64
    return dict(c=i64(c), o=i64(o), kh=i64(kernel[0]), kw=i64(kernel[1]), stride_h=i64(stride[0]),
                stride_w=i64(stride[1]), pad_top=i64(pt), pad_bottom=i64(pb), pad_left=i64(pl), pad_right=i64(pr),
                pad_one=pad_value == "one", pool_h=i64(ph), pool_w=i64(pw), x_repeats=i64(x_repeats))


@pytest.mark.parametrize("kind", EPILOGUES)
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"b{c[0]}_{c[1]}x{c[2]}_c{c[3]}_o{c[4]}_k{c[5][0]}x{c[5][1]}_s{c[6][0]}{c[6][1]}_{c[8]}_pool{c[9]}")
def test_bconv2d_matches_reference(engine, case, kind):
    batch, h, w_, c, o, kernel, stride, padding, pad_value, pool = case
    rng = np.random.default_rng(zlib.crc32(repr((case, kind)).encode()))
    x = np.asarray(formats.pack_bits(_random_signs(rng, (batch, h, w_, c)) >= 0))
    w = formats.pack_conv_weights(_random_signs(rng, (*kernel, c, o)))
    epi_kwargs, epi_operands = _epilogue_operands(rng, o, kernel[0] * kernel[1] * c, kind)
    with jax.default_device(CPU):
        want = np.asarray(reference.bconv2d(x, w.bits, in_channels=c, out_channels=o, kernel_size=kernel,
                                            stride=stride, padding=padding, pad_value=pad_value, pool=pool,
                                            **epi_kwargs))
    target = f"jaxbnn_bconv2d_{kind}"
    operands = [x, w.bits, w.tap_popcount, *epi_operands]
    attrs = _conv_attrs(c, o, kernel, stride, padding, pad_value, pool)
    result = _result(kind, want.shape[:3], o)
    got = _call(target, GPU, result, operands, attrs)
    np.testing.assert_array_equal(got, want)
    _check_against_cpu_handler(target, result, operands, attrs, got)


def test_engine_choice_on_aligned_rows():
    """Aligned rows on Hopper run on wgmma; other GPUs on mma.sync."""
    rng = np.random.default_rng(0)
    m, n, k = 200, 300, 1024
    a = np.asarray(formats.pack_bits(_random_signs(rng, (m, k)) >= 0))
    w = formats.pack_dense_weights(_random_signs(rng, (k, n)))
    _cuda.set_kernel_path("auto")
    _call("jaxbnn_bmm_i32", GPU, _result("i32", (m,), n), [a, w.bits, w.popcount], dict(k=np.int64(k), n=np.int64(n)))
    hopper = GPU.compute_capability == "9.0" if hasattr(GPU, "compute_capability") else False
    assert _cuda.last_kernel_path() == ("wgmma" if hopper else "mma_sync")


def test_handler_rejects_inconsistent_shapes():
    rng = np.random.default_rng(1)
    a = np.asarray(formats.pack_bits(_random_signs(rng, (4, 64)) >= 0))
    w = formats.pack_dense_weights(_random_signs(rng, (64, 8)))
    with pytest.raises(Exception, match="words per row"):
        # k = 100 needs 4 words per row, a has 2
        _call("jaxbnn_bmm_i32", GPU, _result("i32", (4,), 8), [a, w.bits, w.popcount], dict(k=np.int64(100), n=np.int64(8)))


def _extreme_thresholds(rng, n, k_real):
    """Thresholds past every dot, at the ends of [-K, K] and at the int32 limits, each with and without flip,
    among random ones."""
    ends = [-2**31, -2**31 + 1, -k_real - 2, -k_real - 1, -k_real, -k_real + 1, k_real - 1, k_real, k_real + 1,
            k_real + 2, 2**31 - 2, 2**31 - 1]
    threshold = rng.integers(-(k_real // 4), k_real // 4 + 1, n)
    flip = rng.integers(0, 2, n).astype(bool)
    picks = rng.permutation(n)[:2 * len(ends)]
    threshold[picks] = ends * 2
    flip[picks] = [False] * len(ends) + [True] * len(ends)
    return threshold.astype(np.int32), flip


@pytest.mark.parametrize("case", [None, CONV_CASES[0], CONV_CASES[11]],
                         ids=["bmm", "c128_o40_zero", "c512_o40_one"])
def test_threshold_bits_at_int32_extremes(engine, case):
    """Any int32 threshold, with either flip, gives the reference's bits (no overflow of the bounds)."""
    rng = np.random.default_rng(zlib.crc32(repr(("extremes", case)).encode()))
    if case is None:
        m, n, k = 70, 100, 999
        a = np.asarray(formats.pack_bits(_random_signs(rng, (m, k)) >= 0))
        w = formats.pack_dense_weights(_random_signs(rng, (k, n)))
        threshold, flip = _extreme_thresholds(rng, n, k)
        with jax.default_device(CPU):
            want = np.asarray(reference.bmm(a, w.bits, k, n, threshold=threshold, flip=flip))
        got = _call("jaxbnn_bmm_bits", GPU, _result("bits", (m,), n),
                    [a, w.bits, w.popcount, threshold, flip.astype(np.uint8)], dict(k=np.int64(k), n=np.int64(n)))
    else:
        batch, h, w_, c, o, kernel, stride, padding, pad_value, pool = case
        x = np.asarray(formats.pack_bits(_random_signs(rng, (batch, h, w_, c)) >= 0))
        w = formats.pack_conv_weights(_random_signs(rng, (*kernel, c, o)))
        threshold, flip = _extreme_thresholds(rng, o, kernel[0] * kernel[1] * c)
        with jax.default_device(CPU):
            want = np.asarray(reference.bconv2d(x, w.bits, in_channels=c, out_channels=o, kernel_size=kernel,
                                                stride=stride, padding=padding, pad_value=pad_value, pool=pool,
                                                threshold=threshold, flip=flip))
        got = _call("jaxbnn_bconv2d_bits", GPU, _result("bits", want.shape[:3], o),
                    [x, w.bits, w.tap_popcount, threshold, flip.astype(np.uint8)],
                    _conv_attrs(c, o, kernel, stride, padding, pad_value, pool))
    np.testing.assert_array_equal(got, want)


def test_int16_handlers_refuse_reductions_whose_dot_products_may_not_fit():
    n, k = 8, 32768
    a, w = np.zeros((2, k // 32), np.uint32), formats.pack_dense_weights(np.ones((k, n), np.float32))
    with pytest.raises(Exception, match="int16 result holds dot products of at most 32767 products"):
        _call("jaxbnn_bmm_i16", GPU, _result("i16", (2,), n), [a, w.bits, w.popcount], dict(k=np.int64(k), n=np.int64(n)))
    got = _call("jaxbnn_bmm_i16", GPU, _result("i16", (2,), n), [a[:, :-1], *_dense_operands(k - 32, n)],
                dict(k=np.int64(k - 32), n=np.int64(n)))
    np.testing.assert_array_equal(got, -(k - 32))  # every product -1: the most negative sum that fits
    x = np.zeros((1, 4, 4, 128), np.uint32)  # 4096 channels, 3x3: 36864 products
    conv = formats.pack_conv_weights(np.ones((3, 3, 4096, n), np.float32))
    with pytest.raises(Exception, match="reduces over 36864"):
        _call("jaxbnn_bconv2d_i16", GPU, _result("i16", (1, 4, 4), n), [x, conv.bits, conv.tap_popcount],
              _conv_attrs(4096, n, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero", None))


def _dense_operands(k, n):
    w = formats.pack_dense_weights(np.ones((k, n), np.float32))
    return [w.bits, w.popcount]


def test_handler_rejects_reductions_past_the_kernels_limit():
    """More than 65,536 words per dot product: an InvalidArgument naming the limit, not a wrong answer."""
    k_words, n = 65537, 8
    a = np.zeros((1, k_words), np.uint32)
    b = np.zeros((1, (k_words + 3) // 4, 8, 4), np.uint32)  # one FSB row tile
    with pytest.raises(Exception, match="at most 65536"):
        _call("jaxbnn_bmm_i32", GPU, _result("i32", (1,), n), [a, b, np.zeros(n, np.int32)],
              dict(k=np.int64(32 * k_words), n=np.int64(n)))


def test_bmm_inside_jit_and_graph_matches_reference():
    """Two chained calls under jit (XLA may capture them in a command buffer): the same bits as eager."""
    rng = np.random.default_rng(2)
    m, k, n = 96, 512, 256
    a = np.asarray(formats.pack_bits(_random_signs(rng, (m, k)) >= 0))
    w1 = formats.pack_dense_weights(_random_signs(rng, (k, n)))
    w2 = formats.pack_dense_weights(_random_signs(rng, (n, n)))
    t1 = rng.integers(-8, 9, n).astype(np.int32)
    f1 = rng.integers(0, 2, n).astype(np.uint8)

    def net(a, b1, p1, b2, p2):
        h = jax.ffi.ffi_call("jaxbnn_bmm_bits", _result("bits", (m,), n))(a, b1, p1, t1, f1, k=np.int64(k), n=np.int64(n))
        return jax.ffi.ffi_call("jaxbnn_bmm_i32", _result("i32", (m,), n))(h, b2, p2, k=np.int64(n), n=np.int64(n))

    args = [jax.device_put(np.asarray(v), GPU) for v in (a, w1.bits, w1.popcount, w2.bits, w2.popcount)]
    got = np.asarray(jax.jit(net)(*args))
    with jax.default_device(CPU):
        h = reference.bmm(a, w1.bits, k, n, threshold=t1, flip=f1.astype(bool))
        want = np.asarray(reference.bmm(h, w2.bits, n, n))
    np.testing.assert_array_equal(got, want)


def test_ops_dispatch_to_cuda_matches_reference():
    """jaxbnn.ops on GPU arrays runs the CUDA targets (the engine switch shows it) and agrees with the spec."""
    from jaxbnn import ops

    rng = np.random.default_rng(3)
    m, k, n = 70, 300, 90
    a = np.asarray(formats.pack_bits(_random_signs(rng, (m, k)) >= 0))
    w = formats.pack_dense_weights(_random_signs(rng, (k, n)))
    threshold = rng.integers(-20, 21, n).astype(np.int32)
    flip = rng.integers(0, 2, n).astype(bool)
    _cuda.set_kernel_path("simt")
    got = np.asarray(ops.bmm(jax.device_put(a, GPU), jax.device_put(w.bits, GPU), k, n=n,
                             b_popcount=jax.device_put(w.popcount, GPU), threshold=threshold, flip=flip))
    assert _cuda.last_kernel_path() == "simt"
    _cuda.set_kernel_path("auto")
    with jax.default_device(CPU):
        want = np.asarray(reference.bmm(a, w.bits, k, n, threshold=threshold, flip=flip))
    np.testing.assert_array_equal(got, want)

    x = np.asarray(formats.pack_bits(_random_signs(rng, (2, 10, 9, 128)) >= 0))
    cw = formats.pack_conv_weights(_random_signs(rng, (3, 3, 128, 48)))
    got = np.asarray(ops.bconv2d(jax.device_put(x, GPU), jax.device_put(cw.bits, GPU), in_channels=128,
                                 kernel_size=(3, 3), out_channels=48, stride=(2, 2), padding="SAME",
                                 w_tap_popcount=jax.device_put(cw.tap_popcount, GPU)))
    with jax.default_device(CPU):
        want = np.asarray(ops.bconv2d(x, cw.bits, in_channels=128, kernel_size=(3, 3), out_channels=48,
                                      stride=(2, 2), padding="SAME", w_tap_popcount=cw.tap_popcount))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("c, pool", [(64, (2, 2)), (128, (2, 2)), (256, (3, 2))])
def test_pooled_threshold_bconv2d_on_cuda_matches_the_cpu(c, pool):
    """ops.bconv2d with a pool and the threshold epilogue runs unpooled on CUDA and pools the bits after
    (ops.pool_threshold_bits): the same bits as the CPU's fused pool, flipped columns included."""
    from jaxbnn import ops

    rng = np.random.default_rng(c)
    x = np.asarray(formats.pack_bits(_random_signs(rng, (3, 12, 14, c)) >= 0))
    cw = formats.pack_conv_weights(_random_signs(rng, (3, 3, c, 70)))
    threshold = rng.integers(-c // 2, c // 2 + 1, 70).astype(np.int32)
    flip = rng.integers(0, 2, 70).astype(bool)
    args = dict(in_channels=c, kernel_size=(3, 3), out_channels=70, pool=pool, threshold=threshold, flip=flip)
    got = np.asarray(ops.bconv2d(jax.device_put(x, GPU), jax.device_put(cw.bits, GPU),
                                 w_tap_popcount=jax.device_put(cw.tap_popcount, GPU), **args))
    with jax.default_device(CPU):
        want = np.asarray(ops.bconv2d(x, cw.bits, w_tap_popcount=cw.tap_popcount, **args))
    np.testing.assert_array_equal(got, want)
    # the flip's words given (as the runtime keeps them), traced: the same bits
    words = jax.device_put(np.asarray(formats.pack_bits(flip)), GPU)
    with_words = jax.jit(lambda x_, w_, p_, words_: ops.bconv2d(x_, w_, w_tap_popcount=p_, flip_words=words_, **args))
    got = with_words(*(jax.device_put(v, GPU) for v in (x, cw.bits, cw.tap_popcount)), words)
    np.testing.assert_array_equal(np.asarray(got), want)


# --- the first-layer kernel: int8 levels x int8 weights on IMMA, pool, stream shift or threshold planes -------

IMAGE_LAYERS = [  # (image (B, H, W, C), kernel (KH, KW), N, stride, padding, pool, planes (0: int32), shift)
    ((5, 28, 28, 1), (3, 3), 64, 1, "SAME", (2, 2), 1, 0),  # MNIST conv
    ((4, 32, 32, 3), (3, 3), 128, 1, "SAME", None, 2, 0),  # CIFAR-10 VGG-small, ternary output
    ((3, 32, 32, 3), (3, 3), 128, 2, "SAME", None, 0, 7),  # ResNet-14's stem
    ((2, 64, 60, 3), (7, 7), 64, 4, "SAME", None, 0, 7),  # ResNet-18's stem
    ((2, 99, 99, 3), (11, 11), 128, 4, "SAME", (2, 2), 1, 0),  # AlexNet
    ((2, 40, 40, 3), (3, 3), 64, 1, "SAME", None, 1, 0),  # VGG-16
    ((3, 9, 13, 5), (2, 3), 33, (1, 2), ((0, 3), (4, 0)), (3, 2), 2, 0),  # the pool drops a row, 33 channels
    ((1, 16, 16, 2), (1, 1), 31, 1, "VALID", (8, 16), 8, 0),  # the largest window, eight planes
    ((2, 9, 9, 3), (3, 3), 1, 1, "SAME", None, 0, 31),
    ((0, 9, 9, 3), (3, 3), 5, 1, "SAME", None, 1, 0),  # an empty batch
    ((2, 3, 4, 2), (5, 5), 8, 1, ((2, 2), (2, 2)), None, 1, 0),  # a kernel larger than the image
    ((2, 30, 30, 3), (3, 3), 64, 1, "VALID", None, 0, 0),  # every field inside the frame
    ((37, 1, 1, 784), (1, 1), 100, 1, "VALID", None, 1, 0),  # the MNIST MLP: words of four aligned levels
    ((2, 12, 13, 7), (13, 13), 70, 1, "SAME", (2, 1), 2, 0),  # K = 1183: the weights gathered step by step
    ((3, 1, 1, 1100), (1, 1), 40, 1, "VALID", None, 0, 3),  # the same, in aligned words
    # N > 64 and K of 4 to 16 steps of 32 bytes: 128-column tiles
    ((2, 64, 67, 3), (11, 11), 192, 4, "SAME", (2, 2), 2, 0),  # AlexNet-like, a partial second column tile
    ((2, 24, 19, 3), (7, 7), 130, (1, 2), "SAME", None, 0, 3),
    ((1, 16, 16, 128), (1, 1), 128, 1, "VALID", (8, 16), 3, 0),  # the largest window, aligned words
    ((2, 10, 10, 32), (4, 4), 100, 1, "SAME", None, 2, 0),  # K = 512: the most steps kept resident
    ((2, 12, 12, 8), (9, 9), 96, 1, "SAME", None, 1, 0),  # K = 648: back to 64-column tiles
    # the windowed kernel (C <= 4, no pool or 2 x 2): its slot layouts, partial tiles, the stream's scalar stores
    ((3, 21, 23, 1), (7, 7), 33, 3, "SAME", None, 2, 0),  # one channel: 7 taps in two slots of 4 pixels
    ((2, 19, 27, 2), (3, 5), 40, (1, 2), "SAME", (2, 2), 1, 0),  # two channels, two pixels a slot
    ((3, 13, 21, 4), (3, 3), 70, 1, "SAME", (2, 2), 0, 2),  # four channels, a pooled stream of 70 channels
    # the direct kernel (threshold planes of at most 32 channels from at most 12 products)
    ((9, 28, 28, 1), (3, 3), 32, 1, "SAME", None, 1, 0),  # the MNIST conv net's first layer
    ((2, 15, 14, 3), (2, 2), 32, (2, 1), ((2, 1), (0, 3)), None, 2, 0),  # K = 12, two planes
    ((3, 19, 23, 1), (3, 3), 31, (2, 1), "SAME", (3, 2), 3, 0),  # pool 3 x 2, three planes, a partial word
    ((2, 6, 8, 10), (1, 1), 17, 1, "VALID", None, 1, 0),  # ten channels, K = 10
    # the GEMM form (1 x 1, stride 1, no padding or pool, C and N multiples of 16): whole K chunks or not, partial
    # row and column tiles
    ((37, 1, 1, 784), (1, 1), 1024, 1, "VALID", None, 1, 0),  # the MNIST MLP's first layer
    ((300, 1, 1, 784), (1, 1), 96, 1, "VALID", None, 2, 0),  # three row tiles, two planes
    ((3, 5, 7, 48), (1, 1), 80, 1, "VALID", None, 0, 3),  # a 1 x 1 conv over pixels, int32
    ((130, 1, 1, 1040), (1, 1), 64, 1, "VALID", None, 8, 0),  # K = 8 chunks + 16 bytes, eight planes
    # its wgmma kernel (sm_90, K <= 1248): more row tiles than a column tile's CTAs, the longest K, and past it
    ((4200, 1, 1, 160), (1, 1), 1024, 1, "VALID", None, 1, 0),
    ((70, 1, 1, 1248), (1, 1), 144, 1, "VALID", None, 2, 0),  # a 16-column last tile
    ((70, 1, 1, 1264), (1, 1), 48, 1, "VALID", None, 1, 0),  # the mma.sync kernel
]


@pytest.mark.parametrize("case", IMAGE_LAYERS, ids=[f"{c[0]}_{c[1]}_n{c[2]}_p{c[6]}" for c in IMAGE_LAYERS])
def test_image_conv2d_on_cuda_matches_the_cpu(case):
    """ops.image_conv2d on GPU arrays is one custom call and gives the CPU's integers and bits exactly, with
    weights of every int8 value and thresholds at ties, past the bounds and at the int32 limits."""
    from jaxbnn import ops

    shape, kernel_size, n, stride, padding, pool, planes, shift = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    levels = rng.integers(-128, 128, shape, dtype=np.int8)
    kernel = rng.integers(-128, 128, (*kernel_size, shape[-1], n), dtype=np.int8)
    kernel[..., : n // 2] = rng.integers(-1, 2, kernel[..., : n // 2].shape)  # the zoo's weights: -1, 0, +1
    epilogue = dict(shift=shift)
    if planes:
        with jax.default_device(CPU):
            pre = np.asarray(ops.image_conv2d(levels, kernel, stride=stride, padding=padding, pool=pool))
        ties = pre.ravel()[: planes * n] if pre.size else np.zeros(planes * n, np.int32)
        threshold = np.resize(ties, (planes, n)).astype(np.int64)
        threshold[:, ::7] = rng.choice([-(2**31), 2**31 - 1, -(2**40), 2**40], threshold[:, ::7].shape)
        epilogue = dict(threshold=threshold, flip=rng.integers(0, 2, (planes, n)).astype(bool))

    def layer(x):
        return ops.image_conv2d(x, kernel, stride=stride, padding=padding, pool=pool, **epilogue)

    if shape[0]:
        assert "jaxbnn_image_conv2d" in jax.jit(layer).lower(jax.device_put(levels, GPU)).as_text()
    got = np.asarray(jax.jit(layer)(jax.device_put(levels, GPU)))
    with jax.default_device(CPU):
        want = np.asarray(layer(levels))
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    # the same image as the uint8 pixels of these levels, read by the kernel as they are
    pixels = jax.device_put(_pixels_of(levels), GPU)
    if shape[0]:
        assert _custom_call_reads_pixels(jax.jit(layer).lower(pixels).as_text())
    np.testing.assert_array_equal(np.asarray(jax.jit(layer)(pixels)), want)


def _pixels_of(levels):
    """The uint8 pixels p whose levels p - 128 are `levels`."""
    return (np.asarray(levels).view(np.uint8) ^ 0x80).astype(np.uint8)


def _custom_call_reads_pixels(hlo):
    """Whether the lowered program's image custom call takes a uint8 operand: no pass converts the pixels."""
    calls = [line for line in hlo.splitlines() if "custom_call @jaxbnn_image_conv2d" in line]
    return len(calls) == 1 and "xui8>" in calls[0].split("->")[0]


IMAGE_STREAMS = [  # (image, kernel (KH, KW), N, stride, padding, pool, out_dtype, planes beside it (0: none), shift)
    ((3, 32, 32, 3), (3, 3), 128, 2, "SAME", None, "int16", 0, 7),  # ResNet-14's stem, int16
    ((3, 32, 32, 3), (3, 3), 128, 2, "SAME", None, "int16", 1, 7),  # and the first block's input bits
    ((2, 64, 60, 3), (7, 7), 64, 4, "SAME", None, "int16", 1, 7),  # ResNet-18's stem
    ((2, 64, 60, 3), (7, 7), 64, 4, "SAME", None, "int32", 2, 7),  # an int32 stream, a ternary block's planes
    ((2, 21, 21, 3), (3, 3), 96, 1, "SAME", None, "int16", 2, 0),  # wrapping int16 values, two column warps
    ((3, 19, 23, 2), (3, 5), 30, (1, 2), "SAME", (2, 2), "int16", 1, 1),  # pooled, N % 8 != 0: scalar stores
    ((3, 28, 28, 1), (3, 3), 30, 1, "SAME", None, "int16", 0, 2),
    ((3, 9, 13, 5), (2, 3), 33, (1, 2), ((0, 3), (4, 0)), (3, 2), "int16", 2, 1),  # the im2col kernel
    ((2, 12, 12, 8), (3, 3), 130, 1, "SAME", None, "int16", 0, 0),  # its 128-column tiles, wrapping
    ((37, 1, 1, 784), (1, 1), 100, 1, "VALID", None, "int32", 1, 4),  # a dense first layer's stream and bits
    ((70, 1, 1, 16), (1, 1), 48, 1, "VALID", None, "int16", 1, 0),  # the GEMM form's int16 stream and bits
    ((2, 3, 3, 256), (1, 1), 32, 1, "VALID", None, "int32", 2, 2),  # and its int32, two whole K chunks
    ((700, 1, 1, 160), (1, 1), 272, 1, "VALID", None, "int16", 1, 1),  # its wgmma kernel: a 16-column last tile
    ((300, 1, 1, 96), (1, 1), 128, 1, "VALID", None, "int32", 2, 3),
    ((0, 9, 9, 3), (3, 3), 16, 1, "SAME", None, "int16", 1, 0),  # an empty batch
]


@pytest.mark.parametrize("case", IMAGE_STREAMS, ids=[f"{c[0]}_{c[1]}_n{c[2]}_{c[6]}_p{c[7]}" for c in IMAGE_STREAMS])
def test_image_conv2d_streams_on_cuda_match_the_cpu(case):
    """The stem's forms (`out_dtype`, `keep_stream`): the int16 or int32 stream, alone or with the bits of its
    values, is one custom call and gives the CPU's integers and bits exactly, wrapped int16 values included."""
    from jaxbnn import ops

    shape, kernel_size, n, stride, padding, pool, out_dtype, planes, shift = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    levels = rng.integers(-128, 128, shape, dtype=np.int8)
    kernel = rng.integers(-128, 128, (*kernel_size, shape[-1], n), dtype=np.int8)
    kernel[..., : n // 2] = rng.integers(-1, 2, kernel[..., : n // 2].shape)
    epilogue = dict(shift=shift, out_dtype=out_dtype)
    if planes:
        with jax.default_device(CPU):
            stream = np.asarray(ops.image_conv2d(levels, kernel, stride=stride, padding=padding, pool=pool, **epilogue))
        ties = stream.ravel()[: planes * n] if stream.size else np.zeros(planes * n, np.int32)
        threshold = np.resize(ties, (planes, n)).astype(np.int64)
        threshold[:, ::7] = rng.choice([-(2**31), 2**31 - 1, -(2**40), 2**40], threshold[:, ::7].shape)
        epilogue.update(threshold=threshold, flip=rng.integers(0, 2, (planes, n)).astype(bool), keep_stream=True)

    def layer(x):
        return ops.image_conv2d(x, kernel, stride=stride, padding=padding, pool=pool, **epilogue)

    if shape[0]:
        hlo = jax.jit(layer).lower(jax.device_put(levels, GPU)).as_text()
        assert f"jaxbnn_image_conv2d_i{out_dtype[3:]}{'_bits' if planes else ''}" in hlo
    got = jax.tree.map(np.asarray, jax.jit(layer)(jax.device_put(levels, GPU)))
    with jax.default_device(CPU):
        want = jax.tree.map(np.asarray, layer(levels))
    for got_part, want_part in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert got_part.shape == want_part.shape and got_part.dtype == want_part.dtype
        np.testing.assert_array_equal(got_part, want_part)
    from_pixels = jax.tree.map(np.asarray, jax.jit(layer)(jax.device_put(_pixels_of(levels), GPU)))
    for got_part, want_part in zip(jax.tree.leaves(from_pixels), jax.tree.leaves(want)):
        np.testing.assert_array_equal(got_part, want_part)


def test_image_conv2d_handler_rejects_inconsistent_calls():
    levels = np.zeros((2, 8, 8, 3), np.int8)
    kernel = np.zeros((3, 3, 3, 16), np.int8)
    big = np.zeros((1, 32, 32, 3), np.int8)
    attrs = dict(c=np.int64(3), n=np.int64(16), kh=np.int64(3), kw=np.int64(3), stride_h=np.int64(1),
                 stride_w=np.int64(1), pad_top=np.int64(1), pad_bottom=np.int64(1), pad_left=np.int64(1),
                 pad_right=np.int64(1), pool_h=np.int64(1), pool_w=np.int64(1))
    stream = jax.ShapeDtypeStruct((2, 8, 8, 16), jnp.int32)
    assert _call("jaxbnn_image_conv2d_i32", GPU, stream, [levels, kernel], dict(attrs, shift=np.int64(7))).shape == (2, 8, 8, 16)
    with pytest.raises(Exception, match="shift must lie in"):
        _call("jaxbnn_image_conv2d_i32", GPU, stream, [levels, kernel], dict(attrs, shift=np.int64(32)))
    with pytest.raises(Exception, match="takes int8 levels or uint8 pixels"):
        _call("jaxbnn_image_conv2d_i32", GPU, stream, [levels.astype(np.int16), kernel], dict(attrs, shift=np.int64(0)))
    with pytest.raises(Exception, match="kernel has shape"):
        _call("jaxbnn_image_conv2d_i32", GPU, stream, [levels, kernel[:, :, :2]], dict(attrs, shift=np.int64(0)))
    with pytest.raises(Exception, match="result has shape"):
        _call("jaxbnn_image_conv2d_i32", GPU, jax.ShapeDtypeStruct((2, 7, 8, 16), jnp.int32), [levels, kernel],
              dict(attrs, shift=np.int64(0)))
    bits = jax.ShapeDtypeStruct((2, 8, 8, 9, 1), jnp.uint32)
    with pytest.raises(Exception, match="1 to 8 planes"):
        _call("jaxbnn_image_conv2d_bits", GPU, bits, [levels, kernel, np.zeros((9, 16), np.int32),
                                                       np.zeros((9, 16), np.uint8)], attrs)
    planes = [np.zeros((1, 16), np.int32), np.zeros((1, 16), np.uint8)]
    stream16, bits1 = jax.ShapeDtypeStruct((2, 8, 8, 16), jnp.int16), jax.ShapeDtypeStruct((2, 8, 8, 1, 1), jnp.uint32)
    with pytest.raises(Exception, match="bits result has shape"):
        _call("jaxbnn_image_conv2d_i16_bits", GPU, (stream16, jax.ShapeDtypeStruct((2, 8, 8, 2, 1), jnp.uint32)),
              [levels, kernel, *planes], dict(attrs, shift=np.int64(0)))
    with pytest.raises(Exception, match="stream result has shape"):
        _call("jaxbnn_image_conv2d_i16_bits", GPU, (jax.ShapeDtypeStruct((2, 8, 8, 15), jnp.int16), bits1),
              [levels, kernel, *planes], dict(attrs, shift=np.int64(0)))
    with pytest.raises(Exception, match="shift must lie in"):
        _call("jaxbnn_image_conv2d_i32_bits", GPU, (stream, bits1), [levels, kernel, *planes],
              dict(attrs, shift=np.int64(-1)))
    with pytest.raises(Exception, match="pool window"):  # a result with elements: XLA skips an empty one's call
        _call("jaxbnn_image_conv2d_i32", GPU, jax.ShapeDtypeStruct((1, 2, 2, 16), jnp.int32), [big, kernel],
              dict(attrs, pool_h=np.int64(16), pool_w=np.int64(16), shift=np.int64(0)))


def _set_padding_bits(words, bits):
    """Every padding bit of each last word (past `bits`) set to 1."""
    words = np.array(words)
    if bits % 32:
        words[..., -1] |= np.uint32(~((1 << (bits % 32)) - 1) & 0xFFFFFFFF)
    return words


@pytest.mark.parametrize("k", [1, 33, 100, 165, 257])
def test_bmm_ignores_padding_bits_on_cuda_as_on_the_cpu(k):
    """Activation and weight words whose padding bits are 1 give the dot products of their real bits, on
    every engine and both platforms."""
    from jaxbnn import ops

    rng = np.random.default_rng(k)
    m, n = 37, 45
    a = np.asarray(formats.pack_bits(_random_signs(rng, (m, k)) >= 0))
    rows = np.asarray(formats.pack_bits(_random_signs(rng, (n, k)) >= 0))
    with jax.default_device(CPU):
        want = np.asarray(reference.bmm(a, formats.to_fsb(rows), k, n))
    dirty_a, dirty_rows = _set_padding_bits(a, k), _set_padding_bits(rows, k)
    for path in ENGINES:
        _cuda.set_kernel_path(path)
        got = np.asarray(ops.bmm(jax.device_put(dirty_a, GPU), jax.device_put(dirty_rows, GPU), k))
        np.testing.assert_array_equal(got, want, err_msg=path)
    _cuda.set_kernel_path("auto")
    with jax.default_device(CPU):
        np.testing.assert_array_equal(np.asarray(ops.bmm(dirty_a, dirty_rows, k)), want)


@pytest.mark.parametrize("c, pad_value", [(33, "zero"), (33, "one"), (100, "zero"), (100, "one")])
def test_bconv2d_ignores_padding_bits_on_cuda_as_on_the_cpu(c, pad_value):
    from jaxbnn import ops

    rng = np.random.default_rng(c)
    x = np.asarray(formats.pack_bits(_random_signs(rng, (2, 9, 7, c)) >= 0))
    rows = np.asarray(formats.pack_bits(_random_signs(rng, (40, 3, 3, c)) >= 0))
    args = dict(in_channels=c, kernel_size=(3, 3), stride=1, padding="SAME", pad_value=pad_value)
    with jax.default_device(CPU):
        want = np.asarray(ops.bconv2d(x, rows, **args))
    dirty_x, dirty_rows = _set_padding_bits(x, c), _set_padding_bits(rows, c)
    for path in ENGINES:
        _cuda.set_kernel_path(path)
        got = np.asarray(ops.bconv2d(jax.device_put(dirty_x, GPU), jax.device_put(dirty_rows, GPU), **args))
        np.testing.assert_array_equal(got, want, err_msg=path)
    _cuda.set_kernel_path("auto")
    with jax.default_device(CPU):
        np.testing.assert_array_equal(np.asarray(ops.bconv2d(dirty_x, dirty_rows, **args)), want)


# Residual blocks' second convolutions (the residual epilogue): the band kernel (C = 64 pixel pairs, C = 128; the
# int16 stream's shortcut staged in 16-byte chunks, or element by element for 77 channels; C = 512 and 1024 at
# N <= 128, its instance of a runtime number of steps, as TNN's side-by-side planes give it), the resident kernel's
# int16 stream (its shortcut staged; 128-column tiles at 7 x 7 and 14 x 14, 256-column ones at batch 72 over two
# column tiles, a 100-channel shortcut element by element, C = 512 on 128-column tiles), the dense-tap kernel
# (C = 16, 32), a type-A shortcut (stride 2, fewer channels), odd N, "one" padding, a shift. The stream's bits of
# one threshold, or of two planes (a ternary conv1's input: the int16 stream's wgmma kernels write both, other
# kernels the launcher's stream-bits pass), some thresholds at the int16 range's ends and past them.
# (batch, H, W, C, O, pad_value, shortcut (SH, SW, SC), shortcut stride, shift)
RESIDUAL_CASES = [
    (3, 17, 24, 64, 64, "zero", (17, 24, 64), 1, 0),
    (2, 15, 14, 64, 128, "zero", (30, 28, 64), 2, 0),
    (2, 9, 11, 128, 100, "one", (9, 11, 77), 1, 1),
    (2, 16, 16, 128, 128, "zero", (16, 16, 128), 1, 0),
    (2, 7, 7, 512, 300, "zero", (7, 7, 256), 1, 0),
    (3, 14, 14, 256, 256, "zero", (27, 28, 128), 2, 3),
    (72, 8, 8, 256, 300, "zero", (8, 8, 256), 1, 2),
    (72, 8, 8, 256, 260, "zero", (16, 16, 100), 2, 1),
    (72, 8, 8, 512, 300, "one", (8, 8, 296), 1, 0),
    (4, 16, 16, 16, 16, "zero", (16, 16, 16), 1, 0),
    (2, 8, 8, 16, 35, "zero", (16, 15, 16), 2, 2),
    (2, 9, 9, 32, 40, "one", (9, 9, 32), 1, 1),
    (2, 12, 12, 512, 128, "zero", (12, 12, 128), 1, 0),
    (2, 10, 9, 1024, 100, "one", (10, 9, 77), 1, 2),
]


@pytest.mark.parametrize("stream_dtype", [np.int32, np.int16])
@pytest.mark.parametrize("bits", ["none", "bits", "planes"])
@pytest.mark.parametrize("case", RESIDUAL_CASES, ids=lambda c: f"b{c[0]}_{c[1]}x{c[2]}_c{c[3]}_o{c[4]}_s{c[7]}")
def test_residual_bconv2d_on_cuda_matches_the_cpu(engine, case, bits, stream_dtype):
    """ops.bconv2d's residual epilogue on every engine, over an int32 or int16 stream: the stream and its bits as
    the CPU computes them (its int32 convolution, then the epilogue in jnp: jaxbnn.reference.residual_epilogue)."""
    from jaxbnn import ops

    batch, h, w_, c, o, pad_value, (sh, sw, sc), stride, shift = case
    rng = np.random.default_rng(zlib.crc32(repr((case, bits)).encode()))
    x = np.asarray(formats.pack_bits(_random_signs(rng, (batch, h, w_, c)) >= 0))
    weights = formats.pack_conv_weights(_random_signs(rng, (3, 3, c, o)))
    shortcut = rng.integers(-3 * 9 * c, 3 * 9 * c, (batch, sh, sw, sc)).astype(stream_dtype)
    shortcut[0, 0, 0, 0] = np.iinfo(stream_dtype).max  # wraps where it meets a positive dot product
    shape = {"none": None, "bits": (o,), "planes": (2, o)}[bits]
    epilogue = {}
    if shape:
        threshold = rng.integers(-9 * c, 9 * c, shape)
        ends = np.array([-2**31, -32770, -32769, -32768, -32767, 32766, 32767, 32768, 32769, 2**31 - 1])
        threshold = np.where(rng.random(shape) < 0.15, ends[rng.integers(0, len(ends), shape)], threshold)
        epilogue = dict(threshold=threshold.astype(np.int32), flip=rng.integers(0, 2, shape).astype(bool))
    kwargs = dict(in_channels=c, kernel_size=(3, 3), out_channels=o, padding="SAME", pad_value=pad_value,
                  w_tap_popcount=weights.tap_popcount, shortcut=shortcut, shortcut_stride=stride, shift=shift,
                  **epilogue)
    on_gpu = {name: jax.device_put(v, GPU) if isinstance(v, np.ndarray) else v for name, v in kwargs.items()}
    got = ops.bconv2d(jax.device_put(x, GPU), jax.device_put(weights.bits, GPU), **on_gpu)
    with jax.default_device(CPU):
        want = ops.bconv2d(x, weights.bits, **kwargs)
    for g, wnt in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == wnt.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(wnt))


def test_residual_handler_rejects_inconsistent_shortcuts():
    rng = np.random.default_rng(5)
    x = np.asarray(formats.pack_bits(_random_signs(rng, (2, 6, 6, 64)) >= 0))
    w = formats.pack_conv_weights(_random_signs(rng, (3, 3, 64, 64)))
    attrs = dict(_conv_attrs(64, 64, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero", None),
                 shortcut_stride=np.int64(1), shift=np.int64(0))
    result = _result("i32", (2, 6, 6), 64)
    for shortcut, stride, shift in [(np.zeros((2, 6, 5, 64), np.int32), 1, 0), (np.zeros((2, 6, 6, 65), np.int32), 1, 0),
                                    (np.zeros((2, 6, 6, 64), np.int32), 1, 32), (np.zeros((2, 6, 6, 64), np.int32), 0, 0)]:
        call = dict(attrs, shortcut_stride=np.int64(stride), shift=np.int64(shift))
        with pytest.raises(Exception, match="shortcut|shift"):
            _call("jaxbnn_bconv2d_residual_i32", GPU, result, [x, w.bits, w.tap_popcount, shortcut], call)


def test_residual_bits_handler_rejects_inconsistent_threshold_planes():
    rng = np.random.default_rng(6)
    x = np.asarray(formats.pack_bits(_random_signs(rng, (2, 6, 6, 64)) >= 0))
    w = formats.pack_conv_weights(_random_signs(rng, (3, 3, 64, 40)))
    attrs = dict(_conv_attrs(64, 40, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero", None),
                 shortcut_stride=np.int64(1), shift=np.int64(0))
    shortcut = np.zeros((2, 6, 6, 40), np.int16)
    stream = jax.ShapeDtypeStruct((2, 6, 6, 40), jnp.int16)

    def bits(*tail):
        return jax.ShapeDtypeStruct((2, 6, 6) + tail, jnp.uint32)

    for planes, flip_planes, result, message in [
            (3, 3, bits(3, 2), "1 to 2 planes"),  # more planes than the kernels write
            (2, 1, bits(2, 2), "flip"),
            (2, 2, bits(2, 1), "stream bits have shape"),
            (2, 2, bits(2), "stream bits have shape"),
            (1, 1, bits(2, 2), "stream bits have shape")]:
        threshold, flip = np.zeros((planes, 40), np.int32), np.zeros((flip_planes, 40), np.uint8)
        with pytest.raises(Exception, match=message):
            _call("jaxbnn_bconv2d_residual_i16_bits", GPU, (stream, result),
                  [x, w.bits, w.tap_popcount, shortcut, threshold, flip], attrs)


# Inputs whose taps read each pixel's words twice (x_repeats 2: a TNN / BTN layer's side-by-side activation blocks):
# the band kernel (C = 256 read as 4 + 4 words; "one" padding), the resident kernel (N = 256 on 8 x 8), stride 2
# (cp.async), stored pixels of 2 and 1 words, a 1x1 convolution.
REPEATED_CONV_CASES = [(3, 14, 14, 256, 64, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero"),
                       (2, 15, 13, 256, 128, (3, 3), (1, 1), ((1, 1), (1, 1)), "one"),
                       (4, 8, 8, 512, 256, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero"),
                       (3, 14, 14, 512, 128, (3, 3), (2, 2), ((1, 1), (1, 1)), "zero"),
                       (2, 10, 9, 128, 70, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero"),
                       (2, 9, 9, 64, 40, (3, 3), (1, 1), ((1, 1), (1, 1)), "one"),
                       (2, 8, 8, 512, 64, (1, 1), (1, 1), ((0, 0), (0, 0)), "zero")]


@pytest.mark.parametrize("kind", ["i32", "bits"])
@pytest.mark.parametrize("case", REPEATED_CONV_CASES, ids=lambda c: f"b{c[0]}_{c[1]}x{c[2]}_c{c[3]}_o{c[4]}_s{c[6][0]}")
def test_conv_handler_reads_a_repeated_input_in_place(engine, case, kind):
    """x_repeats 2 on the stored half equals x_repeats 1 on the input written out twice, and the reference."""
    batch, h, w_, c, o, kernel, stride, padding, pad_value = case
    rng = np.random.default_rng(zlib.crc32(repr((case, kind)).encode()))
    stored = np.asarray(formats.pack_bits(_random_signs(rng, (batch, h, w_, c // 2)) >= 0))
    x = np.concatenate([stored, stored], axis=-1)
    w = formats.pack_conv_weights(_random_signs(rng, (*kernel, c, o)))
    epi_kwargs, epi_operands = _epilogue_operands(rng, o, kernel[0] * kernel[1] * c, kind)
    with jax.default_device(CPU):
        want = np.asarray(reference.bconv2d(x, w.bits, in_channels=c, out_channels=o, kernel_size=kernel,
                                            stride=stride, padding=padding, pad_value=pad_value, **epi_kwargs))
    target, result = f"jaxbnn_bconv2d_{kind}", _result(kind, want.shape[:3], o)
    attrs = _conv_attrs(c, o, kernel, stride, padding, pad_value, None)
    got = _call(target, GPU, result, [stored, w.bits, w.tap_popcount, *epi_operands],
                dict(attrs, x_repeats=np.int64(2)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(_call(target, GPU, result, [x, w.bits, w.tap_popcount, *epi_operands], attrs), want)


def test_residual_handler_reads_a_repeated_input_in_place():
    """The int16 stream's residual kernel over a TNN block's repeated activation blocks, with both threshold planes."""
    rng = np.random.default_rng(8)
    c, o = 256, 64
    stored = np.asarray(formats.pack_bits(_random_signs(rng, (3, 12, 12, c // 2)) >= 0))
    w = formats.pack_conv_weights(_random_signs(rng, (3, 3, c, o)))
    shortcut = rng.integers(-3000, 3000, (3, 12, 12, o)).astype(np.int16)
    threshold, flip = rng.integers(-400, 400, (2, o)).astype(np.int32), rng.integers(0, 2, (2, o)).astype(np.uint8)
    attrs = dict(_conv_attrs(c, o, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero", None), shortcut_stride=np.int64(1),
                 shift=np.int64(1))
    result = (jax.ShapeDtypeStruct((3, 12, 12, o), jnp.int16), jax.ShapeDtypeStruct((3, 12, 12, 2, 2), jnp.uint32))

    def run(x, x_repeats):
        operands = [jax.device_put(v, GPU) for v in (x, w.bits, w.tap_popcount, shortcut, threshold, flip)]
        call = jax.ffi.ffi_call("jaxbnn_bconv2d_residual_i16_bits", result)
        return [np.asarray(v) for v in call(*operands, **dict(attrs, x_repeats=np.int64(x_repeats)))]

    for got, want in zip(run(stored, 2), run(np.concatenate([stored, stored], axis=-1), 1)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("c,words,x_repeats,message", [
    (256, 4, 3, "x_repeats must be 1, or 2 with c a multiple of 64"),
    (96, 2, 2, "x_repeats must be 1, or 2 with c a multiple of 64"),
    (256, 8, 2, "8 words per pixel"),
    (256, 4, 1, "4 words per pixel")])
def test_conv_handler_refuses_inconsistent_repeats(c, words, x_repeats, message):
    x = np.zeros((1, 6, 6, words), np.uint32)
    w = formats.pack_conv_weights(np.ones((3, 3, c, 8), np.float32))
    attrs = _conv_attrs(c, 8, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero", None, x_repeats=x_repeats)
    with pytest.raises(Exception, match=message):
        _call("jaxbnn_bconv2d_i32", GPU, _result("i32", (1, 6, 6), 8), [x, w.bits, w.tap_popcount], attrs)


@pytest.mark.parametrize("c,doubled,pad_value,x_repeats", [
    (1536, 16, "zero", 1),    # doubled words not a multiple of 32
    (1792, 32, "zero", 1),    # the rest (24 words) not a multiple of 16
    (1536, 32, "one", 1),     # "one" padding
    (1024, 32, "zero", 1),    # nothing after the doubled words
    (3072, 32, "zero", 2),    # a pixel read twice
    (1530, 32, "zero", 1),    # channels short of whole words
])  # fmt: skip
def test_doubled_conv_handler_refuses_what_its_reduction_order_cannot_take(c, doubled, pad_value, x_repeats):
    words = -(-c // 32) // x_repeats
    x = np.zeros((1, 6, 6, words), np.uint32)
    w = formats.pack_conv_weights(np.ones((3, 3, c, 8), np.float32))
    attrs = dict(_conv_attrs(c, 8, (3, 3), (1, 1), ((1, 1), (1, 1)), pad_value, None, x_repeats=x_repeats),
                 doubled_tap_words=np.int64(doubled))
    with pytest.raises(Exception, match="bconv2d_doubled needs"):
        _call("jaxbnn_bconv2d_doubled_i32", GPU, _result("i32", (1, 6, 6), 8), [x, w.bits, w.tap_popcount], attrs)


# --- ternary and mixed products (TNN, TBN, BTN) through the ops: one binary call over the planes side by side --

TERNARY_MODES = ["tnn", "tbn", "btn"]
# (batch, h, w, c, o, kernel, stride, padding, pad_value, pool): channels within and past whole words, both
# paddings, pools, output channels not a multiple of 32 (the threshold planes' padding columns)
TERNARY_CONV_CASES = [
    (2, 9, 7, 128, 40, (3, 3), 1, "SAME", "zero", None),
    (1, 9, 8, 33, 17, (3, 3), 2, ((2, 0), (1, 3)), "one", (2, 2)),
    (3, 8, 8, 64, 70, (3, 3), 2, "SAME", "one", None),
    (2, 12, 16, 256, 64, (3, 3), 1, "SAME", "zero", (2, 2)),
    (1, 6, 6, 3, 5, (7, 7), 1, "SAME", "zero", (3, 3)),
    (2, 7, 7, 512, 130, (3, 3), 1, "SAME", "zero", None),
    # TNN in three blocks a tap (ops._takes_doubled_conv): strided, pooled; "one" padding in four
    (1, 6, 10, 1000, 33, (3, 3), 2, "SAME", "zero", None),
    (2, 8, 12, 600, 70, (3, 3), 1, "SAME", "zero", (2, 2)),
    (2, 8, 8, 512, 40, (3, 3), 1, "SAME", "one", (2, 2)),
]


def _ternary_operands(rng, mode, x_shape, w_shape):
    """(packed activations, packed weights) of a product `mode` with random values."""
    conv = len(w_shape) == 4

    def values(ternary, shape):
        return (rng.integers(-1, 2, shape) if ternary else rng.choice([-1, 1], shape)).astype(np.float32)

    x = values(mode in ("tnn", "tbn"), x_shape)
    w = values(mode in ("tnn", "btn"), w_shape)
    packed_x = formats.pack_ternary_pm_planes(x) if mode in ("tnn", "tbn") else formats.pack_bits(x >= 0)
    if mode in ("tnn", "btn"):
        packed_w = (formats.pack_ternary_conv_weights if conv else formats.pack_ternary_dense_weights)(w)
    else:
        packed_w = (formats.pack_conv_weights if conv else formats.pack_dense_weights)(w)
    return packed_x, packed_w


def _ternary_epilogues(rng, n, k):
    spread = min(k // 4, 3 * int(np.sqrt(k))) + 2  # where the dot products lie: a few standard deviations
    threshold = rng.integers(-spread, spread + 1, (2, n)).astype(np.int32)
    flip = rng.integers(0, 2, (2, n)).astype(bool)
    return [dict(), dict(scale=rng.uniform(-2, 2, n).astype(np.float32), bias=rng.uniform(-2, 2, n).astype(np.float32)),
            dict(threshold=threshold[0], flip=flip[0]), dict(threshold=threshold, flip=flip)]


def _on(device, tree):
    return jax.tree.map(lambda v: jax.device_put(v, device), tree)


@pytest.mark.parametrize("mode", TERNARY_MODES)
@pytest.mark.parametrize("m,k,n", [(1, 3, 1), (5, 300, 33), (129, 1000, 257), (64, 512, 128), (3, 1500, 65),
                                   (300, 4096, 300)])
def test_ternary_bmm_on_cuda_matches_the_cpu_kernels(engine, mode, m, k, n):
    """On CUDA the ternary and mixed products run as one binary product over their planes side by side (a long
    TNN one as three blocks, the first two doubled): the same integers, bits and affine values as the CPU's own
    ternary kernels, on every engine."""
    from jaxbnn import ops

    rng = np.random.default_rng(zlib.crc32(repr((mode, m, k, n)).encode()))
    a, w = _ternary_operands(rng, mode, (m, k), (k, n))
    for epilogue in _ternary_epilogues(rng, n, k):
        got = np.asarray(jax.jit(lambda a, w: ops.bmm(a, w, **epilogue))(_on(GPU, a), _on(GPU, w)))
        want = np.asarray(jax.jit(lambda a, w: ops.bmm(a, w, **epilogue))(_on(CPU, a), _on(CPU, w)))
        np.testing.assert_array_equal(got, want, err_msg=f"epilogue {sorted(epilogue)}")


@pytest.mark.parametrize("m,k,n,doubled", [(1, 1056, 8, 1), (130, 3072, 257, 2), (64, 5000, 40, 3), (300, 2048, 300, 1)])
def test_doubled_bmm_on_cuda_matches_its_jnp_form(engine, m, k, n, doubled):
    """The binary product whose first K blocks count twice (`bmm_doubled`), random bits and popcounts within the
    range: the handler's int32 values equal the jnp form's, on every engine."""
    from jaxbnn import ops

    rng = np.random.default_rng(zlib.crc32(repr((m, k, n, doubled)).encode()))
    a = formats.pack_bits(rng.integers(0, 2, (m, k)).astype(bool))
    w = formats.to_fsb(formats.pack_bits(rng.integers(0, 2, (n, k)).astype(bool)))
    popcount = rng.integers(0, k + 1, n).astype(np.int32)
    run = jax.jit(lambda a, w, c: ops._doubled_binary_bmm(a, w, c, {}, k=k, n=n, kind="i32", doubled_k_blocks=doubled))
    np.testing.assert_array_equal(np.asarray(run(*_on(GPU, (a, w, popcount)))),
                                  np.asarray(run(*_on(CPU, (a, w, popcount)))))


@pytest.mark.parametrize("b,h,w,c,o,kernel,stride,pool,doubled", [
    (2, 7, 9, 1536, 40, (3, 3), 1, None, 32), (1, 8, 8, 3072, 300, (3, 3), 2, None, 64),
    (2, 9, 8, 1536, 33, (3, 3), 1, (2, 2), 32), (3, 5, 20, 1536, 8, (1, 3), 1, None, 32),
])  # fmt: skip
def test_doubled_bconv2d_on_cuda_matches_its_jnp_form(engine, b, h, w, c, o, kernel, stride, pool, doubled):
    """The convolution whose every tap's first words count twice (`bconv2d_doubled`), random bits and tap
    popcounts (so that out-of-frame taps need their corrections), "zero" padding: the handler's int32 values equal
    the jnp form's, on every engine."""
    from jaxbnn import ops

    rng = np.random.default_rng(zlib.crc32(repr((b, h, w, c, o, kernel, doubled)).encode()))
    taps = kernel[0] * kernel[1]
    x = formats.pack_bits(rng.integers(0, 2, (b, h, w, c)).astype(bool))
    wt = formats.to_fsb(formats.pack_bits(rng.integers(0, 2, (o, taps * c)).astype(bool)))
    popcount = rng.integers(0, 2 * c, (taps, o)).astype(np.int32)
    pads = ops._conv_padding("SAME", (h, w), kernel, (stride, stride))
    attrs = (c, o) + kernel + (stride, stride) + pads[0] + pads[1] + (False,) + (pool or (1, 1))
    run = jax.jit(lambda x, w, p: ops._doubled_binary_conv(x, w, p, {}, attrs=attrs, kind="i32",
                                                           pooled=pool is not None, doubled_tap_words=doubled))
    np.testing.assert_array_equal(np.asarray(run(*_on(GPU, (x, wt, popcount)))),
                                  np.asarray(run(*_on(CPU, (x, wt, popcount)))))


@pytest.mark.parametrize("mode", TERNARY_MODES)
@pytest.mark.parametrize("case", TERNARY_CONV_CASES, ids=lambda c: f"b{c[0]}_{c[1]}x{c[2]}_c{c[3]}_o{c[4]}_{c[8]}_pool{c[9]}")
def test_ternary_bconv2d_on_cuda_matches_the_cpu_kernels(engine, mode, case):
    from jaxbnn import ops

    batch, h, w_, c, o, kernel, stride, padding, pad_value, pool = case
    rng = np.random.default_rng(zlib.crc32(repr((mode, case)).encode()))
    x, w = _ternary_operands(rng, mode, (batch, h, w_, c), (*kernel, c, o))
    for epilogue in _ternary_epilogues(rng, o, kernel[0] * kernel[1] * c):
        def conv(x, w):
            return ops.bconv2d(x, w, stride=stride, padding=padding, pad_value=pad_value, pool=pool, **epilogue)

        got = np.asarray(jax.jit(conv)(_on(GPU, x), _on(GPU, w)))
        want = np.asarray(jax.jit(conv)(_on(CPU, x), _on(CPU, w)))
        np.testing.assert_array_equal(got, want, err_msg=f"epilogue {sorted(epilogue)}")


# Ternary and mixed residual blocks' second convolutions: the side-by-side binary product through the residual
# epilogue (ResNet-18's 64-channel block: TBN's 128 side-by-side channels on the band kernel, TNN's 256 on the
# resident one; a type-A shortcut at 128 channels; odd channels with "one" padding; 256 channels at 7 x 7, TNN's
# 1024 past the resident kernel's weights: the persistent one; ResNet-18's last block with a type-A shortcut, TNN's
# and TBN's 2048 and 1024 side-by-side channels on the persistent kernel).
# (batch, H, W, C, O, pad_value, shortcut (SH, SW, SC), shortcut stride, shift)
TERNARY_RESIDUAL_CASES = [
    (3, 17, 24, 64, 64, "zero", (17, 24, 64), 1, 0),
    (2, 16, 16, 128, 128, "zero", (32, 31, 64), 2, 1),
    (2, 9, 11, 40, 70, "one", (9, 11, 70), 1, 2),
    (2, 7, 7, 256, 256, "zero", (7, 7, 256), 1, 0),
    (2, 7, 7, 512, 512, "zero", (14, 13, 256), 2, 0),
]


@pytest.mark.parametrize("stream_dtype", [np.int16, np.int32])
@pytest.mark.parametrize("mode", TERNARY_MODES)
@pytest.mark.parametrize("case", TERNARY_RESIDUAL_CASES, ids=lambda c: f"b{c[0]}_{c[1]}x{c[2]}_c{c[3]}_o{c[4]}_s{c[7]}")
def test_ternary_residual_bconv2d_on_cuda_matches_the_cpu_kernels(engine, case, mode, stream_dtype):
    """The stream, its bits and a ternary conv1's two planes, as the CPU's own ternary kernels and the jnp
    epilogue give them."""
    from jaxbnn import ops

    batch, h, w_, c, o, pad_value, (sh, sw, sc), stride, shift = case
    rng = np.random.default_rng(zlib.crc32(repr((case, mode)).encode()))
    x, w = _ternary_operands(rng, mode, (batch, h, w_, c), (3, 3, c, o))
    shortcut = rng.integers(-3 * 9 * c, 3 * 9 * c, (batch, sh, sw, sc)).astype(stream_dtype)
    shortcut[0, 0, 0, 0] = np.iinfo(stream_dtype).max  # wraps where it meets a positive dot product
    for epilogue in [{}] + _ternary_epilogues(rng, o, 9 * c)[2:]:
        def conv(x, w, s):
            return ops.bconv2d(x, w, padding="SAME", pad_value=pad_value, shortcut=s, shortcut_stride=stride,
                               shift=shift, **epilogue)

        got = jax.jit(conv)(_on(GPU, x), _on(GPU, w), _on(GPU, shortcut))
        want = jax.jit(conv)(_on(CPU, x), _on(CPU, w), _on(CPU, shortcut))
        for g, wnt in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert g.dtype == wnt.dtype
            np.testing.assert_array_equal(np.asarray(g), np.asarray(wnt), err_msg=f"epilogue {sorted(epilogue)}")


# --- global pooling of the stream (ops.global_sum_bits) --------------------------------------------------------

# (batch, h, w, c, planes): channels within and past whole words, one pixel, ResNet-18's and ResNet-14's last
# streams, more pixels than the kernel's loads in flight and fewer
GLOBAL_POOL_CASES = [(3, 7, 7, 70, 1), (1, 1, 1, 1, 2), (2, 4, 4, 512, 2), (5, 13, 11, 33, 1), (16, 7, 7, 512, 1),
                     (64, 4, 4, 512, 2), (2, 3, 2, 96, 8)]


@pytest.mark.parametrize("dtype", [np.int16, np.int32])
@pytest.mark.parametrize("case", GLOBAL_POOL_CASES, ids=lambda c: f"b{c[0]}_{c[1]}x{c[2]}_c{c[3]}_p{c[4]}")
def test_global_sum_bits_on_cuda_matches_the_cpu(case, dtype):
    """The CUDA kernel against the reference on the CPU: streams spanning their type's range (an int32 stream's
    sums wrap), thresholds at the sums (ties) and at the int32 limits, flipped channels."""
    from jaxbnn import ops

    batch, h, w_, c, planes = case
    rng = np.random.default_rng(zlib.crc32(repr((case, np.dtype(dtype).name)).encode()))
    info = np.iinfo(dtype)
    stream = rng.integers(info.min, info.max, (batch, h, w_, c), endpoint=True, dtype=dtype)
    total = ((stream.astype(np.int64).sum(axis=(1, 2)) + 2**31) % 2**32 - 2**31).astype(np.int32)
    threshold = total[rng.integers(0, batch, (planes, c)), np.arange(c)] + rng.integers(-1, 2, (planes, c))
    ends = np.array([-2**31, 2**31 - 1], np.int64)
    threshold = np.where(rng.random((planes, c)) < 0.1, ends[rng.integers(0, 2, (planes, c))], threshold)
    threshold = np.clip(threshold, -2**31, 2**31 - 1).astype(np.int32)
    flip = rng.integers(0, 2, (planes, c)).astype(bool)
    got = ops.global_sum_bits(jax.device_put(stream, GPU), jax.device_put(threshold, GPU), jax.device_put(flip, GPU))
    with jax.default_device(CPU):
        want = ops.global_sum_bits(stream, threshold, flip)
    assert got.dtype == want.dtype == jnp.uint32 and got.shape == (batch, planes, formats.num_words(c))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# --- the stream's threshold planes after a residual kernel (ops._stream_planes) -----------------------------------

# (stream shape, planes). The rows kernel (whole 32-channel words, one or two planes): rows not a multiple of a
# CTA's, a CTA's threads not a multiple of a row's vectors (96 channels), one row a CTA (2048 int16 channels; int32
# ones take the word kernel), more rows than the grid's CTAs cover in one round. The word kernel: three and eight
# planes, channels past a word, one channel. Leading batch dims.
STREAM_PLANE_CASES = [((3, 5, 7, 64), 2), ((2, 9, 9, 96), 2), ((3, 2048), 1), ((5, 1024), 2), ((300000, 32), 2),
                      ((2, 9, 9, 96), 3), ((2, 3, 2, 2, 32), 8), ((2, 4, 4, 70), 2), ((5, 1), 1)]


@pytest.mark.parametrize("case", STREAM_PLANE_CASES, ids=lambda c: "x".join(map(str, c[0])) + f"_p{c[1]}")
@pytest.mark.parametrize("dtype", [np.int16, np.int32])
def test_stream_planes_on_cuda_match_the_reference(case, dtype):
    """The CUDA pass against the reference on the CPU: values over their type's whole range, thresholds at the
    values (ties) and at the int32 limits, flipped channels."""
    from jaxbnn import ops

    shape, planes = case
    rng = np.random.default_rng(zlib.crc32(repr((case, np.dtype(dtype).name)).encode()))
    info = np.iinfo(dtype)
    stream = rng.integers(info.min, info.max, shape, endpoint=True, dtype=dtype)
    c = shape[-1]
    values = stream.reshape(-1, c)
    threshold = values[rng.integers(0, len(values), (planes, c)), np.arange(c)].astype(np.int64)
    threshold += rng.integers(-1, 2, (planes, c))
    ends = np.array([-2**31, 2**31 - 1], np.int64)
    threshold = np.where(rng.random((planes, c)) < 0.1, ends[rng.integers(0, 2, (planes, c))], threshold)
    threshold = np.clip(threshold, -2**31, 2**31 - 1).astype(np.int32)
    flip = rng.integers(0, 2, (planes, c)).astype(np.uint8)
    got = jax.jit(ops._stream_planes)(*(jax.device_put(v, GPU) for v in (stream, threshold, flip)))
    want = reference.epilogue(jax.device_put(stream, CPU), threshold=threshold, flip=flip)
    assert got.dtype == jnp.uint32 and got.shape == shape[:-1] + (planes, formats.num_words(c))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_stream_planes_handler_rejects_inconsistent_shapes():
    stream = np.zeros((2, 3, 40), np.int16)
    result = jax.ShapeDtypeStruct((2, 3, 1, 2), jnp.uint32)
    for threshold, flip, res, message in [
            (np.zeros((1, 41), np.int32), np.zeros((1, 41), np.uint8), result, "threshold"),
            (np.zeros((9, 40), np.int32), np.zeros((9, 40), np.uint8), result, "threshold"),
            (np.zeros((1, 40), np.int32), np.zeros((2, 40), np.uint8), result, "flip"),
            (np.zeros((1, 40), np.int32), np.zeros((1, 40), np.uint8), jax.ShapeDtypeStruct((2, 3, 1, 1), jnp.uint32),
             "result"),
            (np.zeros((1, 40), np.int32), np.zeros((1, 40), np.uint8), jax.ShapeDtypeStruct((3, 2, 1, 2), jnp.uint32),
             "result")]:
        with pytest.raises(Exception, match=message):
            _call("jaxbnn_stream_bits", GPU, res, [stream, threshold, flip], {})
    with pytest.raises(Exception, match="int16 or int32"):
        _call("jaxbnn_stream_bits", GPU, result, [stream.astype(np.int8), np.zeros((1, 40), np.int32),
                                                  np.zeros((1, 40), np.uint8)], {})


def test_global_sum_bits_handler_rejects_inconsistent_shapes():
    stream = np.zeros((2, 3, 3, 40), np.int16)
    result = jax.ShapeDtypeStruct((2, 1, 2), jnp.uint32)
    for threshold, flip, res, message in [
            (np.zeros((1, 41), np.int32), np.zeros((1, 41), np.uint8), result, "threshold"),
            (np.zeros((1, 40), np.int32), np.zeros((2, 40), np.uint8), result, "flip"),
            (np.zeros((1, 40), np.int32), np.zeros((1, 40), np.uint8), jax.ShapeDtypeStruct((2, 1, 1), jnp.uint32),
             "bits result")]:
        with pytest.raises(Exception, match=message):
            _call("jaxbnn_global_sum_bits", GPU, res, [stream, threshold, flip], {})
    with pytest.raises(Exception, match="int16 or int32"):
        _call("jaxbnn_global_sum_bits", GPU, result, [stream.astype(np.int8), np.zeros((1, 40), np.int32),
                                                      np.zeros((1, 40), np.uint8)], {})


# --- dense chains in one kernel (ops.bmm_chain) ------------------------------------------------------------------

# (rows, widths k_0, n_0 = k_1, ..., last epilogue): ResNet-14's tail, one layer, eight, widths off every word /
# tile / k256 step, the widest reduction (4096), rows off the CTA's 16 and past one block a CTA; and a chain whose
# weights pass a CTA's shared memory (two 1024-wide layers: the op runs its layers' kernels)
CHAIN_CASES = [(1024, (512, 512, 512, 10), "f32"), (37, (77, 45, 300, 10), "f32"), (17, (33, 1), "bits"),
               (1, (1, 64, 1, 95), "bits"), (3000, (4096, 100, 33), "bits"),
               (16, (257, 255, 129, 31, 64, 96, 8, 300, 2), "f32"), (5000, (2000, 33, 10), "f32"),
               (8, (1024, 1024, 1024, 10), "f32")]


def _chain_layers(rng, widths, last_kind, tie_rows):
    """Layers of random ±1 weights; the thresholds of each layer at the dot products of its input `tie_rows`
    (ties), a few at the saturation ends and past them, flips at random."""
    layers, x = [], tie_rows
    for i, (k, n) in enumerate(zip(widths[:-1], widths[1:])):
        w = formats.pack_dense_weights(_random_signs(rng, (k, n)))
        if i == len(widths) - 2 and last_kind == "f32":
            layers.append(dict(b=w, scale=rng.uniform(-2, 2, n).astype(np.float32),
                               bias=rng.uniform(-2, 2, n).astype(np.float32)))
            break
        with jax.default_device(CPU):
            dots = np.asarray(reference.bmm(x, w.bits, k, n))
        threshold = dots[rng.integers(0, len(dots), n), np.arange(n)].astype(np.int64)
        ends = np.array([-k - 1, k + 1, -2**31, 2**31 - 1, -k - 5, k + 7])
        threshold = np.where(rng.random(n) < 0.1, ends[rng.integers(0, len(ends), n)], threshold).astype(np.int32)
        flip = rng.integers(0, 2, n).astype(bool)
        layers.append(dict(b=w, threshold=threshold, flip=flip))
        with jax.default_device(CPU):
            x = np.asarray(reference.bmm(x, w.bits, k, n, threshold=threshold, flip=flip))
    return layers


@pytest.mark.parametrize("case", CHAIN_CASES, ids=lambda c: f"m{c[0]}_" + "-".join(map(str, c[1])) + f"_{c[2]}")
def test_bmm_chain_on_cuda_is_the_reference_layer_after_layer(case):
    """The chain's kernel against the reference on the CPU and against the layers' own kernels on the GPU, bit for
    bit (the logits too: the same two roundings); padding bits of the input set (the kernel ignores them). Ties:
    thresholds at the dot products of the first rows."""
    from jaxbnn import ops

    m, widths, last_kind = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    x = np.asarray(formats.pack_bits(_random_signs(rng, (m, widths[0])) >= 0))
    layers = _chain_layers(rng, widths, last_kind, x[: min(m, 64)])
    text = jax.jit(lambda a: ops.bmm_chain(a, layers)).lower(jax.device_put(x, GPU)).as_text()
    assert (f"jaxbnn_bmm_chain_{last_kind}" in text) == ops.chain_fits_one_kernel(widths[:-1], widths[1:])
    got = np.asarray(ops.bmm_chain(jax.device_put(x, GPU), layers))
    with jax.default_device(CPU):
        want = np.asarray(reference.bmm_chain(x, [(layer["b"].bits, k, n, {e: v for e, v in layer.items() if e != "b"})
                                                   for layer, k, n in zip(layers, widths[:-1], widths[1:])]))
    np.testing.assert_array_equal(got, want)
    layer_by_layer = jax.device_put(x, GPU)
    for layer in layers:
        layer_by_layer = ops.bmm(layer_by_layer, **layer)
    np.testing.assert_array_equal(got, np.asarray(layer_by_layer))
    if widths[0] % 32:  # the last input word's padding bits set: the same result
        padded = x.copy()
        padded[:, -1] |= np.uint32((0xFFFFFFFF << (widths[0] % 32)) & 0xFFFFFFFF)
        np.testing.assert_array_equal(np.asarray(ops.bmm_chain(jax.device_put(padded, GPU), layers)), got)


def test_bmm_chain_handler_rejects_inconsistent_calls():
    rng = np.random.default_rng(3)
    w1, w2 = (formats.pack_dense_weights(_random_signs(rng, kn)) for kn in ((64, 40), (40, 10)))
    x = np.zeros((5, 2), np.uint32)
    t40, f40 = np.zeros(40, np.int32), np.zeros(40, np.uint8)
    s10, b10 = np.ones(10, np.float32), np.zeros(10, np.float32)
    good = [x, w1.bits, w1.popcount, t40, f40, w2.bits, w2.popcount, s10, b10]
    result = jax.ShapeDtypeStruct((5, 10), jnp.float32)

    def call(operands, ks=(64, 40), ns=(40, 10), res=result, target="jaxbnn_bmm_chain_f32"):
        return _call(target, GPU, res, operands, dict(ks=np.array(ks, np.int64), ns=np.array(ns, np.int64)))

    assert call(good).shape == (5, 10)
    # two 1024-wide layers: 128 KiB of weights, past a CTA's shared memory
    wide = [np.zeros((5, 32), np.uint32), np.zeros((128, 8, 8, 4), np.uint32), np.zeros(1024, np.int32),
            np.zeros(1024, np.int32), np.zeros(1024, np.uint8), np.zeros((2, 8, 8, 4), np.uint32),
            np.zeros(10, np.int32), s10, b10]
    for kwargs, message in [
            (dict(operands=good[:-1]), "four operands a layer"),
            (dict(operands=good, ns=(40,)), "each with its k and n"),
            (dict(operands=good, ks=(64, 41)), "reduces over k=41 bits, but the layer before writes n=40"),
            (dict(operands=good, ks=(8192, 40)), "must lie in \\[1, 4096\\]"),
            (dict(operands=wide, ks=(1024, 1024), ns=(1024, 10)), "shared memory"),
            (dict(operands=[np.zeros((5, 3), np.uint32)] + good[1:]), "activations"),
            (dict(operands=good, res=jax.ShapeDtypeStruct((5, 11), jnp.float32)), "result has shape"),
            (dict(operands=good[:3] + [t40[:-1]] + good[4:]), "threshold"),
            (dict(operands=good[:3] + [t40.astype(np.float32)] + good[4:]), "int32 threshold"),
            (dict(operands=good[:7] + [s10.astype(np.int32)] + good[8:]), "float32 scale"),
            (dict(operands=good[:2] + [w1.popcount[:-1]] + good[3:]), "popcounts"),
            (dict(operands=good, res=jax.ShapeDtypeStruct((5, 1), jnp.uint32), target="jaxbnn_bmm_chain_bits"),
             "int32 threshold")]:
        with pytest.raises(Exception, match=message):
            call(**kwargs)
