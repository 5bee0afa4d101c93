"""Page ids → runs → descriptors. Pure, vectorised numpy; no I/O.

`plan_transfer` is the sender's plan for one transfer between two engine layouts: the page lists
cut to equal length (rule truncate), the destination ids guarded, then runs and descriptors.
`plan_runs` splits a pair of page-id lists into runs (maximal stretches where both ids step by
+1); `build_descriptors` turns runs into one (address, length, device) row per run per layer
buffer, for the source and the destination side (`Descriptors`, model.py, what a backend takes),
each side with the one memory kind (host or GPU) of its buffers; `describe` does so from buffers
already in columns (`ComponentLayout.columns`, computed once per layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbroker.core import topology
from kvbroker.core.model import BufferColumns, BufferLayout, Component, Descriptors, EngineLayout
from kvbroker.core.validation import check_page_ids, registered_pages


@dataclass(frozen=True)
class Runs:
    src_start: np.ndarray  # int64 page id of each run's first source page
    dst_start: np.ndarray  # int64 page id of each run's first destination page
    length: np.ndarray  # int64 pages in each run

    @property
    def count(self) -> int:
        return int(self.length.size)

    @property
    def pages(self) -> int:
        return int(self.length.sum())


def plan_runs(src: np.ndarray, dst: np.ndarray) -> Runs:
    """Coalesce equal-length page-id arrays into runs. Order is kept; no deduplication."""
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    if src.shape != dst.shape or src.ndim != 1:
        raise ValueError(f"page lists must be 1-D and of equal length, got {src.shape} and {dst.shape}")
    n = src.size
    if n == 0:
        empty = np.empty(0, dtype=np.int64)
        return Runs(empty, empty, empty)
    # Few and reused temporaries: at 10^7 pages each fresh one is 80 MB the kernel must fault in,
    # which cost more than the arithmetic (benchmarks/RESULTS.md).
    step = np.subtract(src[1:], src[:-1])
    first = np.empty(n, dtype=bool)  # first[i]: page i starts a run
    first[0] = True
    np.not_equal(step, 1, out=first[1:])
    np.subtract(dst[1:], dst[:-1], out=step)
    first[1:] |= step != 1
    del step
    starts = np.flatnonzero(first)
    length = np.empty_like(starts)
    np.subtract(starts[1:], starts[:-1], out=length[:-1])
    length[-1] = n - starts[-1]
    return Runs(src[starts], dst[starts], length)


def _u64_row(values: np.ndarray) -> np.ndarray:
    """Non-negative int64 values (page ids, run lengths) as a (1, n) uint64 view: same bits, no copy."""
    return np.asarray(values, dtype=np.int64).view(np.uint64)[None, :]


def _side(columns: BufferColumns, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    rows = np.empty((columns.count, starts.size, 3), dtype=np.uint64)
    # Computed into the rows in place: no (buffers x runs) temporaries.
    np.multiply(_u64_row(starts), columns.item, out=rows[:, :, 0])
    rows[:, :, 0] += columns.base
    np.multiply(_u64_row(lengths), columns.item, out=rows[:, :, 1])
    rows[:, :, 2] = columns.device
    return rows.reshape(-1, 3)


def build_descriptors(
    runs: Runs, src_buffers: Sequence[BufferLayout], dst_buffers: Sequence[BufferLayout]
) -> Descriptors:
    """One row per (layer buffer, run), buffer-major. Buffers pair up by position and share item_len."""
    if len(src_buffers) != len(dst_buffers):
        raise ValueError("source and destination need the same number of layer buffers")
    return describe(runs, BufferColumns.of(src_buffers, "source"), BufferColumns.of(dst_buffers, "destination"))


def describe(runs: Runs, src: BufferColumns, dst: BufferColumns) -> Descriptors:
    """build_descriptors of buffers already in columns (a ComponentLayout's `columns`, computed once)."""
    if src.count != dst.count:
        raise ValueError("source and destination need the same number of layer buffers")
    if not src.count or runs.count == 0:
        empty = np.empty((0, 3), dtype=np.uint64)
        return Descriptors(empty, empty, src.memory_kind, dst.memory_kind)
    return Descriptors(_side(src, runs.src_start, runs.length), _side(dst, runs.dst_start, runs.length),
                       src.memory_kind, dst.memory_kind)


@dataclass(frozen=True)
class TransferPlan:
    """What one transfer writes: its runs, their descriptors, and how many pages equal lengths cost."""

    runs: Runs
    descriptors: Descriptors
    truncated: int  # destination entries left unfilled (rule truncate): the request's truncated_pages


def plan_transfer(src: EngineLayout, dst: EngineLayout, components: Sequence[Component],
                  src_page_ids: np.ndarray, dst_page_ids: np.ndarray, *, max_pages: int) -> TransferPlan:
    """The writes that move `components` from engine `src` to engine `dst`, whose layouts passed the
    topology rules: both page lists cut to the shorter, the destination ids checked against the
    receiver's pages (it checked its grant; this guards our writes against a peer that lies about
    it), then one descriptor per run per layer buffer, the components' buffers in the order given."""
    src_ids, dst_ids = topology.truncate_page_lists(src_page_ids, dst_page_ids)
    truncated = len(dst_page_ids) - len(dst_ids)
    check_page_ids(dst_ids, "dst_page_ids", registered_pages(dst, components), max_pages, unique=False)
    runs = plan_runs(src_ids, dst_ids)
    src_buffers = [b for k in components for b in src.components[k].buffers]
    dst_buffers = [b for k in components for b in dst.components[k].buffers]
    return TransferPlan(runs, build_descriptors(runs, src_buffers, dst_buffers), truncated)
