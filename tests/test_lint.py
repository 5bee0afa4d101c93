"""ruff and mypy run by the suite, with the versions and configuration pinned in pyproject.toml
(ruff: [tool.ruff]; mypy: [tool.mypy], over the whole daemon and the clients (kvbroker,
kvbroker_client, kvbroker_sglang, kvbroker_vllm), strict on kvbroker/core and kvbroker/flows).
Each fails with the tool's own report."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(tool: str, *args: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec(tool) is None:
        pytest.fail(f"{tool} is not installed: it is pinned in the test extra (pip install -e '.[test]')")
    return subprocess.run([sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    result = run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_finds_nothing_in_the_daemon_and_the_clients():
    result = run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr
