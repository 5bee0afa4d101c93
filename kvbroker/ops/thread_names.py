"""The kernel's name for each of the daemon's own threads.

Python 3.11 keeps a thread's name to itself: `top -H`, `ps -L`, /proc/<pid>/task/<tid>/comm and the
benchmark's per-thread CPU and run-queue figures (kvbroker_tools.threads) see every thread of the
broker as `python`, ours and the engines' alike. `name_this_thread` gives the calling thread its Python name
(`nixl_0`, `mooncake-write_2`) as its kernel name, cut to the kernel's 15 bytes keeping its number:
the initializer of the daemon's pools, and the last step of an engine's construction on its
thread (a thread starts with its creator's kernel name, so the engine's own threads stay `python`).
Best effort: where prctl is missing, the thread keeps the name it had.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import threading

_PR_SET_NAME = 15
_KERNEL_NAME_BYTES = 15


def kernel_name(name: str) -> bytes:
    """`name` as the kernel keeps it: at most 15 bytes, a trailing `_<number>` kept whole."""
    raw = name.encode(errors="replace")
    if len(raw) <= _KERNEL_NAME_BYTES:
        return raw
    head, sep, number = name.rpartition("_")
    if sep and number.isdigit() and len(number) < _KERNEL_NAME_BYTES - 1:
        return head.encode(errors="replace")[:_KERNEL_NAME_BYTES - len(number) - 1] + b"_" + number.encode()
    return raw[:_KERNEL_NAME_BYTES]


def name_this_thread() -> None:
    """Give the calling thread its Python name as its kernel name."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux, or no prctl
        return
    prctl(_PR_SET_NAME, ctypes.c_char_p(kernel_name(threading.current_thread().name)), 0, 0, 0)


def named_pool(threads: int, prefix: str) -> concurrent.futures.ThreadPoolExecutor:
    """A thread pool whose threads carry `prefix_<n>` as their kernel names."""
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=prefix, initializer=name_this_thread)
