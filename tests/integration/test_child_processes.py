"""The child processes kvbroker starts say how they died: exit code or signal, with their stderr tail."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from kvbroker.tools.launch import ChildDied, start_broker
from tests.conftest import run_engines_in_child

pytestmark = pytest.mark.integration

async def test_a_broker_killed_by_a_signal_says_so_with_its_stderr_tail():
    broker = await start_broker("doomed", "--backend", "mooncake", "--log-level", "INFO")
    os.kill(broker.pid, signal.SIGSEGV)
    await asyncio.wait_for(broker.process.wait(), 30)
    with pytest.raises(ChildDied) as died:
        await broker.stop()
    message = str(died.value)
    assert f"broker doomed (pid {broker.pid}) exited with signal SIGSEGV (-11)" in message
    assert "Fatal Python error: Segmentation fault" in message, message  # faulthandler's stacks, in the tail


async def test_a_broker_that_exits_before_it_is_ready_says_how():
    with pytest.raises(ChildDied) as died:
        await start_broker("refused", "--backend", "no-such-engine")
    message = str(died.value)
    assert "broker refused" in message and "exited with code 1 before it was ready" in message, message
    assert "no-such-engine" in message, message  # the settings' complaint, from its stderr


async def test_a_bench_child_killed_by_a_signal_says_so_with_its_stderr_tail():
    from kvbroker.tools.bench_children import Child

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
