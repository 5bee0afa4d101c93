"""The CPU image as scripts/image.sh builds it (scripts/test.sh builds it before the suite, outside the
suite's network namespace): small, without torch or CUDA libraries, running as UID 10001, answering
`kvbroker --version` and `serve --help` as this checkout does, and its health probe passing against a
broker serving in it and failing once the broker is gone. Containers run without a network
(--network none) and with the rlimits this machine's runc can set."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

from kvbroker import __version__

IMAGE = os.environ.get("KVBROKER_IMAGE", "localhost/kvbroker:cpu")
MAX_CPU_IMAGE_MB = 800
PODMAN = ["podman", "--runtime", "runc"]
RUN = ["run", "--rm", "--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)
    if check:
        assert done.returncode == 0, f"podman {' '.join(args)}: {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def image_present() -> str:
    """Why the image cannot be tested here; empty when it can."""
    if shutil.which("podman") is None:
        return "podman is not installed (bash scripts/image.sh installs it and builds the image; test.sh runs it)"
    if podman("image", "exists", IMAGE, check=False).returncode != 0:
        return f"{IMAGE} is not built (bash scripts/image.sh builds it; scripts/test.sh runs it before the suite)"
    return ""


pytestmark = pytest.mark.skipif(bool(image_present()), reason=image_present() or "present")


def test_the_cpu_image_stays_small():
    size = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout)
    assert size <= MAX_CPU_IMAGE_MB * 1_000_000, f"{IMAGE}: {size / 1e6:.0f} MB, over {MAX_CPU_IMAGE_MB} MB"


def test_the_cpu_image_carries_no_torch_and_no_cuda_library():
    listing = podman(*RUN, "--entrypoint", "python", IMAGE, "-c",
                     "import importlib.metadata as m, json; print(json.dumps(sorted(d.metadata['Name'].lower() "
                     "for d in m.distributions())))").stdout
    installed = json.loads(listing.strip().splitlines()[-1])
    assert "kvbroker" in installed and "nixl" in installed and "mooncake-transfer-engine-non-cuda" in installed
    assert not [n for n in installed if n == "torch" or n.startswith(("nvidia-", "triton"))], installed
    found = podman(*RUN, "--user", "0", "--entrypoint", "sh", IMAGE, "-c",
                   "find / -xdev \\( -name 'libcudart*' -o -name 'libcublas*' -o -name 'libnccl*' \\) -print").stdout
    assert found.strip() == "", found


def test_it_runs_as_uid_10001_and_answers_as_this_checkout():
    assert podman(*RUN, "--entrypoint", "id", IMAGE, "-u").stdout.strip() == "10001"
    assert podman(*RUN, "--entrypoint", "kvbroker", IMAGE, "--version").stdout.strip() == f"kvbroker {__version__}"
    assert "usage: kvbroker serve" in podman(*RUN, IMAGE, "--help").stdout  # the entrypoint: `kvbroker serve --help`


def test_its_health_probe_passes_against_a_serving_broker_and_fails_once_it_stops():
    """The image's HEALTHCHECK command, as podman runs it (`podman healthcheck run`), and the exec probe
    the manifests use; the broker on Mooncake (a NIXL broker refuses to start without RDMA here: the
    protected default)."""
    name = f"kvbroker-probe-{os.getpid()}"
    podman("run", "--detach", "--name", name, "--network", "none", "--ulimit", "nofile=1024:1024",
           "--ulimit", "nproc=1024:1024", "--env", "KVBROKER_BACKEND=mooncake", IMAGE)
    try:
        deadline = time.monotonic() + 60
        # No event says the broker is up: its probe is asked until it answers, bounded.
        while podman("exec", name, "python", "-m", "kvbroker.ops.probe", check=False).returncode != 0:
            assert time.monotonic() < deadline, podman("logs", name, check=False).stderr[-3000:]
            assert podman("container", "exists", name, check=False).returncode == 0
            time.sleep(0.5)
        assert podman("healthcheck", "run", name, check=False).returncode == 0  # the image's own HEALTHCHECK
        podman("exec", name, "python", "-m", "kvbroker.ops.probe", "--service", "kvbroker.v1.BrokerService")
        podman("stop", "--time", "30", name)
        assert podman("healthcheck", "run", name, check=False).returncode != 0
        logs = podman("logs", name, check=False).stderr
        assert '"broker stopped"' in logs, logs[-2000:]
    finally:
        podman("rm", "--force", name, check=False)
