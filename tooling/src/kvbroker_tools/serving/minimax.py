"""A MiniMax-M3-shaped model that SGLang 0.5.23 serves on a CPU, and the stand-ins it needs there.

- `build_minimax_model(path, tokenizer_dir=None)`: writes a model directory (config.json naming a
  local configuration module, that module, a tokenizer) for `--trust-remote-code --load-format dummy`:
  3 dense layers then 4 sparse layers whose index branch is K-only, a small MoE, small sizes.
  `minimax()`: that directory built once into the serving tools' cache, as `models.llama()` is.
- `install()`: makes SGLang serve it on a CPU. `MiniMaxSparseAttnBackend` has only Triton kernels
  for its sparse attention; ours are in torch (`sparse_attention`, `select_blocks`). And the dummy
  loader's weights are redrawn (`randomize_weights`) at a scale under which tokens depend on the KV.
  It must run in every SGLang process that builds a model (the scheduler's), so the serving site
  dir's sitecustomize calls it when KVBROKER_SERVING_MINIMAX=1. A server of the model also needs
  SERVER_ARGS on its command line; SERVER_ENV is its environment, which install() sets.
- `index_k_corruption()`: the test switch KVBROKER_MINIMAX_CORRUPT_INDEX_K (a file naming a mode)
  that perturbs the index K as the stand-in reads it from the pool, to show that the tokens depend
  on it.

Why a stand-in that selects blocks, rather than one that attends densely: a dense stand-in never
reads the index K, so a server would answer the same with the index-K pages never moved. Ours scores
every block of the context by q_idx . k_idx read from the pool's index-K buffer, keeps the init and
local blocks plus the best-scoring others, and attends over those blocks only: a wrong index K picks
other blocks, and the tokens change (tests/servers/test_minimax_standin.py shows both).

The stand-in stores K, V and the index K through `kv_pool.set_fused_kv_index_buffer`, as SGLang's
backend does, and reads them back through the pool's getters: the pages a PD transfer moves are the
ones it reads. It is deterministic: float32 arithmetic, ties in block scores broken by block number.
It is test tooling, not a kernel: no batching across requests, O(context) work per query.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from pathlib import Path

import torch

DENSE_LAYERS = 3
SPARSE_LAYERS = 4
LAYERS = DENSE_LAYERS + SPARSE_LAYERS

# Sparse attention: blocks of BLOCK tokens; each query attends over TOPK blocks: the first INIT,
# its own and the LOCAL - 1 before it, and the best-scoring others. From a context of
# TOPK * BLOCK + 1 tokens (9) on, blocks are left out, and the index K decides which.
BLOCK = 2
TOPK = 4
INIT = 1
LOCAL = 1


# What a server of this model needs in its environment besides the serving stack's own:
# MiniMaxM3MoE's router GEMM asks torch.mm for float32 output from bfloat16 inputs, which has no
# CPU kernel; with this off the gate's weight is float32 and a plain matmul runs.
# TORCH_COMPILE_DISABLE: the experts' activation (swiglu_alpha / swiglu_limit, as MiniMax-M3's) is a
# torch.compile'd function (moe_runner/triton_utils/fused_moe.py, swiglu_gpt_oss_sigmoid_alpha); on CPU
# each new shape costs an inductor C++ build, tens of seconds on 2 busy cores, inside a request: a
# server's first /health_generate (one token) was seen to wait 70-180 s for it, longer than SGLang's
# 20 s health timeout again and again, and three such servers starting together past any start-up
# bound. Eager, the same arithmetic runs at once in every server.
SERVER_ENV = {
    "SGLANG_OPT_USE_BF16_ROUTER_GEMM": "0",
    "TORCH_COMPILE_DISABLE": "1",
}

# Server flags the model needs besides the CPU ones (--device cpu --dtype float32 ...; in float16, as
# SGLang 0.5.23's "auto" runs a float32 config on CPU, a server of this model never answered its first
# /health_generate).
SERVER_ARGS = ("--trust-remote-code", "--load-format", "dummy")

CORRUPT_ENV = "KVBROKER_MINIMAX_CORRUPT_INDEX_K"

_CONFIG_MODULE = '''"""Configuration of a MiniMax-M3-shaped test model (written by kvbroker_tools.serving.minimax)."""

from transformers import PretrainedConfig


class MiniMaxM3TestConfig(PretrainedConfig):
    model_type = "minimax_m3"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
'''


def model_config(vocab_size: int) -> dict:
    """The config.json of the model: small sizes, MiniMax-M3's structure.

    float32 for the reason kvbroker_tools.serving.models gives for its Llama: the PD checks compare
    greedy tokens with a non-PD server's, and bfloat16 turns random weights' near-ties into flips.
    """
    sparse = [0] * DENSE_LAYERS + [1] * SPARSE_LAYERS
    return {
        "architectures": ["MiniMaxM3SparseForCausalLM"],
        "model_type": "minimax_m3",
        "auto_map": {"AutoConfig": "configuration_minimax_m3.MiniMaxM3TestConfig"},
        "torch_dtype": "float32",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rotary_dim": 16,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "use_qk_norm": True,
        "qk_norm_type": "per_head",
        "use_gemma_norm": False,
        "tie_word_embeddings": False,
        # MoE on every layer but the first: 4 experts, 2 per token, a sigmoid router with a bias, one
        # shared expert.
        "moe_layer_freq": [0] + [1] * (LAYERS - 1),
        "dense_intermediate_size": 128,
        "intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "routed_scaling_factor": 1.0,
        "n_shared_experts": 1,
        "sparse_attention_config": {
            "sparse_attention_freq": sparse,
            "sparse_disable_index_value": sparse,
            "sparse_num_index_heads": 2,
            "sparse_index_dim": 16,
            "sparse_block_size": BLOCK,
            "sparse_topk_blocks": TOPK,
            "sparse_init_block": INIT,
            "sparse_local_block": LOCAL,
            "sparse_score_type": "max",
        },
    }


def build_minimax_model(path: str | os.PathLike, tokenizer_dir: str | os.PathLike | None = None) -> Path:
    """Writes the model directory at `path` and returns it.

    `tokenizer_dir`: a directory holding a tokenizer (tokenizer.json and its companions) to copy in;
    without one, the serving tools' byte-level BPE tokenizer is trained into `path`
    (kvbroker_tools.serving.models.build_tokenizer). Weights: none; serve with SERVER_ARGS
    (`--load-format dummy`), and install() redraws them.
    """
    from transformers import AutoTokenizer

    from kvbroker_tools.serving import models

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        tokenizer.save_pretrained(str(path))
    else:
        tokenizer = models.build_tokenizer(path)
    config = model_config(max(len(tokenizer), models.VOCAB_SIZE))
    config.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "configuration_minimax_m3.py").write_text(_CONFIG_MODULE)
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}))
    return path


def minimax() -> Path:
    """The model's directory in the serving tools' cache (as kvbroker_tools.serving.models.llama()),
    built on first use under a name that hashes the recipe."""
    from kvbroker_tools.serving import models

    recipe = {"config": model_config(models.VOCAB_SIZE), "module": _CONFIG_MODULE, "corpus": models.CORPUS_PACKAGES,
              "v": models.RECIPE_VERSION}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    return models._built(f"minimax-{digest}", build_minimax_model)


def index_k_corruption() -> str | None:
    """The test switch: the contents of the file that CORRUPT_ENV names, read at every use.

    No variable, no file, or an empty file: none. "zero": the stand-in reads the index K as zeros;
    "negate": as its negative. A file rather than a value so that a test can turn it on and off in a
    running server (the scheduler process reads it), and on one server of a PD pair only.
    """
    path = os.environ.get(CORRUPT_ENV)
    if not path:
        return None
    try:
        mode = Path(path).read_text().strip() or None
    except FileNotFoundError:
        return None
    if mode not in (None, "zero", "negate"):
        raise ValueError(f"{path} (named by {CORRUPT_ENV}) must hold 'zero' or 'negate', not {mode!r}")
    return mode


def select_blocks(idx_q: torch.Tensor, idx_k: torch.Tensor, pos: int, kv_heads: int, block: int,
                  topk: int, init: int, local: int, scale: float) -> torch.Tensor:
    """The blocks one query at position `pos` attends over, per KV head: a bool [kv_heads, blocks].

    idx_q: [index_heads, dim] the query's index Q; idx_k: [pos + 1, dim] the context's index K.
    A block's score is the largest q_idx . k_idx over its tokens (score type "max"); index heads are
    grouped onto KV heads (index_heads // kv_heads each) and a group scores a block by its best head.
    """
    nblocks = pos // block + 1
    chosen = torch.zeros(kv_heads, nblocks, dtype=torch.bool)
    if nblocks <= topk:
        chosen[:] = True
        return chosen
    scores = (idx_q @ idx_k.T) * scale  # [index_heads, pos + 1]
    pad = nblocks * block - scores.shape[1]
    scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    per_block = scores.view(scores.shape[0], nblocks, block).amax(dim=2)  # [index_heads, nblocks]
    group = max(per_block.shape[0] // kv_heads, 1)
    per_block = per_block[: group * kv_heads].view(kv_heads, group, nblocks).amax(dim=1)
    forced = torch.zeros(nblocks, dtype=torch.bool)
    forced[:init] = True
    forced[nblocks - local:] = True
    free = topk - int(forced.sum())
    chosen[:, forced] = True
    per_block[:, forced] = float("-inf")
    # A stable sort breaks ties by block number, so equal scores choose the same blocks every run.
    order = torch.sort(per_block, dim=1, descending=True, stable=True).indices[:, :free]
    chosen.scatter_(1, order, True)
    return chosen


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx_q: torch.Tensor,
                     idx_k: torch.Tensor, positions: list[int], scale: float, idx_scale: float,
                     block: int, topk: int, init: int, local: int) -> torch.Tensor:
    """Causal attention of one request's queries over the blocks `select_blocks` picks for each.

    q: [n, heads, dim]; k, v: [context, kv_heads, dim]; idx_q: [n, index_heads, idx_dim];
    idx_k: [context, idx_dim]; positions: each query's position in the context. Returns [n, heads, dim].
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    rep = heads // kv_heads
    out = torch.empty(q.shape[0], heads, v.shape[2], dtype=torch.float32)
    for i, pos in enumerate(positions):
        chosen = select_blocks(idx_q[i], idx_k[: pos + 1], pos, kv_heads, block, topk, init, local, idx_scale)
        mask = chosen.repeat_interleave(block, dim=1)[:, : pos + 1]  # [kv_heads, pos + 1]
        logits = torch.einsum("hd,thd->ht", q[i], k[: pos + 1].repeat_interleave(rep, dim=1)) * scale
        logits = logits.masked_fill(~mask.repeat_interleave(rep, dim=0), float("-inf"))
        out[i] = torch.einsum("ht,thd->hd", logits.softmax(dim=1), v[: pos + 1].repeat_interleave(rep, dim=1))
    return out


def _read_context(backend, layer, req_pool_index: int, length: int):
    """One request's first `length` tokens of K, V and index K, read from the pool, as float32."""
    slots = backend.req_to_token[req_pool_index, :length].long()
    k_cache, v_cache = backend.kv_pool.get_kv_buffer(layer.layer_id)
    idx_k_cache = backend.kv_pool.get_index_k_buffer(layer.layer_id)
    k = k_cache[slots].float()
    v = v_cache[slots].float()
    idx_k = idx_k_cache[slots].float().reshape(length, -1)
    mode = index_k_corruption()
    if mode == "zero":
        idx_k = torch.zeros_like(idx_k)
    elif mode == "negate":
        idx_k = -idx_k
    return k, v, idx_k


def _store(backend, layer, forward_batch, k, v, idx_k, idx_v) -> None:
    """Stores this step's K, V and index K as SGLang's backend does (forward_extend / forward_decode)."""
    if backend._is_sparse_kv_cached_by_fusion(forward_batch, layer.layer_id):
        return
    backend.kv_pool.set_fused_kv_index_buffer(
        layer, forward_batch.out_cache_loc, k, v, idx_k, idx_v,
        layer.k_scale_float, layer.v_scale_float, layer.idx_k_scale_float, layer.idx_v_scale_float,
    )


def _check_layer(backend, layer) -> None:
    if layer.layer_id not in backend.disable_value_layer_ids:
        raise NotImplementedError(
            f"the CPU stand-in for MiniMax sparse attention serves K-only index layers only; layer "
            f"{layer.layer_id} has an index V (sparse_disable_index_value is 0 for it)")


def _attend(backend, layer, q, idx_q, requests) -> torch.Tensor:
    """requests: (req_pool_index, context length, query positions) per request, rows of q in order."""
    sm_scale = layer.scaling
    idx_scale = backend.idx_head_dim ** -0.5
    outs = []
    row = 0
    for req_pool_index, length, positions in requests:
        n = len(positions)
        k, v, idx_k = _read_context(backend, layer, req_pool_index, length)
        outs.append(sparse_attention(
            q[row: row + n].float(), k, v, idx_q[row: row + n].float(), idx_k, positions,
            sm_scale, idx_scale, backend.block_size_k, backend.topk_blocks, backend.init_blocks,
            backend.local_blocks))
        row += n
    out = torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], layer.v_head_dim).float()
    return out.to(q.dtype)


def _forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, *, idx_q, idx_k, idx_v):
    _check_layer(self, layer)
    _store(self, layer, forward_batch, k, v, idx_k, None)
    seq_lens = forward_batch.seq_lens_cpu.tolist()
    extend_lens = list(forward_batch.extend_seq_lens_cpu)
    pool_indices = forward_batch.req_pool_indices.tolist()
    requests = []
    for index, seq_len, n in zip(pool_indices, seq_lens, extend_lens):
        requests.append((index, seq_len, list(range(seq_len - n, seq_len))))
    rows = sum(extend_lens)
    q = q.view(q.shape[0], layer.tp_q_head_num, layer.qk_head_dim)
    out = _attend(self, layer, q[:rows], idx_q[:rows], requests)
    if rows < q.shape[0]:  # padded rows (DP attention) answer zeros, as SGLang's backend does
        out = torch.cat([out, out.new_zeros(q.shape[0] - rows, *out.shape[1:])])
    return None, out.reshape(q.shape[0], -1).contiguous()


def _forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, *, idx_q, idx_k, idx_v,
                    **kwargs):
    _check_layer(self, layer)
    _store(self, layer, forward_batch, k, v, idx_k, None)
    seq_lens = forward_batch.seq_lens_cpu.tolist()
    pool_indices = forward_batch.req_pool_indices.tolist()
    requests = [(index, seq_len, [seq_len - 1]) for index, seq_len in zip(pool_indices, seq_lens)]
    q = q.view(q.shape[0], layer.tp_q_head_num, layer.qk_head_dim)
    out = _attend(self, layer, q, idx_q, requests)
    return None, out.reshape(q.shape[0], -1).contiguous()


ARCHITECTURE = "MiniMaxM3SparseForCausalLM"


def randomize_weights(model: torch.nn.Module) -> None:
    """Gives the model's weights values under which its tokens depend on its attention.

    `--load-format dummy` draws every weight from U(-1e-3, 1e-3), norms included: the residual stream
    then hardly changes from layer to layer, the next token follows from the last token alone, and no
    corruption of the KV (or the index K) would show in the tokens. Here: norm weights 1, matrices
    N(0, 1/fan_in), the router bias 0, each drawn from a generator seeded by the parameter's name, so
    that the prefill, decode and reference servers hold the same model.
    """
    for name, param in model.state_dict().items():
        if not torch.is_floating_point(param):
            continue
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("e_score_correction_bias"):
            param.zero_()
        elif name.endswith(".weight") and param.dim() >= 2:
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.copy_(values * param.shape[-1] ** -0.5)


def _patch_backend(module) -> None:
    backend = module.MiniMaxSparseAttnBackend
    backend.forward_extend = _forward_extend
    backend.forward_decode = _forward_decode


def _patch_loader(module) -> None:
    dummy_init = module.initialize_dummy_weights
    if getattr(dummy_init, "_kvbroker_minimax", False):
        return

    def initialize_dummy_weights(model, *args, **kwargs):
        dummy_init(model, *args, **kwargs)
        if type(model).__name__ == ARCHITECTURE:
            randomize_weights(model)

    initialize_dummy_weights._kvbroker_minimax = True
    module.initialize_dummy_weights = initialize_dummy_weights


# What install() changes, by module: each patched when it is first imported, or at once if it is.
_PATCHES = {
    "sglang.srt.layers.attention.minimax_sparse_backend": _patch_backend,
    "sglang.srt.model_loader.loader": _patch_loader,
}


def install() -> None:
    """Makes SGLang serve this model on a CPU: MiniMaxSparseAttnBackend's forward_extend and
    forward_decode become the stand-in's, and the dummy loader's weights `randomize_weights`'s.

    Lazy (kvbroker_tools.serving.patches.after_import): a module not imported yet is patched when
    it is, so SGLang's import order stays its own; the patches are idempotent. Sets SERVER_ENV's
    variables where the environment does not already set them (so a sitecustomize that calls this
    sets them before SGLang reads them).
    """
    for name, value in SERVER_ENV.items():
        os.environ.setdefault(name, value)
    from kvbroker_tools.serving.patches import after_import

    for name, patch in _PATCHES.items():
        after_import(name, patch)
