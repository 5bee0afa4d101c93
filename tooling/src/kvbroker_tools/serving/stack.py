"""Real SGLang 0.5.23 servers on this machine's CPU, started as users start them: for the tests, the demo
and the benchmark.

- `start_server`: one `python -m sglang.launch_server` (non-PD, prefill or decode), up once its
  `/health_generate` answers; `ServerProcess.stop` / `kill` end its whole process group.
- `start_router`: `python -m sglang_router.launch_router --pd-disaggregation` over a prefill and a decode.
- `start_pd`: the PD deployment: with `transfer="kvbroker"` a kvbroker broker per server (engine
  `engine`: nixl or mooncake) and `--disaggregation-transfer-backend kvbroker` (SGLANG_PLUGINS=kvbroker,
  KVBROKER_ADDRESS, as clients/README.md says); with `transfer="mooncake"` SGLang's own mooncake
  backend over TCP. `PDStack` restarts its decode server or a broker in place.
- `start_reference`: the plain server whose greedy tokens the PD answers must equal.

Everything binds 127.0.0.1 (run inside scripts/in-netns.sh); ports are picked free; every wait is
bounded, and a child that dies says how, with the tail of its log. Each server logs to a file in
`log_dir` (SGLang logs much; a file keeps its pipe from ever filling).

The servers run with `site/` first on PYTHONPATH: its `sgl_kernel` stand-in and its sitecustomize
(torchvision's schemas; KVBROKER_SERVING_MINIMAX=1 installs kvbroker_tools.serving.minimax).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvbroker_tools import threads
from kvbroker_tools.launch import BrokerProcess, ChildDied, exit_description, start_broker

SITE = Path(__file__).resolve().parent / "site"
LOG_TAIL_LINES = 40

# What SGLang 0.5.23 needs to serve on a CPU machine (../shared/research/sglang-cpu-serving.md says why).
# --dtype float32: with "auto" SGLang 0.5.23 runs a float32 config in float16 on CPU, where two candidate
# tokens often tie exactly, and a PD pair (other batches, other chunks) then picks the other one of the
# two than a non-PD server does.
# --sleep-on-idle: an idle scheduler otherwise spins a core (20 CPU-seconds in 20 s idle, 0.4 with it); three
# idle servers (a reference, prefill, decode) starved everything else on 2 cores. Idle means no request
# in any queue, PD's included, and it wakes on the next request's message at once.
CPU_FLAGS = ("--device", "cpu", "--dtype", "float32", "--attention-backend", "torch_native", "--disable-cuda-graph",
             "--disable-overlap-schedule", "--grammar-backend", "none", "--host", "127.0.0.1",
             "--skip-server-warmup", "--log-level", "info", "--max-total-tokens", "16384", "--sleep-on-idle")
DECODE_FLAGS = ("--disaggregation-decode-retraction-backup", "cpu_tensor")
# The brokers' peer calls: SGLang servers starting beside them on 2 busy cores starved a broker past
# the default 5 s once (a fresh clone's suite at load 20: the first request's offer got "no answer
# within 5.000s" and decode aborted it). What these stacks serve is not the peer timeout's test.
PEER_RPC_TIMEOUT_S = 30.0
START_TIMEOUT_S = 600.0  # tens of seconds alone; minutes on 2 busy cores (a decode restarted beside a CPU hog: over 5)


def shm_files_of_group(pgid: int) -> set[Path]:
    """The /dev/shm files that the processes of group `pgid` map or hold open.

    A server killed with SIGKILL (a crash test, or a stop past its timeout) leaves its segments behind:
    vLLM's and SGLang's queues, and its whole KV cache where an adapter moved it into /dev/shm (a GiB a
    server). On a 24 GiB machine a suite's worth of them fills memory, so whoever kills a server
    unlinks them once it is dead (a broker that still maps one keeps its mapping until it lets go).
    """
    held: set[Path] = set()
    for pid in threads.processes_of_group(pgid):
        proc = Path("/proc") / str(pid)
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
                if len(fields) == 6 and fields[5].startswith("/dev/shm/") and not fields[5].endswith(" (deleted)"):
                    held.add(Path(fields[5]))
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("/dev/shm/") and not target.endswith(" (deleted)"):
                        held.add(Path(target))
    return held


def unlink_all(paths: Iterable[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every server process (the router's too)."""
    path = os.pathsep.join([str(SITE), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {
        **os.environ,
        "PYTHONPATH": path,
        "SGLANG_USE_CPU_ENGINE": "1",
        "SGLANG_HOST_IP": "127.0.0.1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
        "PYTHONUNBUFFERED": "1",
        # /health answers from the HTTP server alone, as a probe every second should; by default it
        # runs a generation and answers after at least 1 s, past the router's 5 s timeout when busy
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",
        **(extra or {}),
    }


@dataclass
class ServerProcess:
    """A child with an HTTP port: an SGLang server or the router, its process group and its log file."""

    name: str
    process: asyncio.subprocess.Process
    url: str
    log_path: Path
    command: list[str]
    env: dict[str, str]
    bootstrap_port: int | None = None
    scratch: Path | None = None  # a directory of the server's own (its IPC sockets), removed once it ended
    _asked: bool = field(default=False, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> list[str]:
        try:
            return self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return []

    def exit_report(self, when: str = "") -> str:
        tail = self.log_tail()
        said = f"the last lines of {self.log_path}:\n" + "\n".join(tail) if tail else f"nothing in {self.log_path}"
        return (f"{self.name} (pid {self.pid}) {exit_description(self.process.returncode)}"
                f"{' ' + when if when else ''}; {said}")

    def alive(self) -> bool:
        return self.process.returncode is None

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    async def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM to its process group (SGLang drains and ends its children), SIGKILL after `timeout`;
        then the /dev/shm files the group held are unlinked. Raises ChildDied when it had died unasked before."""
        died_before = self.process.returncode is not None and not self._asked
        self._asked = True
        held = await asyncio.to_thread(shm_files_of_group, self.pid)
        if self.process.returncode is None:
            self._signal_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), timeout)
            except TimeoutError:
                pass
        self._signal_group(signal.SIGKILL)  # its scheduler and detokenizer too, whatever the leader did
        code = await self.process.wait()
        await asyncio.to_thread(unlink_all, held)
        self._remove_scratch()
        if died_before:
            raise ChildDied(self.exit_report("before it was stopped"))
        return code

    async def kill(self) -> int:
        """SIGKILL to the whole group at once: a crash, as the failure tests want it; then the /dev/shm
        files the group held are unlinked, as the dead processes can no longer do."""
        self._asked = True
        held = await asyncio.to_thread(shm_files_of_group, self.pid)
        self._signal_group(signal.SIGKILL)
        code = await self.process.wait()
        await asyncio.to_thread(unlink_all, held)
        self._remove_scratch()
        return code

    def _remove_scratch(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    async def wait_ready(self, path: str, timeout: float) -> None:
        """Until GET `path` answers 200; ChildDied if it exits first, TimeoutError (it is then killed)."""
        import aiohttp

        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            while True:
                if self.process.returncode is not None:
                    raise ChildDied(self.exit_report("before it was ready"))
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                    async with session.get(self.url + path) as response:
                        if response.status == 200:
                            return
                if time.monotonic() > deadline:
                    await self.kill()
                    raise TimeoutError(self.exit_report(f"(killed: {path} did not answer 200 within {timeout:g}s)"))
                # No event says a server is up: its HTTP port is polled, as SGLang's own launcher does.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.process.wait(), 0.5)


def _open_log(log_dir: Path, name: str, command: list[str]):
    """The child's log file, appended to (a restarted server continues its log), the command first."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / f"{name}.log", "ab")  # closed by spawn once the child holds it
    log.write(f"--- {time.strftime('%H:%M:%S')} {' '.join(command)}\n".encode())
    log.flush()
    return log


async def spawn(name: str, command: list[str], env: dict[str, str], log_dir: Path, url: str,
                bootstrap_port: int | None = None, scratch: Path | None = None) -> ServerProcess:
    """A server (or router) as a child in its own session, logging to `log_dir`/`name`.log; not waited for."""
    log = _open_log(log_dir, name, command)
    try:
        # Its own session: stop() and kill() reach SGLang's scheduler and detokenizer through the group.
        process = await asyncio.create_subprocess_exec(*command, stdout=log, stderr=asyncio.subprocess.STDOUT,
                                                       stdin=asyncio.subprocess.DEVNULL, env=env,
                                                       start_new_session=True)
    finally:
        log.close()
    return ServerProcess(name, process, url, Path(log.name), command, env, bootstrap_port, scratch)


async def start_server(name: str, model: Path, log_dir: Path, *, mode: str | None = None,
                       transfer: str | None = None, args: Sequence[str] = (), env: dict[str, str] | None = None,
                       port: int | None = None, bootstrap_port: int | None = None,
                       timeout: float = START_TIMEOUT_S, wait: bool = True) -> ServerProcess:
    """An SGLang server; `mode` None (plain), "prefill" or "decode" with `transfer` its backend."""
    port = port or free_port()
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), *CPU_FLAGS,
               "--port", str(port)]
    if mode is not None:
        command += ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", transfer]
        if mode == "prefill":
            bootstrap_port = bootstrap_port or free_port()
            command += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        else:
            command += list(DECODE_FLAGS)
    command += list(args)
    server = await spawn(name, command, server_env(env), log_dir, f"http://127.0.0.1:{port}", bootstrap_port)
    if wait:
        try:
            await server.wait_ready("/health_generate", timeout)
        except BaseException:  # cancelled or failed: nobody else holds it to stop it
            await server.kill()
            raise
    return server


async def start_router(prefill: ServerProcess, decode: ServerProcess, log_dir: Path, *,
                       timeout: float = 120.0, args: Sequence[str] = ()) -> ServerProcess:
    """SGLang's router in PD mode over one prefill (with its bootstrap port) and one decode."""
    port = free_port()
    command = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
               "--prefill", prefill.url, str(prefill.bootstrap_port), "--decode", decode.url,
               "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(free_port()), "--log-level", "info",
               # a decode server that died and came back is seen within seconds. /health is a liveness
               # answer (server_env); three failures in a row, not one: a probe that timed out while
               # the machine was busy or the router paused takes no server out of rotation
               "--health-check-endpoint", "/health", "--health-check-interval-secs", "1",
               "--health-failure-threshold", "3",
               "--health-success-threshold", "1", *args]
    router = await spawn("router", command, server_env(), log_dir, f"http://127.0.0.1:{port}")
    await router.wait_ready("/readiness", timeout)  # 200 once it holds healthy prefill and decode workers
    return router


@dataclass
class PDStack:
    """A prefill and a decode server behind SGLang's router; with kvbroker, a broker beside each server."""

    transfer: str  # "kvbroker" or "mooncake"
    engine: str  # the transfer engine: the brokers' (nixl, mooncake) or "mooncake" for SGLang's own
    model: Path
    log_dir: Path
    prefill: ServerProcess
    decode: ServerProcess
    router: ServerProcess
    brokers: dict[str, BrokerProcess] = field(default_factory=dict)  # "prefill", "decode"
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    decode_env: dict[str, str] = field(default_factory=dict)  # decode's only, over `env`
    owns_brokers: bool = True  # False: the caller's brokers, which `stop` leaves running

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def label(self) -> str:
        return f"kvbroker-{self.engine}" if self.transfer == "kvbroker" else "mooncake"

    async def restart_decode(self, *, kill: bool = True) -> None:
        """Decode killed (SIGKILL, a crash) or stopped, and started again on the same port."""
        if kill:
            await self.decode.kill()
        else:
            await self.decode.stop()
        await self.start_decode()

    async def start_decode(self) -> None:
        """A new decode server where the last one was (it has ended); back once the router holds it again."""
        if self.decode.alive():
            raise RuntimeError(f"decode (pid {self.decode.pid}) still runs on port {self.decode.port}")
        self.decode = await start_server("decode", self.model, self.log_dir, mode="decode", transfer=self.transfer,
                                         args=self.decode_args, env=self._server_env("decode"),
                                         port=self.decode.port)
        await self.router.wait_ready("/readiness", 120.0)

    async def restart_broker(self, side: str) -> BrokerProcess:
        """The broker beside `side` stopped and started again on the same addresses; the server's
        client finds it there and registers its engine again."""
        old = self.brokers[side]
        await old.stop()
        self.brokers[side] = await _start_broker(side, self.engine, self.log_dir, listen=old.listen,
                                                 peer_listen=old.peer_listen)
        return self.brokers[side]

    def _server_env(self, side: str) -> dict[str, str]:
        extra = dict(self.env) | (self.decode_env if side == "decode" else {})
        if self.transfer == "kvbroker":
            extra |= {"SGLANG_PLUGINS": "kvbroker", "KVBROKER_ADDRESS": self.brokers[side].listen,
                      "KVBROKER_ENGINE_PREFIX": f"{self.label}-{side}"}
        else:
            extra |= {"MOONCAKE_PROTOCOL": "tcp", "MC_FORCE_TCP": "1"}
        return extra

    def processes(self) -> dict[str, list[int]]:
        """Each part's processes by role (a server's whole process group: SGLang starts its scheduler and
        detokenizer as children), for per-thread CPU and run-queue delay (kvbroker_tools.threads)."""
        roles = {"router": self.router, "prefill": self.prefill, "decode": self.decode}
        out = {role: threads.processes_of_group(server.pid) for role, server in roles.items()}
        out |= {f"{side}_broker": [broker.pid] for side, broker in self.brokers.items()}
        return out

    def pause(self) -> None:
        """SIGSTOP to every process of the deployment: an idle SGLang scheduler spins on a core, so a
        deployment not being measured would take CPU from the one that is (2 cores here)."""
        self._signal_all(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_all(signal.SIGCONT)

    def _signal_all(self, sig: int) -> None:
        signal_all((self.router, self.prefill, self.decode), self.brokers.values(), sig)

    async def stop(self) -> None:
        """Everything, router first; raises ChildDied naming every child that had died unasked."""
        self.resume()  # a paused process would hold its SIGTERM until the SIGKILL
        await stop_in_order([self.router], [self.decode, self.prefill],
                            list(self.brokers.values()) if self.owns_brokers else [])


def signal_all(servers: Iterable[ServerProcess], brokers: Iterable[BrokerProcess], sig: int) -> None:
    """`sig` to each live server's process group and each live broker."""
    for server in servers:
        if server.alive():
            server._signal_group(sig)
    for broker in brokers:
        if broker.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(broker.pid, sig)


async def stop_in_order(*groups: Sequence[ServerProcess | BrokerProcess]) -> None:
    """Stops each group's children together, one group after the other, all of them whatever fails;
    raises ChildDied naming every child that had died unasked."""
    deaths = []
    for group in groups:
        ended = await asyncio.gather(*(child.stop() for child in group), return_exceptions=True)
        deaths += [str(e) for e in ended if isinstance(e, BaseException)]
    if deaths:
        raise ChildDied("\n".join(deaths))


async def _start_broker(side: str, engine: str, log_dir: Path, listen: str | None = None,
                        peer_listen: str | None = None) -> BrokerProcess:
    args = ["--backend", engine, "--log-level", os.environ.get("KVBROKER_SERVING_BROKER_LOG_LEVEL", "INFO"),
            "--peer-rpc-timeout-s", str(PEER_RPC_TIMEOUT_S)]
    if listen:
        args += ["--listen", listen, "--peer-listen", peer_listen]
    else:
        args += ["--listen", f"unix:{log_dir}/broker-{side}.sock"]
    # Traced brokers run with the site dir too: its sitecustomize installs the trace.
    env = {"PYTHONPATH": str(SITE)} if os.environ.get("KVBROKER_SERVING_TRACE") else None
    return await start_broker(f"{side}-{engine}", *args, env=env, log_file=log_dir / f"broker-{side}.log")


async def start_pd(model: Path, log_dir: Path, *, transfer: str = "kvbroker", engine: str = "nixl",
                   prefill_args: Sequence[str] = (), decode_args: Sequence[str] = (),
                   env: dict[str, str] | None = None, decode_env: dict[str, str] | None = None,
                   timeout: float = START_TIMEOUT_S, brokers: dict[str, BrokerProcess] | None = None) -> PDStack:
    """The PD deployment: brokers (kvbroker only), prefill and decode started together, then the router.
    `env` is both servers' extra environment, `decode_env` decode's alone. `brokers` ("prefill",
    "decode"), started by the caller, serve instead of new ones (several deployments on one broker
    pair) and stay the caller's: neither the stack's stop nor a failed start stops them."""
    if transfer not in ("kvbroker", "mooncake"):
        raise ValueError(f"transfer: {transfer!r} is neither 'kvbroker' nor 'mooncake'")
    engine = engine if transfer == "kvbroker" else "mooncake"
    owns_brokers = not brokers
    brokers = dict(brokers or {})
    servers: list[ServerProcess] = []
    stack = None
    log_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240  a local directory, at once
    try:
        if transfer == "kvbroker" and not brokers:
            pair = await asyncio.gather(_start_broker("prefill", engine, log_dir),
                                        _start_broker("decode", engine, log_dir))
            brokers = dict(zip(("prefill", "decode"), pair))
        half = PDStack(transfer, engine, model, log_dir, None, None, None, brokers,  # type: ignore[arg-type]
                       tuple(prefill_args), tuple(decode_args), dict(env or {}), dict(decode_env or {}),
                       owns_brokers)
        prefill = await start_server("prefill", model, log_dir, mode="prefill", transfer=transfer,
                                     args=prefill_args, env=half._server_env("prefill"), wait=False)
        servers.append(prefill)
        decode = await start_server("decode", model, log_dir, mode="decode", transfer=transfer,
                                    args=decode_args, env=half._server_env("decode"), wait=False)
        servers.append(decode)
        await asyncio.gather(prefill.wait_ready("/health_generate", timeout),
                             decode.wait_ready("/health_generate", timeout))
        router = await start_router(prefill, decode, log_dir)
        half.prefill, half.decode, half.router = prefill, decode, router
        stack = half
        return stack
    finally:
        if stack is None:
            for server in servers:
                with contextlib.suppress(ChildDied):
                    await server.stop(timeout=10)
            for broker in brokers.values() if owns_brokers else ():
                with contextlib.suppress(ChildDied):
                    await broker.stop()


async def start_reference(model: Path, log_dir: Path, *, args: Sequence[str] = (),
                          env: dict[str, str] | None = None, timeout: float = START_TIMEOUT_S) -> ServerProcess:
    return await start_server("reference", model, log_dir, args=args, env=env, timeout=timeout)


async def broker_info(broker: BrokerProcess, timeout: float = 5.0):
    """The broker's GetBrokerInfoResponse (its backend, engines, request counts), on a channel of its own."""
    import grpc

    from kvbroker_client.v1 import broker_service_pb2 as bpb
    from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc

    async with grpc.aio.insecure_channel(broker.listen) as channel:
        return await bpb_grpc.BrokerServiceStub(channel).GetBrokerInfo(bpb.GetBrokerInfoRequest(), timeout=timeout)


async def broker_holds(broker: BrokerProcess, timeout: float = 5.0) -> dict[str, int]:
    """What a broker holds now, from its GetBrokerInfo: live requests (accepted, not yet ended: its
    grants on decode, the offers' and Transfers' records on prefill) and its engines. GetBrokerInfo
    counts requests per state since start; every request counts once as PENDING and once in the
    state it ended in, so live = PENDING - SUCCEEDED - FAILED."""
    info = await broker_info(broker, timeout)
    counts = dict(info.request_counts)
    return {"live_requests": counts.get("PENDING", 0) - counts.get("SUCCEEDED", 0) - counts.get("FAILED", 0),
            "engines": len(info.engines), "succeeded": counts.get("SUCCEEDED", 0), "failed": counts.get("FAILED", 0),
            "transferring": counts.get("TRANSFERRING", 0)}
