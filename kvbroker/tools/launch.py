"""Starting and stopping broker processes: for the demo, the benchmarks and the integration tests.

`start_broker` spawns `python -m kvbroker serve` on loopback with port 0 and waits (bounded) for
its ready line; `BrokerProcess.stop` sends SIGTERM and waits, then kills if it must.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class BrokerProcess:
    process: asyncio.subprocess.Process
    listen: str
    peer_listen: str
    broker_id: str
    _stderr_task: asyncio.Task | None = field(default=None, repr=False)
    stderr_lines: list[str] = field(default_factory=list, repr=False)  # stdout's lines after ready, too
    metrics_listen: str = ""  # the metrics endpoint as bound, when started with --metrics-listen

    @property
    def pid(self) -> int:
        return self.process.pid

    async def stop(self, timeout: float = 30.0) -> int:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), timeout)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        if self._stderr_task is not None:
            await asyncio.wait([self._stderr_task], timeout=5)
        return self.process.returncode

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()


async def _drain(stream: asyncio.StreamReader, sink: list[str], echo: bool) -> None:
    while line := await stream.readline():
        text = line.decode(errors="replace").rstrip()
        sink.append(text)
        if echo:
            print(text, file=sys.stderr)


async def start_broker(broker_id: str, *args: str, host: str = "127.0.0.1", timeout: float = 60.0,
                       env: dict[str, str] | None = None, echo_logs: bool = False,
                       prefix: Sequence[str] = (),
                       gate: Callable[[int], Awaitable[None]] | None = None) -> BrokerProcess:
    """Start a broker bound to `host` on free ports; extra `args` are serve flags (later flags win).

    `prefix` runs the broker under another command (e.g. a network-namespace wrapper); with `gate`,
    that wrapper reads one line from stdin before starting the broker, and `gate(pid)` runs first.
    """
    command = [*prefix, sys.executable, "-m", "kvbroker", "serve", "--broker-id", broker_id,
               "--listen", f"{host}:0", "--peer-listen", f"{host}:0", *args]
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.PIPE if gate else None,
        env={**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"), **(env or {})},
    )
    if gate is not None:
        try:
            await gate(process.pid)
        except BaseException:
            process.kill()
            await process.wait()
            raise
        process.stdin.write(b"go\n")
        await process.stdin.drain()
        process.stdin.close()
    lines: list[str] = []
    stderr_task = asyncio.create_task(_drain(process.stderr, lines, echo_logs))
    try:
        while True:
            line = await asyncio.wait_for(process.stdout.readline(), timeout)
            if not line:
                await asyncio.wait([stderr_task], timeout=5)
                raise RuntimeError(f"broker {broker_id} exited before it was ready:\n" + "\n".join(lines[-30:]))
            try:
                ready = json.loads(line)
            except ValueError:
                continue
            if ready.get("event") == "ready":
                break
    except BaseException:
        process.kill()
        await process.wait()
        stderr_task.cancel()
        raise
    # Keep reading stdout too, so a chatty library can never block the broker on a full pipe.
    stdout_task = asyncio.create_task(_drain(process.stdout, lines, echo_logs))
    both = asyncio.ensure_future(asyncio.gather(stderr_task, stdout_task))
    return BrokerProcess(process, ready["listen"], ready["peer_listen"], broker_id, both, lines,
                         metrics_listen=ready.get("metrics_listen", ""))
