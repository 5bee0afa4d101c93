"""WorkerSide: the connector in each vLLM worker (one rank): its engine on the broker in its pod,
and the requests the scheduler hands it. Nothing here blocks vLLM's thread but start-up.

    get_mem_pool_context   the KV cache is allocated in /dev/shm (SharedHostAllocations) when it is a
                           CPU cache, so the broker, another process, can map it
    register_kv_caches     the caches as components (layout.py), registered through an EngineLink
    start_load_kv          each step's StepMetadata: sends (SendingRequest.send_when_offered: one
                           part, all blocks, once decode's offer landed, held up to hold_s), grants
                           (ReceivingRequest.grant, the blocks the prefix cache lacks, src_offset the
                           ones it held), cancels
    get_transfer_results   what ended on the broker's word (Request.when_ended): a send once vLLM has
                           listed the request finished too, a receive at once, a failed receive also
                           in failed_recving (vLLM then fails the request); each id once
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np

from kvbroker_client import Component
from kvbroker_client.adapter import AdapterSettings, EngineLink, Part, Phase, ReceivingRequest, SendingRequest
from kvbroker_client.adapter.memory import MemoryExporter
from kvbroker_client.adapter.request import Request
from kvbroker_vllm.layout import engine_components, engine_topology
from kvbroker_vllm.metadata import BrokerHandshake, GrantSpec, SendSpec, StepMetadata
from kvbroker_vllm.vllm_0_32 import KVConnectorTransferResults, layer_specs, parallel_ranks

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, settings: AdapterSettings, *, role: str, kv_cache_config, block_size: int, tp_size: int,
                 pp_size: int, dp_rank: int, host_cache: bool) -> None:
        self.settings = settings
        self.role = role
        self.kv_cache_config = kv_cache_config
        self.block_size, self.tp_size, self.pp_size, self.dp_rank = block_size, tp_size, pp_size, dp_rank
        self.host_cache = host_cache
        self.link: EngineLink | None = None
        self.ranks = (0, 0)  # (pp, tp)
        self._lock = threading.Lock()
        self._sending: dict[str, SendingRequest] = {}  # by vLLM request id
        self._receiving: dict[str, ReceivingRequest] = {}
        self._components: set[Component] = set()
        self._sent: set[str] = set()  # sends that ended on the broker's word
        self._received: set[str] = set()
        self._failed: set[str] = set()
        self._listed: set[str] = set()  # requests vLLM has listed finished (finished_req_ids)

    # -- start ----------------------------------------------------------------------------------------
    def mem_pool_context(self):
        if not self.host_cache:
            return None
        from kvbroker_client.adapter.hostmem import SharedHostAllocations

        return SharedHostAllocations()

    def register_kv_caches(self, kv_caches: dict) -> None:
        specs = layer_specs(self.kv_cache_config)
        components = engine_components(kv_caches, specs, self.kv_cache_config.num_blocks, MemoryExporter().refs)
        pp, tp = parallel_ranks()
        topology = engine_topology(components, specs, block_size=self.block_size, tp_size=self.tp_size,
                                   tp_rank=tp, pp_size=self.pp_size, pp_rank=pp, dp_rank=self.dp_rank)
        engine_id = f"{self.settings.engine_prefix}/vllm-{self.role}/dp{self.dp_rank}-tp{tp}-pp{pp}"
        link = EngineLink(self.settings, engine_id, holder=f"vllm {self.role} {engine_id} pid {os.getpid()}")
        link.open(topology, components)
        self.link, self.ranks = link, (pp, tp)
        self._components = {c.component for c in components}

    def handshake(self) -> BrokerHandshake | None:
        if self.link is None:
            return None
        return BrokerHandshake(self.link.broker_address, self.link.broker_id, self.link.engine_id, *self.ranks)

    # -- each step ------------------------------------------------------------------------------------
    def start(self, step: StepMetadata | None) -> None:
        if step is None or self.link is None:
            return
        for send in step.sends:
            self._send(send)
        for grant in step.grants:
            self._grant(grant)
        for rid, reason in step.cancels:
            request = self._receiving.get(rid)
            if request is not None:
                request.cancel(reason)

    def _pages(self, block_ids) -> dict[Component, np.ndarray]:
        ids = np.asarray(block_ids, dtype=np.int64)
        return {component: ids for component in sorted(self._components)}

    def _send(self, send: SendSpec) -> None:
        request = SendingRequest(self.link, send.transfer_id)
        self._sending[send.request_id] = request
        rid = send.request_id
        request.when_ended(lambda r: self._ended(rid, r, sending=True))
        request.send_when_offered(Part(self._pages(send.block_ids), last=True), self.settings.hold_s)

    def _grant(self, grant: GrantSpec) -> None:
        request = ReceivingRequest(self.link, grant.transfer.request_id)
        self._receiving[grant.request_id] = request
        rid = grant.request_id
        request.when_ended(lambda r: self._ended(rid, r, sending=False))
        sender = grant.transfer.rank(*self.ranks)
        if sender is None:
            request.fail(f"kvbroker: prefill has no rank pp{self.ranks[0]}/tp{self.ranks[1]} to send this decode "
                         f"rank its KV (its ranks: {[(r.pp_rank, r.tp_rank) for r in grant.transfer.ranks]}); "
                         "prefill and decode need the same tensor and pipeline parallel sizes")
            return
        pages = self._pages(grant.block_ids)
        offsets = {component: grant.held_blocks for component in pages} if grant.held_blocks else None
        request.grant(pages, sender_address=sender.broker_address, sender_engine_id=sender.engine_id,
                      expiry_s=self.settings.grant_expiry_s, src_offsets=offsets)

    def _ended(self, rid: str, request: Request, *, sending: bool) -> None:
        """On the link's loop: the request is over on the broker's word. The set it goes into is
        read under the lock: transfer_results (vLLM's thread) hands its sets over and starts new ones."""
        if request.phase is Phase.FAILED:
            log.warning("kvbroker: request %s (%s on the brokers) failed: %s", rid, request.request_id,
                        request.failure.reason if request.failure else "")
        with self._lock:
            if sending:
                self._sent.add(rid)
            else:
                self._received.add(rid)
                if request.phase is Phase.FAILED:
                    self._failed.add(rid)

    def transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        with self._lock:
            self._listed |= finished_req_ids & set(self._sending)
            sent = self._sent & self._listed
            received, failed = self._received, self._failed
            self._sent -= sent
            self._listed -= sent
            self._received, self._failed = set(), set()
        for rid in sent:
            self._sending.pop(rid, None)
        for rid in received:
            self._receiving.pop(rid, None)
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=received, failed_recving=failed)

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
