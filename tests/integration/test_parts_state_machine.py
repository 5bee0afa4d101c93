"""The offered flow's parts as a hypothesis state machine, against two real brokers on each engine.

One decode engine (canary pool) and one prefill engine (random pool), both MAIN_KV, MINIMAX_INDEX_K
and MINIMAX_DENSE_KV (parts_model.SHAPE: 16 KiB pages, so that writes take a while). An example
offers a fresh grant (a random destination page list per component; a fifth with a short
expiry), then runs up to KVBROKER_MACHINE_STEPS steps drawn from these rules:

    send_part         any part: components granted or not, one listed twice now and then; offsets
                      at the next free entry, anywhere, at or past the end; lists of any length, now
                      and then an id past the pool; last or not; aux none, small, exactly
                      max_aux_bytes, a byte over, or on a part that is not last
    send_chunk        a valid part: the next free entries of some components (dense KV whole)
    send_misplaced    a part over entries an earlier part took, past the end, or dense KV not whole
    send_overtaking   a large part and at once an empty last part, whose notice usually lands first
    send_together     two or three parts at once
    cancel            CancelTransfer on decode or on prefill, alone or among parts sent with it
    next_grant        end this grant (a live one expires or is cancelled), check it whole, offer a
                      fresh one
    expire            (short expiry) wait, through WatchTransfer, for the grant to expire, or send
                      parts back to back until the expiry ends them

The model (parts_model.GrantModel) says what each part must get; where timing decides (parts at
once, a cancel among them, an expiry) parts_model.explanations finds a serialisation of the step's
parts, and a point where the grant ended, that explains every outcome: parts begun before the end
land or fail (and may have written), parts after it are refused and write nothing. The one taken
must also fit decode's state. After every step the invariant compares the brokers with the model:
- bytes: the decode pool is the canary pool with the granted destination pages of landed parts
  written (a part that failed racing the end may have written its pages), and once the grant
  ended it stays as it was at the end: when the watcher saw it end (SUCCEEDED or FAILED), and when
  a CancelTransfer that ended it returned;
- states: decode PENDING until a part lands, TRANSFERRING until the grant ends; SUCCEEDED iff a
  last part was accepted (so every part numbered before it landed), else FAILED with the end's
  code; the sender likewise; decode's parts and pages are the landed ones; refusals change nothing;
- aux: the watcher started with the grant sees it only on its terminal status, equal to the last
  part's aux on SUCCEEDED and empty on FAILED; no other status, nor the sender's, carries it.

Hypothesis rules are synchronous and the brokers' grpc.aio channels live on the test's event loop:
the machine runs in a worker thread (asyncio.to_thread), and each step hands its coroutines to the
test's loop with asyncio.run_coroutine_threadsafe, each wrapped in asyncio.wait_for, and waits for
the result with a timeout (Loop.run). The loop stays free for the channels and the brokers' pipes; a
call that outlives its timeout is cancelled on the loop and fails the step. Nothing sleeps to order
events: ends are awaited through WatchTransfer, every wait bounded.

Examples are derandomised and not shrunk (KVBROKER_MACHINE_SHRINK=1 shrinks): KVBROKER_MACHINE_EXAMPLES
(default 24) per backend. Every draw has a fixed shape, its values mapped onto the model afterwards,
so that a replay meeting another timing draws the same.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from kvbroker_tools import shapes
from tests.support.brokers import Engine
from tests.support.flows import DENSE, M3, offer, watch_first
from tests.support.parts_model import (
    CALL_S,
    DE,
    FAILED,
    FP,
    KINDS,
    MAX_AUX,
    NAMES,
    NUM_PAGES,
    PENDING,
    SHAPE,
    SUCCEEDED,
    TERMINAL,
    TRANSFERRING,
    C,
    Explanation,
    GrantModel,
    Part,
    Verdict,
    attempt,
    code_of,
    code_value,
    explanations,
)

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("KVBROKER_MACHINE_EXAMPLES", "24"))
STEPS = int(os.environ.get("KVBROKER_MACHINE_STEPS", "10"))
# Shrinking replays examples against real brokers for minutes; KVBROKER_MACHINE_SHRINK=1 turns it on.
PHASES = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if os.environ.get("KVBROKER_MACHINE_SHRINK")
                                                          else [])
MACHINE = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, derandomize=True, database=None,
                   deadline=None, print_blob=True, phases=PHASES,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                          HealthCheck.filter_too_much])

LONG_EXPIRY_MS = 300_000  # never reached within an example
SHORT_EXPIRY_MS = (250, 400, 600)


class Loop:
    """Runs coroutines on the test's event loop from the machine's thread, each bounded."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def run(self, coro, timeout: float = CALL_S):
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self.loop)
        try:
            return future.result(timeout + 10)
        except TimeoutError:  # concurrent.futures' is the builtin: from result() or from wait_for
            if not future.done():
                future.cancel()
                raise AssertionError(f"the event loop did not answer within {timeout + 10:.0f}s") from None
            raise AssertionError(f"a call or a wait did not finish within {timeout:.0f}s") from None

    def start(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)


@dataclass
class World:
    loop: Loop
    src: Engine  # prefill, random bytes
    dst: Engine  # decode, canary
    numbers: itertools.count = field(default_factory=itertools.count)
    stats: Counter = field(default_factory=Counter)  # printed: how deep the examples reached


async def terminal(engine: Engine, request_id: str) -> pb.TransferStatus:
    """The request's terminal status, waited for through WatchTransfer (bounded by the caller)."""
    call = engine.stub.WatchTransfer(bpb.WatchTransferRequest(engine_id=engine.engine_id, request_id=request_id),
                                     timeout=CALL_S)
    last = None
    async for update in call:
        last = update.status
    assert last is not None and last.state in TERMINAL, f"the watch of {request_id} ended at {last}"
    return last


def describe(status: pb.TransferStatus) -> str:
    code = f" {code_of(status.code).name if code_of(status.code) else status.code}" if status.code else ""
    return f"{pb.TransferState.Name(status.state)}{code} parts={status.parts} pages={status.pages} " \
           f"aux={len(status.aux)}B ({status.reason[:160]})"


def one_in(n: int):
    """True once in `n` (a power of two): that many fair coins all come up True. Hypothesis
    favours small and boundary values of a range, so a range would not give the odds asked for."""
    return st.lists(st.booleans(), min_size=n.bit_length() - 1, max_size=n.bit_length() - 1).map(all)


# Every draw below has a shape of its own (its choices never depend on what the brokers answered
# before): the values are mapped onto the model's state afterwards. So a replay that meets another
# timing draws the same things, and hypothesis reports the failure, not a "flaky strategy".

def draw_aux(data, last: bool) -> bytes:
    if not last:
        return b"" if not data.draw(one_in(8), label="aux on a part that is not last") else b"early"
    kind = data.draw(st.sampled_from(["none", "small", "small", "limit", "over"]), label="aux")
    if kind == "none":
        return b""
    head = data.draw(st.binary(min_size=1, max_size=24), label="aux bytes")
    if kind == "small":
        return head
    return (head * (MAX_AUX // len(head) + 2))[:MAX_AUX + (kind == "over")]


def source_ids(rng: np.random.Generator, count: int, past_pool: bool) -> tuple[int, ...]:
    ids = rng.integers(0, NUM_PAGES, size=count).tolist()
    return tuple(ids + [NUM_PAGES + int(rng.integers(0, 8))] if past_pool else ids)


def random_part(data, m: GrantModel) -> Part:
    """Any part: components granted or not (one twice now and then), offsets at the next free
    entry, anywhere, or at and past the end, lists of any length, last or not, any aux."""
    kinds = data.draw(st.lists(st.sampled_from(KINDS), max_size=3, unique=True), label="components")
    if kinds and data.draw(one_in(16), label="a component twice"):
        kinds.append(kinds[0])
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="source ids seed"))
    pages = []
    for kind in kinds:
        where = data.draw(st.sampled_from(["next free", "anywhere", "at or past the end"]),
                          label=f"{NAMES[kind]} dst_offset")
        raw = data.draw(st.integers(0, 15), label=f"{NAMES[kind]} offset and length")
        whole = data.draw(st.booleans(), label=f"{NAMES[kind]} to the end of the grant")
        past_pool = data.draw(one_in(16), label=f"{NAMES[kind]} a source id past the pool")
        length = len(m.granted.get(kind, ()))
        off = {"next free": m.free_from(kind)[0] if kind in m.granted else 0, "anywhere": raw % (length + 1),
               "at or past the end": length + raw % 4}[where]
        rest = max(length - off, 0)
        count = rest if whole else (raw * 7 + 3) % (rest + 4)
        pages.append((kind, source_ids(rng, count, past_pool), off))
    last = data.draw(one_in(4), label="last")
    return Part(tuple(pages), last, draw_aux(data, last))


def chunk_part(data, m: GrantModel) -> Part:
    """A part the contract accepts while the grant is live: the next free entries of some
    components; dense KV only on a last part, and there whole (rule dense-kv-length)."""
    kinds = data.draw(st.lists(st.sampled_from(sorted(m.granted)), min_size=1, unique=True), label="components")
    sizes = data.draw(st.lists(st.integers(1, 12), min_size=3, max_size=3), label="pages per component")
    last = data.draw(one_in(4), label="last")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="source ids seed"))
    dense_whole = DENSE in m.granted and not m.covered[DENSE].any()
    if last and dense_whole and DENSE not in kinds:
        kinds.append(DENSE)
    pages = []
    for kind in kinds:
        start, run = m.free_from(kind)
        if kind == DENSE:
            if not (dense_whole and last):
                continue
            start, count = 0, len(m.granted[DENSE])
        else:
            count = min(sizes[KINDS.index(kind)], run)
        pages.append((kind, source_ids(rng, count, False), start))
    if not pages:  # only dense KV was drawn, and it went already: an empty part of the first component
        kind = sorted(m.granted)[0]
        pages.append((kind, (), len(m.granted[kind])))
    return Part(tuple(pages), last, draw_aux(data, last) if last else b"")


def misplaced_part(data, m: GrantModel) -> Part:
    """A part over entries an earlier part took (a free stretch while none has), now and then at
    or past the end of the grant's list, or (dense KV) a page short or long."""
    kind = data.draw(st.sampled_from(sorted(m.granted)), label="component")
    raw = data.draw(st.lists(st.integers(0, 63), min_size=2, max_size=2), label="where and how many")
    last = data.draw(one_in(4), label="last")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="source ids seed"))
    taken = np.flatnonzero(m.covered[kind])
    length = len(m.granted[kind])
    start = int(taken[raw[0] % taken.size]) if taken.size else raw[0] % length
    if raw[1] % 4 == 0:
        return Part(((kind, source_ids(rng, 1 + raw[0] % 3, False), length + raw[1] % 3),), last,
                    draw_aux(data, last))
    if kind == DENSE:  # dense KV moves whole: its list one or two pages short or long, half the time
        count = max(0, length - start + ((1 + raw[1] % 2) * (1 if raw[0] % 2 else -1) if raw[1] % 3 else 0))
    else:
        count = 1 + raw[1] % (length - start)
    return Part(((kind, source_ids(rng, count, False), start),), last, draw_aux(data, last))


def overtaking_parts(data, m: GrantModel) -> list[Part]:
    """A large part, and at once a small last part: the last part has little to write (dense KV
    whole, if the grant has it, since only the last part may carry it; else nothing), so its
    notice usually reaches decode before the large part's, and the grant must wait for that one."""
    aux = data.draw(st.binary(min_size=1, max_size=24), label="aux")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="source ids seed"))
    big = []
    for kind in sorted(m.granted):
        start, run = m.free_from(kind)
        if kind != DENSE and run:
            big.append((kind, source_ids(rng, run, False), start))
    if DENSE in m.granted and not m.covered[DENSE].any():
        last = (DENSE, source_ids(rng, len(m.granted[DENSE]), False), 0)
    else:
        kind = sorted(m.granted)[0]
        last = (kind, (), len(m.granted[kind]))
    return [Part(tuple(big), False), Part((last,), True, aux)]


def some_parts(data, m: GrantModel, low: int, high: int) -> list[Part]:
    """Parts for one step, each drawn as if the ones before it had been begun."""
    ahead, parts = m.copy(), []
    for _ in range(data.draw(st.integers(low, high), label="parts at once")):
        part = chunk_part(data, ahead) if data.draw(st.booleans(), label="valid") else random_part(data, ahead)
        verdict = ahead.plan(part)
        if verdict.code is None and ahead.ended is None and ahead.last_begun is None:
            ahead.begin(part, verdict)
        parts.append(part)
    return parts


class PartsMachine(RuleBasedStateMachine):
    world: World  # set by the test

    def __init__(self) -> None:
        super().__init__()
        self.m: GrantModel | None = None
        self.request_id = ""
        self.expiring = False
        self.expiry_ms = LONG_EXPIRY_MS
        self.before: np.ndarray | None = None  # the decode pool when the grant was offered
        self.expected: np.ndarray | None = None  # with every landed part
        self.possible: np.ndarray | None = None  # and with every part that failed in a race
        self.seen: list[pb.TransferStatus] = []  # the watcher's statuses
        self.watch_end: np.ndarray | None = None  # the decode pool when the watcher saw the end
        self.cancel_end: np.ndarray | None = None  # the decode pool when a CancelTransfer returned
        self.watcher: concurrent.futures.Future | None = None
        self.steps = 0
        self.offered_at = 0.0

    # plumbing

    @property
    def w(self) -> World:
        return self.world

    def run(self, coro, timeout: float = CALL_S):
        return self.w.loop.run(coro, timeout)

    def decode_now(self) -> pb.TransferStatus:
        return self.run(watch_first(self.w.dst, self.request_id, CALL_S))

    def decode_end(self) -> pb.TransferStatus:
        return self.run(terminal(self.w.dst, self.request_id), self._end_wait())

    def _end_wait(self) -> float:
        return CALL_S + (self.expiry_ms / 1000 if self.expiring else 0)

    async def _watch(self, started: asyncio.Event) -> None:
        call = self.w.dst.stub.WatchTransfer(
            bpb.WatchTransferRequest(engine_id=self.w.dst.engine_id, request_id=self.request_id), timeout=600)
        try:
            async for update in call:
                self.seen.append(update.status)
                if update.status.state in TERMINAL:
                    self.watch_end = self.w.dst.segment.array.copy()
                started.set()
        finally:
            started.set()

    async def _watched(self) -> None:
        await asyncio.wrap_future(self.watcher)

    # the grant

    @initialize(data=st.data())
    def offer_grant(self, data) -> None:
        self._offer_grant(data)

    @precondition(lambda self: self.steps >= 3)
    @rule(data=st.data())
    def next_grant(self, data) -> None:
        """End this grant (see _end_grant) and offer a fresh one into a canary pool."""
        self._end_grant()
        self.w.dst.segment.array[:] = shapes.CANARY
        self._offer_grant(data)

    def _offer_grant(self, data) -> None:
        kinds = data.draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=3, unique=True), label="granted")
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="granted pages seed"))
        granted = {}
        for kind in kinds:
            count = data.draw(st.integers(1, 12), label=f"{NAMES[kind]} granted pages")
            granted[kind] = rng.permutation(NUM_PAGES)[:count].astype(np.int64)
        self.expiring = data.draw(one_in(4), label="short expiry")
        self.expiry_ms = data.draw(st.sampled_from(SHORT_EXPIRY_MS), label="expiry_ms") if self.expiring \
            else LONG_EXPIRY_MS
        self.request_id = f"machine-{os.getpid()}-{next(self.w.numbers)}"
        self.m = GrantModel(granted)
        self.seen, self.watch_end, self.cancel_end = [], None, None
        self.before = self.w.dst.segment.array.copy()
        self.expected, self.possible = self.before.copy(), self.before.copy()
        self.offered_at = time.monotonic()  # decode's expiry comes no sooner than expiry_ms after this
        refused = self.run(self._offer(granted))
        started = asyncio.Event()
        self.watcher = self.w.loop.start(self._watch(started))
        self.run(started.wait())
        self.w.stats["grants with a short expiry" if self.expiring else "grants"] += 1
        if refused is not None:  # a short expiry can come before the offer's answer
            assert self.expiring and refused.code() is DE, f"the offer failed: {refused.details()}"
            self._settle(self.decode_end())

    async def _offer(self, granted) -> grpc.aio.AioRpcError | None:
        try:
            reply = await offer(self.w.dst, self.w.src, self.request_id, granted, expiry_ms=self.expiry_ms)
        except grpc.aio.AioRpcError as exc:
            return exc
        assert reply.status.state == PENDING, describe(reply.status)
        return None

    # steps

    @rule(data=st.data())
    def send_part(self, data) -> None:
        self._send([random_part(data, self.m)])

    @rule(data=st.data())
    def send_chunk(self, data) -> None:
        self._send([chunk_part(data, self.m)])

    @rule(data=st.data())
    def send_misplaced(self, data) -> None:
        self._send([misplaced_part(data, self.m)])

    @rule(data=st.data())
    def send_overtaking(self, data) -> None:
        """A last part that may land before the part numbered ahead of it: the grant must wait."""
        self._send(overtaking_parts(data, self.m))

    @rule(data=st.data())
    def send_together(self, data) -> None:
        self._send(some_parts(data, self.m, 2, 3))

    @precondition(lambda self: self.steps >= 3)  # else most grants would end before any part
    @rule(data=st.data(), side=st.sampled_from(["decode", "prefill"]), racing=st.integers(0, 3))
    def cancel(self, data, side: str, racing: int) -> None:
        """CancelTransfer on one side, alone or among `racing` parts sent at once with it."""
        engine = self.w.dst if side == "decode" else self.w.src
        self.w.stats[f"cancel on {side}{' among parts' if racing else ''}"] += 1
        if racing:
            parts = some_parts(data, self.m, racing, racing)
            yields = data.draw(st.integers(0, 4), label="loop turns before the cancel")
            self._send(parts, cancel=(engine, yields))
            return
        reason = f"the machine cancels on {side}"
        status, pool = self.run(self._cancel(engine, reason))
        if self.m.ended is not None:  # it answers the end, and changes nothing
            assert status.state in TERMINAL, f"a cancel after the end: {describe(status)}"
            if side == "decode":
                assert (status.state, status.code) == self.m.ended, f"a cancel after the end: {describe(status)}"
            return
        assert status.state == FAILED, f"cancelled, yet {describe(status)}"
        ended = self.decode_end()
        if ended.code == code_value(C.CANCELLED):
            assert reason in ended.reason, f"decode's end does not say why: {describe(ended)}"
            self.cancel_end = pool
        else:
            assert self.expiring and ended.code == code_value(DE), f"cancelled, yet decode is {describe(ended)}"
        # a short expiry may have come on either side just before the cancel
        self._settle(ended, {C.CANCELLED, DE} if self.expiring else set())

    @precondition(lambda self: self.expiring)  # not on the model's state: timing decides when it ends
    @rule(data=st.data(), streaming=st.booleans())
    def expire(self, data, streaming: bool) -> None:
        """Wait, through WatchTransfer, for the grant to expire; or (`streaming`) send parts one
        after another while it runs out: empty ones until the expiry is near (the clock only aims;
        the model judges whatever happens), then a page each."""
        seed = data.draw(st.integers(0, 2**32 - 1), label="source ids seed") if data is not None else 0
        rng = np.random.default_rng(seed)
        expiry = self.offered_at + self.expiry_ms / 1000
        while streaming and self.m.ended is None and time.monotonic() < expiry + CALL_S:
            kind = min(self.m.granted, key=lambda k: (k == DENSE, -self.m.free_from(k)[1]))
            start, run = self.m.free_from(kind)
            if kind != DENSE and run and expiry - time.monotonic() < 0.03:
                part = Part(((kind, source_ids(rng, 1, False), start),), False)
            else:
                part = Part(((kind, (), len(self.m.granted[kind])),), False)
            self._send([part])
        ended = self.decode_end()
        if self.m.ended is None:
            assert ended.state == FAILED and ended.code == code_value(DE), f"expected the expiry: {describe(ended)}"
            self._settle(ended)

    # how a step's outcomes are judged

    async def _cancel(self, engine: Engine, reason: str, yields: int = 0):
        for _ in range(yields):
            await asyncio.sleep(0)  # lets some of the parts' calls go out first; orders nothing
        reply = await engine.stub.CancelTransfer(bpb.CancelTransferRequest(
            engine_id=engine.engine_id, request_id=self.request_id, reason=reason), timeout=CALL_S)
        return reply.status, self.w.dst.segment.array.copy()

    async def _together(self, parts: list[Part], cancel):
        calls = [attempt(self.w.src, self.request_id, p) for p in parts]
        if cancel is not None:
            engine, yields = cancel
            calls.append(self._cancel(engine, "the machine cancels among parts", yields))
        return await asyncio.gather(*calls)

    def _send(self, parts: list[Part], cancel=None) -> None:
        """Send `parts` at once (with a CancelTransfer among them), then find a serialisation of
        them that explains every outcome and decode's state, and take it as the model's."""
        results = self.run(self._together(parts, cancel))
        outcomes = results[:len(parts)]
        for part, got in zip(parts, outcomes):
            self.w.stats[f"part {got.code.name if got.code else 'OK'}"] += 1
            if got.code is None:
                assert got.status.aux == b"", f"{part} got the aux back on the sender's status"
        end_codes = None  # what may end the grant during this step
        if self.m.ended is None and (cancel is not None or self.expiring):
            end_codes = ({C.CANCELLED} if cancel is not None else set()) | ({DE} if self.expiring else set())
        status = self.decode_end() if self.m.ended is None and cancel is not None else self.decode_now()
        tried = []
        for e in explanations(self.m, parts, outcomes, end_codes):
            if e.needs_end and status.state not in TERMINAL:
                status = self.decode_end()  # the grant ended meanwhile: decode must come to its end
            problem = self._disagrees(e, parts, outcomes, status, end_codes)
            if problem is None:
                self._adopt(e, parts, status, results[-1][1] if cancel is not None else None, end_codes)
                return
            tried.append(f"  order {e.order} ending before position {e.cut}: {problem}")
            if len(tried) > 8:
                break
        lines = "\n".join(f"  {p!r} -> {o!r}" for p, o in zip(parts, outcomes))
        raise AssertionError(f"no serialisation of these parts explains what the brokers did\n{lines}\n"
                             f"decode: {describe(status)}\nthe model before: {self.m.parts} parts landed, ended "
                             f"{self.m.ended}, last part begun {self.m.last_begun}\n" + "\n".join(tried))

    def _disagrees(self, e: Explanation, parts, outcomes, status, end_codes) -> str | None:
        """Why decode's state after the step does not fit `e`; None when it fits."""
        m = e.model
        for i in e.landed:
            want = {SUCCEEDED} if parts[i].last else {TRANSFERRING} | ({FAILED} if end_codes else set())
            if outcomes[i].status.state not in want:
                return f"{parts[i]} landed, but its status is {describe(outcomes[i].status)}"
        if self.m.ended is not None:
            return None if (status.state, status.code) == self.m.ended else "decode changed after its end"
        lasts = [i for i in e.landed if parts[i].last]
        raced_lasts = [i for i in e.racing if parts[i].last]
        if lasts:
            if status.state != SUCCEEDED or status.aux != parts[lasts[0]].aux:
                return f"the last part landed, but decode is {describe(status)}"
        elif status.state == SUCCEEDED:
            if not raced_lasts or status.aux != parts[raced_lasts[0]].aux:
                return "decode succeeded without a last part"
        elif status.state == FAILED:
            if end_codes is None or code_of(status.code) not in end_codes:
                return "decode failed, and nothing in this step may end it"
        elif e.needs_end:
            return "this order needs the grant to have ended"
        elif status.state != (PENDING if m.parts == 0 else TRANSFERRING):
            return f"decode should be {'PENDING' if m.parts == 0 else 'TRANSFERRING'}"
        if not m.parts <= status.parts <= m.parts + m.slack_parts:
            return f"decode counts {status.parts} parts, the model {m.parts} (+{m.slack_parts} racing the end)"
        if not m.pages <= status.pages <= m.pages + m.slack_pages:
            return f"decode counts {status.pages} pages, the model {m.pages} (+{m.slack_pages} racing the end)"
        return None

    def _adopt(self, e: Explanation, parts, status, cancelled_pool, end_codes) -> None:
        for i in e.landed:
            self._write(self.expected, e.verdicts[i])
            self._write(self.possible, e.verdicts[i])
        for i in e.racing:
            self._write(self.possible, e.verdicts[i])
        for i, v in e.verdicts.items():
            stage = "after the end" if self.m.ended is not None else "landed" if i in e.landed else \
                "racing the end" if i in e.racing else "refused: " + v.why if v.why else "late"
            self.w.stats[f"verdict {stage}"] += 1
        if self.m.ended is not None:
            return
        self.m = e.model
        self.w.stats["parts racing the end"] += len(e.racing)
        if status.state == SUCCEEDED and not any(parts[i].last for i in e.landed):
            self.m.aux = status.aux  # a last part that raced a cancel on prefill, and landed
            self.m.parts, self.m.pages = status.parts, status.pages
        if cancelled_pool is not None and status.code == code_value(C.CANCELLED):
            self.cancel_end = cancelled_pool
        if status.state in TERMINAL:
            self._settle(status, {C.ABORTED, C.CANCELLED, DE} if end_codes else set())

    def _settle(self, status: pb.TransferStatus, also: set = frozenset()) -> None:
        """The grant ended at decode: wait for the sender's record to end too, with the same
        outcome or (`also`) another the race of this end allows; from now on every part gets the
        refusal of an ended request."""
        sender = self.run(terminal(self.w.src, self.request_id), self._end_wait())
        if status.state == SUCCEEDED:
            fits = sender.state == SUCCEEDED or (sender.state == FAILED and code_of(sender.code) in also)
        else:
            fits = sender.state == FAILED and (sender.code == status.code or code_of(sender.code) in also)
        assert fits, f"decode ended {describe(status)}, the sender {describe(sender)}"
        if status.code == code_value(DE):  # a cancel after the expiry answers the end, and changes nothing
            again, _ = self.run(self._cancel(self.w.dst, "after the expiry"))
            assert (again.state, again.code) == (status.state, status.code), \
                f"a cancel after the expiry: {describe(again)}"
        self.w.stats[f"grant {pb.TransferState.Name(status.state)[15:]} {code_of(status.code).name}"] += 1
        self.m.ended = (status.state, status.code)
        self.m.end_code = DE if sender.state == FAILED and sender.code == code_value(DE) else FP

    def _write(self, pool: np.ndarray, verdict: Verdict) -> None:
        dst = self.w.dst
        for x in verdict.landed:
            if x.count:
                dst_ids = self.m.granted[x.kind][x.entry:x.entry + x.count]
                pool[:] = shapes.expected_destination(self.w.src.segment.array, pool, dst.shape, dst.placements,
                                                      {x.kind}, x.src_ids, dst_ids)

    # what must hold after every step

    @invariant()
    def brokers_agree_with_the_model(self) -> None:
        if self.m is None:
            return
        self.steps += 1
        self.w.stats[f"step {self.steps}"] += 1
        if self.m.ended is None:
            sender = self.run(watch_first(self.w.src, self.request_id, CALL_S))  # first: decode expires before it
            status = self.decode_now()
            if status.state in TERMINAL and self.expiring and status.code == code_value(DE):
                self._settle(status)
            elif self.expiring and (sender.state, sender.code) == (FAILED, code_value(DE)):
                # the sender's offer runs out no later than decode's grant (its lifetime follows the
                # grant's expiry), so between the two reads the sender can have ended first: decode's end follows
                ended = self.decode_end()
                assert (ended.state, ended.code) == (FAILED, code_value(DE)), \
                    f"the sender's offer expired, decode ended {describe(ended)}"
                self._settle(ended)
            else:
                want = PENDING if self.m.parts == 0 else TRANSFERRING
                assert status.state == want, f"decode is {describe(status)}, the model {pb.TransferState.Name(want)}"
                assert (status.parts, status.pages) == (self.m.parts, self.m.pages), \
                    f"decode is {describe(status)}, the model has {self.m.parts} parts, {self.m.pages} pages"
                want = PENDING if self.m.begun == 0 else TRANSFERRING
                assert sender.state == want, \
                    f"the sender is {describe(sender)}, the model {pb.TransferState.Name(want)}"
        if self.m.ended is not None:
            status = self.decode_now()
            assert (status.state, status.code) == self.m.ended, f"decode changed after its end: {describe(status)}"
            assert status.aux == (self.m.aux if status.state == SUCCEEDED else b""), \
                f"decode's terminal aux is {len(status.aux)} bytes, the last part's {len(self.m.aux)}"
        self._check_pool()
        self._check_watcher()

    def _check_pool(self) -> None:
        actual = self.w.dst.segment.array.copy()
        wrong = np.flatnonzero((actual != self.expected) & (actual != self.possible))
        assert wrong.size == 0, self._where(wrong, "bytes outside what landed parts (or parts racing the end) "
                                                   "may write")
        if self.m.ended is None:
            return
        for end, seen in ((self.watch_end, "its watcher saw it end"), (self.cancel_end, "CancelTransfer ended it")):
            if end is not None:
                late = np.flatnonzero(actual != end)
                assert late.size == 0, self._where(late, f"bytes written after {seen}")

    def _where(self, offsets: np.ndarray, what: str) -> str:
        first = int(offsets[0])
        for p in self.w.dst.placements:
            span = NUM_PAGES * p.item_len
            if p.offset <= first < p.offset + span:
                page = (first - p.offset) // p.item_len
                granted = {NAMES[k]: list(map(int, v)) for k, v in self.m.granted.items()}
                return (f"{offsets.size} {what}: first in {NAMES.get(p.component, p.component)} layer {p.layer_id} "
                        f"page {page}; grant {granted}")
        return f"{offsets.size} {what}: first at offset {first}, outside every layer buffer"

    def _check_watcher(self) -> None:
        """The watcher started with the grant: the parts landed only grow, the state only moves on,
        one terminal status ends it, and only that one carries the aux."""
        seen = list(self.seen)
        assert seen, "the watcher has seen no status"
        rank = {PENDING: 0, TRANSFERRING: 1, SUCCEEDED: 2, FAILED: 2}
        assert [rank[s.state] for s in seen] == sorted(rank[s.state] for s in seen), \
            f"the watch went back: {[describe(s) for s in seen]}"
        assert [s.parts for s in seen] == sorted(s.parts for s in seen), "the watch's part count went back"
        for status in seen[:-1]:
            assert status.state not in TERMINAL, "the watch went on after a terminal status"
            assert status.aux == b"", f"aux on a status that is not terminal: {describe(status)}"
        if seen[-1].state not in TERMINAL:
            assert seen[-1].aux == b"", f"aux on a status that is not terminal: {describe(seen[-1])}"
        elif self.m.ended is not None:
            assert (seen[-1].state, seen[-1].code) == self.m.ended, f"the watcher ended {describe(seen[-1])}"
            assert seen[-1].aux == (self.m.aux if seen[-1].state == SUCCEEDED else b""), \
                "the watcher's terminal status does not carry the last part's aux"

    def teardown(self) -> None:
        if self.m is None:
            return
        try:
            self._end_grant()
        finally:
            if self.watcher is not None and not self.watcher.done():
                self.watcher.cancel()
            self.w.dst.segment.array[:] = shapes.CANARY

    def _end_grant(self) -> None:
        """End a live grant (a short expiry runs out, any other is cancelled), then check the whole
        of what its watcher saw."""
        if self.m.ended is None and self.expiring:  # hypothesis may have switched `expire` off
            self.expire(None, streaming=False)
        if self.m.ended is None:
            status, pool = self.run(self._cancel(self.w.dst, "the grant is done with"))
            ended = self.decode_end()
            if ended.code == code_value(C.CANCELLED):
                self.cancel_end = pool
            else:
                assert self.expiring and ended.code == code_value(DE), f"cancelled, yet {describe(ended)}"
            self._settle(ended, {C.CANCELLED, DE} if self.expiring else set())
        self.run(self._watched())
        self.brokers_agree_with_the_model()
        assert self.seen[-1].state in TERMINAL, "the watcher missed the end"
        again = self.decode_now()
        assert (again.state, again.aux) == (self.seen[-1].state, self.seen[-1].aux), \
            f"a watch after the end: {describe(again)}"


def run_machine(world: World) -> None:
    machine = type("Machine", (PartsMachine,), {"world": world})
    run_state_machine_as_test(machine, settings=MACHINE)
    print(dict(sorted(world.stats.items())))


@pytest.mark.timeout(120 + 12 * EXAMPLES)
async def test_parts_into_one_grant_keep_the_contract(brokers, engines):
    """Parts, orders, overlaps, cancels and expiries: the grant succeeds iff every part landed, no
    byte outside the granted pages changes, the aux arrives once, with the terminal status."""
    src = await engines.make(brokers.prefill, "prefill", SHAPE, components=M3, seed=31)
    dst = await engines.make(brokers.decode, "decode", SHAPE, components=M3, fill="canary")
    await asyncio.to_thread(run_machine, World(Loop(asyncio.get_running_loop()), src, dst))
