"""ARCHITECTURE.md names every module of the daemon, so that a new module comes with its paragraph."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_daemon_module_is_in_the_architecture_doc():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    modules = sorted(p.relative_to(ROOT / "kvbroker") for p in (ROOT / "kvbroker").rglob("*.py"))
    missing = [str(m) for m in modules if m.name not in text and m.name != "__init__.py"]
    assert not missing, f"ARCHITECTURE.md does not name {missing}"
