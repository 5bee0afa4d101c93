"""SGLang's host (CPU) KV pools born in shared memory, so a broker can open them.

SGLang allocates its CPU pools with plain `torch.zeros` on the heap, and right after caches their
addresses (`_init_data_ptrs_and_strides`, MLA's `data_ptrs`), so moving them later would leave those
caches pointing at freed memory. The plugin therefore builds them under the adapter core's
SharedHostAllocations (kvbroker_client.adapter.hostmem), with an AROUND hook on
KVCacheConfigurator._build_token_to_kv_pool (every pool SGLang's configurator builds, drafts
included) when `--disaggregation-transfer-backend kvbroker` runs in prefill or decode mode.

Pools built elsewhere (`--enable-unified-memory`'s single byte buffer) stay on the heap and are
refused, by name, when the KV manager registers them (HOST_HINT).
"""

from __future__ import annotations

import logging

from kvbroker_client.adapter.hostmem import SharedHostAllocations

log = logging.getLogger(__name__)

BACKEND = "kvbroker"
HOOK_TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool"
HOST_HINT = ("kvbroker's SGLang plugin builds the host KV pools of SGLang's KV-cache configurator in shared "
             "memory (kvbroker_sglang.host_pools); this buffer was allocated elsewhere (e.g. "
             "--enable-unified-memory's single buffer, or a pool built outside SGLang's configurator): build it "
             "under kvbroker_client.adapter.hostmem.SharedHostAllocations, move it with "
             "hostmem.share_in_place before its address is cached, or keep the KV cache on the GPU")


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
