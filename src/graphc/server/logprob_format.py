"""Logprobs as OpenAI's API lays them out: a completion's `tokens` / `token_logprobs` /
`top_logprobs` / `text_offset` lists, a chat's `content` list of token objects with their bytes.

A token's text is its own decoding (`token_text`): a token that holds part of a character decodes
to U+FFFD, as each token decoded alone does (so `bytes` are that text's UTF-8, not the token's raw
bytes). Artifacts without a tokenizer name tokens as vLLM's `return_tokens_as_token_ids` does.
"""

from __future__ import annotations

import itertools

from graphc.runtime.logprobs import TokenLogprobs


def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False) if tokenizer is not None else f"token_id:{token}"


def logprobs_body(tokenizer, ids: list[int], entries: list[TokenLogprobs | None], chat: bool, offset: int = 0) -> dict:
    """The logprobs of `ids` (one entry each; a completion's echoed prompt's first is None, and
    null in the body), a chat's or a completion's; `offset`: where the first token's text starts
    in the choice's text (a stream's later chunks)."""
    if chat:
        return {"content": [{**_chat_token(tokenizer, token, entry.logprob),
                             "top_logprobs": [_chat_token(tokenizer, t, lp) for t, lp in entry.top]}
                            for token, entry in zip(ids, entries)], "refusal": None}
    tokens = [token_text(tokenizer, token) for token in ids]
    return {"tokens": tokens, "token_logprobs": [entry and entry.logprob for entry in entries],
            "top_logprobs": [entry and {token_text(tokenizer, t): lp for t, lp in entry.top} for entry in entries],
            "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))}


def text_length(tokenizer, ids: list[int]) -> int:
    """How far `ids`' logprobs move a completion's `text_offset`."""
    return sum(len(token_text(tokenizer, token)) for token in ids)


def _chat_token(tokenizer, token: int, logprob: float) -> dict:
    text = token_text(tokenizer, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
