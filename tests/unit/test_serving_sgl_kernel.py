"""The sgl_kernel stand-in the tooling's SGLang servers run with (tooling/src/kvbroker_tools/serving/site): each
function against a plain loop of what SGLang's Triton kernel does."""

from __future__ import annotations

import importlib.util

import torch

from kvbroker_tools.serving.stack import SITE


def _stand_in():
    spec = importlib.util.spec_from_file_location("sgl_kernel_stand_in", SITE / "sgl_kernel" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_assign_req_to_token_pool_fills_each_rows_range_from_the_slots_in_order():
    req_to_token = torch.full((4, 16), -1, dtype=torch.int32)
    rows, starts, ends = torch.tensor([2, 0, 3]), torch.tensor([3, 0, 5]), torch.tensor([7, 2, 5])
    slots = torch.arange(100, 106, dtype=torch.int64)
    _stand_in().assign_req_to_token_pool_cpu(rows, req_to_token, starts, ends, slots, 16)
    expected = torch.full((4, 16), -1, dtype=torch.int32)
    taken = 0
    for row, start, end in zip(rows.tolist(), starts.tolist(), ends.tolist()):
        for column in range(start, end):
            expected[row, column] = slots[taken]
            taken += 1
    assert torch.equal(req_to_token, expected)


def test_copy_all_layer_kv_cache_moves_rows_in_every_buffer_reading_all_before_writing():
    buffers = [torch.arange(8 * 12, dtype=torch.uint8).view(8, 12).clone() for _ in range(3)]
    before = [b.clone() for b in buffers]
    pointers = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    strides = torch.tensor([12, 12, 12], dtype=torch.int64)
    src, tgt = torch.tensor([1, 2, 5]), torch.tensor([2, 6, 1])  # row 2 is read and written: overlap
    _stand_in().copy_all_layer_kv_cache_cpu(pointers, strides, tgt, src)
    for b, old in zip(buffers, before):
        expected = old.clone()
        for s, t in zip(src.tolist(), tgt.tolist()):
            expected[t] = old[s]
        assert torch.equal(b, expected)
