"""The client's types against the contract: enums number for number, one error class per status code."""

from __future__ import annotations

import enum

import grpc
import pytest

import kvbroker_client
from kvbroker_client import (
    BrokerError,
    BufferRole,
    Component,
    KvDtype,
    Layout,
    Topology,
    TransferRole,
    TransferState,
    error_for_code,
)
from kvbroker_client.v1 import common_pb2 as pb

ENUMS = [(Component, pb.Component, "COMPONENT_"), (Layout, pb.Layout, "LAYOUT_"),
         (BufferRole, pb.BufferRole, "BUFFER_ROLE_"), (KvDtype, pb.KvDtype, "KV_DTYPE_"),
         (TransferState, pb.TransferState, "TRANSFER_STATE_"), (TransferRole, pb.TransferRole, "TRANSFER_ROLE_")]


@pytest.mark.parametrize(("python", "proto", "prefix"), ENUMS, ids=[e[0].__name__ for e in ENUMS])
def test_enum_mirrors_the_proto_enum_value_for_value(python: type[enum.IntEnum], proto, prefix: str):
    from_proto = {name.removeprefix(prefix): number for name, number in proto.items() if number != 0}
    assert {m.name: m.value for m in python} == from_proto


def test_every_status_code_has_its_own_error_class():
    for code in grpc.StatusCode:
        if code is grpc.StatusCode.OK:
            continue
        cls = error_for_code(code)
        assert cls.code is code
        assert issubclass(cls, BrokerError)
        assert getattr(kvbroker_client, cls.__name__) is cls


def test_error_carries_code_and_reason():
    error = error_for_code(grpc.StatusCode.NOT_FOUND)("engine_id: no engine 'x'")
    assert (error.code, error.reason) == (grpc.StatusCode.NOT_FOUND, "engine_id: no engine 'x'")
    assert str(error) == "NOT_FOUND: engine_id: no engine 'x'"


def test_component_is_named_in_any_spelling():
    assert Component.of("minimax_index_k") is Component.of("COMPONENT_MINIMAX_INDEX_K") is Component.MINIMAX_INDEX_K
    assert Component.of(1) is Component.MAIN_KV
    with pytest.raises(ValueError, match="unknown component"):
        Component.of("mamba")


def test_topology_round_trips_and_defaults_attention_tp_to_tp():
    topology = Topology(page_size=16, start_layer=0, end_layer=8, kv_dtype=KvDtype.BFLOAT16, tp_size=4, tp_rank=3)
    assert (topology.attn_tp_size, topology.attn_tp_rank) == (4, 3)
    assert Topology.from_proto(topology.to_proto()) == topology
