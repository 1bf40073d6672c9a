"""Tests of minips.grouping: exact 1-D clustering, choice of k, regrouping with hysteresis."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from minips.errors import ConfigError
from minips.grouping import (
    Regrouper,
    assign_groups,
    choose_k,
    cluster_1d,
    group_times,
    nearest_group,
)


def _brute_force_sse(values, k):
    """Least within-cluster squared error of log(values) over every contiguous split."""
    x = np.sort(np.log(values))
    best = math.inf
    for cuts in itertools.combinations(range(1, len(x)), k - 1):
        parts = np.split(x, cuts)
        best = min(best, sum(float(((p - p.mean()) ** 2).sum()) for p in parts))
    return best


def _sse(values, labels):
    x = np.log(values)
    return sum(float(((x[labels == g] - x[labels == g].mean()) ** 2).sum()) for g in set(labels))


def test_obvious_groups_k3():
    speeds = [1, 1, 1, 1, 2, 2, 4, 4]
    assert cluster_1d(speeds, 3).tolist() == [0, 0, 0, 0, 1, 1, 2, 2]
    steps = {10 + i: s for i, s in enumerate([4, 1, 2, 1, 4, 1, 2, 1])}
    assert assign_groups(steps, k=3) == {10: 2, 11: 0, 12: 1, 13: 0, 14: 2, 15: 0, 16: 1, 17: 0}


def test_cluster_1d_is_optimal_against_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(30):
        values = rng.lognormal(0.0, 0.8, size=int(rng.integers(3, 9)))
        for k in (1, 2, 3):
            labels = cluster_1d(values, k)
            assert _sse(values, labels) == pytest.approx(_brute_force_sse(values, k), abs=1e-9)
            # groups are numbered from fastest to slowest
            means = [values[labels == g].mean() for g in range(labels.max() + 1)]
            assert means == sorted(means)


def test_cluster_1d_never_splits_equal_values_and_caps_k():
    assert cluster_1d([3.0, 3.0, 3.0], 3).tolist() == [0, 0, 0]
    assert cluster_1d([1.0, 2.0, 1.0, 2.0], 4).tolist() == [0, 1, 0, 1]
    assert cluster_1d([5.0], 2).tolist() == [0]


def test_choose_k():
    assert choose_k([1, 1, 1.5, 1.5, 2, 2, 4, 4], max_k=4) == 4
    assert choose_k([1, 1, 1, 1, 2, 2, 4, 4], max_k=4) == 3
    assert choose_k([1.0, 1.03, 0.98, 1.1, 1.05, 0.97, 1.01, 1.08], max_k=4) == 1
    assert choose_k([1, 1, 1.5, 1.5, 2, 2, 4, 4], max_k=2) == 2  # capped
    # Evenly spread speeds have no clear gap: use as many groups as allowed.
    assert choose_k(np.geomspace(1, 4, 16), max_k=4) == 4
    # Groups of 4 over 16 workers, as in the paper's set-up.
    assert choose_k([1] * 4 + [1.6] * 4 + [2.5] * 4 + [4] * 4, max_k=4) == 4


def test_assign_groups_gssp_profile_forms_four_pairs():
    steps = dict(enumerate([1, 1, 1.5, 1.5, 2, 2, 4, 4]))
    groups = assign_groups(steps, k=None, max_k=4)
    assert groups == {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2, 6: 3, 7: 3}
    assert assign_groups({}, None) == {}


def test_bad_inputs():
    with pytest.raises(ConfigError):
        cluster_1d([1.0, 0.0], 2)
    with pytest.raises(ConfigError):
        cluster_1d([1.0, float("nan")], 1)
    with pytest.raises(ConfigError):
        cluster_1d([1.0], 0)
    with pytest.raises(ConfigError):
        nearest_group(1.0, {})


def test_nearest_group_and_group_times():
    gt = group_times({0: 1.0, 1: 4.0, 2: 2.0, 3: 2.0}, {0: 0, 1: 0, 2: 1, 3: 1})
    assert gt == pytest.approx({0: 2.0, 1: 2.0})
    groups = {0: 1.0, 1: 2.0, 2: 4.0}
    assert nearest_group(1.3, groups) == 0
    assert nearest_group(3.5, groups) == 2
    assert nearest_group(math.sqrt(2), groups) == 0  # exactly between in log: the faster one


def _noisy(rng, base, sigma):
    return {w: t * float(rng.lognormal(0.0, sigma)) for w, t in base.items()}


@pytest.mark.parametrize("k", [None, 3])
def test_regrouper_does_not_flap_under_noise(k):
    rng = np.random.default_rng(1234)
    base = dict(enumerate([1, 1, 1, 1, 2, 2, 4, 4]))
    r = Regrouper(k=k)
    first = r.update(_noisy(rng, base, 0.02))  # calibration: the mean of a few steps
    assert first == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 2, 7: 2}
    changes = [r.update(_noisy(rng, base, 0.1)) for _ in range(500)]
    assert changes.count(None) == 500


def test_regrouper_does_not_flap_at_the_tolerance_boundary():
    # Speeds 1.25x apart sit right on choose_k's tolerance: noise alone would flip k between
    # 1 and 2 at every update; the hysteresis keeps whatever was chosen first.
    rng = np.random.default_rng(7)
    base = dict(enumerate([1, 1, 1, 1.25, 1.25, 1.25]))
    r = Regrouper()
    r.update(_noisy(rng, base, 0.05))
    flips = sum(
        choose_k(list(_noisy(rng, base, 0.05).values())) != choose_k(list(base.values()))
        for _ in range(200)
    )
    assert flips > 20  # the raw rule does flap here
    assert all(r.update(_noisy(rng, base, 0.05)) is None for _ in range(500))


def test_a_lasting_4x_change_regroups_on_its_second_look_without_the_patience():
    rng = np.random.default_rng(5)
    base = dict(enumerate([1, 1, 1, 1, 2, 2, 4, 4]))
    r = Regrouper(k=3)
    r.update(base)
    base[0] = 4.0  # worker 0's machine becomes busy for good
    results = [r.update(_noisy(rng, base, 0.03)) for _ in range(30)]
    changed = [i for i, a in enumerate(results) if a is not None]
    assert changed == [1]  # on its 2nd look, once
    assert results[1] == {0: 2, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 2, 7: 2}


def test_a_change_every_worker_makes_alike_moves_nobody():
    # iterations on a machine whose load rose: every worker waits ~0.45 s more on its server,
    # so the change-point test fires for all of them, but each stays nearest its own group
    r = Regrouper(k=2)
    first = r.update({0: 0.06, 1: 0.07, 2: 0.12, 3: 0.12})
    assert first is not None and first[0] == first[1] != first[2] == first[3]
    # a split of these alone would put worker 2 with worker 0 and 1 with 3: within 10%, noise
    looks = [{0: 0.50, 1: 0.56, 2: 0.54, 3: 0.57}] * 20
    assert [r.update(t) for t in looks] == [None] * len(looks)
    assert r.assignment == first


def test_a_2x_change_fires_on_its_fifth_look_and_a_small_one_keeps_the_patience():
    for factor, look in ((2.0, 4), (1.6, 15)):
        base = dict(enumerate([1, 1, 1, 2, 2]))
        r = Regrouper(k=2)
        r.update(base)
        base[0] = factor  # 2x: as slow as the slow group; 1.6x: just nearer it than its own
        results = [r.update(base) for _ in range(20)]
        changed = [i for i, a in enumerate(results) if a is not None]
        assert changed and changed[0] <= look, (factor, changed)
        if factor < 2:  # the change-point test stays quiet: the patience decides
            assert changed[0] >= r.patience - 1, changed


def test_one_spike_never_regroups_however_large():
    base = dict(enumerate([1, 1, 4, 4]))
    r = Regrouper(k=2)
    r.update(base)
    assert r.update({**base, 0: 16.0}) is None  # one look at 16x
    assert all(r.update(base) is None for _ in range(20))
    assert r.assignment == {0: 0, 1: 0, 2: 1, 3: 1}


def test_a_steady_noisy_run_never_regroups_with_the_change_point_test():
    """The documented false-alarm figure (docs/operations.md): log-normal noise of sigma 0.1 on
    every look of a steady 8-worker profile, 20,000 looks (11 hours at one per 2 s)."""
    rng = np.random.default_rng(1)
    base = dict(enumerate([1, 1, 1.5, 1.5, 2, 2, 4, 4]))
    r = Regrouper()
    r.update(_noisy(rng, base, 0.02))
    assert sum(r.update(_noisy(rng, base, 0.1)) is not None for _ in range(20_000)) == 0


def test_regrouper_auto_k_merges_groups_that_converge():
    base = dict(enumerate([1, 1, 4, 4]))
    r = Regrouper(k=None, patience=2, smoothing=1.0)
    assert r.update(base) == {0: 0, 1: 0, 2: 1, 3: 1}
    same = {w: 1.0 for w in base}
    assert r.update(same) is None
    assert r.update(same) == {0: 0, 1: 0, 2: 0, 3: 0}


def test_regrouper_late_joiner_and_leaver():
    r = Regrouper(k=2)
    r.update({0: 1.0, 1: 1.0, 2: 3.0, 3: 3.0})
    assert r.place(4, 2.5) == 1
    assert r.update({0: 1.0, 1: 1.0, 2: 3.0, 3: 3.0, 4: 2.6}) is None
    assert r.update({0: 1.0, 2: 3.0, 3: 3.0, 4: 2.6}) is None  # 1 left: dropped, no regroup
    assert set(r.assignment) == {0, 2, 3, 4}
    assert r.update({0: 1.0, 2: 3.0, 3: 3.0, 4: 2.6, 5: 1.1}) is None
    assert r.assignment[5] == 0


def test_an_explicit_group_count_is_honoured_for_equal_speeds() -> None:
    """Equal workers give one distinct speed: --groups 2 still means two groups."""
    equal = {w: 0.04 for w in range(4)}
    assert assign_groups(equal, k=2) == {0: 0, 1: 0, 2: 1, 3: 1}
    assert sorted(assign_groups({0: 0.04, 1: 0.04, 2: 0.04}, k=2).values()) == [0, 0, 1]
    assert assign_groups(equal, k=None) == {w: 0 for w in range(4)}  # automatic: one group
    assert set(assign_groups({0: 0.04, 1: 0.04}, k=3).values()) == {0, 1}  # one per worker


def test_a_given_group_count_splits_equal_workers_evenly_not_at_their_noise() -> None:
    """Six equal PCs and two equal boards, --groups 4 (the link-only suite's calibration): the
    boards share one group and the PCs fill three groups of two. The least-squares split cut
    at the noise: the boards apart, one PC group of four (1, 1, 4, 2), which with --merge mean
    weighs a lone board 4x a PC of the four."""
    times = {0: 0.0777, 1: 0.0776, 2: 0.0773, 3: 0.0776, 4: 0.0774, 5: 0.0777,
             6: 0.4318, 7: 0.4278}
    assert sorted(np.bincount(cluster_1d(list(times.values()), 4)).tolist()) == [1, 1, 2, 4]
    groups = assign_groups(times, k=4)
    assert groups[6] == groups[7] == 3  # the boards: the slowest group, together
    assert sorted(np.bincount(list(groups.values())).tolist()) == [2, 2, 2, 2]
    # extra groups go where most workers share a group: 3 groups = PCs in 3 + 3, boards 2
    assert np.bincount(list(assign_groups(times, k=3).values())).tolist() == [3, 3, 2]
    assert assign_groups(times, k=2) == {**{w: 0 for w in range(6)}, 6: 1, 7: 1}
    assert sorted(assign_groups(times, k=8).values()) == list(range(8))
    # distinct speeds as many as the groups: the least-squares split, as before
    profile = {w: s for w, s in enumerate([1, 1, 1.5, 1.5, 2, 2, 4, 4])}
    assert assign_groups(profile, k=4) == {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2, 6: 3, 7: 3}


def test_evenly_split_equal_workers_are_not_regrouped_by_their_noise() -> None:
    """A fixed k over six equal PCs and two boards, grouped on their calibrated (averaged)
    times, then 5% noise a look for 500 looks: the even groups stay (their centres lie within
    the margin of each other)."""
    rng = np.random.default_rng(3)
    base = {w: 0.0776 for w in range(6)} | {6: 0.43, 7: 0.43}
    r = Regrouper(k=4)
    first = r.update(base)
    assert first is not None and sorted(np.bincount(list(first.values())).tolist()) == [2] * 4
    assert all(r.update({w: t * rng.lognormal(0, 0.05) for w, t in base.items()}) is None
               for _ in range(500))
