"""Tests for minips.ml.reference: the SGD formula, the documented batch order, and real training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from minips.errors import ConfigError
from minips.ml import data, models, reference
from minips.ml.data import iterate_batches, shard_indices

FASHION = Path("/usr/share/datasets/fashion-mnist")
needs_fashion = pytest.mark.skipif(not FASHION.is_dir(), reason=f"{FASHION} not installed")


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs with one torch thread (conftest.one_torch_thread)."""


@pytest.fixture(scope="module")
def small() -> data.Dataset:
    x, y = data.make_synthetic_images(256, (1, 32, 32), seed=5)
    return data.Dataset(x, y)


def test_sgd_step_matches_torch_sgd() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal(1000).astype(np.float32)
    v = np.zeros_like(w)
    param = torch.nn.Parameter(torch.from_numpy(w.copy()))
    opt = torch.optim.SGD([param], lr=0.05, momentum=0.9, weight_decay=5e-4)
    for _ in range(10):
        g = rng.standard_normal(1000).astype(np.float32)
        reference.sgd_step(w, v, g, lr=0.05, momentum=0.9, weight_decay=5e-4)
        param.grad = torch.from_numpy(g.copy())
        opt.step()
    np.testing.assert_allclose(w, param.detach().numpy(), rtol=1e-6, atol=1e-7)


def torch_loop(ds: data.Dataset, steps: int, workers: int, lr: float) -> np.ndarray:
    """The same training written independently: torch.optim.SGD, one concatenated batch.

    With equal batch sizes and no batch norm, the mean of the workers' mean-loss gradients is
    the gradient of the mean loss over their batches put together.
    """
    model = models.build_model("lenet5", seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    shards = [shard_indices(len(ds), k, workers, 3) for k in range(workers)]
    per_epoch = min(len(s) // 16 for s in shards)
    for step in range(steps):
        epoch, i = divmod(step, per_epoch)
        batches = [list(iterate_batches(ds, s, 16, 3, epoch))[i] for s in shards]
        x = torch.from_numpy(np.concatenate([b[0] for b in batches]))
        y = torch.from_numpy(np.concatenate([b[1] for b in batches]))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return models.get_flat(model)


@pytest.mark.parametrize("workers", [1, 2])
def test_train_matches_an_independent_torch_loop(small: data.Dataset, workers: int) -> None:
    steps = 20  # more than one epoch of each shard (8 or 16 batches of 16)
    flat, history = reference.train("lenet5", small, lr=0.05, seed=3, steps=steps,
                                    batch_size=16, workers=workers)
    expected = torch_loop(small, steps, workers, lr=0.05)
    np.testing.assert_allclose(flat, expected, rtol=1e-4, atol=1e-5)
    assert history[-1]["step"] == steps


def test_epochs_and_history(small: data.Dataset) -> None:
    flat, history = reference.train("lenet5", small, lr=0.05, seed=0, epochs=2, batch_size=32,
                                    workers=2, test=small)
    assert [h["step"] for h in history] == [4, 8]  # 128 samples per shard -> 4 batches
    assert [h["epoch"] for h in history] == [1.0, 2.0]
    # each epoch's entry evaluates the weights of that moment: the last one, the final weights
    acc, loss = models.evaluate("lenet5", flat, small)
    assert (history[-1]["test_accuracy"], history[-1]["test_loss"]) == (acc, loss)
    first, _ = reference.train("lenet5", small, lr=0.05, seed=0, epochs=1, batch_size=32,
                               workers=2, test=small)
    assert history[0]["test_accuracy"] == models.evaluate("lenet5", first, small)[0]
    assert flat.dtype == np.float32
    with pytest.raises(ConfigError, match="exactly one"):
        reference.train("lenet5", small, lr=0.1, seed=0)
    with pytest.raises(ConfigError, match="exactly one"):
        reference.train("lenet5", small, lr=0.1, seed=0, epochs=1, steps=3)


def test_module_argument_same_as_name(small: data.Dataset) -> None:
    model = models.build_model("lenet5", seed=3)
    a, _ = reference.train(model, small, lr=0.05, seed=3, steps=3, batch_size=16)
    b, _ = reference.train("lenet5", small, lr=0.05, seed=3, steps=3, batch_size=16)
    np.testing.assert_array_equal(a, b)


@needs_fashion
@pytest.mark.timeout(240)
def test_lenet5_one_epoch_on_fashion_mnist() -> None:
    train = data.load_dataset("fashion-mnist", "train", fallback=False)
    test = data.load_dataset("fashion-mnist", "test", fallback=False)
    flat, history = reference.train("lenet5", train, lr=0.02, seed=0, epochs=1)
    acc, loss = models.evaluate("lenet5", flat, test)
    assert acc >= 0.82 and loss < 0.55  # measured: 0.849 / 0.415 after one epoch


@needs_fashion
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lenet5_reaches_88_percent_on_fashion_mnist() -> None:
    train = data.load_dataset("fashion-mnist", "train", fallback=False)
    test = data.load_dataset("fashion-mnist", "test", fallback=False)
    _, history = reference.train("lenet5", train, lr=0.02, seed=0, epochs=5, test=test)
    assert history[-1]["test_accuracy"] >= 0.88  # measured: 0.882 after 3 epochs, 0.886 after 4


@pytest.mark.timeout(120)
def test_script_prints_one_json_object() -> None:
    script = Path(__file__).resolve().parents[1] / "scripts" / "train_reference.py"
    out = subprocess.run(
        [sys.executable, str(script), "--model", "lenet5", "--synthetic", "--steps", "5",
         "--batch-size", "16", "--json"], capture_output=True, text=True, timeout=100, check=True)
    result = json.loads(out.stdout)
    assert result["model"] == "lenet5" and result["synthetic"] is True and result["steps"] == 5
    assert result["wall_s"] > 0
    # the printed accuracy is that of the very training the script describes, run here again
    train = data.load_dataset("fashion-mnist", "train", synthetic=True)
    test = data.load_dataset("fashion-mnist", "test", synthetic=True)
    flat, _ = reference.train("lenet5", train, lr=result["lr"], seed=0, steps=5, batch_size=16)
    acc, loss = models.evaluate("lenet5", flat, test)
    assert (result["test_accuracy"], result["test_loss"]) == (pytest.approx(acc, abs=1e-12),
                                                              pytest.approx(loss, rel=1e-6))
