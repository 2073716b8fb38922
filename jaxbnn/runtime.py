"""Inference from a packed checkpoint: `load(path)` -> a model whose call is one `jax.jit` function.

The graph of the file (`jaxbnn.packed_model`, docs/export.md) runs node by node through `jaxbnn.ops`, in
integers from the pixels to the logits:

- the first layer multiplies the image's int8 levels (pixel - 128) with its int8 weight values
  (`ops.image_conv2d` / `ops.image_matmul`, given the pixels: the kernels read them as stored), its pool
  and its output's thresholds (or the stream's shift) in the same op; a stem also writes the first residual
  block's input bits there (`writes_stem_bits`);
- every other layer, binary or ternary activations times binary or ternary weights (TAB's BNN, TBN, BTN,
  TNN), is one `ops.bmm` / `ops.bconv2d` with its epilogue: the threshold planes writing the next layer's
  packed input (binary bits, or a ternary output's (nonneg, pos) planes; max-pool fused), the affine writing
  the logits, or the int32 dot products of a residual block's stream. Where a platform has no kernel of a
  ternary or mixed product, the op runs it as one binary product over the planes side by side (docs/ops.md);
- integer thresholds turn int32 pre-activations and the residual stream into bits; the stream is the sum
  of each residual block's conv2 output and its shortcut: over an int16 stream, where conv2 is a 3x3
  stride-1 convolution, added in conv2's epilogue, which also writes the next block's input bits
  (`ops.bconv2d(..., shortcut=...)`, `fuses_residual`): on CUDA by the band and resident kernels (a ternary or
  mixed conv2: its side-by-side binary product's; a ternary conv1's two planes are thresholded from the
  stream after it, by a kernel of their own), on the CPU by each product's kernel in its strip epilogue (both
  planes); elsewhere (an int32 stream) added in jnp, where XLA fuses the add with the next block's thresholds
  and packing (docs/design/decisions.md);
- a run of dense layers on packed bits (a ResNet's tail after its global pool, the MNIST MLP's hidden layers)
  is one `ops.bmm_chain` (`dense_chains_of`): on CUDA one kernel, where its weights fit a CTA's shared memory;
  on the CPU one call running the layers' kernels in turn;
- on a platform whose kernels write the int16 stream (CUDA's int16 dot products and residual epilogues, the
  CPU's residual epilogues), a ResNet's stream travels as int16 wherever every value it can take there fits
  (`stream_dtypes`: bounds from the graph and the first layer's weights), else as int32: the same integers
  as the Flax model's int32 stream, in half the bytes per pass over it (conv2 writes them,
  `ops.bconv2d(out_dtype=...)` or its residual epilogue).

Images are uint8 pixels, or floats on the scale the file records (`input_range`), quantized to pixels by
`formats.quantize_images`.

A call's executable holds the parameters as constants where they take at most `EMBEDDED_PARAMETERS_BYTES`
(`embed_parameters`): each argument buffer costs the host a little on every call, which made a small
network's call at batch 1 on the CPU take 35 us instead of 21 (the MNIST MLP, 19 arrays). Larger models pass
them as arguments, so that an executable per batch shape does not copy them again. Even an embedding call
takes its uniform parameter arrays (every element the same: an untrained model's thresholds, the flips of a
layer with none) as arguments, one per distinct shape, type and value: XLA holds such a constant as a scalar
and broadcasts it on every call, on a GPU a kernel each (`_uniform_parameters`).

The file holds every operand as the ops take it (ternary weights as their two ±1 planes stacked along the
output axis, `formats.TernaryDenseBits` / `TernaryConvBits`; popcounts per row or per conv tap), so
loading moves the arrays to the device as they are (the bool flips as uint8, the handlers' dtype) and packs,
unpacks and derives nothing, with three exceptions, built once at load rather than inside every call: a
ternary layer's (nonneg, pos) thresholds stacked into the `(2, N)` planes the epilogues take; where the
default platform has no kernels of a layer's ternary or mixed product (CUDA), the weights that product runs as
(`ops.side_by_side_weights`); and on the CPU a dense first layer's sign masks (`formats.image_kernel_masks`),
which its kernel reads at a small batch instead of the int8 kernel.

This module never imports the exporter or the training code.
"""

from __future__ import annotations

import math
import os
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxbnn import _ffi, formats, ops, packed_model, reference
from jaxbnn.packed_model import PackedModel, uses_conv_layout, weight_geometry

__all__ = ["PackedNet", "InputRangeWarning", "load", "from_packed", "run_nodes", "run_node", "run_dense_chain",
           "stream_dtypes", "fuses_residual", "fuses_dense_chains", "dense_chains_of", "writes_stem_bits",
           "CHAIN_MAX_ROWS", "EMBEDDED_PARAMETERS_BYTES"]

# The largest packed parameters (bytes) a call's executable holds as constants unless told (`embed_parameters`):
# the zoo models in bnn up to VGG-small (1.95 MiB; ResNet-14 1.52, ResNet-18 1.62, the MNIST models 1.17 and
# 0.26). At batch 8 on an H200 their calls dispatch faster without 39-63 argument buffers (VGG-small 74-103
# against 137-166 us a forward, ResNet-14 121 against 145-149); on the CPU the same or faster. The next one up,
# AlexNet, holds 11.9 MiB, which would be HLO text at every compile and a second copy on the device.
EMBEDDED_PARAMETERS_BYTES = 2 << 20


class InputRangeWarning(UserWarning):
    """Float images that do not look like the scale the model's file records (they are quantized to pixels
    on that scale, so values off it are clipped). `warnings.simplefilter("error", InputRangeWarning)` makes
    it an error."""


def load(path: str | os.PathLike, *, embed_parameters: bool | None = None) -> "PackedNet":
    """Load and validate a `.jbnn` packed checkpoint; returns the jitted inference model. embed_parameters:
    see `PackedNet`."""
    return PackedNet(packed_model.load(path), embed_parameters=embed_parameters)


def from_packed(packed: PackedModel, *, embed_parameters: bool | None = None) -> "PackedNet":
    """The inference model of an in-memory packed model (the exporter returns one), validated as `load`
    validates a file (`PackedNet(packed)` itself)."""
    return PackedNet(packed, embed_parameters=embed_parameters)


class PackedNet:
    """A packed model ready to run: ``logits = net(images)`` (float32 (B, num_classes)).

    ``images``: uint8 pixels (B, *input_shape), as the model was trained on; or floats on the scale
    ``input_range = (low, high)`` the file records, quantized to pixels by `formats.quantize_images`.
    ``params`` holds the packed parameters (a pytree of arrays); the graph is static. ``trace(images)``
    returns every node's output as it travels (packed bits, ternary plane pairs, the residual stream (int16 or
    int32, ``stream_dtypes``), logits).

    ``embed_parameters``: whether a call's executable holds ``params`` as constants (``embeds_parameters``);
    None: where the packed parameters take at most `EMBEDDED_PARAMETERS_BYTES`. ``trace`` takes them as
    arguments either way. An embedding call compiles ``params`` into its executable per batch shape, so a
    net's parameters are fixed once it is built: a model with other parameters is another `PackedNet`.
    """

    def __init__(self, packed: PackedModel, *, embed_parameters: bool | None = None):
        if embed_parameters is not None and not isinstance(embed_parameters, (bool, np.bool_)):
            raise TypeError(f"embed_parameters must be True, False or None, got {embed_parameters!r}")
        if not isinstance(packed, PackedModel):
            raise TypeError(f"PackedNet takes a PackedModel (as export_model returns), got {type(packed).__name__}; "
                            "a .jbnn file: jaxbnn.load(path)")
        packed_model.validate(packed)  # as a file is on load: a model the format refuses runs nowhere
        self.graph = packed.graph
        self.target = packed.target
        self.tile = packed.tile
        self.packed_bytes = packed.nbytes()
        self.input_shape = tuple(self.graph["input_shape"])
        self.input_range = tuple(float(v) for v in self.graph["input_range"])
        self.num_classes = self.graph["num_classes"]
        self.params = [_prepare_node(node, _node_tensors(packed.tensors, f"nodes.{i}."))
                       for i, node in enumerate(self.graph["nodes"])]
        nodes = self.graph["nodes"]
        self.stream_dtypes = stream_dtypes(nodes, packed.tensors)
        dtypes = self.stream_dtypes
        input_range = self.input_range
        self._forward = jax.jit(lambda params, x: _run(nodes, params, _pixels(x, input_range), dtypes)[-1])
        self._trace = jax.jit(lambda params, x: _run(nodes, params, _pixels(x, input_range), dtypes))
        self.embeds_parameters = bool(self.packed_bytes <= EMBEDDED_PARAMETERS_BYTES if embed_parameters is None
                                      else embed_parameters)
        self._uniform_arguments = ()
        if self.embeds_parameters:
            # The parameters closed over by a jit around the one above: traced straight into one function, the
            # same program (identical HLO after optimization) ran the MNIST conv net's call at batch 1 on the
            # CPU in 66-82 us instead of 43-55 (not explained; measured in one process, alternating).
            self._uniform_arguments, with_uniform = _uniform_parameters(self.params)
            forward = self._forward
            self._embedded_forward = jax.jit(lambda x, *uniform: forward(with_uniform(uniform), x))

    def _call(self, images):
        """The jitted forward of `images` (checked: uint8 pixels, or float images it quantizes), as a call runs it."""
        return self._call_forward(*self._call_arguments(images))

    @property
    def _call_forward(self):
        """The jitted function a call runs, on `_call_arguments(images)`."""
        return self._embedded_forward if self.embeds_parameters else self._forward

    def _call_arguments(self, images) -> tuple:
        """The arguments of `_call_forward` for `images`."""
        if self.embeds_parameters:
            return (images, *self._uniform_arguments)
        return (self.params, images)

    def _check_input(self, images):
        """`images` as the jitted forward takes them: uint8 pixels, or float images (quantized on the file's scale in
        the same program, `_pixels`: a separate program would cost a call at a small batch half its host time)."""
        images = formats.host_or_device(images)
        self._check_images(images)
        if images.dtype == np.uint8:
            # a device array as it is: jnp.asarray would cost a call several microseconds of host time
            return images if isinstance(images, jax.Array) else jnp.asarray(images)
        # host images only: a device array's range would cost a reduction and a sync on every call
        if isinstance(images, np.ndarray):
            if images.size:
                self._warn_outside_range(float(images.min()), float(images.max()))
            return jnp.asarray(images, jnp.float32)
        return images

    def _check_images(self, images) -> None:
        """Refuse images of another shape than (batch, *input_shape), or of a type other than uint8 or float."""
        if images.ndim != len(self.input_shape) + 1 or tuple(images.shape[1:]) != self.input_shape:
            raise ValueError(f"{self.graph['name']} takes images of shape (batch, {', '.join(map(str, self.input_shape))}),"
                             f" got {tuple(images.shape)}")
        if images.dtype != np.uint8 and not jnp.issubdtype(images.dtype, jnp.floating):
            low, high = self.input_range
            raise TypeError(f"images must be uint8 pixels (0..255) or floats in [{low:g}, {high:g}] (the scale "
                            f"{self.graph['name']}'s file records), got {images.dtype}")

    def _warn_outside_range(self, smallest: float, largest: float, stacklevel: int = 4) -> None:
        """Warn about float images off the file's scale: beyond its range (by more than 1% of its width),
        or none negative where the range is centred below zero (images scaled to [0, 1]). stacklevel: the
        caller's frame, as `warnings.warn` counts it from here."""
        low, high = self.input_range
        slack = 0.01 * (high - low)
        shifted = "x" if low == 0 else f"(x {'-' if low > 0 else '+'} {abs(low):g})"
        scale = (f"{self.graph['name']} takes float images in [{low:g}, {high:g}] (quantized to pixels p = "
                 f"round({shifted} * 255 / {high - low:g})); these span [{smallest:g}, {largest:g}]")
        if not low - slack <= smallest <= largest <= high + slack:  # NaN included
            advice = "scale them to that range, or pass the uint8 pixels"
        elif low < 0 <= smallest and (low + high) / 2 <= 0:
            advice = (f"none is negative: images scaled to [0, 1] need {low:g} + x * {high - low:g}; or pass the "
                      "uint8 pixels")
        else:
            return
        warnings.warn(f"{scale}: {advice}", InputRangeWarning, stacklevel=stacklevel)

    def __call__(self, images) -> jax.Array:
        return self._call(self._check_input(images))

    def trace(self, images) -> list:
        """Every node's output for `images`: a list, one entry per graph node (residual nodes give the
        pair (conv1 output, block output))."""
        return self._trace(self.params, self._check_input(images))

    def predict(self, images, batch_size: int = 500) -> np.ndarray:
        """Class indices (int32) of any number of `images` (uint8 pixels or floats, as for a call), in calls of
        `batch_size` images, converted a call at a time (a memory-mapped set is read as it goes). The last call
        is padded to `batch_size`, and a set of fewer images to the next power of two, so that whatever sizes
        a server's requests have, at most log2(batch_size) + 2 shapes are compiled."""
        if isinstance(batch_size, (bool, np.bool_)) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        batch_size = int(batch_size)  # a narrow numpy integer would wrap in the offsets below
        images = formats.host_or_device(np.asarray(images))
        self._check_images(images)  # here, as an empty set of images makes no call
        floating = jnp.issubdtype(images.dtype, jnp.floating)  # bfloat16 and the other ml_dtypes floats too
        if floating and images.size:
            self._warn_outside_range(float(np.min(images)), float(np.max(images)), stacklevel=3)
        total, out = len(images), []
        for start in range(0, total, batch_size):
            chunk = np.asarray(images[start:start + batch_size], np.float32 if floating else np.uint8)
            count = len(chunk)
            shape = batch_size if total > batch_size else min(batch_size, 1 << (count - 1).bit_length())
            if count < shape:
                # copies of a row of the chunk: padding on the images' own scale
                chunk = np.concatenate([chunk, np.repeat(chunk[:1], shape - count, axis=0)])
            out.append(np.asarray(jnp.argmax(self._call(jnp.asarray(chunk)), axis=-1), np.int32)[:count])
        return np.concatenate(out) if out else np.zeros((0,), np.int32)

    def throughput(self, images, repeats: int = 5) -> float:
        """Images per second of the jitted call on `images` (one batch, compiled first)."""
        if isinstance(repeats, (bool, np.bool_)) or not isinstance(repeats, (int, np.integer)) or repeats < 1:
            raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
        repeats = int(repeats)
        images = self._check_input(images)
        self._call(images).block_until_ready()
        start = time.perf_counter()
        for _ in range(repeats):
            out = self._call(images)
        out.block_until_ready()
        return repeats * images.shape[0] / (time.perf_counter() - start)


def _uniform_parameters(params) -> tuple:
    """(arguments, with_uniform) for a forward that holds `params` as constants: `arguments` one array per
    distinct (shape, dtype, bytes of the value) of the arrays of more than one element whose elements are all the
    same bytes, and `with_uniform(arguments)` the parameters with those arrays replaced by their argument (the
    others as they are: the constants). XLA keeps a uniform constant as a scalar and materializes its broadcast on
    every call, a kernel each on a GPU (ten in the untrained MNIST conv net's forward: 144.6 against 152.0 us of
    device time at batch 1024 on an H200); an argument is a buffer."""
    leaves, tree = jax.tree.flatten(params)
    slots, arguments, index = [], [], {}
    for leaf in leaves:
        value = np.asarray(leaf)
        rows = value.reshape(-1).view(np.uint8).reshape(value.size, value.dtype.itemsize) if value.size else None
        if value.size > 1 and (rows == rows[0]).all():
            key = (value.shape, value.dtype.str, rows[0].tobytes())
            if key not in index:
                index[key] = len(arguments)
                arguments.append(leaf)
            slots.append(index[key])
        else:
            slots.append(None)

    def with_uniform(uniform):
        return jax.tree.unflatten(tree, [leaf if slot is None else uniform[slot] for leaf, slot in zip(leaves, slots)])

    return tuple(arguments), with_uniform


def _node_tensors(tensors: dict, prefix: str) -> dict:
    return {name[len(prefix):]: value for name, value in tensors.items() if name.startswith(prefix)}


# --- parameters: what each node needs at run time -------------------------------------------------------


def _prepare_node(node: dict, tensors: dict) -> dict:
    if node["kind"] in ("dense", "conv"):
        return _prepare_linear(node, tensors)
    if node["kind"] == "residual":
        return {key: _prepare_linear(node[key], _node_tensors(tensors, f"{key}."), shortcut=key == "conv2")
                for key in ("conv1", "conv2")}
    params = {name: _on_device(value) for name, value in tensors.items()}  # global pooling: its thresholds
    return {**params, **_threshold_planes(node, params)}


def _on_device(value):
    """A tensor on the device as it is, except bool flips, which become uint8 (the handlers' dtype), so that
    no call converts them again."""
    return jnp.asarray(value.astype(np.uint8) if value.dtype == np.bool_ else value)


def _threshold_planes(node: dict, params: dict) -> dict:
    """A ternary output's thresholds and flips as the ops' epilogues take them, (2, N) (nonneg, pos) planes, and
    those of a ternary operand read from the stream (a residual block's conv1: `input_threshold_planes`), stacked
    once here: stacked in the forward, each was a small kernel of its own per layer and call. Not where the
    thresholds vary per feature (`_per_feature_levels`), which the epilogues do not take."""
    planes = {}
    if node["output"] == "ternary" and len(node.get("level_shape") or ()) <= 1:
        planes["threshold_planes"] = jnp.stack([params["threshold_nonneg"], params["threshold_pos"]])
        planes["flip_planes"] = jnp.stack([params["flip_nonneg"], params["flip_pos"]])
    reads_ternary_stream = node.get("input") == "stream" and node.get("operand") == "ternary"
    if reads_ternary_stream and len(node.get("input_level_shape") or ()) <= 1:
        for name in ("threshold", "flip"):
            planes[f"input_{name}_planes"] = jnp.stack([params[f"input_{name}_{p}"] for p in ("nonneg", "pos")])
    return planes


def _prepare_linear(node: dict, tensors: dict, shortcut: bool = False) -> dict:
    """The node's tensors as the ops take them: no unpacking, no packing; derived only the threshold planes
    (`_threshold_planes`), a pooled threshold convolution's flip words (`ops.bconv2d`'s flip_words, which the
    forward would otherwise pack per layer and call, an XLA kernel each) and, where the platform has no kernel
    of a ternary or mixed product, its side-by-side weights (`shortcut`: a residual block's conv2, whose
    residual epilogue takes the four blocks)."""
    params = {name: _on_device(value) for name, value in tensors.items()}
    params.update(_threshold_planes(node, params))
    if node["operand"] == "image":
        if node["kind"] == "dense" and _default_platform() == "cpu" and _is_ternary_valued(tensors["kernel"]):
            params["kernel_masks"] = formats.image_kernel_masks(tensors["kernel"])
        return params
    if node["kind"] == "conv" and node.get("pool") and node["output"] in ("binary", "ternary") \
            and not _per_feature_levels(node):
        flip = _threshold_epilogue(node["output"], params)["flip"]
        params["flip_words"] = formats.pack_bits(flip != 0)
    rows, k_bits, kernel, c = weight_geometry(node)
    n = node["out_channels"]
    ternary = node["weights"] == "ternary"
    if uses_conv_layout(node):
        conv_bits = formats.TernaryConvBits if ternary else formats.ConvBits
        params["weight"] = conv_bits(params["weight"], params.pop("weight_tap_popcount"), kernel_size=kernel,
                                     in_channels=c, out_channels=n)
    else:
        dense_bits = formats.TernaryDenseBits if ternary else formats.DenseBits
        params["weight"] = dense_bits(params["weight"], params.pop("weight_popcount"), k=k_bits, n=n)
    ternary_activations = node["operand"] == "ternary"
    if (ternary or ternary_activations) and not _has_native_product(ternary_activations, ternary):
        planes = 2 if node["output"] == "ternary" and not _per_feature_levels(node) else 0
        params["side_by_side"] = ops.side_by_side_weights(params["weight"], ternary_activations=ternary_activations,
                                                          threshold_planes=planes, shortcut=shortcut)
    return params


def _is_ternary_valued(kernel) -> bool:
    """Whether every value of a first layer's kernel is -1, 0 or +1 (a binary or ternary layer's: then the CPU reads
    its few-row calls from the kernel's sign masks, `formats.image_kernel_masks`)."""
    values = np.asarray(kernel)
    return values.dtype == np.int8 and bool(np.isin(values, (-1, 0, 1)).all())


def _has_native_product(ternary_activations, ternary_weights):
    """Whether the default platform has kernels of this ternary or mixed product (else the op runs it as one
    binary product, on the side-by-side weights built at load)."""
    mode = {(True, True): "tnn", (True, False): "tbn", (False, True): "btn"}[(ternary_activations, ternary_weights)]
    return _ffi.has_target(_default_platform(), f"jaxbnn_{mode}_bmm_i32")


def _default_platform() -> str:
    """The default backend as `_ffi.has_target` names platforms ("cpu", "cuda")."""
    return {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())


# --- the forward pass ----------------------------------------------------------------------------------------


def _pixels(images, input_range):
    """The uint8 pixels of the images a forward takes: uint8 as they are, floats quantized on `input_range`."""
    return images if images.dtype == jnp.uint8 else formats.quantize_images(images, input_range)


def _run(nodes, params, pixels, dtypes):
    """Outputs of every node for uint8 `pixels`, in order (the last one is the logits). The first layer takes
    the pixels as they are (`ops.image_conv2d`): on CUDA its kernel reads their levels itself."""
    return run_nodes(nodes, params, jnp.asarray(pixels), dtypes)


def stream_dtypes(nodes, tensors, narrow=None) -> list:
    """Per graph node, the integer type its stream output travels in (None for a node without one): int16
    where every value the stream can take there lies within [-32767, 32767] and the narrow stream is wanted,
    else int32. `narrow` (default: whether the default platform's kernels write int16 dot products, CUDA's, or
    add the shortcut of every block to an int16 stream in their epilogue, the CPU's, `fuses_residual`)
    applies to graphs whose residual blocks' conv2 are binary products or add the shortcut in their epilogue
    (`fuses_residual`, any product): elsewhere the int16 stream would be the int32 products converted, which
    measured slower (on the 2-core EPYC and on an H200; decisions.md).

    The stream's values are bounded by the graph: a layer writing it (the stem) by its dot products'
    magnitude shifted right (the first layer's: 128 times its largest column sum of |weight| (`tensors`, the
    file's), a packed layer's: its reduction length K), and each residual block adds its conv2's K (the
    shortcut only subsamples and zero-pads the stream). ResNet-14 stays below 16,200 and ResNet-18 below
    17,500 with the zoo's ±1 first layers."""
    conv2s = [node["conv2"] for node in nodes if node["kind"] == "residual"]
    if narrow is None:
        narrow = (_ffi.has_target(_default_platform(), "jaxbnn_bconv2d_i16")
                  or (fuses_residual() and all(_fuses_shortcut(conv2) for conv2 in conv2s)))
    narrow = narrow and all((conv2["operand"] == "binary" and conv2["weights"] == "binary")
                            or (fuses_residual() and _fuses_shortcut(conv2)) for conv2 in conv2s)
    narrowest = jnp.int16 if narrow else jnp.int32
    dtypes, bound = [], 0
    for i, node in enumerate(nodes):
        if node["kind"] == "residual":
            bound += _stream_bound(node["conv2"], tensors, f"nodes.{i}.conv2.")
        elif node["kind"] in ("dense", "conv") and node["output"] == "stream":
            bound = _stream_bound(node, tensors, f"nodes.{i}.")
        else:
            dtypes.append(None)
            continue
        dtypes.append(narrowest if bound <= np.iinfo(np.int16).max else jnp.int32)
    return dtypes


def _stream_bound(node, tensors, prefix) -> int:
    """The largest magnitude of a stream-output layer's values, `dot >> stream_shift`."""
    if node["operand"] == "image":
        column_sums = np.abs(np.asarray(tensors[prefix + "kernel"], np.int64)).reshape(-1, node["out_channels"]).sum(0)
        largest = 128 * int(column_sums.max(initial=0))  # the levels lie in [-128, 127]
    else:
        _, _, (kh, kw), c = weight_geometry(node)
        largest = kh * kw * c  # a ±1 or ternary dot product of K terms
    return -(-largest >> node["stream_shift"])  # floor(-largest / 2**shift) is the most negative value


def run_nodes(nodes, params, x, stream_dtypes=None, fuse_residual=None, stem_bits=None, dense_chains=None):
    """Outputs of `nodes` in order, from `x`, the value the first of them reads (the image's uint8 pixels or
    int8 levels, bits, a ternary plane pair or the stream): the whole graph, or a part of it. Each node runs as
    `run_node` runs it, with the bits the node before it wrote for it and writing those of the node after it.
    stream_dtypes: per node, the type of its stream output (`PackedNet.stream_dtypes` for the same nodes);
    None: int32 throughout. fuse_residual: whether the residual blocks over an int16 stream add their shortcut
    in conv2's epilogue, which also writes the next block's input bits (`ops.bconv2d(..., shortcut=...)`);
    None: the blocks whose conv2 the default platform runs faster that way (`fuses_residual`). stem_bits:
    whether a first layer writing the stream also writes the first block's input bits (or ternary planes)
    from the same values (`ops.image_conv2d(..., keep_stream=True)`); None: where the default platform has
    that kernel (`writes_stem_bits`). dense_chains: whether runs of small dense layers run as one op each
    (`ops.bmm_chain`, `dense_chains_of`); None: where the default platform runs such a chain as one call
    (`fuses_dense_chains`). A chain gives its last node's output; the nodes before it in the chain still list
    theirs, computed layer by layer (XLA drops them where nothing reads them: in a forward that returns the
    logits)."""
    dtypes = stream_dtypes or [jnp.int32] * len(nodes)
    fuse_dense = fuses_dense_chains() if dense_chains is None else dense_chains
    rows = jax.tree.leaves(x)[0].shape[0]  # x: an array, or a ternary value's planes
    chain_starts = {end: start for start, end in dense_chains_of(nodes, rows)} if fuse_dense else {}
    outputs, inputs = [], []
    bits = None  # the stream's bits for the next node's conv1, from the epilogue that wrote the stream
    for i, (node, p, dtype) in enumerate(zip(nodes, params, dtypes)):
        following = (nodes[i + 1], params[i + 1]) if i + 1 < len(nodes) else None
        inputs.append(x)
        if i in chain_starts:
            start = chain_starts[i]
            out, bits = run_dense_chain(nodes[start:i + 1], params[start:i + 1], inputs[start]), None
        else:
            out, bits = run_node(node, p, x, dtype, input_bits=bits, following=following,
                                 fuse_residual=fuse_residual, stem_bits=stem_bits)
        outputs.append(out)
        x = out[1] if node["kind"] == "residual" else out
    return outputs


# The most rows a fused dense chain takes on CUDA (`dense_chains_of`): 128 blocks of 16 rows, one block a CTA on
# an H100 / H200 (132 SMs), the regime it was measured in (ResNet-14 at 8 and 1024, ResNet-18 at 8 and 512). Past
# it the chain kernel's CTAs take blocks in turn, each block through every layer, latency-bound and not measured
# against the layers' own kernels, which spread larger batches wider. The CPU's chain runs each layer's own
# kernel in turn, at any batch.
CHAIN_MAX_ROWS = 2048


def fuses_dense_chains() -> bool:
    """Whether the default platform runs a chain of dense layers as one call (`ops.bmm_chain`): CUDA, one kernel
    where the layers fit it; the CPU, its layers' kernels in turn."""
    return _ffi.has_target(_default_platform(), "jaxbnn_bmm_chain_f32")


def _chain_layer(node) -> bool:
    """Whether a node can be a layer of a dense chain: a dense layer of binary weights on packed binary
    activations (not a packed image), writing the next layer's bits or the logits."""
    return (node["kind"] == "dense" and node["operand"] == "binary" and node["weights"] == "binary"
            and node.get("input") == "binary" and not uses_conv_layout(node)
            and node["output"] in ("binary", "affine"))


def dense_chains_of(nodes, rows, platform=None) -> list:
    """The runs of nodes that `run_nodes` fuses into one `ops.bmm_chain` each at a batch of `rows` on `platform`
    (None: the default one): (start, end) index pairs, end inclusive. Consecutive chain layers (`_chain_layer`;
    only the last may write the logits), at least two; on CUDA at most CHAIN_MAX_ROWS rows and as many layers as
    one kernel takes (`ops.chain_fits_one_kernel`: widths, layers, the weights in a CTA's shared memory), on the
    CPU any."""
    on_cpu = (_default_platform() if platform is None else platform) == "cpu"
    if not on_cpu and rows > CHAIN_MAX_ROWS:
        return []
    chains, i = [], 0
    while i < len(nodes):
        j = i
        while j < len(nodes) and _chain_layer(nodes[j]) and (on_cpu or ops.chain_fits_one_kernel(
                [node["in_shape"][-1] for node in nodes[i:j + 1]], [node["out_channels"] for node in nodes[i:j + 1]])):
            j += 1
            if nodes[j - 1]["output"] != "binary":
                break
        if j - i >= 2:
            chains.append((i, j - 1))
        i = max(j, i + 1)
    return chains


def run_dense_chain(nodes, params, x):
    """A run of dense nodes that `run_nodes` fuses (`dense_chains_of`) as it runs them: their last output, by one
    `ops.bmm_chain` on `x`, the first node's input (per-node timing)."""
    layers = []
    for node, p in zip(nodes, params):
        epilogue = (dict(threshold=p["threshold"], flip=p["flip"]) if node["output"] == "binary"
                    else dict(scale=p["scale"], bias=p["bias"]))
        layers.append(dict(b=p["weight"], **epilogue))
    return ops.bmm_chain(x, layers)


def run_node(node, params, x, stream_dtype=jnp.int32, input_bits=None, following=None, fuse_residual=None,
             stem_bits=None):
    """One graph node as it runs inside the graph (`run_nodes`; per-node timing): from `x`, the value it reads,
    and `input_bits`, that value's bits (or ternary planes) where the epilogue that wrote `x` wrote them too (a
    residual block's conv1 reads them instead of thresholding the stream; None: it thresholds it). following:
    (node, params) of the node after it, whose input bits this node's epilogue writes where the platform's does
    (a stem before a residual block, `writes_stem_bits`; a residual block whose conv2 adds the shortcut in its
    epilogue, `fuses_residual`); None for the last node. stream_dtype, fuse_residual, stem_bits: as
    `run_nodes`. Returns (the node's output as `run_nodes` lists it, the bits written for `following` or
    None)."""
    next_node, next_params = following or (None, None)
    if node["kind"] in ("dense", "conv"):
        stem_bits = writes_stem_bits() if stem_bits is None else stem_bits
        if (stem_bits and node["operand"] == "image" and node["output"] == "stream" and next_node is not None
                and next_node["kind"] == "residual"):
            next_input = _conv1_input_thresholds(next_node["conv1"], next_params["conv1"])
            if next_input is not None:
                return _image_layer(node, params, x, stream_dtype, next_input=next_input)
        return _linear(node, params, x, stream_dtype), None
    if node["kind"] == "residual":
        inner = _linear(node["conv1"], params["conv1"], x, input_bits=input_bits)
        fuse = (fuse_residual if fuse_residual is not None
                else fuses_residual() and _fuses_shortcut(node["conv2"]))
        if fuse and stream_dtype == jnp.int16:
            stream, bits = _residual_epilogue(node, params, inner, x, following)
            return (inner, stream), bits
        stream = _linear(node["conv2"], params["conv2"], inner, stream_dtype) + _shortcut(node, x).astype(stream_dtype)
        return (inner, stream), None
    return _global_pool(node["output"], params, x), None


def _global_pool(domain, p, stream):
    """A global_pool node: each image's int32 sum of the stream over its pixels through the node's thresholds,
    in one op (`ops.global_sum_bits`): packed bits (binary), or the (nonneg, pos) plane pair (ternary)."""
    out = ops.global_sum_bits(stream, **_threshold_epilogue(domain, p))
    return out if domain == "binary" else (out[:, 0], out[:, 1])


def writes_stem_bits() -> bool:
    """Whether the default platform's first layer writes the stream and the first block's input bits in one
    pass (CUDA and the CPU); elsewhere XLA thresholds and packs the stream after it."""
    return _ffi.has_target(_default_platform(), "jaxbnn_image_conv2d_i16_bits")


def fuses_residual() -> bool:
    """Whether the default platform adds an int16 stream's shortcut in conv2's epilogue where that was measured
    faster than XLA's add (`_fuses_shortcut`): CUDA and the CPU (docs/design/decisions.md, "The residual
    epilogue"). Elsewhere, and for an int32 stream, XLA's add, fused with the next block's thresholds and
    packing."""
    return _ffi.has_target(_default_platform(), "jaxbnn_bconv2d_residual_i16_bits")


def _fuses_shortcut(conv2) -> bool:
    """Whether the platform (`fuses_residual`) adds the shortcut in this conv2's narrow residual epilogue: a 3x3
    stride-1 unpooled convolution whose product has one. On CUDA every product (a ternary or mixed one as the
    side-by-side binary product): the band kernel (64 or 128 channels) or the resident kernel (256, 512) copies
    the shortcut into shared memory while its MMAs run; against the int16 dot products plus XLA's add (fused with
    the next block's thresholds and packing), whole forwards in one process on an H200: ResNet-18 batch 512
    1.53 ms (the band kernel's blocks only: 1.67, XLA's add everywhere: 2.12), ResNet-14 batch 1024 0.54 (0.65,
    0.71). On the CPU every product's kernel adds it in its strip epilogue. docs/design/decisions.md, "The
    residual epilogue"."""
    if not (conv2["kernel_size"] == [3, 3] and conv2["stride"] == [1, 1] and conv2["pool"] is None):
        return False
    mode = ops._mode(conv2.get("operand") == "ternary", conv2.get("weights") == "ternary")
    platform = _default_platform()
    return (mode == "bnn" or not _ffi.has_target(platform, f"jaxbnn_{mode}_conv2d_i32")
            or _ffi.has_target(platform, f"jaxbnn_{mode}_conv2d_residual_i16_bits"))


def _residual_epilogue(node, p, inner, stream, following):
    """A residual block's conv2 (any product) with its shortcut added in the epilogue: the new stream and, where
    the next node (`following`: (node, params) or None) is a residual block whose conv1 thresholds the stream per
    channel, its input bits or ternary planes through those thresholds (else None)."""
    conv2 = node["conv2"]
    next_node, next_params = following or (None, None)
    next_input = None
    if next_node is not None and next_node["kind"] == "residual":
        next_input = _conv1_input_thresholds(next_node["conv1"], next_params["conv1"])
    if conv2["operand"] == "ternary":
        inner = formats.TernaryPlanes(*inner)
    out = ops.bconv2d(inner, p["conv2"]["weight"], shortcut=stream.astype(jnp.int16),
                      shortcut_stride=node["shortcut_stride"], side_by_side=p["conv2"].get("side_by_side"),
                      **_conv_args(conv2), **({} if next_input is None else next_input[0]))
    if next_input is None:
        return out, None
    stream, bits = out
    return stream, (bits[..., 0, :], bits[..., 1, :]) if next_input[1] else bits


def _shortcut(node, x):
    """ResNet type A: subsample by the stride, zero-pad the channels."""
    s = node["shortcut_stride"]
    x = x[:, ::s, ::s, :]
    extra = node["out_shape"][-1] - node["in_shape"][-1]
    return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, extra))) if extra else x


def _quantize(domain, p, z, prefix=""):
    """int32 pre-activations -> packed bits (binary) or the (nonneg, pos) plane pair (ternary), through the
    node's integer thresholds. A pair comes from one reduction, its words `(..., 2, W)` as the kernels' epilogues
    write them, which the side-by-side product on CUDA reads as they lie (`ops.bconv2d`); XLA made a stack of two
    planes packed apart a loop over both reductions (a ternary ResNet-18 at batch 512 three times slower, H200)."""
    if domain == "binary":
        return formats.pack_bits(formats.binarize(z, p[prefix + "threshold"], p[prefix + "flip"]))
    if prefix + "threshold_planes" in p:
        threshold, flip = p[prefix + "threshold_planes"], p[prefix + "flip_planes"]
    else:  # thresholds per feature (OH, OW, C): stacked here, (OH, OW, 2, C)
        threshold, flip = (jnp.stack([p[f"{prefix}{name}_{plane}"] for plane in ("nonneg", "pos")], axis=-2)
                           for name in ("threshold", "flip"))
    planes = formats.pack_bits(formats.binarize(z[..., None, :], threshold, flip))
    return planes[..., 0, :], planes[..., 1, :]


def _linear(node, p, x, stream_dtype=jnp.int32, input_bits=None):
    """A dense or conv node; `stream_dtype`: the type of a stream output; `input_bits`: a stream input's bits
    where the previous epilogue wrote them (else its thresholds run here)."""
    if input_bits is not None:
        x = input_bits
    elif node["input"] == "stream":
        x = _quantize(node["operand"], p, x, prefix="input_")
    if node["operand"] == "image":
        out = _image_layer(node, p, x, stream_dtype)
    else:
        out = _packed_layer(node, p, x, stream_dtype)
    return out.astype(stream_dtype) if node["output"] == "stream" else out


def _flatten(x):
    """(B, ...) -> (B, features); explicit sizes, as a -1 cannot be resolved for an empty batch."""
    return x.reshape(x.shape[0], math.prod(x.shape[1:]))


def _conv_args(node):
    """bconv2d keyword arguments of a node: its own conv, or the VALID conv covering a packed image."""
    if node["kind"] == "conv":
        return dict(stride=tuple(node["stride"]), padding=tuple(tuple(p) for p in node["padding"]),
                    pad_value=node["pad_value"])
    return dict(stride=1, padding="VALID", pad_value="zero")


def _threshold_epilogue(output, p):
    """The thresholds of a binary output, or the (nonneg, pos) threshold planes of a ternary one."""
    if output == "binary":
        return dict(threshold=p["threshold"], flip=p["flip"])
    return dict(threshold=p["threshold_planes"], flip=p["flip_planes"])


def _per_feature_levels(node) -> bool:
    """Whether a ternary output's thresholds vary per feature (shape (OH, OW, C), docs/export.md), which the
    ops' epilogue (thresholds per channel) does not take."""
    return node["output"] == "ternary" and len(node["level_shape"]) > 1


def _packed_layer(node, p, x, stream_dtype):
    """A layer on packed binary bits or ternary planes: one op with the output's epilogue (threshold planes
    -> the next layer's bits or ternary planes, affine -> logits, none -> the stream, shifted: unshifted
    dot products of a `stream_dtype` stream are written in that type); with thresholds per feature, the op's
    int32 dot products are thresholded after it."""
    output = node["output"]
    per_feature = _per_feature_levels(node)
    if output in ("binary", "ternary") and not per_feature:
        epilogue = _threshold_epilogue(output, p)
        if "flip_words" in p:
            epilogue["flip_words"] = p["flip_words"]
    elif output == "affine":
        epilogue = dict(scale=p["scale"], bias=p["bias"])
    elif output == "stream" and node["stream_shift"] == 0:
        epilogue = dict(out_dtype=stream_dtype)  # its bound (stream_dtypes) covers these dot products
    else:
        epilogue = {}
    if node["operand"] == "ternary":
        x = formats.TernaryPlanes(*x)
    side_by_side = p.get("side_by_side")
    if uses_conv_layout(node):
        pool = node.get("pool") if node["kind"] == "conv" else None
        out = ops.bconv2d(x, p["weight"], pool=None if pool is None else tuple(pool), side_by_side=side_by_side,
                          **_conv_args(node), **epilogue)
        out = out if node["kind"] == "conv" else out.reshape(out.shape[0], *out.shape[3:])
    else:
        out = ops.bmm(x, p["weight"], side_by_side=side_by_side, **epilogue)
    if per_feature:
        return _quantize(output, p, out)
    if output == "ternary":
        return out[..., 0, :], out[..., 1, :]
    if output == "stream":
        return out >> node["stream_shift"]  # an arithmetic shift: floor division by 2**shift
    return out


def _conv1_input_thresholds(conv1, q):
    """The input thresholds of a residual block's conv1, which reads the stream, as the threshold epilogue of the
    op writing that stream takes them (one per channel; a ternary operand's (nonneg, pos) pair as planes), and
    whether they are ternary; None where they vary per pixel (`input_level_shape` of rank 3), which the ops'
    epilogues do not take."""
    if conv1["operand"] == "binary":
        return dict(threshold=q["input_threshold"], flip=q["input_flip"]), False
    if "input_threshold_planes" not in q:
        return None
    return dict(threshold=q["input_threshold_planes"], flip=q["input_flip_planes"]), True


def _image_layer(node, p, levels, stream_dtype=jnp.int32, next_input=None):
    """First layer: the image's levels (int8, or the uint8 pixels they come from) times the int8 weight values,
    with the pool and the output's epilogue in the same op (one custom call on a platform with the native
    kernel). A stream output is written in `stream_dtype`; with `next_input` (`_conv1_input_thresholds`: the thresholds
    of the conv1 reading it) the pair (stream, that conv1's input bits or ternary planes). With thresholds per
    feature, the op's int32 pre-activations are thresholded after it, as `_packed_layer` does."""
    output = node["output"]
    per_feature = _per_feature_levels(node)
    if output in ("binary", "ternary") and not per_feature:
        epilogue = _threshold_epilogue(output, p)
    elif output == "stream":
        epilogue = dict(shift=node["stream_shift"], out_dtype=stream_dtype)
        if next_input is not None:
            epilogue.update(next_input[0], keep_stream=True)
    else:
        epilogue = {}
    if node["kind"] == "conv":
        pool = node["pool"]
        out = ops.image_conv2d(levels, p["kernel"], stride=tuple(node["stride"]),
                               padding=tuple(tuple(q) for q in node["padding"]),
                               pool=None if pool is None else tuple(pool), **epilogue)
    else:
        out = ops.image_matmul(_flatten(levels), p["kernel"], kernel_masks=p.get("kernel_masks"), **epilogue)
    if next_input is not None:
        stream, bits = out
        return stream, (bits[..., 0, :], bits[..., 1, :]) if next_input[1] else bits
    if per_feature:
        return _quantize(output, p, out)
    if output == "ternary":
        return out[..., 0, :], out[..., 1, :]
    if output == "affine":
        # the affine epilogue's float32 steps (the product rounded before the sum, never an FMA), as the Flax
        # classifier and every other affine node compute them
        return reference.epilogue(out, scale=p["scale"], bias=p["bias"])
    return out
