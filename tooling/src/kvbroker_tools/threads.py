"""Each process's threads: CPU and run-queue delay, from the kernel's scheduler statistics.

`/proc/<pid>/task/<tid>/schedstat` holds three numbers per thread: nanoseconds on a CPU, nanoseconds
runnable but waiting for one (the run-queue delay) and the slices it ran. A snapshot reads them for
every thread of the processes it is given, grouped by process role and thread name (`comm` with its
trailing number dropped: `mooncake-write_0` and `mooncake-write_3` are one group, `mooncake-write`;
a process's first thread is `main`: a broker's event loop; kvbroker.ops.thread_names names the
broker's pools for the kernel, so the threads left as `python` are the engines' own);
`spent` is what each group took between two snapshots. A thread that ended between them is missed
(its numbers go with it); one that started counts from zero.

On a machine with more runnable threads than cores, the run-queue delay is the time the request's work
waited for a core: what an extra thread woken per request, or a server spinning beside it, costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
_NUMBERED = re.compile(r"[-_:. ]?\d+$")


@dataclass
class Times:
    cpu_ns: int = 0
    wait_ns: int = 0
    slices: int = 0
    threads: int = 0

    def add(self, other: Times) -> None:
        self.cpu_ns += other.cpu_ns
        self.wait_ns += other.wait_ns
        self.slices += other.slices
        self.threads += other.threads


Snapshot = dict[tuple[str, str], dict[int, Times]]  # (role, thread group) -> tid -> its times


def group_of(comm: str) -> str:
    """A thread's group: its name without a trailing number (`grpc_global_tim` stays itself)."""
    return _NUMBERED.sub("", comm) or comm


def processes_of_group(pgid: int, proc: Path = PROC) -> list[int]:
    """The pids of process group `pgid` (a server and the processes it started)."""
    pids = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:  # field 5, pgrp
                    pids.append(int(entry.name))
    return pids


def snapshot(processes: Mapping[str, Iterable[int]], proc: Path = PROC) -> Snapshot:
    """Every thread of each role's processes, now. A process or thread that ends while it is read is skipped."""
    taken: Snapshot = {}
    for role, pids in processes.items():
        for pid in pids:
            for task in _tasks(proc / str(pid)):
                with contextlib.suppress(OSError, ValueError):
                    comm = (task / "comm").read_text().strip()
                    cpu, wait, slices = (int(x) for x in (task / "schedstat").read_text().split()[:3])
                    group = "main" if task.name == str(pid) else group_of(comm)  # the event loop's, in a broker
                    taken.setdefault((role, group), {})[int(task.name)] = Times(cpu, wait, slices, 1)
    return taken


def _tasks(process: Path) -> list[Path]:
    try:
        return list((process / "task").iterdir())
    except OSError:  # it ended
        return []


def spent(first: Snapshot, last: Snapshot) -> dict[tuple[str, str], Times]:
    """Per (role, thread group), what its threads took between two snapshots; `threads` counts those in
    `last`."""
    out: dict[tuple[str, str], Times] = {}
    for key, threads in last.items():
        before = first.get(key, {})
        total = out.setdefault(key, Times())
        for tid, now in threads.items():
            was = before.get(tid, Times())
            total.add(Times(now.cpu_ns - was.cpu_ns, now.wait_ns - was.wait_ns, now.slices - was.slices, 1))
    return out


async def over(begin: float, end: float, processes: Mapping[str, Iterable[int]]) -> dict[tuple[str, str], Times]:
    """What each role's thread groups took between loop times `begin` and `end` (a bench window)."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, begin - loop.time()))
    first = await asyncio.to_thread(snapshot, processes)
    await asyncio.sleep(max(0.0, end - loop.time()))
    return spent(first, await asyncio.to_thread(snapshot, processes))


def accumulate(into: dict[tuple[str, str], Times], more: Mapping[tuple[str, str], Times]) -> None:
    """Add the times of one window to those of earlier ones; `threads` keeps the largest count seen."""
    for key, times in more.items():
        total = into.setdefault(key, Times())
        threads = max(total.threads, times.threads)
        total.add(times)
        total.threads = threads


def per_request(times: Mapping[tuple[str, str], Times], requests: int, top: int = 6) -> dict:
    """Per role: CPU and run-queue delay per request in ms, threads, and its `top` thread groups by CPU
    (the rest summed as `other`; a tie by name)."""
    n = max(requests, 1)
    roles: dict[str, list[tuple[str, Times]]] = {}
    for (role, group), t in times.items():
        roles.setdefault(role, []).append((group, t))
    out: dict = {}
    for role, groups in sorted(roles.items()):
        groups.sort(key=lambda g: (-g[1].cpu_ns, g[0]))
        whole = Times()
        for _, t in groups:
            whole.add(t)
        shown = {group: _row(t, n) for group, t in groups[:top] if t.cpu_ns or t.wait_ns}
        rest = Times()
        for _, t in groups[top:]:
            rest.add(t)
        if rest.threads:
            shown["other"] = _row(rest, n)
        out[role] = {**_row(whole, n), "groups": shown}
    return out


def _row(t: Times, n: int) -> dict:
    return {"cpu_ms": round(t.cpu_ns / n / 1e6, 4), "wait_ms": round(t.wait_ns / n / 1e6, 4),
            "slices": round(t.slices / n, 2), "threads": t.threads}
