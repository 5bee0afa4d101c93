"""Helpers the test modules share (one copy each): refusals, sync (the domain's BrokerError) and
async (a gRPC call's AioRpcError)."""

from __future__ import annotations

import grpc
import pytest

from kvbroker.core.errors import BrokerError


def refusal(fn, *args, **kwargs) -> BrokerError:
    """The BrokerError `fn(*args, **kwargs)` raises; fails the test if it raises none."""
    with pytest.raises(BrokerError) as info:
        fn(*args, **kwargs)
    return info.value


async def rpc_refusal(call) -> grpc.aio.AioRpcError:
    """The status a gRPC call ends with; fails the test if it succeeds."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value
