"""LossComp, loss-voted compression: our reconstruction (the method's own text is not public).

The worker calls ``observe_loss(loss_t)`` with the loss of step t (computed on weights that
already contain the updates sent at steps < t), then ``compress(grad_t)``. State per worker:
``votes`` v and ``counts`` c (n,) float32, the index sets sent at the last ``credit_lag`` steps,
moving averages of the loss, and a byte budget. The exact rules, with the defaults:

1. Loss statistics. ``fast = EMA(loss, beta_fast=0.9)``, ``slow = EMA(loss, beta_slow=0.98)``
   (both start at the first loss). The smoothed loss change of step t is ``d = fast - loss``
   (> 0: this loss came in below the recent average); ``drift`` and ``noise^2`` are the running
   mean of d and of ``(d - drift)^2`` (a plain mean over the first 50 steps, then an EMA with
   rate 0.02), so they follow the current trend.
2. Credit. ``z = clip((d - drift) / noise, -3, 3)``: how much better than usual under the
   current trend this step went, in noise units (a drop is a positive vote). Centring on the drift
   matters: while the loss falls every step looks good, and crediting that would only reward the
   coordinates sent most often. Every coordinate sent in the last ``credit_lag=1`` steps gets
   ``v[i] += z`` and ``c[i] += 1``.
3. Decay. Before crediting, all votes and counts are multiplied by ``exp(-1 / W)``,
   W = ``vote_window=1`` epoch in steps (steps per epoch measured from ``set_epoch``;
   ``steps_per_epoch=200`` until then). Done lazily with one global scale, so a step costs
   O(k), not O(n).
4. Selection. Each coordinate's record as a t-statistic, ``t = v / sqrt(c)`` with ``c`` its
   (equally decayed) number of credits, so pure-noise votes give t ~ N(0, 1). ``score = |acc| *
   (1 + vote_weight * clip(soft(t, vote_dead) / vote_scale, -1, 1))``, ``soft(t, d) = sign(t) *
   max(|t| - d, 0)``, ``vote_dead=2``, ``vote_scale=2``; the exact top-k of the score is sent
   (values from ``acc`` = residual + gradient, error feedback as everywhere). Only a significant
   record moves a score, by at most ``vote_weight``. **``vote_weight`` defaults to 0 (votes are
   kept but do not steer):** on LeNet-5 / Fashion-MNIST every setting we tried (0.3, the same
   with the sign reversed, 0.1 with an earlier normalisation) lost 0.5-1 point against 0
   (docs/compression.md), so the votes carry no usable signal there.
5. Kept fraction. ``trend = (slow - fast) / noise`` is > 0 while the loss falls, about 0 when it
   stalls and < 0 when it rises. ``ratio_t = target * 2 ** -clip(trend / trend_ref, -1, 1) *
   2 ** clip(-debt / budget_horizon, -1, 1)``, clamped to ``target * [min_mult=0.25,
   max_mult=4]``, with ``trend_ref=0.5``, ``budget_horizon=50`` steps and ``debt`` = sum over
   past steps of ``(kept_t - target) / target``. The first factor halves the fraction while the
   loss falls steadily, is 1 on a plateau and doubles it while the loss rises; the
   second is an integral controller that pays back over- or under-spending, so the average kept
   fraction tracks ``ratio`` (the target), which makes comparisons at matched bytes fair.

Without any ``observe_loss`` call LossComp is exactly Top-K with error feedback at ``ratio``;
with the default ``vote_weight=0`` it is Top-K + error feedback with the loss-trend ratio.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

from minips.compress.topk import TopKCompressor
from minips.errors import ConfigError
from minips.sparse import SparseVector

__all__ = ["LossCompCompressor"]

RENORM_BELOW = 1e-12  # fold the lazy decay scale into the votes before float32 loses range
STATS_RATE = 0.02  # EMA rate of the drift and noise of the loss change (~50 steps)
Z_CLIP = 3.0  # a single step's vote is at most this many noise units
TINY = 1e-30  # keeps 0 / sqrt(0) at 0 for never-credited coordinates


class LossCompCompressor(TopKCompressor):
    """``losscomp``: top-k on magnitude x vote factor, with a loss-trend kept fraction."""

    name = "losscomp"

    def __init__(self, size: int, *, ratio: float = 0.01, vote_weight: float = 0.0,
                 vote_dead: float = 2.0, vote_scale: float = 2.0, vote_window: float = 1.0,
                 steps_per_epoch: int = 200, credit_lag: int = 1, beta_fast: float = 0.9,
                 beta_slow: float = 0.98,
                 trend_ref: float = 0.5, budget_horizon: float = 50.0, min_mult: float = 0.25,
                 max_mult: float = 4.0, **kw: Any) -> None:
        super().__init__(size, ratio=ratio, **kw)
        if not (0.0 <= vote_weight < 1.0 and vote_scale > 0 and vote_dead >= 0 and vote_window > 0
                and credit_lag >= 1 and 0 < min_mult <= 1.0 <= max_mult):
            raise ConfigError("losscomp: bad vote or ratio parameters")
        self.p = dict(vote_weight=vote_weight, vote_dead=vote_dead, vote_scale=vote_scale,
                      vote_window=vote_window, beta_fast=beta_fast, beta_slow=beta_slow,
                      trend_ref=trend_ref, budget_horizon=budget_horizon, min_mult=min_mult,
                      max_mult=max_mult)
        self.default_spe = steps_per_epoch
        self.votes = np.zeros(size, np.float32)  # (n,) true votes = votes * vote_gain
        self.counts = np.zeros(size, np.float32)  # (n,) credits received, same lazy decay
        self.vote_gain = 1.0  # lazy decay: one scalar instead of an O(n) multiply per step
        self.sent: deque[np.ndarray] = deque(maxlen=credit_lag)  # recent index sets, int64
        self.fast = self.slow = self.drift = self.noise2 = math.nan
        self.steps = 0  # observe_loss calls
        self.debt = 0.0  # sum of (kept - target) / target over past compress calls
        scratch = size if vote_weight > 0.0 else 0  # only steering votes need them
        self._score = np.empty(scratch, np.float32)  # (n,) scratch for |acc| * vote factor
        self._factor = np.empty(scratch, np.float32)  # (n,) scratch for the vote factor

    # ------------------------------------------------------------------ loss -> votes

    def observe_loss(self, loss: float) -> None:
        loss = float(loss)
        if not math.isfinite(loss):
            return  # a NaN loss says nothing about which coordinates helped
        if math.isnan(self.fast):
            self.fast = self.slow = loss
            self.drift = self.noise2 = 0.0
            return
        z = self._update_stats(loss)
        self._decay_votes()
        for idx in self.sent:
            self.votes[idx] += np.float32(z / self.vote_gain)
            self.counts[idx] += np.float32(1.0 / self.vote_gain)
        self.steps += 1

    def _update_stats(self, loss: float) -> float:
        """Update the loss averages; return this step's vote z (clipped noise units)."""
        p = self.p
        d = self.fast - loss  # > 0: this loss came in below the smoothed loss
        dev = d - self.drift  # ... by more than is usual under the current trend
        rate = max(STATS_RATE, 1.0 / (self.steps + 1))  # running mean first, then an EMA
        self.drift += rate * dev
        self.noise2 += rate * (dev * dev - self.noise2)
        self.fast += (1.0 - p["beta_fast"]) * (loss - self.fast)
        self.slow += (1.0 - p["beta_slow"]) * (loss - self.slow)
        return max(-Z_CLIP, min(Z_CLIP, dev / (math.sqrt(self.noise2) + 1e-12)))

    def _decay_votes(self) -> None:
        spe = self.steps / self.epoch if self.epoch >= 0.05 else self.default_spe
        self.vote_gain *= math.exp(-1.0 / max(1.0, self.p["vote_window"] * spe))
        if self.vote_gain < RENORM_BELOW:
            self.votes *= np.float32(self.vote_gain)
            self.counts *= np.float32(self.vote_gain)
            self.vote_gain = 1.0

    def vote_values(self) -> np.ndarray:
        """(n,) float32 current (decayed) votes; a copy, for inspection and tests."""
        return self.votes * np.float32(self.vote_gain)

    # ------------------------------------------------------------------ ratio

    def trend(self) -> float:
        """(slow - fast) / noise: > 0 while the loss falls, ~0 on a plateau, < 0 when it rises."""
        if math.isnan(self.fast) or self.noise2 <= 0.0:
            return 0.0
        return (self.slow - self.fast) / math.sqrt(self.noise2)

    def current_ratio(self) -> float:
        p = self.p
        t = max(-1.0, min(1.0, self.trend() / p["trend_ref"]))
        b = max(-1.0, min(1.0, -self.debt / p["budget_horizon"]))
        mult = min(p["max_mult"], max(p["min_mult"], 2.0 ** (b - t)))
        return min(1.0, self.ratio * mult)

    # ------------------------------------------------------------------ selection

    def vote_stats(self, out: np.ndarray | None = None) -> np.ndarray:
        """(n,) float32 t-statistic of each coordinate's record: votes / sqrt(credits)."""
        t = np.add(self.counts, np.float32(TINY), out=out)
        np.sqrt(t, out=t)
        np.divide(self.votes, t, out=t)
        t *= np.float32(math.sqrt(self.vote_gain))  # v g / sqrt(c g)
        return t

    def _select(self, acc: np.ndarray, k: int) -> np.ndarray:
        if self.steps and self.p["vote_weight"] > 0.0:
            factor = self._vote_factor()
            score = np.abs(acc, out=self._score)  # (n,) float32
            score *= factor
        else:
            score = acc  # the selector ranks by |acc|
        return self.selector.select(score, k)

    @property
    def device_ready(self) -> bool:
        return self.p["vote_weight"] == 0.0  # steering votes are (n,) numpy arrays on the host

    def _sent(self, packet: SparseVector) -> None:
        """Book the indices just sent: the next vote credits them, the byte budget counts them."""
        self.sent.append(packet.indices.astype(np.int64))
        self.debt += (packet.nnz / self.size - self.ratio) / self.ratio

    def _vote_factor(self) -> np.ndarray:
        """(n,) float32: 1 + vote_weight * clip(soft(t, vote_dead) / vote_scale, -1, 1)."""
        dead, scale = self.p["vote_dead"], self.p["vote_scale"]
        f = self.vote_stats(out=self._factor)
        np.clip(f, -(dead + scale), dead + scale, out=f)
        f -= np.clip(f, -dead, dead, out=self._score)  # soft threshold: |t| <= dead -> 0
        f *= np.float32(self.p["vote_weight"] / scale)
        f += np.float32(1.0)
        return f
