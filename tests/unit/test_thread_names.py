"""The daemon's pool threads carry their Python names as kernel names (kvbroker.ops.thread_names), so
`top -H` and the bench's per-thread figures tell them from the engines' threads."""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path

from kvbroker.ops.thread_names import kernel_name, name_this_thread


def test_a_long_name_keeps_its_number_within_fifteen_bytes():
    assert kernel_name("nixl_0") == b"nixl_0"
    assert kernel_name("mooncake-write_3") == b"mooncake-writ_3"
    assert kernel_name("kvbroker-health_12") == b"kvbroker-hea_12"
    assert kernel_name("a-very-long-thread-name") == b"a-very-long-thr"
    assert all(len(kernel_name(n)) <= 15 for n in ("x" * 40 + "_1234567", "_" * 30))


def test_a_pool_thread_takes_its_python_name_in_the_kernel():
    def comm() -> tuple[str, str]:
        return threading.current_thread().name, Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text()

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mooncake-write",
                                               initializer=name_this_thread) as pool:
        python_name, kernel = pool.submit(comm).result(timeout=30)
    assert python_name == "mooncake-write_0"
    assert kernel.strip() == "mooncake-writ_0"
