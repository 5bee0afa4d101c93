"""Run with vLLM's Python (.venv-vllm): the KV cache vLLM 0.32 builds for MiniMax-M3 (3 dense + 4
sparse layers, bfloat16, block size 128), allocated as its worker allocates it, inside
kvbroker_vllm's memory pool context (/dev/shm), mapped by kvbroker_vllm.layout and registered with
the broker at argv[1]. Prints one JSON line: the components as the broker took them.

vLLM 0.32's MiniMax-M3 has GPU kernels only, and its whole model cannot be built on a CPU (its MoE has
no CPU backend), so only what the KV cache needs is built: the config, and the attention layers on
the meta device, whose own get_kv_cache_spec gives the specs vLLM groups and sizes. Two stand-ins,
both test-only: the model module imports one torchvision enum (torchvision is left out of
locks/vllm.txt), and vLLM's registry inspects models in a subprocess that would not see that stand-in.
"""

from __future__ import annotations

import enum
import json
import os
import sys
import tempfile
import types

import torch

LAYERS, DENSE, BLOCK = 7, 3, 128


def stand_in_torchvision() -> None:
    import vllm.model_executor.models.registry as registry

    vision = types.ModuleType("torchvision")
    vision.transforms = types.ModuleType("torchvision.transforms")
    vision.transforms.InterpolationMode = enum.Enum("InterpolationMode", "NEAREST BILINEAR BICUBIC")
    sys.modules["torchvision"], sys.modules["torchvision.transforms"] = vision, vision.transforms
    registry._run_in_subprocess = lambda fn: fn()


def config_dir() -> str:
    from vllm.transformers_utils.configs.minimax_m3 import MiniMaxM3TextConfig

    base = MiniMaxM3TextConfig().to_dict()
    sparse = dict(base["sparse_attention_config"])
    sparse["sparse_attention_freq"] = [0] * DENSE + [1] * (LAYERS - DENSE)
    sparse["sparse_disable_index_value"] = [0] * DENSE + [1] * (LAYERS - DENSE)
    text = {**base, "num_hidden_layers": LAYERS, "sparse_attention_config": sparse, "torch_dtype": "bfloat16"}
    directory = tempfile.mkdtemp(prefix="minimax-m3-")
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3SparseForCausalLM"],
                   "text_config": text, "torch_dtype": "bfloat16"}, f)
    return directory


def kv_cache_config(vllm_config):
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.models.minimax_m3.nvidia import model as m3
    from vllm.utils.network_utils import get_open_port
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
    initialize_model_parallel(1, 1)
    text = vllm_config.model_config.hf_text_config
    sparse = m3._sparse_attention_layer_ids(text)
    with torch.device("meta"):
        for layer in range(text.num_hidden_layers):
            kind = m3.MiniMaxM3SparseAttention if layer in sparse else m3.MiniMaxM3Attention
            kind(config=text, layer_id=layer, prefix=f"model.layers.{layer}.self_attn",
                 cache_config=vllm_config.cache_config)
    layers = vllm_config.compilation_config.static_forward_context
    specs = {name: spec for name, layer in layers.items() if isinstance(layer, AttentionLayerBase)
             and (spec := layer.get_kv_cache_spec(vllm_config)) is not None}
    layout = resolve_kv_cache_layout(vllm_config, [["LBHNC"]], specs.values())
    (config,) = get_kv_cache_configs(vllm_config, [specs], [64 << 20])
    return config, layout


def main(broker: str) -> dict:
    stand_in_torchvision()
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.utils import allocate_kv_cache

    from kvbroker_client.adapter import AdapterSettings
    from kvbroker_vllm.worker import WorkerSide

    vllm_config = EngineArgs(model=config_dir(), skip_tokenizer_init=True, block_size=BLOCK, max_model_len=4096,
                             enforce_eager=True, dtype="bfloat16", load_format="dummy").create_engine_config()
    with set_current_vllm_config(vllm_config):
        config, layout = kv_cache_config(vllm_config)
        worker = WorkerSide(AdapterSettings(address=broker, engine_prefix="minimax-test"), role="consumer",
                            kv_cache_config=config, block_size=BLOCK, tp_size=1, pp_size=1, dp_rank=0,
                            host_cache=True)
        with worker.mem_pool_context():
            caches = allocate_kv_cache(config, torch.device("cpu"), layout)
        worker.register_kv_caches(caches)
        try:
            engines = worker.link.loop.run(worker.link.client.info(), timeout=30).engines
            (engine,) = [e for e in engines if e.engine_id == worker.link.engine_id]
            return {"num_blocks": config.num_blocks, "groups": len(config.kv_cache_groups),
                    "components": {c.component.name: {
                        "layout": c.layout.name, "num_pages": c.num_pages,
                        "layers": [b.layer_id for b in c.layer_buffers],
                        "item_lens": sorted({b.item_len for b in c.layer_buffers})} for c in engine.components},
                    "topology": {"page_size": engine.topology.page_size, "kv_dtype": engine.topology.kv_dtype.name,
                                 "layers": [engine.topology.start_layer, engine.topology.end_layer]}}
        finally:
            worker.close()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
    os._exit(0)  # NIXL's teardown crashes at interpreter exit (tests/support/brokers.py run_engines_in_child)
