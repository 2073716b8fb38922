"""Packed zoo models on the GPU: the jitted program calls the CUDA targets, and every layer's packed output
equals the CPU run's (the popcount kernels, or the reference where no CPU module is built) bit for bit, the
float outputs to float32 rounding.

The small models of zoo_cases.py (every network mode; channel counts of a few words: mostly the mma.sync
engine) and ResNet-18 / VGG-16 at full width on 32 x 32 images, whose layers of C = 64 to 512 the planner's
rules give to the wgmma kernels: the image band (C = 64 as pixel pairs, C = 128), the persistent kernel
(stride 2, its 3-step short-K instance at C = 64; rows no TMA box takes), the resident weights (VGG-16's 8 x 8
layers); VGG-16's pooled layers take the CUDA path of a pooled threshold convolution (ops.pool_threshold_bits).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxbnn import _ffi, runtime
from jaxbnn.export import export_model
from jaxbnn.models import build_model
from zoo_cases import CASES, images_for, randomize, zoo_model

pytestmark = pytest.mark.gpu

CPU = jax.devices("cpu")[0]
FULL_WIDTH = [("imagenet-resnet18", "bnn", {}), ("imagenet-vgg16", "bnn", {"padding_value": "one"})]


def _gpu():
    return jax.devices("cuda")[0]


def _outputs(net, images, device):
    with jax.default_device(device):
        return [np.asarray(leaf) for leaf in jax.tree.leaves(net.trace(images))]


def _run_on_both(model, images):
    net = runtime.from_packed(export_model(model, target="sm90"))
    gpu = _gpu()
    with jax.default_device(gpu):
        text = net._trace.lower(net.params, images).as_text()
    targets = [f"jaxbnn_{op}_{epilogue}" for op in ("bmm", "bconv2d") for epilogue in ("i32", "f32", "bits")]
    assert any(_ffi.has_target("cuda", t) and t in text for t in targets), "the GPU program calls no CUDA target"
    for i, (want, got) in enumerate(zip(_outputs(net, images, CPU), _outputs(net, images, gpu), strict=True)):
        if np.issubdtype(want.dtype, np.integer):
            np.testing.assert_array_equal(got, want, err_msg=f"output {i}")
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"output {i}")


@pytest.mark.parametrize("name, mode, options", CASES, ids=[f"{n}-{m}-{i}" for i, (n, m, _) in enumerate(CASES)])
def test_small_zoo_model_on_the_gpu_equals_the_cpu(name, mode, options):
    model = zoo_model(name, mode, options)
    _run_on_both(model, images_for(model, 5, seed=7))


@pytest.mark.parametrize("name, mode, options", FULL_WIDTH, ids=[n for n, _, _ in FULL_WIDTH])
def test_full_width_model_on_the_gpu_equals_the_cpu(name, mode, options):
    model = randomize(build_model(name, mode, num_classes=10, input_shape=(32, 32, 3), width=1.0,
                                  rngs=nnx.Rngs(0), layer_options=options), 1)
    _run_on_both(model, images_for(model, 4, seed=8))
