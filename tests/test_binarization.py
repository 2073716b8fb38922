"""How NaN, -NaN, -0.0, +-inf and subnormals binarize (docs/formats.md, "Binary values and bits"), the same
on every path: formats.binarize on the host, eagerly and under jit, pack_bits into the native kernels, the
Flax layers' eval forward. The comparison is IEEE's: NaN compares false in either direction (bit 0, -1),
-0.0 equals 0 (bit 1, +1), a negative subnormal is below 0 even on a backend that flushes subnormals to
zero. Float images, non-finite ones included, reach the Flax model and the packed runtime as the pixels
formats.quantize_images makes of them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxbnn import formats, ops, packed_model, reference, runtime
from jaxbnn import layers as L
from jaxbnn.export import export_model
from zoo_cases import zoo_model

SPECIALS = np.array([np.nan, -np.nan, -0.0, 0.0, np.inf, -np.inf, 1e-45, -1e-45, -1.17e-38, 1.0, -2.0],
                    np.float32)
AT_LEAST_ZERO = np.array([0, 0, 1, 1, 1, 0, 1, 0, 0, 1, 0], bool)  # bit of x >= 0
AT_MOST_ZERO = np.array([0, 0, 1, 1, 0, 1, 0, 1, 1, 0, 1], bool)  # bit of x <= 0 (flip)
SIGNS = np.where(AT_LEAST_ZERO, 1, -1)


@pytest.mark.parametrize("where", ["host", "device", "jit"])
def test_binarize_special_values(where):
    run = {"host": lambda f, *a: f(*a), "device": lambda f, x, *a: f(jnp.asarray(x), *a),
           "jit": lambda f, *a: jax.jit(f)(*a)}[where]
    np.testing.assert_array_equal(np.asarray(run(formats.binarize, SPECIALS)), AT_LEAST_ZERO)
    np.testing.assert_array_equal(np.asarray(run(lambda x: formats.binarize(x, 0.0, True), SPECIALS)), AT_MOST_ZERO)
    nan_threshold = run(lambda x: formats.binarize(x, np.float32(np.nan), x > 0), SPECIALS)
    np.testing.assert_array_equal(np.asarray(nan_threshold), False)  # a NaN threshold clears every bit


def test_host_and_device_operands_give_the_same_bits():
    """Wherever x, threshold and flip live: a float x against the threshold in x's dtype (a host float16 x and a
    float32 threshold that rounds to 0 in float16); a 64-bit host x against a device threshold, not narrowed; a
    bool x against an integer threshold beyond int32, not wrapped; a host bfloat16 x taken."""
    import ml_dtypes

    cases = [
        (np.float16([0.0]), np.float32([1e-45]), None),
        (np.float32([0.1]), np.float64([0.1]), np.array([True])),
        (np.array([2**63 - 1, 2**40, -(2**40)]), np.array([5, 5, 5], np.int32), np.array([False, True, False])),
        (np.array([True, False, True]), np.array([2**40, -(2**40), 1]), None),
        (np.array([1.0, -1.0, 0.0], ml_dtypes.bfloat16), np.float32([0.0, 0.0, 0.0]), None),
    ]
    for x, threshold, flip in cases:
        want = np.asarray(formats.binarize(x, threshold, flip))  # every operand on the host
        exact = np.where(flip, x.astype(np.float64) <= threshold.astype(np.float64), x.astype(np.float64) >=
                         threshold.astype(np.float64)) if x.dtype.kind in "iub" else want
        np.testing.assert_array_equal(want, exact, err_msg=str(x.dtype))
        for moved, original in (((jnp.asarray(x), threshold, flip), x), ((x, jnp.asarray(threshold), flip), threshold)):
            if formats._narrowed_by_jax(original.dtype):
                continue  # a 64-bit array on the device is already narrowed: not the same value
            got = formats.binarize(*moved) if flip is not None else formats.binarize(*moved[:2])
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=str((x.dtype, threshold.dtype)))
    with pytest.raises(TypeError, match="would be narrowed"):
        jax.jit(lambda t: formats.binarize(np.array([2**40]), t))(jnp.int32(1))


@pytest.mark.parametrize("where", ["host", "device", "jit"])
def test_integers_against_float_thresholds_compare_exactly(where):
    """x >= t as x >= ceil(t), x <= t as x <= floor(t): an int32 beyond float32's 24-bit mantissa is not rounded
    to a float (2**24 + 1 against 2**24 + 0.5 is above it); past the ends of x's type and at +-inf the threshold
    decides alone; NaN clears the bit either way; a bool x is 0 / 1."""
    big = 2**24 + 1
    x = np.array([big, big, -(2**31), 2**31 - 1, 7, 7, 7, 7, 1, 0], np.int32)
    t = np.array([big - 0.5, big - 0.5, -2.0**31 - 4096, 2.0**31, np.inf, -np.inf, np.nan, 6.999, 0.5, 0.5])
    at_least = np.array([1, 1, 1, 0, 0, 1, 0, 1, 1, 0], bool)
    at_most = np.array([0, 0, 0, 1, 1, 0, 0, 0, 0, 1], bool)
    run = {"host": lambda f, *a: f(*a), "device": lambda f, x, *a: f(jnp.asarray(x), *a),
           "jit": lambda f, *a: jax.jit(f)(*a)}[where]
    for threshold in (t, t.astype(np.float32)):
        exact = np.asarray([float(v) for v in threshold])
        want_at_least = np.array([x_ >= t_ for x_, t_ in zip(x.tolist(), exact.tolist())])
        want_at_most = np.array([x_ <= t_ for x_, t_ in zip(x.tolist(), exact.tolist())])
        np.testing.assert_array_equal(np.asarray(run(formats.binarize, x, threshold)), want_at_least)
        np.testing.assert_array_equal(np.asarray(run(lambda a, b: formats.binarize(a, b, True), x, threshold)),
                                      want_at_most)
    np.testing.assert_array_equal(np.asarray(run(formats.binarize, x, t)), at_least)
    np.testing.assert_array_equal(np.asarray(run(lambda a, b: formats.binarize(a, b, True), x, t)), at_most)
    np.testing.assert_array_equal(np.asarray(run(formats.binarize, np.array([True, False]), np.float32(0.5))),
                                  [True, False])
    if where == "host":  # a 64-bit integer on the host: not rounded to float64 either
        np.testing.assert_array_equal(np.asarray(formats.binarize(np.array([2**62 + 1]), np.float64(2.0**62))), True)
        np.testing.assert_array_equal(np.asarray(formats.binarize(np.array([2**62 + 1]), np.float64(2.0**62), True)),
                                      False)


def test_complex_values_are_refused():
    for x, threshold in ((np.array([1 + 1j]), 0), (jnp.array([1.0]), np.array([0j]))):
        with pytest.raises(TypeError, match="must be numeric"):
            formats.binarize(x, threshold)


def test_special_values_through_pack_bits_and_the_native_kernels():
    rng = np.random.default_rng(0)
    w = np.where(rng.random((SPECIALS.size, 9)) < 0.5, 1.0, -1.0).astype(np.float32)
    dense = formats.pack_dense_weights(w)
    for x in (SPECIALS[None], jnp.asarray(SPECIALS[None])):
        a = ops.pack_bits(x)
        np.testing.assert_array_equal(np.asarray(ops.unpack_bits(a, SPECIALS.size))[0], SIGNS)
        np.testing.assert_array_equal(np.asarray(ops.bmm(a, dense))[0], SIGNS @ w)
        np.testing.assert_array_equal(np.asarray(reference.bmm(a, dense.bits, SPECIALS.size, 9))[0], SIGNS @ w)


def test_the_flax_layer_eval_forward_binarizes_the_same_way():
    layer = L.BinaryLinear(SPECIALS.size, 5, mode="bnn", rngs=nnx.Rngs(0))
    layer.eval()
    kernel_signs = np.where(np.asarray(layer.kernel[...]) >= 0, 1, -1)
    np.testing.assert_array_equal(np.asarray(layer(jnp.asarray(SPECIALS[None])))[0], SIGNS @ kernel_signs)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: layer(x))(SPECIALS[None]))[0], SIGNS @ kernel_signs)


@pytest.mark.parametrize("name", ["mnist-mlp", "mnist-conv"])
def test_non_finite_float_images_are_pixels_to_the_runtime_and_the_flax_model(tmp_path, name):
    """Float images reach both models as the pixels formats.quantize_images makes of them (NaN and -inf
    pixel 0, +inf 255, -0.0 like 0.0), so the packed logits are the Flax model's eval logits on them."""
    model = zoo_model(name, "bnn", {})
    path = tmp_path / "m.jbnn"
    packed_model.save(path, export_model(model))
    net = runtime.load(path)
    values = np.array([np.nan, -np.nan, -0.0, np.inf, -np.inf], np.float32)
    images = np.broadcast_to(values[:, None, None, None], (len(values), *model.input_shape)).copy()
    images[:, 0, 0, 0] = 1.0  # one ordinary pixel in each
    pixels = np.asarray(formats.quantize_images(images, net.input_range))
    np.testing.assert_array_equal(pixels[:, 1, 1, 0], [0, 0, 128, 255, 0])
    assert (pixels[:, 0, 0, 0] == 255).all()
    with pytest.warns(runtime.InputRangeWarning, match=r"these span \[nan, nan\]"):
        logits = np.asarray(net(images))
    assert np.isfinite(logits).all()
    flax_logits = np.asarray(model(formats.quantize_images(images)))
    np.testing.assert_allclose(logits, flax_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(logits, np.asarray(net(pixels)))
    with pytest.raises(TypeError, match="uint8"):  # the Flax model takes pixels, never floats
        model(jnp.asarray(images))
