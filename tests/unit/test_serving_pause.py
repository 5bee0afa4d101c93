"""The serving benchmark measures one deployment with the others paused: `PDStack.pause` stops every
process of a deployment (each server's whole process group), `resume` lets it run again, and
`compare.only` leaves exactly the asked deployment running; `processes` and `measuring` give each
request's per-thread CPU and run-queue delay."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from kvbroker_tools.serving import client, compare
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


async def test_a_deployments_processes_are_each_servers_whole_group(deployments):
    a = deployments["a"]
    got = a.processes()
    assert set(got) == {"router", "prefill", "decode"}  # no brokers in SGLang's own deployment
    assert sorted(got["decode"]) == sorted([a.decode.pid, a.decode_child])
    assert got["prefill"][0] == a.prefill.pid and len(got["prefill"]) == 2


async def test_measured_requests_sum_each_roles_threads_per_label():
    """`measuring` adds each request's thread times to its label's Series; a deployment that worked
    between the snapshots (here the ask itself spins in a thread of this process) shows it."""
    me = {"client": [os.getpid()]}

    async def ask(http, url, prompt, tokens):
        deadline = time.process_time() + 0.02
        while time.process_time() < deadline:  # CPU in this process's main thread, inside the window
            pass
        return client.Answer([1], 0.001, 0.002, {})

    series = await compare.interleaved_ttft(None, {"a": "u", "b": "v"}, [[1], [2]], 1, warmup=0, ask=ask,
                                            measuring={"a": me})
    assert series["b"].threads == {}  # not measured
    cpu = sum(t.cpu_ns for (role, _), t in series["a"].threads.items() if role == "client")
    assert cpu >= 2 * 20_000_000
