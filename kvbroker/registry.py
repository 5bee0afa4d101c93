"""Engines, components and layer buffers: validation of what a server registers, and lookup.

`validate_spec` checks a declared engine without touching memory (pure, property-tested);
`Registry.register` also resolves memory references, refuses overlaps with other engines and
registers the regions with the transfer engine. Called by the Broker only.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Protocol

from kvbroker.errors import BrokerError, Code, invalid, not_found
from kvbroker.memory import MappedSegment, map_shared_memory
from kvbroker.model import (
    BufferLayout,
    ComponentKind,
    ComponentLayout,
    CudaIpcRef,
    EngineLayout,
    EngineSpec,
    Layout,
    Role,
    SharedMemoryRef,
    Topology,
)
from kvbroker.topology import reject_index_with_value

IDENTIFIER = re.compile(r"[A-Za-z0-9._:/-]{1,128}")
ROLES_BY_LAYOUT = {Layout.FLAT: (Role.FLAT,), Layout.KV_SPLIT: (Role.K, Role.V)}


def check_identifier(value: str, field_name: str) -> None:
    if not IDENTIFIER.fullmatch(value):
        raise invalid(f"{field_name}: {value!r} must match [A-Za-z0-9._:/-]{{1,128}}")


def validate_topology(t: Topology) -> None:
    for name in ("tp_size", "attn_tp_size", "pp_size", "page_size"):
        if getattr(t, name) < 1:
            raise invalid(f"topology.{name}: must be at least 1, got {getattr(t, name)}")
    for rank, size in (("tp_rank", "tp_size"), ("attn_tp_rank", "attn_tp_size"), ("pp_rank", "pp_size")):
        if getattr(t, rank) >= getattr(t, size):
            raise invalid(f"topology.{rank}: must be below {size}={getattr(t, size)}, got {getattr(t, rank)}")
    if t.end_layer <= t.start_layer:
        raise invalid(f"topology.end_layer: must exceed start_layer={t.start_layer}, got {t.end_layer}")


def validate_spec(spec: EngineSpec, max_pages: int) -> None:
    """Everything about a declared engine that can be checked without mapping memory."""
    check_identifier(spec.engine_id, "engine_id")
    validate_topology(spec.topology)
    if not spec.components:
        raise invalid("components: at least one component is required")
    seen: set[ComponentKind] = set()
    for i, comp in enumerate(spec.components):
        where = f"components[{i}]"
        reject_index_with_value(comp.kind)
        if comp.kind in seen:
            raise invalid(f"{where}.component: {comp.kind.name} is registered twice")
        seen.add(comp.kind)
        if comp.kind is ComponentKind.MINIMAX_INDEX_K and comp.layout is not Layout.FLAT:
            raise invalid(f"{where}.layout: MINIMAX_INDEX_K must be LAYOUT_FLAT, got {comp.layout.name}")
        if not 1 <= comp.num_pages <= max_pages:
            raise invalid(f"{where}.num_pages: must be in [1, {max_pages}], got {comp.num_pages}")
        if not comp.layer_buffers:
            raise invalid(f"{where}.layer_buffers: at least one layer buffer is required")
        roles = ROLES_BY_LAYOUT[comp.layout]
        keys: set[tuple[int, Role]] = set()
        for j, buf in enumerate(comp.layer_buffers):
            at = f"{where}.layer_buffers[{j}] (layer {buf.layer_id}, {buf.role.name})"
            if buf.role not in roles:
                raise invalid(f"{at}.role: {comp.layout.name} layout takes {'/'.join(r.name for r in roles)}")
            if (buf.layer_id, buf.role) in keys:
                raise invalid(f"{at}: layer {buf.layer_id} {buf.role.name} is declared twice")
            keys.add((buf.layer_id, buf.role))
            if not spec.topology.start_layer <= buf.layer_id < spec.topology.end_layer:
                raise invalid(
                    f"{at}.layer_id: outside the engine's layers "
                    f"[{spec.topology.start_layer}, {spec.topology.end_layer})"
                )
            if buf.item_len == 0:
                raise invalid(f"{at}.item_len: must be greater than zero")
            if buf.length < comp.num_pages * buf.item_len:
                raise invalid(
                    f"{at}.length: {buf.length} bytes is shorter than num_pages × item_len = "
                    f"{comp.num_pages} × {buf.item_len} = {comp.num_pages * buf.item_len}"
                )
            if buf.memory is None:
                raise invalid(f"{at}.memory: a memory reference is required")
        if comp.layout is Layout.KV_SPLIT:
            layers = {layer for layer, _ in keys}
            for layer in sorted(layers):
                for role in roles:
                    if (layer, role) not in keys:
                        raise invalid(f"{where}.layer_buffers: layer {layer} has no {role.name} buffer")


@dataclass(frozen=True)
class Region:
    """A registered byte range, as handed to a transfer engine."""

    address: int
    length: int
    device: int
    gpu: bool


@dataclass
class Engine:
    spec: EngineSpec
    layout: EngineLayout
    generation: int
    regions: list[Region]
    segments: list[MappedSegment] = field(repr=False)
    backend_handle: object = None

    @property
    def engine_id(self) -> str:
        return self.spec.engine_id

    @property
    def registered_bytes(self) -> int:
        return sum(r.length for r in self.regions)

    def release(self) -> None:
        for segment in self.segments:
            segment.close()
        self.segments.clear()


@dataclass
class _Span:
    segment: str
    start: int
    end: int
    engine_id: str
    where: str


class RegistryObserver(Protocol):
    def engine_added(self, engine: Engine) -> None: ...

    def engine_removed(self, engine: Engine) -> None: ...


class Registry:
    """The engines of one broker. Mutated only by the Broker, on the event loop."""

    def __init__(self, max_pages: int, observer: RegistryObserver | None = None) -> None:
        self._observer = observer
        self._engines: dict[str, Engine] = {}
        self._generations = itertools.count(1)
        self._max_pages = max_pages

    def __contains__(self, engine_id: str) -> bool:
        return engine_id in self._engines

    def __iter__(self):
        return iter(list(self._engines.values()))

    def __len__(self) -> int:
        return len(self._engines)

    def get(self, engine_id: str) -> Engine:
        try:
            return self._engines[engine_id]
        except KeyError:
            raise not_found(f"engine_id: no engine {engine_id!r} is registered on this broker") from None

    def build(self, spec: EngineSpec) -> Engine:
        """Validate and map an engine; not yet visible. The caller registers its regions, then `add`s it."""
        validate_spec(spec, self._max_pages)
        if spec.engine_id in self._engines:
            raise BrokerError(Code.ALREADY_EXISTS, f"engine_id: engine {spec.engine_id!r} is already registered")
        spans = self._spans(spec)
        self._check_overlaps(spans)
        segments: dict[str, MappedSegment] = {}
        try:
            components = {}
            for i, comp in enumerate(spec.components):
                buffers = []
                for j, buf in enumerate(comp.layer_buffers):
                    at = f"components[{i}].layer_buffers[{j}] (layer {buf.layer_id}, {buf.role.name}).memory"
                    if isinstance(buf.memory, CudaIpcRef):
                        raise invalid(f"{at}.cuda_ipc: this broker has no CUDA support; use shared_memory")
                    assert isinstance(buf.memory, SharedMemoryRef)
                    name = buf.memory.name
                    if name not in segments:
                        segments[name] = map_shared_memory(name, f"{at}.shared_memory.name")
                    seg = segments[name]
                    if buf.memory.offset + buf.length > seg.size:
                        raise invalid(
                            f"{at}.shared_memory: offset {buf.memory.offset} + length {buf.length} "
                            f"exceeds segment {name!r} of {seg.size} bytes"
                        )
                    buffers.append(
                        BufferLayout(buf.layer_id, buf.role, seg.address + buf.memory.offset, buf.length, buf.item_len)
                    )
                buffers.sort(key=lambda b: (b.layer_id, b.role))
                components[comp.kind] = ComponentLayout(comp.kind, comp.layout, comp.num_pages, tuple(buffers))
        except BaseException:
            for seg in segments.values():
                seg.close()
            raise
        regions = [
            Region(b.address, b.length, b.device, gpu=False) for c in components.values() for b in c.buffers
        ]
        layout = EngineLayout(spec.engine_id, spec.topology, components)
        return Engine(spec, layout, next(self._generations), regions, list(segments.values()))

    def add(self, engine: Engine) -> None:
        if engine.engine_id in self._engines:
            raise BrokerError(Code.ALREADY_EXISTS, f"engine_id: engine {engine.engine_id!r} is already registered")
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
    def _spans(spec: EngineSpec) -> list[_Span]:
        spans = []
        for i, comp in enumerate(spec.components):
            for j, buf in enumerate(comp.layer_buffers):
                if isinstance(buf.memory, SharedMemoryRef):
                    where = f"components[{i}].layer_buffers[{j}] (layer {buf.layer_id}, {buf.role.name})"
                    start = buf.memory.offset
                    spans.append(_Span(buf.memory.name, start, start + buf.length, spec.engine_id, where))
        return spans

    def _check_overlaps(self, spans: list[_Span]) -> None:
        others = [s for engine in self._engines.values() for s in self._spans(engine.spec)]
        ordered = sorted(spans + others, key=lambda s: (s.segment, s.start))
        for a, b in zip(ordered, ordered[1:]):
            if a.segment == b.segment and b.start < a.end:
                new, old = (a, b) if a in spans else (b, a)
                owner = "" if old.engine_id == new.engine_id else f" of engine {old.engine_id!r}"
                raise invalid(
                    f"{new.where}.memory: overlaps {old.where}{owner} in segment {new.segment!r} "
                    f"([{new.start}, {new.end}) and [{old.start}, {old.end}))"
                )
