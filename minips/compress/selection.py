"""Top-k by magnitude: which entries of a vector a sparse payload keeps (sparse.py has the
payload itself).

``TopKSelector`` picks the k entries of largest magnitude of an (n,) float32 vector
(a gradient, a residual, a non-negative score) for every caller: the compressors, the
downlink's publish and the group <-> global exchange. It works in a few streaming passes instead
of a full sort or partition, and never writes |x| out in full:

1. sample ``s`` scores at random positions (s about 1024 / density, at most n / 8) and take the
   sample quantile that should leave ``k * (1 + margin)`` entries above it;
2. one pass ``|x| >= threshold``, computed in cache-sized chunks into a reused bool mask, then
   ``np.flatnonzero`` gives the candidates, already sorted;
3. too few candidates (< k): lower the threshold in proportion to the miss and go back to 2, at
   most ``MAX_REFINES`` times, then fall back to one full partition (always correct);
4. two modes. Exact (``tolerance=0``): an exact partition among the candidates only
   (O(candidates), about 1.15 k) keeps exactly k; the result does not depend on the sample,
   only the time does. Sampled (DGC, ``tolerance > 0``): the quantile aims at
   ``k * (1 + max(tolerance / 2, 2 standard errors))`` and any count in
   ``[k, k * (1 + tolerance)]`` is sent as is (no partition at all); more is trimmed to k.

Vectors of at most ``8 * MIN_SAMPLE`` entries skip the sample: one exact partition. When the
sample's threshold is 0 (the vector is mostly zeros) the candidates are the non-zeros, found in
one scan: O(n) read, O(nnz) work, never a partition of all n; with fewer than k of them, the
lowest-index zeros fill the rest (the same k as the partition, by the tie rule below).

``top_among(indices, values, k)`` is the same exact top-k over a vector given by its possibly
non-zero entries only (a change log's candidates: ``core/changelog.py``): O(m), never O(n).
``kept_count(ratio, n)`` is the k a kept fraction means. The array steps (gather, k-th value,
``>=`` mask, nonzero) are small methods, so the torch twin (``compress.device_compress.TorchTopK``)
overrides only them and runs this very algorithm, with the sample positions drawn from the same
numpy generator: same seed, same indices.

Invariants: selection returns (k',) int64 indices, strictly increasing: the k' largest
magnitudes, ties at the threshold broken by position (lowest index first); exact mode gives
k' == k, sampled mode k <= k' <= k * (1 + tolerance), so it never keeps less than the exact
top-k. Everything here is vectorised numpy: no Python loop runs per element.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "SAMPLE_PER_DENSITY",
    "MAX_SAMPLE",
    "MIN_SAMPLE",
    "EXACT_MARGIN_STDS",
    "APPROX_MARGIN_STDS",
    "MAX_REFINES",
    "CHUNK",
    "kept_count",
    "top_among",
    "TopKSelector",
]


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


def top_among(indices: np.ndarray, values: np.ndarray, k: int) -> np.ndarray:
    """The exact top-k by magnitude of a vector that is zero outside ``indices`` ((m,)
    strictly increasing) where it holds ``values`` ((m,) float32), zeros left out: the
    indices of the k largest ``|values|``, ties broken by lowest index, increasing. O(m),
    whatever the vector's length: what ``TopKSelector.select`` then ``!= 0`` gives."""
    if k <= 0:
        return indices[:0]
    nz = values != 0  # (m,) bool
    if int(np.count_nonzero(nz)) <= k:
        return indices[nz]
    mag = np.abs(values)
    kth = np.partition(mag, mag.size - k)[mag.size - k]  # > 0: more than k are non-zero
    keep = mag > kth
    ties = np.flatnonzero(mag == kth)[: k - int(np.count_nonzero(keep))]
    keep[ties] = True
    return indices[keep]


class TopKSelector:
    """Reusable top-k by magnitude over (n,) float32, exact or sampled; see the module docstring.

    Built once per vector size and reused every step (it keeps its scratch buffers and its
    generator). The array steps at the end are numpy; ``TorchTopK`` overrides only them."""

    def __init__(self, size: int, seed: int = 0, *, tolerance: float = 0.0) -> None:
        self.size = size
        self.tolerance = tolerance  # 0 -> exact k; DGC uses 0.1 -> k to 1.1 k
        self.rng = np.random.default_rng(seed)  # the sample's positions (numpy in the twin too)
        self.refines = 0  # threshold retries in the last call (for tests and stats)
        self.path = ""  # how the last call chose: "sample", "partition" or "nonzero"
        self._mask, self._mag = self._scratch(size)  # |x| >= threshold, and |x|

    def select(self, score: Any, k: int) -> Any:
        """(k',) int64 sorted indices of the largest ``|score|`` entries; ``score`` (n,) float32,
        a numpy array (a torch tensor for ``TorchTopK``: the indices are one too, beside it)."""
        n = len(score)
        self.refines = 0
        self.path = "sample"  # or "partition" (small n) or "nonzero" (``_mostly_zero``)
        if k <= 0:
            return self._arange(0)
        if k >= n:
            return self._arange(n)
        mag = self._magnitude(score)
        if n <= 8 * MIN_SAMPLE:  # small vectors: a full partition is cheapest and exact
            self.path = "partition"
            return self._trim(mag, self._arange(n), k)
        return self._sampled(mag, k)

    def _sampled(self, score: Any, k: int) -> Any:
        n = len(score)
        p = k / n
        s = int(min(MAX_SAMPLE, n // 8, max(MIN_SAMPLE, SAMPLE_PER_DENSITY / p)))
        at = self._positions(self.rng.integers(0, n, size=s))  # (s,) int64
        sample = self._abs_at(score, at)  # (s,) float32
        std = 1.0 / np.sqrt(p * s)  # relative standard error of the count a quantile predicts
        if self.tolerance > 0.0:  # land inside [k, k (1 + tol)]; overshoot is trimmed cheaply
            margin = max(self.tolerance / 2, APPROX_MARGIN_STDS * std)
        else:  # overshoot by enough that a second pass is rarely needed
            margin = EXACT_MARGIN_STDS * std + 0.02
        want = k * (1.0 + margin)
        for _ in range(MAX_REFINES + 1):
            # The sample entry that leaves about want/n of the sample above it.
            pos = int(np.clip(s - round(want / n * s), 0, s - 1))
            threshold = self._kth(sample, pos)
            if not threshold:  # |x| >= 0 would take all n: the non-zeros are the candidates
                return self._mostly_zero(score, k)
            cand = self._above(score, threshold)  # (c,) int64, sorted
            c = len(cand)
            if c >= k:
                return cand if c <= k * (1.0 + self.tolerance) else self._trim(score, cand, k)
            self.refines += 1
            want *= (1.0 + margin) * k / max(c, 1)  # too few: aim lower by the miss
        return self._trim(score, self._arange(n), k)

    def _mostly_zero(self, score: Any, k: int) -> Any:
        """The k largest of a vector whose k-th largest may be 0: among its non-zeros (one
        scan, then O(nnz)); fewer than k of them are all kept, with the lowest-index zeros."""
        self.path = "nonzero"
        nz = self._nonzero(score)  # (c,) int64 sorted
        c = len(nz)
        if c >= k:
            return self._trim(score, nz, k)
        # the k - c zeros kept lie below k; with j non-zeros below their end L = k - c + j
        # the result is 0..L-1 then nz[j:], already sorted: j counts nz[t] - t < k - c
        j = int(((nz - self._arange(c)) < (k - c)).sum())
        out = self._arange(k)
        out[k - c + j:] = nz[j:]
        return out

    def _trim(self, score: Any, cand: Any, k: int) -> Any:
        """Exactly the k largest among sorted candidates ``cand``, kept in index order."""
        vals = self._abs_at(score, cand)  # (c,) float32
        kth = self._kth(vals, len(vals) - k)  # the k-th largest value
        keep = vals > kth
        ties = self._nonzero(vals == kth)[: k - int(keep.sum())]  # fill with lowest-index ties
        keep[ties] = True
        return cand[keep]

    # -- the array steps, in numpy (``compress.device_compress.TorchTopK`` does each in torch)

    def _scratch(self, size: int) -> tuple[Any, Any]:
        """(n,) bool mask and (chunk,) float32 |x| of one chunk, reused by every call."""
        return np.empty(size, dtype=np.bool_), np.empty(min(size, CHUNK), dtype=np.float32)

    def _arange(self, n: int) -> Any:
        return np.arange(n, dtype=np.int64)

    def _magnitude(self, score: Any) -> Any:
        return score  # |x| is taken where it is read: chunk by chunk, or at a few positions

    def _positions(self, at: np.ndarray) -> Any:
        return at

    def _abs_at(self, score: Any, at: Any) -> Any:
        return np.abs(score[at])

    def _kth(self, v: Any, pos: int) -> Any:
        """The value at 0-based position ``pos`` of ``v`` sorted."""
        return np.partition(v, pos)[pos]

    def _nonzero(self, mask: Any) -> Any:
        return np.flatnonzero(mask)

    def _above(self, score: Any, threshold: Any) -> Any:
        mask, buf = self._mask, self._mag
        for lo in range(0, score.size, CHUNK):
            part = score[lo : lo + CHUNK]
            chunk = np.abs(part, out=buf[: part.size])
            np.greater_equal(chunk, threshold, out=mask[lo : lo + part.size])
        return np.flatnonzero(mask)  # (c,) int64, sorted
