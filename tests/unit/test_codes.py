"""One table of status codes (kvbroker_client.codes) for the daemon's edge and the clients: a number on
the wire and the grpc.StatusCode agree both ways, the domain's Code names the same status by the same
number, and a number outside the table is UNKNOWN, never an exception."""

from __future__ import annotations

import grpc

from kvbroker.core.errors import Code
from kvbroker.edge.codes import status_code as edge_status_code
from kvbroker_client import codes
from kvbroker_client.model import TransferStatus
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb


def test_every_grpc_code_round_trips_through_its_number():
    for code in grpc.StatusCode:
        assert codes.status_code(codes.code_number(code)) is code


def test_the_domains_codes_are_the_same_statuses_by_number():
    for code in Code:
        assert edge_status_code(code).name == code.name
        assert codes.code_number(edge_status_code(code)) == int(code)


def test_a_number_outside_the_table_is_unknown():
    assert codes.status_code(99) is grpc.StatusCode.UNKNOWN
    assert edge_status_code(99) is grpc.StatusCode.UNKNOWN


def test_the_client_reads_a_status_through_the_same_table():
    message = bpb.TransferStatus(request_id="r", engine_id="e", role=pb.TRANSFER_ROLE_RECEIVER,
                                 state=pb.TRANSFER_STATE_FAILED, code=codes.code_number(grpc.StatusCode.ABORTED))
    status = TransferStatus.from_proto(message)
    assert status.code is grpc.StatusCode.ABORTED
