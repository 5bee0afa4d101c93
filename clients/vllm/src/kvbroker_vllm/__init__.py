"""kvbroker for vLLM's PD disaggregation: a V1 KV connector on kvbroker_client.adapter (the engine-neutral core).

    --kv-transfer-config '{"kv_connector": "KvbrokerConnector", "kv_connector_module_path": "kvbroker_vllm", ...}'

    connector   KvbrokerConnector: the façade vLLM loads, one side per role
    scheduler   SchedulerSide (the engine core): sends, grants, cancels; when blocks are freed
    worker      WorkerSide (each worker): the rank's engine on its broker, the requests it moves
    metadata    what crosses processes and servers (StepMetadata, BrokerHandshake, TransferParams)
    layout      the KV caches as components: the tables
    vllm_0_32   every use of vLLM's surface beyond the connector base, read from that release
"""

from kvbroker_vllm.connector import KvbrokerConnector

__all__ = ["KvbrokerConnector"]
