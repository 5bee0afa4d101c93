"""The contract: committed stubs match the proto, the proto passes Buf's lint, and it breaks nothing of
its released form (`buf breaking` against proto/released/kvbroker-v1.binpb; CHANGELOG.md says when that
form may be rebuilt)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUF = ROOT / ".tools" / "node_modules" / ".bin" / "buf"


def test_generated_stubs_are_fresh():
    result = subprocess.run([sys.executable, "scripts/gen_proto.py", "--check"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_proto_passes_buf_lint():
    assert BUF.exists(), "buf is installed by scripts/test.sh (npm @bufbuild/buf into .tools/)"
    result = subprocess.run([str(BUF), "lint"], cwd=ROOT / "proto", capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_field_and_rpc_is_commented():
    missing = []
    for path in sorted((ROOT / "proto" / "kvbroker" / "v1").glob("*.proto")):
        text = path.read_text().splitlines()
        for i, line in enumerate(text):
            stripped = line.strip()
            is_field = stripped.endswith(";") and "=" in stripped and not stripped.startswith(("syntax", "//"))
            is_rpc = stripped.startswith("rpc ")
            if (is_field or is_rpc) and "_UNSPECIFIED = 0" not in stripped:
                if not text[i - 1].strip().startswith("//"):
                    missing.append(f"{path.name}:{i + 1}: {stripped}")
    assert not missing, "uncommented fields:\n" + "\n".join(missing)


RELEASED = ROOT / "proto" / "released" / "kvbroker-v1.binpb"


def buf_breaking(proto: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BUF), "breaking", "--against", str(RELEASED)], cwd=proto, capture_output=True,
                          text=True, timeout=120)


def test_the_contract_breaks_nothing_of_its_released_form():
    assert BUF.exists(), "buf is installed by scripts/test.sh (npm @bufbuild/buf into .tools/)"
    result = buf_breaking(ROOT / "proto")
    assert result.returncode == 0, "a breaking change to kvbroker.v1 (CHANGELOG.md says how one is made):\n" + \
        result.stdout + result.stderr
    assert "released/kvbroker-v1.binpb" in (ROOT / "CHANGELOG.md").read_text()


def test_the_breaking_check_sees_a_break(tmp_path):
    """The check is not vacuous: the contract with one field removed fails it, naming the field."""
    copy = tmp_path / "proto"
    shutil.copytree(ROOT / "proto", copy, ignore=shutil.ignore_patterns("released"))
    service = copy / "kvbroker" / "v1" / "broker_service.proto"
    text = service.read_text()
    assert "  string receiver_broker_id = 11;\n" in text
    service.write_text(text.replace("  string receiver_broker_id = 11;\n", ""))
    result = buf_breaking(copy)
    assert result.returncode != 0 and "receiver_broker_id" in result.stdout + result.stderr, result.stdout
