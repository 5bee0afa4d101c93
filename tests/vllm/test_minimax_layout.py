"""MiniMax-M3's KV cache as vLLM 0.32 builds it (tests/vllm/minimax_kv_cache.py, in vLLM's own
environment): the index K caches, their own spec in the one block table, register as MINIMAX_INDEX_K
beside MAIN_KV, with the pages and sizes vLLM gave them. vLLM 0.32's MiniMax-M3 has GPU kernels only,
so no server of it runs here: this pins the mapping on vLLM's own KV cache config."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbroker_tools.launch import start_broker
from tests.support.vllm_servers import run_in_vllm

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).with_name("minimax_kv_cache.py")


async def test_minimax_m3_index_k_registers_as_its_own_component_on_the_main_kvs_block_ids():
    broker = await start_broker("vllm-minimax-layout", "--backend", "nixl")
    try:
        got = await run_in_vllm(SCRIPT, broker.listen, timeout=600, env={"PYTHONPATH": str(SCRIPT.parents[2])})
    finally:
        await broker.stop()
    blocks = got["num_blocks"]
    assert got["groups"] == 1, "MiniMax-M3's main and index caches share one block table in vLLM 0.32"
    assert got["components"] == {
        "MAIN_KV": {"layout": "FLAT", "num_pages": blocks, "layers": list(range(7)),
                    "item_lens": [128 * 4 * 2 * 128 * 2]},  # block 128 x 4 KV heads x (K + V) x 128 dims x bf16
        "MINIMAX_INDEX_K": {"layout": "FLAT", "num_pages": blocks, "layers": [3, 4, 5, 6],
                            "item_lens": [128 * 128 * 2]},  # K only: one 128-dim vector per token
    }
    assert got["topology"] == {"page_size": 128, "kv_dtype": "BFLOAT16", "layers": [0, 7]}
    assert blocks > 0
