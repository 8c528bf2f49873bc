"""A generation's text, decoded as its tokens arrive, at a cost per token that does not grow with
the generation.

Decoding every token so far on each new one costs O(n) per token (O(n^2) per request: at 8 k
tokens, seconds of the event loop per stream). Decoding a token alone is wrong: a byte-level
tokenizer splits one character over several tokens, and a SentencePiece-style one drops a word's
leading space when the word is decoded first. So each step decodes a short window: the tokens
since the last settled point, with the previous window's tokens before them as context, and
appends what the new tokens add, once that does not end in an incomplete UTF-8 character (the
approach of Hugging Face's text-generation-inference and vLLM's incremental detokenizer).
"""

from __future__ import annotations

INCOMPLETE = "\ufffd"
"""What a tokenizer decodes an incomplete UTF-8 character's bytes to."""


class IncrementalText:
    """`text` is the decoding of `ids` so far, less a tail still being completed (always empty
    without a tokenizer: artifacts whose checkpoint had none, served as token ids)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._context = 0
        """Where the window starts: tokens decoded already, there for their effect on the next."""
        self._settled = 0
        """Tokens whose text is in `text`; those after it are still pending."""

    def add(self, token: int) -> None:
        self.ids.append(token)
        self._advance(final=False)

    def finish(self) -> None:
        """Append whatever is pending, an incomplete character included (the generation ended)."""
        self._advance(final=True)

    def _advance(self, final: bool) -> None:
        if self.tokenizer is None or self._settled == len(self.ids):
            return
        before = self.tokenizer.decode(self.ids[self._context:self._settled])
        after = self.tokenizer.decode(self.ids[self._context:])
        if final or (len(after) > len(before) and not after.endswith(INCOMPLETE)):
            self.text += after[len(before):]
            self._context, self._settled = self._settled, len(self.ids)
