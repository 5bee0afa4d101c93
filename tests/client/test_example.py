"""The README's example, run against real brokers: a prefill and a decode server in the offered flow,
every byte and the aux bytes verified."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session")]


def load_example():
    spec = importlib.util.spec_from_file_location("prefill_decode", ROOT / "clients" / "examples" / "prefill_decode.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


async def test_example_moves_a_request_between_two_brokers_verified(client_brokers):
    example = load_example()
    result = await example.run(client_brokers.prefill.listen, client_brokers.decode.listen, seed=3)
    assert result["verified"], result
    assert result["receiver"] == "SUCCEEDED" and result["aux_verified"]
    assert result["parts"] == example.CHUNKS  # one Transfer part per chunk of the main KV
    after_prefix = example.REQUEST_PAGES - example.PREFIX_PAGES
    assert result["pages"] == 2 * after_prefix + example.REQUEST_PAGES  # main KV, index-K suffix, dense KV
