"""The child processes kvbroker starts: they reach exec while gRPC is busy, and each says how it died.

The first test is the stress test of a grpcio crash: with gRPC's fork handlers on, a process whose
grpc.aio calls are in flight and which starts a child through uvloop (fork, then exec) loses that
child to a SIGSEGV in gRPC's event-engine threads about once in 30 starts, before it reaches exec.
kvbroker turns the handlers off when it is imported (kvbroker/__init__.py), as every kvbroker entry
point imports it before grpc. KVBROKER_STRESS_SPAWNS sets how many children it starts (default 300).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil
import signal
import sys

import pytest

from kvbroker_client.client import BrokerClient
from kvbroker_tools.launch import ChildDied, exit_description, start_broker
from tests.support.brokers import REPO_ROOT, run_engines_in_child

pytestmark = pytest.mark.integration

CALLERS = 16


async def spawn_while_calling(spawns: int) -> dict:
    """`spawns` children that exit at once, one after another, while CALLERS tasks keep unary calls
    to a broker in flight; how each child ended, and how many calls ran meanwhile."""
    broker = await start_broker("fork-stress", "--backend", "mooncake", "--log-level", "WARNING")
    client = await BrokerClient.connect(broker.listen)
    calls, stopping = 0, asyncio.Event()

    async def keep_calling() -> None:
        nonlocal calls
        while not stopping.is_set():
            await client.info()
            calls += 1

    callers = [asyncio.create_task(keep_calling()) for _ in range(CALLERS)]
    ended: collections.Counter[str] = collections.Counter()
    try:
        for _ in range(spawns):
            child = await asyncio.create_subprocess_exec(
                shutil.which("true"), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL)
            ended[exit_description(await child.wait())] += 1
    finally:
        stopping.set()
        await asyncio.gather(*callers, return_exceptions=True)
        await client.close()
        await broker.stop()
    return {"ended": dict(ended), "calls": calls}


# As `python -m kvbroker` and its children do: kvbroker first, then the rest, on uvloop.
STRESS = ("import kvbroker, json, os, sys, uvloop\n"
          "from tests.integration.test_child_processes import spawn_while_calling\n"
          "print(json.dumps(uvloop.run(spawn_while_calling(int(sys.argv[1])))), flush=True)\n"
          "os._exit(0)\n")


async def test_children_started_while_grpc_calls_are_in_flight_all_reach_exec():
    spawns = int(os.environ.get("KVBROKER_STRESS_SPAWNS", "300"))
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}  # what kvbroker sets, not us
    stress = await asyncio.create_subprocess_exec(sys.executable, "-X", "faulthandler", "-c", STRESS, str(spawns),
                                                  cwd=REPO_ROOT, env=env, stdout=asyncio.subprocess.PIPE,
                                                  stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(stress.communicate(), 60 + spawns)
    finally:
        if stress.returncode is None:
            stress.kill()
            await stress.wait()
    assert stress.returncode == 0, f"the stress process {exit_description(stress.returncode)}:\n{err.decode()[-3000:]}"
    seen = json.loads(out.decode().strip().splitlines()[-1])
    assert seen["ended"] == {"exited with code 0": spawns}, seen
    assert seen["calls"] > 0, seen


async def test_a_broker_killed_by_a_signal_says_so_with_its_stderr_tail():
    broker = await start_broker("doomed", "--backend", "mooncake", "--log-level", "INFO")
    os.kill(broker.pid, signal.SIGSEGV)
    await asyncio.wait_for(broker.process.wait(), 30)
    with pytest.raises(ChildDied) as died:
        await broker.stop()
    message = str(died.value)
    assert f"broker doomed (pid {broker.pid}) exited with signal SIGSEGV (-11)" in message
    assert "Fatal Python error: Segmentation fault" in message, message  # faulthandler's stacks, in the tail


async def test_a_broker_that_ignores_sigterm_is_killed_and_says_so():
    broker = await start_broker("stuck", "--backend", "mooncake")
    os.kill(broker.pid, signal.SIGSTOP)  # a stopped process cannot act on SIGTERM
    with pytest.raises(ChildDied) as died:
        await broker.stop(timeout=1)
    assert "exited with signal SIGKILL (-9) after it ignored SIGTERM for 1s" in str(died.value), str(died.value)


async def test_a_broker_killed_on_purpose_stops_quietly():
    broker = await start_broker("killed", "--backend", "mooncake")
    broker.kill()
    assert await broker.stop() == -signal.SIGKILL


async def test_a_broker_that_exits_before_it_is_ready_says_how():
    with pytest.raises(ChildDied) as died:
        await start_broker("refused", "--backend", "no-such-engine")
    message = str(died.value)
    assert "broker refused" in message and "exited with code 2 before it was ready" in message, message
    assert "backend (--backend / KVBROKER_BACKEND)" in message and "no-such-engine" in message, message


async def test_a_broker_not_ready_in_time_is_killed_and_its_stderr_reported():
    # A wrapper that says something and never starts the broker: what a broker stuck in its start does.
    wrapper = ("sh", "-c", "echo 'stuck before the ready line' >&2; exec sleep 60", "sh")
    with pytest.raises(TimeoutError) as stuck:
        await start_broker("slow", "--backend", "mooncake", prefix=wrapper, timeout=1)
    message = str(stuck.value)
    assert "broker slow" in message and "SIGKILL" in message and "(not ready within 1s)" in message, message
    assert "stuck before the ready line" in message, message


async def test_a_bench_child_killed_by_a_signal_says_so_with_its_stderr_tail():
    from kvbroker_tools.bench_children import Child

    child = await Child.start("direct", "mooncake")
    try:
        with pytest.raises(RuntimeError, match="unknown op"):  # it is up and answering
            await child.ask(op="no-such-op")
        os.kill(child.process.pid, signal.SIGSEGV)
        with pytest.raises(ChildDied) as died:
            await child.reply(timeout=60)
    finally:
        await child.stop()
    message = str(died.value)
    assert "bench child direct" in message and "exited with signal SIGSEGV (-11)" in message, message
    assert "Fatal Python error: Segmentation fault" in message, message


async def die_by_sigsegv(backend: str) -> dict:
    os.kill(os.getpid(), signal.SIGSEGV)
    return {}


async def test_an_engines_child_killed_by_a_signal_says_so_with_its_stderr_tail():
    with pytest.raises(AssertionError) as died:
        await run_engines_in_child("tests.integration.test_child_processes", "die_by_sigsegv", "none", 60)
    message = str(died.value)
    assert "exited with signal SIGSEGV (-11)" in message and "Fatal Python error: Segmentation fault" in message


async def test_a_brokers_log_goes_to_its_log_file_line_for_line(tmp_path):
    """The serving stacks keep each broker's log beside the servers' (start_broker's log_file), so that a
    failure can be read after the fact: every line it wrote, in order, and the file closed once it ended."""
    broker = await start_broker("logged", "--backend", "mooncake", "--log-level", "DEBUG",
                                log_file=tmp_path / "broker.log")
    assert await broker.stop() == 0
    written = (tmp_path / "broker.log").read_text().splitlines()
    assert written and written == broker.stderr_lines[:len(written)]
    assert any('"broker stopped"' in line for line in written), written[-3:]
