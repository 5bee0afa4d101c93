"""tooling/src/kvbroker_tools/serving/trace.py: a wrapped call is one line naming its request, a call that names
none is no line, and a long garbage collection is written with the process's next event."""

from __future__ import annotations

import pytest

from kvbroker_tools.serving import trace


@pytest.fixture
def traced(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBROKER_SERVING_TRACE", str(tmp_path))
    monkeypatch.setattr(trace, "_file", None)
    monkeypatch.setattr(trace, "_collections", type(trace._collections)(maxlen=10))
    yield tmp_path
    if trace._file is not None:
        trace._file.close()


class Streamer:
    def stream_output(self, reqs):
        return len(reqs)


def test_a_call_is_a_line_only_when_it_names_a_request(traced):
    class Req:
        def __init__(self, room, tokens):
            self.bootstrap_room, self.output_ids = room, [0] * tokens

    trace._wrap(Streamer, "stream_output", "server.stream_output",
                lambda a, k: ",".join(str(r.bootstrap_room) for r in a[1] if len(r.output_ids) <= 1) or None)
    assert Streamer().stream_output([Req(7, 1), Req(8, 3)]) == 2
    assert Streamer().stream_output([Req(8, 4)]) == 1  # no first token: no line
    events = trace.read(traced)
    assert [(e["event"], e["key"]) for e in events] == [("server.stream_output", "7")]


def test_a_long_collection_is_written_with_the_next_event_and_a_short_one_not_at_all(traced, monkeypatch):
    clock = iter([10.0, 10.0005, 20.0, 20.25])
    monkeypatch.setattr(trace.time, "time", lambda: next(clock))
    trace._gc("start", {"generation": 0})
    trace._gc("stop", {"generation": 0})  # 0.5 ms
    trace._gc("start", {"generation": 2})
    trace._gc("stop", {"generation": 2})  # 250 ms
    assert not list(traced.glob("*.jsonl"))  # nothing written from inside a collection
    monkeypatch.setattr(trace.time, "time", lambda: 30.0)
    trace._emit("decode.status", 5, state="Success")
    events = trace.read(traced)
    assert [(e["event"], e.get("ms"), e.get("generation"), e["t"]) for e in events] == [
        ("gc", 250.0, 2, 20.0), ("decode.status", None, None, 30.0)]
