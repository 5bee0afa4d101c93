"""The aux codec on SGLang's own MetadataBuffers: a prefill row out, a decode row in, byte for byte."""

from __future__ import annotations

import pytest
import torch

from kvbroker_client.adapter.aux import AuxError, decode_aux, encode_aux, write_aux
from tests.support import sglang_ranks as ranks  # noqa: F401 - declares torchvision's ops before sglang is imported


def _buffers():
    from sglang.srt.disaggregation.utils import MetadataBuffers

    return MetadataBuffers(8, 16, torch.bfloat16, max_sampling_mask_tokens=0, max_top_logprobs_num=4)


def _fill_row(buffers, index: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for tensor in (buffers.output_ids, buffers.cached_tokens, buffers.output_token_logprobs_idx):
        tensor[index] = torch.randint(0, 1 << 30, tensor[index].shape, generator=generator, dtype=tensor.dtype)
    buffers.output_hidden_states[index] = torch.randn(16, generator=generator).to(torch.bfloat16)
    buffers.bootstrap_room[index, 0] = 0x1234_5678_9ABC


def test_a_prefill_row_lands_in_the_decode_row_it_names():
    prefill, decode = _buffers(), _buffers()
    _fill_row(prefill, 5, seed=1)
    ptrs, _, item_lens = prefill.get_buf_infos()
    payload = encode_aux(ptrs, item_lens, 5)
    assert len(payload) < 64 << 10  # the broker's default aux bound
    before = decode.get_buf(3)
    dst_ptrs, _, dst_item_lens = decode.get_buf_infos()
    assert write_aux(decode_aux(payload), dst_ptrs, dst_item_lens, 2) == len(ptrs)
    for got, want in zip(decode.get_buf(2), prefill.get_buf(5)):
        if want is not None:
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    for got, want in zip(decode.get_buf(3), before):  # the neighbouring row is untouched
        if want is not None:
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert int(decode.bootstrap_room[2, 0]) == 0x1234_5678_9ABC


def test_rows_of_another_shape_are_refused_before_any_is_written():
    prefill, decode = _buffers(), _buffers()
    _fill_row(prefill, 0, seed=2)
    ptrs, _, item_lens = prefill.get_buf_infos()
    rows = decode_aux(encode_aux(ptrs, item_lens, 0))
    rows[-1] = rows[-1] + b"\0"
    dst_ptrs, _, dst_item_lens = decode.get_buf_infos()
    with pytest.raises(AuxError, match=f"row {len(rows) - 1} is"):
        write_aux(rows, dst_ptrs, dst_item_lens, 0)
    assert int(decode.output_ids[0].abs().sum()) == 0


@pytest.mark.parametrize("payload, match", [(b"", "shorter than its header"), (b"XXXX\x01\x00\x00", "not"),
                                            (b"KVBA\x01\x02\x00\x04\x00\x00\x00", "row lengths short"),
                                            (b"KVBA\x01\x01\x00\x04\x00\x00\x00abc", "header says 4")])
def test_a_malformed_payload_is_refused(payload, match):
    with pytest.raises(AuxError, match=match):
        decode_aux(payload)
