"""Fast selection of the largest entries of a score vector (sampled threshold, DGC style).

``TopKSelector`` picks the k entries of largest magnitude of a float32 vector x (a gradient, or a
non-negative score) in a few streaming passes instead of a full sort or partition, and without
ever writing |x| out in full:

1. sample ``s`` scores at random positions (s about 1024 / density, at most n / 8) and take the
   sample quantile that should leave ``k * (1 + margin)`` entries above it;
2. one pass ``|x| >= threshold``, computed in cache-sized chunks into a reused bool mask, then
   ``np.flatnonzero`` gives the candidates, already sorted;
3. too few candidates (< k): lower the threshold in proportion to the miss and go back to 2, at
   most ``MAX_REFINES`` times, then fall back to one full partition (always correct);
4. exact mode (``tolerance=0``): an exact partition among the candidates only (O(candidates),
   about 1.15 k) keeps exactly k. Approximate (DGC) mode: the quantile aims at
   ``k * (1 + max(tolerance / 2, 2 standard errors))`` and any count in
   ``[k, k * (1 + tolerance)]`` is sent as is (no partition at all); more than that is trimmed to
   exactly k.

Invariants: the result is (k',) int64 indices, strictly increasing, and they are the k' largest
magnitudes; exact mode gives k' == k, approximate mode k <= k' <= k * (1 + tolerance), so it never
keeps less of the gradient than the exact top-k. Ties at the threshold are broken by position
(lowest index first). Scratch buffers are kept between calls: a selector is built once per
gradient size and reused every step.
"""

from __future__ import annotations

import numpy as np

__all__ = ["TopKSelector", "kept_count"]

SAMPLE_PER_DENSITY = 1024  # sample about this many entries above the threshold: ~3% count error
MAX_SAMPLE = 1 << 18  # cap on the sample (random gathers cost ~10 ns each)
MIN_SAMPLE = 4096
EXACT_MARGIN_STDS = 4.0  # exact mode aims this many standard errors above k, so one pass suffices
APPROX_MARGIN_STDS = 2.0  # approximate mode: at least this many (a miss below k costs a pass)
MAX_REFINES = 3  # lower the threshold at most this many times before a full partition
CHUNK = 1 << 18  # entries per |x| >= t chunk: 1 MiB of float32 stays in cache between the 2 ops
# (measured: 2^18 takes 3.5 ms on 11.7M entries, whole-array abs + compare 5.8 ms, 2^13 7.5 ms)


def kept_count(ratio: float, size: int) -> int:
    """Number of entries a kept fraction means: round(ratio * size), at least 1 if ratio > 0."""
    if ratio <= 0.0 or size == 0:
        return 0
    return min(size, max(1, int(round(ratio * size))))


class TopKSelector:
    """Reusable sampled-threshold top-k by magnitude over (n,) float32; see the module docstring."""

    def __init__(self, size: int, seed: int = 0, *, tolerance: float = 0.0) -> None:
        self.size = size
        self.tolerance = tolerance  # 0 -> exact k; DGC uses 0.1 -> k to 1.1 k
        self.rng = np.random.default_rng(seed)
        self._mask = np.empty(size, dtype=np.bool_)  # (n,) scratch for |x| >= threshold
        self._chunk = np.empty(min(size, CHUNK), dtype=np.float32)  # |x| of one chunk
        self.refines = 0  # threshold retries in the last call (for tests and stats)

    def select(self, score: np.ndarray, k: int) -> np.ndarray:
        """(k',) int64 sorted indices of the largest ``|score|`` entries; ``score`` (n,) float32."""
        n = score.size
        self.refines = 0
        if k <= 0:
            return np.empty(0, dtype=np.int64)
        if k >= n:
            return np.arange(n, dtype=np.int64)
        if n <= 8 * MIN_SAMPLE:  # small vectors: a full partition is cheapest and exact
            return self._trim(score, np.arange(n, dtype=np.int64), k)
        return self._sampled(score, k)

    def _sampled(self, score: np.ndarray, k: int) -> np.ndarray:
        n = score.size
        p = k / n
        s = int(min(MAX_SAMPLE, n // 8, max(MIN_SAMPLE, SAMPLE_PER_DENSITY / p)))
        sample = np.abs(score[self.rng.integers(0, n, size=s)])  # (s,) float32
        std = 1.0 / np.sqrt(p * s)  # relative standard error of the count a quantile predicts
        if self.tolerance > 0.0:  # land inside [k, k (1 + tol)]; overshoot is trimmed cheaply
            margin = max(self.tolerance / 2, APPROX_MARGIN_STDS * std)
        else:  # overshoot by enough that a second pass is rarely needed
            margin = EXACT_MARGIN_STDS * std + 0.02
        want = k * (1.0 + margin)
        for _ in range(MAX_REFINES + 1):
            # The sample entry that leaves about want/n of the sample above it.
            pos = int(np.clip(s - round(want / n * s), 0, s - 1))
            cand = self._above(score, np.partition(sample, pos)[pos])
            if cand.size >= k:
                if cand.size <= k * (1.0 + self.tolerance):
                    return cand
                return self._trim(score, cand, k)
            self.refines += 1
            want *= (1.0 + margin) * k / max(cand.size, 1)  # too few: aim lower by the miss
        return self._trim(score, np.arange(n, dtype=np.int64), k)

    def _above(self, score: np.ndarray, threshold: np.floating) -> np.ndarray:
        mask, buf = self._mask, self._chunk
        for lo in range(0, score.size, CHUNK):
            part = score[lo : lo + CHUNK]
            chunk = np.abs(part, out=buf[: part.size])
            np.greater_equal(chunk, threshold, out=mask[lo : lo + part.size])
        return np.flatnonzero(mask)  # (c,) int64, sorted

    @staticmethod
    def _trim(score: np.ndarray, cand: np.ndarray, k: int) -> np.ndarray:
        """Exactly the k largest among sorted candidates ``cand``, kept in index order."""
        vals = np.abs(score[cand])  # (c,) float32
        kth = np.partition(vals, vals.size - k)[vals.size - k]  # k-th largest value
        keep = vals > kth
        ties = np.flatnonzero(vals == kth)[: k - int(keep.sum())]  # fill with lowest-index ties
        keep[ties] = True
        return cand[keep]
