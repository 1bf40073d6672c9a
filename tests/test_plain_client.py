"""The clients written from docs/protocol.md alone, examples/plain_client.py (Python, no minips
import) and examples/node_client.mjs (Node.js; skipped where `node` is not installed), against a
real `minips server` process: the handshake, PULL and WEIGHTS work byte for byte, a wrong or
missing secret is refused with the documented reason, and no server is one clear line. The
Python client's worker step is checked here, the Node client's own checks in
test_node_client.py."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import minips_server

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CLIENT = EXAMPLES / "plain_client.py"
NODE = shutil.which("node")
COMMANDS = {"python": [sys.executable, str(CLIENT)],  # how each client is started
            "node": [str(NODE), str(EXAMPLES / "node_client.mjs")]}
NO_NODE = pytest.mark.skipif(NODE is None, reason="node (Node.js 20) is not on PATH")
EACH_CLIENT = pytest.mark.parametrize("client", ["python", pytest.param("node", marks=NO_NODE)])
TOKEN = "plain-secret"
N = 61_706  # LeNet-5, the server's default model
Server = tuple[str, str, np.ndarray]  # host, port, initial weights


def start_server(tmp: Path) -> Iterator[Server]:
    """A `minips server` (1 worker, no weight decay) with known initial weights; (host, port,
    weights) once it listens."""
    weights = np.random.default_rng(5).standard_normal(N).astype(np.float32)
    np.save(tmp / "init.npy", weights)
    with minips_server(tmp, TOKEN, "--workers", "1", "--weight-decay", "0",
                       "--init", str(tmp / "init.npy")) as (_, host, port):
        yield host, port, weights


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from start_server(tmp_path_factory.mktemp("plain"))


@pytest.fixture
def fresh_server(tmp_path: Path) -> Iterator[Server]:
    yield from start_server(tmp_path)


def client_command(client: str, host: str, port: str, token: str | None,
                   *args: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run ``client`` with ``token`` (or none)."""
    env = {k: v for k, v in os.environ.items() if k != "MINIPS_TOKEN"}
    if token is not None:
        env["MINIPS_TOKEN"] = token
    return [*COMMANDS[client], host, port, *args], env


def run_client(server: Server, token: str | None, *args: str,
               client: str = "python") -> subprocess.CompletedProcess[str]:
    cmd, env = client_command(client, server[0], server[1], token, *args)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def test_the_client_imports_nothing_of_minips() -> None:
    source = CLIENT.read_text()
    assert "minips." not in source.replace("minips server", "") and "import minips" not in source


@EACH_CLIENT
def test_pulls_the_servers_weights_byte_for_byte(server: Server, tmp_path: Path,
                                                 client: str) -> None:
    out = tmp_path / "weights.f32"
    done = run_client(server, TOKEN, "--out", str(out), client=client)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["encoding"] == "dense-f32" and summary["params"] == N
    assert summary["version"] == 0 and summary["done"] is False
    assert out.read_bytes() == server[2].astype("<f4").tobytes()


@EACH_CLIENT
@pytest.mark.parametrize(("token", "reason"), [("not-the-secret", "wrong token"),
                                               (None, "missing token")])
def test_a_wrong_or_missing_secret_is_refused_with_its_reason(
        server: Server, token: str | None, reason: str, client: str) -> None:
    done = run_client(server, token, client=client)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "refused: auth" in done.stderr and reason in done.stderr


@EACH_CLIENT
def test_no_server_is_one_clear_line_not_a_stack_trace(client: str) -> None:
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        done = run_client(("127.0.0.1", str(s.getsockname()[1]), np.zeros(0)), TOKEN,
                          client=client)
    assert done.returncode == 3 and "cannot talk to 127.0.0.1" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1  # Python's or Node's trace is many lines
    assert "Traceback" not in done.stderr and "    at " not in done.stderr


def test_a_worker_step_moves_exactly_the_pushed_weights_against_the_gradient(
        fresh_server: Server) -> None:
    """Section 9's worker sessions: STATS until ASSIGN, then on the group server ACK (start
    clock), PULL, PUSH of a sparse-v1 gradient, ACK, PULL."""
    done = run_client(fresh_server, TOKEN, "--worker", "--k", "40")
    assert done.returncode == 0, done.stderr
    step = json.loads(done.stdout)
    assert step["group"] == 0 and step["clock"] == 1 and step["version"] == 1
    assert step["moved"] == 40  # momentum SGD's first step moves every pushed coordinate
    assert step["moved_only_where_pushed"] and step["moved_against_the_gradient"]
