"""The model zoo as the export and GPU tests build it: every model at a small input size and width (the
layer sequence is the architecture's), the network modes and layer options to cover, random batch-norm
statistics and affine parameters or a short training run, random uint8 images."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxbnn.cli import import_train_module
from jaxbnn.models import build_model

SMALL = {
    "mnist-mlp": dict(input_shape=(28, 28, 1), width=0.125),
    "mnist-conv": dict(input_shape=(14, 14, 1), width=0.25),
    "cifar10-vgg": dict(input_shape=(8, 8, 3), width=0.0625),
    "cifar10-resnet14": dict(input_shape=(8, 8, 3), width=0.0625),
    "imagenet-alexnet": dict(input_shape=(67, 67, 3), width=0.03125),
    "imagenet-vgg16": dict(input_shape=(32, 32, 3), width=0.0625),
    "imagenet-resnet18": dict(input_shape=(32, 32, 3), width=0.0625),
    "imagenet-darknet19": dict(input_shape=(32, 32, 3), width=0.0625),
}

# Every zoo model at the input size it is built for, narrow (the layer sequence and the image are the real
# ones; the channels are few, so a CPU runs it in seconds).
REAL_SIZE = {
    "mnist-mlp": dict(input_shape=(28, 28, 1), width=0.125),
    "mnist-conv": dict(input_shape=(28, 28, 1), width=0.25),
    "cifar10-vgg": dict(input_shape=(32, 32, 3), width=0.0625),
    "cifar10-resnet14": dict(input_shape=(32, 32, 3), width=0.0625),
    "imagenet-alexnet": dict(input_shape=(224, 224, 3), width=0.0625),
    "imagenet-vgg16": dict(input_shape=(224, 224, 3), width=0.0625),
    "imagenet-resnet18": dict(input_shape=(224, 224, 3), width=0.0625),
    "imagenet-darknet19": dict(input_shape=(224, 224, 3), width=0.0625),
}
NETWORK_MODES = ("bnn", "tnn", "tbn", "btn")

CASES = [
    ("mnist-mlp", "bnn", {}),
    ("mnist-mlp", "tnn", {}),
    ("mnist-mlp", "tbn", {"input_threshold": "learned"}),
    ("mnist-mlp", "btn", {"kernel_threshold": "twn_channel", "xnor_scaling": True}),
    ("mnist-conv", "bnn", {"xnor_scaling": True, "use_bias": True}),
    ("mnist-conv", "bnn", {"padding_value": "one"}),
    ("mnist-conv", "tnn", {"input_threshold": "learned", "kernel_threshold": "learned", "padding_value": "one"}),
    ("cifar10-vgg", "tbn", {}),
    ("cifar10-vgg", "btn", {}),
    ("cifar10-resnet14", "bnn", {}),
    ("cifar10-resnet14", "tnn", {"xnor_scaling": True}),
    ("imagenet-alexnet", "bnn", {}),
    ("imagenet-vgg16", "bnn", {}),
    ("imagenet-resnet18", "btn", {"padding_value": "one"}),
    ("imagenet-darknet19", "tnn", {}),
    ("imagenet-darknet19", "tbn", {"padding_value": "one"}),
]


def randomize(model, seed):
    """Random batch-norm statistics and affine parameters; random biases and learned thresholds."""
    rng = np.random.default_rng(seed)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.BatchNorm):
            c = module.num_features
            gamma = rng.normal(size=c)
            gamma[rng.random(c) < 0.1] = 0.0
            module.mean[...] = jnp.asarray(rng.normal(size=c) * 3, jnp.float32)
            module.var[...] = jnp.asarray(rng.uniform(0.05, 4, size=c), jnp.float32)
            module.scale[...] = jnp.asarray(gamma, jnp.float32)
            module.bias[...] = jnp.asarray(rng.normal(size=c), jnp.float32)
            continue
        for name, centre in (("bias", 0.0), ("input_alpha", 0.3), ("input_beta", -0.3),
                             ("kernel_alpha", 0.3), ("kernel_beta", -0.3)):
            param = getattr(module, name, None)
            if isinstance(param, nnx.Param):
                param[...] = jnp.asarray(centre + 0.2 * rng.normal(size=param[...].shape), jnp.float32)
    model.eval()
    return model


def zoo_model(name, mode, options, seed=0, sizes=SMALL):
    spec = sizes[name]
    model = build_model(name, mode, num_classes=10, input_shape=spec["input_shape"], width=spec["width"],
                        rngs=nnx.Rngs(seed), layer_options=options)
    return randomize(model, seed + 1)


# Zoo models trained: the MNIST and CIFAR-10 ones, each in another network mode, in the default suite (the
# ImageNet graphs take the longest to compile for training on a CPU); every model in every mode under
# --run-slow and on the GPU. Ternary operands with learned thresholds, so that training moves them too.
def trained_options(mode):
    return {"bnn": {}, "tnn": {"input_threshold": "learned", "kernel_threshold": "learned"},
            "tbn": {"input_threshold": "learned"}, "btn": {"kernel_threshold": "learned"}}[mode]


TRAINED_ROTATED = [(name, NETWORK_MODES[i]) for i, name in
                   enumerate(["mnist-mlp", "mnist-conv", "cifar10-vgg", "cifar10-resnet14"])]


def trained_zoo_model(name, mode, options, steps=20, seed=0, sizes=SMALL):
    """A zoo model after `steps` steps of the training loop's own step (`train.loop.train_step`: Adam with
    cosine decay, batch statistics, straight-through gradients, latent weights clipped) on a fixed batch of
    random uint8 images and labels, then in eval mode: its batch-norm running statistics, latent weights and
    learned thresholds are a training run's, not drawn."""
    loop = import_train_module("loop")
    spec = sizes[name]
    model = build_model(name, mode, num_classes=10, input_shape=spec["input_shape"], width=spec["width"],
                        rngs=nnx.Rngs(seed), layer_options=options)
    rng = np.random.default_rng(seed)
    images = jnp.asarray(rng.integers(0, 256, size=(16, *model.input_shape), dtype=np.uint8))
    labels = jnp.asarray(rng.integers(0, 10, size=16))
    optimizer = loop.make_optimizer(model, 1e-2, steps)
    model.train()
    for _ in range(steps):
        loop.train_step(model, optimizer, images, labels)
    model.eval()
    return model


def images_for(model, count, seed):
    """Random uint8 images (every pixel value equally likely)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(count, *model.input_shape), dtype=np.uint8)
