"""The layers of ARCHITECTURE.md, pinned: who may import what, read from the sources' imports (ast).

- core (the model, rules and plans) imports only core, the standard library and numpy;
- flows, core, memory and backends import no gRPC (nor the generated protobuf stubs): the domain
  knows status codes as kvbroker.core.errors.Code, never as grpc.StatusCode;
- only kvbroker.server (which builds the servicers) imports kvbroker.edge from outside it;
- peers.clients is the gRPC client side of the peer plane: it may import grpc and the stubs, and
  converts their messages itself (peers/wire.py), never through the edge;
- no circle of imports among kvbroker's modules, counting those made for type checking only;
- no class over 220 lines, no module over 500, kvbroker/tools included;
- in tests/, no module imports a test module (test_*.py): what tests share lives in helper modules
  (tests/helpers.py, tests/integration/flows.py and the others beside them).
Each rule fails naming the module and the import that breaks it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvbroker"
STDLIB = set(sys.stdlib_module_names)
MAX_CLASS_LINES = 220
MAX_MODULE_LINES = 500


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path) -> set[str]:
    """Every module `path` imports (absolute names; `from x import y` also as x.y, since y may be a module)."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def in_layer(name: str, layer: str) -> bool:
    return name == layer or name.startswith(layer + ".")


def test_core_imports_only_core_the_standard_library_and_numpy():
    broken = []
    for name, path in modules().items():
        if not in_layer(name, "kvbroker.core"):
            continue
        for imported in imports(path):
            top = imported.split(".")[0]
            if top == "kvbroker":
                if not in_layer(imported, "kvbroker.core") and imported != "kvbroker":
                    broken.append(f"{name} imports {imported}")
            elif top not in STDLIB and top not in ("numpy", "__future__"):
                broken.append(f"{name} imports {imported}")
    assert not broken, broken


def test_the_domain_imports_no_grpc():
    broken = []
    for name, path in modules().items():
        if not any(in_layer(name, f"kvbroker.{layer}") for layer in ("core", "flows", "memory", "backends")):
            continue
        for imported in imports(path):
            if imported.split(".")[0] == "grpc" or in_layer(imported, "kvbroker_client.v1"):
                broken.append(f"{name} imports {imported}")
    assert not broken, broken


def test_only_the_server_imports_the_edge():
    broken = []
    for name, path in modules().items():
        if in_layer(name, "kvbroker.edge") or name == "kvbroker.server":
            continue
        broken += [f"{name} imports {i}" for i in imports(path) if in_layer(i, "kvbroker.edge")]
    assert not broken, broken


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: {i for i in imports(path) if i in mods and i != name} for name, path in mods.items()}


def test_no_circle_of_imports_among_kvbroker_modules():
    edges = graph()
    circles, state = [], {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(trail[trail.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    # a package's __init__ importing its own modules is no circle of its modules
    circles = [c for c in circles if not all(in_layer(m, c.split(" -> ")[0]) for m in c.split(" -> "))]
    assert not circles, circles


def test_no_class_or_module_past_its_size():
    too_big = []
    for name, path in modules().items():
        source = path.read_text()
        lines = source.count("\n")
        if lines > MAX_MODULE_LINES:
            too_big.append(f"module {name}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    too_big.append(f"class {name}.{node.name}: {size} lines")
    assert not too_big, too_big


def test_the_rules_see_imports():
    """The reader finds what it must: a layer rule that saw no import would pass vacuously."""
    edges = graph()
    assert "kvbroker.core.errors" in edges["kvbroker.flows.sender"]
    assert any(in_layer(i, "kvbroker.edge") for i in imports(PACKAGE / "server.py"))


def test_no_test_module_imports_another():
    tests = ROOT / "tests"
    broken = []
    for path in sorted(tests.rglob("*.py")):
        for imported in imports(path):
            if in_layer(imported, "tests") and imported.rpartition(".")[2].startswith("test_"):
                broken.append(f"{module_name(path)} imports {imported}")
    assert not broken, broken
