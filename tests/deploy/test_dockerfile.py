"""The image recipe, without a Docker engine: hadolint, the instructions it must hold, the build
context .dockerignore lets through, and its HEALTHCHECK against a real broker."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

from kvbroker.config import Settings
from tests.support.deploy import REPO_ROOT, build_context_files, dockerfile_instructions, env_of, tool

INSTRUCTIONS = dockerfile_instructions()
FINAL_STAGE = max(i.stage for i in INSTRUCTIONS)
FINAL = [i for i in INSTRUCTIONS if i.stage == FINAL_STAGE]


def stage_named(name: str) -> int:
    for i in INSTRUCTIONS:
        if i.keyword == "FROM" and re.search(rf"\bAS\s+{re.escape(name)}$", i.args, re.IGNORECASE):
            return i.stage
    raise AssertionError(f"no stage named {name}")


def only(keyword: str, instructions=FINAL):
    found = [i for i in instructions if i.keyword == keyword]
    assert found, f"no {keyword} in the final stage"
    return found[-1]


def test_hadolint_finds_nothing():
    result = subprocess.run([tool("hadolint"), "--no-color", "Dockerfile"], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_build_is_multi_stage_and_the_final_stage_copies_only_the_venv():
    assert sum(i.keyword == "FROM" for i in INSTRUCTIONS) >= 3
    copies = [i for i in FINAL if i.keyword == "COPY"]
    assert [c.flags().get("from") for c in copies] == ["build"]
    assert copies[0].args.split()[-2:] == ["/opt/venv", "/opt/venv"]


def test_flavor_is_a_build_arg_defaulting_to_cpu_that_picks_the_lock():
    global_args = [i.args for i in INSTRUCTIONS if i.stage == -1 and i.keyword == "ARG"]
    assert "FLAVOR=cpu" in global_args
    assert only("FROM").args == "base AS runtime"
    # buildah (podman build) does not expand an ARG in a stage name: no stage is chosen by one.
    assert not [i.args for i in INSTRUCTIONS if i.keyword == "FROM" and "$" in i.args.split()[0]
                and i.args.split()[0] != "${PYTHON_IMAGE}"]


def test_each_flavor_installs_its_lock_compiled_from_the_extras_pyproject_defines():
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    build = [i for i in INSTRUCTIONS if i.stage == stage_named("build") and i.keyword == "RUN"]
    install = next(i.args for i in build if "FLAVOR" in i.args)
    flavors = (("cpu", "image-cpu", "[nixl,mooncake-cpu]"), ("cuda", "runtime-cuda", "[nixl,mooncake]"))
    for flavor, lock, extra in flavors:
        command = re.search(rf"{flavor}\)(.*?);;", install).group(1)
        assert f"-r locks/{lock}.txt" in command and "--require-hashes" in command, flavor
        assert "--no-deps" in command, "a lock is installed as it is: nothing resolved at build time"
        assert "index-url" not in command, "every package from PyPI"
        assert re.search(rf"^-e \.{re.escape(extra)}$", (REPO_ROOT / "locks" / f"{lock}.in").read_text(),
                         re.MULTILINE), f"locks/{lock}.in must compile the daemon with {extra}"
    assert {"nixl", "mooncake-cpu", "mooncake"} <= set(extras)
    assert re.search(r"\*\).*exit 1", install), "an unknown FLAVOR must fail the build"


def test_the_cpu_image_carries_no_torch_and_no_cuda_library():
    pinned = re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", (REPO_ROOT / "locks" / "image-cpu.txt").read_text(),
                        re.MULTILINE)
    assert "nixl" in pinned and "mooncake-transfer-engine-non-cuda" in pinned
    assert not [p for p in pinned if p == "torch" or p.startswith(("nvidia-", "triton", "nixl-cu12"))], pinned


def test_the_packages_are_installed_after_their_locked_dependencies_and_without_resolving():
    build = [i for i in INSTRUCTIONS if i.stage == stage_named("build") and i.keyword == "RUN"]
    locked = next(n for n, i in enumerate(build) if "FLAVOR" in i.args)
    packages = next(n for n, i in enumerate(build) if "./clients/python" in i.args)
    assert locked < packages
    command = build[packages].args
    assert "--no-deps" in command and command.index("./clients/python") < command.index(" . ")


def test_engine_system_libraries_are_installed_for_both_flavors():
    base = [i for i in INSTRUCTIONS if i.stage == stage_named("base") and i.keyword == "RUN"]
    apt = next(i.args for i in base if "apt-get install" in i.args)
    for package in ("libibverbs1", "ibverbs-providers", "libnuma1", "libcurl4"):
        assert re.search(rf"\s{package}(\s|$)", apt), package
    assert "--no-install-recommends" in apt and "rm -rf /var/lib/apt/lists/*" in apt
    assert re.search(r"\bbase\b", next(i.args for i in INSTRUCTIONS if i.stage == stage_named("runtime")))


def test_runs_as_a_non_root_numeric_user():
    user = only("USER").args.split(":")[0]
    assert user.isdigit() and int(user) != 0  # numeric, so that runAsNonRoot can verify it


def test_entrypoint_is_kvbroker_serve():
    assert only("ENTRYPOINT").exec_form() == ["kvbroker", "serve"]
    assert not [i for i in FINAL if i.keyword == "CMD"]


def test_default_settings_are_a_unix_socket_the_peer_port_and_json_logs():
    env = env_of(INSTRUCTIONS[: INSTRUCTIONS.index(only("ENTRYPOINT"))])
    settings = Settings(**{k.removeprefix("KVBROKER_").lower(): v for k, v in env.items()
                           if k.startswith("KVBROKER_")})
    assert settings.listen == "unix:/run/kvbroker/kvbroker.sock"
    assert settings.health_listen == "unix:/run/kvbroker/health.sock"  # what the HEALTHCHECK asks
    assert settings.peer_listen == "0.0.0.0:50052"
    assert settings.log_format == "json"
    assert only("EXPOSE").args.split() == ["50052", "9400"]  # peer API, Prometheus metrics
    assert any(i.keyword == "RUN" and "/run/kvbroker" in i.args for i in FINAL)


def test_healthcheck_asks_the_grpc_health_service():
    healthcheck = only("HEALTHCHECK")
    assert healthcheck.exec_form()[:3] == ["python", "-m", "kvbroker.ops.probe"]
    assert {"interval", "timeout", "start-period", "retries"} <= set(healthcheck.flags())


def test_build_context_holds_what_the_build_copies_and_nothing_private():
    files = build_context_files()
    for copy in (i for i in INSTRUCTIONS if i.keyword == "COPY" and "--from" not in i.args):
        for source in copy.args.split()[:-1]:
            assert any(f == source or f.startswith(source.rstrip("/") + "/") for f in files), source
    assert "kvbroker/cli.py" in files and "clients/python/pyproject.toml" in files
    for private in (".git/", ".venv/", "tests/", "deploy/", "Dockerfile"):
        assert not [f for f in files if f.startswith(private)], private


def test_build_context_builds_both_packages(tmp_path):
    context = tmp_path / "src"
    for name in build_context_files():
        (context / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, context / name)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                             "--wheel-dir", str(tmp_path / "wheels"), "./clients/python", "."],
                            cwd=context, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "wheels").glob("*.whl")) == [
        "kvbroker", "kvbroker_client"]
    (daemon,) = (tmp_path / "wheels").glob("kvbroker-*.whl")
    with zipfile.ZipFile(daemon) as wheel:  # the SIGBUS guard is compiled into it
        names = wheel.namelist()
    assert [n for n in names if n.startswith("kvbroker/memory/_memguard.") and n.endswith(".so")]
    # The daemon's wheel holds the daemon: no demo, bench or serving stand-ins (those are kvbroker_tools).
    assert {n.split("/")[0] for n in names if not n.startswith("kvbroker-")} == {"kvbroker"}, sorted(names)
    assert not [n for n in names if "tools" in n.split("/")[1:-1]], sorted(names)


@pytest.mark.integration
async def test_healthcheck_passes_against_a_serving_broker_and_fails_after_it_stops(tmp_path):
    from kvbroker_tools.launch import start_broker

    socket = f"unix:{tmp_path}/kvbroker.sock"
    image_env = {**env_of(INSTRUCTIONS[: INSTRUCTIONS.index(only("ENTRYPOINT"))]), "KVBROKER_LISTEN": socket,
                 "KVBROKER_HEALTH_LISTEN": f"unix:{tmp_path}/health.sock"}
    image_env.pop("PATH")
    command = only("HEALTHCHECK").exec_form()
    command[0] = sys.executable

    def healthcheck() -> subprocess.CompletedProcess:
        return subprocess.run(command, env={**os.environ, **image_env}, capture_output=True, text=True,
                              timeout=30)

    broker = await start_broker("healthcheck", "--listen", socket, env=image_env)
    try:
        serving = healthcheck()
    finally:
        await broker.stop()
    stopped = healthcheck()
    assert (serving.returncode, serving.stdout.strip()) == (0, "SERVING"), serving.stderr
    assert stopped.returncode == 1 and "UNAVAILABLE" in stopped.stderr
