"""What crosses between vLLM's processes and between the two servers, as plain picklable values.

    BrokerHandshake     worker -> scheduler, once: the rank's broker and engine (get_handshake_metadata)
    TransferParams      prefill's answer -> the router -> decode's request: the `kvbroker` entry of
                        kv_transfer_params (which broker and engine hold the request, its id there)
    SendSpec, GrantSpec, StepMetadata   scheduler -> workers, each step: what to send, grant, cancel

TransferParams come from the network (a router, a client): `TransferParams.of` bounds and checks
every field before anything uses it, and says which field broke which rule.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from kvbroker_vllm.vllm_0_32 import KVConnectorHandshakeMetadata, KVConnectorMetadata

KEY = "kvbroker"  # our entry in kv_transfer_params
VERSION = 1
MAX_RANKS = 256
_ID = re.compile(r"[A-Za-z0-9._:/-]{1,128}")
_ADDRESS = re.compile(r"[A-Za-z0-9._:\[\]-]{1,256}")


class TransferParamsError(ValueError):
    """A `kvbroker` entry of kv_transfer_params that breaks a rule; the message names the field."""


def broker_request_id(vllm_request_id: str) -> str:
    """The id a request has on the brokers: vLLM's own when it fits the brokers' rule for ids, else
    a digest of it (a client's X-Request-Id may hold anything)."""
    if _ID.fullmatch(vllm_request_id):
        return vllm_request_id
    return "vllm-" + hashlib.sha256(vllm_request_id.encode()).hexdigest()[:40]


@dataclass(frozen=True)
class BrokerHandshake(KVConnectorHandshakeMetadata):
    """One worker's broker: where the other side's broker reaches it, and the engine it registered."""

    broker_address: str
    broker_id: str
    engine_id: str
    pp_rank: int
    tp_rank: int


@dataclass(frozen=True)
class TransferParams:
    """The `kvbroker` entry prefill's request_finished puts into kv_transfer_params."""

    request_id: str  # the request's id on the brokers (broker_request_id of prefill's)
    ranks: tuple[BrokerHandshake, ...]  # prefill's workers, one per (pp, tp) rank
    blocks: int  # prefill's blocks of the request

    def to_json(self) -> dict:
        return {"v": VERSION, "request_id": self.request_id, "blocks": self.blocks,
                "ranks": [{"pp": r.pp_rank, "tp": r.tp_rank, "broker_address": r.broker_address,
                           "broker_id": r.broker_id, "engine_id": r.engine_id} for r in self.ranks]}

    @classmethod
    def of(cls, kv_transfer_params: dict | None) -> TransferParams | None:
        """The entry of a request's kv_transfer_params; None when it has none (not ours to load)."""
        if not isinstance(kv_transfer_params, dict) or KEY not in kv_transfer_params:
            return None
        entry = kv_transfer_params[KEY]
        if not isinstance(entry, dict):
            raise TransferParamsError(f"kv_transfer_params.{KEY}: must be an object")
        if entry.get("v") != VERSION:
            raise TransferParamsError(f"kv_transfer_params.{KEY}.v: {entry.get('v')!r}; this connector reads "
                                      f"version {VERSION}")
        request_id = _text(entry, "request_id", _ID)
        blocks = entry.get("blocks")
        if not isinstance(blocks, int) or isinstance(blocks, bool) or not 0 < blocks <= 1 << 24:
            raise TransferParamsError(f"kv_transfer_params.{KEY}.blocks: {blocks!r} must be an integer in [1, 2^24]")
        ranks = entry.get("ranks")
        if not isinstance(ranks, list) or not 0 < len(ranks) <= MAX_RANKS:
            raise TransferParamsError(f"kv_transfer_params.{KEY}.ranks: must be a list of 1 to {MAX_RANKS} ranks")
        parsed = []
        for i, rank in enumerate(ranks):
            where = f"ranks[{i}]"
            if not isinstance(rank, dict):
                raise TransferParamsError(f"kv_transfer_params.{KEY}.{where}: must be an object")
            pp, tp = rank.get("pp"), rank.get("tp")
            if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_RANKS for x in (pp, tp)):
                raise TransferParamsError(f"kv_transfer_params.{KEY}.{where}: pp and tp must be integers in "
                                          f"[0, {MAX_RANKS})")
            parsed.append(BrokerHandshake(_text(rank, "broker_address", _ADDRESS, where),
                                          _text(rank, "broker_id", _ID, where), _text(rank, "engine_id", _ID, where),
                                          pp, tp))
        if len({(r.pp_rank, r.tp_rank) for r in parsed}) != len(parsed):
            raise TransferParamsError(f"kv_transfer_params.{KEY}.ranks: a (pp, tp) rank is named twice")
        return cls(request_id, tuple(parsed), blocks)

    def rank(self, pp_rank: int, tp_rank: int) -> BrokerHandshake | None:
        return next((r for r in self.ranks if (r.pp_rank, r.tp_rank) == (pp_rank, tp_rank)), None)


def _text(entry: dict, name: str, rule: re.Pattern, where: str = "") -> str:
    value = entry.get(name)
    if not isinstance(value, str) or not rule.fullmatch(value):
        path = f"{where}.{name}" if where else name
        raise TransferParamsError(f"kv_transfer_params.{KEY}.{path}: {str(value)[:64]!r} must match {rule.pattern}")
    return value


@dataclass(frozen=True)
class SendSpec:
    """Prefill: send the request's blocks (all of them, in order) once decode's offer has landed."""

    request_id: str  # vLLM's, on this server
    transfer_id: str  # the brokers'
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class GrantSpec:
    """Decode: grant the blocks its prefix cache lacks; the sender's first `held_blocks` it holds already."""

    request_id: str  # vLLM's, on this server
    transfer: TransferParams
    block_ids: tuple[int, ...]
    held_blocks: int


@dataclass
class StepMetadata(KVConnectorMetadata):
    """One engine step's work for the workers (the scheduler builds it, build_connector_meta)."""

    sends: list[SendSpec] = field(default_factory=list)
    grants: list[GrantSpec] = field(default_factory=list)
    cancels: list[tuple[str, str]] = field(default_factory=list)  # (vLLM request id, why)
