"""The vocabulary of DESIGN.md as frozen dataclasses, shared by the registry, the rules and the planner.

Engines are described twice over: as the server declared them (`*Spec`, memory references) and as
a transfer sees them (`*Layout`, resolved addresses), the latter for local engines and peers alike.
What a transfer engine is handed is here too, so that the backends need nothing else of the
domain: `Region` (a registered byte range) and `Descriptors` (the planner's rows for one write).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


class Component(enum.IntEnum):
    MAIN_KV = 1
    MINIMAX_INDEX_K = 2
    MINIMAX_INDEX_KV = 3
    MINIMAX_DENSE_KV = 4


class Layout(enum.IntEnum):
    FLAT = 1
    KV_SPLIT = 2


class BufferRole(enum.IntEnum):
    FLAT = 1
    K = 2
    V = 3


class KvDtype(enum.IntEnum):
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    FLOAT8_E4M3 = 4
    FLOAT8_E5M2 = 5
    INT8 = 6
    UINT8 = 7


class MemoryKind(enum.IntEnum):
    """Where a layer buffer's bytes live, as a transfer engine registers them."""

    HOST = 1
    GPU = 2


class TransferState(enum.IntEnum):
    PENDING = 1
    TRANSFERRING = 2
    SUCCEEDED = 3
    FAILED = 4

    @property
    def terminal(self) -> bool:
        return self in (TransferState.SUCCEEDED, TransferState.FAILED)


class TransferRole(enum.IntEnum):
    SENDER = 1
    RECEIVER = 2


@dataclass(frozen=True)
class Topology:
    tp_size: int
    tp_rank: int
    attn_tp_size: int
    attn_tp_rank: int
    pp_size: int
    pp_rank: int
    dp_rank: int
    page_size: int
    start_layer: int
    end_layer: int
    kv_dtype: KvDtype


@dataclass(frozen=True)
class SharedMemoryRef:
    name: str
    offset: int


@dataclass(frozen=True)
class CudaIpcRef:
    handle: bytes
    device: int
    offset: int
    allocation_size: int


MemoryRef = SharedMemoryRef | CudaIpcRef


@dataclass(frozen=True)
class LayerBuffer:
    layer_id: int
    role: BufferRole
    memory: MemoryRef | None
    length: int
    item_len: int


@dataclass(frozen=True)
class ComponentSpec:
    kind: Component
    layout: Layout
    num_pages: int
    layer_buffers: tuple[LayerBuffer, ...]


@dataclass(frozen=True)
class BrokerAllocation:
    """The engine asks the broker to allocate its layer buffers, in one GPU pool on `device`."""

    device: int


@dataclass(frozen=True)
class EngineSpec:
    engine_id: str
    topology: Topology
    components: tuple[ComponentSpec, ...]
    broker_allocation: BrokerAllocation | None = None  # None: the server provides every buffer's memory


@dataclass(frozen=True)
class BufferLayout:
    """One layer buffer where a transfer engine can reach it."""

    layer_id: int
    role: BufferRole
    address: int
    length: int
    item_len: int
    device: int = 0
    memory_kind: MemoryKind = MemoryKind.HOST


@dataclass(frozen=True, eq=False)
class BufferColumns:
    """Layer buffers as the planner multiplies page runs by them: (n, 1) uint64 columns of their
    addresses, item lengths and devices, and their one memory kind."""

    base: np.ndarray
    item: np.ndarray
    device: np.ndarray
    memory_kind: MemoryKind

    @classmethod
    def of(cls, buffers: Sequence[BufferLayout], side: str = "layer") -> BufferColumns:
        kinds = {b.memory_kind for b in buffers}
        if len(kinds) > 1:
            raise ValueError(f"{side} layer buffers mix host and GPU memory")
        return cls(np.array([b.address for b in buffers], dtype=np.uint64)[:, None],
                   np.array([b.item_len for b in buffers], dtype=np.uint64)[:, None],
                   np.array([b.device for b in buffers], dtype=np.uint64)[:, None],
                   kinds.pop() if kinds else MemoryKind.HOST)

    @property
    def count(self) -> int:
        return int(self.base.shape[0])


@dataclass(frozen=True)
class ComponentLayout:
    kind: Component
    layout: Layout
    num_pages: int
    buffers: tuple[BufferLayout, ...]  # sorted by (layer_id, role)

    @functools.cached_property
    def columns(self) -> BufferColumns:
        """Its buffers as the planner uses them, computed once per layout (a layout never changes)."""
        return BufferColumns.of(self.buffers)

    @property
    def buffer_keys(self) -> tuple[tuple[int, BufferRole], ...]:
        return tuple((b.layer_id, b.role) for b in self.buffers)

    @property
    def page_bytes(self) -> int:
        """Bytes one page of this component takes: the item_len of every layer buffer."""
        return sum(b.item_len for b in self.buffers)


@dataclass(frozen=True)
class EngineLayout:
    engine_id: str
    topology: Topology
    components: dict[Component, ComponentLayout] = field(hash=False)


@dataclass(frozen=True)
class Region:
    """A registered byte range, as handed to a transfer engine."""

    address: int
    length: int
    device: int
    gpu: bool


@dataclass(frozen=True)
class Descriptors:
    """What one write moves, as the planner built it: one (address, length, device) row per run per
    layer buffer on each side."""

    src: np.ndarray  # (n, 3) uint64: address, length in bytes, device
    dst: np.ndarray  # (n, 3) uint64, row i is where src row i lands
    src_memory_kind: MemoryKind = MemoryKind.HOST
    dst_memory_kind: MemoryKind = MemoryKind.HOST

    @property
    def count(self) -> int:
        return int(self.src.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.src[:, 1].sum())
