"""The README's Operations section stays true: its settings table is the Settings object, its troubleshooting
messages are ones the broker sends, and its grpcurl commands work against a real broker.

`python -m tests.deploy.test_operations_doc` prints the settings table to paste after a change.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from kvbroker.config import Settings
from kvbroker.core.errors import Code
from tests.support.deploy import REPO_ROOT, tool

DOC = REPO_ROOT / "README.md"
FACTORIES = {"gethostname": "the host name"}


def default_text(name: str) -> str:
    info = Settings.model_fields[name]
    if info.default_factory is not None:
        return FACTORIES.get(info.default_factory.__name__, f"{info.default_factory.__name__}()")
    return f"`{info.default}`" if info.default != "" else "empty"


def settings_table() -> str:
    rows = ["| setting | flag | environment variable | default | meaning |",
            "| --- | --- | --- | --- | --- |"]
    for name, info in Settings.model_fields.items():
        rows.append(f"| `{name}` | `--{name.replace('_', '-')}` | `KVBROKER_{name.upper()}` | "
                    f"{default_text(name)} | {info.description} |")
    return "\n".join(rows)


def section(title: str) -> str:
    text = DOC.read_text()
    match = re.search(rf"^### {re.escape(title)}\n(.*?)(?=^##+ |\Z)", text, re.M | re.S)
    assert match, f"no section '### {title}' in {DOC.name}"
    return match.group(1)


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the first table in `text`."""
    rows = []
    for line in text[text.index("\n|") + 1:].splitlines():
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows[2:]  # header and rule


def test_settings_table_is_the_settings_object():
    assert settings_table() in section("Configuration reference")


def test_every_troubleshooting_message_is_one_the_broker_sends():
    tracked = subprocess.run(["git", "ls-files", "kvbroker"], cwd=REPO_ROOT, check=True, capture_output=True,
                             text=True).stdout.split()
    sources = "\n".join((REPO_ROOT / name).read_text() for name in tracked if name.endswith(".py"))
    rows = table_rows(section("Troubleshooting"))
    assert len(rows) >= 15
    for code, message, *_ in rows:
        assert code.strip("`") in Code.__members__ or code == "(log)", code
        fragment = re.fullmatch(r"`([^`]+)`", message)
        assert fragment, f"message cell must be one `fragment`: {message}"
        assert fragment.group(1) in sources, f"no message containing {fragment.group(1)!r} in kvbroker/"


def test_every_status_code_of_the_api_has_a_troubleshooting_row():
    codes = {row[0].strip("`") for row in table_rows(section("Troubleshooting"))}
    design = {"INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "FAILED_PRECONDITION", "PERMISSION_DENIED",
              "UNIMPLEMENTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "INTERNAL"}
    assert design <= codes


def grpcurl_commands() -> list[str]:
    block = section("Inspecting a broker with grpcurl")
    return [line.strip() for line in block.splitlines() if line.strip().startswith("grpcurl ")]


@pytest.mark.integration
async def test_grpcurl_commands_in_the_doc_work_against_a_broker(tmp_path: Path):
    from kvbroker_tools.launch import start_broker

    commands = grpcurl_commands()
    assert len(commands) >= 5
    socket = tmp_path / "kvbroker.sock"
    broker = await start_broker("grpcurl", "--listen", f"unix:{socket}")
    try:
        results = []
        for command in commands:
            command = command.replace("127.0.0.1:50052", broker.peer_listen)
            command = command.replace("/run/kvbroker/kvbroker.sock", str(socket))
            argv = shlex.split(command)
            argv[0] = tool("grpcurl")
            ran = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=30)
            results.append((command, ran))
    finally:
        await broker.stop()
    for command, result in results:
        assert result.returncode == 0, f"{command}\n{result.stderr}"
    assert any('"status": "SERVING"' in r.stdout for _, r in results)


if __name__ == "__main__":
    print(settings_table())
