"""The model zoo: full-size shapes and structure (traced abstractly), a few training steps per model."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxbnn import models
from jaxbnn.layers import BinaryConv, BinaryLinear, clip_latent_weights
from jaxbnn.summary import format_summary, model_summary

FULL_SIZE = {
    "mnist-mlp": ((28, 28, 1), 10),
    "mnist-conv": ((28, 28, 1), 10),
    "cifar10-vgg": ((32, 32, 3), 10),
    "cifar10-resnet14": ((32, 32, 3), 10),
    "imagenet-alexnet": ((224, 224, 3), 1000),
    "imagenet-vgg16": ((224, 224, 3), 1000),
    "imagenet-resnet18": ((224, 224, 3), 1000),
}


def _layers(model):
    return [m for _, m in nnx.iter_modules(model) if isinstance(m, (BinaryConv, BinaryLinear))]


@pytest.mark.parametrize("name", sorted(FULL_SIZE))
def test_full_size_models_trace_to_logits(name):
    input_shape, classes = FULL_SIZE[name]
    model = nnx.eval_shape(lambda: models.build_model(name, "bnn"))
    assert model.input_shape == input_shape and model.num_classes == classes
    rows = model_summary(model, batch_size=2)
    assert rows[-1].output_shape == (2, classes)
    layers = _layers(model)
    assert layers[0].mode == "bwn" and layers[0].input_quantizer is None  # float image in
    assert all(layer.mode == "bnn" and layer.input_quantizer == "sign_ste" for layer in layers[1:])
    last = model.blocks[-1]
    assert isinstance(last, models.DenseBlock) and last.linear.out_features == classes
    assert isinstance(last.bn, nnx.BatchNorm)


def test_zoo_structure_follows_table_v():
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


def test_mlp_summary_counts_parameters_and_bits():
    model = nnx.eval_shape(lambda: models.build_model("mnist-mlp"))
    rows = model_summary(model)
    quantized = 784 * 1024 + 3 * 1024 * 1024 + 1024 * 10
    assert sum(r.quantized_params for r in rows) == quantized
    bn_floats = 4 * (4 * 1024 + 10)  # scale, bias, mean, var
    assert sum(r.float_params for r in rows) == bn_floats
    assert sum(r.memory_bits for r in rows) == quantized + 32 * bn_floats
    # first layer: 1024 rows of 784 bits in 8 x 128-bit FSB tiles (7 tile columns), plus 2 words per channel
    assert rows[0].packed_bytes == (1024 // 8) * 7 * 8 * 16 + 8 * 1024
    text = format_summary(model)
    assert "total" in text and f"{quantized:,}" in text


def test_ternary_models_count_two_bits_per_weight():
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
}


def _few_steps(model, steps=30, batch=16, seed=0, learning_rate=1e-2):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.uniform(-1, 1, (batch, *model.input_shape)).astype(np.float32))
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


# The two deepest graphs take the longest to compile on a CPU.
ZOO_CASES = [pytest.param(name, marks=pytest.mark.slow) if name in ("imagenet-vgg16", "imagenet-resnet18") else name
             for name in sorted(SMALL)]


@pytest.mark.parametrize("name", ZOO_CASES)
def test_every_zoo_model_learns_a_fixed_batch(name):
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
    model = models.build_model("mnist-mlp", mode, width=0.05, rngs=models.default_rngs(1))
    layers = _layers(model)
    assert layers[0].mode == {"tnn": "twn", "tbn": "bwn", "btn": "twn", "float": "float"}[mode]
    assert all(layer.mode == mode for layer in layers[1:])
    losses, _ = _few_steps(model)
    assert np.mean(losses[-5:]) < np.mean(losses[:3]), losses


def test_residual_block_adds_a_type_a_shortcut():
    model = models.build_model("cifar10-resnet14", width=0.0625, rngs=models.default_rngs(2))
    block = next(b for b in model.blocks if isinstance(b, models.ResidualBlock) and b.shortcut_stride == 2)
    block.eval()
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 8, 8, block.in_channels)).astype(np.float32))
    main = block.bn2(block.conv2(block.bn1(block.conv1(x))))
    out = block(x)
    shortcut = np.asarray(out - main)
    np.testing.assert_allclose(shortcut[..., :block.in_channels], np.asarray(x)[:, ::2, ::2, :], atol=1e-5)
    np.testing.assert_array_equal(shortcut[..., block.in_channels:], 0.0)


def test_bad_names_and_inputs_are_refused():
    with pytest.raises(ValueError, match="unknown model"):
        models.build_model("lenet")
    with pytest.raises(ValueError, match="unknown network mode"):
        models.build_model("mnist-mlp", "bwn")
    model = models.build_model("mnist-mlp", width=0.05)
    with pytest.raises(ValueError, match="expects inputs of shape"):
        model(jnp.zeros((2, 32, 32, 3)))
