"""Changes to SGLang 0.5.23 that its CPU serving needs, made in the servers' processes by the site
dir's sitecustomize: `after_import` runs a function on a module right after it is first executed,
without importing it sooner (SGLang's import order stays its own).

- `MooncakeKVSender.supports_host_tensor_indices` off: with it, prefill.py (~1746) allocates
  `pin_memory=True` tensors and records a `torch.cuda.Event`, both of which fail on a CPU-only
  machine. Off, prefill takes its plain path (`kv_to_page_indices`), as for every other backend.
  This is SGLang's own mooncake backend, the comparison; kvbroker's sender never set the flag.

kvbroker_tools.serving.minimax may use `after_import` for its stand-ins too.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType

_pending: dict[str, list[Callable[[ModuleType], None]]] = {}


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _pending:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            for fix in _pending.pop(fullname, []):
                fix(module)

        loader.exec_module = exec_module
        return spec


_finder = _AfterImport()


def after_import(module_name: str, fix: Callable[[ModuleType], None]) -> None:
    """`fix(module)` once `module_name` is imported; at once if it already is."""
    if module_name in sys.modules:
        fix(sys.modules[module_name])
        return
    _pending.setdefault(module_name, []).append(fix)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def _mooncake_sender_without_host_indices(module: ModuleType) -> None:
    module.MooncakeKVSender.supports_host_tensor_indices = False


def install() -> None:
    after_import("sglang.srt.disaggregation.mooncake.conn", _mooncake_sender_without_host_indices)
