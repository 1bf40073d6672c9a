"""docs/architecture.md's reading path names real files with their true code lines and total
(scripts/code_lines.py), holds one gradient's whole round trip (the worker's rules, the wire,
the group's, the global merge) and stays within 1,500 code lines."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("code_lines", ROOT / "scripts" / "code_lines.py")
assert SPEC is not None and SPEC.loader is not None
code_lines = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(code_lines)

ROW = re.compile(r"^\| (\d+) \| `(minips/[\w/]+\.py)` \| ([\d,]+) \|", re.M)


def test_the_reading_paths_table_counts_what_the_files_hold() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    section = page.split("## Reading path", 1)[1].split("\n## ", 1)[0]
    rows = ROW.findall(section)
    assert [int(n) for n, _, _ in rows] == list(range(1, len(rows) + 1))
    paths = [p for _, p, _ in rows]
    # one gradient's round trip: the worker's rules, the wire, the group's, the global merge
    assert {"minips/core/worker_core.py", "minips/wire/messages.py", "minips/core/group_core.py",
            "minips/core/exchange.py", "minips/core/merge.py"} <= set(paths)
    counts = {p: code_lines.code_lines((ROOT / p).read_text()) for p in paths}
    assert {p: int(c.replace(",", "")) for _, p, c in rows} == counts
    total = re.search(r"([\d,]+) lines of code", section)
    assert total is not None and int(total.group(1).replace(",", "")) == sum(counts.values())
    assert sum(counts.values()) <= 1500, "the reading path is read in about an hour (issue 57)"
