"""What the integration tests share to drive real brokers over gRPC (one copy each): the claimed
flow's grant and transfer, the offered flow's offer and part, watching a request, a call's refusal,
a broker's JSON log lines, and the bytes a destination pool should hold after some moves. Not a
test module: test modules import from here, never from each other."""

from __future__ import annotations

import json
import socket

import grpc
import numpy as np

from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_tools import shapes
from tests.support.brokers import ALL
from tests.support.helpers import rpc_refusal as refusal  # noqa: F401  the offered-flow tests' name

MAIN, INDEX, DENSE = pb.COMPONENT_MAIN_KV, pb.COMPONENT_MINIMAX_INDEX_K, pb.COMPONENT_MINIMAX_DENSE_KV
M3 = ("MAIN_KV", "MINIMAX_INDEX_K", "MINIMAX_DENSE_KV")
MEDIUM = shapes.ModelShape("medium", 3, 4, page_size=16, kv_heads=8, head_dim=128, kv_bytes=2, index_head_dim=128,
                         index_bytes=1, num_pages=1024, request_pages=768)


async def grant(dst, request_id, dst_ids, components=ALL, expiry_ms=30_000, timeout=10):
    return await dst.stub.ExpectTransfer(bpb.ExpectTransferRequest(
        request_id=request_id, engine_id=dst.engine_id, components=components,
        dst_page_ids=list(map(int, dst_ids)), expiry_ms=expiry_ms), timeout=timeout)


async def transfer(src, dst, request_id, src_ids, components=ALL, dst_ids=(), timeout=60):
    return await src.stub.Transfer(bpb.TransferRequest(
        request_id=request_id, engine_id=src.engine_id, peer_address=dst.broker.peer_address,
        remote_engine_id=dst.engine_id, components=components, src_page_ids=list(map(int, src_ids)),
        dst_page_ids=list(map(int, dst_ids))), timeout=timeout)


def transfer_call(src, dst, request_id, ids, timeout=60.0):
    """The claimed flow's Transfer as a call not yet awaited (to cut the network under it)."""
    return src.stub.Transfer(bpb.TransferRequest(
        request_id=request_id, engine_id=src.engine_id, peer_address=dst.broker.peer_address,
        remote_engine_id=dst.engine_id, components=ALL, src_page_ids=list(map(int, ids))), timeout=timeout)


async def until_state(engine, request_id, state, timeout=60.0):
    """Watch until `state` (or a terminal one); returns every status seen."""
    call = engine.stub.WatchTransfer(bpb.WatchTransferRequest(engine_id=engine.engine_id, request_id=request_id),
                                     timeout=timeout)
    seen = []
    while (update := await call.read()) is not grpc.aio.EOF:
        seen.append(update.status)
        if update.status.state in (state, pb.TRANSFER_STATE_SUCCEEDED, pb.TRANSFER_STATE_FAILED):
            break
    call.cancel()
    return seen


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def offer(dst, src, request_id, pages: dict, *, sender_engine=True, expiry_ms=30_000, timeout=10,
                src_offsets=None):
    """ExpectTransfer naming the sender: the grant is offered to src's broker before it returns."""
    offsets = src_offsets or {}
    return await dst.stub.ExpectTransfer(bpb.ExpectTransferRequest(
        request_id=request_id, engine_id=dst.engine_id, expiry_ms=expiry_ms,
        pages=[pb.ComponentPages(component=k, page_ids=list(map(int, v)), src_offset=offsets.get(k, 0))
               for k, v in pages.items()],
        sender_address=src.broker.peer_address, sender_engine_id=src.engine_id if sender_engine else ""),
        timeout=timeout)


async def part(src, request_id, pages: dict, *, offsets=None, last=True, aux=b"", receiver="", timeout=30):
    """One Transfer of the offered flow: no peer address, source pages per component (for the
    offer of `receiver`, a broker id, when given)."""
    offsets = offsets or {}
    return await src.stub.Transfer(bpb.TransferRequest(
        request_id=request_id, engine_id=src.engine_id, more_parts=not last, aux=aux, receiver_broker_id=receiver,
        pages=[bpb.PartPages(component=k, src_page_ids=list(map(int, v)), dst_offset=offsets.get(k, 0))
               for k, v in pages.items()]), timeout=timeout)


async def watch_all(engine, request_id, timeout=30):
    call = engine.stub.WatchTransfer(bpb.WatchTransferRequest(engine_id=engine.engine_id, request_id=request_id),
                                     timeout=timeout)
    return [u.status async for u in call]


async def watch_first(engine, request_id, timeout=10):
    """The request's status now: the first message of WatchTransfer."""
    call = engine.stub.WatchTransfer(bpb.WatchTransferRequest(engine_id=engine.engine_id, request_id=request_id),
                                     timeout=timeout)
    try:
        return (await call.read()).status
    finally:
        call.cancel()


async def rest(call) -> list:
    """The statuses a watch still sends, read by read() (the iterator and read() do not mix)."""
    out = []
    while (message := await call.read()) is not grpc.aio.EOF:
        out.append(message.status)
    return out


def log_entries(broker) -> list[dict]:
    """The broker's JSON log lines so far, oldest first (the transfer engines write their own lines,
    not JSON, on the same stream)."""
    entries = []
    for line in list(broker.process.stderr_lines):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


def expect_pages(src, dst, before, moves):
    """The destination pool after `moves`: (component, src ids, dst ids) each."""
    expected = before
    for kind, src_ids, dst_ids in moves:
        expected = shapes.expected_destination(src.segment.array, expected, dst.shape, dst.placements, {kind},
                                               np.asarray(src_ids), np.asarray(dst_ids))
    return expected
