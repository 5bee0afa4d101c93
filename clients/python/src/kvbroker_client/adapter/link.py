"""EngineLink: one engine (an inference server's rank) on its local broker.

    link = EngineLink(settings, engine_id, holder="sglang prefill pid 12")
    link.open(topology, components)     engine thread, bounded: connect, register, read the broker's info
    link.broker_address, link.broker_id the broker's peer address and id, for the other side (as the client
                                        last saw them: a broker restarted under another id is told)
    link.spawn(coro, name=...)          work on the link's loop (a LoopThread), never the engine's thread
    link.close()                        end every task, close the session: the broker releases the engine

It is the only holder of a BrokerClient in an adapter: requests (sending.py, receiving.py) call the
broker through `link.client` on `link.loop`.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Coroutine, Sequence
from typing import Any

from kvbroker_client.adapter.loop import LoopThread
from kvbroker_client.adapter.settings import AdapterSettings
from kvbroker_client.client import BrokerClient
from kvbroker_client.model import ComponentSpec, Topology

log = logging.getLogger(__name__)


class EngineLink:
    def __init__(self, settings: AdapterSettings, engine_id: str, *, holder: str) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.holder = holder
        self.loop: LoopThread | None = None
        self.client: BrokerClient | None = None

    @property
    def broker_address(self) -> str:
        """The broker's peer address: where the other side's broker reaches it."""
        return "" if self.client is None else self.client.peer_address

    @property
    def broker_id(self) -> str:
        """The broker's id: the other side's parts name it as the receiver whose offer they write into."""
        return "" if self.client is None else self.client.broker_id

    @property
    def is_open(self) -> bool:
        return self.client is not None

    def open(self, topology: Topology, components: Sequence[ComponentSpec]) -> None:
        """Connect to the broker and register the engine; raises the broker's error (bounded by
        connect_timeout_s), the link closed again."""
        if self.client is not None:
            return
        self.loop = LoopThread(f"kvbroker {self.engine_id}")
        timeout = self.settings.connect_timeout_s

        async def connect() -> BrokerClient:
            client = await BrokerClient.connect(self.settings.address, timeout=timeout, holder=self.holder)
            try:
                await client.register_engine(self.engine_id, topology, components)
                await client.info()  # the broker's id and peer address, which the client keeps up to date
                return client
            except BaseException:
                await client.close()
                raise

        try:
            self.client = self.loop.run(connect(), timeout=timeout + 5)
        except BaseException:
            self.close()
            raise
        log.info("kvbroker: engine %s registered with the broker at %s (peer address %s): %s", self.engine_id,
                 self.settings.address, self.broker_address,
                 ", ".join(f"{c.component.name} {len(c.layer_buffers)} buffers" for c in components))

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str) -> concurrent.futures.Future:
        assert self.loop is not None, "the link is not open"
        return self.loop.spawn(coro, name=name)

    def close(self) -> None:
        """End every task on the loop, then close the client (its session: the broker releases the engine)."""
        if self.loop is not None:
            client = self.client
            self.loop.close(before_stop=client.close() if client is not None else None)
