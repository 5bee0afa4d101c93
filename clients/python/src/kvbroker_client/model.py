"""The vocabulary of kvbroker.v1 as Python types: what `BrokerClient` takes and returns.

Enums mirror the proto enums number for number (without the `..._UNSPECIFIED` zero); frozen
dataclasses stand for the messages a server builds or reads, each with `to_proto` and/or
`from_proto`. Words as in DESIGN.md: engine, component, layer buffer, page id, grant, run.
"""

from __future__ import annotations

import builtins
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc

from kvbroker_client.codes import status_code
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb


class Component(enum.IntEnum):
    """One state of an engine that kvbroker can move."""

    MAIN_KV = pb.COMPONENT_MAIN_KV
    MINIMAX_INDEX_K = pb.COMPONENT_MINIMAX_INDEX_K
    MINIMAX_INDEX_KV = pb.COMPONENT_MINIMAX_INDEX_KV  # refused by brokers with UNIMPLEMENTED, as upstream
    MINIMAX_DENSE_KV = pb.COMPONENT_MINIMAX_DENSE_KV  # the dense layers' K and V (SGLang 0.5.23)

    @classmethod
    def of(cls, value: Component | int | str) -> Component:
        """A component from itself, its number, or its name ("MAIN_KV", "minimax_index_k")."""
        if isinstance(value, str):
            try:
                return cls[value.upper().removeprefix("COMPONENT_")]
            except KeyError:
                raise ValueError(f"unknown component {value!r}; one of {[c.name for c in cls]}") from None
        return cls(value)


class Layout(enum.IntEnum):
    FLAT = pb.LAYOUT_FLAT  # one buffer per layer (MLA latent, K-only index)
    KV_SPLIT = pb.LAYOUT_KV_SPLIT  # a K and a V buffer per layer (MHA)


class BufferRole(enum.IntEnum):
    FLAT = pb.BUFFER_ROLE_FLAT
    K = pb.BUFFER_ROLE_K
    V = pb.BUFFER_ROLE_V


class KvDtype(enum.IntEnum):
    FLOAT32 = pb.KV_DTYPE_FLOAT32
    FLOAT16 = pb.KV_DTYPE_FLOAT16
    BFLOAT16 = pb.KV_DTYPE_BFLOAT16
    FLOAT8_E4M3 = pb.KV_DTYPE_FLOAT8_E4M3
    FLOAT8_E5M2 = pb.KV_DTYPE_FLOAT8_E5M2
    INT8 = pb.KV_DTYPE_INT8
    UINT8 = pb.KV_DTYPE_UINT8


class TransferState(enum.IntEnum):
    PENDING = pb.TRANSFER_STATE_PENDING
    TRANSFERRING = pb.TRANSFER_STATE_TRANSFERRING
    SUCCEEDED = pb.TRANSFER_STATE_SUCCEEDED
    FAILED = pb.TRANSFER_STATE_FAILED

    @property
    def terminal(self) -> bool:
        return self in (TransferState.SUCCEEDED, TransferState.FAILED)


class TransferRole(enum.IntEnum):
    SENDER = pb.TRANSFER_ROLE_SENDER
    RECEIVER = pb.TRANSFER_ROLE_RECEIVER


@dataclass(frozen=True)
class SharedMemoryRef:
    """A region in a named POSIX shared-memory segment (/dev/shm/<name>) at a byte offset."""

    name: str
    offset: int

    def to_proto(self) -> pb.MemoryRef:
        return pb.MemoryRef(shared_memory=pb.SharedMemoryRef(name=self.name, offset=self.offset))


@dataclass(frozen=True)
class CudaIpcRef:
    """A region in a CUDA allocation exported as an IPC handle (GPU memory; see issue 8)."""

    handle: bytes
    device: int
    offset: int
    allocation_size: int

    def to_proto(self) -> pb.MemoryRef:
        return pb.MemoryRef(cuda_ipc=pb.CudaIpcRef(handle=self.handle, device=self.device, offset=self.offset,
                                                   allocation_size=self.allocation_size))


MemoryRef = SharedMemoryRef | CudaIpcRef


def _memory_from_proto(message: pb.MemoryRef) -> MemoryRef | None:
    which = message.WhichOneof("kind")
    if which == "cuda_ipc":
        c = message.cuda_ipc
        return CudaIpcRef(c.handle, c.device, c.offset, c.allocation_size)
    if which == "shared_memory":
        return SharedMemoryRef(message.shared_memory.name, message.shared_memory.offset)
    return None


@dataclass(frozen=True)
class LayerBuffer:
    """One contiguous page-indexed region of one layer: page p is [offset + p*item_len, ... + item_len)."""

    layer_id: int  # global layer id
    role: BufferRole
    memory: MemoryRef | None  # None when the broker allocates (register_engine(memory_ownership="broker"))
    length: int  # bytes; at least num_pages * item_len
    item_len: int  # bytes of one page

    @property
    def num_pages(self) -> int:
        return self.length // self.item_len

    def to_proto(self) -> pb.LayerBuffer:
        return pb.LayerBuffer(layer_id=self.layer_id, role=self.role.value,
                              memory=None if self.memory is None else self.memory.to_proto(),
                              length=self.length, item_len=self.item_len)

    @classmethod
    def from_proto(cls, m: pb.LayerBuffer) -> LayerBuffer:
        return cls(m.layer_id, BufferRole(m.role), _memory_from_proto(m.memory), m.length, m.item_len)


@dataclass(frozen=True)
class ComponentSpec:
    """One component of an engine and its layer buffers; valid page ids are [0, num_pages)."""

    component: Component
    layout: Layout
    num_pages: int
    layer_buffers: tuple[LayerBuffer, ...]

    def to_proto(self) -> pb.ComponentSpec:
        return pb.ComponentSpec(component=self.component.value, layout=self.layout.value, num_pages=self.num_pages,
                                layer_buffers=[b.to_proto() for b in self.layer_buffers])

    @classmethod
    def from_proto(cls, m: pb.ComponentSpec) -> ComponentSpec:
        return cls(Component(m.component), Layout(m.layout), m.num_pages,
                   tuple(LayerBuffer.from_proto(b) for b in m.layer_buffers))


@dataclass(frozen=True)
class Topology:
    """An engine's parallel layout and cache shape. attn_tp_* default to tp_* (no DP attention)."""

    page_size: int  # tokens per page
    start_layer: int  # first global layer id held by this rank
    end_layer: int  # one past the last
    kv_dtype: KvDtype
    tp_size: int = 1
    tp_rank: int = 0
    attn_tp_size: int | None = None
    attn_tp_rank: int | None = None
    pp_size: int = 1
    pp_rank: int = 0
    dp_rank: int = 0

    def __post_init__(self) -> None:
        if self.attn_tp_size is None:
            object.__setattr__(self, "attn_tp_size", self.tp_size)
        if self.attn_tp_rank is None:
            object.__setattr__(self, "attn_tp_rank", self.tp_rank)
        object.__setattr__(self, "kv_dtype", KvDtype(self.kv_dtype))

    def to_proto(self) -> pb.Topology:
        return pb.Topology(tp_size=self.tp_size, tp_rank=self.tp_rank, attn_tp_size=self.attn_tp_size,
                           attn_tp_rank=self.attn_tp_rank, pp_size=self.pp_size, pp_rank=self.pp_rank,
                           dp_rank=self.dp_rank, page_size=self.page_size, start_layer=self.start_layer,
                           end_layer=self.end_layer, kv_dtype=self.kv_dtype.value)

    @classmethod
    def from_proto(cls, m: pb.Topology) -> Topology:
        return cls(page_size=m.page_size, start_layer=m.start_layer, end_layer=m.end_layer,
                   kv_dtype=KvDtype(m.kv_dtype), tp_size=m.tp_size, tp_rank=m.tp_rank,
                   attn_tp_size=m.attn_tp_size, attn_tp_rank=m.attn_tp_rank, pp_size=m.pp_size,
                   pp_rank=m.pp_rank, dp_rank=m.dp_rank)


@dataclass(frozen=True)
class EngineInfo:
    """An engine as a broker holds it."""

    engine_id: str
    topology: Topology
    components: tuple[ComponentSpec, ...]
    registered_bytes: int
    memory_ownership: str = "server"  # "broker": each buffer's memory is its place in the broker's pool
    session_id: str = ""  # the session that holds it; empty when none does

    @classmethod
    def from_proto(cls, m: bpb.EngineInfo) -> EngineInfo:
        return cls(m.engine_id, Topology.from_proto(m.topology),
                   tuple(ComponentSpec.from_proto(c) for c in m.components), m.registered_bytes,
                   "broker" if m.memory_ownership == bpb.MEMORY_OWNERSHIP_BROKER else "server", m.session_id)


@dataclass(frozen=True)
class PeerInfo:
    address: str
    broker_id: str
    epoch: int
    handshakes: int


@dataclass(frozen=True)
class SessionInfo:
    """An open session and the engines it holds."""

    session_id: str
    holder: str
    engine_ids: tuple[str, ...]
    opened_unix_ms: int


@dataclass(frozen=True)
class BrokerInfo:
    """A broker's identity and what it holds. `epoch` changes on every start of the broker."""

    broker_id: str
    epoch: int
    version: str
    backend: str
    peer_address: str  # what to pass as peer_address when sending to an engine of this broker
    engines: tuple[EngineInfo, ...]
    peers: tuple[PeerInfo, ...]
    request_counts: Mapping[str, int] = field(default_factory=dict)
    sessions: tuple[SessionInfo, ...] = ()
    peers_authenticated: bool = False  # False: peers' broker ids are their own claims (no mutual TLS)
    peer_allow: tuple[str, ...] = ()  # identity patterns of the peers this broker admits

    @property
    def engine_ids(self) -> tuple[str, ...]:
        return tuple(e.engine_id for e in self.engines)

    @classmethod
    def from_proto(cls, m: bpb.GetBrokerInfoResponse) -> BrokerInfo:
        return cls(m.broker_id, m.epoch, m.version, m.backend, m.peer_address,
                   tuple(EngineInfo.from_proto(e) for e in m.engines),
                   tuple(PeerInfo(p.address, p.broker_id, p.epoch, p.handshakes) for p in m.peers),
                   dict(m.request_counts),
                   tuple(SessionInfo(x.session_id, x.holder, tuple(x.engine_ids), x.opened_unix_ms)
                         for x in m.sessions),
                   m.peers_authenticated, tuple(m.peer_allow))


@dataclass(frozen=True)
class TransferStatus:
    """The state of one request on one broker. For FAILED, `code` and `reason` say why."""

    request_id: str
    engine_id: str
    role: TransferRole
    state: TransferState
    code: grpc.StatusCode  # OK unless FAILED
    reason: str
    pages: int  # pages moved per layer buffer (after truncation)
    runs: int  # runs (descriptors per layer buffer)
    bytes: int  # over all components and layer buffers
    truncated_pages: int  # dropped because the page lists differed in length
    duration_us: int
    components: tuple[Component, ...]
    # builtins.bytes: the field `bytes` above shadows the type inside this class
    aux: builtins.bytes = b""  # receiver, SUCCEEDED only: the aux payload of the sender's last part
    parts: int = 0  # parts landed so far (the offered flow)

    @classmethod
    def from_proto(cls, m: bpb.TransferStatus) -> TransferStatus:
        return cls(m.request_id, m.engine_id, TransferRole(m.role), TransferState(m.state), status_code(m.code),
                   m.reason, m.pages, m.runs, m.bytes, m.truncated_pages, m.duration_us,
                   tuple(Component(c) for c in m.components), m.aux, m.parts)
