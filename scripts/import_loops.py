"""Import loops among minips's modules: every import counts as an edge, at module level, inside a
function, or under ``if TYPE_CHECKING:`` (a late import hides a loop; it does not remove it).

Usage: python scripts/import_loops.py [--only mod1,mod2,...] [--root minips]

Prints each loop (a strongly connected set of modules, with one cycle through it) and exits 1
when there is one; with ``--only`` only loops through one of the named modules (``worker``,
``minips.worker`` or ``dashboard.web``) count. ``from minips import x`` is an edge to the module
``minips.x`` when there is one, else to the package ``minips``.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the package at ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The package's modules that module ``name`` imports, anywhere in its file."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package of this module, up level - 1
                pkg = _package_of(name, path).split(".")
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    yield sub
                elif base in known:
                    yield base


def graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (no self edges)."""
    known = modules(root)
    return {m: set(imports(m, p, known)) - {m} for m, p in known.items()}


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def cycle(edges: dict[str, set[str]], comp: list[str]) -> list[str]:
    """One cycle through the first module of ``comp`` (breadth-first, inside ``comp``)."""
    start, inside = comp[0], set(comp)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges[v] & inside):
            if w == start:
                return [*paths[v], start]
            if w not in paths:
                paths[w] = [*paths[v], w]
                queue.append(w)
    return comp


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent / "minips"))
    ap.add_argument("--only", default="", help="comma list of modules whose loops count")
    args = ap.parse_args(argv)
    root = Path(args.root)
    edges = graph(root)
    only = {m if m.startswith(root.name + ".") else f"{root.name}.{m}"
            for m in filter(None, args.only.split(","))}
    loops = [c for c in strongly_connected(edges) if not only or only & set(c)]
    for comp in loops:
        print(f"loop of {len(comp)} modules: {' -> '.join(cycle(edges, comp))}"
              f"  (all: {', '.join(comp)})")
    if not loops:
        print(f"no import loop among {len(edges)} modules" + (f" through {len(only)} named"
                                                              if only else ""))
    return 1 if loops else 0


if __name__ == "__main__":
    sys.exit(main())
