"""The global server's rules without IO (global_core.py): message in, actions out. Each entry
point is driven in one thread with a fake clock and its returned actions checked; one group's
ratio has one owner (roster.py)."""

from __future__ import annotations

import numpy as np
import pytest

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
    RunDone,
    SendSettings,
    WeightsReady,
    reply,
)
from minips.core.config import RunConfig
from minips.core.exchange import BETWEEN_GROUPS, SyncPoint
from minips.core.global_core import GlobalCore
from minips.core.replay import MAX_SESSIONS, Merged
from minips.core.roster import GroupHandle
from minips.errors import ConfigError, RemoteProtocolError
from minips.serve.group import GroupServer
from minips.serve.peers import GroupPeer, NoGroup
from minips.server import InProcGroup
from minips.wire import control, messages

N = 10


def core(weights: np.ndarray | None = None, **run: object) -> GlobalCore:
    t = [0.0]
    cfg = RunConfig(lr_warmup=0.0, **run)  # type: ignore[arg-type]
    return GlobalCore(cfg, weights, regroup=False, wall=lambda: 1e9 + t[0])


def stats(step_time: float, clock: int = 0) -> control.Stats:
    return control.Stats(clock=clock, step_time=step_time, loss=1.0)


def grouped(c: GlobalCore, groups: int = 1) -> None:
    """Every worker in a group (as the shell's FormGroups does), no server behind it."""
    handles = [GroupHandle(g, f"h:{g}", [w for w in c.workers if w % groups == g])
               for g in range(groups)]
    c.groups_formed(handles, {w: w % groups for w in c.workers}, 0.0)


def decided(actions: list[GlobalAction]) -> list[GlobalAction]:
    """The actions other than the record's lines and the answer to the group that asked."""
    return [a for a in actions if not isinstance(a, (Log, GroupReply))]


def test_the_groups_form_once_when_every_worker_reported() -> None:
    c = core(np.zeros(N, np.float32), workers=2)
    for w in (0, 1):
        c.roster.admit(w)
    assert c.on_stats(0, stats(0.01), 0.0) == []  # one of two: wait
    assert c.on_stats(1, stats(0.02), 0.0) == [FormGroups()]
    assert c.on_stats(1, stats(0.02), 0.5) != [FormGroups()]  # drawn up once
    assert c.workers[1].step_time == 0.02


def test_the_calibration_deadline_groups_whoever_reported_or_the_next_to_report() -> None:
    c = core(np.zeros(N, np.float32), workers=3)
    assert decided(c.calib_timeout(60.0)) == []  # nobody yet: the first STATS will
    c.roster.admit(2)
    assert c.on_stats(2, stats(0.01), 61.0) == [FormGroups()]
    assert decided(c.calib_timeout(62.0)) == []
    late = core(np.zeros(N, np.float32), workers=3)
    late.roster.admit(0)
    assert late.on_stats(0, stats(0.01), 0.0) == []
    assert decided(late.calib_timeout(60.0)) == [FormGroups()]


def test_a_worker_reporting_after_the_grouping_is_placed_late() -> None:
    c = core(np.zeros(N, np.float32), workers=2)
    c.roster.admit(0)
    c.on_stats(0, stats(0.01), 0.0)
    c.calib_timeout(60.0)
    grouped(c)
    assert decided(c.admit(-1, 61.0)) == [Admitted(1)]
    assert c.on_stats(1, stats(0.02), 61.0) == [PlaceLate(1)]
    assert decided(c.place_late(1)) == [Placed(1, 0)]  # the one group there is
    assert c.place_late(1) == []  # it has one now


def test_the_first_initial_weights_are_taken_others_of_another_size_refused() -> None:
    c = core(None)
    assert c.on_initial(np.ones(N, np.float32)) == [WeightsReady()]
    assert c.on_initial(np.zeros(N, np.float32)) == []  # a second worker's: dropped
    assert c.weights is not None and c.weights.tolist() == [1.0] * N
    with pytest.raises(RemoteProtocolError, match="another model size"):
        c.on_initial(np.zeros(N + 1, np.float32))


def test_a_non_finite_delta_is_not_merged_and_fails_the_run() -> None:
    c = core(np.zeros(N, np.float32), workers=1)
    c.roster.admit(0)
    grouped(c)
    bad = np.zeros(N, np.float32)
    bad[3] = np.nan
    actions = c.merge(0, bad, {"samples": 4}, 0.0)
    fail, done = decided(actions)
    assert isinstance(fail, Fail) and done == RunDone("diverged")
    assert fail.code == "diverged" and "NaN or inf" in fail.reason == c.failure
    assert c.version == 0 and c.samples == 0 and c.weights is not None
    assert np.isfinite(c.weights).all()
    assert c.fail("workers_gone", "later") == []  # the first failure is the one kept


def test_the_epochs_budget_says_done_once_and_every_final_group_says_all_final() -> None:
    c = core(np.zeros(N, np.float32), workers=2, groups=2, mode="gssp", epochs=1.0,
             train_size=10)
    for w in (0, 1):
        c.roster.admit(w)
    grouped(c, 2)
    actions = c.merge(0, np.ones(N, np.float32), {"samples": 6, "session": 1, "seq": 1}, 0.0)
    assert decided(actions) == []
    actions = c.merge(1, np.ones(N, np.float32), {"samples": 6, "session": 2, "seq": 1,
                                                     "final": True}, 0.0)
    assert decided(actions) == [RunDone("epochs")]
    assert c.done and c.done_reason == "epochs" and c.finish("wall time") == []
    assert c.group_left(0) == [AllFinal()]  # group 1's last merge was final
    assert c.budget_left() == ""


def test_every_group_final_with_budget_left_waits_for_the_workers_until_a_tick_past_it() -> None:
    """The rejoin deadline is the core's: ``all_final`` starts the wait, ``tick(now)`` ends it
    when a group trains again and fails the run once ``now`` passes it."""
    c = core(np.zeros(N, np.float32), workers=1, epochs=1.0, train_size=10)
    c.roster.admit(0)
    grouped(c)
    final = {"samples": 2, "session": 1, "seq": 1, "final": True}
    assert AllFinal() in c.merge(0, np.ones(N, np.float32), final, 0.0)
    assert c.all_final(100.0, 30.0) == [Log("waiting_for_workers",
                                             {"wait_s": 30.0, "left": "2 of 10 samples"})]
    assert c.tick(129.9) == []
    back = {"samples": 2, "session": 1, "seq": 2}  # a group's non-final merge: they are back
    c.merge(0, np.ones(N, np.float32), back, 110.0)
    assert c.tick(130.0) == [Log("workers_back")]
    assert c.tick(1e6) == [] and not c.done  # no wait runs: no deadline passes
    c.merge(0, np.ones(N, np.float32), {**final, "seq": 3}, 140.0)
    c.all_final(140.0, 30.0)
    assert c.tick(169.0) == []
    fail, done = decided(c.tick(170.0))
    assert isinstance(fail, Fail) and fail.code == "workers_gone" and done == RunDone(
        "workers_gone")
    assert "gone for 30 s with 6 of 10 samples left" in c.failure and c.tick(1e6) == []


def test_every_group_final_with_nothing_left_to_train_ends_the_run() -> None:
    c = core(np.zeros(N, np.float32), workers=1)  # no budget: the workers end the run
    c.roster.admit(0)
    grouped(c)
    assert decided(c.all_final(0.0, 30.0)) == [RunDone("workers left")]
    assert c.done and c.tick(1e6) == []


def test_group_answers_name_the_exchanges_held_and_a_repeat_is_not_merged_twice() -> None:
    c = core(np.zeros(N, np.float32), workers=1)
    c.roster.admit(0)
    grouped(c)
    pull = reply(c.group_pull(0, 0.0), messages.GlobalWeights)
    assert pull.info["members"] == [0] and pull.info["last_exchange"] == [-1, -1]
    delta = np.full(N, 0.5, np.float32)
    first = reply(c.on_exchange(0, delta, {"samples": 2, "session": 7, "seq": 1}, 0.0),
                  messages.ExchangeReply)
    again = reply(c.on_exchange(0, delta, {"samples": 2, "session": 7, "seq": 1}, 0.0),
                  messages.ExchangeReply)  # reply lost
    assert c.version == 1 and c.samples == 2 and first.samples == again.samples == 2
    assert reply(c.group_pull(0, 0.0), messages.GlobalWeights).info["last_exchange"] == [7, 1]
    w = sparse.decode_vector(again.payload, N)
    assert np.asarray(w).tolist() == [0.5] * N
    c.checkpoint_state()  # a snapshot records the exchange it holds
    assert c.merger.exchange_reply(0, delta, c.done).saved_exchanges == [[-1, -1], [7, 1]]


def test_a_replay_is_not_merged_twice_however_many_sessions_came_between() -> None:
    # 65 group process runs (the old window was 64), then the first one's exchange replayed:
    # answered as a repeat, also by a core resumed from a checkpoint taken after them
    c = core(np.zeros(N, np.float32), workers=1)
    c.roster.admit(0)
    grouped(c)
    one = np.ones(N, np.float32)
    for session in range(1, 67):
        c.on_exchange(0, one, {"samples": 1, "session": session, "seq": 1}, 0.0)
    assert c.version == 66
    c.on_exchange(0, one, {"samples": 1, "session": 1, "seq": 1}, 0.0)  # session 1's lost reply
    assert c.version == 66 and c.samples == 66
    state = c.checkpoint_state()
    back = core(None, workers=1)
    back.load_state_dict(state)
    back.resume({0: GroupHandle(0, "h:0", [0])}, state)
    actions = back.on_exchange(0, one, {"samples": 1, "session": 1, "seq": 1}, 0.0)
    assert back.version == 66 and [a.event for a in actions if isinstance(a, Log)] == [
        "merge_repeat"]


def test_past_the_sessions_kept_a_new_session_is_refused_not_an_old_one_forgotten() -> None:
    c = core(np.zeros(N, np.float32), workers=1)
    c.roster.admit(0)
    grouped(c)
    one = np.ones(N, np.float32)
    c.merger.merged[0] = Merged([[s, 1] for s in range(MAX_SESSIONS)])  # the run's sessions so far
    with pytest.raises(RemoteProtocolError, match="sessions already"):  # ERROR invalid
        c.on_exchange(0, one, {"samples": 1, "session": MAX_SESSIONS, "seq": 1}, 0.0)
    assert c.version == 0 and c.samples == 0  # nothing of it merged
    c.on_exchange(0, one, {"samples": 1, "session": 0, "seq": 1}, 0.0)  # the oldest: a repeat
    assert c.version == 0
    c.on_exchange(0, one, {"samples": 1, "session": 0, "seq": 2}, 0.0)  # a known session goes on
    assert c.version == 1


def test_a_checkpoint_state_comes_back_into_a_new_core() -> None:
    c = core(np.arange(N, dtype=np.float32), workers=2)
    for w in (0, 1):
        c.roster.admit(w)
        c.on_stats(w, stats(0.01 * (w + 1)), 0.0)
    grouped(c)
    c.merge(0, np.ones(N, np.float32), {"samples": 3, "session": 1, "seq": 4}, 0.0)
    state = c.checkpoint_state()
    back = core(None, workers=2)
    back.load_state_dict(state)
    assert back.weights is not None and c.weights is not None
    np.testing.assert_array_equal(back.weights, c.weights)
    assert (back.version, back.samples) == (1, 3)
    assert {w: (e.group, e.step_time) for w, e in back.workers.items()} == {
        0: (0, 0.01), 1: (0, 0.02)}
    assert state["groups"][0]["last_exchange"] == [1, 4] and state["groups"][0]["state"] is None
    other = core(None, workers=2, lr=0.5)
    with pytest.raises(ConfigError):
        other.load_state_dict(state)


def test_a_groups_ratio_has_one_owner_the_shell_hands_it_to_the_group() -> None:
    """The roster sets a group's GDTopK ratio; the core says ``SendSettings``, and the shell gives
    it to the group server (here in-process: its core's ``set_ratio``) and to its workers."""
    c = core(np.zeros(N, np.float32), workers=2, groups=2, mode="gssp", compressor="gdtopk",
             ratio=0.01)
    for w in (0, 1):
        c.roster.admit(w)
        c.on_stats(w, stats(0.01 * (w + 1)), 0.0)
    gs = GroupServer(0, c.run, np.zeros(N, np.float32), None, members=[0])
    peers: dict[int, GroupPeer] = {0: InProcGroup(gs), 1: NoGroup()}  # the shell's
    c.groups_formed([GroupHandle(0, "h:0", [0], served=True),
                     GroupHandle(1, "h:1", [1])], {0: 0, 1: 1}, 0.0)
    c.roster.policy.every_s = 0.0  # type: ignore[union-attr]
    c.roster.observe_iter_time(0, 0.5, 0.0)
    actions = c.merge(1, np.zeros(N, np.float32), {"samples": 1, "iter_time": 0.1}, 0.0)
    ratios = next(a.ratios for a in actions if isinstance(a, SendSettings))
    assert ratios[0] > ratios[1]  # group 0 is the slower one now: it sends more
    assert c.groups[0].ratio == ratios[0]  # the one copy, the roster's
    assert c.assign_message(c.groups[1]).ratio == ratios[1]
    for g in ratios:  # what GlobalServer does with SendSettings
        peers[g].send_settings(c.assign_message(c.groups[g]))
    assert gs.core.weights_message(0, []).info["ratio"] == ratios[0]


def test_a_workers_first_stats_says_where_its_data_came_from_and_is_logged() -> None:
    c = core(np.zeros(N, np.float32), workers=2)
    for w in (0, 1):
        c.roster.admit(w)
    said = {"dataset": "fashion-mnist", "split": "train", "synthetic": True, "source": "",
            "reason": "no files"}
    got = c.on_stats(0, control.Stats(clock=0, step_time=0.01, loss=1.0, data=said), 0.0)
    assert got == [Log("data", {"worker": 0, **said})]
    assert c.on_stats(1, stats(0.02), 0.0) == [FormGroups()]  # no data: nothing logged
    # a bad ``data`` is the server's to refuse (conversation.check_stats: ERROR invalid, since
    # 5e0ee13), by this one rule
    for bad in ({"dataset": 3}, {"synthetic": "yes"}, {"owner": "x"}, {"source": "x" * 5000}):
        with pytest.raises(messages.Invalid):
            control.data_origin(bad)


def test_a_group_process_told_its_group_before_the_groups_form_gets_its_h_not_0() -> None:
    # ``--local-steps auto``: the ASSIGN a group process gets (sessions.external_group, before
    # groups_formed) carries the H the grouping then gives the group, as the workers' does
    c = core(np.zeros(N, np.float32), workers=4, groups=2, mode="gssp", optimizer_at="worker",
             local_steps=0, local_steps_max=8)
    for w, t in enumerate((0.05, 0.05, 0.2, 0.2)):
        c.roster.admit(w)
        c.on_stats(w, stats(t), 0.0)
    assignment = c.first_assignment(0.0)
    handles = [GroupHandle(g, f"h:{g}", sorted(w for w, v in assignment.items() if v == g))
               for g in (0, 1)]
    early = [c.assign_message(h).local_steps for h in handles]  # before the groups form
    assert early == [8, 2]
    c.groups_formed(handles, assignment, 0.0)
    assert [c.assign_message(h).local_steps for h in handles] == early
    one = core(np.zeros(N, np.float32), workers=1, optimizer_at="worker", local_steps=0)
    assert one.assign_message(GroupHandle(0, "h:0", [0])).local_steps == 8  # nothing known yet
    fixed = core(np.zeros(N, np.float32), workers=1, optimizer_at="worker", local_steps=3)
    assert fixed.assign_message(GroupHandle(0, "h:0", [0])).local_steps == 0  # 0: the run's H


def merge_line(actions: list[GlobalAction]) -> dict[str, object]:
    """The fields of the ``merge`` line an exchange's merge wrote."""
    return next(a.fields for a in actions if isinstance(a, Log) and a.event == "merge")


def test_between_group_staleness_counts_other_groups_merges_since_the_last_answer() -> None:
    # two groups exchange in a scripted order; each merge line says how many merges of the
    # *other* group its delta was computed without (``missed``) and how old the global weights
    # it rebased on were (``base_age_s``): counted from the group's last answer or PULL
    c = core(np.zeros(N, np.float32), workers=2, groups=2, mode="gssp")
    for w in (0, 1):
        c.roster.admit(w)
    grouped(c, 2)  # at now = 0: both groups open with the weights of version 0
    one = np.ones(N, np.float32)
    seqs = {0: 0, 1: 0}

    def exchange(g: int, now: float, repeat: bool = False) -> dict[str, object]:
        seqs[g] += 0 if repeat else 1
        actions = c.merge(g, one, {"samples": 1, "session": 10 + g, "seq": seqs[g]}, now)
        if repeat:  # answered, not merged: no merge line
            assert "merge" not in [a.event for a in actions if isinstance(a, Log)]
            return {}
        line = merge_line(actions)
        return {k: line[k] for k in BETWEEN_GROUPS}

    assert exchange(0, 1.0) == {"missed": 0, "base_age_s": 1.0}  # nothing merged before it
    assert exchange(1, 2.0) == {"missed": 1, "base_age_s": 2.0}  # group 0's merge at 1 s
    assert exchange(1, 3.5) == {"missed": 0, "base_age_s": 1.5}  # its own merge never counts
    assert exchange(0, 4.0) == {"missed": 2, "base_age_s": 3.0}  # group 1's two merges
    reply(c.group_pull(0, 5.0), messages.GlobalWeights)  # group 0 takes the weights whole
    assert exchange(1, 6.0) == {"missed": 1, "base_age_s": 2.5}  # group 0's merge at 4 s
    assert exchange(0, 7.0) == {"missed": 1, "base_age_s": 2.0}  # from the PULL, not 4 s
    assert exchange(0, 8.0, repeat=True) == {}  # group 0's reply was lost: it sends again
    assert c.version == 6
    assert exchange(1, 9.0) == {"missed": 1, "base_age_s": 3.0}
    assert exchange(0, 10.0) == {"missed": 1, "base_age_s": 2.0}  # from the repeat's answer


def test_a_sync_point_leaves_the_groups_own_merges_out() -> None:
    # 7 - 3 versions since the point, one of them the group's own: 3 missed
    assert SyncPoint(version=3, merges=1, at=0.5).between_groups(7, 2, 2.0) == {
        "missed": 3, "base_age_s": 1.5}


def test_between_group_staleness_is_unknown_after_a_resume_until_the_first_answer() -> None:
    # the point is not in the checkpoint: an in-process group resumed from it rebased on
    # weights the new server cannot name, so its first merge line says None, the next a figure
    c = core(np.zeros(N, np.float32), workers=1)
    c.roster.admit(0)
    grouped(c)
    c.merge(0, np.ones(N, np.float32), {"samples": 1, "session": 1, "seq": 1}, 1.0)
    state = c.checkpoint_state()
    back = core(None, workers=1)
    back.load_state_dict(state)
    back.resume({0: GroupHandle(0, "h:0", [0])}, state)
    first = merge_line(back.merge(0, np.ones(N, np.float32), {"session": 1, "seq": 2}, 5.0))
    assert (first["missed"], first["base_age_s"]) == (None, None)
    then = merge_line(back.merge(0, np.ones(N, np.float32), {"session": 1, "seq": 3}, 5.25))
    assert (then["missed"], then["base_age_s"]) == (0, 0.25)
