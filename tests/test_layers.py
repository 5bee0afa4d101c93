"""The layers of ARCHITECTURE.md, pinned: who may import what, read from the sources' imports (ast).

- core (the model, rules and plans) imports only core, the standard library and numpy;
- flows, core, memory and backends import no gRPC (nor the generated protobuf stubs): the domain
  knows status codes as kvbroker.core.errors.Code, never as grpc.StatusCode;
- only kvbroker.server (which builds the servicers) imports kvbroker.edge from outside it;
- peers.clients is the gRPC client side of the peer plane: it may import grpc and the stubs, and
  converts their messages itself (peers/wire.py), never through the edge;
- no circle of imports among kvbroker's modules, counting those made for type checking only;
- the daemon (kvbroker) imports neither its tooling (kvbroker_tools, in tooling/) nor the tests;
- no class over 220 lines, no module over 500, tooling/ and clients/ included (BrokerClient, the
  client's façade, excepted by name: its jobs are modules of their own, its size the API's docs);
- the adapter core (kvbroker_client.adapter) imports no engine, and torch only in hostmem; an engine
  adapter (kvbroker_sglang, kvbroker_vllm) imports neither grpc nor BrokerClient (the core holds the
  broker), and only its factory module reads the engine's role;
- in tests/ (and benchmarks/), the only tests modules imported are tests.support's: never a test
  module (test_*.py) nor a conftest. What tests share lives in tests/support (its __init__ maps it);
  the conftests hold the fixtures, made of it, and tests/support holds none.
Each rule fails naming the module and the import that breaks it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvbroker"
CLIENT_SOURCES = sorted((ROOT / "clients").glob("*/src"))
TOOLING_SOURCE = ROOT / "tooling" / "src"
TESTS = ROOT / "tests"
SUPPORT = "tests.support"  # the one package through which tests share code
ADAPTERS = ("kvbroker_sglang", "kvbroker_vllm")
ENGINES = ("sglang", "vllm")
# module -> the one module of an adapter that may look at the engine's role (its factory)
ROLE_FACTORIES = {"kvbroker_sglang": {"kvbroker_sglang.manager", "kvbroker_sglang.host_pools"},
                  "kvbroker_vllm": {"kvbroker_vllm.connector"}}
# Classes past MAX_CLASS_LINES, each with why; the size rule reports any other.
OVERSIZE = {"kvbroker_client.client.BrokerClient": "the client's public façade: its jobs are requests, calls, "
                                                  "recovery and session; what stays is the API's docstrings "
                                                  "and one-line delegations (~250 lines)"}
STDLIB = set(sys.stdlib_module_names)
MAX_CLASS_LINES = 220
MAX_MODULE_LINES = 500


def module_name(path: Path) -> str:
    for src in [*CLIENT_SOURCES, TOOLING_SOURCE]:
        if path.is_relative_to(src):
            return module_name_under(path, src)
    return module_name_under(path, ROOT)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def client_modules() -> dict[str, Path]:
    """The client packages' modules by import name (the generated stubs left out)."""
    found = {}
    for src in CLIENT_SOURCES:
        for path in sorted(src.rglob("*.py")):
            if "v1" not in path.relative_to(src).parts:
                found[module_name_under(path, src)] = path
    return found


def module_name_under(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


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


def tooling_modules() -> dict[str, Path]:
    return {module_name_under(p, TOOLING_SOURCE): p for p in sorted(TOOLING_SOURCE.rglob("*.py"))}


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


def test_the_daemon_imports_neither_its_tooling_nor_the_tests():
    broken = [f"{name} imports {imported}" for name, path in modules().items() for imported in imports(path)
              if imported.split(".")[0] in ("kvbroker_tools", "tests")]
    assert not broken, broken


def test_no_class_or_module_past_its_size():
    too_big = []
    for name, path in {**modules(), **client_modules(), **tooling_modules()}.items():
        source = path.read_text()
        lines = source.count("\n")
        if lines > MAX_MODULE_LINES:
            too_big.append(f"module {name}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES and f"{name}.{node.name}" not in OVERSIZE:
                    too_big.append(f"class {name}.{node.name}: {size} lines")
        if lines > MAX_MODULE_LINES and any(key.startswith(name + ".") for key in OVERSIZE):
            too_big.remove(f"module {name}: {lines} lines")
    assert not too_big, too_big


def test_the_adapter_core_imports_no_engine_and_torch_only_for_host_memory():
    broken = []
    for name, path in client_modules().items():
        if not in_layer(name, "kvbroker_client.adapter"):
            continue
        for imported in imports(path):
            top = imported.split(".")[0]
            if top in ENGINES or top in ADAPTERS or (top == "torch" and name != "kvbroker_client.adapter.hostmem"):
                broken.append(f"{name} imports {imported}")
    assert not broken, broken


def test_engine_adapters_reach_the_broker_only_through_the_core():
    broken = []
    for name, path in client_modules().items():
        if name.split(".")[0] not in ADAPTERS:
            continue
        for imported in imports(path):
            if (imported.split(".")[0] == "grpc" or in_layer(imported, "kvbroker_client.client")
                    or in_layer(imported, "kvbroker_client.exchange") or in_layer(imported, "kvbroker_client.v1")
                    or imported == "kvbroker_client.BrokerClient"):
                broken.append(f"{name} imports {imported}")
    assert not broken, broken


def test_only_an_adapters_factory_reads_the_engines_role():
    """One class per role: no adapter module but its factory names the role it runs as."""
    broken = []
    for name, path in client_modules().items():
        adapter = name.split(".")[0]
        if adapter not in ADAPTERS or name in ROLE_FACTORIES[adapter]:
            continue
        source = path.read_text()
        for word in ("disaggregation_mode", "DisaggregationMode", "KVConnectorRole", "kv_role"):
            if word in source:
                broken.append(f"{name} mentions {word}")
    assert not broken, broken


def test_the_rules_see_imports():
    """The reader finds what it must: a layer rule that saw no import would pass vacuously."""
    edges = graph()
    assert "kvbroker.core.errors" in edges["kvbroker.flows.sender"]
    assert any(in_layer(i, "kvbroker.edge") for i in imports(PACKAGE / "server.py"))
    clients = client_modules()
    assert "kvbroker_client.adapter.EngineLink" in imports(clients["kvbroker_sglang.manager"])
    assert "kvbroker_client.client" in imports(clients["kvbroker_client.adapter.link"])
    tooling = tooling_modules()
    assert "kvbroker_tools.launch.start_broker" in imports(tooling["kvbroker_tools.demo"])
    assert "kvbroker_tools.serving.stack" in tooling and "kvbroker.cli" in modules()
    assert "tests.support.brokers.open_broker" in imports(TESTS / "integration" / "test_daemon.py")
    # an import inside a test function, and a benchmark's inside its main()
    assert "tests.support.brokers.assert_bytes" in imports(TESTS / "deploy" / "test_peer_tls.py")
    assert "tests.support.sglang_ranks.Ranks" in imports(ROOT / "benchmarks" / "sglang_plugin_hops.py")
    assert "tests.support.reference.Reference" in imports(TESTS / "conftest.py")


def test_tests_share_code_only_through_the_support_package():
    """No test module imports another test module or a conftest (pytest hands a test its fixtures by
    name): every tests module imported, in tests/ and benchmarks/, is tests.support or in it."""
    broken = []
    for path in sorted([*TESTS.rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]):
        for imported in imports(path):
            if in_layer(imported, "tests") and imported != "tests" and not in_layer(imported, SUPPORT):
                broken.append(f"{module_name(path)} imports {imported}")
    assert not broken, broken


def test_fixtures_live_in_conftests_not_in_the_support_package():
    found = []
    for path in sorted((TESTS / "support").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for decorator in node.decorator_list:
                    target = decorator.func if isinstance(decorator, ast.Call) else decorator
                    if ast.unparse(target).endswith("fixture"):
                        found.append(f"{module_name(path)}.{node.name}")
    assert not found, found
