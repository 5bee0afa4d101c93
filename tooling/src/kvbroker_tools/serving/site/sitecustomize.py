"""Run at start-up by every Python process of the tooling's SGLang servers (this directory is on their
PYTHONPATH; tooling/src/kvbroker_tools/serving/stack.py sets it): what SGLang 0.5.23 needs on a CPU machine
before it is imported.

- torchvision's operator schemas (kvbroker_tools.serving.cpu_torchvision says why);
- SGLang's CPU fixes of kvbroker_tools.serving.patches (its mooncake backend's CUDA-only path);
- with KVBROKER_SERVING_TRACE=<dir>, the timestamps of kvbroker_tools.serving.trace (servers and brokers);
- with KVBROKER_SERVING_MINIMAX=1, the MiniMax-M3 CPU stand-ins of kvbroker_tools.serving.minimax
  (its `install()`), when that module exists.
"""

from __future__ import annotations

import importlib.util
import os


def _prepare() -> None:
    from kvbroker_tools.serving import patches
    from kvbroker_tools.serving.cpu_torchvision import declare_torchvision_ops

    declare_torchvision_ops()
    patches.install()
    if os.environ.get("KVBROKER_SERVING_TRACE"):
        from kvbroker_tools.serving import trace

        trace.install()
    if os.environ.get("KVBROKER_SERVING_MINIMAX") == "1" and importlib.util.find_spec(
            "kvbroker_tools.serving.minimax") is not None:
        from kvbroker_tools.serving import minimax

        minimax.install()


_prepare()
