"""plan_transfer, the sender's plan between two engine layouts: truncation, the guard on the
receiver's pages, and one descriptor per run per layer buffer in the components' order."""

from __future__ import annotations

import numpy as np
import pytest

from kvbroker.core.errors import BrokerError, Code
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
from kvbroker.core.planner import plan_transfer

TOPOLOGY = Topology(1, 0, 1, 0, 1, 0, 0, 16, 0, 4, KvDtype.BFLOAT16)
MAIN, INDEX = Component.MAIN_KV, Component.MINIMAX_INDEX_K
ITEM = {MAIN: 256, INDEX: 64}


def engine(base: int, num_pages: int = 32, kinds=(MAIN, INDEX)) -> EngineLayout:
    """Layer 2 of each component, one FLAT buffer each, laid out from `base`."""
    components = {
        k: ComponentLayout(k, Layout.FLAT, num_pages,
                           (BufferLayout(2, BufferRole.FLAT, base + i * (1 << 20), num_pages * ITEM[k], ITEM[k]),))
        for i, k in enumerate(kinds)}
    return EngineLayout(f"e{base}", TOPOLOGY, components)


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_the_plan_writes_one_descriptor_per_run_per_layer_buffer_in_the_components_order():
    src, dst = engine(1 << 30), engine(1 << 31)
    plan = plan_transfer(src, dst, (INDEX, MAIN), ids(0, 1, 2, 7), ids(10, 11, 12, 3), max_pages=1 << 20)

    assert (plan.runs.count, plan.runs.pages, plan.truncated) == (2, 4, 0)
    index_src, main_src = src.components[INDEX].buffers[0], src.components[MAIN].buffers[0]
    index_dst = dst.components[INDEX].buffers[0]
    assert plan.descriptors.src[:, :2].tolist() == [
        [index_src.address, 3 * ITEM[INDEX]], [index_src.address + 7 * ITEM[INDEX], ITEM[INDEX]],
        [main_src.address, 3 * ITEM[MAIN]], [main_src.address + 7 * ITEM[MAIN], ITEM[MAIN]]]
    assert plan.descriptors.dst[0, :2].tolist() == [index_dst.address + 10 * ITEM[INDEX], 3 * ITEM[INDEX]]
    assert plan.descriptors.nbytes == 4 * (ITEM[INDEX] + ITEM[MAIN])


def test_page_lists_of_unequal_length_are_cut_to_the_shorter_and_the_entries_left_counted():
    plan = plan_transfer(engine(0), engine(1 << 31), (MAIN,), ids(0, 1, 2, 3, 4), ids(5, 6, 7), max_pages=1 << 20)
    assert (plan.runs.pages, plan.truncated) == (3, 0)  # source pages past the grant's list are not counted
    plan = plan_transfer(engine(0), engine(1 << 31), (MAIN,), ids(0, 1, 2), ids(5, 6, 7, 8, 9), max_pages=1 << 20)
    assert (plan.runs.pages, plan.truncated) == (3, 2)  # destination entries 8 and 9 left unfilled


def test_a_destination_page_beyond_the_receivers_pages_writes_nothing():
    with pytest.raises(BrokerError) as info:
        plan_transfer(engine(0), engine(1 << 31, num_pages=8), (MAIN,), ids(0, 1), ids(3, 8), max_pages=1 << 20)
    assert info.value.code is Code.INVALID_ARGUMENT
    assert "dst_page_ids[1]: page id 8 is out of range [0, 8)" in info.value.reason


def test_a_component_the_receiver_did_not_register_is_a_failed_precondition():
    with pytest.raises(BrokerError) as info:
        plan_transfer(engine(0), engine(1 << 31, kinds=(MAIN,)), (INDEX,), ids(0), ids(0), max_pages=1 << 20)
    assert info.value.code is Code.FAILED_PRECONDITION
