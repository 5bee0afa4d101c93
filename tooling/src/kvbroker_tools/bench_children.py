"""The bench's child processes, and the handle the parent holds on each (`Child`).

A child runs as `python -m kvbroker_tools.bench_children direct BACKEND | control CONFIG` and speaks
JSON lines on stdout (whatever a library prints goes to stderr):
- `direct`: the engine without a broker, two Backend instances driven by the parent over stdin
  (`setup`, `plan`, `plan_parts`, `write`, `teardown`), one sender and one receiver or both in one
  process;
- `control`: per concurrency level, side by side, the one-RPC floor (GetBrokerInfo) and one-page
  requests of both flows (claimed: grant, then a Transfer that names the peer; offered: grant
  offered to the prefill broker, then one part) in a loop from concurrent workers on one event
  loop (uvloop or asyncio's), with the CPU each broker and the client spent and the prefill
  broker's NotifyParts calls and notices, then the same offered request on the Exchange stream
  beside a bare message on it (bench_exchange.py), and the request as the adapters follow it, with
  the messages it costs (bench_messages.py); answers once, with its report.
Called by bench.py's sections only.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvbroker_tools import shapes
from kvbroker_tools.launch import FATAL_TAIL_LINES, ChildDied, exit_report
from kvbroker_tools.shapes import ALL, MiB, engine_buffers


class Child:
    """A `python -m kvbroker_tools.bench_children ...` process: one JSON line in, one JSON line out. A
    child that dies raises ChildDied from `reply` (or `stop`), saying how it ended, with its stderr tail."""

    def __init__(self, process: asyncio.subprocess.Process, what: str) -> None:
        self.process = process
        self.what = what
        self.timeout = 600.0
        self.stderr: list[str] = []
        self._drain = asyncio.create_task(self._read_stderr())
        self._reported = False  # its death was raised already

    @classmethod
    async def start(cls, *args: str) -> Child:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-X", "faulthandler", "-m", "kvbroker_tools.bench_children", *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, limit=64 * MiB,
            env={**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")})
        return cls(process, " ".join(args[:1]))

    async def _read_stderr(self) -> None:
        while line := await self.process.stderr.readline():
            self.stderr = (self.stderr + [line.decode(errors="replace").rstrip()])[-FATAL_TAIL_LINES:]

    def _died(self, when: str = "") -> ChildDied:
        self._reported = True
        return ChildDied(exit_report(f"bench child {self.what} (pid {self.process.pid})", self.process.returncode,
                                     self.stderr, when))

    async def reply(self, timeout: float) -> dict:
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
        if not line:
            await asyncio.wait([self._drain], timeout=5)
            try:
                await asyncio.wait_for(self.process.wait(), 5)
            except TimeoutError:  # it closed its stdout but lives on: ended here, and said so
                self.process.kill()
                await self.process.wait()
            raise self._died("before it answered")
        answer = json.loads(line)
        if not answer.get("ok", True):
            raise RuntimeError(f"bench child {self.what}: {answer['error']}")
        return answer

    async def ask(self, **command) -> dict:
        self.process.stdin.write((json.dumps(command) + "\n").encode())
        await self.process.stdin.drain()
        return await self.reply(self.timeout)

    async def stop(self) -> None:
        """Close its stdin and wait for it to exit (SIGKILL after 30 s); ChildDied if it did not exit 0."""
        hung = False
        if self.process.returncode is None:
            try:
                self.process.stdin.close()
                await asyncio.wait_for(self.process.wait(), 30)
            except (TimeoutError, ConnectionError):
                hung = True
                self.process.kill()
                await self.process.wait()
        await asyncio.wait([self._drain], timeout=5)
        self._drain.cancel()
        if (hung or self.process.returncode != 0) and not self._reported:
            raise self._died("after it ignored its closed stdin for 30 s" if hung else "after its stdin closed")


def _protocol_stream():
    """stdout for our JSON lines only: whatever a library prints goes to stderr instead."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


async def _direct_setup(command: dict, sender, receiver, state: dict) -> dict:
    """Map the pools and register the sides this child plays: both (one process), or one of two.

    A receiver-only child answers with its metadata and its destination pool's address, which the
    parent hands to a sender-only child in another process.
    """
    from kvbroker.core.model import Region
    from kvbroker_client.shm import SharedSegment

    shape = shapes.ModelShape(**command["shape"])
    placements = shapes.place_buffers(shape)
    segments = {side: SharedSegment(name, command["size"], create=False)
                for side, name in command["segments"].items()}
    state.update(segments=list(segments.values()), handles=[])
    bases = {side: seg.array.ctypes.data for side, seg in segments.items()}
    if "dst" not in bases:
        bases["dst"] = command["peer"]["dst_base"]
    state["src"], state["dst"] = (engine_buffers(shape, placements, bases[side]) if side in bases else None
                                  for side in ("src", "dst"))
    answer: dict = {}
    if "src" in segments:
        started = time.perf_counter()
        regions = [Region(b.address, b.length, 0, False) for b in state["src"]]
        state["handles"].append((sender, await sender.register(regions)))
        answer.update(register_s=time.perf_counter() - started, regions=len(regions))
    if "dst" in segments:
        regions = [Region(b.address, b.length, 0, False) for b in state["dst"]]
        state["handles"].append((receiver, await receiver.register(regions)))
    if "src" in segments and "dst" in segments:
        state["peer"] = await sender.connect(await receiver.metadata())
    elif "src" in segments:
        state["peer"] = await sender.connect(base64.b64decode(command["peer"]["metadata"]))
    else:
        answer.update(metadata=base64.b64encode(await receiver.metadata()).decode(), dst_base=bases["dst"])
    return answer


async def _direct_child(backend: str) -> None:
    """The engine without a broker: Backend instances the parent drives over stdin, one JSON line each."""
    from kvbroker.backends import create_backend
    from kvbroker.config import Settings
    from kvbroker.core.planner import build_descriptors, plan_runs

    out = _protocol_stream()
    loop = asyncio.get_running_loop()
    settings = Settings(backend=backend, listen="127.0.0.1:0", peer_listen="127.0.0.1:0")
    sender = create_backend(settings, f"bench-direct-src-{os.getpid()}")
    receiver = create_backend(settings, f"bench-direct-dst-{os.getpid()}")
    await asyncio.gather(sender.start(), receiver.start())
    state: dict = {}
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        command = json.loads(line)
        try:
            op = command["op"]
            if op == "setup":
                answer = await _direct_setup(command, sender, receiver, state)
            elif op == "plan":
                started = time.perf_counter()
                runs = plan_runs(np.asarray(command["src_ids"]), np.asarray(command["dst_ids"]))
                state["descriptors"] = build_descriptors(runs, state["src"], state["dst"])
                answer = {"plan_s": time.perf_counter() - started, "runs": runs.count,
                          "descriptors": state["descriptors"].count, "bytes": state["descriptors"].nbytes}
            elif op == "plan_parts":  # the planned request cut into parts: [a, b) of its page lists each
                src, dst = np.asarray(command["src_ids"]), np.asarray(command["dst_ids"])
                state["parts"] = [build_descriptors(plan_runs(src[a:b], dst[a:b]), state["src"], state["dst"])
                                  for a, b in zip(command["bounds"][:-1], command["bounds"][1:])]
                answer = {"descriptors": sum(d.count for d in state["parts"])}
            elif op == "write":
                started = time.perf_counter()
                for descriptors in state["parts"] if command.get("parts") else [state["descriptors"]]:
                    await sender.write(state["peer"], descriptors, timeout=command["timeout"])
                answer = {"seconds": time.perf_counter() - started}
            elif op == "teardown":
                for backend_, handle in state.pop("handles"):
                    await backend_.deregister(handle)
                for segment in state.pop("segments"):
                    segment.close()
                state.clear()
                answer = {}
            else:
                raise ValueError(f"unknown op {op!r}")
            out.write(json.dumps({"ok": True, **answer}) + "\n")
        except Exception as exc:  # the parent reports it and fails the section
            out.write(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
    out.flush()
    os._exit(0)  # NIXL's UCX teardown may crash at interpreter exit; nothing is left to release


FLOWS = ("claimed", "offered")  # the old flow (Transfer names the peer, claims the grant), and the new one


@dataclass
class Window:
    """What the control-plane workers saw of one window: the requests ending inside it (`takes`)."""

    begin: float
    end: float
    transfer_s: list[float] = dataclasses.field(default_factory=list)  # the Transfer call (the floor: its RPC)
    grant_s: list[float] = dataclasses.field(default_factory=list)  # ExpectTransfer (offered: with the offer)
    errors: list[str] = dataclasses.field(default_factory=list)

    def takes(self, now: float) -> bool:
        """Whether a call ending at `now` counts: inside the window, or after it while the window holds
        none (on a loaded machine one call can outlast a short window; an empty row measures nothing)."""
        return self.begin <= now and (now <= self.end or not self.transfer_s)


async def _claimed(config: dict, prefill, decode, rid: str, page: int) -> tuple[float, float]:
    """ExpectTransfer, then the old flow's Transfer (it names the peer and claims the grant); the
    seconds of each."""
    t0 = time.perf_counter()
    await decode.expect_transfer(config["decode_engine"], rid, dst_page_ids=[page], components=ALL, expiry_s=60)
    t1 = time.perf_counter()
    await prefill.transfer(config["prefill_engine"], rid, config["peer"], config["decode_engine"], [page],
                           components=ALL)
    return t1 - t0, time.perf_counter() - t1


async def _offered(config: dict, prefill, decode, rid: str, page: int) -> tuple[float, float]:
    """ExpectTransfer naming the sender (the grant is offered to the prefill broker before it returns,
    as a decode server does it while prefill still computes), then one part, the last, of one page;
    the seconds of each."""
    pages = {c: [page] for c in ALL}
    t0 = time.perf_counter()
    await decode.expect_transfer(config["decode_engine"], rid, pages, sender_address=config["prefill_peer"],
                                 sender_engine_id=config["prefill_engine"], expiry_s=60)
    t1 = time.perf_counter()
    status = await prefill.transfer_part(config["prefill_engine"], rid, pages, last=True)
    t2 = time.perf_counter()
    if status.state.name != "SUCCEEDED" or status.parts != 1:
        raise RuntimeError(f"the part ended {status.state.name} after {status.parts} parts")
    return t1 - t0, t2 - t1


async def _followed(config: dict, prefill, decode, rid: str, page: int) -> tuple[float, float]:
    from kvbroker_tools import bench_messages
    return await bench_messages.followed(config, prefill, decode, rid, page)


async def _followed_apart(config: dict, prefill, decode, rid: str, page: int) -> tuple[float, float]:
    from kvbroker_tools import bench_messages
    return await bench_messages.followed(config, prefill, decode, rid, page, apart=True)


REQUESTS = {"claimed": _claimed, "offered": _offered, "followed": _followed, "followed_apart": _followed_apart}


async def _control_worker(config: dict, flow: str, prefill, decode, window: Window, concurrency: int,
                          w: int) -> None:
    """One request of `flow` after another, each on page `w` of both engines."""
    loop = asyncio.get_running_loop()
    request = REQUESTS[flow]
    i = 0
    while loop.time() < window.end and len(window.errors) <= 100:
        rid = f"cp-{config['tag']}-{flow}-{concurrency}-{w}-{i}"
        i += 1
        try:
            grant_s, transfer_s = await request(config, prefill, decode, rid, w)
        except Exception as exc:  # counted and reported; the run goes on
            window.errors.append(f"{type(exc).__name__}: {exc}")
            continue
        if window.takes(loop.time()):
            window.grant_s.append(grant_s)
            window.transfer_s.append(transfer_s)


async def _floor_worker(client, window: Window) -> None:
    """The cheapest broker call (GetBrokerInfo) in a loop: what one unary RPC costs on this stack."""
    loop = asyncio.get_running_loop()
    while loop.time() < window.end:
        started = time.perf_counter()
        await client.info()
        if window.takes(loop.time()):
            window.transfer_s.append(time.perf_counter() - started)


async def _control_child(config: dict) -> dict:
    """Per concurrency level, side by side: the floor (bare GetBrokerInfo), the claimed flow and the
    offered flow, each a window of `seconds` after `warmup_s`; then each flow against the floor."""
    from kvbroker_client.client import BrokerClient
    from kvbroker_tools import bench_exchange, bench_messages

    loop = asyncio.get_running_loop()
    prefill = await BrokerClient.connect(config["prefill"], exchange=False)  # the unary calls
    decode = await BrokerClient.connect(config["decode"], exchange=False)
    s_prefill = await BrokerClient.connect(config["prefill"])  # the same on the Exchange stream
    s_decode = await BrokerClient.connect(config["decode"])
    results, floor, exchange, followed = [], [], [], []
    tools = bench_exchange.Windows(Window, _control_worker, _cpu_over, _flow_row, _percentiles)
    try:
        for concurrency in config["concurrency"]:
            begin = loop.time() + config["warmup_s"]
            window = Window(begin, begin + config["seconds"])
            cpu, _ = await asyncio.gather(_cpu_over(window, {"broker": config["broker_pids"]["prefill_broker"]}),
                                          asyncio.gather(*(_floor_worker(prefill, window)
                                                           for _ in range(concurrency))))
            calls = len(window.transfer_s)
            floor.append({"concurrency": concurrency, "calls_per_s": calls / config["seconds"],
                          "call_ms": _percentiles(np.asarray(window.transfer_s) * 1e3),
                          "cpu_ms_per_call": {k: round(v * 1e3 / max(calls, 1), 4) for k, v in cpu.items()
                                              if k != "machine_busy_cores"}})
            for flow in FLOWS:
                begin = loop.time() + config["warmup_s"]
                window = Window(begin, begin + config["seconds"])
                cpu, _ = await asyncio.gather(
                    _cpu_over(window, config["broker_pids"], config.get("prefill_metrics", "")),
                    asyncio.gather(*(_control_worker(config, flow, prefill, decode, window, concurrency, w)
                                     for w in range(concurrency))))
                results.append(_flow_row(flow, concurrency, config["seconds"], window, cpu))
            offered = next((r for r in results if r["flow"] == "offered" and r["concurrency"] == concurrency), None)
            exchange.append(await bench_exchange.level(tools, config, concurrency, s_prefill, s_decode, floor[-1],
                                                       offered))
            if config.get("decode_metrics"):
                followed += await bench_messages.level(tools, config, concurrency, s_prefill, s_decode)
    finally:
        for client in (prefill, decode, s_prefill, s_decode):
            await client.close()
    _against(results, floor)
    return {"loop": f"{type(loop).__module__}.{type(loop).__name__}", "results": results, "rpc_floor": floor,
            "exchange": exchange, "followed": followed}


def _flow_row(flow: str, concurrency: int, seconds: float, window: Window, cpu: dict) -> dict:
    requests = len(window.transfer_s)
    transfer, grant = np.asarray(window.transfer_s), np.asarray(window.grant_s)
    notices = cpu.pop("notices", None)
    row = {
        "flow": flow, "concurrency": concurrency, "requests": requests, "seconds": seconds,
        "requests_per_s": requests / seconds,
        "transfer_ms": _percentiles(transfer * 1e3),
        "grant_ms": _percentiles(grant * 1e3),
        "request_ms": _percentiles((grant + transfer) * 1e3),
        "errors": len(window.errors), "first_error": window.errors[0] if window.errors else "",
        "cpu_ms_per_request": {k: round(v * 1e3 / max(requests, 1), 4) for k, v in cpu.items()
                               if k != "machine_busy_cores"},
        "machine_busy_cores": round(cpu["machine_busy_cores"], 2),
    }
    if flow == "offered" and notices is not None:
        row["notify"] = {**notices, "notices_per_call": round(notices["notices"] / notices["calls"], 3)
                         if notices["calls"] else None}
    return row


def _against(results: list[dict], floor: list[dict]) -> None:
    """Each flow's row against the floor at its concurrency, and the offered flow against the claimed."""
    floors = {f["concurrency"]: f for f in floor}
    claimed = {r["concurrency"]: r for r in results if r["flow"] == "claimed"}
    for r in results:
        f = floors.get(r["concurrency"])
        if f is not None and f["call_ms"]["p50"] and r["transfer_ms"]["p50"] is not None:
            r["transfer_p50_vs_floor"] = round(r["transfer_ms"]["p50"] / f["call_ms"]["p50"], 3)
            r["request_p50_vs_floor"] = round(r["request_ms"]["p50"] / f["call_ms"]["p50"], 3)
        if f is not None and f["calls_per_s"]:
            r["requests_per_s_vs_floor"] = round(r["requests_per_s"] / f["calls_per_s"], 4)
        old = claimed.get(r["concurrency"])
        if r["flow"] == "offered" and old is not None and old["requests_per_s"]:
            r["requests_per_s_vs_claimed"] = round(r["requests_per_s"] / old["requests_per_s"], 3)


def _process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _machine_busy_s() -> float:
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


NOTIFY_COUNTERS = {"calls": "kvbroker_peer_notify_calls_total", "notices": "kvbroker_peer_part_notices_total"}


def _notify_counters(metrics_listen: str) -> dict[str, float]:
    """The sender broker's NotifyParts calls and part notices so far, from its /metrics."""
    from kvbroker_tools.bench_messages import samples

    values = {s.name: s.value for s in samples(metrics_listen)}
    return {key: values.get(name, 0.0) for key, name in NOTIFY_COUNTERS.items()}


async def _cpu_over(window: Window, broker_pids: dict[str, int], metrics_listen: str = "") -> dict:
    """CPU-seconds each broker and this client spent inside the window, and the machine's busy cores;
    with `metrics_listen` (the sender broker's), the NotifyParts calls and notices it made in it."""
    loop = asyncio.get_running_loop()

    def sample() -> dict[str, float]:
        now = {name: _process_cpu_s(pid) for name, pid in broker_pids.items()}
        return {**now, "client": time.process_time(), "machine": _machine_busy_s()}

    await asyncio.sleep(max(0.0, window.begin - loop.time()))
    first = sample()
    counted = await asyncio.to_thread(_notify_counters, metrics_listen) if metrics_listen else None
    await asyncio.sleep(max(0.0, window.end - loop.time()))
    last = sample()
    spent: dict = {k: last[k] - first[k] for k in first}
    spent["machine_busy_cores"] = spent.pop("machine") / (window.end - window.begin)
    if counted is not None:
        now = await asyncio.to_thread(_notify_counters, metrics_listen)
        spent["notices"] = {k: int(now[k] - counted[k]) for k in counted}
    return spent


def _percentiles(values: np.ndarray) -> dict:
    if values.size == 0:
        return {"p50": None, "p99": None, "mean": None}
    p50, p99 = np.percentile(values, [50, 99])
    return {"p50": round(float(p50), 4), "p99": round(float(p99), 4), "mean": round(float(values.mean()), 4)}


def _child_main(argv: Sequence[str]) -> None:
    role = argv[0]
    if role == "direct":
        import uvloop

        uvloop.run(_direct_child(argv[1]))  # the brokers' loop
    elif role == "control":
        config = json.loads(argv[1])
        out = _protocol_stream()
        if config["loop"] == "uvloop":
            import uvloop

            report = uvloop.run(_control_child(config))
        else:
            report = asyncio.run(_control_child(config))
        out.write(json.dumps({"ok": True, **report}) + "\n")
        out.flush()
    else:
        raise SystemExit(f"usage: python -m kvbroker_tools.bench_children direct BACKEND | control CONFIG "
                         f"(got {role!r})")


if __name__ == "__main__":
    _child_main(sys.argv[1:])
