"""Tests for the compressors of minips.compress: every compressor on tiny hand-computed
vectors, the error-feedback invariant, known statistics, the warm-up and GDTopK ratio policy, and
LossComp's votes and kept fraction moving the documented way."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from minips.compress.losscomp import LossCompCompressor
from minips.compress.ratios import gdtopk_ratios
from minips.compress.registry import COMPRESSORS, make_compressor
from minips.compress.topk import warmup_ratio
from minips.errors import ConfigError, LocalProtocolError
from minips.sparse import SparseVector, add_into, decode_vector, encode_vector
from minips.wire.fields import Payload

F32 = np.float32


def vec(*xs: float) -> np.ndarray:
    return np.array(xs, F32)


# ---------------------------------------------------------------------------- hand-computed


def test_none_sends_everything_and_keeps_nothing() -> None:
    c = make_compressor("none", 3, ratio=0.1)
    g = vec(1, -2, 3)
    out = c.compress(g)
    assert isinstance(out, np.ndarray) and out.tolist() == [1, -2, 3] and out is not g
    assert c.residual is not None and not c.residual.any() and c.kept_fraction == 1.0


def test_dense_compressors_ignore_any_ratio() -> None:
    for name in ("none", "fp16"):
        c = make_compressor(name, 3, ratio=0.0)
        c.set_ratio(7.0)  # whatever an ASSIGN carries
        assert c.ratio == 1.0 and np.asarray(c.compress(vec(1, 2, 3))).size == 3


def test_fp16_keeps_the_rounding_error() -> None:
    c = make_compressor("fp16", 2, ratio=1.0)
    out = c.compress(vec(1 / 3, 1e5))
    assert isinstance(out, np.ndarray) and out.dtype == np.float16
    assert out[1] == 65504  # clipped to the largest float16
    assert c.residual is not None
    assert c.residual[0] == F32(1 / 3) - F32(np.float16(1 / 3))
    assert c.residual[1] == 1e5 - 65504


@pytest.mark.parametrize("name", ["topk", "dgc", "gdtopk", "losscomp"])
def test_magnitude_compressors_hand_computed(name: str) -> None:
    opts: dict[str, Any] = {"warmup_epochs": 0} if name == "gdtopk" else {}
    c = make_compressor(name, 4, ratio=0.5, **opts)
    out = c.compress(vec(0.1, -3, 2, 0.5))
    assert isinstance(out, SparseVector)
    assert out.indices.tolist() == [1, 2] and out.values.tolist() == [-3, 2]
    assert c.residual is not None and c.residual.tolist() == [F32(0.1), 0, 0, 0.5]
    out = c.compress(vec(1, 0, 0, 0))  # the residual is added back before selecting
    assert isinstance(out, SparseVector)
    assert out.indices.tolist() == [0, 3] and out.values.tolist() == [F32(1.1), 0.5]
    assert c.kept_fraction == 0.5


def test_randomk_hand_checked() -> None:
    c = make_compressor("randomk", 10, ratio=0.3, seed=5)
    g = np.arange(10, dtype=F32)
    out = c.compress(g)
    assert isinstance(out, SparseVector) and out.nnz == 3
    assert np.all(np.diff(out.indices.astype(int)) > 0)
    assert np.array_equal(out.values, g[out.indices])
    again = make_compressor("randomk", 10, ratio=0.3, seed=5).compress(g)
    assert isinstance(again, SparseVector) and np.array_equal(again.indices, out.indices)
    unbiased = make_compressor("randomk", 10, ratio=0.3, seed=5, error_feedback=False,
                               unbiased=True).compress(g)
    assert isinstance(unbiased, SparseVector)
    np.testing.assert_allclose(unbiased.values, g[out.indices] * 10 / 3, rtol=1e-6)


def test_without_error_feedback_the_input_is_untouched() -> None:
    c = make_compressor("topk", 4, ratio=0.25, error_feedback=False)
    g = vec(1, 2, 3, 4)
    c.compress(g)
    out = c.compress(g)
    assert isinstance(out, SparseVector) and out.indices.tolist() == [3]
    assert g.tolist() == [1, 2, 3, 4] and c.residual is None


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        make_compressor("zip", 10, ratio=0.1)
    with pytest.raises(ConfigError):
        make_compressor("topk", 10, ratio=0.0)
    with pytest.raises(ConfigError):
        make_compressor("topk", 10, ratio=0.1, no_such_option=1)
    with pytest.raises(ConfigError):
        make_compressor("randomk", 10, ratio=0.1, unbiased=True)
    with pytest.raises(LocalProtocolError):
        make_compressor("topk", 10, ratio=0.1).compress(np.ones(9, F32))


# ---------------------------------------------------------------------------- error feedback


SPARSE_NAMES = sorted(set(COMPRESSORS) - {"none", "fp16"})  # value_dtype is their option


@pytest.mark.parametrize(
    ("name", "value_dtype"),
    [(n, "f32") for n in sorted(COMPRESSORS)] + [(n, "f16") for n in SPARSE_NAMES],
)
def test_error_feedback_conserves_the_gradient_sum(name: str, value_dtype: str) -> None:
    opts: dict[str, Any] = {} if value_dtype == "f32" else {"value_dtype": "f16"}
    n, rng = 5000, np.random.default_rng(11)
    c = make_compressor(name, n, ratio=0.01, seed=2, **opts)
    grads = np.zeros(n, np.float64)
    sent = np.zeros(n, np.float64)
    for step in range(60):
        g = (rng.laplace(size=n) * 0.1).astype(F32)
        grads += g
        c.set_epoch(step / 20)
        c.observe_loss(2.0 * math.exp(-step / 30) + 0.05 * rng.normal())
        enc, codec, bufs = encode_vector(c.compress(g), value_dtype=value_dtype)
        part = np.zeros(n, F32)
        add_into(part, decode_vector(Payload(enc, codec, bufs), n))  # what the server receives
        sent += part
    assert c.residual is not None
    np.testing.assert_allclose(sent + c.residual, grads, atol=2e-4)


# ---------------------------------------------------------------------------- known statistics


def test_randomk_keeps_density_of_the_energy() -> None:
    n, density = 200_000, 0.05
    g = np.random.default_rng(4).laplace(size=n).astype(F32)
    shares = []
    for seed in range(5):
        c = make_compressor("randomk", n, ratio=density, seed=seed)
        out = c.compress(g)
        assert isinstance(out, SparseVector)
        energy = np.square(out.values, dtype=np.float64).sum()
        shares.append(energy / np.square(g, dtype=np.float64).sum())
    assert np.mean(shares) == pytest.approx(density, rel=0.05)


def test_topk_drops_the_known_energy_share() -> None:
    n, p = 1_000_000, 0.01
    g = np.random.default_rng(5).laplace(size=n).astype(F32)
    out = make_compressor("topk", n, ratio=p).compress(g)
    assert isinstance(out, SparseVector) and out.nnz == 10_000
    t = -math.log(p)  # see test_sparse: the top 1% of a Laplace holds p (t^2 + 2t + 2) / 2
    kept = np.square(out.values, dtype=np.float64).sum() / np.square(g, dtype=np.float64).sum()
    assert 1 - kept == pytest.approx(1 - p * (t * t + 2 * t + 2) / 2, abs=0.005)


# ---------------------------------------------------------------------------- schedules


def test_warmup_ratio_follows_dgc() -> None:
    got = [warmup_ratio(e, 0.001) for e in (0, 0.5, 1, 2, 3, 3.99, 4, 10)]
    assert got == [0.25, 0.25, 0.0625, 0.015625, 0.00390625, 0.00390625, 0.001, 0.001]
    assert warmup_ratio(2, 0.02) == 0.02  # never below the final ratio
    assert warmup_ratio(0, 0.5) == 0.5


def test_gdtopk_compressor_warms_up_then_uses_the_server_ratio() -> None:
    n = 10_000
    c = make_compressor("gdtopk", n, ratio=0.004)
    kept = []
    for epoch in (0, 1, 2, 3, 4):
        c.set_epoch(epoch)
        c.compress(np.ones(n, F32))
        kept.append(c.kept_fraction)
    c.set_ratio(0.015)
    c.compress(np.ones(n, F32))
    kept.append(c.kept_fraction)
    assert kept == pytest.approx([0.25, 0.0625, 0.0156, 0.004, 0.004, 0.015], abs=6e-4)


def test_gdtopk_ratios_direction_and_clamping() -> None:
    # slower-more, the released code's direction: the fastest group gets the floor.
    assert gdtopk_ratios([1.0, 2.0, 4.0]) == pytest.approx([0.004, 0.008, 0.016])
    # The authors' published floors 0.4% / 0.81% / 1.5% come from times 1 : 2.025 : 3.75.
    assert gdtopk_ratios([2.0, 4.05, 7.5]) == pytest.approx([0.004, 0.0081, 0.015])
    assert gdtopk_ratios([4.0, 1.0, 2.0], direction="slower-less") == pytest.approx(
        [0.004, 0.016, 0.008])
    assert gdtopk_ratios([1.0, 100.0]) == [0.004, 0.05]  # clamped to hi
    assert gdtopk_ratios([1.0, 3.0], floor=0.0001, alpha=0.5, lo=0.001) == pytest.approx(
        [0.001, 0.001])  # clamped to lo
    assert gdtopk_ratios([1.0, 9.0], alpha=0.5) == pytest.approx([0.004, 0.012])
    assert gdtopk_ratios([3.0, 5.0], alpha=0.0) == [0.004, 0.004]
    assert gdtopk_ratios([]) == []
    for bad in ({"direction": "up"}, {"lo": 0.1, "hi": 0.01}):
        with pytest.raises(ConfigError):
            gdtopk_ratios([1.0], **bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        gdtopk_ratios([1.0, 0.0])


# ---------------------------------------------------------------------------- LossComp


def test_losscomp_votes_follow_the_loss_and_steer_selection() -> None:
    n = 40
    a, b = np.arange(20, 30), np.arange(0, 10)  # top-k ties would pick b (lower indices)
    c = make_compressor("losscomp", n, ratio=0.25, vote_weight=0.5)
    assert isinstance(c, LossCompCompressor)
    big_a, big_b = np.zeros(n, F32), np.zeros(n, F32)
    big_a[a], big_b[b] = 5.0, 5.0
    loss = 2.0
    c.observe_loss(loss)
    for _ in range(60):  # long enough for the loss statistics to settle
        c.compress(big_a)  # send A ...
        loss -= 0.1
        c.observe_loss(loss)  # ... and the loss drops: A gets a positive vote
        c.compress(big_b)  # send B ...
        loss += 0.05
        c.observe_loss(loss)  # ... and the loss rises: B gets a negative vote
    votes = c.vote_values()
    assert np.all(votes[a] > 0) and np.all(votes[b] < 0)
    assert not votes[np.setdiff1d(np.arange(n), np.concatenate([a, b]))].any()
    tie = np.zeros(n, F32)
    tie[a], tie[b] = 1.0, 1.0
    assert c.residual is not None
    c.residual[:] = 0.0
    out = c.compress(tie)  # same magnitude: the good record wins (k is < 10: loss falling)
    assert isinstance(out, SparseVector) and out.nnz > 0
    assert set(out.indices.tolist()) <= set(a.tolist())


def test_losscomp_vote_factor_hand_computed() -> None:
    c = make_compressor("losscomp", 5, ratio=0.2, vote_weight=0.5)  # vote_dead 2, vote_scale 2
    assert isinstance(c, LossCompCompressor)
    c.votes[:] = [0, 1, 3, 8, -8]
    c.counts[:] = [0, 1, 1, 1, 1]  # t = votes: |t| <= 2 is noise, 2..4 ramps, >= 4 is full
    assert c.vote_stats().tolist() == [0, 1, 3, 8, -8]
    assert c._vote_factor().tolist() == [1, 1, 1.25, 1.5, 0.5]
    c.counts[:] = 4  # the same votes over 4 credits: t halves
    assert c._vote_factor().tolist() == [1, 1, 1, 1.5, 0.5]


def test_losscomp_votes_decay_over_the_window() -> None:
    c = make_compressor("losscomp", 10, ratio=0.1, steps_per_epoch=10, vote_window=1.0)
    assert isinstance(c, LossCompCompressor)
    c.observe_loss(1.0)
    c.compress(vec(0, 0, 0, 1, 0, 0, 0, 0, 0, 0))
    c.observe_loss(0.5)  # credits coordinate 3
    v1 = c.vote_values()[3]
    assert v1 > 0
    c.compress(vec(0, 0, 0, 0, 0, 9, 0, 0, 0, 0))
    c.observe_loss(0.4)  # credits coordinate 5; coordinate 3 only decays
    assert c.vote_values()[3] == pytest.approx(v1 * math.exp(-1 / 10), rel=1e-5)
    c.set_epoch(2.0)  # 2 observed steps in 2 epochs: the window is now 1 step
    c.observe_loss(0.4)
    assert c.vote_values()[3] == pytest.approx(v1 * math.exp(-1 / 10 - 1), rel=1e-5)


def run_losscomp(losses: list[float], n: int = 4000, ratio: float = 0.01) -> list[float]:
    c = make_compressor("losscomp", n, ratio=ratio, seed=1)
    rng = np.random.default_rng(2)
    kept = []
    for loss in losses:
        c.observe_loss(loss)
        c.compress(rng.laplace(size=n).astype(F32))
        kept.append(c.kept_fraction)
    return kept


def test_losscomp_ratio_shrinks_while_falling_and_grows_on_plateau_or_rise() -> None:
    rng = np.random.default_rng(3)
    fall = [2.0 * math.exp(-t / 100) + 0.02 * rng.normal() for t in range(200)]
    flat = [fall[-1] + 0.02 * rng.normal() for _ in range(400)]
    kept = run_losscomp(fall + flat)
    # Falling steadily: below the target until the budget controller (horizon 50 steps) has
    # saved enough; the plateau that follows: above it, paying back what was saved.
    assert np.mean(kept[:100]) < 0.01 * 0.8
    assert np.mean(kept[325:475]) > 0.01 * 1.1  # (the slow average needs ~100 steps)
    assert min(kept) >= 0.01 * 0.25 and max(kept) <= 0.01 * 4  # always within the bounds
    rise = [1.0 + 0.005 * t + 0.02 * rng.normal() for t in range(200)]
    assert np.mean(run_losscomp(rise)[:100]) > 0.01 * 1.25


def test_losscomp_average_kept_fraction_tracks_the_target() -> None:
    rng = np.random.default_rng(4)
    losses = [2.0 / (1 + t / 50) + 0.1 * rng.normal() for t in range(1500)]
    assert np.mean(run_losscomp(losses)) == pytest.approx(0.01, rel=0.1)


def test_losscomp_without_losses_is_topk() -> None:
    g = np.random.default_rng(6).laplace(size=3000).astype(F32)
    a = make_compressor("losscomp", 3000, ratio=0.02).compress(g)
    b = make_compressor("topk", 3000, ratio=0.02).compress(g)
    assert isinstance(a, SparseVector) and isinstance(b, SparseVector)
    assert np.array_equal(a.indices, b.indices) and np.array_equal(a.values, b.values)
