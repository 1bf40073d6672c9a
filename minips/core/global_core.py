"""The global server's rules without IO: the roster and the grouping, GDTopK's ratios, the
run's budget and its checkpoints. The global weights and the groups' exchanges with them are
``merge.Merger``'s, which ``GlobalCore`` holds (the round trip reads in core/merge.py).

``server.GlobalServer`` (asyncio) and ``simulate.py`` (simulated time) drive it. Time comes in as
``now`` (``wall`` only dates records and the wall budget), the worker traffic as event data from
the shell's ledger. Every entry point answers with a list of actions (``actions.py``) in the
order the shell is to perform them; what goes back to the one who asked is one of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from minips import sparse
from minips.core.actions import (
    Admitted,
    AllFinal,
    Fail,
    FormGroups,
    GlobalAction,
    GroupReply,
    Log,
    Placed,
    PlaceLate,
    Regroup,
    Rehomed,
    RunDone,
    SendSettings,
    WeightsReady,
    reply,
)
from minips.core.config import RunConfig
from minips.core.exchange import Delta, ExchangeResult
from minips.core.merge import Merger
from minips.core.roster import GroupHandle, Roster, WorkerEntry
from minips.core.snapshot import restore_groups, restore_workers, snapshot
from minips.errors import RemoteProtocolError
from minips.wire import control, messages

__all__ = ["GlobalCore"]


class _OfMerger:
    """An attribute of the core's ``Merger``, read and set through the core."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, core: GlobalCore, owner: type | None = None) -> Any:
        return getattr(core.merger, self.name)

    def __set__(self, core: GlobalCore, value: Any) -> None:
        setattr(core.merger, self.name, value)


class GlobalCore:
    """The roster, the grouping, the run's budget and checkpoints; the weights in ``merger``."""

    run = _OfMerger()  # RunConfig: the run's rules (the merger reads them too)
    weights = _OfMerger()  # np.ndarray | None: the global weights (none before the first)
    version = _OfMerger()  # int: merges applied to the weights
    samples = _OfMerger()  # int: training samples all groups reported

    def __init__(self, run: RunConfig, weights: np.ndarray | None, *, regroup: bool,
                 wall: Callable[[], float]) -> None:
        self.roster = Roster(run, regroup=regroup)
        self.merger = Merger(run, self.roster, weights)  # the weights and the groups' copies
        self.wall = wall  # the run's wall clock (records, the wall budget); rules take ``now``
        self.workers = self.roster.workers  # worker id -> WorkerEntry
        self.groups = self.roster.groups  # group id -> GroupHandle
        self.grouped = False  # the first groups are drawn up (FormGroups went out)
        self.calib_expired = False  # calib_timeout_s passed: the next STATS forms the groups
        self.done, self.done_reason = False, ""  # the run is over, and why (``finish``)
        self.failure = ""  # why the run ended short or broken ("" = it did not; ``fail``)
        self.train_size = run.epoch_samples()
        self.started_training = 0.0  # wall time when the groups were formed
        self._rejoin: tuple[float, float, str] | None = None  # (deadline, wait s, left): all_final

    # -- workers ---------------------------------------------------------------------------
    def admit(self, wanted: int, now: float) -> list[GlobalAction]:
        """A worker id for a HELLO that asked for ``wanted`` (``Roster.admit``): ``Admitted``."""
        return [Admitted(self.roster.admit(wanted, now))]

    def worker_joined(self, w: int) -> list[GlobalAction]:
        """Worker ``w``'s control channel opened (a newer one replaces an older)."""
        entry = self.workers[w]
        entry.connected, entry.left, entry.said_gone = True, False, False
        self.roster.seated(w)
        return [Log("joined", {"worker": w})]

    def worker_leaving(self, w: int, reason: str = "") -> list[GlobalAction]:
        """Worker ``w`` said LEAVE (``reason``: why, e.g. it has no data): its id may go again."""
        self.workers[w].left = True
        self.workers[w].left_because = "" if reason == "bye" else reason
        return []

    def worker_gone(self, w: int) -> list[GlobalAction]:
        """Worker ``w``'s control channel closed (after LEAVE, or lost)."""
        entry = self.workers[w]
        entry.connected, entry.said_gone = False, True
        reason = (entry.left_because or "leave") if entry.left else "done" if self.done \
            else "connection lost"
        return [Log("left", {"worker": w, "reason": reason})]

    def group_saw_gone(self, g: int, w: int) -> list[GlobalAction]:
        """Group ``g``'s process saw worker ``w``'s connection break (EXCHANGE event `left`):
        said here only when no control channel of ``w``'s did since it opened (a worker killed
        before it rejoined a resumed server)."""
        entry = self.workers.get(w)
        if entry is not None:
            if entry.connected or entry.said_gone:
                return []
            entry.said_gone = True
        return [Log("left", {"group": g, "worker": w,
                             "reason": f"its connection to group {g} was lost"})]

    def on_stats(self, w: int, msg: control.Stats, now: float) -> list[GlobalAction]:
        """Worker ``w``'s measured speed: form the groups, place it, regroup or update ratios."""
        entry = self.workers[w]
        entry.step_time, entry.clock = float(msg.step_time), int(msg.clock)
        said = [Log("data", {"worker": w, **msg.data})] if msg.data else []  # its first STATS
        return said + self._placed(w, entry, now)

    def probe_pulled(self, w: int, now: float) -> list[GlobalAction]:
        """Worker ``w``'s link probe: the weights go out to it at ``now`` (``Roster``'s)."""
        self.roster.probe_pulled(w, now)
        return []

    def probe_pushed(self, w: int, now: float) -> list[GlobalAction]:
        """The probe's PUSH of ``w`` arrived at ``now``: its link time, logged."""
        link = self.roster.probe_pushed(w, now)
        return [] if link is None else [Log("link_probe", {"worker": w, "link_s": link})]

    def _placed(self, w: int, entry: WorkerEntry, now: float) -> list[GlobalAction]:
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

    def on_initial(self, weights: np.ndarray) -> list[GlobalAction]:
        """A worker's initial weights: the first are taken, later ones of another size refused."""
        if self.weights is None:
            self.weights = weights
            return [WeightsReady()]
        if weights.size != self.weights.size:
            raise RemoteProtocolError("initial weights of another model size",
                                      expected=self.weights.size, got=weights.size)
        return []

    # -- grouping --------------------------------------------------------------------------
    def calib_timeout(self, now: float) -> list[GlobalAction]:
        """``calib_timeout_s`` passed: group whoever reported (nobody yet: the first STATS)."""
        if self.grouped:
            return []
        self.calib_expired = True
        reported = sorted(self.roster.step_times())
        actions: list[GlobalAction] = [Log("calib_timeout", {"reported": reported,
                                                             "expected": self.run.workers})]
        if reported:
            self.grouped = True
            actions.append(FormGroups())
        return actions

    def first_assignment(self, now: float) -> dict[int, int]:
        """``{worker: group}`` (0 = fastest), its ratios and H set before the groups open."""
        assignment = self.roster.first_assignment()
        self.roster.first_ratios(assignment, now)
        self.roster.first_steps = self.roster.steps_for(assignment)
        return assignment

    def ratio_of(self, g: int) -> float:
        """The GDTopK ratio group ``g`` opens with (``Roster.ratio_of``)."""
        return self.roster.ratio_of(g)

    def groups_formed(self, handles: list[GroupHandle], assignment: dict[int, int],
                      now: float) -> list[GlobalAction]:
        """The first groups are open (``handles``) with the global weights as of ``now``:
        training starts, every worker of ``assignment`` is in its group."""
        for h in handles:
            self.group_opened(h, now)
        self.roster.refresh_step_times()
        self.started_training = self.wall()
        for w, g in assignment.items():
            self.workers[w].group = g
        steps = self.roster.update_local_steps()  # local steps auto: each group's first H
        return [Log("groups", {"assignment": {str(w): g for w, g in assignment.items()},
                               **self.roster.speeds(assignment),
                               "ratios": {str(g): h.ratio for g, h in self.groups.items()},
                               "addresses": {str(g): h.address
                                             for g, h in self.groups.items()}}),
                *self._local_steps_actions(steps)]

    def _local_steps_actions(self, changed: list[int]) -> list[GlobalAction]:
        """Local steps auto: log the groups' H, send the changed ones (``SendSettings``)."""
        if not changed:
            return []
        return [Log("local_steps", {"local_steps": {str(g): h.local_steps
                                                    for g, h in self.groups.items()}}),
                SendSettings({g: self.groups[g].ratio for g in changed})]

    def place_late(self, w: int) -> list[GlobalAction]:
        """Worker ``w`` reported after the grouping: ``Placed`` in the group nearest in speed."""
        entry = self.workers[w]
        if entry.group >= 0:
            return []
        g = self.roster.place_late(entry)
        return [Log("placed", {"worker": w, "group": g, "moved": {str(w): g},
                               "step_time": entry.step_time,
                               "iteration_s": entry.iteration()}), Placed(w, g)]

    def group_opened(self, h: GroupHandle, now: float) -> list[GlobalAction]:
        """Group ``h`` has its server, opened with the global weights as of ``now``."""
        self.groups[h.id] = h
        self.merger.synced_now(h.id, now)
        return []

    def moved(self, moves: dict[int, int], now: float) -> list[GlobalAction]:
        """A ``Regroup`` carried out (``{worker: group}``, open groups); the ratios anew."""
        for w, g in moves.items():
            self.roster.move(w, g)
        return [Log("regroup", {"moved": {str(w): g for w, g in moves.items()},
                                **self.roster.speeds(self.workers)}),
                *self._update_ratios(now)]

    def group_served(self, g: int, address: str) -> list[GlobalAction]:
        """A group process at ``address`` took group ``g`` over (``Roster.orphan``)."""
        h = self.groups[g]
        h.served, h.address = True, address
        return [Log("group_adopted", {"group": g, "address": address})]

    def group_lost(self, g: int, final: bool = False) -> list[GlobalAction]:
        """Group ``g``'s group process is gone: lost, or ended (``final``, or the run is)."""
        self.groups[g].served = False
        return [Log("group_ended" if final or self.done else "group_lost", {"group": g})]

    def rehome(self, g: int) -> list[GlobalAction]:
        """Nobody took lost group ``g`` over: its workers move (``Roster.rehome``)."""
        if self.groups[g].served or self.done or not (moved := self.roster.rehome(g)):
            return []
        return [Log("rehomed", {"group": g, "moved": {str(w): v for w, v in moved.items()}}),
                Rehomed(g, moved)]

    def resume(self, handles: dict[int, GroupHandle], state: dict[str, Any]) -> list[GlobalAction]:
        """The checkpoint's groups (``state``, after ``load_state_dict``) opened again."""
        self.grouped = True
        restore_groups(self.roster, self.merger.merged, handles, state)
        self.started_training = self.wall() - float(state["train_s"])
        return []

    # -- GDTopK ratios -----------------------------------------------------------------------
    def _update_ratios(self, now: float) -> list[GlobalAction]:
        """GDTopK's new ratios (``Roster.update_ratios``) and local steps auto's new H, sent."""
        new = self.roster.update_ratios(now)
        steps = self._local_steps_actions(self.roster.update_local_steps())
        if not new:
            return steps
        policy = self.roster.policy
        times = {str(g): policy.times.get(g) for g in new} if policy else {}
        return [Log("ratios", {"ratios": {str(g): r for g, r in new.items()},
                               "iter_time": times}), SendSettings(new), *steps]

    # -- the groups' exchanges (the round trip is core/merge.py's) ---------------------------
    def merge(self, g: int, delta: Delta, stats: dict[str, Any], now: float,
              traffic: Mapping[str, int] | None = None) -> list[GlobalAction]:
        """Group ``g``'s exchange merged (``Merger.merge``) and what it decides beyond the
        weights: a failure, ratios, the budget; ``GroupReply`` (last) with the result."""
        out = self.merger.merge(g, delta, stats, now, done=self.done, traffic=traffic)
        actions: list[GlobalAction] = self.fail("diverged", out.diverged) if out.diverged else []
        if out.added and self.roster.policy is not None:  # its iteration time feeds GDTopK
            self.roster.observe_iter_time(g, stats.get("iter_time"), now)
            actions += self._update_ratios(now)
        actions += out.logs
        if out.added:
            actions += self._check_budget()
        return [*actions, GroupReply(g, out.result)]

    def on_exchange(self, g: int, delta: Delta, stats: dict[str, Any], now: float,
                    traffic: Mapping[str, int] | None = None) -> list[GlobalAction]:
        """A group process's EXCHANGE: ``merge``; ``GroupReply`` (last) with EXCHANGE_REPLY."""
        actions = self.merge(g, delta, stats, now, traffic)
        res = reply(actions, ExchangeResult)
        return [*actions[:-1], GroupReply(g, self.merger.exchange_reply(g, res.weights, res.done))]

    def group_pull(self, g: int, now: float,
                   traffic: Mapping[str, int] | None = None) -> list[GlobalAction]:
        """A group process's PULL: GLOBAL_WEIGHTS, naming the exchange merged last."""
        msg = self.weights_message(self.merger.pulled(g, now), members=self.groups[g].members,
                                   traffic=traffic)
        last = list(self.groups[g].last_exchange)
        return [GroupReply(g, dataclasses.replace(msg, last_exchange=last))]

    def group_left(self, g: int) -> list[GlobalAction]:
        """Group ``g``'s server said LEAVE: it is final."""
        self.groups[g].final = True
        return self._check_budget()

    # -- the budget --------------------------------------------------------------------------
    def _check_budget(self) -> list[GlobalAction]:
        actions: list[GlobalAction] = []
        if self.run.epochs > 0 and self.samples >= self.run.epochs * self.train_size:
            actions += self.finish("epochs")
        if self.groups and all(h.final for h in self.groups.values()):
            actions.append(AllFinal())  # the end, or a wait for the workers to rejoin
        return actions

    # Every group final with budget left: every worker is gone at once, only for a while
    # (stopped, partitioned, restarted). They get ``wait_s``, counted from the latest group's
    # end; a group's first non-final merge means they are back. The shell ticks the wait.
    def all_final(self, now: float, wait_s: float) -> list[GlobalAction]:
        """Every group is final at ``now``: the run ends, or waits ``wait_s`` for its workers."""
        left = self.budget_left()
        if not left:
            return self.finish("workers left")
        self._rejoin = (now + wait_s, wait_s, left)
        return [Log("waiting_for_workers", {"wait_s": wait_s, "left": left})]

    def tick(self, now: float) -> list[GlobalAction]:
        """A rejoin wait at ``now``: over when a group trains again, a failure once past."""
        if self._rejoin is None:
            return []
        by, wait_s, left = self._rejoin
        if self.done or not all(h.final for h in self.groups.values()):
            self._rejoin = None
            return [] if self.done else [Log("workers_back")]
        if now < by:
            return []
        self._rejoin = None
        return self.fail("workers_gone", "the run ended short of its budget: every worker was "
                         f"gone for {wait_s:.0f} s with {left} left (--rejoin-wait)")

    def budget_left(self) -> str:
        """What is left of the budget ("": spent, the run is over, or the workers end it)."""
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

    def finish(self, reason: str) -> list[GlobalAction]:
        """Budget spent (or the run failed): ``done``, logged; ``RunDone`` tells the rest."""
        if self.done:
            return []
        self.done, self.done_reason = True, reason
        return [Log("done", {"reason": reason, "train_s": self.trained_s()}), RunDone(reason)]

    def fail(self, code: str, reason: str) -> list[GlobalAction]:
        """End the run now because of ``reason`` (the first one is ``failure``): ``Fail``."""
        if self.failure:
            return []
        self.failure = reason
        return [Log("failed", {"code": code, "reason": reason}), Fail(code, reason),
                *self.finish(code)]

    # -- checkpoints -------------------------------------------------------------------------
    def checkpoint_state(self, held: dict[int, dict[str, Any]] | None = None) -> dict[str, Any]:
        """A snapshot of the run (``held``: the shell's traffic and states of each group)."""
        assert self.weights is not None
        return snapshot(self.run, self.roster, self.weights, version=self.version,
                        samples=self.samples, saved_at=self.wall(),
                        train_s=self.wall() - self.started_training, merged=self.merger.merged,
                        held=held or {})

    def load_state_dict(self, state: dict[str, Any]) -> list[GlobalAction]:
        """A checkpoint's weights, counters and workers (its groups: ``resume``)."""
        self.weights = restore_workers(self.run, self.roster, state)
        self.merger.changes = None  # nothing before the checkpoint's weights is known
        self.version, self.samples = state["version"], state["samples"]
        return [WeightsReady()]

    # -- messages for the other roles --------------------------------------------------------
    def weights_message(self, weights: Delta | None = None, final: bool = False,
                        members: list[int] | None = None,
                        traffic: Mapping[str, int] | None = None) -> messages.GlobalWeights:
        """GLOBAL_WEIGHTS with the global weights (or ``weights``) and the run's counters
        (``traffic``: the worker bytes of the shell's ledger, ``bytes_up`` / ``bytes_down``)."""
        w = self.weights if weights is None else weights
        w = w if w is not None else np.zeros(0, np.float32)
        traffic = traffic or {}
        return messages.GlobalWeights(
            version=self.version, done=final or self.done, size=int(w.size),
            samples=self.samples, t=self.wall() - self.run.t0, train_s=self.trained_s(),
            done_reason=self.done_reason, bytes_up=int(traffic.get("bytes_up", 0)),
            bytes_down=int(traffic.get("bytes_down", 0)), members=members or [],
            payload=sparse.encode_vector(w))

    def assign_message(self, h: GroupHandle) -> control.Assign:
        """ASSIGN for group ``h``: address, ratio, the run's staleness bound, H (0: the run's)."""
        s = self.run.staleness_bound
        return control.Assign(group=h.id, address=h.address, ratio=h.ratio,
                               staleness=-1 if s is None else int(s),
                               local_steps=self.roster.local_steps_of(h))
