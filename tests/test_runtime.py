"""The inference runtime: uint8 pixels in (floats quantized on the scale the file records), one jitted
function over the packed parameters, packed activations between layers, every node's integers as the
format defines them, the custom calls in the compiled program, clear errors, and no dependency on export/
or train/."""

import re
import subprocess
import sys
import tracemalloc
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxbnn.export import export_model, fidelity_report
from jaxbnn import _ffi, formats, packed_model, runtime
from jaxbnn.models import build_model
from zoo_cases import images_for, zoo_model


@pytest.fixture(scope="module")
def conv_model():
    model = build_model("mnist-conv", "bnn", input_shape=(12, 12, 1), num_classes=10, width=0.25, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(3)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.BatchNorm):
            module.mean[...] = jnp.asarray(rng.normal(size=module.num_features), jnp.float32)
            module.scale[...] = jnp.asarray(rng.normal(size=module.num_features), jnp.float32)
    model.eval()
    return model


@pytest.fixture(scope="module")
def net(conv_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("packed") / "conv.jbnn"
    packed_model.save(path, export_model(conv_model))
    return runtime.load(path)


def pixels(count, seed=0, shape=(12, 12, 1)):
    return np.random.default_rng(seed).integers(0, 256, size=(count, *shape), dtype=np.uint8)


def images(count, seed=0, shape=(12, 12, 1)):
    """Float images on the scale [-1, 1] the test files record."""
    return np.random.default_rng(seed).uniform(-1, 1, size=(count, *shape)).astype(np.float32)


def test_logits_and_predictions(net, conv_model):
    """uint8 pixels in: the Flax model's eval logits (both integer up to the classifier's float32 affine)."""
    x = pixels(7, seed=1)
    logits = np.asarray(net(x))
    assert logits.shape == (7, 10) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, np.asarray(conv_model(jnp.asarray(x))), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(net.predict(x, batch_size=3), np.argmax(logits, axis=-1))


def test_activations_stay_packed_between_binary_layers(net):
    trace = net.trace(pixels(2))
    nodes = net.graph["nodes"]
    for node, out in zip(nodes[:-1], trace[:-1]):
        assert node["output"] == "binary"
        assert out.dtype == jnp.uint32, node["name"]
        assert out.shape == (2, *node["out_shape"][:-1], formats.num_words(node["out_channels"])), node["name"]
    assert trace[-1].dtype == jnp.float32


def test_one_batch_row_at_a_time_gives_the_same_logits(net):
    x = pixels(5, seed=2)
    whole = np.asarray(net(x))
    for i in range(len(x)):
        np.testing.assert_array_equal(np.asarray(net(x[i:i + 1]))[0], whole[i])


def _lowered_call(net, x):
    """The program a call of `net` on uint8 `x` runs, lowered."""
    return net._call_forward.lower(*net._call_arguments(x))


def test_the_compiled_program_calls_the_native_targets_where_registered(net):
    """The program takes uint8 pixels; the first conv with its pool and thresholds is one native custom call
    (or, without the module, the spec's exact integer dot of the gathered taps), the layers after it the
    native custom calls."""
    text = _lowered_call(net, jnp.zeros((2, 12, 12, 1), jnp.uint8)).as_text()
    assert "tensor<2x12x12x1xui8>" in text
    if _ffi.has_target("cpu", "jaxbnn_image_conv2d_bits"):
        assert "jaxbnn_image_conv2d_bits" in text
    else:
        assert re.search(r"stablehlo.dot_general .*: \(tensor<2x12x12x9xi32>, tensor<9x\d+xi32>\) -> "
                         r"tensor<2x12x12x\d+xi32>", text)
    assert "stablehlo.convolution" not in text  # no float convolution anywhere
    # convs and the dense layer on the packed image: bconv2d with the threshold epilogue; classifier: bmm affine
    for target in ("jaxbnn_bconv2d_bits", "jaxbnn_bmm_f32"):
        assert (target in text) == _ffi.has_target("cpu", target), target


@pytest.mark.parametrize("bad, error, message", [
    (np.zeros((2, 28, 28, 1), np.uint8), ValueError, r"mnist-conv takes images of shape \(batch, 12, 12, 1\), got "
                                                      r"\(2, 28, 28, 1\)"),
    (np.zeros((12, 12, 1), np.float32), ValueError, r"shape \(batch, 12, 12, 1\), got \(12, 12, 1\)"),
    (np.zeros((2, 12, 12, 1), np.int32), TypeError, r"images must be uint8 pixels \(0..255\) or floats in \[-1, 1\] "
                                                    r"\(the scale mnist-conv's file records\), got int32"),
    (np.zeros((2, 12, 12, 1), np.int8), TypeError, "got int8"),  # levels are not pixels
    (np.zeros((2, 12, 12, 1), bool), TypeError, "got bool"),
    (jnp.zeros((2, 12, 12, 1), jnp.uint16), TypeError, "got uint16"),
])
def test_bad_input_is_refused_before_lowering(net, monkeypatch, bad, error, message):
    monkeypatch.setattr(net, "_call", lambda *args: pytest.fail("the input reached the jitted forward"))
    with pytest.raises(error, match=message):
        net(bad)


def test_a_small_model_s_call_holds_its_parameters_and_takes_the_images_alone(net):
    """Below EMBEDDED_PARAMETERS_BYTES the call's executable holds the parameters as constants: its arguments
    are the images and the parameter arrays of one value, one per distinct value (each argument buffer costs the
    host time on every call)."""
    assert net.packed_bytes <= runtime.EMBEDDED_PARAMETERS_BYTES and net.embeds_parameters
    args, _ = _lowered_call(net, jnp.zeros((2, 12, 12, 1), jnp.uint8)).args_info
    assert len(jax.tree.leaves(args)) == 1 + len(net._uniform_arguments)


def test_uniform_parameters_are_arguments_of_the_call_not_broadcasts(tmp_path):
    """An untrained model's thresholds (one value a layer) and flips (none set): XLA would hold each such
    constant as a scalar broadcast on every call; the call takes them as arguments instead, one per distinct
    shape, type and value, and its compiled program broadcasts no more than the one that takes every parameter
    as an argument (the ops' own). The logits are the argument form's."""
    model = build_model("mnist-conv", "bnn", input_shape=(12, 12, 1), num_classes=10, width=0.25, rngs=nnx.Rngs(5))
    model.eval()
    path = tmp_path / "untrained.jbnn"
    packed_model.save(path, export_model(model))
    net = runtime.load(path)
    uniform = [a for a in jax.tree.leaves(net.params) if a.size > 1 and np.unique(np.asarray(a)).size == 1]
    distinct = {(a.shape, a.dtype.str, np.asarray(a).reshape(-1)[0].item()) for a in uniform}
    assert net.embeds_parameters and len(distinct) > 1
    assert len(net._uniform_arguments) == len(distinct)
    x = jnp.asarray(pixels(3, seed=6))
    arguments = runtime.load(path, embed_parameters=False)
    broadcasts = [len(re.findall(r"\bbroadcast\(", _lowered_call(n, x).compile().as_text())) for n in (net, arguments)]
    assert broadcasts[0] <= broadcasts[1]
    np.testing.assert_array_equal(np.asarray(net(x)), np.asarray(arguments(x)))


def test_only_arrays_of_one_value_in_every_byte_are_uniform():
    """Uniform means the same bytes in every element: 0.0 and -0.0 differ (a bias of -0.0 is not one of 0.0),
    NaNs of one pattern are uniform, a single element is left as it is; equal arrays share one argument."""
    params = {"zeros": np.zeros(4, np.int32), "same": np.zeros(4, np.int32), "signed": np.array([0.0, -0.0], np.float32),
              "nan": np.full(3, np.nan, np.float32), "one": np.ones(1, np.float32),
              "varied": np.arange(3, dtype=np.int32), "flips": np.zeros(4, np.uint8)}
    arguments, with_uniform = runtime._uniform_parameters(params)
    assert len(arguments) == 3  # zeros and same as one, nan, flips (the same bytes as zeros, another dtype)
    rebuilt = with_uniform(arguments)
    for name, value in params.items():
        assert np.asarray(rebuilt[name]).dtype == value.dtype
        assert np.asarray(rebuilt[name]).tobytes() == value.tobytes(), name
    assert rebuilt["signed"] is params["signed"] and rebuilt["one"] is params["one"]


def test_parameters_as_constants_or_arguments_give_the_same_logits(net, tmp_path, monkeypatch, conv_model):
    path = tmp_path / "conv.jbnn"
    packed_model.save(path, export_model(conv_model))
    monkeypatch.setattr(runtime, "EMBEDDED_PARAMETERS_BYTES", net.packed_bytes - 1)
    larger = runtime.load(path)  # past the limit: arguments
    assert not larger.embeds_parameters
    args, _ = _lowered_call(larger, jnp.zeros((2, 12, 12, 1), jnp.uint8)).args_info
    assert len(jax.tree.leaves(args)) == 1 + len(jax.tree.leaves(larger.params))
    told = runtime.load(path, embed_parameters=True)
    assert told.embeds_parameters
    x = pixels(5, seed=4)
    for other in (larger, told, runtime.load(path, embed_parameters=False)):
        np.testing.assert_array_equal(np.asarray(other(x)), np.asarray(net(x)))
        np.testing.assert_array_equal(other.predict(x, batch_size=2), net.predict(x, batch_size=2))


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_embed_parameters_takes_a_bool_or_none(net, tmp_path, conv_model, bad):
    path = tmp_path / "conv.jbnn"
    packed_model.save(path, export_model(conv_model))
    with pytest.raises(TypeError, match=f"embed_parameters must be True, False or None, got {bad!r}"):
        runtime.load(path, embed_parameters=bad)


def test_predict_refuses_a_batch_size_below_one(net):
    for batch_size in (-5, 0, 2.5, True):
        with pytest.raises(ValueError, match=f"batch_size must be a positive integer, got {batch_size!r}"):
            net.predict(images(3), batch_size=batch_size)


def test_predict_and_throughput_take_narrow_numpy_integers_as_their_values(net):
    x = pixels(300)
    want = net.predict(x, batch_size=200)
    for batch_size in (np.uint8(200), np.int16(200)):
        np.testing.assert_array_equal(net.predict(x, batch_size=batch_size), want)
    assert net.throughput(pixels(2), repeats=np.uint8(200)) > 0


def test_predict_of_bfloat16_images_quantizes_them_as_a_call_does(net):
    x = jnp.asarray(np.random.default_rng(3).uniform(-1, 1, (8, *net.input_shape)), jnp.bfloat16)
    want = np.argmax(np.asarray(net(x)), axis=-1)
    for given in (x, np.asarray(x)):
        np.testing.assert_array_equal(net.predict(given), want)
    with pytest.warns(runtime.InputRangeWarning):
        net.predict(np.asarray(pixels(2), jnp.bfloat16))


def test_a_packed_net_is_built_from_a_packed_model_only(net, tmp_path):
    for given in (str(tmp_path / "m.jbnn"), None, {"graph": {}, "tensors": {}}):
        with pytest.raises(TypeError, match="PackedNet takes a PackedModel .*jaxbnn.load\\(path\\)"):
            runtime.from_packed(given)


def test_throughput_refuses_repeats_below_one(net):
    for repeats in (-1, 0, 1.5, False):
        with pytest.raises(ValueError, match=f"repeats must be a positive integer, got {repeats!r}"):
            net.throughput(pixels(2), repeats=repeats)


def test_predict_checks_the_images_shape_and_type_even_when_there_are_none(net):
    """An empty set of images makes no call, so predict checks them itself."""
    with pytest.raises(ValueError, match=r"takes images of shape \(batch, 12, 12, 1\), got \(0, 3, 3, 3\)"):
        net.predict(np.zeros((0, 3, 3, 3), np.uint8))
    with pytest.raises(ValueError, match=r"got \(\)"):
        net.predict(np.uint8(3))
    with pytest.raises(TypeError, match="images must be uint8 pixels .* got int32"):
        net.predict(np.zeros((0, 12, 12, 1), np.int32))


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_an_empty_batch_gives_empty_logits_and_predictions(net, dtype):
    """A dense layer on a packed image flattens it: with no rows, a -1 in that reshape cannot be resolved."""
    empty = np.zeros((0, 12, 12, 1), dtype)
    assert np.asarray(net(empty)).shape == (0, 10)
    assert net.predict(empty).shape == (0,) and net.predict(empty).dtype == np.int32
    assert all(np.asarray(out).shape[0] == 0 for out in jax.tree.leaves(net.trace(empty)))


# --- the input scale: uint8 as they are, floats quantized on the scale the file records -----------------


def test_float_images_are_quantized_with_the_files_input_range(net, conv_model):
    """A float image is the uint8 image formats.quantize_images makes of it on the file's input_range, in
    a call, under the caller's jit, and in predict; the Flax model on those pixels gives the same logits."""
    assert net.input_range == (-1.0, 1.0)
    x = images(6, seed=4)
    x[0, :3, 0, 0] = [-1.0, 1.0, 0.0]  # the ends of the range and a tie (pixel 127.5 -> 128, half to even)
    quantized = formats.quantize_images(x, net.input_range)
    assert quantized.dtype == jnp.uint8
    expected = np.asarray(net(quantized))
    np.testing.assert_array_equal(np.asarray(net(x)), expected)
    np.testing.assert_array_equal(np.asarray(net(jnp.asarray(x))), expected)  # a device array
    np.testing.assert_array_equal(np.asarray(jax.jit(net)(x)), expected)  # traced
    np.testing.assert_array_equal(np.asarray(net.trace(x)[-1]), expected)
    narrow = jnp.asarray(x, jnp.bfloat16)  # a narrower float: quantized as its float32 value
    np.testing.assert_array_equal(np.asarray(net(narrow)), np.asarray(net(formats.quantize_images(narrow))))
    np.testing.assert_array_equal(net.predict(x, batch_size=4), net.predict(quantized, batch_size=4))
    np.testing.assert_allclose(expected, np.asarray(conv_model(quantized)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("input_range", [(-1.0, 1.0), (0.0, 1.0), (-0.5, 3.0)])
def test_floats_made_from_pixels_give_the_pixels_logits(conv_model, input_range):
    """low + p * (high - low) / 255 in float32 is quantized back to p on the file's scale: the same logits
    as the uint8 image, every pixel value included, and no warning."""
    net = runtime.from_packed(export_model(conv_model, input_range=input_range))
    assert net.graph["input_range"] == list(input_range) and net.input_range == input_range
    low, high = input_range
    x = pixels(3, seed=5)
    x.reshape(-1)[:256] = np.arange(256)
    floats = x.astype(np.float32) * np.float32((high - low) / 255) + np.float32(low)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(np.asarray(net(floats)), np.asarray(net(x)))


def test_floats_beyond_the_range_are_clipped_to_the_end_pixels(net):
    """Off-scale values (infinities too) are pixel 0 or 255, with the warning."""
    x = pixels(2, seed=8)
    x[0, 0, :4, 0] = [0, 0, 255, 255]
    floats = -1 + x.astype(np.float32) * np.float32(2 / 255)
    floats[0, 0, :4, 0] = [-7.0, -np.inf, 3.0, np.inf]
    with pytest.warns(runtime.InputRangeWarning):
        np.testing.assert_array_equal(np.asarray(net(floats)), np.asarray(net(x)))


@pytest.mark.parametrize("scale, message", [
    (lambda p: p.astype(np.float32),
     r"^mnist-conv takes float images in \[-1, 1\] \(quantized to pixels p = round\(\(x \+ 1\) \* 255 / 2\)\); "
     r"these span \[0, 255\]: scale them to that range, or pass the uint8 pixels$"),
    (lambda p: p.astype(np.float32) / 255, r"these span \[0, 1\]: none is negative: images scaled to \[0, 1\] "
                                           r"need -1 \+ x \* 2; or pass the uint8 pixels$"),
    (lambda p: np.full(p.shape, np.nan, np.float32), r"these span \[nan, nan\]: scale them to that range"),
    (lambda p: p.astype(np.float32) / 127.5 - 1.03, r"these span \[-1.03, 0.97\]: scale them"),  # > 1% below
])
def test_floats_off_the_files_scale_draw_a_warning_naming_it(net, scale, message):
    x = pixels(4, seed=6)
    x[:, 0, 0, 0], x[:, 0, 1, 0] = 0, 255
    with pytest.warns(runtime.InputRangeWarning, match=message) as record:
        net(scale(x))
    assert record[0].filename == __file__  # the caller's line


def test_the_warning_shows_the_files_scale(conv_model):
    """The scale and the quantization formula in the warning are the file's own."""
    net = runtime.from_packed(export_model(conv_model, input_range=(10.0, 20.0)))
    with pytest.warns(runtime.InputRangeWarning, match=r"takes float images in \[10, 20\] \(quantized to pixels p = "
                                                       r"round\(\(x - 10\) \* 255 / 10\)\); these span \[0, 1\]"):
        net(np.linspace(0, 1, 2 * 144, dtype=np.float32).reshape(2, 12, 12, 1))  # images scaled to [0, 1]


def test_predict_compiles_a_few_shapes_whatever_the_request_sizes(net):
    """A server's requests of 1 to 40 images at batch_size 16: calls of 1, 2, 4, 8 and 16 images only, each
    request's predictions those of its images one by one."""
    x = pixels(40, seed=9)
    one_by_one = np.asarray(jnp.argmax(net(x), axis=-1))
    shapes = set()
    forward = net._call_forward
    original = net._call

    def recording(chunk):
        shapes.add(chunk.shape[0])
        return original(chunk)

    net._call = recording
    try:
        for count in range(1, 41):
            got = net.predict(x[:count], batch_size=16)
            assert got.dtype == np.int32
            np.testing.assert_array_equal(got, one_by_one[:count])
    finally:
        del net._call
    assert shapes == {1, 2, 4, 8, 16} and net._call_forward is forward


def test_predict_converts_float_images_a_call_at_a_time(net, tmp_path):
    """A memory-mapped float32 set is read as the calls go, not copied whole first."""
    x = images(1024, seed=3)
    path = tmp_path / "images.f32"
    x.tofile(path)
    mapped = np.memmap(path, np.float32, mode="r", shape=x.shape)
    net.predict(mapped[:32], batch_size=32)  # compiled before measuring
    tracemalloc.start()
    try:
        got = net.predict(mapped, batch_size=32)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(got, net.predict(x, batch_size=32))
    assert peak < x.nbytes / 8, peak  # the whole set: 576 KiB; a call's images: 18 KiB


def test_predict_warns_at_the_callers_line(net):
    with pytest.warns(runtime.InputRangeWarning) as caught:
        net.predict(images(4) * 10)
    assert caught[0].filename == __file__


def test_a_packed_net_built_directly_validates_its_model(net, conv_model):
    """`PackedNet(packed)` refuses what `load` and `from_packed` refuse, rather than running it."""
    packed = export_model(conv_model)
    name = next(t for t in packed.tensors if t.endswith("weight_tap_popcount"))
    wrong = packed_model.PackedModel(graph=packed.graph, tensors={**packed.tensors, name: packed.tensors[name] + 1},
                                     target=packed.target)
    with pytest.raises(packed_model.PackedModelError, match=f"tensor '{name}' does not match"):
        runtime.PackedNet(wrong)


def test_floats_on_the_files_scale_draw_no_warning(net, conv_model):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net(images(4, seed=7))
        net.predict(images(4, seed=7))
        net.predict(images(7, seed=7), batch_size=4)
        jax.jit(net)(images(4, seed=7))  # traced values are not checked (nor can they be)
        net(images(4, seed=7) * 1.009)  # within 1% of the range's width
        # predict pads its last batch with the images' own rows, not with zeros off this file's scale
        shifted = runtime.from_packed(export_model(conv_model, input_range=(10.0, 20.0)))
        shifted.predict(images(5, seed=7) * 5 + 15, batch_size=4)


def test_a_corrupted_file_is_refused(tmp_path, conv_model):
    path = tmp_path / "m.jbnn"
    packed_model.save(path, export_model(conv_model))
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2 + 40] ^= 1
    path.write_bytes(bytes(blob))
    with pytest.raises(packed_model.PackedModelError):
        runtime.load(path)


# --- loading uses the file's tensors as they are --------------------------------------------------------

# Every node kind whose weights the file stores, in every network mode: the first layer (image operand, a
# conv or a dense over the image), convs and dense layers on a packed image (conv bit matrix, tap
# popcounts), dense layers on a packed vector (dense bit matrix, row popcounts), the ResNet stem, residual
# blocks' convs and global pooling (thresholds of the stream).
LOAD_CASES = [("mnist-conv", mode, {}) for mode in ("bnn", "tnn", "tbn", "btn")] + [
    ("mnist-mlp", "btn", {"kernel_threshold": "twn_channel"}),
    ("mnist-mlp", "tbn", {}),
    ("cifar10-resnet14", "tnn", {}),
]

# (pack_bits is not among them: a pooled threshold convolution's flip words are packed at load; the stored
# weights and thresholds are compared with the loaded ones below)
FORMAT_FUNCTIONS = ("binarize", "unpack_bits", "to_fsb", "from_fsb", "popcount", "ternary_planes",
                    "pack_ternary", "unpack_ternary", "ternary_pm_planes", "ternary_weight_signs",
                    "pack_dense_weights", "pack_conv_weights")


def _parameters_by_tensor_name(net) -> dict:
    """The loaded parameters of every node, named as the file's tensors; the threshold planes stacked at load
    (`runtime._threshold_planes`) are checked against the thresholds they stack, a pooled threshold
    convolution's flip words against its flips, and a dense first layer's kernel masks (on the CPU) against
    its kernel."""
    def linear(prefix, params):
        for key, value in params.items():
            if key == "kernel_masks":
                want = formats.image_kernel_masks(np.asarray(params["kernel"]))
                np.testing.assert_array_equal(np.asarray(value.masks), np.asarray(want.masks))
                np.testing.assert_array_equal(np.asarray(value.counts), np.asarray(want.counts))
            elif key == "flip_words":
                flip = params["flip_planes"] if "flip_planes" in params else params["flip"]
                np.testing.assert_array_equal(np.asarray(value), np.asarray(formats.pack_bits(np.asarray(flip) != 0)))
            elif key.endswith("_planes"):
                nonneg, pos = (params[key.replace("_planes", f"_{plane}")] for plane in ("nonneg", "pos"))
                np.testing.assert_array_equal(np.asarray(value), np.stack([np.asarray(nonneg), np.asarray(pos)]))
            elif isinstance(value, (formats.ConvBits, formats.TernaryConvBits)):
                yield prefix + "weight", value.bits
                yield prefix + "weight_tap_popcount", value.tap_popcount
            elif isinstance(value, (formats.DenseBits, formats.TernaryDenseBits)):
                yield prefix + "weight", value.bits
                yield prefix + "weight_popcount", value.popcount
            else:
                yield prefix + key, value

    named = {}
    for index, (node, params) in enumerate(zip(net.graph["nodes"], net.params)):
        if node["kind"] == "residual":
            for key in ("conv1", "conv2"):
                named.update(linear(f"nodes.{index}.{key}.", params[key]))
        else:
            named.update(linear(f"nodes.{index}.", params))
    return named


@pytest.mark.parametrize("name, mode, options", LOAD_CASES, ids=[f"{n}-{m}" for n, m, _ in LOAD_CASES])
def test_loading_runs_the_stored_tensors_as_they_are(tmp_path, monkeypatch, name, mode, options):
    model = zoo_model(name, mode, options)
    path = tmp_path / "model.jbnn"
    packed_model.save(path, export_model(model))
    stored = packed_model.load(path).tensors
    with monkeypatch.context() as patch:
        # the one derived operand, a platform without ternary kernels' side-by-side weights, is built from these
        # functions: test_without_ternary_kernels_the_side_by_side_weights_are_built_once_at_load covers it
        patch.setattr(runtime, "_has_native_product", lambda *_: True)
        for function in FORMAT_FUNCTIONS:
            patch.setattr(formats, function, lambda *args, _name=function, **kwargs: pytest.fail(
                f"loading called formats.{_name}: the file should hold what the ops take"))
        net = runtime.load(path)

    loaded = _parameters_by_tensor_name(net)
    assert sorted(loaded) == sorted(stored)
    for tensor, array in stored.items():
        value = np.asarray(loaded[tensor])
        # the first layer's int8 kernel too, as image_conv2d takes it; the bool flips as uint8, the handlers' dtype
        assert value.dtype == (np.uint8 if array.dtype == np.bool_ else array.dtype), tensor
        np.testing.assert_array_equal(value, array, err_msg=tensor)

    images = images_for(model, 6, seed=3)
    report = fidelity_report(model, net, images)
    assert report.exact, (report.summary(), [n for n in report.nodes if n.mismatches])
    assert report.logits_max_rel_diff <= 4e-6, report.summary()
    np.testing.assert_array_equal(net.predict(images, batch_size=4), np.argmax(np.asarray(model(images)), axis=-1))


@pytest.mark.parametrize("mode", ["bnn", "tnn"])
def test_a_dense_first_layer_on_the_cpu_holds_its_kernel_masks(mode, monkeypatch):
    """On the CPU a dense first layer of -1 / 0 / +1 weights gets its kernel's sign masks at load (the VNNI
    kernel reads them at a small batch); the logits are those of the same net without them."""
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU's forms")
    model = zoo_model("mnist-mlp", mode, {})
    packed = export_model(model)
    net = runtime.from_packed(packed)
    masks = net.params[0]["kernel_masks"]
    assert isinstance(masks, formats.ImageKernelMasks) and masks.masks.shape[0] == (1 if mode == "bnn" else 2)
    monkeypatch.setattr(runtime, "_is_ternary_valued", lambda kernel: False)
    plain = runtime.from_packed(packed)
    assert "kernel_masks" not in plain.params[0]
    for batch in (1, 3, 70):
        images = images_for(model, batch, seed=batch)
        np.testing.assert_array_equal(np.asarray(net(images)), np.asarray(plain(images)))


@pytest.mark.parametrize("mode", ["bnn", "tnn"])
def test_pooled_threshold_convolutions_keep_their_flip_words(mode):
    """A pooled conv with a threshold epilogue holds its flips' words from load (`ops.bconv2d`'s flip_words, which
    CUDA's pool of the bits reads), the planes' words for a ternary output; no other node has any."""
    net = runtime.from_packed(export_model(zoo_model("mnist-conv", mode, {})))
    pooled = 0
    for node, params in zip(net.graph["nodes"], net.params):
        if node["kind"] == "conv" and node.get("pool") and node["operand"] != "image":
            pooled += 1
            flip = params["flip_planes"] if node["output"] == "ternary" else params["flip"]
            np.testing.assert_array_equal(np.asarray(params["flip_words"]), np.asarray(formats.pack_bits(flip != 0)))
        else:
            assert "flip_words" not in params, node["name"]
    assert pooled == 2


def test_an_in_memory_model_with_a_wrong_tap_popcount_is_refused(conv_model):
    packed = export_model(conv_model)
    name = "nodes.1.weight_tap_popcount"
    packed.tensors[name] = packed.tensors[name] + np.eye(*packed.tensors[name].shape, dtype=np.int32)
    with pytest.raises(packed_model.PackedModelError, match=rf"node 1 \(blocks.1\): tensor '{name}' does not match"):
        runtime.from_packed(packed)


def test_a_file_of_a_previous_format_version_is_refused(tmp_path):
    from test_packed_model import FORMAT_V1_FILE, format_v2_file

    with pytest.raises(packed_model.PackedModelError, match="format version 1 is not supported.*jaxbnn export"):
        runtime.load(FORMAT_V1_FILE)
    with pytest.raises(packed_model.PackedModelError, match=r"format version 2 is not supported \(this jaxbnn "
                                                            r"reads version 3\); re-export .*jaxbnn export"):
        runtime.load(format_v2_file(tmp_path / "v2.jbnn"))


def test_runtime_imports_neither_export_nor_training_code():
    code = (
        "import sys, jaxbnn.runtime\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('export', 'train', 'flax', 'optax')"
        " or m.startswith(('jaxbnn.export', 'jaxbnn.train', 'jaxbnn.models', 'jaxbnn.layers'))]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={"PYTHONPATH": ":".join(p for p in sys.path if p)})
    assert result.returncode == 0, result.stderr


# --- the integer graph, against numpy ------------------------------------------------------------------------


def numpy_weights(node, tensors, prefix):
    """The weight values of a linear node as numpy int64: (KH, KW, C, N) for the conv bit matrix and the
    image operand's convs, (K, N) otherwise; ternary ones from their two stored ±1 planes."""
    if node["operand"] == "image":
        return tensors[prefix + "kernel"].astype(np.int64)
    rows, k_bits, (kh, kw), c = packed_model.weight_geometry(node)
    matrix = np.asarray(formats.unpack_bits(formats.from_fsb(tensors[prefix + "weight"], rows, k_bits), k_bits))
    if packed_model.uses_conv_layout(node):
        matrix = matrix.reshape(rows, kh, kw, -1)[..., :c].transpose(1, 2, 3, 0)  # (KH, KW, C, rows)
    else:
        matrix = matrix.T
    signs = np.where(matrix, 1, -1)
    n = node["out_channels"]
    return signs if node["weights"] == "binary" else (signs[..., :n] + signs[..., n:]) // 2


def numpy_quantize(z, tensors, prefix, domain):
    """Integers -> ±1 (binary) or -1, 0, +1 (ternary) through int32 thresholds: flip ? z <= t : z >= t."""
    def bit(suffix):
        t, flip = tensors[f"{prefix}threshold{suffix}"], tensors[f"{prefix}flip{suffix}"]
        return np.where(flip, z <= t, z >= t).astype(np.int64)

    return 2 * bit("") - 1 if domain == "binary" else bit("_nonneg") + bit("_pos") - 1


def numpy_linear(node, tensors, prefix, x):
    if node["input"] == "stream":
        x = numpy_quantize(x, tensors, prefix + "input_", node["operand"])
    w = numpy_weights(node, tensors, prefix)
    if node["kind"] == "dense":
        z = x.reshape(len(x), -1) @ w.reshape(-1, w.shape[-1])
    else:
        (pt, pb), (pl, pr) = node["padding"]
        fill = -1 if node["pad_value"] == "one" else 0  # "zero": level 0 of an image, 0 of a ternary value
        x = np.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)), constant_values=fill)
        (kh, kw), (sh, sw) = node["kernel_size"], node["stride"]
        oh, ow = (x.shape[1] - kh) // sh + 1, (x.shape[2] - kw) // sw + 1
        z = sum(x[:, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw] @ w[i, j]
                for i in range(kh) for j in range(kw))
        if node["pool"]:
            ph, pw = node["pool"]
            b, h, wd, n = z.shape
            z = z[:, :h // ph * ph, :wd // pw * pw].reshape(b, h // ph, ph, wd // pw, pw, n).max(axis=(2, 4))
    output = node["output"]
    if output == "stream":
        return z // 2 ** node["stream_shift"]  # floor division, negative values included
    if output == "affine":
        return z.astype(np.float32) * tensors[prefix + "scale"] + tensors[prefix + "bias"]
    return numpy_quantize(z, tensors, prefix, output)


def numpy_forward(packed, pixels):
    """docs/export.md's graph in numpy int64: every node's output (a residual node's: conv1's, the stream)."""
    x = pixels.astype(np.int64) - 128
    outputs = []
    for index, node in enumerate(packed.graph["nodes"]):
        prefix = f"nodes.{index}."
        if node["kind"] == "residual":
            inner = numpy_linear(node["conv1"], packed.tensors, prefix + "conv1.", x)
            s, extra = node["shortcut_stride"], node["out_shape"][-1] - node["in_shape"][-1]
            shortcut = np.pad(x[:, ::s, ::s], ((0, 0), (0, 0), (0, 0), (0, extra)))
            x = numpy_linear(node["conv2"], packed.tensors, prefix + "conv2.", inner) + shortcut
            outputs.append((inner, x))
        elif node["kind"] == "global_pool":
            x = numpy_quantize(x.sum(axis=(1, 2)), packed.tensors, prefix, node["output"])
            outputs.append(x)
        else:
            x = numpy_linear(node, packed.tensors, prefix, x)
            outputs.append(x)
    return outputs


def as_values(out, channels):
    """A runtime output as numpy values: packed bits -> ±1, a plane pair -> -1, 0, +1, integers as they are."""
    if isinstance(out, tuple):
        nonneg, pos = (np.asarray(formats.unpack_bits(plane, channels), np.int64) for plane in out)
        return nonneg + pos - 1
    if out.dtype == jnp.uint32:
        return 2 * np.asarray(formats.unpack_bits(out, channels), np.int64) - 1
    return np.asarray(out)


@pytest.mark.parametrize("which", ["binary", "ternary", "resnet-bnn", "resnet-tnn"])
def test_every_node_computes_the_integers_of_the_format(which):
    """Hand-built graphs with random thresholds (test_packed_model's) against numpy: the image operand on
    the levels p - 128 with level-0 padding, pooling before the thresholds, "one" padding, the stem's floor
    shift of negative sums, stream thresholds per channel and per feature, the shortcut, the global sum."""
    from test_packed_model import MODELS

    packed = MODELS[which]()
    net = runtime.from_packed(packed)
    x = pixels(3, seed=11, shape=net.input_shape)
    x[0] = 0  # large negative sums into the stem's shift
    x[1] = 255
    expected = numpy_forward(packed, x)
    got = net.trace(x)
    for node, out, want, stream_dtype in zip(net.graph["nodes"], got, expected, net.stream_dtypes):
        if node["kind"] == "residual":
            np.testing.assert_array_equal(as_values(out[0], node["conv1"]["out_channels"]), want[0])
            out, want = out[1], want[1]
            assert out.dtype == stream_dtype
        if want.dtype == np.float32:
            np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6, atol=1e-6, err_msg=node["name"])
        else:
            np.testing.assert_array_equal(as_values(out, node["out_shape"][-1]), want, err_msg=node["name"])
    if which.startswith("resnet"):  # the stem's sums include negative ones that are not multiples of 2**7
        stem = dict(net.graph["nodes"][0], stream_shift=0)
        sums = numpy_linear(stem, packed.tensors, "nodes.0.", x.astype(np.int64) - 128)
        assert ((sums < 0) & (sums % 128 != 0)).any()


@pytest.mark.parametrize("mode", ["bnn", "tnn"])
def test_the_narrow_stream_computes_the_integers_of_the_format(mode, monkeypatch):
    """The stream as int16 (where the platform's kernels write int16 dot products, CUDA; run here on purpose):
    the same integers as numpy's, the stem's extreme sums included; where the blocks add their shortcut outside
    conv2's epilogue (the CPU's form, taken here on every platform), only a binary conv2 narrows it."""
    from test_packed_model import tiny_resnet

    monkeypatch.setattr(runtime, "fuses_residual", lambda: False)
    packed = tiny_resnet(mode=mode)
    net = runtime.from_packed(packed)
    nodes = net.graph["nodes"]
    dtypes = runtime.stream_dtypes(nodes, packed.tensors, narrow=True)
    assert dtypes[:2] == ([jnp.int16] * 2 if mode == "bnn" else [jnp.int32] * 2)
    x = pixels(3, seed=11, shape=net.input_shape)
    x[0], x[1] = 0, 255
    got = jax.jit(lambda p, levels: runtime.run_nodes(nodes, p, levels, dtypes))(net.params, formats.image_levels(x))
    expected = numpy_forward(packed, x)
    assert got[1][1].dtype == dtypes[1]
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(as_values(got[1][0], 6), expected[1][0])
    np.testing.assert_array_equal(got[1][1], expected[1][1])
    np.testing.assert_allclose(np.asarray(got[-1]), expected[-1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["bnn", "tnn", "btn"])
def test_the_residual_epilogue_carries_the_stream_and_its_bits_as_the_jnp_add_does(mode, monkeypatch):
    """CUDA's form of a narrow-stream ResNet (conv2 adds the shortcut in its epilogue and writes the next block's
    input bits, or a ternary conv1's planes; the last block the stream alone), run here on purpose: every node's
    output equals the jnp add's, the strided blocks' subsampled, channel-padded shortcuts included. A ternary or
    mixed conv2 adds it in its side-by-side binary product's epilogue, where the platform has none of its own."""
    monkeypatch.setattr(runtime, "fuses_residual", lambda: True)
    model = zoo_model("cifar10-resnet14", mode, {})
    packed = export_model(model)
    net = runtime.from_packed(packed)
    nodes = net.graph["nodes"]
    dtypes = runtime.stream_dtypes(nodes, packed.tensors, narrow=True)
    assert jnp.int32 not in dtypes
    levels = formats.image_levels(images_for(model, 5, seed=4))

    def run(fuse):
        return jax.jit(lambda p, x: runtime.run_nodes(nodes, p, x, dtypes, fuse_residual=fuse))(net.params, levels)

    fused, added = run(True), run(False)
    assert sum(node["kind"] == "residual" for node in nodes) >= 3
    for node, got, want in zip(nodes, fused, added):
        for got_part, want_part in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert got_part.dtype == want_part.dtype, node["name"]
            np.testing.assert_array_equal(np.asarray(got_part), np.asarray(want_part), err_msg=node["name"])


@pytest.mark.parametrize("mode, narrow", [("bnn", True), ("bnn", False), ("tnn", False)])
def test_the_stem_writes_the_first_blocks_input_as_the_jnp_thresholds_do(mode, narrow):
    """CUDA's stem (`ops.image_conv2d(..., keep_stream=True)`: the stream and the first block's input bits, or
    its ternary planes, from the same values), run here on purpose: every node's output equals that of the
    stem writing the stream alone and jnp thresholding it, in the int16 and the int32 stream."""
    model = zoo_model("cifar10-resnet14", mode, {})
    packed = export_model(model)
    net = runtime.from_packed(packed)
    nodes = net.graph["nodes"]
    dtypes = runtime.stream_dtypes(nodes, packed.tensors, narrow=narrow)
    assert dtypes[0] == (jnp.int16 if narrow else jnp.int32)
    assert runtime._conv1_input_thresholds(nodes[1]["conv1"], net.params[1]["conv1"]) is not None
    images = images_for(model, 5, seed=6)
    images[0], images[1] = 0, 255
    levels = formats.image_levels(images)

    def run(stem_bits):
        return jax.jit(lambda p, v: runtime.run_nodes(nodes, p, v, dtypes, stem_bits=stem_bits))(net.params, levels)

    fused, separate = run(True), run(False)
    for node, got, want in zip(nodes, fused, separate):
        for got_part, want_part in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert got_part.dtype == want_part.dtype, node["name"]
            np.testing.assert_array_equal(np.asarray(got_part), np.asarray(want_part), err_msg=node["name"])


def test_a_stem_leaves_thresholds_per_pixel_to_jnp():
    """A ternary conv1 with thresholds per feature (H, W, C) is not the image op's per-channel epilogue: the
    stem writes the stream alone there."""
    from test_packed_model import tiny_resnet

    net = runtime.from_packed(tiny_resnet(mode="tnn"))
    nodes = net.graph["nodes"]
    assert runtime._conv1_input_thresholds(nodes[1]["conv1"], net.params[1]["conv1"]) is None


def test_the_shortcut_is_added_in_the_epilogue_of_3x3_stride_1_blocks():
    """Blocks whose conv2 is a 3x3 stride-1 unpooled convolution (on CUDA the band kernel at 64 or 128 channels,
    the resident kernel at 256 or 512) add their shortcut in its epilogue; others keep XLA's add. A ternary or
    mixed conv2 too (on CUDA its side-by-side binary product, on the CPU its own product's kernel)."""
    def conv2(c, o, size=16, kernel=(3, 3), stride=(1, 1), pool=None):
        return {"in_shape": [size, size, c], "out_channels": o, "kernel_size": list(kernel), "stride": list(stride),
                "pool": pool}

    assert runtime._fuses_shortcut(conv2(128, 128)) and runtime._fuses_shortcut(conv2(64, 64, size=56))
    assert runtime._fuses_shortcut(conv2(256, 256, size=8)) and runtime._fuses_shortcut(conv2(512, 512, size=4))
    assert not runtime._fuses_shortcut(conv2(128, 128, kernel=(1, 1)))
    assert not runtime._fuses_shortcut(conv2(128, 128, stride=(2, 2)))
    assert not runtime._fuses_shortcut(conv2(128, 128, pool=[2, 2]))
    for operand, weights in (("ternary", "ternary"), ("ternary", "binary"), ("binary", "ternary")):
        assert runtime._fuses_shortcut(dict(conv2(128, 128), operand=operand, weights=weights))


@pytest.mark.parametrize("mode", ["bnn", "tnn", "tbn", "btn"])
def test_the_cpu_carries_a_resnets_int16_stream_in_its_kernels(mode):
    """On the CPU a ResNet's stream is int16 in every mode: the stem writes it with the first block's input bits
    (or ternary planes), each block's conv2 (the product's own kernel) adds its shortcut and writes the next
    block's input in its epilogue (one custom call a layer), and the network computes the integers of the same
    graph with every fused form off. Between the calls XLA computes nothing: a ternary output's planes reach the
    next ternary kernel as the epilogue wrote them, no slices copied."""
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU's forms")
    model = zoo_model("cifar10-resnet14", mode, {})
    net = runtime.from_packed(export_model(model))
    nodes = net.graph["nodes"]
    blocks = sum(node["kind"] == "residual" for node in nodes)
    images = images_for(model, 3, seed=8)
    hlo = net._call_forward.lower(*net._call_arguments(images)).compile().as_text()  # every call inlined
    calls = re.findall(r'custom_call_target="(\w+)"', hlo)
    residual = "jaxbnn_bconv2d_residual_i16" if mode == "bnn" else f"jaxbnn_{mode}_conv2d_residual_i16"
    assert set(net.stream_dtypes) - {None} == {jnp.int16}
    assert calls.count("jaxbnn_image_conv2d_i16_bits") == 1
    assert calls.count(residual + "_bits") == blocks - 1
    assert calls.count(residual) == 1  # the last block's stream, for the global pool
    entry = hlo[hlo.index("\nENTRY"):]
    assert re.findall(r"= \S+ (fusion|copy|slice|concatenate|transpose)\(", entry) == []
    levels = formats.image_levels(images)
    plain = jax.jit(lambda p, x: runtime.run_nodes(nodes, p, x, fuse_residual=False, stem_bits=False,
                                                   dense_chains=False))(net.params, levels)
    np.testing.assert_array_equal(np.asarray(net(images)), np.asarray(plain[-1]))


def test_a_stream_beyond_int16_travels_as_int32():
    """A stem whose sums may pass int16 (3x3 over 32 channels, no shift: up to 128 * 288) makes the stream int32
    from there on, and every node still computes the format's integers (numpy): nothing wraps."""
    from test_packed_model import tiny_resnet

    packed = tiny_resnet(image_channels=32, stem_shift=0)
    net = runtime.from_packed(packed)
    assert runtime.stream_dtypes(net.graph["nodes"], packed.tensors, narrow=True)[:2] == [jnp.int32, jnp.int32]
    x = pixels(3, seed=11, shape=net.input_shape)
    kernel = packed.tensors["nodes.0.kernel"]
    x[0, 1:4, 1:4] = np.where(kernel[..., 0] > 0, 255, 0)  # the stem's pixel (1, 1): its first column past int16
    x[1] = 255 - x[0]
    expected = numpy_forward(packed, x)
    assert np.abs(expected[0]).max() > np.iinfo(np.int16).max
    got = net.trace(x)
    assert got[0].dtype == jnp.int32
    np.testing.assert_array_equal(got[0], expected[0])
    assert got[1][1].dtype == jnp.int32
    np.testing.assert_array_equal(got[1][1], expected[1][1])
    np.testing.assert_allclose(np.asarray(got[-1]), expected[-1], rtol=1e-6, atol=1e-6)


def _stream_graph(stem_column_sum, stem_shift, conv2_reductions):
    """Graph nodes and tensors for `runtime.stream_dtypes` alone: an image-operand stem of one output column
    whose |weights| sum to `stem_column_sum`, then residual blocks whose conv2 reduce over the given lengths
    (1x1 convolutions)."""
    weights = np.zeros((3, 3, 3, 2), np.int8)
    weights.reshape(-1, 2)[:, 1] = -1  # the other column sums to 27
    left, row = stem_column_sum, 0
    while left:
        weights.reshape(-1, 2)[row, 0] = min(left, 127)
        left -= min(left, 127)
        row += 1
    nodes = [{"kind": "conv", "operand": "image", "output": "stream", "stream_shift": stem_shift, "out_channels": 2}]
    for k in conv2_reductions:
        conv2 = {"kind": "conv", "operand": "binary", "weights": "binary", "in_shape": [4, 4, k],
                 "kernel_size": [1, 1], "out_channels": 2, "output": "stream", "stream_shift": 0}
        nodes.append({"kind": "residual", "conv2": conv2})
    nodes.append({"kind": "global_pool", "output": "binary"})
    return nodes, {"nodes.0.kernel": weights}


@pytest.mark.parametrize("stem_sum, shift, reductions, want", [
    (255, 0, [127, 1], ["int16", "int16", "int32"]),  # 128 * 255 = 32640, + 127 = 32767: the last that fits
    (256, 0, [], ["int32"]),  # 32768
    (2000, 3, [767, 1], ["int16", "int16", "int32"]),  # 128 * 2000 / 2**3 = 32000, + 767 = 32767
    (255, 9, [32767], ["int16", "int32"]),  # ceil(32640 / 512) = 64
])
def test_the_stream_type_follows_the_bound_of_its_values(stem_sum, shift, reductions, want):
    """int16 while the largest magnitude the stream can reach (the stem's 128 * max column sum of |weight|,
    shifted; plus each block's conv2 reduction length) is at most 32767, int32 from the first node past it."""
    nodes, tensors = _stream_graph(stem_sum, shift, reductions)
    dtypes = runtime.stream_dtypes(nodes, tensors, narrow=True)
    assert dtypes[-1] is None  # global pooling writes no stream
    assert [np.dtype(d).name for d in dtypes[:-1]] == want
    assert runtime.stream_dtypes(nodes, tensors, narrow=False)[:-1] == [jnp.int32] * len(want)


def test_run_nodes_runs_any_part_of_a_graph():
    """From any node's input (the levels, bits, planes or the stream), the rest of the trace."""
    from test_packed_model import tiny_resnet

    net = runtime.from_packed(tiny_resnet(mode="tnn"))
    x = pixels(2, seed=12, shape=net.input_shape)
    trace = net.trace(x)
    nodes = net.graph["nodes"]
    inputs = [formats.image_levels(x)] + [out[1] if node["kind"] == "residual" else out
                                          for node, out in zip(nodes, trace[:-1])]
    for start, value in enumerate(inputs):
        rest = runtime.run_nodes(nodes[start:], net.params[start:], value)
        assert len(rest) == len(nodes) - start
        for got, want in zip(jax.tree.leaves(rest), jax.tree.leaves(trace[start:])):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_run_node_runs_a_node_as_the_graph_runs_it():
    """Node by node, each with the input bits the node before it wrote and writing the next node's (the stem's
    and the fused residual epilogues' bits, forced here on purpose), the same outputs as the whole graph; the bits
    a node writes are the next node's thresholds of its stream."""
    model = zoo_model("cifar10-resnet14", "bnn", {})
    packed = export_model(model)
    net = runtime.from_packed(packed)
    nodes, params = net.graph["nodes"], net.params
    dtypes = runtime.stream_dtypes(nodes, packed.tensors, narrow=True)
    levels = formats.image_levels(images_for(model, 3, seed=8))
    forced = dict(fuse_residual=True, stem_bits=True)
    whole = runtime.run_nodes(nodes, params, levels, dtypes, **forced)
    x, bits, written = levels, None, 0
    for i, (node, p, dtype) in enumerate(zip(nodes, params, dtypes)):
        following = (nodes[i + 1], params[i + 1]) if i + 1 < len(nodes) else None
        out, bits = runtime.run_node(node, p, x, dtype, input_bits=bits, following=following, **forced)
        for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(whole[i])):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=node["name"])
        x = out[1] if node["kind"] == "residual" else out
        if bits is not None:
            written += 1
            q = params[i + 1]["conv1"]
            want = formats.pack_bits(formats.binarize(x, q["input_threshold"], q["input_flip"]))
            np.testing.assert_array_equal(np.asarray(bits), np.asarray(want), err_msg=node["name"])
    assert written >= 3  # the stem and the blocks before another block


@pytest.mark.parametrize("mode", ["tnn", "tbn", "btn"])
def test_without_ternary_kernels_the_side_by_side_weights_are_built_once_at_load(mode, monkeypatch):
    """On a platform without kernels of the ternary and mixed products (CUDA), each such layer's weights are
    built at load as its one binary product takes them, and every node's output is the native run's."""
    if jax.default_backend() != "cpu":
        pytest.skip("compares with the CPU's native ternary kernels (the GPU's case is tests/test_gpu_models.py)")
    model = zoo_model("mnist-conv", mode, {})
    packed = export_model(model)
    x = images_for(model, 3, seed=4)
    native = runtime.from_packed(packed)
    assert not any("side_by_side" in p for p in native.params if isinstance(p, dict))
    want = native.trace(x)
    has_target = _ffi.has_target
    monkeypatch.setattr(_ffi, "has_target", lambda platform, target: has_target(platform, target) and not any(
        target.startswith(f"jaxbnn_{m}_") for m in ("tnn", "tbn", "btn")))  # fmt: skip
    jax.clear_caches()
    net = runtime.from_packed(packed)
    prepared = [node["name"] for node, p in zip(net.graph["nodes"], net.params) if "side_by_side" in p]
    assert prepared == [node["name"] for node in net.graph["nodes"] if node.get("operand") == "ternary"
                        or node.get("operand") == "binary" and node.get("weights") == "ternary"]  # fmt: skip
    text = net._trace.lower(net.params, jnp.asarray(x)).as_text()
    assert f"jaxbnn_{mode}_" not in text
    # no rearranged weights inside the program: the binary calls take the loaded ones as they are
    assert "stablehlo.transpose" not in text
    jax.tree.map(np.testing.assert_array_equal, net.trace(x), want)
    jax.clear_caches()


def test_without_ternary_kernels_a_tnn_resnet_takes_three_blocks_where_it_can_and_four_in_its_residual_convs(
        monkeypatch):
    """On a platform without the ternary kernels, a TNN ResNet-14's 3x3 convolutions over 512 channels run as three
    doubled blocks a tap, its residual conv2s keep the four blocks their epilogue takes (`shortcut=True` at load), and
    every node's output is the native run's."""
    if jax.default_backend() != "cpu":
        pytest.skip("compares with the CPU's native ternary kernels (the GPU's case is tests/test_gpu_models.py)")
    model = zoo_model("cifar10-resnet14", "tnn", {}, sizes={"cifar10-resnet14": dict(input_shape=(8, 8, 3), width=1.0)})
    packed = export_model(model)
    x = images_for(model, 2, seed=7)
    want = runtime.from_packed(packed).trace(x)
    has_target = _ffi.has_target
    monkeypatch.setattr(_ffi, "has_target", lambda platform, target: has_target(platform, target) and not any(
        target.startswith(f"jaxbnn_{m}_") for m in ("tnn", "tbn", "btn")))  # fmt: skip
    jax.clear_caches()
    net = runtime.from_packed(packed)
    convs = {(node["name"], key): p[key]["side_by_side"] for node, p in zip(net.graph["nodes"], net.params)
             if node["kind"] == "residual" for key in ("conv1", "conv2") if "side_by_side" in p[key]}
    three = {name for name, w in convs.items() if w.in_channels == 3 * 512}
    assert three and all(key == "conv1" for _, key in three)
    assert all(w.in_channels == 4 * 512 for (_, key), w in convs.items() if key == "conv2" and w.in_channels > 4 * 256)
    assert "jaxbnn_tnn_" not in net._trace.lower(net.params, jnp.asarray(x)).as_text()
    jax.tree.map(np.testing.assert_array_equal, net.trace(x), want)
    jax.clear_caches()


def test_dense_chains_of_the_zoo_s_tails():
    """Which runs of dense layers the forward fuses into one `ops.bmm_chain` (`runtime.dense_chains_of`): layers
    on packed bits, never the first layer (it reads the image) nor VGG-small's first dense layer (it reads a
    packed image, as a convolution); on CUDA only where their weights fit a CTA's shared memory together, at most
    CHAIN_MAX_ROWS rows, on the CPU any run at any batch."""
    graphs = {}
    width = {"imagenet-alexnet": 0.25}  # its 4096-wide layers as 1024-wide ones: the same chains, a quicker export

    def chains(name, rows, platform):
        if name not in graphs:
            model = build_model(name, "bnn", width=width.get(name, 1.0), rngs=nnx.Rngs(0))
            graphs[name] = export_model(model).graph["nodes"]
        return runtime.dense_chains_of(graphs[name], rows, platform)

    assert chains("cifar10-resnet14", 1024, "cuda") == [(8, 10)]  # global pool, then 512-512-512-10
    assert chains("cifar10-resnet14", runtime.CHAIN_MAX_ROWS + 1, "cuda") == []
    assert chains("mnist-mlp", 8, "cuda") == []  # 1024-wide layers: 128 KiB of weights each
    assert chains("cifar10-vgg", 8, "cuda") == []
    assert chains("imagenet-alexnet", 8, "cuda") == []
    assert chains("cifar10-resnet14", runtime.CHAIN_MAX_ROWS + 1, "cpu") == [(8, 10)]
    assert chains("mnist-mlp", 1, "cpu") == [(1, 4)]  # the image layer, then 1024-1024-1024-10
    assert chains("cifar10-vgg", 8, "cpu") == [(7, 9)]
    assert chains("imagenet-alexnet", 8, "cpu") == [(6, 8)]
    assert chains("mnist-conv", 8, "cpu") == []  # a convolution's bits, then the classifier alone


@pytest.mark.parametrize("name", ["mnist-mlp", "cifar10-resnet14"])
def test_a_fused_dense_chain_gives_the_logits_of_its_layers(name):
    """run_nodes with the dense chains fused and without: the same node outputs (on the CPU the chain's op runs
    its layers' kernels in turn; on CUDA one kernel, tests/test_gpu_models.py)."""
    model = zoo_model(name, "bnn", {}, seed=2)
    net = runtime.from_packed(export_model(model))
    images = jnp.asarray(images_for(model, 5, seed=4))
    assert runtime.dense_chains_of(net.graph["nodes"], 5)
    fused = runtime.run_nodes(net.graph["nodes"], net.params, images, net.stream_dtypes, dense_chains=True)
    plain = runtime.run_nodes(net.graph["nodes"], net.params, images, net.stream_dtypes, dense_chains=False)
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
