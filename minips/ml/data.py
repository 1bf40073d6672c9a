"""Data sets for workers: real loaders, download (verified in fetch.py), sharding, batch order.

Real sets: MNIST and Fashion-MNIST from IDX files (gzip or raw), CIFAR-10 from its binary batches.
Files are looked for in ``data_dir`` (when given), then ``~/.cache/minips/<name>`` (or
``$MINIPS_CACHE_DIR/<name>``), then system directories (Fashion-MNIST: Debian's
/usr/share/datasets/fashion-mnist). Missing files are downloaded (from the official URL, or from
``mirror=`` / ``$MINIPS_DATA_MIRROR``) into ``data_dir`` (or the cache) and refused unless their
SHA-256 matches the pinned digest. If no real data can be had, a
synthetic stand-in of the same shape is returned, announced with a WARNING and recorded in
``meta["synthetic"]``; ``synthetic=True`` asks for it directly.

Invariants:
- ``Dataset.x`` is float32 (N, C, H, W), normalised per channel as ``(pixel/255 - mean) / std``;
  ``Dataset.y`` is int64 (N,). 28x28 sets are zero-padded (pixel 0, before normalising) to
  ``pad_to`` = 32 by default, the input LeNet-5 expects; ``pad_to=None`` keeps 28x28.
- The "translation" set (the seq2seq task, generated in code) is the one exception:
  ``x`` int64 (N, SRC_LEN) source tokens, ``y`` int64 (N, TGT_LEN) target tokens, see below.
- Sharding and batch order live in shards.py, the generators in synthetic.py, the real sets'
  files (specs, readers, search, download) in data_files.py; all are re-exported here so
  workers import everything data-related from one module.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from minips.errors import ConfigError, DataError
from minips.ml import data_files
from minips.ml.data_files import DATASET_NAMES, cache_dir, download, read_cifar_batch, read_idx
from minips.ml.fetch import fetch_file
from minips.ml.shards import batch_stream, iterate_batches, num_batches, shard_indices
from minips.ml.synthetic import (
    BOS,
    EOS,
    PAD,
    SRC_LEN,
    TGT_LEN,
    VOCAB,
    WORDS,
    make_synthetic_images,
    make_translation,
)

__all__ = [
    "Dataset", "DATASET_NAMES", "load_dataset", "download", "fetch_file", "read_idx",
    "read_cifar_batch", "cache_dir", "make_synthetic_images", "make_translation",
    "shard_indices", "num_batches", "iterate_batches", "batch_stream", "PAD", "BOS", "EOS",
    "WORDS", "VOCAB", "SRC_LEN", "TGT_LEN",
]

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
    images, labels = data_files.decode(spec, paths)
    x = _normalise(_pad(images, pad_to), spec.mean, spec.std)
    meta = {"name": name, "split": split, "source": str(paths[0].parent), "synthetic": False,
            "num_classes": 10}
    return Dataset(x, labels, meta)


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
