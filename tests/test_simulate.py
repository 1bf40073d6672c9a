"""`minips simulate` (simulate.py): the role cores in simulated time write a real run directory;
BSP on the simulator is synchronous SGD; the command's flags and errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from minips import metrics, optim
from minips.config import RunConfig
from minips.simulate import Quadratic, SimConfig, simulate

SLOW = [1, 1, 1.5, 1.5, 2, 2, 4, 4]


def test_a_gssp_simulation_writes_a_run_directory_that_the_summary_reads(tmp_path: Path) -> None:
    run = RunConfig(workers=8, mode="gssp", compressor="topk", ratio=0.02, lr=0.02,
                    lr_warmup=0, dataset="synthetic", epochs=100, base_step_s=0.04)
    s = simulate(SimConfig(run=run, slowdowns=SLOW, jitter=0.1, rate=2.5e6, latency_s=0.002,
                           dim=2000, max_pushes=2000, eval_every_s=0.5, out_dir=str(tmp_path),
                           name="sim"))
    assert s["pushes"] == s["steps"] >= 2000 and s["groups"] == 4
    assert s["samples"] == 64 * s["steps"]  # every push counted once, by the global server too
    assert all(s[h] > 0 for h in metrics.HOPS)
    assert s["bytes_worker_group"] < 0.1 * s["bytes_raw"]  # 2% uploads, as on the wire
    evals = metrics.read_jsonl(tmp_path / "sim" / "eval.jsonl")
    assert evals[-1]["loss"] < evals[0]["loss"] / 5  # it trains
    per = s["per_worker"]
    fast, slow = per["0"]["steps"], per["7"]["steps"]
    assert 3 <= fast / slow <= 5  # a group steps at its own pace: 4x slower worker, ~1/4 steps
    assert s["mean_staleness"] is not None and s["sim_s"] > 0


def test_bsp_on_the_simulator_is_synchronous_sgd(tmp_path: Path) -> None:
    """Eight workers in BSP, dense: 25 rounds equal 25 SGD steps on the mean of the eight
    gradients, drawn from the same random streams (momentum and weight decay included)."""
    run = RunConfig(workers=8, mode="bsp", lr=0.2, momentum=0.9, weight_decay=5e-4,
                    lr_warmup=0, dataset="synthetic", epochs=100, sync_every=3)
    rounds, dim = 25, 300
    s = simulate(SimConfig(run=run, slowdowns=SLOW, dim=dim, max_pushes=8 * rounds,
                           out_dir=str(tmp_path), name="bsp"))
    assert 8 * rounds <= s["pushes"] < 8 * (rounds + 1)  # a last round left incomplete
    objective = Quadratic(dim, 1.0, run.seed)
    rngs = [np.random.default_rng(run.seed * 1000 + w) for w in range(8)]
    w_ref = np.zeros(dim, np.float32)
    opt = optim.SGD(dim, lr=0.2, momentum=0.9, weight_decay=5e-4)
    for _ in range(rounds):
        grads = []
        for w in range(8):
            rngs[w].standard_normal()  # the draw of the step's compute time
            grads.append(objective.gradient(w_ref, run.batch_size, rngs[w]))
        opt.step(w_ref, np.asarray(np.mean(grads, axis=0, dtype=np.float32)))
    final = np.load(tmp_path / "bsp" / "final_weights.npy")
    np.testing.assert_allclose(final, w_ref, rtol=1e-5, atol=1e-6)


def test_the_command_prints_its_summary_and_refuses_bad_flags(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "minips", "simulate", "--slowdown", "1,2,4,4",
           "--mode", "gssp", "--compressor", "gdtopk", "--ratio", "0.05", "--dim", "500",
           "--max-pushes", "400", "--link-mbit", "10", "--latency-ms", "5",
           "--out", str(tmp_path), "--name", "cli"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["workers"] == 4 and got["pushes"] >= 400 and got["compressor"] == "gdtopk"
    assert (tmp_path / "cli" / "summary.json").exists()
    bad = subprocess.run([*cmd[:4], "--dim", "0", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "--dim 0" in bad.stderr and "Traceback" not in bad.stderr


def test_every_simulate_option_has_help() -> None:
    from minips import cli

    parser = cli.build_parser()
    sim = parser._subparsers._group_actions[0].choices["simulate"]  # type: ignore[union-attr,index]
    for action in sim._actions:
        assert action.help, action.option_strings
    text = sim.format_help()
    assert "--link-mbit" in text and "--max-pushes" in text and "--jitter" in text
