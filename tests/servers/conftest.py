"""The real-server tests: SGLang 0.5.23 servers started as users start them
(tooling/src/kvbroker_tools/serving), one PD deployment per transfer engine of the brokers, shared by a
module's tests, beside the session's non-PD reference server (tests/conftest.py's `reference`). What
they share lives in tests/support/sglang_servers.py; here, only their marker.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/servers/" in str(item.fspath):
            item.add_marker(pytest.mark.servers)
