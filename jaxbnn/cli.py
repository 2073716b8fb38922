"""The ``jaxbnn`` command line: one argparse subcommand per entry of ``COMMANDS``.

A command is two functions: ``add_arguments(parser)`` (cheap, no heavy imports, so ``--help`` is
fast) and ``run(args) -> int`` (imports what it needs). To add a command, write the pair and register
it in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from typing import Callable, NamedTuple


class Command(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


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


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="mnist-mlp",
                        help="zoo model: mnist-mlp, mnist-conv, cifar10-vgg, cifar10-resnet14, "
                             "imagenet-alexnet, imagenet-vgg16, imagenet-resnet18 (default mnist-mlp)")
    parser.add_argument("--mode", default="bnn", help="bnn, tnn, tbn, btn or float (default bnn)")
    parser.add_argument("--data", default="mnist5k", help="mnist5k (offline), mnist or cifar10 (default mnist5k)")
    parser.add_argument("--data-dir", help="directory holding the mnist IDX / cifar10 binary files")
    parser.add_argument("--epochs", type=integer_at_least(1), default=10)
    parser.add_argument("--batch-size", type=integer_at_least(1), default=100)
    parser.add_argument("--lr", type=finite_number(positive=True), default=1e-3,
                        help="peak Adam learning rate (cosine decay)")
    parser.add_argument("--weight-decay", type=finite_number(positive=False), default=0.0)
    parser.add_argument("--seed", type=integer_at_least(0), default=0)
    parser.add_argument("--width", type=finite_number(positive=True), default=1.0,
                        help="channel/width multiplier of the model")
    parser.add_argument("--augment", action=argparse.BooleanOptionalAction, default=None,
                        help="random crop + flip (default: on for cifar10 only)")
    parser.add_argument("--out", required=True, help="run directory: checkpoints, metrics.jsonl, curves.png; "
                                                      "rerunning with the same directory resumes")
    parser.add_argument("--checkpoint-every", type=integer_at_least(0), default=0, metavar="STEPS",
                        help="also checkpoint every STEPS steps inside an epoch (default: after each epoch only)")
    parser.add_argument("--summary", action="store_true", help="print the model summary before training")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


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
    rows = loop.fit(config, args.out, progress=not args.no_progress, checkpoint_every=args.checkpoint_every)
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


def _add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_dir", help="training run directory (config.json + Orbax checkpoints)")
    parser.add_argument("output", help="packed checkpoint to write (.jbnn), atomically")
    parser.add_argument("--target", default="cpu", choices=("cpu", "sm90", "sm80"),
                        help="kernel target whose FSB tile the weights are packed for (default cpu)")


def _run_export(args: argparse.Namespace) -> int:
    from jaxbnn import packed_model

    loop = import_train_module("loop")
    export = import_export_package()
    model = loop.load_trained(args.checkpoint_dir)
    packed = export.export_model(model, target=args.target)
    size = packed_model.save(args.output, packed)
    print(f"{model.name} ({model.mode}) -> {args.output} (target {args.target}, tile {packed.tile[0]}x{packed.tile[1]})")
    print(export.format_size_report(export.size_report(model, packed), file_bytes=size))
    return 0


def _add_predict_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("packed", help="packed checkpoint (.jbnn) written by `jaxbnn export`")
    parser.add_argument("--data", default="mnist5k", help="mnist5k (offline), mnist or cifar10 (default mnist5k)")
    parser.add_argument("--data-dir", help="directory holding the mnist IDX / cifar10 binary files")
    parser.add_argument("--batch-size", type=int, default=500, help="images per jitted call (default 500)")


def _run_predict(args: argparse.Namespace) -> int:
    import numpy as np

    from jaxbnn import runtime

    data = import_train_module("data")
    if args.batch_size < 1:
        raise ValueError("--batch-size must be positive")
    net = runtime.load(args.packed)
    _, test = data.load_dataset(args.data, args.data_dir)
    if tuple(test.images.shape[1:]) != net.input_shape:
        raise ValueError(f"{args.packed} takes images of shape {net.input_shape}; {args.data} has "
                         f"{tuple(test.images.shape[1:])}")
    images = data.to_float(test.images)
    predictions = net.predict(images, args.batch_size)
    accuracy = float(np.mean(predictions == test.labels))
    batch = images[: min(args.batch_size, len(images))]
    print(f"{net.graph['name']} ({net.graph['mode']}, target {net.target}) on {args.data} test: "
          f"accuracy {accuracy:.4f} ({len(images)} images)")
    print(f"throughput {net.throughput(batch):,.0f} images/s (batch {len(batch)}, jitted); "
          f"CPU kernels: {_native_kernels()}")
    return 0


def _add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", help="run directory (default: a new temporary directory)")
    parser.add_argument("--epochs", type=int, default=10, help="training epochs on MNIST-5k (default 10)")
    parser.add_argument("--width", type=float, default=1.0, help="width multiplier of the MLP (default 1)")
    parser.add_argument("--seed", type=int, default=0)


def _native_kernels() -> str:
    """One line: which CPU kernels the custom calls run (native, or the pure-JAX reference and why)."""
    import jaxbnn

    status = jaxbnn.native_status().get("cpu", "not registered")
    return f"native ({status})" if "targets" in status else f"pure-JAX reference ({status})"


def _flax_throughput(model, images, repeats: int = 5) -> float:
    """Images per second of the Flax model's jitted eval-mode forward pass."""
    import time

    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    forward(state, images).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        out = forward(state, images)
    out.block_until_ready()
    return repeats * len(images) / (time.perf_counter() - start)


def _run_demo(args: argparse.Namespace) -> int:
    import tempfile
    import time
    from pathlib import Path

    import numpy as np

    from jaxbnn import packed_model, runtime

    loop = import_train_module("loop")
    data = import_train_module("data")
    export = import_export_package()
    if args.epochs < 1:
        raise ValueError("--epochs must be positive")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="jaxbnn-demo-"))
    started = time.perf_counter()
    print(f"1/4 train mnist-mlp (bnn) on MNIST-5k for {args.epochs} epochs -> {out}")
    config = loop.TrainConfig(model="mnist-mlp", mode="bnn", data="mnist5k", epochs=args.epochs,
                              width=args.width, seed=args.seed)
    loop.fit(config, out, progress=False)
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
    images = data.to_float(test.images)
    packed_accuracy = float(np.mean(net.predict(images) == test.labels))

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


COMMANDS: dict[str, Command] = {
    "train": Command("train a zoo model (resumes when --out holds a run)", _add_train_arguments, _run_train),
    "export": Command("export a trained run to a packed checkpoint (.jbnn)", _add_export_arguments, _run_export),
    "predict": Command("accuracy and throughput of a packed checkpoint", _add_predict_arguments, _run_predict),
    "demo": Command("train MNIST-MLP on MNIST-5k, export, load, infer, compare", _add_demo_arguments, _run_demo),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxbnn", description="Binary and ternary neural networks in JAX")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        sub = subparsers.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"jaxbnn {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
