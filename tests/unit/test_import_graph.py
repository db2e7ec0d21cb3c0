"""The package's import graph, read from the source (ast): no cycles, stages meet only through public APIs.

Every ``import`` counts, including the lazy ones inside functions (a lazy import hides a cycle from Python, not from
a reader); only ``if TYPE_CHECKING:`` blocks are skipped. Rules (docs/ARCHITECTURE.md):
1. no cycle between eaglenest modules;
2. a stage (regen, drafter, serve) imports another stage only through that stage's package (its ``__init__``), and
   never a private (``_``-prefixed) name of another package;
3. the core (everything outside the stages) imports no stage, except ``eaglenest.cli`` and ``eaglenest.demo``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "eaglenest"
STAGES = ("regen", "drafter", "serve")
CORE_ENTRY_POINTS = {"eaglenest.cli", "eaglenest.demo"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """(imported module, imported names) for every eaglenest import in ``tree``."""
    found: list[tuple[str, list[str]]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, []) for a in child.names if a.name.split(".")[0] == "eaglenest")
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = module.split(".") if is_package else module.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (child.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                if base.split(".")[0] == "eaglenest":
                    found.append((base, [a.name for a in child.names]))
            visit(child)

    visit(tree)
    return found


def _graph() -> tuple[dict[str, set[str]], dict[str, list[tuple[str, list[str]]]]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    raw: dict[str, list[tuple[str, list[str]]]] = {}
    for mod, path in modules.items():
        raw[mod] = _imports(ast.parse(path.read_text()), mod, path.name == "__init__.py")
        for target, names in raw[mod]:
            # `from pkg import submodule` imports the submodule
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            for t in subs or [target]:
                if t in modules and t != mod:
                    edges[mod].add(t)
    return edges, raw


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else None


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                connect(w)
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
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return out


def test_no_import_cycles() -> None:
    edges, _ = _graph()
    assert _cycles(edges) == []


def test_stages_meet_only_through_public_packages() -> None:
    _, raw = _graph()
    bad = []
    for mod, imports in sorted(raw.items()):
        for target, names in imports:
            private = [n for n in names if n.startswith("_") and not target.startswith(mod.rsplit(".", 1)[0])]
            if private:
                bad.append(f"{mod} imports private {private} from {target}")
            src, dst = _stage(mod), _stage(target)
            if src and dst and src != dst and target != f"eaglenest.{dst}":
                bad.append(f"{mod} imports {target} (another stage's module; use eaglenest.{dst}'s public API)")
    assert bad == []


def test_core_imports_no_stage() -> None:
    _, raw = _graph()
    bad = [f"{mod} imports {target}" for mod, imports in sorted(raw.items()) for target, _ in imports
           if _stage(mod) is None and _stage(target) and mod not in CORE_ENTRY_POINTS]
    assert bad == []


def test_the_checker_sees_a_cycle_and_a_private_import() -> None:
    """The rules can fail: a made-up two-module cycle and a private cross-package import are found."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    tree = ast.parse("from eaglenest.speculative.decoder import _Batch\n")
    assert _imports(tree, "eaglenest.serve.continuous", False) == [("eaglenest.speculative.decoder", ["_Batch"])]
