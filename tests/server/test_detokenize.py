"""`IncrementalText`: the text of tokens decoded as they arrive equals the decoding of them all
(byte-level tokens that split characters, invalid bytes, SentencePiece-style leading spaces),
an incomplete character waits for its last byte, and no step decodes more than a short window."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models

from graphc.weights.tiny import byte_level_tokenizer
from graphc.server.detokenize import IncrementalText


class Counting:
    """A tokenizer that records how many ids each decode call is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids)


def metaspace_tokenizer() -> Tokenizer:
    words = ["▁hello", "▁world", "!", "▁", "lo", "▁naïve", "é"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="!"))
    tokenizer.decoder = decoders.Metaspace()
    return tokenizer


def decoded_as_they_arrive(tokenizer, ids: list[int]) -> tuple[list[str], str]:
    text, seen = IncrementalText(tokenizer), []
    for token in ids:
        text.add(token)
        seen.append(text.text)
    text.finish()
    return seen, text.text


@pytest.mark.parametrize("seed", range(20))
def test_tokens_decoded_one_at_a_time_give_the_whole_decoding(seed):
    rng = random.Random(seed)
    byte_level = byte_level_tokenizer()
    # Mostly UTF-8 text split into its bytes, with stray continuation and lead bytes among them.
    text = "".join(rng.choice(["a", " ", "é", "€", "𝄞", "日本"]) for _ in range(60))
    ids = list(text.encode())
    for _ in range(5):
        ids.insert(rng.randrange(len(ids) + 1), rng.choice([0x80, 0xBF, 0xC3, 0xE2, 0xF0]))
    seen, final = decoded_as_they_arrive(byte_level, ids)
    assert final == byte_level.decode(ids)
    assert all(final.startswith(prefix) for prefix in seen)  # text only grows
    metaspace = metaspace_tokenizer()
    words = [rng.randrange(7) for _ in range(40)]
    assert decoded_as_they_arrive(metaspace, words)[1] == metaspace.decode(words)


def test_an_incomplete_character_waits_for_its_last_byte():
    seen, final = decoded_as_they_arrive(byte_level_tokenizer(), list("a€".encode()))  # € is 3 bytes
    assert seen == ["a", "a", "a", "a€"] and final == "a€"
    assert decoded_as_they_arrive(byte_level_tokenizer(), list(b"a\xe2\x82"))[1] == "a\ufffd"  # ended short


def test_each_step_decodes_a_window_not_the_whole_generation():
    counting = Counting(byte_level_tokenizer())
    decoded_as_they_arrive(counting, list(("word " * 400).encode()))  # 2,000 tokens
    assert max(counting.lengths) <= 2 and len(counting.lengths) <= 2 * 2001


def test_without_a_tokenizer_the_ids_are_kept_and_the_text_stays_empty():
    text = IncrementalText(None)
    for token in (5, 6, 7):
        text.add(token)
    text.finish()
    assert text.ids == [5, 6, 7] and text.text == ""
