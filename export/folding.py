"""Batch norm (and the scales before it) + the next layer's quantizer, folded into thresholds.

A block computes, per output channel and in float32, exactly as the Flax model does in eval mode:

    y = dot * alpha + b                      (XNOR alpha, layer bias: optional)
    v = (y - mean) * (rsqrt(var + eps) * gamma) + beta      (nnx.BatchNorm, this order of operations)

and the next layer quantizes v: ``v >= 0`` (sign), or ``v >= lo`` / ``v > hi`` (the two ternary planes).
Each step is a monotone float32 function of ``dot`` (non-decreasing for alpha >= 0; the bn step reverses
the order where gamma < 0), so each comparison is ``dot >= t`` or, flipped, ``dot <= t``. The thresholds
are not derived algebraically (that would be off by one wherever float rounding lands near the boundary):
they are read off the float32 response itself, evaluated with the same operations at every integer the
dot product can take (``-K..K``), and the result is checked to be a single step. For a float operand (the
first layer) the same is done by bisection over the ordered float32 values.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["BnChain", "integer_thresholds", "float_thresholds", "NonMonotoneError"]


class NonMonotoneError(ValueError):
    """The float response of a channel is not a single step: no threshold reproduces it."""


@dataclasses.dataclass(frozen=True)
class BnChain:
    """The float32 path from a layer's dot product to its batch-norm output, per channel (all (C,) or None)."""

    mean: np.ndarray
    var: np.ndarray
    epsilon: float
    gamma: np.ndarray | None = None
    beta: np.ndarray | None = None
    alpha: np.ndarray | None = None  # XNOR weight scale
    bias: np.ndarray | None = None  # layer bias

    @property
    def channels(self) -> int:
        return int(np.shape(self.mean)[0])

    def multiplier(self) -> np.ndarray:
        """``rsqrt(var + eps) * gamma`` in float32, computed as nnx.BatchNorm computes it."""
        return np.asarray(_multiplier(jnp.asarray(self.var, jnp.float32), self.epsilon,
                                      None if self.gamma is None else jnp.asarray(self.gamma, jnp.float32)))

    def select(self, channels: slice) -> "BnChain":
        pick = lambda a: None if a is None else np.asarray(a)[channels]  # noqa: E731
        return BnChain(pick(self.mean), pick(self.var), self.epsilon, pick(self.gamma), pick(self.beta),
                       pick(self.alpha), pick(self.bias))

    def __call__(self, y):
        """The chain on float32 pre-activations `y` (..., C), under jax, in the model's order."""
        return _chain(jnp.asarray(y, jnp.float32), *(None if a is None else jnp.asarray(a, jnp.float32) for a in (
            self.alpha, self.bias, self.mean, self.var, self.gamma, self.beta)), self.epsilon)


@jax.jit
def _multiplier(var, epsilon, gamma):
    mul = jax.lax.rsqrt(var + epsilon)
    return mul if gamma is None else mul * gamma


@jax.jit
def _chain(y, alpha, bias, mean, var, gamma, beta, epsilon):
    if alpha is not None:
        y = y * alpha
    if bias is not None:
        y = y + bias
    v = (y - mean) * _multiplier(var, epsilon, gamma)
    return v if beta is None else v + beta


def _compare(values, level, strict):
    return values > level if strict else values >= level


def _levels(level, channels: int) -> np.ndarray:
    """Comparison constants as (P, C): one row per position the constants vary over (usually P = 1)."""
    level = np.asarray(level, np.float32)
    if level.ndim == 0:
        level = np.broadcast_to(level, (channels,))
    if level.shape[-1] != channels:
        raise ValueError(f"thresholds of shape {level.shape} do not end in the {channels} channels")
    return level.reshape(-1, channels)


def integer_thresholds(chain: BnChain, k: int, level=0.0, strict: bool = False, chunk_elements: int = 1 << 22):
    """Integer thresholds reproducing ``cond(chain(dot))`` for every integer ``dot`` in ``[-k, k]``.

    ``cond`` is ``v >= level`` (``v > level`` when `strict`); `level` is a scalar, or an array ending in the
    C channels (e.g. per-feature ternary thresholds over (H, W, C)). Returns ``(threshold int32, flip
    bool)`` of the broadcast shape of `level` against (C,): the bit is ``dot >= threshold``, or ``dot <=
    threshold`` where flip. A constant channel gets a threshold outside ``[-k, k]``.
    """
    c = chain.channels
    levels = _levels(level, c)
    out_shape = np.broadcast_shapes(np.shape(level), (c,))
    dots = np.arange(-k, k + 1, dtype=np.float32)  # exact: k < 2**24
    threshold = np.empty(levels.shape, np.int64)
    flip = np.empty(levels.shape, bool)
    step = max(1, chunk_elements // (len(dots) * levels.shape[0]))
    for start in range(0, c, step):
        part = slice(start, min(c, start + step))
        response = np.asarray(chain.select(part)(np.broadcast_to(dots[:, None], (len(dots), part.stop - start))))
        bits = _compare(response[:, None, :], levels[None, :, part], strict)  # (V, P, C')
        ones = bits.sum(axis=0)
        falling = bits[0] & ~bits[-1]
        # Rising (or constant) channels: bit = dot >= -k + (number of zeros); falling: dot <= -k + ones - 1.
        t = np.where(falling, -k + ones - 1, -k + (len(dots) - ones))
        expected = np.where(falling[None], dots[:, None, None] <= t[None], dots[:, None, None] >= t[None])
        bad = np.argwhere(np.any(expected != bits, axis=0))
        if len(bad):
            p, ch = bad[0]
            raise NonMonotoneError(f"channel {start + ch}: the float response is not a single step over "
                                   f"dot in [{-k}, {k}] (level {levels[p, start + ch]})")
        threshold[:, part], flip[:, part] = t, falling
    return threshold.astype(np.int32).reshape(out_shape), flip.reshape(out_shape)


# --- float operand (first layer): bisection over the ordered float32 values --------------------------------

_FLOAT_MAX_KEY = int(np.float32(np.finfo(np.float32).max).view(np.int32))


def _to_key(x: np.ndarray) -> np.ndarray:
    """float32 -> int64 key in the same order (-0 and +0 share key 0)."""
    bits = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
    return np.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))


def _from_key(key: np.ndarray) -> np.ndarray:
    key = np.asarray(key, np.int64)
    bits = np.where(key >= 0, key, (-key) | 0x80000000).astype(np.uint32)
    return bits.view(np.float32)


def float_thresholds(chain: BnChain, level=0.0, strict: bool = False):
    """Float32 thresholds on a float pre-activation `y` reproducing ``cond(chain(y))`` for every finite
    float32 `y`: ``(threshold float32, flip bool)``, bit = ``y >= threshold`` (``y <= threshold`` where
    flip). A constant channel gets -inf (always on) or -inf with flip (always off, for finite `y`)."""
    c = chain.channels
    levels = _levels(level, c)
    out_shape = np.broadcast_shapes(np.shape(level), (c,))

    def cond(keys):  # keys (P, C) -> bits (P, C)
        return _compare(np.asarray(chain(_from_key(keys))), levels, strict)

    lo = np.full(levels.shape, -_FLOAT_MAX_KEY, np.int64)
    hi = np.full(levels.shape, _FLOAT_MAX_KEY, np.int64)
    at_lo, at_hi = cond(lo), cond(hi)
    falling = at_lo & ~at_hi
    rising = ~at_lo & at_hi
    # Invariant: rising channels have cond(lo) false and cond(hi) true; falling ones the reverse.
    while True:
        active = (rising | falling) & (hi - lo > 1)
        if not active.any():
            break
        mid = lo + (hi - lo) // 2
        at_mid = cond(mid)
        go_up = np.where(rising, ~at_mid, at_mid)  # the step lies above mid
        lo = np.where(active & go_up, mid, lo)
        hi = np.where(active & ~go_up, mid, hi)
    threshold = np.where(rising, _from_key(hi), np.where(falling, _from_key(lo), np.float32(-np.inf)))
    flip = falling | (~at_lo & ~at_hi)
    _check_float_step(cond, threshold.astype(np.float32), flip)
    return threshold.astype(np.float32).reshape(out_shape), flip.reshape(out_shape)


def _check_float_step(cond, threshold, flip) -> None:
    """Probe the response at values spread over the float range and right around each threshold: it must
    agree with the threshold everywhere."""
    magnitudes = np.float32(10.0) ** np.arange(-30, 31, 0.5, dtype=np.float32)
    spread = np.concatenate([-magnitudes[::-1], [0.0], magnitudes]).astype(np.float32)
    probes = np.concatenate([
        np.broadcast_to(spread[:, None, None], (len(spread),) + threshold.shape),
        np.stack([np.nextafter(threshold, np.float32(-np.inf)), threshold,
                  np.nextafter(threshold, np.float32(np.inf))]),
    ])  # (probes, P, C)
    expected = np.where(flip, probes <= threshold, probes >= threshold)
    bad = np.isfinite(probes) & (cond(_to_key(probes)) != expected)
    if bad.any():
        _, _, ch = np.argwhere(bad)[0]
        raise NonMonotoneError(f"channel {ch}: the float response is not a single step")
