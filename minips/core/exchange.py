"""The exchange between a group server and the global server, both halves: what a group sends,
what the global server answers, and the rules that make each exchange count exactly once, across
a lost reply and across a resumed global server (numpy, sans-IO: no asyncio, no torch).

The arithmetic. Every exchange sends (part of) what the group applied since the last one and takes
(part of) the global weights back:

    s       = topk(sent - w_sync)        sent = the group's weights when the exchange starts
    w       = w_sync' + (w - w_sync - s) what was not sent, or applied meanwhile, is kept
    w_sync' = the group's copy of the global weights after the reply

The kept fraction is ``exchange_ratio(run)``, both ways (1.0: dense, ``s = sent - w_sync``, and
the reply is the global weights G whole, so ``w = G + (w - sent)``, ``w_sync = G``).
``Outgoing.sent`` keeps ``w_sync + s`` (the weights at the entries sent, ``w_sync`` elsewhere), so
the rebase is one line whatever the ratio: ``w += w_sync' - sent``. The exchange that flushes a
group at the end (``final``, or after ``done``) sends everything left (dense).

The two halves. A group's ``GroupSync`` keeps the delta bookkeeping (``begin`` gives the
``Outgoing``, ``complete`` takes the ``ExchangeResult``); its shell carries the exchange through a
``GroupLink``. The global server keeps, per group, a ``GroupMirror``: ``known``, the exact copy the
group holds of the global weights (its ``w_sync``), and answers an exchange with the entries where
G and ``known`` differ most: ``idx = topk(G - known)``, sent as ``G[idx]`` (values to *set*, not to
add), and ``known[idx] = G[idx]``. What a sparse exchange leaves behind stays in ``w - w_sync``
(up) or in ``G - known`` (down) and goes with a later one: error feedback by bookkeeping, nothing
is lost. Answers are dense (``G`` itself, the group takes it whole as ``w_sync``) when the ratio
is 1 (no mirror is kept then), when the mirror is unknown (a new group, a global server resumed
from its checkpoint: ``known`` is not saved), and when the sparse answer would be nearly dense
(``DENSE_AT``). A group process's PULL (registering, adopting, reconnecting) answers with ``G``
dense, so the mirror is reset to it (``GroupMirror.reset``).

Exactly once and resume. Each exchange carries ``session`` and ``seq``; a repeat is answered
without merging again, and a group process sends again what a resumed global server lacks: the
rules and their bookkeeping (``Merged``, ``Unsaved``) are ``core/replay.py``'s. When a reply is
lost the exchange stays *pending* (``GroupSync.pending``) and goes again unchanged.

Progress. ``cluster_samples()`` estimates how many samples all groups have trained on: the
global server's count in the last reply plus this group's samples counted since the exchange it
answered began (for lr schedules). With one group it is exact. ``share`` is the group's share
of the cluster's samples, from the samples each reply counts (its momentum follows it:
``GroupCore._follow_share``); one group's is 1.

Staleness between groups. Groups exchange asynchronously, so a group's delta was computed on
global weights that other groups' merges have passed since. The global server marks, per group,
the ``SyncPoint`` its copy was last brought up to (the global version, the group's own merges
then, the time: each reply, each PULL) and, at the merge of the group's next exchange, counts
``missed`` (other groups' merges since) and ``base_age_s`` (seconds since).

Work per exchange. Given the indices the group's weights changed at since the last exchange
began (its change log, ``core/changelog.py``), ``begin`` looks for ``s`` only among them and
those the last exchange left unsent (``left``), and ``complete`` rebases only the entries ``s``
and a sparse reply name: O(changes), the same ``s`` as over all n. The global server's
``GroupMirror`` does the same with its own log and its own ``left``.

The exact exchange (``RunConfig.xchg_mode`` "exact": ``ExactSync``, ``ExactMirror``). The group
sends every entry it changed since its last exchange began, at ``w - w_sync`` (no top-k, no
``left``); the global server answers with every entry its change log names after the version
that group holds (no ``known`` copy, no top-k): the first answer to a group whose version it
does not know (a new one, a resumed server) is dense, as is one past ``DENSE_AT``. ``w_sync`` is
kept as before-values (``BeforeValues``: copy on first write, as pushes land), so a group holds
one copy of the model and the global server none per group. Every message path is then
O(changes); the bytes on the hop are the changes, not k. Exactly once and resume are the rules
above, unchanged: the same (session, seq), and a repeat is answered from the version the group
held when it sent it.

Invariants: ``w_sync`` is the group's exact copy of what the global server holds for it
(``known``, or G after a dense reply); ``pending`` is either None or the one exchange whose fate
is unknown. When ``known`` is not None, a group that got every reply holds ``known`` exactly, and
one that lost the last replies holds ``known`` except at ``unacked``.
"""

from __future__ import annotations

import collections
import secrets
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from minips import sparse
from minips.compress.selection import TopKSelector, kept_count, top_among
from minips.core.changelog import ChangeLog, kept_record, union_sorted
from minips.core.replay import Tally, Unsaved
from minips.sparse import SparseVector
from minips.wire import messages

__all__ = [
    "DENSE_AT",
    "GroupMirror",
    "TopDiff",
    "exchange_ratio",
    "BETWEEN_GROUPS",
    "SyncPoint",
    "ExchangeResult",
    "GroupLink",
    "Outgoing",
    "GroupSync",
    "SHARE_EMA",
    "MIN_SHARE",
    "Delta",
    "exchange_message",
    "XCHG_MODES",
    "BeforeValues",
    "ExactSync",
    "ExactMirror",
    "group_sync",
    "group_mirror",
]


# answered PULLs one exchange reports, the latest: a received msgpack array holds at most 4096
# items (checks.Limits.max_array_len; more is ERROR limit_exceeded), so a group process never
# sends more; exchanges come every few pushes, so only a group cut off from its global server
# for long has more
MAX_PULLS = 4096

# -- the kept fraction, and the global server's copy of each group's ---------------------------

DENSE_AT = 0.5  # an answer with more than this fraction of entries goes dense (smaller then)


def exchange_ratio(run: Any) -> float:
    """The exchange's kept fraction (both ways): ``run.xchg_ratio``, or when unset the run's
    ``ratio`` with a sparse compressor and 1.0 (dense) with a dense one (``registry.is_sparse``:
    ``none``, ``fp16``)."""
    if run.xchg_ratio is not None:
        return float(run.xchg_ratio)
    from minips.compress.registry import is_sparse  # the plug-ins load with a run, not the rules

    return float(run.ratio) if is_sparse(run.compressor) else 1.0


class GroupMirror:
    """The global server's mirror of what one group holds of the global weights (``known[g]``)
    and the indices of the replies it may have lost."""

    def __init__(self, size: int, ratio: float) -> None:
        self.ratio = ratio
        self._top = TopDiff(size, kept_count(ratio, size))  # the entries a sparse answer sets
        self.known: np.ndarray | None = None  # (n,) float32; None: unknown, answer dense
        self.unacked = np.empty(0, np.uint32)  # indices sent since the group's last new seq
        self.dense_unacked = False  # a dense answer went out since the group's last new seq
        # where known may differ from G beyond the changes G's log holds after version ``mark``
        # ((m,) uint32 sorted; None: anywhere): the next answer looks only there
        self.left: np.ndarray | None = None
        self.mark = 0

    def reset(self, weights: np.ndarray | None = None, version: int = 0) -> None:
        """The group took ``weights`` whole (a dense answer or a PULL; ``version``: the global
        change log's then); None: unknown."""
        keep = weights is not None and self.ratio < 1.0
        self.known = np.array(weights, dtype=np.float32) if keep else None
        self.unacked = np.empty(0, np.uint32)
        self.dense_unacked = False
        self.left, self.mark = np.empty(0, np.uint32), version

    def answer(self, weights: np.ndarray, repeat: bool,
               changes: ChangeLog | None = None) -> np.ndarray | SparseVector:
        """The reply to an exchange, the global weights being ``weights`` after its merge:
        a (n,) copy (dense) or the entries to set (sparse). ``repeat``: the exchange repeats
        the last one (its reply may have been lost). ``changes``: the global weights' change
        log; with it the answer costs O(changes since the last one), else O(n)."""
        if self.known is None or self.ratio >= 1.0 or (repeat and self.dense_unacked):
            return self._dense(weights, changes)
        changed = None if changes is None or self.left is None else changes.since(self.mark)
        where = None if changed is None or self.left is None else sparse.union_of(
            [self.left, changed], weights.size)
        idx, _, self.left = self._top.top(weights, self.known, where)  # (p,) uint32 sorted
        self.mark = 0 if changes is None else changes.version
        self.known[idx] = weights[idx]
        if repeat:
            idx = sparse.unique_sorted(np.concatenate([self.unacked, idx]))
        if idx.size > DENSE_AT * weights.size:
            return self._dense(weights, changes)
        self.unacked, self.dense_unacked = idx, False
        return SparseVector(idx, self.known[idx], weights.size)

    def _dense(self, weights: np.ndarray, changes: ChangeLog | None) -> np.ndarray:
        out = np.array(weights, dtype=np.float32)
        self.reset(out, 0 if changes is None else changes.version)
        self.dense_unacked = True  # if it is lost, the group's copy is anything: dense again
        return out


class TopDiff:
    """The k entries where a vector differs most from a copy of it: looked for among the
    candidates a change log gives (O(candidates)), or over all n (``TopKSelector``, as before
    the log) when there are none or more than n / ``WIDE`` (then one contiguous pass is the
    cheaper one). Both give the exact top-k, ties to the lowest index, zeros left out."""

    WIDE = 8

    def __init__(self, size: int, k: int) -> None:
        self.size, self.k = size, k
        self._selector: TopKSelector | None = None  # made on the first pass over n

    def top(self, now: np.ndarray, copy: np.ndarray, where: np.ndarray | None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(p,) uint32 sorted indices of the k largest ``|now - copy|``, ``now - copy`` there
        ((p,) float32), and where the two may still differ elsewhere ((m,) uint32 sorted; None:
        anywhere). ``where``: the candidates, a superset of where they differ (None: unknown)."""
        if where is None or where.size > self.size // self.WIDE:
            diff = now - copy  # (n,) float32
            if self._selector is None:
                self._selector = TopKSelector(self.size)
            idx = self._selector.select(diff, self.k)  # (k,) int64 sorted
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


# -- the staleness between groups: what a group's exchange was computed without ---------------

BETWEEN_GROUPS = ("missed", "base_age_s")  # a merge line's staleness between groups


@dataclass(frozen=True)
class SyncPoint:
    """The global weights a group's copy was last brought up to, as the global server sent them
    (an exchange's reply, a PULL's GLOBAL_WEIGHTS, or the weights a group opened with): the
    global ``version`` then (merges applied), the group's own ``merges`` by then, and ``at``,
    when (the core's ``now``, seconds). A sparse reply brings the copy up to date only at the
    entries it sets (the rest follows with later replies), so a figure counted from it is a
    lower bound of what the copy lacks."""

    version: int
    merges: int
    at: float

    def between_groups(self, version: int, merges: int, now: float) -> dict[str, Any]:
        """The between-group staleness of the group's exchange merged at ``now``, the global
        weights being at ``version`` before it and the group having ``merges`` merges so far:
        ``missed``, the merges of other groups since this point (the global versions its delta
        was computed without; its own merges never count), and ``base_age_s``, the seconds
        since the weights it rebased on were sent."""
        return {"missed": (version - self.version) - (merges - self.merges),
                "base_age_s": round(now - self.at, 6)}  # to the µs: short record lines


# -- the group's half: the delta, its counters, the rebase ------------------------------------

Delta = np.ndarray | SparseVector  # (n,) float32 dense, or the entries sent


@dataclass
class ExchangeResult:
    """What the global server answers to a group's delta."""

    weights: Delta  # (n,) float32 global weights after the merge (a private copy), or the
    # entries of the group's copy to set to their global values (``GroupMirror.answer``)
    version: int  # global version (merges applied so far)
    done: bool  # the run's budget is spent: stop training
    samples: int = 0  # training samples all groups reported so far (for lr schedules)
    saved: list[int] | None = None  # this session's seqs in the server's last two snapshots
    bytes_up: int = 0  # bytes this exchange carried to the global server (as on the wire)
    bytes_down: int = 0  # bytes its reply carried back
    # the EXCHANGE_REPLY made to count those bytes, sent as it is to a group process (its
    # payload encoded once)
    reply: messages.ExchangeReply | None = None


class GroupLink(Protocol):
    """How a group server reaches the global server (in-process call or TCP)."""

    async def exchange(self, group: int, delta: Delta,
                       stats: dict[str, Any]) -> ExchangeResult:
        """Send this group's delta and counters; return the merged global weights."""
        ...


@dataclass
class Outgoing:
    """One exchange on its way: what it sends, the weights that covers, its counters (seq)."""

    # w_sync + s: (n,) float32 (a dense exchange), or s's entries at the group's weights there
    # (sparse: w_sync elsewhere)
    sent: np.ndarray | SparseVector
    stats: dict[str, Any]  # counters since the previous exchange, plus session and seq
    delta: Delta  # s, sent again unchanged while the exchange is pending
    # the exact exchange (``ExactSync``): (p,) float32 w_sync at ``sent``'s entries, the
    # before-values the exchange covers (what the group's copy holds there until the reply)
    synced: np.ndarray | None = None


SHARE_EMA = 0.25  # GroupSync.share: the weight of the newest exchange in the running mean
MIN_SHARE = 1 / 64  # GroupSync.share's floor (a group of one worker among 64 equal ones)


class GroupSync:
    """A group's side of the exchange: its copy of the global weights (``w_sync``), the delta
    since, the seq and the counters (see the module docstring; the EXCHANGE message it sends is
    ``messages.Exchange``)."""

    def __init__(self, weights: np.ndarray, session: int | None = None,
                 ratio: float = 1.0) -> None:
        self.w_sync = np.array(weights, dtype=np.float32)  # (n,) the group's copy of global
        self.ratio = ratio  # kept fraction of each exchange (1.0: dense)
        self._top = TopDiff(self.w_sync.size, kept_count(ratio, self.w_sync.size))  # s's entries
        # where the weights may differ from w_sync beyond the changes since the last exchange
        # began ((m,) uint32 sorted; None: anywhere): a sparse exchange looks only there
        self.left: np.ndarray | None = np.empty(0, np.uint32)
        self._start(session)

    def _start(self, session: int | None) -> None:
        """The seq, the pending exchange and the counters of a group that has sent nothing."""
        self.session = secrets.randbits(52) if session is None else session  # fits a double
        self.seq = 0  # seq of the last exchange started
        self.pending: Outgoing | None = None  # an exchange whose reply was lost
        self.since = _zero()  # worker pushes since the last exchange started
        # (worker, lead, wait in us) of each PULL answered since then, the latest MAX_PULLS
        self.pulls: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=MAX_PULLS)
        self.global_samples = 0  # all groups' samples, as the last reply said
        self.samples_after = 0  # this group's samples counted since that reply
        # this group's share of the cluster's samples (``share_of``): 1 until two replies
        self.share = 1.0
        self._replied: int | None = None  # the samples the last reply counted, None: none yet
        self._measured = False  # share was measured once (the first measure is taken whole)
        self.unsaved: Unsaved | None = None  # once the server names its snapshots (resume)
        self.lost_track = 0  # resumes whose lost exchanges this record could not name

    def count(self, samples: int, step_time: float, loss: float) -> None:
        """Account one worker push for the next exchange's counters."""
        s = self.since
        s["pushes"] += 1
        s["samples"] += samples
        s["step_time"] += step_time
        s["loss"] += loss
        self.samples_after += samples

    def pulled(self, w: int, lead: int, held_s: float) -> None:
        """Account one answered PULL of worker ``w`` (``lead`` clocks ahead of its group's
        slowest worker, held ``held_s`` by the SSP bound) for the next exchange's counters."""
        self.pulls.append((w, max(0, lead), max(0, round(held_s * 1e6))))

    def moving(self, weights: np.ndarray, idx: np.ndarray | None) -> None:
        """The weights are about to change at ``idx``: nothing to keep (``ExactSync`` keeps
        ``w_sync`` there)."""

    def begin(self, weights: np.ndarray, extra: dict[str, Any], dense: bool = False,
              changed: np.ndarray | None = None) -> Outgoing:
        """The pending exchange again, or a new one covering ``weights`` (``extra`` joins its
        counters: version, final, traffic, clocks); ``dense``: send all of it (a flush).
        ``changed``: the indices the weights changed at since the last exchange began (the
        group's change log; None: unknown): a sparse exchange then costs O(changes), not O(n)."""
        if self.pending is not None:
            return self.pending
        s, n = self.since, max(1, self.since["pushes"])
        self.seq += 1
        stats = {"pushes": s["pushes"], "samples": s["samples"], "step_time": s["step_time"] / n,
                 "loss": s["loss"] / n, **extra, "session": self.session, "seq": self.seq,
                 **_columns(self.pulls)}
        self.since = _zero()
        self.pulls.clear()
        self.pending = self._outgoing(weights, stats, dense, changed)
        return self.pending

    def _outgoing(self, weights: np.ndarray, stats: dict[str, Any], dense: bool,
                  changed: np.ndarray | None) -> Outgoing:
        """``s``: all of ``weights - w_sync`` (dense) or its top entries; ``left`` becomes
        where the weights then still differ from ``sent`` (what the exchange leaves behind)."""
        if dense or self.ratio >= 1.0:
            self.left = np.empty(0, np.uint32)
            return Outgoing(weights.copy(), stats, weights - self.w_sync)
        where = None if changed is None or self.left is None else sparse.union_of(
            [self.left, changed], self.w_sync.size)
        idx, diff, self.left = self._top.top(weights, self.w_sync, where)  # (p,) sorted
        n = self.w_sync.size
        return Outgoing(SparseVector(idx, weights[idx], n), stats, SparseVector(idx, diff, n))

    def touches(self, out: Outgoing, res: ExchangeResult) -> np.ndarray | None:
        """(m,) uint32 sorted: the entries of the group's weights ``complete`` changes (those
        ``out`` sent and those the reply sets), or None when it may change any (dense)."""
        if isinstance(out.sent, np.ndarray) or isinstance(res.weights, np.ndarray):
            return None
        return sparse.union_of([out.sent.indices, res.weights.indices], self.w_sync.size)

    def complete(self, weights: np.ndarray, out: Outgoing, res: ExchangeResult) -> None:
        """The global server answered ``out``: rebase ``weights`` (in place) on its weights,
        ``weights += w_sync' - sent``: over all n when the exchange or its reply is dense, else
        at the entries either names only (``touches``; zero elsewhere)."""
        self._rebase_on(weights, out, res)
        self._settle(weights, out, res)

    def _rebase_on(self, weights: np.ndarray, out: Outgoing, res: ExchangeResult) -> None:
        """``complete``'s arithmetic: the weights and ``w_sync`` after the reply."""
        if isinstance(out.sent, np.ndarray):
            new = self.synced(res.weights)
            weights += new - out.sent
        elif isinstance(res.weights, np.ndarray):
            new = res.weights
            step = new - self.w_sync  # (n,) float32: w_sync' - sent outside s
            step[out.sent.indices] = new[out.sent.indices] - out.sent.values
            weights += step
        else:
            new = self.w_sync  # set in place: O(entries), no (n,) copy
            touched = self.touches(out, res)
            assert touched is not None
            sent = new[touched]  # (m,) w_sync, with s's entries at the weights sent
            sent[np.searchsorted(touched, out.sent.indices)] = out.sent.values
            new[res.weights.indices] = res.weights.values
            weights[touched] += new[touched] - sent
        self.w_sync = new

    def _settle(self, weights: np.ndarray, out: Outgoing, res: ExchangeResult) -> None:
        """``complete``'s bookkeeping: the resume record, the pending exchange, the counters."""
        if res.saved is not None:  # a `minips group` process: keep what a resume would lack
            seq = out.stats["seq"]
            self.unsaved = self.unsaved or Unsaved(weights.size, start=seq - 1)
            self.unsaved.merged(seq, out.delta, out.stats["samples"], res.saved)
        self.pending = None
        # the reply counts the samples up to ``out``; those counted since it began come on top
        self.global_samples, self.samples_after = res.samples, self.since["samples"]
        self.share_of(int(out.stats["samples"]), res.samples)

    def share_of(self, own: int, replied: int) -> None:
        """Follow this group's share of the cluster's samples: of the samples the global server
        counted between its last two replies (``replied``: this one's count), ``own`` were this
        group's (its exchange carried them). The first measure is taken whole, later ones are
        smoothed over about 4 exchanges (``SHARE_EMA``); kept in [``MIN_SHARE``, 1]; one
        group's share stays 1."""
        last, self._replied = self._replied, replied
        if last is None or replied <= last or own <= 0:
            return  # the first reply (a group that starts late), a repeat, or nothing trained
        now = min(1.0, max(MIN_SHARE, own / (replied - last)))
        self.share = self.share + SHARE_EMA * (now - self.share) if self._measured else now
        self._measured = True

    def synced(self, reply: Delta) -> np.ndarray:
        """(n,) float32 the group's copy of the global weights after ``reply``: the dense
        weights themselves, or ``w_sync`` with the reply's entries set."""
        if isinstance(reply, np.ndarray):
            return reply
        new = self.w_sync.copy()
        new[reply.indices] = reply.values
        return new

    def cluster_samples(self) -> int:
        """All groups' samples as of the last reply, plus this group's since then."""
        return self.global_samples + self.samples_after

    def rebase(self, weights: np.ndarray, g: np.ndarray,
               server_seq: int | None = None) -> tuple[np.ndarray, Tally | None]:
        """Reconnected to a (restarted) global server whose weights are ``g`` and which holds
        this session's exchanges up to seq ``server_seq`` (None: it did not say): return the group's
        weights on top of ``g`` and what the server lost of the exchanges before the pending
        one (it goes out again with the next exchange: ``Unsaved``); a pending exchange keeps
        its delta."""
        local = weights - self.w_sync  # (n,) applied here, not known to be held globally
        sent = None if self.pending is None else self.pending.sent
        if isinstance(sent, np.ndarray):
            sent[:] = g + (sent - self.w_sync)
        elif sent is not None:  # s's entries, moved onto g as the dense ones are
            at = sent.indices
            sent.values[:] = g[at] + (sent.values - self.w_sync[at])
        self.w_sync = np.array(g, dtype=np.float32)
        self.left = None  # the weights are g + local now: anywhere may differ
        replay = self.replay(server_seq)
        if replay is not None:
            local += replay.delta
            self.since["samples"] += replay.samples
        return g + local, replay

    def replay(self, server_seq: int | None) -> Tally | None:
        """What the server lost of this session's exchanges, when ``server_seq`` says it."""
        if server_seq is None:
            return None
        pending = None if self.pending is None else self.pending.stats["seq"]
        if self.unsaved is not None:
            replay = self.unsaved.restore(server_seq, pending)
        elif self.seq - (pending is not None) == 0:  # no reply yet: nothing it could lack
            replay = Tally.zero(self.w_sync.size)
        else:  # the replies so far named no snapshot (an older global server)
            replay = None
        if replay is None:
            self.lost_track += 1
        return replay

    def state_dict(self) -> dict[str, Any]:
        """The seq, and the counters of the pushes since the last exchange: the group's
        weights a checkpoint keeps hold those pushes, so the next exchange after a resume
        must count their samples (the soak found them merged with 0)."""
        return {"session": self.session, "seq": self.seq, "since": dict(self.since)}

    def load_state_dict(self, state: dict[str, Any], w_sync: np.ndarray) -> None:
        self.session, self.seq = int(state["session"]), int(state["seq"])
        since = state.get("since") or {}  # absent in older checkpoints: from 0, as before
        self.since = {k: type(v)(since.get(k, v)) for k, v in _zero().items()}
        self.w_sync = np.array(w_sync, dtype=np.float32)
        self.left = None  # the weights come from the checkpoint too: anywhere may differ


def _columns(pulls: collections.deque[tuple[int, int, int]]) -> dict[str, list[int]]:
    """The answered PULLs as EXCHANGE's three lists (``pull_workers``, ``pull_leads``,
    ``pull_waits_us``), one entry per PULL."""
    names = ("pull_workers", "pull_leads", "pull_waits_us")
    return {k: [p[i] for p in pulls] for i, k in enumerate(names)}


def _zero() -> dict[str, Any]:
    return {"pushes": 0, "samples": 0, "step_time": 0.0, "loss": 0.0}


def exchange_message(delta: Delta, stats: dict[str, Any]) -> messages.Exchange:
    """The EXCHANGE that carries one exchange of a group to the global server: ``delta``
    (dense or sparse) and the group's counters as its fields (a clock of None: -1, none;
    counters the message has no field for stay home)."""
    counters: dict[str, Any] = {k: -1 if v is None else v for k, v in stats.items()
                if k in messages.Exchange.INFO}
    return messages.Exchange(**counters, payload=sparse.encode_vector(delta))


# -- the exact exchange: every change, both ways, O(changes) -----------------------------------

XCHG_MODES = ("topk", "exact")  # RunConfig.xchg_mode


HELD, MARK = np.uint8(1), np.uint8(2)  # BeforeValues' mask: a before-value; covers' mark


class BeforeValues:
    """The group's copy of the global weights (``w_sync``) kept where it differs from the
    group's weights only: each entry's value before its first change since the record began
    (copy on first write), O(k) a change. A dense change (the optimizer on the servers), a
    new global server or a checkpoint's copy make it dense: every entry's value, a (n,) copy,
    until the next exchange begins. Invariant: the weights equal ``w_sync`` at every entry the
    record does not hold."""

    def __init__(self, size: int) -> None:
        self.size = size
        # (n,) uint8 per entry: HELD, it holds a before-value; MARK, ``covers`` marks it
        self._held = np.zeros(size, dtype=np.uint8)
        self._idx: list[np.ndarray] = []  # chunks of (c,) uint32, in the order first written
        self._val: list[np.ndarray] = []  # (c,) float32, their before-values
        self.dense: np.ndarray | None = None  # (n,) float32 every before-value; None: sparse
        self._tidy = True  # _idx is one chunk, increasing (or none)

    def save(self, weights: np.ndarray, idx: np.ndarray | None) -> None:
        """The weights are about to change at ``idx`` ((k,) distinct indices; None: anywhere):
        keep the values of those not held yet."""
        if self.dense is not None:
            return
        if idx is None:
            self.set_dense(self.materialize(weights))
            return
        new = np.asarray(idx).astype(np.intp)  # converted once, not at every fancy index
        fresh = self._held[new] == 0  # (k,) not changed since the record began
        if not fresh.all():
            new = new[fresh]
        if new.size:
            self._held[new] = HELD
            self._idx.append(new.astype(np.uint32))
            self._val.append(weights[new])
            self._tidy = False

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(m,) uint32 increasing indices held and (m,) float32 their before-values (sparse
        record only); consolidated once, then kept so."""
        assert self.dense is None
        if not self._idx:
            return np.empty(0, np.uint32), np.empty(0, np.float32)
        if not self._tidy:
            idx, val = np.concatenate(self._idx), np.concatenate(self._val)
            if idx.size > 1 and not (idx[1:] > idx[:-1]).all():  # one sorted push: as it is
                order = np.argsort(idx, kind="stable")  # sorted chunks: a merge of runs
                idx, val = idx[order], val[order]
            self._idx, self._val, self._tidy = [idx], [val], True
        return self._idx[0], self._val[0]

    def at(self, weights: np.ndarray, where: np.ndarray) -> np.ndarray:
        """(p,) float32 ``w_sync`` at ``where`` ((p,) uint32 increasing): the before-value
        where one is held, the weights elsewhere."""
        if self.dense is not None:
            return self.dense[where]
        out = weights[where]
        pos, hit = self._find(where)
        out[hit] = self.items()[1][pos[hit]]
        return out

    def update(self, where: np.ndarray, values: np.ndarray) -> None:
        """``w_sync`` at ``where`` ((p,) uint32 increasing) became ``values``: the held
        before-values there follow (an entry not held stays so: the weights are it)."""
        if self.dense is not None:
            self.dense[where] = values
            return
        pos, hit = self._find(where)
        self.items()[1][pos[hit]] = values[hit]

    def _find(self, where: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = self.items()[0]
        pos = np.searchsorted(idx, where)  # (p,) int64
        np.minimum(pos, max(0, idx.size - 1), out=pos)
        hit = idx[pos] == where if idx.size else np.zeros(where.size, dtype=np.bool_)
        return pos, hit

    def covers(self, big: np.ndarray, small: np.ndarray) -> bool:
        """Every index of ``small`` is in ``big`` (both distinct): marked in the record's
        mask and counted, O(big + small) with no sort (the mask is left as it was)."""
        held = self._held
        held[small] |= MARK
        found = int(np.count_nonzero(held[big] & MARK))
        held[small] &= HELD
        return found == small.size

    def materialize(self, weights: np.ndarray) -> np.ndarray:
        """(n,) float32 ``w_sync`` whole (a new array: O(n), for checkpoints and resumes)."""
        if self.dense is not None:
            return self.dense.copy()
        out = np.array(weights, dtype=np.float32)
        idx, val = self.items()
        out[idx] = val
        return out

    def take(self, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every entry where the weights differ from ``w_sync`` ((m,) uint32 increasing) and
        ``w_sync`` there; the record starts again, empty."""
        if self.dense is not None:
            idx = np.flatnonzero(weights != self.dense).astype(np.uint32)  # NaN differs too
            val = self.dense[idx]
        else:
            idx, val = self.items()
        self.set_dense(None)
        return idx, val

    def set_dense(self, values: np.ndarray | None) -> None:
        """``w_sync`` is ``values`` whole ((n,) float32, kept as it is), or (None) the
        weights themselves: the record empty."""
        if self.dense is None and self._idx:
            self._held[self.items()[0]] = 0
        self._idx, self._val, self.dense, self._tidy = [], [], values, True


class ExactSync(GroupSync):
    """A group's side of the exact exchange: every entry it changed since the last exchange
    began goes up at its delta, ``w - w_sync`` (no top-k, nothing left behind); the reply sets
    every entry the global weights changed at since the version this group holds. ``w_sync``
    is kept as before-values (``BeforeValues``), so the group holds one copy of the model: the
    weights. The shell calls ``moving`` before each change of the weights by a push (the rebase
    of ``complete`` is not one: the record follows it by itself).

    The arithmetic is ``GroupSync``'s dense rule restricted to the entries it can change:
    ``sent`` = the weights at the begin, at the entries that differ from ``w_sync`` (``S``);
    after the reply (the entries ``R`` at ``G``'s values, or ``G`` whole) ``w_sync' = G`` there
    and ``w = w_sync' + (w - sent)`` at ``S | R``: exact (the reply's own values) where nothing
    was pushed in between, one float32 sum where something was."""

    def __init__(self, weights: np.ndarray, session: int | None = None) -> None:
        self.ratio = 1.0  # everything that changed goes: no kept fraction
        self.left = None
        self.weights = weights  # the group's (n,) float32 weights (kept up to date by the calls)
        self.before = BeforeValues(weights.size)
        self._start(session)

    @property  # type: ignore[override]
    def w_sync(self) -> np.ndarray:
        """(n,) float32 the group's copy of the global weights, made whole (O(n): checkpoints,
        resumes, tests): the pending exchange's entries at what they were before it."""
        out = self.before.materialize(self.weights)
        if self.pending is not None and self.pending.synced is not None:
            assert isinstance(self.pending.sent, SparseVector)
            out[self.pending.sent.indices] = self.pending.synced
        return out

    @w_sync.setter
    def w_sync(self, values: np.ndarray) -> None:
        self.before.set_dense(np.array(values, dtype=np.float32))

    def moving(self, weights: np.ndarray, idx: np.ndarray | None) -> None:
        """The weights are about to change at ``idx`` (None: anywhere): keep ``w_sync`` there."""
        self.weights = weights
        self.before.save(weights, idx)

    def _outgoing(self, weights: np.ndarray, stats: dict[str, Any], dense: bool,
                  changed: np.ndarray | None) -> Outgoing:
        """Every entry the record holds whose value moved: ``sent`` the weights there,
        ``delta`` ``sent - w_sync`` (a flush is no different: nothing is left behind), dense
        past ``DENSE_AT`` of n."""
        self.weights = weights
        idx, synced = self.before.take(weights)  # (m,) uint32, (m,) float32
        sent = weights[idx]
        delta = sent - synced
        moved = delta != 0  # an entry pushed back to its value has nothing to send
        if not moved.all():
            idx, sent, delta, synced = idx[moved], sent[moved], delta[moved], synced[moved]
        n = weights.size
        out = SparseVector(idx, delta, n)  # nearly every entry (dense pushes): dense, smaller
        return Outgoing(SparseVector(idx, sent, n), stats,
                        out.to_dense() if idx.size > DENSE_AT * n else out, synced)

    def touches(self, out: Outgoing, res: ExchangeResult) -> np.ndarray | None:
        """``GroupSync.touches``: the entries sent and those the reply sets (a merge of two
        increasing runs), or None for a dense reply."""
        sent, reply = out.sent, res.weights
        if isinstance(reply, np.ndarray) or not isinstance(sent, SparseVector):
            return None
        if self.before.covers(reply.indices, sent.indices):  # the merge's reply: it does
            return reply.indices
        return union_sorted([sent.indices, reply.indices])

    def _rebase_on(self, weights: np.ndarray, out: Outgoing, res: ExchangeResult) -> None:
        """``w = w_sync' + (w - sent)`` at the entries the exchange or the reply names (all
        of them for a dense reply), ``w_sync'`` = the reply there; the record's before-values
        of entries pushed meanwhile become ``w_sync'``."""
        self.weights = weights
        sent, reply = out.sent, res.weights
        assert isinstance(sent, SparseVector) and out.synced is not None
        if isinstance(reply, np.ndarray):
            self._take_dense(weights, sent, reply)
        elif self.before.dense is None:
            self._take_entries(weights, sent, out.synced, reply)
        else:
            self._take_over(weights, out, res)

    def _take_entries(self, weights: np.ndarray, sent: SparseVector, synced: np.ndarray,
                      reply: SparseVector) -> None:
        """A sparse reply, the record sparse: scatters only, O(sent + reply + pushed since).
        The weights are set back to the copy (``w_sync`` before the reply: the record's
        before-values, ``synced`` at the entries sent), the reply is written over it, and
        what was pushed since the begin goes back on top where the exchange or the reply
        changed the copy; elsewhere the weights are as they were, bit for bit."""
        held, kept = self.before.items()  # (h,) pushed since the begin, the weights then
        was = weights[held]  # (h,) float32
        pushed = was - kept
        weights[held] = kept  # the weights at the begin (``sent`` at the entries sent)
        weights[sent.indices] = synced  # the copy before the reply
        weights[reply.indices] = reply.values  # the copy after it: w_sync'
        kept[:] = weights[held]  # the record's before-values become w_sync'
        moved = _within(held, sent.indices) | _within(held, reply.indices)
        weights[held] = np.where(moved, kept + pushed, was)

    def _take_over(self, weights: np.ndarray, out: Outgoing, res: ExchangeResult) -> None:
        """A sparse reply, the record dense (a dense change since the begin): the general
        rule at the entries the exchange or the reply names."""
        sent, reply = out.sent, res.weights
        assert isinstance(sent, SparseVector) and isinstance(reply, SparseVector)
        touched = self.touches(out, res)  # (t,) uint32 increasing
        assert touched is not None
        at_sent = np.searchsorted(touched, sent.indices)
        before = self.before.at(weights, touched)  # sent: the weights at the begin, there
        before[at_sent] = sent.values
        new = before.copy()  # w_sync': the reply where it sets, the old copy elsewhere
        new[at_sent] = out.synced
        new[np.searchsorted(touched, reply.indices)] = reply.values
        weights[touched] = new + (weights[touched] - before)
        self.before.update(touched, new)

    def _take_dense(self, weights: np.ndarray, sent: SparseVector, reply: np.ndarray) -> None:
        """A dense reply: ``w_sync' = G``; ``w = G + (w - sent)``, O(n)."""
        base = self.before.materialize(weights)  # sent where nothing was pushed meanwhile
        base[sent.indices] = sent.values
        step = weights - base  # (n,) what was pushed since the begin
        moved = np.flatnonzero(step).astype(np.uint32)
        weights[:] = reply
        weights[moved] += step[moved]
        self.before.set_dense(None)
        self.before.save(reply, moved)  # w_sync' = G where the weights differ from it

    def rebase(self, weights: np.ndarray, g: np.ndarray,
               server_seq: int | None = None) -> tuple[np.ndarray, Tally | None]:
        """``GroupSync.rebase`` (O(n): a new global server); the pending exchange's copy is
        ``g`` at its entries."""
        new, replay = super().rebase(weights, g, server_seq)
        self.weights = new
        if self.pending is not None and self.pending.synced is not None:
            assert isinstance(self.pending.sent, SparseVector)
            self.pending.synced = g[self.pending.sent.indices]
        return new, replay


def _within(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(len(a),) bool: which entries of ``a`` are in ``b`` (both increasing), O(a log b)."""
    if b.size == 0:
        return np.zeros(a.size, dtype=np.bool_)
    pos = np.minimum(np.searchsorted(b, a), b.size - 1)
    return b[pos] == a


class ExactMirror:
    """The global server's side of the exact exchange for one group: the version of the
    global weights' change log the group holds (``base``: the last reply it took, known when
    its next new seq arrives), and the one its last reply brought (``last``). The answer is
    every entry the log names after ``base``, at the global weights' values: O(changes), no
    copy of what the group holds. A repeat is answered from the same ``base`` (the lost reply
    was not taken); the whole weights when the log does not reach back (a new or resumed
    server, a group far behind) or the entries pass ``DENSE_AT`` of n."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.base: int | None = None  # the version the group holds; None: unknown
        self.last: int | None = None  # the version the last reply brought it to

    def reset(self, weights: np.ndarray | None = None, version: int = 0) -> None:
        """The group took the weights whole at ``version`` (a PULL); None: unknown."""
        self.base = self.last = None if weights is None else version

    def answer(self, weights: np.ndarray, repeat: bool,
               changes: ChangeLog | None = None) -> np.ndarray | SparseVector:
        """The reply to an exchange merged (or repeated: ``repeat``) into ``weights``."""
        if not repeat:
            self.base = self.last  # a new seq: the group took the last reply
        idx = None if changes is None or self.base is None else changes.since(self.base)
        self.last = None if changes is None else changes.version
        if idx is None or idx.size > DENSE_AT * weights.size:
            return np.array(weights, dtype=np.float32)
        return SparseVector(idx, weights[idx], weights.size)


def group_sync(run: Any, weights: np.ndarray) -> GroupSync:
    """A group's side of the exchange ``run.xchg_mode`` names (``weights``: the group's own
    array, which the exact one follows)."""
    if run.xchg_mode == "exact":
        return ExactSync(weights)
    return GroupSync(weights, ratio=exchange_ratio(run))


def group_mirror(run: Any, size: int) -> GroupMirror | ExactMirror:
    """The global server's side of one group's exchange, as ``run.xchg_mode`` names it."""
    if run.xchg_mode == "exact":
        return ExactMirror(size)
    return GroupMirror(size, exchange_ratio(run))
