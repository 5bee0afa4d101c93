"""Starting and stopping broker processes: for the demo, the benchmarks and the integration tests.

`start_broker` spawns `python -m kvbroker serve` on loopback with port 0 and waits (bounded) for
its ready line; `BrokerProcess.stop` sends SIGTERM and waits, then kills if it must; `stop_all`
stops several. A broker that dies unasked is logged when it dies, and `stop` raises ChildDied for
it. `exit_description` and `exit_report` say how any child process ended, for every tool's errors.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)

STDERR_TAIL_LINES = 20
FATAL_TAIL_LINES = 200  # faulthandler's report of a fatal signal: the error line, then every thread's stack


def exit_description(returncode: int) -> str:
    """How a child process ended: "exited with code 1", "exited with signal SIGSEGV (-11)"."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = str(-returncode)
    return f"exited with signal {name} ({returncode})"


def exit_report(what: str, returncode: int, stderr_lines: Sequence[str], when: str = "") -> str:
    """`what` and how it ended, with the last lines it wrote on stderr (from faulthandler's "Fatal
    Python error" on, when it wrote one): the message of a child's death."""
    recent = list(stderr_lines)[-FATAL_TAIL_LINES:]
    fatal = [i for i, line in enumerate(recent) if line.startswith("Fatal Python error")]
    tail = recent[fatal[-1]:] if fatal else recent[-STDERR_TAIL_LINES:]
    said = "its last stderr lines:\n" + "\n".join(tail) if tail else "nothing on its stderr"
    return f"{what} {exit_description(returncode)}{' ' + when if when else ''}; {said}"


class ChildDied(RuntimeError):
    """A child process ended other than as asked; the message says how, with its stderr tail."""


@dataclass
class BrokerProcess:
    process: asyncio.subprocess.Process
    listen: str
    peer_listen: str
    broker_id: str
    _stderr_task: asyncio.Task | None = field(default=None, repr=False)
    stderr_lines: list[str] = field(default_factory=list, repr=False)  # stdout's lines after ready, too
    metrics_listen: str = ""  # the metrics endpoint as bound, when started with --metrics-listen
    health_listen: str = ""  # the health listener as bound, when started with --health-listen
    _asked: str = field(default="", repr=False)  # "stop" or "kill" once we ended it; empty: nobody asked
    _watch: asyncio.Task | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._watch = asyncio.ensure_future(self._log_unasked_death())

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_report(self, when: str = "") -> str:
        """How the broker ended, with its stderr tail; only once it has."""
        return exit_report(f"broker {self.broker_id} (pid {self.pid})", self.process.returncode, self.stderr_lines,
                           when)

    async def _log_unasked_death(self) -> None:
        """Say so the moment the broker dies unasked, whoever holds it and however it is stopped later."""
        code = await self._ended()
        if code != 0 and not self._asked:
            log.error("%s", self.exit_report())

    async def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after `timeout`; the exit code. Raises ChildDied when the broker
        ended other than as asked: it died before (except by `kill`), failed its shutdown, or hung."""
        if self._asked == "kill":
            return await self._ended()
        when = ""  # it ended by itself
        if self.process.returncode is None:
            self._asked, when = "stop", "after SIGTERM"
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), timeout)
            except TimeoutError:
                when = f"after it ignored SIGTERM for {timeout:g}s"
                if self.process.returncode is None:
                    self.process.kill()
        code = await self._ended()
        if code != 0:
            raise ChildDied(self.exit_report(when))
        return code

    async def _ended(self) -> int:
        """Its exit code, once it has exited and its last lines are read."""
        code = await self.process.wait()
        if self._stderr_task is not None:
            await asyncio.wait([self._stderr_task], timeout=5)
        return code

    def kill(self) -> None:
        """SIGKILL; `stop` then reports nothing of how it ended (a death before it is logged already)."""
        self._asked = "kill"
        if self.process.returncode is None:
            self.process.kill()


async def stop_all(brokers: Iterable[BrokerProcess | None]) -> None:
    """Stop every broker given (None: one never started), then raise one ChildDied for all that died."""
    deaths = []
    for broker in brokers:
        if broker is None:
            continue
        try:
            await broker.stop()
        except ChildDied as exc:
            deaths.append(str(exc))
    if deaths:
        raise ChildDied("\n".join(deaths))


async def start_brokers(*starts: Awaitable[BrokerProcess]) -> list[BrokerProcess]:
    """Start brokers concurrently (`start_broker(...)` calls); if one fails, stop those that started
    and raise its error, so that no broker outlives a failed start."""
    started = await asyncio.gather(*starts, return_exceptions=True)
    failed = [s for s in started if isinstance(s, BaseException)]
    if failed:
        await stop_all(b for b in started if not isinstance(b, BaseException))
        raise failed[0]
    return list(started)


async def _drain(stream: asyncio.StreamReader, sink: list[str], echo: bool, log_file: Path | None = None) -> None:
    log = log_file.open("a", buffering=1) if log_file is not None else None  # noqa: ASYNC230  a local file
    try:
        while line := await stream.readline():
            text = line.decode(errors="replace").rstrip()
            sink.append(text)
            if echo:
                print(text, file=sys.stderr)
            if log is not None:
                log.write(text + "\n")
    finally:
        if log is not None:
            log.close()


async def start_broker(broker_id: str, *args: str, host: str = "127.0.0.1", timeout: float = 60.0,
                       env: dict[str, str] | None = None, echo_logs: bool = False,
                       prefix: Sequence[str] = (),
                       gate: Callable[[int], Awaitable[None]] | None = None,
                       log_file: Path | None = None) -> BrokerProcess:
    """Start a broker bound to `host` on free ports; extra `args` are serve flags (later flags win).
    With `log_file`, every line it logs is appended there too (the serving stacks keep it beside the
    servers' logs, for a failure read after the fact).

    `prefix` runs the broker under another command (e.g. a network-namespace wrapper); with `gate`,
    that wrapper writes one line to stdout once it is set up (in its namespace, say), then reads one
    line from stdin before starting the broker: `gate(pid)` runs between the two. Without the first
    line, a gate could act on the wrapper before it has become what the gate expects.
    """
    # faulthandler: a broker killed by a fatal signal leaves its Python stacks in its stderr tail.
    command = [*prefix, sys.executable, "-X", "faulthandler", "-m", "kvbroker", "serve", "--broker-id", broker_id,
               "--listen", f"{host}:0", "--peer-listen", f"{host}:0", *args]
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.PIPE if gate else None,
        # The tools' brokers move bytes over loopback, where UCX has tcp and shared memory only: transports
        # a forged region writes through (backends/transports.py), allowed here unless the caller says no.
        env={**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
             "KVBROKER_ALLOW_UNPROTECTED_TRANSPORTS": os.environ.get("KVBROKER_ALLOW_UNPROTECTED_TRANSPORTS", "true"),
             **(env or {})},
    )
    if gate is not None:
        try:
            if not await asyncio.wait_for(process.stdout.readline(), timeout):
                said = await asyncio.wait_for(process.stderr.read(), 5)
                raise ChildDied(exit_report(f"broker {broker_id} wrapper (pid {process.pid})",
                                            await asyncio.wait_for(process.wait(), 5),
                                            said.decode(errors="replace").splitlines(), "before its gate"))
            await gate(process.pid)
        except BaseException:
            process.kill()
            await process.wait()
            raise
        process.stdin.write(b"go\n")
        await process.stdin.drain()
        process.stdin.close()
    lines: list[str] = []
    stderr_task = asyncio.create_task(_drain(process.stderr, lines, echo_logs, log_file))
    try:
        while True:
            line = await asyncio.wait_for(process.stdout.readline(), timeout)
            if not line:
                await asyncio.wait([stderr_task], timeout=5)
                try:
                    code = await asyncio.wait_for(process.wait(), 5)
                except TimeoutError:  # it closed its stdout but lives on: ended here, and said so
                    process.kill()
                    code = await process.wait()
                raise ChildDied(exit_report(f"broker {broker_id} (pid {process.pid})", code, lines,
                                            "before it was ready"))
            try:
                ready = json.loads(line)
            except ValueError:
                continue
            if ready.get("event") == "ready":
                break
    except TimeoutError:  # not ready in time: killed, and the report says what it wrote meanwhile
        process.kill()
        code = await process.wait()
        await asyncio.wait([stderr_task], timeout=5)
        stderr_task.cancel()
        raise TimeoutError(exit_report(f"broker {broker_id} (pid {process.pid})", code, lines,
                                       f"(not ready within {timeout:g}s)")) from None
    except BaseException:
        if process.returncode is None:
            process.kill()
        await process.wait()
        stderr_task.cancel()
        raise
    # Keep reading stdout too, so a chatty library can never block the broker on a full pipe.
    stdout_task = asyncio.create_task(_drain(process.stdout, lines, echo_logs))
    both = asyncio.ensure_future(asyncio.gather(stderr_task, stdout_task))
    return BrokerProcess(process, ready["listen"], ready["peer_listen"], broker_id, both, lines,
                         metrics_listen=ready.get("metrics_listen", ""), health_listen=ready.get("health_listen", ""))


T = TypeVar("T")


async def stopping_on_signals(main: Awaitable[T]) -> T:
    """`main`, awaited with SIGTERM and SIGINT cancelling the task that awaits it, so that the blocks it
    is in stop the brokers and servers they started before the process ends (CancelledError then)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, task.cancel)
    try:
        return await main
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
