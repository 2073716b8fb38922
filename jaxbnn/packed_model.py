"""The packed checkpoint file (`.jbnn`): one safetensors file whose metadata holds a versioned JSON header.

One definition, used by the exporter (writes) and the runtime (reads). The header carries the format
version, the target and its FSB tile, the inference graph (node kinds, shapes, attributes, the float scale
that float images are quantized from) and a content hash; the graph alone determines which tensors the file must
hold, with which shapes and dtypes (`expected_tensors`). The tensors are the operands the ops take, as they take them (FSB-tiled ±1 weights,
their row or per-tap popcounts, ternary weights as ±1 planes), so the runtime uses them as they are; in
exchange a reader checks their values (`validate`): a wrong popcount or a stray padding bit would give
silently wrong outputs. Layout of the graph and of every tensor: docs/export.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import math
import os
import re
import secrets
import stat
import struct
import sys
from pathlib import Path

import numpy as np

from jaxbnn import formats

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "TARGETS",
    "TRAINING_INPUT_RANGE",
    "PackedModelError",
    "PackedModel",
    "expected_tensors",
    "validate_graph",
    "node_output",
    "validate",
    "content_hash",
    "save",
    "load",
]

FORMAT_NAME = "jaxbnn-packed"
FORMAT_VERSION = 3
METADATA_KEY = "jaxbnn"
# Target -> FSB tile (BH rows, BW bits) its kernels read. All current targets use the TCBNN tile, which is
# also one Hopper wgmma core matrix; the tile is recorded per file so a target may change it later.
TARGETS: dict[str, tuple[int, int]] = {"cpu": formats.FSB_TILE, "sm90": formats.FSB_TILE, "sm80": formats.FSB_TILE}

# The float scale of images given as floats: formats.quantize_images maps [low, high] to the pixels 0..255.
# The exporter records it in every file unless told another.
TRAINING_INPUT_RANGE = (-1.0, 1.0)

# What travels between nodes: the image (int8 levels of the pixels), packed bits, ternary plane pairs, the
# integer residual stream (int32), and at the end the float logits.
OPERANDS = ("image", "binary", "ternary")
WIRES = ("image", "binary", "ternary", "stream")
LINEAR_OUTPUTS = ("binary", "ternary", "affine", "stream")


def is_known_target(target) -> bool:
    """Whether `target` names one of TARGETS (a header's JSON array or object is no name, and unhashable)."""
    return isinstance(target, str) and target in TARGETS


class PackedModelError(ValueError):
    """A packed checkpoint (or a graph about to be written) that does not follow the format."""


@dataclasses.dataclass
class PackedModel:
    """The content of a `.jbnn` file: the graph (JSON-able dict), its tensors (numpy), target and tile."""

    graph: dict
    tensors: dict[str, np.ndarray]
    target: str = "cpu"

    @property
    def tile(self) -> tuple[int, int]:
        return TARGETS[self.target]

    def nbytes(self) -> int:
        """Bytes of all tensors (the packed parameters)."""
        return sum(int(t.nbytes) for t in self.tensors.values())


# --- graph schema ------------------------------------------------------------------------------------


def _fail(where: str, message: str):
    raise PackedModelError(f"{where}: {message}")


def _ints(where, node, key, length=None, minimum=1):
    value = node.get(key)
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        _fail(where, f"attribute {key!r} must be a list of integers, got {value!r}")
    if length is not None and len(value) != length:
        _fail(where, f"attribute {key!r} must have {length} entries, got {value!r}")
    if any(v < minimum for v in value):
        _fail(where, f"attribute {key!r} entries must be >= {minimum}, got {value!r}")
    if any(v > formats.MAX_EXTENT for v in value):  # every size, stride and pool the ops take fits int32
        _fail(where, f"attribute {key!r} entries must be <= {formats.MAX_EXTENT}, got {value!r}")
    return tuple(value)


def _choice(where, node, key, choices):
    value = node.get(key)
    if value not in choices:
        _fail(where, f"attribute {key!r} must be one of {choices}, got {value!r}")
    return value


def _int(where, node, key, minimum=1, maximum=formats.MAX_EXTENT):
    value = node.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        _fail(where, f"attribute {key!r} must be an integer >= {minimum}, got {value!r}")
    if value > maximum:
        _fail(where, f"attribute {key!r} must be an integer <= {maximum}, got {value!r}")
    return value


def uses_conv_layout(node: dict) -> bool:
    """Whether a linear node's ±1 weights are the conv bit matrix (taps padded to whole words, run by bconv2d).

    Binary / ternary-operand convolutions, and dense layers reading a packed image (run as a VALID
    convolution covering it, so the activations stay packed); other dense layers take the dense bit matrix
    (bmm). Image-operand layers store no bit matrix: their `kernel` holds the weight values (int8).
    """
    return node["operand"] != "image" and (node["kind"] == "conv" or len(node["in_shape"]) == 3)


def weight_planes(node: dict) -> int:
    """±1 planes per output channel of a linear node's weights: 1 (binary), 2 (ternary: nonneg, pos)."""
    return 2 if node["weights"] == "ternary" else 1


def weight_geometry(node: dict) -> tuple[int, int, tuple[int, int], int]:
    """(rows, reduction bits of the bit matrix, kernel (kh, kw), input channels c) of a binary- or
    ternary-operand linear node; rows = weight_planes * out_channels."""
    n = node["out_channels"]
    c = node["in_shape"][-1]
    if node["kind"] == "conv":
        kh, kw = node["kernel_size"]
    elif len(node["in_shape"]) == 3:
        kh, kw = node["in_shape"][:2]
    else:
        kh, kw = 1, 1
    rows = weight_planes(node) * n
    if uses_conv_layout(node):
        return rows, kh * kw * formats.num_words(c) * formats.WORD_BITS, (kh, kw), c
    return rows, kh * kw * c, (kh, kw), c


def image_kernel_shape(node: dict) -> tuple[int, ...]:
    """Shape of an image-operand node's `kernel`: the layer's own, HWIO (kh, kw, c, n) or (fan-in, n)."""
    n = node["out_channels"]
    if node["kind"] == "conv":
        return (*node["kernel_size"], node["in_shape"][-1], n)
    return (math.prod(node["in_shape"]), n)


def conv_output_hw(node: dict) -> tuple[int, int]:
    """(OH, OW) of a conv node after its optional pool."""
    h, w, _ = node["in_shape"]
    (pt, pb), (pl, pr) = node["padding"]
    kh, kw = node["kernel_size"]
    sh, sw = node["stride"]
    oh, ow = (h + pt + pb - kh) // sh + 1, (w + pl + pr - kw) // sw + 1
    ph, pw = node["pool"] or (1, 1)
    return oh // ph, ow // pw


def _validate_linear(where: str, node: dict) -> None:
    kind = node["kind"]
    wire = _choice(where, node, "input", WIRES)
    operand = _choice(where, node, "operand", OPERANDS)
    _choice(where, node, "weights", ("binary", "ternary"))
    output = _choice(where, node, "output", LINEAR_OUTPUTS)
    if (wire == "image") != (operand == "image") or (wire not in ("image", "stream") and wire != operand):
        _fail(where, f"a {wire} input cannot feed a {operand} operand")
    if output == "stream":
        _int(where, node, "stream_shift", minimum=0, maximum=31)  # a right shift of int32 dot products
    in_shape = _ints(where, node, "in_shape")
    n = _int(where, node, "out_channels")
    if kind == "conv":
        if len(in_shape) != 3:
            _fail(where, f"conv in_shape must be [H, W, C], got {list(in_shape)}")
        kh, kw = _ints(where, node, "kernel_size", 2)
        _ints(where, node, "stride", 2)
        padding = node.get("padding")
        if (not isinstance(padding, list) or len(padding) != 2
                or not all(isinstance(p, list) and len(p) == 2 for p in padding)
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for p in padding for v in p)):
            _fail(where, f"attribute 'padding' must be [[top, bottom], [left, right]], got {padding!r}")
        # At most the input's extent plus kernel_size - 1 a side, which holds whatever a layer's padding reads
        # the input with ("SAME" and "VALID" stay within kernel_size - 1). Padding costs a file no byte (4000
        # around a 1x1 input: a 64M-element activation from a 2 KB file); so bounded, the padded image is at
        # most about three times the input a side.
        most = (in_shape[0] + kh - 1, in_shape[1] + kw - 1)
        if max(padding[0]) > most[0] or max(padding[1]) > most[1]:
            _fail(where, f"attribute 'padding' {padding!r} exceeds the input's extent plus kernel_size - 1 a side "
                         f"({most[0]} rows, {most[1]} columns): the outputs past it would read padding only")
        if _choice(where, node, "pad_value", ("zero", "one")) != "zero" and operand == "image":
            _fail(where, "an image operand is padded with level 0 (pixel 128): its pad_value must be 'zero'")
        if "pool" not in node:
            _fail(where, "attribute 'pool' missing (null, or [PH, PW] for a max pool)")
        if node["pool"] is not None:
            _ints(where, node, "pool", 2)
        h, w, _ = in_shape
        (pt, pb), (pl, pr) = padding
        if h + pt + pb < kh or w + pl + pr < kw:
            _fail(where, f"a {kh}x{kw} kernel does not fit the padded input {list(in_shape)}")
        oh, ow = conv_output_hw(node)
        if oh < 1 or ow < 1:
            _fail(where, "the pool is larger than the convolution output")
        out_shape = [oh, ow, n]
    else:
        if len(in_shape) not in (1, 3):
            _fail(where, f"dense in_shape must be [K] or [H, W, C], got {list(in_shape)}")
        out_shape = [n]
    products = kh * kw * in_shape[-1] if kind == "conv" else math.prod(in_shape)
    if operand == "image" and products > formats.MAX_IMAGE_REDUCTION:
        _fail(where, f"a first layer of {products} products per output: at most {formats.MAX_IMAGE_REDUCTION} "
                     "int8 products are sure to sum within int32")
    if node.get("out_shape") != out_shape:
        _fail(where, f"out_shape must be {out_shape} for these attributes, got {node.get('out_shape')!r}")
    if output == "ternary":
        _check_level_shape(where, node, "level_shape", out_shape)
    if wire == "stream" and operand == "ternary":
        _check_level_shape(where, node, "input_level_shape", in_shape)


def _check_level_shape(where: str, node: dict, key: str, shape) -> None:
    """A ternary quantizer's levels: one per channel ([C]) or one per feature (the whole shape)."""
    level = _ints(where, node, key)
    if tuple(level) not in ((shape[-1],), tuple(shape)):
        _fail(where, f"{key} {list(level)} must be [{shape[-1]}] or {list(shape)}")


def node_output(node: dict) -> tuple[str, list[int]]:
    """(wire, per-sample shape) of what a node outputs: "binary", "ternary", "stream" or "float" (logits)."""
    if node["kind"] in ("dense", "conv"):
        return ("float" if node["output"] == "affine" else node["output"]), node["out_shape"]
    if node["kind"] == "global_pool":
        return node["output"], node["out_shape"]
    return "stream", node["out_shape"]  # a residual block


def validate_graph(graph: dict) -> None:
    """Check a graph's structure: known node kinds, complete attributes, consistent shapes between nodes."""
    if not isinstance(graph, dict):
        raise PackedModelError(f"graph must be a JSON object, got {type(graph).__name__}")
    for key, kind in (("name", str), ("mode", str), ("nodes", list)):
        if not isinstance(graph.get(key), kind):
            raise PackedModelError(f"graph attribute {key!r} missing or not a {kind.__name__}")
    input_shape = _ints("graph", graph, "input_shape")
    num_classes = _int("graph", graph, "num_classes")
    _check_input_range(graph.get("input_range"))
    if not graph["nodes"]:
        raise PackedModelError("graph has no nodes")
    wire, shape = "image", list(input_shape)
    for index, node in enumerate(graph["nodes"]):
        where = f"node {index}"
        if not isinstance(node, dict):
            _fail(where, "must be a JSON object")
        kind = _choice(where, node, "kind", ("dense", "conv", "residual", "global_pool"))
        if not isinstance(node.get("name"), str):
            _fail(where, f"attribute 'name' must be a string, got {node.get('name')!r}")
        where = f"node {index} ({node['name']})"
        in_shape = node.get("in_shape")
        if in_shape != shape:
            _fail(where, f"in_shape {in_shape!r} differs from the previous output shape {shape}")
        if kind in ("dense", "conv"):
            _validate_linear(where, node)
            if node["input"] != wire:
                _fail(where, f"input is {node['input']!r} but the previous node outputs {wire!r}")
            if wire == "stream":
                _fail(where, "the integer stream is read by residual blocks and global pooling only")
        elif kind == "residual":
            _validate_residual(where, node)
            if wire != "stream":
                _fail(where, f"a residual block takes the integer stream, the previous node outputs {wire!r}")
        else:
            if wire != "stream" or len(shape) != 3 or node.get("out_shape") != shape[-1:]:
                _fail(where, f"global_pool takes the integer stream of an image and outputs [C], got {wire} "
                             f"{shape}, out {node.get('out_shape')!r}")
            if _choice(where, node, "output", ("binary", "ternary")) == "ternary":
                _check_level_shape(where, node, "level_shape", shape[-1:])
        wire, shape = node_output(node)
    if wire != "float" or shape != [num_classes]:
        raise PackedModelError(f"the last node must output float logits [{num_classes}], got {wire} {shape}")


def _check_input_range(value) -> None:
    if value is None:
        raise PackedModelError("graph attribute 'input_range' missing (the input scale the model was trained "
                               "on): re-export the model from its training run: jaxbnn export RUN_DIR MODEL.jbnn")
    low, high = _floats_of_pair(value)
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise PackedModelError(f"graph attribute 'input_range' must be [low, high], finite numbers with low < high, "
                               f"got {value!r}")
    if not formats.resolves_pixels(low, high):
        raise PackedModelError(f"graph attribute 'input_range' {value!r} is beyond float32: float images on it do "
                               "not quantize back to their pixels 0..255 (formats.quantize_images computes in float32)")


def _floats_of_pair(value) -> tuple[float, float]:
    """The floats of a JSON pair of numbers; NaNs where it is not two numbers a float holds."""
    if not (isinstance(value, list) and len(value) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
        return math.nan, math.nan
    try:
        return float(value[0]), float(value[1])
    except OverflowError:  # an integer beyond any float
        return math.nan, math.nan



def _validate_residual(where: str, node: dict) -> None:
    in_shape = _ints(where, node, "in_shape", 3)
    stride = _int(where, node, "shortcut_stride")
    for key in ("conv1", "conv2"):
        if not isinstance(node.get(key), dict) or node[key].get("kind") != "conv":
            _fail(where, f"{key} must be a conv node")
        _validate_linear(f"{where}.{key}", node[key])
    conv1, conv2 = node["conv1"], node["conv2"]
    if conv1["in_shape"] != list(in_shape) or conv1["input"] != "stream":
        _fail(where, "conv1 must read the block's integer stream")
    if conv1["output"] not in ("binary", "ternary"):
        _fail(where, "conv1 must output bits for conv2")
    if conv2["in_shape"] != conv1["out_shape"] or conv2["input"] != conv1["output"]:
        _fail(where, "conv2 must read conv1's output")
    if conv2["output"] != "stream" or conv2["stream_shift"] != 0:
        _fail(where, "conv2 must output its integer dot products as they are (stream, shift 0): they join the "
                     "shortcut")
    h, w, c = in_shape
    out_shape = conv2["out_shape"]
    if out_shape != [-(-h // stride), -(-w // stride), out_shape[-1]] or out_shape[-1] < c:
        _fail(where, f"the type-A shortcut of {list(in_shape)} at stride {stride} cannot reach {out_shape}")
    if node.get("out_shape") != out_shape:
        _fail(where, f"out_shape must be conv2's {out_shape}, got {node.get('out_shape')!r}")


# --- tensors ---------------------------------------------------------------------------------------------


def _linear_tensors(prefix: str, node: dict, tile) -> dict[str, tuple[tuple[int, ...], str]]:
    specs: dict[str, tuple[tuple[int, ...], str]] = {}
    n = node["out_channels"]
    if node["operand"] == "image":
        specs["kernel"] = (image_kernel_shape(node), "int8")
    else:
        rows, k_bits, (kh, kw), _ = weight_geometry(node)
        specs["weight"] = (formats.fsb_shape(rows, k_bits, tile), "uint32")
        if uses_conv_layout(node):
            specs["weight_tap_popcount"] = ((kh * kw, rows), "int32")
        else:
            specs["weight_popcount"] = ((rows,), "int32")
    if node["input"] == "stream":
        specs.update(_threshold_tensors("input_", node["operand"], node.get("input_level_shape"), node["in_shape"][-1]))
    output = node["output"]
    if output in ("binary", "ternary"):
        specs.update(_threshold_tensors("", output, node.get("level_shape"), n))
    elif output == "affine":
        specs["scale"] = ((n,), "float32")
        specs["bias"] = ((n,), "float32")
    return {f"{prefix}{name}": spec for name, spec in specs.items()}


def _threshold_tensors(prefix: str, domain: str, level_shape, channels: int) -> dict:
    """int32 thresholds and bool flips of a quantizer: one per channel (binary), per plane (ternary)."""
    if domain == "binary":
        return {f"{prefix}threshold": ((channels,), "int32"), f"{prefix}flip": ((channels,), "bool")}
    level = tuple(level_shape)
    return {f"{prefix}{name}_{plane}": (level, dtype) for plane in ("nonneg", "pos")
            for name, dtype in (("threshold", "int32"), ("flip", "bool"))}


def expected_tensors(graph: dict, tile) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype) of every tensor a (validated) graph needs, and nothing else."""
    specs = {}
    for index, node in enumerate(graph["nodes"]):
        prefix = f"nodes.{index}."
        if node["kind"] in ("dense", "conv"):
            specs.update(_linear_tensors(prefix, node, tile))
        elif node["kind"] == "residual":
            specs.update(_linear_tensors(prefix + "conv1.", node["conv1"], tile))
            specs.update(_linear_tensors(prefix + "conv2.", node["conv2"], tile))
        else:
            specs.update({prefix + name: spec for name, spec in _threshold_tensors(
                "", node["output"], node.get("level_shape"), node["out_shape"][-1]).items()})
    return specs


def _check_tensors(tensors: dict[str, np.ndarray], graph: dict, tile) -> None:
    expected = expected_tensors(graph, tile)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing:
        raise PackedModelError(f"tensors missing for this graph: {missing}")
    if extra:
        raise PackedModelError(f"tensors not used by this graph: {extra}")
    for name, (shape, dtype) in expected.items():
        array = tensors[name]
        if str(array.dtype) != dtype:
            raise PackedModelError(f"tensor {name!r} has dtype {array.dtype}, the graph needs {dtype}")
        if tuple(array.shape) != tuple(shape):
            raise PackedModelError(f"tensor {name!r} has shape {tuple(array.shape)}, the graph needs {tuple(shape)}")


def _linear_nodes(graph: dict):
    """(where, tensor-name prefix, node) of every linear node, residual blocks' convs included."""
    for index, node in enumerate(graph["nodes"]):
        where = f"node {index} ({node['name']})"
        if node["kind"] in ("dense", "conv"):
            yield where, f"nodes.{index}.", node
        elif node["kind"] == "residual":
            for key in ("conv1", "conv2"):
                yield f"{where}.{key}", f"nodes.{index}.{key}.", node[key]


def _reduction_word_mask(node: dict, words: int) -> np.ndarray:
    """uint32 (words,): the bits of a bit-matrix row that hold weights; every other bit is padding (0)."""
    _, k_bits, (kh, kw), c = weight_geometry(node)
    if uses_conv_layout(node):
        per_tap, real = formats.num_words(c), c  # each tap's channels padded to whole words
    else:
        per_tap, real = formats.num_words(k_bits), k_bits
    tap = np.full(per_tap, 0xFFFFFFFF, np.uint32)
    if real % formats.WORD_BITS:
        tap[-1] = (1 << (real % formats.WORD_BITS)) - 1
    taps = kh * kw if uses_conv_layout(node) else 1
    mask = np.zeros(words, np.uint32)
    mask[: taps * per_tap] = np.tile(tap, taps)
    return mask


def _check_bit_matrix(where: str, prefix: str, node: dict, tensors: dict) -> None:
    """Zero padding bits, the stored popcounts equal to the bits', and ternary planes with pos within nonneg."""
    name = prefix + "weight"
    tiles = np.asarray(tensors[name])
    rt, kt, bh, ww = tiles.shape
    matrix = tiles.transpose(0, 2, 1, 3).reshape(rt * bh, kt * ww)
    rows, _, (kh, kw), c = weight_geometry(node)
    mask = _reduction_word_mask(node, kt * ww)
    if matrix[rows:].any() or (matrix[:rows] & ~mask).any():
        bits = int(np.bitwise_count(mask).sum())
        _fail(where, f"tensor {name!r} has bits set outside its {rows} x {bits}-bit weight matrix (FSB padding "
                     "rows, words and bits must be 0)")
    counts = np.bitwise_count(matrix[:rows]).astype(np.int32)
    if uses_conv_layout(node):
        popcount_name, index_names = prefix + "weight_tap_popcount", ("tap", "row")
        actual = counts[:, : kh * kw * formats.num_words(c)].reshape(rows, kh * kw, -1).sum(axis=-1).T
    else:
        popcount_name, index_names = prefix + "weight_popcount", ("row",)
        actual = counts.sum(axis=-1)
    stored = np.asarray(tensors[popcount_name])
    if not np.array_equal(stored, actual):
        at = tuple(int(i) for i in np.argwhere(stored != actual)[0])
        place = ", ".join(f"{label} {i}" for label, i in zip(index_names, at))
        _fail(where, f"tensor {popcount_name!r} does not match the bits of {name!r}: at {place} it holds "
                     f"{int(stored[at])}, the bits {int(actual[at])}")
    if node["weights"] == "ternary":
        n = node["out_channels"]
        nonneg, pos = matrix[:n], matrix[n:rows]
        if (pos & ~nonneg).any():
            channel = int(np.argwhere(pos & ~nonneg)[0][0])
            _fail(where, f"tensor {name!r}: output channel {channel} has a bit of the pos plane (w > 0) set "
                         "where its nonneg plane (w >= 0) has none")


def _check_values(graph: dict, tensors: dict) -> None:
    """The values of what the ops take as they are: weights and popcounts."""
    for where, prefix, node in _linear_nodes(graph):
        if node["operand"] == "image":
            name = prefix + "kernel"
            allowed = (-1, 1) if node["weights"] == "binary" else (-1, 0, 1)
            kernel = np.asarray(tensors[name])
            bad = ~np.isin(kernel, allowed)
            if bad.any():
                at = tuple(int(i) for i in np.argwhere(bad)[0])
                _fail(where, f"tensor {name!r} holds {int(kernel[at])} at {at}; {node['weights']} weights "
                             f"are {allowed}")
        else:
            _check_bit_matrix(where, prefix, node, tensors)


def _check_tensor_types(tensors) -> None:
    if not isinstance(tensors, dict):
        raise PackedModelError(f"tensors must be a dict of name -> numpy array, got {type(tensors).__name__}")
    for name, array in tensors.items():
        if not isinstance(name, str) or not (hasattr(array, "dtype") and hasattr(array, "shape")):
            raise PackedModelError(f"tensor {name!r} must be a numpy array named by a string, got "
                                   f"{type(array).__name__}")


def _check_structure(model: PackedModel) -> None:
    _check_tensor_types(model.tensors)
    if not is_known_target(model.target):
        raise PackedModelError(f"unknown target {model.target!r}; known: {sorted(TARGETS)}")
    validate_graph(model.graph)
    _check_tensors(model.tensors, model.graph, model.tile)


def validate(model: PackedModel) -> None:
    """Check a packed model as `save` and `load` do: target and tile, graph, tensor names, shapes and dtypes,
    and values (weight values, zero padding bits, popcounts equal to the bits').
    Raises PackedModelError naming the node and tensor."""
    _check_structure(model)
    _check_values(model.graph, model.tensors)


def content_hash(header_core: dict, tensors: dict[str, np.ndarray]) -> str:
    """sha256 over the canonical JSON of the header (without its hash) and every tensor's name, dtype,
    shape and bytes, in name order."""
    digest = hashlib.sha256(json.dumps(header_core, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        digest.update(json.dumps([name, str(array.dtype), list(array.shape)]).encode())
        digest.update(array.tobytes())
    return "sha256:" + digest.hexdigest()


def _header_core(model: PackedModel) -> dict:
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "target": model.target,
        "tile": list(model.tile),
        "graph": model.graph,
    }


# --- files -------------------------------------------------------------------------------------------------


def _names_a_folder(path) -> bool:
    """".", "/", "", a name ending in a separator or in "." or ".." (Path would drop the separator or the "." and
    write a file of the folder's name)."""
    raw = os.fspath(path)
    separators = (os.sep, os.altsep) if os.altsep else (os.sep,)
    return isinstance(raw, str) and (not Path(raw).name or raw.endswith(separators)
                                     or os.path.basename(raw) in (".", ".."))


def save(path: str | os.PathLike, model: PackedModel) -> int:
    """Validate `model` and write it to `path` atomically (a temporary file beside it, renamed over it);
    returns the file size in bytes. The file keeps the mode of the one it replaces, or gets 0o666 less the
    umask, as a file written with open() would. An OSError of the write names `path`, not the temporary."""
    from safetensors.numpy import save as save_safetensors

    _check_tensor_types(model.tensors)
    tensors = {name: np.ascontiguousarray(array) for name, array in model.tensors.items()}
    validate(PackedModel(graph=model.graph, tensors=tensors, target=model.target))
    core = _header_core(model)
    header = dict(core, content_hash=content_hash(core, tensors))
    blob = save_safetensors(tensors, metadata={METADATA_KEY: json.dumps(header, sort_keys=True)})
    if _names_a_folder(path):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
    path = Path(path)
    if not path.parent.is_dir():  # else the error would name the temporary file
        raise FileNotFoundError(errno.ENOENT, "no such folder to write the packed checkpoint into", str(path.parent))
    _remove_stale_temporaries(path)
    tmp = path.with_name(f".{_temporary_stem(path)}.{os.getpid()}.{secrets.token_hex(_TMP_TOKEN_BYTES)}{_TMP_SUFFIX}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
        try:
            with os.fdopen(fd, "wb") as f:
                try:
                    os.fchmod(f.fileno(), stat.S_IMODE(os.stat(path).st_mode))
                except FileNotFoundError:
                    pass
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as error:
        raise _error_naming(path, error) from None
    return len(blob)


def _error_naming(path: Path, error: OSError) -> OSError:
    """`error` naming `path` in place of the hidden temporary (or the pair of both) it names."""
    if error.errno is None:
        return error
    return OSError(error.errno, error.strerror, str(path))  # OSError(errno, ...) is errno's subclass


# A temporary is named `.{stem}.{pid}.{token}.jbnn-tmp`: the stem stands for the file it will replace (its name,
# or where that would make too long a name, a prefix and a hash of it), the pid is its writer's, the token
# tells apart the temporaries of one process.
_TMP_SUFFIX = ".jbnn-tmp"
_TMP_TOKEN_BYTES = 4
_PID_DIGITS = 10  # any 32-bit process id


def _temporary_stem(path: Path) -> str:
    """The part of the names of `path`'s temporaries that stands for `path`: its name where that leaves them
    within the folder's name length limit, else a prefix of the name and a hash of all of it."""
    try:
        name_max = os.pathconf(path.parent, "PC_NAME_MAX")
    except (OSError, ValueError):  # no limit known for this folder
        name_max = 255
    room = name_max - len(f"..{'0' * _PID_DIGITS}.{'0' * 2 * _TMP_TOKEN_BYTES}{_TMP_SUFFIX}")
    stem = path.name
    if len(os.fsencode(stem)) <= room:
        return stem
    digest = "~" + hashlib.sha256(os.fsencode(stem)).hexdigest()[:16]
    while stem and len(os.fsencode(stem + digest)) > room:
        stem = stem[:-1]
    return stem + digest


def _remove_stale_temporaries(path: Path) -> None:
    """Delete the temporary files that killed writes of `path` left (a kill runs no cleanup): those named
    with the id of a process that no longer exists. A live writer's file, and any name other than that of a
    temporary of `path`, is left alone; so is everything where the folder cannot be listed or the file removed,
    which does not stop the write."""
    pattern = re.compile(rf"\.{re.escape(_temporary_stem(path))}\.([0-9]{{1,{_PID_DIGITS}}})"
                         rf"\.[0-9a-f]{{{2 * _TMP_TOKEN_BYTES}}}{re.escape(_TMP_SUFFIX)}")
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        match = pattern.fullmatch(name)
        if match is None or int(match[1]) == os.getpid():
            continue
        try:
            os.kill(int(match[1]), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):  # e.g. another user's file in a sticky folder
                os.unlink(path.parent / name)
        except (OSError, OverflowError):
            pass  # another user's live process, or a number beyond any process id


# A graph header is a few kilobytes per layer; a larger size prefix is corruption, never read into memory.
MAX_HEADER_BYTES = 64 * 2**20
_HEADER_KEYS = ("format", "format_version", "target", "tile", "graph", "content_hash")


def _parse_json(text: bytes | str, what: str, where: str):
    """The JSON value of `text`, or None where it is not JSON; too deep a nesting and too long an integer are
    refused by name."""
    try:
        return json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError):
        return None
    except RecursionError:
        raise PackedModelError(f"{where}: {what} nests too deeply to be a packed checkpoint's") from None
    except ValueError:  # the only other ValueError json raises: Python's limit on integer digits
        raise PackedModelError(f"{where}: {what} holds an integer of more than {sys.get_int_max_str_digits()} "
                               "digits, more than any size in a packed checkpoint") from None


def _read_header(prefix: bytes, file_size: int, read, where: str) -> tuple[dict, int]:
    """(the jaxbnn header, the safetensors header size) from the 8-byte size prefix, reading only the
    header bytes it announces once they are known to lie inside the file."""
    not_packed = f"{where}: not a jaxbnn packed checkpoint (.jbnn)"
    if file_size < 8 or len(prefix) < 8:
        raise PackedModelError(f"{not_packed}: the file holds only {file_size} bytes")
    (size,) = struct.unpack("<Q", prefix)
    if size > file_size - 8:
        raise PackedModelError(f"{not_packed}: it does not start with the safetensors header a .jbnn file has")
    if size > MAX_HEADER_BYTES:
        raise PackedModelError(f"{not_packed}: a safetensors header of {size} bytes is larger than a packed "
                               f"checkpoint's can be ({MAX_HEADER_BYTES})")
    table = _parse_json(read(size), "safetensors header", where)
    if not isinstance(table, dict):
        raise PackedModelError(f"{not_packed}: it does not start with the safetensors header a .jbnn file has")
    metadata = table.get("__metadata__")
    if not isinstance(metadata, dict) or METADATA_KEY not in metadata:
        raise PackedModelError(f"{not_packed}: a safetensors file without the {METADATA_KEY!r} header that "
                               "`jaxbnn export` writes")
    header = _parse_json(metadata[METADATA_KEY], "jaxbnn header", where)
    if header is None:
        raise PackedModelError(f"{where}: jaxbnn header is not valid JSON")
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        raise PackedModelError(f"{where}: header does not declare format {FORMAT_NAME!r}")
    version = header.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise PackedModelError(f"{where}: format_version must be an integer, got {version!r}")
    if version != FORMAT_VERSION:
        raise PackedModelError(f"{where}: format version {version!r} is not supported (this jaxbnn reads "
                               f"version {FORMAT_VERSION}); re-export the model from its training run: "
                               "jaxbnn export RUN_DIR MODEL.jbnn")
    unknown = sorted(set(header) - set(_HEADER_KEYS))
    if unknown:
        raise PackedModelError(f"{where}: header holds keys this format does not define: {unknown}")
    return header, size


def _open_regular(path: Path, where: str) -> int:
    """A read-only descriptor of `path`, refused unless it is a regular file. Opened non-blocking, so a
    FIFO is refused instead of waiting for a writer; a directory or device is never read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:  # Linux refuses to open a socket (ENXIO)
        if err.errno != errno.ENXIO or not stat.S_ISSOCK(os.stat(path).st_mode):
            raise
        raise PackedModelError(f"{where}: is a socket, not a packed checkpoint file") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a regular file")
        raise PackedModelError(f"{where}: is {kind}, not a packed checkpoint file")
    return fd


def _read_exactly(f, count: int, where: str) -> bytes:
    data = f.read(count)
    if len(data) != count:
        raise PackedModelError(f"{where}: file ended after {len(data)} of {count} bytes (changed while read?)")
    return data


def load(path: str | os.PathLike) -> PackedModel:
    """Read and validate a packed checkpoint: a regular file; format and version, graph; the file size
    against the tensors the graph needs (before the tensor bytes are read); tensor names, shapes, dtypes,
    the content hash over the header as stored and the tensors, then the values (`validate`).
    Raises PackedModelError naming the problem (FileNotFoundError / OSError where the file cannot be
    opened)."""
    from safetensors.numpy import load as load_safetensors

    path = Path(path)
    where = str(path)
    with os.fdopen(_open_regular(path, where), "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        header, header_size = _read_header(prefix, file_size, lambda n: _read_exactly(f, n, where), where)
        target = header.get("target")
        if not is_known_target(target):
            raise PackedModelError(f"{where}: unknown target {target!r}; known: {sorted(TARGETS)}")
        if header.get("tile") != list(TARGETS[target]):
            raise PackedModelError(f"{where}: tile {header.get('tile')!r} is not the {target} tile "
                                   f"{list(TARGETS[target])}")
        graph = header.get("graph")
        try:
            validate_graph(graph)
        except PackedModelError as error:
            raise PackedModelError(f"{where}: {error}") from None
        data_bytes = sum(math.prod(shape) * np.dtype(dtype).itemsize
                         for shape, dtype in expected_tensors(graph, TARGETS[target]).values())
        if file_size != 8 + header_size + data_bytes:
            raise PackedModelError(f"{where}: the file has {file_size} bytes, its graph's tensors need "
                                   f"{8 + header_size + data_bytes}: truncated, padded or not this graph's")
        f.seek(0)
        blob = _read_exactly(f, file_size, where)
    try:
        tensors = load_safetensors(blob)
    except Exception as error:  # safetensors raises its own SafetensorError for any malformed payload
        raise PackedModelError(f"{where}: corrupted tensor data ({error})") from None
    try:
        _check_tensors(tensors, graph, TARGETS[target])
    except PackedModelError as error:
        raise PackedModelError(f"{where}: {error}") from None
    model = PackedModel(graph=graph, tensors=tensors, target=target)
    stored = header.get("content_hash")
    actual = content_hash({key: value for key, value in header.items() if key != "content_hash"}, tensors)
    if stored != actual:
        raise PackedModelError(f"{where}: content hash mismatch (header {stored!r}, content {actual!r}): "
                               "the file is corrupted or was modified")
    try:
        _check_values(graph, tensors)
    except PackedModelError as error:
        raise PackedModelError(f"{where}: {error}") from None
    return model
