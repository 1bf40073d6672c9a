"""examples/node_client.mjs, a Node.js client written from docs/protocol.md alone: it uses
Node's built-ins only, a worker step against a real `minips server` moves exactly the pushed
weights, and a server that breaks the protocol gets ERROR and exit status 2. The checks it
shares with the Python client (weights byte for byte, a wrong or missing secret, no server)
are in test_plain_client.py, run for both."""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_plain_client import (
    EXAMPLES,
    NO_NODE,
    TOKEN,
    Server,
    client_command,
    run_client,
    start_server,
)

from minips.wire.messages import PROTOCOL_VERSION

pytestmark = NO_NODE

CLIENT = EXAMPLES / "node_client.mjs"


@pytest.fixture
def fresh_server(tmp_path: Path) -> Iterator[Server]:
    """A server of its own: it ends its run once its only worker has left."""
    yield from start_server(tmp_path)


def test_the_client_uses_only_nodes_built_ins() -> None:
    imports = [line for line in CLIENT.read_text().splitlines() if line.startswith("import ")]
    assert imports and all("from 'node:" in line for line in imports), imports


def test_a_worker_step_moves_exactly_the_pushed_weights_against_the_gradient(
        fresh_server: Server, tmp_path: Path) -> None:
    """Section 9's worker sessions: STATS until ASSIGN, then on the group server ACK (start
    clock), PULL, PUSH of a sparse-v1 gradient, ACK, PULL; checked here on the weights the
    second PULL brought (--out) against the server's initial weights."""
    out = tmp_path / "after.f32"
    done = run_client(fresh_server, TOKEN, "--worker", "--k", "40", "--out", str(out),
                      client="node")
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
    assert prefix[:4] == b"MNPS" and prefix[4] == PROTOCOL_VERSION
    nbuf = prefix[6]
    rest = (12 * nbuf + int.from_bytes(prefix[8:12], "little")
            + int.from_bytes(prefix[12:16], "little"))
    return prefix[5], prefix + exactly(rest)


def test_a_server_that_breaks_the_protocol_gets_error_and_exit_2() -> None:
    """A fake server answers HELLO with a frame of bad magic: the client sends ERROR, closes,
    and exits 2 naming what was wrong."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(20)
        cmd, env = client_command("node", "127.0.0.1", str(listener.getsockname()[1]), TOKEN)
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

