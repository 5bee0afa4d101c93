"""The decode worker's transfer results, in vLLM's own environment (tests/vllm/worker_results_race.py):
a receive that ends while vLLM's thread collects results is handed to vLLM, as failed, exactly once.
Lost, vLLM keeps the request waiting for its KV and its blocks held for good (the client times out)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvbroker_tools.serving import vllm_stack

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).with_name("worker_results_race.py")


async def test_a_receive_failing_while_vllm_collects_results_is_reported_failed_once():
    child = await asyncio.create_subprocess_exec(
        str(vllm_stack.python()), str(SCRIPT), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=vllm_stack.server_env())
    try:
        out, err = await asyncio.wait_for(child.communicate(), 300)
    finally:
        if child.returncode is None:  # timed out: the child goes with the case
            child.kill()
            await child.wait()
    assert child.returncode == 0, f"exit {child.returncode}: {err.decode()[-3000:]}"
    got = json.loads(out.decode().strip().splitlines()[-1])
    assert got["finished_recving"] == [[], ["vllm-request-1"]], got
    assert got["failed_recving"] == [[], ["vllm-request-1"]], got
