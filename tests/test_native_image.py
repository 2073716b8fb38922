"""The native CPU first layer, jaxbnn_image_conv2d_{i32,i16,bits,i32_bits,i16_bits}: registered and used by `ops.image_conv2d` /
`ops.image_matmul`, every kernel ISA tier bit for bit against `jaxbnn.reference` (odd channel and output
counts, strides, asymmetric padding, pools that drop rows, threshold planes, flips, ties, thresholds at the
int32 extremes, every shift, the extreme levels and weights, sizes split over threads), the kernel's sign
masks (`formats.image_kernel_masks`) read in place of the kernel, and the handlers' own validation, exercised
by calling jax.ffi.ffi_call directly with bad operands and attributes."""

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbnn import _cpu, _ffi, formats, ops, reference  # the CPU module is part of every build: no skip

TARGETS = ("jaxbnn_image_conv2d_i32", "jaxbnn_image_conv2d_i16", "jaxbnn_image_conv2d_bits",
           "jaxbnn_image_conv2d_i32_bits", "jaxbnn_image_conv2d_i16_bits")
INT32_MIN, INT32_MAX = np.iinfo(np.int32).min, np.iinfo(np.int32).max


def _tiers():
    """(ISA, AMX tiles) of every first-layer tier this CPU runs: AMX-INT8 where usable (the best ISA's calls
    of enough rows and reduction), then each ISA without it (AVX-512 VNNI, AVX2, portable)."""
    isas = _cpu.supported_isas()
    return ([(isas[0], True)] if _cpu.amx_usable() else []) + [(isa, False) for isa in isas]


@pytest.fixture(params=_tiers(), ids=lambda tier: tier[0] + ("+amx" if tier[1] else ""))
def isa(request):
    """Runs the test once per kernel tier this CPU supports."""
    name, amx = request.param
    previous, previous_amx = _cpu.active_isa(), _cpu.first_layer_amx()
    _cpu.set_isa(name)
    _cpu.set_first_layer_amx(amx)
    yield name
    _cpu.set_isa(previous)
    _cpu.set_first_layer_amx(previous_amx)


def test_amx_tiles_are_used_where_the_cpu_has_them():
    """AMX-INT8 is detected from the CPU and granted by the OS (Linux lists amx_int8 and amx_tile in
    /proc/cpuinfo where both hold); on by default where usable, and refused where not."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = set(cpuinfo.read().split())
    except OSError:
        flags = None
    if flags is not None and "amx_int8" in flags and "amx_tile" in flags:
        assert _cpu.amx_usable() and _cpu.first_layer_amx()
    if not _cpu.amx_usable():
        assert not _cpu.first_layer_amx()
        with pytest.raises(ValueError, match="no AMX-INT8"):
            _cpu.set_first_layer_amx(True)


def test_targets_are_registered_and_the_ops_lower_to_them():
    assert all(t in _cpu.registrations() for t in TARGETS)
    assert all(_ffi.has_target("cpu", t) for t in TARGETS), _ffi.status()
    levels, kernel = np.zeros((2, 8, 8, 3), np.int8), np.ones((3, 3, 3, 5), np.int8)
    hlo = jax.jit(lambda x: ops.image_conv2d(x, kernel, pool=(2, 2), shift=3)).lower(levels).as_text()
    assert "jaxbnn_image_conv2d_i32" in hlo
    threshold = np.zeros((2, 5), np.int32)
    dense = jax.jit(lambda x: ops.image_matmul(x, np.ones((12, 5), np.int8), threshold=threshold))
    assert "jaxbnn_image_conv2d_bits" in dense.lower(np.zeros((4, 12), np.int8)).as_text()


def test_the_handlers_read_uint8_pixels_as_they_are():
    """Pixels reach the custom call as the uint8 they are: no conversion to their levels before it."""
    pixels, kernel = np.zeros((2, 8, 8, 3), np.uint8), np.ones((3, 3, 3, 5), np.int8)
    for layer in (lambda x: ops.image_conv2d(x, kernel, pool=(2, 2), shift=3),
                  lambda x: ops.image_conv2d(x, kernel, threshold=np.zeros(5, np.int32))):
        hlo = jax.jit(layer).lower(pixels).as_text()
        (call,) = [line for line in hlo.splitlines() if "custom_call @jaxbnn_image_conv2d" in line]
        assert "(%arg0," in call and "tensor<2x8x8x3xui8>" in call
        assert "xor" not in hlo and "convert" not in hlo


# --- every tier against the reference ---------------------------------------------------------------


def int8_values(rng, shape):
    return rng.integers(-128, 128, shape, dtype=np.int8)


def reference_conv(levels, kernel, stride, pads, pool, **epilogue):
    return np.asarray(reference.image_conv2d(jnp.asarray(levels), jnp.asarray(kernel), stride=stride, padding=pads,
                                             pool=pool, **epilogue))  # fmt: skip


def thresholds_with_ties(rng, pre, planes):
    """(planes, N) thresholds, half of them actual pre-activation values (ties), the others at the int32
    extremes or near zero; random flips."""
    n = pre.shape[-1]
    flat = pre.reshape(-1, n)
    ties = flat[rng.integers(0, flat.shape[0], (planes, n)), np.arange(n)]
    others = rng.choice(np.array([INT32_MIN, INT32_MAX, -1, 0, 1], np.int64), (planes, n))
    threshold = np.where(rng.random((planes, n)) < 0.5, ties, others).astype(np.int32)
    return threshold, (rng.random((planes, n)) < 0.5).astype(np.uint8)


IMAGE_CASES = [
    # b, h, w, c, n, kernel, stride, padding, pool
    (2, 9, 8, 1, 1, (3, 3), (1, 1), "SAME", None),
    (1, 23, 21, 3, 64, (7, 7), (4, 4), "SAME", None),  # ResNet-18's stem on a small image
    (2, 19, 23, 3, 100, (11, 11), (4, 4), "VALID", (2, 2)),  # AlexNet's first conv on a small image
    (1, 11, 13, 5, 33, (3, 3), (1, 2), ((2, 0), (1, 3)), (2, 3)),  # pool 2x3 drops a row and a column
    (2, 14, 13, 3, 31, (3, 3), (1, 1), "SAME", (3, 3)),  # pool 3x3 drops two rows and a column
    (1, 6, 7, 33, 65, (2, 3), (2, 1), ((1, 1), (0, 2)), None),
    (3, 1, 1, 784, 100, (1, 1), (1, 1), "VALID", None),  # MNIST's dense first layer as a 1x1 image
    (1, 4, 4, 1, 129, (5, 5), (1, 1), ((2, 2), (2, 2)), None),  # the kernel wider than the image
    (1, 5, 3, 3, 40, (5, 5), (2, 2), ((4, 0), (0, 4)), (1, 1)),  # receptive fields beyond two image edges
    # no more gathered rows than reduction elements (the VNNI tier reads the kernel as it is): K not a multiple
    # of 4, N past one 64-column block
    (1, 4, 4, 3, 70, (3, 3), (2, 2), "VALID", None),
    (2, 5, 5, 5, 33, (3, 3), (1, 1), "VALID", (2, 2)),  # 8 rows, a pool window of 4 across register blocks
    (1, 4, 5, 2, 100, (2, 2), (1, 1), "VALID", (1, 3)),  # 9 rows, K = 8: packed again
    (1, 3, 4, 3, 40, (2, 2), (1, 1), "VALID", (1, 3)),  # 6 rows (AVX2 reads the kernel as it is), pool windows of 3
    # reductions of at least 320 levels over at least 32 rows (the AMX tiles): passes of 32 rows cut by the
    # task's last rows, pool windows across passes, a 32-column last block, K not a multiple of 64
    (3, 12, 11, 7, 70, (7, 7), (1, 1), "SAME", (2, 2)),
    (2, 9, 9, 40, 33, (3, 3), (2, 2), ((1, 2), (0, 1)), (1, 2)),
    (1, 7, 6, 320, 129, (1, 1), (1, 1), "VALID", None),  # K = 64 * 5 exactly
    # kernel rows of at most 4 bytes (the AVX2 tier reads a unit kernel's fields where they lie, one quad a kernel
    # row): MNIST's first layer, strided and pooled, 4-byte runs of 4 channels or 4 taps, fields that end at the
    # last byte of the image
    (3, 28, 28, 1, 32, (3, 3), (1, 1), "SAME", None),
    (2, 11, 9, 1, 40, (3, 3), (2, 1), ((1, 2), (0, 1)), (2, 2)),
    (1, 6, 5, 4, 33, (1, 1), (1, 1), "VALID", None),
    (2, 7, 6, 2, 20, (3, 2), (1, 1), "SAME", (1, 2)),
    (1, 9, 10, 1, 9, (5, 4), (1, 1), "SAME", None),
    (2, 6, 5, 1, 8, (3, 3), (1, 1), "VALID", None),
]


@pytest.mark.parametrize("b,h,w,c,n,kernel,stride,padding,pool", IMAGE_CASES, ids=[str(c[:6]) for c in IMAGE_CASES])
def test_every_tier_matches_reference(isa, b, h, w, c, n, kernel, stride, padding, pool):
    rng = np.random.default_rng(b * 1009 + h * 101 + c * 7 + n)
    levels, weights = int8_values(rng, (b, h, w, c)), int8_values(rng, (*kernel, c, n))
    pads = ops._conv_padding(padding, (h, w), kernel, stride)
    pre = reference_conv(levels, weights, stride, pads, pool)
    pixels = levels.view(np.uint8) ^ 0x80  # whose levels p - 128 are `levels`
    for shift in (0, 7, 31):
        layer = jax.jit(lambda x: ops.image_conv2d(x, weights, stride=stride, padding=padding, pool=pool, shift=shift))
        np.testing.assert_array_equal(np.asarray(layer(levels)), pre >> shift)
        if shift == 7:
            np.testing.assert_array_equal(np.asarray(layer(pixels)), pre >> shift)
    for planes in (1, 2):
        threshold, flip = thresholds_with_ties(rng, pre, planes)
        layer = jax.jit(lambda x: ops.image_conv2d(x, weights, stride=stride, padding=padding, pool=pool,
                                                   threshold=threshold, flip=flip))  # fmt: skip
        want = reference_conv(levels, weights, stride, pads, pool, threshold=threshold, flip=flip)
        np.testing.assert_array_equal(np.asarray(layer(levels)), want)
        np.testing.assert_array_equal(np.asarray(layer(pixels)), want)


STREAM_CASES = [  # b, h, w, c, n, kernel, stride, padding, pool, out_dtype, planes beside the stream (0: none), shift
    (3, 32, 32, 3, 128, (3, 3), (2, 2), "SAME", None, "int16", 1, 7),  # ResNet-14's stem and the first block's bits
    (2, 21, 23, 3, 64, (7, 7), (4, 4), "SAME", None, "int32", 2, 7),  # ResNet-18's, a ternary block's two planes
    (2, 21, 21, 3, 96, (3, 3), (1, 1), "SAME", None, "int16", 2, 0),  # int16 values that wrap
    (3, 19, 23, 2, 30, (3, 5), (1, 2), "SAME", (2, 2), "int16", 1, 1),  # pooled, N % 8 != 0: partial stores
    (2, 9, 13, 5, 33, (2, 3), (1, 2), ((0, 3), (4, 0)), (3, 2), "int16", 0, 3),  # the int16 stream alone
    (37, 1, 1, 784, 100, (1, 1), (1, 1), "VALID", None, "int32", 1, 4),  # a dense first layer's stream and bits
    (1, 4, 4, 3, 70, (3, 3), (2, 2), "VALID", None, "int16", 1, 0),  # few rows: the kernel read as it is
    (3, 12, 11, 7, 70, (7, 7), (1, 1), "SAME", (2, 2), "int16", 2, 2),  # the AMX tiles' passes, where usable
]


@pytest.mark.parametrize("case", STREAM_CASES, ids=[f"{c[:5]}_{c[9]}_p{c[10]}" for c in STREAM_CASES])
def test_the_stream_forms_match_reference_on_every_tier(isa, case):
    """The stem's forms (`out_dtype`, `keep_stream`): the int32 or int16 stream (`>> shift`, its low 16 bits),
    alone or with the bits of its values, is one custom call of its own target, exact against the reference
    (ties at the stream's values, thresholds at the int32 extremes, wrapped int16 values)."""
    b, h, w, c, n, kernel, stride, padding, pool, out_dtype, planes, shift = case
    rng = np.random.default_rng(b * 1009 + h * 101 + c * 7 + n + planes)
    levels, weights = int8_values(rng, (b, h, w, c)), int8_values(rng, (*kernel, c, n))
    weights[..., : n // 2] = rng.integers(-1, 2, weights[..., : n // 2].shape)
    pads = ops._conv_padding(padding, (h, w), kernel, stride)
    stream = reference_conv(levels, weights, stride, pads, pool, shift=shift, out_dtype=out_dtype)
    epilogue = dict(shift=shift, out_dtype=out_dtype)
    if planes:
        threshold, flip = thresholds_with_ties(rng, stream.astype(np.int32), planes)
        epilogue.update(threshold=threshold, flip=flip, keep_stream=True)
    layer = jax.jit(lambda x: ops.image_conv2d(x, weights, stride=stride, padding=padding, pool=pool, **epilogue))
    hlo = layer.lower(levels).as_text()
    target = f"jaxbnn_image_conv2d_i{out_dtype[3:]}{'_bits' if planes else ''}"
    assert hlo.count("custom_call @jaxbnn_image_conv2d") == 1 and f"@{target}(" in hlo
    want = reference.image_conv2d(jnp.asarray(levels), jnp.asarray(weights), stride=stride, padding=pads, pool=pool,
                                  **epilogue)
    for got in (layer(levels), layer(pixels_of(levels))):
        for got_part, want_part in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert got_part.dtype == want_part.dtype
            np.testing.assert_array_equal(np.asarray(got_part), np.asarray(want_part))


def pixels_of(levels):
    """The uint8 pixels whose levels p - 128 are `levels`."""
    return levels.view(np.uint8) ^ 0x80


def test_image_matmul_every_tier(isa):
    """The dense first layer: few rows (the columns split over threads; the VNNI tier reads the kernel as it
    is up to 64 rows, the others pack their own columns) and more rows, fewer or more than K (the weights
    packed once); int8 levels and the uint8 pixels they come from."""
    rng = np.random.default_rng(7)
    kernels = {k: int8_values(rng, (k, 300)) for k in (784, 785)}
    for k, m in ((784, 1), (785, 5), (785, 8), (784, 9), (784, 64), (785, 65), (784, 200), (785, 786)):
        kernel = kernels[k]
        levels = int8_values(rng, (m, k))
        pre = levels.astype(np.int64) @ kernel.astype(np.int64)
        np.testing.assert_array_equal(np.asarray(jax.jit(ops.image_matmul)(levels, kernel)), pre)
        pixels = levels.view(np.uint8) ^ 0x80
        np.testing.assert_array_equal(np.asarray(jax.jit(ops.image_matmul)(pixels, kernel)), pre)
        threshold, flip = thresholds_with_ties(rng, pre, 2)
        got = jax.jit(lambda x: ops.image_matmul(x, kernel, threshold=threshold, flip=flip))(levels)
        want = reference.image_epilogue(jnp.asarray(pre.astype(np.int32))[:, None, None], threshold=threshold,
                                        flip=flip)[:, 0, 0]  # fmt: skip
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_extreme_levels_and_weights_are_exact_on_every_tier(isa):
    """-128 and 127 levels times -128 weights, up to the largest reduction the op allows: the products and
    their sums at their largest, without rounding or wrapping (the VNNI tier's wrapping partial sums
    included)."""
    k = ops.MAX_IMAGE_REDUCTION
    for level in (-128, 127):
        for rows in (2, 33):  # 33: the AMX tiles too
            got = np.asarray(jax.jit(ops.image_matmul)(np.full((rows, k), level, np.int8),
                                                       np.full((k, 3), -128, np.int8)))  # fmt: skip
            np.testing.assert_array_equal(got, np.full((rows, 3), k * level * -128))
    levels = np.full((1, 19, 19, 3), -128, np.int8)
    levels[0, ::2, ::3] = 127
    kernel = np.full((11, 11, 3, 5), -128, np.int8)
    got = jax.jit(lambda x: ops.image_conv2d(x, kernel, stride=4, padding="SAME"))(levels)
    pads = ops._conv_padding("SAME", (19, 19), (11, 11), (4, 4))
    np.testing.assert_array_equal(np.asarray(got), reference_conv(levels, kernel, (4, 4), pads, None))


def test_unit_kernels_are_exact_on_every_tier(isa):
    """Kernels of -1, 0 and +1, every zoo model's first layer (the AVX2 tier multiplies them as bytes and sums
    64 quads' products in int16 before widening): the image cases with such kernels, and the largest sums of
    those runs, +-127 (pixels 0 and 255) times +-1 over reductions of one run, a run and a quad, and many runs."""
    rng = np.random.default_rng(11)
    for b, h, w, c, n, kernel, stride, padding, pool in IMAGE_CASES:
        levels, weights = int8_values(rng, (b, h, w, c)), rng.integers(-1, 2, (*kernel, c, n)).astype(np.int8)
        pads = ops._conv_padding(padding, (h, w), kernel, stride)
        pre = reference_conv(levels, weights, stride, pads, pool)
        layer = jax.jit(lambda x: ops.image_conv2d(x, weights, stride=stride, padding=padding, pool=pool))
        np.testing.assert_array_equal(np.asarray(layer(levels)), pre)
        threshold, flip = thresholds_with_ties(rng, pre, 2)
        layer = jax.jit(lambda x: ops.image_conv2d(x, weights, stride=stride, padding=padding, pool=pool,
                                                   threshold=threshold, flip=flip))  # fmt: skip
        want = reference_conv(levels, weights, stride, pads, pool, threshold=threshold, flip=flip)
        np.testing.assert_array_equal(np.asarray(layer(levels.view(np.uint8) ^ 0x80)), want)
    for k in (256, 260, 4097):
        for level in (-128, 127):
            for value in (-1, 1):
                got = jax.jit(ops.image_matmul)(np.full((9, k), level, np.int8), np.full((k, 40), value, np.int8))
                np.testing.assert_array_equal(np.asarray(got), np.full((9, 40), k * level * value))


def test_a_single_value_past_the_unit_range_is_exact_on_every_tier(isa):
    """A -1 / +1 kernel whose last element (past the last whole 32 bytes of the kernel) is -128, paired in the
    reduction with a -1: the AVX2 tier's check of the values must see it, since that pair's byte products
    (255 * -1 + 255 * -128) overflow int16."""
    k, n = 258, 35
    kernel = np.where(np.random.default_rng(5).random((k, n)) < 0.5, -1, 1).astype(np.int8)
    kernel[-2, -1], kernel[-1, -1] = -1, -128
    levels = np.full((9, k), 127, np.int8)
    want = levels.astype(np.int64) @ kernel.astype(np.int64)
    np.testing.assert_array_equal(np.asarray(jax.jit(ops.image_matmul)(levels, kernel)), want)


def test_repeated_parallel_calls_are_identical():
    """Work is split over XLA's thread pool (by outputs and by columns); the split must not change a bit."""
    rng = np.random.default_rng(3)
    levels, kernel = int8_values(rng, (4, 64, 64, 3)), int8_values(rng, (3, 3, 3, 200))
    threshold = rng.integers(-3000, 3000, (2, 200)).astype(np.int32)
    f = jax.jit(lambda x: ops.image_conv2d(x, kernel, pool=(2, 2), threshold=threshold))
    first = np.asarray(f(levels))
    pads = ops._conv_padding("SAME", (64, 64), (3, 3), (1, 1))
    flip = np.zeros((2, 200), np.uint8)
    want = reference_conv(levels, kernel, (1, 1), pads, (2, 2), threshold=threshold, flip=flip)
    np.testing.assert_array_equal(first, want)
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(levels)), first)


@pytest.mark.parametrize("n", [1025, 1088, 8256, 16448])
def test_wide_dense_layer_at_batch_one(n):
    """One output row and more 64-column blocks than the tasks asked for (8 per thread): the blocks, split
    into whole runs per task, leave some tasks without columns (at 2, 16 or 32 threads), which must do
    nothing."""
    rng = np.random.default_rng(n)
    levels, kernel = int8_values(rng, (1, 784)), rng.integers(-1, 2, (784, n)).astype(np.int8)
    pre = levels.astype(np.int64) @ kernel.astype(np.int64)
    np.testing.assert_array_equal(np.asarray(jax.jit(ops.image_matmul)(levels, kernel)), pre)


# --- the kernel's sign masks ------------------------------------------------------------------------------


def test_kernel_masks_layout():
    """formats.image_kernel_masks: one plane for a kernel of -1 and +1, two for one with zeros; bit
    4 (col % 16) + k % 4 of word (k // 4, col // 16), a 64-bit word as (low, high) uint32; each column's counts."""
    kernel = np.full((6, 20), -1, np.int8)
    kernel[5, 17] = kernel[0, 0] = kernel[2, 15] = 1
    masks = formats.image_kernel_masks(kernel)
    assert masks.masks.shape == (1, 2, 2, 2) and masks.counts.shape == (1, 20) and (masks.k, masks.n) == (6, 20)
    words = np.asarray(masks.masks, np.uint64)
    words = words[..., 0] | words[..., 1] << np.uint64(32)
    assert words[0, 0, 0] == 1 | 1 << (4 * 15 + 2) and words[0, 1, 1] == 1 << (4 * 1 + 1)
    assert words[0, 0, 1] == words[0, 1, 0] == 0
    np.testing.assert_array_equal(np.asarray(masks.counts)[0], (kernel == 1).sum(axis=0))
    kernel[3, 4] = 0
    ternary = formats.image_kernel_masks(kernel.reshape(1, 2, 3, 20))
    assert ternary.masks.shape == (2, 2, 2, 2) and ternary.k == 6
    np.testing.assert_array_equal(np.asarray(ternary.counts), [(kernel == 1).sum(axis=0), (kernel == -1).sum(axis=0)])


def test_kernel_masks_give_the_kernels_results_on_every_tier(isa):
    """A dense first layer given its kernel's sign masks: the same results as from the kernel, for binary and
    ternary kernels, every epilogue, int8 levels and uint8 pixels, K and N off the masks' words (quads of 4,
    16-column words, 64-column blocks, a 32-column last block) and 1 to 130 rows (past each tier's most rows the
    packed kernel: AVX-512 VNNI 64, AVX2 128 binary and 16 ternary)."""
    rng = np.random.default_rng(11)
    cases = [(1, 784, 1024, False), (1, 5, 17, True), (3, 31, 40, False), (4, 65, 100, True), (5, 1248, 257, False),
             (7, 3, 1, True), (9, 300, 64, True), (16, 127, 33, False), (17, 129, 40, True), (64, 784, 96, True),
             (65, 64, 70, False), (130, 200, 50, False)]
    for m, k, n, ternary in cases:
        kernel = (rng.integers(-1, 2, (k, n)) if ternary else np.where(rng.random((k, n)) < 0.5, -1, 1)).astype(np.int8)
        masks = formats.image_kernel_masks(kernel)
        assert masks.masks.shape[0] == (2 if (kernel == 0).any() else 1)
        levels = int8_values(rng, (m, k))
        levels[0, : min(k, 8)] = -128  # the extreme levels
        pre = levels.astype(np.int64) @ kernel.astype(np.int64)
        threshold, flip = thresholds_with_ties(rng, pre, 2)
        for x in (levels, levels.view(np.uint8) ^ 0x80):
            got = jax.jit(lambda x: ops.image_matmul(x, kernel, kernel_masks=masks))(x)
            np.testing.assert_array_equal(np.asarray(got), pre)
            got = jax.jit(lambda x: ops.image_matmul(x, kernel, threshold=threshold, flip=flip, keep_stream=True,
                                                     shift=3, out_dtype=jnp.int16, kernel_masks=masks))(x)
            want = reference.image_epilogue(jnp.asarray(pre.astype(np.int32) >> 3)[:, None, None],
                                            out_dtype=jnp.int16, threshold=threshold, flip=flip, keep_stream=True)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w)[:, 0, 0])


def test_kernel_masks_at_the_extreme_sums(isa):
    """Rows of the extreme levels (127 and -128) against columns of all +1, all -1 and alternating signs, binary
    and ternary, over reductions from one quad to 1,248 (the AVX2 tier's sums of 32 quads in int16 at their
    largest): the exact products."""
    for k in (4, 129, 1248):
        columns = [np.ones(k), -np.ones(k), np.where(np.arange(k) % 2 == 0, 1, -1)]
        binary = np.stack(columns * 11, axis=1).astype(np.int8)  # 33 columns: past a 32-column word
        ternary = binary.copy()
        ternary[::3, 1::4] = 0
        levels = np.stack([np.full(k, 127), np.full(k, -128), np.where(np.arange(k) % 2 == 0, 127, -128)]).astype(np.int8)
        for kernel in (binary, ternary):
            masks = formats.image_kernel_masks(kernel)
            want = levels.astype(np.int64) @ kernel.astype(np.int64)
            for x in (levels, levels.view(np.uint8) ^ 0x80):
                got = ops.image_matmul(x, kernel, kernel_masks=masks)
                np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"k={k} planes={masks.masks.shape[0]}")


def test_kernel_masks_in_a_pooled_convolution_of_few_rows(isa):
    """A convolution of few gathered rows (the VNNI tier reads the masks) with a pool window across register
    blocks: the kernel's results."""
    rng = np.random.default_rng(12)
    kernel = rng.integers(-1, 2, (3, 3, 5, 33)).astype(np.int8)
    levels = int8_values(rng, (2, 5, 5, 5))
    masks = formats.image_kernel_masks(kernel)
    want = reference_conv(levels, kernel, (1, 1), ((0, 0), (0, 0)), (2, 2))
    got = ops.image_conv2d(levels, kernel, padding="VALID", pool=(2, 2), kernel_masks=masks)
    np.testing.assert_array_equal(np.asarray(got), want)


def _mask_reading_tiers():
    """The ISAs whose first-layer kernels read the sign masks: AVX-512 VNNI (where the CPU has it) and AVX2."""
    vnni = "avx512vnni" in open("/proc/cpuinfo").read().replace("_", "") if sys.platform == "linux" else False
    return [isa for isa in _cpu.supported_isas() if isa == "avx2" or (isa == "avx512_vpopcntdq" and vnni)]


@pytest.mark.parametrize("ternary", [False, True], ids=["binary", "ternary"])
def test_the_mask_tiers_read_the_masks_instead_of_the_kernel(ternary):
    """The op checks the masks' shape, not their values: on the tiers that read them (AVX-512 VNNI, AVX2), another
    kernel's masks give that kernel's products (which shows the masks are what the call reads)."""
    tiers = _mask_reading_tiers()
    if not tiers:
        pytest.skip("no AVX-512 VNNI or AVX2 on this CPU")
    rng = np.random.default_rng(13)
    kernel = (rng.integers(-1, 2, (100, 50)) if ternary else np.where(rng.random((100, 50)) < 0.5, -1, 1)).astype(np.int8)
    levels = int8_values(rng, (2, 100))
    previous = _cpu.active_isa()
    try:
        for isa in tiers:
            _cpu.set_isa(isa)
            got = ops.image_matmul(levels, kernel, kernel_masks=formats.image_kernel_masks(-kernel))
            np.testing.assert_array_equal(np.asarray(got), -(levels.astype(np.int64) @ kernel.astype(np.int64)), err_msg=isa)
    finally:
        _cpu.set_isa(previous)


def test_only_the_cpu_call_takes_the_masks_operands(monkeypatch):
    """Lowered for CUDA (exported for that platform, as if its module were loaded), the first layer's custom
    calls take their operands as before, without the masks; for the CPU the masks follow the kernel (of no
    planes where none are given)."""
    has_target = _ffi.has_target
    monkeypatch.setattr(_ffi, "has_target", lambda platform, target: platform == "cuda" or has_target(platform, target))
    jax.clear_caches()
    kernel = np.where(np.random.default_rng(0).random((20, 40)) < 0.5, -1, 1).astype(np.int8)
    masks, threshold = formats.image_kernel_masks(kernel), np.zeros((2, 40), np.int32)
    checks = [jax.export.DisabledSafetyCheck.custom_call(target) for target in TARGETS]
    epilogue = ["tensor<2x40xi32>", "tensor<2x40xui8>"]
    cases = [  # target, layer, the CPU call's masks operands, the epilogue's operands
        ("jaxbnn_image_conv2d_bits", lambda x: ops.image_matmul(x, kernel, threshold=threshold, kernel_masks=masks),
         ["tensor<1x5x3x2xui32>", "tensor<1x40xi32>"], epilogue),
        ("jaxbnn_image_conv2d_i32", lambda x: ops.image_matmul(x, kernel),
         ["tensor<0x5x3x2xui32>", "tensor<0x40xi32>"], []),
        ("jaxbnn_image_conv2d_i16_bits",
         lambda x: ops.image_matmul(x, kernel, threshold=threshold, keep_stream=True, out_dtype=jnp.int16),
         ["tensor<0x5x3x2xui32>", "tensor<0x40xi32>"], epilogue),
    ]
    for target, layer, masks_operands, epilogue_operands in cases:
        for platform in ("cuda", "cpu"):
            module = jax.export.export(jax.jit(layer), platforms=[platform], disabled_checks=checks)(
                jax.ShapeDtypeStruct((3, 20), jnp.uint8)).mlir_module()
            (types,) = re.findall(rf"custom_call @{target}\(.* : \(([^)]*)\) ->", module)
            want = ["tensor<3x1x1x20xui8>", "tensor<1x1x20x40xi8>", *(masks_operands if platform == "cpu" else []),
                    *epilogue_operands]
            assert [t.strip() for t in types.split(",")] == want, (target, platform, types)
    jax.clear_caches()


def test_kernel_masks_are_checked():
    kernel = np.ones((8, 3), np.int8)
    with pytest.raises(ValueError, match="kernels of -1, 0 and \\+1 only"):
        formats.image_kernel_masks(np.full((8, 3), 2, np.int8))
    with pytest.raises(TypeError, match="int8 of shape"):
        formats.image_kernel_masks(np.ones((8, 3), np.float32))
    with pytest.raises(TypeError, match="needs the kernel's values"):
        jax.jit(formats.image_kernel_masks)(kernel)
    with pytest.raises(ValueError, match="kernel_masks are a kernel of K = 8, N = 3; this one has K = 8, N = 4"):
        ops.image_matmul(np.zeros((1, 8), np.int8), np.ones((8, 4), np.int8),
                         kernel_masks=formats.image_kernel_masks(kernel))
    with pytest.raises(TypeError, match="kernel_masks must be formats.ImageKernelMasks"):
        ops.image_matmul(np.zeros((1, 8), np.int8), kernel, kernel_masks=np.zeros((1, 2, 1, 2), np.uint32))


# --- the handlers, called directly --------------------------------------------------------------------


def ffi(target, out_shape, out_dtype, *operands, **attrs):
    """Call a native target directly (bypassing jaxbnn.ops and its Python-side checks)."""
    call = lambda *xs: jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(out_shape, out_dtype))(*xs, **attrs)  # noqa: E731
    return jax.block_until_ready(jax.jit(call)(*operands))


I64 = np.int64
# A valid call: a 1x5x5 image of c=3 channels, a 3x3 kernel of n=9 outputs, stride 1, padding 1.
ATTRS = dict(c=I64(3), n=I64(9), kh=I64(3), kw=I64(3), stride_h=I64(1), stride_w=I64(1), pad_top=I64(1),
             pad_bottom=I64(1), pad_left=I64(1), pad_right=I64(1), pool_h=I64(1), pool_w=I64(1))  # fmt: skip
LEVELS = jnp.asarray(np.random.default_rng(0).integers(-128, 128, (1, 5, 5, 3), dtype=np.int8))
KERNEL = jnp.asarray(np.random.default_rng(1).integers(-128, 128, (3, 3, 3, 9), dtype=np.int8))
THRESHOLD, FLIP = jnp.zeros((2, 9), jnp.int32), jnp.zeros((2, 9), jnp.uint8)
# No kernel masks: the operands of no planes (K = 27 reduction elements in 7 quads, N = 9 in one 16-column word).
NO_MASKS, NO_COUNTS = jnp.zeros((0, 7, 1, 2), jnp.uint32), jnp.zeros((0, 9), jnp.int32)


def i32_call(out=((1, 5, 5, 9), jnp.int32), levels=LEVELS, kernel=KERNEL, masks=NO_MASKS, counts=NO_COUNTS,
             **change):
    return ffi("jaxbnn_image_conv2d_i32", *out, levels, kernel, masks, counts, **{**ATTRS, "shift": I64(0), **change})


def bits_call(out=((1, 5, 5, 2, 1), jnp.uint32), levels=LEVELS, kernel=KERNEL, threshold=THRESHOLD, flip=FLIP,
              masks=NO_MASKS, counts=NO_COUNTS, **change):
    return ffi("jaxbnn_image_conv2d_bits", *out, levels, kernel, masks, counts, threshold, flip, **{**ATTRS, **change})


def test_direct_calls_match_reference_with_thresholds_at_the_int32_extremes(isa):
    """The handler takes any int32 threshold (the op saturates its own): INT32_MIN passes every dot (and with
    flip none), INT32_MAX no dot (and with flip every one)."""
    pre = reference_conv(LEVELS, KERNEL, (1, 1), ((1, 1), (1, 1)), None)
    threshold = np.array([[INT32_MIN] * 4 + [INT32_MAX] * 4 + [0], [INT32_MIN, INT32_MAX] * 4 + [int(pre[0, 2, 2, 8])]],
                         np.int32)  # fmt: skip
    flip = np.array([[0, 1] * 4 + [0], [0, 0, 1, 1] * 2 + [1]], np.uint8)
    got = np.asarray(bits_call(threshold=jnp.asarray(threshold), flip=jnp.asarray(flip)))
    want = reference_conv(LEVELS, KERNEL, (1, 1), ((1, 1), (1, 1)), None, threshold=threshold, flip=flip)
    np.testing.assert_array_equal(got, want)
    assert (got[..., 0, 0] & 0xFF == 0b10100101).all()  # plane 0, columns 7..0
    np.testing.assert_array_equal(np.asarray(i32_call(shift=I64(31))), pre >> 31)


def stream_bits_call(target, stream_out, bits_out=((1, 5, 5, 2, 1), jnp.uint32), shift=I64(0)):
    results = [jax.ShapeDtypeStruct(*stream_out), jax.ShapeDtypeStruct(*bits_out)]
    call = lambda *xs: jax.ffi.ffi_call(target, results)(*xs, **ATTRS, shift=shift)  # noqa: E731
    return jax.block_until_ready(jax.jit(call)(LEVELS, KERNEL, NO_MASKS, NO_COUNTS, THRESHOLD, FLIP))


def test_stream_handlers_check_the_stream_type_and_both_results():
    stream16 = ffi("jaxbnn_image_conv2d_i16", (1, 5, 5, 9), jnp.int16, LEVELS, KERNEL, NO_MASKS, NO_COUNTS, **ATTRS,
                   shift=I64(0))
    assert stream16.dtype == jnp.int16
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_image_conv2d_i16: result must be int16, got int32"):
        ffi("jaxbnn_image_conv2d_i16", (1, 5, 5, 9), jnp.int32, LEVELS, KERNEL, NO_MASKS, NO_COUNTS, **ATTRS,
            shift=I64(0))
    stream, bits = stream_bits_call("jaxbnn_image_conv2d_i16_bits", ((1, 5, 5, 9), jnp.int16))
    assert stream.shape == (1, 5, 5, 9) and bits.shape == (1, 5, 5, 2, 1)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_image_conv2d_i32_bits: result must be int32"):
        stream_bits_call("jaxbnn_image_conv2d_i32_bits", ((1, 5, 5, 9), jnp.int16))
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"jaxbnn_image_conv2d_i16_bits: result has shape \(1, 5, 5, 1\)"):
        stream_bits_call("jaxbnn_image_conv2d_i16_bits", ((1, 5, 5, 9), jnp.int16), ((1, 5, 5, 1), jnp.uint32))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"attribute shift = 32 is out of range"):
        stream_bits_call("jaxbnn_image_conv2d_i32_bits", ((1, 5, 5, 9), jnp.int32), shift=I64(32))


def test_handlers_accept_empty_outputs():
    """No images, or a pool window larger than the conv output: empty results (nothing to compute)."""
    assert i32_call(out=((0, 5, 5, 9), jnp.int32), levels=jnp.zeros((0, 5, 5, 3), jnp.int8)).shape == (0, 5, 5, 9)
    assert bits_call(out=((0, 5, 5, 2, 1), jnp.uint32), levels=jnp.zeros((0, 5, 5, 3), jnp.int8)).shape[0] == 0
    assert i32_call(out=((1, 0, 5, 9), jnp.int32), pool_h=I64(6)).shape == (1, 0, 5, 9)


I32_ERRORS = [
    ("levels float32", dict(levels=jnp.zeros((1, 5, 5, 3), jnp.float32)),
     r"operand `levels` must be int8 levels or uint8 pixels \(B, H, W, C\), got float32"),
    ("levels rank 3", dict(levels=jnp.zeros((5, 5, 3), jnp.int8)), r"operand `levels` must be int8 of rank 4"),
    ("levels channels", dict(levels=jnp.zeros((1, 5, 5, 4), jnp.int8)),
     r"operand `levels` has shape \(1, 5, 5, 4\) but c = 3 requires \(1, 5, 5, 3\)"),
    ("kernel uint8", dict(kernel=jnp.zeros((3, 3, 3, 9), jnp.uint8)), r"operand `kernel` must be int8 of rank 4"),
    ("kernel outputs", dict(kernel=jnp.zeros((3, 3, 3, 8), jnp.int8)),
     r"operand `kernel` has shape \(3, 3, 3, 8\) but kh = 3, kw = 3, c = 3, n = 9 requires \(3, 3, 3, 9\)"),
    ("kernel taps", dict(kernel=jnp.zeros((3, 2, 3, 9), jnp.int8)), r"operand `kernel` has shape \(3, 2, 3, 9\)"),
    ("zero stride", dict(stride_w=I64(0)), r"attribute stride_w = 0 is out of range \[1, 2147483647\]"),
    ("negative padding", dict(pad_bottom=I64(-1)), r"attribute pad_bottom = -1 is out of range"),
    ("padding 2**31", dict(pad_left=I64(2**31)), r"attribute pad_left = 2147483648 is out of range"),
    ("padding int64 max", dict(pad_top=I64(2**63 - 1)), r"attribute pad_top = 9223372036854775807 is out of range"),
    ("zero pool", dict(pool_h=I64(0)), r"attribute pool_h = 0 is out of range"),
    ("zero channels", dict(c=I64(0)), r"attribute c = 0 is out of range"),
    ("zero outputs", dict(n=I64(0)), r"attribute n = 0 is out of range"),
    ("shift 32", dict(shift=I64(32)), r"attribute shift = 32 is out of range \[0, 31\]"),
    ("negative shift", dict(shift=I64(-1)), r"attribute shift = -1 is out of range"),
    ("kernel larger than the image", dict(kh=I64(9)), r"the kernel 9 x 3 is larger than the padded image 7 x 7"),
    ("reduction beyond int32", dict(c=I64(2**20)),
     r"the reduction kh \* kw \* c = 3 \* 3 \* 1048576 exceeds 131071 int8 products"),
    ("kernel beyond int32", dict(kw=I64(2**40)), r"attribute kw = 1099511627776 is out of range"),
    ("padded extent beyond int32", dict(pad_top=I64(2**31 - 1), pad_bottom=I64(2**31 - 1)),
     r"the padded image 4294967299 x 7 has an extent beyond int32"),
    ("masks int32", dict(masks=jnp.zeros((0, 7, 1, 2), jnp.int32)), r"operand `kernel_masks` must be uint32 of rank 4"),
    ("masks 3 planes", dict(masks=jnp.zeros((3, 7, 1, 2), jnp.uint32)),
     r"operand `kernel_masks` of shape \(3, 7, 1, 2\) has 3 planes; 0 \(none\), 1 .* or 2"),
    ("masks quads", dict(masks=jnp.zeros((1, 6, 1, 2), jnp.uint32), counts=jnp.zeros((1, 9), jnp.int32)),
     r"operand `kernel_masks` has shape \(1, 6, 1, 2\) but the kernel's K = 27, N = 9 and 1 planes requires "
     r"\(1, 7, 1, 2\)"),
    ("counts of other planes", dict(masks=jnp.zeros((2, 7, 1, 2), jnp.uint32), counts=jnp.zeros((1, 9), jnp.int32)),
     r"operand `kernel_counts` has shape \(1, 9\) but the kernel's K = 27, N = 9 and 2 planes requires \(2, 9\)"),
    ("counts uint32", dict(counts=jnp.zeros((0, 9), jnp.uint32)), r"operand `kernel_counts` must be int32 of rank 2"),
]


@pytest.mark.parametrize("what,change,message", I32_ERRORS, ids=[e[0] for e in I32_ERRORS])
def test_i32_handler_refuses_bad_operands_and_attributes(what, change, message):
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_image_conv2d_i32: " + message):
        i32_call(**change)


BITS_ERRORS = [
    ("threshold float32", dict(threshold=jnp.zeros((2, 9), jnp.float32)), r"operand `threshold` must be int32"),
    ("threshold rank 1", dict(threshold=jnp.zeros(9, jnp.int32)), r"operand `threshold` must be int32 of rank 2"),
    ("threshold 9 planes", dict(threshold=jnp.zeros((9, 9), jnp.int32)),
     r"operand `threshold` of shape \(9, 9\) has 9 planes; 1 to 8 are supported"),
    ("threshold columns", dict(threshold=jnp.zeros((2, 8), jnp.int32)),
     r"operand `threshold` has shape \(2, 8\) but n = 9"),
    ("flip bool", dict(flip=jnp.zeros((2, 9), bool)), r"operand `flip` must be uint8 .*got bool"),
    ("flip planes", dict(flip=jnp.zeros((1, 9), jnp.uint8)),
     r"operand `flip` has shape \(1, 9\) but operand `threshold` \(2, 9\) requires \(2, 9\)"),
    ("result words", dict(out=((1, 5, 5, 2, 2), jnp.uint32)), r"result has shape \(1, 5, 5, 2, 2\)"),
    ("result planes", dict(out=((1, 5, 5, 1, 1), jnp.uint32)), r"result has shape \(1, 5, 5, 1, 1\)"),
    ("result int32", dict(out=((1, 5, 5, 2, 1), jnp.int32)), r"result must be uint32, got int32"),
]


@pytest.mark.parametrize("what,change,message", BITS_ERRORS, ids=[e[0] for e in BITS_ERRORS])
def test_bits_handler_refuses_bad_epilogue_operands_and_results(what, change, message):
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_image_conv2d_bits: " + message):
        bits_call(**change)


def test_i32_handler_refuses_bad_results():
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_image_conv2d_i32: result has shape \(1, 5, 5, 8\)"):
        i32_call(out=((1, 5, 5, 8), jnp.int32))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"result has shape \(1, 2, 2, 9\)"):
        i32_call(out=((1, 2, 2, 9), jnp.int32), pool_h=I64(2))  # pooled OH = 2 but OW = 5
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"jaxbnn_image_conv2d_i32: result must be int32, got float32"):
        i32_call(out=((1, 5, 5, 9), jnp.float32))


def test_handlers_refuse_wrongly_typed_or_missing_attributes():
    """Decoding errors come from XLA's FFI layer itself: still an error, not a crash."""
    with pytest.raises(jax.errors.JaxRuntimeError, match="expected S64 but got S32"):
        i32_call(shift=np.int32(0))
    with pytest.raises(jax.errors.JaxRuntimeError, match="Wrong number of attributes"):
        ffi("jaxbnn_image_conv2d_i32", (1, 5, 5, 9), jnp.int32, LEVELS, KERNEL, NO_MASKS, NO_COUNTS, **ATTRS)
    with pytest.raises(jax.errors.JaxRuntimeError, match="Wrong number of attributes"):
        bits_call(shift=I64(0))
