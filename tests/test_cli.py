"""The command line as a user meets it: help that explains the options, --version, one-line errors for
bad paths, Ctrl-C without a traceback, no files left behind, and the bench table."""

import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
from importlib import metadata

import jax
import jax.numpy as jnp
import pytest

from jaxbnn import cli, packed_model
from jaxbnn.bench import _images_per_s, describe_device
from jaxbnn.models import build_model


def help_text(capsys, *command) -> str:
    """The help of `command`, wider than any line of it: argparse wraps lines at the terminal width, at
    hyphens too (a default of "mnist-mlp" would read "mnist- mlp" once the lines are joined)."""
    with pytest.MonkeyPatch.context() as patch, pytest.raises(SystemExit) as exit_info:
        patch.setenv("COLUMNS", "1000")
        cli.main([*command, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_train_help_shows_every_default_and_explains_the_modes_and_datasets(capsys):
    text = " ".join(help_text(capsys, "train").split())
    for default in ("(default: mnist-mlp)", "(default: bnn)", "(default: mnist5k)", "epochs of the run (default: 10)",
                    "images per training step (default: 100)", "(default: 0.001)", "plain Adam) (default: 0.0)",
                    "batch order (default: 0)", "model (default: 1.0)"):
        assert default in text
    for mode, meaning in (("bnn", "binary activations (+-1) x binary weights (+-1)"),
                          ("tnn", "ternary activations (-1, 0, +1) x ternary weights"),
                          ("tbn", "ternary activations x binary weights"),
                          ("btn", "binary activations x ternary weights"),
                          ("float", "full precision")):
        assert f"{mode} {meaning}" in text
    assert "mnist5k offline" in text and "cifar10 the CIFAR-10 binary batches" in text
    assert "--resume continues it from its last checkpoint" in text and "--restart deletes the run" in text


def test_export_help_explains_the_targets(capsys):
    text = " ".join(help_text(capsys, "export").split())
    assert "(default: cpu)" in text
    for target, meaning in (("cpu", "the CPU popcount kernels"), ("sm90", "NVIDIA Hopper (H100, H200)"),
                            ("sm80", "NVIDIA Ampere and later")):
        assert f"{target} {meaning}" in text


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"jaxbnn {metadata.version('jaxbnn')} (jax {metadata.version('jax')}, ")


def one_line_error(capsys, argv) -> str:
    """The error of a command that must fail with exit status 2 and one line on stderr."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


def test_export_into_a_missing_folder_names_the_folder(tmp_path, capsys):
    target = tmp_path / "missing" / "model.jbnn"
    assert one_line_error(capsys, ["export", str(tmp_path), str(target)]) == \
        f"jaxbnn export: error: no such folder to write into: {tmp_path / 'missing'}"


def test_export_onto_a_folder_asks_for_a_file_name(tmp_path, capsys):
    assert one_line_error(capsys, ["export", str(tmp_path), str(tmp_path)]) == \
        f"jaxbnn export: error: {tmp_path} is a folder; name the file to write, e.g. {tmp_path / 'model.jbnn'}"


def test_export_to_a_name_ending_in_a_separator_asks_for_a_file_name(tmp_path, capsys):
    output = f"{tmp_path / 'out'}/"
    assert one_line_error(capsys, ["export", str(tmp_path), output]) == (
        f"jaxbnn export: error: {output} names a folder (it ends in /); name the file to write, e.g. "
        f"{tmp_path / 'out' / 'model.jbnn'}")
    assert not (tmp_path / "out").exists()
    output = f"{tmp_path / 'out'}/."
    assert one_line_error(capsys, ["export", str(tmp_path), output]).startswith(
        f"jaxbnn export: error: {output} names a folder (it ends in .)")
    assert not (tmp_path / "out").exists()


def test_predict_on_a_folder_says_what_it_takes(tmp_path, capsys):
    assert one_line_error(capsys, ["predict", str(tmp_path)]) == \
        f"jaxbnn predict: error: {tmp_path} is a folder; predict takes a packed checkpoint file (.jbnn)"
    (tmp_path / "config.json").write_text("{}")  # what a training run directory holds
    assert one_line_error(capsys, ["predict", str(tmp_path)]) == (
        f"jaxbnn predict: error: {tmp_path} is a training run directory; predict takes the packed checkpoint "
        f"that `jaxbnn export` writes from it: jaxbnn export {tmp_path} model.jbnn, then jaxbnn predict model.jbnn")


def test_a_file_that_is_not_a_packed_checkpoint_is_refused_in_plain_words(tmp_path, capsys):
    text = tmp_path / "notes.jbnn"
    text.write_text("a text file, not a model\n")
    assert one_line_error(capsys, ["predict", str(text)]) == (
        f"jaxbnn predict: error: {text}: not a jaxbnn packed checkpoint (.jbnn): it does not start with the "
        "safetensors header a .jbnn file has")


@pytest.mark.mnist5k
def test_operating_system_errors_are_one_line(tmp_path, capsys):
    loop = tmp_path / "loop.jbnn"
    loop.symlink_to(loop)
    assert one_line_error(capsys, ["predict", str(loop)]) == \
        f"jaxbnn predict: error: Too many levels of symbolic links: {loop}"
    missing = tmp_path / "missing.jbnn"
    assert one_line_error(capsys, ["predict", str(missing)]) == \
        f"jaxbnn predict: error: No such file or directory: {missing}"
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert one_line_error(capsys, ["train", "--epochs", "1", "--out", str(a_file / "run")]).startswith(
        "jaxbnn train: error: Not a directory: ")


# `python -m jaxbnn.cli` with Ctrl-C on, as in a terminal: a test runner started in the background hands its
# children SIGINT ignored, which Python then keeps.
CLI_WITH_CTRL_C = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                   "sys.argv[0] = 'jaxbnn'; runpy.run_module('jaxbnn.cli', run_name='__main__')")


def interrupt_after(argv, cwd, line_start: str) -> subprocess.CompletedProcess:
    """Run `jaxbnn ARGV` in a fresh interpreter, send it SIGINT (Ctrl-C) once a stdout line starts with
    `line_start`, and return what it printed and its exit status."""
    process = subprocess.Popen([sys.executable, "-c", CLI_WITH_CTRL_C, *argv], cwd=cwd, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if line.startswith(line_start):
                process.send_signal(signal.SIGINT)
                break
        stdout, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    return subprocess.CompletedProcess(argv, process.returncode, "".join(lines) + stdout, stderr)


@pytest.mark.mnist5k
def test_ctrl_c_that_lands_in_a_garbage_collection_callback_still_stops_training(tmp_path, capsys):
    """Python drops a KeyboardInterrupt raised in a gc callback (jax registers one): the command still stops."""
    interrupted = []

    def ctrl_c_at_the_first_collection(phase, info):
        if phase == "start" and not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    gc.callbacks.append(ctrl_c_at_the_first_collection)
    try:
        status = cli.main(["train", "--epochs", "2", "--width", "0.125", "--no-progress", "--out", str(tmp_path / "run")])
    finally:
        gc.callbacks.remove(ctrl_c_at_the_first_collection)
        signal.signal(signal.SIGINT, previous)
    assert interrupted and status == 130
    assert "jaxbnn train: interrupted" in capsys.readouterr().err


def test_ctrl_c_that_jax_turns_into_a_value_error_still_stops_the_command(monkeypatch, capsys):
    """A KeyboardInterrupt raised while jax compares two pytrees' metadata comes out as jax's ValueError from it:
    the command still ends as interrupted, not as an error."""
    class CtrlCOnCompare:
        def __eq__(self, other):
            raise KeyboardInterrupt

        def __hash__(self):
            return 0

    class Node:
        pass

    jax.tree_util.register_pytree_node(Node, lambda node: ((), CtrlCOnCompare()), lambda aux, children: Node())

    def train_interrupted_inside_jax(args):
        return jax.tree.structure(Node()) == jax.tree.structure(Node())

    with pytest.raises(ValueError) as raised:  # what jax raises, so that this test fails where it no longer does
        train_interrupted_inside_jax(None)
    assert isinstance(raised.value.__cause__ or raised.value.__context__, KeyboardInterrupt)
    monkeypatch.setitem(cli.COMMANDS, "train", cli.COMMANDS["train"]._replace(run=train_interrupted_inside_jax))
    assert cli.main(["train", "--out", "unused"]) == 130
    assert capsys.readouterr().err.strip() == ("jaxbnn train: interrupted; to continue from the last checkpoint, "
                                               "run the same command with --resume")


@pytest.mark.mnist5k
def test_ctrl_c_during_training_says_how_to_resume_and_the_advice_holds(tmp_path):
    argv = ["train", "--epochs", "50", "--width", "0.125", "--no-progress", "--out", "run"]
    first = interrupt_after(argv, tmp_path, "epoch 1:")
    assert first.returncode == 130, first.stderr
    assert first.stderr.strip() == ("jaxbnn train: interrupted; to continue from the last checkpoint, run the same "
                                    "command with --resume")
    again = interrupt_after([*argv, "--resume"], tmp_path, "resumed from step")
    assert again.stdout.startswith("resumed from step "), again.stdout
    assert "Traceback" not in again.stderr


@pytest.mark.mnist5k
def test_ctrl_c_during_the_first_compilation_exits_with_130(tmp_path):
    """The interrupt lands inside XLA compiling the training step: jax's teardown would then crash (exit -11)
    after the message; the command ends without it."""
    argv = ["train", "--epochs", "1", "--width", "0.125", "--no-progress", "--out", "run"]
    interrupted = interrupt_after(argv, tmp_path, "training on ")
    assert interrupted.returncode == 130, interrupted.stderr
    assert interrupted.stderr.strip().startswith("jaxbnn train: interrupted; "), interrupted.stderr


@pytest.mark.mnist5k
def test_the_demo_leaves_no_temporary_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert cli.main(["demo", "--epochs", "1", "--width", "0.125"]) == 0
    assert "predictions equal on 1000/1000 samples" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_a_demo_kept_with_other_settings_is_refused_with_the_demos_own_options(tmp_path, capsys):
    """Before training: the run's differing settings as demo options, and --restart (which the demo takes)."""
    kept = {"model": "mnist-mlp", "mode": "bnn", "data": "mnist5k", "epochs": 1, "width": 0.125, "seed": 0}
    (tmp_path / "config.json").write_text(json.dumps(kept))
    assert cli.main(["demo", "--out", str(tmp_path), "--epochs", "2", "--width", "0.125"]) == 2
    assert capsys.readouterr().err.strip() == (f"jaxbnn demo: error: {tmp_path} holds a demo run of --epochs 1: run "
                                               "the demo with those settings to reuse it, or add --restart to delete "
                                               "it and train anew")
    for other, named in (({"model": "mnist-conv"}, "model"), ({"batch_size": 500, "learning_rate": 0.5},
                                                             "batch_size, learning_rate")):
        (tmp_path / "config.json").write_text(json.dumps({**kept, **other}))  # settings the demo has no option for
        assert cli.main(["demo", "--out", str(tmp_path), "--epochs", "1", "--width", "0.125"]) == 2
        assert (f"holds a training run that is not a demo's ({named} differ); give the demo another --out"
                in capsys.readouterr().err)
        # --restart deletes a demo's run only: a run of `jaxbnn train` is not the demo's to delete
        assert cli.main(["demo", "--out", str(tmp_path), "--epochs", "1", "--width", "0.125", "--restart"]) == 2
        assert (f"holds a training run that is not a demo's ({named} differ); give the demo another --out (--restart "
                "deletes only a demo run)" in capsys.readouterr().err)
        assert json.loads((tmp_path / "config.json").read_text()) == {**kept, **other}


def test_export_refuses_to_write_over_a_file_of_the_run_it_reads(tmp_path, capsys):
    """Written over config.json or into a checkpoint, the file would leave a run that can no longer be exported,
    resumed or restarted."""
    run = tmp_path / "run"
    (run / "checkpoints" / "20").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (tmp_path / "config-link").symlink_to(run / "config.json")
    for output in (run / "config.json", run / "metrics.jsonl", run / "checkpoints" / "20" / "model.jbnn",
                   tmp_path / "run" / ".." / "run" / "curves.png", run / "checkpoints-damaged"):
        assert cli.main(["export", str(run), str(output)]) == 2
        assert (f"{output} is a file of the run {run} that export reads; write the packed checkpoint elsewhere, e.g. "
                f"{run / 'model.jbnn'}" in capsys.readouterr().err)
    assert (run / "config.json").read_text() == "{}" and sorted(os.listdir(run)) == ["checkpoints", "config.json"]
    # a link elsewhere to a run's file would be replaced, not followed: not refused as the run's file (this run then
    # stops at its empty checkpoint step)
    assert cli.main(["export", str(run), str(tmp_path / "config-link")]) == 2
    assert "that export reads" not in (err := capsys.readouterr().err) and "no checkpoint in" in err


@pytest.mark.mnist5k
def test_out_of_memory_is_a_one_line_error(tmp_path):
    """A model too large for the machine (here: the CPU process's address space limited to 12 GiB, a layer of the
    width-64 MLP taking 16) is bad input like any other, not a traceback; nothing of the run is written."""
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (12 << 30, 12 << 30)); "
            "from jaxbnn import cli; sys.exit(cli.main(sys.argv[1:]))")
    argv = ["train", "--model", "mnist-mlp", "--epochs", "1", "--width", "64", "--no-progress", "--out", "run"]
    process = subprocess.run([sys.executable, "-c", code, *argv], cwd=tmp_path, capture_output=True, text=True,
                             timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert process.returncode == 2, process.stderr
    assert process.stderr.startswith("jaxbnn train: error: RESOURCE_EXHAUSTED: Out of memory")
    assert len(process.stderr.strip().splitlines()) == 1 and os.listdir(tmp_path) == []


def test_bench_prints_a_table_of_both_sides(tmp_path, capsys):
    model = build_model("mnist-mlp", "bnn", width=0.125)  # untrained: timing does not depend on the values
    model.eval()
    path = tmp_path / "tiny.jbnn"
    packed_model.save(path, cli.import_export_package().export_model(model))
    assert cli.main(["bench", str(path), "--batch-size", "1", "8", "--seconds", "0.05"]) == 0
    printed = capsys.readouterr().out.splitlines()
    dtype = "float32" if jax.devices()[0].platform == "cpu" else "bfloat16"
    device = describe_device(jax.devices()[0])
    assert printed[0] == (f"mnist-mlp (bnn, width 0.125, target cpu) against XLA {dtype} (the same architecture, "
                          f"random weights) on {device}")
    table = [[cell.strip() for cell in line.strip("|").split("|")] for line in printed if line.startswith("|")]
    assert table[0] == ["batch", "jaxbnn images/s", f"XLA {dtype} images/s", "speedup", "device", "jax"]
    assert [row[0] for row in table[2:]] == ["1", "8"]
    for _, packed, xla, speedup, row_device, jax_version in table[2:]:
        packed, xla = float(packed.replace(",", "")), float(xla.replace(",", ""))
        assert packed > 0 and xla > 0
        assert float(speedup.removesuffix("x")) == pytest.approx(packed / xla, rel=0.01, abs=0.01)
        assert (row_device, jax_version) == (device, jax.__version__)
    assert printed[-1].startswith(("CPU kernels: native", "CUDA kernels: native"))


def test_a_batch_the_machine_cannot_hold_is_a_row_out_of_memory():
    """The CPU's out-of-memory error (as the GPU's RESOURCE_EXHAUSTED) gives the table's "out of memory" row."""
    too_large = jax.jit(lambda i: jnp.zeros((2**20, 2**20), jnp.uint8).at[i].set(1))  # 1 TiB
    assert _images_per_s(too_large, (jnp.int32(3),), 8, 0.1) is None


def test_bench_on_a_run_directory_says_what_it_takes(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert one_line_error(capsys, ["bench", str(tmp_path)]) == (
        f"jaxbnn bench: error: {tmp_path} is a training run directory; bench takes the packed checkpoint that "
        f"`jaxbnn export` writes from it: jaxbnn export {tmp_path} model.jbnn, then jaxbnn bench model.jbnn")
