"""Every counter a group process moves on the global server is bounded where it enters: per
EXCHANGE (``samples`` and ``pushes`` at most 2^40) and cumulatively (the run's samples, its
version and the worker traffic of all groups at most 2^62, what the wire can carry). An
EXCHANGE over a bound is refused (ERROR ``invalid``), nothing of it is merged, its connection is
closed, and the server keeps answering everyone else with the model unchanged; before these
bounds one EXCHANGE made every later PULL of an evaluator or a group ERROR ``internal``.
Against a real in-process global server over loopback (tests/raw_group.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import records, recv_as
from raw_group import Cluster, closed, values

from minips.wire import control, messages
from minips.wire.conversation import MAX_EXCHANGE_COUNT
from minips.wire.fields import MAX_INT
from minips.wire.messages import MAX_COUNT

pytestmark = pytest.mark.timeout(60)


async def refused_and_nothing_changed(c: Cluster, g: int, **counters: Any) -> None:
    """``counters`` in group ``g``'s EXCHANGE are refused; the server still answers an
    evaluator and a new group process, with the weights and counters as they were."""
    before, samples, version = c.weights(), c.srv.core.samples, c.srv.core.version
    reply = await c.exchange(c.groups[g], **{"seq": 99, **counters})
    assert isinstance(reply, control.Error) and reply.code == "invalid", reply
    assert await closed(c.groups[g])
    w = await c.evaluate()  # was ERROR internal
    np.testing.assert_array_equal(values(w), before)
    assert (w.samples, w.version) == (samples, version)
    np.testing.assert_array_equal(c.weights(), before)
    again = await c.connect_group(7399)  # a replacement adopts the group and PULLs it whole
    assert (await recv_as(again, control.Assign)).group == g
    np.testing.assert_array_equal(values(await c.pull(again)), before)


@pytest.mark.parametrize("counter", ["samples", "pushes"])
async def test_one_exchange_claiming_2_62_samples_or_pushes_is_refused(
        tmp_path: Path, counter: str) -> None:
    c = await Cluster(tmp_path).start()
    try:
        await c.pull(c.groups[0])
        await refused_and_nothing_changed(c, 0, **{counter: 1 << 62})
    finally:
        await c.close()


@pytest.mark.parametrize("counter", ["samples", "pushes"])
async def test_the_per_exchange_bound_is_2_40(tmp_path: Path, counter: str) -> None:
    c = await Cluster(tmp_path).start()
    try:
        await c.pull(c.groups[0])
        ok = await c.exchange(c.groups[0], **{counter: MAX_EXCHANGE_COUNT})
        assert isinstance(ok, messages.ExchangeReply)
        assert c.srv.core.version == 1
        await refused_and_nothing_changed(c, 0, **{counter: MAX_EXCHANGE_COUNT + 1})
    finally:
        await c.close()


async def test_the_runs_samples_stop_at_2_62(tmp_path: Path) -> None:
    """Samples that each fit in one exchange but together pass 2^62 are refused."""
    c = await Cluster(tmp_path).start()
    try:
        await c.pull(c.groups[0])
        c.srv.core.samples = MAX_COUNT - MAX_EXCHANGE_COUNT  # as a run that counted this many
        ok = await c.exchange(c.groups[0], samples=MAX_EXCHANGE_COUNT)
        assert isinstance(ok, messages.ExchangeReply) and ok.samples == MAX_COUNT
        await refused_and_nothing_changed(c, 0, seq=2, samples=1)
    finally:
        await c.close()


async def test_the_global_version_stops_at_2_62(tmp_path: Path) -> None:
    c = await Cluster(tmp_path).start()
    try:
        await c.pull(c.groups[0])
        c.srv.core.version = MAX_COUNT  # as a run that merged this many exchanges
        await refused_and_nothing_changed(c, 0)
    finally:
        await c.close()


async def test_a_groups_own_version_moves_nothing_here(tmp_path: Path) -> None:
    """EXCHANGE's ``version`` is the group's weights version, up to the wire's 2^63-1: the
    global server counts its own merges and is not moved by it."""
    c = await Cluster(tmp_path).start()
    try:
        await c.pull(c.groups[0])
        reply = await c.exchange(c.groups[0], version=MAX_INT)
        assert isinstance(reply, messages.ExchangeReply) and reply.version == 1
        w = await c.evaluate()
        assert w.version == 1
        np.testing.assert_array_equal(values(w), np.ones(6, np.float32))
    finally:
        await c.close()


@pytest.mark.parametrize("counter", ["bytes_in", "bytes_out"])
async def test_worker_traffic_of_all_groups_stops_at_2_62(tmp_path: Path, counter: str) -> None:
    """Each group reports its workers' bytes so far; the server adds them up for an evaluator,
    so the group whose report would take the sum past 2^62 is refused."""
    c = await Cluster(tmp_path, groups=2).start()
    try:
        for ch in c.groups.values():
            await c.pull(ch)
        ok = await c.exchange(c.groups[0], **{counter: MAX_COUNT})
        assert isinstance(ok, messages.ExchangeReply)
        await refused_and_nothing_changed(c, 1, **{counter: 1})
        w = await c.evaluate()
        assert w.info["bytes_up" if counter == "bytes_in" else "bytes_down"] == MAX_COUNT
    finally:
        await c.close()


async def test_answered_pulls_must_come_one_entry_per_pull_in_each_list(tmp_path: Path) -> None:
    """EXCHANGE's pull_workers, pull_leads and pull_waits_us of unequal length are refused;
    equal ones are merged, and the merge line carries them and the exchange's bytes."""
    c = await Cluster(tmp_path).start()
    try:
        await c.pull(c.groups[0])
        ok = await c.exchange(c.groups[0], pull_workers=[0, 1], pull_leads=[2, 0],
                              pull_waits_us=[1500, 0])
        assert isinstance(ok, messages.ExchangeReply)
        await refused_and_nothing_changed(c, 0, seq=2, pull_workers=[0, 1], pull_leads=[2],
                                          pull_waits_us=[1500, 0])
    finally:
        await c.close()
    merge = [r for r in records(tmp_path / "global.jsonl") if r.get("event") == "merge"]
    assert len(merge) == 1 and merge[0]["pull_leads"] == [2, 0]
    assert merge[0]["bytes_to_global"] > 0 and merge[0]["bytes_from_global"] > 0
