"""Engines, components and layer buffers: what a server registers, checked, mapped and looked up.

`Registry.check` runs `validate_spec` (validation.py: the declared engine, without touching memory)
and refuses a taken id and overlaps with other engines (on the event loop); `Registry.materialise`
allocates a broker-owned pool when the engine asks for one and resolves memory references
(memory.py; blocking, so in a worker thread); the Broker then registers the regions with the
transfer engine and `add`s the engine, which checks overlaps again against the files actually
mapped. Overlaps compare memory by identity: a segment is its file's (st_dev, st_ino), whatever
name (hard link) it was registered by. Called by the Broker only.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from kvbroker.core.errors import BrokerError, Code, invalid, not_found
from kvbroker.core.model import (
    BufferLayout,
    ComponentLayout,
    CudaIpcRef,
    EngineLayout,
    EngineSpec,
    LayerBuffer,
    MemoryKind,
    Region,
    SharedMemoryRef,
)
from kvbroker.core.validation import validate_spec
from kvbroker.memory.mapping import (
    BrokerPool,
    GpuMemory,
    ImportLease,
    MappedSegment,
    map_shared_memory,
    plan_pool,
    segment_identity,
)

log = logging.getLogger(__name__)


@dataclass
class Engine:
    spec: EngineSpec  # as registered: with a broker-owned pool, each buffer's memory names its place in it
    layout: EngineLayout
    generation: int
    regions: list[Region]
    held: list[Held] = field(repr=False)  # mapped segments, imported allocations, the broker-owned pool
    backend_handle: object = None
    session_id: str = ""  # the session that holds it (released when it ends); empty: none

    @property
    def engine_id(self) -> str:
        return self.spec.engine_id

    @property
    def registered_bytes(self) -> int:
        return sum(r.length for r in self.regions)

    @property
    def segment_identities(self) -> dict[str, tuple[int, int]]:
        """The file each segment name resolved to when it was mapped: (st_dev, st_ino)."""
        return {h.name: h.identity for h in self.held if isinstance(h, MappedSegment)}

    def release(self) -> None:
        _close_all(self.held)


class Held(Protocol):
    def close(self) -> None: ...


def _close_all(held: list[Held]) -> None:
    """Close each; one that fails (a driver that refuses to close the allocation of a server that
    died) is logged, and the others are still closed."""
    while held:  # the pool last: it was allocated first
        item = held.pop()
        try:
            item.close()
        except Exception:
            log.exception("could not release %r; releasing the rest", item)


@dataclass
class _Span:
    memory: tuple[object, ...]  # ("shm", dev, ino), ("shm-name", name) or ("cuda", device, handle): no overlaps
    label: str  # the memory, for messages
    start: int
    end: int
    engine_id: str
    where: str


class RegistryObserver(Protocol):
    def engine_added(self, engine: Engine) -> None: ...

    def engine_removed(self, engine: Engine) -> None: ...


class Registry:
    """The engines of one broker. Mutated only by the Broker, on the event loop."""

    def __init__(self, max_pages: int, observer: RegistryObserver | None = None, gpu: GpuMemory | None = None,
                 max_engines: int = 1024) -> None:
        self._max_engines = max_engines
        self._observer = observer
        self._gpu = GpuMemory() if gpu is None else gpu
        self._engines: dict[str, Engine] = {}
        self._generations = itertools.count(1)
        self._max_pages = max_pages

    def __contains__(self, engine_id: str) -> bool:
        return engine_id in self._engines

    def __iter__(self) -> Iterator[Engine]:
        return iter(list(self._engines.values()))

    def __len__(self) -> int:
        return len(self._engines)

    def find(self, engine_id: str) -> Engine | None:
        return self._engines.get(engine_id)

    def get(self, engine_id: str) -> Engine:
        try:
            return self._engines[engine_id]
        except KeyError:
            raise unknown_engine(engine_id) from None

    def build(self, spec: EngineSpec) -> Engine:
        """`check`, then `materialise`: an engine mapped but not yet visible."""
        self.check(spec)
        return self.materialise(spec)

    def check(self, spec: EngineSpec) -> None:
        """Everything about a new engine that needs no memory: its declaration, its id, its overlaps."""
        validate_spec(spec, self._max_pages)
        if spec.engine_id in self._engines:
            raise BrokerError(Code.ALREADY_EXISTS, f"engine_id: engine {spec.engine_id!r} is already registered")
        if len(self._engines) >= self._max_engines:
            raise BrokerError(Code.RESOURCE_EXHAUSTED, f"engine_id: {len(self._engines)} engines are registered, the "
                                                       f"limit of this broker (max_engines)")
        self._check_overlaps(self._spans(spec, segment_identity))

    def materialise(self, spec: EngineSpec) -> Engine:
        """Map a `check`ed engine: allocate its pool, map segments, open CUDA allocations. It makes
        blocking system and driver calls, so the Broker runs it off the event loop; it reads nothing
        of the registry's engines. The caller registers the regions with the backend, then `add`s it."""
        held: list[Held] = []
        try:
            pool = None
            if spec.broker_allocation is not None:
                pool, spec = self._allocate_pool(spec)
                held.append(pool)
            resolve = _Resolver(self._gpu, pool, held)
            components = {}
            for i, comp in enumerate(spec.components):
                buffers = []
                for j, buf in enumerate(comp.layer_buffers):
                    at = f"components[{i}].layer_buffers[{j}] (layer {buf.layer_id}, {buf.role.name}).memory"
                    address, kind, device = resolve(buf, at)
                    buffers.append(
                        BufferLayout(buf.layer_id, buf.role, address, buf.length, buf.item_len, device, kind))
                buffers.sort(key=lambda b: (b.layer_id, b.role))
                components[comp.kind] = ComponentLayout(comp.kind, comp.layout, comp.num_pages, tuple(buffers))
        except BaseException:
            _close_all(held)
            raise
        regions = [Region(b.address, b.length, b.device, gpu=b.memory_kind is MemoryKind.GPU)
                   for c in components.values() for b in c.buffers]
        layout = EngineLayout(spec.engine_id, spec.topology, components)
        return Engine(spec, layout, next(self._generations), regions, held)

    def _allocate_pool(self, spec: EngineSpec) -> tuple[BrokerPool, EngineSpec]:
        """One GPU pool for every layer buffer; the spec with each buffer's memory naming its place in it."""
        assert spec.broker_allocation is not None  # only a broker-allocated spec comes here
        device = spec.broker_allocation.device
        lengths = [b.length for c in spec.components for b in c.layer_buffers]
        offsets, size = plan_pool(lengths)
        pool = self._gpu.allocate_pool(device, size, "memory_ownership: MEMORY_OWNERSHIP_BROKER")
        places = iter(offsets)
        components = tuple(
            dataclasses.replace(c, layer_buffers=tuple(
                dataclasses.replace(b, memory=CudaIpcRef(pool.handle, device, next(places), size))
                for b in c.layer_buffers))
            for c in spec.components)
        return pool, dataclasses.replace(spec, components=components)

    def add(self, engine: Engine) -> None:
        if engine.engine_id in self._engines:
            raise BrokerError(Code.ALREADY_EXISTS, f"engine_id: engine {engine.engine_id!r} is already registered")
        # `check` resolved names by stat; a name may point at another file by the time it was opened
        self._check_overlaps(self._spans(engine.spec, engine.segment_identities.get))
        self._engines[engine.engine_id] = engine
        if self._observer is not None:
            self._observer.engine_added(engine)

    def remove(self, engine_id: str) -> Engine:
        engine = self.get(engine_id)
        del self._engines[engine_id]
        if self._observer is not None:
            self._observer.engine_removed(engine)
        return engine

    @staticmethod
    def _spans(spec: EngineSpec, identity: Callable[[str], tuple[int, int] | None]) -> list[_Span]:
        """The byte ranges a spec claims, each keyed by its memory; `identity` resolves a segment name to its file."""
        spans = []
        files: dict[str, tuple[int, int] | None] = {}  # one stat per segment, not per buffer
        for i, comp in enumerate(spec.components):
            for j, buf in enumerate(comp.layer_buffers):
                where = f"components[{i}].layer_buffers[{j}] (layer {buf.layer_id}, {buf.role.name})"
                m = buf.memory
                if isinstance(m, SharedMemoryRef):
                    if m.name not in files:
                        files[m.name] = identity(m.name)
                    file = files[m.name]  # None: no such file; mapping it will say so
                    memory = ("shm-name", m.name) if file is None else ("shm", *file)
                    spans.append(_Span(memory, f"segment {m.name!r}", m.offset, m.offset + buf.length,
                                       spec.engine_id, where))
                elif isinstance(m, CudaIpcRef):
                    spans.append(_Span(("cuda", m.device, bytes(m.handle)),
                                       f"CUDA allocation {bytes(m.handle[:8]).hex()}… on device {m.device}",
                                       m.offset, m.offset + buf.length, spec.engine_id, where))
        return spans

    def _check_overlaps(self, spans: list[_Span]) -> None:
        others = [s for engine in self._engines.values()
                  for s in self._spans(engine.spec, engine.segment_identities.get)]
        ordered = sorted(spans + others, key=lambda s: (s.memory, s.start))
        for a, b in itertools.pairwise(ordered):
            if a.memory == b.memory and b.start < a.end:
                new, old = (a, b) if a in spans else (b, a)
                owner = "" if old.engine_id == new.engine_id else f" of engine {old.engine_id!r}"
                same = "" if old.label == new.label else f" (the same file as {old.label}: a hard link)"
                raise invalid(
                    f"{new.where}.memory: overlaps {old.where}{owner} in {new.label}{same} "
                    f"([{new.start}, {new.end}) and [{old.start}, {old.end}))"
                )


class _Resolver:
    """Addresses of one engine's layer buffers; what it maps or opens goes on `held` (one entry per memory)."""

    def __init__(self, gpu: GpuMemory, pool: BrokerPool | None, held: list[Held]) -> None:
        self._gpu = gpu
        self._held = held
        self._segments: dict[str, MappedSegment] = {}
        self._allocations: dict[tuple[int, bytes], BrokerPool | ImportLease] = {}
        if pool is not None:
            self._allocations[(pool.device, pool.handle)] = pool

    def __call__(self, buf: LayerBuffer, at: str) -> tuple[int, MemoryKind, int]:
        m = buf.memory
        if isinstance(m, CudaIpcRef):
            key = (m.device, bytes(m.handle))
            allocation = self._allocations.get(key)
            if allocation is None:
                allocation = self._gpu.import_allocation(m, f"{at}.cuda_ipc")
                self._held.append(allocation)
                self._allocations[key] = allocation
            return allocation.address + m.offset, MemoryKind.GPU, m.device
        assert isinstance(m, SharedMemoryRef)
        seg = self._segments.get(m.name)
        if seg is None:
            seg = map_shared_memory(m.name, f"{at}.shared_memory.name")
            self._held.append(seg)
            self._segments[m.name] = seg
        if m.offset + buf.length > seg.size:
            raise invalid(f"{at}.shared_memory: offset {m.offset} + length {buf.length} "
                          f"exceeds segment {m.name!r} of {seg.size} bytes")
        seg.reserve(m.offset, buf.length, f"{at}.shared_memory")
        return seg.address + m.offset, MemoryKind.HOST, 0


def unknown_engine(engine_id: str) -> BrokerError:
    """NOT_FOUND for an engine id this broker does not hold; also what a peer that is not admitted
    hears, word for word, so that engine ids cannot be told apart from the outside."""
    return not_found(f"engine_id: no engine {engine_id[:128]!r} is registered on this broker")
