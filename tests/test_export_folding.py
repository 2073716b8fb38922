"""The folding math: batch norm (+ XNOR alpha, bias) and the next quantizer as one threshold comparison.

The reference is always the Flax model's own float computation (nnx.BatchNorm in eval mode, jitted), on
every integer the dot product can reach, or on float inputs placed right around the found threshold.
Batch-norm parameters are adversarial: negative, zero, tiny, subnormal and huge gamma; zero variance;
large eps; means that put the boundary exactly on an integer; thresholds outside the reachable range.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxbnn.export.folding import BnChain, NonMonotoneError, float_thresholds, integer_thresholds

GAMMAS = [1.0, -1.0, 0.0, -0.0, 1e-30, -1e-30, 1e-42, 1e30, -1e30, 3e38, 0.37, -2.5]


def adversarial_bn(seed: int, epsilon: float = 1e-5) -> nnx.BatchNorm:
    """A batch norm in eval mode with one channel per adversarial gamma, then random channels."""
    rng = np.random.default_rng(seed)
    n = len(GAMMAS) + 20
    gamma = np.concatenate([GAMMAS, rng.normal(size=20) * 3]).astype(np.float32)
    mean = (rng.integers(-20, 20, size=n) + rng.choice([0.0, 0.5, 0.25], size=n)).astype(np.float32)
    var = rng.choice([0.0, 1e-8, 0.5, 1.0, 37.0], size=n).astype(np.float32)
    beta = rng.choice([0.0, -0.0, 1e-3, -1.0, 2.0, 1e6, -1e6], size=n).astype(np.float32)
    bn = nnx.BatchNorm(n, epsilon=epsilon, rngs=nnx.Rngs(0))
    bn.mean[...], bn.var[...] = jnp.asarray(mean), jnp.asarray(var)
    bn.scale[...], bn.bias[...] = jnp.asarray(gamma), jnp.asarray(beta)
    bn.eval()
    return bn


def chain_of(bn: nnx.BatchNorm, alpha=None, bias=None) -> BnChain:
    return BnChain(np.asarray(bn.mean[...]), np.asarray(bn.var[...]), bn.epsilon, np.asarray(bn.scale[...]),
                   np.asarray(bn.bias[...]), alpha, bias)


def flax_response(bn, y, alpha=None, bias=None):
    """What the Flax block computes from pre-activations y: bn(y * alpha + bias), jitted as in a model."""

    @nnx.jit
    def run(bn, y):
        if alpha is not None:
            y = y * alpha
        if bias is not None:
            y = y + bias
        return bn(y)

    return np.asarray(run(bn, jnp.asarray(y, jnp.float32)))


def apply_thresholds(values, threshold, flip):
    return np.where(flip, values <= threshold, values >= threshold)


@pytest.mark.parametrize("epsilon", [1e-5, 1e-3, 0.5])
@pytest.mark.parametrize("k", [1, 32, 77, 1024])
def test_integer_thresholds_equal_sign_of_batch_norm_on_every_reachable_dot(epsilon, k):
    bn = adversarial_bn(k, epsilon)
    threshold, flip = integer_thresholds(chain_of(bn), k)
    dots = np.arange(-k, k + 1, dtype=np.float32)
    expected = flax_response(bn, np.broadcast_to(dots[:, None], (len(dots), bn.num_features))) >= 0
    np.testing.assert_array_equal(apply_thresholds(dots[:, None], threshold, flip), expected)


def test_directions_and_constant_channels():
    bn = adversarial_bn(0)
    k = 50
    threshold, flip = integer_thresholds(chain_of(bn), k)
    gamma = np.asarray(bn.scale[...])
    varying = (threshold > -k) & (threshold < k)
    assert np.all(flip[varying] == (gamma[varying] < 0)), "negative gamma flips the comparison"
    # gamma = 0: the output is the constant sign of beta; the threshold lies outside [-k, k].
    for channel in np.flatnonzero(gamma == 0):
        on = np.asarray(bn.bias[...])[channel] >= 0
        dots = np.arange(-k, k + 1)
        assert np.all(apply_thresholds(dots, threshold[channel], flip[channel]) == on)
        assert threshold[channel] in (-k, k + 1, -k - 1)


def test_boundary_exactly_on_an_integer_turns_the_bit_on():
    # bn(dot) = (dot - 3) * gamma: exactly 0 at dot = 3, where sign(0) = +1.
    bn = nnx.BatchNorm(2, epsilon=0.0, rngs=nnx.Rngs(0))
    bn.mean[...] = jnp.asarray([3.0, 3.0])
    bn.var[...] = jnp.asarray([1.0, 1.0])
    bn.scale[...] = jnp.asarray([2.0, -2.0])
    bn.bias[...] = jnp.asarray([0.0, 0.0])
    threshold, flip = integer_thresholds(chain_of(bn), 9)
    np.testing.assert_array_equal(threshold, [3, 3])
    np.testing.assert_array_equal(flip, [False, True])


def test_thresholds_outside_the_reachable_range():
    bn = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
    bn.mean[...] = jnp.asarray([0.0, 0.0, 0.0, 0.0])
    bn.var[...] = jnp.asarray([1.0, 1.0, 1.0, 1.0])
    bn.scale[...] = jnp.asarray([1.0, 1.0, -1.0, -1.0])
    bn.bias[...] = jnp.asarray([100.0, -100.0, 100.0, -100.0])  # |beta| > k: constant over [-k, k]
    k = 10
    threshold, flip = integer_thresholds(chain_of(bn), k)
    dots = np.arange(-k, k + 1)[:, None]
    bits = apply_thresholds(dots, threshold, flip)
    np.testing.assert_array_equal(bits.all(axis=0), [True, False, True, False])
    np.testing.assert_array_equal((~bits).all(axis=0), [False, True, False, True])


def test_xnor_alpha_and_layer_bias_fold_into_the_threshold():
    bn = adversarial_bn(3)
    rng = np.random.default_rng(3)
    alpha = rng.uniform(0.0, 2.0, size=bn.num_features).astype(np.float32)
    alpha[0] = 0.0  # an all-zero kernel: constant channel
    bias = rng.normal(size=bn.num_features).astype(np.float32)
    k = 300
    threshold, flip = integer_thresholds(chain_of(bn, alpha, bias), k)
    dots = np.arange(-k, k + 1, dtype=np.float32)
    expected = flax_response(bn, np.broadcast_to(dots[:, None], (len(dots), bn.num_features)), alpha, bias) >= 0
    np.testing.assert_array_equal(apply_thresholds(dots[:, None], threshold, flip), expected)


@pytest.mark.parametrize("strict", [False, True])
def test_ternary_levels_per_channel_and_per_feature(strict):
    bn = adversarial_bn(5)
    c = bn.num_features
    rng = np.random.default_rng(5)
    level = rng.normal(size=(3, c)).astype(np.float32)  # e.g. per (position, channel) thresholds
    level[0, :4] = [0.0, 1e9, -1e9, 0.5]
    k = 64
    threshold, flip = integer_thresholds(chain_of(bn), k, level, strict)
    assert threshold.shape == flip.shape == (3, c)
    dots = np.arange(-k, k + 1, dtype=np.float32)
    response = flax_response(bn, np.broadcast_to(dots[:, None], (len(dots), c)))[:, None, :]
    expected = response > level if strict else response >= level
    np.testing.assert_array_equal(apply_thresholds(dots[:, None, None], threshold, flip), expected)


def test_float_thresholds_are_exact_around_the_step():
    bn = adversarial_bn(7)
    rng = np.random.default_rng(7)
    alpha = rng.uniform(0.1, 2.0, size=bn.num_features).astype(np.float32)
    threshold, flip = float_thresholds(chain_of(bn, alpha))
    assert threshold.dtype == np.float32
    # Probe the float32 neighbours of every threshold (where rounding decides) and random values.
    finite = np.where(np.isfinite(threshold), threshold, 0.0).astype(np.float32)
    around = [finite]
    for _ in range(3):
        around.insert(0, np.nextafter(around[0], np.float32(-np.inf)))
        around.append(np.nextafter(around[-1], np.float32(np.inf)))
    probes = np.concatenate([np.stack(around), rng.normal(size=(200, bn.num_features)).astype(np.float32) * 30])
    expected = flax_response(bn, probes, alpha) >= 0
    np.testing.assert_array_equal(apply_thresholds(probes, threshold, flip), expected)


def test_float_thresholds_of_a_ternary_level():
    bn = adversarial_bn(9)
    level = np.float32(0.7)
    for strict in (False, True):
        threshold, flip = float_thresholds(chain_of(bn), level, strict)
        finite = np.where(np.isfinite(threshold), threshold, 0.0).astype(np.float32)
        probes = np.stack([np.nextafter(finite, np.float32(-np.inf)), finite, np.nextafter(finite, np.float32(np.inf))])
        response = flax_response(bn, probes)
        expected = response > level if strict else response >= level
        np.testing.assert_array_equal(apply_thresholds(probes, threshold, flip), expected)


class _Wavy(BnChain):
    """Not a batch norm: a response with two steps, which no single threshold reproduces."""

    def select(self, channels):
        return self

    def __call__(self, y):
        return jnp.cos(jnp.asarray(y, jnp.float32) / 3.0)


def test_a_response_with_two_steps_is_refused():
    wavy = _Wavy(np.zeros(1, np.float32), np.ones(1, np.float32), 1e-5)
    with pytest.raises(NonMonotoneError, match="single step"):
        integer_thresholds(wavy, 20)
    with pytest.raises(NonMonotoneError, match="single step"):
        float_thresholds(wavy)
