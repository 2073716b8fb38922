"""Training runs on the offline MNIST-5k split: learning, checkpoint resume, an existing run resumed or
restarted only when asked, and the CLI's checks before it writes anything (the accuracy rows of
docs/accuracy.md: tests/test_docs.py)."""

import json
import os
import re
from fractions import Fraction

import jax

import numpy as np
import pytest
from flax import nnx

from jaxbnn import cli
from jaxbnn.bench import describe_device

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
    resumed = loop.fit(config, tmp_path / "resumed", resume=True, progress=False, checkpoint_every=11,
                       log=messages.append)
    assert messages[0].startswith("resumed from step 55 (epoch 2, batch 15)")
    assert messages[1] == f"training on {describe_device(jax.devices()[0])}"
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


def test_a_diverged_state_is_never_checkpointed(tmp_path):
    """A loss or parameters no longer finite stop the run at the next checkpoint instead of saving it: a resume
    or an export would take it for the run's latest state."""
    config = loop.TrainConfig(epochs=1, **{**SMALL_MLP, "learning_rate": 1e38, "width": 0.125})
    diverged = r"training diverged at epoch 1, by step (\d+) \(loss (nan|inf)\)"
    with pytest.raises(FloatingPointError, match=diverged) as error:
        loop.fit(config, tmp_path, progress=False, checkpoint_every=5, log=lambda _: None)
    diverged_at = int(re.search(r"step (\d+)", str(error.value)).group(1))
    steps = loop._checkpoint_steps(tmp_path)
    assert all(step < diverged_at for step in steps)
    if steps:  # the states saved before are finite
        model = loop.load_trained(tmp_path)
        assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model))))


def test_a_run_directory_refuses_a_different_configuration(tmp_path):
    config = loop.TrainConfig(epochs=1, **SMALL_MLP)
    loop.fit(config, tmp_path, progress=False, log=lambda _: None)
    other = loop.TrainConfig(epochs=1, **{**SMALL_MLP, "mode": "tnn"})
    with pytest.raises(ValueError, match=r"different configuration: mode 'bnn' \(now 'tnn'\)"):
        loop.fit(other, tmp_path, progress=False, log=lambda _: None)


def test_cli_train_writes_metrics_plot_and_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(["train", "--model", "mnist-mlp", "--data", "mnist5k", "--epochs", "1", "--width", "0.125",
                     "--out", str(out), "--no-progress", "--summary"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "total" in printed and "final test accuracy" in printed
    assert f"training on {describe_device(jax.devices()[0])}\n" in printed
    assert re.search(r"epoch 1: .* \| [0-9.]+s \(training [0-9,]+ images/s\)", printed)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["epoch"] == 1 and 0 <= rows[0]["test_accuracy"] <= 1
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "checkpoints" / "40").is_dir()  # named by global step: 4,000 images / 100 per batch
    assert json.loads((out / "config.json").read_text())["model"] == "mnist-mlp"


TINY_RUN = ["--model", "mnist-mlp", "--epochs", "1", "--width", "0.125", "--no-progress"]


@pytest.mark.parametrize("mistake, message", [
    (["--model", "mnist-cnn"], "unknown model 'mnist-cnn'; did you mean 'mnist-conv'?"),
    (["--mode", "bnnn"], "unknown mode 'bnnn'; did you mean 'bnn'?"),
    (["--data", "mnist-5k"], "unknown dataset 'mnist-5k'; did you mean 'mnist5k'?"),
    (["--data", "mnist"], "pass it with --data-dir"),
    (["--data", "mnist", "--data-dir", "no-such-folder"], "--data-dir no-such-folder: no such folder"),
    (["--batch-size", "5000"], "batch size 5000 exceeds the 4000 training images"),
    (["--model", "imagenet-alexnet"], "too small for this network"),
])
def test_a_mistyped_train_command_writes_nothing_so_the_corrected_one_runs(tmp_path, capsys, mistake, message):
    out = tmp_path / "run"
    assert cli.main(["train", *TINY_RUN, "--out", str(out), *mistake]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
    assert cli.main(["train", *TINY_RUN, "--out", str(out)]) == 0
    assert "final test accuracy" in capsys.readouterr().out


@pytest.mark.parametrize("option, value, message", [
    ("--lr", "-1", "argument --lr: must be a finite number > 0, got -1"),
    ("--lr", "0", "argument --lr: must be a finite number > 0, got 0"),
    ("--lr", "nan", "argument --lr: must be a finite number > 0, got nan"),
    ("--epochs", "0", "argument --epochs: must be >= 1, got 0"),
    ("--epochs", "2.5", "argument --epochs: expected an integer, got '2.5'"),
    ("--batch-size", "-4", "argument --batch-size: must be >= 1, got -4"),
    ("--weight-decay", "-0.1", "argument --weight-decay: must be a finite number >= 0, got -0.1"),
    ("--width", "0", "argument --width: must be a finite number > 0, got 0"),
    ("--seed", "-1", "argument --seed: must be >= 0, got -1"),
    ("--checkpoint-every", "-5", "argument --checkpoint-every: must be >= 0, got -5"),
])
def test_out_of_range_numbers_are_refused_before_anything_is_written(tmp_path, capsys, option, value, message):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--out", str(out), f"{option}={value}"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_the_python_api_checks_the_configuration_before_writing(tmp_path):
    for bad, message in ((dict(learning_rate=-1.0), "learning_rate must be a finite number > 0, got -1.0"),
                         (dict(epochs=0), "epochs must be an integer >= 1, got 0"),
                         (dict(model="lenet"), "unknown model 'lenet'; known: mnist-mlp, mnist-conv"),
                         (dict(model=["mnist-mlp"]), "unknown model ['mnist-mlp']; did you mean 'mnist-mlp'?"),
                         (dict(data_dir=5), "data_dir must be a folder name or None, got 5"),
                         (dict(width=1e308), "width must be at most 64, got 1e+308"),
                         (dict(seed=2**63), "seed must be at most 2^63 - 1, got 9223372036854775808"),
                         (dict(augment="yes"), "augment must be true, false or None"),
                         (dict(augment=1.0), "augment must be true, false or None (the dataset's default), got 1.0"),
                         (dict(augment=0), "augment must be true, false or None (the dataset's default), got 0"),
                         (dict(augment=1 + 0j), "augment must be true, false or None"),
                         (dict(learning_rate=Fraction(1, 1000)), "learning_rate must be a finite number > 0"),
                         (dict(weight_decay=10**400), "weight_decay must be a finite number >= 0"),
                         (dict(width=10**400), "width must be a finite number > 0")):
        with pytest.raises(ValueError, match=re.escape(message)):
            loop.fit(loop.TrainConfig(**{**SMALL_MLP, **bad}), tmp_path / "run", progress=False)
        assert not (tmp_path / "run").exists()


def test_numpy_scalars_in_the_configuration_are_recorded_as_the_numbers_they_hold():
    config = loop.TrainConfig(epochs=np.int64(2), learning_rate=np.float32(0.5), augment=np.bool_(True),
                              seed=np.int32(3), width=np.float64(0.25))
    loop.check_config(config)
    recorded = json.loads(json.dumps(config.to_json()))
    assert (recorded["epochs"], recorded["learning_rate"], recorded["augment"], recorded["seed"],
            recorded["width"]) == (2, 0.5, True, 3, 0.25)
    assert loop.TrainConfig(**recorded) == config


def test_loading_a_trained_model_does_not_look_for_its_dataset_folder(tmp_path):
    """export reads no images: a run whose data folder has moved away is loaded up to its checkpoints."""
    config = loop.TrainConfig(data="mnist", data_dir=str(tmp_path / "moved-away"), epochs=1)
    (tmp_path / "config.json").write_text(json.dumps(config.to_json()))
    with pytest.raises(FileNotFoundError, match=f"{tmp_path} has no checkpoint"):
        loop.load_trained(tmp_path)
    with pytest.raises(ValueError, match="--data-dir .*moved-away: no such folder"):
        loop.check_config(config)


def test_the_progress_bar_stays_out_of_a_log_file(tmp_path, capsys):
    # Under pytest's capture stderr is not a terminal, as when it is redirected to a file: no bar frames.
    loop.fit(loop.TrainConfig(epochs=1, **SMALL_MLP), tmp_path, progress=True, log=lambda _: None)
    assert "\r" not in capsys.readouterr().err


def test_cli_requires_an_output_directory():
    with pytest.raises(SystemExit):
        cli.main(["train"])


def test_rerunning_a_finished_run_says_it_is_complete_and_how_to_train_longer(tmp_path):
    config = loop.TrainConfig(epochs=1, **SMALL_MLP)
    rows = loop.fit(config, tmp_path, progress=False, log=lambda _: None)
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())

    finished = (f"{tmp_path} holds a finished run (1/1 epochs, test accuracy {rows[-1]['test_accuracy']:.4f}): "
                "nothing to train. To train longer, start a new run with a larger --epochs in a new --out directory "
                f"(the learning rate decays to zero over a run's epochs); to use this one: jaxbnn export {tmp_path} "
                "MODEL.jbnn")
    messages = []
    assert loop.fit(config, tmp_path, resume=True, progress=False, log=messages.append) == rows
    assert messages == [finished]
    with pytest.raises(ValueError) as refused:  # without --resume: the same news, and how to train again
        loop.fit(config, tmp_path, progress=False, log=messages.append)
    assert str(refused.value) == f"{finished}; --restart deletes it and trains again"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == checkpoints


def test_a_different_epoch_count_is_refused_not_ignored(tmp_path):
    loop.fit(loop.TrainConfig(epochs=1, **SMALL_MLP), tmp_path, progress=False, log=lambda _: None)
    config_before = (tmp_path / "config.json").read_text()
    for epochs in (2, 3):  # a finished 1-epoch run neither extended nor silently kept
        for resume in (False, True):
            with pytest.raises(ValueError, match=rf"holds a run of 1 epoch, not {epochs}: .*Continue it with "
                                                 rf"--epochs 1 --resume, or train {epochs} epochs in a new --out "
                                                 r"directory \(or here with --restart, which deletes this run\)"):
                loop.fit(loop.TrainConfig(epochs=epochs, **SMALL_MLP), tmp_path, resume=resume, progress=False,
                         log=lambda _: None)
    assert (tmp_path / "config.json").read_text() == config_before


def test_train_export_and_predict_on_mnist_files_from_a_folder(tmp_path, capsys):
    from test_data import _fake_mnist

    folder = tmp_path / "mnist"
    folder.mkdir()
    _fake_mnist(folder, n_train=20, n_test=6)
    out = tmp_path / "run"
    assert cli.main(["train", "--data", "mnist", "--data-dir", str(folder), "--batch-size", "5", *TINY_RUN,
                     "--out", str(out)]) == 0
    assert cli.main(["export", str(out), str(tmp_path / "m.jbnn")]) == 0
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"):
        (folder / name).unlink()  # predict scores the test split and reads nothing else
    capsys.readouterr()
    assert cli.main(["predict", str(tmp_path / "m.jbnn"), "--data", "mnist", "--data-dir", str(folder)]) == 0
    printed = capsys.readouterr().out
    assert "on mnist test: accuracy" in printed and "(6 images)" in printed


def files_under(folder) -> dict[str, int]:
    """Relative path -> size of every file under a folder."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_existing_run_is_refused_unless_resumed_or_restarted(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--epochs", "2", "--width", "0.125", "--no-progress", "--out", str(out)]

    def stop_after_the_first_epoch(message):  # its checkpoint is written: step 40 (4,000 images, 100 a step)
        if message.startswith("epoch 1:"):
            raise _Interrupt

    with pytest.raises(_Interrupt):
        loop.fit(loop.TrainConfig(model="mnist-mlp", epochs=2, width=0.125), out, progress=False,
                 log=stop_after_the_first_epoch)
    before = files_under(out)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"jaxbnn train: error: {out} holds a run (1/2 epochs done, last checkpoint at step 40): pass "
                   "--resume to continue it, or --restart to delete it and start over\n")
    assert files_under(out) == before
    assert cli.main([*argv, "--resume"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"resumed from step 40 (epoch 2, batch 0) in {out}\n")
    assert "epoch 1:" not in printed and "epoch 2:" in printed


def test_resume_needs_a_run(tmp_path, capsys):
    missing = tmp_path / "missing"
    assert cli.main(["train", *TINY_RUN, "--out", str(missing), "--resume"]) == 2
    assert capsys.readouterr().err == (f"jaxbnn train: error: nothing to resume: {missing} does not exist; drop "
                                       "--resume to start a run there\n")
    assert not missing.exists()
    with pytest.raises(ValueError, match=f"nothing to resume: {tmp_path} holds no run \\(no config.json\\)"):
        loop.fit(loop.TrainConfig(epochs=1, **SMALL_MLP), tmp_path, resume=True, progress=False)
    with pytest.raises(ValueError, match="resume and restart exclude each other"):
        loop.fit(loop.TrainConfig(epochs=1, **SMALL_MLP), tmp_path, resume=True, restart=True, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_restart_deletes_the_run_and_nothing_else_then_starts_over(tmp_path):
    loop.fit(loop.TrainConfig(epochs=1, **SMALL_MLP), tmp_path, progress=False, log=lambda _: None)
    (tmp_path / "checkpoints-damaged" / "20").mkdir(parents=True)  # a step a resume set aside
    (tmp_path / "notes.txt").write_text("mine\n")
    (tmp_path / "model.jbnn").write_bytes(b"exported")
    messages = []
    other = loop.TrainConfig(epochs=1, **{**SMALL_MLP, "mode": "tnn"})  # any configuration: the old run goes
    rows = loop.fit(other, tmp_path, restart=True, progress=False, log=messages.append)
    assert messages[0] == (f"deleted the run in {tmp_path}: checkpoints, checkpoints-damaged, metrics.jsonl, "
                           "curves.png, config.json")
    assert [r["epoch"] for r in rows] == [1]
    assert json.loads((tmp_path / "config.json").read_text())["mode"] == "tnn"
    assert sorted(os.listdir(tmp_path)) == ["checkpoints", "config.json", "curves.png", "metrics.jsonl", "model.jbnn",
                                            "notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "mine\n" and (tmp_path / "model.jbnn").read_bytes() == b"exported"


def test_restart_refuses_a_folder_that_is_not_a_run(tmp_path):
    config = loop.TrainConfig(epochs=1, **SMALL_MLP)
    folder = tmp_path / "papers"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine\n")
    with pytest.raises(ValueError, match=r"holds no jaxbnn run \(no config.json\), so --restart deletes nothing"):
        loop.fit(config, folder, restart=True, progress=False)
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))  # another tool's
    before = files_under(folder)
    with pytest.raises(ValueError, match="does not look like a jaxbnn run .*so --restart deletes nothing"):
        loop.fit(config, folder, restart=True, progress=False)
    assert files_under(folder) == before

    run = tmp_path / "run"
    loop.fit(config, run, progress=False, log=lambda _: None)
    (run / "checkpoints" / "plots").mkdir()  # not something a run writes
    before = files_under(run)
    with pytest.raises(ValueError, match=f"{run / 'checkpoints' / 'plots'} is not a checkpoint step, so --restart "
                                         "deletes nothing"):
        loop.fit(config, run, restart=True, progress=False)
    assert files_under(run) == before and (run / "checkpoints" / "plots").is_dir()
