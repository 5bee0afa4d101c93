"""kvbroker: a gRPC sidecar that brokers KV-cache transfers between prefill and decode pods."""

__version__ = "0.1.0"
