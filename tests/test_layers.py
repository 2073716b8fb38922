"""Binary/ternary layers: exact integer pre-activations, padding values, modes, clipping, injection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxbnn import layers as L
from jaxbnn import quantizers as q


def _normal(seed, shape, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).normal(0, scale, shape).astype(np.float32))


def _sign(a):
    return np.where(np.asarray(a) >= 0, 1, -1).astype(np.int64)


def _conv_int(x_int, w_int, stride, pads, fill):
    """Integer NHWC/HWIO convolution by explicit loops over output pixels (the spec for BinaryConv)."""
    (pt, pb), (pl, pr) = pads
    x = np.pad(x_int, ((0, 0), (pt, pb), (pl, pr), (0, 0)), constant_values=fill)
    kh, kw, _, o = w_int.shape
    oh = (x.shape[1] - kh) // stride + 1
    ow = (x.shape[2] - kw) // stride + 1
    out = np.zeros((x.shape[0], oh, ow, o), np.int64)
    for i in range(oh):
        for j in range(ow):
            patch = x[:, i * stride:i * stride + kh, j * stride:j * stride + kw, :]
            out[:, i, j, :] = np.tensordot(patch, w_int, axes=([1, 2, 3], [0, 1, 2]))
    return out


def test_bnn_linear_equals_the_integer_dot_product_exactly():
    k = 1000  # odd sizes: not a multiple of 32 or 128
    layer = L.BinaryLinear(k, 37, mode="bnn", rngs=nnx.Rngs(0))
    x = _normal(1, (3, k))
    y = np.asarray(layer(x))
    expected = _sign(x) @ _sign(layer.kernel[...])
    np.testing.assert_array_equal(y, expected.astype(np.float32))
    assert np.all(y == np.round(y)) and np.any(y != 0)


def test_xnor_scaling_multiplies_the_integer_dot_by_mean_abs_weight():
    layer = L.BinaryLinear(45, 9, mode="bnn", xnor_scaling=True, rngs=nnx.Rngs(1))
    x = _normal(2, (4, 45))
    w = np.asarray(layer.kernel[...])
    expected = (_sign(x) @ _sign(w)) * np.abs(w).mean(0)
    np.testing.assert_allclose(np.asarray(layer(x)), expected, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(layer.kernel_scale()), np.abs(w).mean(0), rtol=1e-6)


def test_xnor_input_scaling_dense():
    layer = L.BinaryLinear(20, 6, mode="bnn", input_scaling=True, rngs=nnx.Rngs(1))
    x = _normal(3, (5, 20))
    expected = (_sign(x) @ _sign(layer.kernel[...])) * np.abs(np.asarray(x)).mean(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(layer(x)), expected, rtol=1e-6)


@pytest.mark.parametrize("padding_value,fill", [("zero", 0), ("one", -1)])
@pytest.mark.parametrize("stride,padding", [(1, "SAME"), (2, "SAME"), (2, "VALID"), (1, ((2, 0), (1, 3)))])
def test_bnn_conv_matches_integer_convolution_with_its_padding_value(padding_value, fill, stride, padding):
    layer = L.BinaryConv(35, 11, 3, stride, padding=padding, padding_value=padding_value, rngs=nnx.Rngs(2))
    x = _normal(4, (2, 7, 6, 35))
    pads = layer.explicit_padding(7, 6)
    expected = _conv_int(_sign(x), _sign(layer.kernel[...]), stride, pads, fill)
    np.testing.assert_array_equal(np.asarray(layer(x)), expected.astype(np.float32))


def test_one_and_zero_padding_differ_only_at_the_border():
    kwargs = dict(rngs=nnx.Rngs(3))
    zero = L.BinaryConv(8, 4, 3, padding_value="zero", **kwargs)
    one = L.BinaryConv(8, 4, 3, padding_value="one", rngs=nnx.Rngs(3))
    x = _normal(5, (1, 6, 6, 8))
    dz, do = np.asarray(zero(x)), np.asarray(one(x))
    np.testing.assert_array_equal(dz[:, 1:-1, 1:-1], do[:, 1:-1, 1:-1])
    assert np.any(dz[:, 0] != do[:, 0])


@pytest.mark.parametrize("mode", ["tnn", "tbn", "btn"])
def test_ternary_modes_compute_integer_dot_products_of_their_operands(mode):
    layer = L.BinaryLinear(64, 10, mode=mode, rngs=nnx.Rngs(4))
    x = _normal(6, (3, 64))
    xq, wq = np.asarray(layer.quantize_input(x)), np.asarray(layer.quantized_kernel())
    act, weight = L.MODES[mode]
    assert set(np.unique(xq)) <= ({-1.0, 0.0, 1.0} if act == "ternary" else {-1.0, 1.0})
    assert set(np.unique(wq)) <= ({-1.0, 0.0, 1.0} if weight == "ternary" else {-1.0, 1.0})
    if act == "ternary":
        np.testing.assert_array_equal(xq, np.asarray(q.ternarize(x, 0.5, -0.5)))
    if weight == "ternary":
        w = np.asarray(layer.kernel[...])
        delta = 0.7 * np.abs(w).mean()
        np.testing.assert_array_equal(wq, (w > delta).astype(np.float32) - (w < -delta))
        assert np.any(wq == 0)
    np.testing.assert_array_equal(np.asarray(layer(x)), xq.astype(np.int64) @ wq.astype(np.int64))


def test_ternary_conv_pads_quantized_input_with_minus_one():
    layer = L.BinaryConv(5, 3, 3, mode="tnn", padding_value="one", kernel_threshold="twn_channel",
                         rngs=nnx.Rngs(5))
    x = _normal(7, (2, 5, 5, 5))
    xq = np.asarray(layer.quantize_input(x)).astype(np.int64)
    wq = np.asarray(layer.quantized_kernel()).astype(np.int64)
    expected = _conv_int(xq, wq, 1, ((1, 1), (1, 1)), -1)
    np.testing.assert_array_equal(np.asarray(layer(x)), expected)
    alpha, _ = layer.kernel_thresholds()
    assert alpha.shape == (3,)


@pytest.mark.parametrize("mode", sorted(L.MODES))
def test_layer_shapes_in_every_mode(mode):
    lin = L.BinaryLinear(30, 7, mode=mode, rngs=nnx.Rngs(0))
    assert lin(_normal(0, (4, 30))).shape == (4, 7)
    assert lin(_normal(0, (2, 3, 30))).shape == (2, 3, 7)
    conv = L.BinaryConv(3, 5, (3, 5), (2, 1), mode=mode, rngs=nnx.Rngs(0))
    assert conv(_normal(1, (2, 9, 8, 3))).shape == (2, 5, 8, 5)
    assert lin.mode == mode and conv.mode == mode


def test_learned_thresholds_receive_gradients():
    layer = L.BinaryLinear(16, 4, mode="tnn", input_threshold="learned", kernel_threshold="learned",
                           rngs=nnx.Rngs(6))
    x = _normal(8, (8, 16))
    grads = nnx.grad(lambda m: jnp.sum(m(x) * jnp.arange(4.0)))(layer)
    for name in ("input_alpha", "input_beta", "kernel_alpha", "kernel_beta", "kernel"):
        assert np.any(np.asarray(getattr(grads, name)[...]) != 0), name
    assert layer.input_alpha.shape == (16,) and layer.kernel_alpha.shape == (4,)


def test_ste_masks_input_gradient_outside_the_clip_range():
    layer = L.BinaryLinear(10, 3, rngs=nnx.Rngs(7))
    x = jnp.linspace(-2.0, 2.0, 10)[None, :]
    gx = jax.grad(lambda v: jnp.sum(layer(v)))(x)
    outside = np.abs(np.asarray(x)) > 1
    assert np.all(np.asarray(gx)[outside] == 0) and np.all(np.asarray(gx)[~outside] != 0)


def test_clip_latent_weights_keeps_kernels_in_range():
    binary = L.BinaryLinear(6, 4, rngs=nnx.Rngs(0))
    floating = L.BinaryLinear(6, 4, mode="float", rngs=nnx.Rngs(0))
    big = _normal(9, (6, 4), scale=5.0)
    binary.kernel[...] = big
    floating.kernel[...] = big
    model = nnx.List([binary, floating])
    L.clip_latent_weights(model)
    np.testing.assert_array_equal(np.asarray(binary.kernel[...]), np.clip(np.asarray(big), -1, 1))
    np.testing.assert_array_equal(np.asarray(floating.kernel[...]), np.asarray(big))  # float weights: no clip


def test_binary_dot_general_injected_into_nnx_linear():
    dense = nnx.Linear(50, 6, dot_general=L.binary_dot_general, rngs=nnx.Rngs(0))
    x = _normal(10, (3, 50))
    expected = _sign(x) @ _sign(dense.kernel[...]) + np.asarray(dense.bias[...])
    np.testing.assert_allclose(np.asarray(dense(x)), expected, rtol=1e-6)
    grads = nnx.grad(lambda m: jnp.sum(m(x)))(dense)
    assert np.any(np.asarray(grads.kernel[...]) != 0)


def test_binary_conv_general_dilated_injected_into_nnx_conv_matches_binary_conv():
    conv = nnx.Conv(4, 5, (3, 3), strides=2, use_bias=False,
                    conv_general_dilated=L.binary_conv_general_dilated, rngs=nnx.Rngs(0))
    ours = L.BinaryConv(4, 5, 3, 2, padding_value="zero", rngs=nnx.Rngs(1))
    ours.kernel[...] = conv.kernel[...]
    x = _normal(11, (2, 7, 7, 4))
    np.testing.assert_array_equal(np.asarray(conv(x)), np.asarray(ours(x)))


def test_binary_dot_general_in_linen_dense():
    import flax.linen as linen

    dense = linen.Dense(5, use_bias=False, dot_general=L.binary_dot_general)
    x = _normal(12, (2, 9))
    params = dense.init(jax.random.key(0), x)
    expected = _sign(x) @ _sign(params["params"]["kernel"])
    np.testing.assert_array_equal(np.asarray(dense.apply(params, x)), expected)


def test_ternary_drop_in_needs_explicit_thresholds():
    import functools

    with pytest.raises(ValueError, match="thresholds"):
        L.make_binary_dot_general("ternarize_ste")
    dot = L.make_binary_dot_general(functools.partial(q.ternarize_ste, alpha=0.5, beta=-0.5), "sign_ste")
    x, w = _normal(13, (2, 8)), _normal(14, (8, 3))
    expected = np.asarray(q.ternarize(x, 0.5, -0.5)).astype(np.int64) @ _sign(w)
    np.testing.assert_array_equal(np.asarray(dot(x, w, (((1,), (0,)), ((), ())))), expected)


def test_bad_configurations_and_inputs_are_refused():
    with pytest.raises(ValueError, match="unknown mode"):
        L.BinaryLinear(4, 4, mode="xnor", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs quantized activations"):
        L.BinaryConv(3, 4, 3, mode="bwn", padding_value="one", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="produces ternary values"):
        L.BinaryLinear(4, 4, mode="bnn", input_quantizer="ternarize_ste", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="heaviside"):
        L.BinaryLinear(4, 4, mode="bnn", kernel_quantizer="ste_heaviside", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="padding_value"):
        L.BinaryConv(3, 4, 3, padding_value="reflect", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="expects 4 input features"):
        L.BinaryLinear(4, 4, rngs=nnx.Rngs(0))(jnp.ones((2, 5)))
    with pytest.raises(ValueError, match="NHWC"):
        L.BinaryConv(3, 4, 3, rngs=nnx.Rngs(0))(jnp.ones((2, 5, 5, 4)))


@pytest.mark.parametrize("build, message", [
    (lambda r: L.BinaryLinear(0, 4, rngs=r), "in_features must be a positive int, got 0"),
    (lambda r: L.BinaryConv(3, -1, 3, rngs=r), "out_features must be a positive int, got -1"),
    (lambda r: L.BinaryConv(3, 4, 0, rngs=r), "kernel_size must be a positive int or a pair of them, got 0"),
    (lambda r: L.BinaryConv(3, 4, 3.0, rngs=r), "kernel_size must be a positive int or a pair of them, got 3.0"),
    (lambda r: L.BinaryConv(3, 4, True, rngs=r), "kernel_size must be a positive int or a pair of them, got True"),
    (lambda r: L.BinaryConv(3, 4, 3, (1, 0), rngs=r),
     r"strides must be a positive int or a pair of them, got \(1, 0\)"),
    (lambda r: L.BinaryLinear(3, 4, mode=[], rngs=r), r"unknown mode \[\]"),
    (lambda r: L.BinaryLinear(3, 4, kernel_clip=0, rngs=r),
     "kernel_clip must be a positive finite number within float32's range, or None; got 0"),
    (lambda r: L.BinaryLinear(3, 4, kernel_clip=10**400, rngs=r), "kernel_clip must be a positive finite number"),
    (lambda r: L.BinaryLinear(3, 4, kernel_clip=1e-50, rngs=r), "kernel_clip must be a positive finite number"),
    (lambda r: L.BinaryLinear(3, 4, mode="tnn", kernel_delta=-0.7, rngs=r),
     "kernel_delta must be a finite number >= 0 within float32's range, got -0.7"),
    (lambda r: L.BinaryLinear(3, 4, mode="tbn", input_delta=float("nan"), rngs=r),
     "input_delta must be a finite number >= 0 within float32's range, got nan"),
    # float32 would make these thresholds infinite: every weight would ternarize to 0
    (lambda r: L.BinaryLinear(3, 4, mode="btn", kernel_threshold="fixed", kernel_delta=1e300, rngs=r),
     "kernel_delta must be a finite number >= 0 within float32's range, got 1e\\+300"),
    (lambda r: L.BinaryLinear(3, 4, mode="tnn", kernel_delta=10**400, rngs=r), "kernel_delta must be a finite number"),
    (lambda r: L.BinaryLinear(3, 4, use_bias="False", rngs=r), "use_bias must be True or False, got 'False'"),
    (lambda r: L.BinaryConv(3, 4, 3, xnor_scaling=1, rngs=r), "xnor_scaling must be True or False, got 1"),
    (lambda r: L.BinaryConv(3, 4, 3, input_scaling="no", rngs=r), "input_scaling must be True or False, got 'no'"),
    (lambda r: L.BinaryConv(3, 4, 3, padding=((1.5, 0), (0, 0)), rngs=r),
     r"padding must be 'SAME', 'VALID' or \(\(top, bottom\), \(left, right\)\) of ints >= 0; got \(\(1.5, 0\)"),
    (lambda r: L.BinaryConv(3, 4, 3, padding=((True, False), (0, 0)), rngs=r), "padding must be"),
    (lambda r: L.BinaryConv(3, 4, 3, padding=(("1", "1"), (0, 0)), rngs=r), "padding must be"),
    (lambda r: L.BinaryConv(3, 4, 3, padding=1, rngs=r), "padding must be"),
    (lambda r: L.BinaryConv(3, 4, 3, padding=None, rngs=r), "padding must be"),
    (lambda r: L.BinaryConv(3, 4, 3, padding=((1, -1), (0, 0)), rngs=r), "padding must be"),
    (lambda r: L.BinaryConv(3, 4, 3, padding=((1, 1),), rngs=r), "padding must be"),
])
def test_layer_settings_are_checked_when_the_layer_is_built(build, message):
    with pytest.raises(ValueError, match=message):
        build(nnx.Rngs(0))


def test_explicit_padding_of_numpy_ints_is_kept_as_python_ints():
    conv = L.BinaryConv(3, 4, 3, padding=[(np.int64(1), 0), [0, np.int32(2)]], rngs=nnx.Rngs(0))
    assert conv.padding == ((1, 0), (0, 2)) and all(type(p) is int for pair in conv.padding for p in pair)


def test_clip_latent_weights_refuses_what_is_not_a_module():
    with pytest.raises(TypeError, match="takes an nnx.Module, got str"):
        L.clip_latent_weights("not a model")


@pytest.mark.parametrize("dtype, k", [(jnp.bfloat16, 301), (jnp.float16, 2049), (jnp.int8, 300)])
def test_binary_dot_general_is_exact_with_a_wide_preferred_element_type(dtype, k):
    """In lax's result type narrow operands round or wrap the sums (as documented); a wide one is exact."""
    lhs, rhs = jnp.ones((1, k), dtype), jnp.ones((k, 1), dtype)
    wide = jnp.int32 if jnp.issubdtype(dtype, jnp.integer) else jnp.float32
    dims = (((1,), (0,)), ((), ()))
    assert int(L.binary_dot_general(lhs, rhs, dims, preferred_element_type=wide)[0, 0]) == k
    assert int(L.binary_dot_general(lhs, rhs, dims)[0, 0].astype(jnp.float32)) != k


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("mode", ["bwn", "bnn", "tnn"])
def test_a_conv_takes_any_real_input_type_as_a_linear_layer_does(dtype, mode):
    """int8 image levels reach a first layer in bwn (no input quantizer): operands promoted as dot_general
    promotes them, the same values as from float32."""
    x = jnp.asarray(np.random.default_rng(0).integers(-3, 4, (2, 6, 6, 2))).astype(dtype)
    conv = L.BinaryConv(2, 4, 3, mode=mode, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(conv(x), np.float32), np.asarray(conv(x.astype(jnp.float32))))
