"""scripts/code_lines.py counts what a reader reads as code: docstrings, comments and blank lines
aside (docs/architecture.md's reading path is counted with it)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "code_lines.py"
SPEC = importlib.util.spec_from_file_location("code_lines", SCRIPT)
assert SPEC is not None and SPEC.loader is not None
code_lines = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(code_lines)

SAMPLE = '''"""A module docstring
over two lines."""

import os  # a comment after code counts as code


def f(x):
    """f's docstring."""
    # a comment line
    s = """a string that is
not a docstring"""
    return (x +
            1)
'''


def test_docstrings_comments_and_blank_lines_are_not_code() -> None:
    # import, def, s = (2 lines), return (2 lines)
    assert code_lines.code_lines(SAMPLE) == 6


def test_the_script_prints_each_file_and_the_total(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(SAMPLE)
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "a.py")],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.splitlines()[-1].split() == ["6", "total"]
