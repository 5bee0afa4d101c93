"""`kvbroker bench --quick --json` runs every section end to end and reports well-formed JSON.

Timings are never asserted: the machine is shared. Runs inside the suite's loopback-only namespace.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


async def test_quick_bench_completes_with_every_section_in_its_json():
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvbroker", "bench", "--quick", "--json", cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(child.communicate(), 240)
    finally:
        if child.returncode is None:
            child.terminate()  # the bench stops its brokers and releases its shared memory on SIGTERM
            await child.wait()
    assert child.returncode == 0, err.decode(errors="replace")[-4000:]
    report = json.loads(out)

    assert {"meta", "plan", "backends", "data_plane", "control_plane", "planner", "registration", "targets",
            "errors"} <= report.keys()
    assert report["quick"] is True and report["errors"] == []
    cases = report["data_plane"]["cases"]
    assert {c["backend"] for c in cases} == set(report["backends"])
    assert {c["pattern"] for c in cases} == {"contiguous", "runs16", "scattered"}
    for case in cases:
        assert {"size_mib", "pages", "layers", "page_size_tokens", "bytes", "runs", "descriptors",
                "broker_gbps", "direct_gbps", "direct2_gbps", "ratio", "ratio_vs_direct2"} <= case.keys()
        assert case["verified"], case
    assert {m["size_mib"] for m in report["data_plane"]["memcpy"]} == {c["size_mib"] for c in cases}
    for run in report["control_plane"]["runs"]:
        assert {"backend", "client_loop", "concurrency", "requests_per_s", "transfer_ms"} <= run.keys()
        assert {"p50", "p99"} <= run["transfer_ms"].keys()
    assert {r["client_loop"] for r in report["control_plane"]["runs"]} == {"uvloop", "asyncio"}
    assert all("plan_runs_ids_per_s" in row for row in report["planner"]["rows"])
    assert {r["backend"] for r in report["registration"]["rows"]} == set(report["backends"])
    for verdict in report["targets"]:
        assert {"target", "subject", "figure", "threshold", "met"} <= verdict.keys()
