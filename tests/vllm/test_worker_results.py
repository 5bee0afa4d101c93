"""The decode worker's transfer results, in vLLM's own environment (tests/vllm/worker_results_race.py):
a receive that ends while vLLM's thread collects results is handed to vLLM, as failed, exactly once.
Lost, vLLM keeps the request waiting for its KV and its blocks held for good (the client times out)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.vllm_servers import run_in_vllm

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).with_name("worker_results_race.py")


async def test_a_receive_failing_while_vllm_collects_results_is_reported_failed_once():
    got = await run_in_vllm(SCRIPT, timeout=300)
    assert got["finished_recving"] == [[], ["vllm-request-1"]], got
    assert got["failed_recving"] == [[], ["vllm-request-1"]], got
