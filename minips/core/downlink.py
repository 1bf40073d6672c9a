"""A group server's answers to PULLs, sans-IO (numpy only: no asyncio, no torch, no clocks): the
compressed downlink (``Downlink``) and the exact one (``ExactDownlink``).

Without either every PULL is answered with the whole weights. The exact downlink answers a
worker that holds version ``since`` with the entries the group's change log
(``core/changelog.py``) names after it, at their values now: the worker then holds the weights
bit for bit, for O(changes since) work (docs/compression.md, "The exact downlink"); with
``values="f16"`` the updates' values go out rounded to float16, and the copy is the weights to
that rounding where an update set it.

With the compressed one the group keeps a *published*
copy ``w_pub`` with a publish version ``pub``, and every worker holds a copy of ``w_pub`` at
some version. The scheme is DoubleSqueeze's server-side error feedback, adapted to an
asynchronous group (docs/compression.md, "The downlink"):

- **publish** (``publish(weights)``; the group server publishes once per turn of its event loop
  that answers PULLs, however many it answers):
  ``e = weights - w_pub`` is the residual; its ``k = kept * n`` largest ``|e|`` coordinates are
  published: ``w_pub[idx] = weights[idx]``, ``pub += 1``, and ``idx`` goes into a bounded log.
  What is not published stays in ``e`` (error feedback is implicit: nothing is lost, only
  delayed), and a coordinate once published is exact (``w_pub`` takes the weights' own float32),
  or with ``values="f16"`` the weights' value rounded to float16: an update then carries 2
  bytes a value instead of 4, the worker still holds ``w_pub`` bit for bit (every coordinate
  an update names holds a float16 value), and the rounding stays in ``e`` like the rest.
- **drift bound**: after a publish ``||weights - w_pub||_2 <= drift * ||weights||_2``. When the
  top-k would leave more, the publish takes the next largest coordinates too, as few as keep the
  bound (so a jump of the weights, e.g. an exchange with the global server, goes out at once).
- **answer** (``answer(since)``): a worker that holds version ``since`` still in the log gets the
  coordinates published after it, with their values in ``w_pub`` now (a sparse *set*, not an
  add: the merge of several publishes is exact, whatever order they came in). The worker writes
  them into its copy and holds ``w_pub`` at ``pub`` exactly, bit for bit.
- **dense resync** (``w_pub`` whole, ``since = -1``): for a worker that names no version or one
  the log no longer has (first pull, reconnect, another group, plain clients), and when the
  merged set is over ``dense_fraction`` of ``n`` (then dense is the smaller message).
- **with the group's change log** (``changes``): a publish looks only at the coordinates that
  changed since the last one and those it left unpublished then (``behind``), and the drift
  sums ``||weights||^2`` and ``||weights - w_pub||^2`` (float64) follow each change as it lands
  (``moving`` before it, ``moved`` after): O(changes) a turn, the same choices as over all n.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from minips.compress.selection import TopKSelector, kept_count, top_among
from minips.core.changelog import ChangeLog, kept_record
from minips.core.config import RunConfig
from minips.errors import RemoteProtocolError
from minips.sparse import SparseVector, decode_vector, set_into, union_of, unique_sorted

__all__ = ["Answer", "Downlink", "ExactDownlink", "group_downlink", "Diverged", "check_finite",
           "apply_weights", "trusted_since", "sq_norm", "wire_values", "DRIFT", "LOG_SIZE",
           "DENSE_FRACTION", "VALUES"]

DRIFT = 0.01  # bound on ||weights - w_pub|| / ||weights|| after every publish (--down-drift)
LOG_SIZE = 64  # publishes kept in the log; a worker further behind gets the weights dense
DENSE_FRACTION = 0.4  # a merged answer with more changed coordinates than this goes dense
VALUES = ("f32", "f16")  # what an update's values are sent as (``Downlink.values``)
WIDE = 8  # more candidates than n / WIDE: a publish takes one pass over n instead
SQ_CHUNK = 1 << 16  # entries per float64 chunk of ``sq_norm`` (512 KiB: stays in cache)
F16_MAX = float(np.finfo(np.float16).max)


# what a publish picks: coordinates, the residual there, ||residual||^2, what stays behind
Picked = tuple[np.ndarray, np.ndarray, float, "np.ndarray | None"]


@dataclass(frozen=True)
class Answer:
    """What a PULL gets: ``payload`` brings a copy from version ``since`` to ``version``.

    ``since`` -1: ``payload`` is ``w_pub`` whole, (n,) float32 (a copy, safe to send while the
    group goes on). Otherwise a ``SparseVector`` whose values are the new values of the
    coordinates it names (set, not add)."""

    version: int
    since: int
    payload: SparseVector | np.ndarray


class Downlink:
    """The published copy of one group's weights, its version, and the log of publishes."""

    def __init__(self, weights: np.ndarray, kept: float, *, drift: float = DRIFT,
                 log_size: int = LOG_SIZE, dense_fraction: float = DENSE_FRACTION,
                 values: str = "f32", changes: ChangeLog | None = None) -> None:
        if (not 0 < kept <= 1 or drift < 0 or log_size < 1 or not 0 < dense_fraction <= 1
                or values not in VALUES):
            raise ValueError(f"bad downlink settings: kept {kept}, drift {drift}, "
                             f"log_size {log_size}, dense_fraction {dense_fraction}, "
                             f"values {values}")
        self.values = values  # "f16": published values rounded to float16, sent as such
        self.w_pub = np.array(weights, dtype=np.float32)  # (n,) what the workers can hold
        self.n = int(self.w_pub.size)
        self.k = kept_count(kept, self.n)  # coordinates per publish, before the drift bound
        self.drift_bound = drift
        self.dense_fraction = dense_fraction
        self.pub = 0  # publish version of w_pub
        self.log: collections.deque[np.ndarray] = collections.deque(maxlen=log_size)
        self.published = 0  # coordinates published so far
        self.forced = 0  # of them, those beyond k that the drift bound needed
        self.answers = {"update": 0, "dense": 0}  # answers given, by kind
        self.last_drift = 0.0  # ``drift(weights)`` right after the last publish
        self._made: dict[int, Answer] = {}  # answers made since the last publish, by ``since``
        # with the group's change log: where w_pub may lag the weights, beyond the changes
        # the log holds after version ``_seen`` ((m,) uint32 sorted; None: anywhere)
        self.changes = changes
        self._seen = 0 if changes is None else changes.version
        self.behind: np.ndarray | None = np.empty(0, np.uint32)
        self._selector: TopKSelector | None = None  # made on the first publish over all n
        self.wsq = sq_norm(self.w_pub)  # ||weights||^2 and ||weights - w_pub||^2, float64,
        self.gap2 = 0.0  # kept up to date as changes land (``moving`` / ``moved``)
        # the weights after a change anywhere (the optimizer on the servers: every push): the
        # sums are computed from them when next asked (``_sums``: once a turn of PULLs, which
        # publishes once), not at every push; None: the sums are up to date
        self._stale: np.ndarray | None = None

    def drift(self, weights: np.ndarray) -> float:
        """``||weights - w_pub|| / ||weights||`` now, computed anew (O(n); 0 when both are
        zero)."""
        return _relative(sq_norm(weights - self.w_pub), sq_norm(weights))

    def drift_now(self) -> float:
        """``drift(weights)`` from the sums kept as changes land: O(1) (O(n) once after
        changes anywhere)."""
        self._sums()
        return _relative(self.gap2, self.wsq)

    def _sums(self) -> None:
        """Bring ``wsq`` and ``gap2`` up to date after changes anywhere: two passes over n."""
        if self._stale is not None:
            weights, self._stale = self._stale, None
            self.wsq, self.gap2 = sq_norm(weights), sq_norm(weights - self.w_pub)

    def counts(self) -> dict[str, int]:
        """The counts so far, for a group's ``exchange`` record lines: publishes, coordinates
        published, and of them those beyond k that the drift bound forced."""
        return {"publishes": self.pub, "published": self.published, "forced": self.forced}

    def finite(self) -> bool:
        """The weights are finite, as far as the sums say (a NaN or inf weight makes them not:
        float32 squares cannot overflow a float64 sum), and so is the last publish's drift."""
        self._sums()
        return all(math.isfinite(x) for x in (self.wsq, self.gap2, self.last_drift))

    def moving(self, weights: np.ndarray, idx: np.ndarray | None) -> Any:
        """The weights are about to change at ``idx`` (None: anywhere): what ``moved`` needs
        to bring the sums up to date (their parts at ``idx`` now), O(k); None when they are
        computed anew anyway (a change anywhere, now or since they were last asked)."""
        if idx is None or self._stale is not None:
            return None
        pub = self.w_pub.take(idx)  # (k,) float32; w_pub does not change before ``moved``
        return (*self._parts(weights, idx, pub), pub)

    def moved(self, weights: np.ndarray, idx: np.ndarray | None, before: Any) -> None:
        """The weights changed at ``idx`` (``moving`` gave ``before``): the sums follow, O(k);
        after a change anywhere they are computed anew, O(n), when next asked."""
        if idx is None or before is None:
            self._stale = weights
            return
        wsq, gap2 = self._parts(weights, idx, before[2])
        self.wsq = max(0.0, self.wsq + wsq - before[0])
        self.gap2 = max(0.0, self.gap2 + gap2 - before[1])

    @staticmethod
    def _parts(weights: np.ndarray, idx: np.ndarray, pub: np.ndarray) -> tuple[float, float]:
        """The parts at ``idx`` of ``||weights||^2`` and ``||weights - w_pub||^2`` (float64),
        ``pub`` being ``w_pub`` there."""
        w = weights.take(idx).astype(np.float64)  # (k,); take: 1.1 us where [idx] takes 1.7
        e = w - pub
        return float(np.dot(w, w)), float(np.dot(e, e))

    def publish(self, weights: np.ndarray) -> int:
        """Publish the largest residuals (at least k, more if the drift bound needs them);
        return how many coordinates changed (0: nothing to publish, the version stays). With a
        change log, only the coordinates that changed or lag already are looked at."""
        if self.changes is not None:
            self._sums()
            wsq = self.wsq
        else:
            wsq = sq_norm(weights)
        picked = self._pick(weights, wsq)
        if picked is None:  # w_pub is the weights
            self.behind, self.gap2, self.last_drift = np.empty(0, np.uint32), 0.0, 0.0
            return 0
        idx, e, total, behind = picked
        sent = e.astype(np.float64)
        left = max(0.0, total - float(np.dot(sent, sent)))  # ||e||^2 not published
        if self.values == "f16":  # the rounding stays behind, in the residual
            rounded = self._set_half(weights, idx)
            left += float(np.dot(rounded, rounded))
            if behind is not None:
                behind = unique_sorted(np.concatenate([behind, idx[rounded != 0]]))
        else:
            self.w_pub[idx] = weights[idx]
        self.behind = None if behind is None else kept_record(behind, self.n)
        self.gap2 = left
        self.last_drift = math.sqrt(left / wsq) if wsq else 0.0
        self.pub += 1
        self._made.clear()
        self.log.append(idx)
        self.published += int(idx.size)
        self.forced += max(0, idx.size - self.k)
        return int(idx.size)

    def _pick(self, weights: np.ndarray, wsq: float) -> Picked | None:
        """What to publish: (p,) uint32 sorted coordinates, the residual there, ``||e||^2``
        (float64) and where w_pub still lags afterwards (None: not known); None when nothing
        lags. Among the coordinates the change log names since the last publish and those left
        behind then (O(them)), or over all n without a log, past what it holds, or when they
        are more than n / 8 (then one contiguous pass is the cheaper one)."""
        where = None
        if self.changes is not None:
            changed = self.changes.since(self._seen)
            self._seen = self.changes.version
            if changed is not None and self.behind is not None:
                where = union_of([self.behind, changed], self.n)
        if where is None or where.size > self.n // WIDE:
            return self._pick_over_n(weights, wsq)
        e = weights[where] - self.w_pub[where]  # (w,) float32
        nz = e != 0
        cand, e = where[nz], e[nz]
        if cand.size == 0:
            return None
        if cand.size <= self.k:
            return cand, e, float(np.dot(e.astype(np.float64), e)), cand[:0]
        pos = self._select(np.abs(e), wsq, lambda m: top_among(np.arange(m.size), m, self.k))
        rest = np.ones(cand.size, dtype=np.bool_)
        rest[pos] = False
        return cand[pos], e[pos], float(np.dot(e.astype(np.float64), e)), cand[rest]

    def _pick_over_n(self, weights: np.ndarray, wsq: float) -> Picked | None:
        """``_pick`` over all n: the exact top k of ``|weights - w_pub|`` by ``TopKSelector``
        (a few streaming passes), as before the change log."""
        e = weights - self.w_pub  # (n,) float32
        moved = int(np.count_nonzero(e))
        if moved == 0:
            return None
        if moved <= self.k:  # all of them go: nothing stays behind
            idx = np.flatnonzero(e).astype(np.uint32)
            return idx, e[idx], sq_norm(e), idx[:0]
        if self._selector is None:
            self._selector = TopKSelector(self.n)
        selector = self._selector
        idx = self._select(np.abs(e), wsq, lambda m: selector.select(m, self.k))
        return idx.astype(np.uint32), e[idx], sq_norm(e), None

    def _set_half(self, weights: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """``w_pub[idx]`` = the weights there rounded to float16 (kept exact past its range);
        returns the rounding left behind, (p,) float64."""
        exact = weights[idx]
        with np.errstate(over="ignore"):
            half = exact.astype(np.float16).astype(np.float32)
        big = ~np.isfinite(half)  # past float16's range: kept exact (then sent as f32)
        half[big] = exact[big]
        self.w_pub[idx] = half
        return (exact - half).astype(np.float64)

    def _select(self, mag: np.ndarray, wsq: float,
                top: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Positions in ``mag`` (|residual|, more than k of them > 0) to publish, increasing:
        the k largest (``top``: exact, ties to the lowest position), or the fewest largest that
        leave ``sum(mag^2)`` of the rest within drift^2 * wsq."""
        # float16 rounding leaves at most (2^-11)^2 of the published part: kept out of the budget
        budget = self.drift_bound ** 2 * wsq * (0.99 if self.values == "f16" else 1.0)
        first = top(mag)  # (k,) sorted
        sq = mag.astype(np.float64) ** 2
        if float(sq.sum()) - float(sq[first].sum()) <= budget:
            return first
        order = np.argsort(sq, kind="stable")  # ascending: the tail that may stay comes first
        kept = int(np.searchsorted(np.cumsum(sq[order]), budget, side="right"))
        return np.sort(order[kept:])  # everything above the part whose squares fit the budget

    def answer(self, since: int) -> Answer:
        """The message for a worker that holds ``w_pub`` at version ``since`` (-1: none).
        Workers that pulled together hold the same version, so until the next publish an
        answer is made once per ``since`` and then shared (it is never written to)."""
        behind = self.pub - since
        if since < 0 or behind < 0 or behind > len(self.log):
            since = -1
        made = self._made.get(since)  # emptied by every publish
        if made is None:
            made = self._made[since] = self._answer(since, behind)
        self.answers["dense" if made.since < 0 else "update"] += 1
        return made

    def _answer(self, since: int, behind: int) -> Answer:
        if since < 0:
            return self._dense()
        if behind == 0:
            return Answer(self.pub, since, SparseVector.empty(self.n))
        idx = self.log[-1] if behind == 1 else self._union(behind)
        if idx.size > self.dense_fraction * self.n:
            return self._dense()
        return Answer(self.pub, since, SparseVector(idx, self.w_pub[idx], self.n))

    def wire_values(self, answer: Answer) -> str:
        """The value type an answer goes out in (``wire_values``)."""
        return wire_values(self.values, answer)

    def _union(self, behind: int) -> np.ndarray:
        """(m,) uint32 sorted coordinates of the last ``behind`` publishes, each once
        (``sparse.union_of``: sorted when few, an (n,) mask when many)."""
        return union_of([self.log[-j] for j in range(1, behind + 1)], self.n)

    def _dense(self) -> Answer:
        return Answer(self.pub, -1, self.w_pub.copy())


class ExactDownlink:
    """The exact downlink: a PULL that holds version ``since`` of the weights gets the entries
    changed after it (the group's change log, ``core/changelog.py``) at their values now. The
    worker then holds the weights themselves, bit for bit: no published copy, no residual, no
    drift, and O(changes since) work per answer (the whole weights when the log cannot say, or
    when the changes pass ``dense_fraction`` of n). Versions are the change log's."""

    last_drift = 0.0  # the answers are exact (with "f16" values, to float16's rounding)

    def __init__(self, weights: np.ndarray, changes: ChangeLog, *,
                 dense_fraction: float = DENSE_FRACTION, values: str = "f32") -> None:
        if values not in VALUES:
            raise ValueError(f"bad downlink values {values}: {' | '.join(VALUES)}")
        # "f16": an update's values go out rounded to float16, 2 bytes each; the worker's copy
        # is then the weights to float16's rounding where an update set it (within 2^-11 of
        # each value, not growing: every update sets values, it adds nothing), exact elsewhere
        self.values = values
        self.weights = weights  # the group's (n,) float32 weights (``moved`` follows them)
        self.changes = changes
        self.dense_fraction = dense_fraction
        self.answers = {"update": 0, "dense": 0}  # answers given, by kind
        self._made: dict[int, Answer] = {}  # answers of version ``_made_at``, by ``since``
        self._made_at = changes.version

    @property
    def pub(self) -> int:
        """The version a worker is brought to: the change log's."""
        return self.changes.version

    def drift_now(self) -> float:
        return 0.0

    def counts(self) -> dict[str, int]:
        """No publishes to count."""
        return {}

    def finite(self) -> bool:
        """Every answer is checked as it is made (``check_finite``)."""
        return True

    def publish(self, weights: np.ndarray) -> int:
        """Nothing to publish: every answer reads the weights as they are."""
        return 0

    def moving(self, weights: np.ndarray, idx: np.ndarray | None) -> Any:
        return None

    def moved(self, weights: np.ndarray, idx: np.ndarray | None, before: Any) -> None:
        """The weights changed (the array may be a new one: a rebase)."""
        self.weights = weights

    def answer(self, since: int) -> Answer:
        """The message for a worker that holds the weights at version ``since`` (-1: none);
        made once per ``since`` and version, then shared (it is never written to)."""
        if self._made_at != self.changes.version:
            self._made.clear()
            self._made_at = self.changes.version
        made = self._made.get(since)
        if made is None:
            made = self._made[since] = self._answer(since)
        self.answers["dense" if made.since < 0 else "update"] += 1
        return made

    def _answer(self, since: int) -> Answer:
        n = int(self.weights.size)
        idx = self.changes.since(since) if since >= 0 else None
        if idx is None or idx.size > self.dense_fraction * n:
            return Answer(self.pub, -1, self.weights.copy())
        return Answer(self.pub, since, SparseVector(idx, self.weights[idx], n))

    def wire_values(self, answer: Answer) -> str:
        """The value type an answer goes out in (``wire_values``)."""
        return wire_values(self.values, answer)


def wire_values(values: str, answer: Answer) -> str:
    """The value type ``answer`` goes out in: ``values``, unless the answer is dense or one of
    its values is past float16's range (then ``"f32"``: the copy stays within the rounding)."""
    payload = answer.payload
    if values == "f32" or not isinstance(payload, SparseVector):
        return "f32"
    fits = payload.values.size == 0 or float(np.abs(payload.values).max()) <= F16_MAX
    return "f16" if fits else "f32"


def sq_norm(x: np.ndarray) -> float:
    """``sum(x^2)`` in float64 (float32's would overflow past 1.8e19 per entry), in chunks so
    that no (n,) float64 copy is made."""
    total = 0.0
    for lo in range(0, x.size, SQ_CHUNK):
        part = x[lo:lo + SQ_CHUNK].astype(np.float64)
        total += float(np.dot(part, part))
    return total


def _relative(gap2: float, wsq: float) -> float:
    """sqrt(gap2 / wsq): 0 when both are zero, inf when only the weights are."""
    if wsq:
        return math.sqrt(gap2 / wsq)
    return 0.0 if gap2 == 0 else math.inf


class Diverged(RemoteProtocolError):
    """The group's weights hold NaN or inf (finite pushes can overflow float32): the PULL
    being answered gets ERROR ``diverged`` instead of WEIGHTS. A RemoteProtocolError so that
    the shell's rejection path (ERROR ``code``, then close) carries it; no weight that is not
    finite ever goes out."""

    code = "diverged"


def check_finite(payload: SparseVector | np.ndarray, group: int,
                 weights_finite: bool = True) -> None:
    """Raise ``Diverged`` unless every value a WEIGHTS would carry is finite (one float64 sum:
    NaN and inf propagate, float32 values cannot overflow it; O(what is sent)) and so are the
    weights themselves as far as the caller knows (``weights_finite``: the compressed
    downlink's float64 sums of their squares, finite until a weight is not, even one that the
    published copy still lags)."""
    values = payload.values if isinstance(payload, SparseVector) else payload
    if not weights_finite or not np.isfinite(np.sum(values, dtype=np.float64)):
        raise Diverged(f"group {group}'s weights hold NaN or inf: the model diverged; try a "
                       "lower --lr", got=int(np.count_nonzero(~np.isfinite(values))))


def group_downlink(run: RunConfig, weights: np.ndarray,
                   changes: ChangeLog) -> Downlink | ExactDownlink | None:
    """How a group answers PULLs (``RunConfig.down_mode``): ``exact``, the changes since the
    version held at their values now; ``auto``, the compressed downlink when its kept fraction
    (``downlink_ratio``) is below 1, else the weights whole (None)."""
    if run.down_mode == "exact":
        return ExactDownlink(weights, changes, values=run.down_values)
    down = run.downlink_ratio()
    if down >= 1:
        return None
    return Downlink(weights, down, drift=run.down_drift, values=run.down_values,
                    changes=changes)


def trusted_since(named: int, last_sent: int) -> int:
    """The ``since`` of a PULL the group server can trust (the version its worker's copy is at):
    the ``since`` it names only if that is the version of the last WEIGHTS sent on the same
    connection (docs/protocol.md, section 3); else -1, and the answer is dense. A reconnect,
    a worker moved from another group or a client that keeps no copy thus get the whole
    weights, and a wrong ``since`` can never make a copy drift."""
    return named if named == last_sent else -1


def apply_weights(replica: np.ndarray | None, held: int, w: Any, size: int) -> np.ndarray:
    """The weights WEIGHTS ``w`` brings a copy at version ``held`` to: its buffers whole
    (``since`` -1), or ``replica`` with the coordinates they name set to their values (an
    update must start from the version held). Raises RemoteProtocolError for a bad one."""
    got = decode_vector(w.payload, size)
    if w.since < 0:
        return np.asarray(got.to_dense() if isinstance(got, SparseVector) else got)
    if replica is None or w.since != held or not isinstance(got, SparseVector):
        raise RemoteProtocolError("WEIGHTS update does not fit the copy held",
                                  expected=held, got=w.since)
    set_into(replica, got)
    return replica
