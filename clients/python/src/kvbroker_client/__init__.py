"""kvbroker's client package: `BrokerClient` and its types, and the generated `kvbroker.v1` stubs.

    from kvbroker_client import BrokerClient, Topology, KvDtype, Component
    from kvbroker_client.tensors import SharedPool, kv_split_component, flat_component   # host buffers
    from kvbroker_client.v1 import broker_service_pb2                                    # raw stubs

Errors are typed by status code (`NotFound`, `FailedPrecondition`, ...), all `BrokerError`.
`kvbroker_client.tensors` imports torch only when torch tensors are used (extra `torch`).
"""

from kvbroker_client.client import BrokerClient
from kvbroker_client.errors import (
    Aborted,
    AlreadyExists,
    BrokerError,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    Unknown,
    error_for_code,
)
from kvbroker_client.model import (
    BrokerInfo,
    BufferRole,
    Component,
    ComponentSpec,
    CudaIpcRef,
    EngineInfo,
    KvDtype,
    LayerBuffer,
    Layout,
    MemoryRef,
    PeerInfo,
    SessionInfo,
    SharedMemoryRef,
    Topology,
    TransferRole,
    TransferState,
    TransferStatus,
)

__all__ = [
    "Aborted", "AlreadyExists", "BrokerClient", "BrokerError", "BrokerInfo", "BufferRole", "Cancelled", "Component",
    "ComponentSpec", "CudaIpcRef", "DataLoss", "DeadlineExceeded", "EngineInfo", "FailedPrecondition", "Internal",
    "InvalidArgument", "KvDtype", "LayerBuffer", "Layout", "MemoryRef", "NotFound", "OutOfRange", "PeerInfo",
    "PermissionDenied", "ResourceExhausted", "SessionInfo", "SharedMemoryRef", "Topology", "TransferRole",
    "TransferState", "TransferStatus", "Unauthenticated", "Unavailable", "Unimplemented", "Unknown", "error_for_code",
]
