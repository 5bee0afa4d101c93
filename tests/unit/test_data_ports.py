"""data_port_range: validated as both engines take it, and the environment it sets for each engine,
set only where the operator set nothing and put back after."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from kvbroker.backends import ports
from kvbroker.config import Settings, parse_port_range


@pytest.mark.parametrize("text", ["20100-20199", "1024-1024", "61000-65535", "20000-32767"])
def test_a_range_both_engines_honour_is_accepted(text):
    ports_ = Settings(data_port_range=text).data_ports
    assert ports_ == parse_port_range(text) and len(ports_) >= 1


@pytest.mark.parametrize("text", ["20199-20100", "100-200", "1023-2000", "60000-70000", "40000-40010",
                                  "32000-33000", "60999-61000", "20100", "a-b", "20100-", "-20100"])
def test_a_range_outside_1024_65535_or_touching_the_kernels_ephemeral_ports_is_refused(text):
    with pytest.raises(ValidationError, match="data_port_range"):
        Settings(data_port_range=text)


def test_no_range_leaves_the_engines_their_own_ports():
    assert Settings().data_ports is None


def test_ucx_listens_in_the_range_on_the_advertised_hosts_interface():
    values = ports.ucx_environment(range(20100, 20200), "127.0.0.1")
    assert values["UCX_TCP_PORT_RANGE"] == "20100-20199"
    assert values["UCX_NET_DEVICES"].split(",")[0] == "lo"


def test_the_interface_of_an_address_is_the_one_that_holds_it():
    assert ("lo", __import__("ipaddress").ip_address("127.0.0.1")) in ports.interface_addresses()
    assert ports.interface_of("127.0.0.1") == "lo"
    assert ports.interface_of("localhost") == "lo"
    assert ports.interface_of("192.0.2.1") is None  # TEST-NET-1: nobody's


def test_every_rdma_port_is_named_as_ucx_names_it(tmp_path):
    for device, port in (("mlx5_0", "1"), ("mlx5_1", "1"), ("mlx5_1", "2")):
        (tmp_path / device / "ports" / port).mkdir(parents=True)
    assert ports.rdma_ports(tmp_path) == ["mlx5_0:1", "mlx5_1:1", "mlx5_1:2"]
    assert ports.rdma_ports(tmp_path / "none") == []


def test_mooncake_takes_the_range_as_its_rpc_ports():
    assert ports.mooncake_environment(range(20100, 20200)) == {"MC_MIN_RPC_PORT": "20100",
                                                                "MC_MAX_RPC_PORT": "20199"}


def test_the_environment_is_set_only_where_the_operator_set_nothing_and_put_back(monkeypatch):
    monkeypatch.setenv("UCX_NET_DEVICES", "eth0")
    monkeypatch.delenv("UCX_TCP_PORT_RANGE", raising=False)
    with ports.environment({"UCX_NET_DEVICES": "lo", "UCX_TCP_PORT_RANGE": "1-2"}) as applied:
        assert applied == {"UCX_TCP_PORT_RANGE": "1-2"}
        assert os.environ["UCX_NET_DEVICES"] == "eth0" and os.environ["UCX_TCP_PORT_RANGE"] == "1-2"
    assert os.environ["UCX_NET_DEVICES"] == "eth0" and "UCX_TCP_PORT_RANGE" not in os.environ
