"""Run in vLLM's environment (tests/vllm/test_worker_results.py): a decode worker's receive fails on the
link's loop while vLLM's thread collects transfer results (here: while the failure is being logged, the
widest part of that window). Prints, as JSON, every id vLLM was handed over both collections."""

from __future__ import annotations

import json
import logging

from kvbroker_client.adapter import AdapterSettings, ReceivingRequest
from kvbroker_vllm.worker import WorkerSide

worker = WorkerSide(AdapterSettings(), role="consumer", kv_cache_config=None, block_size=32, tp_size=1, pp_size=1,
                    dp_rank=0, host_cache=False)
handed = []


class CollectMeanwhile(logging.Handler):
    """vLLM's thread takes its results while the loop logs the failure."""

    def emit(self, record: logging.LogRecord) -> None:
        handed.append(worker.transfer_results(set()))


logging.getLogger("kvbroker_vllm.worker").addHandler(CollectMeanwhile())
request = ReceivingRequest(None, "broker-request-1")  # type: ignore[arg-type] - never offered: no link used
request.when_ended(lambda r: worker._ended("vllm-request-1", r, sending=False))
request.fail("the sender's broker refused the late offer")
handed.append(worker.transfer_results(set()))
print(json.dumps({"finished_recving": [sorted(r.finished_recving) for r in handed],
                  "failed_recving": [sorted(r.failed_recving) for r in handed]}))
