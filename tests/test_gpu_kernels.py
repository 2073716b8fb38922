"""The CUDA FFI targets (jaxbnn._cuda) held bit for bit to the pure-JAX reference, on every engine.

Each test calls the native targets of docs/ops.md directly through `jax.ffi.ffi_call` on the GPU, once per
engine (wgmma, mma.sync, CUDA cores), and compares with `jaxbnn.reference` evaluated on the CPU (and with
the CPU handlers where they are built). Inputs are random, shapes odd (K not a multiple of 32/128/256,
M = 1, borders with both padding modes, strides, pools).
"""

from __future__ import annotations

import os
import re
import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxbnn import formats, reference

pytestmark = pytest.mark.gpu


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


# Without a GPU or the CUDA module, conftest.py skips every test here (marker `gpu`), or fails them when
# JAXBNN_REQUIRE_GPU=1: the module must still import.
try:
    import jaxbnn._cuda as _cuda
except ImportError:
    _cuda = None
from jaxbnn import _ffi  # noqa: E402, F401  (registers the targets of the built modules)

GPU = _gpus()[0] if _gpus() else None
CPU = jax.devices("cpu")[0]
ENGINES = ["wgmma", "mma_sync", "simt"]
EPILOGUES = ["i32", "f32", "bits"]


@pytest.fixture(params=ENGINES)
def engine(request):
    _cuda.set_kernel_path(request.param)
    yield request.param
    _cuda.set_kernel_path("auto")


def _epilogue_operands(rng, n, k_real, kind):
    if kind == "f32":
        scale = rng.uniform(-2, 2, n).astype(np.float32)
        bias = rng.uniform(-2, 2, n).astype(np.float32)
        return dict(scale=scale, bias=bias), [scale, bias]
    if kind == "bits":
        threshold = rng.integers(-(k_real // 4) - 2, k_real // 4 + 3, n).astype(np.int32)
        flip = rng.integers(0, 2, n).astype(bool)
        return dict(threshold=threshold, flip=flip), [threshold, flip.astype(np.uint8)]
    return {}, []


def _result(kind, rows_shape, n):
    if kind == "bits":
        return jax.ShapeDtypeStruct(rows_shape + (formats.num_words(n),), jnp.uint32)
    return jax.ShapeDtypeStruct(rows_shape + (n,), jnp.float32 if kind == "f32" else jnp.int32)


def _call(target, device, result, operands, attrs):
    operands = [jax.device_put(np.asarray(x), device) for x in operands]
    return np.asarray(jax.ffi.ffi_call(target, result)(*operands, **attrs))


def _random_signs(rng, shape):
    return np.where(rng.random(shape) < 0.5, -1.0, 1.0).astype(np.float32)


def _check_against_cpu_handler(target, result, operands, attrs, got):
    if _ffi.has_target("cpu", target):
        np.testing.assert_array_equal(got, _call(target, CPU, result, operands, attrs))


BMM_SHAPES = [(1, 3, 100), (5, 33, 31), (1, 1, 1), (129, 257, 1000), (64, 64, 128), (300, 520, 2144), (17, 300, 4096)]


@pytest.mark.parametrize("kind", EPILOGUES)
@pytest.mark.parametrize("m,n,k", BMM_SHAPES)
def test_bmm_matches_reference(engine, m, n, k, kind):
    rng = np.random.default_rng(zlib.crc32(repr((m, n, k, kind)).encode()))
    a = np.asarray(formats.pack_bits(_random_signs(rng, (m, k)) >= 0))
    w = formats.pack_dense_weights(_random_signs(rng, (k, n)))
    epi_kwargs, epi_operands = _epilogue_operands(rng, n, k, kind)
    with jax.default_device(CPU):
        want = np.asarray(reference.bmm(a, w.bits, k, n, **epi_kwargs))
    target = f"jaxbnn_bmm_{kind}"
    operands = [a, w.bits, w.popcount, *epi_operands]
    attrs = dict(k=np.int64(k), n=np.int64(n))
    got = _call(target, GPU, _result(kind, (m,), n), operands, attrs)
    np.testing.assert_array_equal(got, want)
    _check_against_cpu_handler(target, _result(kind, (m,), n), operands, attrs, got)


# (batch, h, w, c, o, kernel, stride, ((top, bottom), (left, right)), pad_value, pool)
CONV_CASES = [
    (2, 9, 7, 128, 40, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero", None),
    (2, 9, 7, 128, 40, (3, 3), (1, 1), ((1, 1), (1, 1)), "one", None),
    (3, 8, 8, 64, 70, (3, 3), (2, 2), ((1, 1), (1, 1)), "zero", None),
    (1, 11, 10, 100, 33, (5, 5), (1, 1), ((2, 2), (2, 2)), "zero", None),
    (2, 13, 12, 256, 64, (7, 7), (2, 2), ((3, 3), (3, 3)), "zero", None),
    (1, 20, 19, 3, 16, (11, 11), (4, 4), ((2, 2), (2, 2)), "zero", None),
    (2, 6, 6, 512, 130, (1, 1), (1, 1), ((0, 0), (0, 0)), "zero", None),
    (2, 8, 8, 128, 96, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero", (2, 2)),
    (2, 9, 9, 128, 64, (3, 3), (1, 1), ((1, 1), (1, 1)), "one", (3, 3)),
    (2, 7, 9, 32, 50, (2, 3), (1, 2), ((0, 1), (2, 0)), "zero", (2, 1)),
]


def _conv_attrs(c, o, kernel, stride, padding, pad_value, pool):
    (pt, pb), (pl, pr) = padding
    ph, pw = pool or (1, 1)
    i64 = np.int64
    return dict(c=i64(c), o=i64(o), kh=i64(kernel[0]), kw=i64(kernel[1]), stride_h=i64(stride[0]),
                stride_w=i64(stride[1]), pad_top=i64(pt), pad_bottom=i64(pb), pad_left=i64(pl), pad_right=i64(pr),
                pad_one=pad_value == "one", pool_h=i64(ph), pool_w=i64(pw))


@pytest.mark.parametrize("kind", EPILOGUES)
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"b{c[0]}_{c[1]}x{c[2]}_c{c[3]}_o{c[4]}_k{c[5][0]}x{c[5][1]}_s{c[6][0]}{c[6][1]}_{c[8]}_pool{c[9]}")
def test_bconv2d_matches_reference(engine, case, kind):
    batch, h, w_, c, o, kernel, stride, padding, pad_value, pool = case
    rng = np.random.default_rng(zlib.crc32(repr((case, kind)).encode()))
    x = np.asarray(formats.pack_bits(_random_signs(rng, (batch, h, w_, c)) >= 0))
    w = formats.pack_conv_weights(_random_signs(rng, (*kernel, c, o)))
    epi_kwargs, epi_operands = _epilogue_operands(rng, o, kernel[0] * kernel[1] * c, kind)
    with jax.default_device(CPU):
        want = np.asarray(reference.bconv2d(x, w.bits, in_channels=c, out_channels=o, kernel_size=kernel,
                                            stride=stride, padding=padding, pad_value=pad_value, pool=pool,
                                            **epi_kwargs))
    target = f"jaxbnn_bconv2d_{kind}"
    operands = [x, w.bits, w.tap_popcount, *epi_operands]
    attrs = _conv_attrs(c, o, kernel, stride, padding, pad_value, pool)
    result = _result(kind, want.shape[:3], o)
    got = _call(target, GPU, result, operands, attrs)
    np.testing.assert_array_equal(got, want)
    _check_against_cpu_handler(target, result, operands, attrs, got)


def test_engine_choice_on_aligned_rows():
    """K words a multiple of 4 on Hopper run on wgmma; other GPUs and unaligned rows on mma.sync or CUDA cores."""
    rng = np.random.default_rng(0)
    m, n, k = 200, 300, 1024
    a = np.asarray(formats.pack_bits(_random_signs(rng, (m, k)) >= 0))
    w = formats.pack_dense_weights(_random_signs(rng, (k, n)))
    _cuda.set_kernel_path("auto")
    _call("jaxbnn_bmm_i32", GPU, _result("i32", (m,), n), [a, w.bits, w.popcount], dict(k=np.int64(k), n=np.int64(n)))
    hopper = GPU.compute_capability == "9.0" if hasattr(GPU, "compute_capability") else False
    assert _cuda.last_kernel_path() == ("wgmma" if hopper else "mma_sync")


def test_handler_rejects_inconsistent_shapes():
    rng = np.random.default_rng(1)
    a = np.asarray(formats.pack_bits(_random_signs(rng, (4, 64)) >= 0))
    w = formats.pack_dense_weights(_random_signs(rng, (64, 8)))
    # k = 100 needs 4 words per row, a has 2 (the message of common/checks.h, shared with the CPU handlers)
    message = r"jaxbnn_bmm_i32: operand `a` has shape \(4, 2\) but k = 100 requires \(4, 4\)"
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        _call("jaxbnn_bmm_i32", GPU, _result("i32", (4,), 8), [a, w.bits, w.popcount], dict(k=np.int64(100), n=np.int64(8)))


def test_bmm_inside_jit_and_graph_matches_reference():
    """Two chained calls under jit (XLA may capture them in a command buffer): the same bits as eager."""
    rng = np.random.default_rng(2)
    m, k, n = 96, 512, 256
    a = np.asarray(formats.pack_bits(_random_signs(rng, (m, k)) >= 0))
    w1 = formats.pack_dense_weights(_random_signs(rng, (k, n)))
    w2 = formats.pack_dense_weights(_random_signs(rng, (n, n)))
    t1 = rng.integers(-8, 9, n).astype(np.int32)
    f1 = rng.integers(0, 2, n).astype(np.uint8)

    def net(a, b1, p1, b2, p2):
        h = jax.ffi.ffi_call("jaxbnn_bmm_bits", _result("bits", (m,), n))(a, b1, p1, t1, f1, k=np.int64(k), n=np.int64(n))
        return jax.ffi.ffi_call("jaxbnn_bmm_i32", _result("i32", (m,), n))(h, b2, p2, k=np.int64(n), n=np.int64(n))

    args = [jax.device_put(np.asarray(v), GPU) for v in (a, w1.bits, w1.popcount, w2.bits, w2.popcount)]
    got = np.asarray(jax.jit(net)(*args))
    with jax.default_device(CPU):
        h = reference.bmm(a, w1.bits, k, n, threshold=t1, flip=f1.astype(bool))
        want = np.asarray(reference.bmm(h, w2.bits, n, n))
    np.testing.assert_array_equal(got, want)


def test_ops_dispatch_to_cuda_matches_reference():
    """jaxbnn.ops on GPU arrays runs the CUDA targets (the engine switch shows it) and agrees with the spec."""
    from jaxbnn import ops

    rng = np.random.default_rng(3)
    m, k, n = 70, 300, 90
    a = np.asarray(formats.pack_bits(_random_signs(rng, (m, k)) >= 0))
    w = formats.pack_dense_weights(_random_signs(rng, (k, n)))
    threshold = rng.integers(-20, 21, n).astype(np.int32)
    flip = rng.integers(0, 2, n).astype(bool)
    _cuda.set_kernel_path("simt")
    got = np.asarray(ops.bmm(jax.device_put(a, GPU), jax.device_put(w.bits, GPU), k, n=n,
                             b_popcount=jax.device_put(w.popcount, GPU), threshold=threshold, flip=flip))
    assert _cuda.last_kernel_path() == "simt"
    _cuda.set_kernel_path("auto")
    with jax.default_device(CPU):
        want = np.asarray(reference.bmm(a, w.bits, k, n, threshold=threshold, flip=flip))
    np.testing.assert_array_equal(got, want)

    x = np.asarray(formats.pack_bits(_random_signs(rng, (2, 10, 9, 128)) >= 0))
    cw = formats.pack_conv_weights(_random_signs(rng, (3, 3, 128, 48)))
    got = np.asarray(ops.bconv2d(jax.device_put(x, GPU), jax.device_put(cw.bits, GPU), in_channels=128,
                                 kernel_size=(3, 3), out_channels=48, stride=(2, 2), padding="SAME",
                                 w_tap_popcount=jax.device_put(cw.tap_popcount, GPU)))
    with jax.default_device(CPU):
        want = np.asarray(ops.bconv2d(x, cw.bits, in_channels=128, kernel_size=(3, 3), out_channels=48,
                                      stride=(2, 2), padding="SAME", w_tap_popcount=cw.tap_popcount))
    np.testing.assert_array_equal(got, want)


# --- the handlers' own validation: the CPU handlers' error paths (tests/test_native_cpu.py) on the GPU ---
# Both backends validate with xla_ffi/common/checks.h, so a bad call is refused on the GPU with the message
# the CPU handler gives for it, word for word; each test checks the expected text and compares with the CPU.


def _u32(*shape):
    return np.random.default_rng(0).integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)


def _refusal(target, device, result, operands, attrs):
    """The handler's message (from the target name to the end of its line) for a call it must refuse."""
    with pytest.raises(jax.errors.JaxRuntimeError) as refused:
        _call(target, device, result, operands, attrs)
    message = str(refused.value)
    assert f"{target}: " in message, message
    return message[message.index(f"{target}: "):].splitlines()[0]


def _assert_refused_like_cpu(target, result, operands, attrs, message):
    on_gpu = _refusal(target, GPU, result, operands, attrs)
    assert re.match(re.escape(target) + ": " + message, on_gpu), on_gpu
    if _ffi.has_target("cpu", target):
        assert on_gpu == _refusal(target, CPU, result, operands, attrs)


I64 = np.int64
# A valid bmm call: M=4, k=100 (4 words), n=10 (FSB tiles (2, 1, 8, 4)).
BMM_CALL = dict(a=_u32(4, 4), b=_u32(2, 1, 8, 4), popc=np.zeros(10, np.int32), k=I64(100), n=I64(10))


def _bmm_refused(message, target="jaxbnn_bmm_i32", out=((4, 10), jnp.int32), extra=(), **change):
    call = {**BMM_CALL, **change}
    _assert_refused_like_cpu(target, jax.ShapeDtypeStruct(*out), [call["a"], call["b"], call["popc"], *extra],
                             dict(k=call["k"], n=call["n"]), message)


BMM_ERRORS = [
    ("a float32", dict(a=np.zeros((4, 4), np.float32)), r"operand `a` must be uint32 of rank 2 .*got float32"),
    ("a rank 3", dict(a=_u32(1, 4, 4)), r"operand `a` must be uint32 of rank 2"),
    ("a words != ceil(k/32)", dict(a=_u32(4, 3)), r"operand `a` has shape \(4, 3\) but k = 100 requires \(4, 4\)"),
    ("b too few reduction tiles", dict(k=I64(200), a=_u32(4, 7)), r"operand `b` has shape \(2, 1, 8, 4\)"),
    ("b too few row tiles", dict(n=I64(17), popc=np.zeros(17, np.int32)), r"operand `b` has shape"),
    ("b empty tile", dict(b=_u32(2, 1, 8, 0)), r"operand `b` has an empty tile"),
    ("b rank 2", dict(b=_u32(10, 4)), r"operand `b` must be uint32 of rank 4"),
    ("b_popcount length", dict(popc=np.zeros(9, np.int32)), r"operand `b_popcount` has shape \(9,\)"),
    ("b_popcount dtype", dict(popc=np.zeros(10, np.float32)), r"operand `b_popcount` must be int32"),
    ("negative k", dict(k=I64(-1)), r"attribute k = -1 is out of range"),
    ("k beyond int32", dict(k=I64(2**31)), r"attribute k = 2147483648 is out of range"),
    ("negative n", dict(n=I64(-3)), r"attribute n = -3 is out of range"),
]


@pytest.mark.parametrize("what,change,message", BMM_ERRORS, ids=[e[0] for e in BMM_ERRORS])
def test_bmm_handler_refuses_bad_operands_like_cpu(what, change, message):
    _bmm_refused(message, **change)


def test_bmm_handler_refuses_bad_results_and_epilogue_operands_like_cpu():
    _bmm_refused(r"result has shape \(4, 11\)", out=((4, 11), jnp.int32))
    _bmm_refused(r"result must be int32, got float32", out=((4, 10), jnp.float32))
    scale, bias = np.ones(10, np.float32), np.zeros(10, np.float32)
    f32 = dict(target="jaxbnn_bmm_f32", out=((4, 10), jnp.float32))
    _bmm_refused(r"operand `scale` must be float32", extra=(np.ones(10, np.int32), bias), **f32)
    _bmm_refused(r"operand `bias` has shape \(9,\)", extra=(scale, np.zeros(9, np.float32)), **f32)
    threshold, flip = np.zeros(10, np.int32), np.zeros(10, np.uint8)
    bits = dict(target="jaxbnn_bmm_bits", out=((4, 1), jnp.uint32))
    _bmm_refused(r"operand `flip` must be uint8.*bool", extra=(threshold, np.zeros(10, bool)), **bits)
    _bmm_refused(r"operand `threshold` must be int32", extra=(np.zeros(10, np.float32), flip), **bits)
    _bmm_refused(r"result has shape \(4, 10\)", target="jaxbnn_bmm_bits", out=((4, 10), jnp.uint32),
                 extra=(threshold, flip))  # fmt: skip


def test_handler_refuses_wrongly_typed_or_missing_attributes():
    """Decoding errors come from XLA's FFI layer itself: still an error, not a crash."""
    operands = [jax.device_put(BMM_CALL[name], GPU) for name in ("a", "b", "popc")]

    def call_under_jit(**attrs):
        call = jax.ffi.ffi_call("jaxbnn_bmm_i32", jax.ShapeDtypeStruct((4, 10), jnp.int32))
        return jax.block_until_ready(jax.jit(lambda *xs: call(*xs, **attrs))(*operands))

    with pytest.raises(jax.errors.JaxRuntimeError, match="expected S64 but got S32"):
        call_under_jit(k=np.int32(100), n=I64(10))
    with pytest.raises(jax.errors.JaxRuntimeError, match="Wrong number of attributes"):
        call_under_jit(n=I64(10))


# A valid bconv2d call: 1x5x5 image, c=40 (2 words), o=9, 3x3 kernel, stride 1, padding 1.
CONV_CALL_ATTRS = _conv_attrs(40, 9, (3, 3), (1, 1), ((1, 1), (1, 1)), "zero", None)
CONV_CALL = dict(x=_u32(1, 5, 5, 2), w=_u32(2, 5, 8, 4), taps=np.zeros((9, 9), np.int32))


def _conv_operands_attrs(extra, change):
    operands = {name: change.pop(name) if name in change else value for name, value in CONV_CALL.items()}
    return [operands["x"], operands["w"], operands["taps"], *extra], {**CONV_CALL_ATTRS, **change}


def _conv_refused(message, target="jaxbnn_bconv2d_i32", out=((1, 5, 5, 9), jnp.int32), extra=(), **change):
    operands, attrs = _conv_operands_attrs(extra, change)
    _assert_refused_like_cpu(target, jax.ShapeDtypeStruct(*out), operands, attrs, message)


CONV_ERRORS = [
    ("x float32", dict(x=np.zeros((1, 5, 5, 2), np.float32)), r"operand `x` must be uint32 of rank 4"),
    ("x channel words", dict(x=_u32(1, 5, 5, 3)), r"operand `x` has shape \(1, 5, 5, 3\) but c = 40 requires"),
    ("w reduction tiles", dict(w=_u32(2, 4, 8, 4)), r"operand `w` has shape \(2, 4, 8, 4\)"),
    ("w output tiles", dict(w=_u32(1, 5, 8, 4)), r"operand `w` has shape \(1, 5, 8, 4\)"),
    ("tap popcount shape", dict(taps=np.zeros((9, 8), np.int32)), r"operand `w_tap_popcount` has shape \(9, 8\)"),
    ("tap popcount dtype", dict(taps=np.zeros((9, 9), np.uint8)), r"operand `w_tap_popcount` must be int32"),
    ("zero stride", dict(stride_h=I64(0)), r"attribute stride_h = 0 is out of range"),
    ("negative padding", dict(pad_left=I64(-1)), r"attribute pad_left = -1 is out of range"),
    ("zero pool", dict(pool_w=I64(0)), r"attribute pool_w = 0 is out of range"),
    ("zero channels", dict(c=I64(0)), r"attribute c = 0 is out of range"),
    ("kernel larger than input", dict(kh=I64(9)), r"the kernel 9 x 3 is larger than the padded input 7 x 7"),
    ("reduction beyond int32", dict(c=I64(2**30)), r"the reduction kh \* kw \* c = 3 \* 3 \* 1073741824 does not fit int32"),
]


@pytest.mark.parametrize("what,change,message", CONV_ERRORS, ids=[e[0] for e in CONV_ERRORS])
def test_bconv2d_handler_refuses_bad_operands_like_cpu(what, change, message):
    _conv_refused(message, **change)


def test_bconv2d_handler_refuses_bad_results_like_cpu():
    _conv_refused(r"result has shape \(1, 5, 5, 8\)", out=((1, 5, 5, 8), jnp.int32))
    _conv_refused(r"result has shape \(1, 4, 4, 9\)", out=((1, 4, 4, 9), jnp.int32), pad_top=I64(0))  # OW = 5
    threshold, flip = np.zeros(9, np.int32), np.zeros(9, np.uint8)
    _conv_refused(r"result has shape \(1, 5, 5, 9\)", target="jaxbnn_bconv2d_bits", out=((1, 5, 5, 9), jnp.uint32),
                  extra=(threshold, flip))  # fmt: skip
    _conv_refused(r"operand `scale` has shape \(8,\)", target="jaxbnn_bconv2d_f32", out=((1, 5, 5, 9), jnp.float32),
                  extra=(np.ones(8, np.float32), np.zeros(9, np.float32)))  # fmt: skip


def test_handlers_accept_empty_outputs():
    """Zero rows, or a pool window larger than the conv output, give empty results (nothing to launch)."""
    operands, attrs = [_u32(0, 4), BMM_CALL["b"], BMM_CALL["popc"]], dict(k=BMM_CALL["k"], n=BMM_CALL["n"])
    assert _call("jaxbnn_bmm_i32", GPU, jax.ShapeDtypeStruct((0, 10), jnp.int32), operands, attrs).shape == (0, 10)
    operands, attrs = _conv_operands_attrs((), dict(pool_h=I64(6)))
    empty = jax.ShapeDtypeStruct((1, 0, 5, 9), jnp.int32)
    assert _call("jaxbnn_bconv2d_i32", GPU, empty, operands, attrs).shape == (1, 0, 5, 9)


# --- what only the CUDA kernels refuse (the CPU kernels run these calls) ---


def _refused_on_gpu_only(target, result, operands, attrs, message):
    assert re.match(re.escape(target) + ": " + message, _refusal(target, GPU, result, operands, attrs))
    if _ffi.has_target("cpu", target):
        assert _call(target, CPU, result, operands, attrs).shape == result.shape


CUDA_ONLY_BMM_ERRORS = [
    ("16-row tiles", dict(b=_u32(1, 1, 16, 4)),
     r"operand `b` has FSB tiles of 16 rows x 128 bits; the CUDA kernels take tiles of 8 rows x 128 bits"),
    ("256-bit tiles", dict(b=_u32(2, 1, 8, 8)), r"operand `b` has FSB tiles of 8 rows x 256 bits"),
    ("k = 0", dict(k=I64(0), a=_u32(4, 0), b=_u32(2, 0, 8, 4)), r"the CUDA kernels need a reduction of at least one bit"),
]


@pytest.mark.parametrize("what,change,message", CUDA_ONLY_BMM_ERRORS, ids=[e[0] for e in CUDA_ONLY_BMM_ERRORS])
def test_bmm_handler_refuses_what_the_cuda_kernels_cannot_run(what, change, message):
    call = {**BMM_CALL, **change}
    _refused_on_gpu_only("jaxbnn_bmm_i32", jax.ShapeDtypeStruct((4, 10), jnp.int32), [call["a"], call["b"], call["popc"]],
                         dict(k=call["k"], n=call["n"]), message)  # fmt: skip


def test_bconv2d_handler_refuses_what_the_cuda_kernels_cannot_run():
    # 64-bit tiles: the 3 x 3 x 2 words = 576 reduction bits take 9 of them
    operands, attrs = _conv_operands_attrs((), dict(w=_u32(2, 9, 8, 2)))
    _refused_on_gpu_only("jaxbnn_bconv2d_i32", jax.ShapeDtypeStruct((1, 5, 5, 9), jnp.int32), operands, attrs,
                         r"operand `w` has FSB tiles of 8 rows x 64 bits")  # fmt: skip
    # a 9 x 9 pool window over a 9 x 9 conv output (1 x 1 kernel, no padding): 81 rows per pooled pixel
    attrs = _conv_attrs(40, 9, (1, 1), (1, 1), ((0, 0), (0, 0)), "zero", (9, 9))
    operands = [_u32(1, 9, 9, 2), _u32(2, 1, 8, 4), np.zeros((1, 9), np.int32)]
    _refused_on_gpu_only("jaxbnn_bconv2d_i32", jax.ShapeDtypeStruct((1, 1, 1, 9), jnp.int32), operands, attrs,
                         r"the pool window 9 x 9 is larger than the CUDA kernels take \(64 elements\)")  # fmt: skip
