"""The import rules that docs/ARCHITECTURE.md states, checked against the code.

The document's ``parts`` block names every module's part and what each part may
import; this test reads that block, reads every module's imports (those under
``if TYPE_CHECKING:`` too: a type-only import is still an arrow between parts), and
fails on a module no part names, an import a rule does not allow, a third-party import
a pure part may not make, or a circle of imports between modules.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
# installed layout: the folders beside kvstore/ are subpackages of kvstore
PACKAGES = {"kvstore": ROOT / "kvstore", "kvstore.tiers": ROOT / "tiers",
            "kvstore.scheduler": ROOT / "scheduler", "kvstore.kernels": ROOT / "kernels",
            "kvstore.plugins": ROOT / "plugins"}
# what a pure part (one marked "pure" in the block) may never import
IO_MODULES = {"zmq", "asyncio", "uvloop", "socket", "lmdb", "aiofiles", "mmap", "redis",
              "torch", "cupy", "prometheus_client", "threading", "subprocess"}


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if any(name.startswith(other + ".") or name == other
                   for other in PACKAGES if other != package and other.startswith(package + ".")):
                continue  # a folder mapped as a package of its own
            found[name] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module ``name`` imports (absolute names), type-only imports included."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            named = [f"{mod}.{alias.name}" for alias in node.names]
            inner = [n for n in named if n in known]  # from kvstore import protocol
            out.update(inner if inner else [mod])
    return out


def rules() -> tuple[dict[str, str], dict[str, set[str]], set[str]]:
    """(module -> part, part -> parts it may import, pure parts) from the document."""
    text = DOC.read_text()
    block = re.search(r"```parts\n(.*?)```", text, re.S)
    assert block, "docs/ARCHITECTURE.md has no ```parts block"
    part_of: dict[str, str] = {}
    may: dict[str, set[str]] = {}
    pure: set[str] = set()
    for line in block.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        head, _, rest = line.partition(":")
        part, *flags = head.split()
        members, _, allowed = rest.partition("->")
        may[part] = set(allowed.split())
        if "pure" in flags:
            pure.add(part)
        for member in members.split():
            part_of[member] = part
    return part_of, may, pure


def _part(module: str, part_of: dict[str, str]) -> str | None:
    """The part of a module: its own entry, or its package's (``kvstore.kernels.*``)."""
    if module in part_of:
        return part_of[module]
    name = module.rpartition(".")[0]
    while name.count("."):  # within a subpackage (kvstore.kernels.copy), not the face
        if name in part_of:
            return part_of[name]
        name = name.rpartition(".")[0]
    return None


def test_every_module_has_a_part_and_imports_only_what_its_part_may() -> None:
    part_of, may, pure = rules()
    mods = modules()
    unplaced = sorted(m for m in mods if _part(m, part_of) is None)
    assert not unplaced, f"modules no part of docs/ARCHITECTURE.md names: {unplaced}"
    wrong: set[str] = set()
    for name, path in sorted(mods.items()):
        mine = _part(name, part_of)
        assert mine is not None
        for target in imports_of(name, path, mods):
            top = target.split(".")[0]
            if top == "kvstore":
                if target not in mods and target.rpartition(".")[0] not in mods:
                    continue
                real = target if target in mods else target.rpartition(".")[0]
                theirs = _part(real, part_of)
                if theirs != mine and theirs not in may[mine]:
                    wrong.add(f"{name} ({mine}) imports {real} ({theirs})")
            elif mine in pure and top in IO_MODULES:
                wrong.add(f"{name} ({mine}, pure) imports {top}")
    assert not wrong, "imports the rules do not allow:\n" + "\n".join(sorted(wrong))


def test_no_circle_of_imports() -> None:
    mods = modules()
    graph = {name: {t if t in mods else t.rpartition(".")[0]
                    for t in imports_of(name, path, mods)
                    if t in mods or t.rpartition(".")[0] in mods} - {name}
             for name, path in mods.items()}
    # a package's __init__ that only hands names on is not an arrow back
    state: dict[str, int] = {}
    circle: list[str] = []

    def visit(node: str, stack: list[str]) -> bool:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if mods[nxt].name == "__init__.py" and node.startswith(nxt + "."):
                continue  # a module importing its own package's face
            if state.get(nxt) == 1:
                circle.extend(stack[stack.index(nxt):] + [nxt])
                return True
            if state.get(nxt) is None and visit(nxt, stack):
                return True
        stack.pop()
        state[node] = 2
        return False

    for name in sorted(graph):
        if state.get(name) is None and visit(name, []):
            break
    assert not circle, "a circle of imports: " + " -> ".join(circle)


def test_no_module_over_800_lines_and_no_class_over_400() -> None:
    """Modules small enough to read in one sitting (the package's and the benchmarks')."""
    paths = list(modules().values()) + sorted((ROOT / "benchmarks").glob("*.py"))
    too_big: list[str] = []
    for path in paths:
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > 800:
            too_big.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if size > 400:
                    too_big.append(f"{path.relative_to(ROOT)}: class {node.name}, {size} lines")
    assert not too_big, "\n".join(too_big)
