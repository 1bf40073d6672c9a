"""The run's ledger: one count of every figure, that never falls (record/ledger.py), and the
readers that take their figures from it (summary.json, the dashboard's state)."""

from __future__ import annotations

import json
from pathlib import Path

from minips.dashboard.state import RunState
from minips.record.ledger import HOPS, Ledger
from minips.record.metrics import summarize


def test_a_source_that_starts_again_from_zero_adds_only_what_is_new() -> None:
    """A link flap or a group adopted by a new process: its running counter starts from 0.
    The totals went 571 -> 472 MB on the console; here they only grow."""
    led = Ledger()
    led.count("workers-0", {"bytes_worker_group": 500, "bytes_group_worker": 900})
    led.count("workers-0", {"bytes_worker_group": 700, "bytes_group_worker": 1000})
    assert led.figures()["bytes_worker_group"] == 700
    led.count("workers-0", {"bytes_worker_group": 50, "bytes_group_worker": 10})  # restarted
    assert (led.figures()["bytes_worker_group"], led.figures()["bytes_group_worker"]) == (750, 1010)
    led.count("workers-0", {"bytes_worker_group": 80, "bytes_group_worker": 10})
    assert led.figures()["bytes_worker_group"] == 780
    led.count("workers-1", {"bytes_worker_group": 20})  # another source adds to the same hop
    assert led.figures()["bytes_worker_group"] == 800
    assert led.figures()["bytes_total"] == sum(led.figures()[h] for h in HOPS) == 1810


def test_every_figure_only_grows_over_any_sequence_of_reports() -> None:
    led, seen = Ledger(), dict.fromkeys(HOPS, 0)
    values = [5, 9, 9, 3, 0, 12, 2, 2, 40, 1]
    for i, v in enumerate(values):
        led.count(f"s{i % 3}", {h: v * (j + 1) for j, h in enumerate(HOPS)})
        led.add("pushes_merged", v % 4)
        led.add("pushes_merged", -5)  # never below
        now = led.figures()
        for h in HOPS:
            assert now[h] >= seen[h]
            seen[h] = now[h]


def test_a_resume_goes_on_from_the_checkpoint_and_the_last_figures_written() -> None:
    """The checkpoint is older than the last line the record wrote: bytes sent after it were
    sent. The console said 528 MB before a kill -9 and 208 MB after the resume."""
    before = Ledger()
    before.count("workers-0", {"bytes_worker_group": 1000, "bytes_group_worker": 2000})
    before.worker(3, steps=10, pushes=10)
    saved = json.loads(json.dumps(before.state_dict()))  # as a checkpoint keeps it
    before.count("workers-0", {"bytes_worker_group": 1500, "bytes_group_worker": 2600})
    written = before.figures()  # the last line before the kill
    after = Ledger()
    after.load_state_dict(saved)
    after.catch_up(written)
    assert after.figures() == written
    # the in-process group's saved traffic goes on from the checkpoint's: only what is new
    after.count("workers-0", {"bytes_worker_group": 1100, "bytes_group_worker": 2100})
    assert after.figures()["bytes_worker_group"] == 1500 + 100
    assert after.workers[3] == {"steps": 10, "pushes": 10}
    after.worker(3, steps=4)  # a restarted worker's own count starts again: the ledger's holds
    assert after.workers[3]["steps"] == 10


def _run_dir(tmp: Path, events: list[dict]) -> Path:
    (tmp / "config.json").write_text(json.dumps({"t0": 0.0, "mode": "gssp", "workers": 2}))
    with open(tmp / "global.jsonl", "w") as f:
        for r in events:
            f.write(json.dumps(r) + "\n")
    return tmp


def test_an_evaluator_elsewhere_is_scored_from_the_servers_lines(tmp_path: Path) -> None:
    """Its eval.jsonl is on its own machine: summary.json said final_accuracy null and the
    dashboard "No evaluator is connected". Its SCOREs are the server's eval lines."""
    figures = {"bytes_worker_group": 10, "bytes_group_worker": 20, "bytes_group_global": 3,
               "bytes_global_group": 4, "bytes_total": 37}
    run = _run_dir(tmp_path, [
        {"t": 1.0, "event": "groups", "assignment": {"0": 0, "1": 0}, **figures},
        {"t": 2.0, "event": "eval", "accuracy": 0.5, "loss": 1.2, "final": False, **figures},
        {"t": 3.0, "event": "eval", "accuracy": 0.83, "loss": 0.6, "final": True, **figures},
        {"t": 3.5, "event": "done", "train_s": 2.5, **figures}])
    s = summarize(run, write=False)
    assert (s["final_accuracy"], s["eval_points"]) == (0.83, 2)
    assert {k: s[k] for k in figures} == figures
    state = RunState({"t0": 0.0, "mode": "gssp", "workers": 2})
    for line in (run / "global.jsonl").read_text().splitlines():
        state.add("global", json.loads(line))
    assert [p["accuracy"] for p in state.eval] == [0.5, 0.83]
    assert state.hops() == {"worker_to_group": 10.0, "group_to_worker": 20.0,
                            "group_to_global": 3.0, "global_to_group": 4.0}
    state.add("eval", {"t": 2.5, "accuracy": 0.6})  # the same points from eval.jsonl: not twice
    assert len(state.eval) == 2


def test_the_figures_a_line_carries_leave_its_own_fields_alone() -> None:
    """Every global.jsonl line carries the ledger's figures beside its own fields: a figure
    named "pushes" overwrote a merge line's pushes since the last exchange (the dashboard then
    summed running totals and its bytes per push read a quarter)."""
    from minips.record.ledger import FIGURES

    own = {"pushes", "samples", "version", "group", "group_samples", "t", "event", "bytes_up",
           "bytes_down", "bytes_in", "bytes_out"}
    assert not own & set(FIGURES)
