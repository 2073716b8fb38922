"""The ops, the exporter and the runtime under settings a JAX user may choose: inside `jax.shard_map` (data
parallel inference), under explicit sharding, with `jax_enable_x64` on, with `jax_numpy_rank_promotion` set to
"raise", and with host arrays in the other byte order. Each gives the same integers as the default setting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from flax import nnx

from jaxbnn import formats, ops, runtime
from jaxbnn.export import export_model
from zoo_cases import images_for, zoo_model


def signs(rng, shape):
    return rng.choice(np.array([-1.0, 1.0], np.float32), shape)


def big_endian(x):
    x = np.asarray(x)
    return x.astype(x.dtype.newbyteorder(">"))


@pytest.fixture(scope="module")
def models():
    """A dense chain, a ternary conv net and a residual net, small, with their packed forms."""
    built = {name: zoo_model(name, mode, {}) for name, mode in
             (("mnist-mlp", "bnn"), ("mnist-conv", "tnn"), ("cifar10-resnet14", "bnn"))}
    packed = {name: export_model(model) for name, model in built.items()}
    return {name: (model, packed[name], runtime.from_packed(packed[name])) for name, model in built.items()}


# --- jax.shard_map -----------------------------------------------------------------------------------


def op_cases():
    """(name, function of the activations / images, their value): each op on a batch of 4 rows."""
    rng = np.random.default_rng(0)
    k, n, c = 70, 9, 40
    a = ops.pack_bits(rng.standard_normal((4, k)).astype(np.float32))
    w = formats.pack_dense_weights(signs(rng, (k, n)))
    ternary = formats.pack_ternary_dense_weights(rng.integers(-1, 2, (k, n)).astype(np.float32))
    x = ops.pack_bits(rng.standard_normal((4, 5, 6, c)).astype(np.float32))
    kernel = formats.pack_conv_weights(signs(rng, (3, 3, c, c)))
    shortcut = rng.integers(-50, 50, (4, 5, 6, c)).astype(np.int16)
    levels = rng.integers(-128, 128, (4, 9, 9, 3)).astype(np.int8)
    image_kernel = rng.integers(-1, 2, (3, 3, 3, n)).astype(np.int8)
    stream = rng.integers(-1000, 1000, (4, 3, 3, n)).astype(np.int32)
    last = formats.pack_dense_weights(signs(rng, (n, 3)))
    return [
        ("bmm", lambda a_: ops.bmm(a_, w), a),
        ("bmm threshold", lambda a_: ops.bmm(a_, w, threshold=np.arange(n, dtype=np.int32) - 4), a),
        ("bmm affine", lambda a_: ops.bmm(a_, w, scale=np.ones(n, np.float32), bias=np.zeros(n, np.float32)), a),
        ("bmm ternary weights", lambda a_: ops.bmm(a_, ternary), a),
        ("bmm_chain", lambda a_: ops.bmm_chain(a_, [dict(b=w, threshold=np.zeros(n, np.int32)),
                                                    dict(b=last, scale=np.ones(3, np.float32))]), a),
        ("bconv2d pooled", lambda x_: ops.bconv2d(x_, kernel, pool=(2, 2), threshold=np.zeros(c, np.int32)), x),
        ("bconv2d residual", lambda x_: ops.bconv2d(x_, kernel, shortcut=shortcut[:x_.shape[0]],
                                                    threshold=np.zeros(c, np.int32)), x),
        ("image_conv2d", lambda v: ops.image_conv2d(v, image_kernel, threshold=np.zeros(n, np.int32)), levels),
        ("global_sum_bits", lambda s: ops.global_sum_bits(s, np.zeros(n, np.int32)), stream),
    ]


def shard_mapped(fn):
    """`fn` inside `jax.shard_map` over a batch axis, the mesh on the first device: its axis is manual, so the
    values the operands derive from the batch vary along it and the weights closed over do not."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=PartitionSpec("batch"), out_specs=PartitionSpec("batch")))


@pytest.mark.parametrize("name, fn, value", op_cases(), ids=[case[0] for case in op_cases()])
def test_every_op_runs_inside_shard_map(name, fn, value):
    want = jax.tree.map(np.asarray, fn(value))
    got = jax.tree.map(np.asarray, shard_mapped(fn)(value))
    jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("name", ["mnist-mlp", "mnist-conv", "cifar10-resnet14"])
def test_a_packed_net_runs_inside_shard_map(models, name):
    _, _, net = models[name]
    images = images_for(net, 4, seed=1)
    np.testing.assert_array_equal(np.asarray(shard_mapped(net)(images)), np.asarray(net(images)))


def explicitly_sharded(fn, value):
    """`fn` jitted under a mesh of explicit sharding on the first device, on `value` sharded over its batch
    axis: jnp's results carry the batch's sharding in their types, an FFI call's come out replicated."""
    mesh = jax.make_mesh((1,), ("batch",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        return jax.jit(fn)(jax.device_put(value, NamedSharding(mesh, PartitionSpec("batch"))))


@pytest.mark.parametrize("name, fn, value", op_cases(), ids=[case[0] for case in op_cases()])
def test_every_op_runs_under_explicit_sharding(name, fn, value):
    want = jax.tree.map(np.asarray, fn(value))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, explicitly_sharded(fn, value)), want)


@pytest.mark.parametrize("name", ["mnist-mlp", "mnist-conv", "cifar10-resnet14"])
def test_a_packed_net_runs_under_explicit_sharding(models, name):
    _, _, net = models[name]
    images = images_for(net, 4, seed=1)
    np.testing.assert_array_equal(np.asarray(explicitly_sharded(net, images)), np.asarray(net(images)))


# --- jax_enable_x64 ----------------------------------------------------------------------------------


@pytest.fixture
def x64():
    """jax_enable_x64 on for the test (jnp's sums and Python scalars then default to 64 bits)."""
    before = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


def test_popcounts_stay_int32_under_x64(x64):
    rng = np.random.default_rng(1)
    w = formats.pack_dense_weights(signs(rng, (70, 9)))
    assert formats.popcount(w.bits).dtype == jnp.int32
    assert w.popcount.dtype == jnp.int32
    assert formats.pack_conv_weights(signs(rng, (3, 3, 5, 4))).tap_popcount.dtype == jnp.int32


def test_ops_give_the_same_integers_under_x64(x64):
    """Weights given as bare tiles or rows: the popcount the op derives reaches the kernel as int32."""
    rng = np.random.default_rng(2)
    k, n = 70, 9
    a, w = signs(rng, (5, k)), signs(rng, (k, n))
    packed = formats.pack_dense_weights(w)
    x = ops.pack_bits(a)
    want = (a @ w).astype(np.int32)
    for got in (ops.bmm(x, packed), ops.bmm(x, packed.bits, k, n=n),
                ops.bmm(x, formats.from_fsb(packed.bits, n, k), k),
                ops.bmm_chain(x, [dict(b=packed.bits, k=k, n=n, scale=np.ones(n, np.float32))])):
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("name", ["mnist-mlp", "mnist-conv", "cifar10-resnet14"])
def test_export_and_the_runtime_under_x64_give_the_default_settings_logits(models, name, x64):
    model, default_packed, net = models[name]
    images = images_for(model, 4, seed=2)
    packed = export_model(model)
    assert {t: v.dtype for t, v in packed.tensors.items()} == {t: v.dtype for t, v in default_packed.tensors.items()}
    for t, v in packed.tensors.items():
        np.testing.assert_array_equal(v, default_packed.tensors[t], err_msg=t)
    np.testing.assert_array_equal(np.asarray(runtime.from_packed(packed)(images)), np.asarray(net(images)))
    assert net.predict(images).dtype == np.int32
    logits = model(jnp.asarray(images))
    assert logits.dtype == jnp.float32


# --- jax_numpy_rank_promotion="raise" -------------------------------------------------------------------


@pytest.fixture
def strict_ranks():
    """jnp refusing implicit rank promotion, as strict codebases set it: the library spells out its own."""
    with jax.numpy_rank_promotion("raise"):
        yield


@pytest.mark.parametrize("name, fn, value", op_cases(), ids=[case[0] for case in op_cases()])
def test_every_op_runs_with_rank_promotion_raising(name, fn, value):
    want = jax.tree.map(np.asarray, fn(value))
    with jax.numpy_rank_promotion("raise"):
        got = jax.tree.map(np.asarray, jax.jit(fn)(value))
    jax.tree.map(np.testing.assert_array_equal, got, want)


def weight_form_cases():
    """(name, thunk): products whose weights are raw packed words (their popcounts derived or checked) and TNN
    products that run as three blocks (k or C from 385 to 512), whose masks broadcast per row or tap word."""
    rng = np.random.default_rng(1)
    k, n, c = 70, 9, 40
    a = ops.pack_bits(rng.standard_normal((4, k)).astype(np.float32))
    w = formats.pack_dense_weights(signs(rng, (k, n)))
    x = ops.pack_bits(rng.standard_normal((1, 5, 6, c)).astype(np.float32))
    kernel = formats.pack_conv_weights(signs(rng, (3, 3, c, 12)))
    ternary = lambda shape: rng.integers(-1, 2, shape).astype(np.float32)  # noqa: E731
    planes = formats.pack_ternary_pm_planes(ternary((4, 400)))
    tnn_w = formats.pack_ternary_dense_weights(ternary((400, 8)))
    tnn_x = formats.pack_ternary_pm_planes(ternary((1, 4, 4, 400)))
    tnn_kernel = formats.pack_ternary_conv_weights(ternary((3, 3, 400, 8)))
    return [
        ("bmm of FSB tiles", lambda: ops.bmm(a, w.bits, k, n=n)),
        ("bmm of row-packed words", lambda: ops.bmm(a, formats.from_fsb(w.bits, n, k), k)),
        ("bmm with a checked popcount", lambda: ops.bmm(a, w.bits, k, n=n, b_popcount=w.popcount)),
        ("bmm_chain of FSB tiles", lambda: ops.bmm_chain(a, [dict(b=w.bits, k=k, n=n,
                                                                   threshold=np.zeros(n, np.int32))])),
        ("bconv2d of FSB tiles", lambda: ops.bconv2d(x, kernel.bits, in_channels=c, kernel_size=3, out_channels=12)),
        ("tnn bmm in three blocks", lambda: ops.bmm(planes, tnn_w)),
        ("tnn bmm in three blocks, two planes out", lambda: ops.bmm(planes, tnn_w, threshold=np.array([[-3] * 8,
                                                                                                      [3] * 8]))),
        ("tnn bconv2d in three blocks", lambda: ops.bconv2d(tnn_x, tnn_kernel)),
        ("tnn side-by-side weights in three blocks",
         lambda: ops.side_by_side_weights(tnn_w, ternary_activations=True)),
    ]


@pytest.mark.parametrize("name, thunk", weight_form_cases(), ids=[case[0] for case in weight_form_cases()])
def test_raw_weights_and_three_block_products_run_with_rank_promotion_raising(name, thunk):
    want = jax.tree.map(np.asarray, thunk())
    with jax.numpy_rank_promotion("raise"):
        got = jax.tree.map(np.asarray, thunk())
    jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("name", ["mnist-mlp", "mnist-conv", "cifar10-resnet14"])
def test_models_train_export_and_run_with_rank_promotion_raising(models, name, strict_ranks):
    model, default_packed, net = models[name]
    images = images_for(model, 4, seed=3)
    packed = export_model(model)
    np.testing.assert_array_equal(np.asarray(runtime.from_packed(packed)(images)), np.asarray(net(images)))
    np.testing.assert_array_equal(np.asarray(model(jnp.asarray(images))), np.asarray(net(images)))
    np.testing.assert_array_equal(net.predict(np.asarray(images, np.float32) / 127.5 - 1, batch_size=3),
                                  net.predict(images, batch_size=3))
    model.train()
    try:
        nnx.grad(lambda m: m(jnp.asarray(images)).sum())(model)  # the training forward and its gradients
    finally:
        model.eval()


# --- byte order ----------------------------------------------------------------------------------------


def test_big_endian_host_arrays_give_what_native_ones_give():
    rng = np.random.default_rng(3)
    k, n = 70, 9
    a = ops.pack_bits(signs(rng, (5, k)))
    w = formats.pack_dense_weights(signs(rng, (k, n)))
    threshold, flip = rng.integers(-k, k, n).astype(np.int32), rng.integers(0, 2, n).astype(np.int32)
    scale, bias = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    popcount = np.asarray(w.popcount)
    cases = [
        (lambda *v: ops.bmm(v[0], w, threshold=v[1], flip=v[2]), (a, threshold, flip)),
        (lambda *v: ops.bmm(v[0], w, scale=v[1], bias=v[2]), (a, scale, bias)),
        (lambda *v: ops.bmm(v[0], w.bits, k, n=n, b_popcount=v[1]), (a, popcount)),
        (lambda *v: ops.global_sum_bits(v[0], v[1], v[2]),
         (rng.integers(-99, 99, (2, 3, 3, n)).astype(np.int32), threshold, flip)),
        (lambda *v: formats.unpack_bits(v[0], k), (a,)),
        (lambda *v: ops.pack_bits(v[0], v[1]), (rng.standard_normal((2, n)).astype(np.float64), threshold)),
        (lambda *v: formats.popcount(v[0]), (a,)),
    ]
    for fn, values in cases:
        want = np.asarray(fn(*(np.asarray(v) for v in values)))
        np.testing.assert_array_equal(np.asarray(fn(*(big_endian(v) for v in values))), want)


def test_the_weight_packers_take_big_endian_weights():
    rng = np.random.default_rng(5)
    dense, conv = signs(rng, (70, 9)), signs(rng, (3, 3, 5, 4))
    ternary = rng.integers(-1, 2, (70, 9)).astype(np.float32)
    for pack, w in ((formats.pack_dense_weights, dense), (formats.pack_conv_weights, conv),
                    (formats.pack_ternary_dense_weights, ternary)):
        jax.tree.map(np.testing.assert_array_equal, pack(big_endian(w)), pack(w))


def test_the_packing_helpers_take_lists_of_traced_arrays_and_array_likes():
    """Only numpy arrays in the other byte order are converted on the host: a list of traced values or an
    `nnx.Param` goes to jnp as before."""
    words = jnp.arange(6, dtype=jnp.uint32).reshape(2, 3)
    bits = jnp.asarray(np.random.default_rng(6).random((2, 40)) > 0.5)
    np.testing.assert_array_equal(jax.jit(lambda a, b: formats.popcount([a, b]))(words[0], words[1]),
                                  formats.popcount(words))
    np.testing.assert_array_equal(jax.jit(lambda a, b: formats.pack_bits([a, b]))(bits[0], bits[1]),
                                  formats.pack_bits(bits))
    np.testing.assert_array_equal(jax.jit(lambda a, b: formats.unpack_bits([a, b], 96))(words[0], words[1]),
                                  formats.unpack_bits(words, 96))
    np.testing.assert_array_equal(jax.jit(lambda a: formats.popcount(nnx.Param(a)))(words), formats.popcount(words))


def test_a_packed_net_takes_big_endian_float_images(models):
    _, _, net = models["mnist-conv"]
    images = np.random.default_rng(4).uniform(-1, 1, (3, *net.input_shape)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(net(big_endian(images))), np.asarray(net(images)))
