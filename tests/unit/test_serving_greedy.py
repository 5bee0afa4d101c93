"""How the real-server tests judge an answer against the non-PD reference (kvbroker_tools.serving.client
.mismatch): equal tokens pass, a tie in the reference may go either way and is checked on from the
answer's choice, anything else names the first wrong token. The reference here is a table: greedy
continuations by prompt."""

from __future__ import annotations

import pytest

from kvbroker_tools.serving.client import TIE_NATS, Greedy, mismatch

PROMPT = [5, 6]


def reference(table: dict[tuple[int, ...], Greedy]):
    async def fetch(prompt: list[int], tokens: int) -> Greedy:
        made = table[tuple(prompt)]
        return Greedy(made.ids[:tokens], made.runner_up[:tokens])

    return fetch


# After PROMPT the reference answers 10 11 12, tied at its first token with 20; after PROMPT + [20] it
# answers 21 22, where 22 leads 30 by a clear margin.
TABLE = {
    (5, 6): Greedy([10, 11, 12], [(20, 0.0), (40, 0.5), (41, 0.7)]),
    (5, 6, 20): Greedy([21, 22], [(31, 0.4), (30, 0.3)]),
}


async def test_the_references_own_answer_is_greedy():
    assert await mismatch(reference(TABLE), PROMPT, [10, 11, 12], 3) is None


async def test_the_other_side_of_a_tie_is_greedy_when_what_follows_it_is():
    assert await mismatch(reference(TABLE), PROMPT, [20, 21, 22], 3) is None


async def test_after_the_other_side_of_a_tie_every_token_is_still_checked():
    why = await mismatch(reference(TABLE), PROMPT, [20, 21, 30], 3)
    assert why is not None and why.startswith("token 2 is 30 where the reference answers 22")


async def test_the_runner_up_where_the_reference_leads_clearly_is_a_mismatch():
    why = await mismatch(reference(TABLE), PROMPT, [10, 40, 12], 3)
    assert why is not None and why.startswith("token 1 is 40 where the reference answers 11")


@pytest.mark.parametrize("margin", [TIE_NATS * 1.01, 0.1])
async def test_a_margin_above_the_tie_bound_is_no_tie(margin):
    table = {**TABLE, (5, 6): Greedy([10, 11, 12], [(20, margin), (40, 0.5), (41, 0.7)])}
    assert await mismatch(reference(table), PROMPT, [20, 21, 22], 3) is not None


async def test_a_token_that_is_neither_of_the_tied_two_is_a_mismatch():
    assert await mismatch(reference(TABLE), PROMPT, [99, 21, 22], 3) is not None


async def test_an_answer_of_another_length_is_a_mismatch():
    assert await mismatch(reference(TABLE), PROMPT, [10, 11], 3) == "2 tokens where 3 were asked for"
