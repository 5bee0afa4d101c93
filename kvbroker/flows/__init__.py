"""The request flows: the Broker façade, the engines' registry and sessions, every request's record,
the receiver side and both senders. No gRPC: peers are reached through kvbroker.peers.link.PeerLink."""
