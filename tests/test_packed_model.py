"""The packed checkpoint file: round trip, atomic writes, and refusal of anything that is not a valid file."""

import json
import os
import struct

import numpy as np
import pytest
from safetensors.numpy import save as save_safetensors

from jaxbnn import formats, packed_model
from jaxbnn.packed_model import PackedModel, PackedModelError


def tiny_model(seed: int = 0) -> PackedModel:
    """float image (4, 4, 3) -> first conv (binary weights, threshold) -> dense on the packed image
    (binary x binary, affine logits)."""
    rng = np.random.default_rng(seed)
    conv = {"name": "blocks.0", "kind": "conv", "input": "float", "operand": "float", "weights": "binary",
            "in_shape": [4, 4, 3], "out_channels": 5, "kernel_size": [3, 3], "stride": [1, 1],
            "padding": [[1, 1], [1, 1]], "pad_value": "zero", "pool": [2, 2], "out_shape": [2, 2, 5],
            "output": "binary"}
    dense = {"name": "blocks.1", "kind": "dense", "input": "binary", "operand": "binary", "weights": "binary",
             "in_shape": [2, 2, 5], "out_channels": 3, "out_shape": [3], "output": "affine"}
    first = formats.pack_dense_weights(rng.normal(size=(27, 5)))
    second = formats.pack_conv_weights(rng.normal(size=(2, 2, 5, 3)))
    tensors = {
        "nodes.0.weight": np.asarray(first.bits), "nodes.0.weight_popcount": np.asarray(first.popcount),
        "nodes.0.threshold": rng.normal(size=5).astype(np.float32), "nodes.0.flip": rng.random(5) < 0.5,
        "nodes.1.weight": np.asarray(second.bits), "nodes.1.weight_popcount": np.asarray(second.tap_popcount).sum(axis=0, dtype=np.int32),
        "nodes.1.scale": rng.normal(size=3).astype(np.float32), "nodes.1.bias": rng.normal(size=3).astype(np.float32),
    }
    graph = {"name": "tiny", "mode": "bnn", "input_shape": [4, 4, 3], "num_classes": 3, "nodes": [conv, dense]}
    return PackedModel(graph=graph, tensors=tensors, target="cpu")


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


def test_round_trip(tmp_path):
    model = tiny_model()
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
    "edit, message",
    [
        (lambda t: t.pop("nodes.1.bias"), "missing"),
        (lambda t: t.update({"nodes.1.extra": np.zeros(3, np.float32)}), "not used"),
        (lambda t: t.update({"nodes.0.flip": np.zeros(5, np.uint8)}), "dtype"),
        (lambda t: t.update({"nodes.0.threshold": np.zeros(5, np.int32)}), "dtype"),
        (lambda t: t.update({"nodes.1.weight": np.zeros((1, 2, 8, 4), np.uint32)}), "shape"),
    ],
)
def test_save_refuses_tensors_that_do_not_fit_the_graph(tmp_path, edit, message):
    model = tiny_model()
    edit(model.tensors)
    with pytest.raises(PackedModelError, match=message):
        packed_model.save(tmp_path / "m.jbnn", model)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda g: g["nodes"][0].update(kind="lstm"), "kind"),
        (lambda g: g["nodes"][0].update(out_shape=[4, 4, 5]), "out_shape"),
        (lambda g: g["nodes"][1].update(input="ternary", operand="ternary"), "input"),
        (lambda g: g["nodes"][0].update(pad_value="two"), "pad_value"),
        (lambda g: g["nodes"][0].update(stride=[0, 1]), "stride"),
        (lambda g: g.update(num_classes=4), "logits"),
        (lambda g: g.update(nodes=[]), "no nodes"),
    ],
)
def test_save_refuses_an_invalid_graph(tmp_path, edit, message):
    model = tiny_model()
    edit(model.graph)
    with pytest.raises(PackedModelError, match=message):
        packed_model.save(tmp_path / "m.jbnn", model)


def test_unknown_target_is_refused(tmp_path):
    model = tiny_model()
    model.target = "tpu"
    with pytest.raises(PackedModelError, match="target"):
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
        (lambda h: h.update(format_version=2), "version 2 is not supported"),
        (lambda h: h.update(format="other"), "format"),
        (lambda h: h.update(target="sm70"), "target"),
        (lambda h: h.update(tile=[16, 128]), "tile"),
        (lambda h: h["graph"]["nodes"][0].update(out_channels=6), "out_shape"),
        (lambda h: h["graph"].update(name="renamed"), "content hash mismatch"),
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
    rewrite(path, tensors_edit=lambda t: t.update({"nodes.1.scale": t["nodes.1.scale"][::-1].copy()}))
    with pytest.raises(PackedModelError, match="content hash mismatch"):
        packed_model.load(path)


def test_a_plain_safetensors_file_is_not_a_packed_checkpoint(tmp_path):
    path = tmp_path / "plain.safetensors"
    path.write_bytes(save_safetensors({"w": np.ones(3, np.float32)}))
    with pytest.raises(PackedModelError, match="not a jaxbnn packed checkpoint"):
        packed_model.load(path)


def test_garbage_is_refused(tmp_path):
    path = tmp_path / "garbage.jbnn"
    path.write_bytes(struct.pack("<Q", 12) + b"{not json!!}" + b"\0" * 16)
    with pytest.raises(PackedModelError, match="not valid JSON"):
        packed_model.load(path)
