"""Every enum of the daemon's model and of the client's equals the proto enum of its name, number for
number and name for name (the proto's names without their prefix, UNSPECIFIED aside): convert.enum_in
turns proto numbers into domain members by value, and the client does the same."""

from __future__ import annotations

import enum

import pytest

from kvbroker.core import model
from kvbroker_client import model as client_model
from kvbroker_client.v1 import broker_service_pb2, common_pb2

PROTO_ENUMS = {**common_pb2.DESCRIPTOR.enum_types_by_name, **broker_service_pb2.DESCRIPTOR.enum_types_by_name}


def enums_of(module) -> list[type[enum.Enum]]:
    return [v for v in vars(module).values()
            if isinstance(v, type) and issubclass(v, enum.Enum) and v.__module__ == module.__name__]


def proto_members(descriptor) -> dict[str, int]:
    """The proto enum's values by name, without the prefix its zero value names (`X_UNSPECIFIED`)."""
    zero = descriptor.values_by_number[0].name
    assert zero.endswith("_UNSPECIFIED"), f"{descriptor.name}: its zero value is {zero}"
    prefix = zero.removesuffix("UNSPECIFIED")
    assert all(v.name.startswith(prefix) for v in descriptor.values), f"{descriptor.name}: a value lacks {prefix}"
    return {v.name.removeprefix(prefix): v.number for v in descriptor.values if v.number != 0}


ENUMS = enums_of(model) + enums_of(client_model)


def test_both_models_have_enums_to_compare():
    assert {e.__name__ for e in enums_of(model)} >= {"Component", "Layout", "BufferRole", "KvDtype", "MemoryKind",
                                                      "TransferState", "TransferRole"}
    assert enums_of(client_model)


@pytest.mark.parametrize("domain", ENUMS, ids=lambda e: f"{e.__module__}.{e.__name__}")
def test_an_enum_equals_its_proto_enum_number_for_number_and_name_for_name(domain):
    assert domain.__name__ in PROTO_ENUMS, f"no proto enum is named {domain.__name__}"
    assert {m.name: m.value for m in domain} == proto_members(PROTO_ENUMS[domain.__name__])
