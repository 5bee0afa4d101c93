"""The manifests run as pods (issue 38): each role rendered with the mooncake-tcp component (this machine
has no RDMA), turned into a Pod of the CPU image as tests/support/pods.py says (only where podman 4.3
or this machine lacks what a cluster has), and run by `podman kube play` on podman's bridge network in
the suite's network namespace. Each pod: the broker and a server stand-in (tests/support/pod_server.py)
sharing /dev/shm and the local socket; the brokers talk mutual TLS with a test CA's certificates, as
cert-manager's would be. One MiniMax-M3-shaped request moves prefill -> decode, verified to the byte; the
probes pass; a broker killed comes back and the next request moves; a request in flight on it fails
with the documented status."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import trustme
import yaml

from tests.support import pods
from tests.support.deploy import one, render_overlay

IPS = {"prefill": "10.88.0.50", "decode": "10.88.0.51"}  # podman's default bridge network, 10.88.0.0/16
PEER = f"{IPS['prefill']}:50052"
SEED = "7"


def missing() -> str:
    if shutil.which("podman") is None:
        return "podman is not installed (bash scripts/image.sh installs it and builds the image; test.sh runs it)"
    if subprocess.run(["podman", "image", "exists", pods.IMAGE], capture_output=True).returncode != 0:
        return f"{pods.IMAGE} is not built (bash scripts/image.sh builds it; scripts/test.sh runs it before the suite)"
    return ""


pytestmark = pytest.mark.skipif(bool(missing()), reason=missing() or "present")


class Pods:
    def __init__(self, root: Path) -> None:
        # runc (crun refuses this machine's cgroups) and the rlimits it may set here, for kube play too.
        (root / "containers.conf").write_text('[containers]\ndefault_ulimits = ["nofile=1024:1024", '
                                              '"nproc=1024:1024"]\n[engine]\nruntime = "runc"\n')
        self.env = {**os.environ, "CONTAINERS_CONF": str(root / "containers.conf")}
        self.name = {role: f"{role}-inference-0" for role in IPS}
        self.grace_s = 60  # the pods' terminationGracePeriodSeconds, as rendered

    def podman(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=self.env)
        if check:
            assert done.returncode == 0, f"podman {' '.join(args)}: {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done

    def container(self, role: str, which: str) -> str:
        return f"{self.name[role]}-{which}"

    def reports(self, role: str) -> list[dict]:
        lines = self.podman("logs", self.container(role, "inference-server"), check=False).stdout.splitlines()
        return [json.loads(line) for line in lines if line.startswith("{") and '"role"' in line]

    def until(self, what, timeout: float = 180.0, why: str = ""):
        """Poll `what` until truthy or the bound: no event says a container's state changed here."""
        deadline = time.monotonic() + timeout
        while not (got := what()):
            assert time.monotonic() < deadline, why or f"not within {timeout:g}s"
            time.sleep(0.5)
        return got

    def healthy(self, role: str) -> bool:
        return self.podman("healthcheck", "run", self.container(role, "kvbroker"), check=False).returncode == 0

    def one_shot(self, role: str, request: str, *env: str) -> subprocess.Popen:
        """The server stand-in once more beside the first, for `request` (engines of its own)."""
        extra = [f"--env={e}" for e in env]
        return subprocess.Popen(["podman", "exec", *extra, "--env", f"ROLE={role}", "--env", f"REQUEST={request}",
                                 "--env", f"SEED={SEED}", "--env", "ONCE=1", "--env", f"PREFILL_PEER={PEER}",
                                 self.container(role, "inference-server"), "python", "/opt/pod-server/pod_server.py"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = tmp_path_factory.mktemp("pods")
    scratch = Path("/dev/shm") / root.name  # the suite's private /dev/shm: the pods' emptyDirs, in memory
    deployed = Pods(root)
    ca = trustme.CA()
    try:
        for role in ("prefill", "decode"):
            (root / role).mkdir()
            docs = render_overlay(root / role, role, "mooncake-tcp")
            pods.identity(ca, root / f"tls-{role}", deployed.name[role])
            deployed.grace_s = one(docs, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            manifest = pods.pod(docs, name=deployed.name[role], ip=IPS[role], tls=root / f"tls-{role}",
                                scratch=scratch, server_env={"ROLE": role, "SEED": SEED, "PREFILL_PEER": PEER})
            (root / f"{role}.yaml").write_text(yaml.safe_dump(manifest))
            deployed.podman("kube", "play", "--replace", "--network", "podman", "--ip", IPS[role],
                            str(root / f"{role}.yaml"), timeout=300)
        yield deployed
    finally:
        deployed.podman("pod", "rm", "--force", *deployed.name.values(), check=False)
        shutil.rmtree(scratch, ignore_errors=True)


def test_a_request_moves_between_the_pods_verified_to_the_byte(deployment):
    decode = deployment.until(lambda: deployment.reports("decode"), why="decode's server reported nothing")
    assert decode == [{"role": "decode", "state": "SUCCEEDED", "aux_verified": True, "mismatched_bytes": 0,
                       "verified": True}]
    assert deployment.until(lambda: deployment.reports("prefill")) == [
        {"role": "prefill", "state": "SUCCEEDED", "parts": 3}]


def test_the_probes_podman_runs_pass_and_the_local_socket_has_the_documented_mode(deployment):
    for role in IPS:
        deployment.until(lambda r=role: deployment.healthy(r), timeout=60, why=f"{role}'s broker never healthy")
        mode = deployment.podman("exec", deployment.container(role, "kvbroker"), "stat", "-c", "%a %u %g",
                                 "/run/kvbroker/kvbroker.sock").stdout.split()
        assert mode == ["660", "10001", "10001"], mode  # README, Ports: mode 0660 from the moment it exists


def test_a_killed_broker_comes_back_and_the_next_request_moves(deployment):
    """SIGKILL to the decode broker's process, as a crash: podman restarts the container (the pod's
    restartPolicy Always, as kubelet restarts a native sidecar), the server stand-in registers its engine
    again on the new broker, and a new request pair moves and verifies."""
    test_a_request_moves_between_the_pods_verified_to_the_byte(deployment)
    broker = deployment.container("decode", "kvbroker")
    started = deployment.podman("inspect", "--format", "{{.State.StartedAt}}", broker).stdout
    pid = int(deployment.podman("inspect", "--format", "{{.State.Pid}}", broker).stdout)
    os.kill(pid, signal.SIGKILL)
    deployment.until(lambda: deployment.podman("inspect", "--format", "{{.State.StartedAt}}", broker).stdout != started
                     and deployment.healthy("decode"), timeout=120, why="the killed broker did not come back")
    runs = {role: deployment.one_shot(role, "pods-2") for role in ("decode", "prefill")}
    outputs = {role: run.communicate(timeout=180) for role, run in runs.items()}
    assert runs["decode"].returncode == 0, outputs["decode"]
    report = json.loads(outputs["decode"][0].strip().splitlines()[-1])
    assert report["verified"] and report["mismatched_bytes"] == 0, report
    assert runs["prefill"].returncode == 0, outputs["prefill"]


def test_a_request_in_flight_on_a_killed_broker_fails_with_its_status_and_the_next_one_moves(deployment):
    """Decode's grant is offered and prefill holds it without sending (HOLD=1): the request is in flight
    when the decode broker dies. Decode's server sees it fail, and the restarted broker holds nothing of it."""
    test_a_request_moves_between_the_pods_verified_to_the_byte(deployment)
    holder = deployment.one_shot("prefill", "pods-3", "HOLD=1")
    waiting = deployment.one_shot("decode", "pods-3")
    broker = deployment.container("decode", "kvbroker")
    assert json.loads(waiting.stdout.readline()) == {"offered": "pods-3"}  # its word once the grant is live
    started = deployment.podman("inspect", "--format", "{{.State.StartedAt}}", broker).stdout
    os.kill(int(deployment.podman("inspect", "--format", "{{.State.Pid}}", broker).stdout), signal.SIGKILL)
    out, err = waiting.communicate(timeout=180)  # the rest of its output
    holder.kill()
    assert waiting.returncode == 1, (out, err)
    report = json.loads(out.strip().splitlines()[-1])
    # The client's word for a request its broker lost (README, client: requests in flight at a restart
    # are lost with the old broker): Unavailable, the watch cut with the process.
    assert report["verified"] is False and report["error"].startswith("UNAVAILABLE:"), report
    deployment.until(lambda: deployment.podman("inspect", "--format", "{{.State.StartedAt}}", broker).stdout
                     != started and deployment.healthy("decode"), timeout=120)


def test_a_pod_stopped_ends_the_other_sides_request_with_the_drains_status_and_nothing_stays_held(deployment):
    """Prefill's pod stops (SIGTERM, as a rollout or a drain does) with decode's grant offered to it and
    nothing sent: the prefill broker drains and fails what it holds, telling decode, whose request ends
    UNAVAILABLE naming the sender ("broker shut down before the request completed") once the drain's
    grace (20 s) ran out, before the grant's expiry (60 s); the decode broker holds no request afterwards.
    Runs last: the pod stays stopped."""
    test_a_request_moves_between_the_pods_verified_to_the_byte(deployment)
    holder = deployment.one_shot("prefill", "pods-4", "HOLD=1")
    waiting = deployment.one_shot("decode", "pods-4", "EXPIRY_S=60")
    assert json.loads(waiting.stdout.readline()) == {"offered": "pods-4"}
    # As kubelet stops a pod, its native sidecar (the broker) gets SIGTERM and the pod's grace (60 s), which
    # covers the broker's drain (KVBROKER_SHUTDOWN_GRACE_S, 20 s) after which it fails what it holds; the
    # sandbox goes last. (`podman pod stop` alone stops the sandbox with the others, and with the pod's
    # shared PID namespace its end kills every process at once: no drain.)
    deployment.podman("stop", "--time", str(deployment.grace_s), deployment.container("prefill", "kvbroker"),
                      timeout=180)
    holder.kill()
    deployment.podman("pod", "stop", deployment.name["prefill"], timeout=60)
    out, err = waiting.communicate(timeout=120)
    report = json.loads(out.strip().splitlines()[-1])
    assert waiting.returncode == 1, (report, err)
    assert report["error"] == ("UNAVAILABLE: sender 'prefill-inference-0' failed: broker shut down before the "
                               "request completed"), report

    status = json.loads(deployment.podman("exec", deployment.container("decode", "kvbroker"), "kvbroker", "status",
                                          "--json").stdout)
    # GetBrokerInfo counts requests per state since start, each once as PENDING and once as its end:
    # none live is PENDING = SUCCEEDED + FAILED (kvbroker_tools.serving.stack.broker_holds).
    counts = status["request_counts"]
    assert counts["PENDING"] == counts["SUCCEEDED"] + counts["FAILED"], counts  # nothing stays on decode's broker
