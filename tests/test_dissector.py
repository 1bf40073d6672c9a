"""The Wireshark dissector (tools/wireshark/minips.lua) and a real run's frames seen three ways.

The dissector is generated from minips/wire's tables (scripts/gen_dissector.py): regenerated
here and compared byte for byte, so it cannot drift from the code.

One short real 2-worker `minips local --trace` runs in a network namespace of its own, while
tcpdump captures its loopback (only this run's frames: the machine's own loopback carries
whatever else runs). Its frames are then read three ways that must agree: the roles' trace
files (`minips trace RUN_DIR`), the capture decoded by `minips trace --pcap`, and tshark with
the dissector, which must decode every frame with its kind, length and every key of its map.
The capture parts skip, saying why, without root, ip, tcpdump or tshark.
"""

from __future__ import annotations

import collections
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from minips.run import trace_cmd
from minips.wire.kinds import meta_keys
from minips.wire.messages import Kind

ROOT = Path(__file__).resolve().parents[1]
LUA = ROOT / "tools" / "wireshark" / "minips.lua"
RUN_S = 150  # the run's hard limit (seconds); it takes about 20-30 s on 2 busy cores


def load_generator() -> Any:
    spec = importlib.util.spec_from_file_location("gen_dissector",
                                                  ROOT / "scripts" / "gen_dissector.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_dissector_is_what_the_tables_give_byte_for_byte():
    gen = load_generator()
    assert LUA.read_text(encoding="utf-8") == gen.render(), \
        "tools/wireshark/minips.lua is stale: run scripts/gen_dissector.py"
    for kind in Kind:  # every kind and every key of its map is in it
        assert f'[{int(kind)}] = "{kind.name}"' in gen.render()
        for key in meta_keys(kind):
            assert f'  "{key}",' in gen.render()


def test_the_generator_check_mode_sees_a_stale_file(tmp_path: Path):
    stale = tmp_path / "minips.lua"
    stale.write_text(LUA.read_text().replace('"PUSH"', '"PUSHED"'))
    cmd = [sys.executable, str(ROOT / "scripts" / "gen_dissector.py"), "--check", "--out"]
    proc = subprocess.run(cmd + [str(stale)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "run scripts/gen_dissector.py" in proc.stderr
    proc = subprocess.run(cmd + [str(LUA)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# -- one real run, captured ------------------------------------------------------------------

def _capture_missing() -> str:
    """Why this machine cannot capture the run in a namespace of its own ("" if it can)."""
    if os.geteuid() != 0:
        return "needs root (a network namespace and tcpdump)"
    missing = [t for t in ("ip", "tcpdump", "tshark") if shutil.which(t) is None]
    return f"{', '.join(missing)} not installed" if missing else ""


def _wait_for(path: Path, mark: bytes, proc: subprocess.Popen[bytes], seconds: float,
              failed: str) -> None:
    """Poll ``path`` until it holds ``mark``; ``failed`` (with the file's tail) if ``proc``
    ends or ``seconds`` pass first."""
    deadline = time.monotonic() + seconds
    while mark not in path.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{failed}: {path.read_bytes()[-500:].decode(errors='replace')}")
        time.sleep(0.05)


END_MARK = b"minips-test: the run has ended"

# One connection on the namespace's loopback that carries END_MARK, sent after the run: tcpdump
# writes packets in the order the kernel gave them, so once the mark is in the file, every frame
# of the run before it is too. (Stopped at once, tcpdump loses what it has not read yet: once on
# a busy CI machine, the run's last three frames.)
_SEND_MARK = f"""
import socket
with socket.create_server(("127.0.0.1", 0)) as srv:
    with socket.create_connection(srv.getsockname(), timeout=10) as c:
        peer, _ = srv.accept()
        c.sendall({END_MARK!r})
        peer.recv(100)
        peer.close()
"""


def _local(run_root: Path, prefix: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = [*prefix, sys.executable, "-m", "minips", "local", "--workers", "2", "--max-steps",
           "6", "--sync-every", "2", "--no-plot", "--no-progress", "--out", str(run_root),
           "--name", "run", "--eval-every", "0.5", "--trace"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_S,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The run directory, and its capture (None, with the reason, where none can be made)."""
    root = tmp_path_factory.mktemp("traced")
    why = _capture_missing()
    if why:
        proc = _local(root, [])
        assert proc.returncode == 0, proc.stderr[-3000:]
        return {"run": root / "run", "pcap": None, "why": why}
    ns = f"minips-trace-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True, timeout=30)
    dump = None
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"],
                       check=True, timeout=30)
        err = root / "tcpdump.err"
        with open(err, "wb") as f:
            # -B: a 64 MB capture buffer (the default 2 MB dropped a dense PUSH under load, and
            # tshark then decoded 15 of the 16 PUSHes the traces hold)
            dump = subprocess.Popen(["ip", "netns", "exec", ns, "tcpdump", "-i", "lo", "-U",
                                     "-B", "65536", "-w", str(root / "cap.pcap"), "tcp"],
                                    stderr=f)
        _wait_for(err, b"listening on", dump, 30, "tcpdump did not start")
        proc = _local(root, ["ip", "netns", "exec", ns])
        assert proc.returncode == 0, proc.stderr[-3000:]
        subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", _SEND_MARK],
                       check=True, timeout=30)
        _wait_for(root / "cap.pcap", END_MARK, dump, 30, "tcpdump never wrote the end mark")
    finally:
        if dump is not None:
            dump.send_signal(signal.SIGTERM)  # all of the run is in the file by now
            dump.wait(timeout=30)
        subprocess.run(["ip", "netns", "del", ns], timeout=30)
    return {"run": root / "run", "pcap": root / "cap.pcap", "why": ""}


def _wire_frames(run: Path) -> list[trace_cmd.Frame]:
    """The frames that crossed TCP, from the trace files (an in-process exchange did not)."""
    got, _ = trace_cmd.load_frames(trace_cmd.trace_files(run))
    return [f for f in got if not f.inproc]


def test_every_role_traces_and_minips_trace_shows_a_training_step(captured: dict[str, Any]):
    run = captured["run"]
    names = sorted(p.name for p in run.glob("*.trace.jsonl"))
    assert names == ["evaluator.trace.jsonl", "server.trace.jsonl", "worker-0.trace.jsonl",
                     "worker-1.trace.jsonl"]
    proc = subprocess.run([sys.executable, "-m", "minips", "trace", str(run)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if not line.startswith("#")]
    seen = collections.Counter((r[1], r[3], r[4]) for r in rows)
    for src, dst, kind in (("worker-0", "group-0", "PULL"), ("group-0", "worker-1", "WEIGHTS"),
                           ("worker-1", "group-0", "PUSH"), ("group-0", "worker-0", "ACK"),
                           ("group-0", "server", "EXCHANGE"),
                           ("server", "group-0", "EXCHANGE_REPLY"),
                           ("evaluator", "server", "PULL"),
                           ("server", "evaluator", "GLOBAL_WEIGHTS")):
        assert seen[(src, dst, kind)] >= 1, (src, dst, kind)
    # a training step's frames carry the SSP clock and the version
    assert any(r[4] == "PUSH" and "clock=" in " ".join(r) for r in rows)
    assert any(r[4] == "WEIGHTS" and "version=" in " ".join(r) for r in rows)
    assert (run / "trace-chart.png").stat().st_size > 0
    svg = (run / "trace-chart.svg").read_text()
    assert "PULL" in svg and "EXCHANGE_REPLY" in svg and "group-0" in svg


def _skip_without_capture(captured: dict[str, Any]) -> Path:
    if captured["pcap"] is None:
        pytest.skip(f"no capture: {captured['why']}")
    return Path(captured["pcap"])


def test_the_capture_decodes_to_the_conversation_the_traces_hold(captured: dict[str, Any]):
    pytest.importorskip("dpkt")
    pcap = _skip_without_capture(captured)
    traced = collections.Counter((f.src, f.dst, f.kind, f.nbytes)
                                 for f in _wire_frames(captured["run"]))
    decoded = collections.Counter((f.src, f.dst, f.kind, f.nbytes)
                                  for f in trace_cmd.read_pcap(pcap))
    assert decoded == traced
    assert sum(traced.values()) > 50


def test_tshark_with_the_dissector_decodes_every_frame_and_its_fields(captured: dict[str, Any]):
    pcap = _skip_without_capture(captured)
    cmd = ["tshark", "-X", f"lua_script:{LUA}", "-r", str(pcap),
           "-o", "tcp.try_heuristic_first:TRUE", "-Y", "minips", "-T", "fields",
           "-e", "minips.kind_name", "-e", "minips.frame_len", "-e", "minips.keys",
           "-e", "minips.meta.clock", "-E", "aggregator=|", "-E", "separator=/t"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    decoded: collections.Counter[tuple[str, int]] = collections.Counter()
    clocks = 0
    for line in proc.stdout.splitlines():
        kinds, lengths, keys, clock = (line.split("\t") + ["", "", "", ""])[:4]
        rows = list(zip(kinds.split("|"), lengths.split("|"), keys.split("|"), strict=True))
        for kind, length, got in rows:
            assert got == " ".join(meta_keys(Kind[kind])), (kind, got)  # every key decoded
            decoded[(kind, int(length))] += 1
        clocks += len([c for c in clock.split("|") if c])
    traced = collections.Counter((f.kind, f.nbytes) for f in _wire_frames(captured["run"]))
    assert decoded == traced
    assert {k for k, _ in decoded} >= {"HELLO", "CHALLENGE", "AUTH", "WELCOME", "ASSIGN",
                                       "STATS", "PULL", "WEIGHTS", "PUSH", "ACK",
                                       "GLOBAL_WEIGHTS", "LEAVE"}
    with_clock = sum(n for (kind, _), n in decoded.items() if "clock" in meta_keys(Kind[kind]))
    assert clocks == with_clock > 0  # the SSP clock of every frame that has one
