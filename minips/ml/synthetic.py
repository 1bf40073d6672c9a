"""Generated data: the stand-in images and the seq2seq translation task.

Nothing here reads files. ``make_synthetic_images`` is the last-resort stand-in for a real image
set (data.py announces it loudly when used); ``make_translation`` generates the toy translation
task on which the seq2seq model is trained, since no translation corpus is available offline.
"""

from __future__ import annotations

import numpy as np

__all__ = ["make_synthetic_images", "make_translation", "PAD", "BOS", "EOS", "WORDS", "VOCAB",
           "SRC_LEN", "TGT_LEN"]


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
