"""The packed checkpoint file: round trip, atomic writes, and refusal of anything that is not a valid file."""

import errno
import json
import os
import re
import resource
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save as save_safetensors

from jaxbnn import formats, packed_model, runtime
from jaxbnn.packed_model import PackedModel, PackedModelError


FORMAT_V1_FILE = Path(__file__).parent / "data" / "format_v1_mnist_conv_tbn.jbnn"


def weight_values(rng, shape, weights):
    """Random ±1 (binary) or {-1, 0, +1} (ternary) weight values."""
    return rng.choice([-1, 1] if weights == "binary" else [-1, 0, 1], size=shape).astype(np.float32)


def as_signs(values, weights):
    """The ±1 weights that binary / ternary weight values are stored as (ternary: output axis doubled)."""
    return values if weights == "binary" else np.asarray(formats.ternary_weight_signs(values))


def thresholds(rng, prefix, domain, shape):
    """Random int32 thresholds and bool flips of a quantizer writing `domain` bits, per channel or level."""
    if domain == "binary":
        return {f"{prefix}threshold": rng.integers(-20, 20, shape).astype(np.int32),
                f"{prefix}flip": rng.random(shape) < 0.5}
    return {f"{prefix}{name}_{plane}": value for plane in ("nonneg", "pos") for name, value in
            thresholds(rng, "", "binary", shape).items()}


def tiny_model(seed: int = 0, weights: str = "binary") -> PackedModel:
    """image (4, 4, 3) -> first conv (image operand: int8 kernel; threshold, pool) -> dense on the packed
    image (conv bit matrix, tap popcounts; threshold) -> dense (dense bit matrix, row popcounts; affine
    logits), every layer with `weights` (binary / ternary) weights."""
    rng = np.random.default_rng(seed)
    conv = {"name": "blocks.0", "kind": "conv", "input": "image", "operand": "image", "weights": weights,
            "in_shape": [4, 4, 3], "out_channels": 5, "kernel_size": [3, 3], "stride": [1, 1],
            "padding": [[1, 1], [1, 1]], "pad_value": "zero", "pool": [2, 2], "out_shape": [2, 2, 5],
            "output": "binary"}
    hidden = {"name": "blocks.1", "kind": "dense", "input": "binary", "operand": "binary", "weights": weights,
              "in_shape": [2, 2, 5], "out_channels": 4, "out_shape": [4], "output": "binary"}
    logits = {"name": "blocks.2", "kind": "dense", "input": "binary", "operand": "binary", "weights": weights,
              "in_shape": [4], "out_channels": 3, "out_shape": [3], "output": "affine"}
    first = weight_values(rng, (3, 3, 3, 5), weights)
    second = formats.pack_conv_weights(as_signs(weight_values(rng, (2, 2, 5, 4), weights), weights))
    last_values = weight_values(rng, (4, 3), weights)
    last_values[0, 0] = -1  # both planes' bit 0 of output channel 0 clear (the pos-plane test sets one)
    last = formats.pack_dense_weights(as_signs(last_values, weights))
    tensors = {
        "nodes.0.kernel": first.astype(np.int8), **thresholds(rng, "nodes.0.", "binary", 5),
        "nodes.1.weight": np.asarray(second.bits), "nodes.1.weight_tap_popcount": np.asarray(second.tap_popcount),
        **thresholds(rng, "nodes.1.", "binary", 4),
        "nodes.2.weight": np.asarray(last.bits), "nodes.2.weight_popcount": np.asarray(last.popcount),
        "nodes.2.scale": rng.normal(size=3).astype(np.float32), "nodes.2.bias": rng.normal(size=3).astype(np.float32),
    }
    graph = {"name": "tiny", "mode": "bnn" if weights == "binary" else "tnn", "input_shape": [4, 4, 3],
             "input_range": [-1.0, 1.0], "num_classes": 3, "nodes": [conv, hidden, logits]}
    return PackedModel(graph=graph, tensors=tensors, target="cpu")


def tiny_resnet(seed: int = 0, mode: str = "bnn", image_channels: int = 2, stem_shift: int = 7) -> PackedModel:
    """The integer stream's nodes, activations and weights binary (bnn) or ternary (tnn): image (5, 5, 2) ->
    stem (image operand, stride 2, output stream >> 7; other channels and shifts as given) -> residual block at stride 2 (conv1 reads the
    stream through input thresholds: per channel, or per feature for ternary; conv2 outputs the stream,
    shift 0; 4 -> 6 channels) -> global_pool (thresholds per channel) -> dense (affine logits)."""
    rng = np.random.default_rng(seed)
    domain = {"bnn": "binary", "tnn": "ternary"}[mode]

    def conv(name, wire, operand, in_shape, n, stride, output, **extra):
        h, w, _ = in_shape
        oh, ow = (h - 1) // stride + 1, (w - 1) // stride + 1
        return {"name": name, "kind": "conv", "input": wire, "operand": operand, "weights": domain,
                "in_shape": in_shape, "out_channels": n, "kernel_size": [3, 3], "stride": [stride, stride],
                "padding": [[1, 1], [1, 1]], "pad_value": "zero", "pool": None, "out_shape": [oh, ow, n],
                "output": output, **extra}

    ternary = {"level_shape": [6]} if domain == "ternary" else {}
    stem = conv("blocks.0", "image", "image", [5, 5, image_channels], 4, 2, "stream", stream_shift=stem_shift)
    conv1 = conv("blocks.1.conv1", "stream", domain, [3, 3, 4], 6, 2, domain, **ternary,
                 **({"input_level_shape": [3, 3, 4]} if domain == "ternary" else {}))
    conv1["pad_value"] = "one"
    conv2 = conv("blocks.1.conv2", domain, domain, [2, 2, 6], 6, 1, "stream", stream_shift=0)
    block = {"name": "blocks.1", "kind": "residual", "in_shape": [3, 3, 4], "out_shape": [2, 2, 6],
             "shortcut_stride": 2, "conv1": conv1, "conv2": conv2}
    pool = {"name": "blocks.2", "kind": "global_pool", "in_shape": [2, 2, 6], "out_shape": [6], "output": domain,
            **ternary}
    logits = {"name": "blocks.3", "kind": "dense", "input": domain, "operand": domain, "weights": domain,
              "in_shape": [6], "out_channels": 3, "out_shape": [3], "output": "affine"}
    conv_bits = [formats.pack_conv_weights(as_signs(weight_values(rng, (3, 3, 4 if i == 1 else 6, 6), domain),
                                                    domain)) for i in (1, 2)]
    dense_bits = formats.pack_dense_weights(as_signs(weight_values(rng, (6, 3), domain), domain))
    tensors = {"nodes.0.kernel": weight_values(rng, (3, 3, image_channels, 4), domain).astype(np.int8),
               **thresholds(rng, "nodes.1.conv1.input_", domain, (3, 3, 4) if domain == "ternary" else 4),
               **thresholds(rng, "nodes.1.conv1.", domain, 6),
               **thresholds(rng, "nodes.2.", domain, 6),
               "nodes.3.weight": np.asarray(dense_bits.bits),
               "nodes.3.weight_popcount": np.asarray(dense_bits.popcount),
               "nodes.3.scale": rng.normal(size=3).astype(np.float32),
               "nodes.3.bias": rng.normal(size=3).astype(np.float32)}
    for key, bits in zip(("conv1", "conv2"), conv_bits):
        tensors[f"nodes.1.{key}.weight"] = np.asarray(bits.bits)
        tensors[f"nodes.1.{key}.weight_tap_popcount"] = np.asarray(bits.tap_popcount)
    graph = {"name": "tiny-resnet", "mode": mode, "input_shape": [5, 5, image_channels], "input_range": [-1.0, 1.0],
             "num_classes": 3, "nodes": [stem, block, pool, logits]}
    return PackedModel(graph=graph, tensors=tensors, target="cpu")


MODELS = {"binary": lambda: tiny_model(weights="binary"), "ternary": lambda: tiny_model(weights="ternary"),
          "resnet-bnn": lambda: tiny_resnet(mode="bnn"), "resnet-tnn": lambda: tiny_resnet(mode="tnn")}


def write_unvalidated(path, model: PackedModel) -> None:
    """Write `model` as a well-formed file with a correct content hash but without validating its values:
    what a faulty writer would produce."""
    core = {"format": packed_model.FORMAT_NAME, "format_version": packed_model.FORMAT_VERSION,
            "target": model.target, "tile": list(model.tile), "graph": model.graph}
    header = dict(core, content_hash=packed_model.content_hash(core, model.tensors))
    path.write_bytes(save_safetensors(model.tensors, metadata={"jaxbnn": json.dumps(header)}))


def set_bit(tiles: np.ndarray, row: int, bit: int) -> np.ndarray:
    """A copy of FSB tiles with bit `bit` of matrix row `row` set."""
    tiles = tiles.copy()
    _, _, bh, ww = tiles.shape
    word = bit // formats.WORD_BITS
    tiles[row // bh, word // ww, row % bh, word % ww] |= np.uint32(1 << (bit % formats.WORD_BITS))
    return tiles


def rewrite(path, header_edit=None, tensors_edit=None):
    """Rewrite a valid file with its header and/or tensors edited, keeping the stored content hash."""
    model = packed_model.load(path)
    blob = path.read_bytes()
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(json.loads(blob[8:8 + size])["__metadata__"]["jaxbnn"])
    tensors = dict(model.tensors)
    if header_edit:
        header_edit(header)
    if tensors_edit:
        tensors_edit(tensors)
    path.write_bytes(save_safetensors(tensors, metadata={"jaxbnn": json.dumps(header)}))


@pytest.mark.parametrize("which", list(MODELS))
def test_round_trip(tmp_path, which):
    model = MODELS[which]()
    path = tmp_path / "m.jbnn"
    size = packed_model.save(path, model)
    assert size == path.stat().st_size
    loaded = packed_model.load(path)
    assert loaded.graph == model.graph and loaded.target == "cpu" and loaded.tile == formats.FSB_TILE
    assert sorted(loaded.tensors) == sorted(model.tensors)
    for name, array in model.tensors.items():
        assert loaded.tensors[name].dtype == array.dtype
        np.testing.assert_array_equal(loaded.tensors[name], array)
    assert loaded.nbytes() == model.nbytes()


def test_the_graph_alone_determines_every_tensor():
    """The tensors of each node kind (docs/export.md's table): the image operand's int8 kernel, the stream
    readers' int32 thresholds, no tensor for a stream output, per-feature input levels of a ternary reader."""
    graph = tiny_resnet(mode="tnn").graph
    def planes(prefix, shape):
        return {f"{prefix}{name}_{plane}": (shape, dtype) for plane in ("nonneg", "pos")
                for name, dtype in (("threshold", "int32"), ("flip", "bool"))}

    assert packed_model.expected_tensors(graph, formats.FSB_TILE) == {
        "nodes.0.kernel": ((3, 3, 2, 4), "int8"),
        **planes("nodes.1.conv1.input_", (3, 3, 4)),
        "nodes.1.conv1.weight": ((2, 3, 8, 4), "uint32"),  # 12 rows (6 nonneg, 6 pos) x 9 taps of one word
        "nodes.1.conv1.weight_tap_popcount": ((9, 12), "int32"),
        **planes("nodes.1.conv1.", (6,)),
        "nodes.1.conv2.weight": ((2, 3, 8, 4), "uint32"),
        "nodes.1.conv2.weight_tap_popcount": ((9, 12), "int32"),
        **planes("nodes.2.", (6,)),
        "nodes.3.weight": ((1, 1, 8, 4), "uint32"), "nodes.3.weight_popcount": ((6,), "int32"),
        "nodes.3.scale": ((3,), "float32"), "nodes.3.bias": ((3,), "float32"),
    }
    binary = packed_model.expected_tensors(tiny_resnet(mode="bnn").graph, formats.FSB_TILE)
    assert {name: spec for name, spec in binary.items() if "threshold" in name or "flip" in name} == {
        "nodes.1.conv1.input_threshold": ((4,), "int32"), "nodes.1.conv1.input_flip": ((4,), "bool"),
        "nodes.1.conv1.threshold": ((6,), "int32"), "nodes.1.conv1.flip": ((6,), "bool"),
        "nodes.2.threshold": ((6,), "int32"), "nodes.2.flip": ((6,), "bool"),
    }


def test_node_output_names_the_wire_of_every_node_kind():
    """What each node puts on the wire, as its reader must take it: the stem and residual blocks the stream."""
    assert [packed_model.node_output(node) for node in tiny_resnet(mode="tnn").graph["nodes"]] == [
        ("stream", [3, 3, 4]), ("stream", [2, 2, 6]), ("ternary", [6]), ("float", [3])]
    assert [packed_model.node_output(node) for node in tiny_model().graph["nodes"]] == [
        ("binary", [2, 2, 5]), ("binary", [4]), ("float", [3])]


def test_write_is_atomic_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "m.jbnn"
    packed_model.save(path, tiny_model(0))
    before = path.read_bytes()
    bad = tiny_model(1)
    bad.tensors["nodes.0.threshold"] = bad.tensors["nodes.0.threshold"][:4]
    with pytest.raises(PackedModelError, match="nodes.0.threshold"):
        packed_model.save(path, bad)
    assert path.read_bytes() == before, "a refused write must leave the old file untouched"
    packed_model.save(path, tiny_model(2))
    assert os.listdir(tmp_path) == ["m.jbnn"]
    assert path.read_bytes() != before


@pytest.mark.parametrize(
    "which, edit, message",
    [
        ("binary", lambda t: t.pop("nodes.2.bias"), r"missing for this graph: \['nodes.2.bias'\]"),
        ("binary", lambda t: t.update({"nodes.2.extra": np.zeros(3, np.float32)}), "not used"),
        ("binary", lambda t: t.update({"nodes.0.flip": np.zeros(5, np.uint8)}), "'nodes.0.flip' has dtype uint8"),
        ("binary", lambda t: t.update({"nodes.0.threshold": np.zeros(5, np.float32)}),
         "'nodes.0.threshold' has dtype float32, the graph needs int32"),
        ("binary", lambda t: t.update({"nodes.1.weight": np.zeros((1, 2, 8, 4), np.uint32)}), "shape"),
        ("binary", lambda t: t.update({"nodes.1.weight_tap_popcount": np.zeros((4, 3), np.int32)}), "shape"),
        ("binary", lambda t: t.update({"nodes.1.weight_tap_popcount": np.zeros((4, 4), np.int64)}), "dtype"),
        # the image operand: int8 weight values in the layer's HWIO layout, no bit matrix
        ("binary", lambda t: t.update({"nodes.0.kernel": np.ones((3, 3, 3, 5), np.float32)}),
         "'nodes.0.kernel' has dtype float32, the graph needs int8"),
        ("binary", lambda t: t.update({"nodes.0.kernel": np.ones((3, 3, 5, 3), np.int8)}),
         r"'nodes.0.kernel' has shape \(3, 3, 5, 3\), the graph needs \(3, 3, 3, 5\)"),
        ("binary", lambda t: t.update({"nodes.0.weight": t["nodes.1.weight"]}), r"not used.*'nodes.0.weight'"),
        # the stream's readers hold int32 thresholds; a stream output holds no tensor
        ("resnet-bnn", lambda t: t.pop("nodes.1.conv1.input_threshold"), r"\['nodes.1.conv1.input_threshold'\]"),
        ("resnet-bnn", lambda t: t.update({"nodes.1.conv1.input_threshold": np.zeros(4, np.float32)}),
         "'nodes.1.conv1.input_threshold' has dtype float32, the graph needs int32"),
        ("resnet-bnn", lambda t: t.update({"nodes.1.conv1.input_flip": np.zeros(6, bool)}),
         r"'nodes.1.conv1.input_flip' has shape \(6,\), the graph needs \(4,\)"),
        ("resnet-tnn", lambda t: t.update({"nodes.1.conv1.input_threshold_pos": np.zeros(4, np.int32)}),
         r"'nodes.1.conv1.input_threshold_pos' has shape \(4,\), the graph needs \(3, 3, 4\)"),
        ("resnet-bnn", lambda t: t.update({"nodes.2.threshold": np.zeros(4, np.int32)}),
         r"'nodes.2.threshold' has shape \(4,\), the graph needs \(6,\)"),
        ("resnet-tnn", lambda t: t.pop("nodes.2.flip_nonneg"), r"\['nodes.2.flip_nonneg'\]"),
        ("resnet-bnn", lambda t: t.update({"nodes.0.threshold": np.zeros(4, np.int32)}),
         r"not used by this graph: \['nodes.0.threshold'\]"),
        ("resnet-bnn", lambda t: t.update({"nodes.1.conv2.bn_mean": np.zeros(6, np.float32)}),
         r"not used by this graph: \['nodes.1.conv2.bn_mean'\]"),
    ],
)
def test_save_refuses_tensors_that_do_not_fit_the_graph(tmp_path, which, edit, message):
    model = MODELS[which]()
    edit(model.tensors)
    with pytest.raises(PackedModelError, match=message):
        packed_model.save(tmp_path / "m.jbnn", model)


def replace_node(index, node):
    return lambda g: g["nodes"].__setitem__(index, node)


GLOBAL_POOL_ON_BITS = {"name": "pool", "kind": "global_pool", "in_shape": [2, 2, 5], "out_shape": [5],
                       "output": "binary"}
DENSE_ON_THE_STREAM = {"name": "head", "kind": "dense", "input": "stream", "operand": "binary",
                       "weights": "binary", "in_shape": [3, 3, 4], "out_channels": 3, "out_shape": [3],
                       "output": "affine"}


@pytest.mark.parametrize(
    "which, edit, message",
    [
        ("binary", lambda g: g["nodes"][0].update(kind="lstm"), "kind"),
        ("binary", lambda g: g["nodes"][0].update(out_shape=[4, 4, 5]), "out_shape"),
        ("binary", lambda g: g["nodes"][2].update(input="ternary", operand="ternary"), "input"),
        ("binary", lambda g: g["nodes"][0].update(stride=[0, 1]), "stride"),
        # sizes, strides and pools the ops could never take (int32): refused on write, not on every call
        ("binary", lambda g: g["nodes"][0].update(stride=[2**31, 1]),
         r"node 0 \(blocks.0\): attribute 'stride' entries must be <= 2147483647, got \[2147483648, 1\]"),
        ("binary", lambda g: g["nodes"][0].update(pool=[1, 2**62]), r"attribute 'pool' entries must be <= 2147483647"),
        ("resnet-bnn", lambda g: g["nodes"][1].update(shortcut_stride=2**63),
         r"node 1 \(blocks.1\): attribute 'shortcut_stride' must be an integer <= 2147483647, got 9223372036854775808"),
        ("binary", lambda g: g.update(num_classes=4), "logits"),
        ("binary", lambda g: g.update(nodes=[]), "no nodes"),
        ("binary", lambda g: g.update(input_range=[1.0, -1.0]), r"'input_range' must be \[low, high\]"),
        ("binary", lambda g: g.update(input_range=[0, "255"]), r"'input_range' must be \[low, high\]"),
        ("binary", lambda g: g.update(input_range=[-1.0, float("inf")]), r"'input_range' must be \[low, high\]"),
        ("binary", lambda g: g.update(input_range=[0, 10**400]), r"'input_range' must be \[low, high\]"),
        # float32 must resolve the range: formats.quantize_images' low and scale 255 / (high - low) are float32
        ("binary", lambda g: g.update(input_range=[0, 5e-324]),
         r"graph attribute 'input_range' \[0, 5e-324\] is beyond float32: float images on it do not quantize back "
         r"to their pixels 0..255"),
        ("binary", lambda g: g.update(input_range=[0, 1e-45]), r"'input_range' \[0, 1e-45\] is beyond float32"),
        ("binary", lambda g: g.update(input_range=[-1e308, 1e308]), r"'input_range' .* is beyond float32"),
        ("binary", lambda g: g.update(input_range=[-3e38, 3e38]), r"'input_range' .* is beyond float32"),
        ("binary", lambda g: g.update(input_range=[1e20, 1e20 + 1e6]), r"'input_range' .* is beyond float32"),
        ("binary", lambda g: g.update(input_range=[1000.0, 1000.001]), r"'input_range' .* is beyond float32"),
        ("binary", lambda g: g["nodes"][0].update(pad_value="two"), "attribute 'pad_value' must be one of"),
        # padding: at most the input's extent (4 x 4) plus kernel_size - 1 (3 x 3) a side, whatever the rest says
        ("binary", lambda g: g["nodes"][0].update(padding=[[7, 1], [1, 1]]),
         r"node 0 \(blocks.0\): attribute 'padding' \[\[7, 1\], \[1, 1\]\] exceeds the input's extent plus "
         r"kernel_size - 1 a side \(6 rows, 6 columns\): the outputs past it would read padding only"),
        ("binary", lambda g: g["nodes"][0].update(padding=[[0, 0], [0, 7]]),
         r"'padding' .* exceeds the input's extent"),
        ("resnet-bnn", lambda g: g["nodes"][1]["conv1"].update(padding=[[1, 4000], [1, 1]]),
         r"node 1 \(blocks.1\).conv1: attribute 'padding' .* exceeds the input's extent"),
        ("binary", lambda g: g["nodes"][0].pop("pool"), r"node 0 \(blocks.0\): attribute 'pool' missing"),
        ("resnet-bnn", lambda g: g["nodes"][1]["conv2"].pop("pool"), r"blocks.1\).conv2: attribute 'pool' missing"),
        ("binary", lambda g: g["nodes"][2].pop("name"), r"node 2: attribute 'name' must be a string, got None"),
        ("resnet-bnn", lambda g: g["nodes"][2].update(name=7), r"node 2: attribute 'name' must be a string, got 7"),
        # the image: read by the first node only, as its image operand, padded with level 0
        ("binary", lambda g: g["nodes"][0].update(input="float", operand="float"),
         r"node 0 \(blocks.0\): attribute 'input' must be one of \('image', 'binary', 'ternary', 'stream'\), "
         "got 'float'"),
        ("binary", lambda g: g["nodes"][0].update(operand="float"),
         r"attribute 'operand' must be one of \('image', 'binary', 'ternary'\), got 'float'"),
        ("binary", lambda g: g["nodes"][0].update(operand="binary"), "image input cannot feed a binary operand"),
        ("binary", lambda g: g["nodes"][1].update(operand="image"), "binary input cannot feed a image operand"),
        ("binary", lambda g: g["nodes"][1].update(input="image", operand="image"),
         r"node 1 \(blocks.1\): input is 'image' but the previous node outputs 'binary'"),
        ("binary", lambda g: g["nodes"][0].update(pad_value="one"), "image operand.*pad_value must be 'zero'"),
        # stream wires: written by a stream output, read by residual blocks and global pooling only
        ("resnet-bnn", lambda g: g.update(nodes=[g["nodes"][0], DENSE_ON_THE_STREAM]),
         r"node 1 \(head\): the integer stream is read by residual blocks and global pooling only"),
        ("resnet-bnn", lambda g: g["nodes"][0].update(output="binary"),
         r"node 1 \(blocks.1\): a residual block takes the integer stream, the previous node outputs 'binary'"),
        ("binary", lambda g: g["nodes"].insert(1, GLOBAL_POOL_ON_BITS),
         r"node 1 \(pool\): global_pool takes the integer stream of an image and outputs \[C\], got binary"),
        ("resnet-bnn", lambda g: g["nodes"][1]["conv1"].update(input="binary"),
         "conv1 must read the block's integer stream"),
        ("resnet-bnn", lambda g: g["nodes"][1]["conv1"].update(output="stream", stream_shift=0),
         "conv1 must output bits for conv2"),
        ("resnet-bnn", lambda g: g["nodes"][1]["conv2"].update(input="ternary", operand="ternary"),
         "conv2 must read conv1's output"),
        ("resnet-bnn", lambda g: g["nodes"][1]["conv2"].update(output="binary"),
         r"conv2 must output its integer dot products as they are \(stream, shift 0\)"),
        ("resnet-bnn", lambda g: g["nodes"][1].update(shortcut_stride=1),
         r"the type-A shortcut of \[3, 3, 4\] at stride 1 cannot reach \[2, 2, 6\]"),
        ("resnet-bnn", lambda g: g["nodes"][1].update(out_shape=[2, 2, 4]), "out_shape must be conv2's"),
        # stream_shift: the stream output's right shift of the int32 dot products
        ("resnet-bnn", lambda g: g["nodes"][0].pop("stream_shift"),
         r"node 0 \(blocks.0\): attribute 'stream_shift' must be an integer >= 0, got None"),
        ("resnet-bnn", lambda g: g["nodes"][0].update(stream_shift=-1), "'stream_shift' must be an integer >= 0"),
        ("resnet-bnn", lambda g: g["nodes"][0].update(stream_shift=7.0), "'stream_shift' must be an integer"),
        ("resnet-bnn", lambda g: g["nodes"][0].update(stream_shift=True), "'stream_shift' must be an integer"),
        ("resnet-bnn", lambda g: g["nodes"][0].update(stream_shift=2**40), "'stream_shift' must be .* <= 31"),
        ("resnet-bnn", lambda g: g["nodes"][1]["conv2"].update(stream_shift=1),
         r"node 1 \(blocks.1\): conv2 must output its integer dot products as they are \(stream, shift 0\)"),
        ("resnet-bnn", lambda g: g["nodes"][1]["conv2"].pop("stream_shift"),
         r"node 1 \(blocks.1\).conv2: attribute 'stream_shift'"),
        # the levels of ternary thresholds: per channel or per feature
        ("resnet-tnn", lambda g: g["nodes"][1]["conv1"].pop("input_level_shape"),
         r"blocks.1\).conv1: attribute 'input_level_shape' must be a list of integers, got None"),
        ("resnet-tnn", lambda g: g["nodes"][1]["conv1"].update(input_level_shape=[3, 4]),
         r"input_level_shape \[3, 4\] must be \[4\] or \[3, 3, 4\]"),
        ("resnet-tnn", lambda g: g["nodes"][1]["conv1"].update(level_shape=[2, 6]),
         r"level_shape \[2, 6\] must be \[6\] or \[2, 2, 6\]"),
        # global_pool: the stream of an image in, the thresholds' bits or planes out
        ("resnet-bnn", lambda g: g["nodes"][2].update(output="affine"),
         r"node 2 \(blocks.2\): attribute 'output' must be one of \('binary', 'ternary'\), got 'affine'"),
        ("resnet-bnn", lambda g: g["nodes"][2].update(out_shape=[2, 2, 6]), r"outputs \[C\].*out \[2, 2, 6\]"),
        ("resnet-tnn", lambda g: g["nodes"][2].pop("level_shape"),
         r"node 2 \(blocks.2\): attribute 'level_shape' must be a list of integers, got None"),
        ("resnet-tnn", lambda g: g["nodes"][2].update(level_shape=[5]), r"level_shape \[5\] must be \[6\]"),
        ("resnet-bnn", lambda g: g["nodes"][2].update(kind="global_avg_pool"), "attribute 'kind' must be one of"),
    ],
)
def test_save_refuses_an_invalid_graph(tmp_path, which, edit, message):
    """Each broken attribute is refused with a message naming it (and the node)."""
    model = MODELS[which]()
    edit(model.graph)
    with pytest.raises(PackedModelError, match=message):
        packed_model.save(tmp_path / "m.jbnn", model)


def test_the_padding_of_same_of_a_full_convolution_and_of_a_layers_wider_one_is_accepted():
    """"SAME" pads at most kernel_size - 1 a side (what the exporter writes for it, and for "VALID" none), a full
    convolution exactly that; a layer's explicit padding may go further, up to the input's extent more."""
    from jaxbnn.layers import same_padding

    assert all(max(same_padding(size, kernel, stride)) <= kernel - 1
               for size in range(1, 13) for kernel in range(1, 8) for stride in range(1, 5))
    graph = tiny_model().graph
    graph["nodes"][0].update(padding=[[2, 2], [2, 2]], out_shape=[3, 3, 5])  # 8x8 padded, 6x6 out, pooled 3x3
    graph["nodes"][1]["in_shape"] = [3, 3, 5]
    packed_model.validate_graph(graph)
    graph["nodes"][0].update(padding=[[6, 0], [6, 6]], out_shape=[4, 7, 5])  # 10x16 padded, 8x14 out, pooled
    graph["nodes"][1]["in_shape"] = [4, 7, 5]
    packed_model.validate_graph(graph)


@pytest.mark.parametrize("target", ["tpu", ["cpu"], {"cpu": None}])
def test_unknown_target_is_refused(tmp_path, target):
    model = tiny_model()
    model.target = target
    message = re.escape(f"unknown target {target!r}; known: ['cpu', 'sm80', 'sm90']")
    with pytest.raises(PackedModelError, match=message):
        packed_model.validate(model)
    with pytest.raises(PackedModelError, match=message):
        packed_model.save(tmp_path / "m.jbnn", model)


def test_flipped_byte_in_the_tensors_fails_the_hash(tmp_path):
    path = tmp_path / "m.jbnn"
    packed_model.save(path, tiny_model())
    blob = bytearray(path.read_bytes())
    blob[-3] ^= 0x10  # inside the last tensor's data
    path.write_bytes(bytes(blob))
    with pytest.raises(PackedModelError, match="content hash mismatch"):
        packed_model.load(path)


@pytest.mark.parametrize("cut", [0, 5, 100, -1])
def test_truncated_file_is_refused(tmp_path, cut):
    path = tmp_path / "m.jbnn"
    packed_model.save(path, tiny_model())
    blob = path.read_bytes()
    path.write_bytes(blob[:cut] if cut >= 0 else blob[:cut])
    with pytest.raises(PackedModelError):
        packed_model.load(path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda h: h.update(format_version=4), r"format version 4 is not supported \(this jaxbnn reads version 3\)"),
        (lambda h: h.update(format="other"), "format"),
        (lambda h: h.update(target="sm70"), "target"),
        (lambda h: h.update(target=["cpu"]), r"unknown target \['cpu'\]; known:"),
        (lambda h: h.update(target={"cpu": [8, 128]}), r"unknown target \{'cpu': \[8, 128\]\}; known:"),
        (lambda h: h.update(tile=[16, 128]), "tile"),
        (lambda h: h["graph"]["nodes"][0].update(out_channels=6), "out_shape"),
        (lambda h: h["graph"].update(name="renamed"), "content hash mismatch"),
        (lambda h: h["graph"].update(input_range=[0, 5e-324]), r"'input_range' \[0, 5e-324\] is beyond float32"),
        # a 2 KB file whose activation would be 64M elements a sample
        (lambda h: h["graph"]["nodes"][0].update(padding=[[4000, 4000], [4000, 4000]]),
         r"node 0 \(blocks.0\): attribute 'padding' .* exceeds the input's extent"),
        (lambda h: h["graph"].pop("input_range"), "graph attribute 'input_range' missing \\(the input scale the "
                                                   "model was trained on\\): re-export the model from its training "
                                                   "run: jaxbnn export RUN_DIR MODEL.jbnn"),
    ],
)
def test_edited_header_is_refused(tmp_path, edit, message):
    path = tmp_path / "m.jbnn"
    packed_model.save(path, tiny_model())
    rewrite(path, header_edit=edit)
    with pytest.raises(PackedModelError, match=message):
        packed_model.load(path)


def test_swapped_tensor_values_fail_the_hash(tmp_path):
    path = tmp_path / "m.jbnn"
    packed_model.save(path, tiny_model())
    rewrite(path, tensors_edit=lambda t: t.update({"nodes.2.scale": t["nodes.2.scale"][::-1].copy()}))
    with pytest.raises(PackedModelError, match="content hash mismatch"):
        packed_model.load(path)


def test_a_plain_safetensors_file_is_not_a_packed_checkpoint(tmp_path):
    path = tmp_path / "plain.safetensors"
    path.write_bytes(save_safetensors({"w": np.ones(3, np.float32)}))
    with pytest.raises(PackedModelError, match=r"not a jaxbnn packed checkpoint \(.jbnn\): a safetensors file "
                                               "without the 'jaxbnn' header"):
        packed_model.load(path)


@pytest.mark.parametrize("tensors, message", [
    ([], "tensors must be a dict of name -> numpy array, got list"),
    ({"nodes.0.kernel": [1.0, -1.0]}, "tensor 'nodes.0.kernel' must be a numpy array named by a string, got list"),
    ({"nodes.0.kernel": None}, "tensor 'nodes.0.kernel' must be a numpy array named by a string, got NoneType"),
])
def test_tensors_that_are_not_arrays_are_refused_by_name(tmp_path, tensors, message):
    model = tiny_model()
    broken = PackedModel(graph=model.graph, tensors=tensors if isinstance(tensors, list) else {**model.tensors,
                                                                                                **tensors})
    with pytest.raises(PackedModelError, match=re.escape(message)):
        packed_model.validate(broken)
    with pytest.raises(PackedModelError, match=re.escape(message)):
        runtime.from_packed(broken)


@pytest.mark.parametrize("folder", [".", "/", ""])
def test_saving_onto_a_folder_name_says_it_is_a_folder(folder):
    with pytest.raises(IsADirectoryError):
        packed_model.save(folder, tiny_model())


def test_saving_to_a_name_ending_in_a_separator_writes_no_file_of_the_folder_s_name(tmp_path):
    for path in (f"{tmp_path / 'out'}/", f"{tmp_path}/", f"{tmp_path / 'out'}/.", f"{tmp_path / 'out'}/.."):
        with pytest.raises(IsADirectoryError):
            packed_model.save(path, tiny_model())
    assert list(tmp_path.iterdir()) == []


def test_saving_into_a_missing_folder_names_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder to write the packed checkpoint into") as error:
        packed_model.save(tmp_path / "missing" / "m.jbnn", tiny_model())
    assert error.value.filename == str(tmp_path / "missing")


def test_garbage_is_refused(tmp_path):
    path = tmp_path / "garbage.jbnn"
    path.write_bytes(struct.pack("<Q", 12) + b"{not json!!}" + b"\0" * 16)
    with pytest.raises(PackedModelError, match=r"not a jaxbnn packed checkpoint \(.jbnn\): it does not start with "
                                               "the safetensors header"):
        packed_model.load(path)


# --- the values: what the ops take is used as it is, so a reader checks it --------------------------------


def add_one(name, at):
    """An edit adding 1 to tensor `name` at index `at`."""
    def edit(tensors):
        tensors[name] = tensors[name].copy()
        tensors[name][at] += 1
    return edit


def set_weight_bit(name, row, bit):
    return lambda tensors: tensors.update({name: set_bit(tensors[name], row, bit)})


def set_pos_bit_without_nonneg(tensors):
    """Output channel 0 of node 2 (3 channels, ternary): bit 0 of its pos-plane row 3, whose nonneg row 0 has
    bit 0 clear; its row popcount follows, so only the plane rule is broken."""
    tensors["nodes.2.weight"] = set_bit(tensors["nodes.2.weight"], 3, 0)
    add_one("nodes.2.weight_popcount", 3)(tensors)


def set_value(name, at, value):
    def edit(tensors):
        tensors[name] = tensors[name].copy()
        tensors[name][at] = value
    return edit


VALUE_ERRORS = [
    ("binary", add_one("nodes.1.weight_tap_popcount", (1, 2)),
     r"node 1 \(blocks.1\): tensor 'nodes.1.weight_tap_popcount' does not match the bits of 'nodes.1.weight': "
     r"at tap 1, row 2"),
    ("ternary", add_one("nodes.1.weight_tap_popcount", (3, 6)),  # row 6: the pos plane of channel 2
     r"node 1 \(blocks.1\): tensor 'nodes.1.weight_tap_popcount' .* at tap 3, row 6"),
    ("binary", add_one("nodes.2.weight_popcount", 1),
     r"node 2 \(blocks.2\): tensor 'nodes.2.weight_popcount' does not match the bits of 'nodes.2.weight': at row 1"),
    ("ternary", add_one("nodes.2.weight_popcount", 4),
     r"tensor 'nodes.2.weight_popcount' .* at row 4"),
    # padding: a row past the matrix, a channel past C = 5 inside a tap's word, a bit past K = 4
    ("binary", set_weight_bit("nodes.2.weight", 5, 0),
     r"node 2 .*'nodes.2.weight' has bits set outside its 3 x 4-bit"),
    ("binary", set_weight_bit("nodes.1.weight", 0, 32 + 7),
     r"node 1 .*'nodes.1.weight' has bits set outside its 4 x 20-bit"),
    ("ternary", set_weight_bit("nodes.2.weight", 0, 4),
     r"'nodes.2.weight' has bits set outside its 6 x 4-bit"),
    ("ternary", set_pos_bit_without_nonneg,
     r"node 2 \(blocks.2\): tensor 'nodes.2.weight': output channel 0 has a bit of the pos plane"),
    ("binary", set_value("nodes.0.kernel", (0, 1, 2, 3), 0),
     r"node 0 \(blocks.0\): tensor 'nodes.0.kernel' holds 0 at \(0, 1, 2, 3\); binary weights are \(-1, 1\)"),
    ("ternary", set_value("nodes.0.kernel", (2, 2, 0, 4), 2), r"tensor 'nodes.0.kernel' holds 2 at \(2, 2, 0, 4\)"),
    ("binary", lambda t: t.update({"nodes.2.weight_popcount": np.zeros(3, np.int32)}),
     r"node 2 \(blocks.2\): tensor 'nodes.2.weight_popcount' does not match the bits of 'nodes.2.weight'"),
    # inside a residual block, and the stem's image operand
    ("resnet-bnn", add_one("nodes.1.conv1.weight_tap_popcount", (4, 5)),
     r"node 1 \(blocks.1\).conv1: tensor 'nodes.1.conv1.weight_tap_popcount' does not match the bits of "
     r"'nodes.1.conv1.weight': at tap 4, row 5"),
    ("resnet-tnn", set_weight_bit("nodes.1.conv2.weight", 0, 6),
     r"node 1 \(blocks.1\).conv2: tensor 'nodes.1.conv2.weight' has bits set outside its 12 x 54-bit"),
    ("resnet-bnn", set_value("nodes.0.kernel", (1, 1, 1, 3), -128),
     r"node 0 \(blocks.0\): tensor 'nodes.0.kernel' holds -128 at \(1, 1, 1, 3\); binary weights are \(-1, 1\)"),
    ("resnet-tnn", set_value("nodes.0.kernel", (0, 0, 0, 0), 127), r"'nodes.0.kernel' holds 127 .* \(-1, 0, 1\)"),
]


@pytest.mark.parametrize("which, edit, message", VALUE_ERRORS)
def test_wrong_values_are_refused_on_write_and_on_load(tmp_path, which, edit, message):
    model = MODELS[which]()
    packed_model.validate(model)
    edit(model.tensors)
    path = tmp_path / "m.jbnn"
    with pytest.raises(PackedModelError, match=message):
        packed_model.save(path, model)
    assert not path.exists()
    write_unvalidated(path, model)
    with pytest.raises(PackedModelError, match=message):
        packed_model.load(path)


def format_v2_file(path) -> Path:
    """A version 2 file as that format wrote it: a float-operand first layer with float thresholds, a
    residual-free graph, a content hash over its own header."""
    rng = np.random.default_rng(0)
    first = {"name": "blocks.0", "kind": "dense", "input": "float", "operand": "float", "weights": "binary",
             "in_shape": [4, 4, 1], "out_channels": 3, "out_shape": [3], "output": "affine"}
    graph = {"name": "old", "mode": "bnn", "input_shape": [4, 4, 1], "input_range": [-1.0, 1.0],
             "num_classes": 3, "nodes": [first]}
    tensors = {"nodes.0.kernel": rng.choice([-1, 1], (16, 3)).astype(np.int8),
               "nodes.0.scale": np.ones(3, np.float32), "nodes.0.bias": np.zeros(3, np.float32)}
    core = {"format": packed_model.FORMAT_NAME, "format_version": 2, "target": "cpu",
            "tile": list(formats.FSB_TILE), "graph": graph}
    header = dict(core, content_hash=packed_model.content_hash(core, tensors))
    path.write_bytes(save_safetensors(tensors, metadata={"jaxbnn": json.dumps(header)}))
    return path


@pytest.mark.parametrize("version", [1, 2])
def test_a_file_of_a_previous_format_version_is_refused_with_what_to_do(tmp_path, version):
    path = FORMAT_V1_FILE if version == 1 else format_v2_file(tmp_path / "v2.jbnn")
    blob = path.read_bytes()
    (size,) = struct.unpack("<Q", blob[:8])
    assert json.loads(json.loads(blob[8:8 + size])["__metadata__"]["jaxbnn"])["format_version"] == version
    with pytest.raises(PackedModelError, match=rf"format version {version} is not supported \(this jaxbnn reads "
                                               r"version 3\); re-export the model from its training run: "
                                               r"jaxbnn export RUN_DIR MODEL.jbnn"):
        packed_model.load(path)


# --- what is read, and how ----------------------------------------------------------------------------------


def load_within(path, seconds=20):
    """packed_model.load(path) in a thread, which must finish (reading a FIFO would wait for a writer forever)."""
    outcome = {}

    def run():
        try:
            outcome["model"] = packed_model.load(path)
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"loading {path} did not finish in {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["model"]


def test_only_regular_files_are_read(tmp_path):
    with pytest.raises(PackedModelError, match="is a directory, not a packed checkpoint file"):
        load_within(tmp_path)
    fifo = tmp_path / "pipe.jbnn"
    os.mkfifo(fifo)
    with pytest.raises(PackedModelError, match="is a FIFO, not a packed checkpoint file"):
        load_within(fifo)
    with pytest.raises(PackedModelError, match="is a device, not a packed checkpoint file"):
        load_within("/dev/zero")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "socket.jbnn"))
        with pytest.raises(PackedModelError, match="is a socket, not a packed checkpoint file"):
            load_within(tmp_path / "socket.jbnn")
    with pytest.raises(FileNotFoundError):
        load_within(tmp_path / "missing.jbnn")


def test_a_huge_sparse_file_is_refused_before_its_data_is_read(tmp_path):
    path = tmp_path / "m.jbnn"
    size = packed_model.save(path, tiny_model())
    with open(path, "r+b") as f:
        f.truncate(2**31)  # sparse: 2 GiB of zeros after a valid header
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(PackedModelError, match=rf"the file has {2**31} bytes, its graph's tensors need {size}"):
        load_within(path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 200 * 1024  # KiB


@pytest.mark.parametrize("header_size, message", [
    (2**40, "it does not start with the safetensors header a .jbnn file has"),
    (packed_model.MAX_HEADER_BYTES + 1, f"a safetensors header of {packed_model.MAX_HEADER_BYTES + 1} bytes is larger"),
])
def test_a_size_prefix_beyond_the_file_or_any_header_is_refused(tmp_path, header_size, message):
    path = tmp_path / "m.jbnn"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", header_size))
        f.truncate(packed_model.MAX_HEADER_BYTES + 100)
    with pytest.raises(PackedModelError, match=message):
        load_within(path)


@pytest.mark.parametrize("where", ["jaxbnn header", "safetensors header"])
def test_deeply_nested_json_is_refused(tmp_path, where):
    deep = "[" * 200_000 + "]" * 200_000
    path = tmp_path / "deep.jbnn"
    if where == "jaxbnn header":
        path.write_bytes(save_safetensors({"w": np.ones(3, np.float32)}, metadata={"jaxbnn": deep}))
    else:
        table = ('{"__metadata__": {"jaxbnn": "{}"}, "x": ' + deep + "}").encode()
        path.write_bytes(struct.pack("<Q", len(table)) + table)
    with pytest.raises(PackedModelError, match=f"{where} nests too deeply"):
        load_within(path)


@pytest.mark.parametrize("where", ["jaxbnn header", "safetensors header"])
def test_an_integer_too_long_for_python_to_read_is_refused(tmp_path, where):
    digits = "9" * (sys.get_int_max_str_digits() + 1)
    path = tmp_path / "long.jbnn"
    if where == "jaxbnn header":
        header = '{"format": "jaxbnn-packed", "format_version": ' + digits + "}"
        path.write_bytes(save_safetensors({"w": np.ones(3, np.float32)}, metadata={"jaxbnn": header}))
    else:
        table = ('{"__metadata__": {"jaxbnn": "{}"}, "x": ' + digits + "}").encode()
        path.write_bytes(struct.pack("<Q", len(table)) + table)
    with pytest.raises(PackedModelError, match=f"{re.escape(str(path))}: {where} holds an integer of more than "
                                               f"{sys.get_int_max_str_digits()} digits"):
        load_within(path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda h: h.update(format_version=3.0), "format_version must be an integer, got 3.0"),
        (lambda h: h.update(format_version=True), "format_version must be an integer, got True"),
        (lambda h: h.update(format_version="3"), "format_version must be an integer, got '3'"),
        (lambda h: h.update(comment="hello"), r"header holds keys this format does not define: \['comment'\]"),
        (lambda h: h["graph"]["nodes"][2].update(note="x"), "content hash mismatch"),
    ],
)
def test_the_header_is_taken_as_stored(tmp_path, edit, message):
    """Nothing in the header escapes the checks: no key outside the format, no version of another type, and
    the content hash is over the header as stored (a rebuilt one would ignore an extra node attribute)."""
    path = tmp_path / "m.jbnn"
    packed_model.save(path, tiny_model())
    rewrite(path, header_edit=edit)
    with pytest.raises(PackedModelError, match=message):
        packed_model.load(path)


@pytest.mark.parametrize("mode", [0o644, 0o600, 0o640])
def test_save_keeps_the_mode_of_the_file_it_replaces(tmp_path, mode):
    path = tmp_path / "m.jbnn"
    path.write_bytes(b"old")
    path.chmod(mode)
    packed_model.save(path, tiny_model())
    assert path.stat().st_mode & 0o777 == mode


def test_a_new_file_gets_the_mode_open_would_give_it(tmp_path):
    umask = os.umask(0o027)
    try:
        packed_model.save(tmp_path / "m.jbnn", tiny_model())
    finally:
        os.umask(umask)
    assert (tmp_path / "m.jbnn").stat().st_mode & 0o777 == 0o640  # 0o666 less the umask, not mkstemp's 0o600


def test_temporaries_of_killed_writes_are_removed_and_a_failed_write_leaves_none(tmp_path):
    path = tmp_path / "m.jbnn"
    dead = tmp_path / ".m.jbnn.999999999.0badc0de.jbnn-tmp"  # a pid no process has: its writer was killed
    live = tmp_path / f".m.jbnn.{os.getppid()}.0badc0de.jbnn-tmp"  # a live process may still be writing
    dead.write_bytes(b"partial")
    live.write_bytes(b"partial")
    packed_model.save(path, tiny_model())
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, "m.jbnn"])
    live.unlink()
    target = tmp_path / "a-directory.jbnn"
    target.mkdir()  # the final rename fails
    with pytest.raises(OSError):
        packed_model.save(target, tiny_model())
    assert sorted(os.listdir(tmp_path)) == ["a-directory.jbnn", "m.jbnn"]


def test_only_the_temporaries_of_the_file_being_saved_are_removed(tmp_path):
    """A temporary is `.{name}.{pid}.{8 hex digits}.jbnn-tmp`: one of `m.jbnn.999999999` (a file of its own,
    written by a live process or not) and names save never writes are no temporaries of `m.jbnn`."""
    kept = [f".m.jbnn.999999999.{os.getppid()}.abcd1234.jbnn-tmp",  # m.jbnn.999999999's, its writer alive
            ".m.jbnn.999999999.999999998.abcd1234.jbnn-tmp",  # m.jbnn.999999999's, its writer gone
            ".m.jbnn.999999999.jbnn-tmp", ".m.jbnn.999999999.ABCD1234.jbnn-tmp",  # no token, or not lowercase hex
            ".m.jbnn.x999999999.abcd1234.jbnn-tmp", ".m.jbnn.99999999999.abcd1234.jbnn-tmp"]  # no pid
    stale = ".m.jbnn.999999999.abcd1234.jbnn-tmp"  # m.jbnn's, its writer gone
    for name in [*kept, stale]:
        (tmp_path / name).write_bytes(b"partial")
    packed_model.save(tmp_path / "m.jbnn", tiny_model())
    assert sorted(os.listdir(tmp_path)) == sorted([*kept, "m.jbnn"])


def name_max(folder) -> int:
    """The longest file name `folder` takes, in bytes."""
    return os.pathconf(folder, "PC_NAME_MAX")


@pytest.mark.parametrize("character", ["m", "é"])
def test_a_name_as_long_as_the_folder_allows_is_saved(tmp_path, character):
    """The temporary beside it keeps within the limit too, though its name adds a pid and a token to the name."""
    path = tmp_path / (character * ((name_max(tmp_path) - 5) // len(character.encode())) + ".jbnn")
    packed_model.save(path, tiny_model())
    assert os.listdir(tmp_path) == [path.name]
    assert packed_model.load(path).graph == tiny_model().graph


KILLED_WRITER = """
import os, sys
from jaxbnn import packed_model
model = packed_model.load(sys.argv[1])
os.replace = lambda *paths: os._exit(9)  # killed after writing its temporary, before renaming it
packed_model.save(sys.argv[2], model)
"""


def test_the_temporary_of_a_killed_write_of_a_long_name_is_removed_by_the_next_save(tmp_path):
    source = tmp_path / "source.jbnn"
    packed_model.save(source, tiny_model())
    path = tmp_path / ("m" * (name_max(tmp_path) - 5) + ".jbnn")
    writer = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(source), str(path)], capture_output=True)
    assert writer.returncode == 9, writer.stderr.decode()[-2000:]
    (temporary,) = set(os.listdir(tmp_path)) - {source.name}
    assert temporary.endswith(".jbnn-tmp")
    packed_model.save(path, tiny_model())
    assert sorted(os.listdir(tmp_path)) == sorted([source.name, path.name])


def test_a_failed_write_names_the_file_not_its_temporary_and_leaves_none(tmp_path, monkeypatch):
    folder = tmp_path / "out"
    folder.mkdir()
    directory = folder / "a-directory.jbnn"
    directory.mkdir()
    with pytest.raises(IsADirectoryError) as renamed:  # the final rename fails
        packed_model.save(directory, tiny_model())
    too_long = folder / ("m" * name_max(folder) + ".jbnn")
    with pytest.raises(OSError) as named:  # a name longer than the folder takes: the rename fails
        packed_model.save(too_long, tiny_model())

    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError) as written:
        packed_model.save(folder / "m.jbnn", tiny_model())
    for error, path, code in [(renamed, directory, errno.EISDIR), (named, too_long, errno.ENAMETOOLONG),
                              (written, folder / "m.jbnn", errno.ENOSPC)]:
        assert (error.value.errno, error.value.filename, error.value.filename2) == (code, str(path), None)
        assert ".jbnn-tmp" not in str(error.value)
    assert os.listdir(folder) == ["a-directory.jbnn"]


@pytest.mark.parametrize("input_range", [[0.0, 1.0], [0.0, 255.0], [-2.1179, 2.64], [-1e30, 1e30], [1e-30, 2e-30]])
def test_an_input_range_float32_resolves_is_accepted_and_gives_its_pixels_back(tmp_path, input_range):
    model = tiny_model()
    model.graph["input_range"] = input_range
    packed_model.save(tmp_path / "m.jbnn", model)
    low, high = input_range
    pixels = np.arange(256)
    floats = (low + pixels * ((high - low) / 255)).astype(np.float32)
    np.testing.assert_array_equal(formats.quantize_images(floats, input_range), pixels)


def test_export_refuses_a_target_or_input_range_the_file_would_refuse():
    from flax import nnx

    from jaxbnn.export import ExportError, export_model
    from jaxbnn.models import build_model

    model = build_model("mnist-mlp", "bnn", input_shape=(4, 4, 1), num_classes=3, width=0.25, rngs=nnx.Rngs(0))
    with pytest.raises(ExportError, match=r"unknown target \['cpu'\]"):
        export_model(model, target=["cpu"])
    with pytest.raises(ExportError, match=r"'input_range' \[0.0, 1e-45\] is beyond float32"):
        export_model(model, input_range=(0.0, 1e-45))
    assert export_model(model, input_range=(0.0, 1.0)).graph["input_range"] == [0.0, 1.0]
