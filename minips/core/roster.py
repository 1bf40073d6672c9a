"""The global server's roster: which workers exist, which group each is in, each group's speed,
GDTopK ratio and whether a server serves it (no asyncio, no sockets, no torch; time comes in as
``now``).

``GlobalCore`` owns one ``Roster`` (its asyncio shell ``GlobalServer`` does the I/O around
it): ``admit`` gives workers their ids, ``first_assignment`` forms the groups
(``grouping.Regrouper``), ``maybe_regroup`` says whether speeds drifted, ``move`` moves workers.

Speed is the iteration a group waits on, not compute alone (DESIGN.md, "Grouping"): each
worker's entry keeps its compute time (``step_time``, its STATS) and its iteration
(``iteration_s``, what its group server measured: PUSH to PUSH less the SSP hold, reported with
every exchange, ``observe_iterations``). Before any group measured it, the grouping sees the
calibration's compute time plus ``link_s``, one weights download and one push-sized upload over
the worker's own link timed by the global server (``WorkerEntry.iteration``). The grouping, the
regrouping test, a late joiner's or a lost group's workers' placement and GDTopK's first ratios
all use ``iteration_times``.
GDTopK: ``first_ratios`` sets the ratios the groups open with, every exchange's measured
iteration time goes to ``observe_iter_time``, and when ``update_ratios`` returns new ratios
(``RatioPolicy``) the core tells its shell to send them (``SendSettings``). Local steps auto:
``update_local_steps`` sets each group's H from its step time (``local_steps.auto_local_steps``)
in the handle; it travels as the ratio does (ASSIGN).

Worker ids: a HELLO asks for one or sends -1; -1 gets an id never given out, else one whose worker
is gone (``free_id``), so a worker restarted without its old id still finds a place.

Groups. Each group has one record, its ``GroupHandle``: members, address, speed, ratio, H, its
exchanges' counters, and whether a group server serves it now (``served``). The server itself is
the shell's (``serve/peers.py``): the roster only says who is where. The group's GDTopK ratio
has one owner, ``GroupHandle.ratio``, which the roster sets; the shell hands a new one (with the
group's H) to the group's server (``GroupPeer.send_settings``).

Invariants: a worker with ``group >= 0`` is listed in exactly that group's ``members``; group ids
stay stable across a regroup (``match_labels`` names new groups after the old group most of their
members come from), so only workers whose group really changed are moved.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from minips import grouping
from minips.core.config import RunConfig
from minips.core.local_steps import auto_local_steps
from minips.errors import AuthError

__all__ = [
    "WorkerEntry",
    "GroupHandle",
    "Roster",
    "match_labels",
    "TRAFFIC",
    "MAX_TRAFFIC_BASES",
    "REGROUP_EVERY_S",
    "REGROUP_DELAY_S",
    "REGROUP_FAST_S",
    "CLAIM_S",
]


# -- the roster ------------------------------------------------------------------------------

REGROUP_EVERY_S = 2.0  # the Regrouper sees the step times once per this period
# A lasting change of a worker's speed by 2x or more moves it within this many seconds: its
# iteration time (its group's exchanges bring it, every sync_every pushes of the group; the
# STATS that trigger the looks come every second) reaches the Regrouper once per REGROUP_EVERY_S;
# the smoothed log time (weight 0.3) needs 3 to 5 looks to cross to the other group's side, then
# the groups must stay out of shape for ``patience`` = 5 looks: (5 + 5) x 2 s + 2 s of STATS and
# margin (docs/operations.md, tests/test_changing_speeds.py)
REGROUP_DELAY_S = 30.0
# A lasting change by 3x or more skips the patience (the Regrouper's change-point test fires on
# its 2nd look): an exchange of its group, up to REGROUP_EVERY_S to the next look, 2 looks, the
# regroup
REGROUP_FAST_S = 10.0
CLAIM_S = 10.0  # s an id given to a handshake is held for it (the handshake's own time limit)


@dataclass
class WorkerEntry:
    """What the global server knows of one worker."""

    id: int
    connected: bool = False  # its control channel is open (the shell holds the channel)
    step_time: float | None = None  # last reported seconds per step: compute to an encoded push
    link_s: float | None = None  # calibration: weights down + a push up its link, server-timed
    iteration_s: float | None = None  # its group server's last measured iteration (s)
    clock: int = 0  # last reported clock
    group: int = -1  # assigned group, -1 before grouping
    left: bool = False  # sent LEAVE
    left_because: str = ""  # the reason its LEAVE gave ("" or "bye": a plain goodbye)
    said_gone: bool = False  # a `left` line named it since its control channel last opened

    def iteration(self) -> float | None:
        """Seconds of the iteration its group waits on: measured by its group server once one
        did, else its compute time plus the calibration's link time (compute alone from a
        worker that timed no link); None before its first STATS."""
        if self.iteration_s:
            return self.iteration_s
        if not self.step_time:
            return None
        return self.step_time + (self.link_s or 0.0)


TRAFFIC = ("bytes_in", "bytes_out")  # a group's worker traffic counters (EXCHANGE's fields)
MAX_TRAFFIC_BASES = 4096  # group-process sessions whose traffic base a group keeps


class GroupHandle:
    """One group as the global server sees it (its server is the shell's: serve/peers.py)."""

    def __init__(self, id: int, address: str, members: list[int] | None = None,
                 ratio: float = 0.01, served: bool = False) -> None:
        self.id = id
        self.address = address  # "host:port" where its workers connect ("": none serves it)
        self.members: list[int] = list(members or [])
        self.served = served  # a group server serves it now (a lost group process: False)
        self.ratio = ratio  # GDTopK kept fraction for its workers (the one owner of it)
        self.step_time = 0.0  # mean of its workers' step (compute) times, seconds
        self.iteration_s = 0.0  # mean of its workers' iteration times (WorkerEntry.iteration)
        self.local_steps = 0  # H of its workers with local_steps auto (0: the run's H)
        self.final = False  # flushed its last delta
        self.merges = 0
        self.last_exchange = (-1, -1)  # (session, seq) of the last merged exchange
        # last_exchange as of the last two checkpoint snapshots, older first (exchange.py)
        self.snapshots: list[tuple[int, int]] = [(-1, -1)] * 2
        # worker traffic the group had counted when each group-process session began (session ->
        # {bytes_in, bytes_out}): each session counts from 0, on top of it (across_sessions)
        self.traffic_bases: dict[int, dict[str, int]] = {}

    def across_sessions(self, info: dict[str, Any], known: dict[str, int]) -> dict[str, Any]:
        """A group process's EXCHANGE counters (``info``) with its ``bytes_in`` / ``bytes_out``,
        which count from 0 in each group-process session, put on top of what the group's
        earlier sessions counted (``known``: its counts as of its last merged exchange, the
        shell's): the group's worker traffic so far, which does not fall when another process
        takes the group over, and is not counted twice when the same process comes back to a
        resumed server (a replay of an older session keeps its base)."""
        session = info["session"]
        base = self.traffic_bases.get(session)
        if base is None:
            # the session those counts came from, on a server resumed from its checkpoint (which
            # keeps the counts, not their split): they hold part of this session's own, so its
            # base is at most what the others counted; else a new session, from 0 on top of them
            own = session == self.last_exchange[0]
            base = {k: max(0, int(known.get(k, 0)) - (int(info[k]) if own else 0))
                    for k in TRAFFIC}
            self.traffic_bases[session] = base
            while len(self.traffic_bases) > MAX_TRAFFIC_BASES:
                del self.traffic_bases[next(iter(self.traffic_bases))]
        return {**info, **{k: base[k] + int(info[k]) for k in TRAFFIC}}


class Roster:
    """Workers, groups and the grouping policy of one run (see the module docstring)."""

    def __init__(self, run: RunConfig, *, regroup: bool) -> None:
        self.run = run
        self.workers: dict[int, WorkerEntry] = {}
        self.groups: dict[int, GroupHandle] = {}
        self.regrouper = grouping.Regrouper(k=run.fixed_groups or None, max_k=run.max_groups)
        self.regroup = regroup  # regroup when speeds drift (GSSP with in-process groups)
        self._regroup_at = -REGROUP_EVERY_S  # `now` of the last Regrouper update
        self._claimed: dict[int, float] = {}  # id -> `now` it was given to a handshake
        self._probes: dict[int, float] = {}  # worker -> `now` its link probe's weights went out
        self._fastest: dict[int, float] = {}  # worker -> its fastest probe this session (s)
        self.first_steps: dict[int, int] = {}  # local steps auto: H per group, first grouping
        from minips.compress.registry import ratio_policy  # plug-ins load with a run

        self.policy = ratio_policy(run.compressor, run.ratio, direction=run.gdtopk_direction,
                                   alpha=run.gdtopk_alpha)  # GDTopK ratios per group, or None

    def admit(self, wanted: int, now: float = 0.0) -> int:
        """A worker id for a HELLO that asked for ``wanted`` (-1: ``free_id``). The id is held
        for the handshake that asked (until ``seated``, at most CLAIM_S), so two HELLOs with -1
        at once never get the same id."""
        if wanted < 0:
            wanted = self.free_id(now)
        if wanted >= self.run.workers:
            raise AuthError(f"worker id {wanted} out of range 0..{self.run.workers - 1}")
        self.workers.setdefault(wanted, WorkerEntry(wanted))
        self._claimed[wanted] = now
        return wanted

    def free_id(self, now: float) -> int:
        """The lowest id never given out, else the lowest whose worker is gone (no control
        connection: it crashed, was lost or left), so a restarted worker that does not send its
        old id still gets in, with a gone worker's shard and group."""
        held = {w for w, t in self._claimed.items() if now - t < CLAIM_S}
        unused = [i for i in range(self.run.workers) if i not in self.workers]
        gone = [w for w, e in sorted(self.workers.items()) if not e.connected and w not in held]
        free = unused + gone
        if not free:
            raise AuthError(f"no free worker id: all {self.run.workers} are connected")
        return free[0]

    def seated(self, w: int) -> None:
        """Worker ``w``'s session started (its control connection is in its entry); its link
        probes count anew."""
        self._claimed.pop(w, None)
        self._fastest.pop(w, None)

    def step_times(self, live_only: bool = False) -> dict[int, float]:
        """``{worker: seconds per step}`` of the workers that reported one."""
        return {w: e.step_time for w, e in self.workers.items()
                if e.step_time and not (live_only and e.left)}

    def iteration_times(self, live_only: bool = False) -> dict[int, float]:
        """``{worker: seconds per iteration}`` (``WorkerEntry.iteration``) of the workers that
        reported a step time: what the grouping uses."""
        return {w: t for w, e in self.workers.items()
                if (t := e.iteration()) and not (live_only and e.left)}

    def observe_iterations(self, stats: dict[str, Any]) -> None:
        """An exchange's per-worker iteration times (``iter_workers``, ``iter_us``: one entry
        per worker its group timed since its last exchange) into the workers' entries."""
        for w, us in zip(stats.get("iter_workers") or [], stats.get("iter_us") or [],
                         strict=False):
            if w in self.workers and us > 0:
                self.workers[w].iteration_s = us / 1e6

    # The first grouping must see the link too, and no group has timed anyone yet. A worker's
    # calibration therefore ends with one iteration's transfers over its own link, on its
    # control channel: a PULL answered with the global weights whole (what its group's first
    # answer costs it), then a PUSH the size of its real ones (its calibration gradient, as its
    # compressor would send it), which the server drops. The server times the weights going
    # out to the PUSH arriving: the link's share of an iteration, measured where a group would
    # see it, for one weights transfer and one push, without training on anything or holding
    # the other workers (a warm-up iteration in a provisional group would). Its compute time is
    # the calibration's own (STATS), so ``WorkerEntry.iteration`` is the two summed. A worker
    # probes more than once and the fastest counts: a process the CPU scheduler left waiting
    # (8 workers on 2 cores) would otherwise read as a slow link.
    def probe_pulled(self, w: int, now: float) -> None:
        """Worker ``w``'s link probe: the weights go out to it at ``now``."""
        self._probes[w] = now

    def probe_pushed(self, w: int, now: float) -> float | None:
        """The link probe's PUSH of ``w`` arrived at ``now``: its link time (weights down, a
        push up, seconds); the fastest of its session's probes is its entry's ``link_s``. None
        without a probe's PULL before."""
        t = self._probes.pop(w, None)
        if t is None or w not in self.workers:
            return None
        took = max(0.0, now - t)
        self._fastest[w] = min(self._fastest.get(w, took), took)
        self.workers[w].link_s = self._fastest[w]
        return took

    def all_reported(self) -> bool:
        return len(self.step_times()) >= self.run.workers

    def first_assignment(self) -> dict[int, int]:
        """``{worker: group}`` for the first grouping (group 0 = fastest)."""
        return self.regrouper.update(self.iteration_times()) or {}

    def maybe_regroup(self, now: float) -> dict[int, int] | None:
        """A new assignment when the Regrouper's hysteresis says the speeds drifted, else None."""
        if not (self.regroup and self.run.sync.regroup and self.run.regroup) \
                or now - self._regroup_at < REGROUP_EVERY_S:
            return None  # one look per period, so the Regrouper's patience counts periods
        self._regroup_at = now
        new = self.regrouper.update(self.iteration_times(live_only=True))
        old = {w: e.group for w, e in self.workers.items() if not e.left}
        ended = {g for g, h in self.groups.items() if h.final}  # flushed its last delta: gone
        return None if new is None else match_labels(new, old, ended)

    def moved(self, assignment: dict[int, int]) -> dict[int, int]:
        """The workers whose group ``assignment`` changes, with their new group."""
        return {w: g for w, g in assignment.items() if self.workers[w].group != g}

    def move(self, w: int, g: int) -> None:
        """Move worker ``w`` (grouped) to the open group ``g``."""
        self.groups[self.workers[w].group].members.remove(w)
        self.add_member(g, w)

    def add_member(self, g: int, w: int) -> None:
        """Worker ``w`` joins group ``g`` (its entry says so too)."""
        handle = self.groups[g]
        handle.members.append(w)
        handle.final = False
        self.workers[w].group = g

    def place_late(self, entry: WorkerEntry) -> int:
        """The group for a worker that reported after the grouping (nearest in iteration)."""
        self.refresh_step_times()
        t = entry.iteration() or 1.0
        g = grouping.nearest_group(t, {g: h.iteration_s for g, h in self.groups.items()
                                       if h.iteration_s > 0} or {min(self.groups): t})
        self.regrouper.place(entry.id, t)
        self.add_member(g, entry.id)
        return g

    def orphan(self, prefer: int) -> GroupHandle | None:
        """A group no server serves, for a group process that connects after the grouping:
        group ``prefer`` (its own) first, else the first in the roster; None when every group
        has its server."""
        orphans = [h for h in self.groups.values() if not h.served]
        return min(orphans, key=lambda h: h.id != prefer, default=None)

    def rehome(self, lost: int) -> dict[int, int]:
        """Move every member of group ``lost`` (its server is gone, no replacement came) to the
        group with a connected server nearest in speed; return ``{worker: new group}`` (empty:
        nowhere to go). Once they moved, ``lost`` no longer holds the end of the run (final)."""
        self.refresh_step_times()
        times = {g: h.iteration_s or 1.0 for g, h in self.groups.items() if h.served}
        if not times:
            return {}
        moved = {}
        for w in list(self.groups[lost].members):
            g = grouping.nearest_group(self.workers[w].iteration() or 1.0, times)
            self.move(w, g)
            self.regrouper.assignment[w] = g
            moved[w] = g
        if moved:
            self.groups[lost].final = True
        return moved

    def first_ratios(self, assignment: dict[int, int], now: float) -> None:
        """GDTopK: the ratios of the first grouping, from the workers' iteration times (before
        the groups open, so each group server starts with its own; ``ratio_of``)."""
        if self.policy is None:
            return
        times = self.iteration_times()
        counts = collections.Counter(assignment.values())
        for g in counts:
            self.policy.seed(g, float(np.mean([times[w] for w, h in assignment.items()
                                               if h == g])))
        self.policy.propose(counts, now)

    def ratio_of(self, g: int) -> float:
        """Group ``g``'s GDTopK ratio as the policy last set it (the run's ratio otherwise)."""
        return self.policy.ratios.get(g, self.run.ratio) if self.policy else self.run.ratio

    def observe_iter_time(self, g: int, iter_time: Any, now: float) -> None:
        """An exchange of group ``g`` reported its workers' mean iteration time (ratios.py)."""
        if self.policy is not None:
            self.policy.observe(g, iter_time, now)

    def update_ratios(self, now: float) -> dict[int, float]:
        """Refresh each group's mean step and iteration times; with GDTopK, the new
        ``{group: ratio}`` of every group with workers when the policy (rate limit, hysteresis)
        proposes new ones, now in the group handles; {} otherwise."""
        self.refresh_step_times()
        if self.policy is None or not self.groups:
            return {}
        for g, h in self.groups.items():
            self.policy.seed(g, h.iteration_s)  # a group that has not reported one yet
        new = self.policy.propose({g: len(h.members) for g, h in self.groups.items()}, now)
        for g, r in (new or {}).items():
            self.groups[g].ratio = r
        return new or {}

    def update_local_steps(self) -> list[int]:
        """Local steps auto: each group's H from its step time (``local_steps.auto_local_steps``,
        groups with workers, step times as of the last ``refresh_step_times``); the groups whose
        H changed ([] when H is the run's)."""
        if not self.run.local_steps_auto:
            return []
        times = {g: h.step_time for g, h in self.groups.items() if h.members}
        changed = []
        held = {g: h.local_steps for g, h in self.groups.items()}
        for g, steps in auto_local_steps(times, self.run.local_steps_max, held).items():
            if steps != self.groups[g].local_steps:
                self.groups[g].local_steps = steps
                changed.append(g)
        return changed

    def steps_for(self, assignment: dict[int, int]) -> dict[int, int]:
        """Local steps auto: each group's H for ``assignment`` as ``GlobalCore.groups_formed``
        will set it (its members' mean step time, ``auto_local_steps``), so that an ASSIGN sent
        before (a group process's: ``GlobalCore.assign_message``) carries it too; {} with the
        run's H."""
        if not self.run.local_steps_auto:
            return {}
        times: dict[int, list[float]] = {}
        for w, g in assignment.items():
            if t := self.workers[w].step_time:
                times.setdefault(g, []).append(t)
        return auto_local_steps({g: float(np.mean(t)) for g, t in times.items()},
                                self.run.local_steps_max)

    def local_steps_of(self, h: GroupHandle) -> int:
        """Group ``h``'s H for its ASSIGN: the one ``update_local_steps`` set, or with local
        steps auto before it did (a group process is given its group before the groups form)
        the first grouping's (``steps_for``), else the fastest group's; 0: the run's."""
        if h.local_steps or not self.run.local_steps_auto:
            return h.local_steps
        return self.first_steps.get(h.id) or self.run.local_steps_max

    def speeds(self, workers: Iterable[int]) -> dict[str, dict[str, float | None]]:
        """What the grouping saw of ``workers``: ``iteration_s`` (``WorkerEntry.iteration``,
        what it groups by) and ``compute_s`` (their step time), ``{worker: seconds}``."""
        entries = [self.workers[w] for w in sorted(workers) if w in self.workers]
        return {"iteration_s": {str(e.id): e.iteration() for e in entries},
                "compute_s": {str(e.id): e.step_time for e in entries}}

    def refresh_step_times(self) -> None:
        """Each group's step time and iteration time: the means of its members' latest."""
        for h in self.groups.values():
            times = [t for w in h.members if (t := self.workers[w].step_time)]
            if times:
                h.step_time = float(np.mean(times))
            iters = [t for w in h.members if (t := self.workers[w].iteration())]
            if iters:
                h.iteration_s = float(np.mean(iters))

    def restore_regrouper(self) -> None:
        """After a resume: the Regrouper starts from the saved assignment, not from scratch."""
        times = self.iteration_times()
        if times:
            self.regrouper.update(times)
            self.regrouper.assignment = {w: e.group for w, e in self.workers.items()
                                         if e.step_time and e.group >= 0}


def match_labels(new: dict[int, int], old: dict[int, int],
                 ended: set[int] | frozenset[int] = frozenset()) -> dict[int, int]:
    """Rename the new groups after the old group most of their members come from (greedy, by
    overlap), so a regroup moves only the workers whose group really changed. A group that
    needs a fresh label never gets one of ``ended`` (groups whose server flushed its last delta
    and left: a worker sent there would wait for a server that is gone)."""
    overlap: dict[tuple[int, int], int] = {}
    for w, g in new.items():
        overlap[g, old.get(w, -1)] = overlap.get((g, old.get(w, -1)), 0) + 1
    rename: dict[int, int] = {}
    for (g, h), _ in sorted(overlap.items(), key=lambda kv: -kv[1]):
        if g not in rename and h >= 0 and h not in rename.values():
            rename[g] = h
    spare = (i for i in range(len(new) + len(old) + len(ended) + 1)
             if i not in rename.values() and i not in ended)
    for g in sorted(set(new.values()) - set(rename)):
        rename[g] = next(spare)
    return {w: rename[g] for w, g in new.items()}
