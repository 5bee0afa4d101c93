"""Each topology rule on its own: it refuses what it must, names itself, and lets the rest through."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbroker.core import topology
from kvbroker.core.errors import Code
from kvbroker.core.model import (
    BufferLayout,
    BufferRole,
    Component,
    ComponentLayout,
    EngineLayout,
    KvDtype,
    Layout,
    Topology,
)
from tests.support.helpers import refusal

BASE = Topology(tp_size=1, tp_rank=0, attn_tp_size=1, attn_tp_rank=0, pp_size=1, pp_rank=0, dp_rank=0,
                page_size=16, start_layer=0, end_layer=4, kv_dtype=KvDtype.BFLOAT16)
INDEX = Component.MINIMAX_INDEX_K
MAIN = Component.MAIN_KV


def engine(topo=BASE, item_len=64, layers=(2, 3), layout=Layout.FLAT, kinds=(INDEX,)):
    comps = {}
    for kind in kinds:
        roles = (BufferRole.FLAT,) if layout is Layout.FLAT else (BufferRole.K, BufferRole.V)
        bufs = tuple(BufferLayout(layer, role, 4096 * layer, 4096, item_len) for layer in layers for role in roles)
        comps[kind] = ComponentLayout(kind, layout, 64, bufs)
    return EngineLayout("e", topo, comps)



def test_index_with_value_is_unimplemented():
    error = refusal(topology.reject_index_with_value, Component.MINIMAX_INDEX_KV)
    assert error.code is Code.UNIMPLEMENTED and "rule index-with-value" in error.reason
    topology.reject_index_with_value(INDEX)


@pytest.mark.parametrize("side", ["src", "dst"])
def test_index_k_refuses_pp_above_one_on_either_side(side):
    pp = dataclasses.replace(BASE, pp_size=2)
    args = (INDEX, pp, BASE) if side == "src" else (INDEX, BASE, pp)
    error = refusal(topology.check_no_pipeline_parallel, *args)
    assert error.code is Code.FAILED_PRECONDITION
    assert "PP>1 not supported for MiniMax sparse index" in error.reason and "rule index-k-pp" in error.reason


def test_pp_rule_leaves_main_kv_alone():
    topology.check_no_pipeline_parallel(MAIN, dataclasses.replace(BASE, pp_size=2), BASE)


def test_index_k_refuses_heterogeneous_attention_tp():
    error = refusal(topology.check_homogeneous_attention_tp, INDEX, BASE, dataclasses.replace(BASE, attn_tp_size=4))
    assert error.code is Code.FAILED_PRECONDITION and "heterogeneous TP" in error.reason
    topology.check_homogeneous_attention_tp(MAIN, BASE, dataclasses.replace(BASE, attn_tp_size=4))


@pytest.mark.parametrize("change, words", [
    (dict(page_size=32), "page_size differs"), (dict(kv_dtype=KvDtype.FLOAT8_E4M3), "kv_dtype differs")])
def test_cache_shape_must_match(change, words):
    error = refusal(topology.check_same_cache_shape, BASE, dataclasses.replace(BASE, **change))
    assert error.code is Code.FAILED_PRECONDITION and words in error.reason and "rule same-shape" in error.reason


def test_layout_must_match():
    error = refusal(topology.check_same_component_layout, engine(kinds=(MAIN,)).components[MAIN],
                    engine(kinds=(MAIN,), layout=Layout.KV_SPLIT).components[MAIN])
    assert "layout differs" in error.reason


def test_layer_ids_must_match():
    error = refusal(topology.check_same_component_layout, engine().components[INDEX],
                    engine(layers=(2,)).components[INDEX])
    assert "layer ids differ" in error.reason and "[2, 3]" in error.reason


def test_item_len_must_match():
    error = refusal(topology.check_same_component_layout, engine().components[INDEX],
                    engine(item_len=128).components[INDEX])
    assert "layer 2 FLAT item_len differs (sender 64, receiver 128)" in error.reason


def test_check_transfer_names_a_missing_component():
    error = refusal(topology.check_transfer, engine(kinds=(INDEX, MAIN)), engine(), [MAIN])
    assert "MAIN_KV is not registered by receiver" in error.reason


def test_check_transfer_accepts_matching_engines():
    topology.check_transfer(engine(kinds=(INDEX, MAIN)), engine(kinds=(INDEX, MAIN)), [INDEX, MAIN])


@pytest.mark.parametrize("n_src, n_dst", [(5, 3), (3, 5), (4, 4), (0, 2)])
def test_truncation_cuts_to_the_shorter(n_src, n_dst):
    src, dst = topology.truncate_page_lists(np.arange(n_src), np.arange(10, 10 + n_dst))
    assert len(src) == len(dst) == min(n_src, n_dst)
    assert src.tolist() == list(range(min(n_src, n_dst)))


DENSE = Component.MINIMAX_DENSE_KV


def test_dense_kv_refuses_pp_above_one_and_heterogeneous_attention_tp():
    error = refusal(topology.check_no_pipeline_parallel, DENSE, BASE, dataclasses.replace(BASE, pp_size=2))
    assert "rule dense-kv-pp" in error.reason and "MiniMax dense KV" in error.reason
    error = refusal(topology.check_homogeneous_attention_tp, DENSE, BASE, dataclasses.replace(BASE, attn_tp_size=2))
    assert "rule dense-kv-attn-tp" in error.reason and error.code is Code.FAILED_PRECONDITION


def test_dense_kv_part_needs_equal_lengths():
    granted = np.arange(10, 16)
    error = refusal(topology.part_pages, DENSE, np.arange(5), granted, 0, last=True)
    assert error.code is Code.FAILED_PRECONDITION and "rule dense-kv-length" in error.reason
    assert "sender 5 from dst_offset 0, receiver 6" in error.reason
    whole = topology.part_pages(DENSE, np.arange(6), granted, 0, last=True)
    assert whole.dst.tolist() == granted.tolist()


def test_dense_kv_moves_with_the_last_part_only_and_from_its_first_entry():
    granted = np.arange(10, 16)
    error = refusal(topology.part_pages, DENSE, np.arange(6), granted, 0, last=False)
    assert error.code is Code.FAILED_PRECONDITION and "rule dense-kv-length" in error.reason
    assert "more_parts" in error.reason
    error = refusal(topology.part_pages, DENSE, np.arange(4), granted, 2, last=True)
    assert "rule dense-kv-length" in error.reason and "from dst_offset 2" in error.reason


@pytest.mark.parametrize("n_src, offset, n_dst", [(5, 1, 3), (2, 1, 2), (3, 0, 3)])
def test_index_k_part_is_truncated_to_the_shorter(n_src, offset, n_dst):
    part = topology.part_pages(INDEX, np.arange(n_src), np.arange(20, 24), offset, last=False)
    assert len(part.src) == len(part.dst) == n_dst
    assert part.dst.tolist() == list(range(20 + offset, 20 + offset + n_dst))


def test_main_kv_part_lands_on_the_next_entries_and_drops_what_runs_past_the_end():
    granted = np.array([7, 3, 9, 1, 5])
    part = topology.part_pages(MAIN, np.array([40, 41]), granted, 1, last=False)
    assert part.dst.tolist() == [3, 9] and part.dst_offset == 1
    tail = topology.part_pages(MAIN, np.array([40, 41, 42]), granted, 3, last=False)
    assert tail.src.tolist() == [40, 41] and tail.dst.tolist() == [1, 5]


def test_a_part_past_the_end_of_the_grant_is_refused():
    error = refusal(topology.part_pages, MAIN, np.arange(2), np.arange(4), 4, last=False)
    assert error.code is Code.PERMISSION_DENIED and "rule part-in-grant" in error.reason
    assert topology.part_pages(MAIN, np.arange(0), np.arange(4), 4, last=False).dst.size == 0


@given(st.data())
def test_src_offset_lands_each_sender_page_past_it_on_its_entry_and_writes_none_before(data):
    """Rule src-offset against a naive model: the sender's sequence cut into parts at random, the
    grant starting at sender position `s`; each sender page at position p >= s lands on entry p - s."""
    n = data.draw(st.integers(1, 40), label="sender pages")
    s = data.draw(st.integers(0, n), label="src_offset")
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, n - 1)), max_size=5), label="cuts") - {n})
    bounds = [0, *cuts, n]
    sender = np.arange(100, 100 + n)
    granted = np.arange(500, 500 + n - s)
    landed = {}
    for start, end in zip(bounds, bounds[1:]):
        part = topology.part_pages(MAIN, sender[start:end], granted, start, last=end == n, src_offset=s)
        assert part.dst.tolist() == granted[part.dst_offset:part.dst_offset + len(part.dst)].tolist()
        for src_page, dst_page in zip(part.src.tolist(), part.dst.tolist()):
            assert dst_page not in landed, "an entry written twice"
            landed[dst_page] = src_page
    assert landed == {500 + p - s: 100 + p for p in range(s, n)}


def test_src_offset_applies_to_the_index_and_the_dense_kv_as_a_suffix():
    sender = np.arange(10)
    index = topology.part_pages(INDEX, sender, np.arange(20, 27), 0, last=True, src_offset=3)
    assert index.src.tolist() == list(range(3, 10)) and index.dst_offset == 0
    dense = topology.part_pages(DENSE, sender, np.arange(30, 34), 0, last=True, src_offset=6)
    assert dense.src.tolist() == [6, 7, 8, 9] and dense.dst.tolist() == [30, 31, 32, 33]
    error = refusal(topology.part_pages, DENSE, sender, np.arange(30, 35), 0, last=True, src_offset=6)
    assert "rule dense-kv-length" in error.reason
