"""`kvbroker bench --quick --json` runs every section end to end and reports well-formed JSON, with
the offered flow's rows beside the claimed flow's (control plane) and the request in parts (data plane).

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
    _assert_parts(report)
    _assert_control_plane(report)
    assert all("plan_runs_ids_per_s" in row for row in report["planner"]["rows"])
    assert {r["backend"] for r in report["registration"]["rows"]} == set(report["backends"])
    for verdict in report["targets"]:
        assert {"target", "subject", "figure", "threshold", "met"} <= verdict.keys()
    floor_verdicts = [v for v in report["targets"] if v["target"] == "p50_floor"]
    assert len(floor_verdicts) == 2 and all(v["figure"] > 0 for v in floor_verdicts)  # one per client loop
    text = err.decode()
    assert "offered" in text and "x floor" in text and "Parts:" in text  # the table shows the new rows


def _assert_parts(report: dict) -> None:
    """The request of one size as 1 part and as n parts of the offered flow, per backend and pattern,
    every one moved, checked page by page, and ended SUCCEEDED with all its parts."""
    parts = report["data_plane"]["parts"]
    assert parts["parts"] > 1 and parts["size_mib"] == report["plan"]["parts_size_mib"]
    assert {(c["backend"], c["pattern"]) for c in parts["cases"]} == {
        (b, p) for b in report["backends"] for p in ("contiguous", "runs16", "scattered")}
    for case in parts["cases"]:
        assert case["verified"], case
        assert case["parts"] == parts["parts"] and sum(case["part_pages"]) == case["pages"]
        assert len(case["one_part_s"]) == len(case["parts_s"]) == report["plan"]["repeats"]
        for key in ("one_part_gbps", "parts_gbps", "claimed_gbps", "direct2_one_gbps", "direct2_parts_gbps"):
            assert case[key] > 0, (key, case)


def _assert_control_plane(report: dict) -> None:
    """Every concurrency level has its floor and a row of each flow, without errors; the offered rows
    carry their figures against the floor and the claimed flow, and the notices per NotifyParts call."""
    control = report["control_plane"]
    runs, concurrency = control["runs"], report["plan"]["concurrency"]
    assert {r["client_loop"] for r in runs} == {"uvloop", "asyncio"}
    assert {(r["client_loop"], r["flow"], r["concurrency"]) for r in runs} == {
        (loop, flow, c) for loop in ("uvloop", "asyncio") for flow in ("claimed", "offered") for c in concurrency}
    assert {(f["client_loop"], f["concurrency"]) for f in control["rpc_floor"]} == {
        (loop, c) for loop in ("uvloop", "asyncio") for c in concurrency}
    for run in runs:
        assert {"backend", "client_loop", "concurrency", "requests_per_s", "transfer_ms"} <= run.keys()
        assert run["errors"] == 0, run["first_error"]
        assert run["requests"] > 0 and run["requests_per_s"] > 0
        for key in ("transfer_ms", "grant_ms", "request_ms"):
            assert 0 < run[key]["p50"] <= run[key]["p99"], (key, run)
        assert run["request_ms"]["p50"] >= run["transfer_ms"]["p50"]
        assert run["transfer_p50_vs_floor"] > 0 and run["requests_per_s_vs_floor"] > 0
        if run["flow"] == "offered":
            assert run["requests_per_s_vs_claimed"] > 0
            notify = run["notify"]
            assert notify["calls"] > 0 and notify["notices"] >= notify["calls"]  # at least one part notice a call
            assert notify["notices_per_call"] >= 1
