"""Tests for minips.ml.data: real files, formats written by the tests, download, sharding, order."""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import socket
import struct
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minips.errors import ConfigError, DataError
from minips.ml import data, data_files
from minips.ml.data import batch_stream, iterate_batches, shard_indices

FASHION = Path("/usr/share/datasets/fashion-mnist")
needs_fashion = pytest.mark.skipif(not FASHION.is_dir(), reason=f"{FASHION} not installed")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Downloads in these tests never touch the user's ~/.cache."""
    monkeypatch.setenv("MINIPS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MINIPS_DATA_MIRROR", raising=False)


# ---------------------------------------------------------------- helpers writing real formats


def idx_bytes(arr: np.ndarray) -> bytes:
    """An IDX file of unsigned bytes: magic 0 0 8 ndim, big-endian dims, data."""
    head = bytes([0, 0, 8, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return head + arr.astype(np.uint8).tobytes()


def write_mnist(folder: Path, n_train: int = 12, n_test: int = 5, gz: bool = True) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28)).astype(np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        for kind, arr, dim in (("images", images, 3), ("labels", labels, 1)):
            raw = idx_bytes(arr)
            name = f"{prefix}-{kind}-idx{dim}-ubyte"
            if gz:
                (folder / (name + ".gz")).write_bytes(gzip.compress(raw))
            else:
                (folder / name).write_bytes(raw)
        arrays[prefix] = (images, labels)
    return arrays


def cifar_bytes(images: np.ndarray, labels: np.ndarray) -> bytes:
    """CIFAR-10 binary records: label byte then 3072 bytes (R, G, B planes, row-major)."""
    rec = np.concatenate([labels[:, None], images.reshape(len(labels), -1)], axis=1)
    return rec.astype(np.uint8).tobytes()


def write_cifar(folder: Path, per_batch: int = 4) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    out = {}
    for fname in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        images = rng.integers(0, 256, (per_batch, 3, 32, 32)).astype(np.uint8)
        labels = rng.integers(0, 10, per_batch).astype(np.uint8)
        (folder / fname).write_bytes(cifar_bytes(images, labels))
        out[fname] = (images, labels)
    return out


def load_local(name: str, split: str, folder: Path) -> data.Dataset:
    """Only the files already in ``folder``: no download, no synthetic fallback."""
    return data.load_dataset(name, split, folder, download=False, fallback=False)


def truncate(path: Path, nbytes: int) -> None:
    path.write_bytes(path.read_bytes()[:-nbytes])


# ---------------------------------------------------------------- Fashion-MNIST from Debian


@needs_fashion
def test_fashion_mnist_from_debian_path() -> None:
    t0 = time.perf_counter()
    train = data.load_dataset("fashion-mnist", "train", fallback=False)
    elapsed = time.perf_counter() - t0
    test = data.load_dataset("fashion-mnist", "test", fallback=False)
    assert train.x.shape == (60_000, 1, 32, 32) and test.x.shape == (10_000, 1, 32, 32)
    assert train.x.dtype == np.float32 and train.y.dtype == np.int64
    assert train.y.min() == 0 and train.y.max() == 9
    assert np.bincount(train.y).tolist() == [6000] * 10
    assert np.bincount(test.y).tolist() == [1000] * 10
    assert train.meta["synthetic"] is False and train.meta["source"] == str(FASHION)
    assert elapsed < 30.0  # 0.7 s on an idle 2-core machine; only catches pathologies


@needs_fashion
def test_fashion_mnist_normalisation_and_padding() -> None:
    raw = data.load_dataset("fashion-mnist", "test", pad_to=None, fallback=False)
    padded = data.load_dataset("fashion-mnist", "test", fallback=False)
    assert raw.x.shape == (10_000, 1, 28, 28)
    assert abs(float(raw.x.mean())) < 0.05 and abs(float(raw.x.std()) - 1.0) < 0.05
    np.testing.assert_array_equal(padded.x[:, :, 2:30, 2:30], raw.x)
    background = np.float32((0.0 - 0.2860) / 0.3530)
    assert np.all(padded.x[:, :, :2] == background) and np.all(padded.x[:, :, :, 30:] == background)


# ---------------------------------------------------------------- IDX files written here


@pytest.mark.parametrize("gz", [True, False])
def test_idx_files_in_data_dir(tmp_path: Path, gz: bool) -> None:
    arrays = write_mnist(tmp_path, gz=gz)
    ds = load_local("mnist", "train", tmp_path)
    images, labels = arrays["train"]
    assert ds.x.shape == (12, 1, 32, 32)
    np.testing.assert_array_equal(ds.y, labels.astype(np.int64))
    expected = (images[:, None].astype(np.float32) / 255 - 0.1307) / 0.3081
    np.testing.assert_allclose(ds.x[:, :, 2:30, 2:30], expected, rtol=1e-5, atol=1e-5)
    assert ds.meta["source"] == str(tmp_path)


# ---------------------------------------------------------------- the decoded cache


def decoded_files(tmp_path: Path, name: str = "mnist") -> list[str]:
    folder = tmp_path / "cache" / name / "decoded"  # MINIPS_CACHE_DIR (_private_cache)
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_a_second_load_maps_the_decoded_split_the_first_kept(tmp_path: Path) -> None:
    write_mnist(tmp_path / "files")
    first = load_local("mnist", "train", tmp_path / "files")
    kept = decoded_files(tmp_path)
    assert len(kept) == 2 and kept[0].startswith("train-pad32-") and kept[0].endswith(".x.npy")
    again = load_local("mnist", "train", tmp_path / "files")
    np.testing.assert_array_equal(again.x, first.x)  # bit for bit
    np.testing.assert_array_equal(again.y, first.y)
    assert again.x.dtype == np.float32 and again.y.dtype == np.int64
    assert type(again.x) is np.ndarray and again.meta == first.meta
    again.x[0] = 7.0  # copy-on-write: the file keeps what was decoded
    np.testing.assert_array_equal(load_local("mnist", "train", tmp_path / "files").x, first.x)
    assert decoded_files(tmp_path) == kept


def test_changed_files_are_decoded_again_and_replace_the_entry(tmp_path: Path) -> None:
    write_mnist(tmp_path / "files", n_train=12)
    load_local("mnist", "train", tmp_path / "files")
    old = decoded_files(tmp_path)
    arrays = write_mnist(tmp_path / "files", n_train=20)
    ds = load_local("mnist", "train", tmp_path / "files")
    assert len(ds) == 20
    np.testing.assert_array_equal(ds.y, arrays["train"][1].astype(np.int64))
    new = decoded_files(tmp_path)
    assert len(new) == 2 and not set(new) & set(old)  # one entry per split and padding
    load_local("mnist", "test", tmp_path / "files")
    load_local("mnist", "train", tmp_path / "files")  # unpadded: an entry of its own
    data.load_dataset("mnist", "train", tmp_path / "files", download=False, fallback=False,
                      pad_to=None)
    assert len(decoded_files(tmp_path)) == 6 and set(new) <= set(decoded_files(tmp_path))


def test_a_broken_entry_is_decoded_again_and_the_cache_can_be_turned_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    arrays = write_mnist(tmp_path / "files")
    load_local("mnist", "train", tmp_path / "files")
    x_file = next((tmp_path / "cache" / "mnist" / "decoded").glob("*.x.npy"))
    truncate(x_file, 100)
    ds = load_local("mnist", "train", tmp_path / "files")
    np.testing.assert_array_equal(ds.y, arrays["train"][1].astype(np.int64))
    assert x_file.stat().st_size > 12 * 32 * 32 * 4  # written again, whole
    np.testing.assert_array_equal(load_local("mnist", "train", tmp_path / "files").x, ds.x)
    monkeypatch.setenv(data.DECODED_OFF, "0")
    load_local("mnist", "test", tmp_path / "files")
    assert not any(n.startswith("test-") for n in decoded_files(tmp_path))


def test_truncated_gzip_idx_names_the_file(tmp_path: Path) -> None:
    write_mnist(tmp_path)
    truncate(tmp_path / "train-images-idx3-ubyte.gz", 100)
    with pytest.raises(DataError, match="train-images-idx3-ubyte.gz.*(truncated|corrupt)"):
        load_local("mnist", "train", tmp_path)


def test_truncated_raw_idx_says_what_is_wrong(tmp_path: Path) -> None:
    write_mnist(tmp_path, gz=False)
    truncate(tmp_path / "t10k-images-idx3-ubyte", 7)
    with pytest.raises(DataError, match=r"t10k-images-idx3-ubyte: IDX dims \(5, 28, 28\) need"):
        load_local("mnist", "test", tmp_path)


def test_bad_idx_header_and_label_mismatch(tmp_path: Path) -> None:
    bad = tmp_path / "x.idx"
    bad.write_bytes(b"\x00\x00\x0d\x03" + bytes(20))  # float32 element type, not ubyte
    with pytest.raises(DataError, match="not an IDX file"):
        data_files.read_idx(bad, 3)
    write_mnist(tmp_path / "m", gz=False)
    (tmp_path / "m" / "train-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros(11, np.uint8)))
    with pytest.raises(DataError, match="12 images but .* has 11"):
        load_local("mnist", "train", tmp_path / "m")
    labels = np.full(12, 12, np.uint8)  # right count, impossible class
    (tmp_path / "m" / "train-labels-idx1-ubyte").write_bytes(idx_bytes(labels))
    with pytest.raises(DataError, match="train-labels-idx1-ubyte: label 12 outside 0..9"):
        load_local("mnist", "train", tmp_path / "m")


# ---------------------------------------------------------------- CIFAR-10 binary batches


def test_cifar10_binary_batches(tmp_path: Path) -> None:
    batches = write_cifar(tmp_path / data_files.CIFAR_SUBDIR)  # the archive's own folder name
    train = load_local("cifar10", "train", tmp_path)
    test = load_local("cifar10", "test", tmp_path)
    assert train.x.shape == (20, 3, 32, 32) and test.x.shape == (4, 3, 32, 32)
    images, labels = batches["data_batch_2.bin"]
    np.testing.assert_array_equal(train.y[4:8], labels.astype(np.int64))
    mean, std = np.array([0.4914, 0.4822, 0.4465]), np.array([0.2470, 0.2435, 0.2616])
    expected = (images / 255.0 - mean[:, None, None]) / std[:, None, None]  # R plane = channel 0
    np.testing.assert_allclose(train.x[4:8], expected, rtol=1e-5, atol=1e-5)


def test_cifar10_truncated_and_corrupt(tmp_path: Path) -> None:
    write_cifar(tmp_path)
    truncate(tmp_path / "data_batch_3.bin", 1)
    with pytest.raises(DataError, match="data_batch_3.bin: size .* not a positive multiple"):
        load_local("cifar10", "train", tmp_path)
    bad = bytearray((tmp_path / "test_batch.bin").read_bytes())
    bad[0] = 200  # label byte of the first record
    (tmp_path / "test_batch.bin").write_bytes(bytes(bad))
    with pytest.raises(DataError, match="test_batch.bin: label 200"):
        load_local("cifar10", "test", tmp_path)


# ---------------------------------------------------------------- download and verify


def cifar_archive(tmp_path: Path) -> bytes:
    src = tmp_path / "src"
    write_cifar(src / data_files.CIFAR_SUBDIR, per_batch=3)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(src / data_files.CIFAR_SUBDIR, arcname=data_files.CIFAR_SUBDIR)
    return buf.getvalue()


def test_download_verified_cifar_archive(tmp_path: Path, http_dir: tuple[Path, str]) -> None:
    root, url = http_dir
    archive = cifar_archive(tmp_path)
    (root / "cifar-10-binary.tar.gz").write_bytes(archive)
    digest = hashlib.sha256(archive).hexdigest()
    dest = tmp_path / "dl"
    data_files.download("cifar10", dest, mirror=url, checksums={"cifar-10-binary.tar.gz": digest})
    assert not (dest / "cifar-10-binary.tar.gz").exists()  # archive removed once extracted
    ds = load_local("cifar10", "train", dest)
    assert ds.x.shape == (15, 3, 32, 32) and ds.meta["synthetic"] is False


def test_checksum_mismatch_is_refused(tmp_path: Path, http_dir: tuple[Path, str]) -> None:
    root, url = http_dir
    (root / "cifar-10-binary.tar.gz").write_bytes(cifar_archive(tmp_path))  # not the real file
    dest = tmp_path / "dl"
    with pytest.raises(DataError, match="SHA-256 mismatch, file refused"):
        data.load_dataset("cifar10", "train", dest, mirror=url, fallback=False)
    assert not dest.exists() or not any(dest.iterdir())  # nothing kept, not even a .part


def test_corrupt_archive_with_matching_checksum(tmp_path: Path, http_dir: tuple[Path, str]
                                                ) -> None:
    root, url = http_dir
    junk = cifar_archive(tmp_path)[:-5000]  # verified bytes, but a truncated gzip stream
    (root / "cifar-10-binary.tar.gz").write_bytes(junk)
    sums = {"cifar-10-binary.tar.gz": hashlib.sha256(junk).hexdigest()}
    with pytest.raises(DataError, match="cifar-10-binary.tar.gz: corrupt or truncated archive"):
        data_files.download("cifar10", tmp_path / "dl", mirror=url, checksums=sums)


@needs_fashion
def test_download_real_fashion_files_from_loopback(tmp_path: Path, http_dir: tuple[Path, str]
                                                   ) -> None:
    root, url = http_dir
    for f in FASHION.iterdir():  # the real files, so the pinned SHA-256 digests must match
        (root / f.name).write_bytes(f.read_bytes())
    data_files.download("fashion-mnist", tmp_path / "dl", mirror=url)
    ds = data.load_dataset("fashion-mnist", "test", tmp_path / "dl", download=False)
    assert ds.meta["source"] == str(tmp_path / "dl") and np.bincount(ds.y).tolist() == [1000] * 10


def test_unreachable_mirror_message_names_files_and_dir(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port that was free a moment ago: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DataError) as err:
        data.load_dataset("mnist", "test", tmp_path / "d", mirror=f"http://127.0.0.1:{port}/",
                          fallback=False)
    text = str(err.value)
    assert "t10k-images-idx3-ubyte" in text and str(tmp_path / "d") in text
    assert "download from" in text


# ---------------------------------------------------------------- synthetic data


def test_synthetic_fallback_is_loud_and_recorded(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="minips.ml.data"):
        ds = data.load_dataset("cifar10", "test", tmp_path, download=False)
    assert ds.meta["synthetic"] is True and "no test files" in ds.meta["synthetic_reason"]
    assert ds.x.shape == (2000, 3, 32, 32) and ds.x.dtype == np.float32
    assert "SYNTHETIC" in caplog.text and "NO REAL DATA" in caplog.text


def test_synthetic_when_asked() -> None:
    ds = data.load_dataset("fashion-mnist", "train", synthetic=True)
    assert ds.meta["synthetic"] is True and ds.x.shape == (10_000, 1, 32, 32)
    again = data.load_dataset("synthetic", "train")
    np.testing.assert_array_equal(ds.x, again.x)  # deterministic
    with pytest.raises(ConfigError, match="unknown data set"):
        data.load_dataset("imagenet", "train", synthetic=True)


def test_translation_task() -> None:
    train = data.load_dataset("translation", "train")
    test = data.load_dataset("translation", "test")
    assert train.x.shape == (20_000, data.SRC_LEN) and test.y.shape == (2_000, data.TGT_LEN)
    assert not {r.tobytes() for r in train.x} & {r.tobytes() for r in test.x}  # held out
    src, tgt = test.x[0], test.y[0]
    n = int((src != data.PAD).sum())
    assert tgt[0] == data.BOS and tgt[n + 1] == data.EOS and np.all(tgt[n + 2:] == data.PAD)
    # same word -> same translated word, in reversed order
    lexicon: dict[int, int] = {}
    for s_row, t_row in zip(train.x[:500], train.y[:500], strict=True):
        m = int((s_row != data.PAD).sum())
        for a, b in zip(s_row[:m], t_row[m:0:-1], strict=True):
            assert lexicon.setdefault(int(a), int(b)) == int(b)


# ---------------------------------------------------------------- sharding and batch order


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 500), workers=st.integers(1, 9), seed=st.integers(0, 2**31),
       data_weights=st.lists(st.floats(0.1, 10), min_size=9, max_size=9))
def test_shards_are_disjoint_and_cover(n: int, workers: int, seed: int,
                                       data_weights: list[float]) -> None:
    for weights in (None, data_weights[:workers]):
        shards = [shard_indices(n, k, workers, seed, weights) for k in range(workers)]
        joined = np.concatenate(shards)
        assert joined.dtype == np.int64 and np.array_equal(np.sort(joined), np.arange(n))
        again = shard_indices(n, workers - 1, workers, seed, weights)
        np.testing.assert_array_equal(again, shards[-1])


def test_shard_sizes_follow_weights() -> None:
    sizes = [len(shard_indices(1000, k, 3, 7, [1, 2, 1])) for k in range(3)]
    assert sizes == [250, 500, 250]
    equal = [len(shard_indices(60_000, k, 2, 0)) for k in range(2)]
    assert equal == [30_000, 30_000]
    for bad in ([1, 2], [1, 0, 1], [1, float("nan"), 1]):
        with pytest.raises(ConfigError):
            shard_indices(10, 0, 3, 0, bad)
    with pytest.raises(ConfigError):
        shard_indices(10, 3, 3, 0)


def test_batch_order_is_deterministic_per_seed_and_epoch() -> None:
    ds = data.Dataset(np.arange(50, dtype=np.float32)[:, None], np.arange(50, dtype=np.int64))
    shard = shard_indices(50, 1, 2, seed=3)
    one = [y.tolist() for _, y in iterate_batches(ds, shard, 8, seed=3, epoch=0)]
    two = [y.tolist() for _, y in iterate_batches(ds, shard, 8, seed=3, epoch=0)]
    other = [y.tolist() for _, y in iterate_batches(ds, shard, 8, seed=3, epoch=1)]
    assert one == two and one != other
    assert len(one) == 25 // 8 and all(len(b) == 8 for b in one)  # last partial batch dropped
    flat: list[int] = sum(one, [])
    assert len(set(flat)) == len(flat) and set(flat) <= set(shard.tolist())
    order = shard[np.random.default_rng([3, 0]).permutation(25)]  # the documented order
    assert flat == order[:24].tolist()


def test_subset_gives_the_same_batches() -> None:
    ds = data.Dataset(np.arange(90, dtype=np.float32)[:, None], np.arange(90, dtype=np.int64))
    shard = shard_indices(90, 2, 3, seed=1)
    small = ds.subset(shard)
    full = list(iterate_batches(ds, shard, 7, seed=1, epoch=4))
    local = list(iterate_batches(small, np.arange(len(shard)), 7, seed=1, epoch=4))
    assert len(full) == len(local) == 4
    for (xa, ya), (xb, yb) in zip(full, local, strict=True):
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)


def test_batch_stream_moves_through_epochs() -> None:
    ds = data.Dataset(np.zeros((20, 1), np.float32), np.arange(20, dtype=np.int64))
    stream = batch_stream(ds, np.arange(20), 6, seed=0)
    epochs = [next(stream)[0] for _ in range(7)]
    assert epochs == [0, 0, 0, 1, 1, 1, 2]
    with pytest.raises(ConfigError):
        next(batch_stream(ds, np.arange(5), 6, seed=0))


def test_validation_samples_are_held_out_of_every_shard_the_same_for_every_seed() -> None:
    n, val = 1000, 100
    train_ids, val_ids = data.validation_split(n, val)
    assert len(val_ids) == val and not set(train_ids) & set(val_ids)
    assert sorted([*train_ids, *val_ids]) == list(range(n))
    np.testing.assert_array_equal(data.validation_split(n, val)[1], val_ids)  # no seed in it
    for seed in (0, 1):
        shards = [data.shard_indices(n, k, 4, seed, val_size=val) for k in range(4)]
        got = np.concatenate(shards)
        assert len(got) == len(set(got)) == n - val and not set(got) & set(val_ids)
    # without one, the shards are the ones of before (val_size 0 changes nothing)
    np.testing.assert_array_equal(data.shard_indices(n, 2, 4, 7, val_size=0),
                                  np.sort(np.random.default_rng(7).permutation(n)[500:750]))
    with pytest.raises(ConfigError, match="val_size"):
        data.validation_split(n, n)


def test_the_evaluation_set_is_the_test_split_or_the_held_out_validation_samples() -> None:
    test = data.evaluation_set("fashion-mnist", None, synthetic=True, limit=50)
    assert len(test) == 50 and test.meta["split"] == "test"
    train = data.load_dataset("fashion-mnist", "train", synthetic=True)
    val = data.evaluation_set("fashion-mnist", None, val_size=300, synthetic=True)
    assert len(val) == 300 and val.meta["split"] == "validation"
    _, ids = data.validation_split(len(train), 300)
    np.testing.assert_array_equal(val.x, train.x[ids])


def test_a_run_holding_out_validation_samples_has_that_much_shorter_an_epoch() -> None:
    from minips.core.config import RunConfig

    run = RunConfig(dataset="fashion-mnist", epochs=2.0, val_size=5000).validate()
    assert run.epoch_samples() == 55_000 and run.budget_samples() == 110_000
    with pytest.raises(ConfigError, match="val_size"):
        RunConfig(dataset="fashion-mnist", val_size=60_000 - 10, workers=4).validate()
