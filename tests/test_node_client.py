"""examples/node_client.mjs, a Node.js client written from docs/protocol.md alone, against a real
`minips server` process: the handshake, PULL and WEIGHTS work byte for byte, a wrong or missing
secret is refused with the documented reason, a worker step moves exactly the pushed weights, and
a server that breaks the protocol gets ERROR and exit status 2."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_plain_client import TOKEN, N, start_server

NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="node (Node.js 20) is not on PATH")

CLIENT = Path(__file__).resolve().parents[1] / "examples" / "node_client.mjs"
Server = tuple[str, str, np.ndarray]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from start_server(tmp_path_factory.mktemp("node"))


@pytest.fixture
def fresh_server(tmp_path: Path) -> Iterator[Server]:
    """A server of its own: it ends its run once its only worker has left."""
    yield from start_server(tmp_path)


def client_command(host: str, port: str, token: str | None,
                   *args: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run the Node client with ``token`` (or none)."""
    env = {k: v for k, v in os.environ.items() if k != "MINIPS_TOKEN"}
    if token is not None:
        env["MINIPS_TOKEN"] = token
    return [str(NODE), str(CLIENT), host, port, *args], env


def run_client(server: Server, token: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    cmd, env = client_command(server[0], server[1], token, *args)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def test_the_client_uses_only_nodes_built_ins() -> None:
    imports = [line for line in CLIENT.read_text().splitlines() if line.startswith("import ")]
    assert imports and all("from 'node:" in line for line in imports), imports


def test_pulls_the_servers_weights_byte_for_byte(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "weights.f32"
    done = run_client(server, TOKEN, "--out", str(out))
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["encoding"] == "dense-f32" and summary["params"] == N
    assert summary["version"] == 0 and summary["done"] is False
    assert out.read_bytes() == server[2].astype("<f4").tobytes()


@pytest.mark.parametrize(("token", "reason"), [("not-the-secret", "wrong token"),
                                               (None, "missing token")])
def test_a_wrong_or_missing_secret_is_refused_with_its_reason(
        server: Server, token: str | None, reason: str) -> None:
    done = run_client(server, token)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "refused: auth" in done.stderr and reason in done.stderr


def test_no_server_is_a_clear_error_not_a_stack_trace() -> None:
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        done = run_client(("127.0.0.1", str(s.getsockname()[1]), np.zeros(0)), TOKEN)
    assert done.returncode == 3 and "cannot talk to 127.0.0.1" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "    at " not in done.stderr


def test_a_worker_step_moves_exactly_the_pushed_weights_against_the_gradient(
        fresh_server: Server, tmp_path: Path) -> None:
    """Section 9's worker sessions: STATS until ASSIGN, then on the group server ACK (start
    clock), PULL, PUSH of a sparse-v1 gradient, ACK, PULL; checked here on the weights the
    second PULL brought (--out) against the server's initial weights."""
    out = tmp_path / "after.f32"
    done = run_client(fresh_server, TOKEN, "--worker", "--k", "40", "--out", str(out))
    assert done.returncode == 0, done.stderr
    step = json.loads(done.stdout)
    assert step["group"] == 0 and step["clock"] == 1 and step["version"] == 1
    assert step["moved"] == step["k"] == 40  # no weight decay: only pushed coordinates move
    assert step["moved_only_where_pushed"] and step["moved_against_the_gradient"]
    before, after = fresh_server[2], np.frombuffer(out.read_bytes(), "<f4")
    changed = np.flatnonzero(before != after)
    assert changed.tolist() == step["pushed"]
    assert (np.sign(after[changed] - before[changed]) == -np.array(step["signs"])).all()


def read_frame(conn: socket.socket) -> tuple[int, bytes]:
    """(kind, whole frame) of one frame the client sent; sizes from its prefix (section 1.1)."""
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            assert chunk, "client closed in the middle of a frame"
            data += chunk
        return data
    prefix = exactly(16)
    assert prefix[:5] == b"MNPS\x01"
    nbuf = prefix[6]
    rest = (12 * nbuf + int.from_bytes(prefix[8:12], "little")
            + int.from_bytes(prefix[12:16], "little"))
    return prefix[5], prefix + exactly(rest)


def test_a_server_that_breaks_the_protocol_gets_error_and_exit_2() -> None:
    """A fake server answers HELLO with a frame of bad magic: the client sends ERROR, closes,
    and exits 2 naming what was wrong."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(20)
        cmd, env = client_command("127.0.0.1", str(listener.getsockname()[1]), TOKEN)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(20)
                assert read_frame(conn)[0] == 1  # HELLO
                conn.sendall(b"XNPS" + bytes(12))
                kind, _ = read_frame(conn)
                assert kind == 14  # ERROR
                assert conn.recv(1) == b""  # then it closes
            _, stderr = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    assert proc.returncode == 2, stderr
    assert "bad magic" in stderr and "    at " not in stderr

