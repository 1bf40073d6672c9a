"""Data sets for workers: generated data, sharding and batch order, and the loader of real sets.

The file holds, in order:

- Generated data: the stand-in images and the seq2seq translation task. Nothing there reads
  files. ``make_synthetic_images`` is the last-resort stand-in for a real image set (the loader
  announces it loudly when used); ``make_translation`` generates the toy translation task on
  which the seq2seq model is trained, since no translation corpus is available offline.
- Sharding and batch order: which samples a worker trains on, and in which order
  (``shard_indices``, ``num_batches``, ``iterate_batches``, ``batch_stream``).
- ``Dataset`` and ``load_dataset``, the loader of real sets. The real sets' files (specs,
  readers, search, download and its verification) are in data_files.py, which it calls.

Real sets: MNIST and Fashion-MNIST from IDX files (gzip or raw), CIFAR-10 from its binary batches.
Files are looked for in ``data_dir`` (when given), then ``~/.cache/minips/<name>`` (or
``$MINIPS_CACHE_DIR/<name>``), then system directories (Fashion-MNIST: Debian's
/usr/share/datasets/fashion-mnist). Missing files are downloaded (from the official URL, or from
``mirror=`` / ``$MINIPS_DATA_MIRROR``) into ``data_dir`` (or the cache) and refused unless their
SHA-256 matches the pinned digest. A decoded split (normalised float32, as ``Dataset.x``) is
kept under ``<cache>/<name>/decoded`` and mapped by the next loader of the same files (the
decoded cache, below; ``MINIPS_DECODED_CACHE=0`` turns it off). If no real data can be had, a
synthetic stand-in of the same shape is returned, announced with a WARNING and recorded in
``meta["synthetic"]``; ``synthetic=True`` asks for it directly.

Invariants:
- ``Dataset.x`` is float32 (N, C, H, W), normalised per channel as ``(pixel/255 - mean) / std``;
  ``Dataset.y`` is int64 (N,). 28x28 sets are zero-padded (pixel 0, before normalising) to
  ``pad_to`` = 32 by default, the input LeNet-5 expects; ``pad_to=None`` keeps 28x28.
- The "translation" set (the seq2seq task, generated in code) is the one exception:
  ``x`` int64 (N, SRC_LEN) source tokens, ``y`` int64 (N, TGT_LEN) target tokens, see below.
- Shards from ``shard_indices`` are disjoint, cover 0..n-1 (less the validation samples of
  ``validation_split``, when some are held out) and depend only on their arguments.
- ``iterate_batches(ds, idx, b, seed, epoch)`` permutes the shard ``idx`` with
  ``numpy.random.default_rng([seed, epoch])`` and yields consecutive slices of ``b`` samples,
  dropping the last partial batch, so every step sees exactly ``b`` samples. A worker's step k
  uses its own epoch-local stream: epoch 0's batches, then epoch 1's, ... (``batch_stream``).
  The reference loop (reference.py) and the worker (worker.py) both call these, which is what
  makes a 1-worker BSP run through minips equal to the single-process loop.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from minips.errors import ConfigError, DataError
from minips.ml import data_files

__all__ = [
    "make_synthetic_images",
    "make_translation",
    "PAD",
    "BOS",
    "EOS",
    "WORDS",
    "VOCAB",
    "SRC_LEN",
    "TGT_LEN",
    "shard_indices",
    "validation_split",
    "evaluation_set",
    "VAL_SEED",
    "num_batches",
    "iterate_batches",
    "BatchCursor",
    "batch_stream",
    "Dataset",
    "load_dataset",
    "DECODED_VERSION",
    "DECODED_OFF",
]


# -- generated data: the stand-in images and the seq2seq translation task --------------------------

def make_synthetic_images(n: int, shape: tuple[int, int, int], num_classes: int = 10,
                          seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Learnable stand-in images: a fixed smooth template per class plus noise.

    Returns (x (n, C, H, W) float32, roughly zero mean / unit variance, y (n,) int64).
    Templates depend only on ``shape`` and ``num_classes``; ``seed`` picks the samples.
    """
    c, h, w = shape
    trng = np.random.default_rng(12345)
    coarse = trng.standard_normal((num_classes, c, 4, 4)).astype(np.float32)
    # nearest-neighbour upsampling of a 4x4 pattern -> smooth (num_classes, C, H, W) templates
    rows, cols = np.arange(h) * 4 // h, np.arange(w) * 4 // w
    templates = coarse[:, :, rows][:, :, :, cols]
    rng = np.random.default_rng(seed)
    y = rng.integers(0, num_classes, n).astype(np.int64)
    x = templates[y] + 1.5 * rng.standard_normal((n, c, h, w), dtype=np.float32)
    return x / np.float32(1.8), y


# The seq2seq task. Source sentences are 3..SRC_LEN words over WORDS word ids; the
# "translation" maps each word through a fixed bijection and reverses the word order, so the
# decoder must attend to a position that moves with every output step.
PAD, BOS, EOS = 0, 1, 2  # token ids shared by both vocabularies
WORDS = 24  # word ids are 3 .. 3 + WORDS - 1
VOCAB = 3 + WORDS  # size of the source and of the target vocabulary
SRC_LEN, TGT_LEN = 10, 12  # padded lengths; target = BOS + up to 10 words + EOS


def make_translation(n: int, seed: int, exclude: set[bytes] | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """``n`` sentence pairs -> (src (n, SRC_LEN) int64, tgt (n, TGT_LEN) int64), PAD-padded.

    Pairs whose source is in ``exclude`` (``src_row.tobytes()``) are skipped, which keeps the
    test split disjoint from the training split.
    """
    lexicon = 3 + np.random.default_rng(777).permutation(WORDS)  # word id -> target word id
    rng = np.random.default_rng(seed)
    src = np.zeros((n, SRC_LEN), np.int64)
    tgt = np.zeros((n, TGT_LEN), np.int64)
    i = 0
    while i < n:
        length = int(rng.integers(3, SRC_LEN + 1))
        words = rng.integers(0, WORDS, length)
        src[i, :length] = 3 + words
        if exclude is not None and src[i].tobytes() in exclude:
            src[i] = PAD
            continue
        tgt[i, 0], tgt[i, 1:length + 1], tgt[i, length + 1] = BOS, lexicon[words[::-1]], EOS
        i += 1
    return src, tgt


# -- sharding and batch order: which samples a worker trains on, in which order --------------------

def _shard_bounds(n: int, num_workers: int, weights: Sequence[float] | None) -> np.ndarray:
    """(num_workers + 1,) int64 cut points 0 = b0 <= b1 <= ... = n, sized by ``weights``."""
    w = np.ones(num_workers) if weights is None else np.asarray(weights, np.float64)
    if w.shape != (num_workers,) or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ConfigError(f"weights must be {num_workers} positive numbers, got {weights!r}")
    cuts = np.rint(np.cumsum(w) / w.sum() * n).astype(np.int64)
    return np.concatenate([[0], cuts[:-1], [n]])


VAL_SEED = 0x5EED_0A1  # the validation samples depend on this alone: the same for every run seed


def validation_split(n: int, val_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(training ids, validation ids) of samples 0..n-1, each sorted int64: the last
    ``val_size`` of one fixed permutation (``VAL_SEED``) are held out. The same for every run
    seed and worker count, so runs tuned on it compare; ``val_size`` 0 holds nothing out."""
    if not 0 <= val_size < n:
        raise ConfigError(f"val_size {val_size} not in 0..{n - 1}")
    perm = np.random.default_rng(VAL_SEED).permutation(n)
    cut = n - val_size
    return np.sort(perm[:cut]).astype(np.int64), np.sort(perm[cut:]).astype(np.int64)


def shard_indices(n: int, worker_id: int, num_workers: int, seed: int,
                  weights: Sequence[float] | None = None, val_size: int = 0) -> np.ndarray:
    """Worker ``worker_id``'s shard of samples 0..n-1 -> (m,) int64, sorted.

    One permutation from ``seed`` is cut into ``num_workers`` consecutive pieces, piece sizes
    proportional to ``weights`` (e.g. measured speeds; equal when None), so shards are disjoint
    and together cover every sample, less the ``val_size`` held out (``validation_split``;
    with 0, the permutation of 0..n-1 itself, as before there was one).
    """
    if not 0 <= worker_id < num_workers:
        raise ConfigError(f"worker_id {worker_id} not in 0..{num_workers - 1}")
    rng = np.random.default_rng(seed)
    if val_size:
        pool = validation_split(n, val_size)[0]
        perm = pool[rng.permutation(len(pool))]
    else:
        perm = rng.permutation(n)
    bounds = _shard_bounds(len(perm), num_workers, weights)
    return np.sort(perm[bounds[worker_id]:bounds[worker_id + 1]]).astype(np.int64)


def num_batches(shard_size: int, batch_size: int) -> int:
    """Batches per epoch of a shard (the last partial batch is dropped)."""
    return shard_size // batch_size


def iterate_batches(ds: Any, indices: np.ndarray, batch_size: int, seed: int, epoch: int
                    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (x (b, ...) , y (b, ...)) batches of one epoch over ``indices``, in a fixed order.

    The order is ``indices[default_rng([seed, epoch]).permutation(len(indices))]`` cut into
    consecutive slices of ``batch_size``; the last partial slice is dropped.
    """
    if batch_size <= 0:
        raise ConfigError(f"batch_size must be positive, got {batch_size}")
    order = indices[np.random.default_rng([seed, epoch]).permutation(len(indices))]
    for start in range(0, num_batches(len(order), batch_size) * batch_size, batch_size):
        idx = order[start:start + batch_size]  # (b,) int64
        yield ds.x[idx], ds.y[idx]


def batch_stream(ds: Any, indices: np.ndarray, batch_size: int, seed: int,
                 start_epoch: int = 0) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Endless (epoch, x, y): epoch ``start_epoch``'s batches, then the next epoch's, ..."""
    if num_batches(len(indices), batch_size) == 0:
        raise ConfigError(f"shard of {len(indices)} samples has no full batch of {batch_size}")
    epoch = start_epoch
    while True:
        for xb, yb in iterate_batches(ds, indices, batch_size, seed, epoch):
            yield epoch, xb, yb
        epoch += 1


class BatchCursor:
    """Batches of any size in ``iterate_batches``' order (LB-BSP: the size changes with the
    worker's speed): epoch e's permutation cut into consecutive slices; a slice that does not
    fit in what is left of an epoch starts the next one (the rest is dropped, as there). With a
    constant size it yields exactly ``batch_stream``'s batches."""

    def __init__(self, ds: Any, indices: np.ndarray, seed: int, start_epoch: int = 0) -> None:
        self.ds, self.indices, self.seed = ds, indices, seed
        self.epoch, self.pos = start_epoch, 0
        self._order = self._permutation()

    def _permutation(self) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.epoch])
        return self.indices[rng.permutation(len(self.indices))]  # (n,) int64

    def take(self, size: int) -> tuple[int, np.ndarray, np.ndarray]:
        """The next (epoch, x, y) of ``size`` samples (at most the shard's)."""
        size = max(1, min(size, len(self.indices)))
        if self.pos + size > len(self._order):
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._permutation()
        idx = self._order[self.pos:self.pos + size]  # (size,) int64
        self.pos += size
        return self.epoch, self.ds.x[idx], self.ds.y[idx]


# -- the data sets: real loaders, with a synthetic stand-in ----------------------------------------

log = logging.getLogger(__name__)


@dataclass
class Dataset:
    """Samples of one split: ``x`` (N, C, H, W) float32, ``y`` (N,) int64, ``meta`` dict."""

    x: np.ndarray
    y: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def subset(self, indices: np.ndarray) -> Dataset:
        """A copy holding only ``indices`` (a worker's shard, so the rest can be freed).

        ``iterate_batches(ds.subset(s), arange(len(s)), ...)`` yields the same batches as
        ``iterate_batches(ds, s, ...)``: the order depends on positions within the shard only.
        """
        return Dataset(self.x[indices], self.y[indices], dict(self.meta, subset=len(indices)))


def evaluation_set(name: str, data_dir: str | Path | None, *, val_size: int = 0,
                   limit: int = 0, synthetic: bool = False, fallback: bool = True) -> Dataset:
    """What an evaluator scores: the test split, or with ``val_size`` the validation samples
    held out of the training split (``validation_split``; its meta says ``split``
    "validation"); the first ``limit`` of them when ``limit`` > 0."""
    if val_size:
        train = load_dataset(name, "train", data_dir, synthetic=synthetic, fallback=fallback)
        ds = train.subset(validation_split(len(train), val_size)[1])
        ds.meta["split"] = "validation"
    else:
        ds = load_dataset(name, "test", data_dir, synthetic=synthetic, fallback=fallback)
    return ds.subset(np.arange(min(limit, len(ds)))) if limit else ds


# ---------------------------------------------------------------- decoding and normalising


def _normalise(u8: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """uint8 (N, C, H, W) -> float32 (pixel/255 - mean) / std per channel, in place on the copy."""
    x = u8.astype(np.float32)  # (N, C, H, W) float32, one allocation
    for c, (m, s) in enumerate(zip(mean, std, strict=True)):
        x[:, c] *= np.float32(1.0 / (255.0 * s))
        x[:, c] -= np.float32(m / s)
    return x


def _pad(u8: np.ndarray, pad_to: int | None) -> np.ndarray:
    """Zero-pad (N, C, H, W) images centred to pad_to x pad_to (no-op when already that big)."""
    h, w = u8.shape[-2:]
    if pad_to is None or (h >= pad_to and w >= pad_to):
        return u8
    top, left = (pad_to - h) // 2, (pad_to - w) // 2
    widths = ((0, 0), (0, 0), (top, pad_to - h - top), (left, pad_to - w - left))
    return np.pad(u8, widths)


def _load_real(name: str, split: str, data_dir: str | Path | None, download: bool,
               mirror: str | None, pad_to: int | None) -> Dataset:
    spec = data_files.spec_of(name)
    paths = data_files.find_or_download(name, split, data_dir, download, mirror)
    entry = _decoded_entry(name, split, spec, paths, pad_to)
    if (cached := _read_decoded(entry)) is not None:
        x, labels = cached
    else:
        images, labels = data_files.decode(spec, paths)
        x = _normalise(_pad(images, pad_to), spec.mean, spec.std)
        _write_decoded(entry, x, labels)
    meta = {"name": name, "split": split, "source": str(paths[0].parent), "synthetic": False,
            "num_classes": 10}
    return Dataset(x, labels, meta)


# ---------------------------------------------------------------- the decoded cache

# Every worker of a run decodes, pads and normalises the same files (Fashion-MNIST's training
# set: about 0.6 s of one core on an idle machine, 245 MB of float32 each). The first one keeps
# the result under cache_dir(name)/decoded; the others, and every later run, map that file
# (copy-on-write: nothing is read until used, and the processes of one machine share its pages).
DECODED_VERSION = 1  # in the entry's key: a change of _normalise or _pad bumps it
DECODED_OFF = "MINIPS_DECODED_CACHE"  # =0: decode every time, write nothing


def _decoded_entry(name: str, split: str, spec: data_files.Spec, paths: list[Path],
                   pad_to: int | None) -> Path | None:
    """Where the decoded split is kept: one entry per data set, split and padding, its key
    the source files (path, size, time of change) and how they are turned into ``x``; None
    when the cache is off. Another key of the same kind replaces the entry (``_write_decoded``)."""
    if os.environ.get(DECODED_OFF, "1") == "0":
        return None
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in paths]
    key = repr((DECODED_VERSION, stats, pad_to, spec.mean, spec.std)).encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    return data_files.cache_dir(name) / "decoded" / f"{split}-pad{pad_to}-{digest}"


def _decoded_file(entry: Path, kind: str) -> Path:
    return entry.with_name(f"{entry.name}.{kind}.npy")


def _read_decoded(entry: Path | None) -> tuple[np.ndarray, np.ndarray] | None:
    """(x float32 (N, C, H, W), y int64 (N,)) mapped from ``entry``, or None when it is not
    there (or not whole: then the caller decodes)."""
    if entry is None:
        return None
    try:  # copy-on-write: a caller may write into x without touching the file
        x = np.load(_decoded_file(entry, "x"), mmap_mode="c").view(np.ndarray)
        y = np.load(_decoded_file(entry, "y"))
    except (OSError, ValueError):
        return None
    if x.dtype != np.float32 or y.dtype != np.int64 or x.ndim != 4 or len(x) != len(y):
        return None
    return x, y


def _write_decoded(entry: Path | None, x: np.ndarray, y: np.ndarray) -> None:
    """Keep ``x``, ``y`` at ``entry`` (y first, each written aside and renamed: a reader that
    finds x finds both whole) and remove the entries of other keys; a cache it cannot write
    (a full disk, no home) is only a slower next start."""
    if entry is None:
        return
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        for kind, arr in (("y", y), ("x", x)):
            dest = _decoded_file(entry, kind)
            part = dest.with_name(f"{dest.name}.{os.getpid()}.part")
            try:
                with open(part, "wb") as out:
                    np.save(out, arr)
                part.replace(dest)
            finally:
                part.unlink(missing_ok=True)
        stem = entry.name.rsplit("-", 1)[0]
        for old in entry.parent.glob(f"{stem}-*.npy"):
            if not old.name.startswith(entry.name + "."):
                old.unlink(missing_ok=True)
    except OSError as exc:
        log.info("decoded cache %s not written: %s", entry, exc)


# ---------------------------------------------------------------- synthetic data

_SYNTH_SIZES = {"train": 10_000, "test": 2_000}  # stand-in sizes: quick to make and to learn
_SYNTH_SEEDS = {"train": 1, "test": 2}  # different samples, same class templates


def _synthetic_stand_in(name: str, split: str, pad_to: int | None, reason: str) -> Dataset:
    shape = data_files.SPECS[name].shape if name in data_files.SPECS else (1, 28, 28)
    if pad_to is not None and shape[1] < pad_to:
        shape = (shape[0], pad_to, pad_to)
    x, y = make_synthetic_images(_SYNTH_SIZES[split], shape, 10, _SYNTH_SEEDS[split])
    meta = {"name": name, "split": split, "source": "synthetic", "synthetic": True,
            "num_classes": 10, "synthetic_reason": reason}
    return Dataset(x, y, meta)


_TRANSLATION_SIZES = {"train": 20_000, "test": 2_000}  # pairs per split of the seq2seq task


def _translation(split: str) -> Dataset:
    train_src, train_tgt = make_translation(_TRANSLATION_SIZES["train"], seed=11)
    if split == "train":
        src, tgt = train_src, train_tgt
    else:
        seen = {row.tobytes() for row in train_src}
        src, tgt = make_translation(_TRANSLATION_SIZES["test"], seed=12, exclude=seen)
    meta = {"name": "translation", "split": split, "source": "generated", "synthetic": True,
            "src_vocab": VOCAB, "tgt_vocab": VOCAB, "pad": PAD}
    return Dataset(src, tgt, meta)


# ---------------------------------------------------------------- public loader


def load_dataset(name: str, split: str, data_dir: str | Path | None = None, *,
                 download: bool = True, synthetic: bool = False, pad_to: int | None = 32,
                 mirror: str | None = None, fallback: bool = True) -> Dataset:
    """Load ``split`` ("train" or "test") of data set ``name`` (see ``DATASET_NAMES``).

    ``synthetic=True`` returns the stand-in without looking for files. Otherwise real files are
    found or downloaded (module docstring); if that fails, ``fallback=True`` returns the
    stand-in with a loud WARNING, ``fallback=False`` raises the ``DataError`` that says which
    files to put where. "translation" is always generated; "synthetic" always synthetic.
    """
    if split not in ("train", "test"):
        raise ConfigError(f"split must be 'train' or 'test', got {split!r}")
    if name == "translation":
        return _translation(split)
    if name == "synthetic" or synthetic:
        if name not in ("synthetic", *data_files.SPECS):
            data_files.spec_of(name)  # raises ConfigError naming the known sets
        log.warning("%s/%s: using SYNTHETIC data, as asked", name, split)
        return _synthetic_stand_in(name, split, pad_to, "asked for")
    try:
        return _load_real(name, split, data_dir, download, mirror, pad_to)
    except DataError as exc:
        if not fallback:
            raise
        log.warning("!" * 72 + "\n!!! NO REAL DATA for %s/%s: %s\n!!! Training on a SYNTHETIC "
                    "stand-in; results say nothing about %s.\n" + "!" * 72,
                    name, split, exc, name)
        return _synthetic_stand_in(name, split, pad_to, str(exc))
