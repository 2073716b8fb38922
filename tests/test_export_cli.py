"""`jaxbnn export` / `jaxbnn predict` on a real (short) training run, and `jaxbnn demo` (slow)."""

import gzip
import json
import re

import numpy as np
import pytest

from jaxbnn import cli, packed_model, runtime
from jaxbnn.cli import import_train_module
from jaxbnn.models import build_model
from test_data import _fake_mnist, _write_idx
from test_packed_model import FORMAT_V1_FILE


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    loop = import_train_module("loop")
    out = tmp_path_factory.mktemp("run")
    config = loop.TrainConfig(model="mnist-mlp", mode="bnn", data="mnist5k", epochs=1, width=0.125, batch_size=200)
    loop.fit(config, out, progress=False, log=lambda *_: None)
    return out


@pytest.mark.mnist5k
def test_export_then_predict(run_dir, tmp_path, capsys):
    """export writes a file for the target; predict on it scores the trained model's accuracy, and the file's
    predictions on uint8 test images are the Flax model's."""
    path = tmp_path / "mlp.jbnn"
    assert cli.main(["export", str(run_dir), str(path), "--target", "sm80"]) == 0
    printed = capsys.readouterr().out
    assert "blocks.4" in printed and "checkpoint file" in printed
    assert packed_model.load(path).target == "sm80"

    assert cli.main(["predict", str(path), "--data", "mnist5k", "--batch-size", "256"]) == 0
    printed = capsys.readouterr().out
    accuracy = float(re.search(r"accuracy ([0-9.]+)", printed).group(1))
    # The packed model's accuracy equals the trained model's test accuracy (same predictions).
    loop, data = import_train_module("loop"), import_train_module("data")
    model = loop.load_trained(run_dir)
    _, test = data.load_dataset("mnist5k")
    assert accuracy == pytest.approx(loop.evaluate(model, test)["accuracy"], abs=1e-4)
    assert accuracy > 0.2  # chance is 0.1: the exported run has learned something
    assert "images/s" in printed
    np.testing.assert_array_equal(runtime.load(path).predict(test.images[:50]),
                                  np.argmax(np.asarray(model(test.images[:50])), axis=-1))


def test_errors_are_reported_not_raised(tmp_path, capsys):
    """A missing run, a file that is no packed checkpoint and an older format version are one-line errors."""
    missing = tmp_path / "nothing"
    assert cli.main(["export", str(missing), str(tmp_path / "x.jbnn")]) == 2
    assert "no config.json" in capsys.readouterr().err
    bogus = tmp_path / "bogus.jbnn"
    bogus.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    assert cli.main(["predict", str(bogus)]) == 2
    assert "not a jaxbnn packed checkpoint" in capsys.readouterr().err
    assert cli.main(["predict", str(FORMAT_V1_FILE)]) == 2
    assert "format version 1 is not supported (this jaxbnn reads version 3); re-export the model from its " \
           "training run: jaxbnn export RUN_DIR MODEL.jbnn" in capsys.readouterr().err


@pytest.mark.parametrize("setting, value", [
    ("data", "foo"), ("data", ["x"]), ("model", ["mnist-mlp"]), ("width", "abc"), ("width", 1e308), ("seed", 2**64),
])
def test_export_names_a_config_json_with_values_that_cannot_train(tmp_path, capsys, setting, value):
    loop = import_train_module("loop")
    run = tmp_path / "run"
    run.mkdir()
    config = {**loop.TrainConfig(epochs=1).to_json(), setting: value}
    (run / "config.json").write_text(json.dumps(config))
    assert cli.main(["export", str(run), str(tmp_path / "m.jbnn")]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"jaxbnn export: error: {run / 'config.json'} is not a training configuration (")
    assert error.count("\n") == 1
    assert not (tmp_path / "m.jbnn").exists()


def _cut_short(path):
    path.write_bytes(path.read_bytes()[:-20])


def _corrupt_deflate_stream(path):
    with gzip.open(path, "rb") as f:
        payload = f.read()
    compressed = gzip.compress(payload, mtime=0)
    path.write_bytes(compressed[:10] + b"\xff" + compressed[11:])  # a deflate block type that is none


@pytest.mark.parametrize("spoil, file, message", [
    (_cut_short, "t10k-images-idx3-ubyte.gz", "damaged gzip file"),
    (_corrupt_deflate_stream, "t10k-labels-idx1-ubyte.gz", "damaged gzip file"),
    (lambda path: _write_idx(path, np.full(5, 200, np.uint8)), "t10k-labels-idx1-ubyte.gz",
     "label 200 out of range 0..9"),
    (lambda path: _write_idx(path, np.zeros((5, 28, 28), np.float32), code=0x0D), "t10k-images-idx3-ubyte.gz",
     "MNIST images are unsigned bytes (IDX element type 0x08), this file holds float32"),
    (lambda path: _write_idx(path, np.zeros((0, 28, 28), np.uint8)), "t10k-images-idx3-ubyte.gz", "holds no images"),
])
def test_predict_names_a_damaged_mnist_file_in_one_line(tmp_path, capsys, spoil, file, message):
    model = build_model("mnist-mlp", "bnn", width=0.125)  # untrained: predict stops at the data
    model.eval()
    packed = tmp_path / "m.jbnn"
    packed_model.save(packed, cli.import_export_package().export_model(model))
    folder = tmp_path / "mnist"
    folder.mkdir()
    _fake_mnist(folder, gz=True)
    spoil(folder / file)
    assert cli.main(["predict", str(packed), "--data", "mnist", "--data-dir", str(folder)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"jaxbnn predict: error: {folder / file}") and message in error
    assert error.count("\n") == 1


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path, capsys):
    """demo trains, exports and runs the MLP: the packed model predicts as the Flax model on every image."""
    assert cli.main(["demo", "--out", str(tmp_path / "demo"), "--epochs", "2"]) == 0
    printed = capsys.readouterr().out
    assert "predictions equal on 1000/1000 samples" in printed
    flax_accuracy = float(re.search(r"Flax model accuracy\s+([0-9.]+)", printed).group(1))
    packed_accuracy = float(re.search(r"packed model accuracy\s+([0-9.]+)", printed).group(1))
    assert flax_accuracy == packed_accuracy > 0.8
