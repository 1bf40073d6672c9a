"""In a TLS cluster every hop is TLS: docs/operations.md's recipe (one CA made with openssl, a
certificate per server with ``subjectAltName=IP:``) run as written, a real `minips server`, a
`minips group` and a worker on loopback; a group server that would serve its workers in plain
text is refused at registration with one line; TLS failures name their cause (a certificate not
for the address dialled, one signed by another CA, a peer that speaks plain text).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import minips_server, records, steps, wait_ready_file

from minips.core.config import RunConfig
from minips.net import transport
from minips.net.endpoints import client_ssl
from minips.server import GlobalServer, ServerConfig

SECRET = "tls-cluster-secret-0123456789"
N = 61_706  # LeNet-5, the server's default model


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str = "ca") -> None:
    """``name``.pem / ``name``.key: a CA, as docs/operations.md makes it."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl command not available")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
            f"/CN=minips {name}", "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)


def sign(d: Path, name: str, san: str, ca: str = "ca") -> tuple[str, str]:
    """``name``.pem / ``name``.key for ``san`` (e.g. IP:127.0.0.1), signed by ``ca``, as
    docs/operations.md does it; (certificate, key) paths."""
    (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout",
            f"{name}.key", "-out", f"{name}.csr", cwd=d)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.pem",
            cwd=d)
    return str(d / f"{name}.pem"), str(d / f"{name}.key")


def minips(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "minips", *args],
                          env={**os.environ, "MINIPS_TOKEN": SECRET}, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    make_ca(d)
    sign(d, "server", "IP:127.0.0.1")
    sign(d, "group", "IP:127.0.0.1")
    sign(d, "elsewhere", "IP:10.9.8.7")  # a certificate for another machine
    make_ca(d, "other-ca")
    sign(d, "stranger", "IP:127.0.0.1", ca="other-ca")  # the right address, another CA
    return d


def tls(d: Path, name: str) -> tuple[str, ...]:
    return ("--tls-cert", str(d / f"{name}.pem"), "--tls-key", str(d / f"{name}.key"))


RUN = ("--workers", "1", "--epochs", "0.05", "--mode", "ssp", "--compressor", "none",
       "--base-step", "0.02", "--external-groups", "1", "--calib-timeout", "120")


@pytest.mark.timeout(240)
def test_the_tls_recipe_runs_server_group_and_worker_to_the_end(tmp_path: Path,
                                                               certs: Path) -> None:
    np.save(tmp_path / "init.npy", np.zeros(N, np.float32))
    ca = str(certs / "ca.pem")
    with minips_server(tmp_path, SECRET, *RUN, "--init", str(tmp_path / "init.npy"),
                       *tls(certs, "server")) as (server, _, port):
        group = subprocess.Popen(
            [sys.executable, "-m", "minips", "group", "--connect", f"127.0.0.1:{port}",
             "--listen", "127.0.0.1:0", *tls(certs, "group"), "--tls-ca", ca,
             "--run-dir", str(tmp_path)],
            env={**os.environ, "MINIPS_TOKEN": SECRET}, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        try:
            worker = minips("worker", "--connect", f"127.0.0.1:{port}", "--id", "0",
                            "--tls-ca", ca, "--run-dir", str(tmp_path), timeout=180)
            assert worker.returncode == 0, worker.stderr[-2000:]
            assert server.wait(timeout=60) == 0
            assert group.wait(timeout=60) == 0, group.communicate()[1][-2000:]
        finally:
            if group.poll() is None:
                group.kill()
            group.communicate(timeout=30)
    assert len(steps(tmp_path / "worker-0.jsonl")) >= 0.05 * 60_000 / 64


def group_against(certs: Path, tmp: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """A `minips group` with ``flags`` against a TLS global server: its run ends."""
    np.save(tmp / "init.npy", np.zeros(N, np.float32))
    with minips_server(tmp, SECRET, *RUN, "--init", str(tmp / "init.npy"),
                       *tls(certs, "server")) as (_, _, port):
        return minips("group", "--connect", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0",
                      "--run-dir", str(tmp), *flags, timeout=60)


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minips group: error:"), done.stderr
    return lines[0]


def test_a_group_server_without_its_own_certificate_is_refused_at_registration(
        tmp_path: Path, certs: Path) -> None:
    line = one_line_error(group_against(certs, tmp_path, "--tls-ca", str(certs / "ca.pem")))
    assert "plain text" in line and "--tls-cert" in line


@pytest.mark.parametrize("ca, cause", [
    ("other-ca", "certificate verify failed"),  # the server's certificate: not from this CA
])
def test_a_certificate_the_group_cannot_verify_is_named(tmp_path: Path, certs: Path, ca: str,
                                                        cause: str) -> None:
    line = one_line_error(group_against(certs, tmp_path, *tls(certs, "group"), "--tls-ca",
                                        str(certs / f"{ca}.pem")))
    assert cause in line and "TimeoutError" not in line


async def test_tls_failures_name_their_cause(tmp_path: Path, certs: Path) -> None:
    """A certificate for another address, one of another CA, a plain-text server: each is one
    ``TLSError`` at once (not retried), saying which."""
    ctx = client_ssl(str(certs / "ca.pem"))
    cases = [("elsewhere", ctx, "IP address mismatch"),
             ("stranger", ctx, "certificate verify failed"),
             (None, ctx, "plain text")]
    for name, ssl, cause in cases:
        cert = None if name is None else str(certs / f"{name}.pem")
        key = None if name is None else str(certs / f"{name}.key")
        srv = GlobalServer(ServerConfig(run=RunConfig(workers=1), port=0, token=SECRET,
                                        run_dir=str(tmp_path / (name or "plain")),
                                        tls_cert=cert, tls_key=key),
                           np.zeros(4, np.float32))
        port = await srv.start()
        try:
            with pytest.raises(transport.TLSError, match=cause):
                await transport.connect("127.0.0.1", port, token=SECRET, timeout=20,
                                        retries=5, ssl=ssl)
        finally:
            await srv.close()


@pytest.mark.timeout(240)
def test_eval_under_tls_reaches_the_servers_console_and_summary(tmp_path: Path,
                                                                certs: Path) -> None:
    """`--eval` was refused with --tls-cert, and a separate evaluator's accuracy never reached
    the operator (`final accuracy - (no evaluator: --eval)`). Now the child verifies the server
    with the CA beside its certificate, its SCOREs reach the global server, whose console and
    global.jsonl carry them."""
    np.save(tmp_path / "init.npy", np.zeros(N, np.float32))
    run = ("--workers", "1", "--epochs", "0.05", "--mode", "ssp", "--compressor", "none",
           "--base-step", "0.02", "--calib-timeout", "120", "--eval-every", "1")
    ready = tmp_path / "server.addr"
    server = subprocess.Popen(
        [sys.executable, "-m", "minips", "server", "--port", "0", *run, "--eval",
         "--init", str(tmp_path / "init.npy"), *tls(certs, "server"), "--run-dir",
         str(tmp_path / "run"), "--ready-file", str(ready)],
        env={**os.environ, "MINIPS_TOKEN": SECRET}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready_file(ready, server)
        port = ready.read_text().split()[1]
        worker = minips("worker", "--connect", f"127.0.0.1:{port}", "--id", "0", "--tls-ca",
                        str(certs / "ca.pem"), "--run-dir", str(tmp_path / "w"), timeout=180)
        assert worker.returncode == 0, worker.stderr[-2000:]
        out, _ = server.communicate(timeout=120)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate(timeout=30)
    assert server.returncode == 0, out[-3000:]
    scores = [r for r in records(tmp_path / "run" / "global.jsonl") if r.get("event") == "eval"]
    assert scores and scores[-1]["final"] is True, out[-3000:]
    final = scores[-1]["accuracy"]
    assert f"final accuracy {final:.4f}" in out, out[-3000:]
    assert f"test acc {100 * final:5.1f}%" in out, out[-3000:]  # the last progress line
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_accuracy"] == pytest.approx(final, abs=1e-9)


def test_eval_under_tls_without_a_ca_beside_the_certificate_is_refused_with_the_way_around(
        tmp_path: Path, certs: Path) -> None:
    """--eval under TLS needs the CA that verifies the certificate beside it (the child
    verifies the server as a worker does); without one it is refused in one line saying so
    and naming the separate evaluator's command."""
    alone = tmp_path / "alone"
    alone.mkdir()
    for name in ("server.pem", "server.key"):  # signed by ca.pem, which is not copied
        shutil.copy(certs / name, alone / name)
    out = subprocess.run([sys.executable, "-m", "minips", "server", "--port", "0", "--eval",
                          "--tls-cert", str(alone / "server.pem"), "--tls-key",
                          str(alone / "server.key"), "--run-dir", str(tmp_path / "run"),
                          "--quiet"], env={**os.environ, "MINIPS_TOKEN": SECRET},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CA that verifies it beside it" in lines[0], out.stderr
    assert "minips evaluator --connect" in lines[0]
