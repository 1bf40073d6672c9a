"""The modes' table (core/config.py): each mode's decisions, and that the servers follow the
table."""

from __future__ import annotations

import pytest

from minips.core import config
from minips.core.config import MODES, RunConfig
from minips.errors import ConfigError


def test_the_table_has_the_five_modes_and_their_decisions() -> None:
    assert MODES == config.MODES == ("bsp", "ssp", "asp", "gssp", "lbbsp")
    rows = {m: (config.policy(m).staleness_bound(3), config.policy(m).in_rounds(3),
                config.policy(m).group_count(4), config.policy(m).regroup,
                config.policy(m).balanced) for m in MODES}
    assert rows == {"bsp": (0, True, 1, False, False), "ssp": (3, False, 1, False, False),
                    "asp": (None, False, 1, False, False), "gssp": (3, False, 4, True, False),
                    "lbbsp": (0, True, 1, False, True)}


def test_every_mode_exchanges_every_sync_every_pushes_and_merges_by_the_rule() -> None:
    for m in MODES:
        p = config.policy(m)
        assert [p.exchange_due(n, 4) for n in (3, 4, 5)] == [False, True, True]
        assert (p.merge_scale("mean", 4), p.merge_scale("sum", 4), p.merge_scale("mean", 1)) == (
            0.25, 1.0, 1.0)


def test_a_bound_of_zero_applies_in_rounds_whatever_the_mode_is_called() -> None:
    assert config.policy("ssp").in_rounds(0) and config.policy("gssp").in_rounds(0)
    assert not config.policy("asp").in_rounds(0)  # no bound at all


@pytest.mark.parametrize("mode", MODES)
def test_run_config_asks_the_table(mode: str) -> None:
    run = RunConfig(mode=mode, staleness=2, groups=3).validate()
    p = config.policy(mode)
    assert run.sync is p
    assert (run.staleness_bound, run.in_rounds, run.fixed_groups) == (
        p.staleness_bound(2), p.in_rounds(2), p.group_count(3))


def test_an_unknown_mode_is_refused_with_the_modes_there_are() -> None:
    with pytest.raises(ValueError, match="one of"):
        config.policy("gossip")
    with pytest.raises(ConfigError, match="mode"):
        RunConfig(mode="gossip").validate()

