"""The planner against a naive per-page loop."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbroker.core.model import BufferLayout, BufferRole
from kvbroker.core.planner import build_descriptors, plan_runs


def naive_runs(src, dst):
    runs = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def as_tuples(runs):
    return list(zip(runs.src_start.tolist(), runs.dst_start.tolist(), runs.length.tolist()))


page_lists = st.integers(0, 300).flatmap(
    lambda n: st.tuples(st.permutations(range(max(n, 1)))
                        .map(lambda p: p[:n]), st.permutations(range(max(n, 1))).map(lambda p: p[:n]))
)


@settings(max_examples=300, deadline=None)
@given(page_lists)
def test_runs_match_a_naive_loop_on_random_lists(lists):
    src, dst = (np.array(x, dtype=np.int64) for x in lists)
    assert as_tuples(plan_runs(src, dst)) == naive_runs(src.tolist(), dst.tolist())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 20)), max_size=30), st.integers(0, 500))
def test_runs_match_a_naive_loop_on_run_structured_lists(pieces, offset):
    src = np.concatenate([np.arange(s, s + n) for s, n in pieces] or [np.empty(0, np.int64)]).astype(np.int64)
    dst = src[::-1].copy() if offset % 2 else src + offset
    assert as_tuples(plan_runs(src, dst)) == naive_runs(src.tolist(), dst.tolist())


def test_empty_lists_make_no_runs():
    runs = plan_runs(np.empty(0, np.int64), np.empty(0, np.int64))
    assert runs.count == 0 and runs.pages == 0


def test_single_page_is_one_run():
    assert as_tuples(plan_runs(np.array([7]), np.array([3]))) == [(7, 3, 1)]


def test_reversed_lists_never_coalesce():
    src = np.arange(10)[::-1]
    assert plan_runs(src, src).count == 10


def test_contiguous_lists_are_one_run():
    assert as_tuples(plan_runs(np.arange(5, 105), np.arange(0, 100))) == [(5, 0, 100)]


def test_a_break_on_either_side_splits_the_run():
    assert as_tuples(plan_runs(np.array([1, 2, 3, 4]), np.array([10, 11, 20, 21]))) == [(1, 10, 2), (3, 20, 2)]


def test_descriptors_are_one_row_per_buffer_and_run():
    src_bufs = [BufferLayout(0, BufferRole.K, 1000, 10_000, 100), BufferLayout(0, BufferRole.V, 50_000, 10_000, 100)]
    dst_bufs = [BufferLayout(0, BufferRole.K, 7000, 10_000, 100, device=2),
                BufferLayout(0, BufferRole.V, 90_000, 10_000, 100, device=2)]
    runs = plan_runs(np.array([1, 2, 5]), np.array([0, 1, 9]))
    d = build_descriptors(runs, src_bufs, dst_bufs)
    assert d.src.tolist() == [[1100, 200, 0], [1500, 100, 0], [50_100, 200, 0], [50_500, 100, 0]]
    assert d.dst.tolist() == [[7000, 200, 2], [7900, 100, 2], [90_000, 200, 2], [90_900, 100, 2]]
    assert d.nbytes == 600 and d.count == 4


@settings(max_examples=100, deadline=None)
@given(page_lists, st.lists(st.integers(1, 64), min_size=1, max_size=5))
def test_descriptors_cover_exactly_the_pages_a_naive_copy_would(lists, item_lens):
    src, dst = (np.array(x, dtype=np.int64) for x in lists)
    src_bufs = [BufferLayout(i, BufferRole.FLAT, (1 << 20) * (i + 1), 0, n) for i, n in enumerate(item_lens)]
    dst_bufs = [BufferLayout(i, BufferRole.FLAT, (1 << 40) + (i << 20), 0, n) for i, n in enumerate(item_lens)]
    d = build_descriptors(plan_runs(src, dst), src_bufs, dst_bufs)
    moved = set()
    for (sa, ln, _), (da, dl, _) in zip(d.src.tolist(), d.dst.tolist()):
        assert ln == dl
        moved.update((sa + k, da + k) for k in range(ln))
    naive = {(b.address + s * b.item_len + k, c.address + t * c.item_len + k)
             for b, c in zip(src_bufs, dst_bufs) for s, t in zip(src.tolist(), dst.tolist())
             for k in range(b.item_len)}
    assert moved == naive
