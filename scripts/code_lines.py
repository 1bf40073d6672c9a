"""Code lines of Python files: the lines a reader reads as code, docstrings, comments and blank
lines aside (Python's tokenizer decides; a docstring is a string that is a statement of its
own). docs/architecture.md's reading path counts its files this way, and
tests/test_reading_path.py holds the page to it.

Usage: python scripts/code_lines.py FILE...   (one line per file, then the total)
"""

from __future__ import annotations

import io
import sys
import tokenize
from pathlib import Path

LAYOUT = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
          tokenize.ENDMARKER}
BEFORE_STATEMENT = {tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}


def code_lines(source: str) -> int:
    """How many lines of ``source`` hold code, not counting docstrings, comments, blank lines."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    docstrings = {line for i, t in enumerate(tokens) if _is_docstring(tokens, i)
                  for line in range(t.start[0], t.end[0] + 1)}
    return len({line for t in tokens if t.type not in LAYOUT
                for line in range(t.start[0], t.end[0] + 1)} - docstrings)


def _is_docstring(tokens: list[tokenize.TokenInfo], i: int) -> bool:
    """Token ``i`` is a string that makes a statement on its own (first in it and last)."""
    if tokens[i].type != tokenize.STRING:
        return False
    before = next((t for t in reversed(tokens[:i]) if t.type not in (tokenize.NL,
                                                                     tokenize.COMMENT)), None)
    after = next(t for t in tokens[i + 1:] if t.type not in (tokenize.NL, tokenize.COMMENT))
    return (before is None or before.type in BEFORE_STATEMENT) and \
        after.type in (tokenize.NEWLINE, tokenize.ENDMARKER)


def main(paths: list[str]) -> int:
    total = 0
    for path in paths:
        n = code_lines(Path(path).read_text())
        total += n
        print(f"{n:6,d}  {path}")
    print(f"{total:6,d}  total")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
