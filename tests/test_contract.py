"""The contract: committed stubs match the proto, and the proto passes Buf's lint."""

from __future__ import annotations

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
