"""The package's import graph, read from the source (ast): no cycles, layers as documented, stages meet only
through public APIs.

Every ``import`` counts, including the lazy ones inside functions (a lazy import hides a cycle from Python, not from
a reader), and so does every string that names an eaglenest module whole (``"eaglenest.drafter.train"``, or
``"eaglenest.x.y:attr"``): lazy package faces (``_EXPORTS`` tables), the CLI's subcommand table and hook factories
import through such strings. Only ``if TYPE_CHECKING:`` blocks are skipped. Rules (docs/ARCHITECTURE.md):
1. no cycle between eaglenest modules, and none between rooms (top-level packages);
2. each room imports only the rooms :data:`ALLOWED` names for it (contracts: nothing above them);
3. a stage (regen, drafter, serve) imports another stage only through that stage's package (its ``__init__``), and
   never a private (``_``-prefixed) name of another package;
4. the core (everything outside the stages) imports no stage, except the entry points (the CLI and the demo).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "eaglenest"
STAGES = ("regen", "drafter", "serve", "flywheel")
CORE_ENTRY_POINTS = {"eaglenest.cli", "eaglenest.demo"}
MODULE_STRING = re.compile(r"^eaglenest(\.\w+)+(:\w+)?$")

_BOTTOM = {"targets", "config", "ray_private", "lr_schedule", "plotting"}
_CORE = {*_BOTTOM, "contracts", "kernels", "runtime", "drafters", "sizing", "engines", "speculative"}
ALLOWED: dict[str, set[str]] = {
    "targets": set(),
    "config": set(),
    "ray_private": set(),
    "lr_schedule": set(),
    "plotting": set(),
    "contracts": {"config", "targets"},
    "kernels": {"config"},
    "runtime": {"config", "ray_private"},
    "drafters": {"config", "targets", "contracts", "kernels"},
    "sizing": {"config", "targets", "contracts"},
    "engines": {"config", "targets", "contracts", "kernels", "drafters", "lr_schedule"},
    "speculative": {"config", "targets", "contracts", "kernels", "drafters", "engines", "plotting"},
    "regen": _CORE,
    "drafter": {*_CORE, "regen"},
    "serve": _CORE,
    "flywheel": {*_CORE, "regen", "drafter", "serve"},
}
"""Which rooms each room may import (a room is a top-level package or module of eaglenest). Rooms not named here
are entry points (the CLI, ``demo``, the ``*_cli`` modules, the package's own ``__init__``): they may import any."""


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
    lazy = _lazy_module_strings(tree)

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
            elif id(child) in lazy:
                found.append((child.value.split(":")[0], []))
            visit(child)

    visit(tree)
    return found


def _lazy_module_strings(tree: ast.AST) -> set[int]:
    """ids of the string constants that import: a module path as a table's value (or a tuple there: lazy faces, the
    CLI's subcommands), an ``import_module``/``find_spec`` argument, or a ``module:attr`` factory path. A logger's
    name or a ``python -m`` argument names a module without importing it."""
    out: set[int] = set()

    def mark(node: ast.AST | None) -> None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_STRING.match(node.value):
            out.add(id(node))
        elif isinstance(node, ast.Tuple):
            for e in node.elts:
                mark(e)

    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for v in node.values:
                mark(v)
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "find_spec") and node.args:
                mark(node.args[0])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and ":" in node.value:
            mark(node)
    return out


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


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "eaglenest"


def _room_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for mod, targets in edges.items():
        rooms.setdefault(_room(mod), set())
        for t in targets:
            if _room(t) != _room(mod):
                rooms[_room(mod)].add(_room(t))
    return rooms


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


def test_no_cycle_between_rooms() -> None:
    rooms = _room_edges(_graph()[0])
    for r in list(rooms):
        for t in rooms[r]:
            rooms.setdefault(t, set())
    assert _cycles(rooms) == []


def test_each_room_imports_only_what_its_layer_allows() -> None:
    edges, _ = _graph()
    bad = sorted(f"{mod} ({_room(mod)}) imports {t} ({_room(t)})" for mod, targets in edges.items()
                 for t in targets if _room(mod) in ALLOWED and _room(t) != _room(mod)
                 and _room(t) not in ALLOWED[_room(mod)])
    assert bad == []


def test_lazy_faces_and_module_strings_are_edges() -> None:
    """The lazy package faces resolve: drafter's ``_EXPORTS`` reaches the training loop, the CLI reaches every
    stage, so a cycle through either cannot hide."""
    edges, _ = _graph()
    assert "eaglenest.drafter.driver" in edges["eaglenest.drafter"]
    assert {"eaglenest.regen.cli", "eaglenest.serve.cli", "eaglenest.drafter.cli"} <= edges["eaglenest.cli"]
    tree = ast.parse('X = {"a": "eaglenest.drafter.train", "b": "eaglenest.engines.sglang.hooks:capture_hook"}\n'
                     '"""eaglenest.drafter is mentioned in prose"""\nlog = getLogger("eaglenest.serve")\n')
    assert _imports(tree, "eaglenest.x", False) == [("eaglenest.drafter.train", []),
                                                     ("eaglenest.engines.sglang.hooks", [])]


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
    assert _room_edges({"eaglenest.contracts.x": {"eaglenest.engines.y"}, "eaglenest.engines.y": set()}) == {
        "contracts": {"engines"}, "engines": set()}
    assert "engines" not in ALLOWED["contracts"]
    tree = ast.parse("from eaglenest.speculative.decoder import _Batch\n")
    assert _imports(tree, "eaglenest.serve.continuous", False) == [("eaglenest.speculative.decoder", ["_Batch"])]
