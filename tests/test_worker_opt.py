"""The optimizer on the worker (core/worker_opt.py) and DGC as published on it: momentum
correction and momentum-factor masking on a hand-computed example, error feedback with masking,
local clipping, the warm-up over a fraction of the run, the group server adding updates as
they are, the config's checks and flags, and the simulator running the mode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minips.compress.registry import make_compressor
from minips.compress.topk import GDTopKCompressor, dense_end_ratio, fraction_warmup_ratio
from minips.core.config import FieldError, RunConfig
from minips.core.group_core import GroupCore
from minips.core.worker_opt import Upload, WorkerSGD, clip_scale
from minips.errors import ConfigError
from minips.record.rundir import read_jsonl
from minips.run.flags import build_parser, run_config_from_args
from minips.sim.simulate import SimConfig, simulate
from minips.sparse import SparseVector, encode_vector
from minips.wire import messages
from minips.wire.fields import Payload

# three gradients of 4 coordinates, exact in float32 (binary fractions)
GRADS = [[1.0, -3.0, 0.5, 2.0], [1.0, 1.0, 0.5, -1.0], [0.0, 2.0, -1.0, 0.5]]


def three_steps(masking: bool) -> tuple[list[tuple[list[int], list[float]]], Upload]:
    """Top-1 of 4 (``topk``, ratio 0.25), momentum 0.5, lr 1, no decay: what each step sent."""
    run = RunConfig(optimizer_at="worker", momentum=0.5, weight_decay=0.0, lr=1.0,
                    momentum_masking=masking, workers=1)
    up = Upload(run, make_compressor("topk", 4, ratio=0.25))
    w = np.zeros(4, np.float32)
    sent = []
    for g in GRADS:
        p = up.packet(np.array(g, np.float32), w)
        assert isinstance(p, SparseVector)
        sent.append((p.indices.tolist(), p.values.tolist()))
    return sent, up


def test_momentum_correction_and_masking_hand_computed() -> None:
    """u <- 0.5 u + g, r <- r + u, send the largest |r|, r[sent] = 0, u[sent] = 0:
    1: u = [1, -3, .5, 2], r = u, sends r[1] = -3; r = [1, 0, .5, 2], u = [1, 0, .5, 2]
    2: u = [1.5, 1, .75, 0], r = [2.5, 1, 1.25, 2], sends r[0]; r = [0, 1, 1.25, 2],
       u = [0, 1, .75, 0]
    3: u = [0, 2.5, -.625, .5], r = [0, 3.5, .625, 2.5], sends r[1]; r = [0, 0, .625, 2.5]."""
    sent, up = three_steps(masking=True)
    assert sent == [([1], [-3.0]), ([0], [2.5]), ([1], [3.5])]
    assert up.compressor.residual is not None and up.opt is not None
    np.testing.assert_array_equal(up.compressor.residual, [0, 0, 0.625, 2.5])
    np.testing.assert_array_equal(up.opt.velocity, [0, 0, -0.625, 0.5])


def test_without_masking_the_old_momentum_keeps_pushing() -> None:
    """The same steps unmasked: 2: u = [1.5, -.5, .75, 0], r = [2.5, -.5, 1.25, 2] sends r[0];
    3: u = [.75, 1.75, -.625, .5], r = [.75, 1.25, .625, 2.5] sends r[3]."""
    sent, up = three_steps(masking=False)
    assert sent == [([1], [-3.0]), ([0], [2.5]), ([3], [2.5])]
    assert up.opt is not None
    np.testing.assert_array_equal(up.opt.velocity, [0.75, 1.75, -0.625, 0.5])


@pytest.mark.parametrize("value_dtype", ["f32", "f16"])
def test_error_feedback_holds_with_masking(value_dtype: str) -> None:
    """Everything sent plus the residual is every update the optimizer made (masking clears
    the velocity, never the accumulation): DGC with clipping, decay and momentum."""
    n, rng = 5000, np.random.default_rng(3)
    run = RunConfig(optimizer_at="worker", momentum=0.9, weight_decay=5e-4, lr=0.1,
                    momentum_masking=True, grad_clip=20.0, workers=4)
    up = Upload(run, make_compressor("dgc", n, ratio=0.01, value_dtype=value_dtype))
    w = rng.standard_normal(n).astype(np.float32)
    updates, sent = np.zeros(n, np.float64), np.zeros(n, np.float64)
    for step in range(30):
        g = (rng.standard_normal(n) * (1 + step % 3)).astype(np.float32)
        before = up.opt.velocity.copy() if up.opt is not None else None
        packet = up.packet(g, w, lr_factor=0.5 + step / 60)
        assert isinstance(packet, SparseVector) and up.opt is not None and before is not None
        # the update of this step, recomputed: clip to 20 / sqrt(4), decay, momentum, lr
        scale = min(1.0, 10.0 / float(np.linalg.norm(g.astype(np.float64))))
        u = 0.9 * before + (g * scale + 5e-4 * w)
        updates += 0.1 * (0.5 + step / 60) * u
        np.add.at(sent, packet.indices.astype(np.int64), packet.values)
        assert not up.opt.velocity[packet.indices.astype(np.int64)].any()  # masked
    assert up.compressor.residual is not None
    np.testing.assert_allclose(sent + up.compressor.residual, updates, rtol=1e-4, atol=1e-5)


def test_local_clipping_scales_by_one_over_sqrt_workers() -> None:
    """grad_clip 2 over 4 workers: each clips at 1; a gradient of norm 10 is scaled by 1/10."""
    g = np.zeros(4, np.float32)
    g[:2] = [6.0, 8.0]  # norm 10
    assert clip_scale(g, 1.0) == pytest.approx(0.1) and clip_scale(g, 0.0) == 1.0
    assert clip_scale(g, 50.0) == 1.0
    run = RunConfig(optimizer_at="worker", momentum=0.0, weight_decay=0.0, lr=1.0,
                    grad_clip=2.0, workers=4)
    up = Upload(run, make_compressor("none", 4, ratio=1.0))
    out = up.packet(g, np.zeros(4, np.float32))
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, np.array([0.6, 0.8, 0, 0]), rtol=1e-6)


def test_the_update_is_the_reference_sgd_step() -> None:
    """One worker's update is what torch-style SGD subtracts: lr * (m v + g + wd w)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal(100).astype(np.float32)
    opt = WorkerSGD(100, lr=0.05, momentum=0.9, weight_decay=5e-4)
    v: np.ndarray = np.zeros(100, np.float32)
    for _ in range(3):
        g = rng.standard_normal(100).astype(np.float32)
        v = np.float32(0.9) * v + (g + np.float32(5e-4) * w)
        delta = opt.update(w, g, lr_factor=0.5)
        np.testing.assert_allclose(delta, np.float32(0.025) * v, rtol=1e-6, atol=1e-8)
        w = w - delta
    state = opt.state_dict()
    again = WorkerSGD(100, lr=0.05, momentum=0.9, weight_decay=5e-4)
    again.load_state_dict(state)
    np.testing.assert_array_equal(again.velocity, opt.velocity)
    with pytest.raises(ConfigError):
        WorkerSGD(50, lr=0.05, momentum=0.9, weight_decay=0).load_state_dict(state)


def _kept_at(c, progresses: tuple[float, ...], *, seed: int) -> list[float]:
    """The kept fraction of compressor ``c`` on one gradient at each run ``progress``."""
    g = np.random.default_rng(seed).standard_normal(c.size).astype(np.float32)
    kept = []
    for p in progresses:
        c.set_progress(p)
        c.compress(g)
        kept.append(c.kept_fraction)
    return kept


def test_warmup_over_a_fraction_of_the_run() -> None:
    """Kept fraction 25% at the start, geometric to the final one at 10% of the run."""
    assert fraction_warmup_ratio(0.0, 0.01, 0.1) == pytest.approx(0.25)
    assert fraction_warmup_ratio(0.05, 0.01, 0.1) == pytest.approx(0.05)  # sqrt(.25 * .01)
    assert fraction_warmup_ratio(0.1, 0.01, 0.1) == 0.01
    assert fraction_warmup_ratio(0.7, 0.01, 0.1) == 0.01
    assert fraction_warmup_ratio(0.0, 0.01, 0.0) == 0.01  # no warm-up
    c = make_compressor("dgc", 10_000, ratio=0.01, warmup_fraction=0.1, tolerance=0.0)
    kept = _kept_at(c, (0.0, 0.05, 0.2), seed=1)
    assert kept == pytest.approx([0.25, 0.05, 0.01], rel=0.02)
    with pytest.raises(ConfigError, match="not both"):
        make_compressor("dgc", 10, ratio=0.1, warmup_fraction=0.1, warmup_epochs=2)
    # gdtopk's own warm-up by epochs gives way to one by fraction (--copt warmup_fraction=...)
    by_fraction = make_compressor("gdtopk", 10, ratio=0.1, warmup_fraction=0.1)
    assert isinstance(by_fraction, GDTopKCompressor)
    assert (by_fraction.warmup_epochs, by_fraction.warmup_fraction) == (0, 0.1)
    by_epochs = make_compressor("gdtopk", 10, ratio=0.1)
    assert isinstance(by_epochs, GDTopKCompressor) and by_epochs.warmup_epochs == 4


def test_a_denser_final_phase_multiplies_the_ratio_at_the_end_of_the_run() -> None:
    """dense_end_fraction 0.2, factor 4: the ratio as set until 80% of the run, then
    geometric to 4x at its end (2x half-way); gdtopk's server-set ratio is multiplied too."""
    assert dense_end_ratio(0.5, 0.2, 4.0) == 1.0
    assert dense_end_ratio(0.8, 0.2, 4.0) == 1.0
    assert dense_end_ratio(0.9, 0.2, 4.0) == pytest.approx(2.0)
    assert dense_end_ratio(1.0, 0.2, 4.0) == pytest.approx(4.0)
    assert dense_end_ratio(1.3, 0.2, 4.0) == pytest.approx(4.0)  # past the budget: no more
    assert dense_end_ratio(0.99, 0.0, 4.0) == 1.0  # off
    for name in ("dgc", "gdtopk"):
        c = make_compressor(name, 10_000, ratio=0.01, warmup_epochs=0, tolerance=0.0,
                            dense_end_fraction=0.2, dense_end_factor=4.0)
        c.set_ratio(0.02)  # gdtopk: the ratio its group's policy sent
        kept = _kept_at(c, (0.5, 0.9, 1.0), seed=2)
        assert kept == pytest.approx([0.02, 0.04, 0.08], rel=0.02)
    with pytest.raises(ConfigError, match="dense_end"):
        make_compressor("dgc", 10, ratio=0.1, dense_end_fraction=0.2, dense_end_factor=0.5)
    with pytest.raises(FieldError, match="dense_end_fraction"):  # a fraction of no budget
        RunConfig(compressor="gdtopk", compressor_opts={"dense_end_fraction": 0.2}).validate()
    RunConfig(compressor="gdtopk", compressor_opts={"dense_end_fraction": 0.2},
              epochs=1).validate()


def test_the_group_server_adds_a_pushed_update_as_it_is() -> None:
    """Optimizer on the workers: no momentum or decay on the server, lr 1 shared among the
    group's live workers (ssp, 2 workers: half of each update); WEIGHTS say the lr factor of
    the next update and the run's progress."""
    run = RunConfig(mode="ssp", workers=2, optimizer_at="worker", lr=0.1, lr_warmup=1.0,
                    dataset="synthetic", train_size=1000, max_steps=10, batch_size=50)
    w0 = np.ones(6, np.float32)
    core = GroupCore(0, run, w0, members=[0, 1])
    assert core.opt.momentum == 0 and core.opt.weight_decay == 0
    first = core.weights_message(0, [])
    assert first.lr_factor == pytest.approx(50 / 1000) and first.progress == 0.0
    update = SparseVector(np.array([1, 4], np.uint32), np.array([0.5, -2.0], np.float32), 6)
    enc, codec, bufs = encode_vector(update)
    core.push(0, messages.Push(clock=1, samples=50, payload=Payload(enc, codec,
                               tuple(bufs))), now=0.0)
    np.testing.assert_array_equal(core.weights, [1, 0.75, 1, 1, 2, 1])
    after = core.weights_message(1, [])
    assert after.lr_factor == pytest.approx(100 / 1000)  # 50 samples seen, then 50 more
    assert after.progress == pytest.approx(50 / (10 * 2 * 50))


def test_the_config_checks_where_the_optimizer_is() -> None:
    RunConfig(optimizer_at="worker", grad_clip=1.0, momentum_masking=True).validate()
    for bad in ({"optimizer_at": "client"}, {"grad_clip": 1.0}, {"momentum_masking": True},
                {"optimizer_at": "worker", "grad_clip": -1.0},
                {"compressor": "dgc", "compressor_opts": {"warmup_fraction": 0.05}}):
        with pytest.raises(FieldError):
            RunConfig(**bad).validate()  # type: ignore[arg-type]
    RunConfig(compressor="dgc", compressor_opts={"warmup_fraction": 0.05}, epochs=1).validate()
    assert RunConfig().optimizer_at == "server"  # the default: as before


def test_the_flags_fill_the_config() -> None:
    args = build_parser().parse_args([
        "local", "--optimizer-at", "worker", "--grad-clip", "5", "--momentum-masking", "on",
        "--compressor", "dgc", "--copt", "warmup_fraction=0.05", "--epochs", "1"])
    run = run_config_from_args(args)
    assert (run.optimizer_at, run.grad_clip, run.momentum_masking) == ("worker", 5.0, True)
    assert run.compressor_opts == {"warmup_fraction": 0.05}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["local", "--momentum-masking", "maybe"])


def test_the_simulator_runs_dgc_as_published_on_workers(tmp_path: Path) -> None:
    """GSSP on the synthetic objective with the optimizer on the workers and every DGC piece:
    it trains, and the workers' uploads are sparse (after the warm-up)."""
    run = RunConfig(workers=4, mode="gssp", groups=2, compressor="dgc", ratio=0.02, lr=0.01,
                    lr_warmup=0, dataset="synthetic", epochs=100, base_step_s=0.04,
                    optimizer_at="worker", momentum_masking=True, grad_clip=100.0,
                    compressor_opts={"warmup_fraction": 0.001})
    simulate(SimConfig(run=run, slowdowns=[1, 1, 2, 2], dim=2000, max_pushes=800,
                       out_dir=str(tmp_path), name="dgc"))
    evals = read_jsonl(tmp_path / "dgc" / "eval.jsonl")
    assert evals[-1]["loss"] < evals[0]["loss"] / 10  # measured: 0.277 -> 0.003
    recs = read_jsonl(tmp_path / "dgc" / "worker-0.jsonl")
    assert recs[0]["kept_fraction"] > 0.2 and recs[-1]["kept_fraction"] < 0.03
