"""SGLang 0.5.23 on CPU torch: the one adjustment its import chain needs, made before sglang is imported
(by tests/sglang/conftest.py and by the servers' sitecustomize in site/).

`sglang.srt.disaggregation.utils` imports `sglang.srt.configs`, which imports torchvision.transforms
(InternVL's image utils). PyPI has torchvision only as CUDA builds: its C ops need libtorch_cuda and
do not load on the CPU torch of locks/runtime-cpu.txt, and then torchvision's own import stops at
`register_fake("torchvision::nms")` for an operator nobody defined. Defining the schemas of the two
operators it registers unconditionally (nms, qnms; the others are guarded by `_has_ops()`) lets the
real torchvision package import; calling those operators would still fail, and nothing here does.
"""

from __future__ import annotations

import importlib.util

import torch

_library: torch.library.Library | None = None


def declare_torchvision_ops() -> None:
    """On a CPU build of torch with torchvision installed, define the schemas torchvision's import needs."""
    global _library
    if _library is not None or torch.version.cuda is not None or importlib.util.find_spec("torchvision") is None:
        return
    _library = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        if not _has_schema(f"torchvision::{op}"):
            _library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


def _has_schema(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(name, "")
    except RuntimeError:
        return False
    return True
