"""Structured outputs: a request's grammar (a JSON schema, a regular expression, a set of
choices) enforced token by token with llguidance, the grammar engine vLLM and SGLang use too.

Why llguidance rather than xgrammar: both compile JSON schemas and give a per-step bitmask of the
allowed tokens over a Hugging Face tokenizer, but llguidance is one 3 MB wheel with no Python
dependencies and takes the checkpoint's tokenizer.json as it is, while xgrammar 0.2.9 pulls in
transformers and triton (gigabytes on this stack) and reads the tokenizer through transformers.

Where: on the leader, like penalties (`graphc.runtime.penalties`): the row's logits from the
step, the disallowed tokens at -inf, then the programs' own sampler with the row's seed. A
constrained row does not draft under speculative decoding (its drafts would need a mask at every
draft position and the logits of each, which a step does not return).
"""

from __future__ import annotations

import json
import re

from graphc.errors import GraphcError


class Grammars:
    """Grammars over one artifacts' tokenizer (building its llguidance tokenizer takes about a
    second, so it is built once, on the first constrained request)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
        self._spec = (tokenizer_json, vocab_size, eos_token_ids)
        self._tokenizer = None
        self.vocab_size, self.eos_token_ids = vocab_size, eos_token_ids

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from llguidance import LLTokenizer

            text, vocab_size, eos = self._spec
            self._tokenizer = LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
        return self._tokenizer

    def checked(self, grammar: str) -> str:
        """`grammar`, or GraphcError with llguidance's reason where it cannot be compiled."""
        from llguidance import LLMatcher

        problem = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem and not problem.startswith("WARNING"):
            raise GraphcError(problem)
        return grammar

    def constraint(self, grammar: str) -> TokenConstraint:
        """A fresh constraint (one request's state) of a `checked` grammar."""
        return TokenConstraint(self, grammar)


THINKING = r"think[lazy]: /(?s:.*)<\/think>/"
"""A reasoning section: any text, up to the first `</think>` (lazy: it ends there)."""


def grammar_of(body: str, thinking: bool = False) -> str:
    """The grammar (llguidance's Lark) of an output that `body` (a rule's alternatives) matches,
    after a reasoning section where `thinking` (the prompt left the model thinking: the grammar
    holds from `</think>` on, as vLLM constrains reasoning models)."""
    start = f"start: think ({body})" if thinking else f"start: {body}"
    return start + "\n" + (THINKING + "\n" if thinking else "")


def json_value(schema: dict, item_separator: str = ",", key_separator: str = ":") -> str:
    """A Lark term: JSON valid under `schema`, with these separators and no other whitespace
    (free whitespace is a place for a generation to wander into endless spaces)."""
    spacing = {"whitespace_flexible": False, "item_separator": item_separator, "key_separator": key_separator}
    return "%json" + json.dumps({**schema, "x-guidance": spacing})


def json_schema_grammar(schema: dict, thinking: bool = False) -> str:
    """The grammar of JSON text valid under `schema`, compact."""
    return grammar_of(json_value(schema), thinking)


def regex_grammar(pattern: str, thinking: bool = False) -> str:
    # Lark's regex literal ends at a "/" and at a line's end: escape those the pattern has.
    literal = re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", pattern).replace("\n", "\\n")
    return grammar_of(f"/{literal}/", thinking)


def choice_grammar(choices: list[str], thinking: bool = False) -> str:
    """Exactly one of `choices`."""
    return grammar_of(" | ".join(json.dumps(c, ensure_ascii=False) for c in choices), thinking)


class TokenConstraint:
    """One request's place in its grammar: the tokens allowed next, and each token taken.

    A grammar that allows no token, or refuses one taken (neither should happen: the token is
    drawn from the allowed ones), is `broken`: from then on only EOS is allowed, so the request
    ends; it must not stop the engine, which serves every other request too."""

    def __init__(self, grammars: Grammars, grammar: str):
        from llguidance import LLMatcher

        self.grammars = grammars
        self.matcher = LLMatcher(grammars.tokenizer, grammar)
        self.broken: str | None = None

    def allowed(self):
        """[V] bool: the tokens the grammar allows next (EOS alone once it is complete)."""
        import numpy as np
        import torch

        if self.broken is None:
            bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            allowed = torch.from_numpy(bits[: self.grammars.vocab_size].astype(bool))
            if bool(allowed.any()):
                return allowed
            self.broken = self.matcher.get_error() or "the grammar allows no token"
        eos = torch.zeros(self.grammars.vocab_size, dtype=torch.bool)
        eos[self.grammars.eos_token_ids] = True
        return eos

    def take(self, token: int) -> None:
        if self.broken is None and not self.matcher.consume_token(token):
            self.broken = self.matcher.get_error() or f"the grammar refused token {token}"
