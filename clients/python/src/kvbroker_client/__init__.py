"""kvbroker's client package: the generated `kvbroker.v1` stubs (in `kvbroker_client.v1`)."""
