"""A watch nobody reads (flows/records.py's Watcher, through TransferTable.watch) holds a bounded number
of statuses: past WATCH_BACKLOG, changes of one state fold into the latest, which carries every count
so far, and each change of state is still seen."""

from __future__ import annotations

import numpy as np

from kvbroker.core.model import Component, TransferState
from kvbroker.flows.records import WATCH_BACKLOG
from kvbroker.flows.transfers import TransferTable


async def test_a_watch_nobody_reads_folds_changes_of_one_state_and_keeps_each_state():
    table = TransferTable()
    record = table.add_grant("decode-0", "r1", {Component.MAIN_KV: np.arange(1000, dtype=np.int64)}, 60.0, None)
    watch = table.watch("decode-0", "r1")
    assert (await anext(watch)).state is TransferState.PENDING  # the watch is on the record now
    for _ in range(500):
        table.progress(record, landed={Component.MAIN_KV: 1}, runs=1, nbytes=64)
    table.succeed(record)
    (watcher,) = record.watchers
    assert len(watcher) <= WATCH_BACKLOG + 1 < 50  # not one per change: 500 of them came
    seen = [status async for status in watch]
    assert [s.state for s in seen][-2:] == [TransferState.TRANSFERRING, TransferState.SUCCEEDED]
    assert seen[-2].parts == 500  # the latest TRANSFERRING status, with every part so far
    parts = [s.parts for s in seen[:-1]]
    assert parts == sorted(parts) and len(seen) <= WATCH_BACKLOG + 1
