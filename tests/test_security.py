"""Security of a live global server: HMAC handshake (wrong secret, no secret, replayed
handshake), TLS with a self-signed certificate made in the test (and a plain client refused),
loopback-only binding without a secret, secrets never written to logs, no pickle anywhere.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import make_certificate, minips_server, steps

from minips.core.config import RunConfig
from minips.errors import AuthError, ConfigError
from minips.net import transport
from minips.net.endpoints import check_bind, is_loopback
from minips.server import GlobalServer, ServerConfig
from minips.wire import control, frames, handshake

SECRET = "s3cret-token-that-must-never-be-logged"
PACKAGE = Path(__file__).resolve().parent.parent / "minips"


def make_server(tmp_path: Path, **cfg: Any) -> GlobalServer:
    conf = ServerConfig(run=RunConfig(workers=2), host="127.0.0.1", port=0, token=SECRET,
                        run_dir=str(tmp_path), linger_s=0.5, **cfg)
    return GlobalServer(conf, np.zeros(4, np.float32))


async def test_wrong_and_missing_secret_are_refused_with_a_reason(tmp_path: Path) -> None:
    srv = make_server(tmp_path)
    port = await srv.start()
    try:
        with pytest.raises(AuthError, match="wrong token"):
            await transport.connect("127.0.0.1", port, token="not-it", timeout=3)
        with pytest.raises(AuthError, match="missing token"):
            await transport.connect("127.0.0.1", port, token="", timeout=3)
        ch = await transport.connect("127.0.0.1", port, token=SECRET, timeout=3)
        assert ch.welcome_info["worker_id"] == 0  # the right secret still gets in
        await ch.close()
        assert srv.server is not None and srv.server.stats["refused"] == 2
    finally:
        await srv.close()


async def _raw_handshake(port: int, hello: control.Hello, auth: control.Auth | None,
                         client: handshake.ClientHandshake) -> tuple[Any, control.Auth]:
    """Speak the handshake frame by frame; send ``auth`` (a recorded one) or compute it.
    Returns the server's reply to AUTH and the AUTH that was sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    dec = frames.FrameDecoder()
    try:
        writer.writelines(frames.encode(hello))
        challenge = await _next(reader, dec)
        assert isinstance(challenge, control.Challenge)
        sent = auth if auth is not None else client.on_challenge(challenge)
        writer.writelines(frames.encode(sent))
        return await _next(reader, dec), sent
    finally:
        writer.close()


async def _next(reader: asyncio.StreamReader, dec: Any) -> Any:
    while True:
        msgs = dec.feed(await asyncio.wait_for(reader.read(65536), 5))
        if msgs:
            return msgs[0]


async def test_a_replayed_handshake_is_refused(tmp_path: Path) -> None:
    srv = make_server(tmp_path)
    port = await srv.start()
    try:
        client = handshake.ClientHandshake(SECRET, role="worker", worker_id=1)
        reply, recorded = await _raw_handshake(port, client.hello, None, client)
        assert isinstance(reply, control.Welcome)
        # An eavesdropper replays the same HELLO and AUTH: the server's nonce is new.
        replay, _ = await _raw_handshake(port, client.hello, recorded, client)
        assert isinstance(replay, control.Refuse) and "HMAC" in replay.reason
    finally:
        await srv.close()


async def test_tls_server_serves_tls_clients_and_refuses_plain_ones(
        tmp_path: Path, tls_files: tuple[Path, Path]) -> None:
    cert, key = tls_files
    srv = make_server(tmp_path, tls_cert=str(cert), tls_key=str(key))
    port = await srv.start()
    try:
        with pytest.raises(ConnectionError, match="could not connect"):
            await transport.connect("127.0.0.1", port, token=SECRET, timeout=2, retries=1)
        ctx = ssl.create_default_context(cafile=str(cert))
        ch = await transport.connect("127.0.0.1", port, token=SECRET, timeout=5, ssl=ctx)
        assert ch._transport.get_extra_info("ssl_object") is not None
        await ch.close()
        with pytest.raises(ConnectionError):  # a certificate it does not trust
            await transport.connect("127.0.0.1", port, token=SECRET, timeout=2, retries=0,
                                    ssl=ssl.create_default_context())
    finally:
        await srv.close()


@pytest.mark.timeout(180)
def test_a_tls_cluster_trains_with_a_certificate_for_a_host_name(tmp_path: Path) -> None:
    """`minips server --tls-cert` and a worker `--connect localhost:PORT --tls-ca`, with a
    certificate for the name localhost only (no IP address in it, as for a real host name): the
    worker verifies the global server and its group server by that name and trains to the end.
    (A group server address of 127.0.0.1 would fail the certificate check.)"""
    cert, key = make_certificate(tmp_path, "DNS:localhost")
    np.save(tmp_path / "init.npy", np.zeros(61_706, np.float32))
    run = ("--workers", "1", "--epochs", "0.1", "--mode", "ssp", "--compressor", "none",
           "--base-step", "0.02", "--init", str(tmp_path / "init.npy"))
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    with minips_server(tmp_path, SECRET, *run, *tls) as (server, _, port):
        worker = subprocess.run(
            [sys.executable, "-m", "minips", "worker", "--connect", f"localhost:{port}",
             "--id", "0", "--tls-ca", str(cert), "--run-dir", str(tmp_path)],
            env={**os.environ, "MINIPS_TOKEN": SECRET}, capture_output=True, text=True,
            timeout=150)
        assert worker.returncode == 0, worker.stderr[-2000:]
        assert server.wait(timeout=60) == 0
    # the whole budget, batches of at most 64
    assert len(steps(tmp_path / "worker-0.jsonl")) >= 0.1 * 60_000 / 64


def test_non_loopback_bind_needs_a_secret_or_insecure() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    with pytest.raises(ConfigError, match="without a secret"):
        check_bind("0.0.0.0", "", insecure=False)
    check_bind("0.0.0.0", SECRET, insecure=False)
    check_bind("0.0.0.0", "", insecure=True)
    check_bind("127.0.0.1", "", insecure=False)


def test_cli_server_refuses_a_public_bind_without_secret(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin"}  # no MINIPS_TOKEN
    out = subprocess.run([sys.executable, "-m", "minips", "server", "--host", "0.0.0.0",
                          "--port", "0", "--run-dir", str(tmp_path), "--quiet"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "refusing to listen on 0.0.0.0" in out.stderr
    grp = subprocess.run([sys.executable, "-m", "minips", "group", "--connect", "127.0.0.1:9",
                          "--listen", "0.0.0.0:0"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert grp.returncode == 2 and "refusing to listen" in grp.stderr


async def test_secret_never_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    srv = make_server(tmp_path)
    port = await srv.start()
    try:
        with pytest.raises(AuthError):
            await transport.connect("127.0.0.1", port, token=SECRET + "x", timeout=3)
        ch = await transport.connect("127.0.0.1", port, token=SECRET, timeout=3)
        assert SECRET not in repr(ch.welcome_info)
        await ch.close()
    finally:
        await srv.close()
    assert "refused" in caplog.text and SECRET not in caplog.text
    for f in tmp_path.rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f


def test_no_pickle_anywhere() -> None:
    for path in PACKAGE.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(import|from)\s+(c?pickle|dill|joblib)\b", text, re.M), path
        assert "allow_pickle=True" not in text, path
        assert "torch.load(" not in text, path
