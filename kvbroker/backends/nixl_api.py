"""NIXL's Python API, imported as `import nixl` would choose it, without importing torch where that
decides nothing (`import_nixl_api`)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

# The builds of NIXL's `nixl` package, in the order it tries them when it finds no CUDA version.
NIXL_BUILDS = ("nixl_cu13", "nixl_cu12", "nixl_rocm")


def import_nixl_api():
    """NIXL's `_api` module, as `import nixl` chooses it, without importing torch where that decides nothing.

    The `nixl` package picks one of its builds by the CUDA version torch was built with. Beside a
    build of torch without CUDA (this project's CPU machines) it reads none off disk and imports all
    of torch to ask again: 3-5 s of every broker's start, for the same answer, the first build
    installed in NIXL_BUILDS' order. Then that build's `_api` is imported directly; otherwise (a CUDA
    torch, or torch already imported) `import nixl` chooses.
    """
    if "torch" not in sys.modules and torch_build_without_cuda():
        for name in NIXL_BUILDS:
            try:
                return importlib.import_module(f"{name}._api")
            except ModuleNotFoundError as e:
                if e.name != name:
                    raise
    from nixl import _api

    return _api


def torch_build_without_cuda() -> bool:
    """Whether an installed torch says, in its version.py (read, not imported), that it has no CUDA."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return False
    try:
        tree = ast.parse((Path(spec.origin).parent / "version.py").read_text())
    except (OSError, SyntaxError, ValueError):
        return False
    for node in tree.body:
        target: ast.expr
        value: ast.expr | None
        if isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == "cuda":
            return isinstance(value, ast.Constant) and value.value is None
    return False
