"""An offer's components are checked before any of its page lists is converted (peers/wire.py): a
refused offer costs its bytes and a look at its component fields, not a million-id conversion
(which took 0.1 CPU-second per 9 MB OfferGrant; benchmarks/health_flood.py, issue 21)."""

from __future__ import annotations

import secrets
from types import SimpleNamespace

import pytest

from kvbroker.core.errors import BrokerError, Code
from kvbroker.peers.wire import grant_offer_in
from kvbroker_client.v1 import common_pb2 as pb


class Untouchable:
    """A page list that fails the test if anything reads it."""

    def __len__(self) -> int:
        raise AssertionError("a page list was read before the components were checked")

    def __iter__(self):
        raise AssertionError("a page list was read before the components were checked")


def offer(*components: int) -> SimpleNamespace:
    return SimpleNamespace(engine_id="decode-0/tp0", request_id="r", sender_engine_id="", peer_address="127.0.0.1:9",
                           offer_token=secrets.token_hex(16), remaining_ms=1000, generation=1,
                           pages=[SimpleNamespace(component=c, page_ids=Untouchable()) for c in components])


@pytest.mark.parametrize("components, code, says", [
    ((pb.COMPONENT_MAIN_KV, pb.COMPONENT_MAIN_KV), Code.INVALID_ARGUMENT, "pages: a component is listed twice"),
    ((pb.COMPONENT_MAIN_KV, pb.COMPONENT_MINIMAX_INDEX_KV), Code.UNIMPLEMENTED, "rule index-with-value"),
    ((pb.COMPONENT_MAIN_KV, 99), Code.INVALID_ARGUMENT, "pages[1].component"),
])
def test_an_offers_components_are_refused_before_its_pages_are_read(components, code, says):
    with pytest.raises(BrokerError) as refused:
        grant_offer_in(offer(*components), max_pages=1 << 20)
    assert refused.value.code is code, refused.value
    assert says in str(refused.value)
