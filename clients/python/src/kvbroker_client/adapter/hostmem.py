"""Host (CPU) tensors in shared memory, so a broker, another process, can open them (needs torch).

A broker opens host memory only by a /dev/shm name (memory.py). Engines allocate their CPU KV caches
with plain torch factories on the heap and soon cache the tensors' addresses, so an adapter acts
while the cache is being built, or moves a tensor before anything took its address:

    SharedHostAllocations   a torch function mode: each CPU tensor a factory (zeros, empty, full, ...)
                            returns is moved into its own /dev/shm segment at birth (torch's
                            file_system sharing, in place), before anything reads its address
    share_in_place(tensor)  the same move for one tensor that exists already; its address changes

Cost: one copy of each buffer (its zeros, into the segment), and the pool lives in /dev/shm, which
must be large enough to hold it (containers: 64 MiB by default). The segments are torch's own
(`torch_<pid>_...`): torch_shm_manager unlinks them when the process ends, but not when the server's
whole process group is killed (SIGKILL, OOM): then they stay in /dev/shm, the KV cache's size each,
until someone unlinks them (the test stacks do: kvbroker_tools.serving.stack). GPU tensors are left
alone (brokers open them by CUDA IPC).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

# Factories that make a tensor of fresh memory; never those that may wrap memory someone else owns
# (tensor, as_tensor, asarray, from_numpy), which a move would tear away from its owner.
_FACTORIES = frozenset({
    torch.empty, torch.empty_strided, torch.zeros, torch.ones, torch.full,
    torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like,
    torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_full,
})


def share_in_place(tensor: torch.Tensor) -> int:
    """Move a CPU tensor's storage into /dev/shm in place; the bytes moved (0 for GPU or empty tensors)."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return 0
    storage = tensor.untyped_storage()
    if not storage.is_shared():
        storage._share_filename_cpu_()  # a new /dev/shm mapping, the bytes copied once
    return storage.nbytes()


class SharedHostAllocations(TorchFunctionMode):
    """While active, every CPU tensor a torch factory returns is moved into /dev/shm before it is handed out."""

    def __init__(self) -> None:
        super().__init__()
        self.moved_bytes = 0
        self.moved_tensors = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if (func in _FACTORIES and isinstance(result, torch.Tensor) and result.device.type == "cpu"
                and not kwargs.get("pin_memory") and result.numel() > 0):
            self.moved_bytes += share_in_place(result)
            self.moved_tensors += 1
        return result
