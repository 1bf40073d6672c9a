"""The soak's checker: reads a run afterwards and states each invariant with its evidence.

It reads only what the run left: the records (global.jsonl, group-*.jsonl, worker-*.jsonl,
eval.jsonl, summary.json, config.json), the final weights, the checkpoint directory's listing as
the soak recorded it, the clients' logs (logs/*.log) and the soak's history
(soak/history.jsonl: faults injected and healed, processes started and ended, the orphan scan)
and resource samples (soak/resources.jsonl). One line per invariant, PASS or FAIL with figures:

- exactly_once: no (session, seq) merged twice by one server life, and a repeat across lives
  only of a merge after that life's last checkpoint (the documented window); the global sample
  count above what the workers saw ACKed by at most one push per worker kill and per connection
  a worker gave up with a push in flight (applied, its ACK never read: a `group_lost` or
  `lease_expired` line of its own), and below it by at most the documented losses
  (a killed global server: the merges after its last checkpoint; a group process killed,
  stopped or cut off: what its group ACKed since its last exchange);
- loss_window: each kill of the global server came at most checkpoint_every_s + WRITE_SLACK_S
  after its last checkpoint (docs/operations.md: at most one period plus the write), or, when
  the checkpoint's disk was full in between (a disk_full fault healed after that checkpoint),
  at most the server's ROOM_POLL_S + WRITE_SLACK_S after the disk had room again if that is
  later; a kill while the disk is still full may come any time after it (nothing can be written);
- counters_never_fall: every ledger figure across every global.jsonl line, and summary.json at
  least the last line's;
- checkpoint: the last checkpoint (copied out of its tmpfs by the soak) loads, finite, at
  most the final count;
- finite_model and accuracy: final_weights.npy finite; its test accuracy at most ACC_POINTS
  under the unfaulted twin's (both on the whole test set), and at most ACC_ABOVE_POINTS above
  it (a faulted run ends above its twin while accuracy still climbs: fewer live workers, less
  staleness; far above is a twin that trained wrong);
- exits: every role's last process exit 0 (a process the nemesis killed aside), none killed at
  the end, no orphan, no checkpoint temp file;
- resources: the global server's descriptors and RSS at the end of each of its lives within a
  bound of their level early in that life, the summary.json it writes at the end included
  (it streams the records: docs/operations.md);
- events: each fault long enough to be seen has its event line within its detection bound
  (lease + 2 s; a resumed line within 60 s of the restart). The bound runs on the detector's
  clock: a process that is SIGSTOPped prints nothing, and on SIGCONT finds the lease run out and
  says so at once, so each second the detecting role (the global server for a group process;
  the groups' servers for a worker) was stopped inside the window lengthens it; a line not
  written before its detector was killed is not asked for (its successor never held the link).
  A group process whose group was rehomed (empty, docs/operations.md) ends as `group_ended`
  when it goes, not `group_lost`: either line shows it.

A failed invariant prints the shortest window of the history around its evidence and the seed
that replays it.

Usage: python scripts/soak_check.py RUN_DIR --baseline TWIN_DIR
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Check", "Run", "Verdict", "check", "check_accuracy", "last_figures", "table"]

LEDGER = ("bytes_worker_group", "bytes_group_worker", "bytes_group_global", "bytes_global_group",
          "bytes_total", "pushes_merged", "merges_done", "samples_trained")
ACC_POINTS = 2.0  # the faulted run's final accuracy at most this many points under its twin's
ACC_ABOVE_POINTS = 5.0  # ... and at most this many above (the short soak: +2.05 to +3 seen)
DETECT_SLACK_S = 2.0  # an event line within lease + this of the fault
RESUME_BOUND_S = 60.0  # a restarted global server says `resumed` within this of its start
WRITE_SLACK_S = 1.5  # a checkpoint's write time beyond checkpoint_every_s
FD_GROWTH = 64  # open descriptors the global server may gain over a life
RSS_GROWTH = 1.5  # RSS at the end of a life at most this times its early level, plus RSS_SLACK
RSS_SLACK_KB = 96 << 10
WORKER_EVENTS = {"link_lost", "expired", "left", "lease_expired"}
CONNECTION_ENDS = {"group_lost", "lease_expired"}  # a worker's own lines: it left its group


def jsonl(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines file's objects ([] when missing; a truncated last line skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def last_figures(run: Path) -> dict[str, Any]:
    """The last global.jsonl line's figures (the ledger's)."""
    lines = jsonl(run / "global.jsonl")
    return lines[-1] if lines else {}


@dataclass
class Run:
    """What a run left, its times in seconds since the run's t0 (config.json)."""

    path: Path
    t0: float
    glob: list[dict[str, Any]]
    groups: dict[str, list[dict[str, Any]]]
    workers: dict[int, list[dict[str, Any]]]
    history: list[dict[str, Any]]
    begin: dict[str, Any]

    @classmethod
    def read(cls, path: Path) -> Run:
        t0 = float(json.loads((path / "config.json").read_text())["t0"])
        history = jsonl(path / "soak" / "history.jsonl")
        for h in history:
            h["rel"] = h["t"] - t0
        workers = {int(p.stem.split("-")[1]): jsonl(p) for p in path.glob("worker-*.jsonl")}
        return cls(path, t0, jsonl(path / "global.jsonl"),
                   {p.stem: jsonl(p) for p in path.glob("group-*.jsonl")}, workers, history,
                   next((h for h in history if h["op"] == "begin"), {}))

    def events(self, *names: str) -> list[dict[str, Any]]:
        """Event lines of the global server and every group server named ``names``."""
        lines = [*self.glob, *(r for g in self.groups.values() for r in g)]
        return sorted((r for r in lines if r.get("event") in names), key=lambda r: r["t"])

    def steps(self) -> list[dict[str, Any]]:
        return [r for rs in self.workers.values() for r in rs if "event" not in r]

    def faults(self) -> list[dict[str, Any]]:
        """Each injected fault with ``healed`` (its heal line's rel time, or None)."""
        healed = {h["id"]: h["rel"] for h in self.history if h["op"] in ("heal", "not_restarted")}
        return [{**h, "healed": healed.get(h["id"])} for h in self.history if h["op"] == "inject"]

    def window(self, t0: float, t1: float) -> list[str]:
        """The history lines between run times ``t0`` and ``t1`` (1 s either side)."""
        return [f"  {h['rel']:8.2f} s  " + json.dumps({k: v for k, v in h.items()
                                                       if k not in ("t", "rel")})
                for h in self.history if t0 - 1 <= h["rel"] <= t1 + 1]


@dataclass
class Check:
    name: str
    ok: bool
    evidence: str
    window: tuple[float, float] | None = None  # run times of the history that shows it


@dataclass
class Verdict:
    seed: int
    run: Path
    checks: list[Check] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    recovery: dict[str, float] = field(default_factory=dict)  # kind -> slowest, s
    accuracy: tuple[float, float] | None = None  # (soak, twin)
    windows: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def text(self) -> str:
        lines = [f"seed {self.seed}: {self.run}"]
        for c in self.checks:
            lines.append(f"  {'PASS' if c.ok else 'FAIL'} {c.name}: {c.evidence}")
            if not c.ok:
                lines += self.windows.get(c.name, [])
                lines.append(f"  replay: python scripts/soak.py --seed {self.seed} --seeds 1")
        return "\n".join(lines)


# -- the invariants ----------------------------------------------------------------------------

def lives(run: Run) -> list[list[dict[str, Any]]]:
    """global.jsonl split at each `resumed` line: one list per server life."""
    out: list[list[dict[str, Any]]] = [[]]
    for r in run.glob:
        if r.get("event") == "resumed":
            out.append([])
        out[-1].append(r)
    return out


def snapshots(life: list[dict[str, Any]]) -> list[float]:
    """When each checkpoint of a life took its state: its line comes once written."""
    return [r["t"] - float(r.get("write_s", 0)) for r in life if r.get("event") == "checkpoint"]


def global_kills(run: Run) -> list[dict[str, Any]]:
    return [f for f in run.faults() if f["kind"] == "kill_global"]


def lost_windows(run: Run) -> list[tuple[float, float, int]]:
    """For each life that a kill ended: (its last checkpoint's time, or its resume's when it
    wrote none, the kill's time, samples lost). Lost: those merged after the checkpoint (the
    resumed count is the checkpoint's), and with in-process groups also those their workers saw
    ACKed after it and not merged yet (the groups' state since the checkpoint dies with the
    server; `minips group` processes keep theirs and send it again)."""
    out = []
    steps = [] if run.begin.get("external") else run.steps()
    parts = lives(run)
    kills = global_kills(run)
    for n, (life, nxt, kill) in enumerate(zip(parts, parts[1:], kills, strict=False)):
        # a life killed before its first checkpoint loses what it merged since its resume
        start = [life[0]["t"]] if n > 0 and life else []
        ckpts = start + snapshots(life)
        merges = [r for r in life if r.get("event") == "merge"]
        resumed = nxt[0]
        lost = (merges[-1]["samples"] if merges else 0) - int(resumed.get("samples", 0))
        since = ckpts[-1] if ckpts else 0.0
        acked = sum(int(s.get("samples", 0)) for s in steps if since < s["t"] <= kill["rel"] + 0.5)
        out.append((since, kill["rel"], max(0, lost, acked)))
    return out


def group_losses(run: Run) -> int:
    """Samples a group ACKed since its last exchange when a fault on its group process made the
    global server drop it (`group_lost` naming it by its line's due time): what the docs say
    such a group loses. Counted up to the group_lost line (the process was stopped or dead) or,
    for a partition, up to its heal (the group went on serving its workers)."""
    lease = float(run.begin.get("lease_s", 10))
    steps = run.steps()
    total = 0
    for f in run.faults():
        if f["kind"] not in ("kill_group", "stop_group", "partition") or f.get("ok") is False:
            continue
        want = expected_event(run, f)
        due = want.due if want else f["rel"] + lease + DETECT_SLACK_S
        lost = [r for r in run.events("group_lost") if f["rel"] - 0.5 <= r["t"] <= due]
        if not lost:
            continue
        g = int(lost[0]["group"])
        exchanges = [r["t"] for r in run.groups.get(f"group-{g}", [])
                     if r.get("event") == "exchange" and r["t"] <= f["rel"]]
        since = max(exchanges, default=0.0)
        until = f["healed"] if f["kind"] == "partition" and f["healed"] else lost[0]["t"]
        total += sum(int(s.get("samples", 0)) for s in steps
                     if s.get("group") == g and since < s["t"] <= until + 0.5)
    return total


def check_exactly_once(run: Run) -> list[Check]:
    checks = []
    seen: dict[tuple[int, int], tuple[int, float]] = {}
    twice, outside = [], []
    parts = lives(run)
    last_ckpt = [max(snapshots(life), default=0.0)
                 for life in parts]
    for n, life in enumerate(parts):
        for r in life:
            if r.get("event") != "merge":
                continue
            key = (int(r["session"]), int(r["seq"]))
            if key in seen:
                was_life, was_t = seen[key]
                if was_life == n:
                    twice.append((key, was_t, r["t"]))
                elif was_t <= last_ckpt[was_life]:
                    outside.append((key, was_t, r["t"]))
            seen[key] = (n, r["t"])
    bad = twice + outside
    checks.append(Check(
        "merged_once", not bad,
        f"{len(seen)} (session, seq) merged over {len(parts)} server lives; {len(twice)} merged "
        f"twice by one life, {len(outside)} again after a resume though the checkpoint held "
        f"them; {sum(1 for r in run.glob if r.get('event') == 'merge_repeat')} merge_repeat "
        f"answered", (bad[0][1], bad[0][2]) if bad else None))
    steps = run.steps()
    acked = sum(int(s.get("samples", 0)) for s in steps)
    merges = [r for r in run.glob if r.get("event") == "merge"]
    merged = int(merges[-1]["samples"]) if merges else 0
    windows = lost_windows(run)
    allowed = sum(w[2] for w in windows) + group_losses(run)
    # a push its group applied whose ACK its worker never read: the worker was killed, or gave
    # up the connection (its group silent past the lease: a stopped or cut group process, a cut
    # link; or its own lease run out), with the push in flight; a worker has one push in flight
    # at a time, so at most one push of each kill and each such line of the worker's own record
    cut = sum(1 for f in run.faults() if f["kind"] == "kill_worker") + sum(
        1 for rs in run.workers.values() for r in rs if r.get("event") in CONNECTION_ENDS)
    unacked = cut * max((int(s.get("samples", 0)) for s in steps), default=0)
    gap = acked - merged
    ok = -unacked <= gap <= allowed
    checks.append(Check(
        "samples_once", ok,
        f"workers ACKed {acked:,} samples, the global count is {merged:,}: {gap:,} missing; "
        f"documented losses allow {allowed:,} ({len(windows)} global-server windows "
        f"{sum(w[2] for w in windows):,}, group faults {allowed - sum(w[2] for w in windows):,}),"
        f" pushes applied but not ACKed {unacked:,} ({cut} worker kills or lost connections,"
        f" one push each)"
        + ("; counted twice" if gap < -unacked else ""), None if ok else (0.0, 1e9)))
    from minips.server import ROOM_POLL_S

    bound = float(run.begin.get("checkpoint_every_s", 0)) + WRITE_SLACK_S
    room_bound = ROOM_POLL_S + WRITE_SLACK_S
    plain, room, full, late = [], [], 0, []
    for w in windows:
        due = loss_due(run, w[0], w[1])
        if w[1] > due:
            late.append(w)
        if due == math.inf:
            full += 1
        elif due > w[0] + bound:  # the disk's room back set it: the time since then
            room.append(w[1] - (due - room_bound))
        else:
            plain.append(w[1] - w[0])
    checks.append(Check(
        "loss_window", not late,
        f"{len(windows)} kills of the global server: {len(plain)} at most "
        f"{max(plain, default=0):.1f} s after its last checkpoint (bound {bound:.1f} s), "
        f"{len(room)} at most {max(room, default=0):.1f} s after a full disk had room again "
        f"(bound {room_bound:.2f} s), {full} while it was full; {len(late)} late; "
        f"{sum(w[2] for w in windows):,} samples lost in all",
        (late[0][0], late[0][1]) if late else None))
    return checks


def loss_due(run: Run, since: float, kill: float) -> float:
    """The run time by which the checkpoint after the one at ``since`` was written at the
    latest (docs/operations.md): ``since`` + checkpoint_every_s, or when the checkpoint's disk
    was full after ``since`` (a disk_full fault), the server's ROOM_POLL_S after it had room
    again if that is later; plus WRITE_SLACK_S. Infinite when the disk was still full at the
    kill: no checkpoint could be written."""
    from minips.server import ROOM_POLL_S

    due = since + float(run.begin.get("checkpoint_every_s", 0))
    for f in run.faults():
        if f["kind"] != "disk_full" or f["rel"] > kill:
            continue
        if f["healed"] is None or f["healed"] >= kill:
            return math.inf
        if f["healed"] > since:
            due = max(due, f["healed"] + ROOM_POLL_S)
    return due + WRITE_SLACK_S


def check_counters(run: Run) -> Check:
    falls = []
    last: dict[str, float] = {}
    for r in run.glob:
        for k in LEDGER:
            if k in r:
                if r[k] < last.get(k, 0):
                    falls.append((k, last[k], r[k], r["t"]))
                last[k] = r[k]
    summary_path = run.path / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    figures = summary.get("figures", summary)
    below = [k for k in LEDGER if k in figures and k in last and figures[k] < last[k]]
    ok = not falls and not below and bool(summary)
    first = falls[0] if falls else None
    return Check("counters_never_fall", ok,
                 f"{len(run.glob)} global lines, {len(falls)} falls"
                 + (f" (first: {first[0]} {first[1]} -> {first[2]} at {first[3]:.1f} s)"
                    if first else "")
                 + (f"; summary.json below the last line in {below}" if below else "")
                 + ("" if summary else "; no summary.json")
                 + f"; last: samples_trained {last.get('samples_trained', 0):,.0f}, "
                   f"bytes_total {last.get('bytes_total', 0):,.0f}",
                 (first[3] - 5, first[3]) if first else None)


def accuracy(run: Path) -> float:
    from minips.ml import data, models

    test = data.load_dataset("fashion-mnist", "test", fallback=False)
    return float(models.evaluate("lenet5", np.load(run / "final_weights.npy"), test)[0])


def check_accuracy(soak: float, twin: float) -> Check:
    """The faults cost at most ACC_POINTS of the twin's accuracy. A faulted run may end above
    its twin (a killed or stopped worker leaves the rest less stale, which shows while accuracy
    still climbs), but not by more than ACC_ABOVE_POINTS: that is a twin that trained wrong."""
    points = 100 * (soak - twin)
    return Check("accuracy", -ACC_POINTS <= points <= ACC_ABOVE_POINTS,
                 f"{100 * soak:.2f}% faulted vs {100 * twin:.2f}% unfaulted twin "
                 f"({points:+.2f} points, bounds -{ACC_POINTS} / +{ACC_ABOVE_POINTS})")


def check_checkpoint(run: Run) -> Check:
    """The last checkpoint the soak kept loads, its weights finite, its samples at most the
    global count at the end (a checkpoint is a past state of the run)."""
    from minips.errors import MiniPSError
    from minips.record.checkpoint import load

    path = run.path / "soak" / "checkpoint-last.npz"
    try:
        state = load(path)
    except MiniPSError as exc:
        return Check("checkpoint", False, str(exc))
    merges = [r for r in run.glob if r.get("event") == "merge"]
    final = int(merges[-1]["samples"]) if merges else 0
    w = np.asarray(state["weights"])
    ok = bool(np.isfinite(w).all()) and int(state["samples"]) <= final
    return Check("checkpoint", ok, f"the last checkpoint loads: {int(state['samples']):,} "
                 f"samples (the run ended at {final:,}), {w.size:,} weights, "
                 f"{int((~np.isfinite(w)).sum())} not finite")


def check_model(run: Run, baseline: Path, verdict: Verdict) -> list[Check]:
    path = run.path / "final_weights.npy"
    if not path.exists():
        return [Check("finite_model", False, "no final_weights.npy")]
    w = np.load(path)
    finite = bool(np.isfinite(w).all())
    checks = [Check("finite_model", finite, f"{w.size:,} weights, "
                    f"{int((~np.isfinite(w)).sum())} not finite, |w|max {np.abs(w).max():.3g}")]
    if finite and (baseline / "final_weights.npy").exists():
        soak, twin = accuracy(run.path), accuracy(baseline)
        verdict.accuracy = (soak, twin)
        checks.append(check_accuracy(soak, twin))
    else:
        checks.append(Check("accuracy", False, f"no twin weights in {baseline}"))
    return checks


def check_exits(run: Run) -> Check:
    last: dict[str, dict[str, Any]] = {}
    for h in run.history:
        if h["op"] == "exit":
            last[h["role"]] = h
    started = {h["role"] for h in run.history if h["op"] == "start"}
    bad = [f"{r} exit {h['rc']}" for r, h in last.items() if h["rc"] != 0 and not h["by_nemesis"]]
    bad += [f"{r} never ended" for r in started - set(last)]
    bad += [f"{h['role']} killed at the end" for h in run.history if h["op"] == "killed_at_end"]
    end = next((h for h in run.history if h["op"] == "end"), {})
    orphans, temps = end.get("orphans"), end.get("checkpoint_temps")
    ok = not bad and orphans == [] and temps == []
    t = next((h["rel"] for h in run.history if h["op"] == "exit" and h["rc"] != 0
              and not h["by_nemesis"]), None)
    return Check("exits", ok,
                 f"{len(last)} roles ended, {len(bad)} not as documented {bad[:4]}; orphans "
                 f"{orphans}; checkpoint temp files {temps}",
                 (t - 10, t) if t is not None else None)


def check_resources(run: Run) -> Check:
    """Each global-server life's descriptors and RSS, to its last sample (the summary.json
    `minips server` writes once every connection is closed included: it streams the records,
    docs/operations.md). The lives that broke the bound are listed first, then the largest
    growths."""
    samples = jsonl(run.path / "soak" / "resources.jsonl")
    by_pid: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in samples:
        by_pid[r["pid"]].append(r)
    lives: list[tuple[bool, float, str]] = []  # (bound broken, RSS growth, what it shows)
    for pid, rs in by_pid.items():
        if len(rs) < 6:
            continue
        third = len(rs) // 3
        fd0 = float(np.median([r["fds"] for r in rs[:third]]))
        rss0 = float(np.median([r["rss_kb"] for r in rs[:third]]))
        fd1 = max(r["fds"] for r in rs[-third:])
        rss1 = max(r["rss_kb"] for r in rs[-third:])
        bad = fd1 > fd0 + FD_GROWTH or rss1 > RSS_GROWTH * rss0 + RSS_SLACK_KB
        lives.append((bad, rss1 - rss0, f"pid {pid}: fds {fd0:.0f} -> {fd1}, RSS "
                      f"{rss0 / 1024:.0f} -> {rss1 / 1024:.0f} MB"))
    lives.sort(key=lambda x: (not x[0], -x[1]))
    broken = sum(1 for life in lives if life[0])
    return Check("resources", bool(lives) and not broken,
                 f"{len(by_pid)} server lives sampled, {broken} beyond the bounds; "
                 + "; ".join(life[2] for life in lives[:4])
                 + f" (bounds: +{FD_GROWTH} fds, x{RSS_GROWTH} + {RSS_SLACK_KB >> 10} MB)")


class Expect(NamedTuple):
    """The event lines that show a fault and by when."""

    names: set[str]
    due: float  # run time by which the first of them is due
    worker: int | None  # the worker a line must name (None: any)
    cut: float = math.inf  # run time a detector was killed before ``due``: none due after it


def detectors(run: Run, f: dict[str, Any]) -> frozenset[str]:
    """Who sees fault ``f`` go silent: the global server sees a group process; a worker is
    seen by its group's server (the global server's process, or any `minips group`) and by the
    global server (its own connection)."""
    if not f["target"].startswith("w") or not run.begin.get("external"):
        return frozenset({"server"})
    return frozenset({"server", *(h["role"] for h in run.history
                                  if h["op"] == "start" and h["role"].startswith("group"))})


def down(run: Run, roles: frozenset[str], kinds: tuple[str, ...]) -> list[tuple[float, float]]:
    """The run times when a fault of ``kinds`` held one of ``roles`` (overlaps merged)."""
    spans = sorted((f["rel"], math.inf if f["healed"] is None else f["healed"])
                   for f in run.faults() if f["target"] in roles and f["kind"] in kinds)
    merged: list[tuple[float, float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def inside(spans: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Seconds of ``spans`` between run times ``t0`` and ``t1``."""
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in spans)


def expected_event(run: Run, f: dict[str, Any]) -> Expect | None:
    """The lines that show fault ``f`` (``Expect``), or None when none is promised: a fault no
    line names, or one too short to be seen. A detector killed before the line was due cuts the
    promise there (its successor never held the link that went silent).

    Leases run on the wall clock, but a SIGSTOPped detector prints nothing until SIGCONT (then
    at once, its lease run out): a silence is promised a line when its detector ran for
    DETECT_SLACK_S of it past the lease (counted from the detector's SIGCONT when it was
    stopped as the fault began), and the line is due lease + DETECT_SLACK_S after the fault
    plus every second the detector was stopped meanwhile."""
    lease = float(run.begin.get("lease_s", 10))
    kind, target, rel = f["kind"], f["target"], f["rel"]
    seen_by = detectors(run, f)
    stops = down(run, seen_by, ("stop_global", "stop_group"))
    healed = f["healed"] or rel
    bound = lease + DETECT_SLACK_S
    due = rel + bound
    for _ in range(len(stops) + 1):  # each stop the longer window reaches lengthens it
        due = rel + bound + inside(stops, rel, due)
    kills = down(run, seen_by, ("kill_global", "kill_group")) if kind != "kill_global" else []
    cut = min((a for a, b in kills if b > rel and a <= due), default=math.inf)
    # a detector stopped when the fault began reads, as it continues, what its peer sent
    # before the cut: its silence starts then (the 30-minute soak of seed 0: a partition 3.4 s
    # into a 7.6 s stop of the global server, healed 2.8 s after it went on, was asked a line)
    began = max((b for a, b in stops if a <= rel < b), default=rel)
    silent = (healed - began - lease) - inside(stops, began + lease, healed) >= DETECT_SLACK_S
    worker = int(target[1:]) if target.startswith("w") else None
    if worker is not None:
        began = max((h["rel"] for h in run.history if h["op"] == "start"
                     and h["role"] == target and h["rel"] <= rel), default=-math.inf)
        if not any(began < s["t"] <= rel for s in run.workers.get(worker, [])
                   if "event" not in s):
            return None  # this process trained no step yet: no group holds its lease
        if kind == "kill_worker" or (kind in ("stop_worker", "link_cut") and silent):
            return Expect(WORKER_EVENTS, due, worker, max(cut, rel))
        return None
    grouped = min((r["t"] for r in run.glob if r.get("event") == "groups"), default=math.inf)
    if (kind.endswith("_group") or kind == "partition") and rel < grouped:
        return None  # a group process holds no group before the grouping: none to lose
    # a group whose workers were rehomed no longer holds the end of the run: its process
    # going is `group_ended` (GlobalCore.group_lost), a line that shows it as well
    rehomed = any(r.get("event") == "rehomed" and r["t"] < rel for r in run.glob)
    lost = {"group_lost", "group_ended"} if rehomed else {"group_lost"}
    if not peer_of_this_life(run, target, rel):
        return None  # the resumed global server never held this process's link: no line
    if lost_already(run, target, rel):
        return None  # the server had named that link lost and the process not back: no line
    if kind == "kill_group" or (kind in ("stop_group", "partition") and silent):
        return Expect(lost, due, None, max(cut, rel))
    if kind == "kill_global":
        return Expect({"resumed"}, healed + RESUME_BOUND_S, None)
    return None


def peer_of_this_life(run: Run, role: str, rel: float) -> bool:
    """Whether group process ``role`` had registered with the global server's life at run time
    ``rel``: a resumed server knows a group process only once it registered again
    (``group_adopted`` from its address since the last ``resumed``). One killed or cut off
    before that was never its peer, and no line can name it (the 30-minute soak of seed 0:
    three kills of a group process 0.6-1.5 s after a resume, each "late" by 12-26 s, when the
    replacement's own kill was the line). The history's ``addresses`` map roles to hosts (netns);
    on loopback every group process shares one: then each must have registered.
    A life begins when its process starts, before it prints `resumed` (the 30-minute soak of
    seed 2: a partition 0.4 s after the restart, 0.1 s before `resumed`, was asked a line for
    a link the new life never held)."""
    resumed = [r["t"] for r in run.glob if r.get("event") == "resumed" and r["t"] <= rel]
    restarted = [h["rel"] for h in run.history if h["op"] == "start" and h["role"] == "server"
                 and h.get("n", 1) > 1 and h["rel"] <= rel]
    if not resumed and not restarted:
        return True
    began = max(resumed + restarted)
    host = run.begin.get("addresses", {}).get(role)
    if host is not None:
        return bool(adoptions(run, began, rel, host))
    groups = {h["role"] for h in run.history if h["op"] == "start" and
              h["role"].startswith("group")}
    return len({str(r.get("address")) for r in adoptions(run, began, rel)}) >= len(groups)


def adoptions(run: Run, t0: float, t1: float, host: str | None = None) -> list[dict[str, Any]]:
    """The global server's `group_adopted` lines between run times ``t0`` and ``t1``, in
    time order; with ``host``, only those of a group process on that host (its address)."""
    return sorted((r for r in run.glob if r.get("event") == "group_adopted"
                   and t0 <= r["t"] <= t1
                   and (host is None or str(r.get("address")).rsplit(":", 1)[0] == host)),
                  key=lambda r: r["t"])


def lost_already(run: Run, role: str, rel: float) -> bool:
    """Whether group process ``role``'s link was already lost at run time ``rel``: the group
    it last registered as (its latest `group_adopted` from its host) was named `group_lost`
    or `group_ended` since, and the process had not registered again. A fault then cuts no
    link the server holds, and no line can name it (the 30-minute soak of seed 0: group1's
    machine cut off at 1342.9 s, `group_lost` at 1346.7 s, healed at 1350.0 s and cut off
    again at 1351.0 s for 8.8 s, before its process registered again at 1361.2 s: that second
    partition was counted "late" by the `group_lost` of a later fault, 152 s after it).
    On loopback every group process shares one host, so the records cannot tell which group
    a process held: False, as before."""
    host = run.begin.get("addresses", {}).get(role)
    if host is None:
        return False
    adopted = adoptions(run, -math.inf, rel, host)
    if not adopted:
        return False  # registered before the grouping, in the first life: held
    last = adopted[-1]
    return any(r.get("event") in ("group_lost", "group_ended") and r.get("group") == last["group"]
               and last["t"] < r["t"] <= rel for r in run.glob)


def names_worker(r: dict[str, Any], worker: int | None) -> bool:
    return worker is None or r.get("worker") == worker or worker in r.get("workers", ())


def check_events(run: Run, verdict: Verdict) -> list[Check]:
    seen, missed, late, failed = 0, [], [], []
    for f in run.faults():
        verdict.faults[f["kind"]] += 1
        if f.get("ok") is False:
            failed.append(f)
            continue
        recovered = recovery(run, f)
        if recovered is not None:
            verdict.recovery[f["kind"]] = max(verdict.recovery.get(f["kind"], 0.0), recovered)
        want = expected_event(run, f)
        if want is None:
            continue
        due = want.due
        hits = [r for r in run.events(*want.names) if r["t"] >= f["rel"] - 0.5
                and names_worker(r, want.worker)]
        if hits and hits[0]["t"] <= due:
            seen += 1
        elif want.cut <= due:
            continue  # its detector was killed first: the line died with it
        elif hits:
            late.append((f, hits[0]["t"] - f["rel"], round(due - f["rel"], 1)))
        else:
            missed.append((f, round(due - f["rel"], 1)))
    bad = [(f, b) for f, b in missed] + [(f, b) for f, _, b in late]
    text = (f"{seen} faults seen within their bound; {len(missed)} never seen "
            f"{[(f['kind'], f['target'], round(f['rel'], 1)) for f, _ in missed][:4]}; "
            f"{len(late)} late {[(f['kind'], round(d, 1), b) for f, d, b in late][:4]}")
    return [Check("faults_injected", not failed, f"{len(run.faults())} injected, "
                  f"{len(failed)} could not be {[(f['kind'], f['target']) for f in failed][:4]}",
                  (failed[0]["rel"], failed[0]["rel"]) if failed else None),
            Check("events", not bad, text,
                  (bad[0][0]["rel"], bad[0][0]["rel"] + bad[0][1]) if bad else None)]


def recovery(run: Run, f: dict[str, Any]) -> float | None:
    """Seconds from the fault to training again where it hit: the worker's next step, the
    evaluator's next score, else the next merge after the fault healed; None when no such line
    came, or for faults that hit nothing in particular (a rate change, a hostile client)."""
    if f["kind"] in ("link_rate", "garbage", "flood"):
        return None
    after = f["healed"] if f["healed"] is not None else f["rel"]
    if f["target"].startswith("w"):
        steps = run.workers.get(int(f["target"][1:]), [])
        nxt = [s["t"] for s in steps if "event" not in s and s["t"] > after]
    elif f["target"] == "eval":
        nxt = [r["t"] for r in jsonl(run.path / "eval.jsonl") if "accuracy" in r
               and r["t"] > after]
    else:
        nxt = [r["t"] for r in run.glob if r.get("event") == "merge" and r["t"] > after]
    return (min(nxt) - f["rel"]) if nxt else None


def check(run_dir: Path, baseline: Path) -> Verdict:
    """Every invariant of ``run_dir`` (a soak), the twin ``baseline`` for the accuracy."""
    run = Run.read(run_dir)
    verdict = Verdict(int(run.begin.get("seed", -1)), run_dir)
    verdict.checks += check_exactly_once(run)
    verdict.checks.append(check_counters(run))
    verdict.checks += check_model(run, baseline, verdict)
    verdict.checks.append(check_checkpoint(run))
    verdict.checks.append(check_exits(run))
    verdict.checks.append(check_resources(run))
    verdict.checks += check_events(run, verdict)
    for c in verdict.checks:
        if not c.ok and c.window is not None:
            verdict.windows[c.name] = run.window(*c.window)
    return verdict


def table(verdicts: list[Verdict]) -> str:
    """The report's table: faults per kind, invariants held, slowest recovery, accuracy."""
    kinds = sorted({k for v in verdicts for k in v.faults})
    lines = ["| fault | " + " | ".join(f"seed {v.seed}" for v in verdicts)
             + " | slowest recovery, s |", "|---|" + "---|" * len(verdicts) + "---|"]
    for k in kinds:
        slow = max((v.recovery.get(k, math.nan) for v in verdicts), default=math.nan)
        lines.append(f"| {k} | " + " | ".join(str(v.faults.get(k, 0)) for v in verdicts)
                     + f" | {'-' if math.isnan(slow) else f'{slow:.1f}'} |")
    held = [f"{sum(c.ok for c in v.checks)}/{len(v.checks)}" for v in verdicts]
    lines.append("| invariants held | " + " | ".join(held) + " | |")
    accs = [f"{100 * v.accuracy[0]:.2f} vs {100 * v.accuracy[1]:.2f}" if v.accuracy else "-"
            for v in verdicts]
    lines.append("| accuracy % (faulted vs unfaulted) | " + " | ".join(accs) + " | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="check a soak run's invariants")
    p.add_argument("run", type=Path)
    p.add_argument("--baseline", type=Path, required=True, help="the unfaulted twin's run dir")
    args = p.parse_args(argv)
    if not (args.run / "config.json").exists():
        p.error(f"{args.run} holds no run (no config.json)")
    verdict = check(args.run, args.baseline)
    print(verdict.text())
    print(table([verdict]))
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
