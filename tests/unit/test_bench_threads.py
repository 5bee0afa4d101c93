"""The bench's per-thread CPU and run-queue delay (kvbroker_tools.threads), on a made-up /proc and on this process."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path

from kvbroker_tools import threads

PR_SET_NAME = 15


def _task(proc: Path, pid: int, tid: int, comm: str, cpu: int, wait: int, slices: int) -> None:
    task = proc / str(pid) / "task" / str(tid)
    task.mkdir(parents=True, exist_ok=True)
    (task / "comm").write_text(comm + "\n")
    (task / "schedstat").write_text(f"{cpu} {wait} {slices}\n")


def test_group_drops_a_trailing_number_only():
    assert threads.group_of("mooncake-write_3") == "mooncake-write"
    assert threads.group_of("ThreadPoolExecutor-0_1") == "ThreadPoolExecutor-0"
    assert threads.group_of("python3") == "python"
    assert threads.group_of("grpc_global_tim") == "grpc_global_tim"
    assert threads.group_of("7") == "7"


def test_spent_is_per_group_the_difference_and_counts_new_threads_from_zero(tmp_path):
    _task(tmp_path, 10, 10, "kvbroker", 1_000_000, 500_000, 10)
    _task(tmp_path, 10, 11, "nixl_0", 2_000_000, 0, 4)
    first = threads.snapshot({"decode_broker": [10]}, tmp_path)
    _task(tmp_path, 10, 10, "kvbroker", 4_000_000, 1_500_000, 16)
    _task(tmp_path, 10, 11, "nixl_0", 2_000_000, 0, 4)
    _task(tmp_path, 10, 12, "nixl_1", 3_000_000, 2_000_000, 3)  # started between the snapshots
    last = threads.snapshot({"decode_broker": [10, 99]}, tmp_path)  # 99 ended before it was read
    got = threads.spent(first, last)
    assert got[("decode_broker", "main")] == threads.Times(3_000_000, 1_000_000, 6, 1)  # the process's first thread
    assert got[("decode_broker", "nixl")] == threads.Times(3_000_000, 2_000_000, 3, 2)
    table = threads.per_request(got, requests=2)["decode_broker"]
    assert (table["cpu_ms"], table["wait_ms"], table["threads"]) == (3.0, 1.5, 3)
    assert list(table["groups"]) == ["main", "nixl"]  # by CPU, a tie by name
    assert table["groups"]["nixl"]["wait_ms"] == 1.0


def test_windows_accumulate_and_the_rest_is_summed_as_other(tmp_path):
    total: dict = {}
    for _ in range(2):
        threads.accumulate(total, {("p", f"g{i}x"): threads.Times(1_000_000 * (i + 1), 0, 1, 1) for i in range(4)})
    table = threads.per_request(total, requests=1, top=2)["p"]
    assert list(table["groups"]) == ["g3x", "g2x", "other"]
    assert table["groups"]["other"]["cpu_ms"] == 6.0  # (1 + 2) ms twice
    assert table["cpu_ms"] == 20.0


def test_a_spinning_thread_of_this_process_shows_its_cpu_in_its_group():
    stop = threading.Event()

    def spin() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, b"spinner-7", 0, 0, 0)  # Python 3.11 names none
        while not stop.is_set():
            pass

    first = threads.snapshot({"me": [os.getpid()]})
    spinner = threading.Thread(target=spin, name="spinner-7")
    spinner.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            got = threads.spent(first, threads.snapshot({"me": [os.getpid()]}))
            if got.get(("me", "spinner"), threads.Times()).cpu_ns >= 50_000_000:
                break
            stop.wait(0.01)
    finally:
        stop.set()
        spinner.join(10)
    assert got[("me", "spinner")].cpu_ns >= 50_000_000
    assert got[("me", "spinner")].threads == 1
