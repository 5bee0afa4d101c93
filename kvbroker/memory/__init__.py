"""Memory references into addresses: shared-memory segments, CUDA IPC handles, the SIGBUS guard."""
