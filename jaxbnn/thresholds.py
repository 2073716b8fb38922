"""Integer thresholds: a batch norm followed by the next layer's quantizer, as one integer comparison.

A channel of a block maps an integer pre-activation ``z`` (a popcount dot product) through an optional
XNOR weight scale ``alpha`` and layer bias ``bias``, then a batch norm (``mean``, ``var``, ``epsilon``,
``gamma``, ``beta``), and the next layer's quantizer compares the result with a ``level`` (0 for sign, the
two ternary levels for a ternary operand). This module turns that chain into ``(threshold, flip)`` pairs.

Semantics. Every parameter is taken as the exact real number its float32 value denotes (``epsilon`` as
``float32(epsilon)``, the level as its float32 value). For an integer ``z``::

    V(z) = gamma * ((alpha * z + bias) - mean) / sqrt(var + epsilon) + beta      (exact real arithmetic)
    bit(z) = V(z) >= level        (V(z) > level when strict)

with ``gamma = 1``, ``beta = 0``, ``alpha = 1``, ``bias = 0`` where absent. No rounding happens anywhere:
this is the real-number value of the chain, not the float32 computation of it. The result satisfies, for
every integer ``z`` with ``|z| <= 2**31 - 2``::

    bit(z) == (z >= threshold)   where not flip
    bit(z) == (z <= threshold)   where flip

With ``s = sqrt(var + epsilon) > 0``, ``V(z) >= L  <=>  P * z >= Q`` where ``P = gamma * alpha`` and
``Q = (L - beta) * s + gamma * (mean - bias)``:

- ``P > 0``: ``bit(z) = z >= Q / P`` (``z > Q / P`` when strict): threshold ``ceil(Q / P)``
  (``floor(Q / P) + 1``), flip False;
- ``P < 0``: ``bit(z) = z <= Q / P`` (``z < Q / P`` when strict): threshold ``floor(Q / P)``
  (``ceil(Q / P) - 1``), flip True;
- ``P == 0``: a constant channel, ``bit = 0 >= Q`` (``0 > Q`` when strict), decided exactly.

Degenerate channels: a NaN or infinite value among a channel's parameters (``epsilon`` included) or its
level, or ``var + epsilon <= 0`` (exact sum), give bit 0 for every ``z``, as NaN binarizes to bit 0
(value -1) everywhere else in the library.

Encodings: always on is ``(INT32_MIN, False)``, always off ``(INT32_MAX, False)``. A threshold whose exact
value lies beyond ``[-(2**31 - 2), 2**31 - 2]`` becomes one of them: a rising threshold above the range is
always off, below it always on; a falling one above the range is always on, below it always off. So flip
is True only for a falling channel whose threshold lies in the range.

Computation. A float64 estimate of ``Q / P`` and a bound on its error decide every entry whose estimate is
not within the bound of an integer; the remaining entries (exact ties and near-ties) are decided with
Python integers, the square root handled by sign analysis and comparison of squares. The float32 inputs
are decoded from their bits, so a host that flushes subnormals to zero computes the same thresholds. The
module is numpy and Python only: the exporter and a jax.pure_callback in the model's eval forward share it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = ["BnChain", "integer_thresholds", "INT32_MIN", "INT32_MAX", "Z_LIMIT"]

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
Z_LIMIT = 2**31 - 2  # the thresholds are exact for every integer z with |z| <= Z_LIMIT

# Bound on the float64 estimate's error, relative to the magnitudes it is built from (see _estimate):
# the operations contribute at most about 6 units of 2**-53; 2**-40 leaves a factor of over 1000, which
# also covers the rounding of the bound itself and of the interval ends.
_RELATIVE_BOUND = 2.0**-40
# |Q / P| beyond this lies far outside the int32 range: the threshold clamps without an exact check.
# (+-_FAR also serve as the raw thresholds of constant channels, which clamp to always off / on.)
_FAR = 2.0**32

_FIELDS = ("mean", "var", "gamma", "beta", "alpha", "bias")
_DEFAULTS = {"gamma": 1.0, "beta": 0.0, "alpha": 1.0, "bias": 0.0}


@dataclasses.dataclass(frozen=True)
class BnChain:
    """The per-channel path from an integer pre-activation z to the batch-norm output.

    All arrays are (C,) float32 (or None: gamma = 1, beta = 0, alpha = 1, bias = 0).
    """

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

    def select(self, channels: slice) -> BnChain:
        """The chain of the channels `channels` only."""
        pick = lambda a: None if a is None else np.asarray(a)[channels]  # noqa: E731
        return BnChain(pick(self.mean), pick(self.var), self.epsilon, pick(self.gamma), pick(self.beta),
                       pick(self.alpha), pick(self.bias))


def classifier_affine(chain: BnChain) -> tuple[np.ndarray, np.ndarray]:
    """``(scale, bias)`` float32 (C,) of the classifier: its logits are ``float32(z) * scale + bias``, the
    product rounded before the sum, for the integer dot product z (folded in float64, each rounded once to
    float32). The exporter writes them and the Flax model's eval forward computes its logits with them, so
    both give the same float32 logits on every platform, near-ties between classes included. A channel
    whose fold is not finite is left as it comes out (the exporter refuses it)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        mul = 1.0 / np.sqrt(np.asarray(chain.var, np.float64) + np.float64(np.float32(chain.epsilon)))
        if chain.gamma is not None:
            mul = mul * np.asarray(chain.gamma, np.float64)
        alpha = 1.0 if chain.alpha is None else np.asarray(chain.alpha, np.float64)
        bias = 0.0 if chain.bias is None else np.asarray(chain.bias, np.float64)
        beta = 0.0 if chain.beta is None else np.asarray(chain.beta, np.float64)
        scale = np.broadcast_to(alpha * mul, mul.shape).astype(np.float32)
        return scale, ((bias - np.asarray(chain.mean, np.float64)) * mul + beta).astype(np.float32)


def ternary_levels_cross(alpha, beta):
    """Where a ternary quantizer's nonneg plane takes its pos plane's comparison (v > alpha) instead of its own
    (v >= beta): where alpha is a finite level and beta is not a finite level at or below it (learned levels
    that cross, alpha < beta; or beta NaN or infinite, a degenerate level). Then the value is +1 wherever
    v > alpha, as `quantizers.ternarize` has it, and the planes never hold pos without nonneg. numpy or jax
    arrays."""
    def finite(x):
        return abs(x) < float("inf")

    return finite(alpha) & ~(finite(beta) & (alpha >= beta))


def integer_thresholds(chain: BnChain, level=0.0, strict: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(threshold int32, flip bool)`` with ``bit(z) == (z <= threshold if flip else z >= threshold)``.

    `level` is a scalar or an array whose last axis is the C channels (e.g. (C,) per channel or (H, W, C)
    per feature), taken as float32. Both results have shape ``np.broadcast_shapes(np.shape(level), (C,))``.
    The rule, its special cases and its encodings are those of the module docstring.
    """
    c = chain.channels
    with np.errstate(over="ignore"):  # a value beyond float32 becomes inf, a degenerate channel
        level32 = np.asarray(level, np.float32)
        params = {name: _channel_array(chain, name, c) for name in _FIELDS}
        epsilon32 = np.full(1, chain.epsilon, np.float32)
    out_shape = np.broadcast_shapes(level32.shape, (c,))
    rows = math.prod(out_shape[:-1])
    level32 = np.ascontiguousarray(np.broadcast_to(level32, out_shape)).reshape(rows, c)

    est = _estimate(params, epsilon32, level32)
    # Raw thresholds, before clamping. Where the estimate settles Q / P it is not an integer, so the
    # rising threshold is floor(Q / P) + 1 and the falling one floor(Q / P), strict or not; a constant
    # channel is on or off through a threshold far beyond the range.
    raw = np.where(est.rising, est.floor + 1, est.floor)
    raw = np.where(est.const, np.where(est.const_on, -_FAR, _FAR), raw).astype(np.int64)
    if est.exact.any():
        rows_i, cols_i = np.nonzero(est.exact)
        raw[rows_i, cols_i] = _exact_entries(params, epsilon32, level32, rows_i, cols_i, est.lo, est.hi, strict)

    in_range = (raw >= -Z_LIMIT) & (raw <= Z_LIMIT)
    on = np.where(est.falling, raw > Z_LIMIT, raw < -Z_LIMIT)
    threshold = np.where(in_range, raw, np.where(on, INT32_MIN, INT32_MAX))
    threshold = np.where(est.degenerate, INT32_MAX, threshold)
    flip = est.falling & in_range  # never degenerate: est.falling excludes those entries
    return threshold.astype(np.int32).reshape(out_shape), flip.reshape(out_shape)


def _channel_array(chain: BnChain, name: str, c: int) -> np.ndarray:
    value = getattr(chain, name)
    if value is None:
        value = _DEFAULTS[name]
    return np.ascontiguousarray(np.broadcast_to(np.asarray(value, np.float32), (c,)))


def _decode(x32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(finite, value as float64) of a float32 array, read from its bits (non-finite values read as 0).

    Every float32, subnormals included, is a normal float64; building it from the integer significand
    keeps it exact even where the host treats subnormal inputs as zero.
    """
    bits = x32.view(np.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.int32)
    fraction = bits & 0x7FFFFF
    finite = exponent != 0xFF
    significand = np.where(exponent == 0, fraction, fraction | 0x800000).astype(np.float64)
    value = np.ldexp(significand, np.maximum(exponent, 1) - 150)
    value = np.where(bits >> 31 == 1, -value, value)
    return finite, np.where(finite, value, 0.0)


def _units(x32) -> int:
    """The exact value of a float32 scalar as an integer count of 2**-149 (the smallest subnormal)."""
    bits = int(np.asarray(x32, np.float32).view(np.uint32))
    exponent, fraction = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    n = fraction if exponent == 0 else (fraction | 0x800000) << (exponent - 1)
    return -n if bits >> 31 else n


@dataclasses.dataclass
class _Estimate:
    degenerate: np.ndarray  # (R, C) bit 0 everywhere
    rising: np.ndarray  # (R, C) P > 0 (and not degenerate)
    falling: np.ndarray  # (R, C) P < 0 (and not degenerate)
    const: np.ndarray  # (R, C) P == 0 (and not degenerate)
    const_on: np.ndarray  # (R, C) the constant bit, where decided by the estimate
    floor: np.ndarray  # (R, C) floor(Q / P) (clipped to +-2**33), where decided by the estimate
    exact: np.ndarray  # (R, C) entries the estimate leaves undecided
    lo: np.ndarray  # (R, C) Q / P lies in [lo, hi]
    hi: np.ndarray


def _estimate(params: dict[str, np.ndarray], epsilon32: np.ndarray, level32: np.ndarray) -> _Estimate:
    """Q / P in float64, with the entries whose floor it does not settle marked `exact`.

    Error: the float32 values are exact in float64, and P = gamma * alpha is exact (a product of two
    24-bit significands). With u = 2**-53, ``L - beta``, ``var + eps`` and ``mean - bias`` carry a
    relative error <= u each, sqrt adds <= u (and halves the error of its argument), each product <= u, so
    ``ys = (L - beta) * s`` is within 4u of its exact value and ``w = gamma * (mean - bias)`` within 2.01u;
    ``q = ys + w`` is then within ``5.1u * (|ys| + |w|)`` of Q, and ``r = q / P`` within
    ``5.1u * (|ys| + |w|) / |P| + 1.01u * |r|`` of Q / P. The bound used is ``2**-40 * ((|ys| + |w|) / |P| +
    |r|)``. No intermediate overflows or underflows: float32 magnitudes lie in [2**-149, 2**128), so every
    nonzero intermediate lies within about [2**-610, 2**560], inside float64's normal range.
    """
    finite = np.ones(params["mean"].shape, bool)
    val = {}
    for name in _FIELDS:
        ok, val[name] = _decode(params[name])
        finite &= ok
    eps_ok, eps64 = _decode(epsilon32)
    level_ok, level64 = _decode(level32)
    d = val["var"] + eps64[0]  # its sign is exact: the sum of two float32 values never rounds to 0
    channel_bad = ~finite | ~eps_ok[0] | ~(d > 0)
    degenerate = channel_bad[None, :] | ~level_ok

    with np.errstate(all="ignore"):
        s = np.sqrt(np.where(channel_bad, 1.0, d))
        p = val["gamma"] * val["alpha"]
        w = val["gamma"] * (val["mean"] - val["bias"])
        ys = (level64 - val["beta"]) * s
        q = ys + w
        magnitude = np.abs(ys) + np.abs(w)
        const_c = p == 0
        safe_p = np.where(const_c, 1.0, p)
        r = q / safe_p
        bound = _RELATIVE_BOUND * (magnitude / np.abs(safe_p) + np.abs(r))
        lo, hi = r - bound, r + bound

    const = const_c[None, :] & ~degenerate
    rising = (p > 0)[None, :] & ~degenerate
    falling = (p < 0)[None, :] & ~degenerate
    # No integer within [lo, hi] (or all of it far beyond the int32 range): floor(Q / P) == floor(r), and
    # Q / P is not an integer, so strict and non-strict comparisons agree.
    settled = (np.ceil(lo) > hi) | (lo > _FAR) | (hi < -_FAR)
    const_settled = np.abs(q) > _RELATIVE_BOUND * magnitude  # then sign(q) == sign(Q) != 0
    exact = np.where(const, ~const_settled, ~settled) & ~degenerate
    return _Estimate(
        degenerate=degenerate, rising=rising, falling=falling, const=const, const_on=q < 0,
        floor=np.floor(np.clip(r, -2 * _FAR, 2 * _FAR)), exact=exact, lo=lo, hi=hi)


def _sign_root(y: int, e: int, t: int) -> int:
    """sign(y * sqrt(e) - t), exactly, for integers y, t and e > 0."""
    if y == 0:
        return (t < 0) - (t > 0)
    if y > 0:
        if t <= 0:
            return 1
        diff = y * y * e - t * t
    else:
        if t >= 0:
            return -1
        diff = t * t - y * y * e
    return (diff > 0) - (diff < 0)


def _exact_entries(params, epsilon32, level32, rows_i, cols_i, lo, hi, strict: bool) -> list[int]:
    """Raw thresholds (before clamping) of the given entries, in integer arithmetic.

    In units of 2**-298 (so that every product of two float32 values is an integer): ``P = gamma * alpha``,
    ``W = gamma * (mean - bias)``, and ``(L - beta) * sqrt(var + eps) = Y * sqrt(E)`` with Y the level minus
    beta in units of 2**-149 and E = (var + eps) * 2**298 (2**-149 units, times 2**149). Then
    ``bit(z) = sign(Y * sqrt(E) - (z * P - W)) <= 0`` (``< 0`` when strict).
    """
    eps_units = _units(epsilon32[0])
    channel_ints: dict[int, tuple[int, int, int, int]] = {}
    out = []
    for row, col in zip(rows_i.tolist(), cols_i.tolist()):
        if col not in channel_ints:
            u = {name: _units(params[name][col]) for name in _FIELDS}
            channel_ints[col] = (u["beta"], (u["var"] + eps_units) << 149, u["gamma"] * u["alpha"],
                                 u["gamma"] * (u["mean"] - u["bias"]))
        beta, e, p, w = channel_ints[col]
        y = _units(level32[row, col]) - beta

        def bit(z: int) -> bool:
            sign = _sign_root(y, e, z * p - w)
            return sign < 0 if strict else sign <= 0

        if p == 0:
            out.append(int(-_FAR) if bit(0) else int(_FAR))
        else:
            out.append(_search(bit, p > 0, float(lo[row, col]), float(hi[row, col])))
    return out


def _search(bit, rising: bool, lo: float, hi: float) -> int:
    """The raw threshold of a monotone `bit`, knowing that Q / P lies in [lo, hi].

    A rising threshold lies in [floor(lo), floor(hi) + 1], a falling one in [floor(lo) - 1, floor(hi)]: the
    search covers [floor(lo), floor(hi)] and the value one past its far end. Searched within the int32
    range widened by one on each side, a threshold outside it comes back as a value beyond the range, which
    clamps the same way.
    """
    edge = Z_LIMIT + 1
    a = min(max(math.floor(max(lo, -_FAR)), -edge), edge)
    b = min(max(math.floor(min(hi, _FAR)), -edge), edge)
    if rising:  # smallest k in [a, b] with bit(k), else b + 1
        low, high = a, b + 1
        while low < high:
            mid = (low + high) // 2
            if bit(mid):
                high = mid
            else:
                low = mid + 1
        return low
    low, high = a - 1, b  # largest k in [a, b] with bit(k), else a - 1
    while low < high:
        mid = (low + high + 1) // 2
        if bit(mid):
            low = mid
        else:
            high = mid - 1
    return low
