"""The contract of one offered grant and its parts, as the parts state machine
(test_parts_state_machine.py) models it; pure, no broker but in `attempt`.

- `Part`: one Transfer of the offered flow; `GrantModel`: which entries of each of a grant's page
  lists begun parts have taken, which parts landed, the aux, how the grant ended;
- `GrantModel.plan`: what one part must get from a live grant: a local refusal, a plan refusal,
  or acceptance and the entries it lands (the rules of DESIGN.md and topology.part_pages);
- `explanations`: the serialisations of one step's parts (and the points where the grant may have
  ended meanwhile) under which every outcome the brokers gave is one the contract allows;
- `attempt`: the one call to a broker here, a part sent and its `Outcome` (shared with test_expiry_gap.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import grpc
import numpy as np

from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_client.v1 import common_pb2 as pb
from tests.support.brokers import SMALL, Engine
from tests.support.flows import DENSE, INDEX, MAIN

# The tests' small shape with 16 KiB main and dense pages (1 KiB index pages): a part of a dozen pages
# is a few MiB, so that a write is still running now and then when a cancel or an expiry comes.
SHAPE = dataclasses.replace(SMALL, name="machine", page_size=8, kv_heads=8, head_dim=128, index_head_dim=128)
KINDS = (MAIN, INDEX, DENSE)
NAMES = {MAIN: "MAIN", INDEX: "INDEX", DENSE: "DENSE"}
NUM_PAGES = SHAPE.num_pages
MAX_AUX = 65536  # the brokers' max_aux_bytes (default)
CALL_S = 30.0  # one call, or one bounded wait for an end: far above what any takes here

C = grpc.StatusCode
IA, RE, PD, FP, DE = C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED, C.PERMISSION_DENIED, C.FAILED_PRECONDITION, \
    C.DEADLINE_EXCEEDED
RACE_FAILURES = {C.ABORTED, C.FAILED_PRECONDITION, C.DEADLINE_EXCEEDED, C.CANCELLED}  # a part begun before the end
PENDING, TRANSFERRING = pb.TRANSFER_STATE_PENDING, pb.TRANSFER_STATE_TRANSFERRING
SUCCEEDED, FAILED = pb.TRANSFER_STATE_SUCCEEDED, pb.TRANSFER_STATE_FAILED
TERMINAL = (SUCCEEDED, FAILED)


def code_value(code: grpc.StatusCode) -> int:
    return code.value[0]


_CODES = {c.value[0]: c for c in C}


def code_of(value: int) -> grpc.StatusCode | None:
    """A status's code as a grpc.StatusCode (None for a number gRPC does not know)."""
    return _CODES.get(value)


@dataclass(frozen=True)
class Part:
    """One Transfer of the offered flow: (component, source page ids, dst_offset) each."""

    pages: tuple[tuple[int, tuple[int, ...], int], ...]
    last: bool
    aux: bytes = b""

    def request(self, src: Engine, request_id: str) -> bpb.TransferRequest:
        return bpb.TransferRequest(
            request_id=request_id, engine_id=src.engine_id, more_parts=not self.last, aux=self.aux,
            pages=[bpb.PartPages(component=k, src_page_ids=list(ids), dst_offset=off) for k, ids, off in self.pages])

    def __repr__(self) -> str:
        pages = ", ".join(f"{NAMES[k]}@{off}:{list(ids)}" for k, ids, off in self.pages)
        aux = f", aux={len(self.aux)}B" if self.aux else ""
        return f"Part([{pages}], last={self.last}{aux})"


@dataclass(frozen=True)
class Landed:
    kind: int
    src_ids: np.ndarray
    entry: int  # first entry of the grant's list of `kind`
    count: int


@dataclass(frozen=True)
class Verdict:
    """What the contract says of one part against a live grant: refused at `stage` with `code`, or
    (code None) accepted, landing `landed`."""

    code: grpc.StatusCode | None
    stage: str  # "local" (the sender's own checks, before any state), "plan", or "accepted"
    why: str = ""  # the rule that refused it
    landed: tuple[Landed, ...] = ()


@dataclass
class GrantModel:
    granted: dict[int, np.ndarray]  # destination pages per component
    covered: dict[int, np.ndarray] = field(default_factory=dict)  # entries taken by begun parts
    begun: int = 0  # parts accepted by the sender (it numbered them)
    last_begun: Part | None = None
    parts: int = 0  # parts landed at decode
    pages: int = 0  # entries landed at decode
    slack_parts: int = 0  # parts that failed in a race: decode may or may not have counted them
    slack_pages: int = 0
    aux: bytes = b""  # of the accepted last part
    ended: tuple[int, int] | None = None  # decode's terminal (state, code)
    end_code: grpc.StatusCode | None = None  # what a part gets once the grant ended and both sides settled

    def __post_init__(self) -> None:
        if not self.covered:
            self.covered = {k: np.zeros(len(v), dtype=bool) for k, v in self.granted.items()}

    def copy(self) -> GrantModel:
        return GrantModel(dict(self.granted), {k: v.copy() for k, v in self.covered.items()}, self.begun,
                          self.last_begun, self.parts, self.pages, self.slack_parts, self.slack_pages, self.aux,
                          self.ended, self.end_code)

    def free_from(self, kind: int) -> tuple[int, int]:
        """The first free entry of `kind`'s list and the free run from it ((len, 0) when full)."""
        free = np.flatnonzero(~self.covered[kind])
        if not free.size:
            return len(self.covered[kind]), 0
        start = int(free[0])
        taken = np.flatnonzero(self.covered[kind][start:])
        return start, int(taken[0]) if taken.size else len(self.covered[kind]) - start

    def plan(self, part: Part) -> Verdict:
        """The verdict on `part` were it the next to reach a live grant."""
        kinds = [k for k, _, _ in part.pages]
        if len(set(kinds)) != len(kinds):
            return Verdict(IA, "local", "a component twice")
        if any(i >= NUM_PAGES for _, ids, _ in part.pages for i in ids):
            return Verdict(IA, "local", "a source id past the pool")
        if part.aux and not part.last:
            return Verdict(IA, "local", "aux before the last part")
        if len(part.aux) > MAX_AUX:
            return Verdict(RE, "local", "aux over max_aux_bytes")
        if not part.pages and not part.last:
            return Verdict(IA, "local", "no pages")
        landed = []
        for kind, ids, off in part.pages:
            if kind not in self.granted:
                return Verdict(PD, "plan", "component outside the grant")
            length = len(self.granted[kind])
            if off > length or (off == length and ids):
                return Verdict(PD, "plan", "part-in-grant")
            rest = length - off
            if kind == DENSE and (not part.last or off or len(ids) != length):
                return Verdict(FP, "plan", "dense-kv-length: whole, on the last part only")
            count = min(len(ids), rest)
            if self.covered[kind][off:off + count].any():
                return Verdict(FP, "plan", "over an earlier part")
            landed.append(Landed(kind, np.asarray(ids[:count], dtype=np.int64), off, count))
        if not landed:
            return Verdict(IA, "plan", "a last part with no component")
        if part.last and DENSE in self.granted:
            sent = int(self.covered[DENSE].sum()) + sum(x.count for x in landed if x.kind == DENSE)
            if sent != len(self.granted[DENSE]):
                return Verdict(FP, "plan", "last part leaves dense KV unsent")
        return Verdict(None, "accepted", "", tuple(landed))

    def begin(self, part: Part, verdict: Verdict) -> None:
        for x in verdict.landed:
            self.covered[x.kind][x.entry:x.entry + x.count] = True
        self.begun += 1
        if part.last:
            self.last_begun = part

    def land(self, part: Part, verdict: Verdict) -> None:
        self.parts += 1
        self.pages += sum(x.count for x in verdict.landed)
        if part.last:
            self.aux = part.aux


@dataclass(frozen=True)
class Outcome:
    """What one Transfer got: its status (code None) or its refusal."""

    code: grpc.StatusCode | None
    status: pb.TransferStatus | None = None
    details: str = ""

    def __repr__(self) -> str:
        if self.code is None:
            return f"OK({pb.TransferState.Name(self.status.state)})"
        return f"{self.code.name}({self.details[:160]})"


async def attempt(src: Engine, request_id: str, part: Part) -> Outcome:
    """`part` sent to src's broker: what it got."""
    try:
        reply = await src.stub.Transfer(part.request(src, request_id), timeout=CALL_S)
    except grpc.aio.AioRpcError as exc:
        return Outcome(exc.code(), None, exc.details() or "")
    return Outcome(None, reply.status)


@dataclass
class Explanation:
    """A serialisation of one step's parts that the outcomes agree with."""

    order: tuple[int, ...]
    cut: int  # parts at positions from `cut` on came after the grant ended
    model: GrantModel  # the model after the step
    landed: list[int]  # indexes of parts that landed (and their verdicts)
    racing: list[int]  # begun before the end, failed with it: they may have written
    verdicts: dict[int, Verdict]

    @property
    def needs_end(self) -> bool:
        return bool(self.racing) or self.cut < len(self.order)


def explanations(model: GrantModel, parts: list[Part], outcomes: list[Outcome], end_codes: set | None):
    """Every serialisation (and, with `end_codes`, every point where the grant ended meanwhile) under
    which each outcome is one the contract allows; those with no end first."""
    n = len(parts)
    cuts = range(n, -1, -1) if end_codes is not None else [n]
    for cut in cuts:
        for order in itertools.permutations(range(n)):
            m = model.copy()
            landed, racing, verdicts = [], [], {}
            for pos, i in enumerate(order):
                part, got = parts[i], outcomes[i]
                v = m.plan(part)
                verdicts[i] = v
                if v.stage == "local":
                    if got.code is not v.code:
                        break
                    continue
                if m.ended is not None:  # ended before this step, both sides settled
                    if got.code is not m.end_code:
                        break
                    continue
                if pos >= cut or m.last_begun is not None:  # after the end, or after the last part
                    allowed = {FP} | (end_codes or set()) | ({v.code} if v.code is not None else set())
                    if got.code not in allowed:
                        break
                    continue
                if v.code is not None:
                    if got.code is not v.code:
                        break
                    continue
                m.begin(part, v)
                if got.code is None:
                    m.land(part, v)
                    landed.append(i)
                elif end_codes is not None and got.code in RACE_FAILURES:
                    racing.append(i)
                    m.slack_parts += 1
                    m.slack_pages += sum(x.count for x in v.landed)
                else:
                    break
            else:
                yield Explanation(order, cut, m, landed, racing, verdicts)
