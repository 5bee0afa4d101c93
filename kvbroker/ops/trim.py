"""Memory handed back to the system after big requests: `MemoryTrim`, which admission.py tells of
every request it reads.

Two things keep what a flood of big requests took. First, a refused request stays alive in a
reference cycle: grpc keeps the AbortError of `context.abort` on the call's state, and its traceback
holds the handler's frames, the request and the context, which holds the state. Only the cyclic
collector frees it, and it rarely runs a full collection: it counts Python objects, and a 3 MiB
request is one. (Admission now strips that traceback as the error leaves the handler,
admission._bare: the peak of the flood below fell from 1.2-1.4 GiB to about 400 MiB over the
baseline; the collection here is for what else may hold a request.) Measured on a NIXL broker before
that (baseline 293 MiB VmRSS, glibc's malloc_stats): 48 ClaimGrants of 1M page ids naming no engine,
each refused NOT_FOUND, left 177 MiB in use until gc.collect(). Second, glibc keeps freed memory:
its heaps shrink only from the top, and its dynamic mmap threshold (raised to 32 MiB by the first
big free) puts later big buffers on the heaps too. The same broker after 16 concurrent callers sent
3 rounds of 55, 9 and 3 MiB ClaimGrants, then of 11 MiB OfferGrants, all refused, stayed at 848-982
MiB; with MALLOC_ARENA_MAX=2 or 1, or a fixed MALLOC_MMAP_THRESHOLD_, at 540-620 MiB; gc.collect()
and malloc_trim(0) brought it back to 307-321 MiB. So once requests of TRIM_AFTER_BYTES or more have
stopped for TRIM_INTERVAL_S (or have gone on for TRIM_MAX_WAIT_S), a full collection runs on the
event loop and malloc_trim(0) in a worker thread. Without glibc (musl) only the collection runs.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger(__name__)

TRIM_AFTER_BYTES = 1 << 20
TRIM_INTERVAL_S = 1.0
TRIM_MAX_WAIT_S = 10.0


def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class TrimPolicy:
    """When to trim, from the times of big requests alone: TRIM_INTERVAL_S after the last one, and
    at least every TRIM_MAX_WAIT_S while they go on. Pure: times are seconds of any one clock."""

    def __init__(self, interval_s: float = TRIM_INTERVAL_S, max_wait_s: float = TRIM_MAX_WAIT_S) -> None:
        self._interval_s = interval_s
        self._max_wait_s = max_wait_s
        self._first: float | None = None  # the first big request since the last trim began; None: none waits
        self._last = 0.0

    def note(self, now: float) -> float | None:
        """A big request at `now`: when to look first (`due`), if no look is pending yet."""
        self._last = now
        if self._first is not None:
            return None
        self._first = now
        return now + self._interval_s

    def due(self, now: float) -> float | None:
        """At a look: None to trim now (a trim begins; the requests noted so far are its), else when to
        look again."""
        assert self._first is not None, "a look is asked for only while a big request waits (note)"
        quiet_at = self._last + self._interval_s
        longest_at = self._first + self._max_wait_s
        if now < quiet_at and now < longest_at:
            return min(quiet_at, longest_at)
        self._first = None
        return None

    def waiting(self) -> float | None:
        """When to look, if big requests noted since the last trim began wait for one; else None."""
        return None if self._first is None else self._last + self._interval_s


class MemoryTrim:
    """Trims TRIM_INTERVAL_S after the last big request, and at least every TRIM_MAX_WAIT_S while they go
    on (TrimPolicy), on the running loop's clock and timers."""

    def __init__(self, interval_s: float = TRIM_INTERVAL_S, after_bytes: int = TRIM_AFTER_BYTES,
                 max_wait_s: float = TRIM_MAX_WAIT_S) -> None:
        self._trim = _malloc_trim()
        self._after_bytes = after_bytes
        self._policy = TrimPolicy(interval_s, max_wait_s)
        self._scheduled: asyncio.TimerHandle | asyncio.Task | None = None
        self.trims = 0

    def note(self, nbytes: int) -> None:
        """A request of `nbytes` was read; called on the event loop."""
        if nbytes < self._after_bytes:
            return
        loop = asyncio.get_running_loop()
        look_at = self._policy.note(loop.time())
        if look_at is not None and self._scheduled is None:
            self._scheduled = loop.call_at(look_at, self._due)

    def _due(self) -> None:
        loop = asyncio.get_running_loop()
        look_at = self._policy.due(loop.time())
        if look_at is not None:
            self._scheduled = loop.call_at(look_at, self._due)
            return
        self._scheduled = loop.create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        collected = gc.collect()  # on the loop: finalizers of grpc's objects belong there
        try:
            if self._trim is not None:
                await asyncio.to_thread(self._trim, 0)
            self.trims += 1
        except Exception as exc:  # never worth failing anything for
            log.debug("malloc_trim: %s", exc)
        log.debug("memory trimmed after big requests", extra={"collected": collected,
                                                                "collect_s": round(loop.time() - began, 4)})
        self._scheduled = None
        look_at = self._policy.waiting()  # big requests came while it ran
        if look_at is not None:
            self._scheduled = loop.call_at(look_at, self._due)

    def close(self) -> None:
        if self._scheduled is not None:
            self._scheduled.cancel()
            self._scheduled = None
