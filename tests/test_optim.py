"""Tests of minips.core.optim: the numpy SGD matches torch.optim.SGD step for step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from minips.core.optim import SGD
from minips.errors import ConfigError


@dataclass
class Sparse:
    indices: np.ndarray
    values: np.ndarray
    size: int


def _grads(n, steps, seed, sparse_every=0):
    """Random gradients; every ``sparse_every``-th one is sparse (dense zeros elsewhere)."""
    rng = np.random.default_rng(seed)
    for i in range(steps):
        if sparse_every and i % sparse_every == 0:
            idx = np.sort(rng.choice(n, size=n // 10, replace=False)).astype(np.uint32)
            vals = rng.standard_normal(idx.size).astype(np.float32)
            dense = np.zeros(n, np.float32)
            dense[idx] = vals
            yield Sparse(idx, vals, n), dense
        else:
            g = rng.standard_normal(n).astype(np.float32)
            yield g, g


def _torch_run(w0, dense_grads, **opts):
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = torch.optim.SGD([p], **opts)
    for g in dense_grads:
        p.grad = torch.from_numpy(g.copy())
        opt.step()
    return p.detach().numpy()


@pytest.mark.parametrize(
    "opts",
    [
        dict(lr=0.05, momentum=0.9, weight_decay=5e-4),
        dict(lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True),
        dict(lr=0.1, momentum=0.0, weight_decay=1e-2),
        dict(lr=0.01, momentum=0.5, weight_decay=0.0),
    ],
)
@pytest.mark.parametrize("sparse_every", [0, 2])
def test_matches_torch_sgd(opts, sparse_every):
    n = 1000
    w0 = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    pairs = list(_grads(n, 40, seed=2, sparse_every=sparse_every))
    ours = w0.copy()
    opt = SGD(n, **opts)
    for g, _ in pairs:
        opt.step(ours, g)
    ref = _torch_run(w0, [d for _, d in pairs], **opts)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)
    assert opt.steps == 40 and ours.dtype == np.float32


def test_repeated_sparse_indices_are_summed():
    opt = SGD(4, lr=1.0, momentum=0.0, weight_decay=0.0)
    w = np.zeros(4, np.float32)
    opt.step(w, Sparse(np.array([1, 1, 3]), np.array([1.0, 2.0, 5.0], np.float32), 4))
    assert w.tolist() == [0.0, -3.0, 0.0, -5.0]


def test_state_dict_round_trip_continues_identically():
    n = 300
    pairs = list(_grads(n, 20, seed=3, sparse_every=3))
    w_a = np.ones(n, np.float32)
    a = SGD(n, lr=0.05, nesterov=True)
    for g, _ in pairs[:10]:
        a.step(w_a, g)
    state = a.state_dict()
    b = SGD(n, lr=999.0, momentum=0.1)
    b.load_state_dict(state)
    state["velocity"][:] = 123.0  # the saved copy is independent of the live optimizer
    w_b = w_a.copy()
    for g, _ in pairs[10:]:
        a.step(w_a, g)
        b.step(w_b, g)
    np.testing.assert_array_equal(w_a, w_b)
    assert b.steps == a.steps == 20 and b.nesterov and b.lr == 0.05


def test_lr_can_change_between_steps():
    opt = SGD(2, lr=1.0, momentum=0.0, weight_decay=0.0)
    w = np.zeros(2, np.float32)
    opt.step(w, np.ones(2, np.float32))
    opt.lr = 0.5
    opt.step(w, np.ones(2, np.float32))
    assert w.tolist() == [-1.5, -1.5]


def test_errors():
    opt = SGD(3, lr=0.1)
    with pytest.raises(ConfigError):
        opt.step(np.zeros(4, np.float32), np.zeros(4, np.float32))
    with pytest.raises(ConfigError):
        opt.step(np.zeros(3, np.float64), np.zeros(3, np.float32))
    with pytest.raises(ConfigError):
        opt.step(np.zeros(3, np.float32), np.zeros(2, np.float32))
    with pytest.raises(ConfigError):
        opt.step(np.zeros(3, np.float32), Sparse(np.array([3]), np.ones(1, np.float32), 3))
    with pytest.raises(ConfigError):
        opt.step(np.zeros(3, np.float32), Sparse(np.array([0]), np.ones(1, np.float32), 5))
    with pytest.raises(ConfigError):
        SGD(3, lr=-1.0)
    with pytest.raises(ConfigError):
        SGD(3, lr=0.1, momentum=0.0, nesterov=True)
    with pytest.raises(ConfigError):
        SGD(3, lr=0.1).load_state_dict(SGD(4, lr=0.1).state_dict())


def test_warmup_factor_ramps_linearly_then_stays_at_one() -> None:
    from minips.core.optim import warmup_factor

    assert warmup_factor(0, 100.0) == 0.0
    assert warmup_factor(25, 100.0) == 0.25
    assert warmup_factor(100, 100.0) == 1.0
    assert warmup_factor(500, 100.0) == 1.0
    assert warmup_factor(3, 0.0) == 1.0  # no warm-up


def test_decay_factor_constant_and_cosine_by_hand() -> None:
    from minips.core.optim import decay_factor

    assert decay_factor("constant", 0.7) == 1.0
    assert decay_factor("cosine", 0.0) == 1.0
    assert decay_factor("cosine", 0.25) == pytest.approx(0.5 * (1 + 2**-0.5))  # cos(pi/4)
    assert decay_factor("cosine", 0.5) == pytest.approx(0.5)
    assert decay_factor("cosine", 1.0) == 0.0
    assert decay_factor("cosine", 1.5) == 0.0  # overrun past the budget: stays at 0
    assert decay_factor("cosine", -0.1) == 1.0
    with pytest.raises(ConfigError, match="schedule"):
        decay_factor("step", 0.5)


def test_lr_factor_warms_up_with_the_update_and_decays_before_it() -> None:
    """Synchronous SGD of 4 steps of 512 samples, warm-up over 1024, cosine over 2048: the warm-up
    counts each step's own samples, the decay is read before them, so no step is wasted."""
    from minips.core.optim import lr_factor

    factors = [lr_factor("cosine", seen=t * 512, step=512, ramp=1024, budget=2048)
               for t in range(4)]
    expected = [0.5 * 1.0, 1.0 * 0.5 * (1 + 2**-0.5), 1.0 * 0.5, 1.0 * 0.5 * (1 - 2**-0.5)]
    assert factors == pytest.approx(expected)
    assert lr_factor("constant", seen=10, step=5, ramp=0, budget=0) == 1.0  # no budget needed
