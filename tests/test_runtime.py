"""The inference runtime: one jitted function over the packed parameters, packed activations between
layers, the custom calls in the compiled program, clear errors, and no dependency on export/ or train/."""

import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxbnn.export import export_model, fidelity_report
from jaxbnn import _ffi, formats, packed_model, runtime
from jaxbnn.cli import import_train_module
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


def images(count, seed=0, shape=(12, 12, 1)):
    return np.random.default_rng(seed).uniform(-1, 1, size=(count, *shape)).astype(np.float32)


def test_logits_and_predictions(net, conv_model):
    x = images(7, seed=1)
    logits = np.asarray(net(x))
    assert logits.shape == (7, 10) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, np.asarray(conv_model(jnp.asarray(x))), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(net.predict(x, batch_size=3), np.argmax(logits, axis=-1))


def test_activations_stay_packed_between_binary_layers(net):
    trace = net.trace(images(2))
    nodes = net.graph["nodes"]
    for node, out in zip(nodes[:-1], trace[:-1]):
        assert node["output"] == "binary"
        assert out.dtype == jnp.uint32, node["name"]
        assert out.shape == (2, *node["out_shape"][:-1], formats.num_words(node["out_channels"])), node["name"]
    assert trace[-1].dtype == jnp.float32


def test_one_batch_row_at_a_time_gives_the_same_logits(net):
    x = images(5, seed=2)
    whole = np.asarray(net(x))
    for i in range(len(x)):
        np.testing.assert_array_equal(np.asarray(net(x[i:i + 1]))[0], whole[i])


def test_the_compiled_program_calls_the_native_targets_where_registered(net):
    text = net._forward.lower(net.params, jnp.zeros((2, 12, 12, 1), jnp.float32)).as_text()
    # convs and the dense layer on the packed image: bconv2d with the threshold epilogue; classifier: bmm affine
    for target in ("jaxbnn_bconv2d_bits", "jaxbnn_bmm_f32"):
        assert (target in text) == _ffi.has_target("cpu", target), target


def test_bad_input_is_refused_before_lowering(net):
    with pytest.raises(ValueError, match=r"shape \(batch, 12, 12, 1\)"):
        net(np.zeros((2, 28, 28, 1), np.float32))
    with pytest.raises(ValueError, match="shape"):
        net(np.zeros((12, 12, 1), np.float32))
    with pytest.raises(TypeError, match=r"images must be uint8 pixels \(0..255\) or floats in \[-1, 1\] \(the scale "
                                        "mnist-conv was trained on\\), got int32"):
        net(np.zeros((2, 12, 12, 1), np.int32))


def test_predict_refuses_a_batch_size_below_one(net):
    for batch_size in (-5, 0, 2.5, True):
        with pytest.raises(ValueError, match=f"batch_size must be a positive integer, got {batch_size!r}"):
            net.predict(images(3), batch_size=batch_size)


def test_an_empty_batch_gives_empty_logits_and_predictions(net):
    """A dense layer on a packed image flattens it: with no rows, a -1 in that reshape cannot be resolved."""
    empty = np.zeros((0, 12, 12, 1), np.float32)
    assert np.asarray(net(empty)).shape == (0, 10)
    assert net.predict(empty).shape == (0,)
    assert all(np.asarray(out).shape[0] == 0 for out in jax.tree.leaves(net.trace(empty)))


# --- the input scale: recorded in the file, applied to uint8, checked on floats -------------------------


def pixels(count, seed=0, shape=(12, 12, 1)):
    return np.random.default_rng(seed).integers(0, 256, size=(count, *shape), dtype=np.uint8)


def test_uint8_pixels_are_converted_exactly_as_training_converts_them(net, conv_model):
    to_float = import_train_module("data").to_float
    assert net.input_range == (-1.0, 1.0)
    x = pixels(6, seed=4)
    x[0] = 0  # the ends of the range
    x[1] = 255
    np.testing.assert_array_equal(np.asarray(net(x)), np.asarray(net(to_float(x))))
    np.testing.assert_array_equal(np.asarray(jax.jit(net)(x)), np.asarray(net(to_float(x))))  # traced too
    np.testing.assert_allclose(np.asarray(net(x)), np.asarray(conv_model(jnp.asarray(to_float(x)))), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_array_equal(net.predict(x, batch_size=4), net.predict(to_float(x), batch_size=4))


def test_an_exported_input_range_is_recorded_and_used(conv_model):
    net = runtime.from_packed(export_model(conv_model, input_range=(0.0, 1.0)))
    assert net.graph["input_range"] == [0.0, 1.0]
    x = pixels(3, seed=5)
    np.testing.assert_array_equal(np.asarray(net(x)), np.asarray(net(x.astype(np.float32) / np.float32(255))))


@pytest.mark.parametrize("scale, message", [
    (lambda p: p.astype(np.float32), r"trained on images in \[-1, 1\] \(uint8 pixels p -> -1 \+ p \* 2 / 255\); "
                                     r"these span \[0, 255\]: scale them as in training, or pass the uint8 pixels"),
    (lambda p: p.astype(np.float32) / 255, r"these span \[0, 1\]: none is negative: images scaled to \[0, 1\] "
                                           r"need -1 \+ x \* 2; or pass the uint8 pixels"),
    (lambda p: np.full(p.shape, np.nan, np.float32), r"these span \[nan, nan\]"),
])
def test_floats_off_the_training_scale_draw_a_warning_naming_it(net, scale, message):
    x = pixels(4, seed=6)
    x[:, 0, 0, 0], x[:, 0, 1, 0] = 0, 255
    with pytest.warns(runtime.InputRangeWarning, match=message):
        net(scale(x))


def test_floats_on_the_training_scale_draw_no_warning(net):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net(images(4, seed=7))
        net.predict(images(4, seed=7))
        jax.jit(net)(images(4, seed=7))  # traced values are not checked (nor can they be)


def test_a_corrupted_file_is_refused(tmp_path, conv_model):
    path = tmp_path / "m.jbnn"
    packed_model.save(path, export_model(conv_model))
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2 + 40] ^= 1
    path.write_bytes(bytes(blob))
    with pytest.raises(packed_model.PackedModelError):
        runtime.load(path)


# --- loading uses the file's tensors as they are --------------------------------------------------------

# Every node kind whose weights the file stores, in every network mode: the first layer (float operand, a
# conv or a dense over the image), convs and dense layers on a packed image (conv bit matrix, tap
# popcounts), dense layers on a packed vector (dense bit matrix, row popcounts), residual blocks' convs.
LOAD_CASES = [("mnist-conv", mode, {}) for mode in ("bnn", "tnn", "tbn", "btn")] + [
    ("mnist-mlp", "btn", {"kernel_threshold": "twn_channel"}),
    ("mnist-mlp", "tbn", {}),
    ("cifar10-resnet14", "tnn", {}),
]

FORMAT_FUNCTIONS = ("binarize", "pack_bits", "unpack_bits", "to_fsb", "from_fsb", "popcount", "ternary_planes",
                    "pack_ternary", "unpack_ternary", "ternary_pm_planes", "ternary_weight_signs",
                    "pack_dense_weights", "pack_conv_weights")


def _parameters_by_tensor_name(net) -> dict:
    """The loaded parameters of every node, named as the file's tensors."""
    def linear(prefix, params):
        for key, value in params.items():
            if isinstance(value, formats.ConvBits):
                yield prefix + "weight", value.bits
                yield prefix + "weight_tap_popcount", value.tap_popcount
            elif isinstance(value, formats.DenseBits):
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
        for function in FORMAT_FUNCTIONS:
            patch.setattr(formats, function, lambda *args, _name=function, **kwargs: pytest.fail(
                f"loading called formats.{_name}: the file should hold what the ops take"))
        net = runtime.load(path)

    loaded = _parameters_by_tensor_name(net)
    assert sorted(loaded) == sorted(stored)
    for tensor, array in stored.items():
        value = np.asarray(loaded[tensor])
        if tensor.endswith(".kernel"):  # the first layer's int8 values, as the float conv takes them
            assert array.dtype == np.int8 and value.dtype == np.float32, tensor
        else:
            assert value.dtype == array.dtype, tensor
        np.testing.assert_array_equal(value, array, err_msg=tensor)

    images = images_for(model, 6, seed=3)
    report = fidelity_report(model, net, images)
    assert report.predictions_equal == report.samples, report.summary()
    assert report.bit_mismatches == 0 and report.ties == 0, [n for n in report.nodes if n.mismatches]
    assert report.logits_max_rel_diff <= 4e-6, report.summary()
    tolerance = 0.0 if jax.default_backend() == "cpu" else 1e-5
    assert all(n.max_abs_diff <= tolerance for n in report.nodes[:-1]), report.summary()
    np.testing.assert_array_equal(net.predict(images, batch_size=4), np.argmax(np.asarray(model(images)), axis=-1))


def test_an_in_memory_model_with_a_wrong_tap_popcount_is_refused(conv_model):
    packed = export_model(conv_model)
    name = "nodes.1.weight_tap_popcount"
    packed.tensors[name] = packed.tensors[name] + np.eye(*packed.tensors[name].shape, dtype=np.int32)
    with pytest.raises(packed_model.PackedModelError, match=rf"node 1 \(blocks.1\): tensor '{name}' does not match"):
        runtime.from_packed(packed)


def test_a_file_of_the_previous_format_version_is_refused():
    from test_packed_model import FORMAT_V1_FILE

    with pytest.raises(packed_model.PackedModelError, match="format version 1 is not supported.*jaxbnn export"):
        runtime.load(FORMAT_V1_FILE)


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
