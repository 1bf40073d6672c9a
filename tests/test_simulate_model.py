"""The reference tests through the simulator: BSP workers whose gradients come from the real
model (sim_model.py) end with the weights of the plain single-process loop
(``reference.train``), as tests/test_worker.py checks for the real runner; and the simulator's
eval.jsonl has the accuracy that ``summarize`` reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_worker import reference_weights, schedule_reference  # the real runner's references

from minips.core.config import RunConfig
from minips.ml import data, models
from minips.record.metrics import summarize
from minips.record.rundir import read_jsonl
from minips.sim.simulate import SimConfig, simulate

FASHION = Path("/usr/share/datasets/fashion-mnist")


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """One torch thread, as a worker (conftest.one_torch_thread)."""


@pytest.fixture(scope="module")
def train_set() -> data.Dataset:
    """Fashion-MNIST as the worker tests use it, or a synthetic stand-in where it is absent."""
    if FASHION.is_dir():
        return data.load_dataset("fashion-mnist", "train", download=False, fallback=False)
    x, y = data.make_synthetic_images(2048, (1, 32, 32), seed=5)
    return data.Dataset(x, y)


def simulated(run: RunConfig, train_set: data.Dataset, tmp_path: Path,
              slowdowns: list[float] | None = None) -> np.ndarray:
    """Final global weights of ``run`` on the simulator with the real model, ``run.max_steps``
    steps per worker (they leave at their cap, as real workers)."""
    test = train_set.subset(np.arange(256))
    s = simulate(SimConfig(run=run, real=True, model_opts={"train": train_set, "test": test},
                           slowdowns=slowdowns or [1.0], out_dir=str(tmp_path), name="ref"))
    assert s["samples"] == run.max_steps * run.workers * run.batch_size
    return np.load(tmp_path / "ref" / "final_weights.npy")


def bsp_run(workers: int, momentum: float, steps: int) -> RunConfig:
    return RunConfig(mode="bsp", compressor="none", workers=workers, momentum=momentum,
                     max_steps=steps, base_step_s=0.01, lr=0.05, lr_warmup=0.0,
                     dataset="synthetic", epochs=0.0)


@pytest.mark.timeout(120)
def test_one_worker_bsp_matches_reference(tmp_path: Path, train_set: data.Dataset) -> None:
    run = bsp_run(1, 0.9, 12)
    got = simulated(run, train_set, tmp_path)
    np.testing.assert_allclose(got, reference_weights(run, train_set, 1), rtol=1e-5, atol=1e-6)
    assert not np.allclose(got, models.get_flat(models.build_model("lenet5", 0)))


@pytest.mark.timeout(120)
def test_two_workers_bsp_match_averaged_reference(tmp_path: Path,
                                                  train_set: data.Dataset) -> None:
    run = bsp_run(2, 0.0, 10)
    got = simulated(run, train_set, tmp_path)
    np.testing.assert_allclose(got, reference_weights(run, train_set, 2), rtol=1e-5, atol=1e-6)
    one = reference_weights(run, train_set, 1)  # and not what a single worker would have done
    assert not np.allclose(got, one, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(180)
def test_eight_workers_bsp_are_synchronous_sgd_with_the_lr_schedule(
        tmp_path: Path, train_set: data.Dataset) -> None:
    """8 workers at 4 speeds, momentum, weight decay, a warm-up and a cosine decay over the
    budget: one SGD step per round on the mean of the 8 gradients, at the round's lr."""
    rounds, workers = 50, 8
    run = RunConfig(mode="bsp", compressor="none", workers=workers, momentum=0.9,
                    weight_decay=5e-4, lr=0.05, lr_warmup=0.3, lr_schedule="cosine",
                    epochs=1.0, train_size=rounds * workers * 64,  # the budget ends with round 50
                    max_steps=rounds, base_step_s=0.001, eval_every_s=0.01)
    got = simulated(run, train_set, tmp_path, slowdowns=[1, 1, 1.5, 1.5, 2, 2, 4, 4])
    ref = schedule_reference(run, train_set)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    evals = read_jsonl(tmp_path / "ref" / "eval.jsonl")
    assert len(evals) > 3 and all(0.0 <= e["accuracy"] <= 1.0 for e in evals)
    assert summarize(tmp_path / "ref")["final_accuracy"] == evals[-1]["accuracy"]
