"""SGLang ranks built the way SGLang 0.5.23 builds them, on CPU, for the tests of kvbroker_sglang.

    minimax_pool(...)        a real MiniMaxSparseKVPool (3 dense + 4 K-only sparse layers), built
                             through the plugin's pool hook (host_pools: its CPU buffers born in
                             /dev/shm, as in a kvbroker PD server), filled
    mha_pool(...), mla_pool(...)   SGLang's MHA and MLA pools, likewise (layout tests)
    rank_kv_args(pool, ...)  KVArgs as prefill.py/decode.py `_init_kv_manager` fill them, with real
                             MetadataBuffers for aux and SGLang's own setup_state_kv_args
    SGLangProcess(port)      the runtime context a scheduler process publishes (loopback, bootstrap port)
    page_bytes(pool, ...)    the bytes of given pages of every buffer of a component, for comparison
    Ranks(process)           SGLang's KV managers (and prefill's bootstrap server) built on brokers, as
                             SGLang's `_init_kv_manager` builds them; closed after the test
    broker_flags(backend)    the flags of the brokers they use (BROKER_FLAGS: NIXL's)

No SGLang class is imitated: every object here is SGLang's, placed in shared memory as the plugin places it.
The pools need SGLangProcess's context (a kvbroker PD server's server args), as the hook reads them.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvbroker_tools.serving.cpu_torchvision import declare_torchvision_ops

declare_torchvision_ops()

from sglang.srt.disaggregation.base.conn import KVArgs  # noqa: E402
from sglang.srt.disaggregation.utils import (  # noqa: E402
    MetadataBuffers,
    build_kv_layer_ids,
    get_kv_transfer_buf_infos,
    setup_state_kv_args,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MiniMaxSparseKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.runtime_context import get_context, get_parallel  # noqa: E402

from kvbroker_sglang.host_pools import build_pool_in_shared_memory  # noqa: E402

DENSE_LAYERS = [0, 1, 2]
SPARSE_LAYERS = [3, 4, 5, 6]
PAGE_SIZE = 4
POOL_TOKENS = 128  # 32 pages (SGLang adds one page of padding: 33 pages per buffer)
METADATA_SLOTS = 8
HIDDEN_SIZE = 16


def pool_buffers(pool) -> list[torch.Tensor]:
    if isinstance(pool, MLATokenToKVPool):
        return list(pool.kv_buffer)
    if isinstance(pool, MHATokenToKVPool):
        return [*pool.k_buffer, *pool.v_buffer]
    main = pool.main_pool
    return [*main.k_buffer, *main.v_buffer, *(pool.index_k_pool.k_buffer if pool.index_k_pool else ())]


def built(pool_class, *args, **kwargs):
    """SGLang's pool class built as the plugin's hook on SGLang's KV-cache configurator builds it."""
    return build_pool_in_shared_memory(pool_class, *args, **kwargs)


def _filled(pool, seed: int):
    rng = np.random.default_rng(seed)
    for buffer in pool_buffers(pool):
        raw = buffer.view(torch.uint8).numpy().reshape(-1)
        raw[:] = rng.integers(0, 256, raw.size, dtype=np.uint8)
    return pool


def mha_pool(seed: int, *, start_layer: int, end_layer: int) -> MHATokenToKVPool:
    """SGLang's MHA pool for layers [start_layer, end_layer) (a PP stage), bf16, 2 KV heads of 16."""
    return _filled(built(MHATokenToKVPool, POOL_TOKENS, PAGE_SIZE, torch.bfloat16, 2, 16, end_layer - start_layer,
                         "cpu", False, start_layer=start_layer, end_layer=end_layer), seed)


def mla_pool(seed: int, *, layers: int) -> MLATokenToKVPool:
    """SGLang's MLA pool: one latent (kv_lora_rank 32 + rope 8) per layer, bf16."""
    return _filled(built(MLATokenToKVPool, POOL_TOKENS, PAGE_SIZE, torch.bfloat16, 32, 8, layers, "cpu", False,
                         start_layer=0, end_layer=layers), seed)


def minimax_pool(seed: int, *, fill: str = "random", index_value: bool = False) -> MiniMaxSparseKVPool:
    """SGLang's MiniMax-M3 pool on CPU: bf16 KV, one KV head of 32, a 16-wide index; buffers in /dev/shm."""
    pool = built(MiniMaxSparseKVPool, size=POOL_TOKENS, page_size=PAGE_SIZE, dtype=torch.bfloat16, head_num=1,
                 head_dim=32, idx_head_dim=16, dense_layer_ids=DENSE_LAYERS, sparse_layer_ids=SPARSE_LAYERS,
                 disable_value_sparse_layer_ids=[] if index_value else SPARSE_LAYERS, device="cpu", start_layer=0,
                 end_layer=7)
    buffers = pool_buffers(pool)
    rng = np.random.default_rng(seed)
    for buffer in buffers:
        raw = buffer.view(torch.uint8).numpy().reshape(-1)
        raw[:] = rng.integers(0, 256, raw.size, dtype=np.uint8) if fill == "random" else 0xA5
    return pool


@dataclass
class Rank:
    pool: MiniMaxSparseKVPool | MHATokenToKVPool | MLATokenToKVPool
    kv_args: KVArgs
    metadata: MetadataBuffers


def rank_kv_args(pool, *, engine_rank: int = 0, num_hidden_layers: int = 7) -> Rank:
    """KVArgs filled as SGLang's bootstrap queues fill them (prefill.py ~258-345, decode.py the same)."""
    kv_args = KVArgs()
    kv_args.engine_rank = engine_rank
    kv_args.pp_rank = 0
    kv_args.system_dp_rank = 0
    kv_args.rust_http_port = None
    kv_args.kv_cache_dtype_str = "bfloat16"
    kv_args.kv_layout = None
    kv_args.prefill_start_layer = pool.start_layer
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = get_kv_transfer_buf_infos(pool)
    kv_args.prefill_end_layer = pool.end_layer
    kv_args.num_draft_entries = 0
    kv_args.kv_layer_ids = build_kv_layer_ids(token_to_kv_pool=pool, draft_token_to_kv_pool=None,
                                              num_draft_entries=0, num_hidden_layers=num_hidden_layers)
    kv_args.kv_head_num = getattr(pool, "head_num", 1)  # MLA pools have one latent, no heads
    kv_args.total_kv_head_num = kv_args.kv_head_num
    kv_args.page_size = pool.page_size
    metadata = MetadataBuffers(METADATA_SLOTS, HIDDEN_SIZE, torch.bfloat16, max_sampling_mask_tokens=0,
                               max_top_logprobs_num=4)
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = metadata.get_buf_infos()
    kv_args.ib_device = None
    kv_args.gpu_id = 0
    setup_state_kv_args(kv_args, pool, None, num_hidden_layers)
    return Rank(pool, kv_args, metadata)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SGLangProcess:
    """The runtime context an SGLang scheduler process publishes (TP1, one DP rank, loopback).

    SGLang keeps it process-global; the prefill and decode "ranks" of a test share one process, so
    they share it: the fields both read (host, bootstrap port, TP/DP ranks) are the same for both,
    and each manager is told its mode by its constructor, as SGLang's bootstrap queues tell it.
    """

    RANKS = dict(tp_rank=0, attn_tp_rank=0, attn_cp_rank=0, attn_dp_rank=0, attn_dcp_rank=0, dcp_rank=0, pp_rank=0,
                 dp_rank=0, moe_ep_rank=0, moe_tp_rank=0, moe_dp_rank=0, pp_group=None)  # PP1: no group is used

    def __init__(self, bootstrap_port: int) -> None:
        self.bootstrap_port = bootstrap_port
        self._override = get_context().override_server_args(
            disaggregation_mode="prefill", host="127.0.0.1", disaggregation_bootstrap_port=bootstrap_port,
            disaggregation_transfer_backend="kvbroker")

    def __enter__(self) -> SGLangProcess:
        self._host_ip = os.environ.get("SGLANG_HOST_IP")
        os.environ["SGLANG_HOST_IP"] = "127.0.0.1"  # the ranks' ZMQ sockets: loopback (netns has no other)
        self._override.install()
        get_parallel().override_permanently(**self.RANKS)
        return self

    def __exit__(self, *exc) -> None:
        get_parallel().clear_stamp()
        self._override.restore()
        if self._host_ip is None:
            os.environ.pop("SGLANG_HOST_IP", None)
        else:
            os.environ["SGLANG_HOST_IP"] = self._host_ip


def component_buffers(pool: MiniMaxSparseKVPool, component: str) -> list[torch.Tensor]:
    """The tensors behind a component, in KVArgs order (K of its layers, then V; or the index buffers)."""
    if component == "MAIN_KV":
        layers = SPARSE_LAYERS
    elif component == "MINIMAX_DENSE_KV":
        layers = DENSE_LAYERS
    else:
        return list(pool.index_k_pool.k_buffer)
    return [pool.get_key_buffer(x) for x in layers] + [pool.get_value_buffer(x) for x in layers]


def page_bytes(pool: MiniMaxSparseKVPool, component: str, pages: Sequence[int]) -> list[np.ndarray]:
    """Per buffer of the component: the bytes of `pages`, in order, as uint8 rows of one page."""
    out = []
    for buffer in component_buffers(pool, component):
        raw = buffer.view(torch.uint8).numpy().reshape(buffer.shape[0] // PAGE_SIZE, -1)
        out.append(raw[np.asarray(pages, dtype=np.int64)].copy())
    return out


def whole(pool: MiniMaxSparseKVPool, component: str) -> list[np.ndarray]:
    return [b.view(torch.uint8).numpy().reshape(-1).copy() for b in component_buffers(pool, component)]


def broker_flags(backend: str = "nixl") -> tuple[str, ...]:
    return ("--backend", backend, "--log-level", "WARNING")


BROKER_FLAGS = broker_flags()


class Ranks:
    """Builds SGLang KV managers (and the prefill's bootstrap server) on brokers; closes them after the test."""

    def __init__(self, process: SGLangProcess) -> None:
        self.process = process
        self._closers: list = []

    def bootstrap_server(self):
        from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

        server_class = get_kv_class(TransferBackend.KVBROKER, KVClassType.BOOTSTRAP_SERVER)
        server = server_class(host="127.0.0.1", port=self.process.bootstrap_port)
        self._closers.append(server.close)
        return server

    def manager(self, broker_listen: str, mode: str, rank: Rank, *, is_mla: bool = False, **env: str):
        """SGLang's `_init_kv_manager` last step: the backend's manager class on these KVArgs."""
        from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

        manager_class = get_kv_class(TransferBackend.KVBROKER, KVClassType.MANAGER)
        saved = {k: os.environ.get(k) for k in ("KVBROKER_ADDRESS", *env)}
        os.environ.update({"KVBROKER_ADDRESS": broker_listen, **env})
        try:
            manager = manager_class(rank.kv_args, DisaggregationMode(mode), None, is_mla)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        self._closers.append(manager.close)
        return manager

    def close(self) -> None:
        for close in reversed(self._closers):
            close()
