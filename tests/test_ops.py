"""The public ops: the reference against plain float math, the native kernels against the reference
(bit for bit, random shapes, odd sizes), transformations, and the error paths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxbnn import _ffi, formats, ops, reference
from numpy_spec import numpy_conv

SETTINGS = settings(max_examples=8, deadline=None)
QUICK = settings(max_examples=6, deadline=None)
TARGETS = [f"jaxbnn_{op}_{kind}" for op in ("bmm", "bconv2d") for kind in ("i32", "f32", "bits")]


def signs(rng, shape):
    return rng.choice(np.array([-1.0, 1.0], np.float32), shape)


def random_epilogue(rng, kind, n, k):
    if kind == "f32":
        return dict(scale=rng.standard_normal(n).astype(np.float32), bias=rng.standard_normal(n).astype(np.float32))
    if kind == "bits":
        return dict(threshold=rng.integers(-k, k + 1, n).astype(np.int32), flip=rng.integers(0, 2, n).astype(bool))
    return {}


def assert_same(got, want, kind):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype
    if kind == "f32":  # float(dot) * scale + bias: one rounding apart at most (fused multiply-add or not)
        np.testing.assert_allclose(got, want, rtol=2e-7, atol=2e-7 * np.abs(want).max())
    else:
        np.testing.assert_array_equal(got, want)


# --- the reference is the definition --------------------------------------------------------------


@QUICK
@given(st.integers(1, 9), st.integers(1, 300), st.integers(1, 20), st.integers(0, 2**31))
def test_reference_bmm_is_the_float_product_of_signs(m, k, n, seed):
    rng = np.random.default_rng(seed)
    a, w = signs(rng, (m, k)), rng.standard_normal((k, n)).astype(np.float32)
    packed = formats.pack_dense_weights(w)
    dot = reference.bmm(ops.pack_bits(a), packed.bits, k, n)
    np.testing.assert_array_equal(dot, a @ np.where(w >= 0, 1.0, -1.0))


@QUICK
@given(
    st.integers(1, 9), st.integers(1, 9), st.integers(1, 70), st.integers(1, 9),
    st.sampled_from([1, 2, 3]), st.sampled_from([1, 2]), st.sampled_from(["zero", "one"]),
    st.integers(0, 2), st.integers(0, 2**31),
)  # fmt: skip
def test_reference_bconv_is_the_float_convolution(h, w, c, o, ksize, stride, pad_value, pad, seed):
    rng = np.random.default_rng(seed)
    x, kernel = signs(rng, (2, h, w, c)), signs(rng, (ksize, ksize, c, o))
    padding = ((pad, ksize - 1 - pad if ksize > pad else 0), (pad, pad))
    if (h + sum(padding[0]) - ksize) < 0 or (w + sum(padding[1]) - ksize) < 0:
        return
    cb = formats.pack_conv_weights(kernel)
    dot = reference.bconv2d(
        ops.pack_bits(x), cb.bits, in_channels=c, out_channels=o, kernel_size=(ksize, ksize),
        stride=(stride, stride), padding=padding, pad_value=pad_value,
    )  # fmt: skip
    np.testing.assert_array_equal(dot, numpy_conv(x, kernel, (stride, stride), padding, pad_value))


def test_the_reference_takes_the_epilogues_the_ops_take():
    """scale or bias alone (the other 1 / +0.0) and a threshold without flip: the spec gives what the op gives."""
    rng = np.random.default_rng(3)
    k, n = 40, 6
    a = ops.pack_bits(signs(rng, (3, k)))
    w = formats.pack_dense_weights(signs(rng, (k, n)))
    x = ops.pack_bits(signs(rng, (1, 4, 4, k)))
    cw = formats.pack_conv_weights(signs(rng, (3, 3, k, n)))
    for epi in (dict(scale=np.full(n, -2.0, np.float32)), dict(bias=np.full(n, 0.5, np.float32)),
                dict(threshold=np.arange(n, dtype=np.int32) - 3)):
        np.testing.assert_array_equal(reference.bmm(a, w.bits, k, n, **epi), ops.bmm(a, w, **epi), err_msg=str(epi))
        spec = reference.bconv2d(x, cw.bits, in_channels=k, out_channels=n, kernel_size=(3, 3), stride=(1, 1),
                                 padding=((1, 1), (1, 1)), pad_value="zero", **epi)
        np.testing.assert_array_equal(spec, ops.bconv2d(x, cw, **epi), err_msg=str(epi))
    levels = rng.integers(-128, 128, (1, 4, 4, 3)).astype(np.int8)
    kernel = rng.choice(np.array([-1, 1], np.int8), (3, 3, 3, 8))
    threshold = rng.integers(-20, 20, (2, 8)).astype(np.int32)
    spec = reference.image_conv2d(jnp.asarray(levels), jnp.asarray(kernel), stride=(1, 1), padding=((1, 1), (1, 1)),
                                  threshold=jnp.asarray(threshold))
    np.testing.assert_array_equal(spec, ops.image_conv2d(levels, kernel, threshold=threshold))
    with pytest.raises(ValueError, match=r"threshold must be \(planes, N\) = \(P, 8\), got shape \(8,\)"):
        reference.image_conv2d(jnp.asarray(levels), jnp.asarray(kernel), stride=(1, 1), padding=((1, 1), (1, 1)),
                               threshold=jnp.asarray(threshold[0]))


def test_reference_pool_then_threshold_is_or_and_by_direction():
    rng = np.random.default_rng(0)
    dot = jnp.asarray(rng.integers(-20, 20, (1, 4, 4, 2)), jnp.int32)
    bits = np.asarray(formats.unpack_bits(reference.epilogue(reference.max_pool(dot, (2, 2)), threshold=jnp.array([3, 3]), flip=jnp.array([False, True])), 2))
    per_pixel = np.stack([np.asarray(dot[..., 0]) >= 3, np.asarray(dot[..., 1]) <= 3], -1)
    windows = per_pixel.reshape(1, 2, 2, 2, 2, 2)
    np.testing.assert_array_equal(bits[..., 0], windows[..., 0].any(axis=(2, 4)))  # gamma > 0: OR
    np.testing.assert_array_equal(bits[..., 1], windows[..., 1].all(axis=(2, 4)))  # gamma < 0: AND


@pytest.mark.parametrize("pool, pad_value", [((2, 2), "zero"), ((3, 2), "one"), ((2, 3), "zero")])
def test_pooled_threshold_bits_are_the_unpooled_bits_pooled(pool, pad_value):
    """What the CUDA path of a pooled threshold convolution computes (an unpooled convolution, then
    pool_threshold_bits) equals the pooled op, flipped columns included; odd sizes drop the last row / column."""
    rng = np.random.default_rng(sum(pool))
    x = formats.pack_bits(signs(rng, (2, 9, 11, 40)) >= 0)
    w = formats.pack_conv_weights(signs(rng, (3, 3, 40, 45)))
    epi = random_epilogue(rng, "bits", 45, 9 * 40)
    epi["threshold"] //= 4  # thresholds near the dots' range, so that windows mix set and clear bits
    pooled = ops.bconv2d(x, w, pool=pool, pad_value=pad_value, **epi)
    unpooled = ops.bconv2d(x, w, pad_value=pad_value, **epi)
    got = ops.pool_threshold_bits(unpooled, pool, formats.pack_bits(jnp.asarray(epi["flip"])))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(pooled))
    assert 0 < np.asarray(formats.unpack_bits(pooled, 45)).mean() < 1


@pytest.mark.parametrize("mode", ["bnn", "tnn"])
def test_flip_words_given_give_the_same_pooled_bits(mode):
    """flip_words (`formats.pack_bits(flip != 0)`, which the runtime keeps for CUDA's pooled threshold convolutions), given
    concrete or traced, leave the bits as they are: one threshold plane, and a ternary output's two."""
    rng = np.random.default_rng(5)
    x = (formats.pack_ternary_pm_planes(rng.integers(-1, 2, (2, 9, 11, 40))) if mode == "tnn"
         else formats.pack_bits(signs(rng, (2, 9, 11, 40)) >= 0))
    w = (formats.pack_ternary_conv_weights(rng.integers(-1, 2, (3, 3, 40, 45)).astype(np.float32)) if mode == "tnn"
         else formats.pack_conv_weights(signs(rng, (3, 3, 40, 45))))
    shape = (2, 45) if mode == "tnn" else (45,)
    threshold, flip = rng.integers(-30, 30, shape).astype(np.int32), rng.random(shape) < 0.5
    want = ops.bconv2d(x, w, pool=(2, 2), threshold=threshold, flip=flip)
    words = formats.pack_bits(flip)
    got = ops.bconv2d(x, w, pool=(2, 2), threshold=threshold, flip=flip, flip_words=words)
    traced = jax.jit(lambda x, words: ops.bconv2d(x, w, pool=(2, 2), threshold=threshold, flip=flip,
                                                  flip_words=words))(x, words)
    for out in (got, traced):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_flip_words_are_checked():
    rng = np.random.default_rng(6)
    x = formats.pack_bits(signs(rng, (2, 6, 6, 40)) >= 0)
    w = formats.pack_conv_weights(signs(rng, (3, 3, 40, 45)))
    threshold, flip = rng.integers(-9, 9, 45).astype(np.int32), rng.random(45) < 0.5
    words = formats.pack_bits(flip)
    block = dict(threshold=threshold, flip=flip)
    with pytest.raises(ValueError, match="pooled threshold convolution with a flip"):
        ops.bconv2d(x, w, flip_words=words, **block)  # no pool
    with pytest.raises(ValueError, match="pooled threshold convolution with a flip"):
        ops.bconv2d(x, w, pool=(2, 2), threshold=threshold, flip_words=words)
    with pytest.raises(ValueError, match=r"flip_words must have shape \(2,\)"):
        ops.bconv2d(x, w, pool=(2, 2), flip_words=jnp.zeros(3, jnp.uint32), **block)
    with pytest.raises(TypeError, match="uint32"):
        ops.bconv2d(x, w, pool=(2, 2), flip_words=np.asarray(words).astype(np.int32), **block)
    with pytest.raises(ValueError, match=r"not formats\.pack_bits\(flip != 0\)"):
        ops.bconv2d(x, w, pool=(2, 2), flip_words=formats.pack_bits(~flip), **block)


def test_pool_threshold_bits_refuses_bad_input():
    bits = jnp.zeros((1, 4, 4, 2), jnp.uint32)
    with pytest.raises(TypeError, match="uint32"):
        ops.pool_threshold_bits(bits.astype(jnp.int32), (2, 2), jnp.zeros(2, jnp.uint32))
    with pytest.raises(ValueError, match=r"flip_words must have shape \(2,\)"):
        ops.pool_threshold_bits(bits, (2, 2), jnp.zeros(3, jnp.uint32))
    with pytest.raises(ValueError, match="larger than"):
        ops.pool_threshold_bits(bits, (5, 1), jnp.zeros(2, jnp.uint32))


def numpy_global_sum_bits(stream, threshold, flip):
    """The pooled bits by plain numpy: int64 sums wrapped to int32, compared, packed LSB first."""
    total = stream.astype(np.int64).sum(axis=(-3, -2))
    total = ((total + 2**31) % 2**32 - 2**31)[..., None, :]  # wraps as int32 arithmetic does
    bits = np.where(flip, total <= threshold, total >= threshold)
    words = -(-bits.shape[-1] // 32)
    padded = np.zeros(bits.shape[:-1] + (32 * words,), bool)
    padded[..., : bits.shape[-1]] = bits
    weights = (np.uint64(1) << np.arange(32, dtype=np.uint64)).astype(np.uint64)
    return (padded.reshape(bits.shape[:-1] + (words, 32)) * weights).sum(-1).astype(np.uint32)


@pytest.mark.parametrize("dtype", [np.int16, np.int32])
@pytest.mark.parametrize("shape, planes", [((3, 7, 7, 70), 1), ((1, 1, 1, 1), 2), ((2, 4, 4, 512), 2),
                                           ((5, 13, 11, 33), 1)])
def test_global_sum_bits_is_the_thresholded_int32_sum(shape, planes, dtype):
    """Each image's int32 sum over its pixels (wrapping, at the int32 stream's extremes), compared with
    every threshold plane, ties (a threshold equal to the sum) and flipped channels included."""
    rng = np.random.default_rng(sum(shape) + planes)
    info = np.iinfo(dtype)
    stream = rng.integers(info.min, info.max, shape, endpoint=True, dtype=dtype)
    total = ((stream.astype(np.int64).sum(axis=(1, 2)) + 2**31) % 2**32 - 2**31).astype(np.int32)
    threshold = np.stack([np.where(rng.random(total.shape[-1]) < 0.5, total[0], total[-1] + rng.integers(-2, 3))
                          for _ in range(planes)]).astype(np.int32)
    flip = rng.integers(0, 2, threshold.shape).astype(bool)
    want = numpy_global_sum_bits(stream, threshold, flip)
    np.testing.assert_array_equal(np.asarray(ops.global_sum_bits(stream, threshold, flip)), want)
    np.testing.assert_array_equal(np.asarray(ops.global_sum_bits(stream, threshold[0], flip[0])), want[:, 0])
    np.testing.assert_array_equal(np.asarray(reference.global_sum_bits(stream, threshold, flip)), want)
    # leading axes fold into the batch, under jit and vmap
    stacked = np.stack([stream, stream[::-1]])
    got = jax.jit(jax.vmap(lambda x: ops.global_sum_bits(x, threshold, flip)))(stacked)
    np.testing.assert_array_equal(np.asarray(got), np.stack([want, want[::-1]]))


def test_global_sum_bits_refuses_bad_input():
    stream = np.zeros((2, 3, 3, 40), np.int16)
    threshold = np.zeros(40, np.int32)
    with pytest.raises(TypeError, match="int16 or int32"):
        ops.global_sum_bits(stream.astype(np.int8), threshold)
    with pytest.raises(ValueError, match=r"\(\.\.\., H, W, C\)"):
        ops.global_sum_bits(stream[0, 0], threshold)
    with pytest.raises(ValueError, match=r"threshold must have shape \(40,\) or \(planes, 40\)"):
        ops.global_sum_bits(stream, threshold[:39])
    with pytest.raises(ValueError, match="1 to 8"):
        ops.global_sum_bits(stream, np.zeros((9, 40), np.int32))
    with pytest.raises(TypeError, match="integer"):
        ops.global_sum_bits(stream, threshold.astype(np.float32))
    with pytest.raises(ValueError, match="within int32"):
        ops.global_sum_bits(stream, threshold.astype(np.int64) + 2**31)
    with pytest.raises(ValueError, match="flip must have the shape of threshold"):
        ops.global_sum_bits(stream, threshold, np.zeros(41, bool))
    assert ops.global_sum_bits(stream[:0], threshold).shape == (0, 2)


def test_global_sum_bits_is_one_custom_call_on_the_cpu_that_refuses_bad_operands():
    """The op lowers to the CPU handler; called directly, the handler refuses operands that do not agree."""
    stream = np.zeros((2, 3, 3, 40), np.int16)
    threshold, flip = np.zeros((1, 40), np.int32), np.zeros((1, 40), np.uint8)
    hlo = jax.jit(ops.global_sum_bits).lower(stream, threshold[0]).as_text()
    assert "jaxbnn_global_sum_bits" in hlo
    result = jax.ShapeDtypeStruct((2, 1, 2), jnp.uint32)
    call = lambda res, *operands: jax.ffi.ffi_call("jaxbnn_global_sum_bits", res)(*operands)  # noqa: E731
    for operands, res, message in [
            ((stream, np.zeros((1, 41), np.int32), flip), result, "threshold"),
            ((stream, threshold, np.zeros((2, 40), np.uint8)), result, "flip"),
            ((stream, threshold, flip), jax.ShapeDtypeStruct((2, 1, 1), jnp.uint32), "result"),
            ((stream.astype(np.int8), threshold, flip), result, "int16 or int32"),
            ((stream, np.zeros((9, 40), np.int32), np.zeros((9, 40), np.uint8)),
             jax.ShapeDtypeStruct((2, 9, 2), jnp.uint32), "1 to 8 planes")]:
        with pytest.raises(Exception, match=message):
            jax.block_until_ready(call(res, *operands))


# --- native kernels against the reference ---------------------------------------------------------


def test_cpu_handlers_are_registered():
    missing = [t for t in TARGETS if not _ffi.has_target("cpu", t)]
    assert not missing, f"CPU handlers missing: {missing}; {_ffi.status()}"


def test_ops_lower_to_the_custom_call_on_cpu():
    a = ops.pack_bits(jnp.ones((4, 64)))
    b = ops.pack_bits(-jnp.ones((8, 64)))
    hlo = jax.jit(lambda a, b: ops.bmm(a, b, 64)).lower(a, b).as_text()
    assert "jaxbnn_bmm_i32" in hlo


@SETTINGS
@given(
    st.integers(1, 70), st.integers(1, 700), st.integers(1, 70),
    st.sampled_from(["i32", "f32", "bits"]), st.booleans(), st.integers(0, 2**31),
)  # fmt: skip
def test_bmm_matches_reference(m, k, n, kind, row_packed_b, seed):
    rng = np.random.default_rng(seed)
    a = ops.pack_bits(signs(rng, (m, k)))
    w = formats.pack_dense_weights(rng.standard_normal((k, n)).astype(np.float32))
    b = formats.from_fsb(w.bits, n, k) if row_packed_b else w.bits
    epi = random_epilogue(rng, kind, n, k)
    got = jax.jit(lambda a, b: ops.bmm(a, b, k, n=n, **epi))(a, b)
    assert_same(got, reference.bmm(a, w.bits, k, n, **epi), kind)


@SETTINGS
@given(
    st.integers(1, 3), st.integers(1, 13), st.integers(1, 13), st.integers(1, 100), st.integers(1, 40),
    st.sampled_from([(1, 1), (3, 3), (5, 5), (3, 1), (7, 7)]), st.sampled_from([1, 2]),
    st.sampled_from(["SAME", "VALID", ((2, 0), (1, 3))]), st.sampled_from(["zero", "one"]),
    st.sampled_from([None, (2, 2), (1, 2)]), st.sampled_from(["i32", "f32", "bits"]), st.integers(0, 2**31),
)  # fmt: skip
def test_bconv2d_matches_reference(b, h, w, c, o, ksize, stride, padding, pad_value, pool, kind, seed):
    rng = np.random.default_rng(seed)
    x = ops.pack_bits(signs(rng, (b, h, w, c)))
    kernel = formats.pack_conv_weights(rng.standard_normal(ksize + (c, o)).astype(np.float32))
    epi = random_epilogue(rng, kind, o, ksize[0] * ksize[1] * c)
    run = lambda x: ops.bconv2d(  # noqa: E731
        x, kernel, stride=stride, padding=padding, pad_value=pad_value, pool=pool, **epi
    )
    try:
        got = jax.jit(run)(x)
    except ValueError as err:  # shapes whose output is empty are refused before lowering
        assert "does not fit" in str(err) or "larger than" in str(err)
        return
    (pt, pb), (pl, pr) = ops._conv_padding(padding, (h, w), ksize, (stride, stride))
    want = reference.bconv2d(
        x, kernel.bits, in_channels=c, out_channels=o, kernel_size=ksize, stride=(stride, stride),
        padding=((pt, pb), (pl, pr)), pad_value=pad_value, pool=pool, **epi,
    )  # fmt: skip
    assert_same(got, want, kind)


def test_bmm_large_k_exact():
    rng = np.random.default_rng(7)
    k = 4096 + 37
    a = signs(rng, (33, k))
    w = rng.standard_normal((k, 65)).astype(np.float32)
    got = jax.jit(lambda a: ops.bmm(a, formats.pack_dense_weights(w)))(ops.pack_bits(a))
    np.testing.assert_array_equal(got, a @ np.where(w >= 0, 1.0, -1.0))


# --- transformations --------------------------------------------------------------------------------


def test_bmm_batch_dims_and_vmap_fold_into_rows():
    rng = np.random.default_rng(1)
    a = ops.pack_bits(signs(rng, (3, 2, 5, 90)))
    w = formats.pack_dense_weights(rng.standard_normal((90, 7)).astype(np.float32))
    want = reference.bmm(a.reshape(-1, 3), w.bits, 90, 7).reshape(3, 2, 5, 7)
    np.testing.assert_array_equal(jax.jit(lambda a: ops.bmm(a, w))(a), want)
    np.testing.assert_array_equal(jax.jit(jax.vmap(jax.vmap(lambda a: ops.bmm(a, w))))(a), want)
    hlo = jax.jit(jax.vmap(lambda a: ops.bmm(a, w))).lower(a[0]).as_text()
    assert hlo.count("jaxbnn_bmm_i32") == 1  # one kernel call for the whole batch


def test_vmap_over_weights_falls_back_to_a_loop():
    rng = np.random.default_rng(2)
    a = ops.pack_bits(signs(rng, (4, 50)))
    ws = [formats.pack_dense_weights(rng.standard_normal((50, 9)).astype(np.float32)) for _ in range(3)]
    bits = jnp.stack([w.bits for w in ws])
    got = jax.jit(jax.vmap(lambda b: ops.bmm(a, b, 50, n=9)))(bits)
    for i, w in enumerate(ws):
        np.testing.assert_array_equal(got[i], reference.bmm(a, w.bits, 50, 9))


@pytest.mark.parametrize("eager", [False, True], ids=["jit", "disable_jit"])
def test_vmap_over_no_weights_or_thresholds_gives_empty_results(eager):
    rng = np.random.default_rng(3)
    a = ops.pack_bits(signs(rng, (4, 70)))
    w = formats.pack_dense_weights(signs(rng, (70, 9)))
    stream = jnp.ones((1, 2, 2, 9), jnp.int16)
    with jax.disable_jit(eager):
        no_thresholds = jax.vmap(lambda t: ops.bmm(a, w, threshold=t))(jnp.zeros((0, 9), jnp.int32))
        no_weights = jax.vmap(lambda b: ops.bmm(a, b, 70, n=9))(jnp.zeros((0,) + w.bits.shape, jnp.uint32))
        no_sums = jax.vmap(lambda t: ops.global_sum_bits(stream, t))(jnp.zeros((0, 9), jnp.int32))
    assert (no_thresholds.shape, no_thresholds.dtype) == ((0, 4, 1), jnp.uint32)
    assert (no_weights.shape, no_weights.dtype) == ((0, 4, 9), jnp.int32)
    assert (no_sums.shape, no_sums.dtype) == ((0, 1, 1), jnp.uint32)


def test_bconv2d_vmap_and_batch_dims():
    rng = np.random.default_rng(3)
    x = ops.pack_bits(signs(rng, (2, 3, 6, 6, 33)))
    kernel = formats.pack_conv_weights(rng.standard_normal((3, 3, 33, 4)).astype(np.float32))
    want = np.stack([np.asarray(ops.bconv2d(x[i], kernel)) for i in range(2)])
    np.testing.assert_array_equal(jax.vmap(lambda x: ops.bconv2d(x, kernel))(x), want)
    np.testing.assert_array_equal(ops.bconv2d(x, kernel), want)


def test_packed_output_feeds_the_next_layer():
    """A threshold epilogue writes exactly the next layer's input layout."""
    rng = np.random.default_rng(4)
    x = signs(rng, (6, 200))
    w1, w2 = rng.standard_normal((200, 70)).astype(np.float32), rng.standard_normal((70, 10)).astype(np.float32)
    thr = rng.integers(-5, 5, 70).astype(np.int32)
    hidden = ops.bmm(ops.pack_bits(x), formats.pack_dense_weights(w1), threshold=thr)
    out = ops.bmm(hidden, formats.pack_dense_weights(w2))
    h = np.where(x @ np.where(w1 >= 0, 1.0, -1.0) >= thr, 1.0, -1.0)
    np.testing.assert_array_equal(out, h @ np.where(w2 >= 0, 1.0, -1.0))



def chain_layers(rng, widths, last_kind):
    """bmm_chain layers of the given widths (k_0, n_0 = k_1, ...), every one but the last writing bits, the last
    `last_kind` ("bits" or "f32"); weights given as DenseBits, FSB tiles and row-packed matrices in turn."""
    layers = []
    for i, (k, n) in enumerate(zip(widths[:-1], widths[1:])):
        dense = formats.pack_dense_weights(signs(rng, (k, n)))
        b = [dict(b=dense), dict(b=dense.bits, k=k, n=n), dict(b=formats.from_fsb(dense.bits, n, k), k=k)][i % 3]
        kind = last_kind if i == len(widths) - 2 else "bits"
        layers.append(dict(b, **random_epilogue(rng, kind, n, max(1, int(np.sqrt(k))))))
    return layers


def layer_by_layer(x, layers):
    for layer in layers:
        x = ops.bmm(x, **layer)
    return x


@pytest.mark.parametrize("widths", [(77, 45, 300, 10), (512, 512, 512, 10), (33, 1), (1, 64, 1, 95), (4096, 100, 4096)])
@pytest.mark.parametrize("last_kind", ["bits", "f32"])
def test_bmm_chain_is_bmm_layer_after_layer(widths, last_kind):
    rng = np.random.default_rng(len(widths) * 1000 + widths[0] + (last_kind == "f32"))
    layers = chain_layers(rng, widths, last_kind)
    x = ops.pack_bits(signs(rng, (37, widths[0])))
    want = layer_by_layer(x, layers)
    got = ops.bmm_chain(x, layers)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    spec = reference.bmm_chain(x, [(formats.to_fsb(layer["b"]) if np.ndim(layer["b"]) == 2 else getattr(
        layer["b"], "bits", layer["b"]), k, n, {e: layer[e] for e in ("threshold", "flip", "scale", "bias") if e in layer})
        for layer, k, n in zip(layers, widths[:-1], widths[1:])])
    assert_same(got, spec, last_kind)


def test_bmm_chain_batch_dims_jit_and_vmap():
    rng = np.random.default_rng(9)
    layers = chain_layers(rng, (200, 70, 10), "f32")
    x = ops.pack_bits(signs(rng, (2, 3, 200)))
    want = layer_by_layer(x.reshape(6, -1), layers).reshape(2, 3, 10)
    np.testing.assert_array_equal(np.asarray(ops.bmm_chain(x, layers)), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: ops.bmm_chain(a, layers))(x)), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(jax.vmap(lambda a: ops.bmm_chain(a, layers))(x)), np.asarray(want))
    assert ops.bmm_chain(x[:, :0], layers).shape == (2, 0, 10)


def test_bmm_chain_rejects_bad_chains_before_lowering():
    rng = np.random.default_rng(5)
    first, second, last = chain_layers(rng, (64, 40, 30, 10), "f32")
    x = ops.pack_bits(signs(rng, (4, 64)))
    with pytest.raises(ValueError, match="non-empty list"):
        ops.bmm_chain(x, [])
    with pytest.raises(ValueError, match="non-empty list"):
        ops.bmm_chain(x, first)
    with pytest.raises(TypeError, match="dict"):
        ops.bmm_chain(x, [first, (second["b"],)])
    with pytest.raises(ValueError, match="layer 1 reduces over k=64 bits, but layer 0 writes n=40"):
        ops.bmm_chain(x, [first, first])
    with pytest.raises(ValueError, match="layer 0 must give a threshold of shape \\(40,\\) \\(its bits"):
        ops.bmm_chain(x, [dict(b=first["b"]), second])
    with pytest.raises(ValueError, match="layer 1 must give a threshold of shape \\(30,\\) or scale"):
        ops.bmm_chain(x, [first, dict(second, threshold=None, flip=None)])
    with pytest.raises(ValueError, match="layer 1 must give a threshold of shape \\(30,\\) \\(its bits"):
        ops.bmm_chain(x, [first, dict(second, threshold=None, flip=None, scale=np.ones(30, np.float32)), last])
    with pytest.raises(ValueError, match="arguments \\['out_dtype'\\]"):
        ops.bmm_chain(x, [dict(first, out_dtype=jnp.int16)])
    with pytest.raises(ValueError, match="no weights"):
        ops.bmm_chain(x, [{"threshold": first["threshold"]}])
    with pytest.raises(TypeError, match="ternary weights"):
        ternary = formats.pack_ternary_dense_weights(rng.integers(-1, 2, (64, 40)).astype(np.float32))
        ops.bmm_chain(x, [dict(first, b=ternary)])
    with pytest.raises(TypeError, match="binary activations"):
        ops.bmm_chain(formats.TernaryPlanes(x, x), [first])
    with pytest.raises(ValueError, match="words"):
        ops.bmm_chain(x[:, :1], [first])


# --- errors ---------------------------------------------------------------------------------------


def test_bmm_rejects_bad_arguments_before_lowering():
    a = jnp.zeros((4, 2), jnp.uint32)
    b = jnp.zeros((3, 2), jnp.uint32)
    with pytest.raises(TypeError, match="uint32"):
        ops.bmm(a.astype(jnp.int32), b, 64)
    with pytest.raises(ValueError, match="words"):
        ops.bmm(a, b, 100)
    with pytest.raises(ValueError, match="positive integer"):
        ops.bmm(a, b, 0)
    with pytest.raises(ValueError, match="shape \\(3,\\)"):
        ops.bmm(a, b, 64, threshold=jnp.zeros(4, jnp.int32))
    with pytest.raises(TypeError, match="integer"):
        ops.bmm(a, b, 64, threshold=jnp.zeros(3, jnp.float32))
    with pytest.raises(ValueError, match="not both"):
        ops.bmm(a, b, 64, threshold=jnp.zeros(3, jnp.int32), scale=jnp.ones(3))
    with pytest.raises(ValueError, match="flip only"):
        ops.bmm(a, b, 64, flip=jnp.zeros(3, bool))
    for flip in (np.array(["1", "0", "1"]), np.zeros(3, complex)):
        with pytest.raises(TypeError, match="flip must hold bools or numbers"):
            ops.bmm(a, b, 64, threshold=jnp.zeros(3, jnp.int32), flip=flip)
        with pytest.raises(TypeError, match="flip must hold bools or numbers"):
            ops.pack_bits(np.zeros((2, 3)), threshold=0, flip=flip)
    with pytest.raises(ValueError, match="rows"):
        ops.bmm(a, formats.to_fsb(b), 64, n=20)
    with pytest.raises(ValueError, match="tile columns"):
        ops.bmm(jnp.zeros((4, 5), jnp.uint32), formats.to_fsb(b), 160)


def test_sizes_given_beside_the_weights_dataclass_must_be_its_own():
    """Another k would read the weights' padding bits as weights, or drop real ones; another kernel size or
    channel count of the same word and tap count would read the taps wrongly: refused, naming both."""
    rng = np.random.default_rng(0)
    dense = formats.pack_dense_weights(signs(rng, (33, 4)))
    x = formats.pack_bits(signs(rng, (2, 33)) > 0)
    np.testing.assert_array_equal(np.asarray(ops.bmm(x, dense, k=33, n=4)), np.asarray(ops.bmm(x, dense)))
    with pytest.raises(ValueError, match="k=40 differs from the DenseBits's k 33"):
        ops.bmm(x, dense, k=40)
    with pytest.raises(ValueError, match="n=3 differs from the DenseBits's n 4"):
        ops.bmm(x, dense, n=3)
    with pytest.raises(ValueError, match="bmm_chain layer 0: k=32 differs"):
        ops.bmm_chain(x, [dict(b=dense, k=32, threshold=np.zeros(4, np.int32))])
    ternary = formats.pack_ternary_dense_weights(rng.integers(-1, 2, (33, 4)))
    with pytest.raises(ValueError, match="k=34 differs from the TernaryDenseBits's k 33"):
        ops.bmm(x, ternary, k=34)
    conv = formats.pack_conv_weights(signs(rng, (3, 3, 8, 4)))
    images = formats.pack_bits(signs(rng, (1, 5, 5, 20)) > 0)
    with pytest.raises(ValueError, match=r"kernel_size=\(1, 9\) differs from the ConvBits's kernel_size \(3, 3\)"):
        ops.bconv2d(images, conv, kernel_size=(1, 9), padding="VALID")
    with pytest.raises(ValueError, match="in_channels=20 differs from the ConvBits's in_channels 8"):
        ops.bconv2d(images, conv, in_channels=20, padding="VALID")
    with pytest.raises(ValueError, match="out_channels=5 differs"):
        ops.bconv2d(images[..., :1], conv, out_channels=5, padding="VALID")


def test_unpack_bits_gives_plus_and_minus_one_in_types_that_hold_them():
    words = ops.pack_bits(np.array([[1.0, -1.0, 0.0, -3.0]]))
    for dtype in (jnp.int8, jnp.int32, jnp.bfloat16, jnp.float32):
        values = ops.unpack_bits(words, 4, dtype=dtype)
        assert values.dtype == dtype
        np.testing.assert_array_equal(np.asarray(values, np.float32), [[1, -1, 1, -1]])
    for dtype in (jnp.uint8, jnp.uint32, bool):
        with pytest.raises(TypeError, match="signed integer or float type"):
            ops.unpack_bits(words, 4, dtype=dtype)


def test_vmap_over_images_with_an_empty_axis_gives_what_the_unmapped_op_gives():
    """The batching rule folds the mapped axis into the rows with explicit sizes: a -1 cannot be resolved
    where another axis is empty."""
    stream = jnp.zeros((2, 1, 0, 3, 3), jnp.int32)
    threshold = np.zeros(3, np.int32)
    mapped = jax.vmap(lambda s: ops.global_sum_bits(s, threshold))(stream)
    np.testing.assert_array_equal(np.asarray(mapped), np.asarray(ops.global_sum_bits(stream, threshold)))
    x = jnp.zeros((2, 1, 0, 5, 1), jnp.uint32)
    w = formats.pack_conv_weights(jnp.ones((3, 3, 8, 4)))
    conv = jax.vmap(lambda images: ops.bconv2d(images, w, padding=((1, 2), (1, 1))))(x)  # padded to 3 x 7
    np.testing.assert_array_equal(np.asarray(conv), np.asarray(ops.bconv2d(x[0], w, padding=((1, 2), (1, 1))))[None]
                                  .repeat(2, axis=0))


def test_the_references_affine_epilogue_rounds_the_product_before_the_sum_eager_and_compiled(xla_optimizations):
    """As the kernels do: XLA would otherwise contract `scale * dot + bias` into one FMA when it compiles the
    reference, 1 ulp off on many elements (scale and bias as arguments, or constants it folds)."""
    rng = np.random.default_rng(0)
    dot = jnp.asarray(rng.integers(-400, 400, (8, 64)), jnp.int32)
    scale, bias = (rng.standard_normal(64).astype(np.float32) for _ in range(2))
    scale[:2] = [np.nan, np.inf]
    with np.errstate(invalid="ignore"):
        two_roundings = np.asarray(dot).astype(np.float32) * scale + bias
    for got in (reference.epilogue(dot, scale, bias), jax.jit(lambda *a: reference.epilogue(*a))(dot, scale, bias),
                jax.jit(lambda d: reference.epilogue(d, scale, bias))(dot)):
        np.testing.assert_array_equal(np.asarray(got), two_roundings)


def test_bconv2d_rejects_bad_arguments_before_lowering():
    x = jnp.zeros((1, 5, 5, 1), jnp.uint32)
    w = formats.pack_conv_weights(jnp.ones((3, 3, 20, 4)))
    with pytest.raises(ValueError, match="in_channels"):
        ops.bconv2d(x, w.bits, kernel_size=3)
    with pytest.raises(ValueError, match="pad_value"):
        ops.bconv2d(x, w, pad_value="two")
    with pytest.raises(ValueError, match="padding"):
        ops.bconv2d(x, w, padding="FULL")
    with pytest.raises(ValueError, match="does not fit"):
        ops.bconv2d(jnp.zeros((1, 2, 2, 1), jnp.uint32), w, padding="VALID")
    with pytest.raises(ValueError, match="larger than"):
        ops.bconv2d(x, w, pool=(6, 6))
    with pytest.raises(ValueError, match="words"):
        ops.bconv2d(jnp.zeros((1, 5, 5, 2), jnp.uint32), w)
    with pytest.raises(ValueError, match="w_tap_popcount"):
        ops.bconv2d(x, w.bits, in_channels=20, kernel_size=3, out_channels=4, w_tap_popcount=jnp.zeros((9, 3), jnp.int32))


@pytest.mark.parametrize("mode", ["bnn", "tbn", "btn", "tnn"])
def test_int16_dot_products_are_the_int32_ones(mode):
    """out_dtype=int16: the same integers as the int32 result, in every mode, eager and under jit, for a
    convolution (odd sizes, "one" padding, pooled) and a matrix product, including products of +-K."""
    rng = np.random.default_rng(7)
    ternary_x, ternary_w = mode in ("tbn", "tnn"), mode in ("btn", "tnn")

    def activations(shape):
        if ternary_x:
            return formats.pack_ternary_pm_planes(rng.integers(-1, 2, shape))
        return formats.pack_bits(signs(rng, shape) >= 0)

    def weights(shape, pack):
        return pack(rng.integers(-1, 2, shape).astype(np.float32)) if ternary_w else pack(signs(rng, shape))

    conv_w = weights((3, 3, 45, 37), formats.pack_ternary_conv_weights if ternary_w else formats.pack_conv_weights)
    x = activations((2, 7, 9, 45))
    for kwargs in (dict(pad_value="one"), dict(pool=(2, 2))):
        want = ops.bconv2d(x, conv_w, **kwargs)
        got = ops.bconv2d(x, conv_w, out_dtype=jnp.int16, **kwargs)
        assert got.dtype == jnp.int16 and want.dtype == jnp.int32
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(jax.jit(lambda x: ops.bconv2d(x, conv_w, out_dtype="int16", **kwargs))(x), want)
    dense_w = weights((300, 21), formats.pack_ternary_dense_weights if ternary_w else formats.pack_dense_weights)
    a = activations((5, 300))
    np.testing.assert_array_equal(ops.bmm(a, dense_w, out_dtype=np.int16), ops.bmm(a, dense_w))
    if mode == "bnn":  # the extremes: a row equal to a weight column and one opposite to it
        rows = np.stack([signs(rng, 300)] * 2)
        column = formats.pack_dense_weights(rows[0][:, None])
        packed = formats.pack_bits(np.stack([rows[0] >= 0, rows[0] < 0]))
        np.testing.assert_array_equal(ops.bmm(packed, column, out_dtype=jnp.int16), [[300], [-300]])


def test_int16_dot_products_refuse_what_does_not_fit_them():
    x = jnp.zeros((1, 5, 5, 128), jnp.uint32)  # 4096 channels
    w = formats.pack_conv_weights(jnp.ones((3, 3, 4096, 4)))
    with pytest.raises(ValueError, match="at most 32767 products; this one reduces over 36864"):
        ops.bconv2d(x, w, out_dtype=jnp.int16)
    a, b = jnp.zeros((2, 1), jnp.uint32), formats.pack_dense_weights(jnp.ones((32, 3)))
    with pytest.raises(ValueError, match="not with a threshold"):
        ops.bmm(a, b, out_dtype=jnp.int16, threshold=jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="not with a threshold"):
        ops.bmm(a, b, out_dtype=jnp.int16, scale=jnp.ones(3))
    with pytest.raises(TypeError, match="int32 or int16"):
        ops.bmm(a, b, out_dtype=jnp.int8)
    with pytest.raises(TypeError, match="int32 or int16"):
        ops.bmm(a, b, out_dtype=jnp.float32)
    with pytest.raises(TypeError, match="int32 or int16"):
        ops.bmm(a, b, out_dtype="half an int")
    small = formats.pack_conv_weights(jnp.ones((3, 3, 32, 4)))
    x = jnp.zeros((1, 5, 5, 1), jnp.uint32)
    with pytest.raises(ValueError, match="the shortcut's type"):
        ops.bconv2d(x, small, shortcut=jnp.zeros((1, 5, 5, 4), jnp.int32), out_dtype=jnp.int16)


# --- sizes and values beyond the kernels' range --------------------------------------------------------


HUGE_CONV_ARGUMENTS = [
    (dict(padding=((2**31,) * 2,) * 2), r"padding must hold integers in \[0, 2147483647\]"),
    (dict(padding=((2**62,) * 2,) * 2), r"padding must hold integers in \[0, 2147483647\]"),
    (dict(padding=((-1, 0), (0, 0))), r"padding must hold integers .*non-negative"),
    (dict(padding=((1.5, 0), (0, 0))), r"padding must hold integers"),
    (dict(padding=((2**31 - 1, 2**31 - 1), (0, 0))), r"padding .* makes the padded height 4294967298"),
    (dict(padding=((2**30 - 8,) * 2,) * 2), r"the result would have shape .* elements"),
    (dict(stride=2**31), r"stride must be a positive integer of at most 2147483647"),
    (dict(stride=(1, -2)), r"stride must be a positive integer"),
    (dict(pool=(2**40, 1)), r"pool must be a positive integer of at most"),
    (dict(kernel_size=2**31), r"kernel_size must be a positive integer of at most"),
    (dict(kernel_size=(2**16, 2**16)), r"kernel_size 65536x65536 over in_channels=1 makes"),
]


@pytest.mark.parametrize("change,message", HUGE_CONV_ARGUMENTS, ids=[str(c) for c, _ in HUGE_CONV_ARGUMENTS])
def test_bconv2d_refuses_sizes_beyond_int32_before_lowering(change, message):
    """Sizes whose products overflow XLA's shape arithmetic (an abort inside XLA) or the kernels' int32
    attributes are refused by the Python front with the argument's name."""
    x = jnp.zeros((1, 4, 4, 1), jnp.uint32)
    w = jnp.zeros((1, 1, 8, 4), jnp.uint32)  # FSB tiles of a 1x1 kernel over 1 channel, 1 output
    args = {"in_channels": 1, "kernel_size": 1, "out_channels": 1, **change}
    with pytest.raises(ValueError, match=message):
        ops.bconv2d(x, w, **args)
    with pytest.raises(ValueError, match=message):
        jax.jit(lambda x: ops.bconv2d(x, w, **args))(x)


def test_bmm_refuses_sizes_beyond_int32_and_abstract_giants():
    with pytest.raises(ValueError, match=r"k must be a positive integer of at most 2147483646"):
        ops.bmm(jnp.zeros((1, 1), jnp.uint32), jnp.zeros((1, 1), jnp.uint32), 2**31)
    giant = jax.ShapeDtypeStruct((2**40, 2**20, 1), jnp.uint32)  # never allocated: refused while tracing
    with pytest.raises(ValueError, match=r"the result would have shape \(1099511627776, 1048576, 3\)"):
        jax.jit(lambda a: ops.bmm(a, jnp.zeros((3, 1), jnp.uint32), 32)).lower(giant)


def test_thresholds_of_any_integer_width_saturate_exactly():
    """All dot products are 64 (k = 64, equal rows); a threshold of 2**32 + 10 must set no bit (int64
    wrapped to 10 would set all), -2**40 every bit, whether given on the host or as a device array."""
    a = ops.pack_bits(jnp.ones((2, 64)))
    b = ops.pack_bits(jnp.ones((40, 64)))
    for threshold, flip, want in [(2**32 + 10, False, 0), (-(2**40), False, 1), (2**32 + 10, True, 1),
                                  (-(2**40), True, 0), (2**63 - 1, False, 0), (2**70, False, 0)]:
        host = np.full(40, threshold, np.int64 if abs(threshold) < 2**63 else object)
        bits = ops.unpack_bits(ops.bmm(a, b, 64, threshold=host, flip=np.full(40, flip)), 40)
        np.testing.assert_array_equal(np.asarray(bits), 2 * want - 1)
    device = jnp.full(40, 3_000_000_000, jnp.uint32)  # above int32: an astype would wrap it negative
    np.testing.assert_array_equal(np.asarray(ops.bmm(a, b, 64, threshold=device)), 0)
    conv = ops.bconv2d(jnp.zeros((1, 3, 3, 1), jnp.uint32), formats.pack_conv_weights(-jnp.ones((3, 3, 5, 7))),
                       threshold=np.full(7, 2**40 + 1, np.int64))
    np.testing.assert_array_equal(np.asarray(conv), 0)


def numpy_threshold_bits(dots, threshold, flip):
    """Packed uint32 words (LSB first) of `dot >= threshold`, `dot <= threshold` where flip != 0."""
    bits = np.where(np.asarray(flip) != 0, dots <= threshold, dots >= threshold)
    n = bits.shape[-1]
    bits = np.pad(bits, [(0, 0)] * (bits.ndim - 1) + [(0, -n % 32)]).reshape(bits.shape[:-1] + (-1, 32))
    return (bits.astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)


def test_device_int32_thresholds_and_uint8_flips_reach_the_kernels_as_they_are():
    """Device int32 thresholds far outside [-K - 1, K + 1] (the int32 extremes) and uint8 flips of any nonzero
    value: read exactly, with no clamp or conversion pass in the compiled op."""
    rng = np.random.default_rng(17)
    m, k, n = 6, 100, 40
    a_signs, w_signs = rng.choice([-1.0, 1.0], (m, k)), rng.choice([-1.0, 1.0], (n, k))
    dots = (a_signs @ w_signs.T).astype(np.int64)
    threshold = rng.choice(np.concatenate([dots.ravel()[:20], [-2**31, 2**31 - 1, -k - 5, k + 5]]), n).astype(np.int32)
    flip = rng.choice(np.array([0, 1, 2, 255], np.uint8), n)
    a, rows = ops.pack_bits(a_signs), ops.pack_bits(w_signs)
    w = formats.to_fsb(rows)
    popcount = formats.popcount(rows)
    bmm = jax.jit(lambda a, w, p, t, f: ops.bmm(a, w, k, n=n, b_popcount=p, threshold=t, flip=f))
    t_dev, f_dev = jnp.asarray(threshold), jnp.asarray(flip)
    args = (a, w, popcount, t_dev, f_dev)
    np.testing.assert_array_equal(np.asarray(bmm(*args)), numpy_threshold_bits(dots, threshold, flip))
    if jax.default_backend() == "cpu" and _ffi.has_target("cpu", "jaxbnn_bmm_bits"):
        assert "fusion" not in bmm.lower(*args).compile().as_text()

    x_signs, c_signs = rng.choice([-1.0, 1.0], (2, 6, 6, 40)), rng.choice([-1.0, 1.0], (3, 3, 40, n))
    conv_dots = numpy_conv(x_signs, c_signs, (1, 1), ((1, 1), (1, 1)), "zero").astype(np.int64)
    conv_dots = conv_dots.reshape(2, 3, 2, 3, 2, n).max(axis=(2, 4))
    conv = ops.bconv2d(ops.pack_bits(x_signs), formats.pack_conv_weights(c_signs), pool=(2, 2), threshold=t_dev,
                       flip=f_dev)
    np.testing.assert_array_equal(np.asarray(conv), numpy_threshold_bits(conv_dots, threshold, flip))

    levels, kernel = int8_values(rng, (2, 5, 5, 3)), rng.integers(-128, 128, (3, 3, 3, n)).astype(np.int8)
    image = ops.image_conv2d(levels, kernel, threshold=t_dev, flip=f_dev)
    want = numpy_image_layer(levels, kernel, (1, 1), ((1, 1), (1, 1)), threshold=threshold[None], flip=flip[None] != 0)
    np.testing.assert_array_equal(np.asarray(image), want[..., 0, :])


def test_pack_bits_compares_64_bit_values_without_wrapping():
    x = np.array([[2**32 + 5, 2**40, -(2**33), 7]], np.int64)
    np.testing.assert_array_equal(np.asarray(ops.unpack_bits(ops.pack_bits(x, threshold=2**32 + 10), 4)),
                                  [[-1, 1, -1, -1]])
    np.testing.assert_array_equal(np.asarray(ops.unpack_bits(ops.pack_bits(x, threshold=np.int64(-(2**32))), 4)),
                                  [[1, 1, -1, 1]])
    small = jnp.asarray([[5, -5, 0]], jnp.int32)  # device int32 data, host int64 thresholds beyond its range
    np.testing.assert_array_equal(np.asarray(ops.unpack_bits(ops.pack_bits(small, threshold=2**33), 3)),
                                  [[-1, -1, -1]])
    np.testing.assert_array_equal(
        np.asarray(ops.unpack_bits(ops.pack_bits(small, threshold=-(2**33), flip=True), 3)), [[-1, -1, -1]])
    tiny = np.array([[-1e-50, 1e-50]])  # float64 on the host: not rounded to float32 (-0.0) first
    np.testing.assert_array_equal(np.asarray(ops.unpack_bits(ops.pack_bits(tiny), 2)), [[-1, 1]])


def test_a_concrete_popcount_that_does_not_match_the_weights_is_refused():
    rng = np.random.default_rng(0)
    w = formats.pack_dense_weights(rng.standard_normal((70, 9)).astype(np.float32))
    a = ops.pack_bits(signs(rng, (3, 70)))
    with pytest.raises(ValueError, match=r"b_popcount does not count the \+1 bits of the weights: at \(0,\)"):
        ops.bmm(a, w.bits, 70, n=9, b_popcount=w.popcount.at[0].add(1))
    ops.bmm(a, w.bits, 70, n=9, b_popcount=w.popcount)  # the right one is taken
    conv = formats.pack_conv_weights(rng.standard_normal((3, 3, 40, 5)).astype(np.float32))
    x = ops.pack_bits(signs(rng, (1, 6, 6, 40)))
    wrong = conv.tap_popcount.at[4, 2].set(0)
    with pytest.raises(ValueError, match=r"w_tap_popcount does not count .* at \(4, 2\)"):
        ops.bconv2d(x, conv.bits, in_channels=40, kernel_size=3, out_channels=5, w_tap_popcount=wrong)


def test_ternary_weights_with_a_pos_bit_without_its_nonneg_bit_are_refused():
    """No packer writes such a pair; concrete weights holding one are refused (also closed over by a jitted
    function), traced ones trusted; bits past the real ones (padding) are not weights."""
    rng = np.random.default_rng(9)
    k, n = 70, 3
    w = formats.pack_ternary_dense_weights(rng.integers(-1, 2, (k, n)).astype(np.float32))
    rows = np.asarray(formats.from_fsb(w.bits, 2 * n, k)).copy()
    padded = rows.copy()
    padded[n + 1, -1] |= np.uint32(1 << 31)  # bit 95 of a 70-bit row: padding
    rows[1, 0] &= ~np.uint32(1)
    rows[n + 1, 0] |= np.uint32(1)  # output 1, bit 0: pos without nonneg
    a = ops.pack_bits(signs(rng, (2, k)))

    def ternary(matrix):
        matrix = jnp.asarray(matrix)
        return formats.TernaryDenseBits(formats.to_fsb(matrix), formats.popcount(matrix), k=k, n=n)

    message = r"b: ternary weights of output 1 set a pos bit without its nonneg bit"
    invalid = ternary(rows)
    with pytest.raises(ValueError, match=message):
        ops.bmm(a, invalid)
    with pytest.raises(ValueError, match=message):
        jax.jit(lambda a: ops.bmm(a, invalid))(a)
    jax.jit(lambda a, w: ops.bmm(a, w))(a, invalid)  # traced: trusted
    ops.bmm(a, ternary(padded))
    conv = formats.pack_ternary_conv_weights(rng.integers(-1, 2, (3, 3, 40, 4)).astype(np.float32))
    matrix = np.asarray(formats.from_fsb(conv.bits, 8, 9 * 64)).copy()
    matrix[2, 5] &= ~np.uint32(4)
    matrix[4 + 2, 5] |= np.uint32(4)  # output 2, tap 2, channel 34
    bad = formats.TernaryConvBits(formats.to_fsb(jnp.asarray(matrix)), conv.tap_popcount, kernel_size=(3, 3),
                                  in_channels=40, out_channels=4)
    x = formats.pack_bits(signs(rng, (1, 5, 5, 40)) >= 0)
    with pytest.raises(ValueError, match=r"w: ternary weights of output 2 set a pos bit without its nonneg bit"):
        ops.bconv2d(x, bad)


def test_concrete_popcounts_and_flip_words_are_checked_under_jit_too():
    """Concrete popcounts and flip words closed over by a jitted function: checked as in an eager call (the
    check computes, it does not stage), the right ones taken, wrong ones refused."""
    rng = np.random.default_rng(1)
    w = formats.pack_dense_weights(rng.standard_normal((70, 9)).astype(np.float32))
    a = ops.pack_bits(signs(rng, (3, 70)))
    for popcount in (np.asarray(w.popcount), w.popcount):
        got = jax.jit(lambda a: ops.bmm(a, w.bits, 70, n=9, b_popcount=popcount))(a)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ops.bmm(a, w)))
    with pytest.raises(ValueError, match=r"b_popcount does not count the \+1 bits"):
        jax.jit(lambda a: ops.bmm(a, w.bits, 70, n=9, b_popcount=np.asarray(w.popcount) + 1))(a)
    with pytest.raises(ValueError, match=r"b_popcount does not count the \+1 bits"):
        jax.jit(lambda a: ops.bmm_chain(a, [dict(b=w.bits, k=70, n=9, b_popcount=np.asarray(w.popcount) + 1,
                                                 scale=np.ones(9, np.float32), bias=np.zeros(9, np.float32))]))(a)
    conv = formats.pack_conv_weights(signs(rng, (3, 3, 40, 45)))
    x = formats.pack_bits(signs(rng, (2, 6, 6, 40)) >= 0)
    threshold, flip = rng.integers(-9, 9, 45).astype(np.int32), rng.random(45) < 0.5
    tap, words, wrong = (np.asarray(v) for v in (conv.tap_popcount, formats.pack_bits(flip), formats.pack_bits(~flip)))
    pooled = dict(pool=(2, 2), threshold=threshold, flip=flip)
    got = jax.jit(lambda x: ops.bconv2d(x, conv.bits, in_channels=40, kernel_size=3, out_channels=45,
                                        w_tap_popcount=tap, flip_words=words, **pooled))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ops.bconv2d(x, conv, **pooled)))
    with pytest.raises(ValueError, match=r"not formats\.pack_bits\(flip != 0\)"):
        jax.jit(lambda x: ops.bconv2d(x, conv, flip_words=wrong, **pooled))(x)


def test_row_packed_bmm_with_no_rows_and_empty_batches_give_empty_results():
    a = jnp.zeros((4, 2), jnp.uint32)
    assert ops.bmm(a, jnp.zeros((0, 2), jnp.uint32), 64).shape == (4, 0)
    assert ops.bmm(a, jnp.zeros((0, 2), jnp.uint32), 64, threshold=np.zeros(0, np.int32)).shape == (4, 0)
    assert jax.jit(lambda a: ops.bmm(a, jnp.zeros((0, 2), jnp.uint32), 64))(a).shape == (4, 0)
    assert ops.bmm(jnp.zeros((0, 3, 2), jnp.uint32), jnp.zeros((5, 2), jnp.uint32), 64).shape == (0, 3, 5)
    w = formats.pack_conv_weights(jnp.ones((3, 3, 20, 4)))
    assert ops.bconv2d(jnp.zeros((0, 5, 5, 1), jnp.uint32), w).shape == (0, 5, 5, 4)
    assert ops.bconv2d(jnp.zeros((2, 0, 5, 5, 1), jnp.uint32), w).shape == (2, 0, 5, 5, 4)


def test_a_wrong_dtype_is_reported_as_given():
    with pytest.raises(TypeError, match="got dtype int64"):
        ops.bmm(np.zeros((4, 2), np.int64), jnp.zeros((3, 2), jnp.uint32), 64)


# --- the reference is exact on every platform ------------------------------------------------------------


def test_reference_bconv2d_is_integer_arithmetic():
    """A float convolution is exact only where the backend's algorithm happens to be; the reference must be
    exact everywhere, so it contains no float convolution or float dot product at all."""
    x = jnp.zeros((1, 9, 9, 2), jnp.uint32)
    w = formats.pack_conv_weights(jnp.ones((9, 9, 40, 3))).bits
    jaxpr = jax.make_jaxpr(lambda x, w: reference.bconv2d(
        x, w, in_channels=40, out_channels=3, kernel_size=(9, 9), stride=(1, 1), padding=((4, 4), (4, 4)),
        pad_value="zero", pool=(2, 2)))(x, w)  # fmt: skip
    eqns = [e for e in jaxpr.jaxpr.eqns]
    assert not [e for e in eqns if e.primitive.name == "conv_general_dilated"]
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == jnp.int32 for e in dots for v in (*e.invars, *e.outvars))


@QUICK
@given(
    st.integers(1, 2), st.integers(1, 12), st.integers(1, 12), st.integers(1, 70), st.integers(1, 20),
    st.sampled_from([(1, 1), (3, 3), (9, 9), (3, 5)]), st.sampled_from([(1, 1), (2, 1), (3, 2)]),
    st.sampled_from(["SAME", ((4, 4), (4, 4)), ((0, 0), (3, 3)), ((2, 0), (1, 3))]),
    st.sampled_from(["zero", "one"]), st.sampled_from([None, (2, 2), (1, 3)]), st.integers(0, 2**31),
)  # fmt: skip
def test_reference_bconv2d_equals_the_cpu_module_bit_for_bit(b, h, w, c, o, ksize, stride, padding, pad_value,
                                                              pool, seed):
    rng = np.random.default_rng(seed)
    x = ops.pack_bits(signs(rng, (b, h, w, c)))
    kernel = formats.pack_conv_weights(rng.standard_normal(ksize + (c, o)).astype(np.float32))
    try:
        native = ops.bconv2d(x, kernel, stride=stride, padding=padding, pad_value=pad_value, pool=pool)
    except ValueError as err:  # shapes whose output is empty are refused before lowering
        assert "does not fit" in str(err) or "larger than" in str(err)
        return
    pads = ops._conv_padding(padding, (h, w), ksize, stride)
    spec = jax.jit(lambda x, w: reference.bconv2d(
        x, w, in_channels=c, out_channels=o, kernel_size=ksize, stride=stride, padding=pads,
        pad_value=pad_value, pool=pool))(x, kernel.bits)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(spec), np.asarray(native))


@pytest.mark.parametrize("c, kernel, padding, pool", [
    (40, (9, 9), ((4, 4), (4, 4)), (2, 2)),  # shapes where a float convolution on a GPU was not exact
    (65, (3, 3), ((0, 0), (3, 3)), None),
    (33, (9, 9), ((4, 1), (0, 4)), (3, 1)),
])  # fmt: skip
@pytest.mark.parametrize("pad_value", ["zero", "one"])
def test_reference_bconv2d_named_shapes_equal_the_cpu_module(c, kernel, padding, pool, pad_value):
    rng = np.random.default_rng(c)
    x = ops.pack_bits(signs(rng, (2, 11, 10, c)))
    weights = formats.pack_conv_weights(signs(rng, kernel + (c, 7)))
    native = ops.bconv2d(x, weights, padding=padding, pad_value=pad_value, pool=pool)
    spec = jax.jit(lambda x, w: reference.bconv2d(
        x, w, in_channels=c, out_channels=7, kernel_size=kernel, stride=(1, 1), padding=padding,
        pad_value=pad_value, pool=pool))(x, weights.bits)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(spec), np.asarray(native))


def test_everything_jaxbnn_packs_has_zero_padding_bits():
    """What the packed format promises (docs/formats.md): the packers and the threshold epilogues write 0
    past the last real bit."""
    rng = np.random.default_rng(9)
    n, k = 45, 70
    padding = np.uint32(~((1 << (n % 32)) - 1) & 0xFFFFFFFF)
    a = ops.pack_bits(signs(rng, (5, k)))
    assert not (np.asarray(a)[:, -1] & np.uint32(~((1 << (k % 32)) - 1) & 0xFFFFFFFF)).any()
    w = formats.pack_dense_weights(rng.standard_normal((k, n)).astype(np.float32))
    everyone = dict(threshold=np.full(n, -k - 1, np.int32))  # every real bit set
    assert not (np.asarray(ops.bmm(a, w, **everyone))[:, -1] & padding).any()
    flipped = np.asarray(ops.bmm(a, w, threshold=np.full(n, k + 1, np.int32), flip=np.ones(n, bool)))
    assert not (flipped[:, -1] & padding).any() and (flipped[:, 0] == 0xFFFFFFFF).all()
    x = ops.pack_bits(signs(rng, (1, 6, 6, 33)))
    conv = formats.pack_conv_weights(rng.standard_normal((3, 3, 33, n)).astype(np.float32))
    for pool in (None, (2, 2)):
        bits = np.asarray(ops.bconv2d(x, conv, pool=pool, threshold=np.full(n, -1000, np.int32)))
        assert not (bits[..., -1] & padding).any() and (bits[..., 0] == 0xFFFFFFFF).all()
    rows = formats.from_fsb(w.bits, n, k)
    assert not (np.asarray(rows)[:, -1] & np.uint32(~((1 << (k % 32)) - 1) & 0xFFFFFFFF)).any()


# --- the image operand: int8 levels x int8 weight values -> int32, exact -----------------------------------


def numpy_image_conv(levels, kernel, stride, padding):
    """The convolution in numpy int64, tap by tap, zero (level 0) padding; padding "SAME" is lax's (output
    ceil(size / stride), the extra pixel at the end), "VALID" none, or ((top, bottom), (left, right))."""
    kh, kw, _, _ = kernel.shape
    if padding == "VALID":
        padding = ((0, 0), (0, 0))
    elif padding == "SAME":
        padding = tuple((t // 2, t - t // 2) for t in (max((-(-n // s) - 1) * s + k - n, 0) for n, k, s in
                                                       zip(levels.shape[1:3], (kh, kw), stride)))
    x = np.pad(levels.astype(np.int64), ((0, 0), *padding, (0, 0)))
    sh, sw = stride
    oh, ow = (x.shape[1] - kh) // sh + 1, (x.shape[2] - kw) // sw + 1
    return sum(x[:, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw] @ kernel[i, j].astype(np.int64)
               for i in range(kh) for j in range(kw))


def int8_values(rng, shape):
    return rng.integers(-128, 128, shape, dtype=np.int8)


@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (3, 7, 5), (5, 147, 9), (2, 784, 33), (0, 12, 4)])
def test_image_matmul_is_the_integer_product(m, k, n):
    rng = np.random.default_rng(k)
    levels, kernel = int8_values(rng, (m, k)), int8_values(rng, (k, n))
    got = ops.image_matmul(levels, kernel)
    assert got.dtype == jnp.int32 and got.shape == (m, n)
    np.testing.assert_array_equal(got, levels.astype(np.int64) @ kernel.astype(np.int64))
    np.testing.assert_array_equal(jax.jit(ops.image_matmul)(levels, kernel), got)


IMAGE_CONVS = [  # (image (B, H, W, C), kernel (KH, KW), stride, padding)
    ((2, 5, 7, 1), (1, 1), (1, 1), "SAME"),
    ((2, 5, 7, 3), (3, 3), (1, 1), "SAME"),
    ((1, 6, 5, 3), (3, 3), (2, 2), "SAME"),
    ((2, 9, 8, 1), (3, 3), (1, 2), "VALID"),
    ((1, 23, 21, 3), (7, 7), (4, 4), "SAME"),  # ResNet-18's stem on a small image
    ((2, 19, 23, 3), (11, 11), (4, 4), "VALID"),  # AlexNet's first conv on a small image
    ((1, 15, 15, 3), (11, 11), (4, 4), ((2, 1), (0, 3))),
    ((1, 4, 4, 1), (3, 5), (1, 1), ((1, 1), (2, 2))),
    ((0, 8, 8, 3), (3, 3), (1, 1), "SAME"),  # an empty batch
]


@pytest.mark.parametrize("shape, kernel_size, stride, padding", IMAGE_CONVS, ids=[str(c) for c in IMAGE_CONVS])
def test_image_conv2d_is_the_integer_convolution(shape, kernel_size, stride, padding):
    rng = np.random.default_rng(sum(shape))
    levels, kernel = int8_values(rng, shape), int8_values(rng, (*kernel_size, shape[-1], 5))
    got = ops.image_conv2d(levels, kernel, stride=stride, padding=padding)
    want = numpy_image_conv(levels, kernel, stride, padding)
    assert got.dtype == jnp.int32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_image_conv2d_under_jit_takes_traced_levels():
    """The runtime calls it inside its jitted forward: traced operands pass the same checks."""
    rng = np.random.default_rng(1)
    levels, kernel = int8_values(rng, (2, 6, 5, 3)), int8_values(rng, (3, 3, 3, 4))
    conv = jax.jit(lambda x, w: ops.image_conv2d(x, w, stride=2, padding=((1, 0), (2, 1))))
    np.testing.assert_array_equal(conv(levels, kernel), numpy_image_conv(levels, kernel, (2, 2), ((1, 0), (2, 1))))
    with pytest.raises(TypeError, match="levels must be int8 levels or uint8 pixels, got dtype int32"):
        conv(levels.astype(np.int32), kernel)


def test_image_ops_are_exact_at_the_extreme_values():
    """-128 everywhere times -128 or -1 weights: every product at its largest, summed without rounding or
    wrapping, up to the most products that always fit int32 (more are refused)."""
    levels = np.full((2, 19, 19, 3), -128, np.int8)
    for weight, product in ((-1, 128), (-128, 2**14)):
        kernel = np.full((11, 11, 3, 2), weight, np.int8)
        got = np.asarray(ops.image_conv2d(levels, kernel, stride=4, padding="VALID"))
        assert (got == 11 * 11 * 3 * product).all()
        padded = np.asarray(ops.image_conv2d(levels, kernel, stride=4, padding="SAME"))
        np.testing.assert_array_equal(padded, numpy_image_conv(levels, kernel, (4, 4), "SAME"))
        assert padded.min() < 11 * 11 * 3 * product  # border outputs: level-0 padding adds nothing
    k = ops.MAX_IMAGE_REDUCTION
    assert k * 2**14 <= 2**31 - 1 < (k + 1) * 2**14
    largest = ops.image_matmul(np.full((1, k), -128, np.int8), np.full((k, 2), -128, np.int8))
    np.testing.assert_array_equal(largest, [[k * 2**14] * 2])
    smallest = ops.image_matmul(np.full((1, k), -128, np.int8), np.full((k, 1), 127, np.int8))
    np.testing.assert_array_equal(smallest, [[-k * 128 * 127]])
    with pytest.raises(ValueError, match=rf"{k + 1} products per output: at most {k} int8 products"):
        ops.image_matmul(np.zeros((1, k + 1), np.int8), np.zeros((k + 1, 1), np.int8))
    with pytest.raises(ValueError, match=rf"at most {k} int8 products"):
        ops.image_conv2d(np.zeros((1, 3, 3, k), np.int8), np.zeros((1, 2, k, 1), np.int8))


IMAGE_OP_ERRORS = [
    (lambda: ops.image_matmul(np.zeros((2, 3), np.int16), np.zeros((3, 4), np.int8)), TypeError,
     "levels must be int8 levels or uint8 pixels, got dtype int16"),
    (lambda: ops.image_matmul(np.zeros((2, 3), np.int8), np.zeros((3, 4), np.int64)), TypeError,
     "kernel must be int8, got dtype int64"),  # reported as given, not as jax would convert it
    (lambda: ops.image_matmul(np.zeros((2, 3, 1), np.int8), np.zeros((3, 4), np.int8)), ValueError,
     r"levels must have rank 2, got shape \(2, 3, 1\)"),
    (lambda: ops.image_matmul(np.zeros((2, 3), np.int8), np.zeros(3, np.int8)), ValueError,
     r"kernel must have rank 2, got shape \(3,\)"),
    (lambda: ops.image_matmul(np.zeros((2, 3), np.int8), np.zeros((4, 4), np.int8)), ValueError,
     "levels have 3 features, kernel 4 rows"),
    (lambda: ops.image_conv2d(jnp.zeros((1, 5, 5, 3), jnp.int32), np.zeros((3, 3, 3, 2), np.int8)), TypeError,
     "levels must be int8 levels or uint8 pixels, got dtype int32"),
    (lambda: ops.image_matmul(np.zeros((2, 3), np.float32), np.zeros((3, 4), np.int8)), TypeError,
     "levels must be int8 levels or uint8 pixels, got dtype float32"),
    (lambda: ops.image_conv2d(np.zeros((1, 5, 5, 3), np.int8), np.ones((3, 3, 3, 2), np.float32)), TypeError,
     "kernel must be int8, got dtype float32"),
    (lambda: ops.image_conv2d(np.zeros((5, 5, 3), np.int8), np.zeros((3, 3, 3, 2), np.int8)), ValueError,
     r"levels must have rank 4, got shape \(5, 5, 3\)"),
    (lambda: ops.image_conv2d(np.zeros((1, 5, 5, 3), np.int8), np.zeros((3, 3, 2), np.int8)), ValueError,
     r"kernel must have rank 4"),
    (lambda: ops.image_conv2d(np.zeros((1, 5, 5, 3), np.int8), np.zeros((3, 3, 1, 2), np.int8)), ValueError,
     r"a kernel of shape \(3, 3, 1, 2\) does not take levels of shape \(1, 5, 5, 3\)"),
    (lambda: ops.image_conv2d(np.zeros((1, 5, 5, 3), np.int8), np.zeros((3, 3, 3, 0), np.int8)), ValueError,
     r"kernel \(KH, KW, C, N\) must have every size at least 1, got shape \(3, 3, 3, 0\)"),
    (lambda: ops.image_conv2d(np.zeros((1, 5, 5, 0), np.int8), np.zeros((3, 3, 0, 2), np.int8)), ValueError,
     r"kernel \(KH, KW, C, N\) must have every size at least 1, got shape \(3, 3, 0, 2\)"),
    (lambda: ops.image_matmul(np.zeros((2, 3), np.int8), np.zeros((3, 0), np.int8)), ValueError,
     r"kernel must have at least one row and one column, got shape \(3, 0\)"),
    (lambda: ops.image_matmul(np.zeros((2, 0), np.uint8), np.zeros((0, 4), np.int8)), ValueError,
     r"kernel must have at least one row and one column, got shape \(0, 4\)"),
    (lambda: ops.image_conv2d(np.zeros((1, 2, 5, 1), np.int8), np.zeros((3, 3, 1, 2), np.int8), padding="VALID"),
     ValueError, r"a 3x3 kernel does not fit the padded 2x5 image"),
    (lambda: ops.image_conv2d(np.zeros((1, 5, 5, 1), np.int8), np.zeros((3, 3, 1, 2), np.int8), stride=0),
     ValueError, "stride must be a positive integer"),
    (lambda: ops.image_conv2d(np.zeros((1, 5, 5, 1), np.int8), np.zeros((3, 3, 1, 2), np.int8), padding="FULL"),
     ValueError, r"padding must be 'SAME', 'VALID' or \(\(top, bottom\), \(left, right\)\)"),
    (lambda: ops.image_conv2d(np.zeros((1, 5, 5, 1), np.int8), np.zeros((3, 3, 1, 2), np.int8),
                              padding=((-1, 0), (0, 0))), ValueError, "non-negative"),
    (lambda: ops.image_conv2d(np.zeros((1, 5, 5, 1), np.int8), np.zeros((3, 3, 1, 2), np.int8),
                              padding=((2**31 - 1, 1), (0, 0))), ValueError, "larger than the largest extent"),
]


@pytest.mark.parametrize("call, error, message", IMAGE_OP_ERRORS, ids=[m for _, _, m in IMAGE_OP_ERRORS])
def test_image_ops_refuse_bad_arguments_with_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


# --- the first layer's fused pool and epilogue: the stream's shift, threshold planes ------------------------


def numpy_image_layer(levels, kernel, stride, padding, pool=None, shift=0, threshold=None, flip=None):
    """numpy_image_conv, max-pooled (window = stride, floor), then `>> shift` or the bits of each threshold
    plane (P, N), packed LSB first, as uint32 (B, OH, OW, P, words)."""
    pre = numpy_image_conv(levels, kernel, stride, padding)
    if pool is not None:
        ph, pw = pool
        b, h, w, n = pre.shape
        pre = pre[:, : h // ph * ph, : w // pw * pw].reshape(b, h // ph, ph, w // pw, pw, n).max(axis=(2, 4))
    if threshold is None:
        return pre >> shift
    return numpy_threshold_planes(pre, threshold, flip)


def numpy_threshold_planes(values, threshold, flip=None):
    """The bits of each threshold plane (P, N) of integer `values` (B, OH, OW, N), packed LSB first, as uint32
    (B, OH, OW, P, words)."""
    pre = np.asarray(values, np.int64)
    threshold = np.asarray(threshold, object).astype(np.float64)  # exact for |t| < 2**53: the tests' range
    flip = np.zeros(threshold.shape, bool) if flip is None else np.asarray(flip, bool)
    bits = np.where(flip[:, None, None, None], pre[None] <= threshold[:, None, None, None],
                    pre[None] >= threshold[:, None, None, None])  # (P, B, OH, OW, N)
    n = bits.shape[-1]
    words = -(-n // 32)
    bits = np.pad(bits, [(0, 0)] * 4 + [(0, 32 * words - n)]).reshape(bits.shape[:4] + (words, 32))
    packed = (bits.astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)
    return np.moveaxis(packed, 0, 3)


IMAGE_LAYERS = [  # (image, kernel (KH, KW), N, stride, padding, pool, planes or a shift)
    ((3, 12, 12, 1), (3, 3), 64, 1, "SAME", (2, 2), {"planes": 1}),  # MNIST conv
    ((2, 8, 8, 3), (3, 3), 40, 1, "SAME", None, {"planes": 2}),  # a ternary output
    ((2, 9, 9, 3), (3, 3), 33, 2, "SAME", None, {"shift": 7}),  # ResNet-14's stem
    ((1, 23, 21, 3), (7, 7), 16, 4, "SAME", None, {"shift": 31}),
    ((2, 19, 23, 3), (11, 11), 70, 4, "SAME", (2, 2), {"planes": 3}),  # AlexNet's on a small image
    ((2, 9, 13, 5), (2, 3), 31, (1, 2), ((0, 3), (4, 0)), (3, 2), {"planes": 2}),  # the pool drops a row
    ((1, 8, 16, 2), (1, 1), 5, 1, "VALID", (8, 16), {"planes": 1}),  # the largest window
    ((2, 7, 7, 3), (3, 3), 9, 1, "SAME", (2, 2), {"shift": 0}),
]


@pytest.mark.parametrize("shape, kernel_size, n, stride, padding, pool, epilogue", IMAGE_LAYERS,
                         ids=[str(c[:2]) + str(c[-1]) for c in IMAGE_LAYERS])
def test_image_conv2d_pools_then_shifts_or_thresholds(shape, kernel_size, n, stride, padding, pool, epilogue):
    rng = np.random.default_rng(sum(shape) + n)
    levels, kernel = int8_values(rng, shape), rng.integers(-1, 2, (*kernel_size, shape[-1], n)).astype(np.int8)
    stride2 = (stride, stride) if isinstance(stride, int) else stride
    if "shift" in epilogue:
        got = ops.image_conv2d(levels, kernel, stride=stride, padding=padding, pool=pool, shift=epilogue["shift"])
        want = numpy_image_layer(levels, kernel, stride2, padding, pool, shift=epilogue["shift"])
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(got, want)
        return
    pre = numpy_image_layer(levels, kernel, stride2, padding, pool)
    planes = epilogue["planes"]
    # thresholds on the pre-activations themselves (ties), beyond them, and at the int32 extremes
    threshold = rng.choice(np.concatenate([pre.ravel()[:50], [-2**31, 2**31 - 1, 0, 5]]), (planes, n))
    flip = rng.integers(0, 2, (planes, n)).astype(bool)
    got = ops.image_conv2d(levels, kernel, stride=stride, padding=padding, pool=pool, threshold=threshold, flip=flip)
    want = numpy_image_layer(levels, kernel, stride2, padding, pool, threshold=threshold, flip=flip)
    assert got.dtype == jnp.uint32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    single = ops.image_conv2d(levels, kernel, stride=stride, padding=padding, pool=pool, threshold=threshold[0],
                              flip=flip[0])  # one plane given as a vector: no plane axis
    np.testing.assert_array_equal(single, want[..., 0, :])
    jitted = jax.jit(lambda x: ops.image_conv2d(x, kernel, stride=stride, padding=padding, pool=pool,
                                                threshold=threshold, flip=flip))
    np.testing.assert_array_equal(jitted(levels), want)
    batched = jax.vmap(lambda x: ops.image_conv2d(x, kernel, stride=stride, padding=padding, pool=pool,
                                                  threshold=threshold, flip=flip))(np.stack([levels, levels[::-1]]))
    np.testing.assert_array_equal(batched[1], want[::-1])


def test_image_matmul_thresholds_and_shifts_like_a_one_by_one_conv():
    rng = np.random.default_rng(7)
    levels, kernel = int8_values(rng, (5, 784)), rng.integers(-1, 2, (784, 100)).astype(np.int8)
    pre = levels.astype(np.int64) @ kernel.astype(np.int64)
    np.testing.assert_array_equal(ops.image_matmul(levels, kernel, shift=3), pre >> 3)
    threshold = rng.integers(-300, 300, 100)
    flip = rng.integers(0, 2, 100).astype(bool)
    want = numpy_image_layer(levels[:, None, None], kernel[None, None], (1, 1), "VALID", threshold=threshold[None],
                             flip=flip[None])[:, 0, 0, 0]
    np.testing.assert_array_equal(ops.image_matmul(levels, kernel, threshold=threshold, flip=flip), want)


@pytest.mark.parametrize("epilogue", [dict(shift=3), dict(shift=7, out_dtype=jnp.int16),
                                      dict(threshold=[[0] * 5, [40] * 5], flip=[[0, 1] * 2 + [1]] * 2),
                                      dict(shift=2, out_dtype=jnp.int16, threshold=[3, 0, -9, 8, 1], keep_stream=True)])
def test_image_ops_take_the_uint8_pixels_of_their_levels(epilogue):
    """uint8 pixels p give what their int8 levels p - 128 give (formats.image_levels), in every epilogue, under
    jit and vmap, with "zero" padding still level 0 (pixel 128); image_matmul likewise."""
    rng = np.random.default_rng(11)
    pixels = rng.integers(0, 256, (2, 7, 9, 3), dtype=np.uint8)
    pixels[0, 0, :3] = [0, 128, 255]
    levels = np.asarray(formats.image_levels(pixels))
    kernel = rng.integers(-128, 128, (3, 3, 3, 5), dtype=np.int8)

    def layer(x):
        return ops.image_conv2d(x, kernel, stride=(1, 2), padding="SAME", **epilogue)

    want = jax.tree.map(np.asarray, layer(levels))
    for got in (layer(pixels), jax.jit(layer)(pixels), jax.tree.map(lambda v: v[0], jax.vmap(layer)(pixels[None]))):
        for got_part, want_part in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert got_part.dtype == want_part.dtype
            np.testing.assert_array_equal(got_part, want_part)
    flat = pixels.reshape(2, -1)[:, :40]
    dense = rng.integers(-1, 2, (40, 6), dtype=np.int8)
    np.testing.assert_array_equal(ops.image_matmul(flat, dense, shift=1),
                                  ops.image_matmul(np.asarray(formats.image_levels(flat)), dense, shift=1))


def test_image_thresholds_of_any_width_saturate_exactly():
    """Host thresholds beyond int32 act as the bound past every pre-activation, never wrapped."""
    levels = np.full((1, 4, 4, 1), 127, np.int8)
    kernel = np.ones((1, 1, 1, 3), np.int8)
    threshold = np.array([[2**32 + 10, -(2**40), 127]], np.int64)
    got = np.asarray(ops.image_conv2d(levels, kernel, padding="VALID", threshold=threshold))
    assert (got[..., 0, 0] == 0b110).all()
    huge = np.array([[2**70, -(2**70), 128]], object)
    assert (np.asarray(ops.image_conv2d(levels, kernel, padding="VALID", threshold=huge))[..., 0, 0] == 0b010).all()


def narrowed(values):
    """int64 values as int16's two's-complement narrowing keeps them (astype's)."""
    return ((np.asarray(values, np.int64) + 2**15) % 2**16 - 2**15).astype(np.int16)


def test_the_image_stream_narrows_to_int16_as_astype_does():
    """out_dtype=int16: the shifted pre-activations' low 16 bits, wrapped where they do not fit (the extreme
    levels and weights reach 27 * 2**14), equal where they do."""
    levels = np.full((2, 6, 6, 3), -128, np.int8)
    levels[1] = 127
    kernel = np.full((3, 3, 3, 4), -128, np.int8)
    kernel[..., 1] = 127
    kernel[..., 2:] = np.random.default_rng(2).integers(-1, 2, (3, 3, 3, 2))
    for shift in (0, 3, 7):
        pre = numpy_image_conv(levels, kernel, (1, 1), "SAME")
        got = ops.image_conv2d(levels, kernel, shift=shift, out_dtype=jnp.int16)
        assert got.dtype == jnp.int16
        np.testing.assert_array_equal(got, narrowed(pre >> shift))
    assert (np.abs(pre) > 2**15).any()


@pytest.mark.parametrize("out_dtype, shift, pool, planes", [(jnp.int16, 7, None, 1), (jnp.int16, 0, (2, 2), 2),
                                                            (jnp.int32, 3, (2, 2), 2), (jnp.int32, 0, None, 1)])
def test_image_conv2d_keeps_the_stream_beside_the_bits_of_its_values(out_dtype, shift, pool, planes):
    """keep_stream=True: the pair (stream, bits), the bits those of the stream's values (shifted and narrowed)
    against the thresholds, ties and wrapped values included; one plane given as a vector drops the plane axis;
    under jit and vmap; image_matmul likewise."""
    rng = np.random.default_rng(planes + shift)
    levels, kernel = int8_values(rng, (3, 9, 10, 3)), int8_values(rng, (3, 3, 3, 40))
    kernel[..., :20] = rng.integers(-1, 2, kernel[..., :20].shape)
    stream = numpy_image_layer(levels, kernel, (1, 1), "SAME", pool, shift=shift)
    stream = narrowed(stream) if out_dtype == jnp.int16 else stream.astype(np.int32)
    threshold = rng.choice(np.concatenate([stream.ravel()[:40], [-2**31, 2**31 - 1, 2**40, 0]]), (planes, 40))
    flip = rng.integers(0, 2, (planes, 40)).astype(bool)
    bits = numpy_threshold_planes(stream, threshold, flip)
    call = dict(pool=pool, shift=shift, out_dtype=out_dtype, threshold=threshold, flip=flip, keep_stream=True)
    got_stream, got_bits = ops.image_conv2d(levels, kernel, **call)
    assert got_stream.dtype == out_dtype and got_bits.dtype == jnp.uint32
    np.testing.assert_array_equal(got_stream, stream)
    np.testing.assert_array_equal(got_bits, bits)
    single = ops.image_conv2d(levels, kernel, **dict(call, threshold=threshold[0], flip=flip[0]))
    np.testing.assert_array_equal(single[1], bits[..., 0, :])
    jitted = jax.jit(lambda x: ops.image_conv2d(x, kernel, **call))(levels)
    np.testing.assert_array_equal(jitted[1], bits)
    batched = jax.vmap(lambda x: ops.image_conv2d(x, kernel, **call))(np.stack([levels, levels[::-1]]))
    np.testing.assert_array_equal(batched[0][1], stream[::-1])
    np.testing.assert_array_equal(batched[1][1], bits[::-1])
    unpooled = {k: v for k, v in call.items() if k != "pool"}
    dense_stream, dense_bits = ops.image_matmul(levels[:, 0, 0], kernel[1, 1], **unpooled)
    want = ops.image_conv2d(levels[:, :1, :1], kernel[1:2, 1:2], padding="VALID", **unpooled)
    np.testing.assert_array_equal(dense_stream, want[0][:, 0, 0])
    np.testing.assert_array_equal(dense_bits, want[1][:, 0, 0])


IMAGE_EPILOGUE_ERRORS = [
    (dict(shift=32), ValueError, r"shift must be an integer in \[0, 31\], got 32"),
    (dict(shift=-1), ValueError, "shift must be an integer"),
    (dict(shift=1.0), ValueError, "shift must be an integer"),
    (dict(threshold=np.zeros(2, np.int32), shift=1), ValueError, "shift and out_dtype apply to the stream"),
    (dict(threshold=np.zeros(2, np.int32), out_dtype=jnp.int16), ValueError, "shift and out_dtype apply to the stream"),
    (dict(out_dtype=jnp.int8), TypeError, "out_dtype must be int32 or int16"),
    (dict(out_dtype="float32"), TypeError, "out_dtype must be int32 or int16"),
    (dict(out_dtype=None), TypeError, r"out_dtype must be int32 or int16 \(the stream's type\), got None$"),
    (dict(keep_stream=True), ValueError, "keep_stream applies with a threshold"),
    (dict(threshold=np.zeros(2, np.int32), keep_stream=1), TypeError, "keep_stream must be a bool"),
    (dict(flip=np.zeros(2, bool)), ValueError, "flip only applies with a threshold"),
    (dict(threshold=np.zeros(3, np.int32)), ValueError, r"threshold must have shape \(2,\) or \(planes, 2\)"),
    (dict(threshold=np.zeros((9, 2), np.int32)), ValueError, "with 1 to 8 planes"),
    (dict(threshold=np.zeros((0, 2), np.int32)), ValueError, "with 1 to 8 planes"),
    (dict(threshold=np.zeros(2, np.float32)), TypeError, "threshold must be integer"),
    (dict(threshold=np.zeros((2, 2), np.int32), flip=np.zeros(2, bool)), ValueError,
     r"flip must have the shape of threshold, \(2, 2\)"),
    (dict(pool=(3, 3)), ValueError, r"pool \(3, 3\) is larger than the 2x2 convolution output"),
    (dict(pool=(0, 1)), ValueError, "pool must be a positive integer"),
]


@pytest.mark.parametrize("kwargs, error, message", IMAGE_EPILOGUE_ERRORS, ids=[m for *_, m in IMAGE_EPILOGUE_ERRORS])
def test_image_conv2d_refuses_bad_epilogues(kwargs, error, message):
    with pytest.raises(error, match=message):
        ops.image_conv2d(np.zeros((1, 4, 4, 3), np.int8), np.zeros((3, 3, 3, 2), np.int8), padding="VALID", **kwargs)


def test_image_conv2d_refuses_pool_windows_past_one_kernel_tile():
    levels, kernel = np.zeros((1, 16, 16, 1), np.int8), np.zeros((1, 1, 1, 1), np.int8)
    assert ops.image_conv2d(levels, kernel, pool=(8, 16), shift=0).shape == (1, 2, 1, 1)
    with pytest.raises(ValueError, match=r"pool \(16, 16\) has 256 elements; image_conv2d takes windows of at most 128"):
        ops.image_conv2d(levels, kernel, pool=(16, 16))


@pytest.mark.parametrize("k", [1, 33, 100, 165])
def test_ops_read_only_the_real_bits_whatever_the_padding_bits_hold(k):
    """Activation and weight words with every padding bit set give the dot products of their real bits (the
    popcounts the op derives count real bits only); tests/test_gpu_kernels.py holds CUDA to the same."""
    rng = np.random.default_rng(k)

    def dirty(words, bits):
        words = np.array(words)
        if bits % 32:
            words[..., -1] |= np.uint32(~((1 << (bits % 32)) - 1) & 0xFFFFFFFF)
        return words

    a = np.asarray(ops.pack_bits(signs(rng, (9, k))))
    rows = np.asarray(ops.pack_bits(signs(rng, (13, k))))
    want = np.asarray(ops.bmm(a, rows, k))
    np.testing.assert_array_equal(ops.bmm(dirty(a, k), dirty(rows, k), k), want)
    x = np.asarray(ops.pack_bits(signs(rng, (2, 5, 6, k))))
    w = np.asarray(ops.pack_bits(signs(rng, (7, 3, 3, k))))
    for pad_value in ("zero", "one"):
        conv = dict(in_channels=k, kernel_size=(3, 3), padding="SAME", pad_value=pad_value)
        np.testing.assert_array_equal(ops.bconv2d(dirty(x, k), dirty(w, k), **conv), ops.bconv2d(x, w, **conv))


# --- the residual epilogue: a ResNet block's stream and its bits from the second convolution ------------


def numpy_residual(dot, shortcut, stride, shift, threshold=None, flip=None):
    """(dot >> shift) + the type-A shortcut (subsampled, zero channels appended), wrapping as the shortcut's
    integer type (int32 or int16)."""
    short = shortcut[..., ::stride, ::stride, :].astype(np.int64)
    short = np.concatenate([short, np.zeros(short.shape[:-1] + (dot.shape[-1] - short.shape[-1],), np.int64)], -1)
    unsigned = np.uint32 if shortcut.dtype == np.int32 else np.uint16
    stream = ((np.asarray(dot, np.int64) >> shift) + short).astype(np.uint64).astype(unsigned).view(shortcut.dtype)
    if threshold is None:
        return stream
    bits = np.where(flip, stream <= threshold, stream >= threshold)
    return stream, np.asarray(formats.pack_bits(bits))


RESIDUAL_CASES = [
    # (batch dims, H, W, C, O, kernel, conv stride, shortcut (SH, SW, SC), shortcut stride, shift)
    ((2,), 8, 8, 64, 64, 3, 1, (8, 8, 64), 1, 0),
    ((3,), 7, 9, 40, 70, 3, 1, (13, 17, 33), 2, 1),  # type A: half the pixels, channels zero-padded
    ((2, 2), 5, 6, 17, 33, 1, 1, (5, 6, 17), 1, 31),  # leading batch dims, the largest shift
    ((1,), 9, 9, 32, 48, 3, 2, (10, 9, 32), 2, 0),  # a strided conv1-like geometry, SH = 2 OH
]


@pytest.mark.parametrize("case", RESIDUAL_CASES)
@pytest.mark.parametrize("with_bits", [False, True])
@pytest.mark.parametrize("stream_dtype", [np.int32, np.int16])
def test_residual_epilogue_adds_the_type_a_shortcut_and_thresholds_the_stream(case, with_bits, stream_dtype):
    lead, h, w, c, o, k, stride, (sh, sw, sc), s, shift = case
    rng = np.random.default_rng(len(lead) + h + o + s)
    x = formats.pack_bits(signs(rng, lead + (h, w, c)) >= 0)
    weights = formats.pack_conv_weights(signs(rng, (k, k, c, o)))
    shortcut = rng.integers(-500, 500, lead + (sh, sw, sc)).astype(stream_dtype)
    shortcut.reshape(-1)[0] = np.iinfo(stream_dtype).max  # the sum wraps as the stream's type does
    epilogue = dict(threshold=rng.integers(-60, 60, o).astype(np.int32), flip=rng.integers(0, 2, o).astype(bool))
    conv = dict(kernel_size=(k, k), stride=stride, padding="SAME")
    dot = np.asarray(ops.bconv2d(x, weights, **conv))
    got = ops.bconv2d(x, weights, **conv, shortcut=shortcut, shortcut_stride=s, shift=shift,
                      **(epilogue if with_bits else {}))
    want = numpy_residual(dot, shortcut, s, shift, **(epilogue if with_bits else {}))
    if with_bits:
        np.testing.assert_array_equal(np.asarray(got[0]), want[0])
        np.testing.assert_array_equal(np.asarray(got[1]), want[1])
        assert got[1].dtype == jnp.uint32 and got[1].shape == lead + dot.shape[-3:-1] + (formats.num_words(o),)
    else:
        np.testing.assert_array_equal(np.asarray(got), want)
    stream = got[0] if with_bits else got
    assert stream.dtype == stream_dtype


@pytest.mark.parametrize("stream_dtype", [np.int32, np.int16])
def test_residual_epilogue_of_an_empty_batch_has_the_stream_type(stream_dtype):
    weights = formats.pack_conv_weights(np.ones((3, 3, 32, 40), np.float32))
    x = jnp.zeros((0, 4, 4, 1), jnp.uint32)
    stream, bits = ops.bconv2d(x, weights, kernel_size=(3, 3), shortcut=jnp.zeros((0, 4, 4, 40), stream_dtype),
                               threshold=jnp.zeros(40, jnp.int32))
    assert stream.shape == (0, 4, 4, 40) and stream.dtype == stream_dtype
    assert bits.shape == (0, 4, 4, 2) and bits.dtype == jnp.uint32


@pytest.mark.parametrize("out_dtype, error, message", [
    ("bogus", TypeError, "out_dtype must be int32 or int16, got 'bogus'"),
    (None, TypeError, r"out_dtype must be int32 or int16 \(the residual stream, the shortcut's type\), got None"),
    (jnp.float32, TypeError, "out_dtype must be int32 or int16 .*got float32"),
    (jnp.int16, ValueError, "the residual epilogue's stream has the shortcut's type, int32; got out_dtype=int16"),
])
def test_residual_epilogue_s_out_dtype_is_the_shortcut_s_type_or_int32(out_dtype, error, message):
    weights = formats.pack_conv_weights(np.ones((3, 3, 32, 32), np.float32))
    x = jnp.zeros((1, 4, 4, 1), jnp.uint32)
    with pytest.raises(error, match=message):
        ops.bconv2d(x, weights, kernel_size=(3, 3), shortcut=jnp.zeros((1, 4, 4, 32), jnp.int32), out_dtype=out_dtype)
    short16 = jnp.zeros((1, 4, 4, 32), jnp.int16)  # int32, the default, stands for the shortcut's type
    assert ops.bconv2d(x, weights, kernel_size=(3, 3), shortcut=short16, out_dtype=jnp.int32).dtype == jnp.int16


def test_residual_epilogue_under_jit_and_vmap():
    rng = np.random.default_rng(7)
    x = formats.pack_bits(signs(rng, (3, 2, 6, 6, 64)) >= 0)
    weights = formats.pack_conv_weights(signs(rng, (3, 3, 64, 64)))
    shortcut = jnp.asarray(rng.integers(-99, 99, (3, 2, 6, 6, 64)).astype(np.int32))
    threshold = jnp.asarray(rng.integers(-9, 9, 64).astype(np.int32))

    def block(x, shortcut):
        return ops.bconv2d(x, weights, kernel_size=(3, 3), shortcut=shortcut, threshold=threshold)

    stream, bits = jax.jit(jax.vmap(block))(x, shortcut)
    want_stream, want_bits = block(x, shortcut)
    np.testing.assert_array_equal(np.asarray(stream), np.asarray(want_stream))
    np.testing.assert_array_equal(np.asarray(bits), np.asarray(want_bits))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(shortcut=np.zeros((2, 6, 6, 64), np.int64)), TypeError, "int32 or int16"),
    (dict(shortcut=np.zeros((2, 6, 6, 64), np.int8)), TypeError, "int32 or int16"),
    (dict(shortcut=np.zeros((2, 6, 6, 64), np.int32), out_dtype=np.int16), ValueError, "the shortcut's type"),
    (dict(shortcut=np.zeros((6, 6, 64), np.int32)), ValueError, "batch dims of x"),
    (dict(shortcut=np.zeros((2, 6, 6, 65), np.int32)), ValueError, "does not reach"),
    (dict(shortcut=np.zeros((2, 7, 6, 64), np.int32)), ValueError, "does not reach"),
    (dict(shortcut=np.zeros((2, 12, 12, 64), np.int32)), ValueError, "does not reach"),
    (dict(shortcut=np.zeros((2, 12, 12, 64), np.int32), shortcut_stride=0), ValueError, "shortcut_stride"),
    (dict(shortcut=np.zeros((2, 6, 6, 64), np.int32), shift=32), ValueError, "shift"),
    (dict(shortcut=np.zeros((2, 6, 6, 64), np.int32), pool=(2, 2)), ValueError, "no pool"),
    (dict(shortcut=np.zeros((2, 6, 6, 64), np.int32), scale=np.ones(64, np.float32)), ValueError, "no pool"),
    (dict(shortcut=np.zeros((2, 6, 6, 64), np.int32), threshold=np.full(64, 2**31, np.int64)), ValueError,
     "within int32"),
    (dict(shortcut=np.zeros((2, 6, 6, 64), np.int32), threshold=np.zeros(64, np.float32)), TypeError, "integer"),
    (dict(shortcut=np.zeros((2, 6, 6, 64), np.int32), flip=np.zeros(64, bool)), ValueError, "flip only"),
    (dict(shift=1), ValueError, "give a shortcut"),
    (dict(shortcut_stride=2), ValueError, "give a shortcut"),
])
def test_residual_epilogue_refuses_bad_arguments_before_lowering(kwargs, error, message):
    rng = np.random.default_rng(0)
    x = formats.pack_bits(signs(rng, (2, 6, 6, 64)) >= 0)
    weights = formats.pack_conv_weights(signs(rng, (3, 3, 64, 64)))
    with pytest.raises(error, match=message):
        ops.bconv2d(x, weights, kernel_size=(3, 3), **kwargs)


def test_residual_epilogue_refuses_a_device_threshold_wider_than_int32():
    rng = np.random.default_rng(0)
    x = formats.pack_bits(signs(rng, (1, 4, 4, 32)) >= 0)
    weights = formats.pack_conv_weights(signs(rng, (3, 3, 32, 32)))
    with pytest.raises(TypeError, match="within int32"):
        ops.bconv2d(x, weights, kernel_size=(3, 3), shortcut=jnp.zeros((1, 4, 4, 32), jnp.int32),
                    threshold=jnp.zeros(32, jnp.uint32))
