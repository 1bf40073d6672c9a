"""A group process's HELLO ``address`` is where the global server sends its workers: one that
is empty or not HOST:PORT is refused at the handshake (REFUSE ``refused``, the reason naming
the field), and a wildcard host is replaced by the host the group connects from, which the
server logs as the address it advertises. Against a real in-process global server.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import numpy as np
import pytest
from conftest import recv_as, until

from minips.core.config import RunConfig
from minips.errors import AuthError
from minips.net import transport
from minips.server import GlobalServer, ServerConfig
from minips.wire import control

TOKEN = "group-hello-test-secret-0123"

pytestmark = pytest.mark.timeout(60)


def server(tmp_path: Path) -> GlobalServer:
    cfg = ServerConfig(run=RunConfig(lr_warmup=0.0, workers=1, mode="ssp"), host="127.0.0.1",
                       port=0, token=TOKEN, run_dir=str(tmp_path), calib_timeout_s=10.0,
                       linger_s=1.0, external_groups=1)
    return GlobalServer(cfg, np.zeros(4, np.float32))


BAD = ["", "7123", "127.0.0.1", "127.0.0.1:", ":7123", "127.0.0.1:0", "127.0.0.1:65536",
       "127.0.0.1:http", "fe80::1:7123", "my host:7123", "[]:7123"]


async def test_an_empty_or_malformed_address_is_refused_naming_the_field(tmp_path: Path) -> None:
    srv = server(tmp_path)
    port = await srv.start()
    try:
        for address in BAD:
            with pytest.raises(AuthError, match="HELLO address") as refused:
                await transport.connect("127.0.0.1", port, role="group", address=address,
                                        token=TOKEN, timeout=5, retries=0)
            assert "refused" in str(refused.value), address
        assert not srv.pending_groups
        for good in ("127.0.0.1:7123", "[::1]:7123", "localhost:7123"):
            ch = await transport.connect("127.0.0.1", port, role="group", address=good,
                                         token=TOKEN, timeout=5)
            await ch.close()
    finally:
        await srv.close()


async def test_a_wildcard_host_is_replaced_and_the_advertised_address_logged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    srv = server(tmp_path)
    port = await srv.start()
    caplog.set_level(logging.INFO, logger="minips.server")
    grp = await transport.connect("127.0.0.1", port, role="group", address="[::]:7123",
                                  token=TOKEN)
    ctl = await transport.connect("127.0.0.1", port, role="worker", worker_id=0, token=TOKEN)
    try:
        await ctl.send(control.Stats(clock=0, step_time=0.01, loss=1.0))
        assert (await recv_as(ctl, control.Assign)).address == "127.0.0.1:7123"
        assert isinstance(await recv_as(grp, control.Assign), control.Assign)
        assert any("[::]:7123" in r.getMessage() and "127.0.0.1:7123" in r.getMessage()
                   for r in caplog.records)
    finally:
        await ctl.close()
        await grp.close()
        await srv.close()


async def test_a_group_process_gone_before_the_grouping_is_given_no_group(
        tmp_path: Path) -> None:
    """It leaves the queue when its connection closes: the next one gets the group, and the
    server closes without waiting for it."""
    srv = server(tmp_path)
    port = await srv.start()
    gone = await transport.connect("127.0.0.1", port, role="group", address="127.0.0.1:7123",
                                   token=TOKEN)
    await until(lambda: len(srv.pending_groups) == 1)
    await gone.close()
    await until(lambda: not srv.pending_groups)
    grp = await transport.connect("127.0.0.1", port, role="group", address="127.0.0.1:7124",
                                  token=TOKEN)
    ctl = await transport.connect("127.0.0.1", port, role="worker", worker_id=0, token=TOKEN)
    try:
        await ctl.send(control.Stats(clock=0, step_time=0.01, loss=1.0))
        assert (await recv_as(ctl, control.Assign)).address == "127.0.0.1:7124"
        assert isinstance(await recv_as(grp, control.Assign), control.Assign)
    finally:
        await ctl.close()
        await grp.close()
        await asyncio.wait_for(srv.close(), 10)
