"""A NIXL broker imports NIXL's API without torch where torch has no CUDA (seconds of every start) or
is not installed (the CPU image), and gets the same build `import nixl` would choose."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvbroker.backends import nixl_api as nixl
from tests.support import REPO_ROOT

CHILD = """
import json, os, sys
from kvbroker.backends.nixl_api import import_nixl_api
api = import_nixl_api()
direct = {"module": api.__name__, "torch": "torch" in sys.modules}
import nixl._api
print(json.dumps({**direct, "nixl_chose": sys.modules["nixl._api"].__name__}), flush=True)
os._exit(0)  # NIXL's teardown at interpreter exit is not what this checks
"""


def test_without_torch_nixl_comes_as_import_nixl_would_choose_it(tmp_path):
    """As in the CPU image, where torch is not installed: this environment's packages but torch's."""
    import json
    import os
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    packages = tmp_path / "site-packages"
    packages.mkdir()
    for entry in site.iterdir():
        if not entry.name.startswith(("torch", "__editable__", "_virtualenv")) and not entry.name.endswith(".pth"):
            (packages / entry.name).symlink_to(entry)
    path = os.pathsep.join([str(packages), str(REPO_ROOT), str(REPO_ROOT / "clients" / "python" / "src")])
    out = subprocess.run([sys.executable, "-S", "-c", CHILD], capture_output=True, text=True, timeout=120,
                         check=True, env={**os.environ, "PYTHONPATH": path})
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["torch"] is False and seen["module"] == seen["nixl_chose"] == "nixl_cu13._api", seen
    probe = subprocess.run([sys.executable, "-S", "-c", "import torch"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": path})
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr  # the test saw no torch


def test_this_machines_torch_has_no_cuda_and_nixl_comes_without_it():
    import json

    assert nixl.torch_build_without_cuda(), "the locked torch is the CPU build: its version.py says cuda = None"
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["torch"] is False, "importing NIXL's API imported torch"
    assert seen["module"] == seen["nixl_chose"], seen


@pytest.mark.parametrize(("text", "without"), [
    ("from typing import Optional\ncuda: Optional[str] = None\nhip = None\n", True),
    ("cuda = None\n", True),
    ("cuda: Optional[str] = '12.6'\n", False),
    ("cuda = '13.0'\n", False),
    ("__version__ = '2.13.0'\n", False),  # no cuda line: let `import nixl` decide
    ("cuda = (\n", False),  # not Python
])
def test_a_torch_without_cuda_is_told_by_its_version_file(tmp_path, monkeypatch, text, without):
    (tmp_path / "__init__.py").write_text("raise AssertionError('torch itself is never imported')\n")
    (tmp_path / "version.py").write_text(text)
    spec = SimpleNamespace(origin=str(tmp_path / "__init__.py"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "torch" else None)
    assert nixl.torch_build_without_cuda() is without


def test_no_torch_or_no_version_file_is_not_a_torch_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert nixl.torch_build_without_cuda() is False
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: SimpleNamespace(origin=str(tmp_path / "x.py")))
    assert nixl.torch_build_without_cuda() is False
