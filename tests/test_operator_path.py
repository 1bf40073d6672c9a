"""What an operator meets on the documented multi-machine path (issue 42): a connect error that
says what went wrong and gives up in the time given; a port in use named by its flag, with
nothing created; the external-group default that never hangs; the grouping deadline counted
from the first join; a resume that keeps its counters; a run that exits promptly when done.
Real processes on loopback where the issue says so, each with a hard timeout."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

from minips.net import transport
from minips.run.cli import main


@contextlib.contextmanager
def listener_that_never_accepts() -> Iterator[int]:
    """A loopback port whose connections the kernel completes but nobody ever answers: a
    client's handshake waits for a reply that never comes (a hung server, a middlebox)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield int(s.getsockname()[1])


def closed_port() -> int:
    """A loopback port nothing listens on: every connection is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- connecting: the failure named, the timeout honoured -----------------------------------------

@pytest.mark.timeout(30)
async def test_a_refused_port_is_called_refused_with_its_address() -> None:
    port = closed_port()
    t = time.monotonic()
    with pytest.raises(transport.Unreachable) as err:
        await transport.connect("127.0.0.1", port, timeout=1.5, retries=None, token="")
    said = str(err.value)
    assert f"127.0.0.1:{port}" in said and "connection refused" in said, said
    assert "TimeoutError" not in said and err.value.silent
    assert time.monotonic() - t < 1.5 + 0.5


@pytest.mark.timeout(30)
async def test_a_peer_that_never_answers_is_called_timed_out() -> None:
    with listener_that_never_accepts() as port:
        with pytest.raises(transport.Unreachable, match="timed out") as err:
            await transport.connect("127.0.0.1", port, timeout=1.0, retries=None, token="")
    assert f"127.0.0.1:{port}" in str(err.value) and "TimeoutError()" not in str(err.value)


@pytest.mark.timeout(60)
def test_worker_timeout_is_honoured_and_the_cause_is_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`minips worker --timeout 2` to a port that never answers gives up within about 2 s
    (not 2 s plus a TLS probe of the silent port), naming the address and 'timed out'."""
    with listener_that_never_accepts() as port:
        t = time.monotonic()
        code = main(["worker", "--connect", f"127.0.0.1:{port}", "--timeout", "2",
                     "--data", "synthetic"])
        took = time.monotonic() - t
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"127.0.0.1:{port} within 2.0 s" in err[0] and "timed out" in err[0], err
    # importing torch takes about a second; the TLS probe of the silent port took 3 more
    assert took < 2.0 + 2.5, f"gave up after {took:.1f} s with --timeout 2"


def _can_make_namespaces() -> str:
    """'' when this process may create a network namespace (root and iproute2), else why not."""
    if os.geteuid() != 0:
        return "needs root to create a network namespace"
    try:
        subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"no usable iproute2: {exc}"
    return ""


@pytest.mark.timeout(60)
def test_an_address_whose_packets_vanish_times_out_in_the_time_given(
        tmp_path: pytest.TempPathFactory) -> None:
    """In a network namespace of the test's own: 10.77.0.2 sits behind a veth whose other end
    has no address, so a SYN to it is dropped (timed out); 10.77.0.3 does not answer ARP
    (unreachable). No packet leaves the namespace."""
    why = _can_make_namespaces()
    if why:
        pytest.skip(why)
    ns = f"mpo{os.getpid()}"
    ip = ["ip", "-n", ns]
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=10)
        for args in (["link", "set", "lo", "up"],
                     ["link", "add", "v0", "type", "veth", "peer", "name", "v1"],
                     ["addr", "add", "10.77.0.1/24", "dev", "v0"], ["link", "set", "v0", "up"],
                     ["link", "set", "v1", "up"],
                     ["neigh", "add", "10.77.0.2", "lladdr", "02:00:00:00:00:02", "dev", "v0"]):
            subprocess.run([*ip, *args], check=True, capture_output=True, timeout=10)
    except subprocess.CalledProcessError as exc:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        pytest.skip(f"cannot wire a namespace here: {exc.stderr}")
    try:
        for address, cause in (("10.77.0.2:7070", "timed out"), ("10.77.0.3:7070", "unreachable")):
            t = time.monotonic()
            done = subprocess.run(["ip", "netns", "exec", ns, "python", "-m", "minips", "worker",
                                   "--connect", address, "--timeout", "4", "--data", "synthetic"],
                                  capture_output=True, text=True, timeout=40,
                                  env={**os.environ, "PATH": _venv_path()})
            took = time.monotonic() - t
            assert done.returncode == 2 and cause in done.stderr and address in done.stderr, \
                done.stderr
            assert took < 4 + 4, f"{address}: gave up after {took:.1f} s with --timeout 4"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def _venv_path() -> str:
    """PATH with this interpreter's directory first, so `python` is the one running the test."""
    import sys
    from pathlib import Path

    return f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
