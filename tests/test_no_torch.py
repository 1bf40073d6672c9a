"""The servers' path runs without torch: imported and started with torch made unimportable."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import wait_ready_file

BLOCK_TORCH = textwrap.dedent("""
    import importlib.abc, sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is blocked in this test")
            return None

    sys.meta_path.insert(0, NoTorch())
""")


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=60)


def test_blocker_really_blocks_torch() -> None:
    proc = _run("import torch")
    assert proc.returncode != 0 and "torch is blocked" in proc.stderr


def test_server_modules_import_and_a_global_server_serves_without_torch() -> None:
    proc = _run("""
        import asyncio, sys
        import minips.server, minips.serve.group, minips.serve.group_process, minips.wire.messages
        import minips.net.transport, minips.sparse, minips.grouping, minips.core.ssp
        import minips.core.optim
        import minips.record.metrics, minips.record.checkpoint, minips.run.cli
        import minips.dashboard.monitor, minips.dashboard.web  # --dashboard's server side
        assert "torch" not in sys.modules
        print("imports ok")
    """)
    assert proc.returncode == 0, proc.stderr
    assert "imports ok" in proc.stdout


def test_minips_server_command_starts_without_torch(tmp_path: Path) -> None:
    """`minips server` with torch blocked comes up, listens, and accepts a TCP connection."""
    ready = tmp_path / "server.addr"
    code = BLOCK_TORCH + textwrap.dedent("""
        import sys
        from minips.run.cli import main
        sys.exit(main())
    """)
    args = ["server", "--port", "0", "--workers", "1", "--quiet", "--ready-file", str(ready),
            "--run-dir", str(tmp_path / "run")]
    env = {**os.environ, "MINIPS_TOKEN": "test-secret"}
    proc = subprocess.Popen([sys.executable, "-c", code, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        host, port = wait_ready_file(ready, proc)
        socket.create_connection((host, int(port)), timeout=5).close()
        assert proc.poll() is None
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "torch is blocked" not in err
