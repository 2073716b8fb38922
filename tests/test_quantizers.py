"""Quantizers: forward values (sign(0) = +1, TAB eq. 1) and their surrogate gradients."""

import fractions
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbnn import quantizers as q

# Values on both sides of every boundary of interest (0, ±1, ±0.3), plus random ones.
EDGES = np.array([-2.0, -1.0001, -1.0, -0.9999, -0.3, -1e-7, 0.0, 1e-7, 0.3, 0.9999, 1.0, 1.0001, 2.0], np.float32)


def _points(seed=0, n=200):
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.concatenate([EDGES, rng.normal(0, 1.2, n).astype(np.float32)]))


def _grad(fn, x):
    return jax.grad(lambda v: jnp.sum(fn(v) * jnp.arange(1, v.size + 1, dtype=v.dtype)))(x)


@pytest.mark.parametrize("name", ["sign_ste", "approx_sign", "swish_sign"])
def test_binary_forward_is_sign_with_zero_to_plus_one(name):
    x = _points()
    y = q.get_quantizer(name).fn(x)
    np.testing.assert_array_equal(np.asarray(y), np.where(np.asarray(x) >= 0, 1.0, -1.0))
    assert float(q.get_quantizer(name).fn(jnp.float32(0.0))) == 1.0


def test_sign_ste_gradient_is_clipped_identity():
    x = _points()
    weights = np.arange(1, x.size + 1, dtype=np.float32)
    expected = np.where(np.abs(np.asarray(x)) <= 1.0, weights, 0.0)
    np.testing.assert_array_equal(np.asarray(_grad(q.sign_ste, x)), expected)


def test_sign_ste_clip_value():
    x = jnp.array([-3.0, -2.0, -1.5, 0.5, 2.5], jnp.float32)
    g = jax.grad(lambda v: jnp.sum(q.sign_ste(v, 2.0)))(x)
    np.testing.assert_array_equal(np.asarray(g), [0, 1, 1, 1, 0])


def test_approx_sign_gradient_is_bireal_triangle():
    x = _points()
    xs = np.asarray(x)
    weights = np.arange(1, x.size + 1, dtype=np.float32)
    expected = weights * np.where(np.abs(xs) <= 1.0, 2.0 - 2.0 * np.abs(xs), 0.0)
    np.testing.assert_allclose(np.asarray(_grad(q.approx_sign, x)), expected, rtol=1e-6, atol=1e-6)


def test_swish_sign_gradient_is_derivative_of_its_smooth_surrogate():
    beta = 5.0

    def surrogate(v):  # BNN+'s SignSwish: 2 sigmoid(beta x)(1 + beta x (1 - sigmoid(beta x))) - 1
        s = jax.nn.sigmoid(beta * v)
        return 2 * s * (1 + beta * v * (1 - s)) - 1

    x = _points()
    # autodiff of the surrogate cancels large terms in float32: compare to 1e-3 of the largest slope
    np.testing.assert_allclose(_grad(q.swish_sign, x), _grad(surrogate, x), rtol=1e-3, atol=1e-3 * beta)


def test_swish_sign_gradient_is_zero_far_from_zero_in_every_float_type():
    """Past |beta x| = 80 the slope is below 1e-32: 0, not inf / inf (cosh overflows), also in float16."""
    for dtype in (jnp.float32, jnp.float16, jnp.bfloat16):
        x = jnp.asarray([1e37, -1e38, np.inf, -np.inf, 20.0, 1e4], jnp.float32).astype(dtype)  # float16: inf
        np.testing.assert_array_equal(np.asarray(jax.vmap(jax.grad(q.swish_sign))(x), np.float32), 0.0)
    assert float(jax.grad(q.swish_sign)(jnp.float16(0.1))) > 0


def test_ste_heaviside():
    x = _points()
    np.testing.assert_array_equal(np.asarray(q.ste_heaviside(x)), (np.asarray(x) >= 0).astype(np.float32))
    g = jax.grad(lambda v: jnp.sum(q.ste_heaviside(v)))(x)
    np.testing.assert_array_equal(np.asarray(g), (np.abs(np.asarray(x)) <= 1).astype(np.float32))


def test_ste_heaviside_gives_the_bit_binarize_gives_at_special_values():
    """A negative subnormal is below 0 (XLA's CPU would flush it to -0.0, which is not); NaN is 0."""
    x = jnp.asarray([-1e-45, -1e-40, 1e-45, -0.0, np.nan, np.inf, -np.inf], jnp.float32)
    np.testing.assert_array_equal(np.asarray(q.ste_heaviside(x)), [0, 0, 1, 1, 0, 1, 0])
    np.testing.assert_array_equal(np.asarray(jax.jit(q.ste_heaviside)(x)), (np.asarray(q.binarize(x)) + 1) / 2)


def test_hard_tanh_values_and_mask():
    """Its gradient is the STE mask |x| <= 1: 1 at +-1 too."""
    x = _points()
    np.testing.assert_array_equal(np.asarray(q.hard_tanh(x)), np.clip(np.asarray(x), -1, 1))
    g = jax.grad(lambda v: jnp.sum(q.hard_tanh(v)))(x)
    np.testing.assert_array_equal(np.asarray(g), (np.abs(np.asarray(x)) <= 1).astype(np.float32))
    special = jnp.asarray([np.nan, np.inf, -np.inf, -0.0], jnp.float32)
    np.testing.assert_array_equal(np.asarray(q.hard_tanh(special)), [np.nan, 1, -1, -0.0])
    assert np.signbit(np.asarray(q.hard_tanh(special))[3])


def test_ternarize_follows_tab_equation_1_with_asymmetric_thresholds():
    alpha, beta = 0.3, -0.5
    x = jnp.array([-0.6, -0.5, -0.4999, 0.0, 0.2999, 0.3, 0.3001, 1.5], jnp.float32)
    # strict comparisons: x == alpha and x == beta give 0
    np.testing.assert_array_equal(np.asarray(q.ternarize_ste(x, alpha, beta)), [-1, 0, 0, 0, 0, 0, 1, 1])


def test_ternarize_gives_nan_minus_one_as_the_exported_thresholds_do():
    """NaN sets neither plane's bit through the integer thresholds (-1); so does a NaN threshold."""
    x = jnp.asarray([np.nan, 0.0, 1.0, -1.0], jnp.float32)
    np.testing.assert_array_equal(np.asarray(q.ternarize(x, 0.5, -0.5)), [-1, 0, 1, -1])
    np.testing.assert_array_equal(np.asarray(q.ternarize(x, np.nan, np.nan)), [-1, -1, -1, -1])
    np.testing.assert_array_equal(np.asarray(q.ternarize_ste(x, 0.5, -0.5)), [-1, 0, 1, -1])


def test_ternarize_of_unsigned_or_bool_values_gives_a_signed_type():
    """-1 would wrap to 255 in uint8."""
    values = q.ternarize(jnp.asarray([0, 1, 3, 10], jnp.uint8), 5, 2)
    assert values.dtype == jnp.int16
    np.testing.assert_array_equal(np.asarray(values), [-1, -1, 0, 1])
    np.testing.assert_array_equal(np.asarray(q.ternarize(jnp.asarray([True, False]), 0.5, 0.2)), [1, -1])


def test_ternarize_gradients_wrt_input_and_thresholds():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(0, 1.2, (16, 5)).astype(np.float32))
    alpha = jnp.asarray(rng.uniform(0.1, 0.6, 5).astype(np.float32))  # per channel (last axis)
    beta = jnp.float32(-0.4)  # scalar
    g_out = jnp.asarray(rng.normal(size=(16, 5)).astype(np.float32))
    gx, ga, gb = jax.grad(lambda a, b, c: jnp.sum(q.ternarize_ste(a, b, c) * g_out), argnums=(0, 1, 2))(x, alpha, beta)
    xs, al, go = np.asarray(x), np.asarray(alpha), np.asarray(g_out)
    near_a = (np.abs(xs - al) <= 1).astype(np.float32)
    near_b = (np.abs(xs - -0.4) <= 1).astype(np.float32)
    np.testing.assert_allclose(np.asarray(gx), 0.5 * go * (near_a + near_b), rtol=1e-6)
    assert ga.shape == (5,) and gb.shape == ()
    np.testing.assert_allclose(np.asarray(ga), (-0.5 * go * near_a).sum(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(gb), float((-0.5 * go * near_b).sum()), rtol=1e-5)


def test_twn_thresholds_per_tensor_and_per_channel():
    rng = np.random.default_rng(2)
    w = rng.normal(size=(3, 3, 4, 6)).astype(np.float32)
    a, b = q.twn_thresholds(jnp.asarray(w))
    np.testing.assert_allclose(float(a), 0.7 * np.abs(w).mean(), rtol=1e-6)
    assert float(b) == -float(a)
    a, b = q.twn_thresholds(jnp.asarray(w), 0.5, per_channel=True)
    np.testing.assert_allclose(np.asarray(a), 0.5 * np.abs(w).reshape(-1, 6).mean(0), rtol=1e-6)
    # thresholds follow the weights but do not train through them
    g = jax.grad(lambda v: jnp.sum(q.twn_thresholds(v)[0]))(jnp.asarray(w))
    assert not np.any(np.asarray(g))


def _pairwise_in_numpy(rows):
    """The leading-axis sum in fixed_order_sum's order, in float32 numpy: halves of a zero-padded 2^k rows."""
    rows = np.concatenate([rows, np.zeros((max(1 << max(len(rows) - 1, 0).bit_length(), 1) - len(rows),)
                                          + rows.shape[1:], np.float32)])
    while len(rows) > 1:
        rows = rows[: len(rows) // 2] + rows[len(rows) // 2:]
    return rows[0]


@pytest.mark.parametrize("shape", [(0, 3), (1, 1), (5,), (3, 3, 5, 7), (1025, 3), (3, 3, 64, 40), (2, 2, 700, 1)])
def test_fixed_order_sum_adds_in_its_documented_order_bit_for_bit(shape):
    """The thresholds and scales of the weights sum in one order on every platform (XLA's reductions choose
    theirs): jitted or not, the sum is numpy's float32 adds in that order, bit for bit."""
    rng = np.random.default_rng(sum(shape))
    x = (np.abs(rng.normal(size=shape)) * 1e-3 ** rng.integers(0, 3, size=shape)).astype(np.float32)
    flat = x.reshape(-1)
    blocks = max(-(-flat.size // 1024), 1)
    padded = np.pad(flat, (0, blocks * 1024 - flat.size)).reshape(blocks, 1024)
    want_all = _pairwise_in_numpy(_pairwise_in_numpy(padded))
    want_channels = _pairwise_in_numpy(x.reshape(-1, shape[-1]))
    for fn in (q.fixed_order_sum, jax.jit(q.fixed_order_sum, static_argnums=1)):
        assert np.asarray(fn(jnp.asarray(x), False)).tobytes() == np.float32(want_all).tobytes()
        assert np.asarray(fn(jnp.asarray(x), True)).tobytes() == want_channels.tobytes()
    np.testing.assert_allclose(float(q.fixed_order_sum(jnp.asarray(x))), x.sum(dtype=np.float64), rtol=1e-5)
    grad = jax.grad(lambda v: q.fixed_order_sum(v, True).sum())(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(grad), np.ones(shape, np.float32))


def test_xnor_weight_scale_is_the_least_squares_optimum():
    rng = np.random.default_rng(3)
    w = rng.normal(size=(50, 7)).astype(np.float32)
    alpha = np.asarray(q.xnor_weight_scale(jnp.asarray(w)))
    np.testing.assert_allclose(alpha, np.abs(w).mean(0), rtol=1e-6)
    b = np.where(w >= 0, 1.0, -1.0)
    err = lambda s: ((w - s * b) ** 2).sum(0)  # noqa: E731
    assert np.all(err(alpha) < err(alpha * 1.05)) and np.all(err(alpha) < err(alpha * 0.95))


def test_ternary_weight_scale_averages_the_kept_weights():
    w = jnp.array([[0.9, -0.05], [-0.5, 0.02], [0.01, -0.7]], jnp.float32)
    t = q.ternarize(w, 0.1, -0.1)
    np.testing.assert_allclose(np.asarray(q.ternary_weight_scale(w, t)), [(0.9 + 0.5) / 2, 0.7], rtol=1e-6)


def test_xnor_input_scale_conv_matches_a_box_filter_of_the_channel_mean():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 7, 6, 3)).astype(np.float32)
    k = np.asarray(q.xnor_input_scale_conv(jnp.asarray(x), (3, 3), (2, 2), ((1, 1), (1, 1))))
    a = np.pad(np.abs(x).mean(-1), ((0, 0), (1, 1), (1, 1)))
    expected = np.array([[[a[n, i:i + 3, j:j + 3].mean() for j in range(0, 6, 2)] for i in range(0, 7, 2)]
                         for n in range(2)])
    np.testing.assert_allclose(k[..., 0], expected, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(q.xnor_input_scale_dense(jnp.asarray(x[0, 0]))),
                               np.abs(x[0, 0]).mean(-1, keepdims=True), rtol=1e-6)


def test_quantizers_work_under_jit_and_registry_rejects_unknown_names():
    x = _points()
    np.testing.assert_array_equal(np.asarray(jax.jit(q.sign_ste)(x)), np.asarray(q.binarize(x)))
    assert q.get_quantizer("ternarize_ste").domain == "ternary"
    with pytest.raises(ValueError, match="unknown quantizer"):
        q.get_quantizer("sign")


@pytest.mark.parametrize("fn, parameter", [(q.sign_ste, 2.0), (q.ste_heaviside, 2.0), (q.swish_sign, 3.0)])
def test_a_quantizer_s_parameter_may_be_an_argument_of_a_jitted_function(fn, parameter):
    x = jnp.asarray([0.5, -1.5, 1.9, 2.5], jnp.float32)
    np.testing.assert_array_equal(jax.jit(fn)(x, parameter), fn(x, parameter))
    np.testing.assert_array_equal(jax.jit(jax.grad(lambda v, c: fn(v, c).sum()))(x, parameter),
                                  jax.grad(lambda v: fn(v, parameter).sum())(x))


def test_quantizer_gradients_of_python_floats():
    for fn in (q.sign_ste, q.approx_sign, q.swish_sign, q.ste_heaviside):
        assert np.isfinite(float(jax.grad(fn)(0.5)))
    assert float(jax.grad(q.sign_ste)(0.5)) == 1.0


def test_ternarize_gradient_is_summed_back_to_x_where_thresholds_have_more_axes():
    x = jnp.asarray([-0.8, 0.1, 0.9], jnp.float32)
    alpha = jnp.full((2, 3), 0.5, jnp.float32)
    grad = jax.grad(lambda v: q.ternarize_ste(v, alpha, -0.5).sum())(x)
    assert grad.shape == x.shape
    # per row: (1[|x - alpha| <= 1] + 1[|x - beta| <= 1]) / 2 = [1, 2, 1] / 2; two rows
    np.testing.assert_array_equal(grad, [1.0, 2.0, 1.0])


def test_ternarize_compares_subnormals_as_numbers_as_binarize_does():
    # XLA's CPU flushes subnormals to zero in a float comparison; the bits must not depend on the platform
    x = np.asarray([-1e-40, 1e-40, -1e-45, 1e-45, 0.0, -0.0], np.float32)
    expected = [-1, 1, -1, 1, 0, 0]
    np.testing.assert_array_equal(q.ternarize(jnp.asarray(x), 0.0, 0.0), expected)
    np.testing.assert_array_equal(jax.jit(q.ternarize_ste)(jnp.asarray(x), 0.0, 0.0), expected)
    np.testing.assert_array_equal(q.ternarize(jnp.asarray(x), jnp.float32(1e-41), jnp.float32(-1e-41)),
                                  [-1, 1, 0, 0, 0, 0])


def test_ternarize_converts_the_thresholds_to_x_s_dtype():
    x = jnp.asarray([0.30005], jnp.float16)  # float16(0.3) is float16(0.30005)
    assert int(q.ternarize(x, 0.3, -0.3)[0]) == int(q.ternarize(x, np.float32(0.3), -0.3)[0]) == 0


@pytest.mark.parametrize("fn, factor", [(lambda w: q.twn_thresholds(w)[0], 0.7),
                                        (lambda w: q.twn_thresholds(w, 1.0, per_channel=True)[0], 1.0),
                                        (q.xnor_weight_scale, 1.0)])
def test_weight_means_of_integer_and_float16_weights(fn, factor):
    np.testing.assert_allclose(fn(jnp.asarray([[2], [4], [6]], jnp.int32)), factor * 4.0, rtol=1e-6)
    ones = jnp.ones((70000, 1), jnp.float16)  # a float16 sum of these overflows
    assert fn(ones).dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(fn(ones), np.float32), np.float32(np.float16(factor)))


def test_weight_means_refuse_scalars_and_take_empty_channel_axes():
    for fn in (q.twn_thresholds, q.xnor_weight_scale):
        with pytest.raises(ValueError, match="at least one axis"):
            fn(jnp.float32(1.0))
    assert q.twn_thresholds(jnp.ones((3, 0)), per_channel=True)[0].shape == (0,)
    assert q.xnor_weight_scale(jnp.ones((3, 0))).shape == (0,)


def test_xnor_input_scale_conv_of_integer_images_is_a_float_map():
    x = (jnp.arange(2 * 5 * 5 * 3) % 101 - 50).astype(jnp.int8).reshape(2, 5, 5, 3)
    scale = q.xnor_input_scale_conv(x, (3, 3), (1, 1), "SAME")
    np.testing.assert_allclose(scale, q.xnor_input_scale_conv(x.astype(jnp.float32), (3, 3), (1, 1), "SAME"))


def test_ternarize_of_integers_compares_64_bit_host_thresholds_exactly():
    x = jnp.asarray([0, 5, 2**24 + 1], jnp.int32)
    np.testing.assert_array_equal(q.ternarize(x, np.int64(2**32 + 1), np.int64(-2**32)), [0, 0, 0])
    np.testing.assert_array_equal(q.ternarize(x, np.float64(2**24 + 1), -1.0), [0, 0, 0])
    np.testing.assert_array_equal(q.ternarize(x, 16777216.5, 4.5), [-1, 0, 1])


def test_ternarize_and_binarize_of_float8_values():
    x = jnp.asarray([-2.0, 0.25, 1.0, float("nan")], jnp.float8_e4m3fn)  # a format without infinities
    np.testing.assert_array_equal(q.ternarize(x, 0.5, -0.5), [-1, 0, 1, -1])
    np.testing.assert_array_equal(q.binarize(x), [-1, 1, 1, -1])


def test_xnor_input_scales_of_the_lowest_integer_level_are_its_magnitude():
    black = jnp.full((1, 3, 3, 2), -128, jnp.int8)  # the level of pixel 0
    np.testing.assert_array_equal(q.xnor_input_scale_dense(black), np.full((1, 3, 3, 1), 128.0))
    np.testing.assert_array_equal(q.xnor_input_scale_conv(black, (1, 1), (1, 1), "VALID"), np.full((1, 3, 3, 1), 128.0))


def float32_quotient(x, n):
    """x / n rounded once to the nearest float32 (ties to even), from the exact rational."""
    if not np.isfinite(x) or x == 0:
        return x / np.float32(n) if np.isfinite(x) else x
    exact = abs(fractions.Fraction(float(x)) / int(n))
    ulp = max(math.floor(math.log2(exact)) - 23, -149)
    if fractions.Fraction(2) ** (ulp + 23) > exact:  # log2 rounded up past a power of two
        ulp = max(ulp - 1, -149)
    significand = round(exact / fractions.Fraction(2) ** ulp)  # Fraction rounds half to even
    return np.float32(math.copysign(math.ldexp(significand, ulp), x))


def test_ternary_weight_scale_divides_correctly_rounded_on_every_platform():
    """The quotient is built from integers: what numpy's IEEE division gives, subnormals, zeros, infinities and
    NaNs included (XLA's GPU divides float32 approximately: 30000 / 300 gave 99.99999)."""
    rng = np.random.default_rng(11)
    x = np.concatenate([
        rng.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32).view(np.float32),  # every bit pattern
        rng.standard_normal(2000).astype(np.float32) * np.float32(1e-39),  # subnormal quotients
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 30000.0, 1.0, 3.0, np.finfo(np.float32).max,
                  np.finfo(np.float32).smallest_subnormal, 11938259.0], np.float32)])
    n = np.concatenate([rng.integers(1, [2**31 - 1, 2**24, 1000], (2000, 3)).reshape(-1),
                        rng.integers(1, 100, 10), [2147482119]]).astype(np.int32)  # float64 rounds that one twice
    got = np.asarray(jax.jit(q._divide_by_count)(jnp.asarray(x), jnp.asarray(n)))
    want = np.array([float32_quotient(a, b) for a, b in zip(x, n)], np.float32)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), list(zip(x[~same][:5], n[~same][:5], got[~same][:5], want[~same][:5]))
    w = jnp.asarray(rng.standard_normal((300, 4)).astype(np.float32))
    grad = jax.grad(lambda w: q.ternary_weight_scale(w, jnp.ones_like(w)).sum())(w)
    np.testing.assert_allclose(np.asarray(grad), np.sign(np.asarray(w)) / 300, rtol=1e-6)  # d mean|w| / dw


def test_ternary_weight_scale_ignores_infinite_weights_that_ternarize_to_zero():
    w = jnp.array([[np.inf, 2.0], [2.0, np.nan], [2.0, 3.0]], jnp.float32)
    t = jnp.array([[0, 1], [1, 0], [1, -1]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(q.ternary_weight_scale(w, t)), [2.0, 2.5])


def test_ternary_weight_scale_of_integer_and_float16_weights():
    ones = jnp.ones((70000, 2), jnp.float16)  # a float16 sum of these overflows
    np.testing.assert_array_equal(np.asarray(q.ternary_weight_scale(ones, ones), np.float32), [1.0, 1.0])
    hundreds = jnp.full((300, 2), 100, jnp.int8)  # an int8 sum wraps
    np.testing.assert_array_equal(q.ternary_weight_scale(hundreds, jnp.ones((300, 2))), [100.0, 100.0])
