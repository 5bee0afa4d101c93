"""Tasks an object owns (`OwnedTasks`): each kept, so that it is neither collected nor forgotten,
until it ends; at close, cancelled or waited for, bounded. Every class that starts tasks of its own
holds one: the offer intake, the part sender, the sessions, the notifier, the peer clients."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any


class OwnedTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run `coro` as a task owned here."""
        return self.add(asyncio.get_running_loop().create_task(coro, name=name))

    def add(self, task: asyncio.Task[Any]) -> asyncio.Task[Any]:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    async def wait(self, timeout: float) -> set[asyncio.Task[Any]]:
        """Wait up to `timeout` for every task to end; those still running."""
        if not self._tasks:
            return set()
        _, late = await asyncio.wait(list(self._tasks), timeout=timeout)
        return late

    async def cancel(self, timeout: float) -> None:
        """Cancel every task, then wait up to `timeout` for them to end."""
        for task in list(self._tasks):
            task.cancel()
        await self.wait(timeout)
