"""A bounded fuzz of the ops' argument space and of checkpoint bytes: every case either matches the
reference bit for bit or raises one of the documented exceptions (ValueError / TypeError from the ops'
Python front, PackedModelError from the loader, CheckpointError or a fallback message from a resume);
no abort, no hang. CI runs a few examples of each (well under a minute); JAXBNN_FUZZ_EXAMPLES=N runs N
of each on demand (docs/reliability.md has the figures)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxbnn import formats, ops, packed_model
from jaxbnn.packed_model import PackedModelError
from numpy_spec import numpy_conv

EXAMPLES = int(os.environ.get("JAXBNN_FUZZ_EXAMPLES", "0"))

def fuzz(ci_examples):
    """CI: a fixed (derandomized) set of examples; on demand: JAXBNN_FUZZ_EXAMPLES fresh random ones."""
    return settings(max_examples=EXAMPLES or ci_examples, deadline=None, derandomize=not EXAMPLES,
                    suppress_health_check=list(HealthCheck))


# Thresholds from everywhere an integer can come from: small ones near the dots, int64 extremes, Python
# integers beyond 64 bits, and device arrays of other integer dtypes.
WIDE_INTS = st.one_of(st.integers(-40, 40), st.integers(-(2**63), 2**63 - 1), st.integers(-(2**80), 2**80))
MODES = st.sampled_from(["eager", "jit", "vmap"])


def run(mode, fn, *args):
    """The op called eagerly, under jit, or vmapped (a batch of two copies, folded into the rows)."""
    if mode == "jit":
        return jax.jit(fn)(*args)
    if mode == "vmap":
        stacked = [jnp.stack([a, a]) for a in args]
        return jax.vmap(fn)(*stacked)[0]
    return fn(*args)


def signs(rng, shape):
    return np.where(rng.random(shape) < 0.5, 1.0, -1.0).astype(np.float32)


def np_pack(bits):
    """docs/formats.md's packing in numpy (LSB first, zero padding bits): inputs and expected outputs are
    built without jax, so an example costs the op's compilation only."""
    bits = np.asarray(bits, bool)
    k = bits.shape[-1]
    words = -(-k // 32)
    padded = np.zeros(bits.shape[:-1] + (words * 32,), np.uint64)
    padded[..., :k] = bits
    return (padded.reshape(bits.shape[:-1] + (words, 32)) << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)


def np_fsb(rows, tile):
    """FSB tiles of a row-packed matrix (docs/formats.md), in numpy."""
    bh, ww = tile[0], tile[1] // 32
    r, kw = rows.shape
    rt, kt = -(-r // bh), -(-kw // ww)
    padded = np.zeros((rt * bh, kt * ww), np.uint32)
    padded[:r, :kw] = rows
    return padded.reshape(rt, bh, kt, ww).transpose(0, 2, 1, 3).copy()


def np_max_pool(dots, pool):
    if pool is None:
        return dots
    ph, pw = pool
    b, h, w, o = dots.shape
    return dots[:, : h // ph * ph, : w // pw * pw].reshape(b, h // ph, ph, w // pw, pw, o).max(axis=(2, 4))


@st.composite
def threshold_epilogues(draw, n):
    """Thresholds of any integer width (host, or a device array of a narrower dtype) and flips, one per column."""
    values = draw(st.lists(WIDE_INTS, min_size=n, max_size=n))
    host = np.array(values, object if any(abs(v) >= 2**63 for v in values) else np.int64)
    dtype = draw(st.sampled_from(["host", "int32", "uint32", "int8"]))
    if dtype != "host":
        info = np.iinfo(dtype)
        host = jnp.asarray(np.clip(np.array(values, object), info.min, info.max).astype(dtype))
    return dict(threshold=host, flip=np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n))))


@st.composite
def epilogues(draw, n):
    kind = draw(st.sampled_from(["i32", "f32", "bits"]))
    if kind == "f32":
        rng = np.random.default_rng(draw(st.integers(0, 2**32)))
        scale, bias = rng.standard_normal((2, n)).astype(np.float32)
        return kind, dict(scale=scale, bias=bias)
    if kind == "bits":
        return kind, draw(threshold_epilogues(n))
    return kind, {}


def expected_epilogue(dot, kind, epi):
    """The epilogue on the reference's int32 dots, computed in numpy with Python integers (no saturation)."""
    dot = np.asarray(dot)
    if kind == "i32":
        return dot
    if kind == "f32":
        return dot.astype(np.float32) * epi["scale"] + epi["bias"]
    t = np.array([int(v) for v in np.asarray(epi["threshold"]).tolist()], object)
    bits = np.where(epi["flip"], dot.astype(object) <= t, dot.astype(object) >= t).astype(bool)
    return np_pack(bits)


def assert_matches(got, want, kind):
    got = np.asarray(got)
    assert got.shape == want.shape, (got.shape, want.shape)
    if kind == "f32":
        np.testing.assert_allclose(got, want, rtol=2e-7, atol=2e-7 * max(1.0, float(np.abs(want).max(initial=0))))
    else:
        np.testing.assert_array_equal(got, want)


@fuzz(100)
@given(st.integers(0, 9), st.integers(1, 300), st.integers(0, 40), st.sampled_from(["rows", "fsb", "fsb16x64"]),
       st.data(), MODES, st.integers(0, 2**32))
def test_bmm_matches_the_reference_or_refuses(m, k, n, layout, data, mode, seed):
    rng = np.random.default_rng(seed)
    a_signs, w_signs = signs(rng, (m, k)), signs(rng, (n, k))
    a, rows = np_pack(a_signs > 0), np_pack(w_signs > 0)
    kind, epi = data.draw(epilogues(n))
    b = {"rows": rows, "fsb": np_fsb(rows, (8, 128)), "fsb16x64": np_fsb(rows, (16, 64))}[layout]
    if n == 0 and layout != "rows":
        with pytest.raises(ValueError):
            ops.bmm(a, b, k, n=n, **epi)
        return
    if mode == "vmap" and m == 0:
        mode = "eager"
    got = run(mode, lambda a: ops.bmm(a, b, k, n=n, **epi), a)
    dot = (a_signs @ w_signs.T).astype(np.int32)
    assert_matches(got, expected_epilogue(dot, kind, epi), kind)


@fuzz(30)
@given(st.integers(0, 80), st.lists(st.integers(1, 300), min_size=2, max_size=5),
       st.sampled_from(["rows", "fsb", "fsb16x64"]), st.booleans(), st.data(), MODES, st.integers(0, 2**32))
def test_bmm_chain_matches_numpy_layer_after_layer(m, widths, layout, logits, data, mode, seed):
    """A chain of random widths (up to 80 rows: the CPU's table kernel from 64): every layer's bits through thresholds
    of any width, the last layer bits or float32 logits, as numpy computes the layers one by one."""
    rng = np.random.default_rng(seed)
    values = signs(rng, (m, widths[0]))
    a = np_pack(values > 0)
    layers = []
    for i, (k, n) in enumerate(zip(widths, widths[1:])):
        w_signs = signs(rng, (n, k))
        rows = np_pack(w_signs > 0)
        b = {"rows": rows, "fsb": np_fsb(rows, (8, 128)), "fsb16x64": np_fsb(rows, (16, 64))}[layout]
        dot = (values @ w_signs.T).astype(np.int32)
        if logits and i == len(widths) - 2:
            scale, bias = rng.standard_normal((2, n)).astype(np.float32)
            layers.append(dict(b=b, k=k, n=n, scale=scale, bias=bias))
            want, kind = expected_epilogue(dot, "f32", layers[-1]), "f32"
        else:
            layers.append(dict(b=b, k=k, n=n, **data.draw(threshold_epilogues(n))))
            want, kind = expected_epilogue(dot, "bits", layers[-1]), "bits"
            values = np.where(np.asarray(ops.unpack_bits(want, n)) > 0, 1.0, -1.0).astype(np.float32)
    if mode == "vmap" and m == 0:
        mode = "eager"
    assert_matches(run(mode, lambda a: ops.bmm_chain(a, layers), a), want, kind)


@fuzz(100)
@given(st.integers(0, 2), st.integers(1, 9), st.integers(1, 9), st.integers(1, 70), st.integers(1, 20),
       st.tuples(st.integers(1, 5), st.integers(1, 5)), st.tuples(st.integers(1, 3), st.integers(1, 3)),
       st.one_of(st.sampled_from(["SAME", "VALID"]), st.tuples(*[st.tuples(st.integers(0, 4), st.integers(0, 4))] * 2)),
       st.sampled_from(["zero", "one"]), st.one_of(st.none(), st.tuples(st.integers(1, 3), st.integers(1, 3))),
       st.data(), MODES, st.integers(0, 2**32))
def test_bconv2d_matches_the_reference_or_refuses(b, h, w, c, o, kernel, stride, padding, pad_value, pool, data,
                                                  mode, seed):
    rng = np.random.default_rng(seed)
    x_signs, w_signs = signs(rng, (b, h, w, c)), signs(rng, kernel + (c, o))
    x = np_pack(x_signs > 0)
    weights = np_pack(np.transpose(w_signs, (3, 0, 1, 2)) > 0)  # row-packed (O, KH, KW, ceil(C/32))
    kind, epi = data.draw(epilogues(o))
    def conv(x):
        return ops.bconv2d(x, weights, in_channels=c, kernel_size=kernel, stride=stride, padding=padding,
                           pad_value=pad_value, pool=pool, **epi)

    pads = ops._conv_padding(padding, (h, w), kernel, stride)
    conv_h = (h + sum(pads[0]) - kernel[0]) // stride[0] + 1
    conv_w = (w + sum(pads[1]) - kernel[1]) // stride[1] + 1
    ph, pw = pool or (1, 1)
    if h + sum(pads[0]) < kernel[0] or w + sum(pads[1]) < kernel[1] or conv_h < ph or conv_w < pw:
        with pytest.raises(ValueError, match="does not fit|larger than"):
            conv(x)
        return
    if mode == "vmap" and b == 0:
        mode = "eager"
    got = run(mode, conv, x)
    dot = np_max_pool(numpy_conv(x_signs, w_signs, stride, pads, pad_value), pool)
    assert_matches(got, expected_epilogue(dot, kind, epi), kind)


def ternary_values(rng, shape, ternary):
    return (rng.integers(-1, 2, shape) if ternary else np.where(rng.random(shape) < 0.5, 1, -1)).astype(np.float32)


@st.composite
def plane_epilogues(draw, n):
    """An epilogue of `epilogues`, or two threshold planes (a ternary output's)."""
    kind, epi = draw(epilogues(n))
    if kind != "bits" or not draw(st.booleans()):
        return kind, epi, 0
    threshold = np.array([draw(st.lists(st.integers(-60, 60), min_size=n, max_size=n)) for _ in range(2)], np.int64)
    flip = np.array([draw(st.lists(st.booleans(), min_size=n, max_size=n)) for _ in range(2)])
    return kind, dict(threshold=threshold, flip=flip), 2


def expected_planes(dot, kind, epi, planes):
    if not planes:
        return expected_epilogue(dot, kind, epi)
    return np.stack([expected_epilogue(dot, kind, dict(threshold=epi["threshold"][p], flip=epi["flip"][p]))
                     for p in range(planes)], axis=-2)


@pytest.fixture(params=["native", "side by side"])
def ternary_kernels(request, monkeypatch):
    """The ternary and mixed products through the platform's own kernels (the CPU's), or as on a platform
    without them (CUDA): one binary product over the planes side by side, the binary kernels' epilogues."""
    from jaxbnn import _ffi

    if request.param == "side by side":
        has_target = _ffi.has_target
        monkeypatch.setattr(_ffi, "has_target", lambda platform, target: has_target(platform, target) and not any(
            target.startswith(f"jaxbnn_{mode}_") for mode in ("tnn", "tbn", "btn")))  # fmt: skip
    jax.clear_caches()
    yield request.param
    jax.clear_caches()


@fuzz(16)
@given(st.sampled_from(["tnn", "tbn", "btn"]), st.integers(0, 7), st.integers(1, 200), st.integers(1, 40),
       st.data(), MODES, st.integers(0, 2**32))
def test_ternary_bmm_matches_numpy(ternary_kernels, product, m, k, n, data, mode, seed):
    rng = np.random.default_rng(seed)
    a_values = ternary_values(rng, (m, k), product in ("tnn", "tbn"))
    w_values = ternary_values(rng, (k, n), product in ("tnn", "btn"))
    a = formats.pack_ternary_pm_planes(a_values) if product != "btn" else np_pack(a_values > 0)
    w = (formats.pack_ternary_dense_weights if product != "tbn" else formats.pack_dense_weights)(w_values)
    kind, epi, planes = data.draw(plane_epilogues(n))
    if mode == "vmap" and m == 0:
        mode = "eager"
    fn = (lambda a, b: ops.bmm(formats.TernaryPlanes(a, b), w, **epi)) if product != "btn" else (
        lambda a: ops.bmm(a, w, **epi))  # fmt: skip
    got = run(mode, fn, *(a if product != "btn" else (a,)))
    assert_matches(got, expected_planes((a_values @ w_values).astype(np.int32), kind, epi, planes), kind)


@fuzz(16)
@given(st.sampled_from(["tnn", "tbn", "btn"]), st.integers(0, 2), st.integers(1, 8), st.integers(1, 8),
       st.integers(1, 70), st.integers(1, 40), st.tuples(st.integers(1, 4), st.integers(1, 4)),
       st.tuples(st.integers(1, 2), st.integers(1, 2)), st.sampled_from(["SAME", "VALID"]),
       st.sampled_from(["zero", "one"]), st.one_of(st.none(), st.tuples(st.integers(1, 2), st.integers(1, 2))),
       st.data(), st.integers(0, 2**32))
def test_ternary_bconv2d_matches_numpy(ternary_kernels, product, b, h, w, c, o, kernel, stride, padding, pad_value,
                                       pool, data, seed):
    rng = np.random.default_rng(seed)
    x_values = ternary_values(rng, (b, h, w, c), product in ("tnn", "tbn"))
    w_values = ternary_values(rng, kernel + (c, o), product in ("tnn", "btn"))
    x = formats.pack_ternary_pm_planes(x_values) if product != "btn" else np_pack(x_values > 0)
    weights = (formats.pack_ternary_conv_weights if product != "tbn" else formats.pack_conv_weights)(w_values)
    kind, epi, planes = data.draw(plane_epilogues(o))
    pads = ops._conv_padding(padding, (h, w), kernel, stride)
    conv_h = (h + sum(pads[0]) - kernel[0]) // stride[0] + 1
    conv_w = (w + sum(pads[1]) - kernel[1]) // stride[1] + 1
    ph, pw = pool or (1, 1)
    if conv_h < max(ph, 1) or conv_w < max(pw, 1) or h + sum(pads[0]) < kernel[0] or w + sum(pads[1]) < kernel[1]:
        return  # refusals: test_bconv2d_matches_the_reference_or_refuses
    got = jax.jit(lambda x: ops.bconv2d(x, weights, stride=stride, padding=padding, pad_value=pad_value, pool=pool,
                                        **epi))(x)  # fmt: skip
    dot = np_max_pool(numpy_conv(x_values, w_values, stride, pads, pad_value), pool)
    assert_matches(got, expected_planes(dot, kind, epi, planes), kind)


ANYTHING = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                     st.text(max_size=4), st.tuples(st.integers(-(2**64), 2**64), st.integers(-(2**64), 2**64)),
                     st.lists(st.integers(-(2**40), 2**40), max_size=3))


@fuzz(300)
@given(st.sampled_from(["stride", "padding", "pool", "kernel_size", "in_channels", "out_channels", "pad_value"]),
       ANYTHING)
def test_bconv2d_arguments_of_any_value_give_a_result_or_a_documented_error(name, value):
    x = jnp.zeros((1, 5, 5, 1), jnp.uint32)
    w = formats.pack_conv_weights(jnp.ones((3, 3, 20, 4)))
    try:
        out = ops.bconv2d(x, w, **{name: value})
    except (ValueError, TypeError):
        return
    assert out.dtype == jnp.int32 and out.ndim == 4


@fuzz(300)
@given(st.sampled_from(["k", "n", "threshold", "scale", "b_popcount"]), ANYTHING)
def test_bmm_arguments_of_any_value_give_a_result_or_a_documented_error(name, value):
    a = jnp.zeros((2, 2), jnp.uint32)
    b = jnp.zeros((3, 2), jnp.uint32)
    args = {"k": 64, name: value}
    try:
        out = ops.bmm(a, b, **args)
    except (ValueError, TypeError):
        return
    assert out.shape[0] == 2


@fuzz(20)
@given(st.integers(0, 2), st.integers(1, 12), st.integers(1, 12), st.integers(1, 4), st.integers(1, 6),
       st.tuples(st.integers(1, 11), st.integers(1, 11)), st.tuples(st.integers(1, 4), st.integers(1, 4)),
       st.one_of(st.sampled_from(["SAME", "VALID"]), st.tuples(*[st.tuples(st.integers(0, 4), st.integers(0, 4))] * 2)),
       MODES, st.integers(0, 2**32))
def test_image_conv2d_matches_numpy_or_refuses(b, h, w, c, n, kernel, stride, padding, mode, seed):
    from test_ops import numpy_image_conv

    rng = np.random.default_rng(seed)
    levels = rng.integers(-128, 128, (b, h, w, c), dtype=np.int8)
    weights = rng.integers(-128, 128, (*kernel, c, n), dtype=np.int8)
    pads = ops._conv_padding(padding, (h, w), kernel, stride)
    if h + sum(pads[0]) < kernel[0] or w + sum(pads[1]) < kernel[1]:
        with pytest.raises(ValueError, match="does not fit"):
            ops.image_conv2d(levels, weights, stride=stride, padding=padding)
        return
    if mode == "vmap" and b == 0:
        mode = "eager"
    got = run(mode, lambda x: ops.image_conv2d(x, weights, stride=stride, padding=padding), levels)
    np.testing.assert_array_equal(np.asarray(got), numpy_image_conv(levels, weights, stride, pads))


@fuzz(200)
@given(st.sampled_from(["stride", "padding"]), ANYTHING)
def test_image_conv2d_arguments_of_any_value_give_a_result_or_a_documented_error(name, value):
    try:
        out = ops.image_conv2d(np.zeros((1, 5, 5, 3), np.int8), np.ones((3, 3, 3, 2), np.int8), **{name: value})
    except (ValueError, TypeError):
        return
    assert out.dtype == jnp.int32 and out.ndim == 4


@pytest.fixture(scope="module", params=["binary", "resnet-tnn"])
def packed_file(request, tmp_path_factory):
    """A file of the first-layer, packed-image and dense nodes, and one of the stream's nodes."""
    from test_packed_model import MODELS

    path = tmp_path_factory.mktemp("fuzz") / "m.jbnn"
    packed_model.save(path, MODELS[request.param]())
    return path.read_bytes(), packed_model.load(path)


@fuzz(1000)
@given(st.lists(st.tuples(st.sampled_from(["flip", "set", "cut", "insert"]), st.integers(0, 2**32),
                          st.integers(0, 255)), min_size=1, max_size=4))
def test_checkpoint_bytes_load_unchanged_or_are_refused(tmp_path_factory, packed_file, edits):
    blob, model = packed_file
    data = bytearray(blob)
    for op, where, value in edits:
        i = where % max(len(data), 1)
        if op in ("flip", "set") and not data:
            continue
        if op == "flip":
            data[i] ^= 1 << (value % 8)
        elif op == "set":
            data[i] = value
        elif op == "cut":
            del data[i:]
        else:
            data[i:i] = bytes([value])
    path = tmp_path_factory.mktemp("case") / "m.jbnn"
    path.write_bytes(bytes(data))
    try:
        loaded = packed_model.load(path)
    except PackedModelError:
        return
    # accepted: only an edit that changed nothing the file means (e.g. one JSON space for another)
    assert loaded.graph == model.graph and loaded.target == model.target
    for name, array in model.tensors.items():
        np.testing.assert_array_equal(loaded.tensors[name], array)


@pytest.fixture(scope="module")
def training_checkpoints(tmp_path_factory):
    from test_checkpoints import save_steps

    run_dir = tmp_path_factory.mktemp("run")
    save_steps(run_dir, [10, 20])
    return run_dir


@fuzz(20)
@given(st.lists(st.tuples(st.integers(0, 2**32), st.integers(0, 2**32), st.integers(1, 255)), min_size=1,
                max_size=8))
def test_training_checkpoint_bytes_resume_from_a_verified_step(tmp_path_factory, training_checkpoints, flips):
    """Bytes flipped anywhere in the newest step: the resume verifies it, names it and falls back to the
    step before, with that step's weights."""
    import shutil

    from test_checkpoints import first_kernel, restore

    run_dir = tmp_path_factory.mktemp("case")
    shutil.copytree(training_checkpoints, run_dir, dirs_exist_ok=True)
    files = sorted(p for p in (run_dir / "checkpoints" / "20").rglob("*") if p.is_file())
    for which, where, mask in flips:
        path = files[which % len(files)]
        data = bytearray(path.read_bytes())
        if data:
            data[where % len(data)] ^= mask
            path.write_bytes(bytes(data))
    changed = any(p.read_bytes() != (training_checkpoints / p.relative_to(run_dir)).read_bytes() for p in files)
    step, progress, model, messages = restore(run_dir)
    if not changed:  # the flips cancelled out
        assert (step, messages) == (20, [])
        return
    assert (step, progress["step"]) == (10, 10) and messages[0].startswith("checkpoint step 20 is damaged: ")
    assert np.all(np.asarray(first_kernel(model)) == 10.0)
