"""Local steps (core/local_steps.py: ``LocalSteps``, the outer optimizer, auto H): a worker
runs H optimizer steps on its local weights and pushes their change; its group server applies
it with an outer optimizer (average or DiLoCo's Nesterov); with ``--local-steps auto`` the
global server gives each group its H from its speed. By hand on tiny vectors, through the
role cores, the simulator and a real run on loopback."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_worker import run_cluster

from minips.compress.registry import make_compressor
from minips.core.actions import SendSettings
from minips.core.config import FieldError, RunConfig
from minips.core.global_core import GlobalCore
from minips.core.group_core import GroupCore
from minips.core.local_steps import LocalSteps, auto_local_steps
from minips.core.roster import GroupHandle
from minips.core.worker_opt import Upload
from minips.ml import data, models
from minips.record.rundir import read_jsonl
from minips.run.flags import build_parser, run_config_from_args
from minips.sim.simulate import SimConfig, simulate
from minips.sparse import encode_vector
from minips.wire import control, messages
from minips.wire.fields import Payload

WORKER = {"optimizer_at": "worker", "lr_warmup": 0.0}


def upload(n: int, compressor: str = "none", **run: object) -> Upload:
    cfg = RunConfig(workers=1, **{**WORKER, **run})  # type: ignore[arg-type]
    return Upload(cfg, make_compressor(compressor, n, ratio=0.5, seed=3))


def test_the_pseudo_gradient_is_the_change_of_h_sgd_steps_by_hand() -> None:
    """On f(w) = |w - t|^2 / 2 (gradient w - t), three SGD steps with momentum 0.5 and weight
    decay 0.1 from w0, written out; the push is w0 - w3, and the velocity carries on."""
    t = np.array([1.0, -2.0, 0.5], np.float32)
    w0 = np.array([0.0, 1.0, 2.0], np.float32)
    local = LocalSteps(upload(3, lr=0.1, momentum=0.5, weight_decay=0.1))
    moved = local.start(w0, 3, lr_factor=0.5)
    while not local.finished:
        moved = local.step(moved - t)
    u: np.ndarray
    w, u = w0.astype(np.float64), np.zeros(3)
    for _ in range(3):
        u = 0.5 * u + (w - t) + 0.1 * w
        w = w - 0.1 * 0.5 * u
    sent = local.packet()
    assert isinstance(sent, np.ndarray)  # dense: no compressor
    np.testing.assert_allclose(sent, w0 - w, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(local.opt.velocity, u, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(w0, [0.0, 1.0, 2.0])  # the pulled copy is not moved


def test_one_local_step_is_the_worker_optimizer_bit_for_bit() -> None:
    """H = 1 through the inner loop sends the very packets ``Upload.packet`` sends: top-k with
    error feedback and masking, five pushes, the same bits."""
    rng = np.random.default_rng(0)
    a = upload(50, "topk", momentum_masking=True)
    b = upload(50, "topk", momentum_masking=True)
    inner = LocalSteps(b)
    w = rng.standard_normal(50).astype(np.float32)
    for i in range(5):
        g = rng.standard_normal(50).astype(np.float32)
        pa = a.packet(g, w, lr_factor=0.5 + i / 10, progress=i / 10)
        inner.start(w, 1, lr_factor=0.5 + i / 10)
        inner.step(g)
        pb = inner.packet(progress=i / 10)
        np.testing.assert_array_equal(pa.indices, pb.indices)  # type: ignore[union-attr]
        np.testing.assert_array_equal(pa.values, pb.values)  # type: ignore[union-attr]
        w = w - 0.01 * g


def test_local_steps_and_the_outer_optimizer_need_the_optimizer_on_the_worker() -> None:
    for bad in ({"local_steps": 4}, {"local_steps": 0}, {"outer_optimizer": "nesterov"},
                {"outer_lr": 0.7}, {**WORKER, "local_steps": -1},
                {**WORKER, "outer_optimizer": "adam"}, {**WORKER, "outer_momentum": 1.0}):
        with pytest.raises(FieldError):
            RunConfig(**bad).validate()  # type: ignore[arg-type]
    RunConfig(optimizer_at="worker", local_steps=8, outer_optimizer="nesterov",
              outer_lr=0.7).validate()
    args = build_parser().parse_args(["local", "--optimizer-at", "worker", "--local-steps",
                                      "auto", "--local-steps-max", "16", "--outer-optimizer",
                                      "nesterov", "--outer-lr", "0.7"])
    run = run_config_from_args(args)
    assert run.local_steps_auto and run.local_steps_max == 16 and run.outer_lr == 0.7
    with pytest.raises(SystemExit):
        build_parser().parse_args(["local", "--local-steps", "0"])


def push(core: GroupCore, w: int, clock: int, update: np.ndarray) -> None:
    enc, codec, bufs = encode_vector(update.astype(np.float32))
    core.push(w, messages.Push(clock=clock, samples=64, payload=Payload(enc, codec,
                               tuple(bufs))), now=0.0)


def test_the_nesterov_outer_step_on_the_mean_of_a_round_by_hand() -> None:
    """BSP, 2 workers: each round's mean pseudo-gradient D is one DiLoCo outer step,
    v = mu v + D, w = w - lr (D + mu v); a checkpoint keeps v, so a resumed group server
    takes the next round's step as the one that never stopped."""
    run = RunConfig(mode="bsp", workers=2, outer_optimizer="nesterov", outer_lr=0.7,
                    outer_momentum=0.9, **WORKER)  # type: ignore[arg-type]
    w0 = np.array([1.0, 2.0, 3.0], np.float32)
    core = GroupCore(0, run, w0, members=[0, 1])
    rounds = [(np.array([1.0, 0.0, 2.0]), np.array([0.0, 2.0, 0.0])),
              (np.array([-1.0, 1.0, 0.0]), np.array([0.5, 0.5, 4.0]))]
    w, v = w0.astype(np.float64), np.zeros(3)
    for clock, (d0, d1) in enumerate(rounds[:1], 1):
        push(core, 0, clock, d0)
        push(core, 1, clock, d1)
        d = (d0 + d1) / 2
        v = 0.9 * v + d
        w = w - 0.7 * (d + 0.9 * v)
    np.testing.assert_allclose(core.weights, w, rtol=1e-6)
    resumed = GroupCore(0, run, np.zeros(3, np.float32), members=[0, 1])
    resumed.load_state_dict(core.state_dict(), now=0.0)
    np.testing.assert_allclose(resumed.opt.velocity, v, rtol=1e-6)
    d0, d1 = rounds[1]
    for c in (core, resumed):
        push(c, 0, 2, d0)
        push(c, 1, 2, d1)
    d = (d0 + d1) / 2
    v = 0.9 * v + d
    w = w - 0.7 * (d + 0.9 * v)
    np.testing.assert_allclose(core.weights, w, rtol=1e-6)
    np.testing.assert_array_equal(resumed.weights, core.weights)


def test_averaging_applies_each_push_as_a_share_of_the_groups_step() -> None:
    """Outer SGD (avg) without rounds: each push moves outer_lr / m of its pseudo-gradient."""
    run = RunConfig(mode="ssp", workers=2, outer_lr=0.5, **WORKER)  # type: ignore[arg-type]
    core = GroupCore(0, run, np.zeros(2, np.float32), members=[0, 1])
    push(core, 0, 1, np.array([2.0, -4.0]))
    np.testing.assert_allclose(core.weights, [-0.5, 1.0])
    assert core.weights_message(0, []).local_steps == 1


def test_auto_local_steps_follow_the_groups_speeds() -> None:
    """H_g = round(H_max t_fastest / t_g), clamped to 1..H_max, with hysteresis; the global
    core sets it at the first grouping and sends a change when the speeds move (ASSIGN)."""
    assert auto_local_steps({0: 0.1, 1: 0.2, 2: 0.35, 3: 2.0}, 8) == {0: 8, 1: 4, 2: 2, 3: 1}
    assert auto_local_steps({0: 0.1, 1: 0.23}, 8, {0: 8, 1: 4}) == {0: 8, 1: 4}  # 3.5: held
    assert auto_local_steps({0: 0.1, 1: 0.3}, 8, {0: 8, 1: 4}) == {0: 8, 1: 3}
    run = RunConfig(mode="gssp", workers=4, groups=2, local_steps=0, local_steps_max=8,
                    **WORKER)  # type: ignore[arg-type]
    core = GlobalCore(run, np.zeros(5, np.float32), regroup=False, wall=lambda: 1e9)
    for w, t in enumerate((0.05, 0.05, 0.2, 0.2)):
        core.roster.admit(w)
        core.on_stats(w, control.Stats(clock=0, step_time=t, loss=1.0), 0.0)
    assignment = core.first_assignment(0.0)
    handles = [GroupHandle(g, f"h:{g}", sorted(w for w, h in assignment.items() if h == g))
               for g in sorted(set(assignment.values()))]
    actions = core.groups_formed(handles, assignment, 0.0)
    assert {g: h.local_steps for g, h in core.groups.items()} == {0: 8, 1: 2}
    assert any(isinstance(a, SendSettings) for a in actions)
    assert core.assign_message(core.groups[1]).local_steps == 2
    for w in (2, 3):  # the slow group got faster: 0.1 s a step, H 4
        actions = core.on_stats(w, control.Stats(clock=5, step_time=0.1, loss=1.0), 1.0)
    assert core.groups[1].local_steps == 4
    assert [a.ratios for a in actions if isinstance(a, SendSettings)] == [{1: run.ratio}]


def sim_run(tmp_path: Path, name: str, **run: object) -> np.ndarray:
    cfg = RunConfig(**{"workers": 4, "mode": "gssp", "groups": 2, "lr": 0.02,  # type: ignore[arg-type]
                       "dataset": "synthetic", "epochs": 100, "base_step_s": 0.04,
                       "compressor": "topk", "ratio": 0.05, **WORKER, **run})
    simulate(SimConfig(run=cfg, slowdowns=[1, 1, 4, 4], dim=500, max_pushes=300,
                       out_dir=str(tmp_path), name=name))
    return np.load(tmp_path / name / "final_weights.npy")


def test_h1_is_todays_run_bit_for_bit_in_the_simulator(tmp_path: Path) -> None:
    """Auto local steps capped at H_max 1 go through the whole H machinery (global choice,
    ASSIGN to the groups, WEIGHTS to the workers) and end with today's weights, bit for bit."""
    today = sim_run(tmp_path, "today")
    np.testing.assert_array_equal(sim_run(tmp_path, "auto1", local_steps=0, local_steps_max=1),
                                  today)
    np.testing.assert_array_equal(sim_run(tmp_path, "h1", local_steps=1), today)


def test_the_simulator_trains_with_auto_local_steps(tmp_path: Path) -> None:
    """GSSP, groups 4x apart in speed, H_max 8: the fast group pushes every 8 steps, the slow
    one every 2, each push carries its H batches, and the synthetic objective trains (dense
    pushes: top-k 5% of an 8-step change with the workers' momentum 0.9 diverges here,
    docs/compression.md "Local steps")."""
    sim_run(tmp_path, "auto", local_steps=0, local_steps_max=8, compressor="none")
    evals = read_jsonl(tmp_path / "auto" / "eval.jsonl")
    assert evals[-1]["loss"] < evals[0]["loss"] / 10
    fast = read_jsonl(tmp_path / "auto" / "worker-0.jsonl")
    slow = read_jsonl(tmp_path / "auto" / "worker-3.jsonl")
    assert {r["local_steps"] for r in fast} == {8} and {r["local_steps"] for r in slow} == {2}
    assert all(r["samples"] == 64 * r["local_steps"] for r in fast + slow)
    glob = read_jsonl(tmp_path / "auto" / "global.jsonl")
    assert any(r.get("event") == "local_steps" for r in glob)


@pytest.mark.timeout(120)
async def test_a_real_run_with_auto_local_steps_trains(tmp_path: Path) -> None:
    """GSSP on loopback, 4 workers in 2 groups 4x apart (40 ms and 160 ms a step at least),
    auto local steps up to 4 with Nesterov outer steps: the fast group runs 4 steps per push,
    the slow one fewer, and LeNet-5 on Fashion-MNIST learns."""
    run = RunConfig(mode="gssp", groups=2, workers=4, compressor="none", lr=0.05,
                    local_steps=0, local_steps_max=4, outer_optimizer="nesterov",
                    outer_lr=0.7, outer_momentum=0.5, max_steps=20, base_step_s=0.04,
                    calib_steps=3, eval_every_s=5.0, **WORKER)  # type: ignore[arg-type]
    test = data.load_dataset("fashion-mnist", "test", download=False, fallback=False)
    test = test.subset(np.arange(2000))
    before, _ = models.evaluate(run.model, models.get_flat(models.build_model(run.model, 0)),
                                test)
    # calib_steps 3: the fastest of three, as the first step of a cold process is slow
    srv = await run_cluster(run, tmp_path, slowdowns=[1.0, 1.0, 4.0, 4.0])
    assert srv.core.weights is not None
    after, _ = models.evaluate(run.model, srv.core.weights, test)
    assert before < 0.2 and after > 0.5, (before, after)
    fast, slow = (read_jsonl(tmp_path / f"worker-{w}.jsonl") for w in (0, 3))
    # as of the last STATS (the first grouping's speeds come from a 3-step calibration, which
    # a loaded machine can blur; the STATS during training set H again)
    assert fast[-1]["local_steps"] == 4 and slow[-1]["local_steps"] < 4
    assert all(r["samples"] == 64 * r["local_steps"] for r in fast + slow)


@pytest.mark.timeout(120)
async def test_h1_is_todays_real_run_bit_for_bit(tmp_path: Path) -> None:
    """Two workers in BSP on loopback, the optimizer on the workers, 8 rounds: today's run and
    one with auto local steps capped at 1 (the global server's choice, ASSIGN, WEIGHTS, the
    worker's H) end with the same weights, bit for bit; H = 2 does not."""
    base = RunConfig(mode="bsp", compressor="none", workers=2, momentum=0.9, max_steps=8,
                     base_step_s=0.0, calib_steps=1, lr=0.05, eval_every_s=5.0,
                     **WORKER)  # type: ignore[arg-type]
    ends = []
    for i, extra in enumerate(({}, {"local_steps": 0, "local_steps_max": 1},
                               {"local_steps": 2})):
        run = RunConfig(**{**base.to_info(), **extra})
        srv = await run_cluster(run, tmp_path / str(i))
        assert srv.core.weights is not None
        ends.append(srv.core.weights.copy())
    np.testing.assert_array_equal(ends[1], ends[0])
    assert not np.allclose(ends[2], ends[0], rtol=1e-3, atol=1e-4)
