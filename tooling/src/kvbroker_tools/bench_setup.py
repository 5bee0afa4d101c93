"""What a bench run is given and what its sections share: the `Plan` (how much of each section runs;
`QUICK` for `--quick`) and a backend's `Side` (its pair of brokers, the public clients on them and its
engine-alone children), opened by `open_side` and closed, whatever dies, by `Side.close`.
Used by bench.py (the driver and the control-plane and registration sections) and bench_data.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvbroker_tools.bench_children import Child
from kvbroker_tools.launch import ChildDied, stop_all


@dataclass(frozen=True)
class Plan:
    """How much of each section to run; `quick` keeps all of it under a minute."""

    sizes_mib: tuple[int, ...] = (1, 4, 16, 64, 256, 1024)
    repeats: int = 5
    warmup: int = 1
    concurrency: tuple[int, ...] = (1, 16, 128)
    control_seconds: float = 4.0
    control_warmup_s: float = 1.0
    control_backends: int = 2  # how many of the backends get the control-plane section
    planner_sizes: tuple[int, ...] = (10**4, 10**5, 10**6, 10**7)
    naive_max: int = 10**6
    planner_repeats: int = 5
    registration_repeats: int = 5
    registration_pages: int = 1024
    op_timeout_s: float = 600.0  # bound on any one transfer or child answer: a hang fails the section
    parts_size_mib: int = 64  # the size whose request is also sent as `parts` parts of the offered flow
    parts: int = 8


QUICK = Plan(sizes_mib=(1, 4), repeats=2, concurrency=(1, 16), control_seconds=0.5, control_warmup_s=0.2,
             control_backends=1, planner_sizes=(10**4, 10**5), naive_max=10**4, planner_repeats=2,
             registration_repeats=1, registration_pages=16, op_timeout_s=60.0, parts_size_mib=4, parts=4)


@dataclass
class Side:
    """One backend's pair of brokers, public clients on them, and its engine-alone children: one that
    plays both sides in one process (`direct`), and a sender and a receiver in two (`direct2`)."""

    backend: str
    prefill: object  # launch.BrokerProcess
    decode: object
    p_client: object  # kvbroker_client.BrokerClient
    d_client: object
    direct: Child | None = None
    direct2_tx: Child | None = None
    direct2_rx: Child | None = None

    async def close(self) -> None:
        """Close all of it, whatever dies on the way; then raise one ChildDied for every child that died."""
        for client in (self.p_client, self.d_client):
            await client.close()
        deaths = []
        for child in (self.direct, self.direct2_tx, self.direct2_rx):
            if child is not None:
                try:
                    await child.stop()
                except ChildDied as exc:
                    deaths.append(str(exc))
        try:
            await stop_all((self.prefill, self.decode))
        except ChildDied as exc:
            deaths.append(str(exc))
        if deaths:
            raise ChildDied("\n".join(deaths))


async def open_side(backend: str, with_direct: bool, timeout: float) -> Side:
    from kvbroker_client.client import BrokerClient
    from kvbroker_tools.launch import start_broker, start_brokers

    flags = ("--backend", backend, "--log-level", "WARNING", "--transfer-timeout-s", str(timeout),
             "--metrics-listen", "127.0.0.1:0")  # scraped only at the control plane's window edges
    prefill, decode = await start_brokers(start_broker(f"bench-prefill-{backend}", *flags),
                                          start_broker(f"bench-decode-{backend}", *flags))
    p_client = await BrokerClient.connect(prefill.listen, transfer_timeout=timeout)
    d_client = await BrokerClient.connect(decode.listen, transfer_timeout=timeout)
    side = Side(backend, prefill, decode, p_client, d_client)
    if with_direct:
        side.direct, side.direct2_tx, side.direct2_rx = await asyncio.gather(
            *(Child.start("direct", backend) for _ in range(3)))
        for child in (side.direct, side.direct2_tx, side.direct2_rx):
            child.timeout = timeout
    return side
