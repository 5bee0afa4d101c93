"""SGLang's host (CPU) KV pools born in shared memory, so a broker can open them.

A broker is another process: it opens host memory only by a /dev/shm name (memory.py). SGLang
allocates its CPU pools with plain `torch.zeros` on the heap, and right after caches their
addresses (`_init_data_ptrs_and_strides`, MLA's `data_ptrs`), so moving them later would leave
those caches pointing at freed memory. The plugin therefore acts while the pool is being built:

    build_pool_in_shared_memory   an AROUND hook on KVCacheConfigurator._build_token_to_kv_pool
                                  (every pool SGLang's configurator builds, drafts included): with
                                  `--disaggregation-transfer-backend kvbroker` in prefill or decode
                                  mode, it builds the pool under SharedHostAllocations
    SharedHostAllocations         a torch function mode: each CPU tensor a factory (zeros, empty,
                                  full, ...) returns is moved into its own /dev/shm segment at birth
                                  (torch's file_system sharing: `_share_filename_cpu_`, in place),
                                  before anything reads its address

Cost: one copy of each buffer at start-up (its zeros, into the segment), and the pool lives in
/dev/shm, which must be large enough to hold it (containers: 64 MiB by default). The segments are
torch's own (`torch_<pid>_...`): torch_shm_manager unlinks them when the process ends. GPU tensors
are left alone (brokers open them by CUDA IPC). Pools built elsewhere (`--enable-unified-memory`'s
single byte buffer) stay on the heap and are refused, by name, when the KV manager registers them.
"""

from __future__ import annotations

import logging

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

BACKEND = "kvbroker"
HOOK_TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool"

# Factories that make a tensor of fresh memory; never those that may wrap memory someone else owns
# (tensor, as_tensor, asarray, from_numpy), which a move would tear away from its owner.
_FACTORIES = frozenset({
    torch.empty, torch.empty_strided, torch.zeros, torch.ones, torch.full,
    torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like,
    torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_full,
})


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
            storage = result.untyped_storage()
            storage._share_filename_cpu_()  # in place: a new /dev/shm mapping, the bytes copied once
            self.moved_bytes += storage.nbytes()
            self.moved_tensors += 1
        return result


def serves_this_process() -> bool:
    """Whether this SGLang process runs PD disaggregation with kvbroker (its published server args say so)."""
    try:
        from sglang.srt.runtime_context import get_disagg

        disagg = get_disagg()
        return (disagg.disaggregation_transfer_backend == BACKEND
                and disagg.disaggregation_mode in ("prefill", "decode"))
    except (ImportError, ValueError, AttributeError):  # no server args published: not a PD server
        return False


def build_pool_in_shared_memory(original, *args, **kwargs):
    """The AROUND hook: SGLang's own pool construction, its CPU buffers born in /dev/shm."""
    if not serves_this_process():
        return original(*args, **kwargs)
    mode = SharedHostAllocations()
    with mode:
        pool = original(*args, **kwargs)
    if mode.moved_tensors:
        log.info("kvbroker: %s built in shared memory for the brokers: %d CPU tensors, %.1f MiB in /dev/shm",
                 type(pool).__name__, mode.moved_tensors, mode.moved_bytes / (1 << 20))
    return pool
