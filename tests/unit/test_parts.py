"""Parts of an offered grant: the sender's plan and the receiver's landing agree, and neither lets
a part outside the grant, over an earlier part, or past the rules through."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
from kvbroker.core.parts import Coverage, Landed, Landing, PartPages, check_grant_inside, landed_bytes, plan_part
from kvbroker.core.planner import build_descriptors, plan_runs
from tests.support.helpers import refusal

MAIN, INDEX, DENSE = Component.MAIN_KV, Component.MINIMAX_INDEX_K, Component.MINIMAX_DENSE_KV
TOPO = Topology(1, 0, 1, 0, 1, 0, 0, 4, 0, 4, KvDtype.BFLOAT16)
NUM_PAGES = 64


def engine(base: int) -> EngineLayout:
    def comp(kind, layout, roles, item_len):
        bufs = tuple(BufferLayout(layer, role, base + 0x100000 * (layer * 4 + int(role)) + 0x10000 * int(kind),
                                  NUM_PAGES * item_len, item_len) for layer in (0, 1) for role in roles)
        return ComponentLayout(kind, layout, NUM_PAGES, bufs)

    return EngineLayout("e", TOPO, {
        MAIN: comp(MAIN, Layout.KV_SPLIT, (BufferRole.K, BufferRole.V), 256),
        INDEX: comp(INDEX, Layout.FLAT, (BufferRole.FLAT,), 64),
        DENSE: comp(DENSE, Layout.KV_SPLIT, (BufferRole.K, BufferRole.V), 128),
    })


SRC, DST = engine(1 << 32), engine(1 << 36)


def granted(n_main=8, n_index=4, n_dense=8):
    return {MAIN: np.arange(10, 10 + n_main), INDEX: np.arange(30, 30 + n_index), DENSE: np.arange(40, 40 + n_dense)}


def fresh(grant):
    return Coverage({k: len(v) for k, v in grant.items()})



def test_a_chunk_lands_on_its_entries_with_one_descriptor_per_run_and_buffer():
    grant = granted()
    plan = plan_part(SRC, DST, grant, fresh(grant), [PartPages(MAIN, np.array([0, 1, 2]), 2)], last=False)
    assert plan.landed == (Landed(MAIN, 2, 3),) and plan.pages == 3 and plan.runs == 1
    assert plan.descriptors.count == 4  # 2 layers x K, V
    first = DST.components[MAIN].buffers[0]
    assert int(plan.descriptors.dst[0, 0]) == first.address + 12 * first.item_len
    assert int(plan.descriptors.dst[0, 1]) == 3 * first.item_len


def test_overlapping_an_earlier_part_is_refused_and_names_the_entry():
    grant = granted()
    coverage = fresh(grant)
    coverage.mark(MAIN, 0, 4)
    error = refusal(plan_part, SRC, DST, grant, coverage, [PartPages(MAIN, np.arange(2), 3)], last=False)
    assert error.code is Code.FAILED_PRECONDITION and "entry 3" in error.reason and "page 13" in error.reason


def test_a_component_outside_the_grant_is_permission_denied():
    grant = {MAIN: np.arange(4)}
    error = refusal(plan_part, SRC, DST, grant, fresh(grant), [PartPages(INDEX, np.arange(2), 0)], last=True)
    assert error.code is Code.PERMISSION_DENIED and "MINIMAX_INDEX_K is not in the grant" in error.reason


def test_the_last_part_must_send_dense_kv_whole():
    grant = granted()
    error = refusal(plan_part, SRC, DST, grant, fresh(grant), [PartPages(MAIN, np.arange(8), 0)], last=True)
    assert "rule dense-kv-length" in error.reason and "none of its 8" in error.reason
    plan = plan_part(SRC, DST, grant, fresh(grant), [PartPages(MAIN, np.arange(8), 0),
                                                     PartPages(DENSE, np.arange(8), 0)], last=True)
    assert plan.pages == 16


def test_dense_kv_on_a_part_with_more_parts_is_refused():
    grant = granted()
    error = refusal(plan_part, SRC, DST, grant, fresh(grant), [PartPages(MAIN, np.arange(4), 0),
                                                               PartPages(DENSE, np.arange(8), 0)], last=False)
    assert error.code is Code.FAILED_PRECONDITION and "rule dense-kv-length" in error.reason
    assert "more_parts" in error.reason


def test_a_receiver_page_beyond_its_engine_is_invalid_argument_as_in_the_claimed_flow():
    grant = {MAIN: np.array([3, NUM_PAGES + 1])}
    error = refusal(check_grant_inside, DST, grant, [MAIN], 1 << 20)
    assert error.code is Code.INVALID_ARGUMENT
    assert f"granted MAIN_KV pages[1]: page id {NUM_PAGES + 1} is out of range [0, {NUM_PAGES})" in error.reason
    check_grant_inside(DST, {MAIN: np.array([0, NUM_PAGES - 1])}, [MAIN], 1 << 20)


def test_landing_completes_when_every_part_up_to_the_last_landed():
    landing = Landing(granted(), max_parts=16)
    landing.land(1, 0, [Landed(MAIN, 4, 4)])
    assert not landing.complete
    landing.land(2, 3, [Landed(INDEX, 0, 4), Landed(DENSE, 0, 8)])
    assert not landing.complete and landing.total == 3
    landing.land(0, 0, [Landed(MAIN, 0, 4)])
    assert landing.complete and landing.pages == 20


@pytest.mark.parametrize("notice, words", [
    ((0, 0, [Landed(MAIN, 6, 4)]), "run past the grant's 8 pages"),
    ((0, 0, [Landed(MAIN, 0, 2), Landed(MAIN, 1, 2)]), "reported twice in one part"),
    ((3, 2, [Landed(MAIN, 0, 1)]), "does not fit part 3"),
    ((16, 0, []), "limit of 16 parts"),
])
def test_landing_refuses_a_notice_that_cannot_be_true(notice, words):
    landing = Landing(granted(), max_parts=16)
    error = refusal(landing.land, *notice)
    assert words in error.reason
    assert landing.pages == 0 and not landing.parts


def test_landing_refuses_a_repeated_part_and_an_overlap():
    landing = Landing(granted(), max_parts=16)
    landing.land(0, 0, [Landed(MAIN, 0, 4)])
    assert "reported already" in refusal(landing.land, 0, 0, [Landed(MAIN, 4, 1)]).reason
    assert "earlier part" in refusal(landing.land, 1, 0, [Landed(MAIN, 3, 2)]).reason
    landing.land(1, 2, [Landed(MAIN, 4, 1)])
    assert "the request has 2 parts" in refusal(landing.land, 2, 0, []).reason


def test_landed_bytes_come_from_the_receivers_item_len():
    assert landed_bytes(DST, [Landed(MAIN, 0, 3), Landed(INDEX, 0, 2)]) == 3 * 4 * 256 + 2 * 2 * 64


def reference_rows(kind, src_ids, dst_ids):
    """A component's descriptors planned alone, from its buffers (the claimed flow's way)."""
    described = build_descriptors(plan_runs(np.asarray(src_ids), np.asarray(dst_ids)), SRC.components[kind].buffers,
                                  DST.components[kind].buffers)
    return described.src, described.dst


@pytest.mark.parametrize("index_pages", [[4, 5, 9], [4, 6, 9]], ids=["same-pages", "other-pages"])
def test_components_of_one_part_get_the_rows_each_would_alone(index_pages):
    """MAIN_KV and MINIMAX_INDEX_K of one part, on the same pages (one plan of runs serves both) or
    on others: every component's rows are those it would have planned alone, in the part's order."""
    grant = {MAIN: np.array([20, 21, 40]), INDEX: np.array([20, 21, 40])}
    plan = plan_part(SRC, DST, grant, fresh(grant), [PartPages(MAIN, np.array([4, 5, 9]), 0),
                                                     PartPages(INDEX, np.array(index_pages), 0)], last=True)
    main, index = reference_rows(MAIN, [4, 5, 9], [20, 21, 40]), reference_rows(INDEX, index_pages, [20, 21, 40])
    assert np.array_equal(plan.descriptors.src, np.concatenate([main[0], index[0]]))
    assert np.array_equal(plan.descriptors.dst, np.concatenate([main[1], index[1]]))
    assert plan.runs == 2 + (2 if index_pages == [4, 5, 9] else 3)


chunks = st.lists(st.tuples(st.integers(0, 10), st.integers(0, 12)), min_size=1, max_size=6)


def pages_written(plan, buffer) -> list[int]:
    """The destination page ids a plan's descriptors write into one layer buffer, in order."""
    pages = []
    for address, length, _ in plan.descriptors.dst.tolist():
        if buffer.address <= address < buffer.address + buffer.length:
            first = (address - buffer.address) // buffer.item_len
            pages.extend(range(first, first + length // buffer.item_len))
    return pages


@settings(max_examples=200, deadline=None)
@given(chunks, st.randoms(use_true_random=False))
def test_plan_and_landing_agree_and_never_leave_the_grant(parts, rnd):
    """Random chunks of MAIN_KV: each part the sender accepts lands on exactly its entries of the
    grant's list, the receiver accepts its notice, and no page is written twice."""
    grant = {MAIN: np.array(rnd.sample(range(NUM_PAGES), 12))}
    sender, landing = fresh(grant), Landing(grant, max_parts=64)
    written: list[int] = []
    for number, (offset, count) in enumerate(parts):
        try:
            plan = plan_part(SRC, DST, grant, sender, [PartPages(MAIN, np.arange(count), offset)], last=False)
        except BrokerError as exc:
            assert exc.code in (Code.PERMISSION_DENIED, Code.FAILED_PRECONDITION)
            continue
        for x in plan.landed:
            sender.mark(x.kind, x.dst_offset, x.pages)
        landing.land(number, 0, plan.landed)
        pages = pages_written(plan, DST.components[MAIN].buffers[0])
        assert pages == grant[MAIN][offset:offset + plan.pages].tolist()
        written.extend(pages)
    assert len(written) == len(set(written)) == landing.pages == sender.covered(MAIN) <= 12
