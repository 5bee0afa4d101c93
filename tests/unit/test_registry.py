"""Validation of what a server registers: every error names the field and the rule."""

from __future__ import annotations

import dataclasses

import pytest

from kvbroker.core.errors import BrokerError, Code
from kvbroker.core.model import (
    BufferRole,
    Component,
    ComponentSpec,
    EngineSpec,
    KvDtype,
    LayerBuffer,
    Layout,
    SharedMemoryRef,
    Topology,
)
from kvbroker.core.validation import validate_spec
from kvbroker.flows.registry import Registry
from kvbroker_client.shm import SharedSegment
from tests.support import helpers

TOPO = Topology(1, 0, 1, 0, 1, 0, 0, 16, 0, 4, KvDtype.BFLOAT16)


def buf(layer, role=BufferRole.FLAT, name="seg", offset=0, length=1024, item_len=64):
    return LayerBuffer(layer, role, SharedMemoryRef(name, offset), length, item_len)


def spec(*components, topo=TOPO, engine_id="decode-0/tp0"):
    return EngineSpec(engine_id, topo, tuple(components))


def index_k(*buffers, num_pages=16):
    return ComponentSpec(Component.MINIMAX_INDEX_K, Layout.FLAT, num_pages, tuple(buffers or (buf(2),)))


def refusal(s: EngineSpec) -> BrokerError:
    return helpers.refusal(validate_spec, s, max_pages=1 << 20)


def test_a_valid_spec_passes():
    validate_spec(spec(index_k(buf(2), buf(3, offset=1024))), max_pages=1 << 20)


def test_index_with_value_is_unimplemented():
    error = refusal(spec(ComponentSpec(Component.MINIMAX_INDEX_KV, Layout.FLAT, 16, (buf(2),))))
    assert error.code is Code.UNIMPLEMENTED and "MINIMAX_INDEX_KV" in error.reason


@pytest.mark.parametrize("bad, words", [
    (spec(index_k(buf(2, item_len=0))), "components[0].layer_buffers[0] (layer 2, FLAT).item_len: must be greater"),
    (spec(index_k(buf(2, length=100))), "(layer 2, FLAT).length: 100 bytes is shorter than num_pages × item_len"),
    (spec(index_k(buf(9))), "(layer 9, FLAT).layer_id: outside the engine's layers [0, 4)"),
    (spec(index_k(buf(2), buf(2, offset=4096))), "layer 2 FLAT is declared twice"),
    (spec(index_k(buf(2, role=BufferRole.K))), ".role: FLAT layout takes FLAT"),
    (spec(ComponentSpec(Component.MINIMAX_INDEX_K, Layout.KV_SPLIT, 16, (buf(2, BufferRole.K), buf(2, BufferRole.V)))),
     "components[0].layout: MINIMAX_INDEX_K must be LAYOUT_FLAT"),
    (spec(ComponentSpec(Component.MAIN_KV, Layout.KV_SPLIT, 16, (buf(1, BufferRole.K),))),
     "layer 1 has no V buffer"),
    (spec(ComponentSpec(Component.MINIMAX_DENSE_KV, Layout.FLAT, 16, (buf(1),))),
     "components[0].layout: MINIMAX_DENSE_KV (K and V per dense layer) must be LAYOUT_KV_SPLIT"),
    (spec(index_k(num_pages=0)), "components[0].num_pages: must be in [1,"),
    (spec(), "components: at least one component"),
    (spec(index_k(), index_k()), "components[1].component: MINIMAX_INDEX_K is registered twice"),
    (spec(index_k(), engine_id="bad id!"), "engine_id: 'bad id!' must match"),
    (spec(index_k(), topo=dataclasses.replace(TOPO, tp_size=0)), "topology.tp_size: must be at least 1"),
    (spec(index_k(), topo=dataclasses.replace(TOPO, tp_rank=1)), "topology.tp_rank: must be below tp_size=1"),
    (spec(index_k(), topo=dataclasses.replace(TOPO, end_layer=0)), "topology.end_layer: must exceed start_layer"),
    (spec(index_k(LayerBuffer(2, BufferRole.FLAT, None, 1024, 64))), "(layer 2, FLAT).memory: a memory reference"),
])
def test_bad_specs_are_invalid_argument_naming_the_field(bad, words):
    error = refusal(bad)
    assert error.code is Code.INVALID_ARGUMENT
    assert words in error.reason


@pytest.fixture
def segment():
    with SharedSegment.create(8192, "kvbt-unit") as seg:
        yield seg


def build_refusal(registry: Registry, s: EngineSpec) -> BrokerError:
    return helpers.refusal(registry.build, s)


def test_missing_segment_is_invalid_argument():
    error = build_refusal(Registry(1 << 20), spec(index_k(buf(2, name="kvbt-no-such-segment"))))
    assert error.code is Code.INVALID_ARGUMENT
    assert "(layer 2, FLAT).memory.shared_memory.name: shared-memory segment 'kvbt-no-such-segment' not found" \
        in error.reason


def test_region_past_the_segment_end_is_invalid_argument(segment):
    error = build_refusal(Registry(1 << 20), spec(index_k(buf(2, name=segment.name, offset=8000))))
    assert "offset 8000 + length 1024 exceeds segment" in error.reason


def test_overlapping_regions_in_one_engine_are_invalid_argument(segment):
    error = build_refusal(Registry(1 << 20), spec(index_k(buf(2, name=segment.name), buf(3, name=segment.name,
                                                                                        offset=512))))
    assert error.code is Code.INVALID_ARGUMENT and "overlaps" in error.reason and "(layer 3, FLAT)" in error.reason


def test_overlap_with_another_engine_is_invalid_argument(segment):
    registry = Registry(1 << 20)
    first = registry.build(spec(index_k(buf(2, name=segment.name)), engine_id="a"))
    registry.add(first)
    error = build_refusal(registry, spec(index_k(buf(2, name=segment.name, offset=1000)), engine_id="b"))
    assert "of engine 'a'" in error.reason
    first.release()


def test_registered_engine_resolves_addresses_inside_the_segment(segment):
    registry = Registry(1 << 20)
    engine = registry.build(spec(index_k(buf(2, name=segment.name), buf(3, name=segment.name, offset=2048))))
    try:
        layout = engine.layout.components[Component.MINIMAX_INDEX_K]
        assert layout.buffers[1].address - layout.buffers[0].address == 2048
        assert engine.registered_bytes == 2048
    finally:
        engine.release()


def test_registering_the_same_engine_twice_is_already_exists(segment):
    registry = Registry(1 << 20)
    engine = registry.build(spec(index_k(buf(2, name=segment.name))))
    registry.add(engine)
    error = build_refusal(registry, spec(index_k(buf(2, name=segment.name, offset=4096))))
    assert error.code is Code.ALREADY_EXISTS
    engine.release()
