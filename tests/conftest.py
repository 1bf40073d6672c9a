"""Fixtures and helpers shared by several test modules (helpers: ``from conftest import ...``)."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from minips.net import lifeline
from minips.record.rundir import read_jsonl
from minips.wire import messages

# Tests send SIGINT to the processes they start (Ctrl-C). A shell that runs pytest in the
# background (`cmd &` without job control) makes it ignore SIGINT, and an ignored signal stays
# ignored across exec: the children never saw it, and the tests timed out (measured: a CI run
# started with `nohup ... &`). A handler does not survive exec, so with one here the children
# start with SIGINT's default, as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def make_certificate(d: Path, *names: str) -> tuple[Path, Path]:
    """A self-signed certificate and key in ``d`` for ``names`` (subjectAltName entries such as
    "DNS:localhost" or "IP:127.0.0.1"), made with openssl; skips the test without openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl command not available")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=minips-test", "-addext", "subjectAltName=" + ",".join(names),
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate and key for 127.0.0.1 and localhost."""
    return make_certificate(tmp_path_factory.mktemp("tls"), "DNS:localhost", "IP:127.0.0.1")


@pytest.fixture()
def one_torch_thread() -> Iterator[None]:
    """One torch thread, as each worker runs: quicker than two on a shared 2-core machine."""
    import torch  # only the tests that ask for this fixture need torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def http_dir(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A loopback HTTP server on port 0 serving a fresh directory: (directory, base URL)."""
    root = tmp_path / "www"
    root.mkdir()
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a, **k: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


_REFERENCES: dict[tuple[Any, ...], np.ndarray] = {}


def cached_reference(model: str, dataset: Any, **kw: Any) -> np.ndarray:
    """``minips.ml.reference.train(model, dataset, **kw)``'s final weights (a copy), computed
    once per session for each data set and arguments: the 8-worker BSP tests of the real runner
    (both optimizer places) and of the simulator compare with the same loop."""
    import hashlib

    from minips.ml import reference

    digest = hashlib.sha256(dataset.x[:256].tobytes() + dataset.y[:4096].tobytes()).hexdigest()
    key = (model, len(dataset), digest, tuple(sorted(kw.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = reference.train(model, dataset, **kw)[0]
    return _REFERENCES[key].copy()


def wait_ready_file(ready: Path, proc: subprocess.Popen[Any],
                    timeout: float = 30.0) -> tuple[str, str]:
    """(host, port) a server process wrote to ``ready`` (its --ready-file); fails, with its
    stderr when piped, if it exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not (ready.exists() and ready.read_text().strip()):
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}: {proc.communicate()[1]}")
        assert time.monotonic() < deadline, "server did not get ready"
        time.sleep(0.05)  # polling a file with a deadline
    host, port = ready.read_text().split()
    return host, port


def wait_for(what: str, cond: Callable[[], Any], timeout: float,
             procs: tuple[subprocess.Popen[Any], ...] = ()) -> Any:
    """Poll ``cond`` until it is truthy; fail naming ``what`` after ``timeout`` seconds or when
    a process that must stay up exited."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        for p in procs:
            assert p.poll() is None, f"{p.args!r} exited with {p.returncode} while waiting: {what}"
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        time.sleep(0.1)


def records(path: Path, **match: Any) -> list[dict[str, Any]]:
    """JSON-lines records of ``path`` whose fields equal ``match`` ([] while it is missing)."""
    if not path.exists():
        return []
    return [r for r in read_jsonl(path) if all(r.get(k) == v for k, v in match.items())]


def steps(path: Path) -> list[dict[str, Any]]:
    """The step records (no events) of a JSON-lines metrics file."""
    return [r for r in records(path) if "event" not in r]


def run_t0(run_dir: Path) -> float:
    """Unix time the run in ``run_dir`` started (config.json): a record's ``t`` counts from it."""
    return float(json.loads((run_dir / "config.json").read_text())["t0"])


def logged_minips(run_dir: Path, name: str, token: str,
                  *args: str) -> subprocess.Popen[bytes]:
    """`python -m minips *args` with ``token`` as MINIPS_TOKEN, its output in run_dir/NAME.log."""
    log = open(run_dir / f"{name}.log", "wb")  # noqa: SIM115 - the child holds it
    proc = subprocess.Popen([sys.executable, "-m", "minips", *args],
                            env=lifeline.child_env({**os.environ, "MINIPS_TOKEN": token}),
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc


@contextlib.contextmanager
def minips_server(run_dir: Path, token: str,
                  *flags: str) -> Iterator[tuple[subprocess.Popen[str], str, str]]:
    """`python -m minips server --port 0 --quiet *flags` writing to ``run_dir``: (process, host,
    port) once it listens; killed at the end if it is still running."""
    ready = run_dir / "server.addr"
    proc = subprocess.Popen(
        [sys.executable, "-m", "minips", "server", "--port", "0", "--quiet", *flags,
         "--run-dir", str(run_dir), "--ready-file", str(ready)],
        env=lifeline.child_env({**os.environ, "MINIPS_TOKEN": token}), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        host, port = wait_ready_file(ready, proc)
        yield proc, host, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``cond`` until it holds or ``timeout`` passes (then fail): waiting without sleeping
    a fixed time."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def run_on(loop: str, coro: Coroutine[Any, Any, Any], timeout: float = 20.0) -> Any:
    """Run ``coro`` to completion on a fresh "asyncio" or "uvloop" event loop, bounded in time."""
    import uvloop

    ev = uvloop.new_event_loop() if loop == "uvloop" else asyncio.new_event_loop()
    try:
        return ev.run_until_complete(asyncio.wait_for(coro, timeout))
    finally:
        ev.close()


M = TypeVar("M", bound=messages.Message)


async def recv_as(ch: Any, kind: type[M], timeout: float = 10.0) -> M:
    """The next message on channel ``ch`` within ``timeout`` seconds; it must be a ``kind``."""
    msg = await asyncio.wait_for(ch.recv(), timeout)
    assert isinstance(msg, kind), f"expected {kind.__name__}, got {msg!r}"
    return msg


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes (other than this one) whose command line contains ``text``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmd:
            pids.append(int(entry.name))
    return pids


def interrupt(proc: subprocess.Popen[Any], timeout: float) -> tuple[Any, Any]:
    """Ctrl-C ``proc`` and return its (stdout, stderr); one that has not ended after
    ``timeout`` seconds is killed (no process outlives its test) and the timeout raised."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise


CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--window-size=1400,900")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium through Selenium; skipped only where chromium is not installed (make
    test installs it with apt-get where it can)."""
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.skip(f"{CHROMIUM} / {CHROMEDRIVER} not installed (apt-get install chromium "
                    "chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="minips-chromium-")
    for flag in (*CHROME_FLAGS, f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


# `make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`): most of its
# wall time is real runs waiting on leases, links and timeouts, not CPU. A module's tests stay
# together on one worker (its module-scoped servers are set up once), and the modules that
# build network namespaces, bridges and tbf links (or run the soak, which does) share one
# worker, so no two of them shape links or pick subnets at the same time.
SHAPES_LINKS = {"test_dissector", "test_links", "test_netns", "test_operator_path",
                "test_readme_netns", "test_separate_machines", "test_soak", "test_soak_findings"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        module = item.path.stem
        item.add_marker(pytest.mark.xdist_group("netns" if module in SHAPES_LINKS else module))
