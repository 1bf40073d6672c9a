"""What an operator reads, said right (issue 58's polish): the printed /metrics address says how
to pass the dashboard's token, and it works as printed; `minips evaluator --help` lists only the
evaluator's flags; a refusal says "refused" once; counts take the singular for one; a dense push
reads 100% on the dashboard; a worker says when the global server is gone and back; a port where
something else than minips answers is named as such. Real sockets on loopback (port 0), real
processes where the line is a process's, hard timeouts."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, cast

import pytest

from minips.core.config import WorkerConfig
from minips.errors import AuthError, RemoteProtocolError
from minips.net import lifeline, transport
from minips.run.flags import build_parser
from minips.run.launch import prometheus_note
from minips.sim.simulate import report
from minips.wire import control, handshake

TOKEN = "polish-test-secret-0123456789abcdef"
PAGE = Path(__file__).resolve().parents[1] / "minips" / "dashboard" / "static" / "index.html"


# -- 1. the /metrics address says how to pass the token ------------------------------------------

def test_prometheus_note_says_how_the_token_is_passed() -> None:
    made = prometheus_note("http://10.0.0.1:8080/?token=abc", guarded=True)
    assert "http://10.0.0.1:8080/metrics?token=abc" in made and "Authorization: Bearer" in made
    env = prometheus_note("http://10.0.0.1:8080/", guarded=True)  # $MINIPS_DASHBOARD_TOKEN's
    assert "/metrics?token=$MINIPS_DASHBOARD_TOKEN" in env and "Authorization: Bearer" in env
    open_ = prometheus_note("http://127.0.0.1:8080/", guarded=False)
    assert "http://127.0.0.1:8080/metrics" in open_ and "token=" not in open_


def _get(url: str, headers: dict[str, str] | None = None) -> int:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


@pytest.mark.timeout(60)
def test_server_prints_a_metrics_url_that_answers_as_printed(tmp_path: Path) -> None:
    pytest.importorskip("aiohttp", reason="the dashboard extra is not installed")
    env = {k: v for k, v in os.environ.items() if k != "MINIPS_DASHBOARD_TOKEN"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "minips", "server", "--port", "0", "--quiet", "--workers", "1",
         "--dashboard", "0.0.0.0:0", "--run-dir", str(tmp_path / "run")],  # 0.0.0.0: a token
        env=lifeline.child_env({**env, "MINIPS_TOKEN": TOKEN}), stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the dashboard's line comes first (pytest's timeout)
        m = re.search(r"Prometheus: (\S+/metrics)\?token=([^,\s]+), or header "
                      r"'Authorization: Bearer <token>'", line)
        assert m, line
        metrics, token = m[1], m[2]
        assert _get(metrics) == 401  # plain curl: what the line is there to prevent
        assert _get(f"{metrics}?token={token}") == 200
        assert _get(metrics, {"Authorization": f"Bearer {token}"}) == 200
    finally:
        proc.kill()
        proc.communicate(timeout=30)


# -- 2. the evaluator's own flags -----------------------------------------------------------------

WORKER_ONLY = ("--id", "--slowdown", "--throttle", "--bandwidth", "--bandwidth-down", "--latency")


def _help(command: str) -> str:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    parsers = cast("dict[str, argparse.ArgumentParser]", sub.choices)  # a subparsers action's
    return parsers[command].format_help()


def test_evaluator_help_lists_no_worker_only_flags() -> None:
    evaluator, worker = _help("evaluator"), _help("worker")
    for flag in WORKER_ONLY:
        assert re.search(rf"{flag}\b", worker), flag
        assert not re.search(rf"{flag}\b", evaluator), flag
    args = build_parser().parse_args(  # every flag the evaluator uses is still taken
        ["evaluator", "--connect", "127.0.0.1:7070", "--run-dir", "r", "--data", "synthetic",
         "--threads", "2", "--timeout", "5", "--reconnect", "9", "--trace", "t.jsonl"])
    from minips.run.cli import _client_config

    cfg = _client_config(args)
    assert isinstance(cfg, WorkerConfig) and cfg.server_port == 7070 and cfg.torch_threads == 2
    assert cfg.reconnect_s == 9 and cfg.worker_id == -1 and cfg.slowdown == 1.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["evaluator", "--connect", "127.0.0.1:7070", "--slowdown", "2"])


# -- 3. refused, once ---------------------------------------------------------------------------

def test_a_refusal_says_refused_once() -> None:
    hs = handshake.ClientHandshake(None, role="worker")
    with pytest.raises(AuthError) as err:
        hs.on_reply(control.Refuse(code="refused", reason="no free worker id: all 1 are "
                                   "connected"))
    assert str(err.value) == "refused by server: no free worker id: all 1 are connected"
    with pytest.raises(AuthError, match=r"refused by server \(auth\): wrong token"):
        hs.on_reply(control.Refuse(code="auth", reason="wrong token"))  # a code that says more


async def test_a_full_server_refuses_a_second_worker_in_one_clear_line() -> None:
    def accept(hello: control.Hello) -> dict[str, Any]:
        raise AuthError("no free worker id: all 1 are connected")  # roster.py's words

    async def handler(ch: Any) -> None:
        await ch.close()

    srv = await transport.serve("127.0.0.1", 0, accept=accept, handler=handler, token=TOKEN)
    try:
        with pytest.raises(AuthError) as err:
            await transport.connect("127.0.0.1", srv.port, token=TOKEN, timeout=5)
    finally:
        srv.close()
    said = str(err.value)
    assert said.count("refused") == 1 and "no free worker id" in said, said


# -- 4. one group, four workers -------------------------------------------------------------------

def test_simulate_report_counts_in_the_singular_for_one() -> None:
    summary = {"mode": "gssp", "compressor": "none", "workers": 4, "groups": 1, "run_dir": "r"}
    first = report(summary, []).splitlines()[0]
    assert "4 workers in 1 group:" in first, first
    first = report({**summary, "workers": 1, "groups": 2}, []).splitlines()[0]
    assert "1 worker in 2 groups:" in first, first


# -- 5. a dense push reads 100% -----------------------------------------------------------------

def _upload_cells(rows: list[dict[str, Any]], compressor: str) -> list[str]:
    """The page's own ``cell`` and ``uploadCell`` functions, run by node on ``rows``."""
    page = PAGE.read_text()
    code = "\n".join(re.search(rf"^function {name}\(.*?^}}$", page, re.S | re.M)[0]  # type: ignore[index]
                     for name in ("cell", "uploadCell"))
    script = (f"{code}\nconst rows = {json.dumps(rows)};\n"
              f"console.log(JSON.stringify(rows.map((w) => uploadCell(w, "
              f"{json.dumps(compressor)}))));")
    out = subprocess.run(["node", "-e", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return [re.sub(r"<[^>]+>", "", c) for c in json.loads(out.stdout)]


@pytest.mark.skipif(shutil.which("node") is None, reason="node runs the page's functions")
def test_dense_upload_reads_100_percent_not_its_frame_header() -> None:
    # 0.0009 over: a PUSH frame's header over lenet5's dense float32 gradient (the issue's 100.09%)
    rows: list[dict[str, Any]] = [{"upload_ratio": 1.0009, "approx": ["upload_ratio"]},
            {"upload_ratio": 1.0009, "approx": []}, {"upload_ratio": None, "approx": []}]
    assert _upload_cells(rows, "none") == ["100% (dense)", "100% (dense)", "–"]
    sparse = _upload_cells([{"upload_ratio": 0.0213, "approx": ["upload_ratio"]}], "topk")
    assert sparse == ["≈2.13%"]  # a compressor's ratio as measured, header included


# -- 7. the global server gone and back; a port where something else answers -------------------

async def test_worker_says_the_global_server_is_gone_and_back(
        caplog: pytest.LogCaptureFixture) -> None:
    from minips.worker import Control  # torch: imported only by this test

    sessions: list[Any] = []
    stop = asyncio.Event()

    async def handler(ch: Any) -> None:
        sessions.append(ch)
        if len(sessions) == 1:
            ch.abort("the test drops the first session")  # the global server "dies"
            return
        await stop.wait()

    srv = await transport.serve("127.0.0.1", 0, accept=lambda hello: {"worker_id": 3},
                                handler=handler, token=TOKEN)
    cfg = WorkerConfig(server_host="127.0.0.1", server_port=srv.port, token=TOKEN,
                       connect_timeout_s=5, reconnect_s=7)
    ctl = Control(cfg, lambda name, **fields: None)
    ctl.heartbeat_s = 5.0
    caplog.set_level(logging.WARNING, logger="minips.worker")
    try:
        await ctl.open()
        loop = asyncio.ensure_future(ctl.loop())
        await _until(lambda: "is back after" in caplog.text, 10)
        ctl.done = True
        ctl.ch.abort("test over")
        await asyncio.wait_for(loop, 5)
    finally:
        stop.set()
        srv.close()
    gone = f"worker 3: the global server at 127.0.0.1:{srv.port} is gone ("
    assert gone in caplog.text and "retrying for up to 7 s" in caplog.text, caplog.text
    assert re.search(r"worker 3: the global server is back after \d+\.\d s", caplog.text)


async def _until(cond: Any, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)  # polling with a deadline


async def _foreign_server(answer: bytes) -> asyncio.Server:
    """A server on loopback port 0 that writes ``answer`` to each connection (b"": says
    nothing) and holds it open."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer)
        await writer.drain()
        await reader.read()  # until the client goes
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def _refusal_of(answer: bytes) -> tuple[int, str]:
    """(port, the error) of a minips client connecting to a server that answers ``answer``."""
    srv = await _foreign_server(answer)
    port = srv.sockets[0].getsockname()[1]
    try:
        with pytest.raises(RemoteProtocolError) as err:
            await transport.connect("127.0.0.1", port, timeout=5)
    finally:
        srv.close()
    return port, str(err.value)


async def test_an_http_server_is_named_not_a_minips_server() -> None:
    port, said = await _refusal_of(b"HTTP/1.0 200 OK\r\nServer: SimpleHTTP/0.6\r\n\r\n<html>")
    assert said == f"127.0.0.1:{port} is not a minips server (it answered 'HTTP/1.0 200 OK')"


async def test_a_long_or_binary_first_line_is_cut_and_printable() -> None:
    _, error = await _refusal_of(b"SSH-2.0-OpenSSH_9.6p1 Debian-4 \x01\x02" + b"x" * 40 + b"\r\n")
    said = re.search(r"it answered '(.*)'\)$", error)
    assert said and said[1].startswith("SSH-2.0-OpenSSH_9.6p1 Debian-4 ??x"), error
    assert len(said[1]) == 40 and said[1].endswith("…")


async def test_a_port_that_takes_the_connection_and_says_nothing_is_told_apart() -> None:
    srv = await _foreign_server(b"")
    port = srv.sockets[0].getsockname()[1]
    try:
        with pytest.raises(transport.Unreachable) as err:
            await transport.connect("127.0.0.1", port, timeout=1.0, retries=0)
    finally:
        srv.close()
    said = str(err.value)
    assert "the port took the connection, then answered nothing to the handshake" in said
    assert "the host is down" not in said, said  # it is up: it took the connection
