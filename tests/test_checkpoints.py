"""Training checkpoints: every step records the sha256 of its files; a resume verifies them, reports a
damaged step by name, sets it aside and resumes from the newest good one, or stops with one message
naming every step when none is good."""

import concurrent.futures
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxbnn import cli
from jaxbnn.models import build_model

loop = cli.import_train_module("loop")


def fresh():
    model = build_model("mnist-mlp", "bnn", input_shape=(4, 4, 1), num_classes=3, width=0.25, rngs=nnx.Rngs(0))
    return model, loop.make_optimizer(model, 1e-3, 10)


def first_kernel(model):
    return next(leaf for leaf in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model))) if np.ndim(leaf) == 2)


def save_steps(run_dir, steps):
    """Checkpoints at `steps`, each with the model's first kernel filled with the step number."""
    model, optimizer = fresh()
    manager = loop._checkpoint_manager(run_dir)
    for step in steps:
        for _, module in nnx.iter_modules(model):
            if isinstance(module, nnx.Linear) or hasattr(module, "kernel"):
                module.kernel[...] = jnp.full(module.kernel[...].shape, float(step))
        loop._save(manager, step, model, optimizer, {"rows": [], "step": step})
    manager.close()


def restore(run_dir):
    """What a resuming run does: verify and restore, then open the checkpoint manager it goes on with."""
    model, optimizer = fresh()
    messages = []
    step, progress = loop._restore(run_dir, model, optimizer, log=messages.append)
    loop._checkpoint_manager(run_dir).close()
    return step, progress, model, messages


def largest_file(step_dir):
    files = [p for p in step_dir.rglob("*") if p.is_file() and p.name != loop.CHECKSUMS]
    return max(files, key=lambda p: p.stat().st_size)


def test_an_intact_newest_step_is_restored(tmp_path):
    save_steps(tmp_path, [10, 20])
    step, progress, model, messages = restore(tmp_path)
    assert (step, progress["step"], messages) == (20, 20, [])
    assert np.all(np.asarray(first_kernel(model)) == 20.0)


def test_flipped_bytes_in_the_newest_step_fall_back_to_the_previous_one(tmp_path):
    save_steps(tmp_path, [10, 20])
    data = largest_file(tmp_path / "checkpoints" / "20")
    blob = bytearray(data.read_bytes())
    for i in range(64):  # 64 bytes flipped in the middle of the state's data
        blob[len(blob) // 2 + i] ^= 0xFF
    data.write_bytes(bytes(blob))
    step, progress, model, messages = restore(tmp_path)
    assert (step, progress["step"]) == (10, 10)
    assert np.all(np.asarray(first_kernel(model)) == 10.0)
    relative = data.relative_to(tmp_path / "checkpoints" / "20").as_posix()
    assert messages == [f"checkpoint step 20 is damaged: {relative} does not match its checksum (corrupted); "
                        f"moved to {tmp_path / 'checkpoints-damaged' / '20'}, trying the previous step"]
    assert sorted(os.listdir(tmp_path / "checkpoints-damaged")) == ["20"]


def test_damaged_orbax_metadata_is_caught_before_orbax_reads_it(tmp_path):
    """orbax's CheckpointManager parses every step's metadata when it is created, and raises on some damage
    (two unknown keys, as two flipped bits make them): the steps are verified before that."""
    save_steps(tmp_path, [10, 20])
    metadata = tmp_path / "checkpoints" / "20" / "_CHECKPOINT_METADATA"
    text = metadata.read_text().replace("commit_timestamp_nsecs", "bommit_timestamp_nsecs")
    metadata.write_text(text.replace("init_timestamp_nsecs", "hnit_timestamp_nsecs"))  # two unknown keys
    step, _, _, messages = restore(tmp_path)  # the manager opened after the restore sees step 10 only
    assert step == 10 and "_CHECKPOINT_METADATA does not match its checksum" in messages[0]


def test_an_empty_or_unfinished_newest_step_falls_back(tmp_path):
    save_steps(tmp_path, [10, 20])
    (tmp_path / "checkpoints" / "30").mkdir()
    step, _, _, messages = restore(tmp_path)
    assert step == 20 and messages[0].startswith("checkpoint step 30 is damaged: the directory is empty")
    (tmp_path / "checkpoints" / "20" / loop.CHECKSUMS).unlink()  # killed between orbax's rename and the record
    step, _, _, messages = restore(tmp_path)
    assert step == 10 and f"it has no {loop.CHECKSUMS}" in messages[0]


def test_a_truncated_or_missing_file_is_named(tmp_path):
    save_steps(tmp_path, [10, 20])
    data = largest_file(tmp_path / "checkpoints" / "20")
    data.write_bytes(data.read_bytes()[:-100])
    step, _, _, messages = restore(tmp_path)
    assert step == 10 and "does not match its checksum" in messages[0]
    save_steps(tmp_path / "other", [5])
    largest_file(tmp_path / "other" / "checkpoints" / "5").unlink()
    with pytest.raises(loop.CheckpointError, match=r"no checkpoint in .* can be resumed from: step 5 .* is missing"):
        restore(tmp_path / "other")


def test_when_no_step_is_good_one_error_names_each(tmp_path):
    save_steps(tmp_path, [10, 20])
    for step in (10, 20):
        (tmp_path / "checkpoints" / str(step) / loop.CHECKSUMS).write_text("{not json")
    with pytest.raises(loop.CheckpointError) as error:
        restore(tmp_path)
    message = str(error.value)
    assert "step 20 (" in message and "step 10 (" in message and "is unreadable" in message
    assert "to start over, use --restart or a new --out directory" in message


def test_saving_continues_after_a_fallback(tmp_path):
    """The damaged newer step no longer sits in orbax's directory, where it would count as the latest step
    and orbax would skip saving the older steps that follow the fallback."""
    save_steps(tmp_path, [10, 20])
    (tmp_path / "checkpoints" / "20" / loop.CHECKSUMS).unlink()
    assert restore(tmp_path)[0] == 10
    save_steps(tmp_path, [15])
    assert restore(tmp_path)[:2] == (15, {"rows": [], "step": 15})


def test_a_garbage_config_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{garbage")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'} is not a training configuration"):
        loop.load_trained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model": "mnist-mlp", "colour": "blue"}))
    with pytest.raises(ValueError, match="is not a training configuration .*colour"):
        loop.load_trained(tmp_path)


NESTED_TOO_DEEPLY = "[" * 100_000 + "]" * 100_000  # past the JSON parser's recursion


def test_json_nested_too_deeply_is_a_file_that_cannot_be_read(tmp_path):
    """The parser's RecursionError is an unreadable file like any other: a checksum record sets its step aside
    (the previous one is restored), a config.json is named, a metrics line is skipped."""
    save_steps(tmp_path, [10, 20])
    (tmp_path / "checkpoints" / "20" / loop.CHECKSUMS).write_text('{"sha256": ' + NESTED_TOO_DEEPLY + "}")
    step, _, _, messages = restore(tmp_path)
    assert step == 10 and "nested too deeply" in messages[0]
    (tmp_path / "config.json").write_text(NESTED_TOO_DEEPLY)
    with pytest.raises(ValueError, match="config.json is not a training configuration .nested too deeply"):
        loop.load_trained(tmp_path)
    with pytest.raises(ValueError, match="config.json is not valid JSON .nested too deeply"):
        run_check(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(NESTED_TOO_DEEPLY + "\n")
    assert loop._epochs_done(tmp_path) == []


def without_blocking(fifo, read, *args):
    """`read(*args)`'s result or exception; a read blocked on `fifo` is released (a writer opens and closes it)
    and fails the test."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(read, *args)
        try:
            future.exception(timeout=30)
        except concurrent.futures.TimeoutError:
            with open(fifo, "w"):
                pass
            pytest.fail(f"{read.__name__} blocked reading the FIFO {fifo}")
        return future


def test_a_run_file_that_is_a_fifo_is_refused_not_read(tmp_path):
    """Reading a FIFO would block until something writes into it."""
    os.mkfifo(tmp_path / "config.json")
    error = without_blocking(tmp_path / "config.json", loop.load_trained, tmp_path).exception()
    assert isinstance(error, ValueError) and "config.json is not a training configuration (not a file)" in str(error)
    os.mkfifo(tmp_path / "metrics.jsonl")
    assert without_blocking(tmp_path / "metrics.jsonl", loop._epochs_done, tmp_path).result() == []


def test_a_linked_step_folder_is_refused_not_taken_for_a_later_step(tmp_path):
    save_steps(tmp_path, [10])
    (tmp_path / "checkpoints" / "20").symlink_to("10")
    with pytest.raises(loop.CheckpointError, match="checkpoints/20 is a link, not a step folder a run writes"):
        restore(tmp_path)


def test_a_reader_skips_a_damaged_step_without_moving_it(tmp_path):
    """Export reads a run (load_trained): it falls back the same way but leaves the directory as it is."""
    save_steps(tmp_path, [10, 20])
    (tmp_path / "checkpoints" / "20" / loop.CHECKSUMS).unlink()
    model, optimizer = fresh()
    messages = []
    step, _ = loop._restore(tmp_path, model, optimizer, log=messages.append, set_aside=False)
    assert step == 10 and messages[0].endswith("trying the previous step") and "moved" not in messages[0]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["10", "20"]
    assert not (tmp_path / "checkpoints-damaged").exists()


def run_check(run_dir, resume=True):
    """What `fit` checks before it writes anything, for a run of `loop.TrainConfig()`'s settings."""
    return loop._check_run_directory(run_dir, loop.TrainConfig(), resume=resume, restart=False)


def test_once_every_step_was_set_aside_the_run_is_not_started_over_silently(tmp_path):
    """A resume that found every step damaged set them aside and stopped; the same command again (or one
    without --resume) must not see an empty checkpoints folder and train from scratch over the run's history."""
    (tmp_path / "config.json").write_text(json.dumps(loop.TrainConfig().to_json()))
    save_steps(tmp_path, [10, 20])
    for step in (10, 20):
        (tmp_path / "checkpoints" / str(step) / loop.CHECKSUMS).write_text("{not json")
    with pytest.raises(loop.CheckpointError):
        loop._restore(tmp_path, *fresh(), log=lambda _: None)
    assert sorted(os.listdir(tmp_path / "checkpoints-damaged")) == ["10", "20"]
    for resume in (True, False):
        with pytest.raises(ValueError, match="every checkpoint was found damaged .* --restart deletes the run"):
            run_check(tmp_path, resume=resume)
    assert loop._check_run_directory(tmp_path, loop.TrainConfig(), resume=False, restart=True)  # what it deletes


@pytest.mark.parametrize("name", ["run[1]", "a]b", "back\\slash"])
def test_a_run_directory_whose_path_orbax_would_glob_is_refused_before_training(tmp_path, name):
    """orbax finds a step's data by a glob under the run's path: under "run[1]" it saves steps it cannot read
    back, which a resume would then set aside as damaged."""
    with pytest.raises(ValueError, match="orbax cannot read back"):
        run_check(tmp_path / name, resume=False)


def test_a_checkpoints_file_is_refused_before_training(tmp_path):
    (tmp_path / "checkpoints").write_text("")
    with pytest.raises(ValueError, match="checkpoints is not a folder"):
        run_check(tmp_path, resume=False)


@pytest.mark.parametrize("name", ["config.json", "metrics.jsonl", "curves.png", "config.json.tmp"])
def test_a_folder_where_a_run_writes_a_file_is_refused_before_training(tmp_path, name):
    """Not found at the run's first write of it: a config.json folder let a whole run train without its config,
    a curves.png folder stopped one after its first epoch."""
    (tmp_path / name).mkdir()
    with pytest.raises(ValueError, match=f"{name} is not a file: a run writes its {name} there"):
        loop.fit(loop.TrainConfig(model="mnist-mlp", epochs=1, width=0.125), tmp_path, progress=False)
    assert os.listdir(tmp_path) == [name]


def test_a_failed_write_leaves_neither_the_file_nor_its_temporary(tmp_path):
    with pytest.raises(UnicodeEncodeError):  # raised after the temporary was opened, as a full disk would be
        loop._write_atomic(tmp_path / "metrics.jsonl", "\udc80")
    assert os.listdir(tmp_path) == []


def test_metrics_rows_of_another_shape_are_not_read_for_messages(tmp_path):
    """metrics.jsonl is rebuilt from the checkpoint on resume; rows a person edited only drop the message's
    accuracy."""
    config = loop.TrainConfig(epochs=1)
    for text in ('{"epoch": 1}\n', "[1]\n", '{"epoch": 1, "test_accuracy": "high"}\n'):
        (tmp_path / "metrics.jsonl").write_text(text)
        assert "finished run (1/1 epochs): nothing to train" in loop._finished_message(
            tmp_path, config, loop._epochs_done(tmp_path))
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1, "test_accuracy": 0.5}\n')
    assert "(1/1 epochs, test accuracy 0.5000)" in loop._finished_message(tmp_path, config, loop._epochs_done(tmp_path))



def test_a_zero_padded_step_folder_is_named_not_opened_under_another_name(tmp_path):
    """orbax takes a copied "0032" for step 32 and then opens "32": refused, naming the folder."""
    save_steps(tmp_path, [10])
    (tmp_path / "checkpoints" / "10").rename(tmp_path / "checkpoints" / "0032")
    with pytest.raises(loop.CheckpointError, match=r"0032 is not a step folder orbax writes \(step 32 would be '32'\)"):
        restore(tmp_path)
    with pytest.raises(loop.CheckpointError, match="0032 is not a step folder"):
        run_check(tmp_path)


@pytest.mark.parametrize("name", ["\u00b2", "\u2460", "\u0663"])  # superscript two, circled one, Arabic-Indic three
def test_a_step_folder_named_with_another_scripts_digit_is_named(tmp_path, name):
    save_steps(tmp_path, [10])
    (tmp_path / "checkpoints" / name).mkdir()
    with pytest.raises(loop.CheckpointError, match=f"checkpoints/{name} is not a step folder orbax writes"):
        restore(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(loop.TrainConfig().to_json()))
    with pytest.raises(ValueError, match=f"checkpoints/{name} is not a checkpoint step, so --restart deletes nothing"):
        loop._check_run_directory(tmp_path, loop.TrainConfig(), resume=False, restart=True)
