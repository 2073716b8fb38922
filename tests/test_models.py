"""The model zoo: full-size shapes and structure (traced abstractly), a few training steps per model, and
the eval forward: a function of integers (the image levels, integer pre-activations through the integer
thresholds of `jaxbnn.thresholds`, the integer residual stream), the float network it stands for away from
ties."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxbnn import formats, models, runtime
from jaxbnn.export import export_model, fidelity_report, size_report
from jaxbnn.layers import BinaryConv, BinaryLinear, clip_latent_weights
from jaxbnn.summary import format_summary, model_summary
from zoo_cases import images_for, randomize

FULL_SIZE = {
    "mnist-mlp": ((28, 28, 1), 10),
    "mnist-conv": ((28, 28, 1), 10),
    "cifar10-vgg": ((32, 32, 3), 10),
    "cifar10-resnet14": ((32, 32, 3), 10),
    "imagenet-alexnet": ((224, 224, 3), 1000),
    "imagenet-vgg16": ((224, 224, 3), 1000),
    "imagenet-resnet18": ((224, 224, 3), 1000),
    "imagenet-darknet19": ((224, 224, 3), 1000),
}


def _layers(model):
    return [m for _, m in nnx.iter_modules(model) if isinstance(m, (BinaryConv, BinaryLinear))]


@pytest.mark.parametrize("name", sorted(FULL_SIZE))
def test_full_size_models_trace_to_logits(name):
    """Every zoo model at full size traces to (batch, classes) logits: a bwn first layer, bnn after it."""
    input_shape, classes = FULL_SIZE[name]
    model = nnx.eval_shape(lambda: models.build_model(name, "bnn"))
    assert model.input_shape == input_shape and model.num_classes == classes
    rows = model_summary(model, batch_size=2)
    assert rows[-1].output_shape == (2, classes)
    layers = _layers(model)
    assert layers[0].mode == "bwn" and layers[0].input_quantizer is None  # the image levels in, unquantized
    assert all(layer.mode == "bnn" and layer.input_quantizer == "sign_ste" for layer in layers[1:])
    last = model.blocks[-1]
    assert isinstance(last, models.DenseBlock) and last.linear.out_features == classes
    assert isinstance(last.bn, nnx.BatchNorm)


def test_zoo_structure_follows_table_v():
    """Channels, pools, strides and layer counts are those of TCBNN Table V."""
    vgg = nnx.eval_shape(lambda: models.build_model("cifar10-vgg"))
    convs = [b for b in vgg.blocks if isinstance(b, models.ConvBlock)]
    assert [b.conv.out_features for b in convs] == [128, 128, 256, 256, 512, 512]
    assert [b.pool for b in convs] == [None, (2, 2)] * 3
    assert [b.linear.out_features for b in vgg.blocks if isinstance(b, models.DenseBlock)] == [1024] * 3 + [10]

    resnet = nnx.eval_shape(lambda: models.build_model("imagenet-resnet18"))
    assert resnet.blocks[0].conv.kernel_size == (7, 7) and resnet.blocks[0].conv.strides == (4, 4)
    residual = [b for b in resnet.blocks if isinstance(b, models.ResidualBlock)]
    assert [(b.out_channels, b.shortcut_stride) for b in residual] == [
        (64, 1), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1)]
    assert len(_layers(resnet)) == 1 + 16 + 3

    alexnet = nnx.eval_shape(lambda: models.build_model("imagenet-alexnet"))
    first = alexnet.blocks[0].conv
    assert (first.kernel_size, first.strides, first.out_features) == ((11, 11), (4, 4), 128)


def test_darknet19_has_the_feature_layers_of_yolov2s_backbone():
    """18 convolutions, 3x3 and 1x1 alternating within a stage, a 2x2 max-pool closing each stage but the
    last, 7x7x1024 features at 224 x 224; TAB's layers 16 and 18 are its 1024C3 on 7x7x512."""
    darknet = nnx.eval_shape(lambda: models.build_model("imagenet-darknet19"))
    convs = [b for b in darknet.blocks if isinstance(b, models.ConvBlock)]
    assert [(b.conv.out_features, b.conv.kernel_size[0]) for b in convs] == [
        (32, 3), (64, 3), (128, 3), (64, 1), (128, 3), (256, 3), (128, 1), (256, 3), (512, 3), (256, 1), (512, 3),
        (256, 1), (512, 3), (1024, 3), (512, 1), (1024, 3), (512, 1), (1024, 3)]  # fmt: skip
    assert [i for i, b in enumerate(convs) if b.pool == (2, 2)] == [0, 1, 4, 7, 12]
    assert all(b.pool is None or b.pool == (2, 2) for b in convs)
    assert model_summary(darknet, batch_size=1)[17].output_shape == (1, 7, 7, 1024)
    assert [(convs[i].conv.in_features, convs[i].conv.out_features) for i in (15, 17)] == [(512, 1024)] * 2


def test_a_resnet_carries_an_integer_stream_between_its_quantizers():
    """A ResNet's stem is a StreamStem (no batch norm, XNOR scale or bias); a residual block has a batch norm
    in front of each quantizer (bn_in, bn1) and none after conv2, whose integer output joins the stream
    unscaled even where the other layers take XNOR scaling and a bias; GlobalPool normalizes the stream's
    sum for the classifier."""
    options = {"xnor_scaling": True, "use_bias": True}
    resnet = nnx.eval_shape(lambda: models.build_model("cifar10-resnet14", layer_options=options))
    stem = resnet.blocks[0]
    assert type(stem) is models.StreamStem and stem.shift == models.STREAM_SHIFT == 7
    assert not hasattr(stem, "bn") and not stem.conv.xnor_scaling and stem.conv.bias is None
    residual = [b for b in resnet.blocks if isinstance(b, models.ResidualBlock)]
    assert len(residual) == 6
    for block in residual:
        assert (block.bn_in.num_features, block.bn1.num_features) == (block.in_channels, block.out_channels)
        assert not hasattr(block, "bn2")
        assert block.conv1.xnor_scaling and block.conv1.use_bias
        assert not block.conv2.xnor_scaling and not block.conv2.use_bias
    pool = resnet.blocks[7]
    assert type(pool) is models.GlobalPool and pool.bn.num_features == 512
    assert [type(b) for b in resnet.blocks[8:]] == [models.DenseBlock] * 3


def test_a_layer_feeding_the_stream_refuses_a_scale_or_bias():
    """The stream's integers enter unscaled: a stem or conv2 with XNOR scaling or a bias is refused."""
    rngs = models.default_rngs(0)
    with pytest.raises(ValueError, match="no XNOR scaling or bias"):
        models.StreamStem(BinaryConv(3, 8, 3, mode="bwn", xnor_scaling=True, rngs=rngs))
    conv1 = BinaryConv(8, 8, 3, rngs=rngs)
    with pytest.raises(ValueError, match="no XNOR scaling or bias"):
        models.ResidualBlock(conv1, BinaryConv(8, 8, 3, use_bias=True, rngs=rngs), rngs=rngs)


def test_mlp_summary_counts_parameters_and_bits():
    """The summary counts quantized and float parameters, their memory and the exporter's packed bytes."""
    model = nnx.eval_shape(lambda: models.build_model("mnist-mlp"))
    rows = model_summary(model)
    quantized = 784 * 1024 + 3 * 1024 * 1024 + 1024 * 10
    assert sum(r.quantized_params for r in rows) == quantized
    bn_floats = 4 * (4 * 1024 + 10)  # scale, bias, mean, var
    assert sum(r.float_params for r in rows) == bn_floats
    assert sum(r.memory_bits for r in rows) == quantized + 32 * bn_floats
    # first layer: its 784 x 1024 int8 weight values (it multiplies the image levels), plus an int32 threshold
    # and a flip byte per channel
    assert rows[0].packed_bytes == 784 * 1024 + 5 * 1024
    # next: 1024 rows of 1024 bits in 8 x 128-bit FSB tiles (8 tile columns), plus a threshold and flip a channel
    assert rows[1].packed_bytes == (1024 // 8) * 8 * 8 * 16 + 5 * 1024
    text = format_summary(model)
    assert "total" in text and f"{quantized:,}" in text


@pytest.mark.parametrize("name, mode, kwargs", [("mnist-mlp", "tnn", {}), ("mnist-mlp", "tbn", {}),
                                               ("cifar10-resnet14", "bnn", dict(width=0.25))])
def test_summary_packed_bytes_are_at_most_the_file_s(name, mode, kwargs):
    """The summary's packed bytes leave out what the file adds (popcounts, the larger folds): never more than the
    exported node's bytes. A ternary kernel is one FSB matrix of twice the rows."""
    model = models.build_model(name, mode, **kwargs)
    exported = size_report(model, export_model(model))
    for row, node in zip(model_summary(model), exported):
        assert row.packed_bytes <= node.packed_bytes, (row, node)


def test_ternary_models_count_two_bits_per_weight():
    """A ternary weight takes two bits of memory, a binary one one."""
    bnn = model_summary(nnx.eval_shape(lambda: models.build_model("mnist-conv", "bnn")))
    tnn = model_summary(nnx.eval_shape(lambda: models.build_model("mnist-conv", "tnn")))
    q = sum(r.quantized_params for r in bnn)
    assert sum(r.memory_bits for r in tnn) - sum(r.memory_bits for r in bnn) == q


# Small inputs / widths where the full architecture would be slow on a CPU; the layer sequence is the same.
SMALL = {
    "mnist-mlp": dict(width=0.125),
    "mnist-conv": dict(width=0.25),
    "cifar10-vgg": dict(width=0.0625),
    "cifar10-resnet14": dict(width=0.0625),
    "imagenet-alexnet": dict(width=0.03125, input_shape=(64, 64, 3), num_classes=20),
    "imagenet-vgg16": dict(width=0.0625, input_shape=(32, 32, 3), num_classes=20),
    "imagenet-resnet18": dict(width=0.0625, input_shape=(64, 64, 3), num_classes=20),
    "imagenet-darknet19": dict(width=0.0625, input_shape=(64, 64, 3), num_classes=20),
}


def _few_steps(model, steps=30, batch=16, seed=0, learning_rate=1e-2):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.integers(0, 256, (batch, *model.input_shape), dtype=np.uint8))
    y = jnp.asarray(rng.integers(0, model.num_classes, batch))
    optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        clip_latent_weights(model)
        return loss, grads

    losses = []
    for _ in range(steps):
        loss, grads = step(model, optimizer)
        losses.append(float(loss))
    return losses, grads


# The three deepest graphs take the longest to compile on a CPU.
ZOO_CASES = [pytest.param(name, marks=pytest.mark.slow)
             if name in ("imagenet-vgg16", "imagenet-resnet18", "imagenet-darknet19") else name
             for name in sorted(SMALL)]


@pytest.mark.parametrize("name", ZOO_CASES)
def test_every_zoo_model_learns_a_fixed_batch(name):
    """Training mode (the float32 blocks, batch statistics, straight-through gradients) fits a fixed batch of
    uint8 images: the loss falls, every layer gets a gradient, latent weights stay clipped."""
    model = models.build_model(name, "bnn", rngs=models.default_rngs(0), **SMALL[name])
    losses, grads = _few_steps(model)
    assert all(math.isfinite(v) for v in losses)
    # single BNN steps are noisy (a sign flip propagates): compare the ends of the run
    assert np.mean(losses[-5:]) < np.mean(losses[:3]), losses
    for layer, g in zip(_layers(model), _layers(grads)):
        assert np.any(np.asarray(g.kernel[...]) != 0), "a layer got no gradient"
        assert float(jnp.max(jnp.abs(layer.kernel[...]))) <= 1.0


@pytest.mark.parametrize("mode", ["tnn", "tbn", "btn", "float"])
def test_mlp_in_other_modes(mode):
    """The MLP's layer modes follow the network mode (first layer bwn / twn / float), and it learns."""
    model = models.build_model("mnist-mlp", mode, width=0.05, rngs=models.default_rngs(1))
    layers = _layers(model)
    assert layers[0].mode == {"tnn": "twn", "tbn": "bwn", "btn": "twn", "float": "float"}[mode]
    assert all(layer.mode == mode for layer in layers[1:])
    losses, _ = _few_steps(model)
    assert np.mean(losses[-5:]) < np.mean(losses[:3]), losses


def test_bad_names_and_inputs_are_refused():
    """Unknown model names and network modes, and images of the wrong shape, are refused."""
    with pytest.raises(ValueError, match="unknown model"):
        models.build_model("lenet")
    with pytest.raises(ValueError, match="unknown network mode"):
        models.build_model("mnist-mlp", "bwn")
    model = models.build_model("mnist-mlp", width=0.05)
    with pytest.raises(ValueError, match="expects images of shape"):
        model(jnp.zeros((2, 32, 32, 3), jnp.uint8))


@pytest.mark.parametrize("name, options, message", [
    ("mnist-mlp", dict(num_classes=0), "num_classes must be a positive int, got 0"),
    ("mnist-mlp", dict(num_classes=True), "num_classes must be a positive int, got True"),
    ("mnist-conv", dict(input_shape=(28, 0, 1)), "input_shape must be a tuple of positive ints"),
    ("mnist-conv", dict(input_shape=(28, 28)), r"a convolution takes \(H, W, C\) images; this network's input_shape"),
    ("mnist-mlp", dict(width=float("nan")), "width must be a finite positive number, got nan"),
    ("mnist-mlp", dict(width=float("inf")), "width must be a finite positive number, got inf"),
    ("imagenet-vgg16", dict(input_shape=(28, 28, 1), width=0.0625),
     r"input \(28, 28, 1\) too small for this network \(block 12 takes \(1, 1, 32\) to nothing\)"),
])
def test_settings_no_network_can_have_are_refused_by_name(name, options, message):
    with pytest.raises(ValueError, match=message):
        models.build_model(name, **options)


def test_a_dense_network_takes_an_input_of_any_rank():
    model = models.build_model("mnist-mlp", input_shape=(784,), width=0.05, rngs=models.default_rngs(0))
    assert model(jnp.zeros((2, 784), jnp.uint8)).shape == (2, 10)


@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.int32])
def test_models_take_uint8_images_only(dtype):
    """Images other than uint8 pixels are refused with a TypeError naming the conversion of float images, in
    training mode and in eval mode."""
    model = models.build_model("mnist-mlp", width=0.05, rngs=models.default_rngs(0))
    images = np.zeros((2, 28, 28, 1), dtype)
    with pytest.raises(TypeError, match=r"formats\.quantize_images"):
        model(images)
    model.eval()
    for forward in (model, model.trace, model.float_forward):
        with pytest.raises(TypeError, match=r"formats\.quantize_images"):
            forward(images)


# --- the eval forward: integers from the pixels to the logits -------------------------------------------


def _narrow_conv_net(mode="bnn", seed=4):
    """mnist-conv on 8 x 8 images, in eval mode: a bwn conv (4 channels), a conv with a 2 x 2 max pool (8),
    another (16), a dense layer (32), the classifier."""
    model = models.build_model("mnist-conv", mode, input_shape=(8, 8, 1), width=0.125,
                               rngs=models.default_rngs(seed))
    model.eval()
    return model


def _jit_trace(model, images):
    graphdef, state = nnx.split(model)
    trace = jax.jit(lambda s, x: nnx.merge(graphdef, s).trace(x))(state, images)
    return jax.tree.map(np.asarray, trace)


def _exact_batch_norm(bn, mean):
    """gamma 1, beta 0, var + epsilon = 1 exactly: the batch norm of z is z - mean, no rounding anywhere."""
    bn.scale[...] = jnp.ones_like(bn.scale[...])
    bn.bias[...] = jnp.zeros_like(bn.bias[...])
    bn.var[...] = jnp.ones_like(bn.var[...])
    bn.epsilon = 0.0
    bn.mean[...] = jnp.asarray(mean, jnp.float32)


def test_an_image_gives_the_same_logits_and_trace_in_any_batch_ties_included():
    """Eval mode is a function of integers: an image's logits and every block's output are the same alone in
    a batch of 1 and inside a batch of 8, with a pre-activation exactly on its batch norm's threshold in two
    layers (a pooled one included), binarized as sign(0) = +1; the packed model agrees there too."""
    model = _narrow_conv_net()
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (1, 8, 8, 1), dtype=np.uint8)
    first, second = model.blocks[0], model.blocks[1]
    # each batch norm's mean is an integer the image's pre-activations reach (at one position, every channel)
    z0 = np.asarray(first.conv.dot(formats.image_levels(image).astype(jnp.float32)))
    _exact_batch_norm(first.bn, z0[0, 3, 4])
    bits0 = np.where(z0 >= z0[0, 3, 4], 1.0, -1.0)
    z1 = np.asarray(models.max_pool(second.conv.dot(jnp.asarray(bits0), quantized=True), second.pool))
    _exact_batch_norm(second.bn, z1[0, 1, 2])
    bits1 = np.where(z1 >= z1[0, 1, 2], 1.0, -1.0)

    alone = _jit_trace(model, image)
    np.testing.assert_array_equal(alone[0], bits0)
    np.testing.assert_array_equal(alone[1], bits1)
    assert (alone[0][0, 3, 4] == 1).all() and (alone[1][0, 1, 2] == 1).all()
    assert (bits0 == -1).any() and (bits1 == -1).any()  # the thresholds split the other positions

    batch = rng.integers(0, 256, (8, 8, 8, 1), dtype=np.uint8)
    batch[5] = image[0]
    together = _jit_trace(model, batch)
    for block_alone, block_together in zip(alone, together):
        np.testing.assert_array_equal(block_alone[0], block_together[5])
    # eager, op by op: the logits up to the float32 rounding of the final affine, whose products XLA may sum in
    # another order op by op than compiled whole (it did with most optimizations off, tests/conftest.py)
    np.testing.assert_allclose(np.asarray(model(image))[0], together[-1][5], rtol=4e-6, atol=0)

    report = fidelity_report(model, runtime.from_packed(export_model(model)), batch)
    assert report.exact and report.logits_max_rel_diff <= 4e-6, report.summary()


def _packed_values(out, channels):
    """A packed node output as values: bits as ±1, a ternary plane pair (nonneg, pos) as nonneg + pos - 1."""
    planes = out if isinstance(out, tuple) else (out,)
    bits = [np.asarray(formats.unpack_bits(p, channels)).astype(int) for p in planes]
    return 2 * bits[0] - 1 if len(bits) == 1 else bits[0] + bits[1] - 1


@pytest.mark.parametrize("mode", ["bnn", "tnn"])
def test_a_nan_batch_norm_output_reads_as_minus_one(mode):
    """A batch norm whose output is NaN (var = -epsilon, a NaN mean) gives -1 to the layer reading it: bit 0
    for a binary operand, -1 for a ternary one, in the Flax eval forward and the exported packed model."""
    model = _narrow_conv_net(mode)
    first, second = model.blocks[0].bn, model.blocks[1].bn
    first.var[...] = first.var[...].at[0].set(-first.epsilon)  # var + epsilon = 0 exactly
    first.mean[...] = first.mean[...].at[1].set(jnp.nan)
    second.mean[...] = second.mean[...].at[2].set(jnp.nan)
    images = np.random.default_rng(1).integers(0, 256, (6, 8, 8, 1), dtype=np.uint8)
    flax_trace = _jit_trace(model, images)
    packed_trace = runtime.from_packed(export_model(model)).trace(images)
    for block, nan_channels in ((0, [0, 1]), (1, [2])):
        flax = flax_trace[block]
        packed = _packed_values(packed_trace[block], flax.shape[-1])
        assert (flax[..., nan_channels] == -1).all()
        np.testing.assert_array_equal(packed, flax)
        others = np.delete(flax, nan_channels, axis=-1)
        assert (others == 1).any() and (others == -1).any()
        if mode == "tnn":
            assert (others == 0).any()


# Random batch statistics and affine parameters (zoo_cases.randomize): no exact ties.
AGREEMENT_CASES = [
    ("mnist-mlp", "tbn", dict(input_shape=(28, 28, 1), width=0.125), {"input_threshold": "learned"}),
    ("mnist-conv", "bnn", dict(input_shape=(14, 14, 1), width=0.25), {"xnor_scaling": True, "use_bias": True}),
    ("cifar10-resnet14", "tnn", dict(input_shape=(8, 8, 3), width=0.0625), {"xnor_scaling": True}),
]


@pytest.mark.parametrize("name, mode, size, options", AGREEMENT_CASES)
def test_the_eval_forward_is_the_float_network_away_from_ties(name, mode, size, options):
    """The integer eval forward computes the float network it stands for (`float_forward` in eval mode).
    Criterion: predictions and logits (to float32 rounding) equal on at least 62 of 64 random images. They
    may differ only where a float32 batch norm lands within a rounding of a quantizer's threshold, which
    random statistics make rare (all 64 agree here); exact equality is the integer contract, checked at ties
    above and against the packed model in test_export."""
    model = models.build_model(name, mode, num_classes=10, rngs=nnx.Rngs(0), layer_options=options, **size)
    randomize(model, 1)
    assert model.integer_eval()
    images = images_for(model, 64, seed=3)
    graphdef, state = nnx.split(model)
    integer = np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, images))
    floats = np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s).float_forward(x))(state, images))
    assert np.sum(np.argmax(integer, -1) == np.argmax(floats, -1)) >= 62
    assert np.sum(np.all(np.isclose(integer, floats, rtol=1e-5, atol=1e-5), axis=-1)) >= 62


def _integer_conv(levels, kernel, stride, padding):
    """Integer convolution (int64), NHWC x HWIO, padded with level 0."""
    x = np.pad(levels, ((0, 0), *padding, (0, 0)))
    kh, kw, _, _ = kernel.shape
    oh, ow = (x.shape[1] - kh) // stride + 1, (x.shape[2] - kw) // stride + 1
    out = np.zeros((x.shape[0], oh, ow, kernel.shape[-1]), np.int64)
    for i in range(kh):
        for j in range(kw):
            out += x[:, i:i + stride * oh:stride, j:j + stride * ow:stride, :] @ kernel[i, j]
    return out


def test_the_resnet_stream_is_integers():
    """Eval mode: the stem outputs floor(conv(levels) / 128) (rounding down below zero too); each residual
    block's stream is integers: conv2's dot product of its ±1 input plus the shortcut, which at stride 2
    takes every other row and column of the stream and zero-pads its channels, at stride 1 is the stream."""
    model = models.build_model("cifar10-resnet14", "bnn", input_shape=(8, 8, 3), width=0.0625,
                               rngs=models.default_rngs(5))
    randomize(model, 6)
    images = images_for(model, 4, seed=7)
    trace = _jit_trace(model, images)

    stem = model.blocks[0].conv
    kernel = np.asarray(stem.quantized_kernel()).astype(np.int64)
    conv = _integer_conv(images.astype(np.int64) - 128, kernel, stem.strides[0], stem.explicit_padding(8, 8))
    np.testing.assert_array_equal(trace[0], np.floor_divide(conv, 128))
    assert ((conv < 0) & (conv % 128 != 0)).any()  # where floor and truncation differ

    stream, seen = trace[0], set()
    for block, (inner, out) in zip(model.blocks[1:7], trace[1:7]):
        assert isinstance(block, models.ResidualBlock)
        assert set(np.unique(inner)) <= {-1.0, 1.0}
        np.testing.assert_array_equal(out, np.round(out))
        conv2 = np.asarray(block.conv2.dot(jnp.asarray(inner), quantized=True))
        s = block.shortcut_stride
        shortcut = np.zeros_like(out)
        shortcut[..., :block.in_channels] = stream[:, ::s, ::s, :]
        np.testing.assert_array_equal(out - conv2, shortcut)
        seen.add((s, block.in_channels, block.out_channels))
        stream = out
    assert {(1, 8, 8), (2, 8, 16), (2, 16, 32)} <= seen


def test_eval_mode_runs_integers_where_the_activations_are_integers():
    """model.eval() runs the integer forward for binary / ternary activations; a float network, XNOR input
    scaling (per-sample float scales) and training mode run the float forward, where trace() is refused."""
    images = np.random.default_rng(2).integers(0, 256, (3, 28, 28, 1), dtype=np.uint8)
    bnn = models.build_model("mnist-mlp", width=0.05, rngs=models.default_rngs(0))
    assert not bnn.integer_eval()
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        bnn.trace(images)
    bnn.eval()
    assert bnn.integer_eval()
    np.testing.assert_array_equal(bnn(images), bnn.trace(images)[-1])
    for model in (models.build_model("mnist-mlp", "float", width=0.05, rngs=models.default_rngs(0)),
                  models.build_model("mnist-mlp", width=0.05, rngs=models.default_rngs(0),
                                     layer_options={"input_scaling": True})):
        model.eval()
        assert not model.integer_eval()
        np.testing.assert_array_equal(model(images), model.float_forward(images))
        with pytest.raises(ValueError, match=r"model\.eval\(\)"):
            model.trace(images)


def test_seeds_that_differ_above_bit_31_build_different_weights():
    """Without x64 jax keeps a seed's low 32 bits; the high word is folded into the key (seeds below 2^32 keep
    jax's key of the seed as it is)."""
    def kernel(seed):
        return np.asarray(models.build_model("mnist-mlp", width=0.0625, rngs=models.default_rngs(seed)).blocks[1]
                          .linear.kernel[...])
    assert not np.array_equal(kernel(0), kernel(2**32))
    assert not np.array_equal(kernel(5), kernel(2**40 + 5))
    for seed in (-1, 2**64, 1.5, True):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\^64\)"):
            models.default_rngs(seed)
    np.testing.assert_array_equal(
        jax.random.key_data(models.default_rngs(7).params()),
        jax.random.key_data(nnx.Rngs(jax.random.key(7, impl="rbg")).params()))
