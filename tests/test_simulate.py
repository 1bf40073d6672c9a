"""`minips simulate` (simulate.py): the role cores in simulated time write a real run directory;
BSP on the simulator is synchronous SGD; PULLs answered at one instant share one publish;
workers that fail and rejoin; the command's flags and errors. The reference tests through
the simulator's real model: tests/test_simulate_model.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minips.core import optim
from minips.core.config import RunConfig
from minips.errors import ConfigError
from minips.record.metrics import BYTE_FIGURES
from minips.record.rundir import read_jsonl
from minips.sim.simulate import SimConfig, Simulation, report, simulate
from minips.sim.timing import Failure, Links, Quadratic, parse_failures

SLOW = [1, 1, 1.5, 1.5, 2, 2, 4, 4]


def test_a_gssp_simulation_writes_a_run_directory_that_the_summary_reads(tmp_path: Path) -> None:
    run = RunConfig(workers=8, mode="gssp", compressor="topk", ratio=0.02, lr=0.02,
                    lr_warmup=0, dataset="synthetic", epochs=100, base_step_s=0.04)
    s = simulate(SimConfig(run=run, slowdowns=SLOW, jitter=0.1, rate=2.5e6, latency_s=0.002,
                           dim=2000, max_pushes=2000, eval_every_s=0.5, out_dir=str(tmp_path),
                           name="sim"))
    assert s["pushes"] == s["steps"] >= 2000 and s["groups"] == 4
    assert s["samples"] == 64 * s["steps"]  # every push counted once, by the global server too
    assert all(s[h] > 0 for h in BYTE_FIGURES)
    assert s["bytes_worker_group"] < 0.1 * s["bytes_raw"]  # 2% uploads, as on the wire
    evals = read_jsonl(tmp_path / "sim" / "eval.jsonl")
    assert evals[-1]["loss"] < evals[0]["loss"] / 5  # it trains
    per = s["per_worker"]
    fast, slow = per["0"]["steps"], per["7"]["steps"]
    assert 3 <= fast / slow <= 5  # a group steps at its own pace: 4x slower worker, ~1/4 steps
    assert s["mean_staleness"] is not None and s["sim_s"] > 0


def test_gdtopk_workers_upload_at_their_groups_ratio(tmp_path: Path) -> None:
    """The global core gives each group its GDTopK ratio; every worker compresses at it, as a
    real worker does once ASSIGN tells it (slower-more: the slowest group keeps the most)."""
    run = RunConfig(workers=8, mode="gssp", compressor="gdtopk", ratio=0.02, lr=0.02,
                    lr_warmup=0, dataset="synthetic", epochs=100, base_step_s=0.04)
    simulate(SimConfig(run=run, slowdowns=SLOW, dim=2000, max_pushes=800,
                       out_dir=str(tmp_path), name="gdt"))
    grouped = next(r for r in read_jsonl(tmp_path / "gdt" / "global.jsonl")
                   if r["event"] == "groups")
    ratios = {int(g): r for g, r in grouped["ratios"].items()}
    assert len(set(ratios.values())) > 1  # the groups were given different ratios
    for w in range(8):
        recs = read_jsonl(tmp_path / "gdt" / f"worker-{w}.jsonl")
        group = recs[0]["group"]
        assert recs[0]["ratio"] == ratios[group], (w, group, recs[0]["ratio"], ratios)
    assert ratios[max(ratios)] > ratios[min(ratios)]


@pytest.mark.parametrize("optimizer_at", ["server", "worker"])
def test_bsp_on_the_simulator_is_synchronous_sgd(tmp_path: Path, optimizer_at: str) -> None:
    """Eight workers in BSP, dense: 25 rounds equal 25 SGD steps on the mean of the eight
    gradients, drawn from the same random streams (momentum and weight decay included),
    whether the group server or each worker holds the optimizer."""
    run = RunConfig(workers=8, mode="bsp", lr=0.2, momentum=0.9, weight_decay=5e-4,
                    lr_warmup=0, dataset="synthetic", epochs=100, sync_every=3,
                    optimizer_at=optimizer_at)
    rounds, dim = 25, 300
    s = simulate(SimConfig(run=run, slowdowns=SLOW, dim=dim, max_pushes=8 * rounds,
                           out_dir=str(tmp_path), name="bsp"))
    assert 8 * rounds <= s["pushes"] < 8 * (rounds + 1)  # a last round left incomplete
    objective = Quadratic(dim, 1.0, run.seed, run.batch_size)
    rngs = [np.random.default_rng(run.seed * 1000 + w) for w in range(8)]
    w_ref = np.zeros(dim, np.float32)
    opt = optim.SGD(dim, lr=0.2, momentum=0.9, weight_decay=5e-4)
    for _ in range(rounds):
        grads = []
        for w in range(8):
            grads.append(objective.gradient(w, w_ref, rngs[w])[0])
        opt.step(w_ref, np.asarray(np.mean(grads, axis=0, dtype=np.float32)))
    final = np.load(tmp_path / "bsp" / "final_weights.npy")
    np.testing.assert_allclose(final, w_ref, rtol=1e-5, atol=1e-6)


def test_the_command_prints_its_summary_and_refuses_bad_flags(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "minips", "simulate", "--slowdown", "1,2,4,4",
           "--mode", "gssp", "--compressor", "gdtopk", "--ratio", "0.05", "--dim", "500",
           "--max-pushes", "400", "--link-mbit", "10", "--latency-ms", "5",
           "--out", str(tmp_path)]
    out = subprocess.run([*cmd, "--name", "cli", "--json"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["workers"] == 4 and got["pushes"] >= 400 and got["compressor"] == "gdtopk"
    assert (tmp_path / "cli" / "summary.json").exists()
    assert got["plots"] and all(Path(p).exists() for p in got["plots"])  # as `minips local`
    bad = subprocess.run([*cmd[:4], "--dim", "0", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "--dim 0" in bad.stderr and "Traceback" not in bad.stderr


def test_without_json_the_command_names_its_figures_and_what_the_workers_train(
        tmp_path: Path) -> None:
    """Sentences, not a JSON line; a run that names a model and a data set (as
    examples/course.toml does) says in one line that the synthetic objective trains instead."""
    cmd = [sys.executable, "-m", "minips", "simulate", "--slowdown", "1,2", "--mode", "gssp",
           "--model", "lenet5", "--dataset", "fashion-mnist", "--dim", "200",
           "--max-pushes", "100", "--no-plot", "--out", str(tmp_path), "--name", "said"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    summary = json.loads((tmp_path / "said" / "summary.json").read_text())
    first, figures = out.stdout.splitlines()[:2]
    assert not out.stdout.lstrip().startswith("{")
    assert f"{summary['sim_s']:.2f} s of simulated training" in first
    assert "2 workers in" in first and "pushes " in figures and "mean staleness" in figures
    assert "no accuracy" in figures and f"{tmp_path / 'said'}" in out.stdout
    said = [line for line in out.stderr.splitlines() if "synthetic quadratic" in line]
    assert len(said) == 1 and "lenet5 on fashion-mnist is not trained" in said[0]


def test_sim_s_is_the_simulated_training_time_not_the_next_evaluation_tick(
        tmp_path: Path) -> None:
    """A run that spends its budget at ~1 s with evaluations every 5 s: sim_s is when the
    budget was spent (train_s, the done event), and no evaluation is drawn at 5 s."""
    run = RunConfig(workers=2, mode="ssp", lr_warmup=0, dataset="synthetic", epochs=100,
                    base_step_s=0.04)
    s = simulate(SimConfig(run=run, slowdowns=[1, 2], dim=50, max_pushes=40, eval_every_s=5.0,
                           out_dir=str(tmp_path), name="short"))
    done = [r["t"] for r in read_jsonl(tmp_path / "short" / "global.jsonl")
            if r["event"] == "done"]
    assert s["sim_s"] == pytest.approx(s["train_s"]) == pytest.approx(done[-1])
    assert 0.5 < s["sim_s"] < 2.0
    last_eval = read_jsonl(tmp_path / "short" / "eval.jsonl")[-1]
    assert last_eval["final"] and last_eval["t"] < 2.0


def test_each_merge_line_says_what_other_groups_merged_since_the_groups_last_answer(
        tmp_path: Path) -> None:
    """The between-group staleness in the records: a merge line's ``missed`` is the other
    groups' merge lines since the group's previous one (or since the groups formed) and its
    ``base_age_s`` the simulated seconds since then (each answer goes out at its merge)."""
    run = RunConfig(workers=4, groups=2, mode="gssp", lr_warmup=0, dataset="synthetic",
                    epochs=100, base_step_s=0.04, sync_every=2)
    simulate(SimConfig(run=run, slowdowns=[1, 1, 4, 4], dim=50, max_pushes=200,
                       out_dir=str(tmp_path), name="between"))
    lines = read_jsonl(tmp_path / "between" / "global.jsonl")
    start = next(r["t"] for r in lines if r["event"] == "groups")
    merges = [r for r in lines if r["event"] == "merge"]
    last: dict[int, tuple[int, float]] = {}  # group -> (merges before its last, its t)
    missed: dict[int, list[int]] = {0: [], 1: []}
    for i, r in enumerate(merges):
        before, since = last.get(r["group"], (0, start))
        others = sum(1 for m in merges[before:i] if m["group"] != r["group"])
        assert r["missed"] == others, (i, r)
        assert r["base_age_s"] == pytest.approx(r["t"] - since, abs=1e-6)
        last[r["group"]] = (i + 1, r["t"])
        missed[r["group"]].append(r["missed"])
    # group 1 steps 4x slower: it misses ~4 of group 0's merges per exchange, group 0 at most 1
    assert len(missed[0]) > 3 * len(missed[1]) > 30
    assert max(missed[0]) == 1 and sorted(missed[1])[len(missed[1]) // 2] == 4


def test_every_simulate_option_has_help() -> None:
    from minips.run import flags

    parser = flags.build_parser()
    sim = parser._subparsers._group_actions[0].choices["simulate"]  # type: ignore[union-attr,index]
    for action in sim._actions:
        assert action.help, action.option_strings
    text = sim.format_help()
    assert "--link-mbit" in text and "--max-pushes" in text and "--jitter" in text


def test_the_pulls_answered_at_one_instant_share_one_publish(tmp_path: Path) -> None:
    """BSP, four workers of one speed, a compressed downlink: each round releases the four
    PULLs at one instant, and the group publishes once for them, as the asyncio group server
    publishes once per event-loop turn."""
    run = RunConfig(workers=4, mode="bsp", compressor="topk", ratio=0.05, lr=0.05,
                    lr_warmup=0, dataset="synthetic", epochs=100, base_step_s=0.01)
    sim = Simulation(SimConfig(run=run, dim=400, max_pushes=4 * 30), tmp_path / "pub")
    core = sim.groups[0].core
    calls: list[float] = []
    publish = core.publish

    def counted() -> None:
        calls.append(sim.t)
        publish()

    core.publish = counted  # type: ignore[method-assign]
    sim.run_all()
    answers = sum(len(r) for r in sim.records)
    assert answers >= 4 * 30 and core.downlink is not None
    assert len(calls) == len(set(calls))  # never twice at one instant
    assert len(calls) <= answers // 4 + 2  # one per round, not one per PULL


def test_a_worker_that_fails_and_rejoins(tmp_path: Path) -> None:
    """Worker 3 drops at 1 s and rejoins at 3 s; worker 2 drops for good at 2 s. BSP rounds
    stop waiting for each while it is gone; worker 3 steps again after it rejoins; the budget
    is reached by those left."""
    run = RunConfig(workers=4, mode="bsp", lr=0.05, lr_warmup=0, dataset="synthetic",
                    epochs=100, base_step_s=0.1)
    fails = [Failure(3, 1.0, 2.0), Failure(2, 2.05)]
    s = simulate(SimConfig(run=run, dim=100, max_pushes=100, failures=fails,
                           out_dir=str(tmp_path), name="fail"))
    recs = {w: read_jsonl(tmp_path / "fail" / f"worker-{w}.jsonl") for w in range(4)}
    t3 = [r["t"] for r in recs[3]]
    assert any(t < 1.0 for t in t3) and not any(1.0 < t < 3.0 for t in t3)
    assert any(t > 3.0 for t in t3)  # back after it rejoined
    assert max(r["t"] for r in recs[2]) < 2.1 and s["pushes"] >= 100
    assert len(recs[3]) < len(recs[0]) - 15  # it did not step while away (2 s, 20 rounds)
    assert recs[3][-1]["clock"] == recs[0][-1]["clock"]  # rejoined at the group's clock
    events = [r["event"] for r in read_jsonl(tmp_path / "fail" / "group-0.jsonl")]
    assert events.count("left") == 2 and events.count("joined") == 1
    assert s["sim_s"] < 10  # a failure due after the end does not stretch the run


def test_links_keep_their_order_under_jitter_and_take_time_per_byte() -> None:
    links = Links(1, rate=1000.0, latency_s=0.01, latency_jitter_s=0.05, seed=0)
    arrivals = [links.arrival(0, 0.001 * i, 10) for i in range(200)]  # a burst
    assert arrivals == sorted(arrivals)  # one TCP connection: in order
    assert arrivals[-1] >= 200 * 10 / 1000.0  # 2,000 bytes at 1,000 bytes/s
    spaced = [links.arrival(0, 10.0 + 0.2 * i, 10) for i in range(100)]
    delays = [a - (10.0 + 0.2 * i) for i, a in enumerate(spaced)]
    assert spaced == sorted(spaced) and min(delays) >= 0.02  # 10 ms sending + 10 ms latency
    assert len({round(d, 9) for d in delays}) > 90  # jittered
    plain = Links(1, rate=0.0, latency_s=0.01, latency_jitter_s=0.0, seed=0)
    assert plain.arrival(0, 5.0, 10**9) == 5.01


def test_failures_parse_and_refuse_bad_items() -> None:
    assert parse_failures("3@10+5, 6@20") == [Failure(3, 10.0, 5.0), Failure(6, 20.0, None)]
    for bad in ("3", "x@1", "3@-1", "3@1+inf", "-1@2"):
        try:
            parse_failures(bad)
        except ConfigError as exc:
            assert bad.split("+")[0].split(",")[0] in str(exc)
        else:
            raise AssertionError(bad)


def test_the_synthetic_simulator_runs_without_torch(tmp_path: Path) -> None:
    """Only sim_model.py imports torch: a synthetic simulation runs with torch unimportable."""
    code = f"""
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, NoTorch())
from minips.core.config import RunConfig
from minips.sim.simulate import SimConfig, simulate
run = RunConfig(workers=4, mode="ssp", dataset="synthetic", epochs=100, lr_warmup=0)
s = simulate(SimConfig(run=run, dim=50, max_pushes=40, out_dir={str(tmp_path)!r}, name="nt"))
assert "torch" not in sys.modules and s["pushes"] >= 40
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_the_demo_preset_brings_its_slowdowns_to_the_simulator_too(tmp_path: Path) -> None:
    """`minips simulate --preset demo` simulates the demo's cluster: 8 workers at
    1,1,1.5,1.5,2,2,4,4, grouped by those speeds (it used to simulate 8 equal workers)."""
    cmd = [sys.executable, "-m", "minips", "simulate", "--preset", "demo", "--dim", "200",
           "--max-pushes", "300", "--no-plot", "--json", "--out", str(tmp_path), "--name", "demo"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["workers"] == 8 and got["groups"] > 1


def test_lbbsp_batches_follow_a_slowdown_schedule_in_simulated_time(tmp_path: Path) -> None:
    from minips.core.slowdown import parse_schedules

    run = RunConfig(workers=3, mode="lbbsp", lr=0.02, lr_warmup=0, dataset="synthetic",
                    epochs=100, base_step_s=0.04, balance_every=5)
    schedules = parse_schedules("1,1,3@0,1@5s")  # worker 2: 3x for 5 s, then as fast
    s = simulate(SimConfig(run=run, slowdowns=[x.first for x in schedules],
                           schedules=schedules, dim=200, max_pushes=900,
                           out_dir=str(tmp_path), name="lb"))
    assert s["sim_s"] > 6
    balance = [r for r in read_jsonl(tmp_path / "lb" / "group-0.jsonl")
               if r.get("event") == "balance"]
    assert balance[0]["batches"] == {"0": 82, "1": 82, "2": 28}  # 3:3:1 of 192
    assert balance[-1]["t"] > 5 and balance[-1]["batches"] == {"0": 64, "1": 64, "2": 64}
    per_clock: dict[int, int] = {}
    for w in range(3):
        for r in read_jsonl(tmp_path / "lb" / f"worker-{w}.jsonl"):
            per_clock[r["clock"]] = per_clock.get(r["clock"], 0) + r["samples"]
    assert set(per_clock.values()) == {192}


def test_gdtopk_ratios_follow_a_scheduled_speed_up(tmp_path: Path) -> None:
    from minips.core.slowdown import parse_schedules

    run = RunConfig(workers=4, groups=2, mode="gssp", compressor="gdtopk", ratio=0.01,
                    lr=0.02, lr_warmup=0, dataset="synthetic", epochs=100, base_step_s=0.04)
    schedules = parse_schedules("1,1,4@0,1@10s,4@0,1@10s")  # the slow group catches up at 10 s
    simulate(SimConfig(run=run, slowdowns=[x.first for x in schedules], schedules=schedules,
                       dim=500, max_pushes=4000, out_dir=str(tmp_path), name="gd"))
    ratios = [(r["t"], r["ratios"]) for r in read_jsonl(tmp_path / "gd" / "global.jsonl")
              if r.get("event") in ("groups", "ratios")]
    assert ratios[0][1]["1"] / ratios[0][1]["0"] > 3  # 4x slower: it uploads more
    assert all(t > 10 for t, _ in ratios[1:])  # nothing changes before the speed-up
    assert ratios[-1][1]["1"] / ratios[-1][1]["0"] < 1.5  # as fast: about the same ratio


def test_a_trace_of_numpy_scalars_is_simulated_as_plain_floats() -> None:
    """Step traces computed with numpy (compare_simulate's calibration) hold np.float64: the
    simulator takes them as floats, so its PUSHes pass the messages' checks (a local-steps
    run's calibration once stopped at the first push)."""
    from minips.sim.timing import StepTimes

    steps = StepTimes([np.float64(0.05)], 0.0, [[np.float64(0.04), np.float64(0.06)]])
    got = [steps.next(0) for _ in range(3)]
    assert got == [0.04, 0.06, 0.05] and all(type(x) is float for x in got)


def _equal_speeds(tmp_path: Path, mode: str, jitter: float, name: str) -> dict:
    run = RunConfig(workers=4, mode=mode, staleness=3, lr=0.05, lr_warmup=0,
                    dataset="synthetic", epochs=100, base_step_s=0.04)
    return simulate(SimConfig(run=run, slowdowns=[1.0], jitter=jitter, dim=200,
                              max_pushes=400, out_dir=str(tmp_path), name=name))


def test_jitter_makes_staleness_visible_with_equal_speeds(tmp_path: Path) -> None:
    """Four workers of one speed: without jitter they push in lock-step and SSP shows no
    staleness (by construction, and the report says why); with 10% jitter they drift apart
    within the bound, while BSP stays at 0 and waits instead."""
    still = _equal_speeds(tmp_path, "ssp", 0.0, "still")
    drift = _equal_speeds(tmp_path, "ssp", 0.1, "drift")
    rounds = _equal_speeds(tmp_path, "bsp", 0.1, "rounds")
    assert still["mean_staleness"] == 0 and still["mean_wait_s"] == 0
    assert 0.5 < drift["mean_staleness"] <= 3 and drift["max_staleness"] <= 3
    assert rounds["mean_staleness"] == 0 and rounds["mean_wait_s"] > 0
    assert rounds["sim_s"] > 1.05 * drift["sim_s"]  # a round waits for its slowest draw
    assert "0 by construction" in report(still, [])
    assert "0 by construction" not in report(drift, []) + report(rounds, [])


def test_jitter_moves_when_a_step_ends_not_what_it_computes(tmp_path: Path) -> None:
    """The jitter draws from streams of its own: BSP with jitter ends with the weights of
    BSP without it (synchronous SGD either way), only later."""
    plain = _equal_speeds(tmp_path, "bsp", 0.0, "plain")
    shaken = _equal_speeds(tmp_path, "bsp", 0.2, "shaken")
    assert shaken["sim_s"] > plain["sim_s"]
    # the same SGD steps; only the order of a round's sum may differ (float32 rounding)
    np.testing.assert_allclose(np.load(tmp_path / "shaken" / "final_weights.npy"),
                               np.load(tmp_path / "plain" / "final_weights.npy"),
                               rtol=1e-5, atol=1e-6)
