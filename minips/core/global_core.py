"""The global server's rules without IO: the weights and their merges, grouping decisions,
GDTopK's ratios, the budget, and what a checkpoint holds.

``GlobalCore`` is what the global server *decides*; ``server.GlobalServer`` (asyncio) holds one
and carries out what it decides over real connections, and ``simulate.py`` drives the same class
in simulated time. No asyncio, sockets, clocks or torch inside (tests/test_group_core.py checks):
times come from the injected clocks or as ``now``. The roster (``roster.py``) holds the workers,
the groups, their servers and their ratios.

Entry points: a worker's HELLO ``admit``, its session ``worker_joined`` / ``worker_leaving`` /
``worker_gone``, its calibration's link probe ``probe_pulled`` / ``probe_pushed``, its STATS
``on_stats``, its initial weights ``on_initial``, the grouping deadline
``calib_timeout``, the groups the shell opened ``groups_formed`` / ``group_opened`` / ``moved`` /
``place_late`` / ``group_served`` / ``group_lost`` / ``rehome`` / ``resume``, a group's exchange
``merge`` (in-process) or ``on_exchange`` / ``group_pull`` / ``group_left`` (a group process:
EXCHANGE -> EXCHANGE_REPLY), the budget ``finish(reason)`` and ``fail``, checkpoints
``load_state_dict``. Each answers in one shape: a list of the actions below, in the order the
shell is to perform them; what goes back to the one who asked is an action too (``Admitted``,
``Reply``). Time comes in as ``now`` (the rules read no clock; ``wall`` only dates records and
the wall budget). The rest are queries (``first_assignment``, ``ratio_of``, ``checkpoint_state``,
the message builders). The actions are frozen dataclasses, so a test compares them:

- ``FormGroups``: every expected worker reported (or the calibration time passed): open the
  groups of ``Roster.first_assignment`` and send each worker its ASSIGN.
- ``PlaceLate(worker)``: a worker reported after the grouping: once the groups are open, put it
  in the group nearest its speed (``place_late``).
- ``Placed(worker, group)``: ``place_late`` put it there: tell it (ASSIGN).
- ``Admitted(worker)``: the id ``admit`` gave a HELLO (its WELCOME says it).
- ``Reply(group, answer)``: what goes back to the group that asked: GLOBAL_WEIGHTS for its PULL,
  EXCHANGE_REPLY for its EXCHANGE, an ``ExchangeResult`` for an in-process ``merge``
  (``reply(actions, kind)`` picks it out).
- ``Regroup(assignment)``: the speeds drifted (``grouping.Regrouper``): move these workers.
- ``SendSettings(ratios)``: how these groups' workers send changed (already in the groups):
  GDTopK chose new ratios ``{group: ratio}``, or local steps auto a new H; tell the group
  servers and every worker of those groups (an ASSIGN carries both).
- ``WeightsReady``: the first initial weights arrived; the grouping may go on.
- ``Done(reason)``: the budget is spent: tell the groups and the workers, wait for the final
  deltas (bounded).
- ``AllFinal``: every group flushed its final delta: end the run, or wait for the workers to
  rejoin when budget is left (``server.GlobalServer``).
- ``Fail(code, reason)``: the run fails now (``diverged``: a group sent NaN or inf): tell the
  workers (ERROR); a ``Done`` follows.
- ``Rehomed(group, moved)``: a lost group's workers moved to live groups: tell them (ASSIGN).
- ``Log(event, fields)`` (``actions.py``, shared with the group core): one line of the run's
  record (the shell adds the time and the counters).

Invariants (server.py's docstring has the run's whole course): ``weights`` changes only in
``merge`` (weights += delta of one group scaled by the sync policy's merge rule, version += 1),
so the global weights are the initial weights plus every delta any group sent; once ``done``,
merges still land: nothing sent is lost. Each (session, seq) of a group is merged at most once
(``replay.Merged``: a seq not above its session's last merged one is answered without
merging). The run's counters (samples, version, the groups' worker traffic summed) never pass
``messages.MAX_COUNT`` (2^62), what GLOBAL_WEIGHTS can carry: an exchange that would take one
past it is refused (``RemoteProtocolError``) before anything of it is merged.

Staleness between groups. ``synced`` holds, per group, the global weights its copy was last
brought up to (``exchange.SyncPoint``: version, the group's own merges then, ``now``): set when
the group opens (``groups_formed``, ``group_opened``), at each PULL (``group_pull``) and at each
answer to its exchanges (``merge``). Each ``merge`` line says how stale the exchange was:
``missed``, the merges of *other* groups since then (its own never count), and
``base_age_s``, the seconds since then; both None for a group resumed from a checkpoint until
its first answer (the point is not saved).

Checkpoints. ``checkpoint_state`` takes a snapshot and ``load_state_dict`` / ``resume`` bring
it back: ``core/snapshot.py`` says what one holds and how it is restored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from minips import sparse
from minips.core.actions import Log
from minips.core.changelog import ChangeLog
from minips.core.config import RunConfig
from minips.core.exchange import (
    BETWEEN_GROUPS,
    Delta,
    ExactMirror,
    ExchangeResult,
    GroupMirror,
    SyncPoint,
    group_mirror,
)
from minips.core.local_steps import auto_local_steps
from minips.core.replay import MAX_SESSIONS, Merged
from minips.core.roster import GroupHandle, GroupPeer, NoGroup, Roster, WorkerEntry
from minips.core.snapshot import restore_group, restore_workers, snapshot
from minips.errors import RemoteProtocolError
from minips.wire import control, frames, messages
from minips.wire.messages import MAX_COUNT

__all__ = [
    "Action",
    "Admitted",
    "AllFinal",
    "Done",
    "Fail",
    "FormGroups",
    "Rehomed",
    "PlaceLate",
    "Placed",
    "Regroup",
    "Reply",
    "SendSettings",
    "WeightsReady",
    "reply",
    "GlobalCore",
]


# -- the actions: what the core asks its shell to do ------------------------------------------

@dataclass(frozen=True)
class FormGroups:
    """Open the first groups and assign every worker."""


@dataclass(frozen=True)
class PlaceLate:
    """Put ``worker`` (reported after the grouping) in the group nearest its speed."""

    worker: int


@dataclass(frozen=True)
class Placed:
    """Worker ``worker`` (reported after the grouping) is in group ``group`` now: tell it."""

    worker: int
    group: int


@dataclass(frozen=True)
class Admitted:
    """A HELLO is admitted as worker ``worker`` (its WELCOME says so)."""

    worker: int


@dataclass(frozen=True)
class Reply:
    """Send ``answer`` back to group ``group``, whose exchange or PULL it answers: the
    EXCHANGE_REPLY or GLOBAL_WEIGHTS of a group process, an ``ExchangeResult`` in-process."""

    group: int
    answer: ExchangeResult | messages.ExchangeReply | messages.GlobalWeights


@dataclass(frozen=True)
class Regroup:
    """Move workers: ``{worker: new group}`` (group ids matched to the old ones)."""

    assignment: dict[int, int]


@dataclass(frozen=True)
class SendSettings:
    """New send settings of the groups ``ratios`` names (``{group: ratio}``, with the H in the
    groups' handles), to deliver to the groups and their workers (ASSIGN)."""

    ratios: dict[int, float]


@dataclass(frozen=True)
class WeightsReady:
    """The global weights exist now (a worker pushed the initial weights)."""


@dataclass(frozen=True)
class Done:
    """The budget is spent (``reason``: epochs, wall time, workers left, ...)."""

    reason: str


@dataclass(frozen=True)
class AllFinal:
    """Every group flushed its final delta."""


@dataclass(frozen=True)
class Fail:
    """The run fails now: ``code`` (one word, the ERROR sent to the workers) and why."""

    code: str
    reason: str


@dataclass(frozen=True)
class Rehomed:
    """Lost group ``group``'s workers moved: ``{worker: new group}``; tell them."""

    group: int
    moved: dict[int, int]


Action = (FormGroups | PlaceLate | Placed | Admitted | Reply | Regroup | SendSettings
          | WeightsReady | Done | AllFinal | Fail | Rehomed | Log)

T = TypeVar("T", ExchangeResult, messages.ExchangeReply, messages.GlobalWeights)


def reply(actions: list[Action], kind: type[T]) -> T:
    """The answer of kind ``kind`` that ``actions`` send back to the group that asked."""
    for a in actions:
        if isinstance(a, Reply) and isinstance(a.answer, kind):
            return a.answer
    raise LookupError(f"no {kind.__name__} among the actions")


# -- the rules -------------------------------------------------------------------------------

class GlobalCore:
    """The global weights, their version, the run's samples and budget, the roster."""

    def __init__(self, run: RunConfig, weights: np.ndarray | None, *, regroup: bool,
                 wall: Callable[[], float]) -> None:
        self.run = run
        self.wall = wall  # the run's wall clock (records, the wall budget); rules take ``now``
        self.weights = None if weights is None else np.array(weights, dtype=np.float32)
        self.version = 0  # merges applied to self.weights
        self.samples = 0  # training samples all groups reported
        self.roster = Roster(run, regroup=regroup)
        self.workers = self.roster.workers  # worker id -> WorkerEntry
        self.groups = self.roster.groups  # group id -> GroupHandle
        # group id -> what it holds of the weights (``RunConfig.xchg_mode``)
        self.mirrors: dict[int, GroupMirror | ExactMirror] = {}
        # group id -> the global weights its copy was last brought up to (between-group
        # staleness, ``synced``); none for a group resumed from a checkpoint until it is answered
        self.synced: dict[int, SyncPoint] = {}
        # for each merge the indices it touched: an answer to a group costs O(changes since)
        self.changes: ChangeLog | None = None  # made with the weights (``change_log``)
        self.merged: dict[int, Merged] = {}  # group id -> last merged seq of its sessions
        self.grouped = False  # the first groups are drawn up (FormGroups went out)
        self.calib_expired = False  # calib_timeout_s passed: the next STATS forms the groups
        self.done = False
        self.done_reason = ""
        self.failure = ""  # why the run ended short or broken ("" = it did not; ``fail``)
        self.train_size = run.epoch_samples()
        self.started_training = 0.0  # wall time when the groups were formed
        self._first_steps: dict[int, int] = {}  # local steps auto: H per group, first grouping

    # -- workers ---------------------------------------------------------------------------

    def admit(self, wanted: int, now: float) -> list[Action]:
        """A worker id for a HELLO that asked for ``wanted`` (``Roster.admit``): ``Admitted``."""
        return [Admitted(self.roster.admit(wanted, now))]

    def worker_joined(self, w: int) -> list[Action]:
        """Worker ``w``'s control channel opened (a newer one replaces an older)."""
        entry = self.workers[w]
        entry.connected, entry.left = True, False
        self.roster.seated(w)
        return [Log("joined", {"worker": w})]

    def worker_leaving(self, w: int, reason: str = "") -> list[Action]:
        """Worker ``w`` said LEAVE (``reason``: why, e.g. it refused to start without its
        data): its session ends, its id may be given out again (nothing to do yet)."""
        self.workers[w].left = True
        self.workers[w].left_because = "" if reason == "bye" else reason
        return []

    def worker_gone(self, w: int) -> list[Action]:
        """Worker ``w``'s control channel closed (after LEAVE, or lost)."""
        entry = self.workers[w]
        entry.connected = False
        reason = (entry.left_because or "leave") if entry.left else "done" if self.done \
            else "connection lost"
        return [Log("left", {"worker": w, "reason": reason})]

    def on_stats(self, w: int, msg: control.Stats, now: float) -> list[Action]:
        """Worker ``w``'s measured speed: form the groups, place it, regroup or update ratios."""
        entry = self.workers[w]
        entry.step_time, entry.clock = float(msg.step_time), int(msg.clock)
        said = [Log("data", {"worker": w, **msg.data})] if msg.data else []  # its first STATS
        return said + self._placed(w, entry, now)

    def probe_pulled(self, w: int, now: float) -> list[Action]:
        """Worker ``w``'s calibration link probe: the global weights go out to it at ``now``
        (``Roster.probe_pulled``; the shell sends ``weights_message()``)."""
        self.roster.probe_pulled(w, now)
        return []

    def probe_pushed(self, w: int, now: float) -> list[Action]:
        """The probe's PUSH of ``w`` arrived at ``now``: its link time is what its first
        grouping adds to its compute (``WorkerEntry.iteration``); logged."""
        link = self.roster.probe_pushed(w, now)
        return [] if link is None else [Log("link_probe", {"worker": w, "link_s": link})]

    def _placed(self, w: int, entry: WorkerEntry, now: float) -> list[Action]:
        """What worker ``w``'s new speed decides: the groups, its place, a regroup, ratios."""
        if not self.grouped:
            if self.calib_expired or self.roster.all_reported():
                self.grouped = True
                return [FormGroups()]
            return []
        if entry.group < 0:
            return [PlaceLate(w)]
        if (new := self.roster.maybe_regroup(now)) is not None:
            return [Regroup(new)]
        return self._update_ratios(now)

    def on_initial(self, weights: np.ndarray) -> list[Action]:
        """A worker's initial weights (WELCOME said ``need_init``): the first are taken; the
        ones that follow are dropped if their size is the run's, else refused."""
        if self.weights is None:
            self.weights = weights
            return [WeightsReady()]
        if weights.size != self.weights.size:
            raise RemoteProtocolError("initial weights of another model size",
                                      expected=self.weights.size, got=weights.size)
        return []

    # -- grouping --------------------------------------------------------------------------

    def calib_timeout(self, now: float) -> list[Action]:
        """``calib_timeout_s`` passed: group whoever reported; with nobody yet, the first STATS
        will, so a server started before its workers does not wait for all of them."""
        if self.grouped:
            return []
        self.calib_expired = True
        reported = sorted(self.roster.step_times())
        actions: list[Action] = [Log("calib_timeout", {"reported": reported,
                                                       "expected": self.run.workers})]
        if reported:
            self.grouped = True
            actions.append(FormGroups())
        return actions

    def first_assignment(self, now: float) -> dict[int, int]:
        """``{worker: group}`` of the first grouping (group 0 = fastest), GDTopK's first ratios
        set (``ratio_of``), before the groups open."""
        assignment = self.roster.first_assignment()
        self.roster.first_ratios(assignment, now)
        self._first_steps = self._steps_for(assignment)
        return assignment

    def _steps_for(self, assignment: dict[int, int]) -> dict[int, int]:
        """Local steps auto: each group's H for ``assignment`` as ``groups_formed`` will set it
        (its members' mean step time, ``auto_local_steps``), so that an ASSIGN sent before
        (a group process's: ``assign_message``) carries it too; {} with the run's H."""
        if not self.run.local_steps_auto:
            return {}
        times: dict[int, list[float]] = {}
        for w, g in assignment.items():
            if t := self.workers[w].step_time:
                times.setdefault(g, []).append(t)
        return auto_local_steps({g: float(np.mean(t)) for g, t in times.items()},
                                self.run.local_steps_max)

    def ratio_of(self, g: int) -> float:
        """The GDTopK ratio group ``g`` opens with (``Roster.ratio_of``)."""
        return self.roster.ratio_of(g)

    def groups_formed(self, handles: list[GroupHandle], assignment: dict[int, int],
                      now: float) -> list[Action]:
        """The first groups are open (``handles``, after ``first_assignment``), each with the
        global weights as they are at ``now``: training starts, every worker of ``assignment``
        is in its group."""
        for h in handles:
            self.groups[h.id] = h
            self.synced_now(h.id, now)
        self.roster.refresh_step_times()
        self.started_training = self.wall()
        for w, g in assignment.items():
            self.workers[w].group = g
        steps = self.roster.update_local_steps()  # local steps auto: each group's first H
        return [Log("groups", {"assignment": {str(w): g for w, g in assignment.items()},
                               **self.speeds(assignment),
                               "ratios": {str(g): h.ratio for g, h in self.groups.items()},
                               "addresses": {str(g): h.address
                                             for g, h in self.groups.items()}}),
                *self._local_steps_actions(steps)]

    def speeds(self, workers: Iterable[int]) -> dict[str, dict[str, float | None]]:
        """What the grouping saw of ``workers``: ``iteration_s`` (``WorkerEntry.iteration``,
        what it groups by) and ``compute_s`` (their step time), ``{worker: seconds}``."""
        entries = [self.workers[w] for w in sorted(workers) if w in self.workers]
        return {"iteration_s": {str(e.id): e.iteration() for e in entries},
                "compute_s": {str(e.id): e.step_time for e in entries}}

    def _local_steps_actions(self, changed: list[int]) -> list[Action]:
        """Local steps auto: log the groups' H and send the changed ones (with ASSIGN, as
        GDTopK's ratios: ``SendSettings``)."""
        if not changed:
            return []
        return [Log("local_steps", {"local_steps": {str(g): h.local_steps
                                                    for g, h in self.groups.items()}}),
                SendSettings({g: self.groups[g].ratio for g in changed})]

    def place_late(self, w: int) -> list[Action]:
        """Worker ``w`` reported after the grouping: ``Placed`` in the group nearest in speed
        (logged); nothing when it has one already."""
        entry = self.workers[w]
        if entry.group >= 0:
            return []
        g = self.roster.place_late(entry)
        return [Log("placed", {"worker": w, "group": g, "moved": {str(w): g},
                               "step_time": entry.step_time,
                               "iteration_s": entry.iteration()}), Placed(w, g)]

    def group_opened(self, h: GroupHandle, now: float) -> list[Action]:
        """A new group (a regroup drew it) has its server, opened with the global weights."""
        self.groups[h.id] = h
        self.synced_now(h.id, now)
        return []

    def moved(self, moves: dict[int, int], now: float) -> list[Action]:
        """A ``Regroup`` carried out: ``{worker: group}`` (open groups) moved; the groups'
        speeds and GDTopK's ratios anew."""
        for w, g in moves.items():
            self.roster.move(w, g)
        return [Log("regroup", {"moved": {str(w): g for w, g in moves.items()},
                                **self.speeds(self.workers)}),
                *self.regrouped(now)]

    def regrouped(self, now: float) -> list[Action]:
        """Workers moved: the groups' speeds and GDTopK's ratios anew."""
        return self._update_ratios(now)

    def group_served(self, g: int, peer: GroupPeer, address: str) -> list[Action]:
        """A group process took group ``g`` over (it had none: ``Roster.orphan``)."""
        h = self.groups[g]
        h.peer, h.address = peer, address
        return [Log("group_adopted", {"group": g, "address": address})]

    def group_lost(self, g: int, final: bool = False) -> list[Action]:
        """Group ``g``'s group process is gone; its last traffic known is kept. At the end of
        the run (``final``: it sent its final delta, or the budget is spent) that is how a group
        ends (``group_ended``), not a loss."""
        h = self.groups[g]
        h.peer = NoGroup(h.peer.traffic())
        return [Log("group_ended" if final or self.done else "group_lost", {"group": g})]

    def rehome(self, g: int) -> list[Action]:
        """Nobody took lost group ``g`` over: its workers move to the live groups nearest in
        speed (``Roster.rehome``; nothing when there is none or the run is over)."""
        if self.groups[g].peer.connected or self.done:
            return []
        moved = self.roster.rehome(g)
        if not moved:
            return []
        return [Log("rehomed", {"group": g, "moved": {str(w): v for w, v in moved.items()}}),
                Rehomed(g, moved)]

    def resume(self, handles: dict[int, GroupHandle], state: dict[str, Any]) -> list[Action]:
        """The checkpoint's groups (``state``, after ``load_state_dict``) opened again:
        in-process ones take their saved state, a group process adopts its group later."""
        self.grouped = True
        for key, saved in state["groups"].items():
            h = handles[int(key)]
            restore_group(h, saved)
            self.merged[h.id] = Merged(saved.get("merged") or [list(h.last_exchange)])
        self.groups.update(sorted(handles.items()))
        self.roster.restore_regrouper()
        self.started_training = self.wall() - float(state["train_s"])
        return []

    # -- GDTopK ratios -----------------------------------------------------------------------

    def _update_ratios(self, now: float) -> list[Action]:
        """GDTopK: when the ratio policy (``Roster.update_ratios``, ratios.py) gives new
        ratios, log them and send them (``SendSettings``); local steps auto: the groups' H
        likewise."""
        new = self.roster.update_ratios(now)
        steps = self._local_steps_actions(self.roster.update_local_steps())
        if not new:
            return steps
        policy = self.roster.policy
        times = {str(g): policy.times.get(g) for g in new} if policy else {}
        return [Log("ratios", {"ratios": {str(g): r for g, r in new.items()},
                               "iter_time": times}), SendSettings(new), *steps]

    # -- the groups' exchanges ---------------------------------------------------------------

    def merge(self, g: int, delta: Delta, stats: dict[str, Any], now: float,
              wire_in: int | None = None) -> list[Action]:
        """Add group ``g``'s delta (dense or sparse) to the global weights; ``Reply`` (last) with
        an ``ExchangeResult``: what the group's copy of them lacks (``exchange.py``: dense
        weights, or entries to set). An
        exchange whose seq is not above the last merged one of its session (a repeat whose
        reply was lost, or an older one replayed) is answered without merging again (with what
        the lost reply set, again). One that would take a counter of the run past 2^62 raises
        ``RemoteProtocolError`` (``check_counters``), nothing merged. ``wire_in``: the bytes
        the exchange took on the wire (the shell measured them); then the group's hop is
        counted, those and the reply's (``ExchangeResult.bytes_up`` / ``bytes_down``, and the
        running totals in the merge's line). The merge's line also says how stale between
        groups the exchange was (``between_groups``: ``missed``, ``base_age_s``); every answer,
        a repeat's too, brings the group's copy up to date (``synced_now``)."""
        assert self.weights is not None
        h = self.groups[g]
        key = (int(stats.get("session", -1)), int(stats.get("seq", -1)))
        merged = self.merged.setdefault(g, Merged())
        repeat = key[1] >= 0 and merged.holds(*key)
        added, stale = False, self.between_groups(g, now)
        if repeat:
            actions: list[Action] = [Log("merge_repeat", {"group": g, "seq": key[1],
                                                          "merged_seq": merged.last[key[0]]})]
        else:
            self.check_counters(g, stats)
            if key[1] >= 0 and merged.full(key[0]):
                raise RemoteProtocolError(
                    f"group {g} had {MAX_SESSIONS} sessions already (one per group process "
                    "run): a new one is refused so that none is forgotten and merged twice",
                    expected="a session this group had", got=key[0])
            if key[1] >= 0:
                merged.note(*key)
            h.last_exchange = key
            added, actions = self._add_delta(g, delta, stats, now)
        sent = self.mirror(g).answer(self.weights, repeat, self.change_log())
        self.synced_now(g, now)  # what the answer brings the group's copy up to
        res = ExchangeResult(sent, self.version, self.done, self.samples)
        if wire_in is not None:  # made once: counted here, sent as it is (``on_exchange``)
            res.reply = self.exchange_reply(g, sent)
            res.bytes_up, res.bytes_down = wire_in, frames.wire_size(res.reply)
            h.hop_bytes["bytes_to_global"] += res.bytes_up
            h.hop_bytes["bytes_from_global"] += res.bytes_down
        if added:
            fields = {k: v for k, v in stats.items() if k not in ("version", "samples")}
            actions.append(Log("merge", {"group": g, "group_samples": stats.get("samples", 0),
                                         **fields, **h.hop_bytes, **stale}))
            actions += self._check_budget()
        return [*actions, Reply(g, res)]

    def on_exchange(self, g: int, delta: Delta, stats: dict[str, Any], now: float,
                    wire_in: int | None = None) -> list[Action]:
        """A group process's EXCHANGE (its delta and counters, ``wire_in`` bytes on the wire):
        merge it; ``Reply`` (last) with the EXCHANGE_REPLY, which names the exchanges this
        server's snapshots hold (``exchange_reply``)."""
        actions = self.merge(g, delta, stats, now, wire_in)
        res = reply(actions, ExchangeResult)
        answer = res.reply if res.reply is not None else self.exchange_reply(g, res.weights)
        return [*actions[:-1], Reply(g, answer)]

    def group_pull(self, g: int, now: float) -> list[Action]:
        """A group process (registering, adopting, reconnecting) takes the global weights whole
        (``Reply`` with GLOBAL_WEIGHTS) at ``now``, so the server's mirror of its copy starts
        from them (exchange.py) and so does its staleness (``synced``); the answer names the
        exchange the server merged last (exchange.py)."""
        assert self.weights is not None
        weights = self.weights.copy()  # what goes out: merges may land before it is written
        self.mirror(g).reset(weights, self.change_log().version)
        self.synced_now(g, now)
        msg = self.weights_message(weights, members=self.groups[g].members)
        return [Reply(g, dataclasses.replace(msg,
                                             last_exchange=list(self.groups[g].last_exchange)))]

    def exchange_reply(self, g: int, weights: Delta) -> messages.ExchangeReply:
        """EXCHANGE_REPLY: the merged weights (or the entries to set) and the last exchange in
        each of the server's last two checkpoint snapshots (exchange.py)."""
        msg = self.weights_message(weights)
        return messages.ExchangeReply(
            version=msg.version, done=msg.done, samples=msg.samples,
            saved_exchanges=[list(key) for key in self.groups[g].snapshots],
            payload=msg.payload)

    def check_counters(self, g: int, stats: dict[str, Any]) -> None:
        """Merging group ``g``'s exchange (its ``stats``) keeps every counter of the run within
        ``MAX_COUNT`` (2^62, what GLOBAL_WEIGHTS carries): the samples, the version, and the
        worker traffic of all groups (each reports its own so far, ``bytes_in`` / ``bytes_out``).
        ``RemoteProtocolError`` naming the counter otherwise."""
        total, own = self.traffic(), self.groups[g].peer.traffic()
        after = {"samples": self.samples + int(stats.get("samples", 0)),
                 "version": self.version + 1}
        for field, key in (("bytes_in", "bytes_up"), ("bytes_out", "bytes_down")):
            after[field] = total[key] - own.get(field, 0) + int(stats.get(field, 0))
        for name, value in after.items():
            if value > MAX_COUNT:
                raise RemoteProtocolError(f"the run's {name} would pass 2^62 with this exchange",
                                          expected=f"<= {MAX_COUNT}", got=value)

    def group_left(self, g: int) -> list[Action]:
        """Group ``g``'s server said LEAVE: it is final."""
        self.groups[g].final = True
        return self._check_budget()

    def change_log(self) -> ChangeLog:
        """The global weights' change log (a new one for new weights: resumed, or the first)."""
        assert self.weights is not None
        if self.changes is None or self.changes.size != self.weights.size:
            self.changes = ChangeLog(self.weights.size)
        return self.changes

    def synced_now(self, g: int, now: float) -> None:
        """Group ``g``'s copy is brought up to the global weights as they are at ``now``."""
        self.synced[g] = SyncPoint(self.version, self.groups[g].merges, now)

    def between_groups(self, g: int, now: float) -> dict[str, Any]:
        """The between-group staleness of group ``g``'s exchange merged at ``now`` (before it
        is merged): ``missed`` and ``base_age_s`` (``exchange.SyncPoint``), None when the
        server does not know what the group's copy rebased on (a group resumed from a
        checkpoint, before its first answer)."""
        point = self.synced.get(g)
        if point is None:
            return dict.fromkeys(BETWEEN_GROUPS)
        return point.between_groups(self.version, self.groups[g].merges, now)

    def mirror(self, g: int) -> GroupMirror | ExactMirror:
        """The global server's copy of what group ``g`` holds of the global weights."""
        assert self.weights is not None
        if g not in self.mirrors:
            self.mirrors[g] = group_mirror(self.run, self.weights.size)
        return self.mirrors[g]

    def _add_delta(self, g: int, delta: Delta, stats: dict[str, Any],
                   now: float) -> tuple[bool, list[Action]]:
        """Merge one new exchange of group ``g``: weights, counters, GDTopK's ratios (False
        and the failure's actions: a delta that is not finite, nothing merged)."""
        assert self.weights is not None
        h = self.groups[g]
        values = delta.values if isinstance(delta, sparse.SparseVector) else delta
        if not np.isfinite(np.sum(values, dtype=np.float64)):  # any NaN / inf makes the sum one
            return False, self.fail("diverged", f"group {g} sent a non-finite update (NaN or "
                                    f"inf) at merge {self.version}: the model diverged; try a "
                                    "lower --lr")
        scale = self.run.sync.merge_scale(self.run.merge, len(self.groups))
        sparse.add_into(self.weights, delta, scale)
        self.change_log().note(delta.indices if isinstance(delta, sparse.SparseVector) else None)
        self.version += 1
        self.samples += int(stats.get("samples", 0))
        h.merges += 1
        h.final = bool(stats.get("final"))  # a non-final merge after a final one: it is back
        h.peer.reported(stats)
        self.roster.observe_iterations(stats)  # its workers' iterations: what grouping uses
        actions: list[Action] = []
        if self.roster.policy is not None:  # the exchange's iteration time feeds GDTopK
            self.roster.observe_iter_time(g, stats.get("iter_time"), now)
            actions += self._update_ratios(now)
        return True, actions

    # -- the budget --------------------------------------------------------------------------

    def _check_budget(self) -> list[Action]:
        actions: list[Action] = []
        if self.run.epochs > 0 and self.samples >= self.run.epochs * self.train_size:
            actions += self.finish("epochs")
        if self.groups and all(h.final for h in self.groups.values()):
            actions.append(AllFinal())  # the end, or a wait for the workers to rejoin
        return actions

    def budget_left(self) -> str:
        """What is left of the budget ("" when it is spent, when the run is over (``done``: one
        budget spent leaves nothing of another), or when the workers end the run: a
        ``max_steps`` cap or no budget at all)."""
        run = self.run
        if run.max_steps > 0 or self.done:
            return ""
        if run.epochs > 0 and self.samples < run.epochs * self.train_size:
            return f"{self.samples:,} of {int(run.epochs * self.train_size):,} samples"
        trained = self.trained_s()
        if run.wall_s > 0 and trained < run.wall_s:
            return f"{trained:.0f} of {run.wall_s:.0f} s of training"
        return ""

    def trained_s(self) -> float:
        """Seconds since the groups were formed (the wall budget's clock)."""
        return self.wall() - self.started_training if self.started_training else 0.0

    def finish(self, reason: str) -> list[Action]:
        """Budget spent (or the run failed): ``done``, logged; ``Done`` tells the rest."""
        if self.done:
            return []
        self.done, self.done_reason = True, reason
        return [Log("done", {"reason": reason, "train_s": self.trained_s()}), Done(reason)]

    def fail(self, code: str, reason: str) -> list[Action]:
        """End the run now because of ``reason`` (kept in ``failure``; the first one counts):
        ``Fail`` tells the workers, then the run is ``done``."""
        if self.failure:
            return []
        self.failure = reason
        return [Log("failed", {"code": code, "reason": reason}), Fail(code, reason),
                *self.finish(code)]

    # -- checkpoints -------------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """A consistent snapshot of the run (``snapshot``)."""
        assert self.weights is not None
        return snapshot(self.run, self.roster, self.weights, version=self.version,
                        samples=self.samples, saved_at=self.wall(),
                        train_s=self.wall() - self.started_training, merged=self.merged)

    def load_state_dict(self, state: dict[str, Any]) -> list[Action]:
        """A checkpoint's weights, counters and workers (``ConfigError`` when it belongs to
        another model or config); its groups come back with ``resume``."""
        self.weights = restore_workers(self.run, self.roster, state)
        self.changes = None  # nothing before the checkpoint's weights is known
        self.version, self.samples = state["version"], state["samples"]
        return [WeightsReady()]

    # -- weights and traffic for the other roles-----------------------------------------------

    def weights_message(self, weights: Delta | None = None, final: bool = False,
                        members: list[int] | None = None) -> messages.GlobalWeights:
        """GLOBAL_WEIGHTS with the global weights (or an exchange's sparse answer: entries to
        set) and the run's counters."""
        w = self.weights if weights is None else weights
        w = w if w is not None else np.zeros(0, np.float32)
        traffic = self.traffic()
        return messages.GlobalWeights(
            version=self.version, done=final or self.done, size=int(w.size),
            samples=self.samples, t=self.wall() - self.run.t0, train_s=self.trained_s(),
            done_reason=self.done_reason, bytes_up=traffic["bytes_up"],
            bytes_down=traffic["bytes_down"], members=members or [],
            payload=sparse.encode_vector(w))

    def assign_message(self, h: GroupHandle) -> control.Assign:
        """ASSIGN for group ``h``: its address, ratio, the run's staleness bound and its
        local steps H (0: the run's)."""
        s = self.run.staleness_bound
        return control.Assign(group=h.id, address=h.address, ratio=h.ratio,
                               staleness=-1 if s is None else int(s),
                               local_steps=self.local_steps_of(h))

    def local_steps_of(self, h: GroupHandle) -> int:
        """Group ``h``'s H for its ASSIGN: the one ``Roster.update_local_steps`` set, or with
        local steps auto before it did (a group process is given its group before the groups
        form) the first grouping's (``_steps_for``), else the fastest group's; 0: the run's."""
        if h.local_steps or not self.run.local_steps_auto:
            return h.local_steps
        return self._first_steps.get(h.id) or self.run.local_steps_max

    def traffic(self) -> dict[str, int]:
        """Worker <-> group bytes so far (group processes: as of their last exchange)."""
        up = down = 0
        for h in self.groups.values():
            b = h.peer.traffic()
            up, down = up + b.get("bytes_in", 0), down + b.get("bytes_out", 0)
        return {"bytes_up": up, "bytes_down": down}
