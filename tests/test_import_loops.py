"""Import loops (scripts/import_loops.py): the checker finds late and TYPE_CHECKING imports, and
no loop runs through the transport, worker, launch, CLI, metrics, config, data or model modules.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import import_loops  # noqa: E402

# the modules split by concept (issue 16); a loop through any of them fails this test
SPLIT = ("channel frame_protocol transport tcp_server net_retry endpoints worker worker_link "
         "worker_control worker_setup evaluator cli cli_flags cli_parser cli_checks launch "
         "cluster progress server_process metrics rundir hops config data data_files models "
         "model_nets reference device plot presets").split()


def test_late_and_type_checking_imports_count_as_edges(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.c import x\n    return x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from . import a\nx = 1\n")
    (pkg / "d.py").write_text("import pkg.a\n")  # into the loop, not part of it
    edges = import_loops.graph(pkg)
    assert import_loops.strongly_connected(edges) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert import_loops.cycle(edges, ["pkg.a", "pkg.b", "pkg.c"]) == [
        "pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    assert import_loops.main(["--root", str(pkg)]) == 1
    assert import_loops.main(["--root", str(pkg), "--only", "d"]) == 0


def test_no_loop_through_the_split_modules() -> None:
    edges = import_loops.graph(ROOT / "minips")
    named = {f"minips.{m}" for m in SPLIT}
    assert named <= set(edges)  # every name is a module (a rename must update the list)
    loops = [c for c in import_loops.strongly_connected(edges) if named & set(c)]
    assert loops == []
