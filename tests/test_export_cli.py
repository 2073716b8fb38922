"""`jaxbnn export` / `jaxbnn predict` on a real (short) training run, and `jaxbnn demo` (slow)."""

import re

import numpy as np
import pytest

from jaxbnn import cli, packed_model, runtime
from jaxbnn.cli import import_train_module
from test_packed_model import FORMAT_V1_FILE


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    loop = import_train_module("loop")
    out = tmp_path_factory.mktemp("run")
    config = loop.TrainConfig(model="mnist-mlp", mode="bnn", data="mnist5k", epochs=1, width=0.125, batch_size=200)
    loop.fit(config, out, progress=False, log=lambda *_: None)
    return out


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


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path, capsys):
    """demo trains, exports and runs the MLP: the packed model predicts as the Flax model on every image."""
    assert cli.main(["demo", "--out", str(tmp_path / "demo"), "--epochs", "2"]) == 0
    printed = capsys.readouterr().out
    assert "predictions equal on 1000/1000 samples" in printed
    flax_accuracy = float(re.search(r"Flax model accuracy\s+([0-9.]+)", printed).group(1))
    packed_accuracy = float(re.search(r"packed model accuracy\s+([0-9.]+)", printed).group(1))
    assert flax_accuracy == packed_accuracy > 0.8
