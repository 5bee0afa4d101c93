"""Opt-in timestamps of one request's steps, from every process it crosses: for the serving benchmark's
timeline (where kvbroker's milliseconds go). Nothing of the daemon or the plugin changes: with
KVBROKER_SERVING_TRACE=<dir> the site dir's sitecustomize calls `install()` in each server and broker
process, which wraps the functions below as their modules are imported (patches.after_import) and
appends one JSON line per call, `{"t": unix seconds, "pid", "event", "key", ...}`, to `<dir>/<pid>.jsonl`.
`key` is the request: SGLang's bootstrap room, which the plugin uses as the broker's request id.

Events, in a request's order:
    decode.send_metadata      decode's receiver sends its metadata (KvbrokerKVReceiver.send_metadata)
    client.expect_transfer    decode's ExpectTransfer call, begin and end (BrokerClient.expect_transfer)
    broker.expect             decode broker: the grant accepted (Receiver.expect)
    broker.offer              prefill broker: decode's offer received (OfferIntake.receive_offer)
    prefill.metadata          prefill's KV manager takes decode's metadata frame (KvbrokerKVManager._on_metadata)
    prefill.send              SGLang hands prefill's KV manager a chunk to send (add_transfer_request)
    client.transfer_part      each part's Transfer call on prefill, begin and end (BrokerClient.transfer_part)
    broker.part               prefill broker: each part written and noticed, begin and end (PartSender.send_part)
    broker.notice             decode broker: part notices taken (Receiver.take_notices), begin and end
    broker.reply              either broker: a status written to its client's Exchange stream (a command's
                              reply or a watch update), with its state
    client.reply              either server's client: that status read off its Exchange stream
    decode.applied            decode's plugin takes a state from its broker (watch or part reply), before
    prefill.applied           SGLang's poll can see it (KvbrokerKVManager.on_request_change)
    decode.status             decode's receiver: its poll() state, each time it changes (KvbrokerKVReceiver.poll)
    server.stream_output      either server's scheduler streams the request's first token to its
                              detokenizer (SchedulerOutputStreamer.stream_output; both backends)

And in every traced process, `gc`: a garbage collection of at least 2 ms (`ms`, `generation`; no key),
written with the process's next event.

SGLang's own mooncake backend is traced at the same steps where it has them (decode.send_metadata,
prefill.metadata as its bootstrap thread parses the frame, prefill.send, prefill.applied and
decode.applied as its manager's status moves to Transferring, Success or Failed, decode.status), so
that the two timelines can be read side by side.

`read(dir)` gathers every process's lines, sorted by time.
"""

from __future__ import annotations

import collections
import functools
import gc
import inspect
import json
import os
import threading
import time
from pathlib import Path

from kvbroker_tools.serving.patches import after_import

_lock = threading.Lock()
_file = None


def _emit(event: str, key, **fields) -> None:
    global _file
    line = json.dumps({"t": time.time(), "pid": os.getpid(), "event": event, "key": str(key), **fields},
                      default=str)
    with _lock:
        if _file is None:
            directory = Path(os.environ["KVBROKER_SERVING_TRACE"])
            directory.mkdir(parents=True, exist_ok=True)
            _file = open(directory / f"{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115  the process's
        while _collections:
            started, ms, generation = _collections.popleft()
            _file.write(json.dumps({"t": started, "pid": os.getpid(), "event": "gc", "key": "", "ms": ms,
                                    "generation": generation}) + "\n")
        _file.write(line + "\n")


_GC_MS = 2.0  # collections at least this long are events
_collections: collections.deque = collections.deque(maxlen=1000)
_gc_started = [0.0]


def _gc(phase: str, info: dict) -> None:
    """A long collection, kept until the next event writes it (a callback that wrote could re-enter _emit)."""
    if phase == "start":
        _gc_started[0] = time.time()
    elif (ms := (time.time() - _gc_started[0]) * 1000) >= _GC_MS:
        _collections.append((_gc_started[0], round(ms, 2), info.get("generation")))


def _wrap(cls, name: str, event: str, key, *, span: bool = False, fields=None) -> None:
    """Wrap `cls.name`: an event at each call (with `span`, one at its begin and one at its end);
    `key(args, kwargs)` names the request (None: no event), `fields(args, kwargs)` adds to the line."""
    original = getattr(cls, name)

    def note(phase, args, kwargs):
        try:
            if (request := key(args, kwargs)) is None:
                return
            extra = fields(args, kwargs) if fields else {}
            _emit(event, request, **({"phase": phase} if span else {}), **extra)
        except Exception as exc:  # a trace never breaks the request it watches
            _emit("trace.error", "", where=event, error=repr(exc))

    if inspect.iscoroutinefunction(original):
        @functools.wraps(original)
        async def traced(*args, **kwargs):
            note("begin", args, kwargs)
            try:
                return await original(*args, **kwargs)
            finally:
                if span:
                    note("end", args, kwargs)
    else:
        @functools.wraps(original)
        def traced(*args, **kwargs):
            note("begin", args, kwargs)
            try:
                return original(*args, **kwargs)
            finally:
                if span:
                    note("end", args, kwargs)
    setattr(cls, name, traced)


def _arg(position: int, name: str):
    def get(args, kwargs):
        return kwargs[name] if name in kwargs else args[position]
    return get


def _states() -> dict:
    """SGLang's KVPoll values by name, for the lines."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    return {getattr(KVPoll, n): n for n in ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success")}


def _side(manager) -> str:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return "decode" if manager.disaggregation_mode == DisaggregationMode.DECODE else "prefill"


def _shared_steps(receiver, manager) -> None:
    """The steps both backends have under the same names: decode.send_metadata, prefill.send and
    decode.status (each change of the receiver's poll() state, as SGLang's scheduler sees it)."""
    _wrap(receiver, "send_metadata", "decode.send_metadata", lambda a, k: a[0].bootstrap_room)
    _wrap(manager, "add_transfer_request", "prefill.send", _arg(1, "bootstrap_room"),
          fields=lambda a, k: {"last": bool(k["is_last_chunk"] if "is_last_chunk" in k else a[4])})
    names, seen, original = _states(), {}, receiver.poll

    @functools.wraps(original)
    def poll(self):
        state = original(self)
        room = self.bootstrap_room
        if seen.get(room) != state:
            seen[room] = state
            _emit("decode.status", room, state=names.get(state, str(state)))
        return state

    receiver.poll = poll


def _plugin(module) -> None:
    receiver, prefill = module.KvbrokerKVReceiver, module.PrefillKVManager
    _shared_steps(receiver, prefill)
    _wrap(prefill, "_on_metadata", "prefill.metadata", lambda a, k: a[1].room,
          fields=lambda a, k: {"decode_prefix_len": a[1].decode_prefix_len})
    manager = module.KvbrokerKVManager
    changing = manager.on_request_change

    @functools.wraps(changing)
    def on_request_change(self, room, request):
        _emit(f"{_side(self)}.applied", room, state=_BROKER_STATE.get(request.phase.name, request.phase.name))
        return changing(self, room, request)

    manager.on_request_change = on_request_change


_BROKER_STATE = {"WAITING": "PENDING"}  # the adapter core's phases, named as the broker's states


def _mooncake(module) -> None:
    """SGLang's own mooncake backend, at the steps that match the plugin's, so that both timelines read alike."""
    receiver, manager = module.MooncakeKVReceiver, module.MooncakeKVManager
    _shared_steps(receiver, manager)
    parse = module.TransferInfo.from_zmq.__func__

    def from_zmq(cls, msg):  # decode's metadata frame, as prefill's bootstrap thread takes it
        info = parse(cls, msg)
        _emit("prefill.metadata", info.room)
        return info

    module.TransferInfo.from_zmq = classmethod(from_zmq)
    names, updating = _states(), manager.update_status
    ended = {name for state, name in names.items() if name in ("Transferring", "Success", "Failed")}

    @functools.wraps(updating)
    def update_status(self, bootstrap_room, status):
        if names.get(status) in ended:
            _emit(f"{_side(self)}.applied", bootstrap_room, state=names[status])
        return updating(self, bootstrap_room, status)

    manager.update_status = update_status


def _client(module) -> None:
    request_id = _arg(2, "request_id")
    _wrap(module.BrokerClient, "expect_transfer", "client.expect_transfer", request_id, span=True)
    _wrap(module.BrokerClient, "transfer_part", "client.transfer_part", request_id, span=True,
          fields=lambda a, k: {"last": k.get("last", True)})


def _broker_receiver(module) -> None:
    _wrap(module.Receiver, "expect", "broker.expect", lambda a, k: a[1].request_id)
    _wrap(module.Receiver, "take_notices", "broker.notice", lambda a, k: ",".join(n.request_id for n in a[2]),
          fields=lambda a, k: {"parts": [n.part for n in a[2]]}, span=True)


def _reply_status(reply):
    """The status an ExchangeResponse carries, or None (a pong, an error)."""
    kind = reply.WhichOneof("reply")
    return getattr(reply, kind).status if kind in ("transfer", "expect", "watch") else None


def _exchange_server(module) -> None:
    def key(args, kwargs):
        status = _reply_status(args[1])
        return "" if status is None else status.request_id

    def fields(args, kwargs):
        status, reply = _reply_status(args[1]), args[1]
        return {"kind": reply.WhichOneof("reply"), "state": None if status is None else status.state}

    _wrap(module._Stream, "_write", "broker.reply", key, fields=fields)


def _exchange_client(module) -> None:
    """Each status read off a client's Exchange stream, as its reader task takes it."""
    from grpc.aio import _call

    reading = _call.StreamStreamCall.read

    @functools.wraps(reading)
    async def read(self):
        message = await reading(self)
        if isinstance(message, module.bpb.ExchangeResponse) and (status := _reply_status(message)) is not None:
            _emit("client.reply", status.request_id, kind=message.WhichOneof("reply"), state=status.state)
        return message

    _call.StreamStreamCall.read = read


def _broker_intake(module) -> None:
    _wrap(module.OfferIntake, "receive_offer", "broker.offer", lambda a, k: a[2].request_id)


def _broker_sender(module) -> None:
    _wrap(module.PartSender, "send_part", "broker.part", lambda a, k: a[1].request_id, span=True)


def _streamer(module) -> None:
    """Either server's scheduler hands a request's first token to its detokenizer (on decode, the
    first step after Success); the later steps' calls are no event."""
    def first(args, kwargs):
        reqs = kwargs["reqs"] if "reqs" in kwargs else args[1]
        return ",".join(str(r.bootstrap_room) for r in reqs if len(r.output_ids) <= 1) or None

    _wrap(module.SchedulerOutputStreamer, "stream_output", "server.stream_output", first)


def install() -> None:
    gc.callbacks.append(_gc)
    after_import("sglang.srt.managers.scheduler_components.output_streamer", _streamer)
    after_import("kvbroker_sglang.conn", _plugin)
    after_import("sglang.srt.disaggregation.mooncake.conn", _mooncake)
    after_import("kvbroker_client.client", _client)
    after_import("kvbroker.flows.receiver", _broker_receiver)
    after_import("kvbroker.flows.offer_intake", _broker_intake)
    after_import("kvbroker.flows.part_sender", _broker_sender)
    after_import("kvbroker.edge.exchange", _exchange_server)
    after_import("kvbroker_client.exchange", _exchange_client)


def read(directory: Path) -> list[dict]:
    """Every process's events, oldest first."""
    events = []
    for path in Path(directory).glob("*.jsonl"):
        events += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(events, key=lambda e: e["t"])
