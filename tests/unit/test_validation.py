"""Request validation of the offered flow: page lists per component, parts, aux, peer addresses."""

from __future__ import annotations

import numpy as np
import pytest

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
from kvbroker.core.validation import check_aux, check_grant_pages, check_part_pages, check_peer_address
from tests.support.helpers import refusal

MAIN, INDEX, INDEX_KV = Component.MAIN_KV, Component.MINIMAX_INDEX_K, Component.MINIMAX_INDEX_KV
TOPO = Topology(1, 0, 1, 0, 1, 0, 0, 16, 0, 4, KvDtype.BFLOAT16)
LAYOUT = EngineLayout("e", TOPO, {
    MAIN: ComponentLayout(MAIN, Layout.KV_SPLIT, 32, (BufferLayout(0, BufferRole.K, 0, 2048, 64),
                                                      BufferLayout(0, BufferRole.V, 4096, 2048, 64))),
    INDEX: ComponentLayout(INDEX, Layout.FLAT, 8, (BufferLayout(1, BufferRole.FLAT, 8192, 512, 64),)),
})


def ids(*values):
    return np.array(values, dtype=np.int64)



def test_grant_pages_are_checked_against_each_components_own_pages():
    granted = check_grant_pages(LAYOUT, [(MAIN, ids(0, 31)), (INDEX, ids(7))], "pages", 1 << 20)
    assert list(granted) == [MAIN, INDEX]
    error = refusal(check_grant_pages, LAYOUT, [(MAIN, ids(0)), (INDEX, ids(8))], "pages", 1 << 20)
    assert error.code is Code.INVALID_ARGUMENT and "pages[1].page_ids (MINIMAX_INDEX_K)[0]: page id 8" in error.reason


@pytest.mark.parametrize("pages, code, words", [
    ([(MAIN, ids(1, 1))], Code.INVALID_ARGUMENT, "appears more than once"),
    ([(MAIN, ids())], Code.INVALID_ARGUMENT, "at least one page id"),
    ([(MAIN, ids(1)), (MAIN, ids(2))], Code.INVALID_ARGUMENT, "listed twice"),
    ([(INDEX_KV, ids(1))], Code.UNIMPLEMENTED, "rule index-with-value"),
    ([(Component.MINIMAX_DENSE_KV, ids(1))], Code.FAILED_PRECONDITION, "MINIMAX_DENSE_KV is not registered"),
    ([], Code.INVALID_ARGUMENT, "at least one component"),
])
def test_bad_grant_pages(pages, code, words):
    error = refusal(check_grant_pages, LAYOUT, pages, "pages", 1 << 20)
    assert error.code is code and words in error.reason


def test_a_grant_list_over_the_request_limit_is_resource_exhausted():
    error = refusal(check_grant_pages, None, [(MAIN, np.arange(5))], "pages", 4)
    assert error.code is Code.RESOURCE_EXHAUSTED


def test_part_pages_may_be_empty_per_component_but_stay_inside_the_sending_engine():
    check_part_pages(LAYOUT, [(MAIN, ids(), 0), (INDEX, ids(3), 2)], "pages", 1 << 20)
    check_part_pages(LAYOUT, [], "pages", 1 << 20)
    error = refusal(check_part_pages, LAYOUT, [(INDEX, ids(9), 0)], "pages", 1 << 20)
    assert "pages[0].src_page_ids (MINIMAX_INDEX_K)[0]: page id 9" in error.reason


def test_aux_is_for_the_last_part_and_bounded():
    check_aux(b"x" * 16, last=True, max_aux_bytes=16)
    assert refusal(check_aux, b"x", last=False, max_aux_bytes=16).code is Code.INVALID_ARGUMENT
    error = refusal(check_aux, b"x" * 17, last=True, max_aux_bytes=16)
    assert error.code is Code.RESOURCE_EXHAUSTED and "max_aux_bytes" in error.reason


@pytest.mark.parametrize("address, good", [
    ("10.0.0.5:50052", True), ("[fd00::5]:50052", True), ("decode-0.kvbroker:50052", True),
    ("unix:/run/kvbroker/peer.sock", True), ("", False), ("10.0.0.5", False), ("a b:1", False),
    ("x" * 300 + ":1", False),
])
def test_peer_addresses(address, good):
    if good:
        check_peer_address(address, "sender_address")
    else:
        assert "sender_address" in refusal(check_peer_address, address, "sender_address").reason
