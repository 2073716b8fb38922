"""Fidelity of the exporter + runtime against the Flax model, over the zoo and every network mode.

For each model: batch norms get random statistics and affine parameters (negative and zero gammas
included), the exported graph runs under jit through jaxbnn.ops, and

- class predictions equal the Flax model's eval-mode predictions on every sample,
- logits are equal: the eval forward computes the classifier as the exported affine,
- every intermediate bit, ternary value and integer of the residual stream equals the Flax model's eval
  forward (both binarize through the same integer thresholds).

Models run at small input sizes / widths (the layer sequence is the architecture's).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxbnn.export import ExportError, export_model, fidelity_report, format_size_report, size_report
from jaxbnn import packed_model, runtime
from jaxbnn.layers import BinaryConv, BinaryLinear
from jaxbnn.models import BinaryNet, ConvBlock, DenseBlock, build_model
from zoo_cases import (CASES, NETWORK_MODES, REAL_SIZE, SMALL, TRAINED_ROTATED, images_for, randomize,
                       trained_options, trained_zoo_model, zoo_model)


@pytest.mark.parametrize("name, mode, options", CASES, ids=[f"{n}-{m}-{i}" for i, (n, m, _) in enumerate(CASES)])
def test_exported_model_reproduces_the_flax_model(name, mode, options):
    model = zoo_model(name, mode, options)
    net = runtime.from_packed(export_model(model))
    report = fidelity_report(model, net, images_for(model, 6, seed=2))
    assert report.predictions_equal == report.samples, report.summary()
    assert report.bit_mismatches == 0, [n for n in report.nodes if n.mismatches]
    assert report.logits_max_rel_diff <= 4e-6, report.summary()
    assert {n.kind for n in report.nodes[:-1]} <= {"binary", "ternary", "stream"}
    assert report.nodes[-1].kind == "float"


def _assert_exact(model, images):
    report = fidelity_report(model, runtime.from_packed(export_model(model)), images)
    assert report.exact and report.logits_max_rel_diff <= 4e-6, report.summary()


# each zoo model once at its real input size, the network modes taken in turn; all of them under --run-slow
ROTATED_MODES = [(name, NETWORK_MODES[i % len(NETWORK_MODES)]) for i, name in enumerate(sorted(REAL_SIZE))]


@pytest.mark.parametrize("name, mode", ROTATED_MODES, ids=[f"{n}-{m}" for n, m in ROTATED_MODES])
def test_zoo_model_at_its_real_input_size_reproduces_the_flax_model(name, mode):
    model = zoo_model(name, mode, {}, seed=3, sizes=REAL_SIZE)
    _assert_exact(model, images_for(model, 3, seed=9))


@pytest.mark.slow
@pytest.mark.parametrize("mode", NETWORK_MODES)
@pytest.mark.parametrize("name", sorted(REAL_SIZE))
def test_every_mode_of_every_zoo_model_at_its_real_input_size_reproduces_the_flax_model(name, mode):
    model = zoo_model(name, mode, {}, seed=5, sizes=REAL_SIZE)
    _assert_exact(model, images_for(model, 3, seed=11))


@pytest.mark.parametrize("name, mode", TRAINED_ROTATED, ids=[f"{n}-{m}" for n, m in TRAINED_ROTATED])
def test_trained_zoo_model_reproduces_the_flax_model(name, mode):
    model = trained_zoo_model(name, mode, trained_options(mode))
    _assert_exact(model, images_for(model, 6, seed=13))


@pytest.mark.slow
@pytest.mark.parametrize("mode", NETWORK_MODES)
@pytest.mark.parametrize("name", sorted(SMALL))
def test_every_mode_of_every_trained_zoo_model_reproduces_the_flax_model(name, mode):
    model = trained_zoo_model(name, mode, trained_options(mode), seed=1)
    _assert_exact(model, images_for(model, 6, seed=17))


@pytest.mark.parametrize("pool", [2, None])
def test_a_first_conv_whose_ternary_output_a_dense_layer_reads_per_feature_reproduces_the_flax_model(pool):
    """A dense layer's learned input thresholds straight after the first conv are one pair per flattened feature
    (OH, OW, C), which the image op's per-channel epilogue does not take: its pre-activations are thresholded
    after it."""
    rngs = nnx.Rngs(0)
    side = 14 if pool else 28
    blocks = [ConvBlock(BinaryConv(1, 4, 3, mode="twn", rngs=rngs), pool, rngs=rngs),
              DenseBlock(BinaryLinear(side * side * 4, 16, mode="tnn", input_threshold="learned", rngs=rngs),
                         rngs=rngs),
              DenseBlock(BinaryLinear(16, 10, mode="tnn", rngs=rngs), rngs=rngs)]
    model = randomize(BinaryNet(blocks, name="conv-dense", mode="tnn", input_shape=(28, 28, 1), num_classes=10), 1)
    packed = export_model(model)
    assert packed.graph["nodes"][0]["level_shape"] == [side, side, 4]
    _assert_exact(model, images_for(model, 5, seed=3))


def test_convolutions_padded_past_kernel_size_minus_one_reproduce_the_flax_model():
    """A layer's explicit padding may exceed what "SAME" gives (3 on a side of a 3x3 kernel: an output column
    reading padding only), on the image and with either pad value on packed bits."""
    rngs = nnx.Rngs(0)
    first = BinaryConv(1, 8, 3, padding=((2, 0), (1, 3)), mode="bwn", rngs=rngs)  # 12 x 14
    blocks = [ConvBlock(first, None, rngs=rngs),
              ConvBlock(BinaryConv(8, 8, 3, padding=((0, 3), (3, 0)), padding_value="one", rngs=rngs), 2,
                        rngs=rngs),  # 13 x 15, pooled 6 x 7
              DenseBlock(BinaryLinear(6 * 7 * 8, 10, rngs=rngs), rngs=rngs)]
    model = randomize(BinaryNet(blocks, name="padded", mode="bnn", input_shape=(12, 12, 1), num_classes=10), 2)
    _assert_exact(model, images_for(model, 5, seed=4))


def test_round_trip_through_the_file_runs_the_same(tmp_path):
    model = zoo_model("cifar10-resnet14", "tbn", {})
    packed = export_model(model, target="sm90")
    path = tmp_path / "resnet.jbnn"
    packed_model.save(path, packed)
    loaded = runtime.load(path)
    images = images_for(model, 3, seed=4)
    np.testing.assert_array_equal(np.asarray(loaded(images)), np.asarray(runtime.from_packed(packed)(images)))
    assert loaded.target == "sm90" and loaded.tile == (8, 128)


def test_binary_layers_are_about_32x_smaller():
    model = build_model("mnist-mlp", "bnn", input_shape=(28, 28, 1), num_classes=10, width=0.5, rngs=nnx.Rngs(0))
    randomize(model, 0)
    rows = size_report(model, export_model(model))
    hidden = [r for r in rows if r.domains == "binary x binary -> binary"]
    assert len(hidden) == 3
    for row in hidden:
        # 512 x 512 float32 kernel + bn state against bits + popcounts + thresholds
        assert 28 < row.float_weight_bytes / row.packed_weight_bytes <= 32
        assert 25 < row.float_bytes / row.packed_bytes <= 32
    assert "smaller" in format_size_report(rows)


@pytest.mark.parametrize("mode, options, message", [
    ("float", {}, "blocks.0: layer in mode 'float' has float weights"),
    ("bnn", {"input_scaling": True}, "blocks.1: XNOR-Net input scaling"),
])
def test_unexportable_models_are_refused(mode, options, message):
    model = build_model("mnist-mlp", mode, input_shape=(28, 28, 1), num_classes=10, width=0.0625,
                        rngs=nnx.Rngs(0), layer_options=options)
    with pytest.raises(ExportError, match=message):
        export_model(model)


def test_a_float_activation_layer_after_the_first_is_refused():
    rngs = nnx.Rngs(0)
    model = BinaryNet([ConvBlock(BinaryConv(1, 4, 3, mode="bwn", rngs=rngs), 2, rngs=rngs),
                       DenseBlock(BinaryLinear(64, 3, mode="bwn", rngs=rngs), rngs=rngs)],
                      name="x", mode="bnn", input_shape=(8, 8, 1), num_classes=3)
    model.eval()
    with pytest.raises(ExportError, match="blocks.1: a bwn layer after the first one reads float activations"):
        export_model(model)


class Doubling(nnx.Module):
    def __call__(self, x):
        return 2 * x


def test_a_block_of_a_type_the_format_does_not_know_is_refused_by_name():
    rngs = nnx.Rngs(0)
    model = BinaryNet([ConvBlock(BinaryConv(1, 4, 3, mode="bwn", rngs=rngs), 2, rngs=rngs), Doubling(),
                       DenseBlock(BinaryLinear(64, 3, mode="bnn", rngs=rngs), rngs=rngs)],
                      name="x", mode="bnn", input_shape=(8, 8, 1), num_classes=3)
    model.eval()
    with pytest.raises(ExportError, match="blocks.1: block type Doubling is not exportable"):
        export_model(model)


def crossed_threshold_model(beta: float, alpha: float = -0.5) -> BinaryNet:
    """A tbn network whose second layer's learned input thresholds are (alpha, beta) on every channel (alpha =
    -0.5 < beta: they cross), behind a batch norm that puts most values near 0."""
    rngs = nnx.Rngs(0)
    model = BinaryNet([ConvBlock(BinaryConv(1, 4, 3, mode="bwn", rngs=rngs), 2, rngs=rngs),
                       DenseBlock(BinaryLinear(64, 8, mode="tbn", input_threshold="learned", rngs=rngs), rngs=rngs),
                       DenseBlock(BinaryLinear(8, 3, mode="tbn", rngs=rngs), rngs=rngs)],
                      name="x", mode="tbn", input_shape=(8, 8, 1), num_classes=3)
    layer = model.blocks[1].linear
    model.blocks[0].bn.scale[...] = jnp.full((4,), 1e-3)
    layer.input_alpha[...] = jnp.full((64,), alpha)
    layer.input_beta[...] = jnp.full((64,), beta)
    model.eval()
    return model


@pytest.mark.parametrize("beta", [0.5, float("nan")])
def test_crossed_learned_ternary_thresholds_quantize_as_ternarize_does(beta):
    """+1 wherever the value is above alpha, as in training (`ternarize`): in the eval forward (the float
    network's values), and in the export (the eval forward's bits)."""
    model = crossed_threshold_model(beta)
    images = np.random.default_rng(0).integers(0, 256, (16, 8, 8, 1), dtype=np.uint8)
    quantized = np.asarray(model.trace(images)[0])
    assert 1.0 in quantized and 0.0 not in quantized  # all between the thresholds, so all above alpha
    np.testing.assert_allclose(np.asarray(model(images)), np.asarray(model.float_forward(images)), rtol=1e-5,
                               atol=1e-5)
    report = fidelity_report(model, runtime.from_packed(export_model(model)), images)
    assert report.exact, report.summary()


@pytest.mark.parametrize("alpha, beta", [(-np.inf, 0.5), (0.5, -np.inf), (np.inf, -0.5), (-0.5, np.inf),
                                         (np.nan, 0.5), (0.5, np.nan), (np.nan, np.nan), (0.1, -0.1)])
def test_ternary_thresholds_at_infinities_and_nans_give_the_eval_forwards_planes(alpha, beta):
    """An infinite or NaN level is degenerate (its plane's bit 0); where beta is, nonneg takes pos's comparison,
    so the planes never hold pos without nonneg. The export's bits are the eval forward's."""
    model = crossed_threshold_model(beta, alpha)
    images = np.random.default_rng(1).integers(0, 256, (16, 8, 8, 1), dtype=np.uint8)
    net = runtime.from_packed(export_model(model))
    nonneg, pos = (np.asarray(plane) for plane in net.trace(images)[0])
    assert not (pos & ~nonneg).any()
    report = fidelity_report(model, net, images)
    assert report.exact, report.summary()


def test_a_kernel_quantizer_whose_values_are_not_weights_is_refused(monkeypatch):
    model = build_model("mnist-mlp", "bnn", input_shape=(28, 28, 1), num_classes=10, width=0.0625, rngs=nnx.Rngs(0))
    quantized = BinaryLinear.quantized_kernel
    monkeypatch.setattr(BinaryLinear, "quantized_kernel", lambda layer: 0.5 * quantized(layer))
    with pytest.raises(ExportError, match=r"blocks.0: the kernel quantizer 'sign_ste' gives values other than"):
        export_model(model)


@pytest.mark.parametrize("channel", [
    dict(scale=np.inf),  # an infinite gamma
    dict(var=0.0, scale=1e37, mean=0.5),  # finite, but gamma / sqrt(var + eps) overflows float32
    dict(var=0.0, epsilon=0.0),  # var + eps = 0
    dict(var=1e-40, epsilon=0.0),  # subnormal: XLA's CPU flushes it to 0, its GPU does not
])
def test_a_classifier_batch_norm_no_float32_affine_reproduces_is_refused(channel):
    """Its float32 batch norm gives +-inf by the sign of its input (or depends on the platform), which the folded
    scale * dot + bias of the eval forward and the packed model does not (inf - inf = NaN): refused, naming the
    channel, rather than exported as something else."""
    model = build_model("mnist-mlp", "bnn", input_shape=(28, 28, 1), num_classes=10, width=0.0625, rngs=nnx.Rngs(0))
    bn = model.blocks[-1].bn
    for name, value in channel.items():
        if name == "epsilon":
            bn.epsilon = value
        else:
            getattr(bn, name)[...] = getattr(bn, name)[...].at[3].set(value)
    model.eval()
    with pytest.raises(ExportError, match=r"blocks.4: the classifier's batch norm on channel\(s\) \[3\]"):
        export_model(model)


def test_a_classifier_batch_norm_with_nan_parameters_gives_nan_logits_as_the_flax_model_does():
    model = build_model("mnist-mlp", "bnn", input_shape=(28, 28, 1), num_classes=10, width=0.0625, rngs=nnx.Rngs(0))
    bn = model.blocks[-1].bn
    bn.mean[...] = bn.mean[...].at[2].set(np.nan)
    bn.scale[...] = bn.scale[...].at[5].set(0.0)
    bn.var[...] = bn.var[...].at[5].set(0.0)
    bn.epsilon = 0.0  # channel 5: 0 / sqrt(0), NaN
    model.eval()
    images = images_for(model, 4, seed=1)
    logits = np.asarray(runtime.from_packed(export_model(model))(images))
    np.testing.assert_array_equal(np.isnan(logits), np.isnan(np.asarray(model(images))))
    assert np.isnan(logits[:, [2, 5]]).all() and not np.isnan(np.delete(logits, [2, 5], axis=1)).any()


def near_tie_classifier(mode, classes=16):
    """Every class the same dot product z, its batch norm giving z + 0.1 from another mean each: logits equal in
    exact arithmetic, apart by float32 rounding only, so the prediction is the rounding's."""
    model = build_model("mnist-mlp", mode, input_shape=(28, 28, 1), num_classes=classes, width=0.02,
                        rngs=nnx.Rngs(0))
    last = model.blocks[-1]
    kernel = last.linear.kernel[...]
    last.linear.kernel[...] = jnp.broadcast_to(kernel[:, :1], kernel.shape)
    mean = np.random.default_rng(1).uniform(0, 1, classes).astype(np.float32)
    last.bn.mean[...], last.bn.var[...] = jnp.asarray(mean), jnp.ones(classes, jnp.float32)
    last.bn.scale[...], last.bn.bias[...] = jnp.ones(classes, jnp.float32), jnp.asarray(mean + np.float32(0.1))
    last.bn.epsilon = 0.0
    model.eval()
    return model


@pytest.mark.parametrize("mode", NETWORK_MODES)
def test_the_eval_forwards_logits_are_the_packed_models_bit_for_bit_at_near_ties(mode, xla_optimizations):
    """The eval forward computes the classifier as the file's affine, float32(z) * scale + bias, rounded twice,
    whatever XLA fuses: the same logits, so the same prediction, even where only rounding separates classes."""
    model = near_tie_classifier(mode)
    images = images_for(model, 48, seed=0)
    net = runtime.from_packed(export_model(model))
    logits = np.asarray(net(images))
    np.testing.assert_array_equal(np.asarray(model(jnp.asarray(images))), logits)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: model(x))(jnp.asarray(images))), logits)
    # the ties are real: the batch norm's own float32 steps, (z - mean) * 1 + beta, rank the classes by rounding
    bn = model.blocks[-1].bn
    z = np.round(logits[:, :1] - np.float32(0.1))
    stepwise = (z - np.asarray(bn.mean[...])) * np.float32(1) + np.asarray(bn.bias[...])
    assert len(np.unique(stepwise.argmax(-1))) > 1


@pytest.mark.parametrize("direction", ["the batch norm overflows", "the folded product overflows"])
def test_a_classifier_at_the_float32_limits_predicts_what_the_packed_model_predicts(direction):
    """Near float32's largest values, the batch norm's steps and the folded affine's overflow at different
    inputs: the eval forward computes the folded affine, so both give the same logits, infinities included."""
    model = build_model("mnist-mlp", "bnn", input_shape=(28, 28, 1), num_classes=3, width=0.02, rngs=nnx.Rngs(0))
    bn = model.blocks[-1].bn
    bn.var[...], bn.epsilon = jnp.ones(3, jnp.float32), 0.0
    if direction == "the batch norm overflows":  # (z + 2e38) * 2 is inf; the fold's bias is 1e38
        bn.mean[...], bn.scale[...] = jnp.asarray([-2e38, 0, 0], jnp.float32), jnp.asarray([2, 1, 1], jnp.float32)
        bn.bias[...] = jnp.asarray([-3e38, 2e38, 0], jnp.float32)
    else:  # scale 2e37 times |z| up to 20 overflows; the batch norm's (z - 10) * 2e37 need not
        bn.mean[...], bn.scale[...] = jnp.asarray([10, 0, 0], jnp.float32), jnp.asarray([2e37, 0, 1], jnp.float32)
        bn.bias[...] = jnp.asarray([0, 3e38, 0], jnp.float32)
    model.eval()
    images = images_for(model, 8, seed=2)
    logits = np.asarray(runtime.from_packed(export_model(model))(images))
    np.testing.assert_array_equal(np.asarray(model(jnp.asarray(images))), logits)


def test_the_eval_logits_differentiate_as_the_batch_norm_in_the_classifiers_parameters():
    """The exported affine's value, the float32 batch norm's derivative: calibrating the classifier against frozen
    statistics works on the eval forward."""
    model = build_model("mnist-mlp", "bnn", input_shape=(28, 28, 1), num_classes=10, width=0.0625, rngs=nnx.Rngs(0))
    model.eval()
    images = jnp.asarray(images_for(model, 8, seed=4))
    last = len(model.blocks) - 1
    classifier = lambda path, v: issubclass(getattr(v, "type", type(v)), nnx.Param) and tuple(path[:2]) == (  # noqa: E731
        "blocks", last)
    grads = nnx.grad(lambda m, x: m(x).sum(), argnums=nnx.DiffState(0, classifier))(model, images)
    grads = nnx.to_pure_dict(grads)["blocks"][last]["bn"]
    bn, linear = model.blocks[-1].bn, model.blocks[-1].linear
    z = np.asarray(model.trace(images)[-2]).reshape(8, -1) @ np.asarray(linear.quantized_kernel())
    normalized = (z - np.asarray(bn.mean[...])) / np.sqrt(np.asarray(bn.var[...]) + bn.epsilon)
    np.testing.assert_allclose(grads["scale"], normalized.sum(0), rtol=1e-5)
    np.testing.assert_array_equal(grads["bias"], np.full(10, 8.0, np.float32))


def test_fidelity_reports_equal_infinite_logits_as_equal():
    model = build_model("mnist-mlp", "bnn", input_shape=(28, 28, 1), num_classes=3, width=0.02, rngs=nnx.Rngs(0))
    bn = model.blocks[-1].bn
    bn.var[...], bn.epsilon, bn.mean[...] = jnp.ones(3), 0.0, jnp.zeros(3)
    bn.scale[...], bn.bias[...] = jnp.asarray([1e38, 1, 1], jnp.float32), jnp.asarray([3e38, 0, 0], jnp.float32)
    model.eval()
    images = images_for(model, 8, seed=2)
    net = runtime.from_packed(export_model(model))
    assert np.isinf(np.asarray(net(images))).any()
    report = fidelity_report(model, net, images)
    assert report.exact and report.logits_max_abs_diff == 0.0 and report.logits_max_rel_diff == 0.0


@pytest.mark.parametrize("input_shape", [(224, 224, 3), (256, 512, 1)])
def test_a_first_layer_of_more_products_than_int32_holds_is_refused(input_shape, tmp_path):
    """A dense first layer over 150,528 (or 131,072) inputs: int8 products could overflow its int32 sums, so the
    exporter refuses it, and the loader a file that holds one, rather than a model that fails on every call."""
    model = build_model("mnist-mlp", "bnn", input_shape=input_shape, num_classes=10, width=0.01, rngs=nnx.Rngs(0))
    model.eval()
    message = r"blocks.0\): a first layer of \d+ products per output: at most 131071"
    with pytest.raises(ExportError, match=message):
        export_model(model)
    small = export_model(build_model("mnist-mlp", "bnn", input_shape=(28, 28, 1), num_classes=10, width=0.01,
                                     rngs=nnx.Rngs(0)))
    graph = json.loads(json.dumps(small.graph))
    graph["input_shape"] = graph["nodes"][0]["in_shape"] = list(input_shape)
    with pytest.raises(packed_model.PackedModelError, match=message):
        packed_model.validate_graph(graph)


def test_reports_refuse_a_model_and_a_packed_model_of_another_network():
    """Named by what differs, rather than a table of mixed rows or an error deep in a comparison."""
    def mlp(mode="bnn", width=0.0625, name="mnist-mlp"):
        return build_model(name, mode, input_shape=(28, 28, 1), num_classes=10, width=width, rngs=nnx.Rngs(0))

    model = mlp()
    images = np.zeros((2, 28, 28, 1), np.uint8)
    for other, message in ((mlp(name="mnist-conv"), "its name 'mnist-conv' \\(the model's 'mnist-mlp'\\)"),
                           (mlp(mode="tnn"), "its mode 'tnn' \\(the model's 'bnn'\\)"),
                           (mlp(width=0.125), "its blocks.0 writes 128 channels \\(the model's 64\\)")):
        packed = export_model(other)
        with pytest.raises(ValueError, match="size_report: the packed model is not this model's export: " + message):
            size_report(model, packed)
        with pytest.raises(ValueError, match="fidelity_report: the packed model is not this model's export"):
            fidelity_report(model, runtime.from_packed(packed), images)
    packed = export_model(model)
    with pytest.raises(TypeError, match="fidelity_report takes the packed model as a jaxbnn.runtime.PackedNet"):
        fidelity_report(model, packed, images)
    with pytest.raises(TypeError, match="takes a PackedModel"):
        size_report(model, runtime.from_packed(packed))
    assert fidelity_report(model, runtime.from_packed(packed), images).exact


def test_unknown_target_is_refused():
    model = build_model("mnist-mlp", "bnn", input_shape=(28, 28, 1), num_classes=10, width=0.0625, rngs=nnx.Rngs(0))
    with pytest.raises(ExportError, match="target"):
        export_model(model, target="tpu")


@pytest.mark.parametrize("input_range", ["ab", ("a", "b"), (0, 10**400), None, 5, (1.0,), (0.0, 1.0, 2.0),
                                         (1.0, -1.0), (0.0, 1e-45)])
def test_an_input_range_that_is_not_a_scale_is_refused(input_range):
    model = build_model("mnist-mlp", "bnn", input_shape=(28, 28, 1), num_classes=10, width=0.0625, rngs=nnx.Rngs(0))
    with pytest.raises(ExportError, match="input_range"):
        export_model(model, input_range=input_range)


def test_the_fidelity_check_catches_a_wrong_threshold():
    model = zoo_model("mnist-mlp", "bnn", {})
    packed = export_model(model)
    images = images_for(model, 6, seed=5)
    assert fidelity_report(model, runtime.from_packed(packed), images).exact
    packed.tensors["nodes.1.threshold"] = packed.tensors["nodes.1.threshold"] + 3
    report = fidelity_report(model, runtime.from_packed(packed), images)
    assert not report.exact
    assert report.nodes[1].mismatches > 0


def test_the_fidelity_check_catches_logits_one_ulp_off():
    model = zoo_model("mnist-mlp", "bnn", {})
    packed = export_model(model)
    images = images_for(model, 6, seed=5)
    scale = f"nodes.{len(packed.graph['nodes']) - 1}.scale"  # the classifier's affine
    packed.tensors[scale] = np.nextafter(packed.tensors[scale], np.float32(np.inf)).astype(np.float32)
    report = fidelity_report(model, runtime.from_packed(packed), images)
    assert report.predictions_equal == report.samples and report.bit_mismatches == 0  # only the logits moved
    assert report.logits_mismatches > 0 and not report.exact
    assert "logits: " in report.summary()


def test_nan_logits_in_both_models_are_an_exact_match():
    model = zoo_model("mnist-mlp", "bnn", {})
    bn = model.blocks[-1].bn
    bn.mean[...] = bn.mean[...].at[2].set(np.nan)  # class 2's logit NaN in the Flax model and the packed one
    model.eval()
    report = fidelity_report(model, runtime.from_packed(export_model(model)), images_for(model, 4, seed=1))
    assert report.exact and report.logits_mismatches == 0
    assert report.logits_max_abs_diff == 0.0 and report.logits_max_rel_diff == 0.0, report.summary()


def test_a_first_layer_that_is_the_classifier_rounds_its_product_before_the_bias(xla_optimizations):
    """An image layer with the affine output: float32(dot) * scale rounded, then + bias, as the Flax classifier
    computes it; a fused multiply-add (one rounding, which XLA's optimizations contract the two into) would move
    logits by an ulp and flip near-tied classes."""
    rng = np.random.default_rng(1)
    layer = BinaryLinear(64, 16, mode="bwn", rngs=nnx.Rngs(0))
    layer.kernel[...] = jnp.broadcast_to(layer.kernel[...][:, :1], layer.kernel.shape)  # one dot, 16 affines
    block = DenseBlock(layer, rngs=nnx.Rngs(1))
    mean = rng.uniform(0, 1, 16).astype(np.float32)
    block.bn.mean[...] = jnp.asarray(mean)
    block.bn.var[...] = jnp.ones(16)
    block.bn.epsilon = 0.0
    block.bn.scale[...] = jnp.asarray(rng.uniform(0.5, 3, 16), jnp.float32)
    block.bn.bias[...] = jnp.asarray(mean * 1.3 + np.float32(0.1))
    model = BinaryNet([block], name="affine-image", mode="bnn", input_shape=(8, 8, 1), num_classes=16)
    model.eval()
    images = rng.integers(0, 256, (64, 8, 8, 1), dtype=np.uint8)
    packed = np.asarray(runtime.from_packed(export_model(model))(images))
    np.testing.assert_array_equal(packed.view(np.uint32), np.asarray(model(images)).view(np.uint32))


def test_the_global_pool_sums_the_stream_in_int32_past_float32_s_integers():
    """The Flax eval forward's global pool adds the integer stream as the packed model does, in int32: sums past
    2^24, which float32 rounds, meet thresholds placed exactly on them."""
    from jaxbnn.models import GlobalPool, StreamStem

    rngs = nnx.Rngs(0)
    stem = BinaryConv(3, 2, 7, mode="bwn", rngs=rngs)
    stem.kernel[...] = -jnp.abs(stem.kernel[...]) - 0.01  # every weight -1: large dot products of dark images
    pool = GlobalPool(2, rngs=rngs)
    head = DenseBlock(BinaryLinear(2, 3, mode="bnn", rngs=rngs), rngs=rngs)
    model = BinaryNet([StreamStem(stem, shift=0), pool, head], name="gp", mode="bnn", input_shape=(40, 40, 3),
                      num_classes=3)
    images = np.random.default_rng(0).integers(0, 12, (4, 40, 40, 3), dtype=np.uint8)
    levels = np.pad(images.astype(np.int64) - 128, ((0, 0), (3, 3), (3, 3), (0, 0)))
    sums = -sum(levels[:, i:i + 40, j:j + 40, :].sum(-1) for i in range(7) for j in range(7)).sum(axis=(1, 2))
    assert sums.min() > 2**24 and np.float32(sums[2]) != sums[2]
    pool.bn.mean[...] = jnp.asarray([sums[2], sums[3]], jnp.float32)  # thresholds on float32's rounding of a sum
    pool.bn.var[...] = jnp.ones(2)
    pool.bn.epsilon = 0.0
    model.eval()
    report = fidelity_report(model, runtime.from_packed(export_model(model)), images)
    assert report.exact, report.summary()


def test_a_model_built_with_numpy_integer_sizes_exports():
    model = build_model("mnist-mlp", "bnn", input_shape=(np.int64(28), np.int32(28), 1), num_classes=np.int64(10),
                        width=0.0625, rngs=nnx.Rngs(0))
    assert all(type(v) is int for v in model.input_shape) and type(model.num_classes) is int
    assert export_model(model).graph["input_shape"] == [28, 28, 1]
