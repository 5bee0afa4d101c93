"""Broker work that blocks (mapping memory, CUDA driver calls) runs in a worker thread, and a caller
cancelled meanwhile leaves nothing behind."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvbroker.flows.broker import _in_thread


async def test_the_event_loop_runs_while_the_work_blocks():
    started, release = threading.Event(), threading.Event()

    def blocking() -> str:
        started.set()
        assert release.wait(10)
        return "mapped"

    work = asyncio.create_task(_in_thread(blocking, undo=lambda _: None))
    assert await asyncio.to_thread(started.wait, 10)
    assert not work.done()  # the loop got here while the work was blocked
    release.set()
    assert await work == "mapped"


async def test_a_cancelled_caller_has_what_the_thread_made_undone():
    started, release = threading.Event(), threading.Event()
    undone: list[str] = []
    undo_ran = threading.Event()

    def blocking() -> str:
        started.set()
        assert release.wait(10)
        return "pool"

    def undo(made: str) -> None:
        undone.append(made)
        undo_ran.set()

    work = asyncio.create_task(_in_thread(blocking, undo=undo))
    assert await asyncio.to_thread(started.wait, 10)
    work.cancel()
    with pytest.raises(asyncio.CancelledError):
        await work
    assert undone == []  # the thread is still mapping: nothing to undo yet
    release.set()
    assert await asyncio.to_thread(undo_ran.wait, 10)
    assert undone == ["pool"]


async def test_a_failure_in_the_thread_reaches_the_caller_and_undoes_nothing():
    undone: list[object] = []

    def failing() -> None:
        raise ValueError("segment not found")

    with pytest.raises(ValueError, match="segment not found"):
        await _in_thread(failing, undo=undone.append)
    assert undone == []
