"""Training runs on the offline MNIST-5k split: learning, checkpoint resume, the CLI, and (slow) the
accuracy rows of docs/accuracy.md."""

import json

import numpy as np
import pytest
from flax import nnx

from jaxbnn import cli

loop = cli.import_train_module("loop")
data = cli.import_train_module("data")

pytestmark = pytest.mark.mnist5k

SMALL_MLP = dict(model="mnist-mlp", mode="bnn", data="mnist5k", batch_size=100, width=0.25, learning_rate=3e-3)


class _Interrupt(Exception):
    pass


def test_short_bnn_run_beats_chance_and_resumes_exactly(tmp_path):
    config = loop.TrainConfig(epochs=2, **SMALL_MLP)
    straight = loop.fit(config, tmp_path / "straight", progress=False, log=lambda _: None)
    assert straight[-1]["test_accuracy"] > 0.75  # chance is 0.10

    def interrupt_inside_the_second_epoch(message):  # 40 steps per epoch: step 55 is batch 15 of epoch 2
        if message == "checkpoint at step 55":
            raise _Interrupt

    with pytest.raises(_Interrupt):
        loop.fit(config, tmp_path / "resumed", progress=False, checkpoint_every=11,
                 log=interrupt_inside_the_second_epoch)
    messages = []
    resumed = loop.fit(config, tmp_path / "resumed", progress=False, checkpoint_every=11, log=messages.append)
    assert messages[0].startswith("resumed from step 55 (epoch 2, batch 15)")
    assert [r["epoch"] for r in resumed] == [1, 2]
    metrics = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in metrics] == [1, 2]
    for a, b in zip(straight, resumed):
        for key in ("train_loss", "train_accuracy", "test_loss", "test_accuracy"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key

    model = loop.load_trained(tmp_path / "resumed")
    test = data.load_mnist5k("test")
    assert loop.evaluate(model, test)["accuracy"] == pytest.approx(resumed[-1]["test_accuracy"])
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.BatchNorm):
            assert module.use_running_average  # loaded for inference


def test_a_run_directory_refuses_a_different_configuration(tmp_path):
    config = loop.TrainConfig(epochs=1, **SMALL_MLP)
    loop.fit(config, tmp_path, progress=False, log=lambda _: None)
    other = loop.TrainConfig(epochs=1, **{**SMALL_MLP, "mode": "tnn"})
    with pytest.raises(ValueError, match="different configuration"):
        loop.fit(other, tmp_path, progress=False, log=lambda _: None)


def test_cli_train_writes_metrics_plot_and_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(["train", "--model", "mnist-mlp", "--data", "mnist5k", "--epochs", "1", "--width", "0.125",
                     "--out", str(out), "--no-progress", "--summary"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "total" in printed and "final test accuracy" in printed
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["epoch"] == 1 and 0 <= rows[0]["test_accuracy"] <= 1
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "checkpoints" / "40").is_dir()  # named by global step: 4,000 images / 100 per batch
    assert json.loads((out / "config.json").read_text())["model"] == "mnist-mlp"


def test_cli_reports_bad_arguments(tmp_path, capsys):
    code = cli.main(["train", "--model", "lenet", "--epochs", "1", "--out", str(tmp_path / "x")])
    assert code == 2 and "unknown model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["train"])  # --out is required


# --- the rows of docs/accuracy.md -----------------------------------------------------------------------------


def _final_accuracy(tmp_path, **overrides):
    config = loop.TrainConfig(**overrides)
    return loop.fit(config, tmp_path / config.mode, progress=False, log=lambda _: None)[-1]["test_accuracy"]


@pytest.mark.slow
def test_mnist_mlp_bnn_is_within_four_points_of_full_precision(tmp_path):
    bnn = _final_accuracy(tmp_path, model="mnist-mlp", mode="bnn", data="mnist5k", epochs=20)
    full = _final_accuracy(tmp_path, model="mnist-mlp", mode="float", data="mnist5k", epochs=20)
    assert full > 0.9 and bnn >= full - 0.04, (bnn, full)


@pytest.mark.slow
def test_mnist_conv_bnn_reaches_95_percent(tmp_path):
    assert _final_accuracy(tmp_path, model="mnist-conv", mode="bnn", data="mnist5k", epochs=15) >= 0.95
