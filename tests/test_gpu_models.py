"""Zoo models on the GPU are exact: the packed model on the GPU, the packed model on the CPU, and the Flax
model's eval forward on the GPU and on the CPU give the same predictions, the same packed bits, ternary
values and integer stream at every node, and logits equal to float32 rounding of the final affine.

Random-init networks with random batch-norm statistics on random uint8 images (the strictest case: a
flipped bit travels to the output): the small models of zoo_cases.py (every network mode, layer options
included), every zoo model in every mode at its real input size (narrow), and ResNet-18 / VGG-16 at full
width on 32 x 32 images, whose layers of C = 64 to 512 the planner's rules give to the wgmma kernels (the
image band, the persistent and resident kernels, VGG-16's pooled threshold convolutions). Trained networks:
every small zoo model in every mode after a short training run on the GPU (its running statistics, latent
weights and learned thresholds a training's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxbnn import _ffi, runtime
from jaxbnn.export import export_model, fidelity_report
from jaxbnn.models import build_model
from zoo_cases import (CASES, NETWORK_MODES, REAL_SIZE, SMALL, images_for, randomize, trained_options,
                       trained_zoo_model, zoo_model)

pytestmark = pytest.mark.gpu

CPU = jax.devices("cpu")[0]
# (TNN and BTN at full width: their convolutions read the repeated side-by-side planes in place, x_repeats 2)
FULL_WIDTH = [("imagenet-resnet18", "bnn", {}), ("imagenet-vgg16", "bnn", {"padding_value": "one"}),
              ("imagenet-resnet18", "tnn", {}), ("imagenet-resnet18", "btn", {})]


def _gpu():
    return jax.devices("cuda")[0]


def _leaves(tree):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def _flax_trace(model, images, device):
    graphdef, state = nnx.split(model)
    with jax.default_device(device):
        state = jax.device_put(state, device)
        return _leaves(jax.jit(lambda s, x: nnx.merge(graphdef, s).trace(x))(state, jax.device_put(images, device)))


def _packed_trace(net, images, device):
    with jax.default_device(device):
        return _leaves(net._trace(jax.device_put(net.params, device), jax.device_put(images, device)))


def _assert_same(runs: dict, names):
    """Every run's node outputs equal the first run's: integers exactly, the logits to float32 rounding."""
    (first, want), *others = runs.items()
    for other, got in others:
        assert len(got) == len(want), (first, other)
        for i, (a, b) in enumerate(zip(want, got)):
            where = f"{other} vs {first}, output {i} ({names[min(i, len(names) - 1)]})"
            if np.issubdtype(a.dtype, np.floating) and i == len(want) - 1:
                np.testing.assert_allclose(b, a, rtol=4e-6, atol=4e-6, err_msg=where)
                assert np.array_equal(np.argmax(a, -1), np.argmax(b, -1)), where
            else:
                np.testing.assert_array_equal(b, a, err_msg=where)


def _check_everywhere(model, images):
    net = runtime.from_packed(export_model(model, target="sm90"))
    gpu = _gpu()
    with jax.default_device(gpu):
        text = net._trace.lower(net.params, images).as_text()
    targets = [f"jaxbnn_{op}_{epilogue}" for op in ("bmm", "bconv2d") for epilogue in ("i32", "f32", "bits")]
    assert any(_ffi.has_target("cuda", t) and t in text for t in targets), "the GPU program calls no CUDA target"
    if net.graph["mode"] == "bnn" and jnp.int16 in net.stream_dtypes:  # conv2 writes the narrow stream itself
        assert "jaxbnn_bconv2d_i16" in text or "jaxbnn_bconv2d_residual_i16" in text
    names = [n["name"] for n in net.graph["nodes"]]
    packed = {"packed CPU": _packed_trace(net, images, CPU), "packed GPU": _packed_trace(net, images, gpu)}
    _assert_same(packed, names)
    flax = {"Flax CPU": _flax_trace(model, images, CPU), "Flax GPU": _flax_trace(model, images, gpu)}
    _assert_same(flax, names)
    # packed against Flax node by node (bits against ±1 / ternary values) on the GPU
    with jax.default_device(gpu):
        report = fidelity_report(model, net, images)
    assert report.exact and report.logits_max_rel_diff <= 4e-6, report.summary()


@pytest.mark.parametrize("name, mode, options", CASES, ids=[f"{n}-{m}-{i}" for i, (n, m, _) in enumerate(CASES)])
def test_small_zoo_model_is_the_same_everywhere(name, mode, options):
    model = zoo_model(name, mode, options)
    _check_everywhere(model, images_for(model, 6, seed=7))


@pytest.mark.parametrize("mode", NETWORK_MODES)
@pytest.mark.parametrize("name", sorted(REAL_SIZE))
def test_zoo_model_at_its_real_input_size_is_the_same_everywhere(name, mode):
    model = zoo_model(name, mode, {}, seed=3, sizes=REAL_SIZE)
    _check_everywhere(model, images_for(model, 4, seed=9))


@pytest.mark.parametrize("mode", NETWORK_MODES)
@pytest.mark.parametrize("name", sorted(SMALL))
def test_trained_zoo_model_is_the_same_everywhere(name, mode):
    model = trained_zoo_model(name, mode, trained_options(mode))
    _check_everywhere(model, images_for(model, 6, seed=13))


@pytest.mark.parametrize("name, mode, options", FULL_WIDTH, ids=[f"{n}-{m}" for n, m, _ in FULL_WIDTH])
def test_full_width_model_is_the_same_everywhere(name, mode, options):
    model = randomize(build_model(name, mode, num_classes=10, input_shape=(32, 32, 3), width=1.0,
                                  rngs=nnx.Rngs(0), layer_options=options), 1)
    _check_everywhere(model, images_for(model, 4, seed=8))


@pytest.mark.parametrize("mode", ["tnn", "btn"])
def test_full_width_ternary_convolutions_read_their_repeated_planes_in_place(mode):
    """TNN's and BTN's side-by-side blocks repeat the activation planes; the CUDA convolutions read them twice a
    tap (x_repeats = 2) where a pixel's planes are whole 16-byte chunks (ResNet-18's C >= 64 for TNN, >= 128 for
    BTN), not a copy."""
    model = build_model("imagenet-resnet18", mode, num_classes=10, input_shape=(32, 32, 3), width=1.0,
                        rngs=nnx.Rngs(0))
    net = runtime.from_packed(export_model(model, target="sm90"))
    with jax.default_device(_gpu()):
        text = net._trace.lower(net.params, images_for(model, 2, seed=3)).as_text()
    assert "x_repeats = 2" in text


@pytest.mark.parametrize("name", ["cifar10-resnet14", "imagenet-resnet18"])
def test_dense_chains_give_the_logits_of_the_layers_one_by_one(name):
    """At full width the ResNets' dense tails run as one kernel on CUDA (`ops.bmm_chain`): the forward calls it,
    and its logits are exactly those of the same layers run one kernel a layer, at a batch of one CTA's rows and
    at one past several CTAs."""
    model = randomize(build_model(name, "bnn", input_shape=(32, 32, 3), rngs=nnx.Rngs(0)), 2)
    net = runtime.from_packed(export_model(model, target="sm90"))
    nodes = net.graph["nodes"]
    for batch in (8, 37):
        images = jax.device_put(images_for(model, batch, seed=batch), _gpu())
        assert runtime.dense_chains_of(nodes, batch), name
        with jax.default_device(_gpu()):
            forward = jax.jit(lambda p, x: runtime.run_nodes(nodes, p, x, net.stream_dtypes)[-1])
            assert "jaxbnn_bmm_chain_" in forward.lower(net.params, images).as_text()
            chained = np.asarray(forward(net.params, images))
            one_by_one = np.asarray(jax.jit(lambda p, x: runtime.run_nodes(nodes, p, x, net.stream_dtypes,
                                                                          dense_chains=False)[-1])(net.params, images))
        np.testing.assert_array_equal(chained, one_by_one)
