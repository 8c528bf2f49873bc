"""Stop strings, as `Generation` cuts a request's text at them: the streamed deltas add up to the
text the unstreamed response returns, whatever the tokens, the stop strings and min_tokens (an
occurrence inside the first min_tokens tokens, or across that boundary, included)."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from graphc.runtime.online import Ticket
from graphc.runtime.scheduler import Request, Result
from graphc.server.metrics import ServerMetrics
from graphc.server.streaming import Generation, find_stop

PIECES = ["a", "n", "i", "na", "an", "ina", "nn"]
"""The fake tokenizer's tokens: few letters, so stop strings occur often, inside tokens and across them."""

words = st.text("ani", min_size=1, max_size=3)


class Pieces:
    def decode(self, ids: list[int]) -> str:
        return "".join(PIECES[i] for i in ids)


class Online:
    """Stands in for `OnlineEngine`: the test delivers the tokens itself."""

    def submit(self, request: Request, listener) -> Ticket:
        self.listener = listener
        return Ticket(request, listener)

    def cancel(self, ticket: Ticket) -> None:
        ticket.cancelled = True


def generate(tokens: list[int], stops: list[str], min_tokens: int) -> tuple[str, str, str]:
    """(the streamed deltas joined, the unstreamed text, the finish reason) of one generation."""
    async def run():
        online = Online()
        request = Request([1], len(tokens), min_new_tokens=min_tokens)
        generation = Generation(online, ServerMetrics(online), request, Pieces(), stops)
        for count, token in enumerate(tokens, start=1):
            online.listener(token, Result(request, tokens, "length") if count == len(tokens) else None)
        streamed = "".join([delta async for delta, *_ in generation.deltas()])
        return streamed, generation.text, generation.finish_reason

    return asyncio.run(run())


def counted(text: str, stops: list[str], exempt: int) -> list[tuple[int, str]]:
    """Every stop string occurrence in `text` that ends past `exempt` characters: (start, string)."""
    return [(i, s) for s in stops for i in range(len(text) - len(s) + 1)
            if text.startswith(s, i) and i + len(s) > exempt]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, len(PIECES) - 1), min_size=1, max_size=12), st.lists(words, min_size=1, max_size=3),
       st.data())
def test_the_streamed_text_is_the_returned_text_with_stop_strings_inside_and_across_min_tokens(tokens, stops, data):
    min_tokens = data.draw(st.integers(0, len(tokens)))
    streamed, text, finish = generate(tokens, stops, min_tokens)
    assert streamed == text
    whole = Pieces().decode(tokens)
    exempt = len(Pieces().decode(tokens[:max(0, min_tokens - 1)]))  # the min_tokens-th token may stop
    assert whole.startswith(text) and not counted(text, stops, exempt)
    if finish == "stop":  # cut before an occurrence that counts
        assert any(whole.startswith(s, len(text)) and len(text) + len(s) > exempt for s in stops)
    else:
        assert finish == "length" and text == whole


@settings(max_examples=300, deadline=None)
@given(st.text("ani", max_size=16), st.lists(words, min_size=1, max_size=3), st.data())
def test_find_stop_gives_the_earliest_occurrence_that_ends_past_what_was_searched(text, stops, data):
    searched = data.draw(st.integers(0, len(text)))
    found = counted(text, stops, searched)
    assert find_stop(text, stops, searched) == (min(i for i, _ in found) if found else None)
