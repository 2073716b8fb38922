"""Public binary ops: argument checks, platform dispatch to the native kernels, vmap rules.

Every op validates shapes, dtypes and attributes here, before lowering, and raises `ValueError` /
`TypeError` with the offending name. On a platform with a registered native handler (`jaxbnn._ffi`) the
op lowers to that XLA FFI custom call; elsewhere it lowers to `jaxbnn.reference`, the spec the kernels are
tested against. Layouts: docs/formats.md; native contract: docs/ops.md.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxbnn import _ffi, formats, reference
from jaxbnn.formats import ConvBits, DenseBits, TernaryConvBits, TernaryDenseBits

__all__ = ["pack_bits", "unpack_bits", "bmm", "bmm_chain", "chain_fits_one_kernel", "bconv2d", "image_matmul",
           "image_conv2d", "global_sum_bits", "pool_threshold_bits", "side_by_side_weights"]


MAX_EXTENT = formats.MAX_EXTENT
# Reduction bits per dot product: the dot products and the saturated thresholds [-K - 1, K + 1] fit int32.
MAX_REDUCTION = 2**31 - 2
# Input words and output elements of one call of the CUDA kernels (int32 indexing): the ops split larger batches.
_KERNEL_INDEX_LIMIT = 2**31 - 1
# The longest reduction of an int16 result (`out_dtype`): every dot product then lies in [-32767, 32767].
MAX_INT16_REDUCTION = 2**15 - 1
# Elements of an output or intermediate: far beyond any memory, so a refusal here only ever replaces an
# allocation failure, and no product of sizes can overflow int64 inside XLA.
MAX_ELEMENTS = 2**48


def pack_bits(x, threshold=None, flip=None):
    """Binarize `x` (bit = x >= threshold, or x <= threshold where flip; default threshold 0, so
    sign(0) = +1) and pack its last axis into uint32 words. Comparisons are exact in the operands' own
    dtypes (`formats.binarize`): NaN gives bit 0, -0.0 bit 1."""
    x = formats.host_or_device(x)
    if x.ndim == 0:
        raise ValueError("pack_bits needs at least one axis to pack")
    channels = x.shape[-1]
    if threshold is not None:
        threshold = _host_or_device_vector("threshold", threshold, channels)
    if flip is not None:
        flip = _flip_values(_host_or_device_vector("flip", flip, channels))
    return _pack(formats.binarize(x, threshold, flip))


_pack = jax.jit(formats.pack_bits)  # one compiled packer per shape: eager calls compile once


def unpack_bits(words, k, dtype=jnp.float32):
    """±1 values `(..., k)` of packed words `(..., ceil(k/32))`, in `dtype`: a signed integer or float type (an
    unsigned one or bool cannot hold -1)."""
    k = _positive_int("k", k)
    words = _packed("words", words, min_rank=1)
    _check_words("words", words, k)
    dtype = jnp.dtype(dtype)
    if not (jnp.issubdtype(dtype, jnp.signedinteger) or jnp.issubdtype(dtype, jnp.floating)):
        raise TypeError(f"unpack_bits gives ±1 values: dtype must be a signed integer or float type, got {dtype}")
    return _unpack(words, k=k, dtype=dtype)


@functools.partial(jax.jit, static_argnames=("k", "dtype"))
def _unpack(words, *, k, dtype):
    return jnp.where(formats.unpack_bits(words, k), 1, -1).astype(dtype)


def bmm(a, b, k=None, *, n=None, b_popcount=None, scale=None, bias=None, threshold=None, flip=None,
        side_by_side=None, out_dtype="int32"):
    """Matrix product `a @ b.T` of packed binary or ternary operands, with a fused epilogue.

    a: packed activations uint32 `(..., M, ceil(k/32))`, or ternary activations: a `formats.TernaryPlanes`
       of two such arrays (the nonneg and pos planes).
    b: binary weights, FSB tiles uint32 `(NT, KT, BH, BW/32)` (`n` rows; default NT*BH), a row-packed
       matrix uint32 `(N, ceil(k/32))` (N may be 0: an empty result), or a `formats.DenseBits` (then `k`,
       `n`, `b_popcount` come from it); or ternary weights, a `formats.TernaryDenseBits` (likewise).
    The four products, binary or ternary activations times binary or ternary weights (TAB's BNN, TBN, BTN,
    TNN), are exact integer dot products in [-k, k].
    b_popcount: the +1 count of each row of `b` (binary weights: `(n,)`; ternary weights: `(2n,)`, the rows
       of both planes), which binary activations use, and ternary ones where the platform has no kernel of
       the product (the composite of binary products, docs/ops.md); derived from `b` when not given. A
       concrete one (outside `jax.jit`) is checked against `b`; a traced one is trusted (a wrong one gives
       wrong dot products).
    Epilogue: none -> the dot products `(..., M, N)`, int32, or int16 with `out_dtype=jnp.int16` (k at most
    `MAX_INT16_REDUCTION`, so every dot product fits: half the bytes to write); `scale`/`bias` -> float32
    `scale * dot + bias`;
    `threshold`/`flip` -> packed bits uint32 `(..., M, ceil(N/32))` of `dot >= threshold`
    (`dot <= threshold` where flip); integer thresholds of any width, saturated exactly to [-k - 1, k + 1].
    With a ternary operand, `threshold`/`flip` may also be `(P, N)` (1 to `MAX_THRESHOLD_PLANES` planes):
    uint32 `(..., M, P, ceil(N/32))`, plane p of `dot >= threshold[p]`; thresholds (lo, hi) give the planes
    (nonneg, pos) of a ternary output (+1 from hi, 0 from lo, -1 below), the next layer's `TernaryPlanes`.
    side_by_side: with a ternary operand, `side_by_side_weights(b, ...)` built once (e.g. at load), which a
       platform without kernels of the product runs instead of rebuilding it on every call (docs/ops.md);
       trusted to be that of `b` (its geometry is checked).
    """
    given_popcount = b_popcount is not None  # the dataclasses' own popcounts are consistent by construction
    ternary_weights = isinstance(b, TernaryDenseBits)
    if isinstance(b, (DenseBits, TernaryDenseBits)):
        k = _recorded_size("k", k, b.k, b)
        n = _recorded_size("n", n, b.n, b)
        b_popcount = b.popcount if b_popcount is None else b_popcount
        b = b.bits
    if k is None:
        raise ValueError("bmm needs k, the number of real bits per row")
    k = _positive_int("k", k, MAX_REDUCTION)
    planes = _activations("a", a, min_rank=2)
    for name, plane in planes.items():
        _check_words(name, plane, k)
    if ternary_weights:
        n = _positive_int("n", n, MAX_EXTENT // 2)
        b, _ = _weights("b", b, k, 2 * n)
        _check_ternary_weights("b", b, n, k, None)
    else:
        b, n = _weights("b", b, k, n)
    rows = 2 * n if ternary_weights else n
    if b_popcount is not None:
        b_popcount = _int32_array("b_popcount", b_popcount, (rows,))
        if given_popcount:
            _check_popcount("b_popcount", b_popcount, b, rows, k, None)
    mode = _mode(len(planes) == 2, ternary_weights)
    kind, epi, threshold_planes = _epilogue(n, k + 1, scale, bias, threshold, flip, mode, out_dtype, k)
    leading = next(iter(planes.values())).shape[:-1]
    _check_elements("the result", leading + _epilogue_tail(kind, n, threshold_planes))
    _check_side_by_side(side_by_side, DenseBits, mode, threshold_planes,
                        dict(k=_dense_side_by_side_channels(mode, k), n=_side_by_side_columns(n, threshold_planes)))
    return _bmm(tuple(planes.values()), b, b_popcount, epi, side_by_side, k=k, n=n, kind=kind, mode=mode,
                threshold_planes=threshold_planes)


@functools.partial(jax.jit, static_argnames=("k", "n", "kind", "mode", "threshold_planes"))
def _bmm(planes, b, b_popcount, epi, side_by_side=None, *, k, n, kind, mode, threshold_planes):
    """The checked op as one compiled function per static signature: an eager call compiles once, then
    costs what a cached jitted call costs."""
    if kind == "i16" and mode != "bnn":  # the int32 products, narrowed (XLA fuses the conversion into the reader)
        return _bmm(planes, b, b_popcount, epi, side_by_side, k=k, n=n, kind="i32", mode=mode,
                    threshold_planes=threshold_planes).astype(jnp.int16)
    tail, out_dtype = _epilogue_tail(kind, n, threshold_planes), _epilogue_output(kind, n)[1]
    leading = planes[0].shape[:-1]
    rows = [a.reshape(math.prod(leading), a.shape[-1]) for a in planes]  # batch dims fold into M: one kernel call
    if rows[0].shape[0] == 0 or n == 0:
        return jnp.zeros(leading + tail, out_dtype)
    # the CUDA kernels index the activation words and the output elements of a call in int32 (of a product with a
    # ternary operand: its side-by-side operand's words)
    words = rows[0].shape[-1] if mode == "bnn" else formats.num_words(_dense_side_by_side_channels(mode, k))
    chunk = _KERNEL_INDEX_LIMIT // max(words, n * max(threshold_planes, 1))
    if 1 <= chunk < rows[0].shape[0]:
        outs = [_bmm(tuple(a[i:i + chunk] for a in rows), b, b_popcount, epi, side_by_side, k=k, n=n, kind=kind,
                     mode=mode, threshold_planes=threshold_planes)
                for i in range(0, rows[0].shape[0], chunk)]
        return jnp.concatenate(outs).reshape(leading + outs[0].shape[1:])
    ternary_weights = mode in ("btn", "tnn")
    weight_rows = 2 * n if ternary_weights else n
    if b.ndim == 2:
        b = formats.to_fsb(b)
    # Every mode keeps the weight rows' popcounts: the products of ternary activations need none natively,
    # but their composite of binary products does (XLA drops them where unused).
    popcount = _derived_popcount(b, weight_rows, k) if b_popcount is None else b_popcount.astype(jnp.int32)
    weights = (b, popcount) + (() if side_by_side is None else (side_by_side.bits, side_by_side.popcount))
    epi = _epilogue_operands(kind, epi, n, k + 1)
    attrs = dict(k=np.int64(k), n=np.int64(n))
    a_count = len(planes)

    def binary_dot(x, b_, popcount_):
        return _bmm((x,), b_, popcount_, {}, k=k, n=weight_rows, kind="i32", mode="bnn", threshold_planes=0)

    def spec(a_, b_, _popcount, *e):
        return reference.bmm(a_, b_, k, n, **dict(zip(epi, e)))

    def bmm_composite(acts, b_, popcount_, prepared, epilogue):
        kw = formats.num_words(k)
        if _takes_doubled_blocks(mode, k):
            if not _doubled_fits(k, n, threshold_planes):
                return _composite(binary_dot, acts, b_, popcount_, n, None, epilogue)
            return _tnn_doubled_bmm(acts, b_, prepared, epilogue, k=k, n=n, kind=kind,
                                    threshold_planes=threshold_planes)
        if not _side_by_side_fits(mode, kw, n, threshold_planes):
            return _composite(binary_dot, acts, b_, popcount_, n, None, epilogue)
        if prepared:
            blocks, block_popcount = prepared
        else:
            blocks, block_popcount = _side_by_side_matrix(mode, formats.from_fsb(b_, weight_rows, k), popcount_[None],
                                                          o=n, c=k, threshold_planes=threshold_planes)
            block_popcount = block_popcount[0]
        reduction_bits = _side_by_side_channels(mode, k)
        x, epilogue, _ = _side_by_side_operands(mode, acts, epilogue, kind=kind, c=k, bound=k + 1,
                                                threshold_planes=threshold_planes, reduction_bits=reduction_bits)
        out = _bmm((x,), blocks, block_popcount, epilogue, k=reduction_bits,
                   n=_side_by_side_columns(n, threshold_planes), kind=kind, mode="bnn",
                   threshold_planes=_native_planes(threshold_planes, n))
        return _side_by_side_result(out, mode, kind, threshold_planes, n)

    def single(*operands):
        out_type = jax.ShapeDtypeStruct((operands[0].shape[0],) + tail, out_dtype)
        if mode != "bnn":
            acts, (b_, popcount_, *prepared_), e = (operands[:a_count], operands[a_count:a_count + len(weights)],
                                                    operands[a_count + len(weights):])
            composite = lambda *_: bmm_composite(acts, b_, popcount_, prepared_, dict(zip(epi, e)))  # noqa: E731
            native = (*acts, b_, popcount_, *e) if mode == "btn" else (_planes_side_by_side(acts), b_, *e)
            return _dispatch(f"jaxbnn_{mode}_bmm_{kind}", out_type, attrs, composite, *native)
        cuda_operands = dict(cuda_weights=lambda b_: _default_tiles(b_, n, k),
                             cuda_activations=lambda a_: _clear_padding_bits(a_, k))
        return _dispatch(f"jaxbnn_bmm_{kind}", out_type, attrs,
                         _elsewhere(kind, "jaxbnn_bmm_i32", out_type, attrs, spec, cuda_operands), *operands,
                         **cuda_operands)

    out = _fold_rows(single, activations=len(planes))(*rows, *weights, *epi.values())
    return out.reshape(leading + out.shape[1:])


# The chains that CUDA runs as one kernel (`bmm_chain`): at most this many layers, each k and n at most this many
# bits (the CTA's activations stay in shared memory at that width), their weights and column parameters within
# this many bytes of shared memory a CTA (`_chain_smem_bytes`; every GPU of the mma.sync engine gives a CTA as much).
MAX_CHAIN_LAYERS = 8
MAX_CHAIN_BITS = 4096
MAX_CHAIN_SHARED_BYTES = 99 * 1024
_CHAIN_LAYER_KEYS = frozenset({"b", "k", "n", "b_popcount", "threshold", "flip", "scale", "bias"})


def bmm_chain(a, layers):
    """`bmm` layer after layer in one op: `a` through each of `layers`, bit for bit what
    `bmm(... bmm(a, **layers[0]) ..., **layers[-1])` gives.

    a: packed binary activations uint32 `(..., M, ceil(k/32))`.
    layers: a sequence of dicts of `bmm`'s arguments: `b` (binary weights: FSB tiles, a row-packed matrix or a
       `formats.DenseBits`), with `k`, `n`, `b_popcount` as `bmm` takes them, and the epilogue: `threshold` /
       `flip` (a threshold of shape (N,): packed bits, the next layer's activations) for every layer but the
       last, which may give `scale` / `bias` instead (float32 logits). Layer i + 1's k is layer i's n.
    Returns the last layer's output: uint32 `(..., M, ceil(N/32))` or float32 `(..., M, N)`.

    On CUDA a chain of at most `MAX_CHAIN_LAYERS` layers whose every k and n is at most `MAX_CHAIN_BITS` and
    whose weights fit a CTA's shared memory (`MAX_CHAIN_SHARED_BYTES`, `chain_fits_one_kernel`) runs as one
    kernel: each CTA copies the weights once and takes blocks of 16 rows through every layer, the activations
    between layers in shared memory (small dense layers are bound by their launches, not their arithmetic;
    docs/ops.md). Elsewhere the layers run as `bmm` calls (the CPU's kernels)."""
    if isinstance(layers, dict) or not isinstance(layers, (list, tuple)) or not layers:
        raise ValueError("bmm_chain takes a non-empty list of layers, each a dict of bmm's arguments")
    planes = _activations("a", a, min_rank=2)
    if len(planes) != 1:
        raise TypeError("bmm_chain takes packed binary activations, not ternary planes")
    x = next(iter(planes.values()))
    weights, popcounts, epilogues, ks, ns, kinds = [], [], [], [], [], []
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict):
            raise TypeError(f"bmm_chain layer {i} must be a dict of bmm's arguments, got {type(layer).__name__}")
        unknown = sorted(set(layer) - _CHAIN_LAYER_KEYS)
        if unknown:
            raise ValueError(f"bmm_chain layer {i} has arguments {unknown}; a layer takes {sorted(_CHAIN_LAYER_KEYS)}")
        if "b" not in layer:
            raise ValueError(f"bmm_chain layer {i} has no weights `b`")
        b, k, n, b_popcount = layer["b"], layer.get("k"), layer.get("n"), layer.get("b_popcount")
        given_popcount = b_popcount is not None
        if isinstance(b, TernaryDenseBits):
            raise TypeError(f"bmm_chain layer {i} has ternary weights; the chain takes binary layers")
        if isinstance(b, DenseBits):
            k = _recorded_size("k", k, b.k, b, f"bmm_chain layer {i}: ")
            n = _recorded_size("n", n, b.n, b, f"bmm_chain layer {i}: ")
            b_popcount = b.popcount if b_popcount is None else b_popcount
            b = b.bits
        if k is None:
            raise ValueError(f"bmm_chain layer {i} needs k, the number of real bits per row")
        k = _positive_int("k", k, MAX_REDUCTION)
        if i == 0:
            _check_words("a", x, k)
        elif k != ns[-1]:
            raise ValueError(f"bmm_chain layer {i} reduces over k={k} bits, but layer {i - 1} writes n={ns[-1]}")
        b, n = _weights("b", b, k, n)
        if b_popcount is not None:
            b_popcount = _int32_array("b_popcount", b_popcount, (n,))
            if given_popcount:
                _check_popcount("b_popcount", b_popcount, b, n, k, None)
        kind, epi, threshold_planes = _epilogue(n, k + 1, layer.get("scale"), layer.get("bias"),
                                                layer.get("threshold"), layer.get("flip"), "bnn", jnp.int32, k)
        last = i == len(layers) - 1
        if threshold_planes or kind not in (("bits", "f32") if last else ("bits",)):
            raise ValueError(f"bmm_chain layer {i} must give a threshold of shape ({n},)"
                             + (" or scale / bias" if last else " (its bits are the next layer's activations)"))
        weights.append(b)
        popcounts.append(b_popcount)
        epilogues.append(epi)
        ks.append(k)
        ns.append(n)
        kinds.append(kind)
    leading = x.shape[:-1]
    _check_elements("the result", leading + _epilogue_tail(kinds[-1], ns[-1], 0))
    return _bmm_chain(x, tuple(weights), tuple(popcounts), tuple(epilogues), ks=tuple(ks), ns=tuple(ns),
                      last_kind=kinds[-1])


def chain_fits_one_kernel(ks, ns) -> bool:
    """Whether a `bmm_chain` of layers of these k and n runs as one kernel where the platform has it (CUDA; else
    as `bmm` calls)."""
    return (len(ks) <= MAX_CHAIN_LAYERS and max(ks) <= MAX_CHAIN_BITS and max(ns) <= MAX_CHAIN_BITS
            and _chain_smem_bytes(ks, ns) <= MAX_CHAIN_SHARED_BYTES)


def _chain_smem_bytes(ks, ns) -> int:
    """The shared memory of a chain kernel's CTA (xla_ffi/cuda/dense_chain.h, DenseChainSmemBytes): two blocks of
    16 rows of activations and their popcounts, then per layer its FSB weights (8-row tiles of 128 bits) and its
    columns' three int32 parameters (n rounded up to 32)."""
    rows = 2 * 16 * (MAX_CHAIN_BITS // 32 + 4) * 4 + 16 * 4
    return rows + sum(-(-n // 8) * -(-k // 128) * 128 + 12 * -(-n // 32) * 32 for k, n in zip(ks, ns))


@functools.partial(jax.jit, static_argnames=("ks", "ns", "last_kind"))
def _bmm_chain(x, weights, popcounts, epilogues, *, ks, ns, last_kind):
    """The checked chain as one compiled function per static signature."""
    leading = x.shape[:-1]
    tail, out_dtype = _epilogue_tail(last_kind, ns[-1], 0), _epilogue_output(last_kind, ns[-1])[1]
    rows = x.reshape(math.prod(leading), x.shape[-1])
    if rows.shape[0] == 0:
        return jnp.zeros(leading + tail, out_dtype)
    kinds = ["bits"] * (len(ks) - 1) + [last_kind]
    operands = []
    for b, popcount, epi, k, n, kind in zip(weights, popcounts, epilogues, ks, ns, kinds):
        b = formats.to_fsb(b) if b.ndim == 2 else b
        popcount = _derived_popcount(b, n, k) if popcount is None else popcount.astype(jnp.int32)
        operands += [b, popcount, *_epilogue_operands(kind, epi, n, k + 1).values()]

    def layer_by_layer(x_, *operands_):
        for i, (k, n, kind) in enumerate(zip(ks, ns, kinds)):
            b, popcount, *e = operands_[4 * i:4 * i + 4]
            names = ("threshold", "flip") if kind == "bits" else ("scale", "bias")
            x_ = _bmm((x_,), b, popcount, dict(zip(names, e)), k=k, n=n, kind=kind, mode="bnn", threshold_planes=0)
        return x_

    def single(x_, *operands_):
        target = f"jaxbnn_bmm_chain_{last_kind}"
        out_type = jax.ShapeDtypeStruct((x_.shape[0],) + tail, out_dtype)
        attrs = dict(ks=np.array(ks, np.int64), ns=np.array(ns, np.int64))

        def one_call(x__, *ops_):
            return _ffi_call(target, out_type, x__, *ops_, **attrs)

        def one_kernel(x__, *ops_):  # CUDA: the kernel takes the default tiles
            ops_ = list(ops_)
            for i, (k, n) in enumerate(zip(ks, ns)):
                ops_[4 * i] = _default_tiles(ops_[4 * i], n, k)
            return one_call(x__, *ops_)

        branches = {}
        if chain_fits_one_kernel(ks, ns) and _ffi.has_target("cuda", target):
            branches["cuda"] = one_kernel
        if _ffi.has_target("cpu", target):
            branches["cpu"] = one_call
        if not branches:
            return layer_by_layer(x_, *operands_)
        return _platform_dependent(x_, *operands_, default=layer_by_layer, **branches)

    # the kernel indexes the activation words and the result's elements of a call in int32
    chunk = _KERNEL_INDEX_LIMIT // max(rows.shape[-1], ns[-1])
    if chunk < rows.shape[0]:
        outs = [_fold_rows(single)(rows[i:i + chunk], *operands) for i in range(0, rows.shape[0], chunk)]
        return jnp.concatenate(outs).reshape(leading + tail)
    return _fold_rows(single)(rows, *operands).reshape(leading + tail)


def bconv2d(
    x,
    w,
    *,
    in_channels=None,
    kernel_size=None,
    out_channels=None,
    stride=1,
    padding="SAME",
    pad_value="zero",
    w_tap_popcount=None,
    pool=None,
    scale=None,
    bias=None,
    threshold=None,
    flip=None,
    flip_words=None,
    shortcut=None,
    shortcut_stride=1,
    shift=0,
    side_by_side=None,
    out_dtype="int32",
):
    """2-D convolution of a packed binary or ternary NHWC image with binary or ternary weights, with optional
    fused max-pool and epilogue.

    x: uint32 `(..., B, H, W, ceil(C/32))`, packed along channels (the padding bits past C are ignored), or
       a ternary image: a `formats.TernaryPlanes` of two such arrays (the nonneg and pos planes).
    w: binary weights, FSB tiles of the conv bit matrix (docs/formats.md), a row-packed uint32
       `(O, KH, KW, ceil(C/32))`, or a `formats.ConvBits` (then sizes and tap popcounts come from it); or
       ternary weights, a `formats.TernaryConvBits` (likewise; its matrix has 2 * O rows).
    padding: "SAME", "VALID" or ((top, bottom), (left, right)). pad_value: "zero" (out-of-frame taps add
    nothing, as a float convolution with zero padding) or "one" (pad with -1, bits 0 in every plane).
    w_tap_popcount: the +1 count of each tap of each weight row (`(KH*KW, O)`, or `(KH*KW, 2 * O)` for
    ternary weights), which binary activations use, and ternary ones where the platform has no kernel of the
    product (as in `bmm`); derived from `w` when not given. A concrete one (outside `jax.jit`) is checked
    against `w`; a traced one is trusted (a wrong one gives wrong dot products: with ternary weights
    everywhere, with binary ones at the border with "zero" padding).
    pool: None or (PH, PW): max-pool of the dot products (window = stride, no padding) before the epilogue.
    Epilogues as in `bmm` (thresholds saturated to [-K - 1, K + 1], K = KH * KW * C; `out_dtype=jnp.int16` for
    K at most `MAX_INT16_REDUCTION`); outputs `(..., B, OH, OW, O)` (int32, int16 / float32),
    `(..., B, OH, OW, ceil(O/32))`, or with a ternary operand and
    `(P, O)` thresholds `(..., B, OH, OW, P, ceil(O/32))`.
    Residual epilogue (a ResNet block's second convolution, of any of the four products; no pool, no scale /
    bias): with `shortcut`, the block's input stream `(..., B, SH, SW, SC)`, int32 or int16, the output is the
    new stream in the shortcut's type, `(dot >> shift) + shortcut[..., ::s, ::s, :]` (s = `shortcut_stride`,
    ceil(SH / s) = OH, ceil(SW / s) = OW; channels past SC, 1 <= SC <= O, add 0: the type-A shortcut), wrapping
    as that type's arithmetic does (`out_dtype` names that type, or is int32, the default, which stands for it);
    with
    `threshold` / `flip` as well (integers within int32, compared with the stream's values; `(O,)`, or `(P, O)`
    for P planes, a ternary operand's (nonneg, pos) pair) the pair (stream, its packed bits
    `(..., B, OH, OW, ceil(O/32))`, or `(..., B, OH, OW, P, ceil(O/32))`): the next block's input, in the same
    pass (on CUDA the kernel writes one plane; more planes are thresholded from the stream after it, by a
    kernel of their own).
    side_by_side: as in `bmm` (`side_by_side_weights(w, ...)`; with a shortcut, `threshold_planes=0`).
    flip_words: `formats.pack_bits(flip != 0)` (uint32, flip's shape with its last axis in words), for a pooled
    threshold convolution whose caller keeps them: CUDA runs it unpooled and pools its bits with them
    (`pool_threshold_bits`), otherwise packing `flip` on every call (a small XLA kernel of its own). Concrete
    ones are checked against a concrete `flip`; traced ones are trusted (as `w_tap_popcount`).
    Every size, padding, stride and output extent must be at most `MAX_EXTENT` (ValueError naming it).
    """
    given_popcount = w_tap_popcount is not None  # the dataclasses' own popcounts are consistent by construction
    ternary_weights = isinstance(w, TernaryConvBits)
    if isinstance(w, (ConvBits, TernaryConvBits)):
        in_channels = _recorded_size("in_channels", in_channels, w.in_channels, w)
        kernel_size = _recorded_size("kernel_size", kernel_size, w.kernel_size, w)
        out_channels = _recorded_size("out_channels", out_channels, w.out_channels, w)
        w_tap_popcount = w.tap_popcount if w_tap_popcount is None else w_tap_popcount
        w = w.bits
    if in_channels is None:
        raise ValueError("bconv2d needs in_channels, the number of real channels of x")
    c = _positive_int("in_channels", in_channels)
    planes = _activations("x", x, min_rank=4)
    for name, plane in planes.items():
        _check_words(name, plane, c)
    x = next(iter(planes.values()))
    if kernel_size is None:
        raise ValueError("bconv2d needs kernel_size (KH, KW)")
    kh, kw = _pair("kernel_size", kernel_size)
    sh, sw = _pair("stride", stride)
    cw = formats.num_words(c)
    k_bits = kh * kw * cw * formats.WORD_BITS
    if k_bits > MAX_REDUCTION:
        raise ValueError(f"kernel_size {kh}x{kw} over in_channels={c} makes {k_bits} reduction bits per dot "
                         f"product; at most {MAX_REDUCTION} fit int32")
    w = _packed("w", w, min_rank=2)
    planes_per_channel = 2 if ternary_weights else 1
    if w.ndim == 4 and w.shape[1:] == (kh, kw, cw):  # row-packed (O, KH, KW, Cw), or (2 * O, ...) if ternary
        if out_channels is not None and out_channels * planes_per_channel != w.shape[0]:
            raise ValueError(f"out_channels={out_channels} but w has {w.shape[0]} rows")
        out_channels = w.shape[0] // planes_per_channel
        if out_channels == 0:
            raise ValueError("w has no output channels")
        w = w.reshape(w.shape[0], kh * kw * cw)
    rows = None if out_channels is None else out_channels * planes_per_channel
    w, rows = _weights("w", w, k_bits, rows)
    o = rows // planes_per_channel
    if o == 0:
        raise ValueError("w has no output channels")
    if ternary_weights:
        _check_ternary_weights("w", w, o, k_bits, (kh * kw, cw, c))
    h, wd = x.shape[-3:-1]
    (pt, pb), (pl, pr) = _conv_padding(padding, (h, wd), (kh, kw), (sh, sw))
    if pad_value not in ("zero", "one"):
        raise ValueError(f"pad_value must be 'zero' or 'one', got {pad_value!r}")
    for name, extent in (("the padded height", h + pt + pb), ("the padded width", wd + pl + pr)):
        if extent > MAX_EXTENT:
            raise ValueError(f"padding {padding!r} makes {name} {extent}, beyond the largest extent {MAX_EXTENT}")
    if h + pt + pb < kh or wd + pl + pr < kw:
        raise ValueError(f"a {kh}x{kw} kernel does not fit the padded {h}x{wd} input")
    oh, ow = (h + pt + pb - kh) // sh + 1, (wd + pl + pr - kw) // sw + 1
    ph, pw = (1, 1) if pool is None else _pair("pool", pool)
    if oh < ph or ow < pw:
        raise ValueError(f"pool {pool} is larger than the {oh}x{ow} convolution output")
    if w_tap_popcount is not None:
        w_tap_popcount = _int32_array("w_tap_popcount", w_tap_popcount, (kh * kw, rows))
        if given_popcount:
            _check_popcount("w_tap_popcount", w_tap_popcount, w, rows, k_bits, (kh * kw, cw, c))
    batch = x.shape[:-3]
    attrs = (c, o, kh, kw, sh, sw, pt, pb, pl, pr, pad_value == "one", ph, pw)
    mode = _mode(len(planes) == 2, ternary_weights)
    if flip_words is not None and (pool is None or threshold is None or flip is None or shortcut is not None):
        raise ValueError("flip_words belong to a pooled threshold convolution with a flip")
    if shortcut is not None:
        if pool is not None or scale is not None or bias is not None:
            raise ValueError("the residual epilogue (shortcut) takes no pool, scale or bias")
        stride = _positive_int("shortcut_stride", shortcut_stride)
        if not _is_int(shift) or not 0 <= shift <= 31:
            raise ValueError(f"shift must be an integer in [0, 31], got {shift!r}")
        shortcut = _shortcut_stream(shortcut, batch, (oh, ow), o, stride)
        stream_dtype = _out_dtype(out_dtype, "the residual stream, the shortcut's type")
        if stream_dtype not in (np.dtype(np.int32), shortcut.dtype):
            raise ValueError(f"the residual epilogue's stream has the shortcut's type, {shortcut.dtype}; got "
                             f"out_dtype={stream_dtype}")
        threshold, flip = _stream_threshold(threshold, flip, o)
        _check_elements("the result", batch + (oh, ow, o))
        _check_elements("the padded input", batch + (h + pt + pb, wd + pl + pr, c))
        if mode == "bnn":
            if side_by_side is not None:
                raise ValueError("side_by_side weights belong to a product with a ternary operand; this one is binary")
            return _bconv2d_residual(x, w, w_tap_popcount, shortcut, threshold, flip, attrs=attrs, stride=stride,
                                     shift=int(shift))
        _check_side_by_side(side_by_side, ConvBits, mode, 0, dict(kernel_size=(kh, kw), out_channels=o,
                                                                  in_channels=_side_by_side_channels(mode, c)))
        return _ternary_residual(tuple(planes.values()), w, w_tap_popcount, side_by_side, shortcut, threshold, flip,
                                 attrs=attrs, mode=mode, stride=stride, shift=int(shift))
    if not _is_int(shift) or shift != 0 or not _is_int(shortcut_stride) or shortcut_stride != 1:
        raise ValueError("shift and shortcut_stride apply to the residual epilogue: give a shortcut")
    kind, epi, threshold_planes = _epilogue(o, kh * kw * c + 1, scale, bias, threshold, flip, mode, out_dtype,
                                            kh * kw * c)
    if flip_words is not None:
        flip_words = _flip_words(flip_words, epi["flip"], o)
    _check_elements("the result", batch + (oh // ph, ow // pw) + _epilogue_tail(kind, o, threshold_planes))
    _check_elements("the padded input", batch + (h + pt + pb, wd + pl + pr, c))
    _check_side_by_side(side_by_side, ConvBits, mode, threshold_planes,
                        dict(kernel_size=(kh, kw), out_channels=_side_by_side_columns(o, threshold_planes),
                             in_channels=_conv_side_by_side_channels(mode, c, kh * kw, side_by_side)))
    return _bconv2d(tuple(planes.values()), w, w_tap_popcount, epi, side_by_side, flip_words, attrs=attrs, kind=kind,
                    pooled=pool is not None, mode=mode, threshold_planes=threshold_planes)


def _flip_words(flip_words, flip, n):
    """Checked flip words of `flip` ((..., n) -> uint32 (..., ceil(n/32))): the same bits where both are concrete."""
    flip_words = _packed("flip_words", flip_words, min_rank=1)
    want = tuple(np.shape(flip)[:-1]) + (formats.num_words(n),)
    if flip_words.shape != want:
        raise ValueError(f"flip_words must have shape {want} (flip's, in words), got {flip_words.shape}")
    if not isinstance(flip_words, jax.core.Tracer) and not isinstance(flip, jax.core.Tracer):
        with jax.ensure_compile_time_eval():  # concrete values under an outer jit too
            packed = np.asarray(formats.pack_bits(np.asarray(flip) != 0))
        if not np.array_equal(np.asarray(flip_words), packed):
            raise ValueError("flip_words are not formats.pack_bits(flip != 0)")
    return flip_words


_CONV_ATTRS = ("c", "o", "kh", "kw", "stride_h", "stride_w", "pad_top", "pad_bottom", "pad_left", "pad_right",
               "pad_one", "pool_h", "pool_w")


@functools.partial(jax.jit, static_argnames=("attrs", "kind", "pooled", "mode", "threshold_planes", "x_repeats"))
def _bconv2d(planes, w, w_tap_popcount, epi, side_by_side=None, flip_words=None, *, attrs, kind, pooled, mode,
             threshold_planes, x_repeats=1):
    """The checked op as one compiled function per static signature (as `_bmm`). x_repeats (binary products
    only): each tap reads the input's words that many times, `c` channels from `ceil(c / 32) / x_repeats` words a
    pixel (`_side_by_side_operands`); the CUDA kernels read them in place, elsewhere they are copied first.
    flip_words: the checked `formats.pack_bits(flip != 0)` of a pooled threshold convolution, or None."""
    if kind == "i16" and mode != "bnn":  # the int32 products, narrowed (XLA fuses the conversion into the reader)
        return _bconv2d(planes, w, w_tap_popcount, epi, side_by_side, attrs=attrs, kind="i32", pooled=pooled,
                        mode=mode, threshold_planes=threshold_planes).astype(jnp.int16)
    c, o, kh, kw, sh, sw, pt, pb, pl, pr, pad_one, ph, pw = attrs
    cw = formats.num_words(c)
    k_bits = kh * kw * cw * formats.WORD_BITS
    batch, (h, wd) = planes[0].shape[:-3], planes[0].shape[-3:-1]
    conv_hw = ((h + pt + pb - kh) // sh + 1, (wd + pl + pr - kw) // sw + 1)
    oh, ow = conv_hw[0] // ph, conv_hw[1] // pw
    tail, out_dtype = _epilogue_tail(kind, o, threshold_planes), _epilogue_output(kind, o)[1]
    # batch dims fold into B: one kernel call
    images = [x.reshape((math.prod(batch),) + x.shape[-3:]) for x in planes]
    if images[0].shape[0] == 0:
        return jnp.zeros(batch + (oh, ow) + tail, out_dtype)
    # the CUDA kernels index the input words and the (unpooled) output elements of a call in int32
    chunk = _KERNEL_INDEX_LIMIT // max(h * wd * images[0].shape[-1], conv_hw[0] * conv_hw[1] * o * max(threshold_planes, 1))
    if 1 <= chunk < images[0].shape[0]:
        outs = [_bconv2d(tuple(x[i:i + chunk] for x in images), w, w_tap_popcount, epi, side_by_side, flip_words,
                         attrs=attrs, kind=kind, pooled=pooled, mode=mode, threshold_planes=threshold_planes,
                         x_repeats=x_repeats)
                for i in range(0, images[0].shape[0], chunk)]
        return jnp.concatenate(outs).reshape(batch + outs[0].shape[1:])
    ternary_weights = mode in ("btn", "tnn")
    rows = 2 * o if ternary_weights else o
    if w.ndim == 2:
        w = formats.to_fsb(w)
    if w_tap_popcount is None:  # kept in every mode, as in `_bmm`
        w_tap_popcount = _real_bit_popcount(w, rows=rows, k_bits=k_bits, taps=(kh * kw, cw, c))
    weights = (w, w_tap_popcount.astype(jnp.int32)) + (
        () if side_by_side is None else (side_by_side.bits, side_by_side.tap_popcount))
    epi = _epilogue_operands(kind, epi, o, kh * kw * c + 1)
    attr_values = dict(zip(_CONV_ATTRS, attrs))
    attr_values = {name: v if name == "pad_one" else np.int64(v) for name, v in attr_values.items()}
    a_count = len(planes)
    # the composite's binary convolution: all 2o rows of ternary weights, unpooled
    binary_attrs = (c, rows) + attrs[2:-2] + (1, 1)

    def binary_dot(x, w_, popcount_):
        return _bconv2d((x,), w_, popcount_, {}, attrs=binary_attrs, kind="i32", pooled=False, mode="bnn",
                        threshold_planes=0)

    doubled_weights = side_by_side is not None and side_by_side.in_channels != _side_by_side_channels(mode, c)

    def conv_composite(acts, w_, popcount_, prepared, pool_window, epilogue):
        if _takes_doubled_conv(mode, c, kh * kw) and not (pad_one and any((pt, pb, pl, pr))):
            # (four-block weights given, a residual convolution's: the three blocks built here)
            return _tnn_doubled_conv(acts, w_, prepared if doubled_weights else None, epilogue, attrs=attrs,
                                     kind=kind, pooled=pooled, threshold_planes=threshold_planes)
        if doubled_weights:  # three-block weights, but "one" padding takes the four blocks: built here
            prepared = None
        if not _side_by_side_fits(mode, kh * kw * cw, o, threshold_planes):
            return _composite(binary_dot, acts, w_, popcount_, o, pool_window, epilogue)
        blocks, block_popcount = prepared or _conv_side_by_side_weights(mode, w_, popcount_, c=c, o=o, taps=kh * kw,
                                                                        threshold_planes=threshold_planes)
        block_channels = _side_by_side_channels(mode, c)
        x, epilogue, x_repeats = _side_by_side_operands(
            mode, acts, epilogue, kind=kind, c=c, bound=kh * kw * c + 1, threshold_planes=threshold_planes,
            reduction_bits=kh * kw * block_channels, read_twice=True)
        out = _bconv2d((x,), blocks, block_popcount, epilogue,
                       attrs=(block_channels, _side_by_side_columns(o, threshold_planes)) + attrs[2:], kind=kind,
                       pooled=pooled, mode="bnn", threshold_planes=_native_planes(threshold_planes, o),
                       x_repeats=x_repeats)
        return _side_by_side_result(out, mode, kind, threshold_planes, o)

    def ref(x_, w_, _popcount, *e):
        return reference.bconv2d(
            x_, w_, in_channels=c, out_channels=o, kernel_size=(kh, kw), stride=(sh, sw),
            padding=((pt, pb), (pl, pr)), pad_value="one" if pad_one else "zero", pool=(ph, pw) if pooled else None,
            **dict(zip(epi, e)),
        )  # fmt: skip

    def single(*operands):
        words_ = None  # flip_words, the last operand where given
        if flip_words is not None:
            *operands, words_ = operands
        out_type = jax.ShapeDtypeStruct((operands[0].shape[0], oh, ow) + tail, out_dtype)
        if mode != "bnn":
            acts, (w_, popcount_, *prepared_), e = (operands[:a_count], operands[a_count:a_count + len(weights)],
                                                    operands[a_count + len(weights):])
            pool_window = (ph, pw) if pooled else None
            composite = lambda *_: conv_composite(acts, w_, popcount_, prepared_, pool_window,  # noqa: E731
                                                  dict(zip(epi, e)))
            native = (*acts, w_, popcount_, *e) if mode == "btn" else (_planes_side_by_side(acts), w_, *e)
            return _dispatch(f"jaxbnn_{mode}_conv2d_{kind}", out_type, attr_values, composite, *native)
        x_, *weights_ = operands
        target = f"jaxbnn_bconv2d_{kind}"
        cuda_attrs = {"x_repeats": np.int64(x_repeats)}
        cuda = None
        if kind == "bits" and ph * pw > 1 and _ffi.has_target("cuda", target):
            # On CUDA, a pooled threshold convolution runs unpooled (the image-band and resident kernels take
            # no pool; the pooled tiles' staged epilogue ran VGG-16's 1_2 ~25x slower, docs/design/decisions.md)
            # and its bits are pooled after: the threshold test is monotone in the dot product,
            # so the bit of a window's max is the OR of the window's bits, and with `flip` their AND.
            # (a plane axis folds into the words: each word pools on its own)
            unpooled = jax.ShapeDtypeStruct((x_.shape[0], *conv_hw) + tail, out_dtype)
            flat = dict(attr_values, **cuda_attrs, pool_h=np.int64(1), pool_w=np.int64(1))

            def cuda(x_, *ws):
                bits = _ffi_call(target, unpooled, x_, *ws, **flat)
                words = formats.pack_bits(ws[-1] != 0) if words_ is None else words_
                pooled_bits = pool_threshold_bits(bits.reshape(bits.shape[:3] + (-1,)), (ph, pw), words.reshape(-1))
                return pooled_bits.reshape(pooled_bits.shape[:3] + tail)
        cuda_operands = dict(cuda_weights=lambda w_: _default_tiles(w_, o, k_bits),
                             cuda_activations=lambda x_: _clear_padding_bits(x_, c // x_repeats))
        elsewhere = _elsewhere(kind, "jaxbnn_bconv2d_i32", out_type, attr_values, ref, cuda_operands,
                               cuda_attrs={"x_repeats": np.int64(1)})
        return _dispatch(target, out_type, attr_values, lambda x_, *rest: elsewhere(_read_input(x_, x_repeats), *rest),
                         x_, *weights_, cuda=cuda, cuda_attrs=cuda_attrs,
                         cpu_activations=lambda x_: _read_input(x_, x_repeats), **cuda_operands)

    given_words = () if flip_words is None else (flip_words,)
    out = _fold_rows(single, activations=len(planes))(*images, *weights, *epi.values(), *given_words)
    return out.reshape(batch + out.shape[1:])


@functools.partial(jax.jit, static_argnames=("attrs", "stride", "shift", "x_repeats"))
def _bconv2d_residual(x, w, w_tap_popcount, shortcut, threshold, flip, *, attrs, stride, shift, x_repeats=1):
    """The checked residual convolution as one compiled function per static signature (as `_bmm`); x_repeats as
    `_bconv2d`'s."""
    planes = threshold is not None and threshold.ndim == 2
    if planes and threshold.shape[0] == 1:
        stream, bits = _bconv2d_residual(x, w, w_tap_popcount, shortcut, threshold[0],
                                         None if flip is None else flip[0], attrs=attrs, stride=stride, shift=shift,
                                         x_repeats=x_repeats)
        return stream, bits[..., None, :]
    if planes and (threshold.shape[0] > _KERNEL_BITS_PLANES or shortcut.dtype != jnp.int16):
        # the int16 stream's kernels write up to two planes; others, a pass of their own
        stream = _bconv2d_residual(x, w, w_tap_popcount, shortcut, None, None, attrs=attrs, stride=stride, shift=shift,
                                   x_repeats=x_repeats)
        return stream, _stream_planes(stream, threshold, flip)
    c, o, kh, kw, sh, sw, pt, pb, pl, pr, pad_one, _, _ = attrs
    cw = formats.num_words(c)
    k_bits = kh * kw * cw * formats.WORD_BITS
    h, wd = x.shape[-3:-1]
    oh, ow = (h + pt + pb - kh) // sh + 1, (wd + pl + pr - kw) // sw + 1
    bits = threshold is not None
    lead = x.shape[:-3]
    stream_type = jax.ShapeDtypeStruct((math.prod(lead), oh, ow, o), shortcut.dtype)
    bits_type = jax.ShapeDtypeStruct((math.prod(lead), oh, ow) + (threshold.shape[:-1] if planes else ()) +
                                     (formats.num_words(o),), jnp.uint32)
    images = x.reshape((math.prod(lead),) + x.shape[-3:])  # batch dims fold into B: one kernel call
    shortcut = shortcut.reshape((math.prod(lead),) + shortcut.shape[-3:])
    if images.shape[0] == 0:
        stream, packed = jnp.zeros(stream_type.shape, shortcut.dtype), jnp.zeros(bits_type.shape, jnp.uint32)
    else:
        if w.ndim == 2:
            w = formats.to_fsb(w)
        if w_tap_popcount is None:
            w_tap_popcount = _real_bit_popcount(w, rows=o, k_bits=k_bits, taps=(kh * kw, cw, c))
        w_tap_popcount = w_tap_popcount.astype(jnp.int32)
        conv_attrs = {name: v if name == "pad_one" else np.int64(v) for name, v in zip(_CONV_ATTRS, attrs)}
        conv = dict(in_channels=c, out_channels=o, kernel_size=(kh, kw), stride=(sh, sw), padding=((pt, pb), (pl, pr)),
                    pad_value="one" if pad_one else "zero")
        residual = dict(stride=stride, shift=shift)
        epilogue = (threshold.astype(jnp.int32), _flip_operand(flip, threshold.shape)) if bits else ()

        def single(x_, w_, popc_, shortcut_, *epi):
            def elsewhere(x_, w_, popc_, shortcut_, *e):
                # the int32 convolution (native where the platform has it), then the epilogue in jnp
                dot = _dispatch("jaxbnn_bconv2d_i32", jax.ShapeDtypeStruct((x_.shape[0], oh, ow, o), jnp.int32), conv_attrs,
                                lambda *ops: reference.bconv2d(*ops[:2], **conv), x_, w_, popc_,
                                cuda_attrs={"x_repeats": np.int64(1)})
                return reference.residual_epilogue(dot, shortcut_, **residual, **dict(zip(("threshold", "flip"), e)))

            types = tuple(jax.ShapeDtypeStruct((x_.shape[0],) + t.shape[1:], t.dtype) for t in (stream_type, bits_type))
            out_type = types if bits else types[0]
            # the int32 stream's targets: jaxbnn_bconv2d_residual_i32 / _bits; the int16 one's: _i16 / _i16_bits
            narrow = shortcut_.dtype == jnp.int16
            target = "jaxbnn_bconv2d_residual_" + ("i16" + "_bits" * bits if narrow else "bits" if bits else "i32")
            return _dispatch(target, out_type,
                             dict(conv_attrs, shortcut_stride=np.int64(stride), shift=np.int64(shift)),
                             lambda x_, *rest: elsewhere(_read_input(x_, x_repeats), *rest),
                             x_, w_, popc_, shortcut_, *epi,
                             cuda_weights=lambda w_: _default_tiles(w_, o, k_bits),
                             cuda_activations=lambda x_: _clear_padding_bits(x_, c // x_repeats),
                             cpu_activations=lambda x_: _read_input(x_, x_repeats),
                             cuda_attrs={"x_repeats": np.int64(x_repeats)})

        out = _fold_rows(single, row_operands=(3,))(images, w, w_tap_popcount, shortcut, *epilogue)
        stream, packed = out if bits else (out, None)
    stream = stream.reshape(lead + stream.shape[1:])
    return (stream, packed.reshape(lead + packed.shape[1:])) if bits else stream


def _stream_planes(stream, threshold, flip):
    """The stream's bits through checked threshold planes `(P, N)`, `(..., P, ceil(N/32))`, where the residual
    kernels do not write them (an int32 stream, more than two planes): on CUDA a pass of its own
    (`jaxbnn_stream_bits`), elsewhere the reference's. XLA's reduction over each word's 32 bits read ResNet-18's
    first stream at 0.7 TB/s (docs/design/decisions.md, "The residual epilogue")."""
    threshold = threshold.astype(jnp.int32)
    flip = _flip_operand(flip, threshold.shape)
    tail = (threshold.shape[0], formats.num_words(stream.shape[-1]))
    rows = stream.reshape((-1,) + stream.shape[-3:])  # (..., B, H, W, C): one call over the images

    def single(x, t, f):
        out_type = jax.ShapeDtypeStruct(x.shape[:-1] + tail, jnp.uint32)
        return _dispatch("jaxbnn_stream_bits", out_type, {},
                         lambda x_, t_, f_: reference.epilogue(x_, threshold=t_, flip=f_), x, t, f)

    return _fold_rows(single)(rows, threshold, flip).reshape(stream.shape[:-1] + tail)


@functools.partial(jax.jit, static_argnames=("attrs", "mode", "stride", "shift"))
def _ternary_residual(planes, w, w_tap_popcount, side_by_side, shortcut, threshold, flip, *, attrs, mode, stride,
                      shift):
    """The residual convolution of a product with a ternary operand. Where the platform has the product's own
    kernel (the CPU): over an int16 stream, that kernel with the residual epilogue
    (`jaxbnn_{mode}_conv2d_residual_i16`, `_i16_bits`); over an int32 one, its int32 dot products, then the
    epilogue in jnp. Elsewhere (CUDA) the side-by-side binary product (`_side_by_side_matrix`) through the binary
    residual epilogue. That product is `parts` (2 or 4, a power of two) times the ternary one, so shifting it
    right by `shift + log2(parts)` more gives the same stream (capped at 31: past it either shift leaves only the
    sign, as |dot| < 2**21 there)."""
    c, o, kh, kw = attrs[:4]
    parts = len(_REDUCTION_BLOCKS[mode])
    lead = planes[0].shape[:-3]
    residual = dict(stride=stride, shift=shift, threshold=threshold, flip=flip)
    fused_target = f"jaxbnn_{mode}_conv2d_residual_i16" + ("" if threshold is None else "_bits")

    def direct():
        dot = _bconv2d(planes, w, w_tap_popcount, {}, attrs=attrs, kind="i32", pooled=False, mode=mode,
                       threshold_planes=0)
        images = math.prod(lead)
        out = reference.residual_epilogue(dot.reshape((images,) + dot.shape[-3:]),
                                          shortcut.reshape((images,) + shortcut.shape[-3:]), **residual)
        return jax.tree.map(lambda v: v.reshape(lead + v.shape[1:]), out)

    def composite():
        if side_by_side is None:
            blocks, block_popcount = _conv_side_by_side_weights(mode, w, w_tap_popcount, c=c, o=o, taps=kh * kw,
                                                                threshold_planes=0)
        else:
            blocks, block_popcount = side_by_side.bits, side_by_side.tap_popcount
        block_channels = _side_by_side_channels(mode, c)
        x, _, x_repeats = _side_by_side_operands(mode, planes, {}, kind="i32", c=c, bound=kh * kw * c + 1,
                                                 threshold_planes=0, reduction_bits=kh * kw * block_channels,
                                                 read_twice=True)
        return _bconv2d_residual(x, blocks, block_popcount, shortcut, threshold, flip,
                                 attrs=(block_channels, o) + attrs[2:], stride=stride,
                                 shift=min(shift + parts.bit_length() - 1, 31), x_repeats=x_repeats)

    def fused():
        cw = formats.num_words(c)
        k_bits = kh * kw * cw * formats.WORD_BITS
        w_ = formats.to_fsb(w) if w.ndim == 2 else w
        popcount = w_tap_popcount
        if popcount is None:
            rows = 2 * o if mode in ("btn", "tnn") else o
            popcount = _real_bit_popcount(w_, rows=rows, k_bits=k_bits, taps=(kh * kw, cw, c))
        images = math.prod(lead)
        if images == 0:
            return direct()
        sh, sw, pt, pb, pl, pr = attrs[4:10]
        oh, ow = (planes[0].shape[-3] + pt + pb - kh) // sh + 1, (planes[0].shape[-2] + pl + pr - kw) // sw + 1
        stream_type = jax.ShapeDtypeStruct((oh, ow, o), jnp.int16)
        epilogue = () if threshold is None else (threshold.astype(jnp.int32), _flip_operand(flip, threshold.shape))
        bits_type = None if threshold is None else jax.ShapeDtypeStruct(
            (oh, ow) + threshold.shape[:-1] + (formats.num_words(o),), jnp.uint32)
        conv_attrs = {name: v if name == "pad_one" else np.int64(v) for name, v in zip(_CONV_ATTRS, attrs)}

        def single(*operands):
            acts, (w_, popcount_, shortcut_), e = (operands[:len(planes)], operands[len(planes):len(planes) + 3],
                                                   operands[len(planes) + 3:])
            rows = acts[0].shape[0]
            types = tuple(jax.ShapeDtypeStruct((rows,) + t.shape, t.dtype) for t in (stream_type, bits_type) if t)
            native = (*acts, w_, popcount_) if mode == "btn" else (_planes_side_by_side(acts), w_)
            return _ffi_call(fused_target, types if len(types) == 2 else types[0], *native, shortcut_, *e,
                             **conv_attrs, shortcut_stride=np.int64(stride), shift=np.int64(shift))

        acts = tuple(x.reshape((images,) + x.shape[-3:]) for x in planes)
        out = _fold_rows(single, activations=len(planes), row_operands=(len(planes) + 2,))(
            *acts, w_, popcount.astype(jnp.int32), shortcut.reshape((images,) + shortcut.shape[-3:]), *epilogue)
        return jax.tree.map(lambda v: v.reshape(lead + v.shape[1:]), out)

    native = {p: direct for p in ("cpu", "cuda") if _ffi.has_target(p, f"jaxbnn_{mode}_conv2d_i32")}
    if shortcut.dtype == jnp.int16:
        native.update({p: fused for p in native if _ffi.has_target(p, fused_target)})
    if not _side_by_side_fits(mode, kh * kw * formats.num_words(c), o, 0):
        own = {p: f for p, f in native.items() if f is fused}
        return _platform_dependent(default=direct, **own) if own else direct()
    if not native:
        return composite()
    return _platform_dependent(default=composite, **native)


def _shortcut_stream(shortcut, batch, out_hw, o, stride):
    """The residual epilogue's shortcut, checked: int32 or int16 (*batch, SH, SW, SC) reaching (OH, OW) at
    `stride`."""
    shortcut = formats.host_or_device(shortcut)
    if shortcut.dtype not in (jnp.int32, jnp.int16):
        raise TypeError(f"shortcut must be the residual stream, int32 or int16, got dtype {shortcut.dtype}")
    if shortcut.ndim != len(batch) + 3 or shortcut.shape[:-3] != batch:
        raise ValueError(f"shortcut must have shape {batch + ('SH', 'SW', 'SC')} (the batch dims of x), got "
                         f"{shortcut.shape}")
    sh, sw, sc = shortcut.shape[-3:]
    if (-(-sh // stride), -(-sw // stride)) != tuple(out_hw) or not 1 <= sc <= o:
        raise ValueError(f"a shortcut of {sh}x{sw}x{sc} at shortcut_stride {stride} does not reach the {out_hw[0]}x"
                         f"{out_hw[1]}x{o} output (ceil(SH / stride) = OH, ceil(SW / stride) = OW, 1 <= SC <= O)")
    return shortcut


def _stream_threshold(threshold, flip, n):
    """The residual stream's threshold and flip, checked: integers of shape (n,) or (P, n) (P planes, a ternary
    operand's two), thresholds within int32 (they are compared with int32 values as they are)."""
    if threshold is None:
        if flip is not None:
            raise ValueError("flip only applies with a threshold")
        return None, None
    threshold, flip, stacked = _planes(threshold, flip, n, lambda t: _int32_threshold(t, "the stream's values"))
    return (threshold, flip) if stacked else (threshold[0], None if flip is None else flip[0])


def _int32_threshold(threshold, compared):
    """Integer thresholds that int32 values (`compared`, named in the errors) meet as they are: a device array of
    a dtype within int32, or host values within its range (then as int32)."""
    if not jnp.issubdtype(threshold.dtype, jnp.integer):
        raise TypeError(f"threshold must be integer ({compared} are integers), got {threshold.dtype}")
    info = np.iinfo(np.int32)
    if isinstance(threshold, jax.Array):
        if not (jnp.iinfo(threshold.dtype).min >= info.min and jnp.iinfo(threshold.dtype).max <= info.max):
            raise TypeError(f"a device threshold must have a dtype within int32, got {threshold.dtype}")
        return threshold
    if threshold.size and not (info.min <= threshold.min() and threshold.max() <= info.max):
        raise ValueError(f"threshold values must lie within int32: {compared} are int32")
    return threshold.astype(np.int32)


def image_matmul(levels, kernel, *, shift=0, threshold=None, flip=None, out_dtype="int32", keep_stream=False,
                 kernel_masks=None):
    """Products of image levels `(M, K)` with int8 weight values `(K, N)` (a first dense layer), with the
    epilogue of `image_conv2d`: the stream `(M, N)` (`>> shift`, int32 or int16), the packed bits of the
    threshold planes, or both. levels: int8 levels, or the uint8 pixels p whose levels p - 128 they are
    (`formats.image_levels`), as `image_conv2d` takes them. kernel_masks: as `image_conv2d`'s.

    Exact integer arithmetic on every platform; one custom call where a native handler exists (it runs as
    a 1x1 convolution of a 1x1 image of K channels)."""
    levels, kernel = _image_levels_operand(levels, 2), _int8("kernel", kernel, 2)
    if levels.shape[1] != kernel.shape[0]:
        raise ValueError(f"levels have {levels.shape[1]} features, kernel {kernel.shape[0]} rows")
    if min(kernel.shape) < 1:
        raise ValueError(f"kernel must have at least one row and one column, got shape {kernel.shape}")
    m, k = levels.shape
    out = image_conv2d(levels.reshape(m, 1, 1, k), kernel.reshape(1, 1, k, kernel.shape[1]), stride=1,
                       padding="VALID", shift=shift, threshold=threshold, flip=flip, out_dtype=out_dtype,
                       keep_stream=keep_stream, kernel_masks=kernel_masks)
    return jax.tree.map(lambda o: o.reshape((m,) + o.shape[3:]), out)


def image_conv2d(levels, kernel, *, stride=1, padding="SAME", pool=None, shift=0, threshold=None, flip=None,
                 out_dtype="int32", keep_stream=False, kernel_masks=None):
    """Convolution of image levels `(B, H, W, C)` with int8 weight values `(KH, KW, C, N)` (a first conv
    layer), zero padding (level 0, pixel 128), with a fused max-pool and epilogue; exact on every platform.

    levels: int8 levels, or the uint8 pixels p as images are stored, whose levels p - 128 the layer multiplies
    (`formats.image_levels`). The CUDA and CPU kernels read pixels as they are; the reference converts them.

    padding: "SAME", "VALID" or ((top, bottom), (left, right)). pool: None or (PH, PW), a max-pool of the
    int32 pre-activations (window = stride, no padding). Epilogue:
    - no threshold: the stream `(B, OH, OW, N)`, the (pooled) pre-activations `>> shift` (an arithmetic
      shift, floor division by 2**shift, 0 <= shift <= 31), int32, or with `out_dtype=jnp.int16` narrowed to
      int16 as `astype` narrows (the low 16 bits: exact where the values fit, which the caller bounds, as
      `runtime.stream_dtypes` does for a ResNet's stem);
    - threshold `(N,)` (flip `(N,)`): packed bits uint32 `(B, OH, OW, ceil(N/32))` of `pre >= threshold`
      (`pre <= threshold` where flip);
    - threshold `(P, N)` (flip `(P, N)`): P threshold planes of the same pre-activations (a ternary
      output's two), uint32 `(B, OH, OW, P, ceil(N/32))`;
    - threshold with `keep_stream=True`: the pair (stream, bits), the bits those of the stream's values (after
      the shift and `out_dtype`'s narrowing) against the thresholds, in the same pass: a stem writing its
      residual stream and the first block's input bits.
    Thresholds are integers of any width, saturated exactly as `bconv2d` saturates its own.

    kernel_masks: None, or `formats.image_kernel_masks(kernel)` (a kernel of -1, 0 and +1), which the CPU's
    AVX-512 VNNI kernel reads instead of the kernel in a call of few gathered rows (a dense first layer at a
    small batch): the same results, from a fraction of the bytes. They must be this kernel's masks: the op
    checks their shape, not their values. Other platforms and tiers ignore them."""
    levels, kernel = _image_levels_operand(levels, 4), _int8("kernel", kernel, 4)
    kh, kw, c, n = kernel.shape
    if min(kernel.shape) < 1:
        raise ValueError(f"kernel (KH, KW, C, N) must have every size at least 1, got shape {kernel.shape}")
    if levels.shape[-1] != c:
        raise ValueError(f"a kernel of shape {kernel.shape} does not take levels of shape {levels.shape}")
    _check_image_reduction(kh * kw * c)
    stride = _pair("stride", stride)
    h, wd = levels.shape[1:3]
    padding = _conv_padding(padding, (h, wd), (kh, kw), stride)
    (pt, pb), (pl, pr) = padding
    if max(h + pt + pb, wd + pl + pr) > MAX_EXTENT:
        raise ValueError(f"padding {padding!r} makes the padded image larger than the largest extent {MAX_EXTENT}")
    if h + pt + pb < kh or wd + pl + pr < kw:
        raise ValueError(f"a {kh}x{kw} kernel does not fit the padded {h}x{wd} image")
    oh, ow = (h + pt + pb - kh) // stride[0] + 1, (wd + pl + pr - kw) // stride[1] + 1
    pool = None if pool is None else _pair("pool", pool)
    ph, pw = pool or (1, 1)
    if ph * pw > MAX_IMAGE_POOL_WINDOW:
        raise ValueError(f"pool {pool} has {ph * pw} elements; image_conv2d takes windows of at most "
                         f"{MAX_IMAGE_POOL_WINDOW}")
    if oh < ph or ow < pw:
        raise ValueError(f"pool {pool} is larger than the {oh}x{ow} convolution output")
    if not _is_int(shift) or not 0 <= shift <= 31:
        raise ValueError(f"shift must be an integer in [0, 31], got {shift!r}")
    narrow = _out_dtype(out_dtype, "the stream's type") == np.int16
    if not isinstance(keep_stream, (bool, np.bool_)):
        raise TypeError(f"keep_stream must be a bool, got {keep_stream!r}")
    if keep_stream and threshold is None:
        raise ValueError("keep_stream applies with a threshold (without one the stream is the output)")
    planes = None
    if threshold is not None:
        if not keep_stream and (shift or narrow):
            raise ValueError("shift and out_dtype apply to the stream: without a threshold, or with keep_stream=True")
        threshold, flip, stacked = _threshold_planes(threshold, flip, n, _image_bound(kh * kw * c))
        planes = threshold.shape[0]
    elif flip is not None:
        raise ValueError("flip only applies with a threshold")
    if planes is None or keep_stream:
        _check_elements("the result", (levels.shape[0], oh // ph, ow // pw, n))
    if planes is not None:
        _check_elements("the result", (levels.shape[0], oh // ph, ow // pw, planes, formats.num_words(n)))
    _check_elements("the gathered taps", (levels.shape[0], oh, ow, kh * kw * c))
    attrs = (c, n, kh, kw, *stride, pt, pb, pl, pr, ph, pw)
    masks, counts = _kernel_masks_operands(kernel_masks, kh * kw * c, n)
    out = _image_conv2d(levels, kernel, threshold, flip, masks, counts, attrs=attrs, shift=int(shift),
                        pooled=pool is not None, narrow=narrow, keep_stream=bool(keep_stream))
    if planes is None or stacked:
        return out
    return (out[0], out[1][..., 0, :]) if keep_stream else out[..., 0, :]


def _out_dtype(out_dtype, what):
    """The integer type `out_dtype` names, int32 or int16 (`what`: the result it types, for the error)."""
    try:
        dtype = None if out_dtype is None else np.dtype(out_dtype)  # np.dtype(None) is float64
    except TypeError:
        raise TypeError(f"out_dtype must be int32 or int16, got {out_dtype!r}") from None
    if dtype not in (np.int32, np.int16):
        raise TypeError(f"out_dtype must be int32 or int16 ({what}), got {out_dtype if dtype is None else dtype}")
    return dtype


_IMAGE_ATTRS = ("c", "n", "kh", "kw", "stride_h", "stride_w", "pad_top", "pad_bottom", "pad_left", "pad_right",
                "pool_h", "pool_w")


def _kernel_masks_operands(kernel_masks, k, n):
    """The CPU handlers' kernel masks operands (`formats.ImageKernelMasks`): the masks' arrays, or arrays of
    no planes where none are given."""
    if kernel_masks is None:
        return np.zeros((0, -(-k // 4), -(-n // 16), 2), np.uint32), np.zeros((0, n), np.int32)
    if not isinstance(kernel_masks, formats.ImageKernelMasks):
        raise TypeError(f"kernel_masks must be formats.ImageKernelMasks (formats.image_kernel_masks), got "
                        f"{type(kernel_masks).__name__}")
    if (kernel_masks.k, kernel_masks.n) != (k, n):
        raise ValueError(f"kernel_masks are a kernel of K = {kernel_masks.k}, N = {kernel_masks.n}; this one has "
                         f"K = {k}, N = {n}")
    masks, counts = kernel_masks.masks, kernel_masks.counts
    planes = masks.shape[0] if masks.ndim == 4 else 0
    if (masks.dtype != jnp.uint32 or masks.shape != (planes, -(-k // 4), -(-n // 16), 2) or planes not in (1, 2)
            or counts.dtype != jnp.int32 or counts.shape != (planes, n)):
        raise ValueError(f"kernel_masks do not have the layout of formats.image_kernel_masks for K = {k}, N = {n}: "
                         f"masks {masks.dtype} {masks.shape}, counts {counts.dtype} {counts.shape}")
    return masks, counts


@functools.partial(jax.jit, static_argnames=("attrs", "shift", "pooled", "narrow", "keep_stream"))
def _image_conv2d(levels, kernel, threshold, flip, masks, counts, *, attrs, shift, pooled, narrow, keep_stream):
    """The checked op as one compiled function per static signature (as `_bmm`). Targets: the stream alone
    (`_i32` / `_i16`), the bits alone (`_bits`), both (`_i32_bits` / `_i16_bits`); where a platform has no
    handler of the call's own, its int32 stream (native where registered) with the rest in jnp."""
    c, n, kh, kw, sh, sw, pt, pb, pl, pr, ph, pw = attrs
    h, wd = levels.shape[1:3]
    oh, ow = ((h + pt + pb - kh) // sh + 1) // ph, ((wd + pl + pr - kw) // sw + 1) // pw
    bits = threshold is not None
    stream_dtype = jnp.int16 if narrow else jnp.int32
    out_types = []
    if not bits or keep_stream:
        out_types.append(((n,), stream_dtype))
    if bits:
        threshold = _saturate(jnp.asarray(threshold), _image_bound(kh * kw * c))
        flip = _flip_operand(flip, threshold.shape)
        out_types.append(((threshold.shape[0], formats.num_words(n)), jnp.uint32))
    if levels.shape[0] == 0:
        outs = tuple(jnp.zeros((0, oh, ow) + tail, dtype) for tail, dtype in out_types)
        return outs if len(outs) == 2 else outs[0]
    attr_values = {name: np.int64(v) for name, v in zip(_IMAGE_ATTRS, attrs)}
    if not bits or keep_stream:
        attr_values["shift"] = np.int64(shift)
    epilogue = (threshold, flip) if bits else ()
    stream_name = "i16" if narrow else "i32"
    target = "jaxbnn_image_conv2d_" + ("bits" if bits and not keep_stream else
                                       f"{stream_name}_bits" if bits else stream_name)
    geometry = dict(stride=(sh, sw), padding=((pt, pb), (pl, pr)), pool=(ph, pw) if pooled else None)

    # pixels: the handlers read them as they are, the reference takes their levels
    to_levels = formats.image_levels if levels.dtype == jnp.uint8 else (lambda x_: x_)

    def single(levels_, kernel_, *epi):
        types = tuple(jax.ShapeDtypeStruct((levels_.shape[0], oh, ow) + tail, dtype) for tail, dtype in out_types)
        out_type = types if len(types) == 2 else types[0]
        ref = lambda x_, w_, *e: reference.image_conv2d(  # noqa: E731
            to_levels(x_), w_, **geometry, shift=shift, out_dtype=stream_dtype, keep_stream=keep_stream,
            **dict(zip(("threshold", "flip"), e)))
        if target in ("jaxbnn_image_conv2d_i32", "jaxbnn_image_conv2d_bits"):
            return _dispatch(target, out_type, attr_values, ref, levels_, kernel_, *epi, cpu_only=2)

        def elsewhere(x_, w_, *e):  # the int32 stream, then the narrowing and the thresholds
            i32_type = jax.ShapeDtypeStruct(types[0].shape, jnp.int32)
            i32_attrs = {**attr_values, "shift": np.int64(shift)}
            i32_ref = lambda x2, w2: reference.image_conv2d(to_levels(x2), w2, **geometry, shift=shift)  # noqa: E731
            stream = _dispatch("jaxbnn_image_conv2d_i32", i32_type, i32_attrs, i32_ref, x_, w_, *epi[-2:],
                               cpu_only=2)
            return reference.image_epilogue(stream, out_dtype=stream_dtype,
                                            **dict(zip(("threshold", "flip"), e)), keep_stream=keep_stream)

        return _dispatch(target, out_type, attr_values, elsewhere, levels_, kernel_, *epi, cpu_only=2)

    # the kernel masks last: the CPU handlers take them after the kernel, the other branches not at all
    return _fold_rows(single)(levels, kernel, *epilogue, masks, counts)


MAX_IMAGE_REDUCTION = formats.MAX_IMAGE_REDUCTION


MAX_THRESHOLD_PLANES = 8  # of a threshold epilogue with planes: a ternary output uses 2
MAX_IMAGE_POOL_WINDOW = 128  # elements of a first layer's pool window: one tile of the CUDA kernel holds a window


def _threshold_planes(threshold, flip, n, bound):
    """`threshold` and `flip` of `image_conv2d` as (P, N) planes, host thresholds saturated to +-bound, and
    whether they were given as planes."""

    def saturated(t):
        if not (jnp.issubdtype(t.dtype, jnp.integer) or t.dtype == object):
            raise TypeError(f"threshold must be integer (the pre-activations are integers), got {t.dtype}")
        return t if isinstance(t, jax.Array) else _saturate_host(t.reshape(-1), bound).reshape(t.shape)

    return _planes(threshold, flip, n, saturated)


def _planes(threshold, flip, n, checked):
    """`threshold` (N,) or (P, N) with `flip` of its shape as (P, N) planes, the thresholds through `checked`,
    and whether they were given as planes."""
    threshold = formats.host_or_device(threshold)
    stacked = threshold.ndim == 2
    if threshold.ndim not in (1, 2) or threshold.shape[-1] != n or not (
            1 <= (threshold.shape[0] if stacked else 1) <= MAX_THRESHOLD_PLANES):
        raise ValueError(f"threshold must have shape ({n},) or (planes, {n}) with 1 to {MAX_THRESHOLD_PLANES} "
                         f"planes, one value per channel, got {threshold.shape}")
    threshold = checked(threshold)
    if flip is not None:
        flip = _flip_values(formats.host_or_device(flip))
        if flip.shape != threshold.shape:
            raise ValueError(f"flip must have the shape of threshold, {threshold.shape}, got {flip.shape}")
    if not stacked:
        threshold, flip = threshold[None], None if flip is None else flip[None]
    return threshold, flip, stacked


def _image_bound(k):
    """The saturation bound of a first layer's thresholds: its pre-activations lie in [-bound + 1, bound - 1]."""
    return 2**14 * k + 1


def _check_image_reduction(k):
    if k > MAX_IMAGE_REDUCTION:
        raise ValueError(f"{k} products per output: at most {MAX_IMAGE_REDUCTION} int8 products are sure to sum "
                         "within int32")


def _image_levels_operand(value, rank):
    """An image layer's input: int8 levels or uint8 pixels of rank `rank`, as given."""
    value = formats.host_or_device(value)
    if value.dtype not in (jnp.int8, jnp.uint8):
        raise TypeError(f"levels must be int8 levels or uint8 pixels, got dtype {value.dtype}")
    if value.ndim != rank:
        raise ValueError(f"levels must have rank {rank}, got shape {value.shape}")
    return value


def _int8(name, value, rank):
    value = formats.host_or_device(value)
    if value.dtype != jnp.int8:
        raise TypeError(f"{name} must be int8, got dtype {value.dtype}")
    if value.ndim != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {value.shape}")
    return value


def global_sum_bits(stream, threshold, flip=None):
    """Global sum pooling of an integer stream into the next layer's packed bits (a ResNet's pooled features):
    per sample and channel the int32 sum over the two spatial axes, wrapping as int32 arithmetic does, then
    `sum >= threshold` (`sum <= threshold` where `flip`).

    stream: int16 or int32 `(..., H, W, C)`, the residual stream. threshold: integers `(C,)`, or `(P, C)` for P
    planes (1 to `MAX_THRESHOLD_PLANES`: a ternary output's (nonneg, pos) pair is two), within int32 (the sums'
    type: a device array of a dtype within int32, host values within its range). flip: bools (or any integers,
    nonzero meaning set) of the threshold's shape; None: none set.
    Returns uint32 `(..., ceil(C/32))`, or `(..., P, ceil(C/32))` for threshold planes, padding bits 0.
    """
    stream = formats.host_or_device(stream)
    if stream.dtype not in (jnp.int16, jnp.int32):
        raise TypeError(f"stream must be the residual stream, int16 or int32, got dtype {stream.dtype}")
    if stream.ndim < 3 or stream.shape[-1] < 1:
        raise ValueError(f"stream must have shape (..., H, W, C) with C >= 1, got {stream.shape}")
    h, w, c = stream.shape[-3:]
    _positive_int("H * W", max(h * w, 1))
    threshold, flip, stacked = _planes(threshold, flip, c, lambda t: _int32_threshold(t, "the sums"))
    _check_elements("the stream", stream.shape)
    out = _global_sum_bits(stream, threshold, flip)
    return out if stacked else out[..., 0, :]


@jax.jit
def _global_sum_bits(stream, threshold, flip):
    """The checked op, compiled (as `_bmm`): one custom call over the samples folded into one batch axis."""
    threshold = threshold.astype(jnp.int32)
    flip = _flip_operand(flip, threshold.shape)
    leading, (h, w, c) = stream.shape[:-3], stream.shape[-3:]
    tail = (threshold.shape[0], formats.num_words(c))
    rows = stream.reshape((math.prod(leading), h, w, c))
    if rows.shape[0] == 0:
        return jnp.zeros(leading + tail, jnp.uint32)

    def single(x, t, f):
        out_type = jax.ShapeDtypeStruct((x.shape[0],) + tail, jnp.uint32)
        return _dispatch("jaxbnn_global_sum_bits", out_type, {}, reference.global_sum_bits, x, t, f)

    return _fold_rows(single)(rows, threshold, flip).reshape(leading + tail)


def pool_threshold_bits(bits, pool, flip_words):
    """Max-pool of threshold bits over `pool` windows (window = stride, no padding; rows and columns past the
    last whole window dropped), as `bconv2d(..., pool=pool, threshold=..., flip=...)` pools its dots before
    the test: the threshold test is monotone in the dot, so a window's bit is the OR of its bits, or their
    AND in the columns whose bit is set in `flip_words` (there each bit is the test's complement).

    bits: uint32 `(B, H, W, words)`, an unpooled threshold output. flip_words: uint32 `(words,)`, the
    `flip` vector packed (`formats.pack_bits(flip != 0)`). Returns uint32 `(B, H // PH, W // PW, words)`.
    """
    bits = _packed("bits", bits, min_rank=4)
    if bits.ndim != 4:
        raise ValueError(f"bits must be (B, H, W, words), got shape {bits.shape}")
    ph, pw = _pair("pool", pool)
    b, h, w, words = bits.shape
    if h < ph or w < pw:
        raise ValueError(f"pool {pool} is larger than the {h}x{w} bits")
    flip_words = _packed("flip_words", flip_words, min_rank=1)
    if flip_words.shape != (words,):
        raise ValueError(f"flip_words must have shape ({words},), got {flip_words.shape}")
    windows = bits[:, : h // ph * ph, : w // pw * pw].reshape(b, h // ph, ph, w // pw, pw, words)
    parts = [windows[:, :, i, :, j] for i in range(ph) for j in range(pw)]
    any_set, all_set = functools.reduce(jnp.bitwise_or, parts), functools.reduce(jnp.bitwise_and, parts)
    any_set, all_set, flip_words = formats.same_rank(any_set, all_set, flip_words)
    return (any_set & ~flip_words) | (all_set & flip_words)


# --- dispatch -------------------------------------------------------------------------------------


def side_by_side_weights(w, *, ternary_activations, threshold_planes=0, shortcut=False):
    """The weights a ternary or mixed product runs as on a platform without kernels of its own (CUDA):
    binary weights of one ±1 product over the planes side by side along the reduction (docs/ops.md), a
    `formats.DenseBits` (from `DenseBits` / `TernaryDenseBits`) or `formats.ConvBits` (from `ConvBits` /
    `TernaryConvBits`) of 2 or 4 times the reduction and N columns (a dense TNN product where three blocks are
    shorter: 3 times the reduction rounded up to 512 bits a block, the first two blocks' counts doubled, each
    column's popcount half the doubled product's range; a TNN convolution likewise where `_takes_doubled_conv`, its
    reduction every tap's two doubled blocks, then every tap's third), and the kernels' bit epilogue writes up to two
    threshold planes (a ternary output) from one product. For more planes, or planes whose columns all fit one
    128-column tile, `threshold_planes * 32 ceil(N/32)` columns, each plane's weights again. `bmm` / `bconv2d`
    build them on every call unless given them (`side_by_side=`): build them once where weights stay
    (`jaxbnn.runtime` does at load).

    ternary_activations: whether the product's activations are ternary (`TernaryPlanes`); threshold_planes:
    the threshold planes (`P` of a `(P, N)` threshold, 2 for a ternary output) the calls will take, 0 for a
    threshold of shape (N,), the affine or the int32 epilogue; shortcut: whether the calls are a residual
    convolution's (`bconv2d(..., shortcut=...)`), which runs the four blocks."""
    if not isinstance(w, (DenseBits, ConvBits, TernaryDenseBits, TernaryConvBits)):
        raise TypeError(f"side_by_side_weights takes formats.DenseBits, ConvBits, TernaryDenseBits or TernaryConvBits, "
                        f"got {type(w).__name__}")
    ternary_weights = isinstance(w, (TernaryDenseBits, TernaryConvBits))
    mode = _mode(bool(ternary_activations), ternary_weights)
    if mode == "bnn":
        raise ValueError("binary activations times binary weights run as they are: side_by_side_weights is for a "
                         "product with a ternary operand")
    if not _is_int(threshold_planes) or not 0 <= threshold_planes <= MAX_THRESHOLD_PLANES:
        raise ValueError(f"threshold_planes must be an integer in [0, {MAX_THRESHOLD_PLANES}], got {threshold_planes!r}")
    rows = 2 if ternary_weights else 1
    if isinstance(w, (ConvBits, TernaryConvBits)):
        kh, kw = w.kernel_size
        c, o = w.in_channels, w.out_channels
        if _takes_doubled_conv(mode, c, kh * kw) and not shortcut:
            taps, cw = kh * kw, formats.num_words(c)
            matrix = formats.from_fsb(w.bits, 2 * o, taps * cw * formats.WORD_BITS)
            bits, counts = _doubled_conv_weights(matrix, c=c, o=o, taps=taps, threshold_planes=threshold_planes)
            return ConvBits(bits, counts, kernel_size=(kh, kw), in_channels=_doubled_conv_channels(c),
                            out_channels=_side_by_side_columns(o, threshold_planes))
        bits, counts = _conv_side_by_side_weights(mode, w.bits, jnp.asarray(w.tap_popcount), c=c, o=o, taps=kh * kw,
                                                  threshold_planes=threshold_planes)
        return ConvBits(bits, counts, kernel_size=(kh, kw), in_channels=_side_by_side_channels(mode, c),
                        out_channels=_side_by_side_columns(o, threshold_planes))
    k, n = w.k, w.n
    matrix = formats.from_fsb(w.bits, rows * n, k)
    if _takes_doubled_blocks(mode, k):
        bits, counts = _doubled_matrix(matrix, k=k, n=n, threshold_planes=threshold_planes)
    else:
        bits, counts = _side_by_side_matrix(mode, matrix, jnp.asarray(w.popcount)[None], o=n, c=k,
                                            threshold_planes=threshold_planes)
        counts = counts[0]
    return DenseBits(bits, counts, k=_dense_side_by_side_channels(mode, k), n=_side_by_side_columns(n, threshold_planes))


def _check_side_by_side(side_by_side, kind, mode, threshold_planes, geometry):
    """`side_by_side` given to an op: weights of that kind and geometry, for a product with a ternary operand."""
    if side_by_side is None:
        return
    if mode == "bnn":
        raise ValueError("side_by_side weights belong to a product with a ternary operand; this one is binary")
    if not isinstance(side_by_side, kind):
        raise TypeError(f"side_by_side must be the formats.{kind.__name__} of side_by_side_weights, got "
                        f"{type(side_by_side).__name__}")
    got = {name: getattr(side_by_side, name) for name in geometry}
    if got != geometry:
        raise ValueError(f"side_by_side has {got}; this call's product ({mode}, {threshold_planes} threshold planes) "
                         f"needs {geometry}: side_by_side_weights(weights, ternary_activations="
                         f"{mode in ('tnn', 'tbn')}, threshold_planes={threshold_planes})")


# A product with a ternary operand as one ±1 product over a longer reduction (docs/ops.md): per mode, the
# blocks of that reduction as (activation plane, weight plane, whether the weight block's padding bits are set)
# of each block; the planes as `TernaryPlanes` / the ternary weights' rows order them, (nonneg, pos). The
# activation blocks are the operand's planes in order, repeated (`_side_by_side_operands`): a ternary operand's
# pair as a kernel's epilogue wrote it, `(..., 2, W)`, is then its first two blocks as they lie.
_REDUCTION_BLOCKS = {
    "tbn": ((0, 0, False), (1, 0, True)),
    "btn": ((0, 0, False), (0, 1, True)),
    "tnn": ((0, 0, False), (1, 0, True), (0, 1, False), (1, 1, True)),
}
# The longest reduction the CUDA kernels take, in words (kMaxReductionWords in xla_ffi/cuda/binary_gemm.h).
_KERNEL_REDUCTION_WORDS = 1 << 16
# The threshold planes the CUDA bit epilogue writes from one product (kMaxBitsPlanes): a ternary output's two.
# More planes run as columns side by side, each plane's weights again; so do planes whose columns all fit the
# narrowest tile (`_NARROW_TILE_COLUMNS`), which computes them at no extra cost: there the planes' longer
# epilogue made ResNet-18's 56 x 56 x 64 layer slower (docs/design/decisions.md).
_KERNEL_BITS_PLANES = 2
_NARROW_TILE_COLUMNS = 128


def _planes_as_columns(threshold_planes, n):
    """The threshold planes the side-by-side product of `n` columns runs as columns side by side (0: none,
    the bit epilogue writes them as planes)."""
    columns = threshold_planes * formats.num_words(n) * formats.WORD_BITS
    return threshold_planes if threshold_planes > _KERNEL_BITS_PLANES or columns <= _NARROW_TILE_COLUMNS else 0


def _native_planes(threshold_planes, n):
    """The threshold planes the side-by-side binary product takes as planes (0: as columns, or none)."""
    return 0 if _planes_as_columns(threshold_planes, n) else threshold_planes


def _side_by_side_fits(mode, reduction_words, n, threshold_planes):
    """Whether the side-by-side product's reduction and columns fit the binary kernels."""
    columns = max(_planes_as_columns(threshold_planes, n), 1) * formats.num_words(n) * formats.WORD_BITS
    return len(_REDUCTION_BLOCKS[mode]) * reduction_words <= _KERNEL_REDUCTION_WORDS and columns <= MAX_EXTENT


def _side_by_side_matrix(mode, matrix, popcount, *, o, c, threshold_planes):
    """The weights of one binary product equal to `parts` times a ternary or mixed one.

    A ternary value is the mean of the ±1 values of its (nonneg, pos) bits, so the product of two vectors is
    the sum of `parts` = 2 (TBN, BTN) or 4 (TNN) ±1 products of their planes, divided by `parts`. Placed side
    by side along the reduction (per tap: every block holds a tap's `cw` channel words), those products are one
    ±1 product: one accumulator, the binary kernels' pool and epilogues. The padding bits of each block (past
    `c`) are 0 in the activations and, in the weights, 0 in half the blocks and 1 in the other half, so their
    ±1 products cancel; "zero" padding excludes every block of an outside tap, "one" padding makes each of
    its activation bits 0 (-1 in every plane), exactly as the ternary product pads. Where every block fits
    one word together (`_dense_blocks`: `parts * c <= 32`, a layer of a few channels) the blocks lie channel
    after channel in that word instead, `parts * c` channels with no padding between them.

    matrix: the weight rows `(planes * o, taps * cw)`; popcount: `(taps, planes * o)`. Threshold planes come from
    the binary kernels' bit epilogue, out of one product, except where `_planes_as_columns`: there they become
    `planes * 32 ceil(o / 32)` columns (each plane's weights again, its padding columns never set), so
    one bit epilogue writes every plane's words in place. Returns (FSB tiles, tap popcounts `(taps, columns)`)."""
    blocks = _REDUCTION_BLOCKS[mode]
    taps = popcount.shape[0]
    cw = matrix.shape[-1] // taps
    real = jnp.asarray(_real_bit_mask(cw, c))
    planes = matrix.reshape(-1, o, taps, cw)
    real = real.reshape((1,) * (planes.ndim - 2) + real.shape)  # per tap word, spelled out (rank promotion)
    counts = popcount.reshape(taps, -1, o).astype(jnp.int32)
    counts = sum(counts[:, p] for _, p, _ in blocks)
    if _dense_blocks(mode, c):
        w = functools.reduce(jnp.bitwise_or, [(planes[p] & real) << (j * c) for j, (_, p, _) in enumerate(blocks)])
    else:
        w = jnp.concatenate([planes[p] & real | (~real if ones else 0) for _, p, ones in blocks], axis=-1)
        counts = counts + sum(ones for _, _, ones in blocks) * (cw * formats.WORD_BITS - c)
    threshold_planes = _planes_as_columns(threshold_planes, o)
    if threshold_planes:
        pad = formats.num_words(o) * formats.WORD_BITS - o
        w = jnp.tile(jnp.pad(w, ((0, pad), (0, 0), (0, 0))), (threshold_planes, 1, 1))
        counts = jnp.tile(jnp.pad(counts, ((0, 0), (0, pad))), (1, threshold_planes))
    return formats.to_fsb(w.reshape(w.shape[0], -1)), counts


def _conv_side_by_side_weights(mode, w, tap_popcount, *, c, o, taps, threshold_planes):
    """`_side_by_side_matrix` of a convolution's weights as the ops take them: FSB tiles (or the bit matrix) of
    `o` (binary) or `2o` (ternary) rows over `taps` taps of `c` channels, and their tap popcounts (None: counted
    here)."""
    cw = formats.num_words(c)
    k_bits, rows = taps * cw * formats.WORD_BITS, 2 * o if mode in ("btn", "tnn") else o
    tiles = formats.to_fsb(w) if w.ndim == 2 else w
    if tap_popcount is None:
        tap_popcount = _real_bit_popcount(tiles, rows=rows, k_bits=k_bits, taps=(taps, cw, c))
    return _side_by_side_matrix(mode, formats.from_fsb(tiles, rows, k_bits), tap_popcount, o=o, c=c,
                                threshold_planes=threshold_planes)


def _conv_side_by_side_channels(mode, c, taps, side_by_side=None):
    """The channels of a convolution's side-by-side weights (`side_by_side_weights`): the three doubled blocks' where
    the product takes them, else the blocks'; a shortcut's four blocks (given for a residual convolution, which takes
    no other, and which a plain one takes too)."""
    four = _side_by_side_channels(mode, c)
    if side_by_side is not None and getattr(side_by_side, "in_channels", None) == four:
        return four
    return _doubled_conv_channels(c) if _takes_doubled_conv(mode, c, taps) else four


def _dense_blocks(mode, c):
    """Whether the side-by-side blocks of `c` channels lie channel after channel in one word (`parts * c <= 32`)
    rather than in word-aligned blocks of `32 ceil(c / 32)` bits each: a first layer on 3 colour channels then
    reduces 4 * 3 bits a tap (TNN), not 4 * 32, and runs on the binary kernels' dense-tap engine."""
    return len(_REDUCTION_BLOCKS.get(mode, ())) * c <= formats.WORD_BITS


def _side_by_side_channels(mode, c):
    """The channels of the side-by-side product (its reduction bits per tap) of a product over `c` channels."""
    parts = len(_REDUCTION_BLOCKS.get(mode, ()))
    return parts * c if _dense_blocks(mode, c) else parts * formats.num_words(c) * formats.WORD_BITS


def _side_by_side_columns(o, threshold_planes):
    planes = _planes_as_columns(threshold_planes, o)
    return planes * formats.num_words(o) * formats.WORD_BITS if planes else o


def _real_bit_mask(cw, c):
    """uint32 (cw,): the real bits of a tap's `cw` channel words holding `c` channels."""
    real = np.full(cw, 0xFFFFFFFF, np.uint32)
    if c % formats.WORD_BITS:
        real[-1] = (1 << c % formats.WORD_BITS) - 1
    return real


# A dense TNN product in three blocks instead of four (docs/ops.md): with P = [t = +1], N = [t = -1] and Z = [t != 0]
# of the activations and P, N and E = [t = 0] of the weights, the AND-popc counts of the blocks (P, P), (N, N) and
# (Z, E), the first two doubled (BinaryGemmProblem::doubled_k_blocks), make the binary kernels' dot product
# R - 2 popc(a) - 2 popc(b) + 4 (2 (S_PP + S_NN) + S_ZE) equal 4 t_a . t_b when every weight column's popcount is
# given as R / 2 (R: `_doubled_range`): position by position (each block's padding bits are 0 in the activations)
# -2 popc(a) + 4 (...) is 4 t_a t_b for every pair of values. Each block takes a whole number of half K blocks, so
# that the doubled pair ends on a K block.
_DOUBLED_BLOCK_BITS = 512
_DOUBLED_SPLIT_BITS = 1024  # a K block of the CUDA kernels (kKBlockWords)
_DOUBLED_REDUCTION_WORDS = 1 << 15  # the bmm_doubled handlers' longest reduction
_DOUBLED_PARTS = 4  # the product is 4 times the ternary one, as the four-block form's


def _doubled_block_words(k):
    return -(-k // _DOUBLED_BLOCK_BITS) * (_DOUBLED_BLOCK_BITS // formats.WORD_BITS)


def _takes_doubled_blocks(mode, k):
    """Whether a dense product over `k` runs as the three doubled blocks: TNN, where they are shorter than the four
    word-aligned blocks (each doubled block takes whole 512-bit halves of a K block: k from 385 to 512, 769 to
    1024, and most k past 1024), within the bmm_doubled handlers' longest reduction (2^15 words: `_doubled_range`)."""
    words = 3 * _doubled_block_words(k)
    return mode == "tnn" and words < 4 * formats.num_words(k) and words <= _DOUBLED_REDUCTION_WORDS


def _dense_side_by_side_channels(mode, k):
    """The reduction bits of a dense side-by-side product over `k`: the three doubled blocks, or the blocks."""
    if _takes_doubled_blocks(mode, k):
        return 3 * _doubled_block_words(k) * formats.WORD_BITS
    return _side_by_side_channels(mode, k)


def _doubled_fits(k, n, threshold_planes):
    """Whether the three-block product's columns fit the binary kernels."""
    columns = max(_planes_as_columns(threshold_planes, n), 1) * formats.num_words(n) * formats.WORD_BITS
    return columns <= MAX_EXTENT


def _doubled_range(reduction_bits, doubled_k_blocks):
    """R, the k_real of a doubled product over K bits (the CUDA handlers'): 2 (D + K), D the doubled bits, so that
    R - 2 popc(a) + 4 (2 S_1 + S_2) lies in [-R, 3 R] as the threshold epilogues assume."""
    return 2 * (doubled_k_blocks * _DOUBLED_SPLIT_BITS + reduction_bits)


def _doubled_matrix(matrix, *, k, n, threshold_planes):
    """The three-block TNN weights (P | N | E per column, each block zero-padded to `_doubled_block_words(k)`) of
    ternary weight rows `(2n, ceil(k / 32))` (nonneg rows, then pos rows), as FSB tiles, and the columns'
    popcounts (every one half of `_doubled_range`); planes as columns as `_side_by_side_matrix` lays them."""
    real = jnp.asarray(_real_bit_mask(matrix.shape[-1], k))[None]  # per row, spelled out (rank promotion)
    nonneg, pos = matrix[:n] & real, matrix[n:] & real
    block = _doubled_block_words(k)
    pad = ((0, 0), (0, block - matrix.shape[-1]))
    w = jnp.concatenate([jnp.pad(plane, pad) for plane in (pos, ~nonneg & real, nonneg & ~pos)], axis=-1)
    threshold_planes = _planes_as_columns(threshold_planes, n)
    columns = n
    if threshold_planes:
        columns = threshold_planes * formats.num_words(n) * formats.WORD_BITS
        w = jnp.tile(jnp.pad(w, ((0, columns // threshold_planes - n), (0, 0))), (threshold_planes, 1))
    counts = jnp.full((columns,), _doubled_range(3 * block * formats.WORD_BITS, 2 * block // 32) // 2, jnp.int32)
    return formats.to_fsb(w), counts


def _doubled_activations(acts, k):
    """The three-block TNN activations (P | N | Z per row or pixel, each block zero-padded) of the (nonneg, pos)
    planes over `k` values."""
    nonneg, pos = (_clear_padding_bits(a, k) for a in _materialized(acts))
    real = jnp.asarray(_real_bit_mask(nonneg.shape[-1], k))
    real = real.reshape((1,) * (nonneg.ndim - 1) + real.shape)  # per row or pixel, spelled out (rank promotion)
    # the values (a + b) / 2 of any bits: a pos bit without its nonneg bit is 0, neither +1 nor -1
    plus, minus = pos & nonneg, ~nonneg & ~pos & real
    pad = ((0, 0),) * (nonneg.ndim - 1) + ((0, _doubled_block_words(k) - nonneg.shape[-1]),)
    return jnp.concatenate([jnp.pad(plane, pad) for plane in (plus, minus, plus | minus)], axis=-1)


def _tnn_doubled_bmm(acts, b, prepared, epilogue, *, k, n, kind, threshold_planes):
    """A dense TNN product as the three-block binary product with its first two blocks doubled."""
    if prepared:
        blocks, counts = prepared
    else:
        blocks, counts = _doubled_matrix(formats.from_fsb(b, 2 * n, k), k=k, n=n, threshold_planes=threshold_planes)
    block = _doubled_block_words(k)
    reduction_bits = 3 * block * formats.WORD_BITS
    x = _doubled_activations(acts, k)
    columns = _side_by_side_columns(n, threshold_planes)
    # (a padding column's threshold past the doubled product's range: its bits stay 0)
    epilogue = _scaled_epilogue(epilogue, kind=kind, parts=_DOUBLED_PARTS, bound=k + 1,
                                threshold_planes=threshold_planes,
                                reduction_bits=_doubled_range(reduction_bits, 2 * block // 32))
    out = _doubled_binary_bmm(x, blocks, counts, epilogue, k=reduction_bits, n=columns, kind=kind,
                              doubled_k_blocks=2 * block // 32)
    return _side_by_side_result(out, "tnn", kind, threshold_planes, n)  # 4 times the ternary product, as four blocks


def _doubled_binary_bmm(x, b, popcount, epilogue, *, k, n, kind, doubled_k_blocks):
    """The binary product whose first `doubled_k_blocks` K blocks of 1024 bits count twice: k - 2 popc(a) -
    2 popcount + 4 (2 S_1 + S_2), S_1 and S_2 the AND-popc counts before and after them, with the epilogue; CUDA's
    `bmm_doubled` handlers, else the same integers in jnp."""
    rows = x.shape[0]
    tail, out_dtype = _epilogue_tail(kind, n, 0 if kind != "bits" or epilogue["threshold"].ndim == 1
                                     else epilogue["threshold"].shape[0]), _epilogue_output(kind, n)[1]
    out_type = jax.ShapeDtypeStruct((rows,) + tail, out_dtype)
    epi = _epilogue_operands(kind, epilogue, n, _doubled_range(k, doubled_k_blocks) + 1)
    attrs = dict(k=np.int64(k), n=np.int64(n), doubled_k_blocks=np.int64(doubled_k_blocks))
    split = doubled_k_blocks * _DOUBLED_SPLIT_BITS
    k_range = _doubled_range(k, doubled_k_blocks)

    def spec(a_, b_, popcount_, *e):
        a_bits = formats.unpack_bits(a_, k).astype(jnp.int32)
        b_bits = formats.unpack_bits(formats.from_fsb(b_, n, k), k).astype(jnp.int32)
        dot = lambda lo, hi: jnp.matmul(a_bits[:, lo:hi], b_bits[:, lo:hi].T,  # noqa: E731
                                        preferred_element_type=jnp.int32)
        sums = 2 * dot(0, split) + dot(split, k)
        d = k_range - 2 * a_bits.sum(-1, dtype=jnp.int32)[:, None] - 2 * popcount_[None, :] + 4 * sums
        return reference.epilogue(d, **dict(zip(epi, e)))

    return _dispatch(f"jaxbnn_bmm_doubled_{kind}", out_type, attrs, spec, x, b, popcount, *epi.values(),
                     cuda_weights=lambda b_: _default_tiles(b_, n, k))


# A TNN convolution in three blocks a tap, as the dense product's: each pixel's [P | N | Z] against each tap's
# [P | N | E], the reduction ordered every tap's doubled blocks (P | N) first, then every tap's third block
# (CUDA's DoubledTapWords), so that the doubled part ends on a K block and the kernels double their accumulators
# once. Each tap's real count is 2 (D + 3 block bits) (D = its doubled bits) and every tap's popcount half of it:
# then an out-of-frame tap ("zero" padding: its activation bits 0) adds 0, and every value is 4 times the
# ternary convolution's. It runs where the four blocks' reduction is past what the resident kernel keeps in
# shared memory (`_DOUBLED_CONV_MIN_BITS`), so that the persistent kernel runs either form: 3 blocks' tensor-core
# work instead of 4, for an XLA pass that forms the three blocks from the two planes.
_DOUBLED_CONV_MIN_BITS = 12 * 1024


def _takes_doubled_conv(mode, c, taps):
    """Whether a convolution over `c` channels and `taps` taps runs as the three doubled blocks (where the pad value
    allows: "zero", or no padding)."""
    if mode != "tnn" or _dense_blocks(mode, c):
        return False
    block, cw = _doubled_block_words(c), formats.num_words(c)
    return (3 * block < 4 * cw and taps * 4 * cw * formats.WORD_BITS > _DOUBLED_CONV_MIN_BITS
            and taps * 3 * block <= _DOUBLED_REDUCTION_WORDS)


def _doubled_conv_channels(c):
    """The reduction bits a tap of the three doubled blocks over `c` channels."""
    return 3 * _doubled_block_words(c) * formats.WORD_BITS


def _doubled_tap_range(c):
    """A doubled convolution's real count per tap (the CUDA handlers' `c`): 2 (D + 3 block bits)."""
    block_bits = _doubled_block_words(c) * formats.WORD_BITS
    return 2 * (2 * block_bits + 3 * block_bits)


def _doubled_conv_weights(matrix, *, c, o, taps, threshold_planes):
    """The three-block TNN convolution weights of ternary weight rows `(2o, taps * ceil(c / 32))` (nonneg rows, then
    pos rows): per column every tap's P | N blocks, then every tap's E block, each zero-padded to
    `_doubled_block_words(c)`, as FSB tiles, and the tap popcounts `(taps, columns)`, every one half of
    `_doubled_tap_range(c)`; planes as columns as `_side_by_side_matrix` lays them."""
    cw = formats.num_words(c)
    real = jnp.asarray(_real_bit_mask(cw, c)).reshape(1, 1, cw)  # per tap word, spelled out (rank promotion)
    planes = matrix.reshape(2, o, taps, cw) & real[None]
    nonneg, pos = planes[0], planes[1]
    block = _doubled_block_words(c)
    pad = ((0, 0), (0, 0), (0, block - cw))
    p_, n_, e_ = (jnp.pad(plane, pad) for plane in (pos, ~nonneg & real, nonneg & ~pos))
    w = jnp.concatenate([jnp.concatenate([p_, n_], axis=-1).reshape(o, -1), e_.reshape(o, -1)], axis=-1)
    columns = o
    planes_as_columns = _planes_as_columns(threshold_planes, o)
    if planes_as_columns:
        columns = planes_as_columns * formats.num_words(o) * formats.WORD_BITS
        w = jnp.tile(jnp.pad(w, ((0, columns // planes_as_columns - o), (0, 0))), (planes_as_columns, 1))
    counts = jnp.full((taps, columns), _doubled_tap_range(c) // 2, jnp.int32)
    return formats.to_fsb(w), counts


def _tnn_doubled_conv(acts, w, prepared, epilogue, *, attrs, kind, pooled, threshold_planes):
    """A TNN convolution as the three-block binary convolution with every tap's first two blocks doubled."""
    c, o, kh, kw = attrs[:4]
    taps, cw = kh * kw, formats.num_words(c)
    if prepared:
        blocks, counts = prepared
    else:
        blocks, counts = _doubled_conv_weights(formats.from_fsb(w, 2 * o, taps * cw * formats.WORD_BITS), c=c, o=o,
                                               taps=taps, threshold_planes=threshold_planes)
    x = _doubled_activations(acts, c)
    columns = _side_by_side_columns(o, threshold_planes)
    # (a padding column's threshold past the doubled product's range: its bits stay 0)
    epilogue = _scaled_epilogue(epilogue, kind=kind, parts=_DOUBLED_PARTS, bound=taps * c + 1,
                                threshold_planes=threshold_planes, reduction_bits=taps * _doubled_tap_range(c))
    block = _doubled_block_words(c)
    out = _doubled_binary_conv(x, blocks, counts, epilogue, attrs=(_doubled_conv_channels(c), columns) + attrs[2:],
                               kind=kind, pooled=pooled, doubled_tap_words=2 * block)
    return _side_by_side_result(out, "tnn", kind, threshold_planes, o)  # 4 times the ternary product, as four blocks


def _doubled_binary_conv(x, w, tap_popcount, epilogue, *, attrs, kind, pooled, doubled_tap_words):
    """The binary convolution (B, H, W, cw) over `c = 32 cw` channels whose every tap's first `doubled_tap_words`
    words count twice, its reduction every tap's doubled words, then every tap's others (`w`'s order): per output
    pixel and column, over the taps in frame, tap_c - 2 popc(a) - 2 tap_popcount + 4 (2 S_1 + S_2), S_1 and S_2
    the AND-popc counts of the doubled words and of the others, tap_c = 2 (32 doubled_tap_words + c); "zero"
    padding only. Then pool and epilogue. CUDA's `bconv2d_doubled` handlers, else the same integers in jnp."""
    c, o, kh, kw, sh, sw, pt, pb, pl, pr, _, ph, pw = attrs
    taps, cw = kh * kw, c // formats.WORD_BITS
    tap_c = 2 * (doubled_tap_words * formats.WORD_BITS + c)
    threshold_planes = 0 if kind != "bits" or epilogue["threshold"].ndim == 1 else epilogue["threshold"].shape[0]
    tail, out_dtype = _epilogue_tail(kind, o, threshold_planes), _epilogue_output(kind, o)[1]
    h, wd = x.shape[1:3]
    conv_hw = ((h + pt + pb - kh) // sh + 1, (wd + pl + pr - kw) // sw + 1)
    out_hw = (conv_hw[0] // ph, conv_hw[1] // pw) if pooled else conv_hw
    epi = _epilogue_operands(kind, epilogue, o, taps * tap_c + 1)
    chunk = _KERNEL_INDEX_LIMIT // max(h * wd * cw, conv_hw[0] * conv_hw[1] * o * max(threshold_planes, 1))
    if 1 <= chunk < x.shape[0]:
        outs = [_doubled_binary_conv(x[i:i + chunk], w, tap_popcount, epilogue, attrs=attrs, kind=kind,
                                     pooled=pooled, doubled_tap_words=doubled_tap_words)
                for i in range(0, x.shape[0], chunk)]
        return jnp.concatenate(outs)
    pool_hw = (ph, pw) if pooled else (1, 1)
    conv_attrs = dict(zip(_CONV_ATTRS, (c, o, kh, kw, sh, sw, pt, pb, pl, pr, False) + pool_hw))
    conv_attrs = {name: v if name == "pad_one" else np.int64(v) for name, v in conv_attrs.items()}
    conv_attrs.update(x_repeats=np.int64(1), doubled_tap_words=np.int64(doubled_tap_words))
    out_type = jax.ShapeDtypeStruct((x.shape[0],) + out_hw + tail, out_dtype)
    doubled_bits = doubled_tap_words * formats.WORD_BITS

    def spec(x_, w_, popcount_, *e):
        x_bits = formats.unpack_bits(x_, c).astype(jnp.int32)
        x_bits = jnp.pad(x_bits, ((0, 0), (pt, pb), (pl, pr), (0, 0)))  # "zero": out-of-frame bits 0
        inside = jnp.pad(jnp.ones((1, h, wd, 1), jnp.int32), ((0, 0), (pt, pb), (pl, pr), (0, 0)))
        rows = formats.unpack_bits(formats.from_fsb(w_, o, taps * c), taps * c).astype(jnp.int32)
        doubled = rows[:, :taps * doubled_bits].reshape(o, taps, doubled_bits)
        others = rows[:, taps * doubled_bits:].reshape(o, taps, c - doubled_bits)
        dot = jnp.zeros((x_.shape[0],) + conv_hw + (o,), jnp.int32)
        for t in range(taps):
            i, j = divmod(t, kw)
            window = lambda v: jax.lax.slice(v, (0, i, j, 0), (v.shape[0], i + sh * (conv_hw[0] - 1) + 1,  # noqa: E731
                                                                  j + sw * (conv_hw[1] - 1) + 1, v.shape[3]),
                                             (1, sh, sw, 1))
            bits, frame = window(x_bits), window(inside)
            products = lambda a, b: jax.lax.dot_general(a, b, (((3,), (1,)), ((), ())),  # noqa: E731
                                                        preferred_element_type=jnp.int32)
            sums = 2 * products(bits[..., :doubled_bits], doubled[:, t]) + products(bits[..., doubled_bits:],
                                                                                     others[:, t])
            dot = dot + frame * (tap_c - 2 * popcount_[t][None, None, None, :]) - 2 * bits.sum(
                -1, keepdims=True, dtype=jnp.int32) + 4 * sums
        if pooled:
            dot = reference.max_pool(dot, (ph, pw))
        return reference.epilogue(dot, **dict(zip(epi, e)))

    cuda = None
    target = f"jaxbnn_bconv2d_doubled_{kind}"
    if kind == "bits" and pooled and ph * pw > 1:
        # as `_bconv2d`'s pooled threshold convolutions on CUDA: unpooled, its bits pooled after
        unpooled = jax.ShapeDtypeStruct((x.shape[0],) + conv_hw + tail, out_dtype)
        flat = dict(conv_attrs, pool_h=np.int64(1), pool_w=np.int64(1))

        def cuda(x_, w_, popcount_, threshold_, flip_):
            bits = _ffi_call(target, unpooled, x_, w_, popcount_, threshold_, flip_, **flat)
            words = formats.pack_bits(flip_ != 0).reshape(-1)
            pooled_bits = pool_threshold_bits(bits.reshape(bits.shape[:3] + (-1,)), (ph, pw), words)
            return pooled_bits.reshape(pooled_bits.shape[:3] + tail)
    return _dispatch(target, out_type, conv_attrs, spec, x, w, tap_popcount, *epi.values(), cuda=cuda,
                     cuda_weights=lambda w_: _default_tiles(w_, o, taps * c))


def _side_by_side_operands(mode, acts, epilogue, *, kind, c, bound, threshold_planes, reduction_bits,
                           read_twice=False):
    """The activations and epilogue operands of the binary product of `_side_by_side_matrix`: the planes side by
    side, the threshold times `parts` (saturated first), the scale divided by it (a power of two: exact), the
    threshold planes' padding columns given a threshold past every product (`reduction_bits`), so their bits
    stay 0. read_twice: where the blocks repeat the planes (TNN, BTN) and a pixel's planes are whole 16-byte
    chunks, the planes once, which the convolution reads twice a tap (its `x_repeats`), instead of their copy.
    Returns (activations, epilogue, x_repeats)."""
    blocks = _REDUCTION_BLOCKS[mode]
    parts = len(blocks)
    x_repeats = 1
    if _dense_blocks(mode, c):
        acts = _materialized(acts)
        x = functools.reduce(jnp.bitwise_or, [_clear_padding_bits(acts[a], c) << (j * c)
                                              for j, (a, _, _) in enumerate(blocks)])
    else:
        # The planes stacked, (..., planes, W), and read as one row of words: where an epilogue wrote the pair
        # that way (a ternary output), XLA's simplifier folds the stack of its slices back into that array, so
        # the operand is the kernel's output as it lies (the barrier on the row: on the stacked pair, XLA copied
        # it); the blocks past the planes repeat them (TNN, BTN: one copy, or the kernel reading them twice).
        planes = jnp.stack([_clear_padding_bits(a, c) for a in acts], axis=-2)
        x = _materialized(planes.reshape(planes.shape[:-2] + (len(acts) * planes.shape[-1],)))
        repeats = parts // len(acts)
        # The tensor-core kernels take a pixel in 16-byte chunks: read twice, a pixel of 8 bytes (BTN's C = 64
        # input) left the band kernel for the persistent one's 8-byte copies, BTN ResNet-18 1.7x slower (H200).
        if read_twice and x.shape[-1] % 4 == 0:
            x_repeats = repeats
        elif repeats > 1:
            x = jnp.concatenate([x] * repeats, axis=-1)
    epilogue = _scaled_epilogue(epilogue, kind=kind, parts=parts, bound=bound, threshold_planes=threshold_planes,
                                reduction_bits=reduction_bits)
    return x, epilogue, x_repeats


def _scaled_epilogue(epilogue, *, kind, parts, bound, threshold_planes, reduction_bits):
    """The epilogue operands of a binary product equal to `parts` times the product's: the threshold times `parts`
    (saturated first), the scale divided by it (a power of two: exact), the threshold planes' padding columns
    given a threshold past every product (`reduction_bits`), so their bits stay 0."""
    if kind == "f32":
        return dict(epilogue, scale=epilogue["scale"] / parts)
    if kind != "bits":
        return epilogue
    threshold = jnp.clip(epilogue["threshold"], -bound, bound) * parts
    epilogue = dict(epilogue, threshold=threshold)
    if _planes_as_columns(threshold_planes, threshold.shape[-1]):
        o = threshold.shape[-1]
        pad = formats.num_words(o) * formats.WORD_BITS - o
        threshold = jnp.pad(threshold, ((0, 0), (0, pad)), constant_values=reduction_bits + 1)
        flip = jnp.pad(epilogue["flip"], ((0, 0), (0, pad)))
        epilogue = dict(threshold=threshold.reshape(-1), flip=flip.reshape(-1))
    return epilogue


def _planes_side_by_side(acts):
    """Ternary activations as the CPU's ternary kernels take them: one array (..., 2, words), each row's (or
    pixel's) nonneg words then its pos words. Where a threshold epilogue of two planes wrote them, XLA folds this
    stack of its output's slices back into that output: the kernel reads it as it lies, no copy."""
    return jnp.stack(acts, axis=-2)


def _materialized(acts):
    """The activation planes (a tuple of arrays, or one stacked array) as arrays of their own before the
    side-by-side operand (their repetition, or the dense blocks' shifts) reads them. Where a plane is computed in
    the same program (a stream's thresholds and packing), XLA's GPU fusion otherwise put that reduction inside
    the concatenation, once per block reading it: a ternary ResNet-18 block at batch 512 took 3.2 ms instead of
    1.15 (H200, docs/design/decisions.md)."""
    return jax.lax.optimization_barrier(acts if isinstance(acts, jax.Array) else tuple(acts))


def _side_by_side_result(out, mode, kind, threshold_planes, n):
    """The ternary or mixed product's output from its side-by-side binary product's."""
    if kind == "i32":
        return out // len(_REDUCTION_BLOCKS[mode])  # exact: a multiple of `parts`
    if _planes_as_columns(threshold_planes, n):
        return out.reshape(out.shape[:-1] + (threshold_planes, out.shape[-1] // threshold_planes))
    return out


def _composite(binary_dot, acts, w, popcount, n, pool, epilogue):
    """A product with a ternary operand where the platform has no kernel of its own and the side-by-side
    reduction would pass the kernels' longest: ternary values are means of two ±1 vectors (t = (a + b) / 2
    from the nonneg and pos planes), so the dot product is the mean of 2 or 4 ±1 dot products, which
    `binary_dot` computes in one int32 call (activation planes stacked along the rows, a ternary weight's
    planes are its 2n output rows); then pool and epilogue as the reference's. Exact."""
    x = jnp.concatenate(_materialized(acts), axis=0) if len(acts) == 2 else acts[0]
    dot = binary_dot(x, w, popcount)
    parts = 1
    if dot.shape[-1] == 2 * n:
        dot, parts = dot[..., :n] + dot[..., n:], 2 * parts
    if len(acts) == 2:
        rows = acts[0].shape[0]
        dot, parts = dot[:rows] + dot[rows:], 2 * parts
    dot = dot // parts  # exact: a sum of `parts` ±1 products with one mean is a multiple of `parts`
    if pool is not None:
        dot = reference.max_pool(dot, pool)
    return reference.epilogue(dot, **epilogue)


def _ffi_call(target, result_types, *operands, **attrs):
    """The custom call `target` on `operands`, inside `jax.shard_map` too: there an FFI call needs all its
    operands to vary along the same manual mesh axes, so those that vary along fewer (weights closed over,
    replicated) are cast to vary along all of them, and its results vary along them."""
    axes = frozenset().union(*(_varying_axes(o) for o in operands))
    if axes:
        operands = [o if _varying_axes(o) == axes else jax.lax.pcast(o, tuple(axes - _varying_axes(o)), to="varying")
                    for o in operands]
        result_types = jax.tree.map(lambda t: jax.eval_shape(
            lambda: jax.lax.pcast(jnp.zeros(t.shape, t.dtype), tuple(axes), to="varying")), result_types)
    return jax.ffi.ffi_call(target, result_types)(*operands, **attrs)


def _platform_dependent(*operands, default, **branches):
    """`jax.lax.platform_dependent`, under jax's explicit sharding too: there an FFI call's results come out
    replicated, where the default branch's (jnp) carry the operands' sharding, and the branches must agree;
    each branch's results are resharded to the default's (the call itself runs on the gathered rows)."""
    if jax.sharding.get_abstract_mesh().explicit_axes:
        types = jax.eval_shape(default, *operands)
        branches = {platform: _resharded_to(types, branch) for platform, branch in branches.items()}
    return jax.lax.platform_dependent(*operands, default=default, **branches)


def _resharded_to(types, branch):
    def run(*operands):
        return jax.tree.map(lambda y, t: y if jax.typeof(y).sharding == t.sharding else jax.sharding.reshard(
            y, t.sharding), branch(*operands), types)
    return run


def _varying_axes(value) -> frozenset:
    """The manual mesh axes (`jax.shard_map`'s) along which a traced value varies; empty outside one."""
    aval = jax.typeof(value)
    manual = getattr(aval, "mat", None)
    return frozenset(manual.varying) if manual is not None else frozenset(getattr(aval, "vma", ()))


def _dispatch(target, out_type, attrs, reference_fn, *operands, cuda=None, cuda_weights=None,
              cuda_activations=None, cpu_activations=None, cuda_attrs=None, cpu_only=0):
    """Lower to the native handler of the platform the computation runs on, else to the reference.
    cuda: the CUDA branch, where it is not the handler alone; cuda_weights / cuda_activations: what the
    CUDA branch does to the weights (the second operand) / the activations (the first) first;
    cpu_activations: what the CPU branch does to the activations first; cuda_attrs: attributes only the CUDA
    handler takes (the convolutions' x_repeats); cpu_only: the last operands that only the CPU handler takes
    (the first layer's kernel masks), after the weights; the other branches and the reference never see them."""
    def common(fn):  # fn on the operands every branch takes
        return fn if not cpu_only else (lambda *ops: fn(*ops[:-cpu_only]))

    native = lambda *ops: _ffi_call(target, out_type, *ops, **attrs)  # noqa: E731
    cpu_native = native if not cpu_only else (
        lambda x, w, *rest: native(x, w, *rest[len(rest) - cpu_only:], *rest[:len(rest) - cpu_only]))
    branches = {p: call for p, call in (("cpu", cpu_native), ("cuda", common(native))) if _ffi.has_target(p, target)}
    if "cpu" in branches and cpu_activations is not None:
        branches["cpu"] = lambda x, *rest: cpu_native(cpu_activations(x), *rest)
    if "cuda" in branches:
        cuda_native = native if cuda_attrs is None else (
            lambda *ops: _ffi_call(target, out_type, *ops, **attrs, **cuda_attrs))
        call = cuda_native if cuda is None else cuda
        weights = (lambda w: w) if cuda_weights is None else cuda_weights
        activations = (lambda x: x) if cuda_activations is None else cuda_activations
        branches["cuda"] = common(lambda x, w, *rest: call(activations(x), weights(w), *rest))
    if not branches:
        return common(reference_fn)(*operands)
    return _platform_dependent(*operands, default=common(reference_fn), **branches)


def _elsewhere(kind, i32_target, out_type, attrs, reference_fn, cuda_operands, cuda_attrs=None):
    """What a binary op runs where a platform has no handler of its own for `kind`: the reference, or for an
    int16 result the int32 products (native where registered), narrowed."""
    if kind != "i16":
        return reference_fn
    i32_type = jax.ShapeDtypeStruct(out_type.shape, jnp.int32)
    return lambda *ops: _dispatch(i32_target, i32_type, attrs, reference_fn, *ops, **cuda_operands,
                                  cuda_attrs=cuda_attrs).astype(jnp.int16)


def _fold_rows(single, activations=1, row_operands=()):
    """Make `single(*rows, *weights)` vmappable, `rows` the first `activations` operands (the planes of
    ternary activations, of one shape) and the operands at `row_operands` (a residual shortcut: one per row):
    a batch of rows only folds into their leading axis (one kernel call), an unbatched row operand broadcast
    along with them; batched weights fall back to a sequential map. Outputs may be tuples."""
    rows_at = set(range(activations)) | set(row_operands)

    @jax.custom_batching.custom_vmap
    def call(*operands):
        return single(*operands)

    @call.def_vmap
    def _rule(axis_size, in_batched, *operands):
        if not any(batched for i, batched in enumerate(in_batched) if i not in rows_at):
            args = [x if i not in rows_at or batched else jnp.broadcast_to(x, (axis_size,) + x.shape)
                    for i, (x, batched) in enumerate(zip(operands, in_batched))]
            rows = args[0].shape[1]
            # explicit sizes: a -1 cannot be resolved where another axis is empty
            out = call(*(x.reshape((axis_size * rows,) + x.shape[2:]) if i in rows_at else x
                         for i, x in enumerate(args)))
            out = jax.tree.map(lambda o: o.reshape((axis_size, rows) + o.shape[1:]), out)
        else:
            args = [
                arg if batched else jnp.broadcast_to(arg, (axis_size,) + arg.shape)
                for arg, batched in zip(operands, in_batched)
            ]
            if axis_size == 0:  # empty: the map's result type without a call (an eager map cannot scan 0 steps)
                one = jax.eval_shape(call, *(jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in args))
                out = jax.tree.map(lambda o: jnp.zeros((0,) + o.shape, o.dtype), one)
            else:
                out = jax.lax.map(lambda xs: call(*xs), args)
        return out, jax.tree.map(lambda _: True, out)

    return call


# --- argument checks ------------------------------------------------------------------------------


def _is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _recorded_size(name, given, recorded, weights, where=""):
    """A size the weights' dataclass records; one also given must be the same (other sizes would read its
    padding bits as weights, or drop real ones)."""
    if given is None:
        return recorded
    same = _pair(name, given) == tuple(recorded) if name == "kernel_size" else _is_int(given) and given == recorded
    if not same:
        raise ValueError(f"{where}{name}={given!r} differs from the {type(weights).__name__}'s {name} {recorded!r}; "
                         "give the same or leave it out")
    return recorded


def _positive_int(name, value, maximum=MAX_EXTENT):
    if not _is_int(value) or not 1 <= value <= maximum:
        raise ValueError(f"{name} must be a positive integer of at most {maximum}, got {value!r}")
    return int(value)


def _pair(name, value):
    values = (value, value) if _is_int(value) else tuple(value) if isinstance(value, (tuple, list)) else ()
    if len(values) != 2:
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
    return tuple(_positive_int(name, v) for v in values)


def _packed(name, value, min_rank):
    """A packed operand, its dtype and rank checked as given (a host array is not converted first, so a
    wrong dtype is reported as it is)."""
    value = formats.host_or_device(value)
    if value.dtype != formats.WORD_DTYPE:
        raise TypeError(f"{name} must hold packed uint32 words, got dtype {value.dtype}")
    if value.ndim < min_rank:
        raise ValueError(f"{name} must have rank >= {min_rank}, got shape {value.shape}")
    return value


def _activations(name, value, min_rank):
    """Packed activations as {name: plane}: one array, or the nonneg and pos planes of a
    `formats.TernaryPlanes` (checked to have one shape)."""
    if not isinstance(value, formats.TernaryPlanes):
        return {name: _packed(name, value, min_rank)}
    planes = {f"{name}.{field}": _packed(f"{name}.{field}", plane, min_rank)
              for field, plane in zip(value._fields, value)}
    nonneg, pos = planes.values()
    if nonneg.shape != pos.shape:
        raise ValueError(f"the planes of ternary {name} must have one shape, got {name}.nonneg {nonneg.shape} and "
                         f"{name}.pos {pos.shape}")
    return planes


def _mode(ternary_activations, ternary_weights):
    """TAB's name of a product: (binary | ternary) activations x (binary | ternary) weights."""
    return {(False, False): "bnn", (True, False): "tbn", (False, True): "btn", (True, True): "tnn"}[
        (ternary_activations, ternary_weights)]


def _check_words(name, value, k):
    if value.shape[-1] != formats.num_words(k):
        raise ValueError(
            f"{name} has {value.shape[-1]} words on its last axis, but {k} bits pack into "
            f"{formats.num_words(k)} words"
        )


def _check_elements(what, shape):
    count = math.prod(shape)
    if count > MAX_ELEMENTS:
        raise ValueError(f"{what} would have shape {tuple(shape)}, {count} elements: more than the "
                         f"{MAX_ELEMENTS} any op takes")


def _weights(name, b, k, n):
    """Weights given as FSB tiles or as a row-packed matrix (tiled inside the compiled op), and their
    row count."""
    b = _packed(name, b, min_rank=2)
    if b.ndim == 2:
        _check_words(name, b, k)
        if n is not None and n != b.shape[0]:
            raise ValueError(f"n={n} but the row-packed {name} has {b.shape[0]} rows")
        return b, b.shape[0]
    if b.ndim != 4:
        raise ValueError(f"{name} must be FSB tiles (NT, KT, BH, BW/32) or row-packed (N, Kw), got {b.shape}")
    nt, kt, bh, ww = b.shape
    if bh < 1 or ww < 1:
        raise ValueError(f"FSB {name} of shape {b.shape} has empty tiles")
    if kt != -(-k // (ww * formats.WORD_BITS)):
        raise ValueError(f"FSB {name} of shape {b.shape} has {kt} tile columns, {k} bits need "
                         f"{-(-k // (ww * formats.WORD_BITS))}")  # fmt: skip
    n = nt * bh if n is None else _positive_int("n", n)
    if not (nt - 1) * bh < n <= nt * bh:
        raise ValueError(f"FSB {name} of shape {b.shape} holds {(nt - 1) * bh + 1}..{nt * bh} rows, not {n}")
    return b, n


def _default_tiles(fsb, rows, k_bits):
    """FSB weights in the default tile: the CUDA kernels take no other (the CPU kernels take any), so the
    CUDA branch re-tiles others and both platforms accept the same calls."""
    if fsb.shape[2:] == (formats.FSB_TILE[0], formats.FSB_TILE[1] // formats.WORD_BITS):
        return fsb
    return formats.to_fsb(formats.from_fsb(fsb, rows, k_bits))


def _derived_popcount(fsb, n, k):
    """The +1 count of each weight row's k real bits (padding bits, whatever they hold, not counted)."""
    return _real_bit_popcount(fsb, rows=n, k_bits=k, taps=None)


def _read_input(x, x_repeats):
    """A convolution's input as its taps read it: each pixel's words `x_repeats` times (`_bconv2d`)."""
    return x if x_repeats == 1 else jnp.concatenate([x] * x_repeats, axis=-1)


def _clear_padding_bits(x, bits):
    """Packed words with the padding bits of each last word (past `bits`) cleared: the CUDA kernels count
    every bit of an activation word, the CPU kernels only the real ones, and both must ignore the padding.
    Nothing to do (no operation) when `bits` fills whole words, as every zoo layer but the first does."""
    tail = bits % formats.WORD_BITS
    if tail == 0:
        return x
    mask = np.full(x.shape[-1], 0xFFFFFFFF, np.uint32)
    mask[-1] = (1 << tail) - 1
    return jnp.bitwise_and(*formats.same_rank(x, jnp.asarray(mask)))


def _int32_array(name, value, shape):
    value = formats.host_or_device(value)
    if not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {value.dtype}")
    if value.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {value.shape}")
    return value


def _check_popcount(name, popcount, weights, rows, k_bits, taps):
    """A concrete popcount must count the +1 bits of concrete weights (their real bits only: padding bits
    are 0 by the contract, and counting them would blame the popcount); traced ones are trusted, as
    documented."""
    if isinstance(popcount, jax.core.Tracer) or isinstance(weights, jax.core.Tracer):
        return
    with jax.ensure_compile_time_eval():  # concrete values under an outer jit too: computed now, not staged
        actual = np.asarray(_real_bit_popcount(weights, rows=rows, k_bits=k_bits, taps=taps)).astype(np.int64)
    stored = np.asarray(popcount).astype(np.int64, copy=False)
    if not np.array_equal(stored, actual):
        at = tuple(int(i) for i in np.argwhere(stored != actual)[0])
        raise ValueError(f"{name} does not count the +1 bits of the weights: at {at} it holds {int(stored[at])}, "
                         f"the weights have {int(actual[at])}")


def _check_ternary_weights(name, weights, n, k_bits, taps):
    """Concrete ternary weights must be pairs the packers write: no real pos bit without its nonneg bit (TAB's
    BTN kernels count a column's non-zero weights from the two planes' popcounts, which such a pair would
    break); traced ones are trusted, as documented. n: the outputs; taps as `_real_bit_popcount`'s."""
    if isinstance(weights, jax.core.Tracer):
        return
    with jax.ensure_compile_time_eval():  # concrete values under an outer jit too: computed now, not staged
        invalid = np.asarray(_pos_without_nonneg(weights, n=n, k_bits=k_bits, taps=taps))
    if invalid.any():
        raise ValueError(f"{name}: ternary weights of output {int(np.argmax(invalid > 0))} set a pos bit without its "
                         "nonneg bit; a ternary weight is the pair (nonneg, pos) of formats.ternary_weight_signs")


@functools.partial(jax.jit, static_argnames=("n", "k_bits", "taps"))
def _pos_without_nonneg(weights, *, n, k_bits, taps):
    """(n,) per output: the real bits its pos plane's row sets and its nonneg plane's row does not."""
    matrix = weights if weights.ndim == 2 else formats.from_fsb(weights, 2 * n, k_bits)
    if taps is None:
        mask = formats.pack_bits(jnp.arange(formats.num_words(k_bits) * formats.WORD_BITS) < k_bits)
    else:
        count, tap_words, channels = taps
        mask = jnp.tile(formats.pack_bits(jnp.arange(tap_words * formats.WORD_BITS) < channels), count)
    return formats.popcount(jnp.bitwise_and(*formats.same_rank(matrix[n:] & ~matrix[:n], mask)))


@functools.partial(jax.jit, static_argnames=("rows", "k_bits", "taps"))
def _real_bit_popcount(weights, *, rows, k_bits, taps):
    """(rows,) +1 counts of a weight matrix (row-packed or FSB), or (taps, rows) per tap of a conv matrix
    of `tap_words` words holding `channels` real bits each (taps = (kh * kw, tap_words, channels)), counting
    real bits only."""
    words = formats.num_words(k_bits)
    matrix = weights if weights.ndim == 2 else formats.from_fsb(weights, rows, k_bits)
    if taps is None:
        mask = formats.pack_bits(jnp.arange(words * formats.WORD_BITS) < k_bits)
        return formats.popcount(matrix & mask[None])  # per row, spelled out (rank promotion)
    count, tap_words, channels = taps
    mask = formats.pack_bits(jnp.arange(tap_words * formats.WORD_BITS) < channels)
    return formats.popcount(matrix.reshape(rows, count, tap_words) & mask[None, None]).T


def _host_or_device_vector(name, value, n):
    """A per-channel vector (a scalar broadcasts), kept where it is: host values are not narrowed to jax's
    32-bit types before the exact comparison of `formats.binarize`."""
    value = formats.host_or_device(value)
    if value.ndim == 0:
        value = (jnp if isinstance(value, jax.Array) else np).broadcast_to(value, (n,))
    if value.shape != (n,):
        raise ValueError(f"{name} must be a scalar or have shape ({n},), one value per channel, got {value.shape}")
    return value


def _flip_values(flip):
    """`flip` as given, where its values are bools or real numbers (nonzero: set)."""
    if not (flip.dtype == bool or (np.issubdtype(flip.dtype, np.number)
                                   and not np.issubdtype(flip.dtype, np.complexfloating))
            or jnp.issubdtype(flip.dtype, jnp.floating)):
        raise TypeError(f"flip must hold bools or numbers (nonzero: the comparison flipped), got {flip.dtype}")
    return flip


def _vector(name, value, n):
    value = formats.host_or_device(value)
    if value.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},), one value per output channel, got {value.shape}")
    return value


def _epilogue(n, bound, scale, bias, threshold, flip, mode="bnn", out_dtype=jnp.int32, k_real=0):
    """(kind, operands, threshold planes) of the epilogue chosen by which parameters are given; operands as
    given, their dtypes and shapes checked; `out_dtype` (int32 or int16, the latter for reductions of at most
    `MAX_INT16_REDUCTION` products, `k_real`) of the plain dot products. Host thresholds are saturated to [-bound, bound] here (jnp would
    wrap an int64 one), device ones inside the compiled op (`_epilogue_operands`). Threshold planes: 0 for
    a threshold of shape (N,); P for one of shape (P, N), P planes of bits with a plane axis (a ternary
    output's two), which the products with a ternary operand take."""
    out_dtype = _out_dtype(out_dtype, "the dot products' type")
    if out_dtype == np.int16:
        if threshold is not None or flip is not None or scale is not None or bias is not None:
            raise ValueError("out_dtype=int16 applies to the plain dot products, not with a threshold or scale / bias")
        if k_real > MAX_INT16_REDUCTION:
            raise ValueError(f"an int16 result holds dot products of at most {MAX_INT16_REDUCTION} products; this one "
                             f"reduces over {k_real}")
        return "i16", {}, 0
    if threshold is not None:
        if scale is not None or bias is not None:
            raise ValueError("give either threshold/flip (packed output) or scale/bias (float output), not both")
        if np.ndim(threshold) == 2:
            if mode == "bnn":
                raise ValueError(f"threshold planes of shape {np.shape(threshold)} are taken by the products with a "
                                 f"ternary operand; the binary product takes a threshold of shape ({n},)")
            threshold, flip, _ = _threshold_planes(threshold, flip, n, bound)
            return "bits", {"threshold": threshold, "flip": flip}, threshold.shape[0]
        threshold = _vector("threshold", threshold, n)
        if not (jnp.issubdtype(threshold.dtype, jnp.integer) or threshold.dtype == object):
            raise TypeError(f"threshold must be integer (the dot products are integers), got {threshold.dtype}")
        if not isinstance(threshold, jax.Array):
            threshold = _saturate_host(threshold, bound)
        flip = None if flip is None else _flip_values(_vector("flip", flip, n))
        return "bits", {"threshold": threshold, "flip": flip}, 0
    if flip is not None:
        raise ValueError("flip only applies with a threshold")
    if scale is not None or bias is not None:
        scale = None if scale is None else _float_vector("scale", scale, n)
        bias = None if bias is None else _float_vector("bias", bias, n)
        return "f32", {"scale": scale, "bias": bias}, 0
    return "i32", {}, 0


def _saturate_host(threshold, bound):
    """int32 thresholds equal in effect to host integers of any size: the dot products lie in
    [-bound + 1, bound - 1], so every threshold beyond +-bound acts as +-bound (>= never / always holds)."""
    if threshold.dtype == object:  # Python integers beyond 64 bits
        if not all(_is_int(v) for v in threshold.tolist()):
            raise TypeError("threshold must hold integers (the dot products are integers)")
        return np.array([min(max(int(v), -bound), bound) for v in threshold.tolist()], np.int32)
    info = np.iinfo(threshold.dtype)
    if info.max > bound:
        threshold = np.minimum(threshold, threshold.dtype.type(bound))
    if info.min < -bound:
        threshold = np.maximum(threshold, threshold.dtype.type(-bound))
    return threshold.astype(np.int32)


def _saturate(threshold, bound):
    """`_saturate_host` of a device integer array, inside the compiled op. An int32 one passes as it is: the
    handlers (docs/ops.md) and the reference take any int32 threshold exactly, so only wider types need the
    clamp before they narrow, and a model's int32 thresholds cost no pass over them per call."""
    if threshold.dtype == jnp.int32:
        return threshold
    info = jnp.iinfo(threshold.dtype)
    if info.max > bound:
        threshold = jnp.minimum(threshold, jnp.asarray(bound, threshold.dtype))
    if info.min < -bound:
        threshold = jnp.maximum(threshold, jnp.asarray(-bound, threshold.dtype))
    return threshold.astype(jnp.int32)


def _flip_operand(flip, shape):
    """`flip` as the handlers take it, uint8 (zeros when not given). Every handler and the reference read any
    nonzero value as set, so a uint8 flip passes as it is (no pass over it per call); others become 0 / 1."""
    if flip is None:
        return jnp.zeros(shape, jnp.uint8)
    flip = jnp.asarray(flip)
    return flip if flip.dtype == jnp.uint8 else flip.astype(bool).astype(jnp.uint8)


def _epilogue_operands(kind, epi, n, bound):
    """The epilogue operands as the handlers take them (inside the compiled op)."""
    if kind == "bits":
        return {"threshold": _saturate(jnp.asarray(epi["threshold"]), bound),
                "flip": _flip_operand(epi["flip"], jnp.shape(epi["threshold"]))}
    if kind == "f32":
        scale, bias = epi["scale"], epi["bias"]
        return {"scale": jnp.ones((n,), jnp.float32) if scale is None else jnp.asarray(scale, jnp.float32),
                "bias": jnp.zeros((n,), jnp.float32) if bias is None else jnp.asarray(bias, jnp.float32)}
    return {}


def _epilogue_output(kind, n):
    """(last-axis length, dtype) of an epilogue's output for n output channels."""
    if kind == "bits":
        return formats.num_words(n), jnp.uint32
    return n, {"i32": jnp.int32, "i16": jnp.int16, "f32": jnp.float32}[kind]


def _epilogue_tail(kind, n, threshold_planes):
    """The trailing shape of an epilogue's output for n output channels: (n,), (words,) or (planes, words)."""
    last = _epilogue_output(kind, n)[0]
    return (threshold_planes, last) if threshold_planes else (last,)


def _float_vector(name, value, n):
    value = _vector(name, value, n)
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(f"{name} must be floating point, got {value.dtype}")
    return value


def _conv_padding(padding, size, kernel, stride):
    if isinstance(padding, str):
        mode = padding.upper()
        if mode == "VALID":
            return (0, 0), (0, 0)
        if mode == "SAME":
            pads = []
            for n, k, s in zip(size, kernel, stride):
                total = max((-(-n // s) - 1) * s + k - n, 0)
                pads.append((total // 2, total - total // 2))
            return tuple(pads)
        raise ValueError(f"padding must be 'SAME', 'VALID' or ((top, bottom), (left, right)), got {padding!r}")
    try:
        (pt, pb), (pl, pr) = padding
    except (TypeError, ValueError):
        raise ValueError(f"padding must be 'SAME', 'VALID' or ((top, bottom), (left, right)), got {padding!r}")
    pads = (pt, pb, pl, pr)
    if not all(_is_int(v) and 0 <= v <= MAX_EXTENT for v in pads):
        raise ValueError(f"padding must hold integers in [0, {MAX_EXTENT}] (non-negative), got {padding!r}")
    return (int(pt), int(pb)), (int(pl), int(pr))
