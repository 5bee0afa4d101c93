"""KvbrokerConnector: kvbroker as a vLLM 0.32 V1 KV connector, a façade over one side per role.

    --kv-transfer-config '{"kv_connector": "KvbrokerConnector", "kv_connector_module_path": "kvbroker_vllm",
                           "kv_role": "kv_producer" | "kv_consumer" | "kv_both"}'

vLLM builds it twice per server: role SCHEDULER in the engine core (SchedulerSide, scheduler.py:
what each step's workers do, when blocks are freed) and role WORKER in each worker process
(WorkerSide, worker.py: the rank's engine on its broker and the requests it moves). Each method
here asserts its side and hands the call over; this is the one place that reads the role. The
broker in the pod is KVBROKER_ADDRESS (kvbroker_client.adapter.AdapterSettings); the connector's
`kv_connector_extra_config` may set `hold_s` (how long prefill holds a request's blocks for decode's
offer) and `grant_expiry_s`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvbroker_client.adapter import AdapterSettings
from kvbroker_vllm.scheduler import SchedulerSide
from kvbroker_vllm.vllm_0_32 import check_version
from kvbroker_vllm.worker import WorkerSide


class KvbrokerConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        check_version()
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        block_size = vllm_config.cache_config.block_size
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(producer=transfer.is_kv_producer, consumer=transfer.is_kv_consumer,
                                                block_size=block_size)
            return
        extra = transfer.kv_connector_extra_config or {}
        settings = AdapterSettings.from_env()
        overrides: dict[str, Any] = {k: float(extra[k]) for k in ("hold_s", "grant_expiry_s")
                                     if extra.get(k) is not None}
        settings = dataclasses.replace(settings, **overrides)
        parallel = vllm_config.parallel_config
        self.worker_side = WorkerSide(settings, role=transfer.kv_role.removeprefix("kv_"),
                                      kv_cache_config=kv_cache_config, block_size=block_size,
                                      tp_size=parallel.tensor_parallel_size, pp_size=parallel.pipeline_parallel_size,
                                      dp_rank=parallel.data_parallel_rank,
                                      host_cache=vllm_config.device_config.device_type == "cpu")

    @property
    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler_side is not None, "a scheduler-side call on a worker's connector"
        return self.scheduler_side

    @property
    def _worker(self) -> WorkerSide:
        assert self.worker_side is not None, "a worker-side call on the scheduler's connector"
        return self.worker_side

    # -- scheduler side ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self._scheduler.build_connector_meta()

    def request_finished(self, request, block_ids):
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output):
        self._scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self.scheduler_side is not None and self.scheduler_side.has_pending_push_work()

    def set_xfer_handshake_metadata_pp_aware(self, metadata) -> None:
        self._scheduler.set_handshake(metadata)

    # -- worker side ---------------------------------------------------------------------------------
    def get_mem_pool_context(self):
        return self._worker.mem_pool_context()

    def register_kv_caches(self, kv_caches):
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self):
        return self._worker.handshake()

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._worker.start(self._get_connector_metadata() if self.has_connector_metadata() else None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous (WAITING_FOR_REMOTE_KVS): no layer waits in a forward

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None  # prefill sends whole requests once they finished, not layer by layer

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids):
        return self._worker.transfer_results(finished_req_ids)

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.close()
