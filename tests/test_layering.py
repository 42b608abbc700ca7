"""The package's structure as docs/ARCHITECTURE.md states it: imports point one way, one
module reads the environment, no file grows past a size one can read."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "specserve"

# Top to bottom: a room may import itself and any room below it, never one above.
ORDER = [
    {"server", "cli", "bench", "train"},
    {"engine"},
    {"runtime"},
    {"speculative"},
    {"model"},
    {"ops"},
    {"kv"},
]
# Leaves any room may import; they import only leaves (config also the registry's data).
LEAVES = {"errors", "sampling_params", "device", "config"}
LEAF_EXCEPTIONS = {("config", "specserve.model.registry")}
MAX_LINES = 600


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "specserve" else None


def _rank(room: str) -> int:
    return next(i for i, rooms in enumerate(ORDER) if room in rooms)


def _imports(path: pathlib.Path) -> list[str]:
    """Every specserve module this file imports, at the top or inside functions."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    package = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this file's package
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append(module)
            out += [f"{module}.{a.name}" for a in node.names]  # `from pkg import module`
    return [m for m in out if m.startswith("specserve.") and _is_module(m)]


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _sources() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_imports_point_one_way():
    wrong = []
    for path in _sources():
        rel = path.relative_to(PACKAGE.parent)
        src = _room(".".join(rel.with_suffix("").parts))
        if src is None or src == "__init__":  # the package root re-exports
            continue
        for target in _imports(path):
            dst = _room(target)
            if dst is None or dst == src or dst == "__init__":
                continue
            if src in LEAVES:
                ok = dst in LEAVES or (src, target) in LEAF_EXCEPTIONS
            elif dst in LEAVES:
                ok = True
            else:
                ok = _rank(dst) >= _rank(src)
            if not ok:
                wrong.append(f"{rel} imports {target}")
    assert not wrong, "imports against the room order:\n" + "\n".join(wrong)


def test_every_room_is_placed():
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    rooms |= {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    placed = set().union(*ORDER) | LEAVES
    assert rooms <= placed, f"rooms without a place in the order: {sorted(rooms - placed)}"


def test_one_module_reads_the_environment():
    readers = sorted(
        str(p.relative_to(PACKAGE.parent))
        for p in _sources()
        if "os.environ" in p.read_text() or "getenv(" in p.read_text()
    )
    assert readers == ["specserve/config/environment.py"], readers


def test_no_source_file_is_too_long_to_read():
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in _sources()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files above {MAX_LINES} lines: {long}"


def test_the_checker_sees_a_wrong_arrow(tmp_path):
    """The import walker itself: a lazy import inside a function is found."""
    src = "def f():\n    from specserve.runtime.worker import Worker\n"
    path = PACKAGE / "ops" / "attention.py"
    names = [n.module for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom)]
    assert names == ["specserve.runtime.worker"]
    assert "specserve.kv.pool" in _imports(path)
