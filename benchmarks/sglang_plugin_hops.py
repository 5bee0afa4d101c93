"""Where one request's time goes inside kvbroker's SGLang plugin (issue 20, item 5): an in-process
timing harness, not a test. A prefill and a decode rank (SGLang's MiniMax pool, the tests' ranks) on
two real brokers; each request is decode's metadata, then prefill's one send() of all its pages,
driven as SGLang's schedulers drive them (poll() in a loop). The plugin's steps are timestamped by
wrapping its own methods on the two managers, and the medians printed as offsets from send_metadata.

    scripts/in-netns.sh .venv/bin/python -m benchmarks.sglang_plugin_hops [--requests 30] [--backend nixl]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections import defaultdict

from kvbroker_tools.serving.cpu_torchvision import declare_torchvision_ops

declare_torchvision_ops()

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ["SGLANG_PLUGINS"] = "kvbroker"


CURRENT: dict[str, int] = {}  # the request being timed: a late event of the one before is not its


def _ours(args) -> bool:
    room = CURRENT.get("room")
    return any(isinstance(a, (int, str)) and a in (room, str(room)) for a in args)


def _timed(marks: dict, name: str, fn, *, when=None, by_room: bool = True):
    def wrapper(*args, **kwargs):
        if (not by_room or _ours(args)) and (when is None or when(*args, **kwargs)):
            marks.setdefault(name, time.perf_counter())
        return fn(*args, **kwargs)

    return wrapper


def _timed_async(marks: dict, name: str, fn):
    async def wrapper(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
        finally:
            if _ours(args):
                marks.setdefault(name, time.perf_counter())

    return wrapper


async def main(requests: int, backend: str) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.plugins import load_plugins

    from kvbroker_client.adapter import Phase
    from kvbroker_sglang.conn import KvbrokerKVReceiver, KvbrokerKVSender
    from kvbroker_tools.launch import start_broker, start_brokers
    from tests.support import sglang_ranks as ranks
    from tests.support.sglang_pair import (
        PAGES,
        PREFILL_AUX,
        PREFIX_PAGES,
        fill_prefill_aux,
        make_pair,
        new_request,
        send_decode_metadata,
    )
    from tests.support.sglang_ranks import Ranks, broker_flags

    load_plugins()
    flags = broker_flags(backend)
    prefill_broker, decode_broker = await start_brokers(start_broker("hops-prefill", *flags),
                                                        start_broker("hops-decode", *flags))
    made = None
    try:
        with ranks.SGLangProcess(ranks.free_port()) as process:
            made = Ranks(process)
            pair = await make_pair(made, prefill_broker.listen, decode_broker.listen)
            marks: dict[str, float] = {}
            p, d = pair.prefill, pair.decode
            p._on_metadata = _timed(marks, "prefill: metadata frame handled", p._on_metadata, by_room=False)
            p.on_request_change = _timed(marks, "prefill: broker's SUCCEEDED applied", p.on_request_change,
                                         when=lambda room, r: r.phase is Phase.SUCCEEDED)
            d.on_request_change = _timed(marks, "decode: broker's SUCCEEDED applied", d.on_request_change,
                                         when=lambda room, r: r.phase is Phase.SUCCEEDED)
            pushing = KvbrokerKVReceiver.push_to_prefill
            KvbrokerKVReceiver.push_to_prefill = _timed(marks, "decode: frame pushed (thread)", pushing, by_room=False)
            dc, pc = d.link.client, p.link.client
            dc.expect_transfer = _timed_async(marks, "decode: ExpectTransfer returned", dc.expect_transfer)
            pc.transfer_part = _timed(marks, "prefill: Transfer part called (loop)", pc.transfer_part)
            pc.transfer_part = _timed_async(marks, "prefill: Transfer part returned", pc.transfer_part)
            samples: dict[str, list[float]] = defaultdict(list)

            def one(i: int) -> None:
                request = new_request(100 + i)
                sender = KvbrokerKVSender(p, pair.bootstrap, request.room)
                receiver = KvbrokerKVReceiver(d, pair.bootstrap, request.room)

                class Polled:  # send_decode_metadata's until() polls it as the scheduler does
                    side = receiver

                    def until(self, *targets, timeout=30.0):
                        deadline = time.monotonic() + timeout
                        while (value := receiver.poll()) not in targets:
                            assert time.monotonic() < deadline
                            time.sleep(0.0002)
                        return value

                marks.clear()
                CURRENT["room"] = request.room
                t0 = time.perf_counter()
                send_decode_metadata(pair, request, Polled())
                marks["decode: send_metadata returned"] = time.perf_counter()
                while sender.poll() != KVPoll.WaitingForInput:
                    time.sleep(0.0002)
                marks["prefill: WaitingForInput polled"] = time.perf_counter()
                sender.init(PAGES - PREFIX_PAGES, PREFILL_AUX)
                fill_prefill_aux(pair, request.room)
                from sglang.srt.disaggregation.minimax import minimax_index_transfer_pages

                prefix = PREFIX_PAGES * ranks.PAGE_SIZE
                index = minimax_index_transfer_pages(request.token_indices(request.prefill_pages),
                                                     page_size=ranks.PAGE_SIZE, prefix_len=prefix)
                marks["prefill: send() called"] = time.perf_counter()
                sender.send(request.prefill_pages[PREFIX_PAGES:].astype("int32"),
                            [index, request.prefill_pages.astype("int32")])
                while sender.poll() not in (KVPoll.Success, KVPoll.Failed):
                    time.sleep(0.0002)
                marks["prefill: Success polled"] = time.perf_counter()
                while receiver.poll() not in (KVPoll.Success, KVPoll.Failed):
                    time.sleep(0.0002)
                marks["decode: Success polled"] = time.perf_counter()
                assert receiver.poll() == KVPoll.Success
                for name, at in marks.items():
                    samples[name].append((at - t0) * 1e3)
                sender.clear(), receiver.clear()

            for i in range(requests):
                await asyncio.to_thread(one, i)
            medians = {name: round(statistics.median(v), 3) for name, v in samples.items()}
            return {"backend": backend, "requests": requests,
                    "median_ms_after_send_metadata": dict(sorted(medians.items(), key=lambda kv: kv[1]))}
    finally:
        if made is not None:
            await asyncio.to_thread(made.close)
        await asyncio.gather(prefill_broker.stop(), decode_broker.stop())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--backend", default="nixl")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.requests, args.backend)), indent=2))
