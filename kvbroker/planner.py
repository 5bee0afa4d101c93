"""Page ids → runs → descriptors. Pure, vectorised numpy; no I/O.

`plan_runs` splits a pair of page-id lists into runs (maximal stretches where both ids step by
+1); `build_descriptors` turns runs into one (address, length, device) row per run per layer
buffer, for the source and the destination side, ready for a transfer engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbroker.model import BufferLayout


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
    if src.size == 0:
        empty = np.empty(0, dtype=np.int64)
        return Runs(empty, empty, empty)
    breaks = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    length = np.diff(np.append(starts, src.size))
    return Runs(src[starts], dst[starts], length)


@dataclass(frozen=True)
class Descriptors:
    src: np.ndarray  # (n, 3) uint64: address, length in bytes, device
    dst: np.ndarray  # (n, 3) uint64, row i is where src row i lands

    @property
    def count(self) -> int:
        return int(self.src.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.src[:, 1].sum())


def _side(buffers: Sequence[BufferLayout], starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    base = np.array([b.address for b in buffers], dtype=np.uint64)[:, None]
    item = np.array([b.item_len for b in buffers], dtype=np.uint64)[:, None]
    device = np.array([b.device for b in buffers], dtype=np.uint64)[:, None]
    rows = np.empty((len(buffers), starts.size, 3), dtype=np.uint64)
    rows[:, :, 0] = base + starts.astype(np.uint64)[None, :] * item
    rows[:, :, 1] = lengths.astype(np.uint64)[None, :] * item
    rows[:, :, 2] = device
    return rows.reshape(-1, 3)


def build_descriptors(
    runs: Runs, src_buffers: Sequence[BufferLayout], dst_buffers: Sequence[BufferLayout]
) -> Descriptors:
    """One row per (layer buffer, run), buffer-major. Buffers pair up by position and share item_len."""
    if len(src_buffers) != len(dst_buffers):
        raise ValueError("source and destination need the same number of layer buffers")
    if not src_buffers or runs.count == 0:
        empty = np.empty((0, 3), dtype=np.uint64)
        return Descriptors(empty, empty)
    return Descriptors(
        _side(src_buffers, runs.src_start, runs.length), _side(dst_buffers, runs.dst_start, runs.length)
    )
