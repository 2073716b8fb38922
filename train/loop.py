"""The training loop: optax Adam with a cosine learning-rate schedule, latent-weight clipping after each
step, jitted train/eval steps, Orbax checkpoints every epoch (atomic; ``resume=True`` continues a run from
its last one), per-epoch metrics as JSON lines and a PNG of the training curves.

Files in the output directory (``RUN_FILES``, ``checkpoints/`` and ``checkpoints-damaged/``: what
``restart=True`` deletes, and nothing else):

- ``config.json``: the run's TrainConfig, written once the whole configuration has been checked (a
  resumed run must match it, epochs included: the learning rate decays over the run's epochs),
- ``checkpoints/<global step>/``: Orbax checkpoints (model and optimizer state, metrics so far), the
  last two kept,
- ``checkpoints-damaged/``: steps a resume found damaged, set aside for inspection,
- ``metrics.jsonl``: one JSON object per finished epoch,
- ``curves.png``: loss and accuracy per epoch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import numbers
import os
import re
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxbnn.bench import is_out_of_memory
from jaxbnn.layers import clip_latent_weights
from jaxbnn.models import MODEL_BUILDERS, NETWORK_MODES, BinaryNet, build_model, default_rngs

from . import data as data_lib

__all__ = ["TrainConfig", "check_config", "make_optimizer", "train_step", "eval_step", "evaluate", "fit",
           "load_trained"]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: str = "mnist-mlp"
    mode: str = "bnn"
    data: str = "mnist5k"
    data_dir: str | None = None
    epochs: int = 10
    batch_size: int = 100
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0
    augment: bool | None = None  # None: the dataset's default (crop + flip for CIFAR-10)
    width: float = 1.0

    def to_json(self) -> dict:
        """The settings as `config.json` records them: numpy scalars (a sweep's np.int64 epochs, say, which
        `check_config` takes) as the Python numbers they hold."""
        return {name: value.item() if isinstance(value, np.generic) else value
                for name, value in dataclasses.asdict(self).items()}


def _known(kind: str, name, known) -> str:
    """'unknown model 'mnist-cnn'; did you mean 'mnist-conv'? known: ...'"""
    close = difflib.get_close_matches(str(name), list(known), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown {kind} {name!r}; {hint}known: {', '.join(known)}"


def _epochs(count: int) -> str:
    return f"{count} epoch" if count == 1 else f"{count} epochs"


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """An int or float (Python or numpy) that a float holds finite: a config's numbers are JSON numbers."""
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, (bool, np.bool_)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past float's range
        return False


def _json(text: str):
    """json.loads, with a document nested too deeply for the parser's recursion a ValueError like any other
    JSON that cannot be read."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to read") from None


# Width multipliers beyond this build no model that fits in memory (at 64 a hidden layer of the MNIST MLP
# holds 2^32 weights); near 1e308 the channel counts overflow to infinity.
MAX_WIDTH = 64
MAX_SEED = 2**63 - 1  # jax.random.key takes an int64


def check_config(config: TrainConfig, *, reads_data: bool = True) -> None:
    """Raise ValueError naming the first setting of ``config`` that cannot train: an unknown model, mode
    or dataset, a dataset folder that is missing, a value of the wrong type, a number out of range.
    ``fit`` calls it before it writes anything, so a typo leaves no run directory behind. With
    ``reads_data=False`` (``load_trained``, which reads no images) the dataset folder is not looked for."""
    if not isinstance(config.model, str) or config.model not in MODEL_BUILDERS:
        raise ValueError(_known("model", config.model, MODEL_BUILDERS))
    if not isinstance(config.mode, str) or config.mode not in NETWORK_MODES:
        raise ValueError(_known("mode", config.mode, NETWORK_MODES))
    if not isinstance(config.data, str) or config.data not in data_lib.DATASETS:
        raise ValueError(_known("dataset", config.data, data_lib.DATASETS))
    if config.data_dir is not None and not isinstance(config.data_dir, str):
        raise ValueError(f"data_dir must be a folder name or None, got {config.data_dir!r}")
    if reads_data and data_lib.DATASETS[config.data]["needs_dir"]:
        if config.data_dir is None:
            raise ValueError(f"dataset {config.data!r} is read from a local folder: pass it with --data-dir")
        if not Path(config.data_dir).is_dir():
            raise ValueError(f"--data-dir {config.data_dir}: no such folder")
    for name, minimum in (("epochs", 1), ("batch_size", 1), ("seed", 0)):
        value = getattr(config, name)
        if not _is_int(value) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    for name, positive in (("learning_rate", True), ("width", True), ("weight_decay", False)):
        value = getattr(config, name)
        if not _is_number(value) or value < 0 or (positive and value == 0):
            raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    if config.width > MAX_WIDTH:
        raise ValueError(f"width must be at most {MAX_WIDTH}, got {config.width!r}")
    if config.seed > MAX_SEED:
        raise ValueError(f"seed must be at most 2^63 - 1, got {config.seed!r}")
    if config.augment is not None and not isinstance(config.augment, (bool, np.bool_)):
        raise ValueError(f"augment must be true, false or None (the dataset's default), got {config.augment!r}")


def make_optimizer(model: nnx.Module, learning_rate: float, total_steps: int, weight_decay: float = 0.0):
    """Adam (AdamW when weight_decay > 0) with cosine decay to zero: the usual BNN recipe."""
    schedule = optax.cosine_decay_schedule(learning_rate, max(total_steps, 1))
    tx = optax.adamw(schedule, weight_decay=weight_decay) if weight_decay else optax.adam(schedule)
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def _loss(model, images, labels):
    logits = model(images)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, logits


@nnx.jit
def train_step(model: BinaryNet, optimizer: nnx.Optimizer, images, labels):
    """One step on a batch (batch-norm in training mode); returns (loss, accuracy)."""
    (loss, logits), grads = nnx.value_and_grad(_loss, has_aux=True)(model, images, labels)
    optimizer.update(model, grads)
    clip_latent_weights(model)
    return loss, jnp.mean(jnp.argmax(logits, -1) == labels)


@nnx.jit
def eval_step(model: BinaryNet, images, labels, valid):
    """(summed loss, number correct) over the rows where ``valid``; the model must be in eval mode."""
    logits = model(images)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    correct = (jnp.argmax(logits, -1) == labels) & valid
    return jnp.sum(jnp.where(valid, losses, 0.0)), jnp.sum(correct)


def evaluate(model: BinaryNet, dataset: data_lib.Dataset, batch_size: int = 500) -> dict:
    """Test loss and accuracy with batch-norm running statistics (leaves the model in eval mode). The last
    batch is padded (and masked) so every batch has one shape and eval_step compiles once."""
    model.eval()
    total_loss, total_correct, n = 0.0, 0, len(dataset.labels)
    for images, labels in data_lib.batches(dataset, batch_size, seed=0, epoch=0, shuffle=False,
                                           drop_remainder=False):
        count = len(labels)
        valid = np.arange(batch_size) < count
        if count < batch_size:
            images = np.concatenate([images, np.zeros((batch_size - count, *images.shape[1:]), images.dtype)])
            labels = np.concatenate([labels, np.zeros(batch_size - count, labels.dtype)])
        loss, correct = eval_step(model, images, labels, valid)
        total_loss += float(loss)
        total_correct += int(correct)
    return {"loss": total_loss / n, "accuracy": total_correct / n}


# --- files ----------------------------------------------------------------------------------------------


def _replace_from(tmp: Path, path: Path, write) -> None:
    """Write `tmp` by `write(tmp)`, then move it over `path`; a failed write (a full disk) leaves no `tmp`."""
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the write's own error is the one to report
            tmp.unlink(missing_ok=True)
        raise


def _write_atomic(path: Path, text: str) -> None:
    _replace_from(path.with_name(path.name + ".tmp"), path, lambda tmp: tmp.write_text(text))


def _plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] for r in rows]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [r["train_loss"] for r in rows], "o-", label="train")
    ax_loss.plot(epochs, [r["test_loss"] for r in rows], "o-", label="test")
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy", title="loss")
    ax_acc.plot(epochs, [r["train_accuracy"] for r in rows], "o-", label="train")
    ax_acc.plot(epochs, [r["test_accuracy"] for r in rows], "o-", label="test")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    try:
        _replace_from(path.with_name(path.name + ".tmp.png"), path, lambda tmp: fig.savefig(tmp, dpi=100))
    finally:
        plt.close(fig)


# The files a run writes in its directory besides its checkpoint folders, with the temporaries of their
# atomic writes (_write_atomic, _plot); config.json last, so that a restart cut short still finds a run.
RUN_FILES = ("metrics.jsonl", "metrics.jsonl.tmp", "curves.png", "curves.png.tmp.png", "config.json.tmp",
             "config.json")
STEP_NAME = re.compile(r"[0-9]+(\.orbax-checkpoint-tmp.*)?")  # a step, or one orbax was still writing
DAMAGED_STEP_NAME = re.compile(r"[0-9]+(\.[0-9]+)?")  # the names _set_aside gives


def _checkpoint_steps(out_dir: Path) -> list[int]:
    checkpoints = out_dir / "checkpoints"
    if not checkpoints.is_dir():
        return []
    steps = [p for p in checkpoints.iterdir() if p.is_dir() and p.name.isdigit()]
    for path in steps:
        if not path.name.isascii():  # a digit such as "²" that int() does not read
            raise CheckpointError(f"{path} is not a step folder orbax writes; move it out of {checkpoints}")
        if path.is_symlink():  # a link to another step would pass for this one
            raise CheckpointError(f"{path} is a link, not a step folder a run writes; move it out of {checkpoints}")
        if path.name != str(int(path.name)):  # orbax takes "0032" for step 32, then opens "32"
            raise CheckpointError(f"{path} is not a step folder orbax writes (step {int(path.name)} would be "
                                  f"'{int(path.name)}'); move it out of {checkpoints}")
    return sorted(int(p.name) for p in steps)


def _read_config(config_path: Path) -> dict:
    if not config_path.is_file():  # a FIFO would block the read
        raise ValueError(f"{config_path} is not a file; use a new --out directory")
    try:
        previous = _json(config_path.read_text())
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{config_path} is not valid JSON ({error}); use a new --out directory") from None
    if not isinstance(previous, dict):
        raise ValueError(f"{config_path} is not a training configuration; use a new --out directory")
    return previous


def _epochs_done(out_dir: Path) -> list[dict]:
    """The metrics rows of a run directory as far as they can be read (for messages only: a resume
    rebuilds metrics.jsonl from its checkpoint)."""
    metrics = out_dir / "metrics.jsonl"
    if not metrics.is_file():  # missing, or a FIFO that would block the read
        return []
    try:
        rows = [_json(line) for line in metrics.read_text().splitlines() if line]
    except (OSError, UnicodeDecodeError, ValueError):
        return []
    return rows if all(isinstance(row, dict) for row in rows) else []


def _check_run_directory(out_dir: Path, config: TrainConfig, *, resume: bool, restart: bool) -> list[Path]:
    """Check that ``fit`` may train ``config`` in ``out_dir`` as asked, before anything is written: with
    neither ``resume`` nor ``restart``, a directory holding a run with checkpoints is refused; ``resume``
    needs a run with ``config``'s settings; ``restart`` needs a directory that holds a run (or nothing).
    Returns what ``restart`` deletes: the run's files and checkpoint folders (empty otherwise)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file, not a run directory")
    unreadable = sorted(set("[]\\") & set(str(out_dir.absolute())))
    if unreadable:  # orbax finds a step's data with a glob under the run's path: "[1]" would match "1", not "[1]"
        raise ValueError(f"--out {out_dir}: a path with {' or '.join(unreadable)} in it holds checkpoints orbax "
                         "cannot read back (it globs under it); use another --out directory")
    for name in ("checkpoints", "checkpoints-damaged"):
        if (out_dir / name).exists() and not (out_dir / name).is_dir():
            raise ValueError(f"{out_dir / name} is not a folder: a run keeps its checkpoints there; move it away, "
                             "or use a new --out directory")
    for name in RUN_FILES:  # a folder (or a FIFO) there would stop the run at its first write of it
        if (out_dir / name).exists() and not (out_dir / name).is_file():
            raise ValueError(f"{out_dir / name} is not a file: a run writes its {name} there; move it away, or use "
                             "a new --out directory")
    config_path = out_dir / "config.json"
    has_config = config_path.is_file()
    if restart:
        if not has_config:
            if out_dir.is_dir() and any(out_dir.iterdir()):
                raise ValueError(f"{out_dir} holds no jaxbnn run (no config.json), so --restart deletes nothing in "
                                 "it: name a run directory, or a new or empty --out directory")
            return []
        try:
            previous = _read_config(config_path)
        except ValueError as error:
            raise ValueError(f"{out_dir} does not look like a jaxbnn run ({error}), so --restart deletes nothing "
                             "in it") from None
        unknown = sorted(set(previous) - set(TrainConfig.__dataclass_fields__))
        if unknown or not {"model", "mode", "data"} <= set(previous):
            raise ValueError(f"{out_dir} does not look like a jaxbnn run ({config_path} is not a training "
                             f"configuration: keys {sorted(previous)}), so --restart deletes nothing in it; use a "
                             "new --out directory")
        return _run_paths(out_dir)
    steps = _checkpoint_steps(out_dir)
    if not has_config:
        if resume:
            where = "does not exist" if not out_dir.exists() else "holds no run (no config.json)"
            raise ValueError(f"nothing to resume: {out_dir} {where}; drop --resume to start a run there")
        if steps:  # checkpoints without their configuration: neither resumed nor overwritten silently
            raise ValueError(f"{out_dir} holds checkpoints but no config.json; use a new --out directory")
        return []
    previous = _read_config(config_path)
    wanted = config.to_json()
    changed = sorted(k for k in set(previous) | set(wanted) if previous.get(k) != wanted.get(k))
    if changed == ["epochs"]:
        raise ValueError(
            f"{out_dir} holds a run of {_epochs(previous['epochs'])}, not {config.epochs}: its learning rate "
            f"decays to zero over {_epochs(previous['epochs'])}, so it cannot be stretched. Continue it with "
            f"--epochs {previous['epochs']} --resume, or train {_epochs(config.epochs)} in a new --out directory "
            "(or here with --restart, which deletes this run)")
    if changed:
        differences = ", ".join(f"{k} {previous.get(k)!r} (now {wanted.get(k)!r})" for k in changed)
        raise ValueError(f"{out_dir} holds a run with a different configuration: {differences}; use a new "
                         "--out directory, --restart to delete this run and start over, or the run's settings "
                         "with --resume to continue it")
    damaged = out_dir / "checkpoints-damaged"
    if not steps and damaged.is_dir() and any(damaged.iterdir()):
        raise ValueError(f"{out_dir} holds a run whose every checkpoint was found damaged and set aside in {damaged}: "
                         "nothing to resume, and starting over here would drop its history silently; --restart "
                         "deletes the run and trains again (or use a new --out directory)")
    if steps and not resume:
        rows = _epochs_done(out_dir)
        if len(rows) >= config.epochs:
            raise ValueError(f"{_finished_message(out_dir, config, rows)}; --restart deletes it and trains again")
        raise ValueError(f"{out_dir} holds a run ({len(rows)}/{config.epochs} epochs done, last checkpoint at step "
                         f"{steps[-1]}): pass --resume to continue it, or --restart to delete it and start over")
    return []


def _run_paths(out_dir: Path) -> list[Path]:
    """The checkpoint folders and files a run wrote in ``out_dir``, in the order to delete them; raises
    ValueError naming an entry of a checkpoint folder that no run writes (nothing is deleted then)."""
    paths = []
    for name, pattern in (("checkpoints", STEP_NAME), ("checkpoints-damaged", DAMAGED_STEP_NAME)):
        folder = out_dir / name
        if not folder.exists() and not folder.is_symlink():
            continue
        if folder.is_symlink() or not folder.is_dir():
            raise ValueError(f"{folder} is not the folder a run writes, so --restart deletes nothing; move it "
                             "away, or use a new --out directory")
        for entry in folder.iterdir():
            if entry.is_symlink() or not entry.is_dir() or not pattern.fullmatch(entry.name):
                raise ValueError(f"{entry} is not a checkpoint step, so --restart deletes nothing; move it out of "
                                 f"{folder}, or use a new --out directory")
        paths.append(folder)
    return paths + [out_dir / name for name in RUN_FILES if (out_dir / name).is_file()]


def _delete(paths: list[Path]) -> None:
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def _start_run(out_dir: Path, config: TrainConfig) -> None:
    """Create the run directory with its config.json (a checked run that has one keeps it)."""
    config_path = out_dir / "config.json"
    if not config_path.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(config_path, json.dumps(config.to_json(), indent=2) + "\n")


def _checkpoint_manager(out_dir: Path):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True, enable_async_checkpointing=False)
    return ocp.CheckpointManager((out_dir / "checkpoints").absolute(), options=options)


def _build(config: TrainConfig, input_shape, num_classes) -> BinaryNet:
    return build_model(config.model, config.mode, input_shape=tuple(input_shape), num_classes=num_classes,
                       width=config.width, rngs=default_rngs(config.seed))


class CheckpointError(ValueError):
    """No checkpoint of a run directory can be resumed from: each one is named with what is wrong with it."""


CHECKSUMS = "jaxbnn-checksums.json"  # in each step directory: sha256 of every file orbax wrote there


def _save(manager, step: int, model, optimizer, progress: dict) -> None:
    """One checkpoint: model + optimizer state, and (as JSON) the metrics rows and the running sums of
    the epoch in progress. Orbax writes it to a temporary directory and renames it when complete; then the
    checksums of its files are written beside them (atomically), which a resume verifies."""
    import orbax.checkpoint as ocp

    state = {"model": nnx.to_pure_dict(nnx.state(model)), "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                               progress=ocp.args.JsonSave(progress)))
    manager.wait_until_finished()
    step_dir = Path(manager.directory) / str(step)
    _write_atomic(step_dir / CHECKSUMS, json.dumps({"sha256": _file_digests(step_dir)}, indent=1) + "\n")


def _file_digests(step_dir: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under a step directory, the checksum file excepted."""
    import hashlib

    digests = {}
    for path in sorted(step_dir.rglob("*")):
        if path.is_file() and path.name != CHECKSUMS:
            digest = hashlib.sha256()
            with path.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            digests[path.relative_to(step_dir).as_posix()] = digest.hexdigest()
    return digests


def _step_problem(step_dir: Path) -> str | None:
    """What is wrong with a step directory's files, or None when they are the ones its checksums record."""
    record = step_dir / CHECKSUMS
    if not any(step_dir.iterdir()):
        return "the directory is empty"
    if not record.is_file():
        return f"it has no {CHECKSUMS} (its write was interrupted)"
    try:
        recorded = _json(record.read_text())["sha256"]
        if not isinstance(recorded, dict):
            raise TypeError("not a mapping")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        return f"{record.name} is unreadable ({error})"
    actual = _file_digests(step_dir)
    for name in sorted(set(recorded) | set(actual)):
        if name not in actual:
            return f"{name} is missing"
        if name not in recorded:
            return f"{name} was not part of the checkpoint"
        if recorded[name] != actual[name]:
            return f"{name} does not match its checksum (corrupted)"
    return None


def _set_aside(step_dir: Path, damaged_dir: Path) -> Path:
    """Move a damaged step out of orbax's directory (kept for inspection; orbax would otherwise count it as
    the latest step and skip saving the steps before it)."""
    damaged_dir.mkdir(exist_ok=True)
    target = damaged_dir / step_dir.name
    index = 1
    while target.exists():
        target = damaged_dir / f"{step_dir.name}.{index}"
        index += 1
    os.replace(step_dir, target)
    return target


def _restore(out_dir: Path, model, optimizer, log=print, set_aside=True) -> tuple[int, dict]:
    """Load the newest checkpoint of a run directory whose files match their checksums into model and
    optimizer; returns (global step, progress), (0, {}) when there is none.

    Every step is verified before orbax reads any of it (a CheckpointManager parses each step's metadata
    when it is created, and some corruptions of it raise there). A damaged step is reported by name and,
    for a run that goes on, set aside in ``checkpoints-damaged/``, so that the manager created after this
    sees good steps only (a reader such as export passes ``set_aside=False`` and leaves the directory as
    it is); the newest good step is restored, an older one where orbax cannot read it. When steps exist
    but none can be restored, raises CheckpointError naming each one and what is wrong with it."""
    import orbax.checkpoint as ocp

    checkpoints = (Path(out_dir) / "checkpoints").absolute()
    damaged_dir = checkpoints.parent / "checkpoints-damaged"
    steps = _checkpoint_steps(checkpoints.parent)[::-1]
    problems = []

    def damaged(step, problem):
        step_dir = checkpoints / str(step)
        problems.append(f"step {step} ({step_dir}): {problem}")
        moved = f"moved to {_set_aside(step_dir, damaged_dir)}, " if set_aside else ""
        log(f"checkpoint step {step} is damaged: {problem}; {moved}trying the previous step")

    good = []
    for step in steps:
        problem = _step_problem(checkpoints / str(step))
        if problem is None:
            good.append(step)
        else:
            damaged(step, problem)
    target = {"model": nnx.to_pure_dict(nnx.state(model)), "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.asarray(a).dtype), target)
    for step in good:
        try:
            with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
                restored = checkpointer.restore(checkpoints / str(step), args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), progress=ocp.args.JsonRestore()))
            progress = dict(restored.progress)
        except Exception as error:  # noqa: BLE001 - any failure of this step: report it, try the next
            if is_out_of_memory(error):  # the machine's limit, not the step's: setting it aside would lose it
                raise
            damaged(step, f"orbax could not restore it ({type(error).__name__}: {str(error).splitlines()[0]})")
            continue
        nnx.update(model, _as_state(model, restored.state["model"]))
        nnx.update(optimizer, _as_state(optimizer, restored.state["optimizer"]))
        return step, progress
    if problems:
        where = f" The damaged steps are in {damaged_dir};" if set_aside else ""
        raise CheckpointError(f"no checkpoint in {checkpoints} can be resumed from: " + "; ".join(problems)
                              + f".{where} to start over, use --restart or a new --out directory")
    return 0, {}


def _check_finite(model, loss: float, epoch: int, step: int) -> None:
    """Stop a run whose loss or parameters (batch-norm statistics included) are no longer finite before it saves
    them: a resume or an export would take a diverged state for the run's latest. The loss is one update behind
    the parameters, so both are checked."""
    finite = math.isfinite(loss) and all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(nnx.state(model))
                                         if jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.inexact))
    if not finite:
        raise FloatingPointError(f"training diverged at epoch {epoch}, by step {step} (loss {loss}); the checkpoints "
                                 "kept are from before it")


def _as_state(module, pure):
    state = nnx.state(module)
    nnx.replace_by_pure_dict(state, pure)
    return state


def fit(config: TrainConfig, out_dir: str | os.PathLike, *, resume: bool = False, restart: bool = False,
        progress: bool = True, checkpoint_every: int = 0, log=print) -> list[dict]:
    """Train a run in ``out_dir``; returns the metrics of every epoch so far.

    A directory that holds a run with checkpoints is refused unless ``resume`` (continue it from its last
    checkpoint, at the exact batch where it stopped: batch order depends only on seed and epoch, so the
    metrics are those of an uninterrupted run) or ``restart`` (delete the run's files and start over).
    A checkpoint is written after every epoch and, with ``checkpoint_every`` > 0, every that many steps
    inside an epoch.
    """
    from tqdm.auto import tqdm

    from jaxbnn.bench import describe_device

    out_dir = Path(out_dir)
    check_config(config)
    if not _is_int(checkpoint_every) or checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be an integer >= 0 (0: after each epoch only), "
                         f"got {checkpoint_every!r}")
    if resume and restart:
        raise ValueError("resume and restart exclude each other: resume continues the run in out_dir, restart "
                         "deletes it")
    run_paths = _check_run_directory(out_dir, config, resume=resume, restart=restart)
    train_set, test_set = data_lib.load_dataset(config.data, config.data_dir)
    if len(train_set.labels) < config.batch_size:
        raise ValueError(f"batch size {config.batch_size} exceeds the {len(train_set.labels)} training images")
    augment = data_lib.DATASETS[config.data]["augment"] if config.augment is None else config.augment
    model = _build(config, train_set.images.shape[1:], train_set.num_classes)
    steps_per_epoch = len(train_set.labels) // config.batch_size
    optimizer = make_optimizer(model, config.learning_rate, steps_per_epoch * config.epochs, config.weight_decay)
    # the first write: everything above has been checked (and allocated: a model too large fails here)
    if run_paths:
        _delete(run_paths)
        log(f"deleted the run in {out_dir}: {', '.join(p.name for p in run_paths)}")
    _start_run(out_dir, config)

    global_step, saved = _restore(out_dir, model, optimizer, log=log)  # before the manager reads any step
    manager = _checkpoint_manager(out_dir)
    rows = saved.get("rows", [])
    partial = saved.get("partial", {"loss_sum": 0.0, "accuracy_sum": 0.0, "seconds": 0.0})
    metrics_path = out_dir / "metrics.jsonl"
    _write_atomic(metrics_path, "".join(json.dumps(r) + "\n" for r in rows))
    first_epoch, skip = divmod(global_step, steps_per_epoch)
    if first_epoch >= config.epochs:
        log(_finished_message(out_dir, config, rows))
        manager.close()
        return rows
    if global_step:
        log(f"resumed from step {global_step} (epoch {first_epoch + 1}, batch {skip}) in {out_dir}")
    elif resume:
        log(f"{out_dir} has no checkpoint yet: training from the first step")
    log(f"training on {describe_device(jax.devices()[0])}")

    for epoch in range(first_epoch + 1, config.epochs + 1):
        started = time.perf_counter() - partial["seconds"]
        model.train()
        loss_sum, accuracy_sum = jnp.float32(partial["loss_sum"]), jnp.float32(partial["accuracy_sum"])
        batches = data_lib.batches(train_set, config.batch_size, seed=config.seed, epoch=epoch, augment=augment)
        # disable=None: no bar when stderr is not a terminal (a log file would fill with redrawn frames).
        # The bar counts images (a unit_scale of 1 would mean SI prefixes to tqdm): its rate is images/s.
        bar = tqdm(batches, total=steps_per_epoch, initial=skip, desc=f"epoch {epoch}/{config.epochs}",
                   unit=" images", unit_scale=config.batch_size if config.batch_size > 1 else False,
                   disable=None if progress else True, leave=False)
        steps_timed, timing_from = 0, time.perf_counter()
        for index, (images, labels) in enumerate(bar):
            if index < skip:
                timing_from = time.perf_counter()
                continue  # done before the interruption; iterated so augmentation draws stay in step
            loss, accuracy = train_step(model, optimizer, images, labels)
            loss_sum, accuracy_sum = loss_sum + loss, accuracy_sum + accuracy
            global_step += 1
            steps_timed += 1
            if progress and index % 10 == 0:
                bar.set_postfix(loss=f"{float(loss):.3f}")
            if checkpoint_every and global_step % checkpoint_every == 0 and index + 1 < steps_per_epoch:
                partial = {"loss_sum": float(loss_sum), "accuracy_sum": float(accuracy_sum),
                           "seconds": time.perf_counter() - started}
                _check_finite(model, partial["loss_sum"] / (index + 1), epoch, global_step)
                _save(manager, global_step, model, optimizer, {"rows": rows, "partial": partial})
                log(f"checkpoint at step {global_step}")
        skip = 0
        partial = {"loss_sum": 0.0, "accuracy_sum": 0.0, "seconds": 0.0}
        train_loss = float(loss_sum) / steps_per_epoch  # waits for the epoch's last step
        images_per_second = steps_timed * config.batch_size / (time.perf_counter() - timing_from)
        _check_finite(model, train_loss, epoch, global_step)
        test = evaluate(model, test_set)
        row = {
            "epoch": epoch,
            "train_loss": train_loss,
            "train_accuracy": float(accuracy_sum) / steps_per_epoch,
            "test_loss": test["loss"],
            "test_accuracy": test["accuracy"],
            "seconds": round(time.perf_counter() - started, 3),
        }
        rows.append(row)
        # The checkpoint holds the rows too, so metrics.jsonl can always be rebuilt from it on resume.
        _save(manager, global_step, model, optimizer, {"rows": rows, "partial": partial})
        with metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        _plot(rows, out_dir / "curves.png", f"{config.model} ({config.mode}) on {config.data}")
        log(f"epoch {epoch}: train loss {row['train_loss']:.4f} acc {row['train_accuracy']:.4f} | "
            f"test loss {row['test_loss']:.4f} acc {row['test_accuracy']:.4f} | {row['seconds']:.1f}s "
            f"(training {images_per_second:,.0f} images/s)")
    manager.close()
    return rows


def _finished_message(out_dir: Path, config: TrainConfig, rows: list[dict]) -> str:
    last = rows[-1].get("test_accuracy") if rows else None
    accuracy = f", test accuracy {last:.4f}" if _is_number(last) else ""
    return (f"{out_dir} holds a finished run ({config.epochs}/{config.epochs} epochs{accuracy}): nothing to "
            "train. To train longer, start a new run with a larger --epochs in a new --out directory (the "
            "learning rate decays to zero over a run's epochs); to use this one: jaxbnn export "
            f"{out_dir} MODEL.jbnn")


def load_trained(out_dir: str | os.PathLike) -> BinaryNet:
    """Rebuild the model of a run directory and load its latest checkpoint (for export and prediction)."""
    out_dir = Path(out_dir)
    config_path = out_dir / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{out_dir} is not a training run directory (no config.json)")
    if not config_path.is_file():  # a FIFO would block the read
        raise ValueError(f"{config_path} is not a training configuration (not a file)")
    try:
        config = TrainConfig(**_json(config_path.read_text()))
        check_config(config, reads_data=False)
    except (UnicodeDecodeError, ValueError, TypeError) as error:  # not JSON, not a TrainConfig's fields or values
        raise ValueError(f"{config_path} is not a training configuration ({error})") from None
    spec = data_lib.DATASETS[config.data]
    model = _build(config, spec["input_shape"], spec["num_classes"])
    optimizer = make_optimizer(model, config.learning_rate, 1, config.weight_decay)
    if _restore(out_dir, model, optimizer, set_aside=False)[0] == 0:
        raise FileNotFoundError(f"{out_dir} has no checkpoint")
    model.eval()
    return model
