"""A stand-in for `sgl_kernel` on CPU machines, for the tooling's SGLang servers only.

PyPI's `sgl_kernel` / `sglang-kernel` are CUDA builds. With `SGLANG_USE_CPU_ENGINE=1` SGLang 0.5.23
imports functions from it at module level: the two a dense model's serving calls
(`sglang/kernels/ops/kvcache/cache_move.py`, `sglang/srt/mem_cache/allocation.py`) are here in
torch; those of speculative decoding (`sglang/kernels/ops/speculative/`) raise NotImplementedError if
called. The module registers no `torch.ops.sgl_kernel` operator, so SGLang's `cpu_has_amx_support()`
is false and it takes its torch-native paths everywhere else. kvbroker_tools.serving puts this directory on the servers'
PYTHONPATH; nothing of kvbroker's imports it.
"""

from __future__ import annotations

import ctypes

import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Row `req_pool_indices[i]` of `req_to_token`, columns `start_offset[i]:end_offset[i]`, takes the
    next `end - start` entries of `out_cache_loc` (the requests' slots, back to back)."""
    del pool_len  # the row length; torch indexing knows it
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        count = end - start
        if count > 0:
            req_to_token[row, start:end] = out_cache_loc[taken:taken + count].to(req_to_token.dtype)
        taken += count


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """In every buffer (`data_ptrs[b]`, rows of `strides[b]` bytes) copy row `src_loc[i]` onto row
    `tgt_loc[i]`; all rows are read before any is written, so overlapping moves are safe."""
    sources, targets = src_loc.tolist(), tgt_loc.tolist()
    if not sources:
        return
    rows = max(max(sources), max(targets)) + 1
    for pointer, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(pointer)
        buffer = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        buffer[targets] = buffer[sources].clone()


def _speculative_only(name: str):
    """A function that says it has no stand-in."""

    def refuse(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: speculative decoding has no CPU stand-in here")

    refuse.__name__ = name
    return refuse


# Imported at module level on CPU by sglang/kernels/ops/speculative/*.py; called only by speculative
# decoding, which the tooling's servers never turn on.
for _name in ("build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu", "assign_draft_cache_locs_contiguous_cpu",
              "assign_extend_cache_locs_cpu", "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu",
              "rotate_input_ids_cpu"):
    globals()[_name] = _speculative_only(_name)
del _name
