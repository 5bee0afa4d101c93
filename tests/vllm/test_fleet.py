"""One broker fleet for both engines: an SGLang PD pair and a vLLM PD pair whose servers register with
the same two brokers (NIXL), requests of both interleaved, each answering as its engine's non-PD
server; the brokers hold both engines' registrations; and an SGLang sender into a vLLM receiver is
refused by the broker's layout rule before any byte moves."""

from __future__ import annotations

import asyncio
import mmap
import os
import re

import grpc
import numpy as np
import pytest
import pytest_asyncio

from kvbroker_client import BrokerClient, BrokerError, Component, FailedPrecondition, SharedMemoryRef
from kvbroker_tools.serving import client, stack, vllm_stack
from tests.support.helpers import serving
from tests.support.vllm_servers import ANSWER_TOKENS, switch_backend

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]  # servers start in minutes here
SGLANG_ENV = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "60", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60"}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fleet(model, vllm_log_root, vllm_starting):
    """The session's vLLM PD pair with its brokers on NIXL, and an SGLang PD stack started on the same two
    brokers while the vLLM servers start; once it has stopped, the brokers hold vLLM's engines alone again."""
    brokers = dict(vllm_starting.brokers)
    if vllm_starting.pair.done():  # a module before may have moved them
        await switch_backend(vllm_starting.pair.result(), "nixl")
        brokers = dict(vllm_starting.pair.result().brokers)
    sglang = await stack.start_pd(model, vllm_log_root / "fleet-sglang", transfer="kvbroker", engine="nixl",
                                  env=SGLANG_ENV, brokers=brokers)
    try:
        vllm = await vllm_starting.pair
        yield sglang, vllm
    finally:
        await sglang.stop()  # the brokers stay: they are the vLLM pair's
        held = await serving(brokers.values(), "nixl", engines=1)
        assert all(got == ("nixl", 1) for got in held.values()), f"SGLang's engines outlived its servers: {held}"


async def test_sglang_and_vllm_requests_interleaved_on_one_broker_pair_each_answer_as_their_engine(
        fleet, reference, vllm_reference, http):
    sglang, vllm = fleet
    prompts = [client.prompts(1, 30 + 25 * i, seed=3000 + i)[0] for i in range(6)]  # no vLLM case asks these

    async def sglang_one(prompt):
        answer = await client.generate(http, sglang.url, prompt, ANSWER_TOKENS)
        return await reference.mismatch(prompt, answer.output_ids, ANSWER_TOKENS)

    async def vllm_one(prompt):
        answer = await vllm_stack.complete(http, vllm.url, prompt, ANSWER_TOKENS)
        return None if answer.output_ids == await vllm_reference.answer(prompt) else answer.output_ids

    results = await asyncio.gather(*(f(p) for p in prompts for f in (sglang_one, vllm_one)))
    assert results == [None] * len(results), results
    for side in ("prefill", "decode"):
        held = await stack.broker_holds(sglang.brokers[side])
        assert held["engines"] == 2, f"the {side} broker holds {held['engines']} engines, not SGLang's and vLLM's"


async def test_an_sglang_sender_into_a_vllm_receiver_is_refused_by_a_topology_rule_and_writes_nothing(fleet):
    sglang, vllm = fleet
    prefill, decode = sglang.brokers["prefill"], sglang.brokers["decode"]
    async with await BrokerClient.connect(prefill.listen) as p, await BrokerClient.connect(decode.listen) as d:
        p_info, d_info = await p.info(), await d.info()
        sender = next(e for e in p_info.engines if "/vllm-" not in e.engine_id)  # SGLang's prefill engine
        receiver = next(e for e in d_info.engines if "/vllm-" in e.engine_id)  # vLLM's decode engine
        main = next(c for c in receiver.components if c.component is Component.MAIN_KV)
        pages = np.arange(main.num_pages - 4, main.num_pages)  # vLLM hands out low block ids first
        before = read_pages(main, pages)
        await d.expect_transfer(receiver.engine_id, "fleet-mix-1", {Component.MAIN_KV: pages},
                                sender_address=p_info.peer_address, sender_engine_id=sender.engine_id, expiry_s=30)
        with pytest.raises(FailedPrecondition) as refused:
            await p.transfer_part(sender.engine_id, "fleet-mix-1", {Component.MAIN_KV: np.arange(4)}, last=True)
        assert refused.value.code is grpc.StatusCode.FAILED_PRECONDITION
        # the first rule the two engines' registrations break (SGLang's page of 1 token, vLLM's block of 32)
        assert re.match(r"rule same-(shape|layout): ", refused.value.reason), refused.value.reason
        with pytest.raises(BrokerError):  # the grant ended (FAILED), not left writable
            await d.wait(receiver.engine_id, "fleet-mix-1", timeout=30)
        assert read_pages(main, pages) == before, "a byte of the refused request landed"


def read_pages(component, pages) -> list[bytes]:
    """The bytes of `pages` of every layer buffer of a component, read from its /dev/shm segment."""
    out = []
    for buffer in component.layer_buffers:
        ref = buffer.memory
        assert isinstance(ref, SharedMemoryRef), ref
        fd = os.open(f"/dev/shm/{ref.name}", os.O_RDONLY)
        try:
            with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as view:
                out += [view[ref.offset + p * buffer.item_len:ref.offset + (p + 1) * buffer.item_len] for p in pages]
        finally:
            os.close(fd)
    return out
