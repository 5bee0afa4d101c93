"""Broker to broker: the PeerLink protocol the flows use, its gRPC clients, the part notifier, the idle policy."""
