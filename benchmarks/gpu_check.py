"""GPU check (issue 8): KV pages in CUDA memory through two brokers, verified to the byte, and how fast.

    python benchmarks/gpu_check.py                      # NIXL, 256 MiB requests, both memory ownerships
    python benchmarks/gpu_check.py --help

On one machine with an NVIDIA GPU (one is enough: both servers then share it; with two, the
decode side takes the second):
- two brokers start (kvbroker_tools.launch.start_broker), and two server processes (this script with
  `--serve`), each holding a MiniMax-M3-shaped pool on its GPU: MAIN_KV as K and V on every layer,
  MINIMAX_INDEX_K on the sparse layers. Each server registers its pool with its own broker, for
  each ownership asked for: `server` (the server allocates with torch and exports CUDA IPC handles
  that the broker opens) and `broker` (the broker allocates and the server opens the handle it gets
  back). The decode side grants a fragmented page list, the prefill side transfers both components
  with one page list; the destination pool is then read back and checked byte by byte against the
  source (moved pages) and its canary (every other byte), the source against itself; then the
  decode server is SIGKILLed, and its broker must release the engine of the ended session;
- the same page lists become the same descriptors for two Backend instances of the same engine in
  this process (no broker), over pools this process allocated;
- a device-to-device copy of the same number of bytes (torch) is the ceiling.
It prints one JSON report on stdout (also to --out): GB/s (median of the timed repeats) per stage.
Exit status: 0 when every stage ran and every byte matched; 1 on any mismatch or failed stage;
2 when this machine has no CUDA device (nothing is started). Bounded by --deadline-s (default 280).

The parts that need no GPU (arguments, the shape, page lists, expectations, figures) are plain
functions, unit-tested in tests/unit/test_gpu_check.py.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parent.parent
# Run as a file from a checkout, kvbroker and kvbroker_client are the checkout's, in this process and
# in the brokers and servers it starts, whether or not they are installed.
_PATHS = [str(ROOT), str(ROOT / "clients" / "python" / "src")]
sys.path[:0] = [p for p in _PATHS if p not in sys.path]
os.environ["PYTHONPATH"] = os.pathsep.join([*_PATHS, *filter(None, [os.environ.get("PYTHONPATH")])])
os.environ.setdefault("UCX_NET_DEVICES", "lo")  # what start_broker gives the brokers, for the direct path too

from kvbroker.core.planner import plan_runs  # noqa: E402
from kvbroker.memory.mapping import plan_pool  # noqa: E402
from kvbroker_tools import shapes  # noqa: E402

MiB = 1 << 20
OWNERSHIPS = ("server", "broker")
BACKENDS = ("nixl", "mooncake")
COMPONENTS = (1, 2)  # COMPONENT_MAIN_KV, COMPONENT_MINIMAX_INDEX_K: one page list carries both
MAX_RUN = 16  # fragmented page lists: runs of 1..16 pages in shuffled order


@dataclasses.dataclass(frozen=True)
class Check:
    """What one run of the check does, from the command line."""

    backend: str
    size_mib: int
    repeats: int
    ownerships: tuple[str, ...]
    src_device: int | None  # None: 0
    dst_device: int | None  # None: 1 when there are two GPUs, else 0
    seed: int
    deadline_s: float
    out: Path | None


def parse_args(argv: Sequence[str] | None = None) -> Check:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=BACKENDS, default="nixl",
                        help="transfer engine of both brokers and of the direct path (default nixl)")
    parser.add_argument("--size-mib", type=int, default=256, help="bytes of one request, in MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per stage after a verified one (default 5)")
    parser.add_argument("--ownership", choices=(*OWNERSHIPS, "both"), default="both",
                        help="who allocates the pools registered with the brokers (default both)")
    parser.add_argument("--src-device", type=int, help="CUDA device of the prefill side (default 0)")
    parser.add_argument("--dst-device", type=int,
                        help="CUDA device of the decode side (default 1 with two GPUs, else 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline-s", type=float, default=280.0, help="bound on the whole check, in seconds")
    parser.add_argument("--out", type=Path, help="also write the JSON report to this file")
    a = parser.parse_args(argv)
    if a.size_mib < 1 or a.repeats < 1 or a.deadline_s <= 0:
        parser.error("--size-mib, --repeats and --deadline-s must be positive")
    return Check(a.backend, a.size_mib, a.repeats, OWNERSHIPS if a.ownership == "both" else (a.ownership,),
                 a.src_device, a.dst_device, a.seed, a.deadline_s, a.out)


def check_shape(size_mib: int) -> shapes.ModelShape:
    """MiniMax-M3-like, per attention-TP rank: 4 dense + 60 sparse layers, MAIN_KV K and V (bf16, one
    KV head of 128), the K-only index (fp8, 128 wide) on the sparse layers, 16-token pages; a request
    of at least `size_mib` MiB, in a pool with twice its pages so the page lists can be fragmented."""
    base = shapes.ModelShape("m3-gpu-check", dense_layers=4, sparse_layers=60, page_size=16, kv_heads=1,
                           head_dim=128, kv_bytes=2, index_head_dim=128, index_bytes=1, num_pages=MAX_RUN,
                           request_pages=1)
    pages = max(1, math.ceil(size_mib * MiB / base.request_bytes(1)))
    pool = math.ceil(2 * pages / MAX_RUN) * MAX_RUN
    return dataclasses.replace(base, num_pages=pool, request_pages=pages)


def page_lists(shape: shapes.ModelShape, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination page ids: distinct, in runs of 1..16 pages, shuffled; as the demo makes them."""
    rng = np.random.default_rng(seed)
    src = shapes.fragmented_pages(rng, shape.num_pages, shape.request_pages, MAX_RUN)
    dst = shapes.fragmented_pages(rng, shape.num_pages, shape.request_pages, MAX_RUN)
    return src, dst


def broker_pool_placements(shape: shapes.ModelShape) -> tuple[list[shapes.BufferPlacement], int]:
    """Where a broker-owned pool puts the layer buffers (registration order, aligned), and its size."""
    placements = shapes.place_buffers(shape)
    offsets, size = plan_pool([shape.num_pages * p.item_len for p in placements])
    return [dataclasses.replace(p, offset=o) for p, o in zip(placements, offsets)], size


def mismatches(actual: np.ndarray, expected: np.ndarray) -> dict:
    diff = np.flatnonzero(actual != expected)
    return {"mismatched_bytes": int(diff.size), "first_mismatch_at": int(diff[0]) if diff.size else None}


def figures(nbytes: int, seconds: Sequence[float]) -> dict:
    """GB/s (1e9 bytes a second) of the median of the timed runs; every run's seconds too."""
    median = statistics.median(seconds)
    return {"bytes": nbytes, "seconds": [round(s, 6) for s in seconds], "median_s": round(median, 6),
            "gb_per_s": round(nbytes / median / 1e9, 3)}


def ratios(stages: dict) -> dict:
    """Each broker path and the direct engine, as a fraction of the device copy and of each other."""
    rate = {name: s.get("gb_per_s") for name, s in stages.items() if s.get("gb_per_s")}
    out = {}
    for name in [n for n in rate if n.startswith("broker_")] + ["direct"]:
        if name in rate and "device_copy" in rate:
            out[f"{name}/device_copy"] = round(rate[name] / rate["device_copy"], 3)
        if name.startswith("broker_") and "direct" in rate:
            out[f"{name}/direct"] = round(rate[name] / rate["direct"], 3)
    return out


def register_request(engine_id: str, shape: shapes.ModelShape, placements: list[shapes.BufferPlacement],
                     refs: Sequence | None, device: int):
    """RegisterEngine for the check's engine: each buffer at its CudaIpcRef, or (refs None) broker-owned."""
    from kvbroker_client.v1 import broker_service_pb2 as bpb
    from kvbroker_client.v1 import common_pb2 as pb

    layouts = {pb.COMPONENT_MAIN_KV: pb.LAYOUT_KV_SPLIT, pb.COMPONENT_MINIMAX_INDEX_K: pb.LAYOUT_FLAT}
    refs = list(refs) if refs is not None else [None] * len(placements)
    components = []
    for kind in dict.fromkeys(p.component for p in placements):
        components.append(pb.ComponentSpec(component=kind, layout=layouts[kind], num_pages=shape.num_pages,
                                           layer_buffers=[
            pb.LayerBuffer(layer_id=p.layer_id, role=p.role, memory=None if ref is None else ref.to_proto(),
                           length=shape.num_pages * p.item_len, item_len=p.item_len)
            for p, ref in zip(placements, refs) if p.component == kind]))
    ownership = bpb.MEMORY_OWNERSHIP_BROKER if all(r is None for r in refs) else bpb.MEMORY_OWNERSHIP_SERVER
    return bpb.RegisterEngineRequest(
        engine_id=engine_id, topology=shapes.topology(shape), components=components, memory_ownership=ownership,
        allocation_device=device if ownership == bpb.MEMORY_OWNERSHIP_BROKER else 0)


# -- the server processes ------------------------------------------------------------------------
class _CudaArray:
    """Bytes at a device address, as torch.as_tensor takes them (__cuda_array_interface__)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


def serve(role: str, broker: str, device: int, ownership: str, shape: shapes.ModelShape, seed: int) -> int:
    """One inference server: a pool on `device`, registered with `broker`; answers dump/exit on stdin."""
    import grpc
    import torch

    from kvbroker_client.tensors import cuda_ipc_ref
    from kvbroker_client.v1 import broker_service_pb2 as bpb
    from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc

    engine_id = f"{role}-gpu-check/tp0"
    cuda = torch.device("cuda", device)
    torch.cuda.set_device(cuda)
    placements = shapes.place_buffers(shape)
    stub = bpb_grpc.BrokerServiceStub(grpc.insecure_channel(broker))
    session = stub.OpenSession(bpb.OpenSessionRequest(holder=f"gpu-check {role} pid {os.getpid()}"))
    session_id = next(session).session_id  # the engine is released when this process goes, however it goes
    opened = driver = None
    if ownership == "server":
        pool = torch.empty(shapes.pool_size(shape, placements), dtype=torch.uint8, device=cuda)
        refs = [cuda_ipc_ref(pool[p.offset:p.offset + shape.num_pages * p.item_len]) for p in placements]
        request = register_request(engine_id, shape, placements, refs, device)
        request.session_id = session_id
        reply = stub.RegisterEngine(request, timeout=120)
        offsets = [p.offset for p in placements]
    else:
        from kvbroker.memory.cuda import load_driver

        request = register_request(engine_id, shape, placements, None, device)
        request.session_id = session_id
        reply = stub.RegisterEngine(request, timeout=120)
        refs = [b.memory.cuda_ipc for c in reply.engine.components for b in c.layer_buffers]
        if len({(r.handle, r.device, r.allocation_size) for r in refs}) != 1:
            raise RuntimeError("a broker-owned engine's layer buffers must name one pool")
        driver = load_driver()
        opened = driver.open_ipc(refs[0].handle, device)
        pool = torch.as_tensor(_CudaArray(opened.address, refs[0].allocation_size), device=cuda)
        offsets = [r.offset for r in refs]
    if role == "prefill":
        generator = torch.Generator(device=cuda).manual_seed(seed)
        pool.copy_(torch.randint(0, 256, pool.shape, dtype=torch.uint8, device=cuda, generator=generator))
    else:
        pool.fill_(shapes.CANARY)
    torch.cuda.synchronize(cuda)
    print(json.dumps({"ready": True, "engine_id": engine_id, "offsets": offsets, "pool_bytes": pool.numel(),
                      "memory_ownership": bpb.MemoryOwnership.Name(reply.engine.memory_ownership)}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "dump":
            torch.cuda.synchronize(cuda)
            pool.cpu().numpy().tofile(command["path"])
            print(json.dumps({"ok": True}), flush=True)
        elif command["op"] == "exit":
            break
    if opened is not None:  # a broker-owned pool is closed here before the broker frees it
        del pool
        torch.cuda.synchronize(cuda)
        driver.close_ipc(opened.address, device)
    stub.UnregisterEngine(bpb.UnregisterEngineRequest(engine_id=engine_id), timeout=60)
    session.cancel()
    return 0


class Server:
    """A `--serve` child, driven by JSON lines."""

    def __init__(self, process: asyncio.subprocess.Process, ready: dict) -> None:
        self.process = process
        self.ready = ready

    @classmethod
    async def start(cls, role: str, broker: str, device: int, ownership: str, check: Check,
                    timeout: float) -> Server:
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(SCRIPT), "--serve", role, "--broker", broker,
            "--serve-device", str(device), "--ownership", ownership, "--size-mib", str(check.size_mib),
            "--seed", str(check.seed), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        server = cls(process, {})
        server.ready = await server._answer(timeout)
        return server

    async def _answer(self, timeout: float) -> dict:
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
        if not line:
            raise RuntimeError(f"server exited with {await self.process.wait()} before answering")
        return json.loads(line)

    async def dump(self, path: str, timeout: float) -> np.ndarray:
        self.process.stdin.write((json.dumps({"op": "dump", "path": path}) + "\n").encode())
        await self._answer(timeout)
        try:
            return np.fromfile(path, dtype=np.uint8)
        finally:
            os.unlink(path)

    async def stop(self, timeout: float = 60.0) -> None:
        if self.process.returncode is None:
            self.process.stdin.write(b'{"op": "exit"}\n')
            try:
                await asyncio.wait_for(self.process.wait(), timeout)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()


# -- the stages ----------------------------------------------------------------------------------
async def broker_stage(check: Check, ownership: str, shape: shapes.ModelShape, devices: tuple[int, int],
                       left, scratch: Path) -> dict:
    """Register both pools (`ownership`), move one verified request, then time `repeats` more."""
    import grpc

    from kvbroker_client.v1 import broker_service_pb2 as bpb
    from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc
    from kvbroker_tools.launch import start_broker

    src_ids, dst_ids = page_lists(shape, check.seed)
    placements = shapes.place_buffers(shape) if ownership == "server" else broker_pool_placements(shape)[0]
    brokers, servers = [], []
    try:
        brokers = list(await asyncio.wait_for(asyncio.gather(
            start_broker("gpu-check-prefill", "--backend", check.backend, "--log-level", "WARNING"),
            start_broker("gpu-check-decode", "--backend", check.backend, "--log-level", "WARNING")), left()))
        servers = list(await asyncio.gather(
            Server.start("prefill", brokers[0].listen, devices[0], ownership, check, left()),
            Server.start("decode", brokers[1].listen, devices[1], ownership, check, left())))
        prefill, decode = servers
        for server in servers:
            if server.ready["offsets"] != [p.offset for p in placements]:
                raise RuntimeError(f"{server.ready['engine_id']}: buffers at {server.ready['offsets'][:4]}..., "
                                   f"expected {[p.offset for p in placements][:4]}...")
        src = await prefill.dump(str(scratch / "src"), left())
        before = await decode.dump(str(scratch / "dst"), left())
        expected = shapes.expected_destination(src, before, shape, placements, set(COMPONENTS), src_ids, dst_ids)
        async with grpc.aio.insecure_channel(brokers[0].listen) as p_chan, \
                grpc.aio.insecure_channel(brokers[1].listen) as d_chan:
            p_stub, d_stub = bpb_grpc.BrokerServiceStub(p_chan), bpb_grpc.BrokerServiceStub(d_chan)
            seconds, status = [], None
            for i in range(check.repeats + 1):
                request_id = f"gpu-check-{ownership}-{i}"
                await d_stub.ExpectTransfer(bpb.ExpectTransferRequest(
                    request_id=request_id, engine_id=decode.ready["engine_id"], components=COMPONENTS,
                    dst_page_ids=dst_ids.tolist(), expiry_ms=120_000), timeout=min(30, left()))
                started = time.perf_counter()
                reply = await p_stub.Transfer(bpb.TransferRequest(
                    request_id=request_id, engine_id=prefill.ready["engine_id"], peer_address=brokers[1].peer_listen,
                    remote_engine_id=decode.ready["engine_id"], components=COMPONENTS,
                    src_page_ids=src_ids.tolist()), timeout=left())
                elapsed = time.perf_counter() - started
                status = reply.status
                if i == 0:  # the first write, checked before anything is timed
                    first = mismatches(await decode.dump(str(scratch / "dst"), left()), expected)
                    if first["mismatched_bytes"]:
                        return {"ok": False, "verified": False, **first, "error": "destination bytes differ"}
                else:
                    seconds.append(elapsed)
            after = mismatches(await decode.dump(str(scratch / "dst"), left()), expected)
            source = mismatches(await prefill.dump(str(scratch / "src"), left()), src)
            released = await session_end(decode, d_stub, min(60.0, left()))
        verified = after["mismatched_bytes"] == 0 and source["mismatched_bytes"] == 0
        return {"ok": verified and released["released"], "verified": verified, **after,
                "source_mismatched_bytes": source["mismatched_bytes"],
                "memory_ownership": prefill.ready["memory_ownership"], "pages": status.pages, "runs": status.runs,
                "descriptors": status.runs * len(placements), "broker_duration_us": status.duration_us,
                "session_end": released, **figures(status.bytes, seconds)}
    except BaseException:
        for broker in brokers:  # what the brokers logged goes with the failure, on stderr
            print(f"-- {broker.broker_id} (pid {broker.pid}), last lines:", *broker.stderr_lines[-30:],
                  sep="\n", file=sys.stderr)
        raise
    finally:
        for server in servers:
            await server.stop()
        for broker in brokers:
            await broker.stop()


async def session_end(server: Server, stub, timeout: float) -> dict:
    """SIGKILL the server: its session's stream ends, and its broker must release the engine (close
    the imported allocation, or free its broker-owned pool) with no UnregisterEngine."""
    from kvbroker_client.v1 import broker_service_pb2 as bpb

    server.process.kill()
    await server.process.wait()
    loop = asyncio.get_running_loop()
    started = loop.time()
    while loop.time() - started < timeout:
        info = await stub.GetBrokerInfo(bpb.GetBrokerInfoRequest(), timeout=10)
        if server.ready["engine_id"] not in {e.engine_id for e in info.engines}:
            return {"released": True, "seconds": round(loop.time() - started, 3)}
        await asyncio.sleep(0.05)
    return {"released": False, "seconds": round(loop.time() - started, 3),
            "error": f"the engine was still registered {timeout:.0f}s after its server was killed"}


def gpu_buffers(shape: shapes.ModelShape, placements, base: int, device: int):
    """Layer buffers as the broker orders them for a transfer (by component, then layer and role), on a GPU."""
    from kvbroker.core.model import BufferLayout, BufferRole, MemoryKind

    out = []
    for kind in COMPONENTS:
        mine = sorted((p for p in placements if p.component == kind), key=lambda p: (p.layer_id, p.role))
        out += [BufferLayout(p.layer_id, BufferRole(p.role), base + p.offset, shape.num_pages * p.item_len, p.item_len,
                             device, MemoryKind.GPU) for p in mine]
    return out


async def direct_stage(check: Check, shape: shapes.ModelShape, devices: tuple[int, int], left) -> dict:
    """Two Backend instances of the engine in this process, the same descriptors, pools this process owns."""
    import torch

    from kvbroker.backends import create_backend
    from kvbroker.config import Settings
    from kvbroker.core.model import Region
    from kvbroker.core.planner import build_descriptors

    placements = shapes.place_buffers(shape)
    size = shapes.pool_size(shape, placements)
    src_ids, dst_ids = page_lists(shape, check.seed)
    generator = torch.Generator(device=f"cuda:{devices[0]}").manual_seed(check.seed)
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=f"cuda:{devices[0]}", generator=generator)
    dst = torch.full((size,), shapes.CANARY, dtype=torch.uint8, device=f"cuda:{devices[1]}")
    torch.cuda.synchronize()
    expected = shapes.expected_destination(src.cpu().numpy(), dst.cpu().numpy(), shape, placements, set(COMPONENTS),
                                         src_ids, dst_ids)
    settings = Settings(backend=check.backend, listen="127.0.0.1:0", peer_listen="127.0.0.1:0")
    sender = create_backend(settings, f"gpu-check-src-{os.getpid()}")
    receiver = create_backend(settings, f"gpu-check-dst-{os.getpid()}")
    await asyncio.gather(sender.start(), receiver.start())
    handles = []
    try:
        src_bufs = gpu_buffers(shape, placements, src.data_ptr(), devices[0])
        dst_bufs = gpu_buffers(shape, placements, dst.data_ptr(), devices[1])
        handles.append((sender, await sender.register([Region(b.address, b.length, b.device, True) for b in src_bufs])))
        handles.append((receiver, await receiver.register([Region(b.address, b.length, b.device, True)
                                                           for b in dst_bufs])))
        peer = await sender.connect(await receiver.metadata())
        descriptors = build_descriptors(plan_runs(src_ids, dst_ids), src_bufs, dst_bufs)
        seconds = []
        for i in range(check.repeats + 1):
            started = time.perf_counter()
            await sender.write(peer, descriptors, timeout=left())
            if i == 0:
                torch.cuda.synchronize()
                first = mismatches(dst.cpu().numpy(), expected)
                if first["mismatched_bytes"]:
                    return {"ok": False, "verified": False, **first, "error": "destination bytes differ"}
            else:
                seconds.append(time.perf_counter() - started)
        torch.cuda.synchronize()
        after = mismatches(dst.cpu().numpy(), expected)
        return {"ok": after["mismatched_bytes"] == 0, "verified": after["mismatched_bytes"] == 0, **after,
                "descriptors": descriptors.count, **figures(descriptors.nbytes, seconds)}
    finally:
        for backend, handle in handles:
            await backend.deregister(handle)
        await asyncio.gather(sender.close(), receiver.close())


def device_copy_stage(check: Check, nbytes: int, devices: tuple[int, int]) -> dict:
    """One contiguous device-to-device copy of the request's bytes (torch, CUDA events): the ceiling."""
    import torch

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=f"cuda:{devices[0]}")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{devices[1]}")
    dst.copy_(src)
    torch.cuda.synchronize()
    verified = bool(torch.equal(dst.to(src.device), src))
    seconds = []
    for _ in range(check.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return {"ok": verified, "verified": verified, **figures(nbytes, seconds)}


def environment(devices: tuple[int, int]) -> dict:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    import torch

    def version(name: str) -> str | None:
        try:
            return package_version(name)
        except PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "devices": {"prefill": devices[0], "decode": devices[1]},
            "packages": {n: version(n) for n in ("nixl", "nixl-cu12", "nixl-cu13", "mooncake-transfer-engine")},
            "env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith(("UCX_", "NIXL_", "MC_"))}}


async def run(check: Check) -> tuple[dict, int]:
    import torch

    if not torch.cuda.is_available():
        return {"check": "gpu", "ok": False, "error": "no CUDA device: this check needs an NVIDIA GPU"}, 2
    loop = asyncio.get_running_loop()
    deadline = loop.time() + check.deadline_s

    def left() -> float:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise TimeoutError(f"the check ran past its deadline of {check.deadline_s:.0f}s")
        return remaining

    count = torch.cuda.device_count()
    devices = (0 if check.src_device is None else check.src_device,
               (1 if count > 1 else 0) if check.dst_device is None else check.dst_device)
    shape = check_shape(check.size_mib)
    src_ids, dst_ids = page_lists(shape, check.seed)
    report = {"check": "gpu", "backend": check.backend, "environment": environment(devices),
              "shape": dataclasses.asdict(shape), "layer_buffers": len(shapes.place_buffers(shape)),
              "request": {"pages": shape.request_pages, "bytes": shape.request_bytes(),
                          "runs": plan_runs(src_ids, dst_ids).count}, "stages": {}}
    stages = report["stages"]
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))  # pools read back to host (not /dev/shm: may be small)
    work = [(f"broker_{o}_owned", lambda o=o: broker_stage(check, o, shape, devices, left, scratch))
            for o in check.ownerships]
    work.append(("direct", lambda: direct_stage(check, shape, devices, left)))
    for name, stage in work:
        started = time.perf_counter()
        try:
            stages[name] = await asyncio.wait_for(stage(), left())
        except Exception as exc:  # noqa: BLE001 - one failed stage is reported; the others still run
            stages[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        stages[name]["wall_s"] = round(time.perf_counter() - started, 3)
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        stages["device_copy"] = device_copy_stage(check, shape.request_bytes(), devices)
    except Exception as exc:  # noqa: BLE001
        stages["device_copy"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    report["ratios"] = ratios(stages)
    report["ok"] = all(s.get("ok") for s in stages.values())
    return report, 0 if report["ok"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve"]:
        serving = argparse.ArgumentParser(prog="gpu_check.py --serve")
        serving.add_argument("--serve", choices=("prefill", "decode"), required=True)
        serving.add_argument("--broker", required=True)
        serving.add_argument("--serve-device", type=int, required=True)
        serving.add_argument("--ownership", choices=OWNERSHIPS, required=True)
        serving.add_argument("--size-mib", type=int, required=True)
        serving.add_argument("--seed", type=int, required=True)
        a = serving.parse_args(argv)
        return serve(a.serve, a.broker, a.serve_device, a.ownership, check_shape(a.size_mib), a.seed)
    check = parse_args(argv)
    report, status = asyncio.run(run(check))
    text = json.dumps(report, indent=2)
    print(text)
    if check.out is not None:
        check.out.write_text(text + "\n")
    return status


if __name__ == "__main__":
    # The direct stage makes NIXL agents in this process, and NIXL's teardown at interpreter exit
    # segfaults (in its bundled libnl-route, 2 runs in 3 here): leave as the broker does, with the
    # report already flushed, so that the exit status is the check's.
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
