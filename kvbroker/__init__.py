"""kvbroker: a gRPC sidecar that brokers KV-cache transfers between prefill and decode pods."""

import os

# gRPC's fork handlers restart its event-engine threads inside a forked child; when the parent's
# channels are busy, one of them segfaults there before the child reaches exec (grpcio 1.85.3 on
# uvloop, whose subprocesses are fork + exec; grpc/grpc#43055 is the same class of bug). kvbroker's
# processes fork only to exec (brokers, bench children), for which gRPC's advice is to turn the
# handlers off. gRPC reads this when it is imported, so it is set here, before any module of ours
# imports grpc; an operator's explicit setting wins.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__version__ = "0.1.0"
