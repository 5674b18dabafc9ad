"""The package's layers, read from the source: every import of one pantheon package by another
(module level or inside a function, not `if TYPE_CHECKING:`) goes down this order, so no package
imports upward and the package graph has no cycle. gguf/, the ground floor, imports nothing of
pantheon."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "pantheon"
# lowest first: a package may import only those before it
LAYERS = ("config", "faults", "gguf", "default_model", "text", "native", "pallas", "model", "engine", "web",
          "router", "cli_types", "cli_llama", "cli", "__main__")


def package_of(module: str) -> str | None:
    """pantheon.x.y -> x (a sub-package or a root module); None for `pantheon` itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def type_checking_blocks(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (annotations only, never run)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skipped


def imports() -> list[tuple[str, str, str]]:
    """(importing package, imported package, file:line) for every cross-package pantheon import."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        source = package_of(".".join(rel.parts))
        tree = ast.parse(path.read_text())
        skipped = type_checking_blocks(tree)
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("pantheon"):
                targets = [node.module] if node.module != "pantheon" else [f"pantheon.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("pantheon")]
            else:
                continue
            for target in targets:
                package = package_of(target)
                if package and package != source:
                    found.append((source, package, f"{path.relative_to(ROOT.parent)}:{node.lineno}"))
    return found


def test_every_package_is_placed_in_a_layer():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    packages |= {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    assert packages <= set(LAYERS), packages - set(LAYERS)


def test_no_package_imports_upward():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = [f"{where}: {a} imports {b}" for a, b, where in imports() if rank[b] >= rank[a]]
    assert not upward, "\n".join(upward)
    assert not [i for i in imports() if i[0] == "gguf"], "gguf/ is the ground floor"


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The walk would catch a kernel importing the engine (as pallas/dispatch.py once did)."""
    fake = tmp_path / "pantheon"
    (fake / "pallas").mkdir(parents=True)
    (fake / "pallas" / "__init__.py").write_text("")
    (fake / "pallas" / "k.py").write_text("def f():\n    from pantheon.engine.faults import FAULTS\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    assert imports() == [("pallas", "engine", "pantheon/pallas/k.py:2")]
