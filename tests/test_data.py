"""Dataset readers on small files written here in the exact on-disk formats, and deterministic batching."""

import gzip
import re
import struct

import numpy as np
import pytest

from jaxbnn.cli import import_train_module

data = import_train_module("data")


def _write_idx(path, array, code=0x08):
    header = struct.pack(">BBBB", 0, 0, code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(payload)


def _fake_mnist(directory, n_train=7, n_test=5, gz=False, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        suffix = ".gz" if gz else ""
        _write_idx(directory / f"{prefix}-images-idx3-ubyte{suffix}", images)
        _write_idx(directory / f"{prefix}-labels-idx1-ubyte{suffix}", labels)
        arrays[prefix] = (images, labels)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx_files_round_trip(tmp_path, gz):
    arrays = _fake_mnist(tmp_path, gz=gz)
    for split, prefix in (("train", "train"), ("test", "t10k")):
        ds = data.load_mnist(tmp_path, split)
        images, labels = arrays[prefix]
        np.testing.assert_array_equal(ds.images[..., 0], images)
        np.testing.assert_array_equal(ds.labels, labels)
        assert ds.images.shape[1:] == (28, 28, 1) and ds.labels.dtype == np.int32


def test_read_idx_other_element_types(tmp_path):
    values = np.arange(-6, 6, dtype=np.int32).reshape(3, 4) * 100000
    _write_idx(tmp_path / "a.idx", values, code=0x0C)
    np.testing.assert_array_equal(data.read_idx(tmp_path / "a.idx"), values)


def test_corrupt_idx_files_are_refused(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x01\x02\x08\x01" + b"\x00" * 8)
    with pytest.raises(ValueError, match="bad magic"):
        data.read_idx(tmp_path / "bad")
    good = np.arange(10, dtype=np.uint8)
    _write_idx(tmp_path / "short", good)
    (tmp_path / "short").write_bytes((tmp_path / "short").read_bytes()[:-1])
    with pytest.raises(ValueError, match="need 10 data bytes"):
        data.read_idx(tmp_path / "short")
    with pytest.raises(FileNotFoundError, match=r"MNIST file train-images-idx3-ubyte\[.gz\] not found in .*; "
                                                 r"--data-dir mnist takes the four IDX files of the MNIST database"):
        data.load_mnist(tmp_path, "train")


def _cut_short(gz: bytes) -> bytes:
    return gz[:len(gz) // 2]


def _reserved_block_type(gz: bytes) -> bytes:
    return gz[:10] + b"\xff" + gz[11:]  # the first deflate block (after the 10-byte header) of a type that is none


def _not_gzip_magic(gz: bytes) -> bytes:
    return b"\x00\x00" + gz[2:]


def _wrong_crc(gz: bytes) -> bytes:
    return gz[:-8] + bytes(4) + gz[-4:]


@pytest.mark.parametrize("damage, reason", [
    (_cut_short, "Compressed file ended before the end-of-stream marker was reached"),
    (_reserved_block_type, "invalid block type"),
    (_not_gzip_magic, "Not a gzipped file"),
    (_wrong_crc, "CRC check failed"),
])
def test_a_damaged_gzip_file_is_refused_by_name(tmp_path, damage, reason):
    _fake_mnist(tmp_path, gz=True)
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    with gzip.open(path, "rb") as f:
        payload = f.read()
    path.write_bytes(damage(gzip.compress(payload, mtime=0)))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: damaged gzip file \(.*{reason}"):
        data.load_mnist(tmp_path, "test")


@pytest.mark.parametrize("name, array, code, message", [
    ("t10k-images-idx3-ubyte", np.full((5, 28, 28), 0.5, np.float32), 0x0D,
     "MNIST images are unsigned bytes (IDX element type 0x08), this file holds float32"),
    ("t10k-images-idx3-ubyte", np.full((5, 28, 28), 300, np.int16), 0x0B,
     "MNIST images are unsigned bytes (IDX element type 0x08), this file holds int16"),
    ("t10k-labels-idx1-ubyte", np.full(5, -1, np.int8), 0x09,
     "MNIST labels are unsigned bytes (IDX element type 0x08), this file holds int8"),
    ("t10k-images-idx3-ubyte", np.zeros((5, 32, 32), np.uint8), 0x08,
     "MNIST images have shape N x 28 x 28, this file holds (5, 32, 32)"),
    ("t10k-labels-idx1-ubyte", np.zeros((5, 1), np.uint8), 0x08,
     "MNIST labels have shape N, this file holds (5, 1)"),
    ("t10k-labels-idx1-ubyte", np.array([0, 1, 200, 3, 4], np.uint8), 0x08, "label 200 out of range 0..9"),
    ("t10k-labels-idx1-ubyte", np.array([0, 1, 10, 3, 4], np.uint8), 0x08, "label 10 out of range 0..9"),
])
def test_mnist_files_that_are_not_mnist_images_and_labels_are_refused_by_name(tmp_path, name, array, code, message):
    _fake_mnist(tmp_path)
    _write_idx(tmp_path / name, array, code=code)
    with pytest.raises(ValueError, match=f"^{re.escape(f'{tmp_path / name}: {message}')}$"):
        data.load_mnist(tmp_path, "test")


def test_an_empty_mnist_split_is_refused_by_name(tmp_path):
    _fake_mnist(tmp_path, n_test=0)
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / 't10k-images-idx3-ubyte'))}: holds no images$"):
        data.load_mnist(tmp_path, "test")
    assert len(data.load_mnist(tmp_path, "train").labels) == 7


def test_mnist_images_and_labels_must_be_as_many(tmp_path):
    _fake_mnist(tmp_path)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(4, np.uint8))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 't10k-images-idx3-ubyte'} holds 5 images but "
                                                   f"{tmp_path / 't10k-labels-idx1-ubyte'} holds 4 labels")):
        data.load_mnist(tmp_path, "test")


def test_a_test_split_reads_only_its_own_files(tmp_path):
    _fake_mnist(tmp_path)
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"):
        (tmp_path / name).unlink()
    assert len(data.load_split("mnist", "test", tmp_path).labels) == 5
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        data.load_split("mnist", "train", tmp_path)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        data.load_split("mnist", "test", tmp_path / "missing")


def _write_cifar(path, images_chw, labels):
    records = np.concatenate([labels[:, None].astype(np.uint8), images_chw.reshape(len(labels), -1)], axis=1)
    records.tofile(path)


def test_cifar10_binary_batches_round_trip(tmp_path):
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    rng = np.random.default_rng(1)
    train_images, train_labels = [], []
    for i in range(1, 6):
        images = rng.integers(0, 256, (3, 3, 32, 32), dtype=np.uint8)
        labels = rng.integers(0, 10, 3, dtype=np.uint8)
        _write_cifar(folder / f"data_batch_{i}.bin", images, labels)
        train_images.append(images)
        train_labels.append(labels)
    test_images = rng.integers(0, 256, (4, 3, 32, 32), dtype=np.uint8)
    test_labels = rng.integers(0, 10, 4, dtype=np.uint8)
    _write_cifar(folder / "test_batch.bin", test_images, test_labels)

    train = data.load_cifar10(tmp_path, "train")  # finds the cifar-10-batches-bin subfolder
    assert train.images.shape == (15, 32, 32, 3)
    np.testing.assert_array_equal(train.images, np.concatenate(train_images).transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(train.labels, np.concatenate(train_labels))
    test = data.load_cifar10(folder, "test")
    assert test.images[2, 5, 7, 1] == test_images[2, 1, 5, 7]  # HWC pixel = CHW pixel
    np.testing.assert_array_equal(test.labels, test_labels)


def test_a_missing_cifar_batch_is_named_with_where_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"CIFAR-10 file test_batch.bin not found in .*; --data-dir cifar10 "
                                                r"takes the 'CIFAR-10 binary version'"):
        data.load_split("cifar10", "test", tmp_path)


def test_truncated_cifar_batch_is_refused(tmp_path):
    np.zeros(3073 * 2 - 5, np.uint8).tofile(tmp_path / "test_batch.bin")
    with pytest.raises(ValueError, match="3073-byte records"):
        data.load_cifar10(tmp_path, "test")


@pytest.mark.mnist5k
@pytest.mark.parametrize("content, message", [
    (None, "damaged gzip file .Compressed file ended"),
    ("1,2,3\n", r"MNIST-5k csv: expected rows of 785 values .784 pixels, label., got \(1, 3\)"),
    (",".join(["300"] * 785) + "\n", "not an MNIST-5k csv of uint8 values"),
    (",".join(["0.5"] * 785) + "\n", "not an MNIST-5k csv of uint8 values"),
    (",".join(["0"] * 785) + "\n", "its 1 rows leave no train images"),
])
def test_a_damaged_mnist5k_file_is_refused_by_name(tmp_path, content, message):
    path = tmp_path / "mnist_5k.csv.gz"
    if content is None:  # a real file cut short
        path.write_bytes(_cut_short(gzip.compress((",".join(["7"] * 785) + "\n").encode() * 50)))
    else:
        path.write_bytes(gzip.compress(content.encode()))
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: .*{message}"):
        data.load_mnist5k("train", path)


def test_mnist5k_split_is_stratified_and_disjoint():
    train, test = data.load_mnist5k("train"), data.load_mnist5k("test")
    assert train.images.shape == (4000, 28, 28, 1) and test.images.shape == (1000, 28, 28, 1)
    np.testing.assert_array_equal(np.bincount(train.labels), [400] * 10)
    np.testing.assert_array_equal(np.bincount(test.labels), [100] * 10)
    train_rows = {img.tobytes() for img in train.images}
    assert not any(img.tobytes() in train_rows for img in test.images)
    assert train.images.max() == 255 and train.images.dtype == np.uint8


@pytest.mark.mnist5k
def test_cifar_shaped_mnist5k_is_read_as_cifar10_with_the_digits_labels(tmp_path):
    """The offline CIFAR-shaped data: CIFAR-10 batches the cifar10 loader reads, one image per MNIST-5k digit
    with its label, the digit's ink brighter than its background, the same bytes for the same seed."""
    folder = data.write_cifar_shaped_mnist5k(tmp_path / "a")
    for split in ("train", "test"):
        cifar, digits = data.load_cifar10(folder, split), data.load_mnist5k(split)
        assert cifar.images.shape == (len(digits.labels), 32, 32, 3) and cifar.images.dtype == np.uint8
        np.testing.assert_array_equal(cifar.labels, digits.labels)
        ink = digits.images[..., 0] > 128
        centre = cifar.images[:, 2:30, 2:30].astype(int).sum(-1)
        assert all(centre[i][ink[i]].mean() > centre[i][~ink[i]].mean() for i in range(0, len(ink), 97))
    again = data.write_cifar_shaped_mnist5k(tmp_path / "b")
    assert (folder / "test_batch.bin").read_bytes() == (again / "test_batch.bin").read_bytes()


def test_batches_are_deterministic_per_seed_and_epoch():
    """The batch order depends only on (seed, epoch); a batch is the dataset's uint8 pixels, unconverted."""
    images = np.arange(50 * 4, dtype=np.uint8).reshape(50, 2, 2, 1)
    ds = data.Dataset(images, np.arange(50, dtype=np.int32), 10)
    order = lambda **kw: np.concatenate([lab for _, lab in data.batches(ds, 8, **kw)])  # noqa: E731
    first = order(seed=3, epoch=1)
    np.testing.assert_array_equal(first, order(seed=3, epoch=1))
    assert not np.array_equal(first, order(seed=3, epoch=2))
    assert not np.array_equal(first, order(seed=4, epoch=1))
    assert len(first) == 48 and len(set(first.tolist())) == 48  # drop_remainder, no repeats
    everything = order(seed=3, epoch=1, drop_remainder=False)
    assert sorted(everything.tolist()) == list(range(50))
    x, y = next(data.batches(ds, 8, seed=0, epoch=0, shuffle=False))
    assert x.dtype == np.uint8  # the pixels the models take, unconverted
    np.testing.assert_array_equal(x, images[:8])
    np.testing.assert_array_equal(y, np.arange(8))


def test_random_crop_flip():
    rng = np.random.default_rng(0)
    images = rng.integers(1, 256, (64, 8, 8, 3), dtype=np.uint8)
    flipped_only = data.random_crop_flip(images, np.random.default_rng(1), pad=0)
    is_same = [np.array_equal(a, b) for a, b in zip(flipped_only, images)]
    is_mirror = [np.array_equal(a, b[:, ::-1]) for a, b in zip(flipped_only, images)]
    assert all(s or m for s, m in zip(is_same, is_mirror)) and 10 < sum(is_mirror) < 54
    cropped = data.random_crop_flip(images, np.random.default_rng(2), pad=2)
    assert cropped.shape == images.shape
    assert np.any(cropped == 0)  # some crops reach into the zero padding


def test_unknown_dataset_and_missing_directory():
    with pytest.raises(ValueError, match="unknown dataset"):
        data.load_dataset("svhn")
    with pytest.raises(ValueError, match="data_dir"):
        data.load_dataset("cifar10")


def test_augmented_batches_stay_uint8_pixels():
    """Augmentation keeps the batches uint8 pixels of the right shape (its padding is pixel 0)."""
    images = np.random.default_rng(0).integers(1, 256, (20, 6, 6, 3), dtype=np.uint8)
    ds = data.Dataset(images, np.arange(20, dtype=np.int32), 10)
    x, _ = next(data.batches(ds, 16, seed=1, epoch=0, augment=True))
    assert x.dtype == np.uint8 and x.shape == (16, 6, 6, 3)
    assert (x == 0).any()



def test_an_idx_file_of_too_many_dimensions_is_refused_naming_it(tmp_path):
    path = tmp_path / "t10k-images-idx3-ubyte"
    path.write_bytes(bytes([0, 0, 0x08, 255]) + bytes(4 * 255))
    with pytest.raises(ValueError, match=f"{path}: an IDX file of 255 dimensions"):
        data.read_idx(path)
