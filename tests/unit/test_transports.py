"""backends/transports.unprotected: which UCX_TLS values let a forged region write anywhere."""

from __future__ import annotations

import pytest

from kvbroker.backends.transports import unprotected


@pytest.mark.parametrize("ucx_tls", [None, "", "all", "^rc", "tcp", "rc,tcp", "posix,sysv", "cma", "sm", "ud",
                                     "ud_x,cuda_ipc", "rc,xpmem"])
def test_nixl_on_transports_that_write_where_they_are_told_is_unprotected(ucx_tls):
    assert unprotected("nixl", ucx_tls)


@pytest.mark.parametrize("ucx_tls", ["rc", "rc,ud", "rc_x,ud_x,cuda_ipc,cuda_copy", "dc_x", "cuda_ipc,cuda_copy",
                                     "ib,gdr_copy", " rc , cuda_ipc "])
def test_nixl_on_rdma_or_gpu_ipc_only_is_protected(ucx_tls):
    assert unprotected("nixl", ucx_tls) == ""


def test_mooncake_is_protected_on_any_protocol():
    assert unprotected("mooncake", None) == ""


def test_the_reason_names_what_is_unprotected():
    assert "names tcp" in unprotected("nixl", "rc,tcp")
    assert "UCX_TLS is unset" in unprotected("nixl", None)
    assert "names ud" in unprotected("nixl", "ud,cuda_ipc")
