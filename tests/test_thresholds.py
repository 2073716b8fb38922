"""Integer thresholds of batch norm + quantizer (jaxbnn.thresholds), against an exact real-number oracle.

The oracle evaluates V(z) = gamma * ((alpha * z + bias) - mean) / sqrt(var + eps) + beta against the level
with fractions.Fraction, deciding the sign of ``X / sqrt(D) + c`` by comparing squares: a formulation
independent of the module's (which multiplies by the square root instead of dividing by it). Each result
is checked at the integers around its threshold and at 0 and +-(2**31 - 2), which pins down a monotone
step.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxbnn import thresholds
from jaxbnn.thresholds import INT32_MAX, INT32_MIN, Z_LIMIT, BnChain, integer_thresholds

F32 = np.float32
N = Z_LIMIT
ON, OFF = (INT32_MIN, False), (INT32_MAX, False)


# --- the oracle --------------------------------------------------------------------------------------------

def _exact(x) -> Fraction | None:
    """The real value of a float32, or None for NaN / inf."""
    x = float(F32(x))
    return Fraction(x) if math.isfinite(x) else None


def _sign(x) -> int:
    return (x > 0) - (x < 0)


def channel_values(chain: BnChain, c: int) -> dict[str, Fraction | None]:
    defaults = {"gamma": 1.0, "beta": 0.0, "alpha": 1.0, "bias": 0.0}
    values = {"epsilon": _exact(chain.epsilon)}
    for name in ("mean", "var", "gamma", "beta", "alpha", "bias"):
        array = getattr(chain, name)
        values[name] = _exact(defaults[name] if array is None else np.asarray(array, F32)[c])
    return values


def exact_bit(values: dict[str, Fraction | None], level: Fraction | None, z: int | Fraction, strict: bool) -> bool:
    """bit(z) of the module's definition (any rational z), in exact arithmetic; False for degenerate channels."""
    if level is None or any(v is None for v in values.values()):
        return False
    d = values["var"] + values["epsilon"]
    if d <= 0:
        return False
    x = values["gamma"] * (values["alpha"] * z + values["bias"] - values["mean"])
    c = values["beta"] - level
    # sign(x / sqrt(d) + c): the sign of the larger of the two terms when their signs differ
    if _sign(x) * _sign(c) >= 0:
        sign = _sign(x) or _sign(c)
    else:
        sign = _sign(x) * _sign(x * x / d - c * c)
    return sign > 0 if strict else sign >= 0


def assert_exact(chain: BnChain, level=0.0, strict: bool = False):
    """Checks integer_thresholds(chain, level, strict) against the oracle; returns its result."""
    threshold, flip = integer_thresholds(chain, level, strict)
    shape = np.broadcast_shapes(np.shape(level), (chain.channels,))
    assert threshold.shape == flip.shape == shape
    assert threshold.dtype == np.int32 and flip.dtype == bool
    levels = np.broadcast_to(np.asarray(level, F32), shape)
    values = [channel_values(chain, c) for c in range(chain.channels)]
    for index in np.ndindex(shape):
        t, f = int(threshold[index]), bool(flip[index])
        assert -N <= t <= N or (t in (INT32_MIN, INT32_MAX) and not f), (index, t, f)
        level_value = _exact(levels[index])
        for z in {0, N, -N} | {min(N, max(-N, t + k)) for k in range(-3, 4)}:
            got = z <= t if f else z >= t
            assert got == exact_bit(values[index[-1]], level_value, z, strict), (
                f"entry {index}: threshold {t} flip {f} strict {strict} wrong at z = {z}")
    return threshold, flip


def chain1(mean, var=1.0, epsilon=0.0, gamma=None, beta=None, alpha=None, bias=None) -> BnChain:
    """A one-channel chain from scalars."""
    arr = lambda x: None if x is None else np.array([x], F32)  # noqa: E731
    return BnChain(arr(mean), arr(var), epsilon, arr(gamma), arr(beta), arr(alpha), arr(bias))


def result1(chain: BnChain, level=0.0, strict=False) -> tuple[int, bool]:
    t, f = assert_exact(chain, level, strict)
    return int(t[0]), bool(f[0])


def random_chain(seed: int, channels: int = 64, alpha: bool = True, bias: bool = True) -> BnChain:
    rng = np.random.default_rng(seed)
    f32 = lambda x: np.asarray(x, F32)  # noqa: E731
    return BnChain(
        mean=f32(rng.normal(0, 30, channels)),
        var=f32(rng.choice([0.0, 1e-3, 0.5, 2.0, 40.0], channels) * rng.uniform(0.5, 1.5, channels)),
        epsilon=1e-5,
        gamma=f32(rng.normal(0, 2, channels)),
        beta=f32(rng.normal(0, 1, channels)),
        alpha=f32(rng.uniform(-0.2, 1.0, channels)) if alpha else None,
        bias=f32(rng.normal(0, 5, channels)) if bias else None)


def level_of(kind: str, channels: int, seed: int):
    rng = np.random.default_rng(seed + 1000)
    if kind == "scalar":
        return F32(rng.normal())
    if kind == "channel":
        return rng.normal(size=channels).astype(F32)
    return rng.normal(size=(2, 3, channels)).astype(F32)


# --- random parameters -------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("level_kind", ["scalar", "channel", "feature"])
@pytest.mark.parametrize("strict", [False, True])
def test_random_parameters_match_the_exact_oracle(seed, level_kind, strict):
    """Mixed-sign gamma and alpha, with and without alpha / bias, every level shape: thresholds are exact."""
    chain = random_chain(seed, alpha=seed != 1, bias=seed != 2)
    assert_exact(chain, level_of(level_kind, chain.channels, seed), strict)


@pytest.mark.parametrize("seed", [3, 4])
@pytest.mark.parametrize("strict", [False, True])
def test_tie_rich_parameters_match_the_exact_oracle(seed, strict):
    """Integer means, perfect-square variances and half-integer levels: most entries are exact ties."""
    rng = np.random.default_rng(seed)
    c = 64
    chain = BnChain(mean=rng.integers(-20, 20, c).astype(F32), var=rng.choice([1.0, 4.0, 0.25, 9.0], c).astype(F32),
                    epsilon=0.0, gamma=rng.choice([-2.0, -1.0, 0.5, 1.0, 3.0], c).astype(F32),
                    beta=rng.choice([0.0, 0.5, -1.0], c).astype(F32),
                    alpha=rng.choice([1.0, 0.5, 0.25, -1.0], c).astype(F32),
                    bias=rng.integers(-3, 3, c).astype(F32))
    assert_exact(chain, (rng.integers(-4, 4, (3, c)) / 2).astype(F32), strict)


@pytest.mark.parametrize("seed", [5, 6])
def test_parameters_over_the_whole_float32_range_match_the_exact_oracle(seed):
    """Magnitudes from subnormal to near float32 max, in every parameter, give exact (or clamped) thresholds."""
    rng = np.random.default_rng(seed)
    c = 64

    def wide(positive=False):
        x = rng.uniform(1, 2, c) * np.exp2(rng.integers(-149, 127, c).astype(float))
        return (x if positive else x * rng.choice([-1, 1], c)).astype(F32)

    chain = BnChain(wide(), wide(positive=True), 0.0, wide(), wide(), wide(), wide())
    for strict in (False, True):
        assert_exact(chain, wide(), strict)


def test_the_fast_path_agrees_with_the_exact_path(monkeypatch):
    """The float64 estimate decides every entry as the integer arithmetic would."""
    chain = random_chain(7)
    level = level_of("feature", chain.channels, 7)
    fast = [integer_thresholds(chain, level, strict) for strict in (False, True)]
    monkeypatch.setattr(thresholds, "_RELATIVE_BOUND", 2.0**100)  # sends every entry to the exact path
    for strict, (t, f) in zip((False, True), fast):
        t_exact, f_exact = integer_thresholds(chain, level, strict)
        np.testing.assert_array_equal(t, t_exact)
        np.testing.assert_array_equal(f, f_exact)


def test_the_float64_interval_contains_the_exact_ratio():
    """The exact Q / P lies in the estimate's [lo, hi], also where Q cancels to 2**-48 of its terms."""
    rng = np.random.default_rng(14)
    c = 400
    wide = lambda low, high: rng.uniform(1, 2, c) * np.exp2(rng.integers(low, high, c))  # noqa: E731
    level, var = wide(-60, 60).astype(F32), wide(-60, 60).astype(F32)
    gamma = (rng.choice([-1.0, 1.0], c) * wide(-30, 30)).astype(F32)
    # mean - bias equal to -level * sqrt(var) / gamma to about 48 bits, so that Q is a sliver of its terms
    target = -level.astype(float) * np.sqrt(var.astype(float)) / gamma.astype(float)
    mean = target.astype(F32)
    bias = (mean - target).astype(F32)
    q = level.astype(float) * np.sqrt(var.astype(float)) + gamma * (mean.astype(float) - bias)  # about Q
    ratio = rng.choice([-1.0, 1.0], c) * rng.uniform(1, 1e4, c)  # about Q / P
    with np.errstate(divide="ignore"):
        alpha = q / (gamma * ratio)
    alpha = np.where((np.abs(alpha) > 2.0**-126) & (np.abs(alpha) < 2.0**127), alpha, 1.0).astype(F32)
    chain = BnChain(mean, var, 0.0, gamma, None, alpha, bias)
    params = {name: np.asarray(getattr(chain, name), F32) for name in ("mean", "var", "gamma", "alpha", "bias")}
    params["beta"] = np.zeros(c, F32)
    estimate = thresholds._estimate(params, np.zeros(1, F32), level[None])
    assert not estimate.degenerate.any() and not estimate.const.any()
    for ch in range(c):
        values, level_value = channel_values(chain, ch), _exact(level[ch])
        lo, hi = Fraction(float(estimate.lo[0, ch])), Fraction(float(estimate.hi[0, ch]))
        rising = bool(estimate.rising[0, ch])
        # bit(z) = z >= Q / P where rising, z <= Q / P where falling; the strict bit excludes z == Q / P
        assert exact_bit(values, level_value, hi if rising else lo, strict=False), ch
        assert not exact_bit(values, level_value, lo if rising else hi, strict=True), ch
    assert np.median(estimate.hi - estimate.lo) > 1  # the construction does cancel


def test_random_levels_rarely_need_the_exact_path(monkeypatch):
    """On random inputs nearly every entry is settled by the float64 estimate (the exact path is the slow one)."""
    exact_entries = []
    original = thresholds._exact_entries

    def counting(params, epsilon32, level32, rows, cols, *rest):
        exact_entries.append(len(rows))
        return original(params, epsilon32, level32, rows, cols, *rest)

    monkeypatch.setattr(thresholds, "_exact_entries", counting)
    chain = random_chain(8)
    level = np.random.default_rng(8).normal(size=(100, 100, chain.channels)).astype(F32)
    integer_thresholds(chain, level)
    assert sum(exact_entries) <= level.size // 10_000


# --- exact ties --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gamma, strict, expected", [
    (1.0, False, (3, False)),   # V(3) = 0 >= 0
    (1.0, True, (4, False)),    # V(3) = 0 is not > 0
    (-1.0, False, (3, True)),   # V(z) = -(z - 3) / 2 >= 0 for z <= 3
    (-1.0, True, (2, True)),
])
def test_exact_tie_at_the_mean(gamma, strict, expected):
    """mean = 3, var = 4, eps = 0, beta = 0: V(3) = 0 exactly, and strictness decides bit(3)."""
    assert result1(chain1(3.0, 4.0, 0.0, gamma, 0.0), 0.0, strict) == expected


@pytest.mark.parametrize("gamma, strict, expected", [
    (2.0, False, (1, False)),   # V(z) = (z - 3) + 2: V(1) = 0
    (2.0, True, (2, False)),
    (-2.0, False, (5, True)),   # V(z) = -(z - 3) + 2: V(5) = 0
    (-2.0, True, (4, True)),
])
def test_exact_tie_moved_by_beta(gamma, strict, expected):
    """var + eps = 4 (a perfect square) and beta = 2 put the tie on an integer away from the mean."""
    assert result1(chain1(3.0, 3.0, 1.0, gamma, 2.0), 0.0, strict) == expected


@pytest.mark.parametrize("strict, expected", [(False, (6, False)), (True, (7, False))])
def test_exact_tie_with_an_irrational_root(strict, expected):
    """level == beta cancels sqrt(2): V(6) = (0.5 * 6 - 3) / sqrt(2) = 0 exactly."""
    chain = chain1(3.0, 2.0, 0.0, 1.0, 0.25, alpha=0.5)
    assert result1(chain, 0.25, strict) == expected


@pytest.mark.parametrize("gamma", [1.0, -1.0])
@pytest.mark.parametrize("strict", [False, True])
def test_irrational_near_tie(gamma, strict):
    """Pell numbers: 15994428 * sqrt(2) is within 3e-8 of an integer, closer than the float64 estimate's bound."""
    chain = chain1(0.0, 2.0, 0.0, gamma)
    t, flip = result1(chain, 15994428.0 * gamma, strict)  # gamma * z / sqrt(2) >= 15994428 * gamma
    assert 22619537**2 - 2 * 15994428**2 == 1  # so the bound 15994428 * sqrt(2) lies just below 22619537
    assert (t, flip) == ((22619537, False) if gamma > 0 else (22619536, True))


@pytest.mark.parametrize("gamma", [1.0, -1.0])
@pytest.mark.parametrize("strict", [False, True])
def test_cancelling_large_terms(gamma, strict):
    """Terms near 2**64 cancel to Q / P ~ -34720, which float64 misses by hundreds: the exact path decides."""
    scale = 2.0**40
    chain = chain1(-scale * 22619536, 2.0, 0.0, gamma, 0.0, alpha=0.7, bias=scale)
    t, flip = result1(chain, gamma * scale * 15994428, strict)
    assert (t, flip) == ((-34720, False) if gamma > 0 else (-34721, True))


# --- constant and degenerate channels ----------------------------------------------------------------------

@pytest.mark.parametrize("beta, level, strict, expected", [
    (0.5, 0.0, False, ON), (0.5, 0.5, False, ON), (0.5, 0.5, True, OFF), (-1.0, 0.0, False, OFF),
    (0.0, -0.0, True, OFF), (0.0, -0.0, False, ON),
])
@pytest.mark.parametrize("gamma", [0.0, -0.0])
def test_zero_gamma_is_a_constant_channel(gamma, beta, level, strict, expected):
    """gamma == 0: V = beta for every z, so the channel is always on or always off."""
    assert result1(chain1(7.0, 1.0, 1e-5, gamma, beta, 0.5, 2.0), level, strict) == expected


@pytest.mark.parametrize("mean, var, beta, strict, expected", [
    (2.0, 1.0, 1.0, False, ON), (2.0, 1.0, 1.0, True, OFF),      # V = -1 + 1
    (3.0, 4.0, 0.5, False, ON), (3.0, 4.0, 0.5, True, OFF),      # V = -1/2 + 1/2
    (3.0, 1.0, 0.5, False, OFF),
    (3.0, 2.0, float(F32(0.5**0.5)), False, OFF),                # float32(1/sqrt 2) < 1/sqrt 2
    (3.0, 2.0, float(np.nextafter(F32(0.5**0.5), F32(1))), False, ON),
])
def test_zero_alpha_is_a_constant_channel(mean, var, beta, strict, expected):
    """alpha == 0: V = gamma * (bias - mean) / sqrt(var + eps) + beta, decided exactly even near zero."""
    assert result1(chain1(mean, var, 0.0, 1.0, beta, alpha=0.0, bias=mean - 1.0), 0.0, strict) == expected


@pytest.mark.parametrize("var, epsilon", [(0.0, 0.0), (-float(F32(1e-5)), 1e-5), (-1.0, 0.5), (0.0, -1e-3)])
def test_nonpositive_variance_plus_epsilon_is_always_off(var, epsilon):
    """var + eps <= 0 (exact sum) has no real square root: bit 0 everywhere."""
    for strict in (False, True):
        assert result1(chain1(0.0, var, epsilon, -1.0), -5.0, strict) == OFF


def test_a_subnormal_variance_plus_epsilon_is_positive():
    """var + eps = 2**-149 > 0 is a real, tiny scale, not a degenerate channel."""
    t, flip = result1(chain1(3.0, 0.0, 1e-45), 0.0)
    assert (t, flip) == (3, False)


@pytest.mark.parametrize("field", ["mean", "var", "gamma", "beta", "alpha", "bias", "level"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_make_only_their_channel_always_off(field, bad):
    """A NaN or infinite parameter or level turns its channel off and leaves the other channels alone."""
    clean = random_chain(9, channels=6)
    level = level_of("channel", 6, 9)
    spoiled = {name: None if getattr(clean, name) is None else np.array(getattr(clean, name))
               for name in ("mean", "var", "gamma", "beta", "alpha", "bias")}
    spoiled_level = level.copy()
    (spoiled_level if field == "level" else spoiled[field])[2] = bad
    for strict in (False, True):
        t, f = assert_exact(BnChain(epsilon=clean.epsilon, **spoiled), spoiled_level, strict)
        t_clean, f_clean = integer_thresholds(clean, level, strict)
        assert (t[2], f[2]) == OFF
        keep = np.arange(6) != 2
        np.testing.assert_array_equal(t[keep], t_clean[keep])
        np.testing.assert_array_equal(f[keep], f_clean[keep])


@pytest.mark.parametrize("epsilon", [np.nan, np.inf, -np.inf, 1e39])
def test_a_non_finite_epsilon_turns_every_channel_off(epsilon):
    """eps is shared by all channels: a NaN or infinite float32(eps) makes each of them degenerate."""
    chain = random_chain(10, channels=5)
    t, f = integer_thresholds(BnChain(chain.mean, chain.var, epsilon, chain.gamma, chain.beta), 0.0)
    np.testing.assert_array_equal(t, INT32_MAX)
    np.testing.assert_array_equal(f, False)


# --- extreme values and clamping ---------------------------------------------------------------------------

def test_huge_parameters_do_not_overflow():
    """Values near float32 max in every parameter (products up to 1e77) still give exact thresholds."""
    big = 3e38
    for gamma, alpha in [(big, big), (-big, big), (big, 1e-45), (1e-45, -big)]:
        for mean, bias, beta, level, var in [(big, -big, -big, big, big), (big, big, 0.0, big, 1.0),
                                             (-big, 1.0, big, -big, 1e-45), (1.0, 0.0, 0.0, 0.0, big)]:
            for strict in (False, True):
                result1(chain1(mean, var, 0.0, gamma, beta, alpha, bias), level, strict)


def test_subnormal_parameters_are_real_numbers():
    """Subnormal gamma, alpha, mean and var are not flushed to zero, on the fast path and at exact ties."""
    tiny = 2.0**-149
    assert result1(chain1(7 * tiny, 4 * tiny, 0.0, tiny, 0.0, 3 * tiny), 0.0) == (3, False)  # z >= 7/3
    assert result1(chain1(7 * tiny, 1.0, 0.0, -tiny, 0.0, 3 * tiny), 0.0) == (2, True)  # z <= 7/3
    assert result1(chain1(6 * tiny, 4 * tiny, 0.0, tiny, 0.0, 3 * tiny), 0.0, True) == (3, False)  # z > 2
    assert result1(chain1(6 * tiny, 4 * tiny, tiny, -tiny, 0.0, 3 * tiny), 0.0) == (2, True)  # z <= 2


@pytest.mark.parametrize("mean, bias, gamma, strict, expected", [
    (2.0**31, 2.0, 1.0, False, (N, False)),        # z >= 2**31 - 2: the last in-range rising threshold
    (2.0**31, 2.0, 1.0, True, OFF),                 # z > 2**31 - 2: never
    (2.0**31, 1.0, 1.0, False, OFF),
    (2.0**31, 2.0, -1.0, False, (N, True)),         # z <= 2**31 - 2: the last in-range falling threshold
    (2.0**31, 2.0, -1.0, True, (N - 1, True)),
    (2.0**31, 1.0, -1.0, False, ON),                # z <= 2**31 - 1: always
    (-(2.0**31), -2.0, 1.0, False, (-N, False)),    # z >= -(2**31 - 2): always, but in range
    (-(2.0**31), -2.0, 1.0, True, (-N + 1, False)),
    (-(2.0**31), -1.0, 1.0, False, ON),
    (-(2.0**31), -2.0, -1.0, False, (-N, True)),    # z <= -(2**31 - 2): in range, though true only at -N
    (-(2.0**31), -2.0, -1.0, True, OFF),
    (1e10, 0.0, 1.0, False, OFF), (-1e10, 0.0, 1.0, False, ON),
    (1e10, 0.0, -1.0, False, ON), (-1e10, 0.0, -1.0, False, OFF),
    (3e38, 0.0, 1e-45, False, OFF), (3e38, 0.0, -1e-45, False, ON),
])
def test_thresholds_beyond_int32_clamp_to_always_on_or_off(mean, bias, gamma, strict, expected):
    """Q / P beyond +-(2**31 - 2) is encoded as always on / off with flip False; the range ends stay exact."""
    assert result1(chain1(mean, 1.0, 0.0, gamma, 0.0, bias=bias), 0.0, strict) == expected


# --- shapes, selection and determinism ---------------------------------------------------------------------

@pytest.mark.parametrize("level, shape", [(0.0, (8,)), (np.zeros(8, F32), (8,)), (np.zeros((4, 5, 8), F32), (4, 5, 8)),
                                          (np.zeros((3, 1), F32), (3, 8))])
def test_result_shapes_and_dtypes(level, shape):
    """Results have the broadcast shape of level against (C,), dtype int32 and bool."""
    t, f = integer_thresholds(random_chain(11, channels=8), level)
    assert t.shape == f.shape == shape and t.dtype == np.int32 and f.dtype == bool


def test_same_inputs_give_the_same_arrays():
    """The result depends on the inputs alone: repeated calls and per-row calls agree."""
    chain = random_chain(12, channels=16)
    level = level_of("feature", 16, 12)
    t, f = integer_thresholds(chain, level, True)
    t2, f2 = integer_thresholds(chain, level.copy(), True)
    np.testing.assert_array_equal(t, t2)
    np.testing.assert_array_equal(f, f2)
    for index in np.ndindex(level.shape[:-1]):
        t_row, f_row = integer_thresholds(chain, level[index], True)
        np.testing.assert_array_equal(t[index], t_row)
        np.testing.assert_array_equal(f[index], f_row)


def test_select_picks_the_channels_thresholds():
    """A chain's selected channels give the thresholds of those channels of the whole chain."""
    chain = random_chain(13, channels=10)
    part = chain.select(slice(3, 7))
    assert part.channels == 4
    level = level_of("channel", 10, 13)
    t, f = integer_thresholds(chain, level)
    t_part, f_part = integer_thresholds(part, level[3:7])
    np.testing.assert_array_equal(t[3:7], t_part)
    np.testing.assert_array_equal(f[3:7], f_part)


# --- property test -----------------------------------------------------------------------------------------

_any_f32 = st.floats(width=32)  # NaN, inf, subnormals, everything
_value = st.one_of(st.floats(-100, 100, width=32), st.integers(-8, 8).map(float), _any_f32)
_variance = st.one_of(st.sampled_from([0.0, 0.25, 1.0, 2.0, 4.0, 9.0]), st.floats(0, 100, width=32), _any_f32)


@st.composite
def _chains_and_levels(draw):
    c = draw(st.integers(1, 3))
    vector = lambda values: np.array(draw(st.lists(values, min_size=c, max_size=c)), F32)  # noqa: E731
    optional = lambda: vector(_value) if draw(st.booleans()) else None  # noqa: E731
    chain = BnChain(vector(_value), vector(_variance), draw(st.sampled_from([0.0, 1e-5, 1e-3, 2.0**-149])),
                    optional(), optional(), optional(), optional())
    level = draw(st.one_of(_value.map(F32), st.just(vector(_value))))
    return chain, level, draw(st.booleans())


@settings(max_examples=200, deadline=None, derandomize=True)
@given(_chains_and_levels())
def test_property_random_float32_parameters_match_the_exact_oracle(case):
    """Any float32 parameters (special values included) give thresholds that reproduce the exact bits."""
    chain, level, strict = case
    assert_exact(chain, level, strict)
