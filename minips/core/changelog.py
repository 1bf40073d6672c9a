"""The change log of one weights vector: for each version, the indices it touched (numpy, sans-IO).

A server's weights change a few entries at a time when the optimizer is on the workers: a push of
k entries, an exchange's top-k, a merge of a sparse delta. Whoever needs "what changed since
version v" (a PULL that holds v, a group's next exchange, the global server's next answer to a
group) asks the log instead of comparing two (n,) vectors, so its work follows the changes, not
the model (docs/performance.md):

- ``note(idx)``: the weights changed at ``idx`` ((k,) indices, each once), or anywhere (None:
  a dense change); the version goes up by one.
- ``since(v)``: (m,) uint32 increasing, every index changed after version ``v``, each once
  (``sparse.union_of``), or None when the log cannot say: ``v`` older than the oldest version
  it keeps, or a dense change came after ``v``. Then the caller falls back to the whole vector,
  as it did before the log (a dense answer, or one pass over n).
- ``TopDiff``: the top-k of a difference between two vectors looked for among the indices a
  log names (the exchange's ``s``, the global server's sparse answer to a group).

Bounded: at most ``max_versions`` versions and ``max_entries`` indices in all (a quarter of the
vector by default: uint32 indices then take the memory of 1/4 of a float32 copy of it); the
oldest go first. A dense change empties the log (nothing before it can be answered sparsely).

The unions are merges, not sorts: each version's indices are (nearly always) increasing, so
``sparse.union_sorted`` merges them (a stable sort finds the runs: O(m log runs), 3-10x a
quicksort of the same entries), and an answer once made is kept (``max_entries`` indices of
them at most) and brought forward by merging the versions noted since: workers that PULL one
after another ask for versions a few apart, and each answer is then one merge of two runs.

Invariant: for every ``v`` with ``oldest <= v <= version``, ``since(v)`` holds every index whose
value may differ between the weights at version ``v`` and now (a superset: an index changed
twice, back to its value, stays in).
"""

from __future__ import annotations

import collections

import numpy as np

from minips.compress.selection import TopKSelector, top_among
from minips.sparse import union_sorted

__all__ = ["ChangeLog", "MAX_VERSIONS", "TopDiff", "kept_record"]

MAX_VERSIONS = 1024  # versions kept; a worker further behind gets the weights whole
RECORD_SHARE = 8  # a record of indices over size / this is dropped (then: one pass over n)


def kept_record(idx: np.ndarray, size: int) -> np.ndarray | None:
    """``idx`` (where a copy lags, say) if it is at most an eighth of ``size``, else None:
    "anywhere", and the next look takes the pass over all n. Bounds the memory of a record
    to n / 2 bytes of uint32, and a set that large is cheaper to find again in one contiguous
    pass than to gather from."""
    return idx if idx.size <= size // RECORD_SHARE else None


class ChangeLog:
    """The indices each of the last versions of one (n,) vector touched."""

    def __init__(self, size: int, *, max_versions: int = MAX_VERSIONS,
                 max_entries: int | None = None) -> None:
        self.size = size
        self.version = 0  # changes noted so far
        self.max_versions = max_versions
        self.max_entries = max(1, size // 4) if max_entries is None else max_entries
        self._changes: collections.deque[np.ndarray] = collections.deque()  # oldest first
        self._entries = 0  # indices held in _changes, summed
        # since(v) as made at version ``at``: v -> (at, union); brought forward when asked
        self._unions: dict[int, tuple[int, np.ndarray]] = {}
        self._cached = 0  # indices held in _unions, summed (at most max_entries)

    @property
    def oldest(self) -> int:
        """The oldest version ``since`` can answer for."""
        return self.version - len(self._changes)

    def note(self, idx: np.ndarray | None) -> int:
        """The weights changed at ``idx`` ((k,) integer indices below ``size``, each once), or
        anywhere (None); return the new version."""
        self.version += 1
        if idx is None:  # nothing before a dense change can be answered sparsely
            self._changes.clear()
            self._entries = 0
            self._unions.clear()
            self._cached = 0
            return self.version
        self._changes.append(np.asarray(idx, dtype=np.uint32))
        self._entries += int(idx.size)
        while self._changes and (self._entries > self.max_entries
                                 or len(self._changes) > self.max_versions):
            self._entries -= int(self._changes.popleft().size)
        return self.version

    def since(self, v: int) -> np.ndarray | None:
        """(m,) uint32 increasing: the indices changed after version ``v``, each once; None
        when the log does not reach back to ``v`` (or ``v`` is not a version it had)."""
        if v < self.oldest or v > self.version:
            return None
        kept = self._unions.get(v)
        if kept is not None and kept[0] == self.version:
            return kept[1]
        union = union_sorted(self._runs(v, kept))  # one merge of every run
        self._keep(v, union)
        return union

    def _runs(self, v: int, kept: tuple[int, np.ndarray] | None) -> list[np.ndarray]:
        """The increasing runs whose union is ``since(v)``: its answer as made at version
        ``at`` (``kept``) and the versions after ``at``; else, without one, the versions after
        ``v`` up to the nearest newer version answered already, its union as of when it was
        made, and the versions after that; else the versions after ``v``."""
        if kept is None:
            newer = [u for u in self._unions if u > v]
            if newer:
                u = min(newer)
                at, union = self._unions[u]
                return [*self._after(v, u), union, *self._after(at, self.version)]
            return self._after(v, self.version)
        at, union = kept
        after = self._after(at, self.version)
        return [union, *after] if union.size else after

    def _after(self, v: int, u: int) -> list[np.ndarray]:
        """The indices of versions ``v`` + 1 to ``u``, one array each, oldest first."""
        return [self._changes[-j] for j in range(self.version - v, self.version - u, -1)]

    def _keep(self, v: int, union: np.ndarray) -> None:
        """Keep ``since(v)`` as of now; the oldest go first past ``max_entries`` in all."""
        old = self._unions.pop(v, None)
        self._cached += union.size - (0 if old is None else old[1].size)
        self._unions[v] = (self.version, union)
        for u in sorted(self._unions):
            if self._cached <= self.max_entries and u >= self.oldest:
                break
            self._cached -= self._unions.pop(u)[1].size


class TopDiff:
    """The k entries where a vector differs most from a copy of it (an exchange's ``s``, a
    sparse answer's entries): looked for among the candidates a change log gives
    (O(candidates)), or over all n (``TopKSelector``, as before the log) when there are none or
    more than n / ``WIDE`` (then one contiguous pass is the cheaper one). Both give the exact
    top-k, ties to the lowest index, zeros left out."""

    WIDE = 8

    # one selector per vector size in a process, made on the first pass over n and shared by
    # every TopDiff of that size (a group's exchange and the global server's answer to it, for
    # each group in one process): its scratch, an (n,) mask, serves one call at a time, and
    # they all run on the serving loop's thread; shared, 4 in-process groups of ResNet-18 hold
    # one 11 MB mask, not 8. A sampled selection is exact whatever its sample, so sharing the
    # generator changes no answer.
    _selectors: dict[int, TopKSelector] = {}

    def __init__(self, size: int, k: int) -> None:
        self.size, self.k = size, k

    def top(self, now: np.ndarray, copy: np.ndarray, where: np.ndarray | None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(p,) uint32 sorted indices of the k largest ``|now - copy|``, ``now - copy`` there
        ((p,) float32), and where the two may still differ elsewhere ((m,) uint32 sorted; None:
        anywhere). ``where``: the candidates, a superset of where they differ (None: unknown)."""
        if where is None or where.size > self.size // self.WIDE:
            diff = now - copy  # (n,) float32
            selector = self._selectors.get(self.size)
            if selector is None:
                selector = self._selectors[self.size] = TopKSelector(self.size)
            idx = selector.select(diff, self.k)  # (k,) int64 sorted
            idx = idx[diff[idx] != 0]
            return idx.astype(np.uint32), diff[idx], None
        diff = now[where] - copy[where]  # (w,) float32
        nz = diff != 0
        cand, diff = where[nz], diff[nz]
        pos = top_among(np.arange(cand.size), diff, self.k)  # (p,) positions in cand
        return cand[pos], diff[pos], kept_record(_rest(cand, pos), self.size)


def _rest(cand: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """``cand`` without the entries at positions ``pos``: what a top-k left behind."""
    keep = np.ones(cand.size, dtype=np.bool_)
    keep[pos] = False
    return cand[keep]
