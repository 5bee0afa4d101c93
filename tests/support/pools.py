"""Real brokers, clients and shared-memory pools for the client tests (tests/client), through the
public client only; tests/client/conftest.py's fixtures are made of these.

- `connect`: a BrokerClient with the tests' deadline (`CALL_TIMEOUT_S`); `release`: what a test
  registered through it unregistered, and the client closed;
- `BrokerPair` (the shared pair's processes), `Brokers` (a test's own brokers, each restartable);
- `Pools`: SharedPools of one test, random or `CANARY`-filled, unlinked after it;
- `unique`, `fragmented`: engine ids, page ids in scattered runs;
- `expected_destination`, `assert_pool_equals`: every byte of a destination pool after a transfer.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from dataclasses import dataclass

import numpy as np

from kvbroker_client import BrokerClient, ComponentSpec
from kvbroker_client.tensors import SharedPool
from kvbroker_tools.launch import BrokerProcess, start_broker

CANARY = 0xA5
BROKER_FLAGS = ("--backend", "nixl", "--log-level", "WARNING")
CALL_TIMEOUT_S = 30.0  # the clients' default deadline: generous, the machine may be busy with other suites


async def connect(target: str, **kwargs) -> BrokerClient:
    kwargs.setdefault("timeout", CALL_TIMEOUT_S)
    return await BrokerClient.connect(target, **kwargs)


@dataclass
class BrokerPair:
    prefill: BrokerProcess
    decode: BrokerProcess


async def release(client: BrokerClient) -> None:
    """Unregister what a test registered through this client, so the shared brokers stay clean."""
    for engine_id in client.registered_engines:
        try:
            await client.unregister_engine(engine_id, timeout=30)
        except Exception:  # noqa: BLE001 - a broker a test stopped on purpose
            pass
    await client.close()


class Brokers:
    """Brokers of one test, each restartable on its own port; all stopped after the test."""

    def __init__(self) -> None:
        self.live: list[BrokerProcess] = []
        self._names = itertools.count(1)

    async def start(self, *args: str, name: str | None = None) -> BrokerProcess:
        broker = await start_broker(name or f"client-test-{next(self._names)}", *BROKER_FLAGS, *args)
        self.live.append(broker)
        return broker

    async def stop(self, broker: BrokerProcess) -> None:
        await broker.stop()
        self.live.remove(broker)

    async def restart(self, broker: BrokerProcess, *args: str) -> BrokerProcess:
        """Stop `broker`, then start a new process on the same local and peer addresses."""
        await self.stop(broker)
        return await self.start("--listen", broker.listen, "--peer-listen", broker.peer_listen, *args,
                                name=broker.broker_id)

    async def close(self) -> None:
        await asyncio.gather(*(b.stop() for b in self.live))


class Pools:
    """Shared-memory pools of one test, unlinked after it."""

    def __init__(self) -> None:
        self._made: list[SharedPool] = []

    def make(self, size: int, *, fill: str = "random", seed: int = 0) -> SharedPool:
        pool = SharedPool(size, prefix="kvbct")
        self._made.append(pool)
        if fill == "random":
            pool.bytes[:] = np.random.default_rng(seed).integers(0, 256, size=pool.size, dtype=np.uint8)
        else:
            pool.bytes[:] = CANARY
        return pool

    def close(self) -> None:
        for pool in self._made:
            pool.close()


_numbers = itertools.count(1)


def unique(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_numbers)}"


def fragmented(rng: np.random.Generator, num_pages: int, count: int, max_run: int = 4) -> np.ndarray:
    """`count` distinct page ids in runs of 1..max_run consecutive pages, in shuffled order."""
    out, taken = [], 0
    for block in rng.permutation(num_pages // max_run):
        n = min(int(rng.integers(1, max_run + 1)), count - taken)
        out.append(np.arange(block * max_run, block * max_run + n))
        taken += n
        if taken == count:
            return np.concatenate(out)
    raise ValueError(f"cannot place {count} pages in {num_pages}")


def expected_destination(src: SharedPool, dst: SharedPool, before: np.ndarray, src_specs: list[ComponentSpec],
                         dst_specs: list[ComponentSpec], src_ids, dst_ids) -> np.ndarray:
    """The destination pool as it must be: source pages at the destination page ids, canaries elsewhere."""
    expected = before.copy()
    sources = {(c.component, b.layer_id, b.role): (b, c.num_pages) for c in src_specs for b in c.layer_buffers}
    for comp in dst_specs:
        for d in comp.layer_buffers:
            s, s_pages = sources[(comp.component, d.layer_id, d.role)]
            assert s.item_len == d.item_len
            src_pages = src.bytes[s.memory.offset:s.memory.offset + s_pages * s.item_len].reshape(s_pages, -1)
            dst_pages = expected[d.memory.offset:d.memory.offset + comp.num_pages * d.item_len].reshape(
                comp.num_pages, -1)
            dst_pages[np.asarray(dst_ids)] = src_pages[np.asarray(src_ids)]
    return expected


def assert_pool_equals(dst: SharedPool, expected: np.ndarray) -> None:
    """Every byte of the destination pool: moved pages equal the source, all else still canary."""
    diff = np.flatnonzero(dst.bytes != expected)
    assert diff.size == 0, f"{diff.size} bytes differ, first at offset {diff[0] if diff.size else None}"
