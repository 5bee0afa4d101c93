"""The serving benchmark measures one deployment with the others paused: `PDStack.pause` stops every
process of a deployment (each server's whole process group), `resume` lets it run again, and
`compare.only` leaves exactly the asked deployment running."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from kvbroker_tools.serving import compare
from kvbroker_tools.serving.stack import PDStack, ServerProcess

# A leader that starts a child in its process group, as an SGLang server starts its scheduler.
FAMILY = ("import subprocess, sys, time; "
          "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
          "print(child.pid, flush=True); time.sleep(120)")


def state(pid: int) -> str:
    """The process's state letter from /proc (R, S, T for stopped, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def pids(stack: PDStack) -> list[int]:
    return [p.pid for p in (stack.prefill, stack.decode, stack.router)] + [stack.decode_child]


async def stopped(stack: PDStack, want: bool, timeout: float = 10.0) -> set[bool]:
    """Whether each process is stopped, once every one is as `want` says or `timeout` passed (a
    signal lands when its target is next scheduled: polled, not assumed)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        seen = {state(pid) == "T" for pid in pids(stack)}
        if seen == {want} or loop.time() > deadline:
            return seen
        await asyncio.sleep(0.01)


async def family(name: str, tmp_path: Path) -> tuple[ServerProcess, int]:
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", FAMILY, stdout=asyncio.subprocess.PIPE,
                                                   start_new_session=True)
    child = int(await asyncio.wait_for(process.stdout.readline(), 30))
    return ServerProcess(name, process, "http://127.0.0.1:1", tmp_path / f"{name}.log", [], {}), child


@pytest.fixture
async def deployments(tmp_path):
    made: dict[str, PDStack] = {}
    try:
        for label in ("a", "b"):
            (prefill, _), (decode, decode_child), (router, _) = [await family(f"{label}-{n}", tmp_path)
                                                                 for n in ("prefill", "decode", "router")]
            made[label] = PDStack("mooncake", "mooncake", tmp_path, tmp_path, prefill, decode, router)
            made[label].decode_child = decode_child
        yield made
    finally:
        for stack in made.values():
            await stack.stop()


async def test_only_pauses_every_process_of_the_other_deployments_and_resumes_the_asked_one(deployments):
    a, b = deployments["a"], deployments["b"]
    compare.only(deployments, "a")
    assert await stopped(b, True) == {True}
    assert await stopped(a, False) == {False}

    compare.only(deployments, "b")
    assert await stopped(a, True) == {True}
    assert await stopped(b, False) == {False}


async def test_a_paused_deployment_still_stops(deployments):
    compare.only(deployments, "a")
    await asyncio.wait_for(deployments["b"].stop(), 20)  # SIGTERM reaches it: stop resumed it first
    assert deployments["b"].prefill.process.returncode is not None
