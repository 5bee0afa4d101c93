"""benchmarks/serving.py's median timeline: each TTFT sample matched to its room by time, its steps in
ms from its own post, repeated steps one row per occurrence, the median per row."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from kvbroker_tools.serving.compare import Series

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serving.py"
_spec = importlib.util.spec_from_file_location("serving_bench", SCRIPT)
serving = importlib.util.module_from_spec(_spec)
sys.modules["serving_bench"] = serving
_spec.loader.exec_module(serving)


def request(room: str, post: float, metadata_ms: float, part_ms: list[float], success_ms: float) -> list[dict]:
    at = lambda ms: post + ms / 1000  # noqa: E731
    events = [{"t": at(metadata_ms), "pid": 1, "event": "decode.send_metadata", "key": room}]
    for i, ms in enumerate(part_ms):
        events.append({"t": at(ms), "pid": 2, "event": "client.transfer_part", "key": room, "phase": "begin",
                       "last": i == len(part_ms) - 1})
    events.append({"t": at(success_ms), "pid": 1, "event": "decode.status", "key": room, "state": "Success"})
    return events


def test_each_sample_is_timed_from_its_own_post_and_each_step_is_its_median():
    # kvbroker samples at 100 s and 300 s, mooncake's (not in this trace) between them at 200 s
    events = request("11", 100.0, 5.0, [20.0, 30.0, 40.0], 50.0) + request("22", 300.0, 7.0, [22.0, 36.0], 60.0)
    series = {"kvbroker-nixl": Series([0.080, 0.100], [[1], [1]], [100.0, 300.0]),
              "mooncake": Series([0.070, 0.090], [[1], [1]], [200.0, 400.0])}
    got = serving.median_timeline(sorted(events, key=lambda e: e["t"]), series)
    assert list(got) == ["kvbroker-nixl", "mooncake"]
    assert (got["mooncake"]["samples"], got["mooncake"]["traced"]) == (2, 0)
    steps = {s["step"]: (s["median_ms"], s["samples"]) for s in got["kvbroker-nixl"]["steps"]}
    assert got["kvbroker-nixl"]["traced"] == 2
    assert steps["decode.send_metadata"] == (6.0, 2)
    assert steps["client.transfer_part (not last) begin"] == (21.0, 2)
    assert steps["client.transfer_part (not last) begin #2"] == (30.0, 1)  # only the first request had three parts
    assert steps["client.transfer_part (last) begin"] == (38.0, 2)
    assert steps["decode.status Success"] == (55.0, 2)
    assert steps["client.first_token"] == (90.0, 2)


def test_mooncake_samples_are_timed_at_the_steps_they_share():
    events = request("33", 200.0, 4.0, [], 30.0)
    events.append({"t": 200.012, "pid": 3, "event": "prefill.send", "key": "33", "last": True})
    series = {"kvbroker-nixl": Series([0.080], [[1]], [100.0]), "mooncake": Series([0.050], [[1]], [200.0])}
    got = serving.median_timeline(sorted(events, key=lambda e: e["t"]), series)
    steps = {s["step"]: s["median_ms"] for s in got["mooncake"]["steps"]}
    assert got["mooncake"]["traced"] == 1 and got["kvbroker-nixl"]["traced"] == 0
    assert steps == {"decode.send_metadata": 4.0, "prefill.send (last)": 12.0, "decode.status Success": 30.0,
                     "client.first_token": 50.0}


def test_a_sample_whose_room_is_not_in_the_trace_is_left_out():
    events = request("11", 100.0, 5.0, [20.0], 50.0)
    series = {"kvbroker-nixl": Series([0.080, 0.100], [[1], [1]], [100.0, 300.0])}
    got = serving.median_timeline(events, series)["kvbroker-nixl"]
    assert (got["samples"], got["traced"]) == (2, 1)
    assert {s["step"]: s["median_ms"] for s in got["steps"]}["client.first_token"] == 80.0


def test_each_sample_says_when_decode_waited_succeeded_and_streamed_and_what_collected_inside_it():
    events = request("11", 100.0, 5.0, [20.0], 50.0)
    events += [{"t": 100.003, "pid": 1, "event": "decode.status", "key": "11", "state": "WaitingForInput"},
               {"t": 100.045, "pid": 2, "event": "server.stream_output", "key": "11,12"},  # prefill's
               {"t": 100.052, "pid": 1, "event": "server.stream_output", "key": "11"},  # decode's
               {"t": 100.060, "pid": 4, "event": "gc", "key": "", "ms": 7.5, "generation": 2},
               {"t": 100.090, "pid": 4, "event": "gc", "key": "", "ms": 9.0, "generation": 2}]  # after its TTFT
    series = {"kvbroker-nixl": Series([0.080], [[1]], [100.0])}
    got = serving.median_timeline(sorted(events, key=lambda e: e["t"]), series)["kvbroker-nixl"]
    assert got["each"] == [{"ttft_ms": 80.0, "waiting_ms": 3.0, "success_ms": 50.0, "decode_streamed_ms": 52.0,
                            "gc": [{"at_ms": 60.0, "ms": 7.5, "pid": 4}]}]
