"""Every bad command line is refused before anything starts: exit status 2 and one line that
names the option and the value, never a traceback (the real CLI, in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import make_certificate, minips_server

# (command line, with {d} for a directory of prepared files; text the message must contain)
BAD: list[tuple[str, str]] = [
    ("server --run-config {d}/bad.json", "--run-config {d}/bad.json: not valid JSON"),
    ("server --run-config {d}/list.json", "--run-config {d}/list.json: expected a JSON object"),
    ("server --run-config {d}/nothing.json", "--run-config {d}/nothing.json: cannot read"),
    ("server --run-config {d}/typed.json", "--run-config {d}/typed.json: a value has the wrong"),
    ("server --init {d}/text.npy", "--init {d}/text.npy: not a .npy"),
    ("server --init {d}/small.npy", "--init {d}/small.npy: 10 weights, but model lenet5 has"),
    ("worker --connect 127.0.0.1:1 --threads 0", "--threads: 0"),
    ("local --slowdown 1,2 --workers 3", "--slowdown 2 factors for --workers 3"),
    ("local --slowdown 1,1,1,1,1 --workers 3", "--slowdown 5 factors for --workers 3"),
    ("local --slowdown 1,zero", "--slowdown: bad slowdown 'zero'"),
    ("local --data-dir {d}/nonexistent", "--data-dir {d}/nonexistent: no such directory"),
    ("worker --connect 127.0.0.1:1 --data-dir {d}/nonexistent", "--data-dir {d}/nonexistent"),
    ("server --port 70000", "--port: 70000"),
    ("server --port -1", "--port: -1"),
    ("server --port seven", "--port: 'seven'"),
    ("server --lr inf", "--lr: inf"),
    ("server --lr nan", "--lr: nan"),
    ("server --lr 0", "--lr 0.0: expected > 0"),
    ("server --checkpoint-every -1", "--checkpoint-every: -1"),
    ("server --compressor foo", "--compressor foo: unknown compressor"),
    ("server --model foo", "--model foo: unknown model"),
    ("server --dataset foo", "--dataset foo: unknown data set"),
    ("server --copt bogus=1", "--copt bogus=1: compressor none has no option 'bogus'"),
    ("server --compressor topk --copt bogus=1", "--copt bogus=1: compressor topk has no"),
    ("server --tls-cert {d}/nonexistent.pem", "--tls-cert {d}/nonexistent.pem: no such file"),
    ("server --tls-cert {d}/cert.pem", "--tls-cert {d}/cert.pem: no private key"),
    ("server --tls-cert {d}/bad.json --tls-key {d}/key.pem", "--tls-cert {d}/bad.json"),
    ("server --tls-key {d}/key.pem", "--tls-key {d}/key.pem: given without --tls-cert"),
    ("server --host garbage.invalid", "--host garbage.invalid"),
    ("group --connect 127.0.0.1:7070 --listen garbage.invalid", "--listen garbage.invalid"),
    ("group --connect 127.0.0.1:7070 --listen h:port", "--listen h:port: expected HOST:PORT"),
    ("group --connect 127.0.0.1:99999", "--connect 127.0.0.1:99999: port 99999"),
    ("worker --connect 127.0.0.1:0", "--connect 127.0.0.1:0: port 0"),
    ("worker --connect 127.0.0.1:1 --tls-ca {d}/bad.json", "--tls-ca {d}/bad.json: not a PEM"),
    ("worker --connect 127.0.0.1:1 --timeout -1", "--timeout: -1"),
    ("server --groups 5 --workers 4", "--groups 5: expected at most the number of workers"),
    ("server --heartbeat 6 --lease 10", "--heartbeat 6.0"),
    ("server --mode fast", "--mode 'fast'"),
    ("server --external-groups -1", "--external-groups: -1"),
    ("server --eval-every 0", "--eval-every 0.0: expected > 0"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bad")
    (d / "bad.json").write_text("{bad")
    (d / "list.json").write_text("[1, 2]")
    (d / "typed.json").write_text('{"workers": "four"}')
    (d / "text.npy").write_text("not an array")
    np.save(d / "small.npy", np.zeros(10, np.float32))
    make_certificate(d, "IP:127.0.0.1")
    return d


def run_cli(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "minips", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "MINIPS_TOKEN": ""})


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("line", "expected"), BAD, ids=[b[0].split(" {")[0] for b in BAD])
def test_a_bad_value_is_refused_in_one_line(line: str, expected: str, files: Path,
                                             tmp_path: Path) -> None:
    args = line.format(d=files).split()
    if args[0] in ("local", "server"):  # nothing may start: a run directory would show it
        args += ["--out" if args[0] == "local" else "--run-dir", str(tmp_path / "run")]
    out = run_cli(args)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert expected.format(d=files) in lines[0]
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


@pytest.mark.timeout(90)
def test_a_plain_client_is_told_that_the_server_speaks_tls(tmp_path: Path) -> None:
    cert, key = make_certificate(tmp_path, "IP:127.0.0.1")
    with minips_server(tmp_path / "run", "", "--tls-cert", str(cert),
                       "--tls-key", str(key)) as (_, host, port):
        out = run_cli(["worker", "--connect", f"{host}:{port}", "--timeout", "2",
                       "--run-dir", str(tmp_path / "w")])
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert f"{host}:{port}: the server speaks TLS; pass --tls-ca" in out.stderr
