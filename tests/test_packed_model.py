"""The packed checkpoint file: round trip, atomic writes, and refusal of anything that is not a valid file."""

import json
import os
import resource
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save as save_safetensors

from jaxbnn import formats, packed_model
from jaxbnn.packed_model import PackedModel, PackedModelError


FORMAT_V1_FILE = Path(__file__).parent / "data" / "format_v1_mnist_conv_tbn.jbnn"


def weight_values(rng, shape, weights):
    """Random ±1 (binary) or {-1, 0, +1} (ternary) weight values."""
    return rng.choice([-1, 1] if weights == "binary" else [-1, 0, 1], size=shape).astype(np.float32)


def as_signs(values, weights):
    """The ±1 weights that binary / ternary weight values are stored as (ternary: output axis doubled)."""
    return values if weights == "binary" else np.asarray(formats.ternary_weight_signs(values))


def tiny_model(seed: int = 0, weights: str = "binary") -> PackedModel:
    """float image (4, 4, 3) -> first conv (float operand: int8 kernel; threshold, pool) -> dense on the
    packed image (conv bit matrix, tap popcounts; threshold) -> dense (dense bit matrix, row popcounts;
    affine logits), every layer with `weights` (binary / ternary) weights."""
    rng = np.random.default_rng(seed)
    conv = {"name": "blocks.0", "kind": "conv", "input": "float", "operand": "float", "weights": weights,
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
        "nodes.0.kernel": first.astype(np.int8),
        "nodes.0.threshold": rng.normal(size=5).astype(np.float32), "nodes.0.flip": rng.random(5) < 0.5,
        "nodes.1.weight": np.asarray(second.bits), "nodes.1.weight_tap_popcount": np.asarray(second.tap_popcount),
        "nodes.1.threshold": rng.integers(-20, 20, 4).astype(np.int32), "nodes.1.flip": rng.random(4) < 0.5,
        "nodes.2.weight": np.asarray(last.bits), "nodes.2.weight_popcount": np.asarray(last.popcount),
        "nodes.2.scale": rng.normal(size=3).astype(np.float32), "nodes.2.bias": rng.normal(size=3).astype(np.float32),
    }
    graph = {"name": "tiny", "mode": "bnn" if weights == "binary" else "tnn", "input_shape": [4, 4, 3],
             "input_range": [-1.0, 1.0], "num_classes": 3, "nodes": [conv, hidden, logits]}
    return PackedModel(graph=graph, tensors=tensors, target="cpu")


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


@pytest.mark.parametrize("weights", ["binary", "ternary"])
def test_round_trip(tmp_path, weights):
    model = tiny_model(weights=weights)
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
        (lambda t: t.pop("nodes.2.bias"), "missing"),
        (lambda t: t.update({"nodes.2.extra": np.zeros(3, np.float32)}), "not used"),
        (lambda t: t.update({"nodes.0.flip": np.zeros(5, np.uint8)}), "dtype"),
        (lambda t: t.update({"nodes.0.threshold": np.zeros(5, np.int32)}), "dtype"),
        (lambda t: t.update({"nodes.1.weight": np.zeros((1, 2, 8, 4), np.uint32)}), "shape"),
        (lambda t: t.update({"nodes.1.weight_tap_popcount": np.zeros((4, 3), np.int32)}), "shape"),
        (lambda t: t.update({"nodes.1.weight_tap_popcount": np.zeros((4, 4), np.int64)}), "dtype"),
        (lambda t: t.update({"nodes.0.kernel": np.ones((3, 3, 3, 5), np.float32)}), "dtype"),
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
        (lambda g: g["nodes"][2].update(input="ternary", operand="ternary"), "input"),
        (lambda g: g["nodes"][0].update(pad_value="two"), "pad_value"),
        (lambda g: g["nodes"][0].update(stride=[0, 1]), "stride"),
        (lambda g: g.update(num_classes=4), "logits"),
        (lambda g: g.update(nodes=[]), "no nodes"),
        (lambda g: g.update(input_range=[1.0, -1.0]), r"'input_range' must be \[low, high\]"),
        (lambda g: g.update(input_range=[0, "255"]), r"'input_range' must be \[low, high\]"),
        (lambda g: g.update(input_range=[-1.0, float("inf")]), r"'input_range' must be \[low, high\]"),
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
        (lambda h: h.update(format_version=3), "version 3 is not supported"),
        (lambda h: h.update(format="other"), "format"),
        (lambda h: h.update(target="sm70"), "target"),
        (lambda h: h.update(tile=[16, 128]), "tile"),
        (lambda h: h["graph"]["nodes"][0].update(out_channels=6), "out_shape"),
        (lambda h: h["graph"].update(name="renamed"), "content hash mismatch"),
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
    ("binary", set_value("nodes.0.threshold", 3, np.nan), r"node 0 .*'nodes.0.threshold' holds NaN"),
    ("binary", lambda t: t.update({"nodes.2.weight_popcount": np.zeros(3, np.int32)}),
     r"node 2 \(blocks.2\): tensor 'nodes.2.weight_popcount' does not match the bits of 'nodes.2.weight'"),
]


@pytest.mark.parametrize("weights, edit, message", VALUE_ERRORS)
def test_wrong_values_are_refused_on_write_and_on_load(tmp_path, weights, edit, message):
    model = tiny_model(weights=weights)
    packed_model.validate(model)
    edit(model.tensors)
    path = tmp_path / "m.jbnn"
    with pytest.raises(PackedModelError, match=message):
        packed_model.save(path, model)
    assert not path.exists()
    write_unvalidated(path, model)
    with pytest.raises(PackedModelError, match=message):
        packed_model.load(path)


def test_a_file_of_the_previous_format_version_is_refused_with_what_to_do():
    blob = FORMAT_V1_FILE.read_bytes()
    (size,) = struct.unpack("<Q", blob[:8])
    assert json.loads(json.loads(blob[8:8 + size])["__metadata__"]["jaxbnn"])["format_version"] == 1
    with pytest.raises(PackedModelError, match=r"format version 1 is not supported \(this jaxbnn reads version 2\); "
                                               r"re-export the model from its training run: jaxbnn export"):
        packed_model.load(FORMAT_V1_FILE)


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


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda h: h.update(format_version=2.0), "format_version must be an integer, got 2.0"),
        (lambda h: h.update(format_version=True), "format_version must be an integer, got True"),
        (lambda h: h.update(format_version="2"), "format_version must be an integer, got '2'"),
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
