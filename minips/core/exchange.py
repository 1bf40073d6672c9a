"""The exchange between a group server and the global server: what a group sends and how it
takes the answer (``GroupSync``), what the global server answers (``GroupMirror``), and how stale
between groups each exchange was (``SyncPoint``). numpy, sans-IO: no asyncio, no torch.

Every exchange sends (part of) what the group applied since the last one and takes (part of)
the global weights back; what is not sent stays in the group's weights and goes with a later one:

    s       = topk(sent - w_sync)        sent = the group's weights when the exchange starts
    w       = w_sync' + (w - w_sync - s) what was not sent, or applied meanwhile, is kept
    w_sync' = the group's copy of the global weights after the reply

Invariants: ``w_sync`` is the group's exact copy of what the global server holds for it
(``GroupMirror.known``, or the global weights after a dense reply); ``pending`` is None or the
one exchange whose fate is unknown, and it goes again unchanged; each (session, seq) is merged
once (the rules are ``core/replay.py``'s). The exact exchange (``--xchg-mode exact``), every
change both ways with no top-k: both its halves (``ExactSync``, ``ExactMirror``, and
``group_mirror``, which picks a group's mirror) are ``core/exact_exchange.py``.
"""

from __future__ import annotations

import collections
import secrets
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from minips import sparse
from minips.compress.selection import kept_count
from minips.core.changelog import ChangeLog, TopDiff
from minips.core.replay import Tally, Unsaved, lost
from minips.sparse import SparseVector
from minips.wire import messages

__all__ = [
    "DENSE_AT",
    "MAX_PULLS",
    "Delta",
    "ExchangeResult",
    "GroupLink",
    "Outgoing",
    "SHARE_EMA",
    "MIN_SHARE",
    "GroupSync",
    "exchange_message",
    "exchange_ratio",
    "GroupMirror",
    "BETWEEN_GROUPS",
    "SyncPoint",
]

DENSE_AT = 0.5  # an answer with more than this fraction of entries goes dense (smaller then)

# answered PULLs one exchange reports, the latest: a received msgpack array holds at most 4096
# items (checks.Limits.max_array_len; more is ERROR limit_exceeded), so a group process never
# sends more; exchanges come every few pushes, so only a group cut off from its global server
# for long has more
MAX_PULLS = 4096


def exchange_ratio(run: Any) -> float:
    """The exchange's kept fraction, both ways (1.0: dense): ``run.xchg_ratio``, or the
    default every hop of the servers takes (``RunConfig.kept_or_default``)."""
    return float(run.kept_or_default(run.xchg_ratio))


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
    since, the seq and the counters (the EXCHANGE message it sends is ``messages.Exchange``)."""

    def __init__(self, weights: np.ndarray, session: int | None = None,
                 kept: float = 1.0) -> None:
        self.w_sync = np.array(weights, dtype=np.float32)  # (n,) the group's copy of global
        self.kept = kept  # the kept fraction of each exchange (1.0: dense)
        self._top = TopDiff(self.w_sync.size, kept_count(kept, self.w_sync.size))  # s's entries
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
        # progress, for lr schedules: all groups' samples as the last reply counted them, and
        # this group's counted since the exchange it answered began (exact with one group)
        self.global_samples = 0
        self.samples_after = 0
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
        group's change log; None: unknown): a sparse exchange then looks for ``s`` only among
        them and those the last one left unsent (``left``), O(changes), the same ``s`` as over
        all n."""
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
        if dense or self.kept >= 1.0:  # a flush, or the dense exchange: s = sent - w_sync
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
        at the entries either names only (``touches``; zero elsewhere). ``sent`` keeps
        ``w_sync + s`` (the weights at the entries sent, ``w_sync`` elsewhere), so the rebase
        is this one line whatever the kept fraction."""
        self._rebase_on(weights, out, res)
        self._settle(weights, out, res)

    def _rebase_on(self, weights: np.ndarray, out: Outgoing, res: ExchangeResult) -> None:
        """``complete``'s arithmetic: the weights and ``w_sync`` after the reply."""
        if isinstance(out.sent, np.ndarray):
            if isinstance(res.weights, np.ndarray):
                new = res.weights
            else:  # set in place: the array stays the one an in-process mirror reads (share)
                new = self.w_sync
                sparse.set_into(new, res.weights)
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
            sparse.set_into(new, res.weights)
            weights[touched] += new[touched] - sent
        self.w_sync = new

    def _settle(self, weights: np.ndarray, out: Outgoing, res: ExchangeResult) -> None:
        """``complete``'s bookkeeping: the resume record, the pending exchange, the counters."""
        if res.saved is not None:  # a `minips group` process: keep what a resumed server lacks
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
        """What the server lost of this session's exchanges, when ``server_seq`` says it
        (``replay.lost``)."""
        if server_seq is None:
            return None
        pending = None if self.pending is None else self.pending.stats["seq"]
        replied = self.seq - (pending is not None) > 0  # an exchange of this session got its reply
        replay = lost(self.unsaved, server_seq, pending, replied, self.w_sync.size)
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


# -- the global server's half: its mirror of each group's copy, the answer ---------------------

class GroupMirror:
    """The global server's mirror of what one group holds of the global weights (``known``: the
    group's ``w_sync``) and the indices of the replies it may have lost. A group in this
    process (``share``) is mirrored by its own ``w_sync``, read where it lies: no copy."""

    def __init__(self, size: int, kept: float) -> None:
        self.kept = kept  # the exchange's kept fraction (1.0: dense, no mirror is kept)
        self._top = TopDiff(size, kept_count(kept, size))  # the entries a sparse answer sets
        self.known: np.ndarray | None = None  # (n,) float32; None: unknown, answer dense
        # the side of a group in this process: its w_sync is ``known``, which it sets itself as
        # it takes each answer (``GroupSync.complete``); None: a copy kept here (a group process)
        self.shared: GroupSync | None = None
        self.unacked = np.empty(0, np.uint32)  # indices sent since the group's last new seq
        self.dense_unacked = False  # a dense answer went out since the group's last new seq
        # where known may differ from G beyond the changes G's log holds after version ``mark``
        # ((m,) uint32 sorted; None: anywhere): the next answer looks only there
        self.left: np.ndarray | None = None
        self.mark = 0

    def share(self, sync: GroupSync) -> None:
        """The group is served in this process and ``sync`` is its side (the global server
        says so as it opens the group, ``GlobalServer.open_group``): this mirror is its
        ``w_sync`` itself, not a copy of it (one (n,) copy per group fewer). The group sets it
        as it takes each answer; the mirror never writes it. Its copy is known from the start,
        so the first answer is a top-k over all n, not the weights whole (nor the dense change
        every PULL of its workers would then get). A top-k exchange only (the exact one keeps
        no copy here, ``ExactMirror``)."""
        if type(sync) is not GroupSync or self.kept >= 1.0:
            return
        self.shared = sync
        self.reset()
        self.known, self.left = sync.w_sync, None  # where it differs from G: anywhere

    def _copy(self) -> np.ndarray | None:
        """``known``: the copy kept here, or the shared group's ``w_sync`` as it is now (it may
        be a new array: a rebase); None: unknown."""
        if self.shared is not None and self.known is not None:
            self.known = self.shared.w_sync
        return self.known

    def reset(self, weights: np.ndarray | None = None, version: int = 0, *,
              copy: bool = True) -> None:
        """The group took ``weights`` whole (a dense answer or a PULL; ``version``: the global
        change log's then); None: unknown (a new group, a resumed server: ``known`` is not
        saved). ``copy`` False: ``weights`` is the mirror's own from now on."""
        keep = weights is not None and self.kept < 1.0
        if not keep:
            self.known = None
        else:
            self.known = np.array(weights, dtype=np.float32) if copy else np.asarray(
                weights, dtype=np.float32)
        self.unacked = np.empty(0, np.uint32)
        self.dense_unacked = False
        self.left, self.mark = np.empty(0, np.uint32), version

    def answer(self, weights: np.ndarray, repeat: bool,
               changes: ChangeLog | None = None) -> np.ndarray | SparseVector:
        """The reply to an exchange, the global weights G being ``weights`` after its merge:
        G whole (a (n,) copy) or the entries where G and ``known`` differ most, at G's values
        (to *set*, not to add). ``repeat``: the exchange repeats the last one (its reply may
        have been lost). ``changes``: G's change log; with it the answer costs O(changes
        since the last one), else O(n)."""
        known = self._copy()
        if known is None or self.kept >= 1.0 or (repeat and self.dense_unacked):
            return self._dense(weights, changes)
        changed = None if changes is None or self.left is None else changes.since(self.mark)
        where = None if changed is None or self.left is None else sparse.union_of(
            [self.left, changed], weights.size)
        # idx = topk(G - known); what it leaves behind stays in G - known for a later answer
        idx, _, self.left = self._top.top(weights, known, where)  # (p,) uint32 sorted
        self.mark = 0 if changes is None else changes.version
        if self.shared is None:  # a shared copy is set by its group as it takes the answer
            known[idx] = weights[idx]
        if repeat:  # the group may lack what the lost reply set: set it again, at G's values
            idx = sparse.unique_sorted(np.concatenate([self.unacked, idx]))
        if idx.size > DENSE_AT * weights.size:
            return self._dense(weights, changes)
        self.unacked, self.dense_unacked = idx, False
        values = weights[idx] if self.shared is not None else known[idx]
        return SparseVector(idx, values, weights.size)

    def _dense(self, weights: np.ndarray, changes: ChangeLog | None) -> np.ndarray:
        """G whole (a private (n,) copy), which is ``known`` from now on: shared, the very array
        the group takes as its copy; else a copy of it kept here (the answer may reach a
        group in this process that the mirror does not know as shared, which writes it)."""
        out = np.array(weights, dtype=np.float32)
        self.reset(out, 0 if changes is None else changes.version,
                   copy=self.shared is None)
        self.dense_unacked = True  # if it is lost, the group's copy is anything: dense again
        return out


# -- the staleness between groups: what a group's exchange was computed without ---------------
# Groups exchange asynchronously, so a group's delta was computed on global weights that other
# groups' merges have passed since. The global server marks, per group, the point its copy was
# last brought up to (each reply, each PULL) and counts, at the merge of its next exchange, the
# other groups' merges since (``missed``) and the seconds since (``base_age_s``).

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

