"""The packed checkpoint file (`.jbnn`): one safetensors file whose metadata holds a versioned JSON header.

One definition, used by the exporter (writes) and the runtime (reads). The header carries the format
version, the target and its FSB tile, the inference graph (node kinds, shapes, attributes, the input range
the model was trained on) and a content hash; the graph alone determines which tensors the file must
hold, with which shapes and dtypes (`expected_tensors`). The tensors are the operands the ops take, as they take them (FSB-tiled ±1 weights,
their row or per-tap popcounts, ternary weights as ±1 planes), so the runtime uses them as they are; in
exchange a reader checks their values (`validate`): a wrong popcount or a stray padding bit would give
silently wrong outputs. Layout of the graph and of every tensor: docs/export.md.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import hashlib
import json
import math
import os
import secrets
import stat
import struct
from pathlib import Path

import numpy as np

from jaxbnn import formats

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "TARGETS",
    "TRAINING_INPUT_RANGE",
    "pixel_values",
    "PackedModelError",
    "PackedModel",
    "expected_tensors",
    "validate_graph",
    "validate",
    "content_hash",
    "save",
    "load",
]

FORMAT_NAME = "jaxbnn-packed"
FORMAT_VERSION = 2
METADATA_KEY = "jaxbnn"
# Target -> FSB tile (BH rows, BW bits) its kernels read. All current targets use the TCBNN tile, which is
# also one Hopper wgmma core matrix; the tile is recorded per file so a target may change it later.
TARGETS: dict[str, tuple[int, int]] = {"cpu": formats.FSB_TILE, "sm90": formats.FSB_TILE, "sm80": formats.FSB_TILE}

# The float range that jaxbnn.train maps uint8 pixels to (train/data.py's to_float); the exporter records
# it in every file unless told another.
TRAINING_INPUT_RANGE = (-1.0, 1.0)

DOMAINS = ("float", "binary", "ternary")
LINEAR_OUTPUTS = ("binary", "ternary", "affine", "float")


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


def pixel_values(input_range) -> np.ndarray:
    """float32 (256,): the model input of each uint8 pixel value p, low + p * (high - low) / 255, computed
    in float32 as training computes it (float32(p) * float32((high - low) / 255) + float32(low))."""
    low, high = (float(v) for v in input_range)
    return np.arange(256, dtype=np.float32) * np.float32((high - low) / 255) + np.float32(low)


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
    return tuple(value)


def _choice(where, node, key, choices):
    value = node.get(key)
    if value not in choices:
        _fail(where, f"attribute {key!r} must be one of {choices}, got {value!r}")
    return value


def _int(where, node, key, minimum=1):
    value = node.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        _fail(where, f"attribute {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def uses_conv_layout(node: dict) -> bool:
    """Whether a linear node's ±1 weights are the conv bit matrix (taps padded to whole words, run by bconv2d).

    Binary / ternary-operand convolutions, and dense layers reading a packed image (run as a VALID
    convolution covering it, so the activations stay packed); other dense layers take the dense bit matrix
    (bmm). Float-operand layers store no bit matrix: their `kernel` holds the weight values.
    """
    return node["operand"] != "float" and (node["kind"] == "conv" or len(node["in_shape"]) == 3)


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


def float_kernel_shape(node: dict) -> tuple[int, ...]:
    """Shape of a float-operand node's `kernel`: the layer's own, HWIO (kh, kw, c, n) or (fan-in, n)."""
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
    wire = _choice(where, node, "input", DOMAINS)
    operand = _choice(where, node, "operand", DOMAINS)
    _choice(where, node, "weights", ("binary", "ternary"))
    output = _choice(where, node, "output", LINEAR_OUTPUTS)
    if wire != "float" and wire != operand:
        _fail(where, f"a {wire} input cannot feed a {operand} operand")
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
        _choice(where, node, "pad_value", ("zero", "one"))
        if node.get("pool") is not None:
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
    if node.get("out_shape") != out_shape:
        _fail(where, f"out_shape must be {out_shape} for these attributes, got {node.get('out_shape')!r}")
    if output == "ternary":
        level = _ints(where, node, "level_shape")
        if level[-1] != n or tuple(out_shape[-len(level):]) != level:
            _fail(where, f"level_shape {list(level)} does not broadcast to the output {out_shape}")
    if wire == "float" and operand == "ternary":
        level = _ints(where, node, "input_level_shape")
        if tuple(in_shape[-len(level):]) != level:
            _fail(where, f"input_level_shape {list(level)} does not broadcast to the input {list(in_shape)}")
    if output == "float":
        for key in ("kernel_scale", "bias"):
            if not isinstance(node.get(key), bool):
                _fail(where, f"attribute {key!r} must be true or false, got {node.get(key)!r}")


def _node_output(node: dict) -> tuple[str, list[int]]:
    """(domain, per-sample shape) of what a node puts on the wire."""
    if node["kind"] in ("dense", "conv"):
        domain = {"affine": "float", "float": "float"}.get(node["output"], node["output"])
        return domain, node["out_shape"]
    return "float", node["out_shape"]  # residual blocks and global pooling keep the real-valued stream


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
    wire, shape = "float", list(input_shape)
    for index, node in enumerate(graph["nodes"]):
        where = f"node {index}"
        if not isinstance(node, dict):
            _fail(where, "must be a JSON object")
        kind = _choice(where, node, "kind", ("dense", "conv", "residual", "global_avg_pool"))
        where = f"node {index} ({node.get('name', kind)})"
        in_shape = node.get("in_shape")
        if in_shape != shape:
            _fail(where, f"in_shape {in_shape!r} differs from the previous output shape {shape}")
        if kind in ("dense", "conv"):
            _validate_linear(where, node)
            if node["input"] != wire:
                _fail(where, f"input is {node['input']!r} but the previous node outputs {wire!r}")
        elif kind == "residual":
            _validate_residual(where, node)
            if wire != "float":
                _fail(where, "a residual block takes the real-valued stream")
        else:
            if wire != "float" or len(shape) != 3 or node.get("out_shape") != shape[-1:]:
                _fail(where, f"global_avg_pool takes a float image and outputs [C], got in {shape}, "
                             f"out {node.get('out_shape')!r}")
        wire, shape = _node_output(node)
    if wire != "float" or shape != [num_classes]:
        raise PackedModelError(f"the last node must output float logits [{num_classes}], got {wire} {shape}")


def _check_input_range(value) -> None:
    if value is None:
        raise PackedModelError("graph attribute 'input_range' missing (the input scale the model was trained "
                               "on): re-export the model from its training run: jaxbnn export RUN_DIR MODEL.jbnn")
    numbers = isinstance(value, list) and len(value) == 2 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    if not numbers or not value[0] < value[1]:
        raise PackedModelError(f"graph attribute 'input_range' must be [low, high], finite numbers with low < high, "
                               f"got {value!r}")


def _validate_residual(where: str, node: dict) -> None:
    in_shape = _ints(where, node, "in_shape", 3)
    stride = _int(where, node, "shortcut_stride")
    for key in ("conv1", "conv2"):
        if not isinstance(node.get(key), dict) or node[key].get("kind") != "conv":
            _fail(where, f"{key} must be a conv node")
        _validate_linear(f"{where}.{key}", node[key])
    conv1, conv2 = node["conv1"], node["conv2"]
    if conv1["in_shape"] != list(in_shape) or conv1["input"] != "float":
        _fail(where, "conv1 must read the block's float input")
    if conv2["in_shape"] != conv1["out_shape"] or conv2["input"] != _node_output(conv1)[0]:
        _fail(where, "conv2 must read conv1's output")
    if conv2["output"] != "float":
        _fail(where, "conv2 must output float (it is added to the shortcut)")
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
    if node["operand"] == "float":
        specs["kernel"] = (float_kernel_shape(node), "int8")
    else:
        rows, k_bits, (kh, kw), _ = weight_geometry(node)
        specs["weight"] = (formats.fsb_shape(rows, k_bits, tile), "uint32")
        if uses_conv_layout(node):
            specs["weight_tap_popcount"] = ((kh * kw, rows), "int32")
        else:
            specs["weight_popcount"] = ((rows,), "int32")
    if node["input"] == "float" and node["operand"] == "ternary":
        level = tuple(node["input_level_shape"])
        specs["input_threshold_nonneg"] = (level, "float32")
        specs["input_threshold_pos"] = (level, "float32")
    threshold_dtype = "float32" if node["operand"] == "float" else "int32"
    output = node["output"]
    if output == "binary":
        specs["threshold"] = ((n,), threshold_dtype)
        specs["flip"] = ((n,), "bool")
    elif output == "ternary":
        level = tuple(node["level_shape"])
        for plane in ("nonneg", "pos"):
            specs[f"threshold_{plane}"] = (level, threshold_dtype)
            specs[f"flip_{plane}"] = (level, "bool")
    elif output == "affine":
        specs["scale"] = ((n,), "float32")
        specs["bias"] = ((n,), "float32")
    else:
        for name in ("bn_mean", "bn_mul", "bn_bias"):
            specs[name] = ((n,), "float32")
        if node["kernel_scale"]:
            specs["kernel_scale"] = ((n,), "float32")
        if node["bias"]:
            specs["bias"] = ((n,), "float32")
    return {f"{prefix}{name}": spec for name, spec in specs.items()}


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
    """The values of what the ops take as they are: weights, popcounts, float thresholds."""
    for where, prefix, node in _linear_nodes(graph):
        if node["operand"] == "float":
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
        for short in ("threshold", "threshold_nonneg", "threshold_pos", "input_threshold_nonneg",
                      "input_threshold_pos"):
            value = tensors.get(prefix + short)
            if value is not None and np.issubdtype(value.dtype, np.floating) and np.isnan(np.asarray(value)).any():
                _fail(where, f"tensor {prefix + short!r} holds NaN (a comparison with NaN is never true)")


def _check_structure(model: PackedModel) -> None:
    if model.target not in TARGETS:
        raise PackedModelError(f"unknown target {model.target!r}; known: {sorted(TARGETS)}")
    validate_graph(model.graph)
    _check_tensors(model.tensors, model.graph, model.tile)


def validate(model: PackedModel) -> None:
    """Check a packed model as `save` and `load` do: target and tile, graph, tensor names, shapes and dtypes,
    and values (weight values, zero padding bits, popcounts equal to the bits', no NaN threshold).
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


def save(path: str | os.PathLike, model: PackedModel) -> int:
    """Validate `model` and write it to `path` atomically (a temporary file beside it, renamed over it);
    returns the file size in bytes. The file keeps the mode of the one it replaces, or gets 0o666 less the
    umask, as a file written with open() would."""
    from safetensors.numpy import save as save_safetensors

    tensors = {name: np.ascontiguousarray(array) for name, array in model.tensors.items()}
    validate(PackedModel(graph=model.graph, tensors=tensors, target=model.target))
    core = _header_core(model)
    header = dict(core, content_hash=content_hash(core, tensors))
    blob = save_safetensors(tensors, metadata={METADATA_KEY: json.dumps(header, sort_keys=True)})
    path = Path(path)
    if not path.parent.is_dir():  # else the error would name the temporary file
        raise FileNotFoundError(errno.ENOENT, "no such folder to write the packed checkpoint into", str(path.parent))
    _remove_stale_temporaries(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}")
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
    return len(blob)


_TMP_SUFFIX = ".jbnn-tmp"


def _remove_stale_temporaries(path: Path) -> None:
    """Delete the temporary files that killed writes of `path` left (a kill runs no cleanup): those named
    with the id of a process that no longer exists. A live writer's file is left alone."""
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*{_TMP_SUFFIX}"):
        pid = tmp.name[len(path.name) + 2 :].split(".")[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # another user's live process


# A graph header is a few kilobytes per layer; a larger size prefix is corruption, never read into memory.
MAX_HEADER_BYTES = 64 * 2**20
_HEADER_KEYS = ("format", "format_version", "target", "tile", "graph", "content_hash")


def _parse_json(text: bytes | str, what: str, where: str):
    """The JSON value of `text`, or None where it is not JSON; too deep a nesting is refused by name."""
    try:
        return json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError):
        return None
    except RecursionError:
        raise PackedModelError(f"{where}: {what} nests too deeply to be a packed checkpoint's") from None


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
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
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
        if target not in TARGETS:
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
