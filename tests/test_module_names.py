"""Every module a reader is pointed to exists: the names in the package's docstrings and comments,
in docs/*.md and in README.md, checked against the tree; and no merge banner is left.

A reference is a path (``core/exchange.py``, ``minips/sim/timing.py``, ``server.py``), a dotted
name whose first part is a minips module, current or former (``exchange.Merged``,
``ssp.ClockTable.may_start``, ``minips.core.roster``), or a minips class's member
(``GroupCore.push``). ``np.float32``, ``self.x`` or ``e.g.`` are not references: their first
part names no minips module or class. The sources are read (ast, tokenize), not imported.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "minips"

# modules the package had once and has no more: a dotted name or a lone ``name`` that starts with
# one of these points a reader at nothing (git history; the merges of the third version)
FORMER = {
    "cli_checks", "cli_flags", "cli_parser", "cli_ray", "cli_simulate", "client_sessions",
    "clock_counts", "frame_protocol", "global_actions", "global_messages", "global_state",
    "group_actions", "group_peer", "group_sessions", "inproc_group", "logcounts", "message_base",
    "model_nets", "model_table", "net_retry", "once_per_turn", "partial_frame", "ray_launch",
    "ray_roles", "replica", "run_end", "server_checkpoint", "server_groups", "server_io",
    "server_process", "sim_config", "sim_cores", "sim_objective", "sim_timing", "sparse_codec",
    "sparse_select", "tcp_server", "unsaved", "worker_control", "worker_link", "worker_setup",
}
# endings after a module-like word that make it a file name, not a module's attribute
FILE_ENDINGS = {"md", "json", "jsonl", "toml", "png", "txt", "csv", "npz", "html", "log", "yaml",
                "yml", "sh", "cfg", "ini", "gz", "pt", "pth", "svg", "js", "css", "pem", "key",
                "crt"}
# subpackages whose names are also everyday variables (``run.ratio``: a RunConfig's field,
# ``core.failure``: a role core's, ``wire.dtype``: a compressor's wire spec): not references
VARIABLES = {"run", "core", "wire"}
BANNER = re.compile(r"^# -- ([a-z_]+): ")  # a merge's banner names the module it came from
PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)\b")
DOTTED = re.compile(r"(?<![\w./-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")
# alone, only the former names no prose or variable uses (``replica`` is also a word)
LONE_FORMER = re.compile(r"\b(" + "|".join(sorted(n for n in FORMER if "_" in n)) + r")\b")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in PKG.rglob("*.py")}
BY_LAST: dict[str, list[str]] = {}  # the last part of a module's name -> the modules so named
for _name in MODULES:
    BY_LAST.setdefault(_name.rsplit(".", 1)[-1], []).append(_name)
TREE_FILES = {p.name for d in (PKG, ROOT / "tests", ROOT / "scripts") for p in d.rglob("*.py")}


def _class_names(cls: ast.ClassDef) -> set[str]:
    """What a class defines: its body's names and every ``self.x =`` in its methods."""
    out: set[str] = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
    return out


def _top_level(module: str) -> dict[str, ast.AST | None]:
    """A module's top-level names: its classes (to look inside), other names (None)."""
    out: dict[str, ast.AST | None] = {}
    for node in ast.parse(MODULES[module].read_text()).body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update({(a.asname or a.name).split(".")[0]: None for a in node.names})
        else:
            out.update({n.id: None for n in ast.walk(node)
                        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)})
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and \
                    ast.unparse(node.targets[0]) == "_LAZY":  # minips' names loaded on first use
                out.update({str(k.value): None for k in node.value.keys
                            if isinstance(k, ast.Constant)})
    return out


TOP = {m: _top_level(m) for m in MODULES}


def _resolves(module: str, rest: list[str]) -> bool:
    """``module`` then ``rest`` names a submodule, a top-level name, or a class's member."""
    if not rest:
        return True
    if f"{module}.{rest[0]}" in MODULES:
        return _resolves(f"{module}.{rest[0]}", rest[1:])
    top = TOP[module]
    if rest[0] not in top:
        return False
    node = top[rest[0]]
    return len(rest) == 1 or not isinstance(node, ast.ClassDef) or rest[1] in _class_names(node)


CLASSES: dict[str, list[ast.ClassDef]] = {}  # every minips class by name
for _path in MODULES.values():
    for _node in ast.walk(ast.parse(_path.read_text())):
        if isinstance(_node, ast.ClassDef):
            CLASSES.setdefault(_node.name, []).append(_node)


def _members(name: str, seen: tuple[str, ...] = ()) -> set[str] | None:
    """What a minips class and its minips bases define; None when a base is not ours (an
    ``Exception``, an ``IntEnum``): its members are not read here."""
    out: set[str] = set()
    for cls in CLASSES.get(name, []):
        out |= _class_names(cls)
        for base in cls.bases:
            b = ast.unparse(base).split("[")[0].split(".")[-1]
            if b in ("object", "Protocol", "Generic"):
                continue
            inherited = None if b not in CLASSES or b in seen else _members(b, (*seen, name))
            if inherited is None:
                return None
            out |= inherited
    return out


def member_is_dead(name: str) -> bool:
    """``Class.member`` where Class is a minips class (and no module) that lacks the member."""
    parts = name.split(".")
    if parts[0] not in CLASSES or parts[0] in BY_LAST or parts[-1] in FILE_ENDINGS:
        return False
    members = _members(parts[0])
    return members is not None and parts[1] not in members


def dotted_is_dead(name: str) -> bool:
    """A dotted name whose first part is a minips module (or was one) that names nothing."""
    parts = name.split(".")
    if parts[-1] in FILE_ENDINGS or parts[-1] == "py" or parts[0] in VARIABLES:
        return False
    if parts[0] in FORMER and parts[0] not in BY_LAST:
        return True
    if parts[0] == "minips":
        return not _resolves("minips", parts[1:])
    candidates = BY_LAST.get(parts[0], [])
    return bool(candidates) and not any(_resolves(m, parts[1:]) for m in candidates)


def path_is_dead(path: str) -> bool:
    """A ``.py`` path that is no file of the tree (from the root, the package, or a bare name)."""
    if "/" not in path:
        return path not in TREE_FILES
    return not ((ROOT / path).is_file() or (PKG / path).is_file())


def dead_names(text: str) -> Iterator[str]:
    """The references in one line of text that name nothing (a former module's name once)."""
    spans = []  # what the path and dotted checks read: a former name inside is theirs
    for m in PATH.finditer(text):
        spans.append(m.span(1))
        if path_is_dead(m.group(1)):
            yield m.group(1)
    for m in DOTTED.finditer(text):
        spans.append(m.span(1))
        if dotted_is_dead(m.group(1).rstrip(".")) or member_is_dead(m.group(1).rstrip(".")):
            yield m.group(1)
    for m in LONE_FORMER.finditer(text):
        if not any(a <= m.start() and m.end() <= b for a, b in spans):
            yield m.group(1)


def source_texts(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of each comment and each line of each docstring of a module."""
    src = path.read_text()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                for i, line in enumerate(body[0].value.value.splitlines()):
                    yield body[0].lineno + i, line


def all_texts() -> Iterator[tuple[str, int, str]]:
    for path in sorted(PKG.rglob("*.py")):
        for line, text in source_texts(path):
            yield str(path.relative_to(ROOT)), line, text
    for path in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        for line, text in enumerate(path.read_text().splitlines(), 1):
            yield str(path.relative_to(ROOT)), line, text


def test_the_checker_tells_references_from_words():
    assert dotted_is_dead("replica.exchange_ratio")
    assert dotted_is_dead("global_actions.Log")
    assert dotted_is_dead("exchange.NoSuchThing")
    assert dotted_is_dead("ssp.ClockTable.no_such_method")
    assert not dotted_is_dead("exchange.exchange_ratio")
    assert not dotted_is_dead("ssp.ClockTable.may_start")
    assert not dotted_is_dead("minips.core.exchange")
    assert not dotted_is_dead("minips.GlobalServer")  # the package loads it on first use
    assert member_is_dead("ClockTable.no_such_method")
    assert not member_is_dead("ClockTable.may_start")
    assert not member_is_dead("RunConfig.down_mode")  # a dataclass field
    for word in ("np.float32", "self.x", "e.g", "protocol.md", "exchange.py", "i.e",
                 "run.ratio", "server.pem"):
        assert not dotted_is_dead(word), word
    assert path_is_dead("core/replica.py") and path_is_dead("worker_link.py")
    assert not path_is_dead("core/exchange.py") and not path_is_dead("minips/sim/timing.py")
    assert list(dead_names("see ``global_actions`` and core/nothing.py")) == [
        "core/nothing.py", "global_actions"]
    assert list(dead_names("``sim_timing.Links``")) == ["sim_timing.Links"]


def test_every_module_named_in_docstrings_comments_and_docs_exists():
    texts = sorted(all_texts())  # by file and line, comments and docstrings together
    assert len(texts) > 5000  # the package and its docs were read, not an empty list
    dead = [f"{where}:{line}: {name}" for where, line, text in texts for name in dead_names(text)]
    assert not dead, "names of modules (or of their members) that do not exist:\n" + \
        "\n".join(dead)


def is_banner(line: str) -> bool:
    """``# -- name: ...`` where name is a module's, now or once: what a merge left. A section
    comment (``# -- encoding: a message in, ...``, ``# -- the rules ---``) is not one."""
    m = BANNER.match(line)
    return m is not None and m.group(1) in {*BY_LAST, *FORMER}


def test_the_banner_check_tells_banners_from_section_comments():
    assert is_banner("# -- global_actions: What the global server's rules ...")
    assert is_banner("# -- group: Group server: one group's model copy, SGD state ...")
    assert not is_banner("# -- encoding: a message in, the bytes of its frame out ---")
    assert not is_banner("# -- the listening side: serve and Server ---")


def test_no_merge_banner_is_left():
    found = [f"{p.relative_to(ROOT)}:{i}: {line[:60]}"
             for d in (PKG, ROOT / "scripts") for p in sorted(d.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if is_banner(line)]
    assert not found, "merge banners naming an old module:\n" + "\n".join(found)


# names that said two things once, and what they are called now (issue 40): a reader meeting
# the old one in code or docs would look for something that is not there
RENAMED = {
    r"\bSendRatios\b": "actions.SendSettings (ratios and H)",
    r"\bsend_ratio\b": "GroupPeer.send_settings",
    r"\bheld_version\b": "downlink.trusted_since",
    r"\bReplica\b": "exchange.GroupMirror (the global server's mirror of a group's copy)",
    r"\bworker\.Link\b|\bclass Link\b": "worker.EmulatedLink",
    r"\bexchange\.Exchange\b|\bExchange\.(begin|complete|pulled)\b": "exchange.GroupSync",
}


def test_no_name_renamed_for_one_meaning_is_left():
    texts = [p for p in PKG.rglob("*.py")] + [
        p for p in (ROOT / "docs").glob("*.md")
        if p.name not in ("performance.md", "results.md")]  # measured records: the lead's
    left = [f"{p.relative_to(ROOT)}: {old} (now {new})" for p in texts
            for old, new in RENAMED.items() if re.search(old, p.read_text(encoding="utf-8"))]
    assert not left, "\n".join(left)
