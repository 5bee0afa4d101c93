"""SchedulerSide: the connector in vLLM's engine core. It holds no broker connection: it decides
what each step's workers do (StepMetadata) and when vLLM may free a request's blocks.

    prefill (kv_producer)
        request_finished      a request prefilled for a remote decode (do_remote_decode) and finished
                              to be continued: its blocks are held (delay_free) and sent by the
                              workers once decode's offer lands; kv_transfer_params name this
                              server's brokers and engines per rank (TransferParams), learned from
                              the workers' handshake at start
        update_connector_output   finished_sending: the broker's word that the send ended; vLLM frees
    decode (kv_consumer)
        get_num_new_matched_tokens   a request with our TransferParams loads the prompt tokens its
                              prefix cache lacks, asynchronously (WAITING_FOR_REMOTE_KVS)
        update_state_after_alloc     its new blocks become the grant; the blocks the prefix cache
                              held are the sender's pages the grant skips (src_offset)
        request_finished      a request whose grant has not ended (aborted while waiting) is cancelled;
                              vLLM keeps its blocks until the workers report it received
"""

from __future__ import annotations

import logging

from kvbroker_vllm.metadata import (
    KEY,
    BrokerHandshake,
    GrantSpec,
    SendSpec,
    StepMetadata,
    TransferParams,
    TransferParamsError,
    broker_request_id,
)
from kvbroker_vllm.vllm_0_32 import HANDED_OVER, new_block_ids

log = logging.getLogger(__name__)


class SchedulerSide:
    def __init__(self, *, producer: bool, consumer: bool, block_size: int) -> None:
        self.producer, self.consumer = producer, consumer
        self.block_size = block_size
        self.ranks: tuple[BrokerHandshake, ...] = ()
        self._step = StepMetadata()
        self._held: set[str] = set()  # prefill: requests whose blocks wait for the send to end
        self._granted: set[str] = set()  # decode: requests whose grant has not been reported ended
        self._local: dict[str, int] = {}  # decode: the tokens the prefix cache held, at the last count

    # -- start ----------------------------------------------------------------------------------------
    def set_handshake(self, metadata: dict[tuple[int, int], object]) -> None:
        """Every worker's broker and engine, by (pp, tp) rank, once at start."""
        self.ranks = tuple(m for _, m in sorted(metadata.items()) if isinstance(m, BrokerHandshake))
        log.info("kvbroker: this server's ranks on their brokers: %s",
                 ", ".join(f"pp{r.pp_rank}/tp{r.tp_rank} {r.engine_id}@{r.broker_address}" for r in self.ranks))

    # -- decode: what to load -------------------------------------------------------------------------
    def _remote(self, request) -> TransferParams | None:
        params = request.kv_transfer_params
        if not self.consumer or not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None
        try:
            transfer = TransferParams.of(params)
        except TransferParamsError as exc:
            log.warning("kvbroker: request %s computes its prompt here: %s", request.request_id, exc)
            return None
        if transfer is None:
            log.warning("kvbroker: request %s asks for a remote prefill without a %r entry in kv_transfer_params "
                        "(was prefill run with kvbroker's connector?); it computes its prompt here",
                        request.request_id, KEY)
        return transfer

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        if request.request_id in self._granted or self._remote(request) is None:
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        if count <= 0:
            return 0, False
        self._local[request.request_id] = num_computed_tokens
        return count, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0 or request.request_id in self._granted:
            return
        transfer = self._remote(request)
        if transfer is None:
            return
        fresh, held = new_block_ids(blocks)
        self._local.pop(request.request_id, None)
        self._granted.add(request.request_id)
        self._step.grants.append(GrantSpec(request.request_id, transfer, tuple(fresh), held))

    # -- both: a request ends -------------------------------------------------------------------------
    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = request.request_id
        self._local.pop(rid, None)
        if rid in self._granted:  # decode: its grant has not been reported ended (aborted while waiting)
            self._step.cancels.append((rid, f"the decode server ended the request ({request.status.name})"))
            return False, None
        params = request.kv_transfer_params
        if not (self.producer and isinstance(params, dict) and params.get("do_remote_decode")):
            return False, None
        if request.status not in HANDED_OVER or not block_ids:
            return False, None  # aborted or failed here: nothing to hand over, the blocks go now
        if not self.ranks:
            log.error("kvbroker: request %s finished for a remote decode, but no worker registered with a broker; "
                      "decode will compute its prompt itself", rid)
            return False, None
        transfer = TransferParams(broker_request_id(rid), self.ranks, len(block_ids))
        self._held.add(rid)
        self._step.sends.append(SendSpec(rid, transfer.request_id, tuple(block_ids)))
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": rid,
                      KEY: transfer.to_json()}

    # -- each step ------------------------------------------------------------------------------------
    def build_connector_meta(self) -> StepMetadata:
        step, self._step = self._step, StepMetadata()
        return step

    def update_connector_output(self, output) -> None:
        for rid in output.finished_sending or ():
            self._held.discard(rid)
        for rid in output.finished_recving or ():
            self._granted.discard(rid)

    def has_pending_push_work(self) -> bool:
        return bool(self._held)
