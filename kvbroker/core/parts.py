"""Parts of an offered grant: which entries of the grant's page lists each part writes. Pure.

An offered grant holds one destination page list per component; parts (the chunks of a chunked
prefill) fill it. Both brokers keep a `Coverage` of the entries written so far, so that no two
parts of one component overlap:

    check_grant_inside(...)  the sender, once it has the receiver's engine: the grant's pages are
                     pages of that engine (INVALID_ARGUMENT, the rule the claimed flow's planner
                     applies to dst_page_ids: validation.check_page_ids)
    plan_part(...)   the sender, before it writes: where the part's pages land, its descriptors
                     (the rules of topology.part_pages per component), refusing a part that lies
                     outside the grant, overlaps an earlier one, or breaks rule dense-kv-length
    Landing.land()   the receiver, when the sender says a part landed: the same bounds, checked
                     again against the receiver's own grant, and whether the grant is complete

Counts on the receiver come from its grant, never from the sender's figures: pages are entries
of its own lists, bytes those entries times its own item_len.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from kvbroker.core import topology
from kvbroker.core.errors import BrokerError, Code, precondition
from kvbroker.core.model import Component, Descriptors, EngineLayout
from kvbroker.core.planner import Runs, describe, plan_runs
from kvbroker.core.validation import check_page_ids


class Coverage:
    """Which entries of each of a grant's page lists have been written (or are being written)."""

    def __init__(self, lengths: Mapping[Component, int]) -> None:
        self._lengths = dict(lengths)
        self._marks: dict[Component, np.ndarray] = {}  # allocated on first use

    def length(self, kind: Component) -> int:
        return self._lengths[kind]

    def first_overlap(self, kind: Component, start: int, count: int) -> int | None:
        """The first entry of [start, start + count) already covered, or None."""
        marks = self._marks.get(kind)
        if marks is None or count == 0:
            return None
        hit = np.flatnonzero(marks[start:start + count])
        return start + int(hit[0]) if hit.size else None

    def mark(self, kind: Component, start: int, count: int) -> None:
        if count == 0:
            return
        marks = self._marks.get(kind)
        if marks is None:
            marks = self._marks[kind] = np.zeros(self._lengths[kind], dtype=bool)
        marks[start:start + count] = True

    def covered(self, kind: Component) -> int:
        marks = self._marks.get(kind)
        return 0 if marks is None else int(np.count_nonzero(marks))

    def unfilled(self) -> int:
        """Entries of the grant's lists not written, summed over its components: truncated_pages."""
        return sum(length - self.covered(kind) for kind, length in self._lengths.items())


@dataclass(frozen=True)
class PartPages:
    """One component's pages of a part as the sender's caller gave them."""

    kind: Component
    src_page_ids: np.ndarray
    dst_offset: int


@dataclass(frozen=True)
class Landed:
    """Entries [dst_offset, dst_offset + pages) of the grant's list of `kind` were written."""

    kind: Component
    dst_offset: int
    pages: int


@dataclass(frozen=True)
class PartPlan:
    landed: tuple[Landed, ...]
    descriptors: Descriptors
    pages: int  # entries written, summed over the part's components
    runs: int  # runs, summed over the part's components


def _overlap_refusal(kind: Component, entry: int, granted: np.ndarray) -> BrokerError:
    return precondition(f"pages: {kind.name} entry {entry} of the grant (page {int(granted[entry])}) "
                        "was written by an earlier part; parts may not overlap")


def check_grant_inside(dst: EngineLayout, granted: Mapping[Component, np.ndarray], components: Iterable[Component],
                       max_pages: int) -> None:
    """The grant's page lists of `components` name only pages the receiver's engine `dst` has: it
    checked its grant; this guards our writes against a receiver that is inconsistent or lies about it."""
    for kind in components:
        if kind in granted and kind in dst.components and granted[kind].size:
            check_page_ids(granted[kind], f"granted {kind.name} pages", dst.components[kind].num_pages,
                           max(max_pages, granted[kind].size), unique=False)


def plan_part(src: EngineLayout, dst: EngineLayout, granted: Mapping[Component, np.ndarray],
              coverage: Coverage, pages: Iterable[PartPages], *, last: bool,
              src_offsets: Mapping[Component, int] | None = None) -> PartPlan:
    """Where each component of a part lands and the descriptors that write it, between engines
    that passed the topology rules and a grant inside `dst` (check_grant_inside). Raises, writing
    nothing, for a part outside the grant, overlapping an earlier part, or breaking a component's
    page rule. `coverage` is left unchanged: the caller marks `landed` once it commits to the part."""
    landed, src_rows, dst_rows = [], [], []
    total_pages = total_runs = 0
    kinds_seen = set()
    # A component with the same pages as the one before it shares that one's runs: one plan per part.
    last_plan: tuple[np.ndarray, np.ndarray, Runs] | None = None
    for entry in pages:
        kind = entry.kind
        if kind in kinds_seen:
            raise BrokerError(Code.INVALID_ARGUMENT, f"pages: {kind.name} is listed twice in one part")
        if kind not in granted:
            raise BrokerError(Code.PERMISSION_DENIED, f"pages: {kind.name} is not in the grant")
        kinds_seen.add(kind)
        rule = topology.part_pages(kind, entry.src_page_ids, granted[kind], entry.dst_offset, last=last,
                                   src_offset=(src_offsets or {}).get(kind, 0))
        hit = coverage.first_overlap(kind, rule.dst_offset, len(rule.dst))
        if hit is not None:
            raise _overlap_refusal(kind, hit, granted[kind])
        if last_plan is None or not (np.array_equal(rule.src, last_plan[0]) and np.array_equal(rule.dst, last_plan[1])):
            last_plan = (rule.src, rule.dst, plan_runs(rule.src, rule.dst))
        runs = last_plan[2]
        described = describe(runs, src.components[kind].columns, dst.components[kind].columns)
        src_rows.append(described.src)
        dst_rows.append(described.dst)
        kinds = (described.src_memory_kind, described.dst_memory_kind)
        landed.append(Landed(kind, rule.dst_offset, len(rule.dst)))
        total_pages += len(rule.dst)
        total_runs += runs.count
    if not landed:
        raise BrokerError(Code.INVALID_ARGUMENT, "pages: a part needs at least one component")
    dense = Component.MINIMAX_DENSE_KV
    if dense in granted and dense not in kinds_seen:
        topology.check_dense_kv(granted[dense], None, 0, last=last)
    descriptors = Descriptors(np.concatenate(src_rows), np.concatenate(dst_rows), *kinds)
    return PartPlan(tuple(landed), descriptors, total_pages, total_runs)


@dataclass
class Landing:
    """The receiver's account of an offered grant's parts, from the sender's notices."""

    granted: Mapping[Component, np.ndarray]
    max_parts: int
    coverage: Coverage = field(init=False)
    parts: set[int] = field(default_factory=set)
    total: int | None = None  # known once the last part's notice arrived
    pages: int = 0

    def __post_init__(self) -> None:
        self.coverage = Coverage({k: len(v) for k, v in self.granted.items()})

    @property
    def complete(self) -> bool:
        return self.total is not None and len(self.parts) == self.total

    def check(self, part: int, total: int, landed: Iterable[Landed]) -> None:
        """Refuse a notice that cannot be true of this grant; nothing changes."""
        if part >= self.max_parts:
            raise BrokerError(Code.RESOURCE_EXHAUSTED, f"part: {part} is beyond the limit of {self.max_parts} "
                                                       "parts per request")
        if part in self.parts:
            raise precondition(f"part: part {part} was reported already")
        if total:
            if self.total is not None and total != self.total:
                raise precondition(f"parts_total: {total}, but an earlier notice said {self.total}")
            if part != total - 1 or total > self.max_parts or any(p >= total for p in self.parts):
                raise precondition(f"parts_total: {total} does not fit part {part} and the parts reported "
                                   f"({len(self.parts)})")
        elif self.total is not None and part >= self.total:
            raise precondition(f"part: {part}, but the request has {self.total} parts")
        seen: dict[Component, list[tuple[int, int]]] = {}
        for x in landed:
            granted = self.granted.get(x.kind)
            if granted is None:
                raise BrokerError(Code.PERMISSION_DENIED, f"landed: {x.kind.name} is not in the grant")
            if x.dst_offset + x.pages > len(granted):
                raise BrokerError(Code.PERMISSION_DENIED,
                                  f"landed: {x.kind.name} entries [{x.dst_offset}, {x.dst_offset + x.pages}) run past "
                                  f"the grant's {len(granted)} pages")
            hit = self.coverage.first_overlap(x.kind, x.dst_offset, x.pages)
            if hit is not None:
                raise _overlap_refusal(x.kind, hit, granted)
            for start, count in seen.get(x.kind, ()):
                if x.dst_offset < start + count and start < x.dst_offset + x.pages:
                    raise precondition(f"landed: {x.kind.name} is reported twice in one part, overlapping")
            seen.setdefault(x.kind, []).append((x.dst_offset, x.pages))

    def land(self, part: int, total: int, landed: Iterable[Landed]) -> int:
        """Record a checked part; returns the entries it wrote."""
        landed = list(landed)
        self.check(part, total, landed)
        for x in landed:
            self.coverage.mark(x.kind, x.dst_offset, x.pages)
        self.parts.add(part)
        if total:
            self.total = total
        written = sum(x.pages for x in landed)
        self.pages += written
        return written


def landed_bytes(layout: EngineLayout, landed: Iterable[Landed]) -> int:
    """Bytes the landed entries cover in `layout`'s engine: entries times the item_len of every
    layer buffer of their component."""
    return sum(x.pages * layout.components[x.kind].page_bytes for x in landed)
