"""The ``jaxbnn`` command line: one argparse subcommand per entry of ``COMMANDS``.

A command is two functions: ``add_arguments(parser)`` (cheap, no heavy imports, so ``--help`` is
fast) and ``run(args) -> int`` (imports what it needs). To add a command, write the pair and register
it in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
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


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="mnist-mlp",
                        help="zoo model: mnist-mlp, mnist-conv, cifar10-vgg, cifar10-resnet14, "
                             "imagenet-alexnet, imagenet-vgg16, imagenet-resnet18 (default mnist-mlp)")
    parser.add_argument("--mode", default="bnn", help="bnn, tnn, tbn, btn or float (default bnn)")
    parser.add_argument("--data", default="mnist5k", help="mnist5k (offline), mnist or cifar10 (default mnist5k)")
    parser.add_argument("--data-dir", help="directory holding the mnist IDX / cifar10 binary files")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-3, help="peak Adam learning rate (cosine decay)")
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--width", type=float, default=1.0, help="channel/width multiplier of the model")
    parser.add_argument("--augment", action=argparse.BooleanOptionalAction, default=None,
                        help="random crop + flip (default: on for cifar10 only)")
    parser.add_argument("--out", required=True, help="run directory: checkpoints, metrics.jsonl, curves.png; "
                                                      "rerunning with the same directory resumes")
    parser.add_argument("--summary", action="store_true", help="print the model summary before training")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _run_train(args: argparse.Namespace) -> int:
    loop = import_train_module("loop")
    if args.epochs < 1 or args.batch_size < 1:
        raise ValueError("--epochs and --batch-size must be positive")
    config = loop.TrainConfig(
        model=args.model, mode=args.mode, data=args.data, data_dir=args.data_dir, epochs=args.epochs,
        batch_size=args.batch_size, learning_rate=args.lr, weight_decay=args.weight_decay, seed=args.seed,
        augment=args.augment, width=args.width,
    )
    if args.summary:
        from jaxbnn.summary import format_summary

        data = import_train_module("data")
        spec = data.DATASETS.get(args.data)
        if spec is None:
            raise ValueError(f"unknown dataset {args.data!r}; known: {sorted(data.DATASETS)}")
        from flax import nnx

        from jaxbnn.models import build_model

        model = nnx.eval_shape(lambda: build_model(args.model, args.mode, input_shape=spec["input_shape"],
                                                   num_classes=spec["num_classes"], width=args.width))
        print(format_summary(model))
    rows = loop.fit(config, args.out, progress=not args.no_progress)
    if rows:
        print(f"final test accuracy {rows[-1]['test_accuracy']:.4f} after epoch {rows[-1]['epoch']}")
    return 0


COMMANDS: dict[str, Command] = {
    "train": Command("train a zoo model (resumes when --out holds a run)", _add_train_arguments, _run_train),
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
